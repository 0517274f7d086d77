"""``dsl.lax``: the names of ``jax.lax`` we support (control flow, slicing, top-k).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

# ---- slicing and indexing

# ---- control flow

# ---- sorting and top-k
# (issue 9, item 4)
_RANK_SORT_MAX = 1024       # rows up to this long are ranked in one fused pass of comparisons (O(n^2))


def top_k(operand, k):
    """The ``k`` largest entries along the last axis, largest first: (values, indices i32), each
    [..., k], as ``jax.lax.top_k``.  Equal values come in index order; NaN counts as the largest.
    A row of at most 1024 entries is ranked by one fused pass of comparisons (O(n^2)); a longer
    one (a vocabulary) is cut into blocks of max(128, 4k), each block's top k kept, and the
    candidates (a quarter of the row or fewer) taken the same way: O(n max(128, 4k)) in all."""
    from . import numpy_api as N
    from .array import _dt
    from .core import DSLError, user_source
    x = N._tracer(operand)
    if x.ndim == 0:
        raise DSLError(f"{user_source()}: top_k needs an array of rank >= 1")
    n = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise DSLError(f"{user_source()}: top_k needs a static int k in [1, {n}], got {k!r}")
    xs = N._barrier(x.astype("int32") if _dt(x) == "bool" else x)     # compared with itself: the same bits
    vals, ids = _top_k_ranked(xs, N.full(xs.shape, 0, "int32") + N.arange(n), k)
    return (vals != 0 if _dt(x) == "bool" else vals), ids


def _lowest(x):
    from .array import _dt
    return float("-inf") if _dt(x) in ("f16", "f32") else -2 ** 31


def _top_k_ranked(x, ids, k):
    """Top k of rows ``x`` (..., n) whose entries have original indices ``ids``, both ordered by
    index: one rank pass, or blocks whose top k are ranked again (equal values keep index order,
    since the candidates stay in block order)."""
    from . import array as A
    from . import numpy_api as N
    n = x.shape[-1]
    block = max(128, 4 * k)
    nb = -(-n // block)
    if n <= _RANK_SORT_MAX or nb * k >= n:
        return _ranked(x, ids, k)
    if nb * block > n:          # pad with the lowest value, after every real entry
        pad = x.shape[:-1] + (nb * block - n,)
        x = A.concatenate([x, N.full(pad, _lowest(x), x.dtype)], axis=-1)
        ids = A.concatenate([ids, N.full(pad, n, "int32")], axis=-1)
    lead = x.shape[:-1]
    v, i = _ranked(x.reshape(lead + (nb, block)), ids.reshape(lead + (nb, block)), k)     # each block's top k
    return _top_k_ranked(v.reshape(lead + (nb * k,)), i.reshape(lead + (nb * k,)), k)


def _ranked(x, ids, k):
    """Top k of rows ``x`` by one pass of comparisons: (values, ``ids`` at them)."""
    from . import numpy_api as N
    rank = N._ranks(x, descending=True)
    return N._by_rank(rank, x, k), N._by_rank(rank, ids, k)


def optimization_barrier(operand):
    """``operand`` (an array, or a tuple or list of arrays) unchanged, each computed once into a
    buffer that every reader loads, as ``jax.lax.optimization_barrier``: fusion does not recompute
    it inside its consumers (whose loops may vectorize it differently, so that a value compared
    with itself could differ in its last bit)."""
    from . import numpy_api as N
    if isinstance(operand, (tuple, list)):
        return type(operand)(N._barrier(N._tracer(x)) for x in operand)
    return N._barrier(N._tracer(operand))
