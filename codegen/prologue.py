"""A GEMV prologue in one pass: RMSNorm's scale after the dot product.

A GEMV fed by a normalization fills its activation as ``act[k] = x[k] * s * w[k]``, where the
scalar ``s`` (``rsqrt(mean(x^2) + eps)``) comes from a reduction over the same ``x``.  Written as
lowered, every workgroup reads ``x`` twice and waits on a block-wide sum before it can fill:

    reduce k: sum_sq += x[k] * x[k]          # pass 1, then a block sum
    s = rsqrt(sum_sq / K + eps)
    for k: act[k] = x[k] * s * w[k]          # pass 2
    for n: acc = sum_k act[k] * W[n, k];  out[n] = f(acc)

The dot product is linear in the activation, so ``sum_k (x s w)[k] W[n, k] = s * sum_k (x w)[k]
W[n, k]``: the fill drops ``s``, the reduction folds into the fill's loop (one pass over ``x``),
and each row's epilogue reads ``acc * s``.  For an activation quantized to q8_1 the same holds:
a block's quants are those of ``x w`` (its step scales with ``s``), and the integer dot product is
scaled by the block's ``d`` and ``s``, both linear.

At the edges of f32 it differs: where ``x * g`` itself overflows (with a gain near 1, the two-pass
form's sum of squares has overflowed already; with a huge gain, 1e29, the two-pass form scales ``x``
first and does not) the rows read ``inf * 0``, NaN, and an ``x`` near 1e-38 is quantized in the
denormal range rather than normalized first.

The mapping applies it to the int8 path, and to a float GEMV where the target asks
(``Target.norm_after_dot``: a persistent kernel's phases, ``codegen.persistent.phase_target``).
``VEGAFUSE_NORM_AFTER_DOT=0`` keeps the two passes (A/B).
"""
from __future__ import annotations

import re
from dataclasses import replace

from . import loopir as L
from .env import switch


def enabled() -> bool:
    """``VEGAFUSE_NORM_AFTER_DOT=0``: the lowered two-pass prologue (A/B)."""
    return switch("VEGAFUSE_NORM_AFTER_DOT", True)


def _uses(body, name) -> int:
    """How many times the local ``name`` is read in ``body``."""
    return sum(isinstance(x, L.Sym) and x.name == name
               for s in L.walk_stmts(body) for e in L.stmt_exprs(s) for x in L.walk_exprs(e))


def _reads(e, names) -> bool:
    return any((isinstance(x, L.Sym) and x.name in names) or (isinstance(x, L.Load) and x.buf in names)
               for x in L.walk_exprs(e))


def _without(e, scale):
    """``e``, a product, with one factor ``scale`` dropped; None if it has none."""
    if not (isinstance(e, L.Bin) and e.op == "mul"):
        return None
    if e.a == scale:
        return e.b
    if e.b == scale:
        return e.a
    a = _without(e.a, scale)
    if a is not None:
        return L.Bin("mul", a, e.b)
    b = _without(e.b, scale)
    return None if b is None else L.Bin("mul", e.a, b)


def _linear_in(value, act) -> bool:
    """Is the accumulator update ``value`` ``act[k] * w`` (or ``w * act[k]``), ``w`` free of ``act``?"""
    if not (isinstance(value, L.Bin) and value.op == "mul"):
        return False
    a_act, b_act = (isinstance(x, L.Load) and x.buf == act for x in (value.a, value.b))
    other = value.b if a_act else value.a
    return (a_act or b_act) and not _reads(other, {act})


def _scaled_segment(seg, act, scale):
    """The parallel loop ``seg`` (a GEMV's output rows) with every read of an accumulator that
    folds ``act`` multiplied by ``scale``; None if ``act`` is read any other way."""
    body, accs = list(seg.body), set()
    if not body or not isinstance(body[0], L.Reduce) or body[0].order != "inner":
        return None
    red = body[0]
    for a in red.accs:
        if _reads(a.value, {act}):
            if a.op != "add" or not _linear_in(a.value, act):
                return None
            accs.add(a.name)
    if not accs or any(_reads(e, {act}) for s in L.walk_stmts(tuple(body[1:])) for e in L.stmt_exprs(s)):
        return None
    rest = L.rewrite(tuple(body[1:]), lambda e: L.rewrite_expr(
        e, lambda x: L.Bin("mul", x, scale) if isinstance(x, L.Sym) and x.name in accs else None))
    return replace(seg, body=(red,) + rest)


def norm_after_dot(body):
    """``body`` (a GEMV kernel's, before mapping) with its normalization's scale moved past the dot
    products and the reduction folded into the fill (the module docstring); None when its prologue
    is not of that form.  The fill becomes a ``Reduce`` whose ``body`` stores
    ``act[k]``: the mapping gives it the fill's loop."""
    body = list(body)
    arrays = {s.name for s in body if isinstance(s, L.Array)}
    fills = [i for i, s in enumerate(body) if isinstance(s, L.Loop) and not s.parallel and len(s.body) == 1
             and isinstance(s.body[0], L.Store) and s.body[0].buf in arrays and s.body[0].index == L.Sym(s.var, "i32")]
    if len(fills) != 1:
        return None
    f = fills[0]
    fill = body[f]
    st = fill.body[0]
    for d in range(f):
        decl = body[d]
        if not isinstance(decl, L.Declare) or _uses(body, decl.name) != 1:
            continue
        scale = L.Sym(decl.name, decl.dtype)
        value = _without(st.value, scale)
        reds = [r for r in range(d) if isinstance(body[r], L.Reduce) and len(body[r].accs) == 1
                and _reads(decl.init, {body[r].accs[0].name})]
        if value is None or len(reds) != 1:
            continue
        r = reds[0]
        red = body[r]
        acc = red.accs[0]
        same_range = red.start == fill.start == L.c(0) and red.stop == fill.stop
        if (not same_range or acc.op != "add" or red.map != "serial" or _uses(body, acc.name) != 1
                or _reads(value, {acc.name, decl.name})):
            continue
        segs = {i: _scaled_segment(s, st.buf, scale) for i, s in enumerate(body)
                if isinstance(s, L.Loop) and s.parallel}
        if not segs or None in segs.values() or any(i < f for i in segs) \
                or any(_reads(e, {st.buf}) for i, s in enumerate(body) if i != f and i not in segs
                       for x in L.walk_stmts((s,)) for e in L.stmt_exprs(x)):
            continue
        k = L.Sym(fill.var, "i32")
        v = L.substitute_expr(acc.value, {red.var: k})
        hoisted = {b.init: L.Sym(b.name, b.dtype) for b in body[:f]       # the locals the simplifier hoisted
                   if isinstance(b, L.Declare) and b is not decl}          # out of the fill, read as the fill does
        one = replace(red, var=fill.var, accs=(replace(acc, value=L.rewrite_expr(v, hoisted.get)),),
                      body=(L.Store(st.buf, st.index, value),))
        name = re.sub(r"_\d+$", "", decl.name)          # as loopir.tidy_names will name it
        note = L.Comment(f"one pass over the input: {name} multiplies each row's dot product instead "
                         f"(codegen/prologue.py)")
        out = []
        for i, s in enumerate(body):
            if i in (r, d):
                continue
            out += [note, one, decl] if i == f else [segs.get(i, s)]
        return tuple(out)
    return None


def squared(acc_value, fill_value):
    """``(x, rest)`` when the norm's reduction adds ``x * x`` and the fill stores ``x * rest``: the
    mapping then reads ``x`` once into a local that both use; else None."""
    if isinstance(acc_value, L.Bin) and acc_value.op == "mul" and acc_value.a == acc_value.b:
        rest = _without(fill_value, acc_value.a)
        if rest is not None:
            return acc_value.a, rest
    return None
