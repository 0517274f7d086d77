"""An executable: the fused kernels of one traced program, compiled for a device, with its buffers.

Built by ``dsl.jit`` (``f.compile(*args)``).  Calling it binds the inputs, runs
the kernels in order and returns the outputs in the traced pytree structure.

Buffers: intermediates are allocated once and reused by every call.  Small
inputs (token ids, positions) are copied into staging buffers, so the prepared
launch plan stays valid; large inputs (weights, KV caches) are bound by
address, and the plan is re-bound only when one of them moves.  A donated input
that a ``dynamic_update_slice`` writes in place is returned as the output.
"""
from __future__ import annotations

import numpy as np

from dsl.core import NP_DTYPES
from dsl.pytree import unflatten
from fusion import build_plan, enabled_rules

_STAGE_BYTES = 1 << 16


class Executable:
    def __init__(self, program, out_tree, backend="cpu", fusion=None, input_names=None, donated=()):
        self.program, self.out_tree, self.backend = program, out_tree, backend
        self.plan = build_plan(program, enabled_rules(fusion), input_names, donated)
        self.device = get_device(backend)
        self.kernels = self.device.compile_many(self.plan.kernels) if self.device else []
        self._buffers = {}
        for name, (shape, dtype) in self.plan.buffers.items():
            if name not in self.plan.inputs:
                self._buffers[name] = np.zeros(shape, NP_DTYPES[dtype])
        self._bound = None
        self._plan_run = None
        self._slots = None

    # ------------------------------------------------------------------ reporting
    def fusion_report(self) -> str:
        """One line per kernel: its family and the DSL ops fused into it (with their source lines)."""
        lines = [f"{len(self.plan.kernels)} kernels (rules on: {', '.join(sorted(self.plan.rules)) or 'none'})"]
        for k in self.plan.kernels:
            ops = ", ".join(e.prim.name for e in k.meta["eqns"])
            lines.append(f"{k.name:<44} {k.family:<11} {k.bytes / 1e3:9.1f} kB  {ops}")
        return "\n".join(lines)

    def kernels_per_layer(self):
        return len(self.plan.kernels)

    # ------------------------------------------------------------------ running
    def _bind(self, arrays):
        """(Re)prepare the launch plan for these input arrays."""
        from engine.devices.cpu import ScalarSlots
        bufs = dict(self._buffers)
        for name, a in zip(self.plan.inputs, arrays):
            if name in self.plan.scalars:
                continue
            bufs[name] = a
        self._slots = ScalarSlots(self.plan.scalars)
        launches = []
        for ck in self.kernels:
            args = {p.name: bufs[p.name] for p in ck.kernel.params if p.kind == "buffer"}
            launches.append(self.device.prepare(ck, args, self._slots))
        self._plan_run = self.device.plan(launches)
        self._bound = [a.ctypes.data if isinstance(a, np.ndarray) else None for a in arrays]

    def __call__(self, *leaves):
        if len(leaves) != len(self.plan.inputs):
            raise TypeError(f"expected {len(self.plan.inputs)} array arguments, got {len(leaves)}")
        if self.device is None:
            outs = self.program.run(*leaves)
            return unflatten(self.out_tree, outs)
        arrays = []
        for v, name, x in zip(self.program.inputs, self.plan.inputs, leaves):
            if name in self.plan.scalars:
                arrays.append(int(x))
                continue
            dt = NP_DTYPES[v.dtype]
            a = np.asarray(x)
            if a.shape != v.shape:
                raise ValueError(f"argument {name}: shape {list(a.shape)} != traced {list(v.shape)}")
            if a.nbytes <= _STAGE_BYTES and name not in self.plan.aliases.values():
                stage = self._buffers.setdefault(name, np.zeros(v.shape, dt))
                np.copyto(stage, a, casting="same_kind" if a.dtype != dt else "no")
                a = stage
            elif a.dtype != dt or not a.flags.c_contiguous:
                if name in self.plan.aliases.values():
                    raise ValueError(f"donated argument {name} must be a contiguous {dt} array (it is updated in place)")
                a = np.ascontiguousarray(a, dt)
            arrays.append(a)
        ptrs = [a.ctypes.data if isinstance(a, np.ndarray) else None for a in arrays]
        if ptrs != self._bound:
            self._bind(arrays)
        for name, x in zip(self.plan.inputs, arrays):
            if name in self.plan.scalars:
                self._slots[name] = x
        self._plan_run()
        by_name = dict(zip(self.plan.inputs, arrays))
        outs = []
        for o in self.plan.outputs:
            if o[0] == "lit":
                outs.append(np.asarray(o[1], NP_DTYPES[o[2]]))
            elif o[1] in by_name:                      # a donated input updated in place
                outs.append(by_name[o[1]])
            else:
                outs.append(self._buffers[o[1]].copy())
        return unflatten(self.out_tree, outs)


_DEVICES = {}


def get_device(backend):
    """The process-wide device for ``backend`` ("cpu"; "reference" has none: it interprets)."""
    if backend == "reference":
        return None
    if backend not in _DEVICES:
        if backend == "cpu":
            from engine.devices.cpu import CPUDevice
            _DEVICES[backend] = CPUDevice()
        else:
            raise ValueError(f"backend {backend!r} is not available in this build; use 'cpu' or 'reference'")
    return _DEVICES[backend]
