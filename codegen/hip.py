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

import math
import re
from dataclasses import dataclass, replace

from . import loopir as L
from .mapping import map_kernel
from .prelude import act_dtype, prelude  # noqa: F401  (prelude is re-exported)
from .targets import Target, get_target, occupancy_lds

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


HW = {"lane": "vf_lane", "wave": "vf_wave", "thread": "threadIdx.x"}


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
BLOCK_REDUCE = {"add": "{a} = vf_block_sum({a}, vf_red);", "max": "{a} = vf_block_max({a}, vf_red);",
                "argmax": "vf_block_argmax(&{a}, &{i}, vf_red, vf_redi);"}
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
        return [f"{pad}{a.name} = {VECTOR_DOT[w.dtype]}({a.name}, {w.buf} + {bare(w.index)}, {act.buf} + {s.var});"]
    v = bare(a.value)
    if a.op == "add":
        return [f"{pad}{a.name} += {v};"]
    if a.op == "max":
        return [f"{pad}{a.name} = {'vf_max' if a.dtype == 'f32' else 'max'}({a.name}, {v});"]
    if a.dtype != "f32":
        return [f"{pad}if ({expr(a.value)} > {a.name}) {{ {a.name} = {v}; {a.arg} = {s.var}; }}"]
    # k only grows: a larger value wins, and the first NaN (not <=, while the best is no NaN yet)
    return [f"{pad}if (!({expr(a.value)} <= {a.name}) && {a.name} == {a.name}) {{ {a.name} = {v}; {a.arg} = {s.var}; }}"
            "   // the first NaN wins, as in numpy"]


def _reduce(s, pad):
    out = []
    for a in s.accs:
        out.append(f"{pad}{CTYPE[a.dtype]} {a.name} = {_const(a.init)};")
        if a.arg:
            out.append(f"{pad}int {a.arg} = 0;")
    lo, hi = s.start, expr(s.stop)
    if s.map == "serial":
        out.append(_for(s.var, expr(lo), hi, "++", pad).replace(f"{s.var} ++", f"++{s.var}"))
    elif s.map == "block":
        out.append(_for(s.var, _plus(lo, "threadIdx.x"), hi, "+= VF_BLOCK", pad))
    else:                                          # lane: vector elements per lane step, split waves
        lane = ("vf_lane" if not s.lanes else f"vf_lane % {s.lanes}") if s.vector == 1 else f"vf_lane * {s.vector}"
        if s.split > 1:                            # this wave's slice of k (the range starts at 0)
            chunk = s.stop.value // s.split
            lo, hi = f"vf_wave % {s.split} * {chunk} + {lane}", f"(vf_wave % {s.split} + 1) * {chunk}"
        else:
            lo = _plus(lo, lane)
        if s.vector > 1:
            out.append(f"{pad}VF_UNROLL_K")
        elif s.unroll:
            out.append(f"{pad}#pragma unroll {s.unroll}")
        step = s.lanes or "VF_WAVE"
        out.append(_for(s.var, lo, hi, f"+= {step}{'' if s.vector == 1 else f' * {s.vector}'}", pad))
    for a in s.accs:
        out += _reduce_update(s, a, pad + "  ")
    out.append(f"{pad}}}")
    if s.map == "block":
        out += [pad + BLOCK_REDUCE[a.op].format(a=a.name, i=a.arg) for a in s.accs]
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
    shared = "__shared__ " if s.space == "lds" else ""
    if s.dtype in L.ACT_Q8:                        # one vf_q8_1 per block of 32
        what = "q8_1 blocks with a residual plane" if s.dtype == "q8_1r" else "q8_1 blocks"
        return [f"{pad}{shared}vf_q8_1 {s.name}[{s.size // 32}];  // {s.size} values in {what}"]
    return [f"{pad}{shared}{CTYPE[s.dtype]} {s.name}[{s.size}];"]


def _quantize(s, pad):
    vals = ", ".join(bare(v) for v in s.values)
    return [f"{pad}vf_quantize_q8_1({s.arr}, {bare(s.group)}, {vals}, {bare(s.active)});"]


STMT = {
    L.Loop: lambda s, pad: _loop(s, pad) + stmts(s.body, pad + "  ") + [f"{pad}}}"],
    L.Reduce: _reduce,
    L.If: _if,
    L.Declare: lambda s, pad: [f"{pad}{CTYPE[s.dtype]} {s.name} = {bare(s.init)};"],
    L.Assign: lambda s, pad: [f"{pad}{s.name} = {bare(s.value)};"],
    L.Array: _array,
    L.Store: lambda s, pad: [f"{pad}{s.buf}[{bare(s.index)}] = {bare(s.value)};"],
    L.Barrier: lambda s, pad: [f"{pad}__syncthreads();"],
    L.Comment: lambda s, pad: [f"{pad}// {s.text}".rstrip()],
    L.Attention: lambda s, pad: _attention(s, pad),
    L.QuantizeQ8: _quantize,
}


def stmts(body, pad="  "):
    """C for a statement list of a mapped kernel."""
    out = []
    for s in body:
        out += STMT[type(s)](s, pad)
    return out


LOG2E = 1.4426950408889634

# the names the attention template declares inside its block: a buffer or position symbol of the
# same name is read through a renamed local (``_attention``)
ATT_LOCALS = ("D", "S", "T", "G", "R", "KT", "CH", "NS", "q_tile", "k_tile", "v_tile", "p_tile", "rescale",
              "row_max", "row_sum", "last_flag", "kv_head", "tile", "first", "split", "p", "end", "lo", "hi",
              "i", "r", "t", "u", "j", "c", "d", "r0", "k_next", "v_next", "m", "l", "o", "start", "s", "top",
              "dot", "mx", "corr", "sum", "pr", "v0", "v1", "v2", "v3", "splits", "group", "slot", "at", "w",
              "acc", "key")


@dataclass(frozen=True)
class _Att:
    """The numbers of one attention template, from its ``AttentionTiles``."""
    a: L.Attention

    def __getattr__(self, name):
        return getattr(self.a.tiles, name)

    @property
    def group(self):
        return self.a.hq // self.a.hkv

    @property
    def rows(self):
        return self.rows_q * self.group

    @property
    def nqt(self):
        return -(-self.a.t // self.rows_q)

    @property
    def waves(self):
        return self.threads // self.wave


def _att_globals(a: L.Attention):
    """File-scope buffers of a split attention: every split's partial rows and, per group of splits,
    how many have arrived (zero when the module loads; the last split sets it back)."""
    x = _Att(a)
    if x.splits == 1:
        return []
    n = a.hkv * x.nqt
    part = n * x.splits * x.rows
    return [f"// {a.out}: the partial rows (output, max, sum) of each of the {x.splits} splits of the cache, and per",
            f"// group of splits how many have arrived (zero when the module loads; the last split resets it)",
            f"__device__ float {a.out}_o_part[{part * a.d}], {a.out}_m_part[{part}], {a.out}_l_part[{part}];",
            f"__device__ unsigned int {a.out}_arrived[{n}];"]


def _one_trip(lines):
    """``lines`` with every loop of one trip (``for (int i = 0; i < 1; ++i)``) written as its body,
    the counter 0: a block when the body spans lines (its locals keep their scope)."""
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"(\s*)for \(int (\w+) = 0; \2 < 1; \+\+\2\) (.*)$", lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        ind, var, rest = m.groups()
        if out and out[-1].startswith("#pragma unroll"):
            out.pop()

        def zero(x):
            x = re.sub(rf"\b{var}\b", "0", x)
            x = re.sub(r" \+ \w+ \* 0\b| \+ 0 \* \w+", "", x)
            return re.sub(r"\((vf_wave|vf_lane)\)", r"\1", x)
        if re.match(r"\{(\s*//.*)?$", rest):              # a body over several lines, up to the brace
            end = next(j for j in range(i + 1, len(lines)) if lines[j] == ind + "}")
            out += [ind + rest] + _one_trip([zero(x) for x in lines[i + 1:end]]) + [ind + "}"]
            i = end + 1
        else:
            out.append(ind + zero(rest))
            i += 1
    return out


def _attention(a: L.Attention, pad):
    """Flash attention over the KV cache (``codegen.mapping.attention_tiles`` chose the tiles): a
    workgroup takes one KV head, a tile of query rows (the group's heads at ``rows_q`` positions)
    and one split of the cache; K/V tiles move through registers (16-byte loads, the next tile's in
    flight while this one is computed) into LDS; each row's scores are spread over ``key_lanes``
    lanes (online softmax in base 2: the scale carries log2 e); each thread accumulates output
    elements of its rows.  The splits' partial rows meet in global memory, where the last split of
    each group to finish combines them (log-sum-exp)."""
    x = _Att(a)
    qd, kd, vd = a.dtypes
    G, R, KT, KL, NT, NS, D = x.group, x.rows, x.keys, x.key_lanes, x.threads, x.splits, a.d
    RW, KPL = x.wave // KL, KT // KL                   # rows a wave scores at once, keys per lane
    RI = -(-R // (x.waves * RW))                       # score rows per lane
    shared_d = NT % D == 0                             # each thread keeps one column d of several rows
    RP = NT // D if shared_d else 0
    OI = -(-R // RP) if shared_d else -(-R * D // NT)  # output elements per thread
    h2f = lambda dt, e: f"vf_h2f({e})" if dt == "f16" else e  # noqa: E731
    out = []
    A = out.append
    T1, tiled = a.t == 1, x.nqt > 1

    # expressions of a row r: its query position t and head
    def t_of(r):
        if T1:
            return "0"
        within = r if G == 1 else f"{r} / G"
        return f"first + {within}" if tiled else within

    def head(r):
        if G == 1:
            return "kv_head"
        return f"kv_head * G + {r}" if T1 else f"kv_head * G + {r} % G"

    def row_index(r):               # the (head, t) row of q and out, in elements
        return f"(size_t)({head(r)}) * D" if T1 else f"((size_t)({head(r)}) * T + {t_of(r)}) * D"

    partial_t = a.t % x.rows_q != 0                    # the last tile has rows past T

    def units(dt):
        es = L.ITEMSIZE[dt]
        e = 16 // es if x.vector else 1
        return e, D // e, "vf_vec16" if x.vector else CTYPE[dt]

    def zero(dt):
        return "vf_zero16()" if x.vector else ("vf_f2h(0.0f)" if dt == "f16" else "0.0f")

    def fetch(start, what):
        lines = [f"// {what}"]
        for buf, dt, regs in (("@k@", kd, "k_next"), ("@v@", vd, "v_next")):
            e, per_row, _ = units(dt)
            total = KT * per_row
            n = -(-total // NT)
            guard = "i < KT * %d && " % per_row if total % NT else ""
            col = f"i % {per_row} * {e}" if e > 1 else f"i % {per_row}"
            load = f"*(const vf_vec16*)({buf} + (size_t)(kv_head * S + key) * D + {col})" if x.vector else \
                f"{buf}[(size_t)(kv_head * S + key) * D + {col}]"
            lines += ["#pragma unroll", f"for (int u = 0; u < {n}; ++u) {{",
                      f"  const int i = threadIdx.x + u * {NT}, key = {start} + i / {per_row};",
                      f"  {regs}[u] = {zero(dt)};",
                      f"  if ({guard}key < hi) {regs}[u] = {load};", "}"]
        return lines

    def stash():
        lines = []
        for tile, dt, regs in (("k_tile", kd, "k_next"), ("v_tile", vd, "v_next")):
            e, per_row, unit = units(dt)
            total = KT * per_row
            n = -(-total // NT)
            col = f"i % {per_row} * {e}" if e > 1 else f"i % {per_row}"
            dst = f"*(vf_vec16*)&{tile}[i / {per_row}][{col}]" if x.vector else f"{tile}[i / {per_row}][{col}]"
            lines += ["#pragma unroll", f"for (int u = 0; u < {n}; ++u) {{",
                      f"  const int i = threadIdx.x + u * {NT};",
                      (f"  if (i < KT * {per_row}) " if total % NT else "  ") + f"{dst} = {regs}[u];", "}"]
        return lines

    # the rows and columns a thread accumulates (PV): r0 + RP * i and d, or pairs threadIdx.x + NT * i
    clamp_rows = shared_d and R % RP != 0
    if shared_d:
        out_row = "min(r0 + %d * i, R - 1)" % RP if clamp_rows else f"r0 + {RP} * i"
        out_col = "d"
        row_ok = "r0 + %d * i < R" % RP if clamp_rows else ""
    else:
        pair = "min((int)threadIdx.x + %d * i, R * D - 1)" % NT if R * D % NT else f"threadIdx.x + {NT} * i"
        out_row, out_col = f"{pair} / D", f"{pair} % D"
        row_ok = f"threadIdx.x + {NT} * i < R * D" if R * D % NT else ""

    def store_rows(value):
        """Lines storing ``value`` (an expression of i, r, d) for every row the thread holds."""
        ok = [c for c in (row_ok, f"{t_of('r')} < T" if partial_t else "") if c]
        body = [f"  const int r = {out_row}, d = {out_col};" if not shared_d else f"  const int r = {out_row};"]
        st = f"@out@[{row_index('r')} + d] = {value};"
        body.append(f"  if ({' && '.join(ok)}) {st}" if ok else f"  {st}")
        return ["#pragma unroll", f"for (int i = 0; i < {OI}; ++i) {{"] + body + ["}"]

    # score rows: lane groups of KL lanes, RW per wave
    srow = "vf_wave + %d * i" % x.waves if RW == 1 else f"(vf_wave + {x.waves} * i) * {RW} + vf_lane / {KL}"
    clamp_srows = R % (x.waves * RW) != 0
    kcol = "vf_lane" if KL == x.wave else f"vf_lane % {KL}"
    jexpr = kcol if KPL == 1 else f"{kcol} + {KL} * u"

    heads = f"{G} query head{'s' if G > 1 else ''}"
    rows_text = heads if x.rows_q == 1 else f"{x.rows_q} query positions x {heads}"
    A(f"// {a.hq} query heads over {a.hkv} KV heads, {a.t} query row{'s' if a.t > 1 else ''}, {a.s} cache positions, "
      f"head dim {D}.  A workgroup: one KV head,")
    A(f"// {rows_text} ({R} rows), " + (f"one of {NS} splits of {x.chunk} positions; " if NS > 1 else "every position; ")
      + f"tiles of {KT} positions in LDS")
    A("{")
    consts = [f"D = {D}", f"S = {a.s}"] + ([f"T = {a.t}"] if not T1 else []) + ([f"G = {G}"] if G > 1 else []) \
        + [f"R = {R}", f"KT = {KT}"] + ([f"CH = {x.chunk}", f"NS = {NS}"] if NS > 1 else [])
    body = [f"constexpr int {', '.join(consts)};",
            "__shared__ float q_tile[R][D] __attribute__((aligned(16)));              // the rows' queries, scaled",
            f"__shared__ {CTYPE[kd]} k_tile[KT][D + {16 // L.ITEMSIZE[kd]}] __attribute__((aligned(16)));"
            "    // rows 16 bytes apart in the banks",
            f"__shared__ {CTYPE[vd]} v_tile[KT][D] __attribute__((aligned(16)));",
            "__shared__ float p_tile[R][KT] __attribute__((aligned(16)));             // the tile's probabilities",
            "__shared__ float rescale[R], row_sum[R];" if NS == 1 else "__shared__ float rescale[R], row_sum[R], row_max[R];"]
    if NS > 1:
        body.append("__shared__ int last_flag;")
    body.append("const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;")
    per = x.nqt * NS
    body.append(f"const int kv_head = blockIdx.x / {per};" if per > 1 else "const int kv_head = blockIdx.x;")
    if tiled:
        body.append(f"const int tile = {x.nqt - 1} - blockIdx.x / {NS} % {x.nqt}, first = tile * {x.rows_q};"
                    "   // the longest tiles start first" if NS > 1 else
                    f"const int tile = {x.nqt - 1} - blockIdx.x % {x.nqt}, first = tile * {x.rows_q};"
                    "   // the longest tiles start first")
    body.append("const int p = @pos@;")
    last = "1" if T1 else (f"min(first + {x.rows_q}, T)" if tiled else "T")
    body.append(f"const int end = p + {last};    // the tile reads positions 0..pos+t of its last row t")
    if NS > 1:
        body += [f"const int split = blockIdx.x % NS, lo = split * CH, hi = min(lo + CH, end);",
                 "if (lo >= hi) return;        // a split past the position: nothing to read"]
    else:
        body.append("const int lo = 0, hi = end;")
    qv = h2f(qd, f"@q@[{row_index('r')} + i % D]")
    qval = f"{qv} * {a.scale * LOG2E!r}f"
    stage = ["// the rows' queries times the scale and log2(e): the softmax runs in base 2",
             f"for (int i = threadIdx.x; i < R * D; i += {NT}) {{",
             "  const int r = i / D;",
             (f"  q_tile[r][i % D] = {t_of('r')} < T ? {qval} : 0.0f;" if partial_t else f"  q_tile[r][i % D] = {qval};"),
             "}"]
    nk, nv = (-(-KT * units(dt)[1] // NT) for dt in (kd, vd))
    body.append(f"{units(kd)[2]} k_next[{nk}];")
    body.append(f"{units(vd)[2]} v_next[{nv}];")
    body += fetch("lo", "the first tile's K and V rows into registers (zeros past hi), in flight with the queries'")
    body += stage
    body += [f"float m[{RI}], l[{RI}], o[{OI}];",
             "#pragma unroll", f"for (int i = 0; i < {RI}; ++i) {{ m[i] = -VF_INF; l[i] = 0.0f; }}",
             "#pragma unroll", f"for (int i = 0; i < {OI}; ++i) o[i] = 0.0f;"]
    if shared_d:
        body.append(f"const int r0 = threadIdx.x / D, d = threadIdx.x % D;   // this thread's output column and first row")
    loop = stash() + ["__syncthreads();"]
    loop += fetch("start + KT", "the next tile's rows: in flight while this one is computed")
    # scores and online softmax
    valid = "start + j < hi" if T1 else f"start + j < hi && start + j <= p + {t_of('rr' if clamp_srows else 'r')}"
    dot_step = "16 / sizeof(" + CTYPE[kd] + ")"
    e_k = units(kd)[0]
    dot = (f"for (int d = 0; d < D; d += {e_k}) dot = vf_dot_qk(dot, &q_tile[{'rr' if clamp_srows else 'r'}][d], &k_tile[j][d]);"
           if x.vector else
           f"for (int d = 0; d < D; ++d) dot += q_tile[{'rr' if clamp_srows else 'r'}][d] * {h2f(kd, 'k_tile[j][d]')};")
    del dot_step
    rr = "rr" if clamp_srows else "r"
    score = [f"// scores: a row on {KL} lanes, each taking {'one key' if KPL == 1 else f'{KPL} keys'} of the tile; online softmax",
             "#pragma unroll", f"for (int i = 0; i < {RI}; ++i) {{", f"  const int r = {srow};"]
    if clamp_srows:
        score.append("  const int rr = min(r, R - 1);      // rows past R compute along (the lanes reduce together)")
    score += [f"  float s[{KPL}], top = -VF_INF;", "#pragma unroll", f"  for (int u = 0; u < {KPL}; ++u) {{",
              f"    const int j = {jexpr};", "    float dot = 0.0f;", "#pragma unroll 4", f"    {dot}",
              f"    s[u] = {valid} ? dot : -VF_INF;", "    top = fmaxf(top, s[u]);", "  }",
              f"  const float mx = fmaxf(m[i], vf_group_max(top, {KL}));",
              "  const float corr = mx == -VF_INF ? 1.0f : exp2f(m[i] - mx);   // -inf: no position yet",
              "  float sum = 0.0f;", "#pragma unroll", f"  for (int u = 0; u < {KPL}; ++u) {{",
              "    const float pr = s[u] == -VF_INF ? 0.0f : exp2f(s[u] - mx);", "    sum += pr;",
              f"    {'if (r < R) ' if clamp_srows else ''}p_tile[r][{jexpr}] = pr;", "  }",
              f"  l[i] = l[i] * corr + vf_group_sum(sum, {KL});", "  m[i] = mx;",
              f"  if ({kcol} == 0{' && r < R' if clamp_srows else ''}) rescale[r] = corr;", "}", "__syncthreads();"]
    loop += score
    vval = lambda j, col: h2f(vd, f"v_tile[{j}][{col}]")  # noqa: E731
    pv = ["// outputs: each thread's rows times the tile's values", "#pragma unroll",
          f"for (int i = 0; i < {OI}; ++i) o[i] *= rescale[{out_row}];",
          "for (int j = 0; j < KT; j += 4) {"]
    if shared_d:
        pv += [f"  const float v0 = {vval('j', 'd')}, v1 = {vval('j + 1', 'd')}, v2 = {vval('j + 2', 'd')}, "
               f"v3 = {vval('j + 3', 'd')};", "#pragma unroll", f"  for (int i = 0; i < {OI}; ++i) {{",
               f"    const vf_float4 pr = *(const vf_float4*)&p_tile[{out_row}][j];",
               "    o[i] += pr.x * v0 + pr.y * v1 + pr.z * v2 + pr.w * v3;", "  }", "}"]
    else:
        pv += ["#pragma unroll", f"  for (int i = 0; i < {OI}; ++i) {{",
               f"    const int r = {out_row}, d = {out_col};",
               "    const vf_float4 pr = *(const vf_float4*)&p_tile[r][j];",
               f"    o[i] += pr.x * {vval('j', 'd')} + pr.y * {vval('j + 1', 'd')} + pr.z * {vval('j + 2', 'd')} "
               f"+ pr.w * {vval('j + 3', 'd')};", "  }", "}"]
    loop += pv + ["__syncthreads();"]
    body += ["for (int start = lo; start < hi; start += KT) {"] + ["  " + ln if not ln.startswith("#") else ln
                                                                   for ln in loop] + ["}"]
    keep = "row_sum[r] = l[i];" if NS == 1 else "row_sum[r] = l[i]; row_max[r] = m[i];"
    body += ["// each row's sum" + (" and max" if NS > 1 else ""), "#pragma unroll", f"for (int i = 0; i < {RI}; ++i) {{",
             f"  const int r = {srow};", f"  if ({kcol} == 0{' && r < R' if clamp_srows else ''}) {{ {keep} }}",
             "}", "__syncthreads();"]
    direct = store_rows("o[i] / row_sum[r]")
    if NS == 1:
        body += direct
    else:
        grp = f"kv_head * {x.nqt} + tile" if tiled else "kv_head"
        o_part, m_part, l_part, arrived = (f"{a.out}_{n}" for n in ("o_part", "m_part", "l_part", "arrived"))
        ok = [c for c in (row_ok, f"{t_of('r')} < T" if partial_t else "") if c]
        cond = f"if ({' && '.join(ok)}) " if ok else ""
        dd = "" if shared_d else f", d = {out_col}"
        merge = ["// the splits' states merged in turn (online softmax: every load is issued ahead of its use)",
                 "float mx = -VF_INF, sum = 0.0f, acc = 0.0f;",
                 "#pragma unroll 8",
                 "for (int c = 0; c < splits; ++c) {",
                 "  const int at = (group * NS + c) * R + r;",
                 f"  const float mc = vf_load_arrived(&{m_part}[at]), lc = vf_load_arrived(&{l_part}[at]);",
                 f"  const float oc = vf_load_arrived(&{o_part}[(size_t)at * D + d]);",
                 "  const float mn = fmaxf(mx, mc);          // -inf: no position of the row so far",
                 "  const float f = mx == -VF_INF ? 0.0f : exp2f(mx - mn), w = mc == -VF_INF ? 0.0f : exp2f(mc - mn);",
                 "  sum = sum * f + w * lc;", "  acc = acc * f + w * oc;", "  mx = mn;", "}",
                 f"@out@[{row_index('r')} + d] = acc / sum;"]
        if ok:
            merge = [f"if ({' && '.join(ok)}) {{"] + ["  " + ln for ln in merge] + ["}"]
        combine = ["#pragma unroll", f"for (int i = 0; i < {OI}; ++i) {{", f"  const int r = {out_row}{dd};"]
        combine += ["  " + ln for ln in merge] + ["}"]
        body += ["const int splits = (end + CH - 1) / CH;     // the splits that hold positions",
                 "if (splits == 1) {"] + ["  " + ln if not ln.startswith("#") else ln for ln in direct] + [
                 "} else {",
                 "  // this split's partial rows to global memory; the last split of the group to arrive combines them",
                 f"  const int group = {grp}, slot = group * NS + split;"]
        part = ["#pragma unroll", f"for (int i = 0; i < {OI}; ++i) {{", f"  const int r = {out_row}{dd};",
                f"  {cond}{o_part}[((size_t)slot * R + r) * D + d] = o[i];", "}",
                f"for (int r = threadIdx.x; r < R; r += {NT}) {{ {m_part}[slot * R + r] = row_max[r]; "
                f"{l_part}[slot * R + r] = row_sum[r]; }}",
                f"if (vf_last_to_arrive(&{arrived}[group], splits, &last_flag)) {{"]
        part += ["  " + ln if not ln.startswith("#") else ln for ln in combine] + ["}"]
        body += ["  " + ln if not ln.startswith("#") else ln for ln in part] + ["}"]
    out += ["  " + ln if not ln.startswith("#") else ln for ln in body] + ["}"]
    text = "\n".join(_one_trip(out))
    outside = {a.q, a.k, a.v, a.out} | {e.name for e in L.walk_exprs(a.pos) if isinstance(e, L.Sym)}
    for name in set(ATT_LOCALS) & outside:                   # a local would hide it: rename the local
        text = re.sub(rf"\b{name}\b", name + "_", text)
    text = (text.replace("@q@", a.q).replace("@k@", a.k).replace("@v@", a.v).replace("@out@", a.out)
            .replace("@pos@", bare(a.pos)))
    return [(pad + line) if line and not line.startswith("#") else line for line in text.split("\n")]


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


def _signature(k: L.Kernel) -> str:
    """Parameters named after tensors.  Scalars (the decode position) arrive through device memory
    (``const int* name_``), so a captured graph replays with the current value."""
    args = []
    for p in k.params:
        if p.kind == "scalar":
            args.append(f"const int* __restrict__ {p.name}_")
        else:
            const = "const " if p.role == "in" else ""
            args.append(f"{const}{CTYPE[p.dtype]}* __restrict__ {p.name}")
    return ", ".join(args)


def _uses_waves(body):
    """Does the kernel text name ``vf_lane``/``vf_wave`` (outside the attention template)?"""
    for s in L.walk_stmts(body):
        if getattr(s, "map", "") in ("wave", "lane"):
            return True
        if any(isinstance(x, L.Hw) and x.name in ("lane", "wave") for e in L.stmt_exprs(s) for x in L.walk_exprs(e)):
            return True
    return False


def render_kernel(k: L.Kernel) -> str:
    """The source of a mapped kernel (``codegen.mapping.map_kernel``), without the prelude."""
    launch = k.launch
    lines = [f"// {k.name}: {k.family} kernel, {k.bytes} bytes moved, {k.flops} flops per call",
             f"// mapping: {launch.how}"]
    lines += [x for s in k.body if isinstance(s, L.Attention) for x in _att_globals(s)]
    lines += [f'extern "C" __global__ void __launch_bounds__({launch.bounds}) {k.name}({_signature(k)}) {{']
    arrays = [s for s in k.body if isinstance(s, L.Array)]
    lines += stmts(arrays)
    if _uses_waves(k.body):
        lines.append("  const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;")
    lines += ["  VF_GRID_LAUNCH_DEPENDENTS();",
              "  VF_GRID_WAIT();                // from here on, the previous kernel's outputs are ready"]
    lines += [f"  const int {p.name} = {p.name}_[0];" for p in k.params if p.kind == "scalar"]
    lines += stmts([s for s in k.body if not isinstance(s, L.Array)])
    return "\n".join(lines + ["}"]) + "\n"


def render_hip(k: L.Kernel, target="gfx906") -> HipKernel:
    """HIP source of one kernel for ``target`` (a name or a Target), with its launch geometry.
    ``k`` is mapped for ``target`` first unless it is mapped already (then only the prelude
    comes from ``target``)."""
    t = get_target(target) if isinstance(target, str) else target
    m = L.tidy_names(map_kernel(k, t), reserved=("vf_lane", "vf_wave"))
    quant = any(p.dtype in L.QUANT_DTYPES for p in k.params)
    att = any(isinstance(s, L.Attention) for s in m.body)
    head = f"// vegafuse kernel for {t.name}; prelude generated from the target table\n" + prelude(t, m.launch.act, quant, att)
    src = head + "\n" + render_kernel(m)
    lds = occupancy_lds(t, m.launch.lds, m.launch.block)
    return HipKernel(k.name, src, (m.launch.grid, 1, 1), (m.launch.block, 1, 1), lds, m, t, len(head) + 1)
