"""The GPU scheduling step: ``map_kernel(kernel, target)`` records in the Loop IR how a kernel runs
on the GPU of ``target``; ``codegen/hip.py`` renders the result and decides nothing.

Families:

* contract (GEMV/matmul): row loops stay serial (one trip: dropped); the prologue's reductions
  run block-wide; the activation is written into LDS (f16 where the target has fp16 dot
  products) by the threads of the workgroup, then a barrier.  The segments' output rows (Q, K, V
  side by side) become one loop over waves; each wave's lanes reduce k, 16 bytes per load when
  the weight row is contiguous in k and aligned (checked here); lane 0 runs the epilogue.  When
  the rows leave most of the chip idle, ``split`` waves share a row and combine through LDS.
  A segment of order "outer" (a (K, N) weight) gives each thread an output column instead.
* attention (``attention_tiles``): a workgroup per (KV head, tile of query rows, split of the
  cache); the query heads of a KV group share each K/V tile, staged in LDS; the splits combine
  by log-sum-exp in the last workgroup of each group to finish.
* elementwise, scatter, reduce: a parallel loop holding reductions gives each iteration a
  workgroup (reductions block-wide, inner parallel loops over its threads, stores of row values
  by thread 0); other parallel loops are flat grid-stride loops over every thread; a kernel that
  computes outside parallel loops (a reduction to a scalar) runs on one workgroup.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import replace

from . import loopir as L
from .loopir import ITEMSIZE
from . import mma
from . import prologue
from .mma import mma_tiles
from .prelude import act_dtype
from .targets import Target, get_target, lds_budget
from .env import env_choice, env_int, switch

LANE, WAVE, THREAD = L.Hw("lane"), L.Hw("wave"), L.Hw("thread")
MAX_GRID = 65535


def map_kernel(k: L.Kernel, t: Target, lds_limit: int = 0, budget: int = 0) -> L.Kernel:
    """``k`` with every loop and reduction assigned to a hardware unit and its launch recorded
    (``k.launch``).  A kernel already mapped is returned as it is.  ``lds_limit``: static LDS
    bytes the kernel must fit besides ``t``'s own (the target whose text it runs on); ``budget``:
    the same for static and dynamic LDS together (``targets.lds_budget``)."""
    if k.launch is not None:
        return k
    k = clear_of_templates(k)
    if t.maps_like:                        # another target's kernel text, launched within this one's limits
        # (its LDS; an emulated wave's 15 waves a workgroup: no larger workgroups, _whole_trips)
        return map_kernel(k, get_target(t.maps_like, emulated_wave=t.emulated_wave), t.max_static_lds, lds_budget(t))
    body = L.drop_unit_loops(k.body, keep_parallel=k.family == "contract")
    if k.family == "contract":
        body, launch = _contract(body, t, min(t.max_static_lds, lds_limit or t.max_static_lds),
                                 min(lds_budget(t), budget or lds_budget(t)))
    elif k.family == "loop":
        body, launch = _one_workgroup(body, t)
    elif any(isinstance(s, L.Attention) for s in body):
        body, launch = _attention(body, t)
    else:
        body, launch = _generic(body, t)
    return replace(k, body=body, launch=launch)


def _lds_bytes(body):
    return int(sum(s.size * ITEMSIZE[s.dtype] for s in L.walk_stmts(body) if isinstance(s, L.Array) and s.space == "lds"))


def one_workgroup_block(t) -> int:
    """Threads of a kernel that runs on one workgroup: ``t.one_workgroup_block`` (``t.block`` where
    unset); ``VEGAFUSE_ONE_WORKGROUP_BLOCK=N`` sets it (A/B; N a multiple of the wave, at most 1024,
    or 15 waves where the wave is emulated)."""
    n = env_int("VEGAFUSE_ONE_WORKGROUP_BLOCK", t.one_workgroup_block or t.block)
    most = 15 * t.wave if t.emulated_wave else 1024     # an emulated wave: at most 15 a workgroup (codegen/prelude.py)
    if n % t.wave or not t.wave <= n <= most:
        emulated = " (gfx906's text on an NVIDIA GPU: at most 15 waves)" if t.emulated_wave else ""
        raise ValueError(f"VEGAFUSE_ONE_WORKGROUP_BLOCK={n} is not a multiple of the wave ({t.wave}) "
                         f"between it and {most}{emulated}; set one (e.g. 256) or unset it")
    return n


def _scratch(body, t, block=0):
    """The LDS that block reductions use, declared first: ``vf_red`` (f32 results), ``vf_redi``
    (an f32 argmax's indices; i32 results, twice as long for an i32 argmax's indices); one entry
    per wave of a workgroup of ``block`` threads (default ``t.block``)."""
    waves = (block or t.block) // t.wave
    accs = [a for r in L.walk_stmts(body) if isinstance(r, L.Reduce) and r.map == "block" for a in r.accs]
    out = (L.Array("vf_red", "f32", waves, "lds"),) if any(a.dtype == "f32" for a in accs) else ()
    if any(a.op == "argmax" or a.dtype == "i32" for a in accs):
        ints = 2 if any(a.op == "argmax" and a.dtype == "i32" for a in accs) else 1
        out += (L.Array("vf_redi", "i32", ints * waves, "lds"),)
    return out


def _block_reduce(r):
    """Block-wide: the workgroup's threads share the loop, then combine (the prelude's f32 and i32
    block reductions)."""
    assert all(a.dtype in ("f32", "i32") for a in r.accs), r
    return replace(r, map="block")


def _once(stmts):
    return (L.If(L.Bin("eq", THREAD, L.c(0)), tuple(stmts)),)


# ------------------------------------------------------------------------------ elementwise, reduce
def _cooperative(body, local=frozenset()):
    """Statements that all threads of a workgroup run together (a store to a ``local`` array,
    private to each thread, is run by every thread)."""
    out = []
    for s in body:
        if isinstance(s, L.Reduce):
            out.append(_block_reduce(s))
        elif isinstance(s, L.Loop) and s.parallel:
            out.append(replace(s, map="block", body=_per_thread(s.body)))
        elif isinstance(s, L.Loop):
            out.append(replace(s, body=_cooperative(s.body, local)))
        elif isinstance(s, L.If):
            out.append(L.If(s.cond, _cooperative(s.then, local), _cooperative(s.orelse, local)))
        elif isinstance(s, L.Store):
            out += [s] if s.buf in local else _once([s])
        else:
            out.append(s)
    return tuple(out)


def _per_thread(body):
    """Statements one thread runs alone: every loop serial."""
    return tuple(replace(s, body=_per_thread(s.body), map="serial") if isinstance(s, L.Loop)
                 else L.If(s.cond, _per_thread(s.then), _per_thread(s.orelse)) if isinstance(s, L.If) else s
                 for s in body)


def _generic(body, t):
    # locals computed before the loops (a clamped position, hoisted by the simplifier) are computed
    # by every thread; anything else outside a parallel loop runs on one workgroup
    single = not all(isinstance(s, (L.Comment, L.Declare)) or (isinstance(s, L.Loop) and s.parallel) for s in body)
    if single:
        body = _cooperative(body)
        grid, how, block = 1, "one workgroup: reductions block-wide, results stored by thread 0", one_workgroup_block(t)
        across = _across(body, t, block)
        if across:
            body, grid = across
            how = (f"{grid} workgroups: each folds a chunk of the reduction block-wide and stores its partial; "
                   "the last to arrive folds the partials and stores the result")
    else:
        out, grid, block = [], 1, t.block
        for s in body:
            if isinstance(s, L.Loop) and any(isinstance(x, L.Reduce) for x in L.walk_stmts(s.body)):
                out.append(replace(s, map="grid", body=_cooperative(s.body)))
                n = s.stop.value - s.start.value if isinstance(s.stop, L.Const) and isinstance(s.start, L.Const) else 1
                grid = max(grid, n)
            elif isinstance(s, L.Loop):
                out.append(replace(s, map="thread", body=_per_thread(s.body)))
                n = s.stop.value - s.start.value if isinstance(s.stop, L.Const) and isinstance(s.start, L.Const) else 1
                grid = max(grid, -(-n // t.block))
            else:
                out.append(s)
        body = tuple(out)
        rows = any(isinstance(s, L.Loop) and s.map == "grid" for s in body)
        how = ("a workgroup per row: reductions block-wide, the row's elements over its threads" if rows
               else "grid-stride loops over every thread")
        if rows and (grid == 1 or _few_long_rows(body, grid, t)):
            block = one_workgroup_block(t)         # one row (a decode step's argmax), or few long ones
    body = _scratch(body, t, block) + body
    return body, L.Launch(min(grid, MAX_GRID), block, "VF_BLOCK", how, _lds_bytes(body))


def _across(body, t: Target, block: int):
    """``(body, parts)`` for a kernel that is one long block-wide reduction and thread 0's stores of
    its result (a decode step's argmax over the vocabulary): the range split into ``parts``
    contiguous chunks, a workgroup each, about 8 elements a thread (their loads unrolled, in flight
    together); each workgroup stores its partial (and, for an argmax, its index) in a "device" array,
    and the last to arrive (``Arrive``) folds the partials in chunk order, so an argmax keeps the
    first of equal maxima.  One workgroup read 608 KB of logits at about 60 GB/s on an H200 (10.7 µs);
    19 took 6 (docs/performance.md).  None where the body is not of that form, the range gives fewer
    than 2 parts, or ``VEGAFUSE_REDUCE_ACROSS=0`` (A/B)."""
    reds = [s for s in body if isinstance(s, L.Reduce)]
    rest = [s for s in body if not isinstance(s, (L.Comment, L.Reduce))]
    if len(reds) != 1 or len(rest) != 1 or not isinstance(rest[0], L.If) or rest[0].orelse \
            or not switch("VEGAFUSE_REDUCE_ACROSS", True):
        return None
    r, then = reds[0], rest[0]
    if r.body or len(r.accs) != 1 or r.accs[0].op not in ("add", "max", "argmax") \
            or not (isinstance(r.start, L.Const) and isinstance(r.stop, L.Const)) or body.index(r) > body.index(then):
        return None
    a, n = r.accs[0], r.stop.value - r.start.value
    parts = min(t.compute_units, -(-n // (8 * block)))
    stores = [s for s in then.then if isinstance(s, L.Store)]
    if parts < 2 or len(stores) != len(then.then):
        return None
    chunk = -(-n // parts)
    first = L.Declare(_suffixed(r.var, "first"), "i32", L.add(r.start, L.mul(L.Hw("workgroup"), L.c(chunk))))
    lo = L.Sym(first.name, "i32")
    out = stores[0].buf
    part, arg, count = f"vf_{out}_part", f"vf_{out}_part_arg", f"vf_{out}_arrived"   # vf_: never a user's name
    arrays = [L.Array(part, a.dtype, parts, "device")]
    keep = [L.Store(part, L.Hw("workgroup"), L.Sym(a.name, a.dtype))]
    if a.arg:
        arrays.append(L.Array(arg, "i32", parts, "device"))
        keep.append(L.Store(arg, L.Hw("workgroup"), L.Sym(a.arg, "i32")))
    arrays.append(L.Array(count, "i32", 1, "device"))
    g = L.Sym(_suffixed(r.var, "part"), "i32")
    total = replace(a, name=_suffixed(a.name, "all"), arg=_suffixed(a.arg, "all") if a.arg else "",
                    value=L.Load(part, g, a.dtype))
    fold = replace(r, var=g.name, start=L.c(0), stop=L.c(parts), accs=(total,))
    result = {a.name: L.Sym(total.name, a.dtype)}
    if a.arg:                                          # the winning part's own index
        result[a.arg] = L.Load(arg, L.Sym(total.arg, "i32"), "i32")
    before = [s for s in body if s is not r and s is not then]
    body = tuple(arrays + before) + (first, replace(r, start=lo, stop=L.Bin("min", L.add(lo, L.c(chunk)), r.stop),
                                                    unroll=t.prologue_unroll),   # a thread's loads in flight together
                                    L.If(then.cond, tuple(keep)), L.Arrive(count, parts), fold,
                                    L.substitute((then,), result)[0])
    return body, parts


def _suffixed(name: str, word: str) -> str:
    """``best_111`` -> ``best_all_111``: a new name that keeps the numbering ``tidy_names`` drops."""
    base, num = re.fullmatch(r"(.*?)(_\d+)?", name).groups()
    return f"{base}_{word}{num or ''}"


def _few_long_rows(body, rows, t) -> bool:
    """A workgroup per row, with no more rows than compute units and rows of at least 8 times
    ``one_workgroup_block`` elements (the device sampler's [63, V] tests of a search pass): each row
    takes a workgroup of ``one_workgroup_block`` threads, whose loads in flight shorten the row's
    chain of latencies (256 threads left 192 loads a thread in sequence at 49152 ids: 13 µs a pass on
    an H200).  ``VEGAFUSE_WIDE_ROWS=0`` keeps ``t.block`` (A/B)."""
    if rows > t.compute_units or not switch("VEGAFUSE_WIDE_ROWS", True):
        return False
    block = one_workgroup_block(t)
    return any(isinstance(r, L.Reduce) and isinstance(r.stop, L.Const) and isinstance(r.start, L.Const)
               and r.stop.value - r.start.value >= 8 * block for r in L.walk_stmts(body))


def _one_workgroup(body, t):
    """The loop family (a scan): its steps are serial, so it runs on one workgroup whose threads
    share each step's parallel loops; the kernel's barriers order the phases.  Local arrays
    (a GEMV's activation) are filled by every thread."""
    local = {s.name for s in L.walk_stmts(body) if isinstance(s, L.Array) and s.space == "local"}
    body = _cooperative(body, frozenset(local))
    block = one_workgroup_block(t)
    body = _scratch(body, t, block) + body
    how = "one workgroup: the steps in order, each step's loops over its threads, barriers between phases"
    return body, L.Launch(1, block, "VF_BLOCK", how, _lds_bytes(body))


# ------------------------------------------------------------------------------ attention
ATT_ROWS = 16              # rows (query positions x the heads of a KV group) a prefill tile aims for


def attention_lds(a: L.Attention, rows: int, keys: int, split: bool = True) -> int:
    """LDS bytes of the attention template: the tile's query rows (f32), a tile of ``keys`` K rows
    (padded by 16 bytes) and V rows in the caches' dtypes, the probabilities, each row's rescale and
    sum and, when the cache is ``split``, its max and the arrival flag."""
    k, v = (ITEMSIZE[x] for x in a.dtypes[1:])
    per_row = 12 if split else 8
    return 4 * rows * a.d + keys * (a.d * k + 16) + keys * a.d * v + 4 * rows * keys + per_row * rows + 4 * split


def attention_tiles(a: L.Attention, t: Target) -> L.AttentionTiles:
    """The tiles of an attention on ``t`` (see ``L.AttentionTiles``).  Decode (T = 1) takes the
    heads of one KV group as its rows; prefill adds query positions up to ``ATT_ROWS`` rows (half as
    many, in turn, while not even 8 keys fit beside them).  Keys per LDS tile: the most of 64, 32,
    16, 8 that fit ``t.attention_lds``.  The cache is split over
    workgroups (flash-decoding) into chunks of at least the positions that spread the grid over the
    chip once, and of at least sqrt(S x rows x 4 / (K + V bytes per element)): there a split's K/V
    reads equal the combine's reads of every split's partial rows (``VEGAFUSE_ATT_CHUNK`` sets
    the positions per split, rounded up to whole tiles: A/B).  The grid is fixed (CUDA graph
    replay); a split past the position exits at once.  Raises ValueError when one tile of 8 keys
    does not fit."""
    decode = decode_tiles(a, t) or prefill_tiles(a, t)
    if decode:
        return decode
    group = a.hq // a.hkv
    rows_q = 1 if a.t == 1 else max(1, min(a.t, ATT_ROWS // group))
    while True:                                 # fewer query positions per tile where a wide head needs it
        rows = rows_q * group
        keys = next((n for n in (64, 32, 16, 8) if attention_lds(a, rows, n) <= t.attention_lds), 0)
        if keys or rows_q == 1:
            break
        rows_q //= 2
    if not keys:
        raise ValueError(f"attention with head dim {a.d} and {group} query heads per KV head needs more than "
                         f"{t.attention_lds} bytes of LDS for 8 keys; use fewer query heads per KV head or a smaller head dim")
    kv_bytes = sum(ITEMSIZE[x] for x in a.dtypes[1:])
    groups = a.hkv * -(-a.t // rows_q)
    chunk = max(a.s * groups / t.compute_units, math.sqrt(a.s * rows * 4 / kv_bytes), keys)
    chunk = env_int("VEGAFUSE_ATT_CHUNK", 0, 0) or chunk          # positions per split (A/B)
    chunk = min(-(-int(math.ceil(chunk)) // keys) * keys, -(-a.s // keys) * keys)
    vector = all(a.d * ITEMSIZE[x] % t.load_bytes == 0 for x in a.dtypes[1:])
    return L.AttentionTiles(rows_q, keys, chunk, -(-a.s // chunk), min(keys, t.wave), vector,
                            t.attention_block, t.wave)


def prefill_lds(a: L.Attention, rows: int, keys: int, split: bool = True) -> int:
    """LDS bytes of the register-blocked prefill template: ``rows`` query rows (f32, padded by 16
    bytes), a tile of ``keys`` K rows (padded by 16 bytes) and V rows in the caches' dtypes, the
    probabilities (rows padded by 16 bytes), each row's sum and, when the cache is ``split``, its max
    and the arrival flag."""
    k, v = (ITEMSIZE[x] for x in a.dtypes[1:])
    return 4 * rows * (a.d + 4) + keys * (a.d * k + 16) + keys * a.d * v + 4 * rows * (keys + 4) + (8 if split else 4) * rows + 4 * split


def prefill_vgprs(a: L.Attention, rm: int, kn: int, tk: int, threads: int, keys: int) -> int:
    """An upper estimate of the registers per lane of the register-blocked prefill template: the
    outputs (rm rows x 4 columns per group of 4 tk), the scores, one step's query and key values, the
    next tile's K/V loads in flight (four per 16-byte load), the row state and about 56 more (hiprtc's
    gfx906 builds at head dim 128, f16: 1 x 2 keys on 16 lanes took 113, 2 x 2 147, 4 x 2 175)."""
    e = 16 // ITEMSIZE[a.dtypes[1]]
    loads = sum(-(-keys * (a.d * ITEMSIZE[x] // 16) // threads) for x in a.dtypes[1:])
    return rm * 4 * -(-a.d // (4 * tk)) + rm * kn + (rm + kn) * e + 4 * loads + 2 * rm + 56


PREFILL_VGPRS = 200        # registers a prefill lane may take where the target sets no budget (nvcc for sm_90
                           # gave 4 rows x 2 keys on 16 lanes 128 at head dim 128, f16; 4 x 4 spilled at 255)


def prefill_tiles(a: L.Attention, t: Target):
    """The register-blocked prefill mapping (T > 1, K/V rows whole 16-byte loads), or None (then the
    tiled template; ``VEGAFUSE_ATT_PREFILL=scalar`` asks for it: A/B).  Rows of ``tk`` lanes (16 or 8);
    a lane takes ``rm`` rows x ``kn`` keys of the scores (4, 2 or 1 each), so a tile has rm x threads /
    tk rows and kn x tk keys.  Among the tiles whose LDS (``prefill_lds``) fits ``t.attention_lds``:
    those whose registers (``prefill_vgprs``) fit ``t.attention_vgprs`` (or ``PREFILL_VGPRS``), then
    two waves per SIMD where LDS and registers allow them, then the most FMAs per LDS read (rm x kn),
    the most rows per lane (a converted f16 key or value serves rm rows), the most threads (of ``t.attention_block``, 128 or 64), the most keys, the fewest registers;
    ``VEGAFUSE_ATT_BLOCK=RMxKNxTKxTHREADS`` sets them (A/B).  A workgroup takes the
    most of the KV group's query heads (a divisor) that fit its rows, at as many positions as fill
    them.  Splits as ``attention_tiles``.  Raises ValueError when no tile fits."""
    if a.t == 1 or env_choice("VEGAFUSE_ATT_PREFILL", ("blocked", "scalar"), "blocked") == "scalar" or \
            any(a.d * ITEMSIZE[x] % t.load_bytes for x in a.dtypes[1:]):
        return None
    budget = t.attention_vgprs or PREFILL_VGPRS
    forced = os.environ.get("VEGAFUSE_ATT_BLOCK")
    if forced:
        try:
            rm, kn, tk, threads = shape = tuple(map(int, forced.lower().split("x")))
        except ValueError:
            raise ValueError(f"VEGAFUSE_ATT_BLOCK={forced!r}: write ROWSxKEYSxLANESxTHREADS, e.g. 4x2x16x128") from None
        lds = prefill_lds(a, rm * threads // max(tk, 1), kn * tk)
        if min(shape) < 1 or tk & (tk - 1) or not tk <= t.wave <= threads or threads % t.wave or lds > t.max_static_lds:
            raise ValueError(f"VEGAFUSE_ATT_BLOCK={forced}: needs lanes a power of two up to the wave ({t.wave}), threads "
                             f"a multiple of it, and at most {t.max_static_lds} bytes of LDS (this tile: {lds}); "
                             "choose another tile or unset it")
        shapes = [shape]
    else:
        shapes = [(rm, kn, tk, nt) for rm in (4, 2, 1) for kn in (4, 2, 1) for tk in (16, 8)
                  for nt in (t.attention_block, 128, 64) if nt <= t.attention_block and tk <= t.wave <= nt]
        shapes = [x for x in shapes if prefill_lds(a, x[0] * x[3] // x[2], x[1] * x[2]) <= t.attention_lds]
    if not shapes:
        raise ValueError(f"attention with head dim {a.d} needs more than {t.attention_lds} bytes of LDS for a tile of "
                         f"8 query rows and 8 keys; use a smaller head dim (or VEGAFUSE_ATT_PREFILL=scalar)")
    regs = {x: prefill_vgprs(a, x[0], x[1], x[2], x[3], x[1] * x[2]) for x in shapes}

    def waves(x):                      # waves per SIMD as far as LDS and registers allow, up to 2
        per_cu = t.lds_per_cu // prefill_lds(a, x[0] * x[3] // x[2], x[1] * x[2])
        by_lds = per_cu * x[3] // t.wave // t.simds_per_cu
        return min(2, by_lds, t.vgprs_per_simd // regs[x] if t.vgprs_per_simd else 2)
    rm, kn, tk, threads = max(shapes, key=lambda x: (regs[x] <= budget, waves(x), x[0] * x[1], x[0], x[3], x[1] * x[2], -regs[x]))
    rows, keys, group = rm * threads // tk, kn * tk, a.hq // a.hkv
    heads = max(h for h in range(1, min(group, rows) + 1) if group % h == 0)
    rows_q = min(a.t, rows // heads)
    kv_bytes = sum(ITEMSIZE[x] for x in a.dtypes[1:])
    groups = a.hkv * group // heads * -(-a.t // rows_q)
    chunk = max(a.s * groups / t.compute_units, math.sqrt(a.s * rows * 4 / kv_bytes), keys)
    chunk = env_int("VEGAFUSE_ATT_CHUNK", 0, 0) or chunk          # positions per split (A/B)
    chunk = min(-(-int(math.ceil(chunk)) // keys) * keys, -(-a.s // keys) * keys)
    return L.AttentionTiles(rows_q, keys, chunk, -(-a.s // chunk), tk, True, threads, t.wave, heads, 1, (rm, kn))


DECODE_FLOATS = 64         # query values a decode lane keeps in registers (as many output accumulators)


def merge_blocks(splits: int) -> int:
    """The splits of a decode attention merged together: all of them up to 16; beyond, blocks of
    about sqrt(splits), the last of each block to finish merging it and the last block merging the
    blocks, so that no merge reads more than a few partial rows per output."""
    return splits if splits <= 16 else math.isqrt(splits - 1) + 1


def decode_lds(a: L.Attention, m: L.AttentionTiles) -> int:
    """LDS bytes of the decode template: each wave's state (max, sum and outputs of its rows) and,
    when the cache is split, a merge's max and sum of each slot's rows and the arrival flag."""
    waves = m.threads // m.wave
    b = merge_blocks(m.splits)
    slots = max(b, -(-m.splits // b))
    return 4 * waves * m.heads * (a.d + 2) + (m.splits > 1) * (8 * slots * m.heads + 4)


def decode_vgprs(heads: int, unroll: int, x: int, upl: int) -> int:
    """An upper estimate of the registers per lane of the decode template: each head's query slice and
    output accumulators (``x`` floats each), its scores, max and sum; the K and V loads of this step and
    of the next (``unroll`` keys of ``upl`` 16-byte loads each, four registers a load); a row's unpacked
    slice and about 24 for addresses and loop state (fitted to hiprtc's gfx906 builds: 6 heads x 4 keys
    took 220, 3 x 2 took 118, 1 x 1 took 55 at head dim 128, f16)."""
    return 2 * heads * x + heads * (unroll + 2) + 16 * unroll * upl + x + 24


def decode_tiles(a: L.Attention, t: Target):
    """The decode (T = 1) mapping, or None where it does not apply (K and V of different dtypes, or
    rows not a whole number of 16-byte loads).  A lane group of ``key_lanes`` lanes owns a key: each
    lane loads 16 bytes of its K and V rows straight from global memory, ``unroll`` keys in flight per
    group, and keeps its slice of every query row and output row in registers (online softmax per
    group, no barrier per step).  The workgroup's ``heads`` query heads (the KV group over 1, 2, ...
    workgroups of ceil(group / n) heads, the last taking fewer where they do not divide it; only
    divisors where the target sets no register budget) and ``unroll`` are the most heads, with 4 or else 2
    keys in flight, then with 1, whose queries fit ``DECODE_FLOATS`` values per lane and whose
    registers (``decode_vgprs``) fit ``t.attention_decode_vgprs`` or else ``t.attention_vgprs`` (sm_90:
    170, the most keys in flight that a long cache needs; gfx906: 128, two waves per SIMD and no
    scratch at any group size); ``VEGAFUSE_ATT_VGPRS`` sets the budget, 0 none, ``VEGAFUSE_ATT_HEADS`` the
    most heads a workgroup: A/B; where nothing fits
    it, one head and one key in flight).  ``t.attention_waves`` waves a workgroup (sm_90: 8, gfx906: 4;
    ``VEGAFUSE_ATT_WAVES`` sets it: A/B).  Splits: the chunk where ``t.attention_workgroups_per_cu``
    workgroups per CU cover the full cache (sm_90: 2, gfx906: 1), in whole steps of the workgroup
    (``VEGAFUSE_ATT_CHUNK`` sets it: A/B); up to ``t.attention_short`` steps of keys, when that is
    more than the chunk, the first split reads the whole context and nothing is combined (``short``;
    ``VEGAFUSE_ATT_SHORT=POSITIONS`` sets it, 0 none; a cache no longer than that is one split)."""
    kd, vd = a.dtypes[1:]
    if a.t != 1 or kd != vd or a.d * ITEMSIZE[kd] % t.load_bytes:
        return None
    group, per = a.hq // a.hkv, t.load_bytes // ITEMSIZE[kd]
    waves, most = env_int("VEGAFUSE_ATT_WAVES", t.attention_waves), t.attention_block // t.wave
    if not 1 <= waves <= most:
        raise ValueError(f"VEGAFUSE_ATT_WAVES={waves}: a decode attention workgroup on {t.name} takes 1 to {most} "
                         f"waves (its launch bound, VF_ATT_BLOCK, is {t.attention_block} threads); set one or unset it")
    units = a.d // per                                     # 16-byte loads per row
    lanes = min(t.wave, 1 << (units - 1).bit_length())
    upl = -(-units // lanes)
    budget = env_int("VEGAFUSE_ATT_VGPRS", t.attention_decode_vgprs or t.attention_vgprs)
    heads = sorted({-(-group // n) for n in range(1, group + 1)}, reverse=True)   # the group over 1, 2, ... workgroups
    heads = [h for h in heads if h <= env_int("VEGAFUSE_ATT_HEADS", group, 1, "1 or more query heads a workgroup")]
    if not budget:
        heads = [h for h in heads if group % h == 0]
    choices = [(h, u) for h in heads for u in (4, 2)] + [(h, 1) for h in heads]
    fits = []
    for heads, unroll in choices:
        if heads * upl * per > DECODE_FLOATS:
            continue
        threads = waves * t.wave
        step = waves * unroll * (t.wave // lanes)  # keys a workgroup loads at once
        # the chunk where the target's workgroups per CU cover the full cache
        chunk = a.s * a.hkv * -(-group // heads) / (t.compute_units * t.attention_workgroups_per_cu)
        chunk = env_int("VEGAFUSE_ATT_CHUNK", 0, 0) or chunk
        chunk = min(-(-int(math.ceil(chunk)) // step) * step, -(-a.s // step) * step)
        short = env_int("VEGAFUSE_ATT_SHORT", t.attention_short * step)
        if short >= a.s:                                   # the whole cache is short: one split
            chunk = -(-a.s // step) * step
        m = L.AttentionTiles(1, step, chunk, -(-a.s // chunk), lanes, True, threads, t.wave, heads, unroll,
                             short=short if chunk < short < a.s else 0)
        if decode_lds(a, m) <= t.attention_lds:
            if not budget or decode_vgprs(heads, unroll, upl * per, upl) <= budget:
                return m
            fits.append(m)
    return fits[-1] if fits else None                      # over the budget: one head, one key in flight


def _attention(body, t):
    """Record the tiles in the Attention statement (kept when another target mapped it: its text
    runs as written) and derive the launch from them."""
    (a,) = [s for s in body if isinstance(s, L.Attention)]
    if a.tiles is None:
        tiled = replace(a, tiles=attention_tiles(a, t))
        body, a = tuple(tiled if s is a else s for s in body), tiled
    m = a.tiles
    group = a.hq // a.hkv
    if m.block:
        nqt = -(-a.t // m.rows_q)
        rows = f"{m.rows_q} query positions x {m.heads} of its {group} query heads"
        how = (f"a workgroup per (KV head, {rows}, {m.chunk}-position split of the cache: {m.splits}); tiles of "
               f"{m.keys} keys in LDS (16-byte loads), rows of {m.key_lanes} lanes, each lane {m.block[0]} rows x "
               f"{m.block[1]} keys of the scores, online softmax"
               + ("; the last split to finish combines them (log-sum-exp)" if m.splits > 1 else ""))
        grid = a.hkv * group // m.heads * nqt * m.splits
        rows_pad = m.block[0] * m.threads // m.key_lanes
        # the launch bounds name the workgroup's own size: nvcc held a 128-thread tile at 128 registers
        # (and spilled) under bounds of 256
        return body, L.Launch(grid, m.threads, str(m.threads), how, prefill_lds(a, rows_pad, m.keys, m.splits > 1))
    if m.heads:
        how = (f"a workgroup per (KV head, {m.heads} of its {group} query heads, {m.chunk}-position split of the "
               f"cache: {m.splits}); {m.key_lanes} lanes per key, {m.unroll} keys in flight per lane group, K/V in "
               "16-byte loads straight to registers, online softmax per group, the waves merged in LDS"
               + ("; the last split to finish combines them (log-sum-exp"
                  + (f", in blocks of {merge_blocks(m.splits)})" if merge_blocks(m.splits) < m.splits else ")")
                  if m.splits > 1 else ""))
        return body, L.Launch(a.hkv * -(-group // m.heads) * m.splits, m.threads, "VF_ATT_BLOCK", how, decode_lds(a, m))
    nqt = -(-a.t // m.rows_q)
    heads = f"{group} query head{'s' if group > 1 else ''}"
    rows = f"{m.rows_q} query positions x {heads}" if m.rows_q > 1 else heads
    how = (f"a workgroup per (KV head, {rows}, {m.chunk}-position split of the cache: {m.splits}); "
           f"tiles of {m.keys} keys in LDS ({'16-byte' if m.vector else 'element'} loads), online softmax"
           + ("; the last split to finish combines them (log-sum-exp)" if m.splits > 1 else ""))
    grid = a.hkv * nqt * m.splits
    return body, L.Launch(grid, m.threads, "VF_ATT_BLOCK", how, attention_lds(a, m.rows_q * group, m.keys, m.splits > 1))


# ------------------------------------------------------------------------------ contract
def vector_width(r: L.Reduce, act: str, t: Target) -> int:
    """Elements per 16-byte weight load for the lane reduction ``r`` of a GEMV, or 1.  Every
    accumulator must be ``act[k] * w[row * m + k]`` with ``w`` a buffer of f16 (8 per load) or f32
    (4), or a quantized weight's elements (``QLoad``: 8 at a time, dequantized together,
    ``vf_dequant8f_*``), ``m`` and the k range multiples of that (so each load is aligned) and ``row``
    free of k."""
    k = L.Sym(r.var, "i32")
    widths = set()
    for a in r.accs:
        v = a.value
        if not (isinstance(v, L.Bin) and v.op == "mul" and isinstance(v.a, L.Load) and v.a.buf == act
                and (v.a.index == k or _row_offset(v.a.index, k) is not None)):
            return 1
        w = v.b.x if isinstance(v.b, L.Cast) and v.b.dtype == "f32" else v.b
        if not (type(w) is L.Load and w.dtype in ("f16", "f32") or type(w) is L.QLoad):
            return 1
        per = 8 if type(w) is L.QLoad else t.load_bytes // ITEMSIZE[w.dtype]
        i = w.index
        ok = (isinstance(i, L.Bin) and i.op == "add" and i.b == k and isinstance(i.a, L.Bin) and i.a.op == "mul"
              and isinstance(i.a.b, L.Const) and i.a.b.value % per == 0
              and k not in set(L.walk_exprs(i.a)))
        if not ok:
            return 1
        widths.add(per)
    extent_ok = isinstance(r.start, L.Const) and isinstance(r.stop, L.Const) and r.start.value == 0
    if len(widths) != 1 or not extent_ok or r.stop.value % next(iter(widths)):
        return 1
    return widths.pop()


def _row_offset(index, k):
    """The constant c of a matmul's activation index ``c + k`` (a row of its LDS group), else None."""
    ok = isinstance(index, L.Bin) and index.op == "add" and isinstance(index.a, L.Const) and index.b == k
    return index.a.value if ok else None


def ksplit(t: Target, rows, K: int, vec: int) -> int:
    """Waves per GEMV output row: when the rows cannot fill the chip with waves, 2 or 4 waves share
    a row's k range and combine partial sums in LDS (more loads in flight, shorter chains).  Only
    with a trip count uniform across each workgroup (every segment's rows a multiple of the rows
    a workgroup takes at once), so that the combine's barriers are safe."""
    if vec == 1:
        return 1
    return _waves_per_row(t, rows, K // vec, 2 * t.wave)


def _waves_per_row(t: Target, rows, steps: int, least: int) -> int:
    """2 or 4 waves share each of ``rows`` (of ``steps`` lane steps: vectors, blocks) while the rows
    leave most of the chip idle, each wave's slice whole and at least ``least`` steps, and every
    segment's rows a multiple of those a workgroup takes at once; else 1."""
    capacity = t.compute_units * t.blocks_per_cu * t.waves_per_block
    ks = 1
    # measured on an H200: splitting rows that fill half the chip (Qwen2.5-7B's O/down) lost 18%;
    # split only rows that leave most of it idle
    while ks < 4 and sum(rows) * ks * 4 <= capacity and steps % (ks * 2) == 0 \
            and steps // (ks * 2) >= least and t.waves_per_block % (ks * 2) == 0 \
            and all(n % (t.waves_per_block // (ks * 2)) == 0 for n in rows):
        ks *= 2
    return ks


def quant_weights(r: L.Reduce, act: str):
    """``[(acc, qload, row)]`` when every accumulator of the GEMV reduction ``r`` is
    ``act[k] * w[row * K + k]`` with ``w`` quantized and K its range (from 0), else None."""
    k = L.Sym(r.var, "i32")
    out = []
    for a in r.accs:
        v = a.value
        if not (isinstance(v, L.Bin) and v.op == "mul" and v.a == L.Load(act, k, "f32") and isinstance(v.b, L.QLoad)):
            return None
        i, K = v.b.index, r.stop
        if not (isinstance(i, L.Bin) and i.op == "add" and i.b == k and isinstance(i.a, L.Bin) and i.a.op == "mul"
                and i.a.b == K and isinstance(K, L.Const) and r.start == L.c(0) and k not in set(L.walk_exprs(i.a))):
            return None
        out.append((a, v.b, i.a.a))
    return out


def _int8_path(body, t, lds_limit) -> bool:
    """Does the GEMV run on int8 dot products: the target has them, every weight is quantized, and
    the quantized activation fits ``lds_limit`` bytes of LDS (with room for the reductions')?"""
    reds = [r for s in L.walk_stmts(body) if isinstance(s, L.Loop) and s.parallel
            for r in s.body[:1] if isinstance(r, L.Reduce)]
    arrays = [a for a in L.walk_stmts(body) if isinstance(a, L.Array)]
    act = {a.name for a in arrays}
    fits = all(a.size * ITEMSIZE[L.int8_activation()] <= lds_limit - 2048 for a in arrays)
    on = t.int8_dot and fits and L.quantized_activations()
    return bool(on and reds and act) and all(quant_weights(r, n) for r in reds for n in act
                                                     if any(x == L.Load(n, L.Sym(r.var, "i32"), "f32")
                                                            for a in r.accs for x in L.walk_exprs(a.value)))


def clear_of_templates(k: L.Kernel) -> L.Kernel:
    """A contraction's buffers renamed (a trailing ``_``) where the tiled matmul's text declares
    the same name (``mma.TEMPLATE_NAMES``: a weight ``k`` or an input ``row``), or where another
    buffer's 8-element register copy would (``x8`` beside ``x``): the text would read the local."""
    if k.family != "contract":
        return k
    names = {p.name for p in k.params}
    taken = set(mma.TEMPLATE_NAMES) | {n + "8" for n in names}
    new = {}
    for n in sorted(names & taken):
        m = n + "_"
        while m in names or m in taken or m in new.values():
            m += "_"
        new[n] = m
    return L.rename_params(k, new)


def _contract(body, t, lds_limit, budget):
    """Map the body of a contraction kernel (see the module docstring): ``lds_limit`` bytes of static
    LDS for the tiled matmul, ``budget`` bytes of LDS in all for a GEMV's activation (an activation
    beyond the static limit is declared in dynamic LDS, ``codegen.hip``)."""
    matmul = _is_matmul(body)
    tiled = mma_tiles(body, t, lds_limit) if matmul else None
    if tiled:                                              # many rows: the tiled matmul (codegen/mma.py)
        return tiled
    info = {"q8": not matmul and _int8_path(body, t, budget)}
    if (info["q8"] or _float_norm_after_dot(body, t)) and prologue.enabled():
        body = prologue.norm_after_dot(body) or body
    original = body
    body = _matmul_rows(body, t, info, lds_limit) if matmul else _contract_rows(body, t, info)
    if info.get("act_dtype") == "f16":                     # the activation is read back as f16
        act = info["act"]
        body = L.rewrite(body, lambda e: L.rewrite_expr(
            e, lambda x: L.Cast(L.Load(act, x.index, "f16"), "f32") if isinstance(x, L.Load) and x.buf == act else None))
    body = _activation_beyond_lds(_scratch(body, t) + body, info, budget)
    ks, total, K, vec = info["split"], info["total"], info["K"], info["vec"]
    per_wave = info.get("rows_per_wave", 1)
    per_cu = _blocks_per_cu(t, K, info["q8"], info.get("copied", False))
    grid = max(1, min(-(-total * ks // (t.waves_per_block * per_wave)), t.compute_units * per_cu))
    even = _balanced(t, info, matmul, grid, per_cu)
    if even:
        body, launch = _contract(original, even, lds_limit, budget)
        rows = f"{even.waves_per_block} row{'s' if even.waves_per_block > 1 else ''}"
        return body, replace(launch, how=f"{launch.how}; {rows} per workgroup, one workgroup per CU")
    whole = _whole_trips(t, info, per_cu)
    if whole:
        return _contract(original, whole, lds_limit, budget)
    stored = ""
    if "stored_q8" in info:                                # the trailing loops, now that the grid is known
        qs = {id(s): _quantize_stored(s, t, info, grid) for s in info["stored_q8"]}
        staged = [q for q in qs.values() if q.whole and q.trips * q.rows <= STAGE_LIMIT and _stage_switch()]
        qs = {i: replace(q, staged=f"{q.src}_rows") if q in staged else q for i, q in qs.items()}
        slots = [q.trips * q.per_trip for q in qs.values() if not q.whole]
        done = (L.Array("vf_done", "i32", max(slots), "lds"),) if slots else ()   # one list: each QuantizeStored
        body = done + tuple(qs.get(id(s), s) for s in body)                       # opens with a barrier
        for q in staged:                                   # read back from LDS, not global memory
            body = _staged(body, q)
        stored = "".join(f"; {q.src}{f' * {q.scale}' if q.scale else ''} also in q8_1 blocks ({q.dst})"
                         + (f" with each block's sum of squares ({q.sumsq})" if q.sumsq else "") + ", "
                         + ("each quantized by the workgroup that stores it" if q.whole else
                            "each quantized by the workgroup that completes it")
                         + f" ({q.rows} rows a trip)" for q in qs.values())
    if info["q8"]:
        lanes, per = info["lanes"], info["rows_per_lane"]
        fill = "copied in q8_1 blocks into LDS" if info.get("copied") else "quantized to q8_1 in LDS"
        how = (f"{K}-element activation {fill}; {'a wave' if lanes == t.wave else f'{lanes} lanes'} "
               f"per {f'{per} output rows' if per > 1 else 'output row'} ({total} rows); each lane takes whole weight blocks of its rows "
               f"(16-byte loads, int8 dot products){stored}")
        return body, L.Launch(grid, t.block, "VF_BLOCK", how, _lds_bytes(body), info["act_dtype"])
    where = ("in device memory, a slice a workgroup (it passes the LDS)" if info.get("act_space") == "global"
             else "in LDS")
    how = (f"{K}-element activation {where}; {'a wave' if ks == 1 else f'{ks} waves'} per output row "
           f"({total} rows); lanes stride k " + (f"{vec} elements (16 bytes) at a time" if vec > 1 and not info.get("dequant8")
                                                  else f"{vec} elements at a time, each 8 quantized weights dequantized "
                                                  "together" if vec > 1 else "one at a time"))
    if matmul:
        G = info["group"]
        rows = "one activation row" if G == 1 else f"{G} activation rows"
        how = (f"a matmul: {rows} of {K} elements at a time {where}; "
               f"{'a wave' if ks == 1 else f'{ks} waves'} per output column ({total} columns)"
               + (f", each lane folding every weight load into the {G} rows" if G > 1 else "") + "; lanes stride k "
               + (f"{vec} elements (16 bytes) at a time" if vec > 1 else "one at a time"))
    if info.get("columns"):                                # (K, N) weights: _column_loops
        cols = (f"a thread per output column of a (K, N) weight ({info['columns']} columns), each folding k "
                f"alone, consecutive lanes reading consecutive columns")
        how = f"{K}-element activation {where}; {cols}" if info.get("only_columns") else f"{how}; {cols}"
    return body, L.Launch(grid, t.block, "VF_BLOCK", how + stored, _lds_bytes(body), info.get("act_dtype", "f32"))


def _float_norm_after_dot(body, t: Target) -> bool:
    """Does a float GEMV take its RMSNorm in one pass (``codegen.prologue``): where the target asks
    (``Target.norm_after_dot``: a persistent kernel's phases; in separate kernels the float fill lost,
    docs/performance.md) and its activation stays f32 in LDS (in f16 the unnormalized ``x * g`` of a
    residual stream's outliers would pass f16's range, where the normalized values do not)?"""
    return t.norm_after_dot and all(act_dtype(t, a.size) == "f32" for a in body if isinstance(a, L.Array))


def _activation_beyond_lds(body, info, budget: int):
    """``body`` with the float activation array in device memory when the kernel's LDS would pass
    ``budget`` bytes (gfx906's 64 KiB: K above about 32,000 f16 values, Llama-3.1-405B's down
    projection): each workgroup fills and reads its own slice (``space="global"``, rendered by
    ``codegen.hip``), the loads then L2 hits instead of LDS reads.  The int8 path is only taken
    where its blocks fit (``_int8_path``), so it never comes here."""
    if _lds_bytes(body) <= budget or "act" not in info or info["q8"]:
        return body
    info["act_space"] = "global"
    return tuple(replace(s, space="global", align=16) if isinstance(s, L.Array) and s.name == info["act"] else s
                 for s in body)


def _balanced(t: Target, info, matmul: bool, grid: int, per_cu: int):
    """The target to map a GEMV on again when its grid of a wave per row fits one round of the CUs
    unevenly (Qwen2.5-7B's down projection: 448 workgroups of 8 rows, 3 or 4 per SM): one workgroup
    of ceil(rows / CUs) waves per CU, so that every CU streams the same rows; else None.  Float
    weights, or int8 dot products whose q8_1 activation is copied (its prologue is cheap once per CU).
    Only rows of at least ``t.balance_k`` elements (``VEGAFUSE_GEMV_BALANCE=0`` turns it off)."""
    waves = -(-info["total"] // t.compute_units)
    plain = not (matmul or (info["q8"] and not info.get("copied")) or info.get("columns") or "stored_q8" in info)
    if not (t.balance_k and _balance() and plain and not t.emulated_wave and info["K"] >= t.balance_k
            and info["split"] == 1 and info.get("rows_per_wave", 1) == 1):
        return None
    if grid % t.compute_units == 0 or grid >= t.compute_units * per_cu or waves * t.wave > 1024:
        return None
    return replace(t, block=waves * t.wave, blocks_per_cu=1, balance_k=0)


def _whole_trips(t: Target, info, per_cu: int):
    """The target to map a GEMV that also stores its output in q8_1 blocks (``fusion.q8``) on again
    when a workgroup's trip stores part of a block (Qwen2.5-7B's gate/up on an H200: 8 rows of a wave
    each, so four workgroups take arrivals on every block): workgroups of f = 32 / gcd(rows, 32) times
    the waves, f times fewer per CU, so that a trip stores whole blocks and the workgroup quantizes them
    itself (``vf_quantize_own``: a barrier, no fences or atomics).  None when the trips are whole
    already, or f workgroups don't make one (over ``t.whole_block`` threads, an emulated wave, fewer than
    f per CU), or ``VEGAFUSE_Q8_WHOLE=0``."""
    if "stored_q8" not in info or t.emulated_wave or not _whole_switch():
        return None
    rows = t.waves_per_block // info["split"] * info.get("rows_per_wave", 1)
    srcs = {_stored_parts(s)[0] for s in info["stored_q8"]}
    f = 32 // math.gcd(rows, 32)
    if f == 1 or any(info["stores"][b][0] % 32 for b in srcs) or t.block * f > min(1024, t.whole_block) or per_cu % f:
        return None
    return replace(t, block=t.block * f, blocks_per_cu=max(1, t.blocks_per_cu // f), int8_blocks_per_cu=per_cu // f,
                   int8_prologue_budget=0)


STAGE_LIMIT = 2048      # values a workgroup keeps in LDS for its own q8_1 blocks (8 KiB)


def _stage_switch() -> bool:
    """``VEGAFUSE_Q8_STAGE=0``: a workgroup quantizing the blocks it stored reads them back from global
    memory instead of from LDS (A/B)."""
    return switch("VEGAFUSE_Q8_STAGE", True)


def _staged(body, q):
    """``body`` with each store ``src[i] = v`` of the whole-trip ``QuantizeStored`` ``q`` also keeping
    ``v`` in the LDS array ``{src}_rows`` (``q.trips * q.rows`` values, trip after trip): row i of the
    loop's row space (``i - first``) at ``(i - first) % rows + rows * ((i - first) / (rows * grid))``."""
    stage, count = f"{q.src}_rows", [0]

    def st(s):
        if isinstance(s, L.Store) and s.buf == q.src:
            r = L.add(s.index, L.c(-q.first)) if q.first else s.index
            at = L.Bin("mod", r, L.c(q.rows))
            if q.trips > 1:
                at = L.add(at, L.mul(L.c(q.rows), L.Bin("idiv", r, L.mul(L.c(q.rows), L.Hw("grid")))))
            count[0] += 1
            v = L.Sym(f"{q.src}_r{count[0] - 1}", "f32")
            return (L.Declare(v.name, "f32", s.value), replace(s, value=v), L.Store(stage, at, v))
        if isinstance(s, L.If):
            return (L.If(s.cond, _flat(s.then, st), _flat(s.orelse, st)),)
        if isinstance(s, L.Loop):
            return (replace(s, body=_flat(s.body, st)),)
        return (s,)
    return (L.Array(stage, "f32", q.trips * q.rows, "lds"),) + _flat(body, st)


def _flat(body, f):
    return tuple(x for s in body for x in f(s))


def _copy16() -> bool:
    """``VEGAFUSE_COPY16=0``: a float GEMV's fill that only copies its input takes a float a thread
    per trip, as any fill (A/B)."""
    return switch("VEGAFUSE_COPY16", True)


def _whole_switch() -> bool:
    """``VEGAFUSE_Q8_WHOLE=0``: every q8_1 block a GEMV stores is quantized by arrivals (A/B)."""
    return switch("VEGAFUSE_Q8_WHOLE", True)


def _blocks_per_cu(t: Target, K: int, int8: bool, copied: bool = False) -> int:
    """Workgroups per CU a GEMV grid aims for: the target's; for int8 dot products its own figure,
    fewer when the activation is so long that its quantization (every workgroup's prologue) would
    take more than the target's budget of elements per CU, unless the prologue only copies q8_1
    blocks an earlier kernel wrote (``copied``).  ``VEGAFUSE_GEMV_BLOCKS_PER_CU`` overrides (A/B)."""
    per_cu = t.blocks_per_cu
    if int8:
        per_cu = t.int8_blocks_per_cu or per_cu
        if t.int8_prologue_budget and _balance() and not copied:
            per_cu = max(1, min(per_cu, t.int8_prologue_budget // K))
    return env_int("VEGAFUSE_GEMV_BLOCKS_PER_CU", per_cu, 1)


def _contract_rows(body, t, info):
    out, segs, comments, arrays, early = [], [], [], set(), []
    for s in body:
        if isinstance(s, L.Comment):                            # opens the next section
            comments.append(s)
            continue
        if isinstance(s, L.Loop) and s.parallel:               # a segment: its output rows
            segs.append((tuple(comments), s))
            comments = []
            continue
        if segs and isinstance(s, L.Declare):                  # an invariant the simplifier hoisted out of the
            early.append(s)                                    # next segment (a clamped position): computed
            continue                                           # before the wave loop, which stays one
        if segs:
            out += early + _rows_of(segs, t, info)
            segs, early = [], []
        out += comments
        comments = []
        if isinstance(s, L.Store) and s.buf in arrays:         # K = 1: the fill without its loop
            s = L.Loop(f"{s.buf}_k", L.c(0), L.c(1), (s,))
        if isinstance(s, L.Loop) and isinstance(s.body[-1], L.Store) and s.body[-1].buf in arrays \
                and all(isinstance(d, L.Declare) for d in s.body[:-1]):
            s = replace(s, body=(_inlined(s.body),))           # a fill with locals (a gathered activation)
        if isinstance(s, L.QuantizeQ8) and len(s.values) == 32:   # one block: its loop dropped
            s = L.Loop(f"{s.arr}_blk", L.c(0), L.c(1), (s,))
        if _stored_q8(s):                                       # the q8_1 form of a buffer this GEMV stores
            info.setdefault("stored_q8", []).append(s)         # (fusion.q8): after the wave loop, in _contract
            out.append(s)
        elif isinstance(s, L.Loop) and isinstance(s.body[0], L.Store) and s.body[0].buf in arrays and info["q8"]:
            info["act"], info["K"], info["act_dtype"] = s.body[0].buf, s.stop.value, L.int8_activation()
            src = _q8_source(s)
            out += [L.CopyQ8(s.body[0].buf, src.buf, src.count // 32) if src else _quantize_fill(s, t), L.Barrier()]
            info["copied"] = src is not None
        elif isinstance(s, L.Loop) and isinstance(s.body[0], L.Store) and s.body[0].buf in arrays:
            info["act"], K = s.body[0].buf, s.stop.value
            dt = act_dtype(t, K)
            st = s.body[0]
            value = L.Cast(st.value, dt) if dt != "f32" else st.value
            # the fill is latency-bound (one global load per thread per trip): unrolled, several loads
            # are in flight (measured on an H200: O/down projections 2906 -> 3131 GB/s)
            k = L.Sym(s.var, "i32")
            if (dt == "f32" and K % 4 == 0 and s.start == L.c(0) and st.index == k and isinstance(st.value, L.Load)
                    and st.value == L.Load(st.value.buf, k, "f32") and _copy16()):
                out += [L.CopyF32(st.buf, st.value.buf, K), L.Barrier()]        # a plain copy: 16 bytes a load
            else:
                out += [replace(s, map="block", unroll=t.prologue_unroll, body=(L.Store(st.buf, st.index, value),)),
                        L.Barrier()]
            info["act_dtype"], info["K"] = dt, K
        elif isinstance(s, L.Reduce) and s.body:               # a fill that shares the norm's loop (codegen.prologue)
            out.append(_fill_with_norm(s, t, info))
        elif isinstance(s, L.Array):
            arrays.add(s.name)
            dt = L.int8_activation() if info["q8"] else act_dtype(t, s.size)
            # f32: read 16 bytes at a time (vf_dot8_h's float4, vf_copy_f32)
            out.append(replace(s, dtype=dt, space="lds", align=16 if dt == "f32" else 0))
        elif isinstance(s, L.Loop):                            # a serial row loop (a matmul's rows)
            out.append(replace(s, body=_contract_rows(s.body, t, info) + (L.Barrier(),)))
        elif isinstance(s, L.Reduce) and _short(s, t):          # each wave folds it alone: no LDS, no barrier;
            at = len(out) - 1 if out and isinstance(out[-1], L.Barrier) else len(out)   # the fill's barrier after
            out.insert(at, replace(s, map="lane"))              # it (its loads in flight with the fill's)
        elif isinstance(s, L.Reduce):
            out.append(_block_reduce(s))
        else:
            out.append(s)
    if segs:
        out += early + _rows_of(segs, t, info)
    return tuple(out + comments)


def _short(r: L.Reduce, t: Target) -> bool:
    """Is ``r`` a sum of at most two steps a lane (the block sums of squares a normalizing GEMV reads,
    ``fusion.q8``), which every wave folds alone rather than the workgroup together?"""
    n = r.stop.value - r.start.value if isinstance(r.stop, L.Const) and isinstance(r.start, L.Const) else None
    return (n is not None and n <= 2 * t.wave and not r.body
            and all(a.op == "add" and a.dtype == "f32" for a in r.accs))


def _rows_of(segs, t, info):
    """``_wave_loop`` of ``segs``, noting for each buffer a segment stores at its row where the buffer's
    rows lie in the loop's row space and the rows a workgroup's trip takes (``_quantize_stored``)."""
    loop = list(_wave_loop(segs, t, info))
    rows = t.waves_per_block // info["split"] * info.get("rows_per_wave", 1)
    for buf, off in _row_offsets(segs).items():
        info.setdefault("stores", {})[buf] = (off, rows, info["total"])
    return loop


def _q8_source(fill):
    """The producer's q8_1 buffer that a GEMV fill ``act[k] = src.block[k / 32][k % 32]`` reads
    (``fusion.q8``: a ``QLoad`` of the int8 activation's format at k), else None."""
    v = fill.body[0].value
    ok = isinstance(v, L.QLoad) and v.fmt == L.int8_activation() and v.index == L.Sym(fill.var, "i32")
    return v if ok else None


def _stored_q8(s) -> bool:
    """Is ``s`` the loop ``for b: dst.block[b] = q8_1(src[32 b .. 32 b + 31])`` that ``fusion.q8`` appends
    to the GEMV storing ``src`` (or of ``src * g``, each block's sum of squares of ``src`` stored beside)?"""
    return _stored_parts(s) is not None


def _stored_parts(s):
    """``(src, g, ss)`` of a ``_stored_q8`` loop (``g`` and ``ss`` "" when it only quantizes ``src``), else None."""
    if not (isinstance(s, L.Loop) and not s.parallel and 1 <= len(s.body) <= 2 and isinstance(s.body[0], L.QuantizeQ8)
            and len(s.body[0].values) == 32):
        return None
    vals = s.body[0].values
    if all(type(v) is L.Load for v in vals) and len(s.body) == 1:
        return vals[0].buf, "", ""
    scaled = all(isinstance(v, L.Bin) and v.op == "mul" and type(v.a) is L.Load and type(v.b) is L.Load
                 and v.a.index == v.b.index for v in vals)
    st = s.body[-1]
    if not (scaled and len(s.body) == 2 and isinstance(st, L.Store) and st.index == L.Sym(s.var, "i32")
            and len({(v.a.buf, v.b.buf) for v in vals}) == 1):
        return None
    return vals[0].a.buf, vals[0].b.buf, st.buf


def _row_offsets(segs) -> dict:
    """{buffer: its first row in the wave loop's row space} for each buffer a segment stores at its
    row (the segments side by side in order; those of order "outer" are column loops, not rows)."""
    out, off = {}, 0
    for _, s in segs:
        if any(isinstance(x, L.Reduce) and x.order == "outer" for x in s.body):
            continue
        for st in L.walk_stmts(s.body):
            if isinstance(st, L.Store) and st.index == L.Sym(s.var, "i32"):
                out.setdefault(st.buf, off)
        off += s.stop.value
    return out


def _quantize_stored(loop, t, info, grid):
    """The producer's ``_stored_q8`` loop as ``QuantizeStored``, whose LDS list of the blocks the workgroup
    completes is ``vf_done`` (one for all of a producer's buffers, sized by ``_contract``): trip j of workgroup
    b stores the wave loop's rows (b + j grid) R .. + R - 1,
    R = the rows of the workgroup's waves (``rows_per_wave`` each, ``split`` waves sharing a row), and
    ``src`` lies at row ``off`` of them (``_rows_of``)."""
    src, scale, sumsq = _stored_parts(loop)
    dst, n = loop.body[0].arr, 32 * loop.stop.value
    off, rows, total = info["stores"][src]
    first, trips, per_trip = -off, -(-total // (grid * rows)), 1
    for r in range(0, total, rows):                         # the most blocks one trip's rows touch
        lo, hi = max(r + first, 0), min(r + first + rows, n)
        if lo < hi:
            per_trip = max(per_trip, (hi - 1) // 32 - lo // 32 + 1)
    whole = rows % 32 == 0 and first % 32 == 0 and _whole_switch()
    return L.QuantizeStored(src, dst, n, first, rows, trips, per_trip, "vf_done", whole, scale=scale, sumsq=sumsq)


def matmul_rows(s: L.Loop):
    """The loop over a tile's rows that a matmul's column loop ``s`` holds (``fusion.schedule.row_tiles``),
    with the column's locals (a bias loaded once per column) substituted into it; None when ``s``
    is not a matmul's column loop (its body locals and one serial loop opening with a Reduce of
    "add" accumulators over a constant row range)."""
    *head, rows = s.body or (None,)
    if not (s.parallel and isinstance(rows, L.Loop) and not rows.parallel and isinstance(rows.stop, L.Const)
            and rows.body and isinstance(rows.body[0], L.Reduce) and all(isinstance(d, L.Declare) for d in head)
            and all(a.op == "add" for a in rows.body[0].accs)):
        return None
    body = rows.body
    for d in reversed(head):
        body = L.substitute(body, {d.name: d.init})
    return replace(rows, body=body)


def _is_matmul(body) -> bool:
    """Is ``body`` the matmul form: every column loop a matmul's (``matmul_rows``)?"""
    segs = [s for s in L.walk_stmts(body) if isinstance(s, L.Loop) and s.parallel]
    return bool(segs) and all(matmul_rows(s) is not None for s in segs)


def matmul_group(t: Target, tile: int, K: int, lds_limit: int) -> int:
    """Activation rows a matmul workgroup holds in LDS at once (and each lane folds into every
    weight load): at most 8 (its accumulators stay in registers) and the tile's rows, the f16/f32
    rows within ``MATMUL_LDS`` bytes (or ``lds_limit`` less 4 KiB, where that is less: a fixed
    budget, so that gfx906 and the NVIDIA wave-64 flavour of its text choose alike)."""
    size = ITEMSIZE[act_dtype(t, K)] * K
    return max(1, min(8, tile, min(MATMUL_LDS, lds_limit - 4096) // size))


MATMUL_LDS = 32 << 10


def _matmul_rows(body, t, info, lds_limit):
    """The matmul form on a GPU: each tile's rows in groups of G (``matmul_group``); per group the
    workgroup fills G activation rows into LDS (each row's prologue reductions block-wide), then
    the segments' output columns run as a GEMV's wave loop whose lane reduction folds each 16-byte
    weight load into G accumulators (one per row: the weight is read once per G rows), and lane 0
    stores the G rows' epilogues."""
    out, segs, comments = [], [], []
    for s in body:
        if isinstance(s, L.Comment):
            comments.append(s)
        elif isinstance(s, L.Loop) and s.parallel:
            segs.append((tuple(comments), s))
            comments = []
        elif isinstance(s, L.Array):
            arr = s
        elif isinstance(s, L.Loop) and not _is_matmul(s.body):             # the fill of the tile's rows
            fill = s
            out += comments
            comments = []
        elif isinstance(s, L.Loop):                 # the loop over row tiles (its LDS declared before it)
            inner = _matmul_rows(s.body, t, info, lds_limit)
            lds = tuple(x for x in inner if isinstance(x, L.Array))
            out = list(lds) + out + comments + [replace(s, body=tuple(x for x in inner if x not in lds) + (L.Barrier(),))]
            comments = []
        else:
            out.append(s)
    if not segs:
        return tuple(out + comments)
    TR = fill.stop.value
    K = arr.size // TR
    G = matmul_group(t, TR, K, lds_limit)
    groups = -(-TR // G)
    dt = act_dtype(t, K)
    r, g = fill.var, L.Sym("group_0", "i32")             # locals end in a counter, dropped by loopir.tidy_names
    ri = L.Sym("group_row_0", "i32")

    def column(i):                     # x of act[r * K + x] (K = 1: the index is r alone)
        return i.b if isinstance(i, L.Bin) and i.op == "add" else L.c(0)

    def rows(body, local, row):        # act[r * K + x] -> act[local * K + x]; then r -> the tile's row
        def ex(e):
            return L.rewrite_expr(e, lambda x: replace(x, index=L.add(L.mul(local, L.c(K)), column(x.index)))
                                  if isinstance(x, L.Load) and x.buf == arr.name else None)
        body = L.rewrite(body, ex)
        body = tuple(replace(st, index=L.add(L.mul(local, L.c(K)), column(st.index)))
                     if isinstance(st, L.Store) and st.buf == arr.name else st for st in body)
        return L.substitute(body, {r: row})
    at = L.add(L.mul(g, L.c(G)), ri) if groups > 1 else ri
    first = L.Bin("min", at, L.c(TR - 1)) if TR % G else at

    def fill_stmt(s):
        if isinstance(s, L.Reduce):
            return _block_reduce(s)
        if isinstance(s, L.Loop):
            st = _inlined(rows(s.body, ri, first))     # a gathered row's locals substituted (a MoE expert)
            value = L.Cast(st.value, dt) if dt != "f32" else st.value
            return replace(s, map="block", unroll=t.prologue_unroll, body=(L.Store(st.buf, st.index, value),))
        return s
    last = fill.body[-1]
    if isinstance(last, L.Store):                        # K = 1: the fill without its k loop
        last = L.Loop("k_0", L.c(0), L.c(1), (last,))
    fill_body = tuple(fill_stmt(s) for s in rows(fill.body[:-1], ri, first) + (last,))
    group = ((L.Loop(ri.name, L.c(0), L.c(G), fill_body),) if G > 1 else L.substitute(fill_body, {ri.name: L.c(0)})) \
        + (L.Barrier(),)
    new_segs = []
    for cmts, s in segs:
        red, *rest = matmul_rows(s).body
        accs, stores = [], []
        for u in range(G):
            local = L.c(u)
            row = L.add(L.mul(g, L.c(G)), local) if groups > 1 else local
            names = {a.name: _renamed(a.name, u) for a in red.accs} if G > 1 else {}
            syms = {a.name: L.Sym(names[a.name], a.dtype) for a in red.accs if a.name in names}
            red_u = rows((red,), local, L.Bin("min", row, L.c(TR - 1)) if TR % G else row)[0]
            accs += [replace(a, name=names.get(a.name, a.name)) for a in red_u.accs]
            body_u = L.substitute(rows(tuple(rest), local, row), syms)
            if G > 1:                                    # the epilogue's own locals, once per row
                own = {x: _renamed(x, u) for x in L.local_names(body_u)}
                body_u = L.rewrite(body_u, lambda e: L.rewrite_expr(e, lambda x: L.Sym(own[x.name], x.dtype)
                                                                    if isinstance(x, L.Sym) and x.name in own else None),
                                   lambda n: own.get(n, n))
            stores += body_u if not TR % G or (groups - 1) * G + u < TR else [L.If(L.Bin("lt", row, L.c(TR)), body_u)]
        new_segs.append((cmts, replace(s, body=(replace(red, accs=tuple(accs)),) + tuple(stores))))
    info["act"], info["K"], info["act_dtype"], info["group"] = arr.name, K, dt, G
    loop = _wave_loop(new_segs, t, info)
    part = tuple(x for x in loop if isinstance(x, L.Array))              # LDS of a k split: declared first
    group += tuple(x for x in loop if not isinstance(x, L.Array)) + (L.Barrier(),)
    out = [replace(arr, size=G * K, dtype=dt, space="lds"), *part] + out
    out += [L.Loop(g.name, L.c(0), L.c(groups), group)] if groups > 1 else L.substitute(group, {g.name: L.c(0)})
    return tuple(out + comments)


def _inlined(body):
    """The last statement of ``body`` (a Store) with the locals declared before it substituted."""
    *decls, st = body
    for d in reversed(decls):
        st = L.substitute((st,), {d.name: d.init})[0]
    return st


def _groups(K, t):
    """The q8_1 fill's trips over groups of 4 values: ``(g, at, active, trips)``, with ``at`` the
    group a thread reads (clamped: every thread takes the same trips) and ``active`` whether it is
    one of the K / 4."""
    groups = K // 4
    trips = -(-groups // t.block) * t.block
    g = L.Sym("g_0", "i32")                 # locals end in a counter, dropped by loopir.tidy_names
    if trips == groups:
        return g, g, L.Const(True, "bool"), trips
    return g, L.Bin("min", g, L.c(groups - 1)), L.Bin("lt", g, L.c(groups)), trips


def _at(e, var, at, i):
    """``e`` (of loop variable ``var``) at element ``4 at + i``."""
    return L.substitute_expr(e, {var: L.add(L.mul(at, L.c(4)), L.c(i))})


def _quantize_fill(s, t):
    """The GEMV prologue's fill ``for k: act[k] = value`` as q8_1: each thread computes 4
    consecutive values, and the 8 threads of a block quantize them together (``QuantizeQ8``).
    Every thread takes the same trips (the shuffles need the whole wave), the last ones only
    helping."""
    st = s.body[0]
    g, at, active, trips = _groups(s.stop.value, t)
    xs = [L.Sym(f"x{i}_0", "f32") for i in range(4)]
    body = tuple(L.Declare(x.name, "f32", _at(st.value, s.var, at, i)) for i, x in enumerate(xs))
    # unrolled, the trips' loads are in flight together (as the float fill's)
    return L.Loop(g.name, L.c(0), L.c(trips), body + (L.QuantizeQ8(st.buf, g, tuple(xs), active),), map="block",
                  unroll=t.prologue_unroll)


def _fill_with_norm(r, t, info):
    """The q8_1 fill that ``codegen.prologue`` folded into its norm's reduction (``r.body``), mapped
    as ``_quantize_fill``, the reduction taking the same trips over the groups' 4 values; no
    barrier after it: the block sum's own make the activation seen by every wave."""
    st, K = r.body[0], r.stop.value
    (acc,) = r.accs
    if not info["q8"]:
        return _float_fill_with_norm(r, t, info)
    info["act"], info["K"], info["act_dtype"], info["copied"] = st.buf, K, L.int8_activation(), False
    g, at, active, trips = _groups(K, t)
    sq = prologue.squared(acc.value, st.value)            # the norm's x * x: x read once, into a local
    if sq:
        xs = [L.Sym(f"x{i}_0", "f32") for i in range(4)]
        decls = tuple(L.Declare(x.name, "f32", _at(sq[0], r.var, at, i)) for i, x in enumerate(xs))
        values = tuple(L.Bin("mul", x, _at(sq[1], r.var, at, i)) for i, x in enumerate(xs))
        terms = [L.Bin("mul", x, x) for x in xs]
    else:
        decls, values = (), tuple(_at(st.value, r.var, at, i) for i in range(4))
        terms = [_at(acc.value, r.var, at, i) for i in range(4)]
    v = terms[0]
    for x in terms[1:]:
        v = L.Bin("add", v, x)
    v = v if active == L.Const(True, "bool") else L.Select(active, v, L.Const(0.0, acc.dtype))
    return replace(r, var=g.name, start=L.c(0), stop=L.c(trips), accs=(replace(acc, value=v),), map="block",
                   body=decls + (L.QuantizeQ8(st.buf, g, values, active),), unroll=t.prologue_unroll)


def _float_fill_with_norm(r, t, info):
    """The float fill that ``codegen.prologue`` folded into its norm's reduction: the workgroup's threads
    take k in turn, each ``x[k]`` read once into a local for both the sum of squares and the fill (its
    block sum's barriers make the activation seen by every wave)."""
    st, K, (acc,) = r.body[0], r.stop.value, r.accs
    info["act"], info["K"], info["act_dtype"] = st.buf, K, "f32"      # f32 only (_float_norm_after_dot)
    sq = prologue.squared(acc.value, st.value)            # the norm's x * x: x read once, into a local
    decls, value = (), st.value
    if sq:
        x = L.Sym("vf_x", "f32")                          # vf_: no user's name (fusion.naming)
        decls, value, acc = (L.Declare(x.name, "f32", sq[0]),), L.Bin("mul", x, sq[1]), replace(acc, value=L.Bin("mul", x, x))
    # a whole number of the workgroup's steps, few enough for registers: every step's x loaded at once
    whole = r.start == L.c(0) and K % t.block == 0 and K // t.block <= WHOLE_FILL_STEPS and _fill_steps_switch()
    return replace(r, map="block", unroll=0 if whole else t.prologue_unroll, whole=whole, accs=(acc,),
                   body=decls + (L.Store(st.buf, st.index, value),))


WHOLE_FILL_STEPS = 16      # steps a thread of a norm's fill (codegen.prologue) takes with all its loads at once


def _fill_steps_switch() -> bool:
    """``VEGAFUSE_FILL_STEPS=0``: a norm's one-pass fill takes its steps one after another (A/B: with a
    step a load's latency, the 1.5B persistent kernel's fills took 1.3-1.8 µs against 0.3-0.6)."""
    return switch("VEGAFUSE_FILL_STEPS", True)


def _lanes_per_row(t, K, sizes):
    """Lanes that share one quantized GEMV row: enough for its K / 32 blocks (a power of two, at
    most the wave), so that a wave takes several short rows side by side; every segment's rows a
    multiple of the rows a wave takes at once (uniform trips, no divergent shuffles).  Where the
    blocks leave lanes idle (48 over 32 lanes: a quarter of the lane steps empty), half the wave
    takes a row when it divides them in at most ``t.int8_full_lanes`` blocks a lane."""
    nb = K // 32
    lanes = min(t.wave, 1 << max(0, (nb - 1).bit_length()))
    half = lanes // 2
    if (t.int8_full_lanes and _full_lanes_switch() and lanes == t.wave and nb % lanes and nb % half == 0
            and nb // half <= t.int8_full_lanes):
        lanes = half
    while lanes < t.wave and any(n % (t.wave // lanes) for n in sizes):
        lanes *= 2
    return lanes


def _full_lanes_switch() -> bool:
    """``VEGAFUSE_INT8_FULL_LANES=0``: a wave per row however many lanes its blocks leave idle (A/B)."""
    return switch("VEGAFUSE_INT8_FULL_LANES", True)


def rows_per_lane(sizes, rows_per_wave, most=4, idle=None) -> int:
    """Rows each lane folds against every activation block it reads from LDS (``most`` or fewer, a
    power of two dividing every segment's rows): one LDS read serves several weight blocks (the
    LDS-per-weight-byte metric of ``codegen.inspect``), and more 16-byte loads are in flight.
    ``idle(u)``, when given (targets with ``int8_balance``), is the share of wave slots idle in the
    grid's rounds with ``u`` rows per lane: the smallest ``u`` within 0.1 of the least idle one wins.
    On an H200 the waves' loads in flight matter more than the LDS reads saved: Qwen2.5-7B q4_0
    decoded at 403.6 tok/s with one row per lane against 365.8 with up to 4 (1.5B: 818.6 against
    713.1), and a last round that keeps a few waves busy while the rest wait costs more still.
    ``VEGAFUSE_QUANT_ROWS`` overrides ``most`` (A/B)."""
    most = env_int("VEGAFUSE_QUANT_ROWS", most, 1)
    fits = [u for u in (8, 4, 2, 1) if u <= most and all(n % (u * rows_per_wave) == 0 for n in sizes)]
    if idle is None:
        return fits[0]
    least = min(idle(u) for u in fits)
    return min(u for u in fits if idle(u) <= least + 0.1)


def _balance() -> bool:
    """The int8 GEMV's balance rules (``Target.int8_balance``, ``int8_prologue_budget``) are on;
    ``VEGAFUSE_GEMV_BALANCE=0`` turns them off (A/B), and the float GEMV's one round per CU
    (``_balanced``)."""
    return switch("VEGAFUSE_GEMV_BALANCE", True)


def _idle_share(tasks: int, capacity: int) -> float:
    """The share of ``capacity`` wave slots idle over the rounds that ``tasks`` wave tasks take (0 when
    they fit one round: filling the chip is the k split's business)."""
    rounds = -(-tasks // capacity)
    return 0.0 if rounds <= 1 else 1 - tasks / (rounds * capacity)


def _renamed(a, u):
    """Accumulator ``a`` for the ``u``-th row of a lane: ``acc_w_q_12`` -> ``acc_w_q_r1_12``."""
    base, num = re.fullmatch(r"(.*?)(_\d+)?", a).groups()
    return f"{base}_r{u}{num or ''}"


def _quant_wave_loop(segs, t, info):
    """``_wave_loop`` for quantized weights: the wave loop takes tiles of ``rows_per_lane`` rows;
    each lane folds whole weight blocks of its tile's rows against one q8_1 activation block
    (``QDot``), ``lanes`` lanes per tile."""
    sizes = [s.stop.value for _, s in segs]
    K = info["K"]
    lanes = _lanes_per_row(t, K, sizes)
    side = t.wave // lanes                               # tiles a wave takes side by side
    # waves share a tile's blocks when the tiles leave the chip idle (as ksplit), a block per lane at least
    split = lambda u: _waves_per_row(t, [n // u for n in sizes], K // 32, t.wave) if lanes == t.wave else 1  # noqa: E731
    capacity = t.compute_units * _blocks_per_cu(t, K, True, info.get("copied", False)) * t.waves_per_block
    idle = (lambda u: _idle_share(sum(sizes) // (side * u) * split(u), capacity)) if t.int8_balance and _balance() else None  # noqa: E731
    per = rows_per_lane(sizes, side, t.int8_rows_per_lane, idle)
    ks = split(per)
    info.update(split=ks, total=sum(sizes), vec=32, rows_per_wave=side * per, lanes=lanes, rows_per_lane=per)
    tile = L.Sym("tile_0", "i32")
    kb = L.Sym("kb_0", "i32")
    # a group's sum is in its last lane (vf_lanes_sum); a whole wave's in every lane (vf_wave_sum)
    last = L.Bin("eq", LANE, L.c(0)) if lanes == t.wave else L.Bin("eq", L.Bin("mod", LANE, L.c(lanes)), L.c(lanes - 1))
    if ks > 1:                                           # the first of the waves that share a tile
        last = L.Bin("and", last, L.Bin("eq", L.Bin("mod", WAVE, L.c(ks)), L.c(0)))
    branches, off = [], 0
    for (comments, s), n in zip(segs, sizes):
        red, *rest = s.body
        own = tile
        if off:                                          # the segment's own tiles, named after its weight
            acc = red.accs[0].name
            own = L.Sym("tile" + acc[len("acc"):] if acc.startswith("acc_") else f"tile_{s.var}", "i32")
        accs, epilogue = [], []
        for u in range(per):
            names = {a.name: _renamed(a.name, u) for a in red.accs} if per > 1 else {}
            row = {s.var: L.add(L.mul(own, L.c(per)), L.c(u))}
            syms = {a: L.Sym(b, "f32") for a, b in names.items()}
            # the epilogue's own locals (RoPE's angle, a pair's head) are declared once per row
            own_locals = {d.name: _renamed(d.name, u) for d in L.walk_stmts(tuple(rest))
                          if isinstance(d, L.Declare)} if per > 1 else {}
            ren = lambda body: L.rewrite(L.substitute(L.substitute(body, row), syms), lambda e: L.rewrite_expr(  # noqa: E731
                e, lambda x: L.Sym(own_locals[x.name], x.dtype) if isinstance(x, L.Sym) and x.name in own_locals
                else None), lambda n: own_locals.get(n, n))
            for a, q, r in quant_weights(red, info["act"]):
                blk = L.add(L.mul(L.substitute_expr(r, row), L.c(K // 32)), kb)
                accs.append(replace(a, name=names.get(a.name, a.name),
                                    value=L.QDot(q.buf, q.fmt, blk, q.count, info["act"], kb)))
            epilogue += ren(tuple(rest))
        unroll = _block_unroll(K // 32 // (lanes * ks))
        red = L.Reduce(kb.name, L.c(0), L.c(K // 32), tuple(accs), map="lane", split=ks,
                       lanes=0 if lanes == t.wave else lanes, unroll=unroll,
                       whole=not unroll and whole_steps(t, -(-(K // 32) // (lanes * ks))))
        seg = (red, L.If(last, tuple(epilogue)))
        if off:
            seg = (L.Declare(own.name, "i32", L.Bin("sub", tile, L.c(off // per))),) + seg
        branches.append(((off + n) // per, comments + seg))
        off += n
    gptq = any(q.fmt == "gptq_int4" for _, s in segs for _, q, _ in quant_weights(s.body[0], info["act"]))
    return _segments(tile, branches, t, ks, per * max(len(s.body[0].accs) for _, s in segs), off // per,
                     lanes=0 if lanes == t.wave else lanes, unroll=trip_unroll(t, -(-(K // 32) // (lanes * ks)), gptq))


def trip_unroll(t: Target, blocks: int, gptq: bool) -> int:
    """Unroll of an int8 GEMV's wave loop over its tiles, so that a lane has several tiles' weight
    loads in flight, on targets with ``t.int8_trip_unroll``: that much where a lane folds at most 2
    blocks of a row (its own loads are too few to hide the latency), 2 where any of its weights is
    gptq_int4 (``gptq``: each block's dot waits on its group's scale and zero point), else none.
    ``VEGAFUSE_TRIP_UNROLL`` overrides (A/B; 0: none)."""
    rule = 0 if not t.int8_trip_unroll else t.int8_trip_unroll if blocks <= 2 else 2 if gptq else 0
    return env_int("VEGAFUSE_TRIP_UNROLL", rule, 0)


def whole_steps(t: Target, steps: int) -> bool:
    """Whether an int8 GEMV lane's loop over weight blocks, of ``steps`` steps (at most; the last
    may leave some lanes out), is written as that constant count, fully unrolled with each step
    guarded, so that all of its loads are in flight at once: up to ``t.int8_whole_steps`` steps
    (gfx906: never; its main loop then read LDS 0.090 times per weight byte, over the 0.056 gate,
    and it is not measured there).  A loop over ``kb += VF_WAVE`` has no count the compiler knows,
    so each step's loads waited on the last's.
    On an H200 (2026-12-03, A/B/A against ``VEGAFUSE_WHOLE_STEPS=0``): Qwen2.5-7B q4_0 517 against
    473 tok/s, gptq_int4 468 against 418, 1.5B q4_0 959 against 934; the float GEMV's loop (vector
    steps, under ``VF_UNROLL_K``) lost 6% at 1.5B f16 written so, and keeps its loop.
    ``VEGAFUSE_WHOLE_STEPS`` sets the most steps (0: never; A/B)."""
    return steps <= env_int("VEGAFUSE_WHOLE_STEPS", t.int8_whole_steps)


def _block_unroll(trips: int) -> int:
    """Unroll of an int8 GEMV lane's loop over weight blocks: 4 when a lane folds 16 blocks or more,
    2 from 8 (long K, e.g. a down projection: several blocks' loads in flight); else the compiler's
    choice.  Measured on an H200, Qwen2.5-7B's down projection (18.5 blocks a lane): 22.2 us not
    unrolled, 19.4 (an older mapping) and 14.0 by 2, 9.7 by 4; its LM head (3.5 blocks a lane) was
    slower by 4, and its gate/up lost 10% by 2 in 256-thread workgroups.  ``VEGAFUSE_QUANT_UNROLL``
    overrides (A/B; 0: the compiler's choice)."""
    return env_int("VEGAFUSE_QUANT_UNROLL", 4 if trips >= 16 else 2 if trips >= 8 else 0, 0)


def _column_loops(segs, t, info):
    """Segments of order "outer" (a (K, N) weight, ``x @ w``): each thread of the grid takes output
    columns n alone and folds k serially; consecutive lanes take consecutive columns, so each step k
    of a wave is one contiguous (coalesced) run of a weight row."""
    columns = sum(s.stop.value for _, s in segs)
    info["columns"] = info.get("columns", 0) + columns
    if "total" not in info:                # no wave loop: the grid covers the columns a thread each
        info.update(split=1, total=columns, vec=1, rows_per_wave=t.wave, only_columns=True)
    return tuple(x for comments, s in segs for x in comments + (replace(s, map="thread", body=_per_thread(s.body)),))


def _wave_loop(segs, t, info):
    """One loop over the waves of the grid for the output rows of every segment, side by side
    (segments of order "outer": ``_column_loops`` after it)."""
    outer = [(c, s) for c, s in segs if any(isinstance(x, L.Reduce) and x.order == "outer" for x in s.body)]
    if outer:
        inner = [x for x in segs if x not in outer]
        return (_wave_loop(inner, t, info) if inner else ()) + _column_loops(outer, t, info)
    if info["q8"]:
        return _quant_wave_loop(segs, t, info)
    sizes = [s.stop.value for _, s in segs]
    vecs = [vector_width(s.body[0], info["act"], t) for _, s in segs]
    vec = min(vecs)                        # a split needs every segment's slices whole vectors
    info["dequant8"] = vec > 1 and any(isinstance(x, L.QLoad) for _, s in segs for a in s.body[0].accs
                                       for x in L.walk_exprs(a.value))
    ks = ksplit(t, sizes, info["K"], max(vecs) if vec > 1 else 1)
    info.update(split=ks, total=sum(sizes), vec=vec)
    row = L.Sym("row_0", "i32")
    branches, off = [], 0
    for (comments, s), n, v in zip(segs, sizes, vecs):
        red, *rest = s.body
        red = replace(red, map="lane", vector=v, split=ks)
        first = L.Bin("eq", LANE, L.c(0))
        if ks > 1:
            first = L.Bin("and", first, L.Bin("eq", L.Bin("mod", WAVE, L.c(ks)), L.c(0)))
        seg = (red, L.If(first, tuple(rest)))
        if off == 0:
            seg = L.substitute(seg, {s.var: row})
        else:                              # the segment's own row, named after its first weight
            own = L.Sym("row" + red.accs[0].name[len("acc"):] if red.accs[0].name.startswith("acc_") else s.var, "i32")
            seg = (L.Declare(own.name, "i32", L.Bin("sub", row, L.c(off))),) + L.substitute(seg, {s.var: own})
        branches.append((off + n, comments + seg))
        off += n
    return _segments(row, branches, t, ks, max(len(s.body[0].accs) for _, s in segs), off)


def _segments(var, branches, t, ks, accs, stop, lanes=0, unroll=0):
    """The wave loop over ``var`` in [0, stop) whose body picks a segment by ``var`` (``branches``:
    (end, statements) in order); with ``ks`` waves per iteration, the LDS their ``accs`` partial
    sums combine through; ``unroll``: the loop's unroll hint (``trip_unroll``)."""
    chain = branches[-1][1]
    for end, seg in reversed(branches[:-1]):
        chain = (L.If(L.Bin("lt", var, L.c(end)), seg, chain),)
    part = (L.Array("vf_part", "f32", t.waves_per_block * accs, "lds"),) if ks > 1 else ()
    return part + (L.Loop(var.name, L.c(0), L.c(stop), chain, parallel=True, map="wave", split=ks, lanes=lanes,
                          unroll=unroll),)
