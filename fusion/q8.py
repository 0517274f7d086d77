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

The float buffer stays: the producer's rows are stored there first.  ``VEGAFUSE_Q8_PRODUCER=0`` keeps
every workgroup's own quantization (A/B).  The CPU does not take this step (its int8 GEMV quantizes each
row itself, ``codegen/llvm.py`` ``int8_gemv``).
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from codegen import loopir as L


def enabled() -> bool:
    """Is the step on (``VEGAFUSE_Q8_PRODUCER``, and activations quantized at all)?"""
    return (os.environ.get("VEGAFUSE_Q8_PRODUCER", "1") != "0"
            and os.environ.get("VEGAFUSE_QUANT_ACT", "q8_1") != "float")


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


def quantize_at_producers(plan, dtype: str):
    """``plan`` (a ``fusion.Plan``, not changed) with each int8 GEMV activation that an earlier GEMV
    stores row by row quantized there once (see the module docstring); ``dtype``: the activation's
    q8 dtype ("q8_1r" or "q8_1", ``codegen.loopir.int8_activation``).  Returns a new Plan."""
    if not enabled():
        return plan
    kernels = list(plan.kernels)
    buffers = dict(plan.buffers)
    writers = {}
    for i, k in enumerate(kernels):
        for p in k.params:
            if p.role != "in":
                writers.setdefault(p.name, []).append(i)
    q8 = {}                                          # float buffer -> its q8 buffer
    for c, k in enumerate(kernels):
        found = identity_fill(k)
        if not found:
            continue
        fill, buf, K = found
        w = writers.get(buf, [])
        if buf in plan.inputs or len(w) != 1 or w[0] >= c or not row_store(kernels[w[0]], buf, K):
            continue
        if buf not in q8:
            name = f"{buf}_q8"
            while name in buffers:
                name += "_"
            q8[buf] = name
            buffers[name] = ((int(K * L.ITEMSIZE[dtype]),), np.dtype(np.uint8))
            p = kernels[w[0]]
            blk = L.Sym(f"{buf}_blk", "i32")
            vals = tuple(L.Load(buf, L.add(L.mul(blk, L.c(32)), L.c(j)), "f32") for j in range(32))
            quant = L.Loop(blk.name, L.c(0), L.c(K // 32), (L.QuantizeQ8(name, blk, vals, L.Const(True, "bool")),))
            note = L.Comment(f"{buf} as q8_1 blocks, for {k.name}")
            kernels[w[0]] = replace(p, params=p.params + (L.Param(name, dtype, shape=(K,), role="out"),),
                                    body=p.body + (note, quant))
        name = q8[buf]
        value = L.QLoad(name, fill.body[0].index, "f32", dtype, K)
        body = tuple(replace(s, body=(replace(s.body[0], value=value),)) if s is fill else s for s in k.body)
        still = any(isinstance(x, L.Load) and x.buf == buf for s in L.walk_stmts(body) for e in L.stmt_exprs(s)
                    for x in L.walk_exprs(e))
        params = tuple(p for p in k.params if p.name != buf or still) + (L.Param(name, dtype, shape=(K,)),)
        kernels[c] = replace(k, params=params, body=body)
    if not q8:
        return plan
    for i, k in enumerate(kernels):
        if k is not plan.kernels[i]:
            kernels[i] = replace(k, bytes=L.traffic(k))
    return replace(plan, kernels=kernels, buffers=buffers)
