"""Render Loop IR kernels to HIP C++ for gfx906, and the same source for NVIDIA (NVRTC).

``render_hip(kernel, target) -> HipKernel`` (source, entry name, launch geometry).

The kernel is first mapped to the GPU (``codegen/mapping.py``: which loop is the workgroup, the
wave, the lane; the vector width; the k split; LDS; barriers).  Rendering is then a table of op
templates and one function per statement kind; it decides nothing.  Everything that differs
between targets for one mapping (wave width, half types, the 16-byte load + dot product, the
wave reduction) is in the prelude written from the target table (``codegen/prelude.py``), so the
same mapped kernel gives the same body text on every target.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

from . import attention
from . import loopir as L
from . import mma
from .mapping import clear_of_templates, map_kernel
from .prelude import prelude  # noqa: F401  (re-exported)
from .targets import Target, get_target, lds_budget, occupancy_lds

CTYPE = {"f32": "float", "f16": "vf_half", "i32": "int", "bool": "bool",
         "q4_0": "vf_byte", "q4_1": "vf_byte", "q8_0": "vf_byte",     # quantized weights: their bytes
         "gptq_int4": "vf_byte",
         "q8_1r": "vf_q8_1", "q8_1": "vf_q8_1"}                       # an activation in LDS: one per block


# ------------------------------------------------------------------------------------ expressions
def _const(e: L.Const) -> str:
    if e.dtype == "bool":
        return "true" if e.value else "false"
    if e.dtype == "i32":
        return str(int(e.value))
    v = float(e.value)
    if math.isinf(v):
        return "VF_INF" if v > 0 else "(-VF_INF)"
    if math.isnan(v):
        return "(VF_INF - VF_INF)"
    s = repr(v)
    return (s if ("." in s or "e" in s) else s + ".0") + "f" if e.dtype == "f32" else f"vf_f2h({s}f)"


HW = {"lane": "vf_lane", "wave": "vf_wave", "thread": "threadIdx.x", "workgroup": "blockIdx.x", "grid": "gridDim.x"}


# C precedence of the infix operators the op table spells as "({a} OP {b})"; bitwise and logical
# operators keep parentheses around their operands (as a careful writer, and clang, want)
C_PREC = {"*": 13, "/": 13, "%": 13, "+": 12, "-": 12, "<": 10, "<=": 10, ">": 10, ">=": 10, "==": 9, "!=": 9}


def _infix(e):
    """The C operator of a Bin spelled infix, or None."""
    if not isinstance(e, L.Bin):
        return None
    t = L.spelling(e.op, e.a.dtype, "c")
    m = re.fullmatch(r"\(\{a\} (\S+) \{b\}\)", t) if isinstance(t, str) else None
    return m.group(1) if m else None


def _operand(e, op, right):
    """``e`` as the left or right operand of infix ``op``: parenthesized unless precedence (and
    left associativity) make that unnecessary."""
    inner = _infix(e)
    if inner in C_PREC and op in C_PREC and (C_PREC[inner] > C_PREC[op] or (C_PREC[inner] == C_PREC[op] and not right)):
        return bare(e)
    return expr(e)


def bare(e) -> str:
    """C for a Loop IR expression where nothing binds to it from outside (a statement, an index, a
    function argument): no parentheses around the whole."""
    op = _infix(e)
    if op is not None:
        return f"{_operand(e.a, op, False)} {op} {_operand(e.b, op, True)}"
    if isinstance(e, L.Select):
        cond = expr(e.cond) if isinstance(e.cond, L.Select) else bare(e.cond)    # (c ? a : b) ? x : y
        return f"{cond} ? {bare(e.a)} : {bare(e.b)}"
    return expr(e)


def _args(template, *names):
    """Whether each placeholder of ``template`` sits alone inside parentheses (a call argument)."""
    return [bool(re.search(r"[(,] ?\{%s\}[,)]" % n, template)) for n in names]


def _f16_call(template, dtype) -> bool:
    """Is an op on f16 operands spelled as a call of the C math library (``expf({x})``)?  Those take
    and return float, so the f16 values go in through vf_h2f and the result back through vf_f2h:
    NVIDIA's __half would otherwise meet float in the expression around it, an ambiguous overload."""
    return dtype == "f16" and bool(re.match(r"\w+\(", template))


def expr(e) -> str:
    """C expression for a Loop IR expression, parenthesized where it could bind to what is around
    it.  f16 values are converted to f32 by explicit Casts."""
    if isinstance(e, L.Const):
        return _const(e)
    if isinstance(e, L.Sym):
        return e.name
    if isinstance(e, L.Hw):
        return HW[e.name]
    if isinstance(e, L.QLoad):
        return f"vf_dequant_{e.fmt}({e.buf}, {bare(e.index)}, {e.count // 32})"
    if isinstance(e, L.Load):
        return f"{e.buf}[{bare(e.index)}]"
    if isinstance(e, L.QDot):
        return f"vf_dot_{e.fmt}({e.w}, {bare(e.block)}, {e.count // 32}, {e.act}[{bare(e.ablock)}])"
    if isinstance(e, L.Un):
        t = L.spelling(e.op, e.x.dtype, "c")
        if callable(t):                        # an op composed of others (a user's primitive)
            return t(e.x)
        if _f16_call(t, e.x.dtype):
            return f"vf_f2h({t.format(x=f'vf_h2f({bare(e.x)})')})"
        (alone,) = _args(t, "x")
        return t.format(x=bare(e.x) if alone else expr(e.x))
    if isinstance(e, (L.Bin, L.Select)) and (_infix(e) or isinstance(e, L.Select)):
        return f"({bare(e)})"
    if isinstance(e, L.Bin):
        t = L.spelling(e.op, e.a.dtype, "c")
        if callable(t):
            return t(e.a, e.b)
        if _f16_call(t, e.a.dtype):
            call = t.format(a=f"vf_h2f({bare(e.a)})", b=f"vf_h2f({bare(e.b)})")
            return call if e.dtype == "bool" else f"vf_f2h({call})"
        a_alone, b_alone = _args(t, "a", "b")
        return t.format(a=bare(e.a) if a_alone else expr(e.a), b=bare(e.b) if b_alone else expr(e.b))
    if isinstance(e, L.Cast):
        src, dst = e.x.dtype, e.dtype
        if src == dst:
            return expr(e.x)
        if src == "f16":
            inner = f"vf_h2f({bare(e.x)})"
            return inner if dst == "f32" else f"({CTYPE[dst]})({inner})"
        if dst == "f16":
            return f"vf_f2h({bare(e.x)})" if src == "f32" else f"vf_f2h((float)({bare(e.x)}))"
        return f"({CTYPE[dst]})({bare(e.x)})"
    raise TypeError(e)


# ------------------------------------------------------------------------------------ statements
def _plus(lo, x):
    """``lo + x`` without a ``0 +``."""
    return x if isinstance(lo, L.Const) and lo.value == 0 else f"{expr(lo)} + {x}"


# first iteration and step of a loop per mapping ("{s}": waves per iteration of a wave loop)
LOOP_MAP = {
    "grid": ("blockIdx.x", "gridDim.x"),
    "block": ("threadIdx.x", "VF_BLOCK"),
    "thread": ("blockIdx.x * VF_BLOCK + threadIdx.x", "gridDim.x * VF_BLOCK"),
    "wave": ("blockIdx.x * VF_WAVES + vf_wave", "gridDim.x * VF_WAVES"),
    "wave_split": ("blockIdx.x * (VF_WAVES / {s}) + vf_wave / {s}", "gridDim.x * (VF_WAVES / {s})"),
    "wave_lanes": ("(blockIdx.x * VF_WAVES + vf_wave) * {r} + vf_lane / {l}", "gridDim.x * VF_WAVES * {r}"),
    "lane": ("vf_lane", "VF_WAVE"),
}
BLOCK_REDUCE = {("add", "f32"): "{a} = vf_block_sum({a}, vf_red);", ("max", "f32"): "{a} = vf_block_max({a}, vf_red);",
                ("argmax", "f32"): "vf_block_argmax(&{a}, &{i}, vf_red, vf_redi);",
                ("add", "i32"): "{a} = vf_block_sum_i({a}, vf_redi);", ("max", "i32"): "{a} = vf_block_max_i({a}, vf_redi);",
                ("argmax", "i32"): "vf_block_argmax_i(&{a}, &{i}, vf_redi);"}
WAVE_REDUCE = {"add": "{a} = vf_wave_sum({a});", "max": "{a} = vf_wave_max({a});"}
VECTOR_DOT = {"f16": "vf_dot8_h", "f32": "vf_dot4_f"}


def _for(var, head, stop, step, pad):
    return f"{pad}for (int {var} = {head}; {var} < {stop}; {var} {step}) {{"


def _loop(s, pad):
    if s.unroll:
        return [f"{pad}#pragma unroll {s.unroll}"] + _loop(replace(s, unroll=0), pad)
    if s.map == "serial":
        return [_for(s.var, bare(s.start), expr(s.stop), "++", pad).replace(f"{s.var} ++", f"++{s.var}")]
    key = "wave_split" if s.map == "wave" and s.split > 1 else "wave_lanes" if s.map == "wave" and s.lanes else s.map
    first, step = (x.format(s=s.split, r=f"(VF_WAVE / {s.lanes})", l=s.lanes) for x in LOOP_MAP[key])
    note = f"  // {s.split} waves per iteration, all take the same trips: barriers are safe" if s.split > 1 else \
        f"  // {s.lanes} lanes per row: a wave takes VF_WAVE / {s.lanes} rows side by side" if s.lanes else ""
    return [_for(s.var, _plus(s.start, first), expr(s.stop), f"+= {step}", pad) + note]


def _reduce_update(s, a, pad):
    """One iteration's update of accumulator ``a`` of ``s``."""
    if s.vector > 1:                              # act[k] * w[row * K + k], checked by the mapping
        w, act = (x.x if isinstance(x, L.Cast) else x for x in (a.value.b, a.value.a))
        if isinstance(w, L.QLoad):                # 8 quantized weights dequantized together
            weights = f"vf_dequant8f_{w.fmt}({w.buf}, {bare(w.index)}, {w.count // 32})"
            return [f"{pad}{a.name} = vf_dot8_w({a.name}, {weights}, {act.buf} + {bare(act.index)});"]
        return [f"{pad}{a.name} = {VECTOR_DOT[w.dtype]}({a.name}, {w.buf} + {bare(w.index)}, {act.buf} + {bare(act.index)});"]
    v = bare(a.value)
    if a.op == "add":
        return [f"{pad}{a.name} += {v};"]
    if a.op == "max":
        return [f"{pad}{a.name} = {'vf_max' if a.dtype == 'f32' else 'max'}({a.name}, {v});"]
    return [f"{pad}vf_argmax_step{'_i' if a.dtype == 'i32' else ''}({v}, {s.var}, &{a.name}, &{a.arg});"]


def _exact(s, extent) -> bool:
    """Do a lane reduction's ``lanes`` (a number, not the wave) divide its range of ``extent``?"""
    return bool(s.lanes) and s.vector == 1 and extent % s.lanes == 0


def _block_steps(s, pad):
    """A block-mapped reduction over a whole number of the workgroup's steps (``whole``): a first loop
    takes every step's leading loads (the body's first Declares) into registers, so that all are in
    flight before the body's first store (a store to LDS may alias a generic pointer's load, and the
    compiler keeps the two in order: a step at a time, a load's latency each)."""
    n = len(s.body) - len(tuple(itertools.dropwhile(lambda x: isinstance(x, L.Declare), s.body)))
    lead, rest, steps = s.body[:n], s.body[n:], f"{expr(s.stop)} / VF_BLOCK"
    assert all(d.name.startswith("vf_") for d in lead), lead      # the mapping's own: {name}_steps is no user's
    head = [f"{pad}#pragma unroll", f"{pad}for (int vf_step = 0; vf_step < {steps}; ++vf_step) {{",
            f"{pad}  const int {s.var} = threadIdx.x + vf_step * VF_BLOCK;"]
    out = [f"{pad}{CTYPE[a.dtype]} {a.name} = {_const(a.init)};" for a in s.accs]
    out += [f"{pad}{CTYPE[d.dtype]} {d.name}_steps[{steps}];   // every step's {d.name}, all loads in flight at once"
            for d in lead]
    out += head + [f"{pad}  {d.name}_steps[vf_step] = {bare(d.init)};" for d in lead] + [f"{pad}}}"]
    out += head + [f"{pad}  const {CTYPE[d.dtype]} {d.name} = {d.name}_steps[vf_step];" for d in lead]
    out += stmts(rest, pad + "  ") + [x for a in s.accs for x in _reduce_update(s, a, pad + "  ")] + [f"{pad}}}"]
    return out + [pad + BLOCK_REDUCE[a.op, a.dtype].format(a=a.name, i=a.arg) for a in s.accs]


def _reduce(s, pad):
    if s.map == "block" and s.whole:
        return _block_steps(s, pad)
    out = []
    for a in s.accs:
        out.append(f"{pad}{CTYPE[a.dtype]} {a.name} = {_const(a.init)};")
        if a.arg:
            out.append(f"{pad}int {a.arg} = 0;")
    lo, hi = s.start, expr(s.stop)
    whole = s.map == "lane" and s.whole                # a constant count of steps over the lane's extent
    extent = s.stop.value // s.split - (0 if s.split > 1 else s.start.value) if whole else 0
    guarded = whole and not _exact(s, extent)          # a step may fall past the range
    if s.map == "serial":
        out.append(_for(s.var, expr(lo), hi, "++", pad).replace(f"{s.var} ++", f"++{s.var}"))
    elif s.map == "block":
        if s.unroll:
            out.append(f"{pad}#pragma unroll {s.unroll}")
        out.append(_for(s.var, _plus(lo, "threadIdx.x"), hi, "+= VF_BLOCK", pad))
    else:                                          # lane: vector elements per lane step, split waves
        lane = ("vf_lane" if not s.lanes else f"vf_lane % {s.lanes}") if s.vector == 1 else f"vf_lane * {s.vector}"
        if s.split > 1:                            # this wave's slice of k (the range starts at 0)
            chunk = s.stop.value // s.split
            lo, hi = f"vf_wave % {s.split} * {chunk} + {lane}", f"(vf_wave % {s.split} + 1) * {chunk}"
        else:
            lo = _plus(lo, lane)
        step = f"{s.lanes or 'VF_WAVE'}{'' if s.vector == 1 else f' * {s.vector}'}"
        if s.whole:                                # a constant count of steps, every load in flight at once
            count = f"({extent} + {step} - 1) / {step if ' ' not in step else f'({step})'}"
            if not guarded:                        # the lanes divide the range: every step is whole
                count = extent // s.lanes
            out += [f"{pad}#pragma unroll   // all of the lane's steps: their loads in flight together",
                    f"{pad}for (int vf_step = 0; vf_step < {count}; ++vf_step) {{",
                    f"{pad}  const int {s.var} = {lo} + vf_step * {step};"]
            if guarded:
                out.append(f"{pad}  if ({s.var} < {hi}) {{")
        else:
            if s.vector > 1:
                out.append(f"{pad}VF_UNROLL_K")
            elif s.unroll:
                out.append(f"{pad}#pragma unroll {s.unroll}")
            out.append(_for(s.var, lo, hi, f"+= {step}", pad))
    inner = pad + ("    " if guarded else "  ")
    out += stmts(s.body, inner)
    for a in s.accs:
        out += _reduce_update(s, a, inner)
    if guarded:
        out.append(f"{pad}  }}")
    out.append(f"{pad}}}")
    if s.map == "block":
        out += [pad + BLOCK_REDUCE[a.op, a.dtype].format(a=a.name, i=a.arg) for a in s.accs]
    elif s.map == "lane" and s.lanes:
        out += [f"{pad}{a.name} = vf_lanes_sum({a.name}, {s.lanes});" for a in s.accs]
    elif s.map == "lane":
        out += [pad + WAVE_REDUCE[a.op].format(a=a.name) for a in s.accs]
        if s.split > 1:                            # the waves sharing the row combine through LDS
            n = len(s.accs)
            slot = lambda w, i: w if n == 1 else f"({w}) * {n} + {i}"  # noqa: E731
            out.append(f"{pad}if (vf_lane == 0) {{")
            out += [f"{pad}  vf_part[{slot('vf_wave', i)}] = {a.name};" for i, a in enumerate(s.accs)]
            out += [f"{pad}}}", f"{pad}__syncthreads();"]
            first = f"vf_wave - vf_wave % {s.split}"
            for i, a in enumerate(s.accs):
                terms = [f"vf_part[{slot(first + (f' + {q}' if q else ''), i)}]" for q in range(s.split)]
                out.append(f"{pad}{a.name} = {' + '.join(terms)};")
            out.append(f"{pad}__syncthreads();")
    return out


def _if(s, pad):
    out = [f"{pad}if ({bare(s.cond)}) {{"]
    while True:
        out += stmts(s.then, pad + "  ")
        if len(s.orelse) == 1 and isinstance(s.orelse[0], L.If):
            s = s.orelse[0]
            out.append(f"{pad}}} else if ({bare(s.cond)}) {{")
            continue
        if s.orelse:
            out.append(f"{pad}}} else {{")
            out += stmts(s.orelse, pad + "  ")
        out.append(f"{pad}}}")
        return out


def _array(s, pad):
    if s.space == "device":                        # file scope: zero when the module loads
        return [f"__device__ {CTYPE[s.dtype]} {s.name}[{s.size}];"]
    shared = "__shared__ " if s.space == "lds" else ""
    if s.dtype in L.ACT_Q8:                        # one vf_q8_1 per block of 32
        what = "q8_1 blocks with a residual plane" if s.dtype == "q8_1r" else "q8_1 blocks"
        align = " __attribute__((aligned(16)))" if shared else ""     # copied 16 bytes at a time (vf_copy_q8_1)
        return [f"{pad}{shared}vf_q8_1 {s.name}[{s.size // 32}]{align};  // {s.size} values in {what}"]
    align = f" __attribute__((aligned({s.align})))" if s.align else ""
    return [f"{pad}{shared}{CTYPE[s.dtype]} {s.name}[{s.size}]{align};"]


def _quantize(s, pad):
    vals = ", ".join(bare(v) for v in s.values)
    return [f"{pad}vf_quantize_q8_1({s.arr}, {bare(s.group)}, {vals}, {bare(s.active)});"]


def _quantize_stored(s, pad):
    src = s.staged or s.src                                         # staged: the workgroup's LDS copy
    x, q = (f"{src}, {s.scale}", f"{s.dst}, {s.sumsq}") if s.scale else (src, s.dst)   # the scaled overloads
    if s.staged:
        return [f"{pad}vf_quantize_staged({x}, {q}, {s.n}, {s.first}, {s.rows}, {s.trips});"]
    if s.whole:
        return [f"{pad}vf_quantize_own({x}, {q}, {s.n}, {s.first}, {s.rows}, {s.trips});"]
    return [f"{pad}vf_quantize_stored({x}, {q}, {s.dst}_count, {s.n}, {s.first}, {s.rows}, {s.trips}, "
            f"{s.per_trip}, {s.done});"]


STMT = {
    L.Loop: lambda s, pad: _loop(s, pad) + stmts(s.body, pad + "  ") + [f"{pad}}}"],
    L.Reduce: _reduce,
    L.If: _if,
    L.Declare: lambda s, pad: [f"{pad}{CTYPE[s.dtype]} {s.name} = {bare(s.init)};"],
    L.Assign: lambda s, pad: [f"{pad}{s.name} = {bare(s.value)};"],
    L.Array: _array,
    L.Store: lambda s, pad: [f"{pad}{s.buf}[{bare(s.index)}] = {bare(s.value)};"],
    L.Barrier: lambda s, pad: [f"{pad}__syncthreads();"],
    L.Stamp: lambda s, pad: [f"{pad}VF_STAMP({L.STAMP_STEPS.index(s.step)});   // {s.step}"],
    L.Arrive: lambda s, pad: [f"{pad}if (!vf_last_to_arrive({s.count}, {s.parts}, &vf_flag)) return;"
                              "  // all but the last workgroup end here"],
    L.Comment: lambda s, pad: [f"{pad}// {s.text}".rstrip()],
    L.Attention: lambda s, pad: _attention(s, pad),
    L.QuantizeQ8: _quantize,
    mma.MatmulTiles: lambda s, pad: mma.render(s, stmts, bare, pad),
    L.CopyQ8: lambda s, pad: [f"{pad}vf_copy_q8_1({s.dst}, {s.src}, {s.blocks});"],
    L.CopyF32: lambda s, pad: [f"{pad}vf_copy_f32({s.dst}, {s.src}, {s.n});"],
    L.QuantizeStored: _quantize_stored,
    L.RingDot: lambda s, pad: [f"{pad}vf_chunk = vf_ring_dot<{s.k}, {s.kc}, {s.cg}, {s.rpt}>(vf_ring, vf_chunk, {s.act}, "
                               f"{s.sums}, {bare(s.slots)});"],
    L.RingProduce: lambda s, pad: [f"{pad}vf_chunk = vf_ring_produce(vf_ring, vf_chunk, vf_tiled + {bare(s.first)}, "
                                   f"{bare(s.slots)}, {s.k}, {s.kc}, {s.flight});"],
}


def stmts(body, pad="  "):
    """C for a statement list of a mapped kernel."""
    out = []
    for s in body:
        out += STMT[type(s)](s, pad)
    return out


def _attention(a: L.Attention, pad):
    """The attention template (``codegen/attention.py``)."""
    return [(pad + line) if line and not line.startswith("#") else line for line in attention.render(a, bare)]


# ------------------------------------------------------------------------------------ kernels
@dataclass
class HipKernel:
    """Rendered source plus how to launch it (grid and block in threads' units, dynamic LDS bytes)."""
    name: str
    source: str
    grid: tuple
    block: tuple
    dynamic_lds: int
    kernel: object
    target: Target
    body_start: int = 0           # offset where the target-independent kernel text begins

    @property
    def body(self):
        return self.source[self.body_start:]


def parameter(p: L.Param) -> str:
    """A kernel parameter's declaration.  Scalars (the decode position) arrive through device memory
    (``const int* name_``), so a captured graph replays with the current value."""
    if p.kind == "scalar":
        return f"const int* __restrict__ {p.name}_"
    return f"{'const ' if p.role == 'in' else ''}{CTYPE[p.dtype]}* __restrict__ {p.name}"


def _signature(k: L.Kernel) -> str:
    """Parameters named after tensors (``parameter``)."""
    return ", ".join(map(parameter, k.params))


def _uses_waves(body):
    """Does the kernel text name ``vf_lane``/``vf_wave`` (outside the attention template)?"""
    for s in L.walk_stmts(body):
        if getattr(s, "map", "") in ("wave", "lane") or isinstance(s, mma.MatmulTiles):
            return True
        if any(isinstance(x, L.Hw) and x.name in ("lane", "wave") for e in L.stmt_exprs(s) for x in L.walk_exprs(e)):
            return True
    return False


def _weights(k: L.Kernel):
    """The large buffers a GEMV or matmul's reductions read and nothing writes: its weights (a
    prefill's [T, K] activation is listed too, which a prefetch only wastes)."""
    def operand(e):
        e = e.x if isinstance(e, L.Cast) else e
        return e.buf if isinstance(e, L.Load) else None
    read = set()
    for s in L.walk_stmts(k.body):
        for a in s.accs if isinstance(s, L.Reduce) else ():
            v = a.value
            if isinstance(v, L.Bin) and v.op == "mul" and operand(v.a) != operand(v.b):  # not a sum of squares
                read |= {operand(v.a), operand(v.b)}
    return [p for p in k.params if p.name in read and p.kind == "buffer" and p.role == "in"
            and len(p.shape) >= 2 and p.size * L.ITEMSIZE[p.dtype] >= 65536]


def _prefetch(weights, n: int) -> list:
    """Before the wait of a programmatic dependent launch: the first ``n`` bytes of each of
    ``weights`` asked of L2 (``vf_prefetch_l2``, a share per workgroup); none when ``n`` is 0."""
    if not n or not weights:
        return []
    lines = [f"  // before the wait: the first {n} bytes of each weight into L2, a share per workgroup"]
    for p in weights:
        size = int(p.size * L.ITEMSIZE[p.dtype])
        lines.append(f"  vf_prefetch_l2({p.name}, {min(n, size)}ull);")
    return lines


def _pool(a: L.Array, grid: int):
    """An array of space "global" (``codegen.mapping._activation_beyond_lds``): the file-scope buffer
    of a slice per workgroup (each slice 16-byte aligned) and the kernel's pointer to its own."""
    ctype = CTYPE[a.dtype]
    per = -(-a.size * L.ITEMSIZE[a.dtype] // 16) * 16 // L.ITEMSIZE[a.dtype]
    return ([f"// {a.name}: {a.size} values a workgroup, in device memory (they pass the LDS): a slice of {per} "
             f"for each of the grid's {grid} workgroup{'s' if grid > 1 else ''}",
             f"__device__ __attribute__((aligned(16))) {ctype} {a.name}_slices[{grid * per}];"],
            [f"  {ctype}* const {a.name} = {a.name}_slices + (size_t)blockIdx.x * {per};   // this workgroup's slice"])


def _lds_size(a: L.Array) -> int:
    """Bytes of ``a`` rounded up to 16 (each array of dynamic LDS starts 16-byte aligned)."""
    return -(-int(math.ceil(a.size * L.ITEMSIZE[a.dtype])) // 16) * 16


def dynamic_arrays(k: L.Kernel, static_lds: int, budget: int = 0) -> list:
    """The LDS arrays of a mapped kernel to declare in dynamic LDS so that the rest fit the
    ``static_lds`` bytes a kernel may declare (the largest first); [] when all fit, when there is
    no limit, or when together they pass the ``budget`` of a workgroup's LDS (``targets.lds_budget``:
    then nothing fits, and the compiler says so)."""
    lds = sorted((s for s in k.body if isinstance(s, L.Array) and s.space == "lds"), key=_lds_size, reverse=True)
    total, out = sum(map(_lds_size, lds)), []
    if budget and total > budget:
        return []
    for a in lds:
        if not static_lds or total <= static_lds:
            break
        out.append(a)
        total -= _lds_size(a)
    return out


def _dynamic(arrays, static_lds: int, pad="  ", why: str = "") -> list:
    """``arrays`` as pointers into one dynamic LDS buffer (``VF_DYNAMIC_LDS``), in order; ``why``
    the comment's reason (by default: past the ``static_lds`` bytes a kernel may declare)."""
    total = sum(map(_lds_size, arrays))
    why = why or f"past the {static_lds} bytes of LDS a kernel may declare"
    lines = [f"{pad}// {why}: {total} bytes of dynamic LDS, sized at launch",
             f"{pad}VF_DYNAMIC_LDS(vf_lds, {total});"]
    at = 0
    for a in arrays:
        ctype = "vf_q8_1" if a.dtype in L.ACT_Q8 else CTYPE[a.dtype]
        what = f"{a.size} values in q8_1 blocks" if a.dtype in L.ACT_Q8 else f"{a.size} values"
        lines.append(f"{pad}{ctype}* const {a.name} = ({ctype}*)(vf_lds + {at});   // {what}")
        at += _lds_size(a)
    return lines


def file_scope(k: L.Kernel) -> list:
    """The lines of a mapped kernel before its function: its header comment and the device-memory
    buffers it keeps between workgroups (attention's partial rows, arrival counts, pools)."""
    launch = k.launch
    lines = [f"// {k.name}: {k.family} kernel, {k.bytes} bytes moved, {k.flops} flops per call",
             f"// mapping: {launch.how}"]
    lines += [x for s in k.body if isinstance(s, L.Attention) for x in attention.globals_of(s)]
    lines += [f"__device__ unsigned int {s.dst}_count[{s.n // 32}];   // arrivals per q8_1 block of {s.src}, zero "
              "between launches" for s in k.body if isinstance(s, L.QuantizeStored) and not s.whole]
    device = [s for s in k.body if isinstance(s, L.Array) and s.space == "device"]
    if device:
        lines += ["// each workgroup's partial result, and how many have arrived (the last sets it back to zero)"]
        counts = {s.count for s in L.walk_stmts(k.body) if isinstance(s, L.Arrive)}
        lines += [f"__device__ unsigned int {s.name}[{s.size}];" if s.name in counts else _array(s, "")[0]
                  for s in device]
    return lines + [x for s in k.body if isinstance(s, L.Array) and s.space == "global" for x in _pool(s, launch.grid)[0]]


def function_body(k: L.Kernel, dynamic=(), static_lds: int = 0, wait=(), why: str = "") -> list:
    """The lines inside a mapped kernel's function: its arrays (``dynamic``: those taken from dynamic
    LDS, see ``_dynamic``), then ``wait`` (the lines that wait for the previous kernel), its scalars
    and its statements."""
    arrays = [s for s in k.body if isinstance(s, L.Array) and s.space in ("local", "lds") and s not in dynamic]
    lines = stmts(arrays) + (_dynamic(dynamic, static_lds, why=why) if dynamic else [])
    lines += [_pool(s, k.launch.grid)[1][0] for s in k.body if isinstance(s, L.Array) and s.space == "global"]
    if any(isinstance(s, L.Arrive) for s in L.walk_stmts(k.body)):
        lines.append("  __shared__ int vf_flag;")
    if _uses_waves(k.body):
        lines.append("  const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;")
    lines += list(wait)
    lines += [f"  const int {p.name} = {p.name}_[0];" for p in k.params if p.kind == "scalar"]
    return lines + stmts([s for s in k.body if not isinstance(s, L.Array)])


def render_kernel(k: L.Kernel, prefetch: int = 0, weights=(), dynamic=(), static_lds: int = 0) -> str:
    """The source of a mapped kernel (``codegen.mapping.map_kernel``), without the prelude;
    ``prefetch``: bytes of each of ``weights`` asked of L2 before the wait (``Target.pdl_prefetch``);
    ``dynamic``: its arrays to take from dynamic LDS (``dynamic_arrays``), past the ``static_lds``
    bytes a kernel may declare."""
    wait = _prefetch(weights, prefetch) + [
        "  VF_GRID_WAIT();                // from here on, the previous kernel's outputs are ready",
        "  VF_GRID_LAUNCH_DEPENDENTS();"]
    lines = file_scope(k) + [f'extern "C" __global__ void __launch_bounds__({k.launch.bounds}) {k.name}({_signature(k)}) {{']
    lines += function_body(k, dynamic, static_lds, wait)
    return "\n".join(lines + ["}"]) + "\n"


def prelude_parts(kernels, mapped) -> dict:
    """Which of the prelude's optional parts ``kernels`` (Loop IR, with ``mapped``: the same kernels
    mapped) need, as ``prelude``'s keyword arguments: quantized weights or q8_1 blocks (``quant``),
    a producer's q8_1 dtype (``q8``), decode attention (``attention``), tensor-core tiles (``mma``), a
    split reduction's arrivals (``arrive``)."""
    params = [p for k in kernels for p in k.params]
    stmts = [s for m in mapped for s in L.walk_stmts(m.body)]
    q8 = next((p.dtype for p in params if p.dtype in L.ACT_Q8), None)          # a producer's q8_1 blocks
    return dict(quant=q8 is not None or any(p.dtype in L.QUANT_DTYPES for p in params), q8=q8,
                attention=any(isinstance(s, L.Attention) for s in stmts),
                mma=any(isinstance(s, mma.MatmulTiles) for s in stmts),
                arrive=any(isinstance(s, L.Arrive) for s in stmts))


def render_hip(k: L.Kernel, target="gfx906") -> HipKernel:
    """HIP source of one kernel for ``target`` (a name or a Target), with its launch geometry.
    ``k`` is mapped for ``target`` first unless it is mapped already (then only the prelude
    comes from ``target``)."""
    t = get_target(target) if isinstance(target, str) else target
    if k.family == "persistent":
        from .persistent import render_persistent
        return render_persistent(k, t)
    m = L.tidy_names(map_kernel(k, t), reserved=("vf_lane", "vf_wave"))
    # VF_BLOCK is the launch's workgroup size (a balanced GEMV takes its own, codegen.mapping._balanced)
    own = replace(t, block=m.launch.block) if m.launch.bounds == "VF_BLOCK" else t
    head = (f"// vegafuse kernel for {t.name}; prelude generated from the target table\n"
            + prelude(own, m.launch.act, **prelude_parts([k], [m])))
    prefetch = t.pdl_prefetch if t.pdl else 0
    dynamic = dynamic_arrays(m, t.max_static_lds, lds_budget(t))
    if dynamic:
        head += ("// arrays in dynamic LDS: declared once, sized at launch\n#define VF_DYNAMIC_LDS(name, bytes) "
                 "extern __shared__ __attribute__((aligned(16))) unsigned char name[]\n")
    src = head + "\n" + render_kernel(m, prefetch, _weights(clear_of_templates(k)) if prefetch else (), dynamic,
                                    t.max_static_lds)
    lds = occupancy_lds(t, m.launch.lds, m.launch.block) + sum(map(_lds_size, dynamic))
    return HipKernel(k.name, src, (m.launch.grid, 1, 1), (m.launch.block, 1, 1), lds, m, t, len(head) + 1)
