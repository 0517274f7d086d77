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
