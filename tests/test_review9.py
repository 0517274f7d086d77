"""Adversarial checks of the JAX-facing API (issue 9): each test is a bug once found, against numpy
in float64 on fresh random inputs."""
import numpy as np
import pytest

import dsl
import dsl.numpy as jnp  # noqa: F401

rng = np.random.default_rng()


def test_xor_with_a_python_scalar():
    # a ^ 3 promoted the literal twice (bitwise_xor, then bitwise_and) and refused the second time
    a = rng.integers(-100, 100, size=11).astype(np.int32)
    got = dsl.jit(lambda a: (a ^ 3, 5 ^ a, dsl.bitwise_xor(a, -7), (a > 0) ^ True))(a)
    for g, w in zip(got, (a ^ 3, 5 ^ a, a ^ -7, (a > 0) ^ True)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("weight", ["full", "pad"])
def test_matmul_with_a_weight_broadcast_from_a_literal(weight):
    # the GEMV named its accumulator after the weight's buffer; a weight that is a literal broadcast
    # (jnp.full, jnp.ones, the constant part of a pad) has none: KeyError in the scheduler
    x = rng.standard_normal(7).astype(np.float32)
    if weight == "full":
        got = dsl.jit(lambda x: x @ dsl.full((7, 3), 0.5))(x)
        want = x.astype(np.float64) @ np.full((7, 3), 0.5)
        terms = 0.5 * np.abs(x.astype(np.float64)).sum()          # the summands' magnitude
    else:
        got = dsl.jit(lambda x: dsl.pad(x[:1], 1, constant_values=0.5) @ dsl.pad(x[:1], 1, constant_values=0.5))(x)
        want = 0.5 + x[0].astype(np.float64) ** 2
        terms = want
    # f32 sums: within a few f32 steps of the summands' magnitude (a sum that nearly cancels is small
    # beside its terms, so rtol alone failed on some draws)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * terms)


def test_lax_div_rem_iota_reshape_have_jax_signatures_and_semantics():
    # lax.div on ints gave numpy's true division (floats); lax.iota(dtype, size) and
    # lax.reshape(x, sizes, dimensions) raised TypeError (they were dsl.iota / dsl.reshape)
    from dsl import lax
    a = rng.integers(-50, 50, size=12).astype(np.int32)
    b = rng.integers(1, 7, size=12).astype(np.int32) * rng.choice([-1, 1], size=12).astype(np.int32)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    q, r, i, t, fq = dsl.jit(lambda a, b, x: (lax.div(a, b), lax.rem(a, b), lax.iota(np.float32, 5),
                                                 lax.reshape(x, (4, 3), dimensions=(1, 0)), lax.div(x, 2.0)))(a, b, x)
    assert q.dtype == np.int32 and r.dtype == np.int32
    np.testing.assert_array_equal(q, np.trunc(a / b).astype(np.int32))
    np.testing.assert_array_equal(r, np.fmod(a, b))
    np.testing.assert_array_equal(i, np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(t, x.T.reshape(4, 3))
    np.testing.assert_allclose(fq, x / 2.0)


def test_jit_on_a_method_binds_self_as_in_jax():
    # @partial(jax.jit, static_argnums=0) on a method: the jit object had no __get__, so obj.f(x)
    # called f(x) and the "static" argument 0 was the array (a 'must be hashable' error)
    from functools import partial

    class Scale:
        def __init__(self, s):
            self.s = s

        @partial(dsl.jit, static_argnums=0)
        def __call__(self, x):
            return x * self.s

        @partial(dsl.jit, static_argnums=0)
        def shifted(self, x, y):
            return x * self.s + y

    x, y = rng.standard_normal(9).astype(np.float32), rng.standard_normal(9).astype(np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    np.testing.assert_allclose(Scale(2.5)(x), x64 * 2.5, rtol=1e-6)
    # within f32 steps of the summands' magnitude: a nearly cancelling x * -1.5 + y (fused or not)
    np.testing.assert_allclose(Scale(-1.5).shifted(x, y), x64 * -1.5 + y64, rtol=0,
                               atol=4e-7 * (np.abs(x64 * 1.5) + np.abs(y64)).max())


def test_tree_util_is_leaf_and_tree_reduce():
    # jax.tree_util.tree_map(f, tree, is_leaf=...) raised TypeError; tree_reduce was missing
    x = rng.standard_normal(5).astype(np.float32)
    tree = {"pair": (x, x * 2), "w": x}
    got = dsl.jit(lambda t: dsl.tree_util.tree_map(lambda a: a[0] + a[1] if isinstance(a, tuple) else a * 3, t,
                                                   is_leaf=lambda a: isinstance(a, tuple)))(tree)
    np.testing.assert_allclose(got["pair"], x * 3, rtol=1e-6)
    np.testing.assert_allclose(got["w"], x * 3, rtol=1e-6)
    assert dsl.tree_util.tree_leaves(tree, is_leaf=lambda a: isinstance(a, tuple))[0] == tree["pair"]
    assert dsl.tree_util.tree_reduce(lambda a, b: a + b, [1, (2, {"z": 3})], 10) == 16
