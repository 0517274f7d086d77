"""The ``jax.numpy`` names we support, composed from the primitives (so the fusion handles them).

Names, signatures and semantics follow ``jax.numpy``; each docstring says where we differ.  Common
differences: float64 and int64 compute as float32 and int32 (as JAX without x64); shapes and
sizes (``split`` sections, ``repeat`` counts, ``pad`` widths, ``einsum`` subscripts) are static
Python values; ``sort`` and ``argsort`` cost O(n^2) per row (sums of comparisons, which fuse
into one kernel: meant for rows up to a few thousand, such as router logits or one head's scores).
"""
from __future__ import annotations

import builtins as _b
import math

import numpy as np

from . import array as A
from .array import Tracer, _dt, asarray, astype, broadcast_to, normalize_axis, reshape, transpose, where
from .core import PRIMITIVES as P, DSLError, Lit, bind, dtype_name, promote, user_source

_FLOAT = ("f16", "f32")


def _tracer(x):
    """``x`` as a Tracer (a Python scalar becomes a traced 0-d array)."""
    x = asarray(x)
    return x if isinstance(x, Tracer) else bind(P["broadcast_in_dim"], x, shape=(), dims=())


def _axes(x, axis):
    """The sorted axes ``axis`` (None, an int or a sequence) names."""
    if axis is None:
        return list(range(x.ndim))
    axes = [normalize_axis(a, x.ndim) for a in (axis if isinstance(axis, (tuple, list)) else (axis,))]
    if len(set(axes)) != len(axes):
        raise DSLError(f"{user_source()}: repeated axis in {axis!r}")
    return sorted(axes)


def _to_last(x, axis):
    """(``x`` with ``axis`` moved last, the permutation that moves it back)."""
    axis = normalize_axis(axis, x.ndim)
    perm = [i for i in range(x.ndim) if i != axis] + [axis]
    back = [perm.index(i) for i in range(x.ndim)]
    return transpose(x, perm), back


# ----------------------------------------------------------------------------- operators
def _int_power(x, n):
    """x ** n for a static int n >= 1 by repeated squaring (exact for ints, wraps like numpy's int32)."""
    result, base = None, x
    while n:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if n:
            base = base * base
    return result


def power(x, y):
    """``x ** y`` with numpy broadcasting and promotion.  A static integer exponent multiplies
    (``x ** 2`` is ``x * x``, exact for ints; a negative one on floats is ``1 / x ** -n``), 0.5 is
    ``sqrt``; otherwise both operands are made float (differs from numpy and JAX for an integer
    base to a traced integer power: DSLError, convert to float first)."""
    if not isinstance(y, Tracer) and isinstance(y, (int, np.integer)) and not isinstance(y, bool):
        x = _tracer(x)
        if _dt(x) == "bool":
            x = astype(x, "i32")
        n = int(y)
        if n == 0:
            return full_like(x, 1)
        if n < 0:
            if _dt(x) not in _FLOAT:
                raise DSLError(f"{user_source()}: integers to negative integer powers are not allowed "
                               "(as in numpy); convert with .astype('float32')")
            return 1.0 / _int_power(x, -n)
        return _int_power(x, n)
    if not isinstance(y, Tracer) and isinstance(y, (float, np.floating)) and float(y) == 0.5:
        return A.sqrt(astype(x, "f32") if _dt(asarray(x)) not in _FLOAT else x)
    x, y = A._promote_pair(x, y)
    if _dt(x) not in _FLOAT and _dt(y) not in _FLOAT:
        raise DSLError(f"{user_source()}: integer ** traced integer is not supported; convert the operands "
                       "with .astype('float32')")
    return A._binary("pow", *(a if _dt(a) in _FLOAT else astype(a, "f32") for a in (x, y)))


def _needs_fix(r, b):
    """Where C's truncated remainder ``r`` of a by ``b`` must move to numpy's floored one."""
    b_neg = (b.value < 0) if isinstance(b, Lit) else (b < 0)
    return (r != 0) & ((r < 0) != b_neg)


def floor_divide(a, b):
    """``a // b`` as numpy: rounds toward minus infinity; an integer division by 0 gives 0
    (numpy too, with a warning).  Floats: ``floor(a / b)``."""
    a, b = A._promote_pair(a, b)
    if _dt(a) != _dt(b):
        a, b = A._fix_dtypes(a, b)
    if _dt(a) == "bool":
        a, b = astype(a, "i32"), astype(b, "i32")
    if _dt(a) in _FLOAT:
        return A.floor(A._binary("div", a, b))
    q, r = A._binary("idiv", a, b), A._binary("mod", a, b)
    return q - where(_needs_fix(r, b), 1, 0)


def remainder(a, b):
    """``a % b`` as numpy: the result has the sign of ``b``; an integer ``x % 0`` is 0 (numpy too)."""
    a, b = A._promote_pair(a, b)
    if _dt(a) != _dt(b):
        a, b = A._fix_dtypes(a, b)
    if _dt(a) == "bool":
        a, b = astype(a, "i32"), astype(b, "i32")
    r = A._binary("mod", a, b)
    return where(_needs_fix(r, b), r + b, r)


def _bitwise(name, a, b):
    a, b = A._promote_pair(a, b)
    if _dt(a) != _dt(b):
        a, b = A._fix_dtypes(a, b)
    if _dt(a) not in ("bool", "i32"):
        raise DSLError(f"{user_source()}: bitwise {name} needs bool or int operands, got {_dt(a)}")
    return A._binary(name, a, b)


def bitwise_and(a, b):
    """``a & b``: logical on bools, bitwise on ints."""
    return _bitwise("and", a, b)


def bitwise_or(a, b):
    """``a | b``: logical on bools, bitwise on ints."""
    return _bitwise("or", a, b)


def bitwise_xor(a, b):
    """``a ^ b``: ``a != b`` on bools, ``(a | b) & ~(a & b)`` on ints."""
    a, b = A._promote_pair(a, b)
    if _dt(a) == _dt(b) == "bool":
        return a != b
    return bitwise_and(bitwise_or(a, b), invert(bitwise_and(a, b)))


def invert(x):
    """``~x``: logical not on bools, bitwise not on ints."""
    x = asarray(x)
    if _dt(x) not in ("bool", "i32"):
        raise DSLError(f"{user_source()}: ~ needs a bool or int array, got {_dt(x)}")
    return A._unary("not", x)


def _truth(x):
    x = asarray(x)
    return x if _dt(x) == "bool" else (x != 0)


def logical_and(a, b):
    """Elementwise logical and; non-bool operands count as ``x != 0`` (bool result, as numpy)."""
    return A._binary("and", _truth(a), _truth(b))


def logical_or(a, b):
    """Elementwise logical or; non-bool operands count as ``x != 0`` (bool result, as numpy)."""
    return A._binary("or", _truth(a), _truth(b))


def logical_not(x):
    """Elementwise logical not; a non-bool operand counts as ``x != 0`` (bool result, as numpy)."""
    return A._unary("not", _truth(x))


# ----------------------------------------------------------------------------- reductions
def min(x, axis=None, keepdims=False):  # noqa: A001
    """Minimum over ``axis`` (None: all), exact: ``-max(-x)`` for floats, ``~max(~x)`` for ints."""
    x = asarray(x)
    if _dt(x) in _FLOAT:
        return -A.max(-x, axis, keepdims)
    return invert(A.max(invert(x), axis, keepdims))


def argmax(x, axis=None, keepdims=False):
    """Index of the first maximum along ``axis`` (None: of the flattened array), i32."""
    x = asarray(x)
    if axis is None:
        y = A._reduce("argmax", reshape(x, (-1,)), -1, False)
        return reshape(y, (1,) * x.ndim) if keepdims else y
    y = A._reduce("argmax", x, axis, False)
    return A.expand_dims(y, axis) if keepdims else y


def argmin(x, axis=None, keepdims=False):
    """Index of the first minimum along ``axis`` (None: of the flattened array), i32."""
    x = asarray(x)
    return argmax(-x if _dt(x) in _FLOAT else invert(x), axis, keepdims)


def amin(x, axis=None, keepdims=False):
    """Alias of ``min``."""
    return min(x, axis, keepdims)


def var(x, axis=None, ddof=0, keepdims=False):
    """Variance over ``axis`` (two passes: mean, then the mean squared deviation), divided by
    ``n - ddof``.  Integer and bool inputs give f32; f16 computes in f32 and gives f16."""
    x = asarray(x)
    xf = astype(x, "f32")
    n = int(np.prod([x.shape[a] for a in _axes(x, axis)]))
    d = xf - A.mean(xf, axis, keepdims=True)
    v = A.sum(d * d, axis, keepdims) * (1.0 / _b.max(n - ddof, 0) if n > ddof else float("nan"))
    return astype(v, "f16") if _dt(x) == "f16" else v


def std(x, axis=None, ddof=0, keepdims=False):
    """Standard deviation: ``sqrt(var(x, axis, ddof))``."""
    return A.sqrt(var(x, axis, ddof, keepdims))


def cumsum(x, axis=None, dtype=None):
    """Cumulative sum along ``axis`` (None: of the flattened array).  Bool and int inputs sum in
    i32.  Each output is a masked sum of its block of up to 128 entries plus the cumulative sum of
    the blocks before it (O(128 n) per row, a few fused kernels, no sequential loop), exact for
    ints; floats accumulate in f32 (f16 gives f16)."""
    x = asarray(x)
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    if dtype is not None:
        x = astype(x, dtype)
    elif _dt(x) == "bool":
        x = astype(x, "i32")
    xt, back = _to_last(x, axis)
    if _dt(xt) == "f16":        # the blocks' sums and totals stay f32; one rounding at the end
        return astype(transpose(_cumsum_last(astype(xt, "f32")), back), "f16")
    return transpose(_cumsum_last(xt), back)


_SCAN_BLOCK = 128


def _cumsum_last(x):
    """Inclusive cumulative sum along the last axis: masked sums within blocks, then the blocks'
    totals' exclusive cumulative sum added to each block."""
    n = x.shape[-1]
    if n <= _SCAN_BLOCK:
        mask = A.iota((n, n), 1) <= A.iota((n, n), 0)                             # [i, j]: j <= i
        rows = broadcast_to(reshape(x, x.shape[:-1] + (1, n)), x.shape + (n,))   # (..., i, j) = x[j]
        return A.sum(where(broadcast_to(mask, rows.shape), rows, 0), axis=-1)
    nb = -(-n // _SCAN_BLOCK)
    if nb * _SCAN_BLOCK > n:
        x = A.concatenate([x, full(x.shape[:-1] + (nb * _SCAN_BLOCK - n,), 0, _dt(x))], axis=-1)
    inner = _cumsum_last(reshape(x, x.shape[:-1] + (nb, _SCAN_BLOCK)))          # (..., nb, B)
    totals = inner[..., -1]                                                      # (..., nb)
    before = _cumsum_last(totals) - totals                                       # exclusive
    y = reshape(inner + A.expand_dims(before, -1), x.shape[:-1] + (nb * _SCAN_BLOCK,))
    return y[..., :n]


# ----------------------------------------------------------------------------- sorting
def _isnan(x):
    return x != x


def _before(xj, xi, j, i, descending=False):
    """Whether element j comes before element i in a stable sort: NaN last, ties by index."""
    if descending:
        xj, xi = xi, xj
    if _dt(xj) in _FLOAT:
        less = (xj < xi) | (_isnan(xi) & ~_isnan(xj))
        equal = (xj == xi) | (_isnan(xi) & _isnan(xj))
    else:
        less, equal = xj < xi, xj == xi
    return less | (equal & (j < i))


def _barrier(x):
    """``x`` computed once into a buffer (see ``dsl.lax.optimization_barrier``)."""
    return bind(P["optimization_barrier"], x)


def _ranks(xt, descending=False):
    """The position of each element of the last axis in its stably sorted row, i32 (..., n)."""
    n = xt.shape[-1]
    shape = xt.shape + (n,)                                                   # (..., i, j)
    xi = broadcast_to(reshape(xt, xt.shape + (1,)), shape)
    xj = broadcast_to(reshape(xt, xt.shape[:-1] + (1, n)), shape)
    i, j = A.iota((n, n), 0), A.iota((n, n), 1)
    return A.sum(astype(_before(xj, xi, j, i, descending), "i32"), axis=-1)


def _by_rank(rank, values, k):
    """out[..., r] = values[..., i] where rank[..., i] == r, for r < k."""
    n = rank.shape[-1]
    shape = rank.shape[:-1] + (k, n)                                          # (..., r, i)
    hit = broadcast_to(reshape(rank, rank.shape[:-1] + (1, n)), shape) == broadcast_to(A.iota((k, n), 0), shape)
    v = broadcast_to(reshape(values, values.shape[:-1] + (1, n)), shape)
    return A.sum(where(hit, v, 0), axis=-1)


def _sorted(x, axis, k=None, descending=False):
    x = asarray(x)
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    if x.ndim == 0:
        raise DSLError(f"{user_source()}: cannot sort a scalar")
    xt, back = _to_last(x, axis)
    xt = _barrier(xt)           # compared with itself: every comparison must see the same bits
    n = xt.shape[-1]
    rank = _ranks(xt, descending)
    idx = broadcast_to(A.iota((n,), 0), xt.shape)
    k = n if k is None else k
    vals, ids = _by_rank(rank, xt, k), _by_rank(rank, idx, k)
    if _dt(x) == "bool":
        vals = vals != 0
    return transpose(vals, back), transpose(ids, back)


def sort(x, axis=-1):
    """Sorted along ``axis`` (None: the flattened array), ascending, stable, NaN last (as numpy).
    Differs from JAX in cost: O(n^2) comparisons per row, one fused pass (see the module)."""
    return _sorted(x, axis)[0]


def argsort(x, axis=-1):
    """Indices (i32) that sort ``x`` along ``axis``, stable (equal values keep their order), NaN
    last; costs as ``sort``."""
    return _sorted(x, axis)[1]


# ----------------------------------------------------------------------------- construction
def full(shape, fill_value, dtype=None):
    """An array of ``shape`` filled with the static scalar ``fill_value``; ``dtype`` defaults to the
    value's (float32 for floats, int32 for ints, bool)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if isinstance(fill_value, Tracer):
        return broadcast_to(fill_value if dtype is None else astype(fill_value, dtype), shape)
    lit = asarray(fill_value, None if dtype is None else dtype_name(dtype))
    return bind(P["broadcast_in_dim"], lit, shape=shape, dims=())


def zeros(shape, dtype="float32"):
    """An array of zeros (float32 unless ``dtype`` says otherwise)."""
    return full(shape, 0, dtype)


def ones(shape, dtype="float32"):
    """An array of ones (float32 unless ``dtype`` says otherwise)."""
    return full(shape, 1, dtype)


def full_like(x, fill_value, dtype=None, shape=None):
    """``full`` with the shape and dtype of ``x`` (unless given)."""
    x = asarray(x)
    return full(x.shape if shape is None else shape, fill_value, _dt(x) if dtype is None else dtype)


def zeros_like(x, dtype=None, shape=None):
    """Zeros with the shape and dtype of ``x``."""
    return full_like(x, 0, dtype, shape)


def ones_like(x, dtype=None, shape=None):
    """Ones with the shape and dtype of ``x``."""
    return full_like(x, 1, dtype, shape)


def arange(start, stop=None, step=None, dtype=None):
    """Values from ``start`` to ``stop`` (excluded) by ``step``, as ``jnp.arange``: static Python
    numbers; int32 when they are all ints, else float32 (unless ``dtype`` says)."""
    for v in (stop, step):
        if v is not None and not isinstance(v, (int, float, np.number)):
            raise DSLError(f"{user_source()}: arange(start, stop=None, step=None, dtype=None) takes static "
                           f"numbers; got {v!r} (pass a dtype as dtype=...)")
    if stop is None:
        start, stop = 0, start
    step = 1 if step is None else step
    if step == 0:
        raise DSLError(f"{user_source()}: arange step must not be 0")
    n = _b.max(int(math.ceil((stop - start) / step)), 0)
    if n == 0:
        raise DSLError(f"{user_source()}: arange({start}, {stop}, {step}) is empty; zero-size arrays are not supported")
    ints = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
    d = dtype_name(dtype) if dtype is not None else "i32" if ints else "f32"
    if d in _FLOAT and not ints:       # start + i * step in f32, as jnp.arange
        return A.iota((n,), 0, "f32") * float(step) + float(start)
    y = A.iota((n,), 0, "i32")
    y = y if step == 1 else y * int(step)
    y = y if start == 0 else y + int(start)
    return astype(y, d)


def stack(arrays, axis=0):
    """Join arrays of one shape along a new ``axis``; dtypes promote as numpy's."""
    xs = [_tracer(x) for x in arrays]
    if not xs:
        raise DSLError(f"{user_source()}: stack needs at least one array")
    if any(x.shape != xs[0].shape for x in xs):
        raise DSLError(f"{user_source()}: stack needs arrays of one shape, got {[list(x.shape) for x in xs]}")
    d = xs[0].var.dtype
    for x in xs[1:]:
        d = promote(d, x.var.dtype)
    axis = normalize_axis(axis, xs[0].ndim + 1)
    return A.concatenate([A.expand_dims(astype(x, d), axis) for x in xs], axis=axis)


def split(x, indices_or_sections, axis=0):
    """Split ``x`` along ``axis`` into equal sections (an int that divides the size) or at the
    static ``indices``; returns a list."""
    x = asarray(x)
    axis = normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if isinstance(indices_or_sections, (int, np.integer)):
        s = int(indices_or_sections)
        if s <= 0 or n % s:
            raise DSLError(f"{user_source()}: array split does not result in an equal division: "
                           f"{n} into {s} sections")
        cuts = [n // s * i for i in range(1, s)]
    else:
        cuts = [int(c) + n if int(c) < 0 else int(c) for c in indices_or_sections]
    edges = [0] + [_b.min(_b.max(c, 0), n) for c in cuts] + [n]
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            raise DSLError(f"{user_source()}: split at {list(indices_or_sections)} gives an empty piece; "
                           "zero-size arrays are not supported")
        idx = tuple(slice(a, b) if i == axis else slice(None) for i in range(x.ndim))
        out.append(x[idx])
    return out


def _tri(x, k, lower):
    x = asarray(x)
    if x.ndim < 2:
        raise DSLError(f"{user_source()}: {'tril' if lower else 'triu'} needs an array of rank >= 2, got {list(x.shape)}")
    n, m = x.shape[-2:]
    row, col = A.iota((n, m), 0), A.iota((n, m), 1)
    keep = (col <= row + int(k)) if lower else (col >= row + int(k))
    return where(keep, x, 0)


def tril(x, k=0):
    """``x`` with the elements above the ``k``-th diagonal of its last two axes zeroed."""
    return _tri(x, k, True)


def triu(x, k=0):
    """``x`` with the elements below the ``k``-th diagonal of its last two axes zeroed."""
    return _tri(x, k, False)


def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
    """``x`` limited to [min, max] elementwise (either may be None); ``a_min``/``a_max`` are the
    older names.  NaN propagates."""
    lo, hi = (a_min if min is None else min), (a_max if max is None else max)
    x = asarray(x)
    if lo is not None:
        x = A.maximum(x, lo)
    if hi is not None:
        x = A.minimum(x, hi)
    return x


def repeat(x, repeats, axis=None):
    """Each element repeated ``repeats`` times (a static int) along ``axis`` (None: flattened).
    Differs from JAX: per-element repeat counts are not supported."""
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise DSLError(f"{user_source()}: repeats must be a static int >= 1, got {repeats!r}")
    x = _tracer(x)
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    axis = normalize_axis(axis, x.ndim)
    y = A.expand_dims(x, axis + 1)
    shape = list(y.shape)
    shape[axis + 1] = int(repeats)
    out = list(x.shape)
    out[axis] *= int(repeats)
    return reshape(broadcast_to(y, shape), out)


def pad(x, pad_width, mode="constant", constant_values=0):
    """``x`` padded with ``constant_values`` by ``pad_width`` (static: an int, ``(before, after)``
    or one pair per axis).  Differs from JAX: only ``mode="constant"`` with a scalar value."""
    if mode != "constant":
        raise DSLError(f"{user_source()}: pad mode {mode!r} is not supported; only mode='constant'")
    x = _tracer(x)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64).reshape(-1, 2) if np.ndim(pad_width) else
                             np.full((1, 2), int(pad_width)), (x.ndim, 2))
    if (widths < 0).any():
        raise DSLError(f"{user_source()}: pad widths must be >= 0, got {np.asarray(pad_width).tolist()}")
    for axis, (before, after) in enumerate(widths.tolist()):
        parts = []
        for w in (before, after):
            shape = list(x.shape)
            shape[axis] = w
            parts.append(full(shape, constant_values, _dt(x)) if w else None)
        pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
        if len(pieces) > 1:
            x = A.concatenate(pieces, axis=axis)
    return x


def squeeze(x, axis=None):
    """``x`` without its size-1 axes (or just ``axis``, which must have size 1)."""
    x = asarray(x)
    axes = [i for i in range(x.ndim) if x.shape[i] == 1] if axis is None else _axes(x, axis)
    for a in axes:
        if x.shape[a] != 1:
            raise DSLError(f"{user_source()}: cannot squeeze axis {a} of size {x.shape[a]}")
    return reshape(x, [d for i, d in enumerate(x.shape) if i not in axes])


# ----------------------------------------------------------------------------- einsum
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _parse_einsum(subscripts, operands):
    spec = subscripts.replace(" ", "")
    ins, arrow, out = spec.partition("->")
    ins = ins.split(",")
    if len(ins) != len(operands):
        raise DSLError(f"{user_source()}: einsum {subscripts!r} names {len(ins)} operands, got {len(operands)}")
    free = [c for c in _LETTERS if c not in spec]
    n_ell = _b.max([x.ndim - len(s.replace("...", "")) for s, x in zip(ins, operands) if "..." in s] or [0])
    ell = "".join(free[:n_ell])
    terms = []
    for s, x in zip(ins, operands):
        if "..." in s:
            k = x.ndim - len(s.replace("...", ""))
            s = s.replace("...", ell[n_ell - k:] if k else "")
        if len(s) != x.ndim or not all(c in _LETTERS for c in s):
            raise DSLError(f"{user_source()}: einsum term {s!r} does not match an operand of rank {x.ndim}")
        if len(set(s)) != len(s):
            raise DSLError(f"{user_source()}: einsum term {s!r} repeats an index (diagonals are not supported)")
        terms.append(s)
    if arrow:
        out = out.replace("...", ell)
    else:
        counts = {c: "".join(terms).count(c) for c in "".join(terms)}
        out = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    sizes = {}
    for s, x in zip(terms, operands):
        for c, d in zip(s, x.shape):
            if sizes.setdefault(c, d) != d:
                raise DSLError(f"{user_source()}: einsum index {c!r} has sizes {sizes[c]} and {d}")
    if any(c not in sizes for c in out) or len(set(out)) != len(out):
        raise DSLError(f"{user_source()}: einsum output {out!r} names an index no input has, or repeats one")
    return terms, out


def _sum_out(x, s, keep):
    """Sum ``x`` (indices ``s``) over the indices not in ``keep``."""
    drop = [i for i, c in enumerate(s) if c not in keep]
    if drop:
        x = A.sum(x, axis=tuple(drop))
        s = "".join(c for c in s if c in keep)
    return x, s


def _contract(a, sa, b, sb, out):
    """The einsum of two operands, to indices ``out`` (in some order; returns it), as one
    ``dot``: batch indices, a's free rows, b's free columns, contracted ones."""
    a, sa = _sum_out(a, sa, set(sb) | set(out))
    b, sb = _sum_out(b, sb, set(sa) | set(out))
    batch = [c for c in sa if c in sb and c in out]
    con = [c for c in sa if c in sb and c not in out]
    af = [c for c in sa if c not in sb]
    bf = [c for c in sb if c not in sa]
    size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
    prod = lambda cs: int(np.prod([size[c] for c in cs]))                       # noqa: E731
    bshape = tuple(size[c] for c in batch)
    a = reshape(transpose(a, [sa.index(c) for c in batch + af + con]), bshape + (prod(af), prod(con)))
    # b is read as it is stored when it can be: [batch, K, N] through matmul, else [batch, N, K] through dot_t
    if [c for c in sb if c not in batch] == con + bf:
        b = reshape(transpose(b, [sb.index(c) for c in batch + con + bf]), bshape + (prod(con), prod(bf)))
        y = A.matmul(a, b)
    else:
        b = reshape(transpose(b, [sb.index(c) for c in batch + bf + con]), bshape + (prod(bf), prod(con)))
        y = A.dot_t(a, b)
    return reshape(y, bshape + tuple(size[c] for c in af + bf)), "".join(batch + af + bf)


def einsum(subscripts, *operands):
    """Einstein summation, as ``jnp.einsum``: ``'bhqd,bhkd->bhqk'``, ``'td,dn->tn'``, ``'...d,nd->...n'``.
    Operands are contracted left to right, each pair as one ``dot`` (matmul when the second one is
    stored [K, N], else dot_t), with f32 accumulation; integer operands are refused (as ``dot``).
    Differs from JAX: no repeated index within one operand (diagonals), no broadcasting of a size-1
    dim against a longer one, no ``optimize`` order."""
    if not isinstance(subscripts, str):
        raise DSLError(f"{user_source()}: einsum needs a subscripts string first, e.g. 'td,nd->tn'")
    xs = [_tracer(x) for x in operands]
    terms, out = _parse_einsum(subscripts, xs)
    x, s = xs[0], terms[0]
    for i in range(1, len(xs)):
        later = set(out).union(*terms[i + 1:])
        x, s = _contract(x, s, xs[i], terms[i], later)
    x, s = _sum_out(x, s, set(out))
    return transpose(x, [s.index(c) for c in out])
