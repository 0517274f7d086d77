"""Render Loop IR kernels to HIP C++ for gfx906, and the same source for NVIDIA (NVRTC).

``render_hip(kernel, target) -> HipKernel`` (source, entry name, launch geometry).

The kernel body is the same text for every target: everything that differs
(wave width, half types, the 16-byte load + dot product, the wave reduction)
is written into a prelude from the target table (``codegen/targets.py``).

Families and their GPU mapping:
* contract (GEMV/matmul): the workgroup computes the prologue (RMSNorm included,
  its sum of squares as a block reduction) into LDS once; each wave then owns
  output rows, its lanes stride over k with 16-byte weight loads against the
  activation in LDS, and a wave reduction feeds the epilogue on lane 0.
* attention: one workgroup per (query head, query row); its waves split the
  context 0..pos+t, lanes hold head-dim elements, partial softmax states are
  combined with log-sum-exp in LDS.
* elementwise / scatter / reduce: every thread runs the Loop IR body; each
  parallel loop becomes a grid-stride loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import loopir as L
from .loopir import ITEMSIZE
from .prelude import act_dtype, prelude  # noqa: F401  (prelude is re-exported)
from .targets import Target, get_target, occupancy_lds

CTYPE = {"f32": "float", "f16": "vf_half", "i32": "int", "bool": "bool"}


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


def expr(e) -> str:
    """C expression for a Loop IR expression.  f16 values are converted to f32 by explicit Casts."""
    if isinstance(e, L.Const):
        return _const(e)
    if isinstance(e, L.Sym):
        return e.name
    if isinstance(e, L.Load):
        return f"{e.buf}[{expr(e.index)}]"
    if isinstance(e, L.Un):
        return L.spelling(e.op, e.x.dtype, "c").format(x=expr(e.x))
    if isinstance(e, L.Bin):
        return L.spelling(e.op, e.a.dtype, "c").format(a=expr(e.a), b=expr(e.b))
    if isinstance(e, L.Select):
        return f"({expr(e.cond)} ? {expr(e.a)} : {expr(e.b)})"
    if isinstance(e, L.Cast):
        src, dst = e.x.dtype, e.dtype
        if src == dst:
            return expr(e.x)
        if src == "f16":
            inner = f"vf_h2f({expr(e.x)})"
            return inner if dst == "f32" else f"({CTYPE[dst]})({inner})"
        if dst == "f16":
            return f"vf_f2h((float)({expr(e.x)}))"
        return f"({CTYPE[dst]})({expr(e.x)})"
    raise TypeError(e)


# ------------------------------------------------------------------------------------ statements
def _is_reduction_loop(s):
    """``for k: acc = op(acc, value)`` with op add/max: can run as a block-wide reduction."""
    return isinstance(s, L.Loop) and s.body and all(
        isinstance(a, L.Assign) and isinstance(a.value, L.Bin) and a.value.op in ("add", "max")
        and a.value.a == L.Sym(a.name, "f32") for a in s.body)


def _argmax_loop(s):
    """``for k: idx = v > best ? k : idx; best = max(best, v)``: the argmax that fusion emits."""
    if not (isinstance(s, L.Loop) and len(s.body) == 2 and all(isinstance(a, L.Assign) for a in s.body)):
        return None
    a, b = s.body
    if isinstance(a.value, L.Select) and isinstance(a.value.cond, L.Bin) and a.value.cond.op == "gt" \
            and isinstance(b.value, L.Bin) and b.value.op == "max" and b.value.dtype == "f32" \
            and a.value.a == L.Sym(s.var, "i32"):
        return a.name, b.name
    return None


def _has_reduction(body):
    return any(_is_reduction_loop(s) or _argmax_loop(s) for s in L.walk_stmts(body))


def stmts(body, ind, cooperative=False):
    """C for a statement list.  Per-thread semantics; parallel loops become grid-stride loops.
    ``cooperative``: reduction loops run block-wide (all threads of the workgroup take part)."""
    out, pad = [], "  " * ind
    for s in body:
        if isinstance(s, L.Loop):
            if cooperative and _argmax_loop(s):
                idx, best = _argmax_loop(s)
                out.append(f"{pad}for (int {s.var} = {expr(s.start)} + threadIdx.x; {s.var} < {expr(s.stop)}; "
                           f"{s.var} += VF_BLOCK) {{")
                out += stmts(s.body, ind + 1)
                out.append(f"{pad}}}")
                out.append(f"{pad}vf_block_argmax(&{best}, &{idx}, vf_red, vf_redi);")
                continue
            if cooperative and _is_reduction_loop(s):
                out.append(f"{pad}for (int {s.var} = {expr(s.start)} + threadIdx.x; {s.var} < {expr(s.stop)}; "
                           f"{s.var} += VF_BLOCK) {{")
                out += stmts(s.body, ind + 1)
                out.append(f"{pad}}}")
                for a in s.body:
                    fn = "vf_block_sum" if a.value.op == "add" else "vf_block_max"
                    out.append(f"{pad}{a.name} = {fn}({a.name}, vf_red);")
                continue
            if s.parallel and cooperative:          # rows with reductions -> workgroups, else -> threads
                unit, step = ("blockIdx.x", "gridDim.x") if _has_reduction(s.body) else ("threadIdx.x", "VF_BLOCK")
                out.append(f"{pad}for (int {s.var} = {expr(s.start)} + {unit}; {s.var} < {expr(s.stop)}; "
                           f"{s.var} += {step}) {{")
            elif s.parallel:
                out.append(f"{pad}for (int {s.var} = {expr(s.start)} + vf_tid; {s.var} < {expr(s.stop)}; "
                           f"{s.var} += vf_nthreads) {{")
            else:
                out.append(f"{pad}for (int {s.var} = {expr(s.start)}; {s.var} < {expr(s.stop)}; ++{s.var}) {{")
            out += stmts(s.body, ind + 1, cooperative)
            out.append(f"{pad}}}")
        elif isinstance(s, L.Declare):
            out.append(f"{pad}{CTYPE[s.dtype]} {s.name} = {expr(s.init)};")
        elif isinstance(s, L.Assign):
            out.append(f"{pad}{s.name} = {expr(s.value)};")
        elif isinstance(s, L.Array):
            out.append(f"{pad}{CTYPE[s.dtype]} {s.name}[{s.size}];")
        elif isinstance(s, L.Store):
            out.append(f"{pad}{s.buf}[{expr(s.index)}] = {expr(s.value)};")
    return out


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


def _scalars(k: L.Kernel, pad="  ") -> str:
    return "".join(f"{pad}const int {p.name} = {p.name}_[0];\n" for p in k.params if p.kind == "scalar")


def _header(k: L.Kernel, how: str) -> str:
    lines = [f"// {k.name}: {k.family} kernel, {k.bytes} bytes moved, {k.flops} flops per call",
             f"// {how}", "// fused DSL ops:"]
    lines += [f"//   {op}" for op in k.ops]
    return "\n".join(lines) + "\n"


def _static_extent(e):
    return e.value if isinstance(e, L.Const) else None


def render_generic(k: L.Kernel, t: Target):
    extents = [_static_extent(s.stop) or 1 for s in L.walk_stmts(k.body) if isinstance(s, L.Loop) and s.parallel]
    threads = max(extents, default=1)
    single = bool(k.meta.get("single_thread")) or _has_reduction(k.body)
    how = ("mapping: a workgroup per row; reductions run block-wide, the row's elements over its threads"
           if single else "mapping: every thread runs the body; parallel loops are grid-stride loops")
    if single:
        rows = [s for s in k.body if isinstance(s, L.Loop) and s.parallel and _has_reduction(s.body)]
        threads = (_static_extent(rows[0].stop) or 1) * t.block if rows else 1
    src = _header(k, how)
    src += f'extern "C" __global__ void __launch_bounds__(VF_BLOCK) {k.name}({_signature(k)}) {{\n'
    src += "  VF_GRID_LAUNCH_DEPENDENTS();\n  VF_GRID_WAIT();                // inputs from the previous kernel are ready\n"
    src += _scalars(k)
    if single:
        src += "  __shared__ float vf_red[VF_WAVES];\n  __shared__ int vf_redi[VF_WAVES];\n"
    src += "  const int vf_tid = blockIdx.x * VF_BLOCK + threadIdx.x;\n"
    src += "  const int vf_nthreads = gridDim.x * VF_BLOCK;\n"
    src += "\n".join(stmts(k.body, 1, cooperative=single)) + "\n}\n"
    grid = max(1, min(-(-threads // t.block), 65535))
    return src, grid


def _weight_dot(d, K, k_var, t):
    """The inner loop of one GEMV row: 16-byte weight loads when the row is contiguous."""
    contig = d["contig"]
    if contig is not None and contig[1] in ("f16", "f32"):
        per = 16 // ITEMSIZE[contig[1]]
        if K % per == 0:
            fn = "vf_dot8_h" if contig[1] == "f16" else "vf_dot4_f"
            row = f"(size_t)({expr(contig[2])}) * {K}"
            return ("vec", per, f"{d['acc']} = {fn}({d['acc']}, {contig[0]} + {row} + vf_k, vf_act + vf_k);")
    return ("scalar", 1, f"{d['acc']} += vf_from_act(vf_act[{k_var}]) * ({expr(d['b'])});")


def _prefetch(m, K, segs):
    """Send each wave's first weight row towards L2 before the prologue, so that the prologue's
    latency and the weights' overlap.  Only rows whose address needs no row variable."""
    rowvars = set(m["row_vars"])
    out, start, first = ["  {  // prefetch: this wave's first output row, while the prologue runs",
                         "    const int vf_r0 = blockIdx.x * VF_WAVES + vf_wave;"], 0, True
    for s in segs:
        dots = [d for d in s["dots"] if d["contig"] is not None
                and not any(isinstance(x, L.Sym) and x.name in rowvars for x in L.walk_exprs(d["contig"][2]))]
        if dots:
            per = 16 // ITEMSIZE[dots[0]["contig"][1]]
            out.append(f"    {'if' if first else 'else if'} (vf_r0 >= {start} && vf_r0 < {start + s['N']}) {{")
            out.append(f"      const int {s['n']} = vf_r0 - {start};")
            out.append(f"      for (int vf_k = vf_lane * {per}; vf_k < {K}; vf_k += VF_WAVE * {per}) {{")
            for d in dots:
                out.append(f"        vf_prefetch({d['contig'][0]} + (size_t)({expr(d['contig'][2])}) * {K} + vf_k);")
            out += ["      }", "    }"]
            first = False
        start += s["N"]
    return out + ["  }"] if not first else []


def ksplit(t: Target, k: L.Kernel) -> int:
    """Waves per GEMV output row: when the rows cannot fill the chip with waves, 2 or 4 waves share
    a row's k range and combine partial sums in LDS (more loads in flight, shorter chains)."""
    if k.family != "contract":
        return 1
    K, total = k.meta["K"], sum(s["N"] for s in k.meta["segments"])
    capacity = t.compute_units * t.blocks_per_cu * t.waves_per_block
    ks = 1
    # measured on an H200: splitting rows that fill half the chip (Qwen2.5-7B's O/down) lost 18%;
    # split only rows that leave most of it idle
    while ks < 4 and total * ks * 4 <= capacity and K % (ks * 2 * 8) == 0 and K // (ks * 2) >= 2 * 8 * t.wave:
        ks *= 2
    return ks


def _segments(segs, K, t, pad, mode):
    """Per-row code of every segment.  ``mode``: "whole" (the wave does all of k, then the
    epilogue), "partial" (this wave's slice of k into LDS), "final" (sum the slices, epilogue)."""
    lines, start = [], 0
    for j, s in enumerate(segs):
        lines.append(f"{pad}{'if' if j == 0 else '} else if'} (vf_r < {start + s['N']}) {{")
        p2 = pad + "  "
        lines.append(f"{p2}const int {s['n']} = vf_r - {start};")
        if mode == "final":
            for i, d in enumerate(s["dots"]):
                lines.append(f"{p2}float {d['acc']} = vf_part[vf_wave][{i}];")
                lines.append(f"{p2}for (int q = 1; q < VF_KSPLIT; ++q) {d['acc']} += vf_part[vf_wave + q][{i}];")
            lines.append(f"{p2}{s['out']}[{expr(s['index'])}] = {expr(s['value'])};   // epilogue")
            start += s["N"]
            continue
        for d in s["dots"]:
            lines.append(f"{p2}float {d['acc']} = 0.0f;")
        kinds = [_weight_dot(d, K, s["k"], t) for d in s["dots"]]
        lo, hi = ("vf_p * (K_ / VF_KSPLIT)", "(vf_p + 1) * (K_ / VF_KSPLIT)") if mode == "partial" else ("0", "K_")
        if all(kd[0] == "vec" for kd in kinds) and len({kd[1] for kd in kinds}) == 1:
            per = kinds[0][1]
            lines.append(f"{p2}VF_UNROLL_K")
            lines.append(f"{p2}for (int vf_k = {lo} + vf_lane * {per}; vf_k < {hi}; vf_k += VF_WAVE * {per}) {{")
            lines += [f"{p2}  {kd[2]}" for kd in kinds]
        else:
            lines.append(f"{p2}for (int {s['k']} = {lo} + vf_lane; {s['k']} < {hi}; {s['k']} += VF_WAVE) {{")
            lines += [f"{p2}  {_weight_dot(dict(d, contig=None), K, s['k'], t)[2]}" for d in s["dots"]]
        lines.append(f"{p2}}}")
        for d in s["dots"]:
            lines.append(f"{p2}{d['acc']} = vf_wave_sum({d['acc']});")
        if mode == "partial":
            lines += [f"{p2}if (vf_lane == 0) vf_part[vf_wave][{i}] = {d['acc']};" for i, d in enumerate(s["dots"])]
        else:
            lines.append(f"{p2}if (vf_lane == 0) {s['out']}[{expr(s['index'])}] = {expr(s['value'])};   // epilogue")
        start += s["N"]
    lines.append(f"{pad}}}")
    return lines


def render_contract(k: L.Kernel, t: Target):
    m = k.meta
    K, segs = m["K"], m["segments"]
    total = sum(s["N"] for s in segs)
    ndots = max(len(s["dots"]) for s in segs)
    lines = [f'extern "C" __global__ void __launch_bounds__(VF_BLOCK) {k.name}({_signature(k)}) {{',
             f"  constexpr int K_ = {K};",
             "  __shared__ vf_act_t vf_act[K_];              // the activation, read from LDS in the main loop",
             "  __shared__ float vf_red[VF_WAVES];",
             "  const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;"]
    lines += ["  VF_GRID_LAUNCH_DEPENDENTS();"]
    lines += _prefetch(m, K, segs)
    lines += ["  VF_GRID_WAIT();                // from here on, the previous kernel's outputs are ready"]
    lines += _scalars(k).rstrip("\n").split("\n") if _scalars(k) else []
    ind = 1
    for v, n in zip(m["row_vars"], m["rows"]):
        lines.append(f"{'  ' * ind}for (int {v} = 0; {v} < {n}; ++{v}) {{")
        ind += 1
    pad = "  " * ind
    lines += stmts(m["row_stmts"], ind, cooperative=True)
    lines += [f"{pad}// prologue: the activation row into LDS",
              f"{pad}#pragma unroll 8",
              f"{pad}for (int {m['kvar']} = threadIdx.x; {m['kvar']} < K_; {m['kvar']} += VF_BLOCK)",
              f"{pad}  vf_act[{m['kvar']}] = vf_to_act({expr(m['prologue'])});",
              f"{pad}__syncthreads();",
              "#if VF_KSPLIT == 1",
              f"{pad}// each wave owns output rows; lanes split k",
              f"{pad}for (int vf_r = blockIdx.x * VF_WAVES + vf_wave; vf_r < {total}; vf_r += gridDim.x * VF_WAVES) {{"]
    lines += _segments(segs, K, t, pad + "  ", "whole")
    lines += [f"{pad}}}",
              "#else",
              f"{pad}// VF_KSPLIT waves share each output row: each takes a slice of k, then LDS combines them",
              f"{pad}__shared__ float vf_part[VF_WAVES][{ndots}];",
              f"{pad}const int vf_p = vf_wave % VF_KSPLIT;",
              f"{pad}for (int vf_base = blockIdx.x * (VF_WAVES / VF_KSPLIT); vf_base < {total}; "
              f"vf_base += gridDim.x * (VF_WAVES / VF_KSPLIT)) {{",
              f"{pad}  const int vf_r = vf_base + vf_wave / VF_KSPLIT;     // uniform trip count: barriers are safe",
              f"{pad}  if (vf_r < {total}) {{"]
    lines += _segments(segs, K, t, pad + "    ", "partial")
    lines += [f"{pad}  }}", f"{pad}  __syncthreads();",
              f"{pad}  if (vf_r < {total} && vf_p == 0 && vf_lane == 0) {{"]
    lines += _segments(segs, K, t, pad + "    ", "final")
    lines += [f"{pad}  }}", f"{pad}  __syncthreads();", f"{pad}}}", "#endif", f"{pad}__syncthreads();"]
    while ind > 1:
        ind -= 1
        lines.append(f"{'  ' * ind}}}")
    lines.append("}")
    how = (f"mapping: {K}-element activation in LDS; VF_KSPLIT waves per output row "
           f"({total} rows), lanes stride k with 16-byte loads")
    grid = max(1, min(-(-total * ksplit(t, k) // (t.waves_per_block * t.rows_per_wave)),
                      t.compute_units * t.blocks_per_cu))
    return _header(k, how) + "\n".join(lines) + "\n", grid


def render_attention(k: L.Kernel, t: Target):
    m = k.meta
    D, S, T = m["D"], m["S"], m["T"]
    group = m["Hq"] // m["Hkv"]
    qd, kd, vd = m["dtypes"]
    ld = lambda buf, idx, dt: f"vf_h2f({buf}[{idx}])" if dt == "f16" else f"{buf}[{idx}]"  # noqa: E731
    src = f"""extern "C" __global__ void __launch_bounds__(VF_ATT_BLOCK) {k.name}({_signature(k)}) {{
  // one workgroup per (query head, query row); waves split the context, lanes hold head-dim elements
  VF_GRID_LAUNCH_DEPENDENTS();
  VF_GRID_WAIT();
{_scalars(k)}  constexpr int D = {D}, S = {S}, T = {T}, DPL = (D + VF_WAVE - 1) / VF_WAVE;
  __shared__ float vf_m[VF_ATT_WAVES], vf_l[VF_ATT_WAVES], vf_o[VF_ATT_WAVES][D];
  const int h = blockIdx.x / T, t = blockIdx.x % T, kvh = h / {group};
  const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;
  const int n = min({expr(m['pos'])} + t + 1, S);        // positions 0..pos+t only
  const size_t qrow = ((size_t)h * T + t) * D;
  float q[DPL], o[DPL];
#pragma unroll
  for (int j = 0; j < DPL; ++j) {{
    const int d = vf_lane + j * VF_WAVE;
    q[j] = d < D ? {ld(m['q'], 'qrow + d', qd)} * {float(m['scale'])!r}f : 0.0f;
    o[j] = 0.0f;
  }}
  float mx = -VF_INF, l = 0.0f;
  // two positions per step, their K and V rows loaded before either is used (loads in flight)
  for (int s = vf_wave; s < n; s += 2 * VF_ATT_WAVES) {{
    const int s2 = s + VF_ATT_WAVES;
    const bool two = s2 < n;
    const size_t row = ((size_t)kvh * S + s) * D, row2 = ((size_t)kvh * S + (two ? s2 : s)) * D;
    float k1[DPL], v1[DPL], k2[DPL], v2[DPL];
#pragma unroll
    for (int j = 0; j < DPL; ++j) {{
      const int d = vf_lane + j * VF_WAVE < D ? vf_lane + j * VF_WAVE : 0;
      k1[j] = {ld(m['k'], 'row + d', kd)}; v1[j] = {ld(m['v'], 'row + d', vd)};
      k2[j] = {ld(m['k'], 'row2 + d', kd)}; v2[j] = {ld(m['v'], 'row2 + d', vd)};
    }}
    float part = 0.0f, part2 = 0.0f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) {{
      if (vf_lane + j * VF_WAVE < D) {{ part += q[j] * k1[j]; part2 += q[j] * k2[j]; }}
    }}
    const float sc = vf_wave_sum(part);
    const float sc2 = two ? vf_wave_sum(part2) : -VF_INF;
    const float mn = fmaxf(fmaxf(mx, sc), sc2), corr = expf(mx - mn), p = expf(sc - mn);
    const float p2 = two ? expf(sc2 - mn) : 0.0f;
    l = l * corr + p + p2;
#pragma unroll
    for (int j = 0; j < DPL; ++j) o[j] = o[j] * corr + p * v1[j] + p2 * v2[j];
    mx = mn;
  }}
  // log-sum-exp combine of the waves' partial results
  if (vf_lane == 0) {{ vf_m[vf_wave] = mx; vf_l[vf_wave] = l; }}
#pragma unroll
  for (int j = 0; j < DPL; ++j) {{
    const int d = vf_lane + j * VF_WAVE;
    if (d < D) vf_o[vf_wave][d] = o[j];
  }}
  __syncthreads();
  float M = -VF_INF;
  for (int w = 0; w < VF_ATT_WAVES; ++w) M = fmaxf(M, vf_m[w]);
  float L = 0.0f;
  for (int w = 0; w < VF_ATT_WAVES; ++w) L += vf_m[w] == -VF_INF ? 0.0f : vf_l[w] * expf(vf_m[w] - M);
  for (int d = threadIdx.x; d < D; d += VF_ATT_BLOCK) {{
    float acc = 0.0f;
    for (int w = 0; w < VF_ATT_WAVES; ++w) acc += vf_m[w] == -VF_INF ? 0.0f : vf_o[w][d] * expf(vf_m[w] - M);
    {m['out']}[qrow + d] = acc / L;
  }}
}}
"""
    how = "mapping: workgroup per (head, row); context split over waves; log-sum-exp combine"
    return _header(k, how) + src, m["Hq"] * T


RENDERERS = {"contract": render_contract, "attention": render_attention}


def render_hip(k: L.Kernel, target="gfx906") -> HipKernel:
    """HIP source of one kernel for ``target`` (a name or a Target), with its launch geometry."""
    t = get_target(target) if isinstance(target, str) else target
    body, grid = RENDERERS.get(k.family, render_generic)(k, t)
    block = t.attention_block if k.family == "attention" else t.block
    act = act_dtype(t, k.meta["K"] if k.family == "contract" else 0)
    head = (f"// vegafuse kernel for {t.name}; prelude generated from the target table\n" + prelude(t, act)
            + f"#define VF_KSPLIT {ksplit(t, k)}\n")
    src = head + "\n" + body
    static = _static_lds(k, t)
    return HipKernel(k.name, src, (grid, 1, 1), (block, 1, 1), occupancy_lds(t, static, block), k, t, len(head) + 1)


def _static_lds(k, t):
    if k.family == "contract":
        act = 2 if act_dtype(t, k.meta["K"]) == "f16" else 4
        return k.meta["K"] * act + 4 * t.waves_per_block
    if k.family == "attention":
        return 4 * (t.attention_block // t.wave) * (2 + k.meta["D"])
    return 0
