"""The compiler, as one function: a jitted function and its arguments in, an executable out.

    f = dsl.jit(fn, backend="cpu")
    ex = compile_program(f, args)          # what f.compile(*args) does
    ex(*leaves)

The passes, in order (each a short function over one IR):

    trace      fn -> Program                       dsl/jit.py
    typecheck  every equation re-checked by its primitive's rule
    partition  which values live in memory, by the fusion rules    fusion/partition.py
    lower      -> Loop IR kernels                   fusion/lower.py, fusion/schedule.py
    simplify   Loop IR -> Loop IR                   codegen/simplify.py
    render     -> LLVM IR (CPU) or HIP C++ (GPUs)   engine/build.py
    build      compile + code cache, one per kernel distinct up to names   engine/build.py
    executable buffers and the launch plan          engine/executable.py

``VEGAFUSE_DEBUG=N`` prints, to stderr once per compile: 1 the kernel list with bytes and
FLOPs; 2 also each kernel's Loop IR; 3 also its source; 4 also the ISA where the target has a
disassembler (gfx906: ``llvm-objdump``; the CPU: llvmlite's assembly).
"""
from __future__ import annotations

import os
import sys

from codegen.loopir import format_kernel
from codegen.simplify import simplify
from dsl.core import DTYPES, QUANT_DTYPES, DSLError, Lit, Program, Var, check_shape
from engine.build import build, render, text_of
from engine.executable import Executable, get_device
from fusion import build_plan, enabled_rules
from codegen.env import switch



def compile_program(f, args=(), traced=None) -> Executable:
    """Compile ``f`` (a ``dsl.jit``) for ``args`` (or its already ``traced`` form, a
    ``dsl.jit.Lowered``) on ``f.backend``.  Raises ``DSLError`` for an invalid program, the
    device's compile error (naming the kernel and the failing line) for code that does not build."""
    traced = traced or f.lower(*args)                                      # trace
    plan = lower_program(traced, f.fusion)                                 # typecheck, partition, lower, simplify
    device = get_device(f.backend)                                         # None: the reference interpreter
    plan = for_device(plan, device)                                        # GPU: activations quantized by producers
    sources = render(plan.kernels, device.compiler) if device else []      # LLVM IR / HIP C++
    binaries = build(sources, device.compiler) if device else []           # compile + code cache
    kernels = device.load(sources, binaries) if device else []
    debug_print(plan, sources, binaries, device)                           # VEGAFUSE_DEBUG=1..4
    return Executable(traced.program, traced.out_tree, plan, device, kernels, f.backend, traced.spec)


def for_device(plan, device):
    """``plan`` as ``device`` runs it: on a GPU with int8 dot products, each GEMV activation that an
    earlier GEMV stores is quantized there once (``fusion.q8.quantize_at_producers``); with
    ``VEGAFUSE_PERSISTENT=1`` on NVIDIA, runs of kernels made one persistent kernel
    (``fusion.persistent``)."""
    target = getattr(device.compiler, "target", None) if device is not None else None
    from fusion import persistent
    on = persistent.enabled(target)                  # the switches' values are checked on every device
    if target is None:
        return plan
    if getattr(target, "int8_dot", False):
        from codegen.loopir import int8_activation
        from fusion.q8 import quantize_at_producers
        plan = quantize_at_producers(plan, int8_activation(), target)
    return persistent.make_persistent(plan, target) if on else plan


def lower_program(traced, fusion=None):
    """The passes before rendering: ``traced`` (a ``dsl.jit.Lowered``) to a ``fusion.Plan``
    whose kernels are simplified Loop IR.  ``fusion``: ``{rule: bool}`` overrides.  The plan of a
    program seen before comes from the disk cache (``cached_plan``)."""
    typecheck(traced.program)
    rules = enabled_rules(fusion)
    return cached_plan(traced, rules, lambda: plan_program(traced, rules))


def plan_program(traced, rules):
    plan = build_plan(traced.program, rules, traced.in_names, traced.donated)      # partition, lower
    plan.kernels = [simplify(k) for k in plan.kernels]
    return plan


def cached_plan(traced, rules, lower):
    """``lower()``'s plan through the disk cache: keyed by ``plan_cache_key`` (the program's IR
    text and source lines, its inputs' names and donations, the rules, the compiler's sources), written atomically,
    lowered again when an entry does not load.  ``VEGAFUSE_PLAN_CACHE=0`` turns it off."""
    if not switch("VEGAFUSE_PLAN_CACHE", True):
        return lower()
    from engine.build import code_cache
    built = []

    def pack():
        built.append(lower())
        return _pack_plan(built[0], traced.program)
    blob, _ = code_cache().get_or_build(plan_cache_key(traced, rules), pack)
    if built:
        return built[0]
    try:
        return _unpack_plan(blob, traced.program)
    except Exception:                      # an entry from elsewhere, or damaged: lower it again
        return lower()


_SOURCES = None


def _compiler_sources() -> str:
    """A hash of the compiler's own source (dsl, fusion, codegen, this file): a plan cached by
    another version of them is never used."""
    global _SOURCES
    if _SOURCES is None:
        import hashlib
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        for d in ("dsl", "fusion", "codegen"):
            for name in sorted(os.listdir(os.path.join(root, d))):
                if name.endswith(".py"):
                    with open(os.path.join(root, d, name), "rb") as fh:
                        h.update(name.encode() + fh.read())
        with open(os.path.abspath(__file__), "rb") as fh:
            h.update(fh.read())
        _SOURCES = h.hexdigest()
    return _SOURCES


def plan_cache_key(traced, rules) -> dict:
    """The disk-cache key of a program's plan: its IR text, its source lines, the names and
    donations of its inputs, the fusion rules, the switches that change plans
    (``fusion.schedule.plan_switches``) and the compiler's source hash."""
    import hashlib

    from fusion.schedule import plan_switches
    prog = traced.program
    donated = [i for i, v in enumerate(prog.inputs) if v in set(traced.donated)]
    return {"kind": "plan", "program": hashlib.sha256(prog.as_text().encode()).hexdigest(),
            "lines": hashlib.sha256("\n".join(_source_lines(prog)).encode()).hexdigest(),
            "inputs": list(traced.in_names), "donated": donated, "rules": sorted(rules),
            "switches": plan_switches(), "compiler": _compiler_sources()}


def _source_lines(prog):
    """Each equation's source line with its text and scope, loop bodies' too: the kernels' comments
    and names come from them, so two programs equal but for their source never share a plan."""
    from dsl.core import Program, source_text
    for e in prog.eqns:
        yield f"{source_text(e)} {e.scope}"
        for v in e.params.values():
            if isinstance(v, Program):
                yield from _source_lines(v)


def _pack_plan(plan, prog) -> bytes:
    """The plan as bytes: each kernel's equations as indices into the program's."""
    import pickle
    index = {id(e): i for i, e in enumerate(prog.eqns)}
    eqns = [k.eqns for k in plan.kernels]
    try:
        for k in plan.kernels:
            k.eqns = tuple(index[id(e)] for e in k.eqns)
        return pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for k, es in zip(plan.kernels, eqns):
            k.eqns = es


def _unpack_plan(blob: bytes, prog):
    import pickle
    plan = pickle.loads(blob)
    for k in plan.kernels:
        k.eqns = tuple(prog.eqns[i] for i in k.eqns)
    return plan


# ----------------------------------------------------------------------------- typecheck
def _type(v) -> str:
    return f"{v.dtype}[{','.join(str(d) for d in v.shape)}]"


def _check_type(v, where):
    """A dtype the kernels have (not f64, which only the interpreter computes in) and a shape they
    can index: no zero-size dims, at most 2**31 - 1 elements."""
    if v.dtype in QUANT_DTYPES:
        if not v.shape or v.shape[-1] % 32:
            raise DSLError(f"{where}: a {v.dtype} array needs a last axis that is a multiple of 32 (its block), "
                           f"got shape {list(v.shape)}")
    elif v.dtype not in DTYPES:
        raise DSLError(f"{where}: dtype {v.dtype} is not supported by the kernels; use one of {', '.join(DTYPES)}")
    check_shape(v.shape, where)


def typecheck(program: Program) -> None:
    """Check ``program`` as the tracer would have built it: every equation's inputs are defined
    before it, its primitive's shape/dtype rule accepts them, and gives the recorded output
    type; every output is defined.  Useful for programs from ``dsl.parse_ir`` or built by hand.

    Raises ``DSLError`` naming the equation's source line (or its index) and the mismatch."""
    defined = set(program.inputs)
    for j, v in enumerate(program.inputs):
        _check_type(v, f"program input {j}")
    for i, e in enumerate(program.eqns):
        where = f"{e.source or f'equation {i}'}: {e.prim.name}"
        for a in e.inputs:
            if isinstance(a, Var) and a not in defined:
                raise DSLError(f"{where}: input {_type(a)} is used before any equation defines it; "
                               "order the equations so that each value is computed before its use")
            if not isinstance(a, (Var, Lit)):
                raise DSLError(f"{where}: input {a!r} is not a Var or Lit")
            if a.dtype in QUANT_DTYPES and e.prim.name != "dequantize":
                raise DSLError(f"{where}: a {_type(a)} array is quantized; only dequantize reads it")
        try:
            shape, dtype = e.prim.rule([(a.shape, a.dtype) for a in e.inputs], **e.params)
        except (DSLError, TypeError, ValueError) as err:
            raise DSLError(f"{where}: {err}") from None
        if (tuple(shape), dtype) != (e.out.shape, e.out.dtype):
            raise DSLError(f"{where}: output recorded as {_type(e.out)} but the rule gives "
                           f"{dtype}[{','.join(str(d) for d in shape)}]; record the rule's type")
        _check_type(e.out, where)
        if e.out in defined:
            raise DSLError(f"{where}: its output {_type(e.out)} is already defined; give each equation a new Var")
        defined.add(e.out)
    for j, o in enumerate(program.outputs):
        if isinstance(o, Var) and o not in defined:
            raise DSLError(f"program output {j} ({_type(o)}) is neither an input nor computed by an equation")


# ----------------------------------------------------------------------------- debug output
def debug_level() -> int:
    """``$VEGAFUSE_DEBUG`` as a level 0..4 (ValueError for anything else)."""
    raw = os.environ.get("VEGAFUSE_DEBUG", "").strip() or "0"
    if raw not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"VEGAFUSE_DEBUG={raw!r} is not a debug level; use 0 (off) to 4")
    return int(raw)


def debug_print(plan, sources, binaries, device) -> None:
    """Print :func:`debug_report` to stderr at ``$VEGAFUSE_DEBUG``'s level (nothing at 0)."""
    level = debug_level()
    if level:
        print(debug_report(level, plan, sources, binaries, device), file=sys.stderr)


def debug_report(level, plan, sources, binaries, device) -> str:
    """What ``VEGAFUSE_DEBUG=level`` prints for one compile (see the module docstring)."""
    kernels = plan.kernels
    total_b, total_f = sum(k.bytes for k in kernels), sum(k.flops for k in kernels)
    where = device.name if device is not None else "reference (interpreted)"
    n = len(kernels)
    out = [f"vegafuse: {n} kernel{'s' * (n != 1)} on {where}, {total_b:,} bytes and {total_f:,} FLOPs per call "
           f"(rules on: {', '.join(sorted(plan.rules)) or 'none'})",
           f"  {'kernel':<44} {'family':<11} {'bytes':>13} {'FLOPs':>13}  code"]
    first = {}
    for i, k in enumerate(kernels):
        code = ""
        if binaries:
            b = binaries[i]
            code = (f"same as {first[id(b)]}" if id(b) in first else
                    "cached" if b.cache_hit else f"compiled in {b.seconds:.2f} s")
            first.setdefault(id(b), k.name)
        out.append(f"  {k.name:<44} {k.family:<11} {k.bytes:>13,} {k.flops:>13,}  {code}")
    if level < 2:
        return "\n".join(out)
    shown = set()
    for i, k in enumerate(kernels):
        out += ["", f"=== {k.name} ({k.family}): {k.bytes:,} bytes, {k.flops:,} FLOPs", "--- Loop IR", format_kernel(k)]
        if level >= 3 and sources:
            out += ["--- source", text_of(sources[i].readable).rstrip()]
        if level >= 4 and binaries:
            b = binaries[i]
            out.append("--- ISA")
            if id(b) in shown:
                out.append(f"(the same code as {first[id(b)]})")
                continue
            shown.add(id(b))
            try:
                isa = device.compiler.disassemble(b)
            except (RuntimeError, OSError, ValueError) as e:        # e.g. no llvm-objdump for AMDGPU
                isa = f"(no ISA: {e})"
            out.append(isa.rstrip() if isa else f"(no disassembler for {device.name})")
    return "\n".join(out)
