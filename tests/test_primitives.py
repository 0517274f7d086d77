"""Every primitive has a lowering on every backend, and every elementwise primitive computes what
its numpy reference computes, for every dtype its rule accepts: on the CPU against float64, and
compiled for gfx906.  A new elementwise primitive is covered here without a line of test code."""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from dsl.core import NP_DTYPES, PRIMITIVES, DSLError
from fusion.lower import LOWER, REDUCE_OPS

rng = np.random.default_rng()
ELEMENTWISE = sorted(p for p, prim in PRIMITIVES.items() if prim.kind == "elementwise" and p in L.OPS)
FAMILIES = {"dot": "contract", "attention": "attention", "dynamic_update_slice": "scatter", "scatter": "scatter",
            "scan": "loop"}


def accepted_dtypes(prim, arity):
    """The dtypes whose all-same-dtype inputs the primitive's rule accepts."""
    out = []
    for dt in ("f32", "f16", "i32", "bool"):
        try:
            prim.rule([((3,), dt)] * arity)
            out.append(dt)
        except DSLError:
            pass
    return out


def sample(dtype, shape):
    """Fresh inputs inside every op's domain (positive, away from zero: log, sqrt, div, mod)."""
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "i32":
        return rng.integers(1, 100, shape).astype(np.int32)
    return rng.uniform(0.5, 2.0, shape).astype(NP_DTYPES[dtype])


def test_every_primitive_has_a_lowering():
    for name, prim in PRIMITIVES.items():
        if prim.kind == "elementwise" and name in L.OPS:
            op = L.OPS[name]
            for dt in accepted_dtypes(prim, op.arity):
                L.spelling(name, dt, "c"), L.spelling(name, dt, "llvm")     # raises if missing
        elif prim.kind in ("view", "index", "elementwise"):
            assert name in LOWER or name in FAMILIES, f"{name}: no rule in fusion/lower.py LOWER"
        elif prim.kind == "reduce":
            assert name in REDUCE_OPS, f"{name}: no accumulator op in fusion/lower.py REDUCE_OPS"
        else:
            assert name in FAMILIES, f"{name}: no kernel family"


def test_a_missing_spelling_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="no llvm spelling for f32.*dsl/primitives.py"):
        L.spelling("and", "f32", "llvm")


def _program(name, dtype):
    """A jitted function applying primitive ``name`` once, and its inputs."""
    prim, arity = PRIMITIVES[name], L.OPS[name].arity
    args = [sample(dtype, (5, 37)) for _ in range(arity)]
    return dsl.jit(lambda *xs: dsl.core.bind(prim, *xs), backend="cpu"), args


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_primitive_against_float64(name):
    for dtype in accepted_dtypes(PRIMITIVES[name], L.OPS[name].arity):
        f, args = _program(name, dtype)
        want = f.lower(*args).program.run(*args, compute_dtype="f64")[0]
        got = np.asarray(f(*args))
        tol = 2e-3 if dtype == "f16" else 1e-5
        assert got.dtype == np.asarray(want).dtype or dtype in ("f16", "f32"), (name, dtype, got.dtype)
        np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol,
                                   err_msg=f"{name} on {dtype}")


def test_every_elementwise_primitive_compiles_for_gfx906():
    """All ops and dtypes in one kernel each per dtype kind, rendered and compiled with hiprtc."""
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from fusion import build_plan
    for dtype in ("f32", "f16", "i32", "bool"):
        names = [n for n in ELEMENTWISE if dtype in accepted_dtypes(PRIMITIVES[n], L.OPS[n].arity)]

        def f(x, y, names=names):
            outs = []
            for n in names:
                xs = (x, y)[:L.OPS[n].arity]
                outs.append(dsl.core.bind(PRIMITIVES[n], *xs))
            return outs
        x, y = sample(dtype, (4, 64)), sample(dtype, (4, 64))
        low = dsl.jit(f).lower(x, y)
        for k in build_plan(low.program, None, low.in_names, low.donated).kernels:
            compile_hip(render_hip(k, "gfx906").source, k.name)        # raises HipCompileError on failure
