"""User-defined elementwise primitives (``dsl.define_elementwise``): they run on the CPU against
float64 numpy, fuse like built-ins, print and parse back, compile for gfx906, and a malformed one
is refused with one clear line."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.hip import render_hip
from dsl.core import DSLError
from stdlib import nn

rng = np.random.default_rng()


def float_rule(avals):
    (shape, dtype), = avals
    if dtype not in ("f32", "f16"):
        raise DSLError(f"needs a float input, got {dtype}")
    return shape, dtype


def same_rule(avals):
    (sa, da), (sb, db) = avals
    if sa != sb or da != db or da not in ("f32", "f16"):
        raise DSLError("needs float inputs of one shape and dtype")
    return sa, da


SOFTPLUS = "add(max(x, 0.0), log(add(1.0, exp(neg(abs(x))))))"
softplus = dsl.define_elementwise("t_softplus", float_rule, lambda x: np.logaddexp(0.0, x), SOFTPLUS)
hypot = dsl.define_elementwise("t_hypot", same_rule, np.hypot, "sqrt(add(mul(a, a), mul(b, b)))")
leaky = dsl.define_elementwise("t_leaky", float_rule, lambda x: np.where(x > 0, x, 0.1 * x),
                               "select(gt(x, 0.0), x, mul(x, 0.1))")


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def f64(x):
    return np.asarray(x, np.float64)


def test_fused_into_a_gemv_epilogue_on_the_cpu():
    @dsl.jit
    def layer(x, w, b):
        return softplus(nn.linear(x, w) + b * 4.0)
    x, w, b = randn(1, 96), randn(40, 96), randn(40)
    c = layer.compile(x, w, b)
    (k,) = c.plan.kernels
    assert k.family == "contract" and "t_softplus" in c.fusion_report().splitlines()[1]
    assert "t_softplus(add(acc_" in L.format_kernel(k)                        # one op in the Loop IR
    want = np.logaddexp(0.0, f64(x) @ f64(w).T + 4 * f64(b))
    np.testing.assert_allclose(c(x, w, b), want, rtol=1e-5, atol=1e-5)
    ref = layer.lower(x, w, b).program.run(x, w, b, compute_dtype="f64")[0]
    np.testing.assert_allclose(ref, want, rtol=1e-12)                          # the interpreter runs the reference


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_user_op_against_float64(dtype):
    a, b = randn(7, 33, dtype=dtype) * 6, randn(33, dtype=dtype)
    f = dsl.jit(lambda a, b: (softplus(a), hypot(a, b), leaky(a), hypot(a, 2.0)))
    got = f(a, b)
    want = (np.logaddexp(0, f64(a)), np.hypot(f64(a), f64(b)), np.where(a > 0, f64(a), 0.1 * f64(a)),
            np.hypot(f64(a), 2.0))
    tol = 1e-5 if dtype == np.float32 else 4e-3
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == (7, 33)
        np.testing.assert_allclose(f64(g), w, rtol=tol, atol=tol)
    assert len(f.compile(a, b).plan.kernels) == 1
    np.testing.assert_allclose(dsl.jit(lambda a: softplus(a), backend="reference")(a),
                               np.logaddexp(0, f64(a)), rtol=tol, atol=tol)


def test_ir_text_parses_back_and_runs():
    f = dsl.jit(lambda x, y: leaky(hypot(x, y)) - softplus(x))
    x, y = randn(4, 8), randn(4, 8)
    text = f.lower(x, y).as_text()
    assert "t_hypot" in text and "t_leaky" in text and "t_softplus" in text
    prog = dsl.parse_ir(text)
    assert prog.as_text() == text
    want = np.hypot(f64(x), y) - np.logaddexp(0, f64(x))
    np.testing.assert_allclose(prog.run(x, y, compute_dtype="f64")[0], want, rtol=1e-12)
    np.testing.assert_allclose(f(x, y), want, rtol=1e-5, atol=1e-5)


def test_renders_and_compiles_for_gfx906():
    from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
    x, w, b = randn(1, 64), randn(32, 64), randn(32)
    for dt in (np.float32, np.float16):
        low = dsl.jit(lambda x, w, b: leaky(softplus(nn.linear(x, w) + b)) + hypot(b, b)).lower(
            x.astype(dt), w.astype(dt), b.astype(dt))
        from fusion import build_plan
        kernels = build_plan(low.program, None, low.in_names, low.donated).kernels
        src = [render_hip(k, "gfx906") for k in kernels]
        # spelled from the expression, literals in the operands' dtype; f16 values enter libm as float
        want = "logf(1.0f + expf((-fabsf(" if dt == np.float32 else "logf(vf_h2f(vf_f2h(1.0f) + vf_f2h(expf(vf_h2f((-vf_f2h(fabsf("
        assert any(want in s.body for s in src)
        try:
            find_hiprtc()
        except HipUnavailable as e:
            pytest.skip(f"hiprtc unavailable: {e}")
        for k, s in zip(kernels, src):
            compile_hip(s.source, k.name)


def test_malformed_definitions_are_refused_with_one_line():
    ref = lambda x: x  # noqa: E731
    cases = [
        (("exp", float_rule, ref, "exp(x)"), "a built-in primitive has that name"),
        (("t_bad", float_rule, ref, "log1q(x)"), "'log1q' is not a Loop IR op; use one of"),
        (("t_bad", float_rule, ref, "add(x)"), "add takes 2 operand"),
        (("t_bad", float_rule, ref, "add(x, y)"), "names its operands x .* or a and b"),
        (("t_bad", float_rule, ref, "exp(x"), "expected ',' or '\\)' after an argument of exp\\("),
        (("t_bad", lambda avals: avals[0], ref, "exp(x)"), "exp is not defined on i32 operands"),
        (("t_bad", lambda avals: ((1,), "f32"), ref, "x"), "rule gives shape \\[1\\] for inputs of shape \\[2, 3\\]"),
        (("t_bad", lambda avals: "f32", ref, "x"), "shape rule returned 'f32'; return \\(shape, dtype\\)"),
        (("t_bad", lambda avals: 1 / 0, ref, "x"), "shape rule raised ZeroDivisionError"),
        (("t_bad", lambda avals: (avals[0][0], "bool"), ref, "x"), "expression gives f32 but the rule gives bool"),
        (("t_bad", float_rule, lambda x: x.sum(-1), "x"), "reference returned shape \\[2\\]"),
        (("t_bad", float_rule, np.exp, "exp(neg(x))"), "the reference gives .* and the expression .* at x="),
        (("Bad-Name", float_rule, ref, "x"), "lowercase letters"),
    ]
    for args, match in cases:
        with pytest.raises(DSLError, match=match) as e:
            dsl.define_elementwise(*args)
        assert "\n" not in str(e.value)
        assert "t_bad" not in L.OPS


def test_redefining_a_user_primitive_replaces_it():
    f1 = dsl.define_elementwise("t_twice", float_rule, lambda x: 2 * x, "mul(x, 2.0)")
    x = randn(5)
    np.testing.assert_allclose(dsl.jit(lambda x: f1(x))(x), 2 * f64(x), rtol=1e-6)
    f2 = dsl.define_elementwise("t_twice", float_rule, lambda x: 3 * x, "mul(x, 3.0)")
    np.testing.assert_allclose(dsl.jit(lambda x: f2(x))(x), 3 * f64(x), rtol=1e-6)


def test_a_user_comparison_gives_bool():
    near = dsl.define_elementwise("t_near", lambda avals: (same_rule(avals)[0], "bool"),
                                  lambda a, b: np.abs(a - b) < 0.5, "lt(abs(sub(a, b)), 0.5)")
    a, b = randn(64), randn(64)
    got = dsl.jit(lambda a, b: dsl.where(near(a, b), a, b))(a, b)
    np.testing.assert_array_equal(got, np.where(np.abs(f64(a) - b) < 0.5, a, b))


def test_the_example_runs():
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    r = subprocess.run([sys.executable, str(repo / "examples" / "softplus_primitive.py")], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "my_softplus(add(acc_" in r.stdout and "max |error| against numpy float64" in r.stdout


@pytest.mark.parametrize("wave", [32, 64])
def test_on_a_cuda_gpu(wave, monkeypatch):
    """The NVIDIA flavour of the HIP source, at the warp's width and at gfx906's (skipped without a GPU)."""
    try:
        from engine.executable import get_device
        get_device("cuda", wave=wave)
    except Exception as e:                               # no driver, no GPU, no cuda-python
        pytest.skip(f"no CUDA device: {e}")
    monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
    f = dsl.jit(lambda x, w, b: (leaky(softplus(nn.linear(x, w) + b) - 1.0), hypot(x, 2.0)), backend="cuda")
    x, w, b = randn(1, 512), randn(1024, 512) / 16, randn(1024)
    y, h = f(x, w, b)
    z = np.logaddexp(0, f64(x) @ f64(w).T + b) - 1.0
    np.testing.assert_allclose(f64(y), np.where(z > 0, z, 0.1 * z), rtol=1e-2, atol=1e-2)   # f16 activation in LDS
    np.testing.assert_allclose(f64(h), np.hypot(f64(x), 2.0), rtol=1e-5, atol=1e-5)
    assert "t_softplus" in f.compile(x, w, b).fusion_report()
