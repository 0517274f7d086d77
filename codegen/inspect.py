"""Read the generated GPU kernels of a model's decode step: resources, ISA counts, source.

    python -m codegen.inspect [--model PATH] --target gfx906 [--context N] [--prefill N]
    python -m codegen.inspect --kernel NAME --source|--isa

The table has, per kernel: registers, LDS (static + the launch's occupancy pad), scratch,
waves per SIMD, code size; counts of ``global_load_dwordx4``, ``flat_load_*``, ``s_waitcnt``
and ``ds_*`` instructions in the kernel's main loop (the innermost loop that loads 16-byte
weight vectors, else the whole kernel), LDS instructions per byte its global loads read
(``ds/B``), ``v_dot4_i32_i8`` (quantized weights), the widths of its global loads (``16x8``:
eight 16-byte loads); bytes moved and FLOPs per call; and whether the LDS reads of its lane loops
are free of bank conflicts (``banks``: see ``lds_banks``).  ``--prefill N``: the kernels of an
N-token prefill instead (contractions of N rows: the matmul family).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from .targets import get_target

_INSN = re.compile(r"^\s+([a-z_0-9]+)\b(.*?)//\s*([0-9A-Fa-f]+):")


def instructions(isa: str):
    """(address, mnemonic, operands) of every instruction in ``llvm-objdump -d`` output."""
    out = []
    for line in isa.splitlines():
        m = _INSN.match(line)
        if m:
            out.append((int(m.group(3), 16), m.group(1), m.group(2).strip()))
    return out


def loops(insns):
    """Backward branches as (first index, last index) spans; SOPP offsets are signed words."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    spans = []
    for i, (addr, op, args) in enumerate(insns):
        if op.startswith("s_cbranch") or op == "s_branch":
            try:
                off = int(args.split()[0])
            except (ValueError, IndexError):
                continue
            off = off - 65536 if off >= 32768 else off
            target = addr + 4 + 4 * off
            if off < 0 and target in index:
                spans.append((index[target], i))
    return spans


def main_loop(isa: str):
    """Instructions of the innermost loop holding a 16-byte global load, among the loops that also
    hold dot products (``v_dot*``: a GEMV's weight loop, not its prologue) when there are any;
    else all of them."""
    insns = instructions(isa)
    cands = [(b - a, a, b) for a, b in loops(insns)
             if any(op == "global_load_dwordx4" for _, op, _ in insns[a:b + 1])]
    dots = [c for c in cands if any(op.startswith("v_dot") for _, op, _ in insns[c[1]:c[2] + 1])]
    cands = dots or cands
    if not cands:
        return insns
    _, a, b = min(cands)
    return insns[a:b + 1]


LOAD_BYTES = {"dwordx4": 16, "dwordx3": 12, "dwordx2": 8, "dword": 4, "ushort": 2, "sshort": 2, "short_d16": 2,
              "short_d16_hi": 2, "ubyte": 1, "sbyte": 1}


def load_widths(insns) -> dict:
    """Global loads by width in bytes: ``{16: 4, 2: 4}``."""
    out = {}
    for _, op, _ in insns:
        if op.startswith("global_load_"):
            w = LOAD_BYTES.get(op[len("global_load_"):], 0)
            out[w] = out.get(w, 0) + 1
    return out


def counts(insns):
    """Instruction counts of a span of ISA: 16-byte and other global loads, generic (flat) loads,
    waits, LDS instructions (``ds_*``), ``v_dot4_i32_i8``; the global bytes its loads read
    (``load_bytes``, per lane) and ``lds_per_byte``: LDS instructions per global byte read, the
    metric of shared/reference/000 for a GEMV's main loop (0.556 before its fix, 0.056 after)."""
    ops = [op for _, op, _ in insns]
    load_bytes = sum(w * n for w, n in load_widths(insns).items())
    ds = sum(op.startswith("ds_") for op in ops)
    return {"dwordx4": ops.count("global_load_dwordx4"),
            "global_other": sum(op.startswith("global_load") and op != "global_load_dwordx4" for op in ops),
            "flat": sum(op.startswith("flat_load") for op in ops),
            "waitcnt": ops.count("s_waitcnt"),
            "ds": ds,
            "dot4": ops.count("v_dot4_i32_i8"),
            "load_bytes": load_bytes,
            "lds_per_byte": ds / load_bytes if load_bytes else 0.0}


_COMPILERS = {}


def compiler_for(target):
    """The hiprtc compiler of ``target`` (one per target: it remembers what it built)."""
    from engine.devices.rocm import HiprtcCompiler
    if target not in _COMPILERS:
        _COMPILERS[target] = HiprtcCompiler(target)
    return _COMPILERS[target]


class Inspected:
    """One kernel compiled for an AMD target, as every device builds (``engine.build``: layers
    share one compile, through the disk cache): source, code object, resources, ISA counts."""

    def __init__(self, kernel, target):
        from engine.build import build, render
        compiler = compiler_for(target)
        (source,) = render([kernel], compiler)
        (binary,) = build([source], compiler)
        self.kernel, self.target = kernel, target
        self.hip = source.readable
        self.code = compiler.code_object(binary)
        self.symbol = binary.entry
        self.res = self.code.resources(self.symbol, workgroup_size=self.hip.block[0],
                                       dynamic_lds_bytes=self.hip.dynamic_lds)
        self._isa = None

    @property
    def source(self):
        return self.hip.source

    def isa(self):
        if self._isa is None:
            # layers that differ only in names share one code object, built as "canonical"
            self._isa = self.code.isa(self.symbol).replace(f"<{self.symbol}", f"<{self.kernel.name}")
        return self._isa

    def loop_counts(self):
        return counts(main_loop(self.isa()))


def decode_plan(model=None, context=512, dtype="native", tokens=1, target=None):
    """The fusion plan of one decode step of ``model`` (a GGUF or HF directory; default SmolLM2)
    with weights loaded as ``dtype`` ("native": a GGUF's quantized tensors as they are; "f16"):
    the pipeline's passes up to rendering (``engine.pipeline.lower_program``) and the GPU plan step
    for ``target`` (default gfx906); ``tokens`` > 1: the prefill of that many tokens instead (its
    contractions: the matmul family)."""
    import numpy as np

    import dsl
    from engine.pipeline import lower_program
    from engine.weights import default_model_path, load_model
    from stdlib import llama
    path = model or default_model_path()
    cfg, params, _ = load_model(path, dtype if dtype != "native" or not os.path.isdir(path) else "f16")
    if context > cfg.max_seq_len:
        raise ValueError(f"--context {context} is beyond the model's {cfg.max_seq_len} positions")
    # only the caches' shapes matter for tracing: one array, broadcast, stands for every layer's
    kv = np.broadcast_to(np.float16(0), (cfg.n_kv_heads, context, cfg.head_dim))   # the default f16 cache
    cache = [(kv, kv) for _ in range(cfg.n_layers)]

    def step(params, tokens, pos, last, cache):
        return llama.forward(cfg, params, tokens, pos, last, cache)
    if tokens > context:
        raise ValueError(f"--prefill {tokens} does not fit the context of {context} positions")
    low = dsl.jit(step, donate_argnums=(4,)).lower(params, np.zeros(tokens, np.int32), 0, 0, cache)
    return gpu_plan(lower_program(low), target or get_target("gfx906"))


def gpu_plan(plan, target=None):
    """``plan`` as a GPU with int8 dot products runs it (``fusion.q8``: activations quantized by
    the kernels that produce them, for ``target`` (a Target or None); ``VEGAFUSE_Q8_PRODUCER=0``: not)."""
    from codegen.loopir import int8_activation
    from fusion.q8 import quantize_at_producers
    return quantize_at_producers(plan, int8_activation(), target)


def widths(it) -> str:
    """The main loop's global loads as ``bytes x count``: ``16x8,2x8``."""
    w = load_widths(main_loop(it.isa()))
    return ",".join(f"{b}x{n}" for b, n in sorted(w.items(), reverse=True)) or "-"


def lds_banks(it) -> str:
    """Whether the LDS reads of the kernel's lane loops are free of bank conflicts, from its mapped
    IR: each lane reads ``vector`` consecutive elements after its neighbour's (consecutive lanes,
    consecutive addresses, at most 16 bytes each: conflict-free on gfx906's 32 banks of 4 bytes)
    "ok"; a wider or irregular stride "check"; "-" without LDS reads there."""
    from . import loopir as L
    from .mma import MatmulTiles, banks
    m = it.hip.kernel
    if m.family == "attention":
        from .attention import lds_banks as attention_banks
        return attention_banks(m)
    tiled = [s for s in m.body if isinstance(s, MatmulTiles)]
    if tiled:                                  # the tiled matmul's padded rows (codegen/mma.py)
        return banks(tiled[0])
    lds = {s.name: s.dtype for s in L.walk_stmts(m.body) if isinstance(s, L.Array) and s.space == "lds"}
    seen = False
    for r in L.walk_stmts(m.body):
        if not (isinstance(r, L.Reduce) and r.map == "lane"):
            continue
        for a in r.accs:
            for x in L.walk_exprs(a.value):
                if isinstance(x, L.Load) and x.buf in lds and lds[x.buf] in ITEMSIZE_LDS:
                    seen = True
                    step = r.vector * ITEMSIZE_LDS[lds[x.buf]]
                    if step > 16 or step & (step - 1) or r.lanes:
                        return "check"
    return "ok" if seen else "-"


ITEMSIZE_LDS = {"f16": 2, "f32": 4}


def table(items, layers_once=True):
    """The report as text; kernels identical up to names (the same layer) are listed once."""
    w = max([40] + [len(it.kernel.name) for it in items])
    head = (f"{'kernel':<{w}} {'family':<11} {'VGPR':>4} {'SGPR':>4} {'LDS':>6} {'scr':>3} {'w/SIMD':>6} "
            f"{'code':>5} {'x4':>3} {'flat':>4} {'wait':>4} {'ds':>3} {'ds/B':>5} {'dot4':>4} {'loads':<10} "
            f"{'KB/call':>8} {'MFLOP':>7} {'banks':>5}  copies")
    rows, seen = [head, "-" * len(head)], {}
    for i, it in enumerate(items):
        key = it.code if layers_once else i
        if key in seen:
            seen[key][1] += 1
            continue
        r, c, k = it.res, it.loop_counts(), it.kernel
        lds = f"{r['lds_bytes']}+{it.hip.dynamic_lds}" if it.hip.dynamic_lds else str(r["lds_bytes"])
        seen[key] = [len(rows), 1]
        rows.append([f"{k.name:<{w}} {k.family:<11} {r['vgprs']:>4} {r['sgprs']:>4} {lds:>6} "
                     f"{r['scratch_bytes']:>3} {r['waves_per_simd']:>6} {r['code_bytes']:>5} {c['dwordx4']:>3} "
                     f"{c['flat']:>4} {c['waitcnt']:>4} {c['ds']:>3} {c['lds_per_byte']:>5.3f} {c['dot4']:>4} "
                     f"{widths(it):<10} {k.bytes / 1e3:>8.1f} {k.flops / 1e6:>7.2f} {lds_banks(it):>5}"])
    for row, n in seen.values():
        rows[row] = rows[row][0] + f"  x{n}"
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m codegen.inspect", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--target", default="gfx906", help="an AMD target: gfx906 (default)")
    p.add_argument("--context", type=int, default=512, help="KV-cache positions (default 512)")
    p.add_argument("--dtype", default="native", choices=["native", "f16"],
                   help="weights: a GGUF's own quantized tensors (default) or f16")
    p.add_argument("--prefill", type=int, default=1, metavar="N",
                   help="the prefill of N tokens instead of the decode step (its matmul kernels)")
    p.add_argument("--kernel", help="one kernel by name (or a unique part of it)")
    p.add_argument("--source", action="store_true", help="print the kernel's HIP source")
    p.add_argument("--isa", action="store_true", help="print the kernel's disassembly")
    p.add_argument("--all", action="store_true", help="list every kernel, not each distinct one once")
    p.add_argument("--no-occupancy-cap", action="store_true", help="drop the 9-waves-per-SIMD cap (A/B switch)")
    args = p.parse_args(argv)
    from dsl.core import DSLError
    from engine.devices.rocm import HipCompileError, HipUnavailable
    from engine.errors import ModelError
    try:
        if args.context < 1:
            raise ValueError(f"--context must be at least 1, got {args.context}")
        if args.kernel is not None and not args.kernel.strip():
            raise ValueError("--kernel needs a name (or a unique part of one)")
        if (args.source or args.isa) and args.kernel is None:
            raise ValueError("--source and --isa print one kernel: name it with --kernel NAME")
        target = get_target(args.target, **({"max_waves_per_simd": 0} if args.no_occupancy_cap else {}))
        if target.vendor != "amd":
            raise ValueError(f"--target {args.target}: inspect compiles through hiprtc for AMD targets "
                             "(gfx906); the NVIDIA flavour runs with --backend cuda")
        if args.prefill < 1:
            raise ValueError(f"--prefill must be at least 1, got {args.prefill}")
        kernels = decode_plan(args.model, args.context, args.dtype, args.prefill, target).kernels
        if args.kernel:
            match = [k for k in kernels if k.name == args.kernel] or [k for k in kernels if args.kernel in k.name]
            if len(match) != 1:
                distinct = list(dict.fromkeys(k.name for k in (match or kernels)))
                names = ", ".join(distinct[:8]) + (f", ... ({len(distinct)} in all)" if len(distinct) > 8 else "")
                raise ValueError(f"--kernel {args.kernel!r} matches {len(match)} kernels; give a kernel's name, or a "
                                 f"part of it that no other name has: {names}")
            it = Inspected(match[0], target)
            print(it.isa() if args.isa else it.source)
            return 0
        items = [Inspected(k, target) for k in kernels]
        step = "the decode step" if args.prefill == 1 else f"the prefill of {args.prefill} tokens"
        print(f"{len(items)} kernels in {step}, target {target.name} (wave{target.wave}); "
              f"main-loop instruction counts; {'every kernel listed' if args.all else 'identical layers listed once'}")
        print(table(items, not args.all))
        if args.prefill > 1:                    # what each contraction chose (the tiled matmul or not)
            print("\nmappings of the contractions (identical layers once):")
            for name, how in dict.fromkeys((re.sub(r"^layers_\d+_", "layers_N_", it.kernel.name), it.hip.kernel.launch.how)
                                           for it in items if it.kernel.family == "contract"):
                print(f"  {name}: {how}")
        return 0
    except (HipUnavailable, HipCompileError, ModelError, ValueError, DSLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:                   # e.g. piped into head
        sys.exit(0)
