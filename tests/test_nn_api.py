"""jax.nn activations, stdlib.nn.layer_norm and lax.top_k (issue 9, item 4) against numpy in float64
on the CPU, with fresh random inputs; numerically stable forms are shown stable; the kernels compile
for gfx906."""
import math

import numpy as np
import pytest

import dsl
from dsl import DSLError
from stdlib import nn as snn

rng = np.random.default_rng()


def f32(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f64(x):
    return np.asarray(x, np.float64)


def close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def ref_lse(x, axis, keepdims=False):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    y = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return y if keepdims else np.squeeze(y, axis=axis)


def test_activations_against_float64():
    from math import erf
    x = f32(6, 50, scale=3.0)
    X = f64(x)
    got = dsl.jit(lambda x: (dsl.nn.gelu(x), dsl.nn.gelu(x, approximate=False), dsl.nn.relu(x), dsl.nn.silu(x),
                             dsl.nn.sigmoid(x), dsl.nn.softplus(x), dsl.nn.log_sigmoid(x), dsl.nn.swish(x)))(x)
    sig = 1 / (1 + np.exp(-X))
    want = (0.5 * X * (1 + np.tanh(math.sqrt(2 / math.pi) * (X + 0.044715 * X ** 3))),
            0.5 * X * (1 + np.vectorize(erf)(X / math.sqrt(2))), np.maximum(X, 0), X * sig, sig,
            np.logaddexp(0, X), -np.logaddexp(0, -X), X * sig)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.float32
        close(g, w, 2e-5 if i else 1e-4)


def test_gelu_default_is_the_tanh_form_as_jax():
    x = f32(200, scale=2.0)
    a, e, d = dsl.jit(lambda x: (dsl.nn.gelu(x, approximate=True), dsl.nn.gelu(x, approximate=False),
                                 dsl.nn.gelu(x)))(x)
    np.testing.assert_array_equal(d, a)
    assert np.max(np.abs(a - e)) > 1e-5                 # the two forms differ; the default is tanh


def test_softplus_and_log_sigmoid_are_stable_for_large_inputs():
    x = np.array([-1000.0, -80.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 1000.0], np.float32)
    sp, ls = dsl.jit(lambda x: (dsl.nn.softplus(x), dsl.nn.log_sigmoid(x)))(x)
    assert np.isfinite(sp).all() and np.isfinite(ls).all()
    close(sp, np.logaddexp(0, f64(x)), 1e-6)
    np.testing.assert_allclose(sp[1:3], np.exp(f64(x[1:3])), rtol=1e-5)    # tiny, not rounded to 0 or log(1)
    close(ls, -np.logaddexp(0, -f64(x)), 1e-6)


def test_log_softmax_logsumexp_softmax_against_float64():
    x = f32(5, 7, 33, scale=4.0)
    X = f64(x)
    got = dsl.jit(lambda x: (dsl.nn.log_softmax(x), dsl.nn.log_softmax(x, axis=1), dsl.nn.logsumexp(x, axis=-1),
                             dsl.nn.logsumexp(x, axis=(0, 2), keepdims=True), dsl.nn.logsumexp(x),
                             dsl.nn.softmax(x, axis=0), dsl.nn.softmax(x)))(x)
    e0, e2 = np.exp(X - X.max(0, keepdims=True)), np.exp(X - X.max(-1, keepdims=True))
    want = (X - ref_lse(X, -1, True), X - ref_lse(X, 1, True), ref_lse(X, -1), ref_lse(X, (0, 2), True),
            ref_lse(X, None), e0 / e0.sum(0, keepdims=True), e2 / e2.sum(-1, keepdims=True))
    for g, w in zip(got, want):
        close(g, w, 2e-5)


def test_logsumexp_with_weights():
    x, w = f32(4, 30, scale=3.0), np.abs(f32(4, 30)) + 0.1
    y = dsl.jit(lambda x, w: dsl.nn.logsumexp(x, axis=1, b=w))(x, w)
    close(y, np.log(np.sum(f64(w) * np.exp(f64(x)), axis=1)), 1e-5)


def test_log_softmax_and_logsumexp_are_stable_for_huge_logits_and_masked_rows():
    x = f32(4, 50, scale=1e4)                           # exp overflows f32 without the max subtracted
    x[1] = -np.inf                                      # a fully masked row
    x[2, :10] = -np.inf
    lsm, lse, sm = dsl.jit(lambda x: (dsl.nn.log_softmax(x), dsl.nn.logsumexp(x, axis=1), dsl.nn.softmax(x)))(x)
    X = f64(x)
    assert np.all(lse[1] == -np.inf) and np.isfinite(lse[[0, 2, 3]]).all()
    close(lse[[0, 2, 3]], ref_lse(X[[0, 2, 3]], 1), 1e-5)
    ok = [0, 2, 3]
    want = X[ok] - ref_lse(X[ok], 1, True)
    np.testing.assert_allclose(np.where(np.isinf(want), 0, lsm[ok]), np.where(np.isinf(want), 0, want), atol=2e-3)
    assert np.all(lsm[2, :10] == -np.inf)
    np.testing.assert_array_equal(sm[1], 0)             # differs from JAX (NaN): a masked row gives zeros
    close(sm[ok].sum(-1), np.ones(3), 1e-5)


def test_softmax_keeps_f16():
    x = f32(3, 40).astype(np.float16)
    y = dsl.jit(lambda x: dsl.nn.softmax(x))(x)
    assert y.dtype == np.float16
    X = f64(x)
    e = np.exp(X - X.max(-1, keepdims=True))
    close(y, e / e.sum(-1, keepdims=True), 2e-3)


def test_layer_norm_against_float64():
    x = f32(3, 5, 96, scale=2.0) + np.float32(50.0)      # an offset: two passes keep the variance exact
    w, b = f32(96), f32(96)
    y, y_plain = dsl.jit(lambda x, w, b: (snn.layer_norm(x, w, b, 1e-5), snn.layer_norm(x)))(x, w, b)
    X = f64(x)
    z = (X - X.mean(-1, keepdims=True)) / np.sqrt(X.var(-1, keepdims=True) + 1e-5)
    close(y, z * f64(w) + f64(b), 2e-4)
    close(y_plain, z, 2e-4)


def ref_top_k(x, k):
    """Largest first, ties in index order, NaN the largest (as jax.lax.top_k)."""
    key = np.where(np.isnan(x), np.inf, x)
    i = np.argsort(-key, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, i, -1), i


@pytest.mark.parametrize("n, k", [(8, 2), (33, 5), (1024, 3), (1500, 4), (5000, 2), (5000, 300), (1100, 1100)])
def test_top_k_against_numpy(n, k):
    x = np.round(f32(3, n) * 4).astype(np.float32)      # ties
    x[0, n // 2] = np.nan
    x[1, :] = -np.inf
    x[1, n - 1] = 2.0
    vals, ids = dsl.jit(lambda x: dsl.lax.top_k(x, k))(x)
    want_v, want_i = ref_top_k(x, k)
    assert vals.dtype == np.float32 and ids.dtype == np.int32 and ids.shape == (3, k)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(vals, want_v)


def test_top_k_of_ints_and_batches():
    x = rng.integers(-5, 5, (2, 3, 40)).astype(np.int32)
    vals, ids = dsl.jit(lambda x: dsl.lax.top_k(x, 6))(x)
    want_v, want_i = ref_top_k(x, 6)
    np.testing.assert_array_equal(vals, want_v)
    np.testing.assert_array_equal(ids, want_i)


def test_top_k_errors():
    with pytest.raises(DSLError, match="static int k in \\[1, 8\\]"):
        dsl.jit(lambda x: dsl.lax.top_k(x, 9))(f32(8))


def test_the_nn_kernels_compile_for_gfx906():
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from fusion import build_plan

    def f(x, w, b, logits):
        return (dsl.nn.gelu(x), dsl.nn.gelu(x, approximate=False), dsl.nn.softplus(x), dsl.nn.log_softmax(x),
                dsl.nn.logsumexp(x, axis=0), snn.layer_norm(x, w, b), *dsl.lax.top_k(x, 2), *dsl.lax.top_k(logits, 3))
    low = dsl.jit(f).lower(f32(4, 64), f32(64), f32(64), f32(1, 2048))
    for k in build_plan(low.program, None, low.in_names, low.donated).kernels:
        compile_hip(render_hip(k, "gfx906").source, k.name)


def test_top_k_routes_a_moe_layer_that_reads_only_the_chosen_experts():
    """lax.top_k + nn.softmax as a JAX user writes the router: the ids feed the expert gathers,
    which fuse into the GEMVs (each weight's traffic is two experts of eight)."""
    from codegen.loopir import buffer_traffic
    E, D, F = 8, 64, 96
    x, wr = f32(1, D), f32(E, D)
    wg, wd = f32(E, F, D) * D ** -0.5, f32(E, D, F) * F ** -0.5

    def moe(x, wr, wg, wd):
        vals, ids = dsl.lax.top_k(dsl.dot_t(x, wr).reshape(E), 2)
        p = dsl.nn.softmax(vals)
        return sum(p[i] * dsl.dot_t(dsl.nn.gelu(dsl.dot_t(x, dsl.take(wg, ids[i]))), dsl.take(wd, ids[i]))
                   for i in range(2))
    f = dsl.jit(moe)
    logits = f64(wr) @ f64(x)[0]
    top = np.argsort(-logits, kind="stable")[:2]
    p = np.exp(logits[top] - logits[top].max())
    p /= p.sum()
    gelu = lambda h: 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))   # noqa: E731
    want = sum(pe * (f64(wd[e]) @ gelu(f64(wg[e]) @ f64(x)[0])) for e, pe in zip(top, p))[None]
    close(f(x, wr, wg, wd), want, 2e-5)
    traffic = {}
    for k in f.compile(x, wr, wg, wd).plan.kernels:
        for name, n in buffer_traffic(k).items():
            traffic[name] = traffic.get(name, 0) + n
    assert traffic["wg"] == wg.nbytes * 2 // E and traffic["wd"] == wd.nbytes * 2 // E
