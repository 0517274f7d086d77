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


def test_out_of_range_axes_and_bad_indices_are_user_errors():
    x = randn(3, 4)
    for f, msg in [(lambda a: a.sum(axis=5), "axis 5 is out of range for an array of rank 2"),
                   (lambda a: a.max(axis=-3), "out of range"),
                   (lambda a: dsl.argmax(a, 3), "out of range"),
                   (lambda a: dsl.expand_dims(a, 10), "out of range"),
                   (lambda a: dsl.concatenate([a, a], 5), "out of range"),
                   (lambda a: a.sum(axis=(0, 0)), "repeated axis"),
                   (lambda a: a[1.5], "index 1.5 is not supported"),
                   (lambda a: a[True], "not supported"),
                   (lambda a: a[0, 0, 0], "too many indices"),
                   (lambda a: a.reshape(-1, -1), "bad shape"),
                   (lambda a: dsl.concatenate([]), "one or more arrays"),
                   (lambda a: [r for r in a], "cannot iterate")]:
        with pytest.raises(DSLError, match=r"test_dsl.py:\d+: .*" + msg):
            dsl.jit(f)(x)


def test_zero_size_and_oversized_arrays_are_rejected():
    with pytest.raises(DSLError, match="zero-size"):
        dsl.jit(lambda a: a + 1.0)(np.zeros((0, 4), np.float32))
    with pytest.raises(DSLError, match="32 bits"):
        dsl.jit(lambda a: dsl.broadcast_to(a, (1 << 16, 1 << 16)).sum())(randn(1 << 16))
    with pytest.raises(DSLError, match="does not fit in i32"):
        dsl.jit(lambda a, n: a * dsl.astype(n, "f32"))(randn(2), 2 ** 40)


def test_bool_arithmetic_is_rejected_and_int_division_is_true_division():
    b = randn(4) > 0
    with pytest.raises(DSLError, match="arithmetic on bool"):
        dsl.jit(lambda a: a + a)(b)
    i = np.array([7, -7, 9, 1], np.int32)
    out = dsl.jit(lambda a: a / 2)(i)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, i / 2)


def test_integer_reductions_are_exact():
    a = np.array([[16777217, 1, 0, 0]], np.int32)
    b = np.array([[2147483647, 5]], np.int32)
    c = np.array([[16777216, 16777217]], np.int32)
    assert dsl.jit(lambda a: a.sum(axis=1))(a)[0] == 16777218
    assert dsl.jit(lambda b: b.max(axis=1))(b)[0] == 2147483647
    assert dsl.jit(lambda c: dsl.argmax(c, 1))(c)[0] == 1


def test_static_args_of_different_types_do_not_share_a_trace():
    f = dsl.jit(lambda x, s: x * (2.0 if s is True else 3.0), static_argnums=1)
    x = randn(3)
    np.testing.assert_allclose(f(x, True), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(f(x, 1), 3 * x, rtol=1e-6)


def test_fusion_switches_must_be_booleans_and_backend_env_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="True or False"):
        dsl.jit(lambda x: x, fusion={"epilogue": "off"})
    monkeypatch.setenv("VEGAFUSE_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="VEGAFUSE_BACKEND='nonsense'"):
        dsl.jit(lambda x: x)


def test_parse_ir_checks_names_and_parameters_and_reads_inf_nan():
    with pytest.raises(DSLError, match="declared twice"):
        dsl.parse_ir("{ lambda a:f32[2] a:f32[2] ;\n  let b:f32[2] = exp a\n  in ( b ) }")
    with pytest.raises(DSLError, match="unknown parameter"):
        dsl.parse_ir("{ lambda a:f32[2] ;\n  let b:f32[] = reduce_sum[axis=0] a\n  in ( b ) }")
    with pytest.raises(DSLError, match="b = slice"):
        dsl.parse_ir("{ lambda a:f32[2] ;\n  let b:f32[2] = slice a\n  in ( b ) }")
    f = dsl.jit(lambda x: dsl.where(x > 0, x, float("-inf")) + float("nan"))
    text = f.lower(randn(3)).as_text()
    assert "-inf:f32" in text and "nan:f32" in text
    assert dsl.parse_ir(text).as_text() == text


def test_errors_in_stdlib_blocks_name_the_callers_line():
    from stdlib import nn

    def bad(x, w):
        return nn.linear(x, w)          # w has the wrong inner dimension
    with pytest.raises(DSLError, match=r"test_dsl.py:\d+ \(in .*stdlib/nn.py:\d+\): dot"):
        dsl.jit(bad)(randn(2, 3), randn(4, 5))


def test_numpy_ufuncs_and_functions_on_traced_values():
    x = randn(3, 4)

    def f(x):
        y = np.exp(x) + np.maximum(x, 0.5) * np.tanh(np.abs(x)) - np.sqrt(np.abs(x) + 1.0)
        return np.sum(np.where(x > 0, y, -y), axis=-1), np.mean(np.reshape(np.negative(y), (4, 3)), axis=0)
    want = dsl.jit(f).lower(x).program.run(x, compute_dtype="f64")
    ax = np.abs(x.astype(np.float64))
    y = np.exp(x.astype(np.float64)) + np.maximum(x, 0.5) * np.tanh(ax) - np.sqrt(ax + 1.0)
    np.testing.assert_allclose(want[0], np.sum(np.where(x > 0, y, -y), -1), rtol=1e-6)
    for got, w in zip(dsl.jit(f)(x), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, hint", [
    (lambda x: np.tan(x), "dsl.sin(x) / dsl.cos(x)"), (lambda x: np.median(x), "dsl functions"),
    (lambda x: np.add.reduce(x), "dsl.sum"), (lambda x: np.exp(x, out=x), "out="),
])
def test_unsupported_numpy_calls_name_the_line_and_the_dsl_function(call, hint):
    with pytest.raises(dsl.DSLError) as e:
        dsl.jit(call)(randn(4))
    msg = str(e.value)
    assert "\n" not in msg and "test_dsl.py:" in msg and hint in msg


def test_an_input_returned_as_it_is_is_a_fresh_array():
    rng = np.random.default_rng()
    f = dsl.jit(lambda x: (x + 1, x))
    a = rng.standard_normal(4).astype("f4")
    _, kept = f(a)
    f(rng.standard_normal(4).astype("f4"))                 # reuses the staging buffer
    np.testing.assert_array_equal(kept, a)
    g = dsl.jit(lambda x: (x, x))
    big = rng.standard_normal(100000).astype("f4")
    p, q = g(big)
    assert p is not big and q is not big and p is not q
    p[0] = 7.0
    assert q[0] == big[0] != 7.0
