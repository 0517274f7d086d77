"""The user-facing traced array and the numpy-like operations on it.

Operations broadcast like numpy, promote dtypes (bool < i32 < f16 < f32), and
turn Python scalars into literals of the other operand's dtype.
"""
from __future__ import annotations

import builtins as _b

import numpy as np

from . import primitives  # noqa: F401  (registers the primitives)
from .core import PRIMITIVES as P, QUANT_DTYPES, DSLError, Lit, Var, bind, dtype_name, np_dtype, promote, user_source

_bmax = _b.max


class Tracer:
    """A value inside a traced function.  ``shape`` and ``dtype`` are static."""
    __array_priority__ = 1000

    def __init__(self, var: Var):
        self.var = var

    shape = property(lambda self: self.var.shape)
    dtype = property(lambda self: np_dtype(self.var.dtype))   # np.dtype("float32"); a quantized format: its name
    ndim = property(lambda self: len(self.var.shape))
    size = property(lambda self: self.var.size)

    def __repr__(self):
        return f"Tracer({self.var.dtype}{list(self.shape)})"

    def __iter__(self):
        raise DSLError(f"{user_source()}: cannot iterate over a traced array; index it with static slices")

    def __float__(self):
        raise DSLError(f"{user_source()}: a traced value has no Python value while tracing; return it from "
                       "the jitted function, or make what it depends on static (static_argnames)")

    __int__ = __index__ = __complex__ = __float__

    def __array__(self, *args, **kwargs):
        raise DSLError(f"{user_source()}: a traced value cannot become a numpy array while tracing; use "
                       "dsl.numpy's functions on it (numpy's own functions work on it too), or return it")

    def __bool__(self):
        raise DSLError(f"{user_source()}: a traced value has no Python truth value; use dsl.where")

    # arithmetic
    __add__ = lambda a, b: _binary("add", a, b)
    __radd__ = lambda a, b: _binary("add", b, a)
    __sub__ = lambda a, b: _binary("sub", a, b)
    __rsub__ = lambda a, b: _binary("sub", b, a)
    __mul__ = lambda a, b: _binary("mul", a, b)
    __rmul__ = lambda a, b: _binary("mul", b, a)
    __truediv__ = lambda a, b: div(a, b)
    __rtruediv__ = lambda a, b: div(b, a)
    __neg__ = lambda a: _unary("neg", a)
    __matmul__ = lambda a, b: matmul(a, b)
    __lt__ = lambda a, b: _binary("lt", a, b)
    __le__ = lambda a, b: _binary("le", a, b)
    __gt__ = lambda a, b: _binary("gt", a, b)
    __ge__ = lambda a, b: _binary("ge", a, b)
    __eq__ = lambda a, b: _binary("eq", a, b)
    __ne__ = lambda a, b: _binary("ne", a, b)
    __hash__ = object.__hash__
    __getitem__ = lambda a, idx: getitem(a, idx)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """numpy ufuncs on traced values (``np.exp(x)``, ``np.maximum(x, 0)``) map to DSL ops;
        anything else raises a DSLError naming the user's line and the DSL function to use."""
        f = _UFUNCS.get(ufunc.__name__) if method == "__call__" else None
        if f is None or kwargs:
            what = f"numpy.{ufunc.__name__}" + (f".{method}" if method != "__call__" else "")
            extra = f" with {', '.join(kwargs)}=" if f is not None else ""
            raise DSLError(f"{user_source()}: {what}{extra} is not supported on traced values; "
                           f"{_ALTERNATIVES.get(f'{ufunc.__name__}.{method}', _ALTERNATIVES.get(ufunc.__name__, _USE_DSL))}")
        return f(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        """numpy functions on traced values (``np.sum``, ``np.reshape``, ``np.where`` ...) map to
        DSL functions; anything else raises a DSLError naming the user's line."""
        f = _FUNCTIONS.get(func.__name__)
        if f is None:
            raise DSLError(f"{user_source()}: numpy.{func.__name__} is not supported on traced values; "
                           f"{_ALTERNATIVES.get(func.__name__, _USE_DSL)}")
        try:
            return f(*args, **kwargs)
        except TypeError as e:
            raise DSLError(f"{user_source()}: numpy.{func.__name__} on a traced value: {e}; "
                           f"call dsl.{f.__name__} instead") from None

    def astype(self, dtype):
        return astype(self, dtype)

    def reshape(self, *shape):
        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)

    def transpose(self, *perm):
        return transpose(self, perm[0] if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm or None)

    @property
    def T(self):
        return transpose(self)

    def sum(self, axis=None, keepdims=False):
        return sum(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return max(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return mean(self, axis, keepdims)

    # ---- numpy operators and methods (issue 9, item 1); the functions are in dsl/numpy_api.py
    __pow__ = lambda a, b: _npapi().power(a, b)
    __rpow__ = lambda a, b: _npapi().power(b, a)
    __floordiv__ = lambda a, b: _npapi().floor_divide(a, b)
    __rfloordiv__ = lambda a, b: _npapi().floor_divide(b, a)
    __mod__ = lambda a, b: _npapi().remainder(a, b)
    __rmod__ = lambda a, b: _npapi().remainder(b, a)
    __and__ = __rand__ = lambda a, b: _npapi().bitwise_and(a, b)
    __or__ = __ror__ = lambda a, b: _npapi().bitwise_or(a, b)
    __xor__ = __rxor__ = lambda a, b: _npapi().bitwise_xor(a, b)
    __invert__ = lambda a: _npapi().invert(a)
    __abs__ = lambda a: _unary("abs", a)
    __pos__ = lambda a: a

    def __len__(self):
        if not self.shape:
            raise DSLError(f"{user_source()}: len() of a traced scalar (shape ()); it has no length")
        return self.shape[0]

    def min(self, axis=None, keepdims=False):
        return _npapi().min(self, axis, keepdims)

    def argmax(self, axis=None, keepdims=False):
        return _npapi().argmax(self, axis, keepdims)

    def argmin(self, axis=None, keepdims=False):
        return _npapi().argmin(self, axis, keepdims)

    def flatten(self):
        return reshape(self, (-1,))

    ravel = flatten

    def squeeze(self, axis=None):
        return _npapi().squeeze(self, axis)

    # (no .var(): ``Tracer.var`` is the traced IR variable; dsl.var(x, axis) is the variance)
    def std(self, axis=None, ddof=0, keepdims=False):
        return _npapi().std(self, axis, ddof=ddof, keepdims=keepdims)

    def cumsum(self, axis=None):
        return _npapi().cumsum(self, axis)

    def clip(self, min=None, max=None):  # noqa: A002
        return _npapi().clip(self, min, max)

    def sort(self, axis=-1):
        return _npapi().sort(self, axis)

    def argsort(self, axis=-1):
        return _npapi().argsort(self, axis)


def _npapi():
    """dsl.numpy_api, imported on first use (it builds on this module)."""
    from . import numpy_api
    return numpy_api


def _dt(x) -> str:
    """Our dtype name of a Tracer, Lit or Var ("f32"): internal code keys on the names."""
    return x.var.dtype if isinstance(x, Tracer) else x.dtype


def _lit(x, dtype):
    if dtype == "bool":
        return Lit(bool(x), dtype)
    if dtype == "i32":
        if isinstance(x, float) and not float(x).is_integer():
            raise DSLError(f"{user_source()}: float {x} mixed with an i32 array; convert the array with .astype('f32')")
        return Lit(int(x), dtype)
    return Lit(float(x), dtype)


def asarray(x, dtype=None):
    if isinstance(x, Tracer):
        return x
    if isinstance(x, Lit):                  # a literal promoted once already (a ^ 3 promotes twice)
        return x if dtype is None or dtype == x.dtype else _lit(x.value, dtype)
    if isinstance(x, (bool, int, float, np.number)):
        d = dtype or ("bool" if isinstance(x, bool) else "i32" if isinstance(x, (int, np.integer)) else "f32")
        return _lit(x, d)
    from .core import _TRACES
    if not _TRACES:
        raise DSLError(f"{user_source()}: DSL operations need a traced function: wrap the code in dsl.jit "
                       "(a QArray's own float values: its .dequantize())"
                       if hasattr(x, "dequantize") else
                       f"{user_source()}: DSL operations need a traced function: wrap the code in dsl.jit")
    raise DSLError(f"{user_source()}: cannot use {type(x).__name__} inside a traced function; "
                   "pass arrays as arguments of the jitted function")


def _promote_pair(a, b):
    """Return (a, b) as atoms of one dtype; Python scalars take the array's dtype."""
    ta, tb = isinstance(a, Tracer), isinstance(b, Tracer)
    for x in (a, b):
        if isinstance(x, Tracer) and _dt(x) in QUANT_DTYPES:
            raise DSLError(f"{user_source()}: a {_dt(x)}{list(x.shape)} array is quantized; read it through "
                           "dsl.dequantize (linear, dot_t, matmul, take and astype do that for you)")
    if ta and not tb:
        return a, asarray(b, _dt(a) if not (isinstance(b, (float, np.floating)) and _dt(a) in ("i32", "bool")) else "f32")
    if tb and not ta:
        return asarray(a, _dt(b) if not (isinstance(a, (float, np.floating)) and _dt(b) in ("i32", "bool")) else "f32"), b
    if not ta and not tb:           # two Python scalars (dsl.where(c, 1, 0.5)): numpy's weak types
        kinds = [bool if isinstance(x, (bool, np.bool_)) else float if isinstance(x, (float, np.floating))
                 else int for x in (a, b)]
        d = "f32" if float in kinds else "i32" if int in kinds else "bool"
        return asarray(a, d), asarray(b, d)
    return a, b


def _fix_dtypes(a, b):
    d = promote(_dt(a), _dt(b))
    return (a if _dt(a) == d else astype(a, d)), (b if _dt(b) == d else astype(b, d))


def broadcast_shapes(*shapes):
    nd = _bmax(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dims = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0} - {1}
        if len(dims) > 1:
            raise DSLError(f"{user_source()}: shapes {', '.join(str(list(s)) for s in shapes)} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_to(x, shape):
    shape = tuple(shape)
    if x.shape == shape:
        return x
    nd = len(shape)
    dims = tuple(range(nd - len(x.shape), nd))
    return bind(P["broadcast_in_dim"], x, shape=shape, dims=dims)


def _binary(name, a, b):
    if not (isinstance(a, Lit) or isinstance(b, Lit)):
        a, b = _promote_pair(a, b)
    if _dt(a) != _dt(b):
        a, b = _fix_dtypes(a, b)
    shape = broadcast_shapes(a.shape, b.shape)
    return bind(P[name], broadcast_to(a, shape), broadcast_to(b, shape))


def _unary(name, x):
    x = asarray(x)
    if P[name].rule is primitives._float_unary_rule and _dt(x) in ("i32", "bool"):
        # sqrt, exp, ... of integers give floats, as in numpy and JAX
        x = Lit(float(x.value), "f32") if isinstance(x, Lit) else astype(x, "f32")
    return bind(P[name], x)


def _make_api(api, name, arity):
    """The public function of an elementwise primitive (see ``dsl.primitives.elementwise``)."""
    if arity == 1:
        def f(x):
            return _unary(name, x)
    else:
        def f(a, b):
            return _binary(name, a, b)
    f.__name__ = f.__qualname__ = api
    f.__doc__ = (f"``{name}`` elementwise" + (", with numpy broadcasting and dtype promotion" if arity == 2 else "")
                 + "; see dsl/primitives.py.")
    return f


ELEMENTWISE_API = sorted(primitives.API)
for _api, (_name, _arity) in primitives.API.items():
    globals()[_api] = _make_api(_api, _name, _arity)


def div(a, b):
    """True division; integer operands give f32, as in numpy and JAX."""
    a, b = _promote_pair(a, b)
    if _dt(a) in ("i32", "bool") and _dt(b) in ("i32", "bool"):
        a, b = (Lit(float(x.value), "f32") if isinstance(x, Lit) else astype(x, "f32") for x in (a, b))
    return _binary("div", a, b)


def astype(x, dtype):
    """``x`` converted to ``dtype``: a numpy dtype or type (``np.float16``), a numpy name or code
    ('float32', 'f4') or ours ('f32'); a quantized array is dequantized.  float64 and int64 give
    float32 and int32 (as JAX without x64); bfloat16 is refused (a storage dtype here)."""
    x, dtype = asarray(x), dtype_name(dtype)
    if dtype in QUANT_DTYPES:
        raise DSLError(f"{user_source()}: astype({dtype!r}): quantize weights outside the traced function "
                       "with dsl.QArray.quantize")
    if _dt(x) in QUANT_DTYPES:
        return dequantize(x, dtype)
    return x if _dt(x) == dtype else bind(P["convert"], x, dtype=dtype)


def dequantize(w, dtype="f32"):
    """The float values of a quantized array ``w`` (q4_0, q4_1, q8_0; shape [..., K], K a multiple
    of 32) as ``dtype`` ("f32" or "f16").  Fused into the kernel that reads them: inside a GEMV each
    weight is dequantized as it is loaded, and no float copy is written (fusion rule
    ``dequantize``).  Formats: ``dsl/quant.py``."""
    w, dtype = asarray(w), dtype_name(dtype)
    return w if _dt(w) == dtype else bind(P["dequantize"], w, dtype=dtype)


def _float(x):
    """``x``, dequantized to f32 when it is a quantized array."""
    x = asarray(x)
    return dequantize(x) if _dt(x) in QUANT_DTYPES else x


def where(cond, a, b):
    """``cond ? a : b`` elementwise, with broadcasting."""
    a, b = _promote_pair(a, b) if not (isinstance(a, Tracer) and isinstance(b, Tracer)) else (a, b)
    if _dt(a) != _dt(b):
        a, b = _fix_dtypes(a, b)
    cond = asarray(cond, "bool")
    shape = broadcast_shapes(cond.shape, a.shape, b.shape)
    return bind(P["select"], broadcast_to(cond, shape), broadcast_to(a, shape), broadcast_to(b, shape))


def iota(shape, dimension=0, dtype="i32"):
    """Array of ``shape`` whose value is its index along ``dimension``."""
    return bind(P["iota"], shape=tuple(shape), dimension=dimension, dtype=dtype_name(dtype))


def arange(start, stop=None, step=None, dtype=None):
    """``jnp.arange``: see ``dsl.numpy_api.arange``."""
    return _npapi().arange(start, stop, step, dtype)


def reshape(x, shape):
    shape = list(shape)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < -1 for d in shape) \
            or shape.count(-1) > 1:
        raise DSLError(f"{user_source()}: bad shape {shape} for reshape (ints >= 0, at most one -1)")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1]))
        shape[shape.index(-1)] = x.size // known if known else 0
    shape = tuple(shape)
    return x if shape == x.shape else bind(P["reshape"], x, shape=shape)


def transpose(x, perm=None):
    perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(normalize_axis(p, x.ndim) for p in perm)
    return x if perm == tuple(range(x.ndim)) else bind(P["transpose"], x, perm=perm)


def swapaxes(x, a, b):
    a, b = normalize_axis(a, x.ndim), normalize_axis(b, x.ndim)
    perm = list(range(x.ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


def normalize_axis(axis, ndim, what="axis"):
    """``axis`` as an index in [0, ndim); DSLError naming the user's line when it is out of range."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise DSLError(f"{user_source()}: {what} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise DSLError(f"{user_source()}: {what} {axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def expand_dims(x, axis):
    shape = list(x.shape)
    shape.insert(normalize_axis(axis, x.ndim + 1), 1)
    return reshape(x, shape)


def slice_(x, start, limit):
    return bind(P["slice"], x, start=tuple(start), limit=tuple(limit))


def concatenate(xs, axis=0):
    xs = [asarray(x) for x in xs]
    if not xs or xs[0].ndim == 0:
        raise DSLError(f"{user_source()}: concatenate needs one or more arrays of rank >= 1")
    return bind(P["concatenate"], *xs, axis=normalize_axis(axis, xs[0].ndim))


def getitem(x, idx):
    """``x[idx]`` as in numpy and JAX: ints, slices (any step), ``None``, ``...``, and integer
    index arrays (traced, or small static lists / numpy arrays) with numpy's advanced-indexing
    rules; a traced scalar ``i`` in ``x[i]`` or ``x[i, :, j]`` is a 0-d index array.  Negative
    indices count from the end; traced indices still out of range are clamped (as JAX does for
    gathers).  A boolean mask (``x[mask]``) has a data-dependent shape: use ``dsl.where``.
    Errors (float or bool index, too many indices, a static index out of range) name the line."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, slice) and any(isinstance(b, Tracer) for b in (i.start, i.stop, i.step)) for i in idx):
        raise DSLError(f"{user_source()}: a slice bound is a traced value (its size would depend on data); "
                       "make it static (static_argnames) or use dsl.lax.dynamic_slice with a static size")
    if any(_advanced(i) or (isinstance(i, slice) and i.step not in (None, 1)) for i in idx):
        return _gather_index(asarray(x), idx)
    for i in idx:
        if not (i is None or i is Ellipsis or isinstance(i, slice)
                or (isinstance(i, (int, np.integer)) and not isinstance(i, bool))):
            raise DSLError(f"{user_source()}: index {i!r} is not supported; use ints, slices, None, ... "
                           "and integer arrays")
    if [i is Ellipsis for i in idx].count(True) > 1:
        raise DSLError(f"{user_source()}: an index can hold one ... only")
    if len([i for i in idx if i is not None and i is not Ellipsis]) > x.ndim:
        raise DSLError(f"{user_source()}: too many indices for an array of rank {x.ndim}")
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        n_real = len([i for i in idx if i is not None and i is not Ellipsis])
        idx = idx[:k] + (slice(None),) * (x.ndim - n_real) + idx[k + 1:]
    idx = idx + (slice(None),) * (x.ndim - len([i for i in idx if i is not None]))
    start, limit, out_shape, dim = [], [], [], 0
    for i in idx:
        if i is None:
            out_shape.append(1)
            continue
        n = x.shape[dim]
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step != 1:
                raise DSLError(f"{user_source()}: slice steps other than 1 are not supported")
            b = _bmax(a, b)
            start.append(a), limit.append(b), out_shape.append(b - a)
        else:
            j = int(i) + n if int(i) < 0 else int(i)
            if not 0 <= j < n:
                raise DSLError(f"{user_source()}: index {i} out of range for axis {dim} of size {n}")
            start.append(j), limit.append(j + 1)
        dim += 1
    y = x if (tuple(start) == (0,) * x.ndim and tuple(limit) == x.shape) else slice_(x, start, limit)
    return reshape(y, out_shape)


def _axis_to_last(x, axis):
    axis = axis % x.ndim
    if axis != x.ndim - 1:
        perm = [i for i in range(x.ndim) if i != axis] + [axis]
        x = transpose(x, perm)
    return x


def _reduce(name, x, axis, keepdims):
    x = asarray(x)
    if x.ndim == 0:
        raise DSLError(f"{user_source()}: cannot reduce a scalar")
    axes = tuple(range(x.ndim)) if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    axes = sorted(normalize_axis(a, x.ndim) for a in axes)
    if len(set(axes)) != len(axes):
        raise DSLError(f"{user_source()}: repeated axis in {axis!r}")
    keep = [i for i in range(x.ndim) if i not in axes]
    y = transpose(x, keep + axes)
    y = reshape(y, [x.shape[i] for i in keep] + [int(np.prod([x.shape[a] for a in axes]))])
    y = bind(P[name], y)
    if keepdims:
        y = reshape(y, [1 if i in axes else x.shape[i] for i in range(x.ndim)])
    return y


def sum(x, axis=None, keepdims=False):  # noqa: A001
    """Sum over ``axis`` (accumulated in float32 for f16 inputs by the kernels).  A bool array
    sums as i32, a count (numpy gives int64, JAX int32)."""
    x = asarray(x)
    return _reduce("reduce_sum", astype(x, "i32") if _dt(x) == "bool" else x, axis, keepdims)


def max(x, axis=None, keepdims=False):  # noqa: A001
    return _reduce("reduce_max", x, axis, keepdims)


def argmax(x, axis=-1):
    return _reduce("argmax", x, axis, False)


def mean(x, axis=None, keepdims=False):
    """Mean over ``axis``; integer inputs give f32, f16 inputs are summed in f32 and give f16."""
    x = asarray(x)
    axes = range(x.ndim) if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    n = int(np.prod([x.shape[normalize_axis(a, x.ndim)] for a in axes]))
    if _dt(x) == "f16":        # sum in f32 (the sum may pass 65504 while the mean fits), scale, round back
        return astype(sum(astype(x, "f32"), axis, keepdims) * (1.0 / n), "f16")
    return sum(x, axis, keepdims) * (1.0 / n)


def matmul(a, b):
    """``a @ b`` with numpy broadcasting of batch dims; vectors are promoted to matrices."""
    return _dot(a, b, trans_b=False)


def dot_t(a, b):
    """``a @ b^T`` over the last two axes (``b`` is [..., N, K]): the layout of linear weights."""
    return _dot(a, b, trans_b=True)


def _dot(a, b, trans_b):
    a, b = _float(a), _float(b)
    va, vb = a.ndim == 1, b.ndim == 1
    if va:
        a = reshape(a, (1,) + a.shape)
    if vb:
        b = reshape(b, (b.shape[0], 1) if not trans_b else (1, b.shape[0]))
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = broadcast_to(a, batch + a.shape[-2:])
    b = broadcast_to(b, batch + b.shape[-2:])
    y = bind(P["dot"], a, b, trans_b=trans_b)
    if va:
        y = reshape(y, y.shape[:-2] + y.shape[-1:])
    if vb:
        y = reshape(y, y.shape[:-1])
    return y


def take(x, ids, axis=0, mode=None, fill_value=None, *, unique_indices=False, indices_are_sorted=False):
    """``x`` at integer ``ids`` along ``axis``: shape x.shape[:axis] + ids.shape + x.shape[axis+1:]
    (``take(emb, ids)`` is an embedding lookup; a quantized ``x`` is dequantized as it is read).

    ``mode``: None or "clip" clamps indices into [0, n) (negative ones to 0), "wrap" takes them
    modulo n, "fill" counts negative ones from the end once and gives ``fill_value`` (NaN for
    floats, the most negative i32, True) for those still out of range.  Differs from ``jnp.take``: the default axis is
    0 (JAX's None flattens ``x``; pass axis=None for that) and the default mode clamps (JAX's
    fills with NaN)."""
    x, ids = _float(x), _index_array(ids, "take")
    if axis is None:
        x, axis = reshape(x, (x.size,)), 0
    axis = normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if mode not in (None, "clip", "wrap", "fill", "promise_in_bounds"):
        raise DSLError(f"{user_source()}: take mode {mode!r}; use None, 'clip', 'wrap' or 'fill'")
    if mode == "wrap":
        ids = _binary("mod", _binary("add", _binary("mod", ids, n), n), n)
    elif mode == "fill":
        ids = where(_binary("lt", ids, 0), _binary("add", ids, n), ids)
    y = bind(P["take"], x, ids) if axis == 0 else _gather_index(
        x, (slice(None),) * axis + (ids,), normalize=False)
    if mode != "fill":
        return y
    ok = _binary("and", _binary("ge", ids, 0), _binary("lt", ids, n))
    ok = broadcast_to(reshape(ok, (1,) * axis + ids.shape + (1,) * (x.ndim - axis - 1)), y.shape)
    return where(ok, y, _fill(_dt(y), fill_value))


def dynamic_update_slice(x, update, starts):
    """``x`` with ``update`` written at runtime offsets ``starts`` (i32 scalars or ints), like
    ``jax.lax.dynamic_update_slice``.  Offsets are clamped so the update fits."""
    if not isinstance(starts, (list, tuple)):
        raise DSLError(f"{user_source()}: starts must be a list with one offset per axis, got {starts!r}")
    return bind(P["dynamic_update_slice"], x, update, *[asarray(s, "i32") for s in starts])


def attention(q, k, v, pos, scale):
    """Causal grouped-query attention over a KV cache.

    q [Hq, T, D] holds queries at absolute positions pos..pos+T-1; k, v [Hkv, S, D]
    are the cache (S = capacity).  Query t sees keys 0..pos+t only, so cost grows
    with the tokens in the cache, not its capacity.  Query head h reads kv head
    h // (Hq // Hkv).  Returns f32 [Hq, T, D].  Softmax accumulates in float32.
    """
    return bind(P["attention"], q, k, v, asarray(pos, "i32"), scale=float(scale))


# ----------------------------------------------------------------------------- numpy interoperability
_USE_DSL = "use the dsl functions (dsl.exp, dsl.maximum, dsl.where, dsl.sum, ...) inside a traced function"
_E = {api: globals()[api] for api in ELEMENTWISE_API}          # the functions made from dsl/primitives.py
_UFUNCS = {
    "exp": _E["exp"], "log": _E["log"], "sqrt": _E["sqrt"], "sin": _E["sin"], "cos": _E["cos"],
    "tanh": _E["tanh"], "negative": _E["neg"], "absolute": _E["abs"], "fabs": _E["abs"], "add": _E["add"],
    "subtract": _E["sub"], "multiply": _E["mul"], "divide": div, "true_divide": div,
    "maximum": _E["maximum"], "minimum": _E["minimum"], "floor": _E["floor"],
    "matmul": matmul,          # (np.fmax and np.fmin ignore NaN; dsl.maximum propagates it: not mapped)
    "less": lambda a, b: _binary("lt", a, b), "less_equal": lambda a, b: _binary("le", a, b),
    "greater": lambda a, b: _binary("gt", a, b), "greater_equal": lambda a, b: _binary("ge", a, b),
    "equal": lambda a, b: _binary("eq", a, b), "not_equal": lambda a, b: _binary("ne", a, b),
    "logical_and": _E["logical_and"], "logical_or": _E["logical_or"], "logical_not": _E["logical_not"],
}
_FUNCTIONS = {
    "sum": sum, "max": max, "amax": max, "mean": mean, "argmax": argmax, "reshape": reshape,
    "transpose": transpose, "swapaxes": swapaxes, "expand_dims": expand_dims, "concatenate": concatenate,
    "where": where, "take": take, "matmul": matmul, "broadcast_to": broadcast_to,
}
_ALTERNATIVES = {
    "add.reduce": "use dsl.sum(x, axis)", "maximum.reduce": "use dsl.max(x, axis)",
    "square": "write x * x", "power": "write x * x, or dsl.exp(y * dsl.log(x))",
    "reciprocal": "write 1.0 / x", "floor_divide": "convert to i32 and use //-free arithmetic, or dsl.div",
    "exp2": "use dsl.exp(x * 0.6931471805599453)", "log2": "use dsl.log(x) * 1.4426950408889634",
    "log1p": "use dsl.log(1.0 + x)", "expm1": "use dsl.exp(x) - 1.0", "tan": "use dsl.sin(x) / dsl.cos(x)",
    "min": "use -dsl.max(-x)", "amin": "use -dsl.max(-x)", "argmin": "use dsl.argmax(-x)",
    "dot": "use x @ w or dsl.dot_t", "clip": "use dsl.minimum(dsl.maximum(x, lo), hi)",
    "logical_not": "use dsl.where(c, False, True)", "sign": "use dsl.where(x > 0, 1.0, 0.0) - dsl.where(x < 0, 1.0, 0.0)",
}


# ---- numpy functions (issue 9, items 1 and 2): numpy's own functions on traced values
def _numpy_names():
    """Map numpy's functions and ufuncs on traced values to dsl/numpy_api.py (called on import)."""
    from . import numpy_api as N
    _UFUNCS.update({
        "power": N.power, "floor_divide": N.floor_divide, "remainder": N.remainder, "mod": N.remainder,
        "bitwise_and": N.bitwise_and, "bitwise_or": N.bitwise_or, "bitwise_xor": N.bitwise_xor,
        "invert": N.invert, "logical_and": N.logical_and, "logical_or": N.logical_or,
        "logical_not": N.logical_not, "erf": globals()["erf"], "log1p": globals()["log1p"],
        "expm1": globals()["expm1"], "square": lambda x: N.power(x, 2),
    })
    for name in ("min", "amin", "argmin", "argmax", "var", "std", "cumsum", "sort", "argsort", "stack", "split",
                 "tril", "triu", "clip", "repeat", "pad", "squeeze", "einsum", "zeros_like", "ones_like",
                 "full_like"):
        _FUNCTIONS[name] = getattr(N, name)
    _FUNCTIONS.update(ravel=lambda x: reshape(x, (-1,)), power=N.power)
    for name in ("square", "power", "floor_divide", "log1p", "expm1", "min", "amin", "argmin", "clip",
                 "logical_not"):
        _ALTERNATIVES.pop(name, None)


# ----------------------------------------------------------------------------- indexing
# x[ids], x[i, :, j], take_along_axis and x.at[idx].set/add/mul/min/max, all through two primitives:
# gather (one clamped index array per dim of x, all of the output's shape) and scatter (the same,
# the update combined into a copy of x, or into x in place when it is donated; out-of-range dropped)
_MAX_STATIC_IDS = 64          # a static index list becomes a constant array of at most this many ids
_MASK_FIX = "a boolean mask has a data-dependent shape; use dsl.where(mask, x, 0) (or another fill value)"


def _advanced(i):
    """Is index entry ``i`` an index array (traced, a list or a numpy array, not a slice or int)?"""
    return isinstance(i, (Tracer, list, np.ndarray))


def _index_array(i, what):
    """Index entry ``i`` as an i32 Tracer (or Lit); DSLError for float or bool indices and masks."""
    if isinstance(i, (list, np.ndarray)):
        a = np.asarray(i)
        if a.dtype == bool:
            raise DSLError(f"{user_source()}: {what} with a boolean mask: {_MASK_FIX}")
        if a.dtype.kind not in "iu" and a.size:
            raise DSLError(f"{user_source()}: {what} index {i!r} is not an integer array")
        return _index_array(_const_ids(a.astype(np.int64)), what)
    if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
        i = Lit(int(i), "i32")
    if isinstance(i, Lit) and i.dtype == "i32":             # a 0-d traced constant
        return bind(P["broadcast_in_dim"], i, shape=(), dims=())
    if not isinstance(i, Tracer):
        raise DSLError(f"{user_source()}: {what} index {i!r} is not supported; use ints, slices, None, ... "
                       "and integer arrays")
    if _dt(i) == "bool":
        raise DSLError(f"{user_source()}: {what} with a boolean mask: {_MASK_FIX}")
    if _dt(i) != "i32":
        raise DSLError(f"{user_source()}: {what} index must be an integer array, got {i.dtype}; "
                       "convert it with .astype('int32')")
    return i


def _const_ids(a):
    """A static integer array as a traced i32 constant (an arithmetic progression is an iota)."""
    if a.size == 0 or a.size > _MAX_STATIC_IDS:
        raise DSLError(f"{user_source()}: a static index array of {a.size} ids is not supported "
                       f"(1 to {_MAX_STATIC_IDS}); pass the ids as an argument of the jitted function")
    if np.any(np.abs(a) >= 2 ** 31):
        raise DSLError(f"{user_source()}: index {a.ravel()[np.argmax(np.abs(a.ravel()))]} does not fit in i32")
    if a.ndim == 0:
        return Lit(int(a), "i32")
    flat = a.ravel()
    step = int(flat[1] - flat[0]) if flat.size > 1 else 0
    if np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        ids = iota((flat.size,))
        ids = ids if step == 1 else _binary("mul", ids, step)
        ids = ids if flat[0] == 0 else _binary("add", ids, int(flat[0]))
    else:
        ids = concatenate([broadcast_to(Lit(int(v), "i32"), (1,)) for v in flat])
    return reshape(ids, a.shape)


def _expand_index(x, idx, what):
    """The entries of index tuple ``idx`` for ``x``: ``...`` expanded, every entry None, a slice,
    a static int (checked, made non-negative) or an i32 index array (a Tracer)."""
    if [i is Ellipsis for i in idx].count(True) > 1:
        raise DSLError(f"{user_source()}: an index can hold one ... only")
    real = [i for i in idx if i is not None and i is not Ellipsis]
    if len(real) > x.ndim:
        raise DSLError(f"{user_source()}: too many indices ({len(real)}) for an array of rank {x.ndim}")
    k = next((j for j, i in enumerate(idx) if i is Ellipsis), len(idx))
    idx = tuple(idx[:k]) + (slice(None),) * (x.ndim - len(real)) + tuple(idx[k + 1:])
    out, dim = [], 0
    for i in idx:
        if i is None or isinstance(i, slice):
            out.append(i)
        elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            n = x.shape[dim]
            if not -n <= int(i) < n:
                raise DSLError(f"{user_source()}: index {int(i)} out of range for axis {dim} of size {n}")
            out.append(int(i) % n)
        else:
            out.append(_index_array(i, what))
        dim += i is not None
    return out


def _index_plan(x, entries, normalize=True):
    """Numpy's advanced indexing as one index array per dim of ``x``, all of the result's shape.

    Returns (shape, ids, (first, count)): the index arrays broadcast together to shape B, placed
    where the first of them stands when they are adjacent in the index, else first (numpy's
    rule); ``first, count``: where B's dims sit in ``shape``.  Static ints join the index arrays.
    Gather and scatter count negative indices from the end; ``normalize=False`` clamps them to 0."""
    adv = [k for k, t in enumerate(entries) if t is not None and not isinstance(t, slice)]
    arrays = {k: (Lit(entries[k], "i32") if isinstance(entries[k], int) else entries[k]) for k in adv}
    bshape = broadcast_shapes(*[a.shape for a in arrays.values()]) if adv else ()
    adjacent = adv == list(range(adv[0], adv[-1] + 1)) if adv else True
    shape, first, dims = ([] if adjacent else list(bshape)), 0, {}
    dim = 0
    for k, t in enumerate(entries):
        if t is None:
            shape.append(1)
            continue
        if isinstance(t, slice):
            start, stop, step = t.indices(x.shape[dim])
            dims[dim] = (len(shape), start, step)
            shape.append(len(range(start, stop, step)))
        elif adjacent and k == adv[0]:
            first = len(shape)
            shape += list(bshape)
        dim += 1
    shape, ids, dim = tuple(shape), [], 0
    for k, t in enumerate(entries):
        if t is None:
            continue
        if isinstance(t, slice):
            q, start, step = dims[dim]
            i = iota(shape, q)
            i = i if step == 1 else _binary("mul", i, step)
            ids.append(i if start == 0 else _binary("add", i, start))
        else:
            a = arrays[k]
            if not normalize and isinstance(a, Tracer):       # negative indices clamp to 0
                a = _binary("max", a, 0)
            at = tuple(range(first + len(bshape) - a.ndim, first + len(bshape)))
            ids.append(a if a.shape == shape else bind(P["broadcast_in_dim"], a, shape=shape, dims=at))
        dim += 1
    return shape, ids, (first, len(bshape))


def _gather_index(x, idx, normalize=True):
    """``x[idx]`` for an index with index arrays or slice steps (see ``getitem``)."""
    x = _float(x)
    entries = _expand_index(x, tuple(idx), "x[...]")
    real = [t for t in entries if t is not None]
    if (isinstance(real[0], Tracer) and all(t is not None for t in entries)
            and all(isinstance(t, slice) and t == slice(None) for t in real[1:])):
        ids = real[0]                                              # rows: the embedding lookup
        if normalize:
            ids = where(_binary("lt", ids, 0), _binary("add", ids, x.shape[0]), ids)
        return bind(P["take"], x, ids)
    shape, ids, _ = _index_plan(x, entries, normalize)
    return bind(P["gather"], x, *ids)


def take_along_axis(arr, indices, axis=-1, mode=None, fill_value=None):
    """``out[..., i, ...] = arr[..., indices[..., i, ...], ...]`` along ``axis``, as
    ``jnp.take_along_axis``: ``indices`` (integers, the rank of ``arr``) broadcasts with ``arr`` in
    the other dims; axis None takes from ``arr`` flattened (1-d ``indices``).  Negative indices
    count from the end; those still out of range give ``fill_value`` (mode None or "fill": NaN for
    floats, the most negative i32, True) or are clamped (mode "clip")."""
    arr, indices = _float(arr), _index_array(indices, "take_along_axis")
    if axis is None:
        arr, axis = reshape(arr, (arr.size,)), 0
    if indices.ndim != arr.ndim:
        raise DSLError(f"{user_source()}: take_along_axis needs indices of the rank of arr ({arr.ndim}), "
                       f"got {list(indices.shape)}")
    if mode not in (None, "clip", "fill", "promise_in_bounds"):
        raise DSLError(f"{user_source()}: take_along_axis mode {mode!r}; use None ('fill') or 'clip'")
    axis = normalize_axis(axis, arr.ndim)
    n = arr.shape[axis]
    other = broadcast_shapes(*[tuple(1 if d == axis else s for d, s in enumerate(a.shape)) for a in (arr, indices)])
    shape = tuple(indices.shape[axis] if d == axis else s for d, s in enumerate(other))
    ids = broadcast_to(indices, shape)             # gather counts negative indices from the end
    per_dim = [ids if d == axis else iota(shape, d) if arr.shape[d] > 1 else broadcast_to(Lit(0, "i32"), shape)
               for d in range(arr.ndim)]
    y = bind(P["gather"], arr, *per_dim)
    if mode not in (None, "fill"):
        return y
    ok = _binary("and", _binary("ge", ids, -n), _binary("lt", ids, n))
    return where(ok, y, _fill(_dt(y), fill_value))


def _fill(dtype, value):
    """JAX's fill value for out-of-range gathers: NaN for floats, the most negative i32, True."""
    if value is not None:
        return value
    return {"i32": -2 ** 31, "bool": True}.get(dtype, float("nan"))


class _IndexUpdate:
    """``x.at[idx]``: functional updates of the elements ``x[idx]`` selects, like JAX's ``.at``.

    ``set``, ``add``, ``mul``, ``min``, ``max`` return a new array (written into ``x`` in place when
    ``x`` is a donated argument that nothing later reads); ``get`` is ``x[idx]``.  ``values``
    broadcast to the shape of ``x[idx]`` and are cast to ``x``'s dtype.  Negative indices count
    from the end; traced indices still out of range are dropped (mode None, "drop" or "fill", as
    JAX), or clamped (mode "clip").  Repeated indices: ``add``/``mul``/``min``/``max`` combine every
    update, ``set`` keeps the last (JAX leaves that unspecified).  ``unique_indices=True`` promises
    no repeats, so the updates also run in parallel over the index arrays."""

    def __init__(self, x, idx):
        self.x, self.idx = x, idx if isinstance(idx, tuple) else (idx,)

    def get(self, *, indices_are_sorted=False, unique_indices=False, mode=None, fill_value=None):
        """``x[idx]`` (out-of-range traced indices clamp; JAX's mode="fill" is not supported here:
        use ``dsl.take(..., mode="fill")``)."""
        if mode not in (None, "clip", "promise_in_bounds") or fill_value is not None:
            raise DSLError(f"{user_source()}: .at[...].get supports mode None or 'clip' (indices clamp); "
                           "for a fill value use dsl.take(x, ids, axis, mode='fill', fill_value=...)")
        return getitem(self.x, self.idx)

    def _apply(self, op, values, mode, unique_indices):
        x = asarray(self.x)
        if mode not in (None, "drop", "fill", "clip", "promise_in_bounds"):
            raise DSLError(f"{user_source()}: .at[...].{op} mode {mode!r}; use None, 'drop' or 'clip'")
        if op != "set" and _dt(x) == "bool":
            raise DSLError(f"{user_source()}: .at[...].{op} on a bool array; convert it with .astype('i32')")
        entries = _expand_index(x, self.idx, f".at[...].{op}")
        if any(t is None for t in entries):
            raise DSLError(f"{user_source()}: None in an .at[...] index adds no element to update; drop it")
        shape, ids, (first, nb) = _index_plan(x, entries)
        if mode == "clip":
            ids = [_binary("max", _binary("min", i, n - 1), 0) for i, n in zip(ids, x.shape)]
        v = asarray(values, _dt(x)) if not isinstance(values, Tracer) else values
        v = v if _dt(v) == _dt(x) else astype(v, _dt(x))
        if len(v.shape) > len(shape) or any(a not in (1, b) for a, b in zip(v.shape[::-1], shape[::-1])):
            raise DSLError(f"{user_source()}: .at[...].{op} values of shape {list(v.shape)} do not broadcast "
                           f"to the indexed shape {list(shape)}")
        v = broadcast_to(v, shape)
        batch = 0 if unique_indices else nb
        perm = [q for q in range(len(shape)) if not first <= q < first + nb] + list(range(first, first + nb))
        v, ids = transpose(v, perm), [transpose(i, perm) for i in ids]
        return bind(P["scatter"], x, v, *ids, op=op, batch=batch)

    def set(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):
        return self._apply("set", values, mode, unique_indices)

    def add(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):
        return self._apply("add", values, mode, unique_indices)

    def mul(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):
        return self._apply("mul", values, mode, unique_indices)

    multiply = mul

    def min(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):  # noqa: A003
        return self._apply("min", values, mode, unique_indices)

    def max(self, values, *, indices_are_sorted=False, unique_indices=False, mode=None):  # noqa: A003
        return self._apply("max", values, mode, unique_indices)


class _At:
    def __init__(self, x):
        self.x = x

    def __getitem__(self, idx):
        return _IndexUpdate(self.x, idx)


Tracer.at = property(lambda self: _At(self), doc="``x.at[idx].set(v)`` and friends: see ``_IndexUpdate``.")
_FUNCTIONS["take_along_axis"] = take_along_axis


def _np_take(a, indices, axis=None, out=None, mode=None):
    """``np.take`` on a traced value: numpy's default axis (None: ``a`` flattened)."""
    if out is not None:
        raise DSLError(f"{user_source()}: numpy.take with out= is not supported on traced values")
    return take(a, indices, axis, "clip" if mode in (None, "raise") else mode)


_np_take.__name__ = "take"
_FUNCTIONS["take"] = _np_take


def jnp_take(a, indices, axis=None, out=None, mode=None, unique_indices=False, indices_are_sorted=False,
             fill_value=None):
    """``jnp.take`` exactly (``dsl.numpy.take``): axis None flattens ``a``; mode None is "fill"
    (NaN for floats out of range).  ``dsl.take`` differs in its defaults (axis 0, clamping)."""
    if out is not None:
        raise DSLError(f"{user_source()}: take with out= is not supported")
    return take(a, indices, axis, "fill" if mode is None else mode, fill_value)
# ---- end of indexing
