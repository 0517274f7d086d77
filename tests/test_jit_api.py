"""``dsl.jit`` as a JAX user calls it: static arguments by name, keyword arguments, the decorator
factory, compiled objects called like the jitted function, namedtuples and dataclasses as pytree
nodes, nested jit, and ``cost_analysis``.  References are numpy in float64."""
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pytest

import dsl
from dsl.core import DSLError
from stdlib import nn

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def f64(x):
    return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- static and keyword arguments
def test_static_argnames_and_keyword_arguments():
    calls = []

    def scale(x, y, *, n, bias=None):
        calls.append(n)
        out = x * float(n) + y
        return out if bias is None else out + bias
    f = dsl.jit(scale, static_argnames="n")
    x, y, b = randn(3, 4), randn(3, 4), randn(4)
    np.testing.assert_allclose(f(x, y, n=3), 3 * f64(x) + y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f(x, y=y, n=3), 3 * f64(x) + y, rtol=1e-6, atol=1e-6)     # y traced by keyword
    np.testing.assert_allclose(f(x, y, n=3, bias=b), 3 * f64(x) + y + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f(x, y, n=5), 5 * f64(x) + y, rtol=1e-6, atol=1e-6)
    assert calls == [3, 3, 3, 5]             # positional y, keyword y and bias are three signatures; n=5 a fourth
    np.testing.assert_allclose(f(randn(3, 4), y=randn(3, 4), n=3).shape, (3, 4))
    assert calls == [3, 3, 3, 5]             # same signature: no retrace


def test_static_argnums_and_argnames_are_inferred_from_each_other():
    def g(x, n):
        return x * float(n)
    f = dsl.jit(g, static_argnums=1)
    assert f.static_argnames == ("n",)
    x = randn(5)
    np.testing.assert_allclose(f(x, n=4), 4 * f64(x), rtol=1e-6)           # static by name too
    assert dsl.jit(g, static_argnames="n").static_argnums == (1,)
    with pytest.raises(ValueError, match="'m' is not a parameter of g"):
        dsl.jit(g, static_argnames="m")


def test_decorator_factory_and_functools_partial():
    @dsl.jit(static_argnums=1)
    def power(x, k):
        out = x
        for _ in range(k - 1):
            out = out * x
        return out

    @functools.partial(dsl.jit, static_argnames="k", donate_argnums=0)
    def power2(x, k):
        return power(x, k)                      # a jit inside a jit traces inline
    x = randn(6)
    np.testing.assert_allclose(power(x, 3), f64(x) ** 3, rtol=1e-5)
    assert isinstance(power, dsl.jit) and power.static_argnums == (1,)
    np.testing.assert_allclose(power2(x.copy(), k=4), f64(x) ** 4, rtol=1e-5)
    assert power2.donate_argnums == (0,)


def test_nested_jit_traces_inline():
    inner = dsl.jit(lambda x, g: nn.rms_norm(x, g, 1e-5))

    @dsl.jit
    def outer(x, g, w):
        return nn.linear(inner(x, g), w)
    x, g, w = randn(1, 64), randn(64), randn(32, 64)
    low = outer.lower(x, g, w)
    assert not inner._cache                     # nothing compiled for the inner function
    assert "dot" in low.as_text() and "rsqrt" in low.as_text()
    h = f64(x) / np.sqrt(np.mean(f64(x) ** 2) + 1e-5) * g
    np.testing.assert_allclose(outer(x, g, w), h @ f64(w).T, rtol=1e-4, atol=1e-4)
    assert len(outer.compile(x, g, w).plan.kernels) == 1            # fused as if written in one function


def test_donate_argnames_updates_a_keyword_argument_in_place():
    def write(u, pos, *, cache):
        return dsl.dynamic_update_slice(cache, u * 2.0, [pos, 0])
    f = dsl.jit(write, donate_argnames="cache")
    cache, u = randn(8, 16), randn(2, 16)
    want = cache.astype(np.float64)
    want[3:5] = 2 * f64(u)
    out = f(u, 3, cache=cache)
    assert out is cache                                   # written in place, as donated
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert f.lower(u, 3, cache=cache).in_names == ["u", "pos", "cache"]


# ----------------------------------------------------------------------------- compiled objects
def test_compiled_object_takes_the_jitted_functions_pytree():
    def f(p, x, *, scale):
        return {"y": dsl.dot_t(x, p["w"]) * scale + p["b"], "x2": x * 2.0}
    jf = dsl.jit(f)
    p, x = {"w": randn(5, 3), "b": randn(5)}, randn(2, 3)
    c = jf.lower(p, x, scale=0.5).compile()
    p2, x2, s2 = {"w": randn(5, 3), "b": randn(5)}, randn(2, 3), 1.5
    for out in (c(p2, x2, scale=s2), jf.compile(p2, x2, scale=s2)(p2, x2, scale=s2)):
        np.testing.assert_allclose(out["y"], f64(x2) @ f64(p2["w"]).T * s2 + p2["b"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["x2"], 2 * f64(x2), rtol=1e-6)
    flat = dsl.tree_flatten(((p2, x2), {"scale": s2}))[0]
    np.testing.assert_allclose(c(*flat)["x2"], 2 * f64(x2), rtol=1e-6)        # the flat leaves: also accepted
    with pytest.raises(TypeError, match="compiled for arguments .* called with"):
        c(p2, [x2], scale=s2)
    with pytest.raises(TypeError, match="compiled for arguments"):
        c(x2, p2, scale=s2)


def test_compiled_object_with_static_arguments_as_in_jax():
    jf = dsl.jit(lambda x, n: x * float(n), static_argnums=1)
    x = randn(4)
    c = jf.lower(x, 7).compile()
    np.testing.assert_allclose(c(x), 7 * f64(x), rtol=1e-6)                   # JAX: static args left out
    np.testing.assert_allclose(c(x, 7), 7 * f64(x), rtol=1e-6)                # or the same values
    with pytest.raises(TypeError, match="compiled for static argument 1 = 7, called with 8"):
        c(x, 8)


# ----------------------------------------------------------------------------- pytree nodes
class Params(NamedTuple):
    w: np.ndarray
    b: np.ndarray


@dsl.tree_util.register_dataclass
@dataclass
class State:
    h: np.ndarray
    c: np.ndarray
    eps: float = field(default=1e-5, metadata={"static": True})


def test_namedtuples_and_dataclasses_in_and_out():
    @dsl.jit
    def step(p: Params, s: State, x):
        h = dsl.tanh(dsl.dot_t(x, p.w) + p.b + s.h)
        return State(h=h, c=s.c + h * s.eps, eps=s.eps), Params(p.w * 1.0, p.b)
    p, s, x = Params(randn(4, 3), randn(4)), State(randn(1, 4), randn(1, 4), 0.25), randn(1, 3)
    s2, p2 = step(p, s, x)
    assert isinstance(s2, State) and isinstance(p2, Params) and s2.eps == 0.25
    h = np.tanh(f64(x) @ f64(p.w).T + p.b + s.h)
    np.testing.assert_allclose(s2.h, h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s2.c, s.c + h * 0.25, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p2.w, p.w, rtol=0)
    names = step.lower(p, s, x).in_names
    assert names == ["p.w", "p.b", "s.h", "s.c", "x"]                         # field names name the inputs
    c = step.compile(p, s, x)
    np.testing.assert_allclose(c(p, s, x)[0].h, h, rtol=1e-5, atol=1e-5)
    step(p, State(s.h, s.c, 0.5), x)
    assert len(step._cache) == 2                                               # a static field retraces


def test_register_pytree_node_and_unregistered_dataclass_error():
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b
    dsl.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, ch: Pair(*ch))
    x, y = randn(3), randn(3)
    out = dsl.jit(lambda p: Pair(p.b, p.a + p.b))(Pair(x, y))
    assert isinstance(out, Pair)
    np.testing.assert_allclose(out.b, f64(x) + y, rtol=1e-6)
    leaves, td = dsl.tree_util.tree_flatten(Pair(x, {"k": y}))
    assert len(leaves) == 2 and dsl.tree_util.tree_unflatten(td, leaves).b["k"] is y

    @dataclass
    class Loose:
        w: np.ndarray
    with pytest.raises(DSLError, match=r"register_dataclass\(Loose\)"):
        dsl.jit(lambda s: s.w * 2.0)(Loose(randn(3)))
    with pytest.raises(TypeError, match="must name each of its fields"):
        dsl.tree_util.register_dataclass(Loose, data_fields=["v"], meta_fields=[])


def test_tree_map_over_several_trees():
    a = {"x": np.ones(2), "y": [np.zeros(2)]}
    b = {"x": np.full(2, 3.0), "y": [np.full(2, 4.0)]}
    out = dsl.tree_map(lambda u, v: u + v, a, b)
    np.testing.assert_array_equal(out["y"][0], [4.0, 4.0])
    with pytest.raises(ValueError, match="different structures"):
        dsl.tree_map(lambda u, v: u, a, {"x": 1})


# ----------------------------------------------------------------------------- cost analysis
def test_cost_analysis_counts_the_fused_plan():
    def block(x, g, w, r):
        return r + nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w))
    N, K = 48, 64
    args = randn(1, K), randn(K), randn(N, K, dtype=np.float16), randn(1, N)
    c = dsl.jit(block).compile(*args)
    cost = c.cost_analysis()
    assert cost["kernels"] == len(c.plan.kernels) == 1
    assert cost["bytes accessed"] == float(sum(k.bytes for k in c.plan.kernels))
    # reads x, g, w (f16), r and writes the output at least once
    assert cost["bytes accessed"] >= 4 * K + 4 * K + 2 * N * K + 4 * N + 4 * N
    assert 2 * N * K <= cost["flops"] <= 2 * N * K + 20 * (N + K)         # the GEMV, plus the elementwise ops
    assert cost["per_kernel"][0]["name"] == c.plan.kernels[0].name
    assert dsl.jit(block).lower(*args).cost_analysis()["flops"] == cost["flops"]
    unfused = dsl.jit(block, fusion={"epilogue": False, "prologue": False}).compile(*args).cost_analysis()
    assert unfused["kernels"] > 1 and unfused["bytes accessed"] > cost["bytes accessed"]


def test_float64_and_int64_arguments_are_traced_as_float32_and_int32():
    """As JAX without x64: np.arange's int64 and float64 arrays run as i32 and f32; int64 values
    beyond int32 are refused, not wrapped."""
    rng = np.random.default_rng()
    x, n = rng.standard_normal(5), rng.integers(-1000, 1000, 5)
    f = dsl.jit(lambda x, n: (x * 2.0, n + 1))
    y, m = f(x, n)
    assert y.dtype == np.float32 and m.dtype == np.int32
    np.testing.assert_allclose(y, x * 2, rtol=1e-6)
    np.testing.assert_array_equal(m, n + 1)
    with pytest.raises(ValueError, match="beyond int32"):
        f(x, np.array([0, 2 ** 40, 0, 0, 0]))


def test_argument_dtypes_and_shapes_are_checked_on_every_call():
    """The call's signature looks each leaf's dtype up in a table kept across calls and takes a numpy
    array's shape as it is: the checks still hold on every call, after a valid call of the same
    dtype (a zero-size array, an unsupported dtype), and float64 still traces as f32."""
    f = dsl.jit(lambda x: x * 2.0)
    x = np.random.default_rng().standard_normal(5)
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(f(x)), (x * 2).astype(np.float32), rtol=1e-6)
        assert f.lower(x).program.inputs[0].dtype == "f32"
        with pytest.raises(DSLError, match="zero-size"):
            f(np.zeros((0, 3)))
        with pytest.raises(DSLError, match="unsupported dtype complex128"):
            f(x.astype(np.complex128))
