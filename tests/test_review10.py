"""Adversarial cases for the matmul family and the paired_epilogue rule (issue 10's review):
each against the float64 interpreter on fresh random inputs, and compiled for gfx906 where a
GPU kernel is at stake."""
import numpy as np
import pytest

import dsl
from stdlib import nn

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def run(f, *args, donate=(), tol=2e-4):
    """``f`` on the CPU against the float64 interpreter; returns the compiled program."""
    jf = dsl.jit(f, backend="cpu", donate_argnums=donate)
    want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = dsl.tree_flatten(jf(*[a.copy() if isinstance(a, np.ndarray) else a for a in args]))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()))
    return jf.compile(*args)


def gfx906(kernels):
    """Every kernel rendered and compiled for gfx906 (hiprtc; skipped without it)."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 compile skipped: {e}")
    from tests.fuzz import _compile_gfx906
    _compile_gfx906(kernels)


@pytest.mark.parametrize("T", [4, 130])
def test_matmul_with_one_column_of_k_compiles_for_gfx906(T):
    """K = 1: the simplifier drops the activation fill's k loop, and the GPU's row groups must
    still rename the tile's row in the fill (it was left undeclared: 'use of undeclared identifier')."""
    c = run(lambda x, w: nn.linear(x, w) * 2.0, randn(T, 1), randn(5, 1))
    gfx906(c.plan.kernels)
