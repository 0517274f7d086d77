"""``dsl.numpy``: the names of ``jax.numpy``, for ``import dsl.numpy as jnp``.

Every function here is the top-level one of the same name (``jnp.stack is dsl.stack``); this
module adds numpy's constants and ``linalg.norm``, and ``take`` with jnp.take's defaults (axis
None, mode "fill"; ``dsl.take`` takes rows and clamps).  A name we do not support raises
AttributeError naming the module, as numpy would.
"""
from __future__ import annotations

import numpy as _np

import dsl as _dsl

inf, nan, pi, e, newaxis = _np.inf, _np.nan, _np.pi, _np.e, None
from .array import jnp_take as take  # noqa: E402,F401  (jnp.take's defaults: axis None, mode "fill")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(_dsl, name)
    except AttributeError:
        raise AttributeError(f"module 'dsl.numpy' has no attribute {name!r} (not supported yet; "
                             "see docs/jax.md for what is)") from None


def __dir__():
    return sorted(set(globals()) | {n for n in dir(_dsl) if not n.startswith("_")})


class linalg:  # noqa: N801  (jnp.linalg)
    """``jnp.linalg``: ``norm`` only."""

    @staticmethod
    def norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002
        """The 2-norm (Frobenius for a matrix) over ``axis`` (all axes when None), as
        ``jnp.linalg.norm`` with ``ord=None``; other orders raise DSLError."""
        if ord not in (None, 2, "fro"):
            raise _dsl.DSLError(f"linalg.norm supports ord=None (the 2-norm) only, got ord={ord!r}")
        return _dsl.sqrt(_dsl.sum(x * x, axis=axis, keepdims=keepdims))
