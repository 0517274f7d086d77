"""lax.scan, lax.fori_loop, lax.cond: against numpy float64 loops written here, one kernel per
scan whatever the trip count, the body printed in the IR and parsed back, gfx906 compilation."""
import numpy as np
import pytest

import dsl
from dsl import lax
from dsl.core import DSLError

RNG = np.random.default_rng()


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def close(out, ref, tol=2e-5):
    for o, r in zip(dsl.tree_flatten(out)[0], dsl.tree_flatten(ref)[0]):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        assert o.shape == r.shape, (o.shape, r.shape)
        np.testing.assert_allclose(o, r, rtol=tol, atol=tol)


# ---------------------------------------------------------------- gated DeltaNet prefill
def deltanet_prefill(S, q, k, v, beta, g):
    """State S (H, dk, dv); per step: decay, delta-rule update, output S^T q."""
    def step(S, x):
        q, k, v, beta, g = x
        S = S * dsl.exp(g)[:, None, None]
        kv = (S * k[:, :, None]).sum(-2)                    # S^T k: (H, dv)
        delta = (v - kv) * beta[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        return S, (S * q[:, :, None]).sum(-2)
    return lax.scan(step, S, (q, k, v, beta, g))


def deltanet_ref(S, q, k, v, beta, g):
    S, ys = S.astype(np.float64), []
    for t in range(q.shape[0]):
        S = S * np.exp(g[t].astype(np.float64))[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        d = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * d[:, None, :]
        ys.append(np.einsum("hkv,hk->hv", S, q[t]))
    return S, np.stack(ys)


def deltanet_inputs(T, H=2, dk=8, dv=4):
    """As the model feeds it: unit-norm keys (the delta rule is stable), queries scaled by 1/sqrt(dk)."""
    k = randn(T, H, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return (randn(H, dk, dv), randn(T, H, dk) / np.float32(np.sqrt(dk)), k, randn(T, H, dv),
            RNG.random((T, H)).astype(np.float32), -RNG.random((T, H)).astype(np.float32))


def test_deltanet_prefill_is_one_kernel_whatever_T():
    sizes = {}
    for T in (4, 64):
        args = deltanet_inputs(T)
        f = dsl.jit(deltanet_prefill)
        close(f(*args), deltanet_ref(*args), 1e-4)
        c = f.compile(*args)
        assert [k.family for k in c.plan.kernels] == ["loop"]
        text = f.lower(*args).as_text()
        sizes[T] = (len(c.plan.kernels), len(text.splitlines()), text.count("="))
    assert sizes[4] == sizes[64]


def test_deltanet_on_the_reference_backend_and_f64_interpreter():
    args = deltanet_inputs(5)
    f = dsl.jit(deltanet_prefill)
    close(f.lower(*args).program.run(*args, compute_dtype="f64"), deltanet_ref(*args), 1e-9)
    close(dsl.jit(deltanet_prefill, backend="reference")(*args), deltanet_ref(*args), 1e-4)


# ---------------------------------------------------------------- scan semantics
def test_scan_pytrees_closures_literals_and_a_gemv_in_the_body():
    h0, xs, w, g = randn(1, 16), randn(7, 1, 8), randn(24, 16), randn(16)

    def rnn(h0, xs, w, g):
        def step(c, x):
            hn = c["h"] * dsl.rsqrt((c["h"] * c["h"]).mean(-1, keepdims=True) + 1e-5) * g
            h = dsl.tanh(dsl.dot_t(dsl.concatenate([hn, x["in"]], 1), w.T))     # (1, 24) @ (24, 16)
            return {"h": h, "n": c["n"] + 1}, (h.sum(), 2.0)
        return lax.scan(step, {"h": h0, "n": 0}, {"in": xs})

    def ref(h0, xs, w, g):
        h, ys = h0.astype(np.float64), []
        for t in range(xs.shape[0]):
            hn = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * g
            h = np.tanh(np.concatenate([hn, xs[t]], 1) @ w)
            ys.append(h.sum())
        return {"h": h, "n": np.int32(xs.shape[0])}, (np.array(ys), np.full(xs.shape[0], 2.0))

    f = dsl.jit(rnn)
    close(f(h0, xs, w, g), ref(h0, xs, w, g), 1e-4)
    assert len(f.compile(h0, xs, w, g).plan.kernels) == 1


def test_reverse_scan_runs_from_the_last_x():
    x, h = randn(6, 4), randn(4)

    def f(x, h):
        return lax.scan(lambda c, r: (dsl.tanh(c * 0.9 + r), c.sum() + r[0]), h, x, reverse=True)

    def ref(x, h):
        c, ys = h.astype(np.float64), [None] * 6
        for t in reversed(range(6)):
            ys[t] = c.sum() + x[t, 0]
            c = np.tanh(c * 0.9 + x[t])
        return c, np.array(ys)
    close(dsl.jit(f)(x, h), ref(x, h))
    batched = dsl.jit(dsl.vmap(f, in_axes=(None, 0)))(x, np.stack([h, -h]))
    close(batched, [np.stack(a) for a in zip(ref(x, h), ref(x, -h))])
    text = dsl.jit(f).lower(x, h).as_text()
    assert "reverse=True" in text and dsl.parse_ir(text).as_text() == text


def test_lax_map_is_a_scan_without_a_carry():
    x = randn(5, 3, 4)
    f = dsl.jit(lambda x: lax.map(lambda a: {"s": dsl.tanh(a).sum(0), "m": a.max()}, x))
    close(f(x), {"s": np.tanh(x.astype(np.float64)).sum(1), "m": x.max((1, 2))})
    assert [k.family for k in f.compile(x).plan.kernels] == ["loop"]


def test_carries_that_swap_and_pass_through():
    a, b = randn(3, 5), randn(3, 5)
    f = dsl.jit(lambda a, b: lax.fori_loop(0, 3, lambda i, c: (c[1], c[0] + 1.0, c[2]), (a, b, a)))
    close(f(a, b), (b.astype(np.float64) + 1, a + 2.0, a))           # (a, b) -> (b, a+1) -> (a+1, b+1) -> (b+1, a+2)


def test_fori_loop_index_drives_an_in_place_row_update():
    x, buf = randn(4, 6), randn(9, 6)

    def f(x, buf):
        def body(i, b):
            row = dsl.take(x, i - 2)[None] * i.astype("f32")
            return dsl.dynamic_update_slice(b, row + b[0:1], [i, 0])
        return lax.fori_loop(2, 8, body, buf)

    ref = buf.astype(np.float64)
    for i in range(2, 8):
        ref[i] = x[min(i - 2, 3)] * i + ref[0]
    j = dsl.jit(f)
    close(j(x, buf), ref)
    assert len(j.compile(x, buf).plan.kernels) == 1         # the index is computed in the loop
    assert dsl.jit(lambda x: lax.fori_loop(3, 3, lambda i, c: c * 2.0, x))(x) is not None


def test_nested_scan_and_integer_carry_with_a_runtime_scalar():
    x = randn(3, 5)

    def f(x, n):
        def outer(c, xr):
            d, _ = lax.scan(lambda d, e: (d * 0.5 + e, None), c, x)
            return d + xr, d.max()
        y = lax.scan(outer, x[0], x)
        k = lax.fori_loop(0, 4, lambda i, c: c + i * n, 1)
        return y, k

    def ref(x, n):
        c, ys = x[0].astype(np.float64), []
        for t in range(3):
            d = c
            for e in x:
                d = d * 0.5 + e
            c = d + x[t]
            ys.append(d.max())
        return (c, np.array(ys)), 1 + 6 * n

    close(dsl.jit(f)(x, 7), ref(x, 7))
    assert [k.family for k in dsl.jit(f).compile(x, 7).plan.kernels] == ["loop", "loop"]   # x[0] computed in it


def test_ir_text_prints_the_body_once_and_parses_back():
    args = deltanet_inputs(3)
    low = dsl.jit(deltanet_prefill).lower(*args)
    text = low.as_text()
    assert text.count("lambda") == 2 and "body={ lambda" in text and "body=" + text.split()[text.split().index("let") + 1].split(":")[0] in text
    back = dsl.parse_ir(text)
    assert back.as_text() == text
    close(back.run(*args, compute_dtype="f64"), deltanet_ref(*args), 1e-9)
    with pytest.raises(DSLError, match="names no earlier loop"):
        dsl.parse_ir(text.replace("body={", "body=zz, b={", 1))


# ---------------------------------------------------------------- cond
def test_cond_traced_is_a_select_and_static_picks_one_branch():
    x, y = randn(4, 3), randn(4, 3)
    calls = []

    def f(x, y):
        r = lax.cond(x.sum() > 0, lambda a, b: (a * b, a), lambda a, b: (a - b, b), x, y)
        s = lax.cond(False, lambda: calls.append("t") or x, lambda: calls.append("f") or y * 2.0)
        return r, s

    for sign in (1.0, -1.0):
        out = dsl.jit(f)(x * sign, y)
        xs = x * sign
        ref = ((xs * y, xs) if xs.sum() > 0 else (xs - y, y), y * 2.0)
        close(out, ref)
    assert calls == ["f", "f"]


# ---------------------------------------------------------------- errors name the user's line
def _line_of(text):
    import inspect
    src = inspect.getsource(test_errors_name_the_users_line).splitlines()
    start = test_errors_name_the_users_line.__code__.co_firstlineno
    return start + next(i for i, s in enumerate(src) if text in s)


def test_errors_name_the_users_line():
    x = randn(3, 4)
    cases = [
        (lambda x: lax.scan(lambda c, r: (c[None], r), x[0], x), "changes carry 0 from f32\\[4\\] to f32\\[1, 4\\]",
         "c[None], r"),
        (lambda x: lax.scan(lambda c, r: (c.astype("i32"), r), x[0], x), "changes carry 0 from f32\\[4\\] to i32",
         'c.astype("i32")'),
        (lambda x: lax.fori_loop(0, x.shape[0] + (x[0, 0] > 0).astype("i32"), lambda i, c: c, x),
         "fori_loop's upper is a traced value", "lax.fori_loop(0, x.shape[0] +"),
        (lambda x: lax.scan(lambda c, r: (c, r), x[0], (x, x[:2])), "leading dims \\[3, 2\\]", "(x, x[:2])"),
        (lambda x: lax.while_loop(lambda c: True, lambda c: c, x), "while_loop is not supported", "lax.while_loop"),
        (lambda x: lax.cond(x[0, 0] > 0, lambda: x, lambda: x[0]), "branches return", "lambda: x[0]"),
    ]
    for f, msg, where in cases:
        with pytest.raises(DSLError, match=msg) as e:
            dsl.jit(f).lower(x)
        assert str(e.value).startswith(f"tests/test_control_flow.py:{_line_of(where)}:"), str(e.value)


# ---------------------------------------------------------------- gfx906
def test_loop_kernels_compile_for_gfx906():
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from codegen.simplify import simplify
    from fusion import build_plan
    x = randn(3, 5)
    progs = [dsl.jit(deltanet_prefill).lower(*deltanet_inputs(4)),
             dsl.jit(lambda x: lax.scan(lambda c, r: (dsl.tanh(c @ x[:, :3] + r[:3].sum()), c.max()), x[:, :3], x)).lower(x)]
    for low in progs:
        for k in build_plan(low.program, None, low.in_names, low.donated).kernels:
            h = render_hip(simplify(k), "gfx906")
            if k.family == "loop":
                assert "for (int t = 0;" in h.source and "__syncthreads();" in h.source and h.kernel.launch.grid == 1
            compile_hip(h.source, k.name)


def test_scalar_xs_computed_from_reductions():
    v, m = randn(6), randn(5, 4)

    def f(v, m):
        a = lax.scan(lambda c, r: (c * 0.5 + r, c * r), 1.0, dsl.max(v, axis=None, keepdims=True))
        b = lax.scan(lambda c, r: (c * 0.5 + r, c - r), 0.0, m.max(-1) + dsl.arange(5).astype("f32"))
        return a, b

    def ref(v, m):
        out = []
        for xs, init, y in ((np.array([v.max()]), 1.0, np.multiply), (m.max(-1) + np.arange(5), 0.0, np.subtract)):
            c, ys = np.float64(init), []
            for r in xs:
                ys.append(y(c, r))
                c = c * 0.5 + r
            out.append((c, np.array(ys)))
        return out
    close(dsl.jit(f)(v, m), ref(v, m))


def decode_loop(q, k, cache):
    """T decode steps in one scan: write key t into the cache (a carry), attend over 0..t."""
    def step(c, x):
        qt, t = x
        c = dsl.dynamic_update_slice(c, dsl.take(k, t)[None, None], [0, t, 0])
        return c, dsl.attention(qt, c, c, t, 0.3)
    return lax.scan(step, cache, (q, dsl.arange(q.shape[0])))


def decode_loop_ref(q, k, cache):
    from tests.test_vmap import attention_ref
    c, ys = cache.astype(np.float64), []
    for t in range(q.shape[0]):
        c[0, t] = k[t]
        ys.append(attention_ref(q[t], c, c, t, 0.3))
    return c, np.stack(ys)


def test_kv_cache_update_and_attention_inside_the_loop():
    q, k, cache = randn(5, 2, 1, 8), randn(6, 8), np.zeros((1, 6, 8), np.float32)
    f = dsl.jit(decode_loop)
    close(f(q, k, cache), decode_loop_ref(q, k, cache), 1e-4)
    assert [kk.family for kk in f.compile(q, k, cache).plan.kernels] == ["loop"]


@pytest.mark.parametrize("wave", [32, 64])
def test_loops_on_a_cuda_gpu(monkeypatch, wave):
    """The loop family on an NVIDIA GPU (the gfx906 kernel text at wave 64); skipped without one."""
    try:
        from engine.executable import get_device
        monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
        get_device("cuda")
    except Exception as e:                                   # no driver, no GPU, no cuda-python
        pytest.skip(f"CUDA tests skipped: {e}")
    args = deltanet_inputs(64, H=4, dk=32, dv=32)
    close(dsl.jit(deltanet_prefill, backend="cuda")(*args), deltanet_ref(*args), 1e-3)
    batch = [np.stack([a, a[::-1].copy()]) for a in args]
    refs = [deltanet_ref(*[a[b] for a in batch]) for b in range(2)]
    close(dsl.jit(dsl.vmap(deltanet_prefill), backend="cuda")(*batch),
          (np.stack([r[0] for r in refs]), np.stack([r[1] for r in refs])), 1e-3)
    q, k, cache = randn(5, 2, 1, 8), randn(6, 8), np.zeros((1, 6, 8), np.float32)
    close(dsl.jit(decode_loop, backend="cuda")(q, k, cache), decode_loop_ref(q, k, cache), 1e-4)
    x, buf = randn(4, 6), randn(9, 6)
    f = dsl.jit(lambda x, b: lax.fori_loop(2, 8, lambda i, b: dsl.dynamic_update_slice(
        b, dsl.take(x, i - 2)[None] * 2.0 + b[0:1], [i, 0]), b), backend="cuda")
    ref = buf.astype(np.float64)
    for i in range(2, 8):
        ref[i] = x[min(i - 2, 3)] * 2 + ref[0]
    close(f(x, buf), ref)


def test_a_carry_updated_elementwise_is_written_in_place_and_others_are_not():
    args = deltanet_inputs(6, H=2, dk=16, dv=8)
    plan = dsl.jit(deltanet_prefill).compile(*args).plan
    (k,) = plan.kernels
    state = [p.name for p in k.params if p.shape == (2, 16, 8)]
    assert len(state) == 2, state                       # the input S and the carry: no per-step copy
    x = randn(4, 8)

    def g(x):
        a = lax.scan(lambda c, r: (c + r, (c * (c + r)).sum()), x[0], x)
        b = lax.scan(lambda c, r: (c - c.mean() + r, c.max()), x[0], x)
        d = lax.scan(lambda c, r: (dsl.concatenate([c[4:], c[:4]]) * 0.5 + r, c), x[0], x)   # a permutation
        return a, b, d

    def ref(x):
        x = x.astype(np.float64)
        outs = []
        for upd, y in ((lambda c, r: c + r, lambda c, r: (c * (c + r)).sum()),
                       (lambda c, r: c - c.mean() + r, lambda c, r: c.max()),
                       (lambda c, r: np.concatenate([c[4:], c[:4]]) * 0.5 + r, lambda c, r: c)):
            c, ys = x[0], []
            for r in x:
                ys.append(y(c, r))
                c = upd(c, r)
            outs.append((c, np.stack(ys)))
        return outs
    close(dsl.jit(g)(x), ref(x))
