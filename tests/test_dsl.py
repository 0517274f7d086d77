"""Tracing, the IR text and its grammar, the reference interpreter, jit caching and user errors."""
import numpy as np
import pytest

import dsl
from dsl.core import DSLError

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_jit_traces_once_per_signature_and_runtime_ints_do_not_retrace():
    calls = []

    @dsl.jit
    def f(x, pos):
        calls.append(1)
        return x * 2.0 + dsl.astype(pos, "f32")

    x = randn(3, 4)
    for pos in (0, 5, 7):
        np.testing.assert_allclose(f(x, pos), x * 2 + pos, rtol=1e-6)
    assert len(calls) == 1
    f(randn(2, 4), 1)                                    # new shape: retrace
    f(randn(2, 4).astype(np.float16), 1)                  # new dtype: retrace
    assert len(calls) == 3


def test_static_args_are_part_of_the_key():
    calls = []

    def g(x, n):
        calls.append(n)
        return x * float(n)
    f = dsl.jit(g, static_argnums=1)
    x = randn(4)
    np.testing.assert_allclose(f(x, 3), 3 * x, rtol=1e-6)
    np.testing.assert_allclose(f(x, 3), 3 * x, rtol=1e-6)
    np.testing.assert_allclose(f(x, 5), 5 * x, rtol=1e-6)
    assert calls == [3, 5]


def test_pytree_params_in_and_out():
    @dsl.jit
    def f(p, x):
        return {"y": dsl.dot_t(x, p["w"]) + p["b"], "both": [x * 1.0, p["b"] * 2.0]}
    p = {"w": randn(5, 3), "b": randn(5)}
    x = randn(2, 3)
    out = f(p, x)
    np.testing.assert_allclose(out["y"], x.astype(np.float64) @ p["w"].T + p["b"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["both"][1], 2 * p["b"], rtol=1e-6)


def test_ir_text_round_trips_and_runs_the_same():
    def f(x, w, pos):
        h = dsl.exp(x - dsl.max(x, axis=-1, keepdims=True))
        y = dsl.dot_t(h, w)
        z = dsl.where(y > 0, y, 0.5 * y)
        c = dsl.concatenate([z[:, 1:], -z[:, :1]], axis=-1)
        return dsl.dynamic_update_slice(c, c[:1] * 3.0, [pos, 0]), dsl.argmax(z)
    x, w = randn(4, 8), randn(6, 8)
    low = dsl.jit(f).lower(x, w, 2)
    text = low.as_text()
    assert text.startswith("{ lambda") and "dot[trans_b=True]" in text
    prog = dsl.parse_ir(text)
    assert prog.as_text() == text
    a = low.program.run(x, w, np.int32(2), compute_dtype="f64")
    b = prog.run(x, w, np.int32(2), compute_dtype="f64")
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_parse_ir_rejects_bad_text():
    with pytest.raises(DSLError, match="unknown primitive"):
        dsl.parse_ir("{ lambda a:f32[2] ;\n  let b:f32[2] = frobnicate a\n  in ( b ) }")
    with pytest.raises(DSLError, match="declared"):
        dsl.parse_ir("{ lambda a:f32[2] ;\n  let b:f32[3] = exp a\n  in ( b ) }")


def test_interpreter_f64_is_an_independent_reference():
    x = randn(3, 5)

    def f(x):
        return dsl.sum(dsl.exp(x) * x, axis=-1)
    (y,) = dsl.jit(f).lower(x).program.run(x, compute_dtype="f64")
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, (np.exp(x.astype(np.float64)) * x).sum(-1), rtol=1e-12)


def test_shape_errors_name_the_users_line():
    def bad(x, w):
        return dsl.dot_t(x, w)          # the contracting dims differ
    with pytest.raises(DSLError, match=r"test_dsl.py:\d+: dot: contracting dims differ"):
        dsl.jit(bad)(randn(2, 3), randn(4, 5))


def test_broadcast_error_and_bool_of_tracer():
    with pytest.raises(DSLError, match=r"test_dsl.py:\d+: shapes \[2, 3\], \[4\] do not broadcast"):
        dsl.jit(lambda x, y: x + y)(randn(2, 3), randn(4))

    def branchy(x):
        if x > 0:
            return x
        return -x
    with pytest.raises(DSLError, match="no Python truth value; use dsl.where"):
        dsl.jit(branchy)(randn(3))


def test_dtype_promotion_and_weak_python_scalars():
    @dsl.jit
    def f(a, b):
        return a + b, a * 2.0
    a, b = randn(4).astype(np.float16), randn(4)
    s, t = f(a, b)
    assert s.dtype == np.float32 and t.dtype == np.float16
    np.testing.assert_allclose(s, a.astype(np.float32) + b, rtol=1e-6)
