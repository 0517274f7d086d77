"""dsl.vmap: each batched program against the per-example function written in numpy float64,
applied in a Python loop; batching rules (not per-index copies) for the core set."""
import numpy as np
import pytest

import dsl
from dsl import lax
from dsl.core import DSLError

from tests.test_control_flow import RNG, close, randn  # noqa: F401


def prims(f, *args):
    return [e.prim.name for e in dsl.jit(f).lower(*args).program.eqns]


def test_elementwise_and_reductions():
    x, y = randn(5, 3, 8), randn(3, 8)

    def f(x, y):
        return dsl.vmap(lambda a, b: (dsl.tanh(a * b + 1.0).sum(-1), dsl.where(a > 0, a, 0.5).max(), a.mean(0)),
                        in_axes=(0, None))(x, y)
    ref = [np.tanh(x.astype(np.float64) * y + 1).sum(-1), np.where(x > 0, x, 0.5).max((1, 2)),
           x.astype(np.float64).mean(1)]
    close(dsl.jit(f)(x, y), ref)
    ops = prims(f, x, y)
    assert ops.count("tanh") == 1 and "concatenate" not in ops      # one op per op, not per batch index


def test_matmul_against_a_shared_weight_folds_the_batch_into_rows():
    x, w = randn(4, 3, 16), randn(24, 16)
    f = dsl.jit(lambda x, w: dsl.vmap(lambda a: dsl.maximum(dsl.dot_t(a, w), 0.0))(x))
    ref = np.maximum(np.stack([xi.astype(np.float64) @ w.T for xi in x]), 0)
    close(f(x, w), ref, 1e-4)
    assert [e.prim.name for e in f.lower(x, w).program.eqns].count("dot") == 1
    c = f.compile(x, w)
    assert [k.family for k in c.plan.kernels] == ["contract"]


def test_matmul_of_two_batched_operands_and_a_vector_dot():
    a, b, v = randn(3, 4, 5), randn(3, 5, 6), randn(3, 5)
    f = dsl.jit(lambda a, b, v: dsl.vmap(lambda x, y, z: (x @ y, x @ z))(a, b, v))
    close(f(a, b, v), [np.stack([a[i].astype(np.float64) @ b[i] for i in range(3)]),
                       np.stack([a[i].astype(np.float64) @ v[i] for i in range(3)])], 1e-4)


def attention_ref(q, k, v, pos, scale):
    hq, t, _ = q.shape
    g = hq // k.shape[0]
    out = np.zeros(q.shape)
    for h in range(hq):
        for i in range(t):
            n = pos + i + 1
            s = k[h // g, :n].astype(np.float64) @ q[h, i] * scale
            p = np.exp(s - s.max())
            out[h, i] = p / p.sum() @ v[h // g, :n]
    return out


def test_attention_folds_the_batch_into_heads():
    B, hq, hkv, T, S, D = 3, 4, 2, 2, 8, 16
    q, k, v = randn(B, hq, T, D), randn(B, hkv, S, D), randn(B, hkv, S, D)

    def f(q, k, v, pos):
        return dsl.vmap(lambda q, k, v: dsl.attention(q, k, v, pos, 0.25))(q, k, v)
    j = dsl.jit(f)
    close(j(q, k, v, 3), np.stack([attention_ref(q[b], k[b], v[b], 3, 0.25) for b in range(B)]), 1e-4)
    assert prims(f, q, k, v, 3).count("attention") == 1


def test_take_with_batched_rows_and_ids():
    x, ids, table = randn(4, 6, 3), np.array([[0, 5], [2, 2], [7, -1], [1, 4]], np.int32), randn(6, 3)
    f = dsl.jit(lambda x, ids, t: dsl.vmap(lambda a, i: (dsl.take(a, i), dsl.take(t, i)))(x, ids))
    clip = np.clip(ids, 0, 5)
    close(f(x, ids, table), [np.stack([x[b][clip[b]] for b in range(4)]), table[clip]])


def test_scan_under_vmap_is_one_loop_kernel():
    from tests.test_control_flow import deltanet_prefill, deltanet_ref
    B, T, H, dk, dv = 3, 5, 2, 4, 4
    args = (randn(B, H, dk, dv), randn(B, T, H, dk), randn(B, T, H, dk), randn(B, T, H, dv),
            RNG.random((B, T, H)).astype(np.float32), -RNG.random((B, T, H)).astype(np.float32))
    f = dsl.jit(dsl.vmap(deltanet_prefill))
    refs = [deltanet_ref(*[a[b] for a in args]) for b in range(B)]
    close(f(*args), (np.stack([r[0] for r in refs]), np.stack([r[1] for r in refs])), 1e-4)
    assert prims(dsl.vmap(deltanet_prefill), *args).count("scan") == 2      # two results of one scan
    assert [k.family for k in f.compile(*args).plan.kernels].count("loop") == 1


def test_in_axes_out_axes_cond_and_the_eager_call():
    x, y = randn(3, 5, 2), randn(2, 5)

    def g(a, b):
        return lax.cond(a.sum() > 0, lambda: a * b, lambda: a - b)
    out = dsl.vmap(g, in_axes=(1, 1), out_axes=1)(x, y)         # eager: jits vmap(g)
    ref = np.stack([g_ref(x[:, i], y[:, i]) for i in range(5)], axis=1)
    close(out, ref)


def g_ref(a, b):
    return a * b if a.sum() > 0 else a - b


def test_a_primitive_without_a_rule_runs_per_index():
    x, u, off = randn(4, 6), randn(4, 2), np.array([0, 1, 3, 9], np.int32)
    f = dsl.jit(lambda x, u, off: dsl.vmap(lambda a, b, o: dsl.dynamic_update_slice(a, b, [o]))(x, u, off))
    ref = x.copy()
    for i in range(4):
        o = min(max(off[i], 0), 4)
        ref[i, o:o + 2] = u[i]
    close(f(x, u, off), ref)


def test_errors_name_the_users_line():
    x = randn(3, 4)
    cases = [
        (lambda x: dsl.vmap(lambda a, b: a + b)(x, x[:2]), "batch sizes 3 \\(argument 0\\), 2 \\(argument 1\\)"),
        (lambda x: dsl.vmap(lambda a, b: a + b, in_axes=(0,))(x, x), "in_axes has 1 entries for 2 arguments"),
        (lambda x: dsl.vmap(lambda a: a, in_axes=2)(x), "in_axes=2 is out of range"),
        (lambda x: dsl.vmap(lambda a: a * 2.0, out_axes=None)(x), "out_axes=None for an output that depends"),
        (lambda x: dsl.vmap(lambda a: a, in_axes=None)(x), "at least one batched argument"),
    ]
    for f, msg in cases:
        with pytest.raises(DSLError, match=msg) as e:
            dsl.jit(f).lower(x)
        assert str(e.value).startswith("tests/test_vmap.py:"), str(e.value)


def test_vmapped_programs_compile_for_gfx906():
    try:
        from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
        find_hiprtc()
    except (ImportError, HipUnavailable) as e:
        pytest.skip(f"hiprtc unavailable: {e}")
    from codegen.hip import render_hip
    from codegen.simplify import simplify
    from fusion import build_plan
    x, w = randn(4, 3, 16), randn(24, 16)
    q, k = randn(2, 4, 1, 16), randn(2, 2, 8, 16)
    lows = [dsl.jit(lambda x, w: dsl.vmap(lambda a: dsl.dot_t(a, w).max(-1))(x)).lower(x, w),
            dsl.jit(lambda q, k: dsl.vmap(lambda q, k: dsl.attention(q, k, k, 3, 0.25))(q, k)).lower(q, k)]
    for low in lows:
        for kern in build_plan(low.program, None, low.in_names, low.donated).kernels:
            compile_hip(render_hip(simplify(kern), "gfx906").source, kern.name)
