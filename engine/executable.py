"""An executable: the fused kernels of one traced program, compiled for a device, with its buffers.

Made by the last pass of ``engine.pipeline.compile_program`` (what ``f.compile(*args)``
runs).  Calling it binds the inputs, runs the kernels in order and returns the outputs in the
traced pytree structure.

Buffers: intermediates are allocated once and reused by every call.  Small
inputs (token ids, positions) are copied into staging buffers, so the prepared
launch plan stays valid; large inputs (weights, KV caches) are bound by
address, and the plan is re-bound only when one of them moves.  A donated input
that a ``dynamic_update_slice`` writes in place is returned as the output.  An output that
is a reshape of a computed value is that value's buffer, returned with the output's shape.
"""
from __future__ import annotations

import numpy as np

from dsl.core import NP_DTYPES, QUANT_DTYPES
from fusion.schedule import contract_orders
from dsl.pytree import unflatten

_STAGE_BYTES = 1 << 16
RUN_HOOK = None         # while engine.verify checks a run: runs the bound kernels itself, one at a time


class Executable:
    """``program`` (a ``dsl.Program``) with outputs in ``out_tree``, planned as ``plan``
    (``fusion.Plan``: kernels, buffers, inputs, outputs), and ``kernels`` loaded on ``device``
    (its compiled kernels, in launch order; ``device`` None: the reference interpreter runs
    the program).  Intermediate buffers are allocated here, once."""

    def __init__(self, program, out_tree, plan, device, kernels, backend="cpu", spec=None):
        self.program, self.out_tree, self.backend = program, out_tree, backend
        self.spec = spec                # dsl.jit.CallSpec: how a call's arguments map to the inputs
        self.plan, self.device, self.kernels = plan, device, kernels
        self._buffers = {}
        for name, (shape, dtype) in self.plan.buffers.items():
            if name not in self.plan.inputs and self.device is not None:
                self._buffers[name] = self.device.empty(shape, dtype)
        self._bound = None
        self._bound_refs = None
        self._tiled_from = set()        # the inputs a persistent kernel's tiled weights were made from
        self._plan_run = None
        self._slots = None

    # ------------------------------------------------------------------ reporting
    def fusion_report(self) -> str:
        """One line per kernel: its family, the bytes it reads and writes per call, the DSL ops fused
        into it and, for a contraction, the access order the scheduler chose for its weights
        (``order: k-inner``: dot products along k, the (N, K) layout; ``order: k-outer``: k outside,
        the columns of a (K, N) weight read along n; both when its segments differ)."""
        n = len(self.plan.kernels)
        lines = [f"{n} kernel{'' if n == 1 else 's'} (rules on: {', '.join(sorted(self.plan.rules)) or 'none'})"]
        for k in self.plan.kernels:
            ops = ", ".join(e.prim.name for e in k.eqns)
            orders = contract_orders(k) if k.family == "contract" else ()
            order = f"  order: {', '.join(f'k-{o}' for o in orders)}" if orders else ""
            lines.append(f"{k.name:<44} {k.family:<11} {k.bytes / 1e3:9.1f} kB  {ops}{order}")
        return "\n".join(lines)

    def cost_analysis(self) -> dict:
        """The plan's cost per call, under ``jax.stages.Compiled.cost_analysis``'s key names (see
        ``cost_of``)."""
        return cost_of(self.plan)

    # ------------------------------------------------------------------ running
    def _bind(self, arrays):
        """(Re)prepare the launch plan for these input buffers."""
        bufs = dict(self._buffers)
        for name, a in zip(self.plan.inputs, arrays):
            if name not in self.plan.scalars:
                bufs[name] = a
        self._slots = self.device.scalar_slots(self.plan.scalars)
        self._tile_all(bufs)
        launches = []
        for ck in self.kernels:
            args = {p.name: bufs[p.name] for p in ck.kernel.params if p.kind == "buffer"}
            launches.append(self.device.prepare(ck, args, self._slots))
        self._plan_run = self.device.plan(launches, self._slots)
        self._bound = [id(a) if not isinstance(a, int) else None for a in arrays]
        self._bound_refs = arrays

    def _tile_all(self, bufs):
        """Fill each persistent kernel's tiled weights (``codegen.ring.tile``) from the weights in ``bufs``
        (buffer name -> device array): each ring phase's share, in the kernel's order.  Done at binding,
        and again by ``bind`` when a staged (small) weight was copied in anew; a weight changed in place
        on the device is not seen."""
        from codegen.loopir import Phase
        from codegen.persistent import tiling
        from codegen.ring import tile
        self._tiled_from = set()
        for ck in self.kernels:
            if ck.kernel.family != "persistent":
                continue
            host, parts = {}, []
            for at, g, tl, names in tiling(ck.kernel, self.device.compiler.target):
                assert at == sum(map(len, parts)), "the tiled weights' shares follow one another"
                for arg in names.values():
                    if arg not in host:
                        host[arg] = self.device.to_host(bufs[arg])
                parts.append(tile(g, tl, {w: host[arg] for w, arg in names.items()}))
            if parts:
                (name,) = {s.tiled for s in ck.kernel.body if isinstance(s, Phase) and s.tiled}
                self.device.copy_in(bufs[name], np.concatenate(parts))
                self._tiled_from |= set(host)

    def bind(self, *leaves):
        """Put the inputs where the kernels read them; returns the device buffers by input name.

        Small host arrays are copied into staging buffers; large host arrays (weights) are used
        in place on the CPU and uploaded once on a GPU; device arrays are used as they are."""
        if len(leaves) != len(self.plan.inputs):
            raise TypeError(f"expected {len(self.plan.inputs)} array arguments, got {len(leaves)}")
        dev, arrays, staged = self.device, [], set()
        donated = set(self.plan.aliases.values())
        for v, name, x in zip(self.program.inputs, self.plan.inputs, leaves):
            if name in self.plan.scalars:
                arrays.append(int(x))
                continue
            if v.dtype in QUANT_DTYPES:                # a dsl.QArray: its bytes, uploaded once
                if getattr(x, "dtype", None) != v.dtype or tuple(x.shape) != v.shape:
                    raise ValueError(f"argument {name}: {getattr(x, 'dtype', type(x).__name__)}"
                                     f"{list(getattr(x, 'shape', ()))} != traced {v.dtype}{list(v.shape)}")
                arrays.append(dev.resident(x.device_bytes()))
                continue
            dt = NP_DTYPES[v.dtype]
            if dev.is_device_array(x):
                if tuple(x.shape) != v.shape or x.dtype != dt:
                    raise ValueError(f"argument {name}: {x.dtype}{list(x.shape)} != traced {dt}{list(v.shape)}")
                arrays.append(x)
                continue
            a = np.asarray(x)
            if a.shape != v.shape:
                raise ValueError(f"argument {name}: shape {list(a.shape)} != traced {list(v.shape)}")
            if a.dtype == np.int64 and a.size and (a.min() < -2 ** 31 or a.max() >= 2 ** 31):
                raise ValueError(f"argument {name}: int64 values beyond int32 (traced as i32, as JAX without x64)")
            if a.nbytes <= _STAGE_BYTES and name not in donated:
                stage = self._buffers.setdefault(name, dev.empty(v.shape, v.dtype))
                dev.copy_in(stage, a)
                arrays.append(stage)
                staged.add(name)
                continue
            if a.dtype != dt or not a.flags.c_contiguous:
                if name in donated:
                    raise ValueError(f"donated argument {name} must be a contiguous {dt} array "
                                     "(it is updated in place)")
                a = np.ascontiguousarray(a, dt)
            arrays.append(dev.resident(a))
        if [id(a) if not isinstance(a, int) else None for a in arrays] != self._bound:
            self._bind(arrays)
        elif staged & self._tiled_from:                # a small weight the ring's tiles hold, copied in anew
            self._tile_all({**self._buffers, **dict(zip(self.plan.inputs, arrays))})
        for name, x in zip(self.plan.inputs, arrays):
            if name in self.plan.scalars:
                self._slots[name] = x
        return dict(zip(self.plan.inputs, arrays))

    def set_scalar(self, name, value):
        """Set a runtime scalar input (by its input name) for the next ``launch``."""
        self._slots[name] = value

    def launch(self):
        """Run the kernels once on the bound inputs (asynchronously on a GPU)."""
        self._plan_run()

    def buffer(self, name):
        """The device buffer of an intermediate or output by buffer name."""
        return self._buffers[name]

    def output_buffers(self):
        """Device buffers of the outputs, in flattened order (None for literals), each with its
        output's shape: an output that is a reshape of a computed value shares that value's memory."""
        by_name = dict(zip(self.plan.inputs, self._bound_refs or []))
        out = []
        for o in self.plan.outputs:
            b = None if o[0] == "lit" else by_name.get(o[1], self._buffers.get(o[1]))
            out.append(b if b is None or tuple(b.shape) == o[2] else b.reshape(o[2]))
        return out

    def __call__(self, *args, **kwargs):
        """Run on the arguments the jitted function takes (the same pytree; static arguments equal
        to those compiled for, or left out as in JAX); returns the outputs in the traced pytree.
        The flat input leaves are accepted too (``call_flat``)."""
        leaves = self.spec.leaves(args, kwargs) if self.spec is not None else args
        return self.call_flat(*leaves)

    def call_flat(self, *leaves):
        """Run on the program's input leaves, in ``dsl.tree_flatten`` order of the dynamic arguments."""
        if self.device is None:
            return unflatten(self.out_tree, self.program.run(*leaves))
        by_name = self.bind(*leaves)
        if RUN_HOOK is None:
            self._plan_run()
        else:
            RUN_HOOK(self, by_name, leaves)
        donated = set(self.plan.aliases.values())
        outs = []
        for o in self.plan.outputs:
            if o[0] == "lit":
                outs.append(np.asarray(o[1], NP_DTYPES[o[2]]))
            elif o[1] in by_name and o[1] in donated:  # a donated input updated in place
                outs.append(by_name[o[1]])
            elif o[1] in by_name and self.plan.buffers[o[1]][1] in QUANT_DTYPES:   # a QArray: itself
                outs.append(leaves[self.plan.inputs.index(o[1])])
            elif o[1] in by_name:                      # an input returned as it is: a copy of its own
                outs.append(np.array(self.device.to_host(by_name[o[1]]), copy=True).reshape(o[2]))
            else:                                      # a view output: its base's buffer, reshaped
                outs.append(self.device.to_host(self._buffers[o[1]]).reshape(o[2]))
        return unflatten(self.out_tree, outs)


def cost_of(plan) -> dict:
    """What one call of ``plan`` costs, estimated statically from its kernels:

    ``"flops"``: floating-point operations, as in JAX: 2 per multiply-add of the contractions and
    attention, 1 per element of each fused elementwise op and reduction (an op inlined at several
    indices is counted once per element of its output); ``"bytes accessed"``: bytes each kernel
    reads and writes (the fusion report's); ``"kernels"``: the number of launches;
    ``"per_kernel"``: for each, ``{"name", "family", "flops", "bytes accessed"}``.  JAX's other keys
    (``"transcendentals"``, ``"utilization..."``) are not given.  Values are floats, as in JAX,
    except the counts."""
    from codegen.loopir import OPS
    per = []
    for k in plan.kernels:
        flops = k.flops + sum(e.out.size if e.prim.kind == "elementwise" else e.inputs[0].size
                              for e in k.eqns
                              if (e.prim.kind == "elementwise" and e.prim.name in OPS) or e.prim.kind == "reduce")
        per.append({"name": k.name, "family": k.family, "flops": float(flops), "bytes accessed": float(k.bytes)})
    return {"flops": float(sum(p["flops"] for p in per)),
            "bytes accessed": float(sum(p["bytes accessed"] for p in per)),
            "kernels": len(per), "per_kernel": per}


_DEVICES = {}


def get_device(backend, wave=None):
    """The process-wide device for ``backend`` ("cpu", "cuda", "hip"; "reference" has none: it
    interprets).  "hip" raises ``HipUnavailable`` where no AMD GPU is visible.

    ``wave`` (cuda only): 32 or 64, the wave width the kernels are rendered at (64: gfx906's wave,
    emulated by two warps); without it ``VEGAFUSE_CUDA_WAVE`` (default 32) decides.  Each width has
    its own device, so wave 32 and wave 64 run side by side in one process; ``dsl.jit(...,
    backend="cuda")`` compiles for the width in effect when it compiles."""
    if backend == "reference":
        return None
    key = backend
    if backend == "cuda":
        from engine.devices.cuda import cuda_wave
        key = ("cuda", cuda_wave(wave))
    elif wave is not None:
        raise ValueError(f"wave= selects the CUDA device's wave width; backend {backend!r} has its own")
    if key not in _DEVICES:
        if backend == "cpu":
            from engine.devices.cpu import CPUDevice
            _DEVICES[key] = CPUDevice()
        elif backend == "cuda":
            from engine.devices.cuda import CUDADevice
            _DEVICES[key] = CUDADevice(wave=key[1])
        elif backend == "hip":
            from engine.devices.hip import HIPDevice
            _DEVICES[key] = HIPDevice()
        else:
            raise ValueError(f"backend {backend!r} is not available in this build; "
                             f"use 'cpu', 'cuda', 'hip' or 'reference'")
    return _DEVICES[key]
