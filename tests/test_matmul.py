"""The matmul family (``fusion.schedule.row_tiles``): contractions of several rows as row tiles,
with the GEMV's prologue and epilogue fusion, on the CPU against the float64 interpreter; the
same kernels compiled for gfx906 and held to its ISA gates.  (On a GPU: ``tests/test_cuda.py``,
the ``test_matmul_*`` tests.)"""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.llvm import is_matmul_columns
from fusion.schedule import MATMUL_ROWS, row_tile
from stdlib import nn
from tests.test_quant_kernels import quantized

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def weight(n, k, dtype):
    """An (n, k) weight of ``dtype`` ("f16", "f32" or a quantized format: a ``dsl.QArray``)."""
    if dtype in ("f16", "f32"):
        return randn(n, k, dtype={"f16": np.float16, "f32": np.float32}[dtype], scale=0.5)
    return quantized((n, k), dtype)


def run(f, *args, donate=()):
    """``f`` on the CPU and in the float64 interpreter (inputs copied first: a donated one is
    overwritten); returns (got, want, compiled)."""
    copy = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    jf = dsl.jit(f, backend="cpu", donate_argnums=donate)
    want = jf.lower(*copy).program.run(*dsl.tree_flatten(list(copy))[0], compute_dtype="f64")
    got = [np.asarray(g, np.float64) for g in dsl.tree_flatten(jf(*args))[0]]
    return got, want, jf.compile(*copy)


def close(got, want, tol=2e-4):
    for g, w in zip(got, want):
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def matmuls(c):
    """The contraction kernels of a compiled function that took the matmul form."""
    return [k for k in c.plan.kernels if k.family == "contract"
            and any(isinstance(s, L.Loop) and is_matmul_columns(s) for s in L.walk_stmts(k.body))]


def gate_up(x, g, wg, wu, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.silu(nn.linear(h, wg)) * nn.linear(h, wu)


def qkv(x, g, wq, wk, wv, bq):
    h = nn.rms_norm(x, g, 1e-5)
    return nn.linear(h, wq, bq), nn.linear(h, wk), nn.linear(h, wv)


@pytest.mark.parametrize("T", [4, 17, 64, 200])
@pytest.mark.parametrize("dtype", ["f16", "f32", "q4_0"])
def test_rmsnorm_gate_up_silu_mul_residual(T, dtype):
    K, N = (96, 37) if dtype != "q4_0" else (128, 37)
    args = (randn(T, K), randn(K), weight(N, K, dtype), weight(N, K, dtype), randn(T, N))
    got, want, c = run(gate_up, *args)
    close(got, want)
    assert len(c.plan.kernels) == 1 and len(matmuls(c)) == 1


@pytest.mark.parametrize("T", [5, 33])
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_1", "gptq_int4"])
def test_qkv_siblings_with_bias(T, dtype):
    K = 64
    args = (randn(T, K), randn(K), weight(48, K, dtype), weight(16, K, dtype), weight(16, K, dtype), randn(48))
    got, want, c = run(qkv, *args)
    close(got, want)
    assert len(matmuls(c)) == 1


def test_in_place_residual_is_added_once():
    """``r = r + x @ w.T`` written into the donated ``r``: the micro-tiles past the last row and
    column (they read the last one again) must not store, or the residual is added twice."""
    T, K, N = 13, 40, 11
    x, w, r = randn(T, K), weight(N, K, "f16"), randn(T, N)
    got, want, c = run(lambda x, w, r: r + nn.linear(x, w), x, w, r, donate=(2,))
    close(got, want)
    assert len(matmuls(c)) == 1


def test_several_row_tiles():
    """More rows than one tile holds (K large enough that a tile is 8 rows): every tile, and the
    last partial one, is computed and stored once."""
    K = 8192
    T = row_tile(10 ** 6, K) * 3 + 3
    assert T > row_tile(T, K)
    args = (randn(T, K, scale=0.1), randn(K), weight(9, K, "f16"), weight(9, K, "f16"), randn(T, 9))
    got, want, c = run(gate_up, *args)
    close(got, want, 5e-4)
    assert len(matmuls(c)) == 1


def test_row_tiles_are_even():
    """Tiles of equal rows (a multiple of 4), as few as fit: T = 128 at K = 1536 is 4 tiles of 32, not
    40 + 40 + 40 + 8 (the last one computing 32 rows past T); no tile computes 4 or more rows past T."""
    assert row_tile(128, 1536) == 32 and row_tile(40, 1536) == 40
    most = row_tile(10 ** 6, 1536)
    for T in np.random.default_rng().integers(most + 1, 2000, 50):
        TR = row_tile(int(T), 1536)
        tiles = -(-int(T) // TR)
        assert TR % 4 == 0 and TR <= most and tiles == -(-int(T) // most) and tiles * TR - T < 4 * tiles


@pytest.mark.parametrize("order", ["1", "0"])
def test_both_micro_tile_orders(order, monkeypatch):
    """Float weights: row groups outside the columns of a chunk (default) or inside
    (``VEGAFUSE_CPU_ROWS_OUTER=0``, the order quantized weights keep), both against float64."""
    monkeypatch.setenv("VEGAFUSE_CPU_ROWS_OUTER", order)
    T, K, N = 70, 96, 150
    args = (randn(T, K), randn(K), weight(N, K, "f16"), weight(N, K, "f16"), randn(T, N))
    got, want, c = run(gate_up, *args)
    close(got, want)
    assert len(matmuls(c)) == 1


def test_few_rows_stay_gemvs():
    T = MATMUL_ROWS - 1
    got, want, c = run(gate_up, randn(T, 32), randn(32), weight(8, 32, "f16"), weight(8, 32, "f16"), randn(T, 8))
    close(got, want)
    assert not matmuls(c) and c.plan.kernels[0].name.startswith("matmul_") is False


def test_switch_off_keeps_the_row_loop(monkeypatch):
    """``VEGAFUSE_MATMUL=0`` (the A/B switch) keeps the GEMV row loop, also for a program whose
    matmul plan is in the plan cache already (the switch is part of its key)."""
    args = (randn(8, 32), randn(32), weight(8, 32, "f16"), weight(8, 32, "f16"), randn(8, 8))
    assert matmuls(run(gate_up, *args)[2])
    monkeypatch.setenv("VEGAFUSE_MATMUL", "0")
    got, want, c = run(gate_up, *args)
    close(got, want)
    assert not matmuls(c)


def test_batched_activation_keeps_the_row_loop():
    """A 3-D activation (batch, rows, K) keeps the GEMV form (one row loop per leading dim)."""
    x, w = randn(2, 6, 16), weight(5, 16, "f32")
    got, want, c = run(lambda x, w: nn.linear(x, w), x, w)
    close(got, want)


# ---------------------------------------------------------------------------------------- gfx906
def gfx906_matmuls(f, *args):
    from codegen.inspect import Inspected
    from codegen.targets import get_target
    c = dsl.jit(f, backend="cpu").compile(*args)
    return [Inspected(k, get_target("gfx906")) for k in matmuls(c)]


@pytest.mark.parametrize("T,K,N", [(17, 576, 1536), (128, 1536, 8960), (64, 8960, 1536)])
def test_gfx906_matmul_isa(T, K, N, monkeypatch):
    """gfx906's gates for the GEMV-style matmul (``VEGAFUSE_MMA=0``; the tiled matmul's are in
    ``tests/test_mma.py``): no scratch, no flat loads, 16-byte weight loads and v_dot2 in the main
    loop, at most one LDS read per weight byte... and at most 9 waves per SIMD."""
    monkeypatch.setenv("VEGAFUSE_MMA", "0")
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 tests skipped: {e}")
    from codegen.inspect import counts, lds_banks, main_loop
    args = (randn(T, K), randn(K), weight(N, K, "f16"), weight(N, K, "f16"), randn(T, N))
    (it,) = gfx906_matmuls(gate_up, *args)
    assert it.res["scratch_bytes"] == 0 and it.res["vgpr_spills"] == 0
    assert 1 <= it.res["waves_per_simd"] <= 9
    isa = it.isa()
    c = counts(main_loop(isa))
    assert c["dwordx4"] >= 1 and c["flat"] == 0 and c["global_other"] == 0, c
    assert "v_dot2_f32_f16" in isa
    assert "a matmul" in it.hip.kernel.launch.how
    assert lds_banks(it) == "ok" and 0 < it.res["lds_bytes"] <= 34 * 1024


@pytest.mark.parametrize("K", [1, 3])
def test_gfx906_matmul_of_short_rows_compiles(K):
    """K = 1 (an outer product: the activation fill has no k loop) and a K below a vector: the
    matmul mapping's fill names every row (an undeclared row index once reached the HIP source);
    values on the CPU against float64."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    x, w = randn(300, K, dtype=np.float16), weight(12, K, "f32")
    got, want, c = run(lambda x, w: nn.linear(x, w) * 2.0, x, w)
    close(got, want)
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 tests skipped: {e}")
    (it,) = gfx906_matmuls(lambda x, w: nn.linear(x, w) * 2.0, x, w)
    assert it.res["scratch_bytes"] == 0 and "a matmul" in it.hip.kernel.launch.how


def test_bench_prefill_prints_our_rate(capsys):
    """``python -m engine.bench --prefill N`` on the CPU: a time and tokens/s for the prompt (the
    Hugging Face peer skipped here)."""
    from engine.bench import main
    assert main(["--prefill", "12", "--repeat", "1", "--no-hf"]) == 0
    out = capsys.readouterr().out
    assert "prefill of a 12-token prompt" in out and "tok/s" in out and "vegafuse cpu" in out


def test_mixed_weight_formats_and_f16_activations():
    """Siblings of different formats (an f16 and a q8_0 weight, one n loop through SiLU * mul) over
    an f16 activation with an f16 result: each rounded as the interpreter rounds it."""
    T, K, N = 9, 64, 24
    x, g = randn(T, K, dtype=np.float16), randn(K)
    got, want, c = run(lambda x, g, a, b: gate_up(x, g, a, b, np.float16(0)), x, g, weight(N, K, "f16"), weight(N, K, "q8_0"))
    close(got, want, 4e-3)
    assert len(matmuls(c)) == 1


def test_gathered_expert_rows():
    """The weight of a T-row matmul gathered by a runtime id (an expert of a MoE), quantized."""
    T, K, N, E = 6, 64, 10, 3
    x, w, eid = randn(T, K), weight(E * N, K, "q4_1"), np.array([1], np.int32)

    def f(x, w, eid):
        rows = dsl.take(w, eid[0] * N + dsl.arange(N))
        return nn.linear(x, rows)
    got, want, c = run(f, x, w, eid)
    close(got, want)
    assert len(matmuls(c)) == 1
