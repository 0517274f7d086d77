"""``dsl.lax``: the names of ``jax.lax`` we support (control flow, slicing, top-k).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

# ---- slicing and indexing

# ---- control flow

# ---- sorting and top-k
# (issue 9, item 4)
_RANK_SORT_MAX = 1024       # rows up to this long take top-k from one sort by ranks (O(n^2) compares)


def top_k(operand, k):
    """The ``k`` largest entries along the last axis, largest first: (values, indices i32), each
    [..., k], as ``jax.lax.top_k``.  Equal values come in index order; NaN counts as the largest.
    A row of at most 1024 entries is ranked by one fused pass of comparisons (O(n^2)); a longer
    one (a vocabulary) takes ``k`` passes of max and argmax (O(k n)), so keep ``k`` small there."""
    from . import array as A
    from . import numpy_api as N
    from .array import _dt
    from .core import DSLError, user_source
    x = N._tracer(operand)
    if x.ndim == 0:
        raise DSLError(f"{user_source()}: top_k needs an array of rank >= 1")
    n = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise DSLError(f"{user_source()}: top_k needs a static int k in [1, {n}], got {k!r}")
    if n <= _RANK_SORT_MAX:
        vals, ids = N._sorted(x, -1, k=k, descending=True)
        return vals, ids
    lowest = {"f16": float("-inf"), "f32": float("-inf"), "i32": -2 ** 31, "bool": False}[_dt(x)]
    col = A.broadcast_to(A.iota((n,), 0), x.shape)
    taken = A.broadcast_to(N.full((), False), x.shape)
    vals, ids = [], []
    for _ in range(k):
        key = A.where(taken, lowest, x)
        m = A.max(key, axis=-1, keepdims=True)
        hit = (key == m) & ~taken
        if _dt(x) in ("f16", "f32"):
            hit = hit | ((key != key) & (m != m) & ~taken)       # NaN: the largest
        i = N.argmax(hit, axis=-1, keepdims=True)
        vals.append(m)
        ids.append(i)
        taken = taken | (col == i)
    return A.concatenate(vals, axis=-1), A.concatenate(ids, axis=-1)
