"""The tiled matmul of a GPU (``mma_tiles``): a contraction of many rows (prefill) as tiles of
``BM`` rows x ``BN`` output columns per workgroup, k in chunks of ``KC`` staged in LDS as f16, and
each wave's 16 x 16 fragments multiplied by the prelude's ``vf_mma_tile`` (``mma.sync`` on NVIDIA,
``v_dot2_f32_f16`` from LDS on gfx906), so that the kernel text is one for every target::

    tile (blockIdx.x): rows m0 .. m0 + BM, columns n0 .. n0 + BN of one segment (Q, K or V)
    for each row of the tile (a wave each): the prologue's reductions (RMSNorm's sum of squares),
        the values the activation reads kept in LDS (``rsqrt_sum_sq_rows[r]``)
    for k0 in chunks of KC:
        A[BM][KC] = f16(prologue element at (row, k0 + k))     (the activation, never in memory)
        B_s[BN][KC] = f16(weight s at (column, k0 + k))       (16-byte loads of f16 / f32 rows;
                                                              quantized blocks dequantized)
        acc_s[fragment] += A[16 rows] x B_s[16 columns]^T     (each sibling: gate/up, a RoPE pair)
    epilogue per accumulator element i: row = tile row + vf_frag_row(i), column = ... + vf_frag_col(i)

The epilogue is the Loop IR the scheduler built (``fusion.schedule.row_tiles``): bias, residual,
SiLU * mul of siblings, RoPE pairs and KV-cache writes, each element seeing every sibling of its
(row, column).  Rows past T read row T - 1 and store nothing; columns past N likewise.  Rows of
16-byte LDS reads are padded to ``KC + PAD`` halves (80 bytes) so that neither the fragment loads
of ``mma.sync`` nor gfx906's 16-byte reads of 8 consecutive rows meet in a bank.

``VEGAFUSE_MMA=0`` keeps the GEMV-style matmul (``codegen.mapping._matmul_rows``): the A/B switch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from . import loopir as L
from .loopir import ITEMSIZE
from .targets import Target
from .env import switch

CTYPE = {"f32": "float", "i32": "int"}

BM, BN = 64, 64            # a workgroup's output tile: 16 fragments of 16 x 16 (4 per wave at wave 64, 2 at 32)
KC = 32                    # k per LDS chunk: two k16 steps of mma.sync, four 16-byte reads of v_dot2
PAD = 8                    # halves after each LDS row: 80-byte rows, free of bank conflicts (see banks)
MMA_ROWS = 16              # a matmul of fewer rows keeps the GEMV-style matmul (a tile would be mostly padding)
MAX_GRID = 65535


@dataclass(frozen=True)
class MmaSegment:
    """One segment's output columns ``[0, n)`` (Q, K or V): the weight element of each sibling
    accumulator at (``col``, ``k``), and the epilogue statements per (``row``, ``col``), which read
    accumulator ``acc`` as ``Sym(acc + "[f][i]")``."""
    comments: tuple
    n: int
    accs: tuple                   # accumulator names
    weights: tuple                # per accumulator: the weight element (an Expr of col and k)
    epilogue: tuple


@dataclass(frozen=True)
class MatmulTiles:
    """A tiled matmul (see the module docstring): T rows over K; ``decls`` computed first (a
    clamped position); ``prologue`` the per-row statements (of ``row``), whose ``row_values`` the
    activation element ``act`` (of ``row``, ``k`` and ``Load(name + "_rows", r)``) reads."""
    t: int
    k: int
    decls: tuple
    comments: tuple
    prologue: tuple
    row_values: tuple             # (name, dtype)
    act: L.Expr
    segments: tuple
    siblings: int                 # the most accumulators of a segment: B tiles in LDS
    threads: int = 256            # of the workgroup (VF_BLOCK): each loads BM * KC / threads activation values
    buffers: int = 2              # LDS buffers of the tiles: 2, the products of a chunk beside the next one's stores

    @property
    def row_tiles(self):
        return -(-self.t // BM)

    def col_tiles(self, seg):
        return -(-seg.n // BN)


def enabled() -> bool:
    """``VEGAFUSE_MMA=0`` turns the tiled matmul off (A/B)."""
    return switch("VEGAFUSE_MMA", True)


def prefetch() -> bool:
    """With one LDS buffer (``VEGAFUSE_MMA_DOUBLE=0``), each chunk's tiles are loaded into registers
    at the end of the previous chunk's products (in flight across the barrier);
    ``VEGAFUSE_MMA_PREFETCH=0`` loads each chunk right before storing it (A/B)."""
    return switch("VEGAFUSE_MMA_PREFETCH", True)


ROW, COL, K, R = (L.Sym(n, "i32") for n in ("row", "col", "k", "r"))
# the names the template declares itself: no local takes them (``_tidy``), and a kernel buffer that
# has one is renamed before mapping (``codegen.mapping.clear_of_templates``)
TEMPLATE_NAMES = ("row", "col", "k", "r", "c", "e", "f", "i", "j", "v", "a_next", "b_next", "load_tiles", "store_tiles",
                  "buf", "k0", "m0", "n0", "frag", "tile_n", "mma_a", "mma_b")


def _factor(v, act):
    """The weight factor of a matmul accumulator ``act[row * K + k] * w`` (either order), else None."""
    if not (isinstance(v, L.Bin) and v.op == "mul"):
        return None
    for a, w in ((v.a, v.b), (v.b, v.a)):
        if isinstance(a, L.Load) and a.buf == act and not any(isinstance(x, L.Load) and x.buf == act
                                                                for x in L.walk_exprs(w)):
            return w
    return None


def parse(body):
    """The matmul form of ``fusion.schedule.row_tiles`` as a ``MatmulTiles``, or None when the body
    is not exactly that form (then the GEMV-style matmul runs it)."""
    from .mapping import _inlined, matmul_rows
    tile, stmts = None, []
    for s in body:
        if isinstance(s, L.Loop) and not s.parallel and any(isinstance(x, L.Loop) and x.parallel for x in s.body):
            if tile is not None:
                return None
            tile, stmts = s, stmts + list(s.body)
        else:
            stmts.append(s)
    decls, comments, segs, fill, act, pro_comments = [], [], [], None, None, ()
    for s in stmts:
        if isinstance(s, L.Comment):
            comments.append(s)
        elif isinstance(s, L.Declare):                   # a clamped position: computed first
            decls.append(s)
        elif isinstance(s, L.Array) and act is None:
            act = s
        elif isinstance(s, L.Loop) and not s.parallel and fill is None:
            fill, pro_comments, comments = s, tuple(comments), []
        elif isinstance(s, L.Loop) and s.parallel and matmul_rows(s) is not None:
            segs.append((tuple(comments), s))
            comments = []
        else:
            return None
    if fill is None or act is None or not segs or comments or not isinstance(fill.stop, L.Const):
        return None
    if tile is not None and any(x == L.Sym(tile.var, "i32") for d in decls for x in L.walk_exprs(d.init)):
        return None
    TR, r = fill.stop.value, fill.var
    Kdim = act.size // TR
    ntiles = tile.stop.value if tile is not None else 1
    subst = {r: ROW} | ({tile.var: L.c(0)} if tile is not None else {})
    *row_stmts, kloop = fill.body
    if not (isinstance(kloop, L.Loop) and kloop.body and isinstance(kloop.body[-1], L.Store)
            and all(isinstance(d, L.Declare) for d in kloop.body[:-1])
            and all(isinstance(d, (L.Declare, L.Reduce)) for d in row_stmts)):
        return None
    if any(isinstance(d, L.Reduce) and any(a.op not in ("add", "max") or a.dtype != "f32" for a in d.accs)
           for d in row_stmts):
        return None
    value = L.substitute_expr(_inlined(kloop.body).value, subst | {kloop.var: K})
    T, out = None, []
    for cmts, s in segs:
        red, *stores = L.substitute(matmul_rows(s).body, subst | {s.var: COL})
        if not (isinstance(red, L.Reduce) and red.start == L.c(0) and red.stop == L.c(Kdim)):
            return None
        if len(stores) == 1 and isinstance(stores[0], L.If) and not stores[0].orelse \
                and isinstance(stores[0].cond, L.Bin) and stores[0].cond.op == "lt" and stores[0].cond.a == ROW \
                and isinstance(stores[0].cond.b, L.Const):
            T, stores = stores[0].cond.b.value, list(stores[0].then)
        weights = tuple(_factor(a.value, act.name) for a in red.accs)
        if any(w is None or any(x == ROW for x in L.walk_exprs(w)) for w in weights):
            return None
        weights = tuple(L.substitute_expr(w, {red.var: K}) for w in weights)
        out.append(MmaSegment(cmts, s.stop.value, tuple(a.name for a in red.accs), weights, tuple(stores)))
    T = T or TR * ntiles
    unclamp = lambda e: L.rewrite_expr(e, lambda x: ROW if x == L.Bin("min", ROW, L.c(T - 1)) else None)  # noqa: E731
    row_stmts = L.rewrite(L.substitute(tuple(row_stmts), subst), unclamp)
    bound = {n: d for n, d in _bound(row_stmts).items()}
    value = unclamp(value)
    used = [n for n in bound if any(isinstance(x, L.Sym) and x.name == n for x in L.walk_exprs(value))]
    value = L.rewrite_expr(value, lambda x: L.Load(x.name + "_rows", R, x.dtype)
                           if isinstance(x, L.Sym) and x.name in used else None)
    out = [replace(g, epilogue=L.rewrite(g.epilogue, unclamp)) for g in out]
    spec = MatmulTiles(T, Kdim, tuple(decls), pro_comments, row_stmts, tuple((n, bound[n]) for n in used), value,
                       tuple(out), max(len(g.accs) for g in out))
    return _tidy(spec)


def _bound(stmts):
    """{name: dtype} of the locals a prologue's row statements bind."""
    out = {}
    for s in stmts:
        if isinstance(s, L.Declare):
            out[s.name] = s.dtype
        elif isinstance(s, L.Reduce):
            out.update({a.name: a.dtype for a in s.accs})
    return out


def _tidy(m: MatmulTiles) -> MatmulTiles:
    """Locals named after what they hold, without the lowering's counters (``acc_w_gate_47`` ->
    ``acc_w_gate``), clear of the template's own names."""
    bodies = m.decls + m.prologue + tuple(x for g in m.segments for x in g.epilogue)
    names = L.local_names(bodies) + [a for g in m.segments for a in g.accs]
    taken, new = set(TEMPLATE_NAMES) | {n + s for n in _buffers(m, bodies) for s in ("", "8")}, {}
    for n in dict.fromkeys(names):
        base = re.sub(r"_\d+$", "", n) or n
        cand, i = base, 1
        while cand in taken or cand + "_rows" in taken:
            cand, i = f"{base}{i}", i + 1
        taken.add(cand)
        new[n] = cand
    ex = lambda e: L.rewrite_expr(e, lambda x: L.Sym(new[x.name], x.dtype) if isinstance(x, L.Sym) and x.name in new  # noqa: E731
                                  else L.Load(new[x.buf[:-5]] + "_rows", x.index, x.dtype)
                                  if isinstance(x, L.Load) and x.buf.endswith("_rows") and x.buf[:-5] in new else None)
    name = lambda n: new.get(n, n)  # noqa: E731
    segs = tuple(replace(g, accs=tuple(new[a] for a in g.accs), weights=tuple(ex(w) for w in g.weights),
                         epilogue=L.rewrite(g.epilogue, ex, name))
                 for g in m.segments)
    return replace(m, decls=L.rewrite(m.decls, ex, name), prologue=L.rewrite(m.prologue, ex, name),
                   row_values=tuple((new[n], d) for n, d in m.row_values), act=ex(m.act), segments=segs)


def _buffers(m: MatmulTiles, bodies) -> set:
    """The kernel's buffers that ``m`` reads or writes: no local takes their names, nor those of
    their 8-element register copies (``{buf}8``, see ``_row_reduce``)."""
    exprs = [m.act, *(w for g in m.segments for w in g.weights)]
    exprs += [e for s in L.walk_stmts(bodies) for e in L.stmt_exprs(s)]
    out = {s.buf for s in L.walk_stmts(bodies) if isinstance(s, L.Store)}
    for x in (x for e in exprs for x in L.walk_exprs(e)):
        if isinstance(x, L.Load):
            out.add(x.buf)
        elif isinstance(x, L.QDot):
            out |= {x.w, x.act}
    return out


def lds_arrays(m: MatmulTiles):
    """The LDS arrays of the template: the A tile, the B tiles of every sibling, the row values."""
    stride = KC + PAD
    return (L.Array("mma_a", "f16", m.buffers * BM * stride, "lds"),
            L.Array("mma_b", "f16", m.buffers * m.siblings * BN * stride, "lds")) \
        + tuple(L.Array(n + "_rows", d, BM, "lds") for n, d in m.row_values)


def mma_tiles(body, t: Target, lds_limit: int):
    """``(body, launch)`` of the tiled matmul for the matmul-form contraction ``body`` on ``t``, or
    None where it does not apply: switched off (``VEGAFUSE_MMA=0``), a target without the fragment
    helper (AMD without ``v_dot2``), fewer than ``MMA_ROWS`` rows or ``KC`` columns of k, a form it
    does not read (see ``parse``: K = 1 has no fill loop), weights that are not f16 values
    (``_not_f16_values``: the tile holds f16, and such weights keep their precision in the row-group
    matmul), LDS beyond ``lds_limit`` or more workgroups than a grid takes."""
    if not enabled() or (t.vendor == "amd" and not t.dot2):
        return None
    m = parse(body)
    if m is None or m.t < MMA_ROWS or m.k < KC or (BN * KC // 8) % t.block or _not_f16_values(m):
        return None
    m = replace(m, threads=t.block, buffers=2 if switch("VEGAFUSE_MMA_DOUBLE", True) else 1)
    arrays = lds_arrays(m)
    lds = sum(a.size * ITEMSIZE[a.dtype] for a in arrays)
    grid = m.row_tiles * sum(m.col_tiles(g) for g in m.segments)
    if lds > lds_limit - 1024 or grid > MAX_GRID:
        return None
    cols = sum(g.n for g in m.segments)
    how = (f"a tiled matmul: {BM} rows x {BN} output columns per workgroup ({m.row_tiles} x "
           f"{grid // m.row_tiles} tiles of {m.t} rows x {cols} columns), k in chunks of {KC} staged in LDS as "
           f"f16 ({m.siblings} weight tile{'s' if m.siblings > 1 else ''}), 16 x 16 fragments per wave through vf_mma_tile")
    return (m,), L.Launch(grid, t.block, "VF_BLOCK", how, lds, "f16" if t.dot2 else "f32")


def _not_f16_values(m: MatmulTiles) -> bool:
    """Does a weight of ``m`` hold values an f16 tile does not: anything but a quantized weight
    (``QLoad``) or an f16 value widened to f32 (f32 weights, f32 arithmetic on them, i32 weights cast
    to f32, whose magnitudes may pass f16's 65504)?"""
    def f16(w):
        while isinstance(w, L.Cast) and w.dtype == "f32":
            w = w.x
        return isinstance(w, L.QLoad) or w.dtype == "f16"
    return not all(f16(w) for g in m.segments for w in g.weights)


# ------------------------------------------------------------------------------ render
def _stage8(w, k):
    """``(buffer, row * S, fmt)`` when the weight element ``w`` is ``buf[row * S + k]`` of f16 or f32 with
    rows of S elements starting 16 bytes apart (copied 8 elements per 16-byte load, which needs the
    alignment: fmt "") or quantized with S a multiple of 32 (8 elements dequantized from an 8-byte
    load: fmt its format), else None."""
    w = w.x if isinstance(w, L.Cast) and w.dtype == "f32" else w
    quant = isinstance(w, L.QLoad)
    if not (type(w) is L.Load and w.dtype in ("f16", "f32") or quant):
        return None
    i = w.index
    ok = (isinstance(i, L.Bin) and i.op == "add" and i.b == K and isinstance(i.a, L.Bin) and i.a.op == "mul"
          and isinstance(i.a.b, L.Const) and K not in set(L.walk_exprs(i.a)))
    if quant and not (ok and i.a.b.value % 32 == 0):
        return None
    if quant:
        return w.buf, i.a, w.fmt, w.count
    return (w.buf, i.a, "", 0) if ok and i.a.b.value * ITEMSIZE[w.dtype] % 16 == 0 else None


def _act_vectors(act, k=K):
    """The loads of the activation element ``act`` that move 8 consecutive ``k`` at once: every load
    whose index reads k is ``buf[base + k]`` of f32 or f16 with ``base`` a k-free multiple of 8
    (so that its 8 elements are whole 16-byte loads); None when one is not."""
    out = []
    for x in L.walk_exprs(act):
        if not (isinstance(x, L.Load) and k in set(L.walk_exprs(x.index))):
            continue
        i = x.index
        base = L.c(0) if i == k else i.a if isinstance(i, L.Bin) and i.op == "add" and i.b == k else None
        aligned = base == L.c(0) or (isinstance(base, L.Bin) and base.op == "mul" and isinstance(base.b, L.Const)
                                      and base.b.value % 8 == 0)
        if base is None or not aligned or k in set(L.walk_exprs(base)) or x.dtype not in ("f32", "f16") \
                or type(x) is not L.Load:
            return None
        if x not in out:
            out.append(x)
    return out


def banks(m: MatmulTiles) -> str:
    """Whether the template's LDS reads are free of bank conflicts: rows of ``KC + PAD`` halves, whose
    byte stride is an odd multiple of 16 (a 16-byte read of 8 consecutive rows, or mma.sync's 4-byte
    reads of 8 rows at 4 offsets, cover 32 banks of 4 bytes once) "ok", else "check"."""
    stride = 2 * (KC + PAD)
    return "ok" if stride % 16 == 0 and (stride // 16) % 2 == 1 else "check"


def render(m: MatmulTiles, stmts, bare, pad="  "):
    """The kernel text of a tiled matmul (``stmts``/``bare``: the HIP renderer's statement and
    expression functions)."""
    stride, mt = KC + PAD, m.row_tiles
    frags = "16 / VF_WAVES"
    out = [f"{pad}__shared__ {'vf_half' if a.dtype == 'f16' else CTYPE[a.dtype]} {a.name}[{a.size}] __attribute__((aligned(16)));"
           + ("   // rows of 16-byte reads" if a.dtype == "f16" else "") for a in lds_arrays(m)]
    out += stmts(m.decls, pad)
    out.append(f"{pad}// a tile of {BM} rows x {BN} columns per workgroup (rows fastest: the tiles of a weight tile run together)")
    if mt > 1:
        out.append(f"{pad}const int m0 = blockIdx.x % {mt} * {BM}, tile_n = blockIdx.x / {mt};")
    else:
        out.append(f"{pad}const int m0 = 0, tile_n = blockIdx.x;")
    clamp = f"min(m0 + r, {m.t - 1})" if m.t % BM else "m0 + r"
    out += stmts(m.comments, pad)
    if m.prologue:
        out.append(f"{pad}for (int r = vf_wave; r < {BM}; r += VF_WAVES) {{   // the prologue's row values, a wave per row")
        out.append(f"{pad}  const int row = {clamp};")
        for st in m.prologue:
            out += _row_reduce(st, m.k, bare, pad + "  ") if isinstance(st, L.Reduce) else stmts((st,), pad + "  ")
        if m.row_values:
            out.append(f"{pad}  if (vf_lane == 0) {{")
            out += [f"{pad}    {n}_rows[r] = {n};" for n, _ in m.row_values]
            out.append(f"{pad}  }}")
        out.append(f"{pad}}}")
        out.append(f"{pad}__syncthreads();")
    chain, first = [], 0
    for g in m.segments:
        chain.append((first, first + m.col_tiles(g), g))
        first += m.col_tiles(g)
    for j, (lo, hi, g) in enumerate(chain):
        head = "if" if j == 0 else "} else if"
        cond = f"tile_n < {hi}"
        if len(chain) == 1:
            body_pad = pad
        else:
            out.append(f"{pad}{head} ({cond}) {{" if j < len(chain) - 1 else f"{pad}}} else {{")
            body_pad = pad + "  "
        out += _segment(m, g, lo, stmts, bare, body_pad, stride, frags)
    if len(chain) > 1:
        out.append(f"{pad}}}")
    return out


def _row_reduce(r: L.Reduce, K: int, bare, pad):
    """A prologue reduction over k by the lanes of a wave: 8 consecutive k per lane step from 16-byte
    loads where its loads allow (see ``_act_vectors``), else one; then the wave's sum or max."""
    k = L.Sym(r.var, "i32")
    each = [_act_vectors(a.value, k) for a in r.accs] if K % 8 == 0 else [None]
    vec = None if any(v is None for v in each) else list(dict.fromkeys(x for v in each for x in v))
    out = [f"{pad}float {a.name} = {'0.0f' if a.op == 'add' else '-VF_INF'};" for a in r.accs]
    fold = {"add": "{a} += {v};", "max": "{a} = vf_max({a}, {v});"}
    if vec is None:
        out.append(f"{pad}for (int {r.var} = vf_lane; {r.var} < {K}; {r.var} += VF_WAVE) {{")
        out += [f"{pad}  " + fold[a.op].format(a=a.name, v=bare(a.value)) for a in r.accs]
    else:
        names = {x: f"{x.buf}8" for x in vec}
        out += [f"{pad}for (int {r.var} = vf_lane * 8; {r.var} < {K}; {r.var} += VF_WAVE * 8) {{   // 8 elements a lane step",
                f"{pad}  float {', '.join(n + '[8]' for n in names.values())};"]
        out += [f"{pad}  vf_load8f({n}, {x.buf} + {bare(x.index)});" for x, n in names.items()]
        out.append(f"{pad}  for (int i = 0; i < 8; ++i) {{")
        for a in r.accs:
            one = L.rewrite_expr(a.value, lambda x: L.Sym(names[x] + "[i]", "f32") if x in names else None)
            one = L.substitute_expr(one, {r.var: L.add(k, L.Sym("i", "i32"))})
            out.append(f"{pad}    " + fold[a.op].format(a=a.name, v=bare(one)))
        out.append(f"{pad}  }}")
    out.append(f"{pad}}}")
    return out + [f"{pad}{a.name} = vf_wave_{'sum' if a.op == 'add' else 'max'}({a.name});" for a in r.accs]


def _segment(m, g, lo, stmts, bare, pad, stride, frags):
    """One segment's main loop and epilogue.  Each chunk's tiles are loaded into registers after the
    previous chunk's products (``prefetch``), then stored into LDS."""
    out = stmts(g.comments, pad)
    out.append(f"{pad}const int n0 = {'tile_n' if not lo else f'(tile_n - {lo})'} * {BN};")
    out.append(f"{pad}float {', '.join(f'{a}[{frags}][VF_FRAG] = {{}}' for a in g.accs)};")
    ragged_k = m.k % KC != 0
    staged = [_stage8(w, K) for w in g.weights]
    vector = not ragged_k and all(staged)
    avec = None if ragged_k else _act_vectors(m.act)
    na = BM * KC // (8 if avec is not None else 1) // m.threads
    nb = BN * KC // (8 if vector else 1) // m.threads
    per = KC // 8 if vector else KC                      # a column's loads in a chunk
    S = len(g.accs)
    clamp = f"min(m0 + r, {m.t - 1})" if m.t % BM else "m0 + r"
    ccl = f"min(n0 + c, {g.n - 1})" if g.n % BN else "n0 + c"
    act = bare(m.act)
    p, q = pad + "  ", pad + "    "

    def each(n, first, lines, at):                       # the n elements of a thread: a loop over j, or one
        if n == 1:
            return [f"{at}{{", f"{at}  const int e = threadIdx.x{first};"] + [f"{at}  {x.replace('[j]', '[0]')}" for x in lines] + [f"{at}}}"]
        return ([f"{at}#pragma unroll", f"{at}for (int j = 0; j < {n}; ++j) {{", f"{at}  const int e = threadIdx.x + j * VF_BLOCK{first};"]
                + [f"{at}  {x}" for x in lines] + [f"{at}}}"])
    out += [f"{pad}{'vf_h8' if avec is not None else 'vf_half'} a_next[{na}];",
            f"{pad}{'vf_h8' if vector else 'vf_half'} b_next[{S}][{nb}];",
            f"{pad}// chunk k0 into registers: the activation tile ({BM} rows x {KC} of the prologue's values, f16) "
            f"and the weight tiles ({', '.join(g.accs)}: {BN} columns x {KC}, {'8 elements' if vector else 'an element'} a load)",
            f"{pad}const auto load_tiles = [&](int k0) {{"]
    reads_row = ROW in set(L.walk_exprs(m.act))
    if avec is not None:                                 # 8 consecutive k per thread, 16-byte loads
        names = {x: f"{x.buf}8" for x in avec}
        one = L.rewrite_expr(m.act, lambda x: L.Sym(names[x] + "[i]", "f32") if x in names else None)
        one = L.substitute_expr(one, {"k": L.add(K, L.Sym("i", "i32"))})
        lines = [f"float {', '.join(n + '[8]' for n in names.values())}, v[8];"]
        lines += [f"vf_load8f({n}, {x.buf} + {bare(x.index)});" for x, n in names.items()]
        lines += [f"for (int i = 0; i < 8; ++i) v[i] = {bare(one)};", "a_next[j] = vf_pack8(v);"]
        out += each(na, f", r = e / {KC // 8}, k = k0 + e % {KC // 8} * 8" + (f", row = {clamp}" if reads_row else ""),
                    lines, p)
    else:
        out += each(na, f", r = e / {KC}, k = k0 + e % {KC}" + (f", row = {clamp}" if reads_row else ""),
                    [f"a_next[j] = vf_f2h({f'k < {m.k} ? {act} : 0.0f' if ragged_k else act});"], p)
    loads = []
    for s_, w in enumerate(g.weights):
        if vector:
            buf, rowe, fmt, count = staged[s_]
            loads.append(f"b_next[{s_}][j] = vf_dequant8_{fmt}({buf}, {bare(rowe)} + k, {count // 32});" if fmt
                         else f"b_next[{s_}][j] = vf_load8({buf} + {bare(rowe)} + k);")
        else:
            v = bare(w)
            loads.append(f"b_next[{s_}][j] = vf_f2h({f'k < {m.k} ? {v} : 0.0f' if ragged_k else v});")
    out += each(nb, f", c = e / {per}, k = k0 + e % {per}{' * 8' if vector else ''}, col = {ccl}", loads, p)
    out.append(f"{pad}}};")
    asz, bsz = BM * stride, S * BN * stride              # one buffer's halves
    two = m.buffers == 2
    ofs = lambda size: f"buf * {size} + " if two else ""  # noqa: E731
    at = lambda base, size: f"{base} + {ofs(size)}"       # noqa: E731
    st = [f"vf_store8({at('mma_a', asz)}e / {KC // 8} * {stride} + e % {KC // 8} * 8, a_next[j]);" if avec is not None
          else f"mma_a[{ofs(asz)}e / {KC} * {stride} + e % {KC}] = a_next[j];"]
    stores = []
    for s_ in range(S):
        off = f"{s_ * BN * stride} + " if s_ else ""
        stores.append(f"vf_store8({at('mma_b', bsz)}{off}e / {per} * {stride} + e % {per} * 8, b_next[{s_}][j]);" if vector
                      else f"mma_b[{ofs(bsz)}{off}e / {per} * {stride} + e % {per}] = b_next[{s_}][j];")
    out.append(f"{pad}// the registers into LDS" + (" buffer buf" if two else ""))
    out.append(f"{pad}const auto store_tiles = [&]({'int buf' if two else ''}) {{")
    out += each(na, "", st, p) + each(nb, "", stores, p)
    out.append(f"{pad}}};")
    nxt = f"k0 + {KC}" if ragged_k else f"k0 + {KC} < {m.k} ? k0 + {KC} : 0"
    again = "" if ragged_k else " (after the last: chunk 0 again, unused)"
    prods = [f"{p}#pragma unroll",
             f"{p}for (int f = 0; f < {frags}; ++f) {{     // this wave's fragments: {BN // 16} per row of fragments",
             f"{q}const int frag = vf_wave * ({frags}) + f;"]
    for s_, a in enumerate(g.accs):
        off = f"{s_ * BN * stride} + " if s_ else ""
        prods.append(f"{q}vf_mma_tile({a}[f], {at('mma_a', asz)}frag / {BN // 16} * {16 * stride}, {stride}, "
                     f"{at('mma_b', bsz)}{off}frag % {BN // 16} * {16 * stride}, {stride}, {KC});")
    prods.append(f"{p}}}")
    if two:                       # one barrier a chunk: the products read one buffer while the next chunk fills the other
        out += [f"{pad}load_tiles(0);", f"{pad}store_tiles(0);", f"{pad}__syncthreads();",
                f"{pad}for (int k0 = 0; k0 < {m.k}; k0 += {KC}) {{",
                f"{p}const int buf = k0 / {KC} % 2;",
                f"{p}load_tiles({nxt});   // the next chunk, in flight during the products{again}"]
        out += prods + [f"{p}store_tiles(1 - buf);", f"{p}__syncthreads();", f"{pad}}}"]
    elif prefetch():              # the next chunk in flight across the barrier, stored after it
        out += [f"{pad}load_tiles(0);", f"{pad}for (int k0 = 0; k0 < {m.k}; k0 += {KC}) {{", f"{p}store_tiles();",
                f"{p}__syncthreads();"]
        out += prods + [f"{p}load_tiles({nxt});   // the next chunk{again}", f"{p}__syncthreads();", f"{pad}}}"]
    else:
        out += [f"{pad}for (int k0 = 0; k0 < {m.k}; k0 += {KC}) {{", f"{p}load_tiles(k0);", f"{p}store_tiles();",
                f"{p}__syncthreads();"] + prods + [f"{p}__syncthreads();", f"{pad}}}"]
    guard = [c for c, ragged in ((f"row < {m.t}", m.t % BM), (f"col < {g.n}", g.n % BN)) if ragged]
    out += [f"{pad}#pragma unroll",
            f"{pad}for (int f = 0; f < {frags}; ++f) {{",
            f"{p}const int frag = vf_wave * ({frags}) + f;",
            f"{p}#pragma unroll",
            f"{p}for (int i = 0; i < VF_FRAG; ++i) {{   // the lane's elements of the fragment",
            f"{q}const int row = m0 + frag / {BN // 16} * 16 + vf_frag_row(i), col = n0 + frag % {BN // 16} * 16 + vf_frag_col(i);"]
    epi = L.substitute(g.epilogue, {a: L.Sym(a + "[f][i]", "f32") for a in g.accs})
    if guard:
        out.append(f"{q}if ({' && '.join(guard)}) {{")
        out += stmts(epi, q + "  ")
        out.append(f"{q}}}")
    else:
        out += stmts(epi, q)
    out += [f"{p}}}", f"{pad}}}"]
    return out
