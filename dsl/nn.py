"""``dsl.nn``: the names of ``jax.nn`` we support (activations, normalizers).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

# ---- activations and normalizers (issue 9, item 4)
import math  # noqa: E402

from . import array as _A  # noqa: E402
from . import numpy_api as _N  # noqa: E402
from .array import _dt, asarray  # noqa: E402
from .core import DSLError, user_source  # noqa: E402

sigmoid = _A.sigmoid          # jax.nn.sigmoid: 1 / (1 + exp(-x)), the ``logistic`` primitive


def _float(x):
    """``x`` as a traced float array (ints and bools as f32, as ``jax.nn`` promotes them)."""
    x = _N._tracer(x)
    return x if _dt(x) in ("f16", "f32") else x.astype("float32")


def relu(x):
    """max(x, 0); NaN stays NaN (as JAX)."""
    return _A.maximum(asarray(x), 0)


def silu(x):
    """SiLU / swish: x * sigmoid(x)."""
    x = _float(x)
    return x * sigmoid(x)


swish = silu


def gelu(x, approximate=True):
    """GELU.  ``approximate=True`` (JAX's default): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)));
    ``approximate=False``: the exact 0.5 x (1 + erf(x / sqrt(2)))."""
    x = _float(x)
    if approximate:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))
        return 0.5 * x * (1.0 + _A.tanh(inner))
    return 0.5 * x * (1.0 + _A.erf(x * (1.0 / math.sqrt(2.0))))


def softplus(x):
    """log(1 + exp(x)), stable for any |x|: max(x, 0) + log1p(exp(-|x|)) (no overflow for large x,
    no lost digits for very negative x)."""
    x = _float(x)
    return _A.maximum(x, 0) + _A.log1p(_A.exp(-_A.abs(x)))


def log_sigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), stable for any |x|."""
    return -softplus(-_float(x))


def _finite_max(x, axis):
    """max over ``axis`` (kept), with infinities and NaN replaced by 0: the shift that keeps exp
    in range without turning an all -inf row into NaN."""
    m = _A.max(x, axis=axis, keepdims=True)
    return _A.where((m == m) & (_A.abs(m) != float("inf")), m, 0.0)


def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
    """log(sum(b * exp(a))) over ``axis`` (None: all), stable: the max is subtracted first.  A row
    of -inf gives -inf.  Computes in f32 (an f16 input gives f16).  Differs from JAX:
    ``return_sign`` is not supported (``b`` must keep the sum positive)."""
    if return_sign:
        raise DSLError(f"{user_source()}: logsumexp(return_sign=True) is not supported")
    a = _float(a)
    x = a.astype("float32")
    m = _finite_max(x, axis)
    e = _A.exp(x - m)
    if b is not None:
        e = e * b
    y = _A.log(_A.sum(e, axis=axis, keepdims=True)) + m
    if not keepdims:
        y = _N.squeeze(y, axis=tuple(range(a.ndim)) if axis is None else axis)
    return y.astype(a.dtype)


def log_softmax(x, axis=-1):
    """x - logsumexp(x) over ``axis``, stable (max subtracted; no log of an underflowed softmax).
    Computes in f32; an f16 input gives f16."""
    x = _float(x)
    xf = x.astype("float32")
    s = xf - _finite_max(xf, axis)
    return (s - _A.log(_A.sum(_A.exp(s), axis=axis, keepdims=True))).astype(x.dtype)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x)) over ``axis``, stable, computed in f32 (an f16 input gives f16).
    Differs from JAX: a row that is all -inf (fully masked) gives zeros, not NaN."""
    x = _float(x)
    xf = x.astype("float32")
    e = _A.exp(xf - _finite_max(xf, axis))
    s = _A.sum(e, axis=axis, keepdims=True)
    return (e / _A.where(s == 0.0, 1.0, s)).astype(x.dtype)


def standardize(x, axis=-1, mean=None, variance=None, epsilon=1e-5):
    """(x - mean) / sqrt(variance + epsilon) over ``axis`` (the statistics computed when not given)."""
    x = _float(x)
    if mean is None:
        mean = _A.mean(x, axis=axis, keepdims=True)
    if variance is None:
        variance = _N.var(x, axis=axis, keepdims=True)
    return (x - mean) * _A.rsqrt(variance + epsilon)

# ---- one_hot (indexing)
def one_hot(x, num_classes, *, dtype="f32", axis=-1):
    """``x == arange(num_classes)`` as ``dtype`` (default f32), the new axis at ``axis``, as
    ``jax.nn.one_hot``: an index outside [0, num_classes) (negative ones too) gives a row of zeros.
    ``x``: an integer (or float) array; ``dtype``: a dtype name or a numpy dtype."""
    import numpy as np

    from . import array as a
    from .core import DSLError, dtype_of, user_source
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise DSLError(f"{user_source()}: one_hot num_classes must be a positive int, got {num_classes!r}")
    x = a.asarray(x)
    name = dtype if isinstance(dtype, str) and dtype in ("f32", "f16", "i32", "bool") else dtype_of(np.dtype(dtype))
    axis = a.normalize_axis(axis, x.ndim + 1)
    xe = a.expand_dims(x, axis)
    shape = xe.shape[:axis] + (num_classes,) + xe.shape[axis + 1:]
    hot = a.broadcast_to(xe, shape) == a.iota(shape, axis, "i32" if a._dt(x) in ("i32", "bool") else a._dt(x))
    return hot if name == "bool" else a.astype(hot, name)
