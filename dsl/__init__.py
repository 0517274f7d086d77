"""vegafuse DSL: a small JAX-like tracing front end.

    import dsl
    @dsl.jit
    def f(x, w):
        return dsl.exp(dsl.dot_t(x, w))
"""
from .core import DSLError, Program  # noqa: F401
from .array import (  # noqa: F401
    Tracer, abs, add, arange, argmax, astype, attention, broadcast_to, concatenate, cos, div, dot_t,
    dynamic_update_slice, exp, expand_dims, iota, log, logical_and, logical_or, matmul, max, maximum, mean,
    minimum, mul, neg, reshape, rsqrt, sigmoid, sin, sqrt, sub, sum, swapaxes, take, tanh, transpose, where,
)
from .irtext import parse_ir  # noqa: F401
from .jit import jit  # noqa: F401
from .pytree import flatten as tree_flatten, tree_map, unflatten as tree_unflatten  # noqa: F401
