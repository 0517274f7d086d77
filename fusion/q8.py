"""GPU plan step: a GEMV's activation quantized once, by the kernel that produces it.

An int8 GEMV on a GPU multiplies q8_1 activation blocks (``codegen/mapping.py``).  Without this step
every workgroup of it quantizes the whole activation in its prologue.  Where the activation is a
buffer that an earlier GEMV of the plan stores row by row, and the consumer reads it as it is (its
prologue is ``act[k] = buf[k]``: the down projection reading the gate/up kernel's SiLU * up), the
producer also writes the q8_1 form of the buffer, ``{buf}_q8``, and the consumer reads that:

* producer: a trailing loop ``for b: {buf}_q8.block[b] = q8_1(buf[32 b .. 32 b + 31])`` (``QuantizeQ8``
  of whole blocks), which the GPU mapping runs after the wave loop: where a workgroup's trips store
  whole blocks, it quantizes them itself (``vf_quantize_own``); else by arrivals, each block quantized
  by the workgroup that stores its last value (``vf_quantize_stored``);
* consumer: its fill reads ``{buf}_q8`` (``QLoad`` of format q8_1r / q8_1: the block's values), which the
  int8 mapping copies into LDS as it is.

The same holds where the consumer normalizes the buffer first (RMSNorm: its prologue, once
``codegen.prologue.norm_after_dot`` has moved the scale past the dot products, quantizes ``x[k] * g[k]``
and sums ``x[k] * x[k]`` in one loop).  Neither needs the whole row: the producer's trailing loop
quantizes ``x * g`` (``{buf}_q8``) and stores each block's sum of squares (``{buf}_ss``, K / 32 floats),
and the consumer's prologue adds the K / 32 sums and copies the blocks:

* producer: ``for b: {buf}_q8.block[b] = q8_1(buf[32 b + j] * g[32 b + j]);  {buf}_ss[b] = sum_j buf[32 b + j]^2``;
* consumer: ``reduce b: sum_sq += {buf}_ss[b]``, the scale from it as before, the fill a ``QLoad`` of
  ``{buf}_q8``, each row's dot product times the scale.

``VEGAFUSE_NORM_AT_PRODUCER=0`` keeps the normalizing consumer's own one-pass prologue (A/B).

The float buffer stays: the producer's rows are stored there first.  ``VEGAFUSE_Q8_PRODUCER=0`` keeps
every workgroup's own quantization (A/B).  The CPU does not take this step (its int8 GEMV quantizes each
row itself, ``codegen/llvm.py`` ``int8_gemv``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from codegen import loopir as L
from codegen.env import switch


def enabled() -> bool:
    """Is the step on (``VEGAFUSE_Q8_PRODUCER``, and activations quantized at all)?"""
    return (switch("VEGAFUSE_Q8_PRODUCER", True)
            and L.quantized_activations())


def norm_enabled() -> bool:
    """Is the normalizing consumer's quantization moved to its producer too (``VEGAFUSE_NORM_AT_PRODUCER``)?"""
    return switch("VEGAFUSE_NORM_AT_PRODUCER", True)


def normed_fill(k: L.Kernel):
    """``(body, one, buf, g, K)`` when the GEMV ``k`` normalizes ``buf`` in its prologue and multiplies
    only quantized weights by it: ``body`` is ``k``'s body in one pass (``codegen.prologue.norm_after_dot``),
    whose loop ``one`` (a ``Reduce`` with a body) sums ``buf[k] * buf[k]`` and fills ``act[k] = buf[k] *
    g[k]`` over K (a multiple of 32), ``g`` a buffer the kernel only reads; else None."""
    from codegen import prologue
    from codegen.mapping import _is_matmul, quant_weights
    if not norm_enabled() or k.family != "contract" or _is_matmul(k.body) or not prologue.enabled():
        return None
    body = prologue.norm_after_dot(k.body)
    ones = [s for s in body or () if isinstance(s, L.Reduce) and s.body]
    if len(ones) != 1:
        return None
    (one,) = ones
    st, kk, K = one.body[0], L.Sym(one.var, "i32"), one.stop
    found = prologue.squared(one.accs[0].value, st.value)
    if not found or st.index != kk or one.start != L.c(0) or not isinstance(K, L.Const) or K.value % 32 \
            or K.value < 64:                         # (one block: nothing to share, and its loop is simplified away)
        return None
    x, g = found
    written = {p.name for p in k.params if p.role != "in"}
    if not (type(x) is L.Load and type(g) is L.Load and x.index == kk == g.index and x.dtype == g.dtype == "f32"
            and x.buf != g.buf and g.buf not in written):
        return None
    segs = [s for s in body if isinstance(s, L.Loop) and s.parallel]
    if not segs or not all(s.body and isinstance(s.body[0], L.Reduce) and quant_weights(s.body[0], st.buf)
                           for s in segs):
        return None
    return body, one, x.buf, g.buf, K.value


def _consumer_of_norm(body, one, q8, ss, dtype: str, x: str, g: str):
    """The one-pass body of a normalizing GEMV with its loop ``one`` replaced by a reduction of the
    producer's block sums ``ss`` and a fill that reads the producer's q8_1 blocks ``q8``."""
    st, acc = one.body[0], one.accs[0]
    K = one.stop.value
    blk = f"{ss}_blk"
    sums = L.Reduce(blk, L.c(0), L.c(K // 32), (replace(acc, value=L.Load(ss, L.Sym(blk, "i32"), "f32")),))
    fill = L.Loop(one.var, L.c(0), L.c(K), (L.Store(st.buf, st.index, L.QLoad(q8, st.index, "f32", dtype, K)),))
    out = []
    for s in body:
        if s is one:
            out += [fill, sums]                      # the copy's loads first, the sums' beside them
        elif isinstance(s, L.Comment) and s.text.startswith("one pass over the input"):
            scale = s.text.split(": ", 1)[1].split(" multiplies")[0]
            out.append(L.Comment(f"the norm's input from its producer (fusion/q8.py): {x} * {g} in q8_1 blocks ({q8}), "
                                 f"each block's sum of {x} * {x} ({ss}); {scale} multiplies each row's dot product"))
        else:
            out.append(s)
    return tuple(out)


def identity_fill(k: L.Kernel):
    """``(fill loop, buf, K)`` when the GEMV ``k`` has one activation array whose fill is ``act[k] =
    buf[k]`` over K (a multiple of 32) and every weight it multiplies by that array is quantized;
    else None."""
    from codegen.mapping import _is_matmul, quant_weights
    if k.family != "contract" or _is_matmul(k.body):
        return None
    arrays = [s for s in k.body if isinstance(s, L.Array)]
    fills = [s for s in k.body if isinstance(s, L.Loop) and not s.parallel and len(s.body) == 1
             and isinstance(s.body[0], L.Store) and any(s.body[0].buf == a.name for a in arrays)]
    if len(arrays) != 1 or len(fills) != 1:
        return None
    (fill,), (act,) = fills, arrays
    st, K = fill.body[0], act.size
    v = st.value
    if not (st.index == L.Sym(fill.var, "i32") and type(v) is L.Load and v.dtype == "f32"
            and v.index == st.index and fill.start == L.c(0) and fill.stop == L.c(K) and K % 32 == 0):
        return None
    segs = [s for s in k.body if isinstance(s, L.Loop) and s.parallel]
    if not segs or not all(s.body and isinstance(s.body[0], L.Reduce) and quant_weights(s.body[0], act.name)
                           for s in segs):
        return None
    return fill, v.buf, K


def row_store(k: L.Kernel, buf: str, n: int):
    """Does ``k`` (a GEMV, not a matmul) store ``buf`` only as ``buf[row] = ...`` in one segment of
    ``n`` output rows, once per row, and read it nowhere?"""
    from codegen.mapping import _is_matmul
    if k.family != "contract" or _is_matmul(k.body):
        return False
    stores = [s for s in L.walk_stmts(k.body) if isinstance(s, L.Store) and s.buf == buf]
    reads = [x for s in L.walk_stmts(k.body) for e in L.stmt_exprs(s) for x in L.walk_exprs(e)
             if isinstance(x, L.Load) and x.buf == buf]
    segs = [s for s in k.body if isinstance(s, L.Loop) and s.parallel
            and any(x in stores for x in s.body)]
    if reads or len(stores) != 1 or len(segs) != 1:
        return False
    (seg,) = segs
    return (stores[0].index == L.Sym(seg.var, "i32") and seg.start == L.c(0) and seg.stop == L.c(n)
            and isinstance(seg.body[0], L.Reduce) and seg.body[0].order == "inner")


def sum_of_squares(xs):
    """``xs[0] * xs[0] + xs[1] * xs[1] + ...`` (f32 expressions)."""
    total = L.Bin("mul", xs[0], xs[0])
    for x in xs[1:]:
        total = L.Bin("add", total, L.Bin("mul", x, x))
    return total


def _cheap(before: L.Kernel, after: L.Kernel, target) -> bool:
    """Is the producer ``after`` (``before`` with a normalization's blocks to quantize), mapped for
    ``target``, still as fast: each block quantized by the workgroup that stores it whole, with at least
    half of ``before``'s workgroups (``codegen.mapping._whole_trips`` takes f times larger ones)?
    Arrivals' fences and atomics, or a grid cut to a quarter, cost the producer more than the
    consumer's one-pass prologue (on an H200, docs/performance.md: Qwen2.5-1.5B's down projection by
    arrivals 9.6 against 7.1 us; Qwen2.5-7B's O projection as 112 workgroups instead of 448)."""
    from codegen.mapping import map_kernel
    m = map_kernel(after, target)
    whole = all(s.whole for s in L.walk_stmts(m.body) if isinstance(s, L.QuantizeStored) and s.sumsq)
    return whole and 2 * m.launch.grid >= map_kernel(before, target).launch.grid


def quantize_at_producers(plan, dtype: str, target=None):
    """``plan`` (a ``fusion.Plan``, not changed) with each int8 GEMV activation that an earlier GEMV
    stores row by row quantized there once (see the module docstring); ``dtype``: the activation's
    q8 dtype ("q8_1r" or "q8_1", ``codegen.loopir.int8_activation``); ``target`` (a
    ``codegen.targets.Target``, or None: every such pair): a normalizing consumer's only where the
    producer, mapped for it, stays as fast (``_cheap``).  Returns a new Plan."""
    if not enabled():
        return plan
    kernels = list(plan.kernels)
    buffers = dict(plan.buffers)
    writers = {}
    for i, k in enumerate(kernels):
        for p in k.params:
            if p.role != "in":
                writers.setdefault(p.name, []).append(i)
    q8 = {}                                          # (float buffer, norm weight or None) -> its q8 buffer(s)

    def fresh(name):
        while name in buffers:
            name += "_"
        return name
    for c, k in enumerate(kernels):
        found, normed = identity_fill(k), None
        if found:
            fill, buf, K = found
        else:
            normed = normed_fill(k)
            if not normed:
                continue
            body, one, buf, g, K = normed
        w = writers.get(buf, [])
        if buf in plan.inputs or len(w) != 1 or w[0] >= c or not row_store(kernels[w[0]], buf, K):
            continue
        if normed and any(i >= w[0] for i in writers.get(g, [])):     # g must be ready when the producer runs
            continue
        key = (buf, g if normed else None)
        if key not in q8:
            name = fresh(f"{buf}_q8")
            new = {name: ((int(K * L.ITEMSIZE[dtype]),), np.dtype(np.uint8))}
            blk = L.Sym(f"{buf}_blk", "i32")
            xs = [L.Load(buf, L.add(L.mul(blk, L.c(32)), L.c(j)), "f32") for j in range(32)]
            params = (L.Param(name, dtype, shape=(K,), role="out"),)
            if normed:                               # x * g in q8_1 blocks, and each block's sum of x * x
                ss = fresh(f"{buf}_ss")
                new[ss] = ((K // 32,), np.dtype(np.float32))
                gs = [L.Load(g, x.index, "f32") for x in xs]
                quant = (L.QuantizeQ8(name, blk, tuple(L.Bin("mul", x, y) for x, y in zip(xs, gs)), L.Const(True, "bool")),
                         L.Store(ss, blk, sum_of_squares(xs)))
                params += (L.Param(ss, "f32", shape=(K // 32,), role="out"),)
                note = L.Comment(f"{buf} times {g} as q8_1 blocks and each block's sum of squares, for "
                                 f"{k.name}'s normalization")
            else:
                quant = (L.QuantizeQ8(name, blk, tuple(xs), L.Const(True, "bool")),)
                note = L.Comment(f"{buf} as q8_1 blocks, for {k.name}")
            p = kernels[w[0]]
            extra = tuple(q for q in k.params if normed and q.name == g and g not in {r.name for r in p.params})
            before = p
            p = replace(p, params=p.params + extra + params, body=p.body + (note, L.Loop(blk.name, L.c(0), L.c(K // 32), quant)))
            if normed and target is not None and not _cheap(before, p, target):
                continue
            kernels[w[0]] = p
            buffers.update(new)
            q8[key] = tuple(new)                     # (the q8 buffer, and the block sums where normed)
        names = q8[key]
        if normed:
            body = _consumer_of_norm(body, one, *names, dtype, buf, g)
        else:
            value = L.QLoad(names[0], fill.body[0].index, "f32", dtype, K)
            body = tuple(replace(s, body=(replace(s.body[0], value=value),)) if s is fill else s for s in k.body)
        read = {x.buf for s in L.walk_stmts(body) for e in L.stmt_exprs(s) for x in L.walk_exprs(e)
                if isinstance(x, L.Load)}
        params = tuple(p for p in k.params if p.name not in key or p.name in read)
        params += tuple(L.Param(n, dtype if n == names[0] else "f32", shape=(K,) if n == names[0] else (K // 32,))
                        for n in names)
        kernels[c] = replace(k, params=params, body=body)
    if not q8:
        return plan
    for i, k in enumerate(kernels):
        if k is not plan.kernels[i]:
            kernels[i] = replace(k, bytes=L.traffic(k))
    return replace(plan, kernels=kernels, buffers=buffers)
