"""``dsl.numpy``: the names of ``jax.numpy``, for ``import dsl.numpy as jnp``.

Every function here is the top-level one of the same name (``jnp.stack is dsl.stack``); this
module adds numpy's constants and ``linalg.norm``, and ``take`` with jnp.take's defaults (axis
None, mode "fill"; ``dsl.take`` takes rows and clamps).  A name we do not support raises
AttributeError naming the module, as numpy would.
"""
from __future__ import annotations

import types as _types

import numpy as _np

import dsl as _dsl

inf, nan, pi, e, newaxis = _np.inf, _np.nan, _np.pi, _np.e, None
from .array import jnp_take as take  # noqa: E402,F401  (jnp.take's defaults: axis None, mode "fill")


float64, int64, finfo, iinfo = _np.float64, _np.int64, _np.finfo, _np.iinfo   # traced as float32 / int32


def __getattr__(name):
    value = getattr(_dsl, name, None) if not name.startswith("__") else None
    if value is None or isinstance(value, _types.ModuleType):          # dsl's own modules are not jnp names
        raise AttributeError(f"module 'dsl.numpy' has no attribute {name!r} (not supported yet; "
                             "see docs/jax.md for what is)")
    return value


def array(x, dtype=None):
    """``jnp.array``: a traced value as it is (converted to ``dtype``); a Python list or numpy array
    stays a static numpy array (usable as an index, ``x.at[...]``, ``take``; arithmetic needs it
    passed as an argument of the jitted function: we do not embed array constants)."""
    if isinstance(x, _dsl.Tracer):
        return x if dtype is None else x.astype(dtype)
    return _np.asarray(x, dtype)


asarray = array


def dot(a, b):
    """``jnp.dot`` for 1-D and 2-D operands (a vector dot product, or ``a @ b``)."""
    return (a * b).sum() if a.ndim == 1 and b.ndim == 1 else a @ b


def outer(a, b):
    """``jnp.outer``: a [n] x b [m] -> [n, m] (operands flattened)."""
    return a.reshape(-1)[:, None] * b.reshape(-1)[None, :]


def square(x):
    """``jnp.square``: ``x * x``."""
    return x * x


def sign(x):
    """``jnp.sign``: -1, 0 or 1 in ``x``'s dtype (NaN stays NaN)."""
    return _dsl.where(x > 0, 1, _dsl.where(x < 0, -1, x * 0)).astype(x.dtype)


def log2(x):
    """``jnp.log2``."""
    return _dsl.log(x) * (1 / _np.log(2))


def logaddexp(a, b):
    """``jnp.logaddexp``: log(exp(a) + exp(b)) without overflow."""
    m = _dsl.maximum(a, b)
    return m + _dsl.log1p(_dsl.exp(-_dsl.abs(a - b)))


def isnan(x):
    """``jnp.isnan``."""
    return x != x


def isinf(x):
    """``jnp.isinf``."""
    return _dsl.abs(x) == _np.inf


def isfinite(x):
    """``jnp.isfinite``."""
    return _dsl.abs(x) < _np.inf


def any(x, axis=None, keepdims=False):  # noqa: A001
    """``jnp.any``: is any element true (non-zero) along ``axis``."""
    return _dsl.max((x != 0).astype("i32"), axis=axis, keepdims=keepdims) > 0


def all(x, axis=None, keepdims=False):  # noqa: A001
    """``jnp.all``: are all elements true (non-zero) along ``axis``."""
    return _dsl.min((x != 0).astype("i32"), axis=axis, keepdims=keepdims) > 0


def flip(x, axis=None):
    """``jnp.flip`` along ``axis`` (an int, a tuple, or all axes)."""
    axes = range(x.ndim) if axis is None else [axis] if isinstance(axis, int) else axis
    axes = {a % x.ndim for a in axes}
    return x[tuple(slice(None, None, -1) if d in axes else slice(None) for d in range(x.ndim))]


def moveaxis(x, source, destination):
    """``jnp.moveaxis`` for one axis."""
    order = [d for d in range(x.ndim) if d != source % x.ndim]
    order.insert(destination % x.ndim, source % x.ndim)
    return _dsl.transpose(x, order)


def eye(n, m=None, k=0, dtype="float32"):
    """``jnp.eye``: ones on the ``k``-th diagonal of an [n, m] array."""
    m = n if m is None else m
    return (_dsl.iota((n, m), 1) - _dsl.iota((n, m), 0) == k).astype(dtype)


def __dir__():
    return sorted(set(globals()) | {n for n in dir(_dsl) if not n.startswith("_")})


class _Partial(type):
    """A jnp submodule of which some names are here: any other is "not supported yet", as for jnp's own."""

    def __getattr__(cls, name):
        raise AttributeError(f"'dsl.numpy.{cls.__name__}' has no attribute {name!r} (not supported yet; "
                             "see docs/jax.md for what is)")


class linalg(metaclass=_Partial):  # noqa: N801  (jnp.linalg)
    """``jnp.linalg``: ``norm`` only."""

    @staticmethod
    def norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002
        """The 2-norm (Frobenius for a matrix) over ``axis`` (all axes when None), as
        ``jnp.linalg.norm`` with ``ord=None``; other orders raise DSLError."""
        if ord not in (None, 2, "fro"):
            raise _dsl.DSLError(f"linalg.norm supports ord=None (the 2-norm) only, got ord={ord!r}")
        return _dsl.sqrt(_dsl.sum(x * x, axis=axis, keepdims=keepdims))
