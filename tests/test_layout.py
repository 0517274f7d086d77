"""Layout: a matmul against a (K, N) weight (``x @ w``) gets the access order of its layout.

The scheduler reads the weight's strides from its lowered index: contiguous along n, it picks
order "outer" (k outside, a run of columns per step: ``codegen.loopir.interchange`` on the CPU, a
column per thread on GPUs); contiguous along k (``x @ w.T``, ``nn.linear``), order "inner"
(dot products along k).  The fusion report names the order.  Timings: examples/bench_layout.py.
"""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.mapping import map_kernel
from codegen.targets import get_target
from engine.pipeline import lower_program
from fusion.schedule import access_order, contract_orders, stride
from stdlib import nn

rng = np.random.default_rng()


def _check(f, *args, rtol=2e-5):
    """``f(*args)`` on the CPU against the float64 reference; returns the compiled executable."""
    out = f(*args)
    ref = f.lower(*args).program.run(*args, compute_dtype="f64")
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), ref)
    for y, r in zip(outs, refs):
        scale = np.abs(r).max()
        assert scale > 0
        np.testing.assert_allclose(y, r, rtol=rtol, atol=rtol * scale)
    return f.compile(*args)


def _orders(c):
    return [contract_orders(k) for k in c.plan.kernels if k.family == "contract"]


@pytest.mark.parametrize("T, K, N, dt", [(1, 576, 1536, "f2"), (1, 1536, 576, "f4"), (16, 576, 1536, "f2"),
                                         (3, 37, 70, "f4"), (2, 9, 1100, "f2")])
def test_a_kn_weight_is_read_along_n_and_matches_float64(T, K, N, dt):
    """Decode GEMVs, a T=16 prefill and ragged shapes (k steps not a multiple of the unroll,
    columns not a multiple of the chunk) give numpy's float64 values, in order k-outer."""
    x = rng.standard_normal((T, K)).astype("f4")
    w = rng.standard_normal((K, N)).astype(dt)
    c = _check(dsl.jit(lambda x, w: x @ w), x, w)
    assert _orders(c) == [("outer",)]
    assert "order: k-outer" in c.fusion_report()


def test_an_nk_weight_keeps_dot_products_along_k():
    x, w = rng.standard_normal((1, 256)).astype("f4"), rng.standard_normal((384, 256)).astype("f2")
    for f in (lambda x, w: x @ w.T, lambda x, w: dsl.dot_t(x, w)):
        c = _check(dsl.jit(f), x, w)
        assert _orders(c) == [("inner",)] and "order: k-inner" in c.fusion_report()


def test_kn_gate_up_with_silu_mul_and_a_mixed_horizontal_kernel():
    """Two (K, N) accumulators under one epilogue (gate, up: SiLU * mul), and a kernel whose
    segments differ: a (K, N) and an (N, K) weight reading the same activation."""
    x, g = rng.standard_normal((1, 192)).astype("f4"), rng.uniform(0.5, 1.5, 192).astype("f4")
    wg, wu = (rng.standard_normal((192, 320)).astype("f2") for _ in range(2))
    wk = rng.standard_normal((96, 192)).astype("f4")

    def block(x, g, wg, wu, wk):
        h = x * dsl.rsqrt(dsl.mean(x * x, -1, keepdims=True) + 1e-5) * g
        a = h @ wg
        return a * dsl.sigmoid(a) * (h @ wu) + 1.0, dsl.dot_t(h, wk)
    c = _check(dsl.jit(block), x, g, wg, wu, wk)
    (k,) = [k for k in c.plan.kernels if k.family == "contract"]
    assert set(contract_orders(k)) == {"inner", "outer"}


def test_interchange_chunks_and_unroll_cover_every_column_and_step(monkeypatch):
    """Small chunks and an unroll that does not divide K: each column's sum is still complete."""
    import codegen.llvm as cl
    monkeypatch.setattr(cl, "COLUMNS", 32)
    monkeypatch.setattr(cl, "ROWS", 3)
    x, w = rng.standard_normal((2, 50)).astype("f4"), rng.standard_normal((50, 77)).astype("f4")
    _check(dsl.jit(lambda x, w: dsl.tanh(x @ w)), x, w)


def test_access_order_reads_strides_from_the_lowered_index():
    k, n, e = L.Sym("k", "i32"), L.Sym("n", "i32"), L.Load("ids", L.c(0), "i32")
    kn = L.Load("w", L.add(L.mul(k, L.c(96)), n), "f16")
    nk = L.Load("w", L.add(L.mul(n, L.c(64)), k), "f16")
    assert (stride(kn.index, k), stride(kn.index, n)) == (96, 1)
    assert access_order([kn], k, n) == "outer" and access_order([nk], k, n) == "inner"
    # a gathered expert: the gathered row is held fixed, only k and n move
    gathered = L.Load("w", L.add(L.mul(L.add(L.mul(L.Bin("max", L.c(0), L.Bin("min", e, L.c(7))), L.c(64)), k),
                                       L.c(96)), n), "f16")
    assert access_order([gathered], k, n) == "outer"
    # a gather that moves with k has no stride
    assert stride(L.Load("w", L.Load("perm", k, "i32"), "f16").index, k) is None


def test_gpu_mapping_gives_a_kn_segment_a_column_per_thread():
    """On GPUs each thread takes an output column (consecutive lanes: consecutive columns, one
    coalesced run of a weight row per step k); the kernel compiles for gfx906."""
    from codegen.hip import render_hip
    x, w = rng.standard_normal((1, 576)).astype("f4"), rng.standard_normal((576, 1536)).astype("f2")
    (k,) = lower_program(dsl.jit(lambda x, w: dsl.exp(x @ w)).lower(x, w)).kernels
    m = map_kernel(k, get_target("gfx906"))
    (col,) = [s for s in L.walk_stmts(m.body) if isinstance(s, L.Loop) and s.parallel]
    (red,) = [s for s in L.walk_stmts(col.body) if isinstance(s, L.Reduce)]
    assert col.map == "thread" and (red.map, red.order) == ("serial", "outer")
    assert m.launch.grid * m.launch.block >= 1536
    src = render_hip(m, "gfx906")
    assert "blockIdx.x * VF_BLOCK + threadIdx.x" in src.body and "vf_wave_sum" not in src.body
    from engine.devices.rocm import HipUnavailable, compile_hip
    try:
        co = compile_hip(src.source, k.name)
    except HipUnavailable as err:                                  # pragma: no cover - depends on the host
        pytest.skip(f"gfx906 compile skipped: {err}")
    assert co.resources()["scratch_bytes"] == 0


@pytest.mark.parametrize("wave", [32, 64])
def test_kn_weight_on_a_cuda_gpu(wave, monkeypatch):
    """The column-per-thread mapping runs on an NVIDIA GPU (at wave 64: gfx906's kernel text),
    a decode GEMV and a T=16 prefill, against float64.  Skipped without a CUDA device."""
    from engine.executable import get_device
    try:
        get_device("cuda", wave=wave)
    except Exception as err:                                       # no driver, no GPU, no cuda-python
        pytest.skip(f"CUDA test skipped: {err}")
    monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
    for T, K, N in ((1, 576, 1536), (16, 576, 1536), (1, 1536, 576)):
        x, w = rng.standard_normal((T, K)).astype("f4"), rng.standard_normal((K, N)).astype("f2")
        # at wave 64 the kernel is gfx906's, whose GEMVs keep the activation in LDS as f16 (v_dot2)
        _check(dsl.jit(lambda x, w: nn.silu(x @ w), backend="cuda"), x, w, rtol=1e-2 if wave == 64 else 1e-4)
