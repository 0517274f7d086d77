"""vegafuse DSL: a small JAX-like tracing front end.

    import dsl
    @dsl.jit
    def f(x, w):
        return dsl.exp(dsl.dot_t(x, w))
"""
from .core import DSLError, Program  # noqa: F401
from . import array as _array
from .array import (  # noqa: F401
    Tracer, arange, argmax, astype, attention, broadcast_to, concatenate, dequantize, div, dot_t, dynamic_update_slice,
    expand_dims, iota, matmul, max, mean, reshape, sum, swapaxes, take, transpose, where,
)
for _api in _array.ELEMENTWISE_API:          # dsl.exp, dsl.add, ...: one per elementwise primitive
    globals()[_api] = getattr(_array, _api)
from .irtext import parse_ir  # noqa: F401
from .quant import QArray  # noqa: F401
from .jit import jit  # noqa: F401
from . import lax, nn  # noqa: F401  (jax.lax and jax.nn names)
from .pytree import flatten as tree_flatten, tree_map, unflatten as tree_unflatten  # noqa: F401
from . import pytree as tree_util  # noqa: F401  (jax.tree_util: register_dataclass, register_pytree_node, ...)
from .primitives import define_elementwise  # noqa: F401  (user-defined elementwise primitives)
# ---- jax.numpy names (issue 9): dsl.stack, dsl.einsum, ... (dsl/numpy_api.py); they replace
# array.py's argmax (axis=None as JAX) and logical_* (non-bool operands count as x != 0)
from . import numpy_api as _numpy_api  # noqa: E402
from .numpy_api import (  # noqa: E402,F401
    amin, argmax, argmin, argsort, bitwise_and, bitwise_or, bitwise_xor, clip, cumsum, einsum, floor_divide, full,
    full_like, invert, logical_and, logical_not, logical_or, min, ones, ones_like, pad, power, remainder, repeat, sort,
    split, squeeze, stack, std, tril, triu, var, zeros, zeros_like,
)
_array._numpy_names()
# numpy's dtypes under jax.numpy's names (dsl.float32 is np.float32); bfloat16 from ml_dtypes is a
# storage dtype: bf16 arrays are traced as f32 and converted on load
from numpy import bool_, float16, float32, int32  # noqa: E402,F401


def __getattr__(name):
    """``dsl.bfloat16``: ml_dtypes is imported when first asked for (its import takes over a second)."""
    if name == "bfloat16":
        from ml_dtypes import bfloat16
        return bfloat16
    raise AttributeError(f"module 'dsl' has no attribute {name!r}")


from .array import take_along_axis  # noqa: F401,E402  (indexing: x[ids], x.at[...], dsl.take(axis=))
# numpy's names for the arithmetic and comparison operators (jnp.subtract, jnp.less, ...)
subtract, multiply, negative, divide, true_divide, absolute = sub, mul, neg, div, div, abs  # noqa: F821
equal, not_equal = (lambda a, b: a == b), (lambda a, b: a != b)  # noqa: E731
less, less_equal, greater, greater_equal = ((lambda a, b: a < b), (lambda a, b: a <= b),  # noqa: E731
                                            (lambda a, b: a > b), (lambda a, b: a >= b))
for _f, _n in ((equal, "equal"), (not_equal, "not_equal"), (less, "less"), (less_equal, "less_equal"),
               (greater, "greater"), (greater_equal, "greater_equal")):
    _f.__name__ = _f.__qualname__ = _n
    _f.__doc__ = f"``jnp.{_n}``: the comparison operator, with broadcasting; a bool array."
for _n, _f in lax._lax_names().items():
    setattr(lax, _n, _f)
# ---- jax.vmap (issue 9, control flow)
from .vmap import vmap  # noqa: F401  (jax.vmap over a leading axis: dsl/vmap.py)
