"""Every kernel family, fused and compiled for the CPU, against the float64 reference interpreter.

Also the fusion hazards and numerical failure kinds other engines shipped:
KV write vs attention read, in-place update vs a later read of the old value,
f16 RMSNorm overflow, fully masked softmax rows, grouped-query attention.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dsl
from fusion import RULES
from stdlib import nn

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def check(f, *args, rtol=2e-4, atol=2e-4, fusion=None, donate=()):
    """Run ``f`` fused on the CPU and in the f64 reference; compare every output."""
    ref_args = [[x.copy() for x in a] if isinstance(a, list) else a.copy() if isinstance(a, np.ndarray) else a
                for a in args]
    jf = dsl.jit(f, backend="cpu", fusion=fusion, donate_argnums=donate)
    low = jf.lower(*ref_args)
    leaves = dsl.tree_flatten(list(ref_args))[0]
    want = low.program.run(*leaves, compute_dtype="f64")
    got = dsl.tree_flatten(jf(*args))[0]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g)) or not np.all(np.isfinite(w))
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=atol)
    return jf.compile(*args)


def families(c):
    return [k.family for k in c.plan.kernels]


def test_elementwise_chain_is_one_kernel():
    def f(x, y):
        return dsl.tanh(x * y + 1.0) - dsl.sigmoid(y) / (dsl.abs(x) + 2.0) + dsl.sqrt(dsl.exp(x * 0.1))
    c = check(f, randn(7, 33), randn(33))
    assert families(c) == ["elementwise"]


def test_rmsnorm_is_one_reduce_kernel():
    x, w = randn(5, 64), randn(64)
    c = check(lambda x, w: nn.rms_norm(x, w, 1e-5), x, w)
    assert families(c) == ["reduce"]


def test_softmax_with_two_reductions_is_one_kernel_and_masked_rows_are_zero():
    x = randn(6, 40)
    x[2, :] = -np.inf                                    # a fully masked row
    c = check(lambda x: nn.softmax(x), x)
    assert families(c) == ["reduce"]
    out = dsl.jit(nn.softmax)(x)
    assert np.all(out[2] == 0) and np.all(np.isfinite(out))


def test_f16_rmsnorm_does_not_overflow():
    x = (rng.uniform(256, 1000, (3, 96)) * rng.choice([-1, 1], (3, 96))).astype(np.float16)
    w = randn(96).astype(np.float16)
    check(lambda x, w: nn.rms_norm(x, w, 1e-5), x, w, rtol=2e-3, atol=2e-3)


def test_f16_sum_accumulates_in_f32():
    x = rng.uniform(0.5, 1.5, (2, 4096)).astype(np.float16)   # the sum needs more than f16 precision
    got = dsl.jit(lambda x: dsl.sum(x.astype("f32"), axis=-1))(x)
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5)


def test_gemv_with_rmsnorm_prologue_and_residual_epilogue():
    x, g, w, r = randn(1, 96), randn(96), randn(80, 96, dtype=np.float16), randn(1, 80)
    c = check(lambda x, g, w, r: r + nn.linear(nn.rms_norm(x, g, 1e-5), w), x, g, w, r, rtol=1e-3, atol=1e-3)
    assert families(c) == ["contract"]


def test_matmul_rows_bias_and_silu_mul_siblings():
    def mlp(x, wg, wu, b):
        return nn.silu(nn.linear(x, wg, b)) * nn.linear(x, wu)
    c = check(mlp, randn(4, 48), randn(40, 48), randn(40, 48), randn(40), rtol=1e-3, atol=1e-3)
    assert families(c) == ["contract"]                   # gate/up share one kernel and one n loop


def test_qkv_horizontal_fusion_shares_the_activation():
    def qkv(x, wq, wk, wv):
        h = nn.rms_norm(x, wq[0], 1e-5)
        return nn.linear(h, wq), nn.linear(h, wk), nn.linear(h, wv)
    c = check(qkv, randn(2, 64), randn(64, 64), randn(16, 64), randn(16, 64), rtol=1e-3, atol=1e-3)
    assert families(c) == ["contract"]
    c = check(qkv, randn(2, 64), randn(64, 64), randn(16, 64), randn(16, 64), rtol=1e-3, atol=1e-3,
              fusion={"horizontal": False})
    assert families(c) == ["contract"] * 3


def test_batched_matmul_and_transposed_operands():
    def f(a, b, c):
        return dsl.matmul(a, b), dsl.dot_t(a, c), dsl.matmul(a, dsl.swapaxes(c, -1, -2))
    check(f, randn(3, 5, 8), randn(3, 8, 6), randn(3, 7, 8), rtol=1e-4, atol=1e-4)


def test_gather_reshape_transpose_slice_concat():
    def f(table, ids, x):
        e = dsl.take(table, ids)                             # (4, 12)
        y = e.reshape(4, 3, 4).transpose(1, 0, 2)            # (3, 4, 4)
        z = dsl.concatenate([y[..., 2:], -y[..., :2]], axis=-1)
        return z + x.reshape(3, 1, 4)
    check(f, randn(10, 12), rng.integers(0, 10, 4).astype(np.int32), randn(12))


def test_argmax_first_index_on_ties():
    x = randn(3, 50)
    x[1, 7] = x[1, 30] = 99.0
    got = dsl.jit(lambda x: dsl.argmax(x, axis=-1))(x)
    np.testing.assert_array_equal(got, [np.argmax(x[0]), 7, np.argmax(x[2])])


def reference_attention(q, k, v, pos):
    """Independent GQA reference: query head h reads kv head h // (Hq // Hkv); float64."""
    hq, t, d = q.shape
    group = hq // k.shape[0]
    out = np.zeros(q.shape)
    for h in range(hq):
        for i in range(t):
            n = pos + i + 1
            s = np.array([np.dot(q[h, i], k[h // group, j]) for j in range(n)], np.float64) / math.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[h, i] = p @ v[h // group, :n].astype(np.float64)
    return out


@pytest.mark.parametrize("hq,hkv,t,pos", [(8, 2, 1, 9), (6, 3, 4, 0), (4, 4, 3, 5)])
def test_kv_write_then_gqa_attention(hq, hkv, t, pos):
    S, D = 16, 32
    q, k, v = randn(hq, t, D), randn(hkv, t, D), randn(hkv, t, D)
    kc, vc = randn(hkv, S, D), randn(hkv, S, D)

    def f(q, k, v, caches, pos):
        out, kc, vc = nn.causal_attention(q, caches[0], caches[1], k, v, pos)
        return out, [kc, vc]
    kc_ref, vc_ref = kc.copy(), vc.copy()
    c = check(f, q, k, v, [kc, vc], pos, donate=(3,))
    fam = families(c)
    assert "attention" in fam and fam.index("attention") > fam.index("scatter" if "scatter" in fam else "elementwise")
    # the attention kernel reads the cache; the kernel writing it is an earlier launch
    att = [k for k in c.plan.kernels if k.family == "attention"][0]
    writers = [k for k in c.plan.kernels if any(p.role != "in" and "caches" in p.name for p in k.params)]
    assert writers and att not in writers
    kc_ref[:, pos:pos + t], vc_ref[:, pos:pos + t] = k, v
    out = dsl.jit(f)(q, k, v, [kc_ref.copy(), vc_ref.copy()], pos)[0]
    np.testing.assert_allclose(out, reference_attention(q, kc_ref, vc_ref, pos), rtol=1e-4, atol=1e-4)


def test_in_place_update_never_moves_before_an_earlier_read():
    """The old cache is read after the update: the update must not happen in place."""
    def f(cache, u, pos):
        new = dsl.dynamic_update_slice(cache, u, [pos, 0])
        old_sum = dsl.sum(cache, axis=-1)                   # reads the old values
        return new, old_sum
    cache, u = randn(8, 16), randn(2, 16)
    c = check(f, cache.copy(), u, 3, donate=(0,))
    assert not c.plan.aliases                            # a copy, not an in-place write


def test_donated_cache_is_updated_in_place():
    def f(cache, u, pos):
        return dsl.dynamic_update_slice(cache, u, [pos, 0])
    cache, u = randn(8, 16), randn(2, 16)
    want = cache.copy()
    want[5:7] = u
    out = dsl.jit(f, donate_argnums=0)(cache, u, 5)
    assert out is cache
    np.testing.assert_array_equal(out, want)
    out = dsl.jit(f)(want.copy(), u, 100)                 # offsets clamp so the update fits
    np.testing.assert_array_equal(out[6:8], u)


def test_every_rule_can_be_switched_off(monkeypatch):
    def layer(x, g, wq, wo):
        h = nn.rms_norm(x, g, 1e-5)
        return x + nn.linear(nn.silu(nn.linear(h, wq)), wo)
    args = randn(2, 32), randn(32), randn(48, 32), randn(32, 48)
    n_on = len(check(layer, *args, rtol=1e-3, atol=1e-3).plan.kernels)
    for rule in RULES:
        c = check(layer, *args, rtol=1e-3, atol=1e-3, fusion={rule: False})
        assert rule not in c.plan.rules
        assert len(c.plan.kernels) >= n_on
    monkeypatch.setenv("VEGAFUSE_FUSION_OFF", "prologue,epilogue")
    c = check(layer, *args, rtol=1e-3, atol=1e-3)
    assert len(c.plan.kernels) > n_on
    with pytest.raises(ValueError, match="unknown fusion rule"):
        dsl.jit(layer, fusion={"nonsense": False}).compile(*args)


# ----------------------------------------------------------------------------- property tests
SHAPES = [(3, 5), (1, 8), (4, 1), (2, 3, 4)]
UNARY = [dsl.exp, dsl.tanh, dsl.sigmoid, lambda x: -x, lambda x: dsl.sqrt(dsl.abs(x) + 0.5), dsl.sin]
BINARY = [dsl.add, dsl.sub, dsl.mul, dsl.maximum, dsl.minimum, lambda a, b: a / (dsl.abs(b) + 1.0)]


@st.composite
def programs(draw):
    """A random straight-line program over a pool of values: elementwise ops, broadcasts,
    reductions and matmuls, with its inputs."""
    shape = draw(st.sampled_from(SHAPES))
    n_in = draw(st.integers(1, 3))
    ops = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8))
    bshape = shape[-1:] if draw(st.booleans()) else (1,) * len(shape)
    return shape, n_in, bshape, ops


def build(shape, n_in, bshape, ops):
    def f(*xs):
        pool = list(xs[:-1]) + [xs[-1]]           # the last input broadcasts
        for kind, i, j in ops:
            a, b = pool[i % len(pool)], pool[j % len(pool)]
            if kind == 0:
                pool.append(UNARY[i % len(UNARY)](a))
            elif kind in (1, 2):
                try:
                    pool.append(BINARY[j % len(BINARY)](a, b))
                except dsl.DSLError:
                    pool.append(a * 0.5)
            elif kind == 3 and a.ndim >= 1:
                pool.append(dsl.sum(a, axis=-1, keepdims=True) * 0.1 + a if a.ndim > 1 else dsl.sum(a, axis=-1))
            elif kind == 4 and a.ndim >= 2:
                w = xs[0]
                pool.append(dsl.matmul(a, dsl.swapaxes(w, -1, -2)) * 0.1 if a.shape == w.shape else a)
            else:
                pool.append(nn.softmax(a) if a.ndim >= 1 else a)
        return pool[len(xs):]
    return f


@settings(max_examples=25, deadline=None)
@given(programs())
def test_random_programs_fused_match_the_reference(prog):
    shape, n_in, bshape, ops = prog
    args = [randn(*shape) for _ in range(n_in)] + [randn(*bshape)]
    check(build(shape, n_in, bshape, ops), *args, rtol=1e-3, atol=1e-3)


def test_floor_of_negative_and_halfway_values():
    x = np.concatenate([randn(61) * 3, np.array([-2.5, -2.0, -0.5, 0.5, 2.0, 2.5], np.float32)])
    check(lambda x: dsl.floor(x) * 2.0, x)
    # f16: rounding to f16 first can cross an integer, which the f64 interpreter does not do
    got = np.asarray(dsl.jit(lambda x: dsl.floor(x.astype("f16")))(x))
    np.testing.assert_array_equal(got, np.floor(x.astype(np.float16)))


# ----------------------------------------------------------------------------- classes found by random programs
@pytest.mark.parametrize("view", ["T", "reshape", "take"])
def test_reduction_over_size_one_dims_fused_into_a_view_stays_in_bounds(view):
    ids = np.zeros(5, np.int32)
    post = {"T": lambda y, i: y.T, "reshape": lambda y, i: y.reshape(2, 2), "take": lambda y, i: dsl.take(y, i)}[view]
    check(lambda x, i: post(x + dsl.sum(x, -1, keepdims=True), i), randn(1, 4), ids)
    check(lambda x, i: post(x * dsl.max(x, 0, keepdims=True)[:, :1], i), randn(1, 4), ids)


@pytest.mark.parametrize("n", [72, 73, 88, 95, 1000])
def test_max_reductions_of_any_length_compile(n):
    """maxnum reductions without nnan made LLVM's loop vectorizer abort the process."""
    check(lambda x: dsl.max(x), randn(n))
    check(lambda x: dsl.argmax(x, -1), randn(3, n))
    check(lambda x: dsl.maximum(x, 0.0).sum(-1), randn(3, n))


@pytest.mark.parametrize("rules", [{}, {"reduce": False}])
def test_max_over_non_trailing_axes(rules):
    x = np.zeros((7, 2, 2), np.float32)
    x[6] = randn(2, 2)
    check(lambda x: dsl.max(x, axis=(0, 2)), x, fusion=rules)
    check(lambda x: dsl.max(x, axis=(0, 2), keepdims=True) - x, randn(7, 2, 2), fusion=rules)


@pytest.mark.parametrize("fused", [True, False])
def test_f16_matmul_gives_f16_accumulated_in_f32(fused):
    x, w = randn(3, 64, dtype=np.float16), randn(64, 5, dtype=np.float16)
    assert dsl.jit(lambda x, w: x @ w).lower(x, w).program.outputs[0].dtype == "f16"
    rules = None if fused else {"epilogue": False}
    check(lambda x, w: x @ w, x, w, rtol=2e-3, atol=2e-3, fusion=rules)
    check(lambda x, w: x @ w + 1.0, x, w, rtol=2e-3, atol=2e-3, fusion=rules)
    check(lambda x, w: dsl.dot_t(x, w.T) * 0.5 - x[:, :5], x, w, rtol=2e-3, atol=2e-3, fusion=rules)


def test_in_place_update_that_reads_its_own_buffer():
    """The update reads rows of the donated buffer that the same kernel overwrites."""
    def f(x, p):
        return dsl.dynamic_update_slice(x, x[0:3] * 2.0 + x[1:4], [p, 0])
    for p in (0, 1, 2, 3):
        check(f, randn(6, 4), p, donate=(0,))
    check(lambda x: dsl.dynamic_update_slice(x, x[1:3, 0:2].T * x[2:4, 2:4] + 1.0, [0, 1]), randn(5, 4), donate=(0,))


def test_in_place_update_by_a_gemv_of_its_own_buffer():
    """The update is a GEMV's epilogue over the donated buffer it is written into: the GEMV kernel
    may not store it there itself (it would overwrite rows other workgroups still read), so the
    update gets its own buffer; planning once retried the same partition forever."""
    def f(x, w, p):
        return dsl.dynamic_update_slice(x, dsl.dot_t(x, w) * 0.17, [p, 20])
    for p in (0, 1, 3):
        check(f, randn(7, 33), randn(8, 33), p, donate=(0,))


def test_f16_mean_accumulates_in_f32():
    x = (rng.random((3, 2000)) * 100 + 50).astype(np.float16)         # row sums pass 65504
    c = check(lambda x: dsl.mean(x, -1), x, rtol=2e-3)
    assert c.program.outputs[0].dtype == "f16"
    check(lambda x: dsl.mean(x, axis=(0, 1), keepdims=True) - x, x, rtol=2e-3, atol=0.2)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_chains_of_thousands_of_ops(backend):
    def f(x, w):
        y = x @ w
        for i in range(2500):
            y = dsl.tanh(y * 1.001 + 0.01) if i % 2 else y + x[:, :1]
        return y + dsl.sum(y, -1, keepdims=True)
    x, w = randn(2, 8), randn(8, 8, scale=0.3)
    jf = dsl.jit(f, backend=backend)
    low = jf.lower(x, w)
    assert dsl.parse_ir(low.as_text()).as_text() == low.as_text()
    np.testing.assert_allclose(jf(x, w), low.program.run(x, w, compute_dtype="f64")[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("same_activation", [True, False])
def test_two_contractions_that_are_not_siblings_meet_in_one_epilogue(same_activation):
    x, w1, w2 = randn(2, 8), randn(5, 8), randn(8, 5)
    if same_activation:
        check(lambda x, w1, w2: -dsl.rsqrt(dsl.abs(dsl.dot_t(x, w1)) + 0.5) - x @ w2, x, w1, w2)
    else:
        check(lambda x, w1, w2: dsl.dot_t(dsl.concatenate([x, x], 1)[:, 4:12], w1) + dsl.tanh(x) @ w2, x, w1, w2)


def test_shared_values_do_not_blow_up_compile_time():
    """Each step reads the previous value twice: inlined as a tree it doubles every step, so the
    partition cuts it into kernels once a tree passes MAX_INLINE_SIZE ops (also in an epilogue)."""
    def chain(x, w):
        y = x @ w.T
        for _ in range(24):
            y = y * dsl.sigmoid(y)
        z = x[:, :8]
        for _ in range(24):
            z = z * dsl.tanh(z) + z * 0.5
        return y, z
    c = check(chain, randn(2, 64), randn(16, 64, scale=0.2), rtol=2e-4, atol=1e-5)   # 48 f32 steps
    assert len(c.plan.kernels) > 3                      # cut, where 2**24-op trees would not finish


@pytest.mark.parametrize("rules", [{"epilogue": False}, None])
def test_a_residual_stream_is_stored_before_its_kernels_reread_every_layer(rules):
    """``x = x + tanh(x) @ w`` for 30 layers.  With the epilogue rule off nothing stores the sum, and
    inlined into each later layer's kernel it would re-add every earlier layer's output (31 [T, D]
    buffers in the last kernel; quadratic in depth; the last prefill matmuls of a 30-layer model
    spilled on gfx906): the partition stores a value read by several ops once its expression
    loads more than ``MAX_SHARED_LOADS`` buffers.  Every kernel reads a bounded number of [T, D]
    buffers, and the result matches float64."""
    from fusion import partition

    def f(x, ws):
        for w in ws:
            x = x + dsl.tanh(x) @ w                  # (T, D)
        return x
    T, D = 5, 24
    c = check(f, randn(T, D), [randn(D, D, scale=0.2) for _ in range(30)], fusion=rules, rtol=1e-3, atol=1e-3)
    reads = [sum(p.shape == (T, D) and p.role == "in" for p in k.params) for k in c.plan.kernels]
    assert max(reads) <= partition.MAX_SHARED_LOADS + 1, reads
    assert len(c.plan.kernels) <= 40


def test_a_value_read_twice_in_one_kernel_stays_inlined_whatever_it_loads():
    """``MAX_SHARED_LOADS`` applies to values read in several kernels, and counts distinct buffers:
    ``v`` below reads 2 buffers (counted 8 once) and ``s`` reads 5, each read twice by one
    elementwise kernel, which stays one kernel; the donated state is still updated in place."""
    def f(x, y):
        u = x + y
        v = u * u * u + u
        return v * dsl.sigmoid(v)
    c = check(f, randn(6, 40), randn(6, 40), rtol=1e-3, atol=1e-3)
    assert families(c) == ["elementwise"]

    def update(state, a, b, c, d):
        s = state * 0.9 + a + b + c + d
        return s * dsl.sigmoid(s)
    c = check(update, *[randn(5, 24) for _ in range(5)], donate=(0,))
    assert families(c) == ["elementwise"] and c.plan.aliases == {"state": "state"}

    def chain(x, y):
        for _ in range(12):
            x = x + dsl.tanh(x) * y
        return x
    assert len(check(chain, randn(6, 40), randn(6, 40), rtol=1e-3, atol=1e-3).plan.kernels) <= 2


def test_argmax_picks_the_first_nan_like_numpy():
    x = randn(6, 37)
    x[1, 5], x[2, 0], x[3, 30], x[3, 7], x[4] = np.nan, np.nan, np.nan, np.nan, np.nan
    for axis in (-1, 0):
        got = np.asarray(dsl.jit(lambda x: dsl.argmax(x, axis))(x))
        np.testing.assert_array_equal(got, np.argmax(x, axis))
    assert int(np.asarray(dsl.jit(lambda x: dsl.argmax(x.reshape(-1)))(x))) == int(np.argmax(x))


def test_integer_division_by_zero_is_defined_and_never_traps():
    """idiv/mod (index arithmetic; users reach them through IR text): x / 0 and x % 0 are 0,
    INT_MIN / -1 wraps; the process must not die of SIGFPE."""
    from dsl.core import PRIMITIVES, bind
    a = np.array([7, -7, 5, -2 ** 31, 9, -9, 2 ** 31 - 1, 0], np.int32)
    c = np.array([2, 2, 0, -1, -4, 0, -1, 0], np.int32)
    f = dsl.jit(lambda a, c: (bind(PRIMITIVES["idiv"], a, c), bind(PRIMITIVES["mod"], a, c)))
    got = [np.asarray(g) for g in f(a, c)]
    np.testing.assert_array_equal(got[0], [3, -3, 0, -2 ** 31, -2, 0, -(2 ** 31 - 1), 0])
    np.testing.assert_array_equal(got[1], [1, -1, 0, 0, 1, 0, 0, 0])
    want = f.lower(a, c).program.run(a, c)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
