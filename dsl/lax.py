"""``dsl.lax``: the names of ``jax.lax`` we support (control flow, slicing, top-k).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

import builtins   # max, min, abs and pow below are jax.lax's elementwise ops (bound at import)

# ---- slicing and indexing
from . import array as _a  # noqa: E402
from .core import DSLError as _DSLError, PRIMITIVES as _P, bind as _bind, user_source as _where  # noqa: E402

# (jax.lax.slice is left out: named `slice`, it would hide the builtin in this module; x[a:b:s] is it)


def _starts(operand, start_indices, sizes, what):
    """The start indices as i32 scalars, each clamped so that ``sizes`` fit (JAX's rule)."""
    if not isinstance(start_indices, (list, tuple)) or len(start_indices) != operand.ndim:
        raise _DSLError(f"{_where()}: {what} needs one start index per dimension of the operand "
                        f"({operand.ndim}), got {start_indices!r}")
    out = []
    for s, n, m in zip(start_indices, sizes, operand.shape):
        if isinstance(s, _a.Tracer) and (s.shape != () or _a._dt(s) != "i32"):
            raise _DSLError(f"{_where()}: {what} start indices must be i32 scalars, got {s.dtype}{list(s.shape)}")
        if isinstance(s, _a.Tracer):
            out.append(_a._binary("max", _a._binary("min", s, m - n), 0))
        elif isinstance(s, int) and not isinstance(s, bool):
            out.append(builtins.min(builtins.max(int(s), 0), m - n))
        else:
            raise _DSLError(f"{_where()}: {what} start index {s!r} is not an int or a traced i32 scalar")
    return out


def slice_in_dim(operand, start_index, limit_index, stride=1, axis=0):
    """``operand[..., start:limit:stride, ...]`` along ``axis``, as ``jax.lax.slice_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    return operand[(slice(None),) * axis + (slice(start_index, limit_index, stride),)]


def index_in_dim(operand, index, axis=0, keepdims=True):
    """``operand``'s static element ``index`` along ``axis``, as ``jax.lax.index_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    y = operand[(slice(None),) * axis + (index,)]
    return _a.expand_dims(y, axis) if keepdims else y


def dynamic_slice(operand, start_indices, slice_sizes):
    """``operand[s0:s0+n0, s1:s1+n1, ...]`` at runtime starts (ints or traced i32 scalars), as
    ``jax.lax.dynamic_slice``: each start is clamped so the slice fits.  Inlined into the kernel
    that reads it (a load at shifted indices), never a copy."""
    operand = _a.asarray(operand)
    sizes = tuple(int(n) for n in slice_sizes)
    if len(sizes) != operand.ndim or any(not 0 < n <= m for n, m in zip(sizes, operand.shape)):
        raise _DSLError(f"{_where()}: dynamic_slice sizes {list(sizes)} do not fit operand {list(operand.shape)}")
    starts = _starts(operand, start_indices, sizes, "dynamic_slice")
    if all(isinstance(s, int) for s in starts):
        return _a.slice_(operand, starts, [s + n for s, n in zip(starts, sizes)])
    ids = []
    for d, (s, n) in enumerate(zip(starts, sizes)):
        i = _a.iota(sizes, d)
        ids.append(i if isinstance(s, int) and s == 0 else _a._binary("add", i, s))
    return _bind(_P["gather"], _a._float(operand), *ids)


def dynamic_update_slice(operand, update, start_indices):
    """``operand`` with ``update`` written at runtime starts, as ``jax.lax.dynamic_update_slice``
    (starts clamped so the update fits).  In place when ``operand`` is donated and nothing later
    reads it; otherwise a copy is written first."""
    return _a.dynamic_update_slice(operand, update, list(start_indices))


def dynamic_index_in_dim(operand, index, axis=0, keepdims=True):
    """``operand``'s element ``index`` (clamped) along ``axis``, as ``jax.lax.dynamic_index_in_dim``."""
    y = dynamic_slice_in_dim(operand, index, 1, axis)
    return y if keepdims else _a.reshape(y, tuple(d for k, d in enumerate(y.shape) if k != _a.normalize_axis(axis, y.ndim)))


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
    """``slice_size`` elements from ``start_index`` (clamped) along ``axis``, as ``jax.lax.dynamic_slice_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    starts = [start_index if k == axis else 0 for k in range(operand.ndim)]
    return dynamic_slice(operand, starts, [slice_size if k == axis else n for k, n in enumerate(operand.shape)])


def dynamic_update_slice_in_dim(operand, update, start_index, axis):
    """``update`` written from ``start_index`` (clamped) along ``axis``, as ``jax.lax.dynamic_update_slice_in_dim``."""
    axis = _a.normalize_axis(axis, operand.ndim)
    return dynamic_update_slice(operand, update, [start_index if k == axis else 0 for k in range(operand.ndim)])


def dynamic_update_index_in_dim(operand, update, index, axis):
    """``update`` (without, or with a size-1, ``axis``) written at ``index`` (clamped) along ``axis``,
    as ``jax.lax.dynamic_update_index_in_dim``."""
    axis = _a.normalize_axis(axis, operand.ndim)
    update = _a.asarray(update)
    if update.ndim == operand.ndim - 1:
        update = _a.expand_dims(update, axis)
    return dynamic_update_slice_in_dim(operand, update, index, axis)


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
    block = builtins.max(128, 4 * k)
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


# ---- elementwise and structural ops under their jax.lax names
def _lax_names():
    """jax.lax's elementwise names for our primitives (``lax.rsqrt``, ``lax.logistic``, ``lax.max``
    (elementwise, not a reduction), ...), bound at import."""
    import dsl as D
    from . import numpy_api as N
    names = {"abs": D.abs, "add": D.add, "sub": D.sub, "mul": D.mul, "div": D.div, "neg": D.neg,
             "exp": D.exp, "log": D.log, "sqrt": D.sqrt, "rsqrt": D.rsqrt, "tanh": D.tanh, "logistic": D.sigmoid,
             "sin": D.sin, "cos": D.cos, "floor": D.floor, "erf": D.erf, "log1p": D.log1p, "expm1": D.expm1,
             "max": D.maximum, "min": D.minimum, "pow": N.power, "eq": D.equal, "ne": D.not_equal,
             "lt": D.less, "le": D.less_equal, "gt": D.greater, "ge": D.greater_equal,
             "reshape": D.reshape, "transpose": D.transpose, "concatenate": D.concatenate, "iota": D.iota}
    return {k: v for k, v in names.items() if callable(v)}


def select(pred, on_true, on_false):
    """``jax.lax.select``: ``on_true`` where ``pred`` (bool, the operands' shape), else ``on_false``."""
    import dsl as D
    return D.where(pred, on_true, on_false)


def convert_element_type(operand, new_dtype):
    """``jax.lax.convert_element_type``: ``operand.astype(new_dtype)``."""
    import dsl as D
    return D.astype(operand, new_dtype)


def integer_pow(x, y):
    """``jax.lax.integer_pow``: ``x ** y`` for a static int ``y`` (repeated multiplication)."""
    from . import numpy_api as N
    return N.power(x, int(y))


def square(x):
    """``jax.lax.square``: ``x * x``."""
    return x * x
