"""A persistent kernel's GEMV phases fed by a ring of weights in LDS (docs/persistent.md, step 2).

A GEMV phase as the mapping makes it (``codegen/mapping.py``: its rows over the waves, each row's dot
products along k from the activation in LDS, then the row's epilogue) waits, after each grid barrier,
for its first weight loads.  Here its weights stream instead: a producer warp a workgroup copies them
into a ring of LDS slots ahead of the phases (it never waits for the grid), and the phase's threads
take them from there.  The phase kernel becomes:

* its rows in blocks of ``rows`` consecutive rows (one block a workgroup on the GPU it is made for),
  taken by the launch's workgroups in a grid-stride loop;
* a block's "slots": the weight rows its rows' dot products read (a RoPE pair's two rows, gate's and
  up's rows), in row order.  The tiled weights (``tile``, made once at load) store each block's slots
  chunk by chunk, ``kc`` columns of all of them a chunk, so that a chunk is one bulk copy;
* ``RingDot``: a thread keeps ``rpt`` slots and the same 8 columns of every chunk and sums in
  registers over the block; a warp's lanes on a row add theirs, the rest meet once in LDS (``vf_sums``),
  and the epilogue (the phase's own statements) runs a row a thread.

``ring_gemv`` recognizes the phases this applies to; ``consumer`` and ``producer`` write their two
sides in Loop IR; ``tile`` lays the weights out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import loopir as L

SLOT_BYTES = 18432         # a ring slot: a chunk of at most this many bytes (the probe's, docs/persistent.md)


@dataclass(frozen=True)
class Segment:
    """Rows ``lo`` to ``hi`` of a GEMV phase whose dot products are ``accs`` (names), the i-th reading
    row ``rows[i]`` (an expression of the row) of weight ``weights[i]``."""
    lo: int
    hi: int
    accs: tuple
    weights: tuple
    rows: tuple


@dataclass(frozen=True)
class RingGemv:
    """A GEMV phase that can take its weights from the ring: ``n`` rows (the variable ``row``), each of
    ``k`` columns, the activation ``act`` (f32 in LDS); ``prologue``, the statements before the rows;
    ``loop``, the mapped loop over the rows."""
    row: str
    n: int
    k: int
    act: str
    segments: tuple
    prologue: tuple
    loop: L.Loop
    params: tuple = ()         # the kernel's parameter names (the consumer's new locals avoid them)

    @property
    def slots(self) -> int:
        return sum((s.hi - s.lo) * len(s.accs) for s in self.segments)


def _segments(body, row, lo, hi):
    """The segments of a row loop's ``body``: an ``if (row < c)`` chain down to leaves."""
    if len(body) == 1 and isinstance(body[0], L.If):
        c = body[0].cond
        if (isinstance(c, L.Bin) and c.op == "lt" and c.a == L.Sym(row, "i32") and isinstance(c.b, L.Const)):
            cut = c.b.value
            return _segments(body[0].then, row, lo, cut) + _segments(body[0].orelse, row, cut, hi)
    return [(lo, hi, body)]


def _hw(e) -> bool:
    """Does the expression read a hardware index (lane, wave, ...)?"""
    return any(isinstance(x, L.Hw) for x in L.walk_exprs(e))


def _weight_row(acc: L.Acc, var: str, act: str, k: int, declared: dict):
    """``(weight, row expression)`` of a dot product ``act[var] * f32(weight[row * k + var])``, or None."""
    v = acc.value
    if acc.op != "add" or acc.dtype != "f32" or not (isinstance(v, L.Bin) and v.op == "mul"):
        return None
    a, w = v.a, v.b.x if isinstance(v.b, L.Cast) else v.b
    if not (isinstance(a, L.Load) and a.buf == act and a.index == L.Sym(var, "i32")):
        return None
    if type(w) is not L.Load or w.dtype != "f16":
        return None
    index = w.index
    for name, init in reversed(list(declared.items())):
        index = L.substitute_expr(index, {name: init})
    at = lambda x: L.substitute_expr(index, {var: L.Const(x, "i32")})   # noqa: E731
    row = L.fold(L.Bin("idiv", at(0), L.Const(k, "i32")))
    return (w.buf, row) if _linear(at, row, k) else None


def _linear(at, row, k) -> bool:
    """Is the index ``row * k + var`` (``at(var)``) for a few rows?"""
    syms = {s.name for s in L.walk_exprs(row) if isinstance(s, L.Sym)}
    if len(syms) != 1:
        return False
    (r,) = syms
    for x in (0, 1, 7, 13):
        env = {r: np.array([x])}
        try:
            base = evaluate(at(0), env)
            if not (base == evaluate(row, env) * k).all() or not (evaluate(at(k - 8), env) == base + k - 8).all():
                return False
        except ValueError:
            return False
    return True


def ring_gemv(m: L.Kernel) -> RingGemv | None:
    """The GEMV phase of the mapped kernel ``m`` as the ring's consumer would take it, or None: its
    last statement a loop over its rows a wave (or a few) each, every row a segment of f16 dot products
    with one f32 activation in LDS along all of its ``k`` columns (k a multiple of 8), then the row's epilogue."""
    body = [s for s in m.body if not isinstance(s, L.Comment)]
    if not body or m.family != "contract" or (m.launch and m.launch.act != "f32"):
        return None
    loop = body[-1]
    if not (isinstance(loop, L.Loop) and loop.map == "wave" and loop.start == L.Const(0, "i32")
            and isinstance(loop.stop, L.Const)):
        return None
    segments, k, act = [], None, None
    for lo, hi, leaf in _segments(loop.body, loop.var, 0, loop.stop.value):
        reduces = [s for s in leaf if isinstance(s, L.Reduce)]
        if len(reduces) != 1 or reduces[0].vector != 8 or reduces[0].body or not isinstance(reduces[0].stop, L.Const):
            return None
        r = reduces[0]
        guards = [s for s in leaf if isinstance(s, L.If) and _hw(s.cond)]
        epilogue = (guards[0].then if guards else ()) + tuple(s for s in leaf if s is not r and s not in guards)
        if len(guards) > 1 or any(_hw(e) for s in L.walk_stmts(epilogue) for e in L.stmt_exprs(s)):
            return None                               # the epilogue runs a row a thread: nothing else reads the lanes
        declared = {s.name: s.init for s in leaf[:leaf.index(r)] if isinstance(s, L.Declare)}
        first = r.accs[0].value
        if act is None and isinstance(first, L.Bin) and isinstance(first.a, L.Load):
            act, k = first.a.buf, r.stop.value
        found = [_weight_row(a, r.var, act, k, declared) for a in r.accs]
        if r.stop.value != k or k % 8 or k < 64 or None in found or r.start != L.Const(0, "i32"):
            return None                               # (a chunk is at least 64 columns: 8 lanes of 8)
        segments.append(Segment(lo, hi, tuple(a.name for a in r.accs), tuple(w for w, _ in found),
                                tuple(row for _, row in found)))
    arrays = {s.name: s for s in m.body if isinstance(s, L.Array)}
    if act not in arrays or arrays[act].space != "lds" or arrays[act].dtype != "f32":
        return None
    prologue = tuple(s for s in m.body[:m.body.index(loop)])
    return RingGemv(loop.var, loop.stop.value, k, act, tuple(segments), prologue, loop, tuple(p.name for p in m.params))


# ------------------------------------------------------------------------------ the tiles
@dataclass(frozen=True)
class Tiles:
    """How a ring phase runs: blocks of ``rows`` rows, chunks of ``kc`` columns, ``cg`` threads on a
    chunk's columns (8 each), ``rpt`` slots a thread; ``most``: the most slots a block has."""
    rows: int
    kc: int
    cg: int
    rpt: int
    most: int

    @property
    def parts(self) -> int:
        """A row's partial sums left in LDS: one from each warp's lanes on its columns."""
        return self.cg // min(self.cg, 32)


def tiles(g: RingGemv, grid: int, block: int) -> Tiles:
    """The tiles of ``g`` for a launch of ``grid`` workgroups of ``block`` consumer threads: a block of
    rows a workgroup, and the widest chunk (``cg`` a power of two) whose bytes fit a slot."""
    rows = -(-g.n // grid)
    while True:
        most = max(cum(g, min(b + rows, g.n)) - cum(g, b) for b in range(0, g.n, rows))
        for cg in (256, 128, 64, 32, 16, 8):
            if cg <= block and 8 * cg <= g.k and most * 8 * cg * 2 <= SLOT_BYTES:
                return Tiles(rows, 8 * cg, cg, -(-most // (block // cg)), most)
        if rows == 1:                                 # ring_gemv admits no such phase (k >= 64, a few dot products a row)
            raise ValueError(f"a GEMV phase of {g.n} rows, k {g.k}: no chunk fits a ring slot of {SLOT_BYTES} bytes")
        rows = -(-rows // 2)


def cum(g: RingGemv, row):
    """The slots before ``row`` (an int, or an i32 expression: then an expression)."""
    if isinstance(row, int):
        return sum(len(s.accs) * min(max(row - s.lo, 0), s.hi - s.lo) for s in g.segments)
    terms = [L.mul(L.c(len(s.accs)), L.Bin("min", L.Bin("max", _minus(row, s.lo), L.c(0)), L.c(s.hi - s.lo))
                   if len(g.segments) > 1 else row) for s in g.segments]
    out = terms[0]
    for t in terms[1:]:
        out = L.add(out, t)
    return L.fold(out)


def _minus(e, n: int):
    return L.Bin("sub", e, L.c(n)) if n else e


def _block(g: RingGemv, t: Tiles, beta: str, first: str, slots: str):
    """Block ``beta``'s first row, its end, and the declarations of its first slot and its slots."""
    lo = L.mul(L.Sym(beta, "i32"), L.c(t.rows))
    hi = L.Bin("min", L.add(lo, L.c(t.rows)), L.c(g.n))
    return lo, hi, [L.Declare(first, "i32", cum(g, lo)),
                    L.Declare(slots, "i32", L.Bin("sub", cum(g, hi), L.Sym(first, "i32")))]


def _names(g: RingGemv, *bases) -> list:
    """Names for ``bases`` that none of the phase's own locals and parameters take."""
    taken = set(L.local_names((g.loop,) + g.prologue)) | set(g.params)
    out = []
    for b in bases:
        out.append(L.fresh_name(b, taken))
        taken.add(out[-1])
    return out


def how(t: Tiles) -> str:
    """The mapping's line for a phase fed by the ring."""
    return (f"a block of {t.rows} row{'s' if t.rows > 1 else ''} a workgroup, its weight rows from the ring in chunks of "
            f"{t.kc} columns; {t.cg} threads on a chunk's columns, 8 each, {t.rpt} weight row{'s' if t.rpt > 1 else ''} a "
            "thread, summed in registers; the epilogue a row a thread")


def consumer(g: RingGemv, t: Tiles, name: str = "vf_sums") -> tuple:
    """The phase's body as the ring's consumer: the prologue, then for each block of rows its dot
    products from the ring (``RingDot``) and its rows' epilogues, a row a thread."""
    beta, first, slots, part = _names(g, "block", "first_slot", "slots", "part")
    lo, hi, decls = _block(g, t, beta, first, slots)

    def leaf(body, seg, base):
        out = []
        for s in body:
            if isinstance(s, L.Reduce):
                rel = L.Bin("sub", L.add(L.c(base), L.mul(L.c(len(seg.accs)), _minus(L.Sym(g.row, "i32"), seg.lo))),
                            L.Sym(first, "i32"))
                accs = tuple(L.Acc(a, "add", L.Load(name, L.add(L.mul(L.add(rel, L.c(i)), L.c(t.parts)), L.Sym(part, "i32")),
                                                   "f32")) for i, a in enumerate(seg.accs))
                out.append(L.Reduce(part, L.c(0), L.c(t.parts), accs))
            elif isinstance(s, L.If) and _hw(s.cond):
                out += list(s.then)                       # the row's lane guard: a thread a row now
            else:
                out.append(s)
        return tuple(out)

    def rows(body, lo_, hi_):
        if len(body) == 1 and isinstance(body[0], L.If) and not _hw(body[0].cond):
            cut = body[0].cond.b.value
            return (L.If(body[0].cond, rows(body[0].then, lo_, cut), rows(body[0].orelse, cut, hi_)),)
        seg = next(s for s in g.segments if s.lo == lo_)
        return leaf(body, seg, cum(g, seg.lo))

    epilogue = L.Loop(g.row, lo, hi, rows(g.loop.body, 0, g.n), map="block")
    # the waves' partial sums of a row that the mapping split (vf_part): no longer read
    keep = tuple(s for s in g.prologue if not (isinstance(s, L.Array) and s.name == "vf_part"))
    dot = L.RingDot(g.k, t.kc, t.cg, t.rpt, g.act, name, L.Sym(slots, "i32"))
    return keep + (L.Array(name, "f32", t.most * t.parts, "lds"),
                   L.Comment(f"blocks of {t.rows} row{'s' if t.rows > 1 else ''}, a workgroup each; their weights from "
                             f"the ring, {t.kc} columns a chunk, {t.cg} threads on a chunk, {t.rpt} weight "
                             f"row{'s' if t.rpt > 1 else ''} a thread"),
                   L.Loop(beta, L.c(0), L.c(-(-g.n // t.rows)), tuple(decls) + (dot, L.Barrier(), epilogue, L.Barrier()),
                          map="grid"))


def producer(g: RingGemv, t: Tiles, flight_bytes: int) -> tuple:
    """The producer warp's walk over the phase: each block the launch's workgroup takes, its chunks, as many
    in flight as hold ``flight_bytes`` (two at least)."""
    decls = _block(g, t, "block", "first_slot", "slots")[2]
    flight = min(max(2, -(-flight_bytes // (t.most * t.kc * 2))), 1 << 16)     # as many as the ring holds, past its size
    return (L.Loop("block", L.c(0), L.c(-(-g.n // t.rows)),
                   tuple(decls) + (L.RingProduce(g.k, t.kc, L.mul(L.Sym("first_slot", "i32"), L.c(g.k)),
                                                 L.Sym("slots", "i32"), flight),), map="grid"),)


# ------------------------------------------------------------------------------ evaluating rows, the layout
_NP = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "idiv": np.floor_divide, "mod": np.mod,
       "min": np.minimum, "max": np.maximum}


def evaluate(e, env: dict) -> np.ndarray:
    """The i32 expression ``e`` over numpy integer arrays (``env``: a Sym's name to its values);
    ValueError for anything else.  The rows are not negative, so C's division is numpy's floor."""
    if isinstance(e, L.Const) and e.dtype == "i32":
        return np.asarray(e.value, np.int64)
    if isinstance(e, L.Sym) and e.name in env:
        return np.asarray(env[e.name], np.int64)
    if isinstance(e, L.Bin) and e.op in _NP:
        return _NP[e.op](evaluate(e.a, env), evaluate(e.b, env))
    raise ValueError(f"not a row expression: {L.format_expr(e)}")


def slot_rows(g: RingGemv):
    """Per dot product of each segment: ``(weight, its rows, their slots)``, the slots in row order."""
    out, base = [], 0
    for s in g.segments:
        r = np.arange(s.lo, s.hi)
        for i, (w, row) in enumerate(zip(s.weights, s.rows)):
            sym = next(x.name for x in L.walk_exprs(row) if isinstance(x, L.Sym))
            out.append((w, evaluate(row, {sym: r}), base + len(s.accs) * (r - s.lo) + i))
        base += len(s.accs) * (s.hi - s.lo)
    return out


def tile(g: RingGemv, t: Tiles, weights: dict) -> np.ndarray:
    """The tiled f16 weights of ``g`` (``weights``: its weight parameters' arrays, each [rows, k]):
    block by block, each block's slots chunk by chunk, a chunk ``kc`` columns of every slot, row-major.
    ``g.slots * g.k`` values in all."""
    m = np.empty((g.slots, g.k), np.float16)
    for w, rows, at in slot_rows(g):
        m[at] = np.asarray(weights[w], np.float16).reshape(-1, g.k)[rows]
    out, whole = [], g.k // t.kc * t.kc
    for b in range(0, g.n, t.rows):
        s = m[cum(g, b):cum(g, min(b + t.rows, g.n))]
        out.append(s[:, :whole].reshape(len(s), -1, t.kc).transpose(1, 0, 2).ravel())
        out.append(s[:, whole:].ravel())
    return np.concatenate(out)
