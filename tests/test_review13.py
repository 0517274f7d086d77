"""Adversarial checks of the float GEMV's balanced grid (``codegen.mapping._balanced``), the CPU
matmul's equal row tiles and loop orders (``fusion.schedule.row_tile``, ``codegen.llvm.micro_tiles``)
and the tiled matmul's exclusion of weights an f16 tile does not hold (``codegen.mma._not_f16_values``):
fresh random inputs against the float64 interpreter, GPU kernel text through the CPU emulation."""
import numpy as np
import pytest

import dsl
from codegen import prelude
from codegen.hip import render_hip
from codegen.mapping import map_kernel
from codegen.targets import get_target
from engine.pipeline import lower_program
from fusion.schedule import row_tile
from stdlib import nn
from tests.emulation import GXX, emulated, launch
from tests.test_gemv_gpu import DOT8
from tests.test_matmul import close, matmuls, randn, run, weight
from tests.test_mma import tiled

rng = np.random.default_rng()
needs_gxx = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
DOT4 = """static inline float vf_dot4_f(float acc, const float* w, const vf_act_t* a) {
  for (int i = 0; i < 4; ++i) acc += a[i] * w[i];
  return acc;
}
"""


def qkv_res(x, g, wq, wk, wv, bq, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.linear(h, wq, bq), nn.linear(h, wk), nn.linear(h, wv)


def gate_up_cast(x, g, wg, wu, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.silu(nn.linear(h, wg.astype(dsl.float32))) * nn.linear(h, wu.astype(dsl.float32))


def emulate_against_f64(f, args, target, tmp):
    """``f`` lowered to one kernel, its text for ``target`` run by the CPU emulation, every output
    compared with the float64 interpreter (outputs start as NaN: a row never written fails);
    returns the rendered kernel."""
    low = dsl.jit(f).lower(*args)
    want = low.program.run(*args, compute_dtype="f64")
    plan = lower_program(low)
    (k,) = plan.kernels
    h = render_hip(k, target)
    bufs = {n: np.ascontiguousarray(a).copy() for n, a in zip(plan.inputs, args)}
    for p in k.params:
        if p.name not in bufs:
            bufs[p.name] = np.full(plan.buffers[p.name][0], np.nan, np.float32)
    defines = f"#define VF_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n#define VF_ATT_BLOCK VF_BLOCK\n"
    helpers = prelude._NV_WAVE_SUM + prelude._COMMON.format() + DOT8 + DOT4
    launch(emulated(h, tmp, defines, helpers), h, [bufs[p.name] for p in k.params])
    for o, w in zip(plan.outputs, want):
        got = bufs[plan.aliases.get(o[1], o[1])].reshape(o[2]).astype(np.float64)
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-3 * max(1.0, np.abs(w).max()))
    return h


@needs_gxx
@pytest.mark.parametrize("K,rows,cus,per_cu", [(8192, (20, 9, 5), 8, 4), (8195, (3, 2, 2), 16, 2),
                                               (8200, (45, 7, 6), 6, 4), (8192, (70, 0, 0), 2, 16)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_balanced_qkv_siblings(K, rows, cus, per_cu, dtype, tmp_path_factory):
    """Q/K/V-like siblings of different row counts behind an RMSNorm prologue, with a bias and a
    residual, K not always a multiple of 8, f16 and f32 weights: whatever grid the rule picks (one
    workgroup of ceil(rows / CUs) waves per CU, or the default when that passes 32 waves) writes
    every row once, to the float64 values."""
    t = get_target("sm_90", compute_units=cus, blocks_per_cu=per_cu)
    rows = tuple(n for n in rows if n)
    ws = [(rng.standard_normal((n, K)) * K ** -0.5).astype(dtype) for n in rows]
    ws += [ws[-1]] * (3 - len(ws))
    args = (randn(1, K), randn(K), *ws, randn(rows[0]), randn(1, rows[0]))
    h = emulate_against_f64(qkv_res, args, t, str(tmp_path_factory.mktemp("balanced")))
    total, waves = sum(rows) + (3 - len(rows)) * rows[-1], -(-sum(rows) // cus)
    if -(-total // 8) % cus and -(-total // 8) < cus * per_cu and 32 * -(-total // cus) <= 1024:
        waves = -(-total // cus)
        assert (h.block[0], h.grid[0]) == (32 * waves, -(-total // waves)), h.kernel.launch
    else:
        assert h.block[0] == 256, h.kernel.launch


def test_balance_keeps_other_targets():
    """gfx906 and the wave-64 flavour keep their 256-thread grids where sm_90 balances."""
    x, w = randn(1, 8192), randn(45, 8192, dtype=np.float16)
    (k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(x, w)).kernels
    assert map_kernel(k, get_target("sm_90", compute_units=8, blocks_per_cu=4)).launch.block == 192
    for name in ("gfx906", "sm_90_wave64"):
        launch_ = map_kernel(k, get_target(name, compute_units=8, blocks_per_cu=4)).launch
        assert launch_.block == 256 and "one workgroup per CU" not in launch_.how, (name, launch_)


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_integer_weights_stay_out_of_the_f16_tile(target, tmp_path_factory):
    """i32 weights cast to f32 (magnitudes past f16's 65504) are not f16 values: the tiled matmul
    (f16 tiles) gave inf/NaN; they take the row-group matmul, as f32 weights do, while an f16
    weight cast to f32 in the program keeps the tiled one."""
    T, K, N = 64, 128, 24
    iw = lambda: rng.integers(-100000, 100000, (N, K)).astype(np.int32)  # noqa: E731
    args = (randn(T, K), randn(K), iw(), iw(), randn(T, N))
    (k,) = lower_program(dsl.jit(gate_up_cast).lower(*args)).kernels
    assert tiled(k, target) is None
    if target == "sm_90":
        emulate_against_f64(gate_up_cast, args, target, str(tmp_path_factory.mktemp("iw")))
    f16 = (randn(T, K), randn(K), weight(N, K, "f16"), weight(N, K, "f16"), randn(T, N))
    (k,) = lower_program(dsl.jit(gate_up_cast).lower(*f16)).kernels
    assert tiled(k, target) is not None


def down_res(x, w, r):
    return r + nn.linear(x, w)


def mixed(x, g, wg, wu, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.silu(nn.linear(h, wg)) * nn.linear(h, wu)


@pytest.mark.parametrize("order", ["1", "0"])
def test_cpu_matmul_tile_edges(order, monkeypatch):
    """T at the row-tile edges (most - 1 .. 2 most + 1) over K of several tiles, N around the
    64-column chunk and the micro-tile, float/quantized/mixed siblings, donated in-place residuals
    (a micro-tile past the last row or column must not apply the epilogue twice), both loop orders."""
    monkeypatch.setenv("VEGAFUSE_CPU_ROWS_OUTER", order)
    K = 2720
    most = row_tile(10 ** 6, K)
    for T, N, dts in [(most, 63, ("f16", "f32")), (most + 1, 65, ("f32", "q4_0")),
                      (2 * most - 1, 129, ("q8_0", "f16")), (2 * most + 1, 5, ("f32", "f32"))]:
        got, want, c = run(down_res, randn(T, K), weight(N, K, dts[0]), randn(T, N), donate=(2,))
        close(got, want)
        got, want, c = run(mixed, randn(T, K), randn(K), weight(N, K, dts[0]), weight(N, K, dts[1]),
                           randn(T, N), donate=(4,))
        close(got, want)
        assert len(matmuls(c)) == 1


@needs_gxx
def test_row_group_matmul_equal_tiles(tmp_path_factory):
    """The GPU row-group matmul (f32 weights on sm_90) over equal row tiles that are not a multiple
    of its activation rows per group (T = 81 at K = 1536: 3 tiles of 28 rows, 8 at a time): every
    row and column written once, to the float64 values."""
    T, K, N = 81, 1536, 13
    assert row_tile(T, K) == 28
    args = (randn(T, K), randn(K), weight(N, K, "f32"), weight(N, K, "f32"), randn(T, N))
    h = emulate_against_f64(mixed, args, "sm_90", str(tmp_path_factory.mktemp("rowgroup")))
    assert h.kernel.launch.how.startswith("a matmul"), h.kernel.launch
