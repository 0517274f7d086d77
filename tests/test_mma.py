"""The tiled matmul of the GPU (``codegen/mma.py``): prefill-sized contractions as 64 x 64 tiles
whose 16 x 16 fragments go through the prelude's ``vf_mma_tile``.  The kernel text at wave 32
(sm_90's: mma.sync's fragment layout) and 64 (gfx906's, also the NVIDIA wave-64 flavour), run on
the CPU by an emulation of the GPU's threads (``tests/gpu_emulation.h``), matches the float64
interpreter on fresh random inputs; every kernel compiles for gfx906 and passes the ISA gates.
``tests/test_cuda.py`` runs them on an NVIDIA GPU (``test_mma_*``)."""

import numpy as np
import pytest

import dsl
from codegen import mma, prelude
from codegen.hip import render_hip
from codegen.inspect import Inspected, counts, lds_banks, main_loop
from codegen.mapping import map_kernel
from codegen.targets import get_target
from engine.pipeline import lower_program
from stdlib import nn
from tests.test_quant_kernels import quantized
from tests.emulation import GXX, HIP, emulated, launch

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def weight(n, k, dtype):
    """An (n, k) weight scaled by 1 / sqrt(k) (outputs of order 1): f16, f32 or a quantized format."""
    if dtype in ("f16", "f32"):
        return randn(n, k, dtype={"f16": np.float16, "f32": np.float32}[dtype], scale=k ** -0.5)
    return quantized((n, k), dtype)


def gate_up(x, g, wg, wu, r):
    h = nn.rms_norm(x, g, 1e-5)
    return r + nn.silu(nn.linear(h, wg)) * nn.linear(h, wu)


def qkv_rope(hd, theta):
    def f(x, g, ws, bs, kc, vc, pos):
        t = x.shape[0]
        h = nn.rms_norm(x, g, 1e-6)
        q, k, v = (nn.linear(h, w, b).reshape(t, -1, hd).transpose(1, 0, 2) for w, b in zip(ws, bs))
        kc, vc = nn.kv_write(kc, vc, nn.rope(k, pos, theta), v, pos)
        return nn.rope(q, pos, theta), kc, vc
    return f


def tiled(k, target):
    """The kernel's MatmulTiles statement on ``target``, or None."""
    return next((s for s in map_kernel(k, get_target(target)).body if isinstance(s, mma.MatmulTiles)), None)


def emulate(k, target, arrays, tmp):
    """Run the kernel text of ``k`` rendered for ``target`` on the CPU (``tests/emulation.py``);
    ``arrays``: numpy arrays in the order of the parameters."""
    h = render_hip(k, target)
    defines = f"#define VF_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n#define VF_ATT_BLOCK VF_BLOCK\n"
    helpers = prelude._NV_WAVE_SUM + prelude._COMMON.format() + prelude._DEQUANT + prelude._DEQUANT8F + prelude._DEQUANT8
    launch(emulated(h, tmp, defines, helpers), h, arrays)


def check(f, args, target, tmp, donate=(), tol=2e-2, f32_weights=False):
    """``f`` lowered to one kernel, its text for ``target`` emulated on the CPU and compared with the
    float64 interpreter (at the f16 tolerance: the tile holds the activation and weights as f16).
    ``f32_weights``: the kernel must keep the row-group matmul instead, and is only checked for that."""
    low = dsl.jit(f, donate_argnums=donate).lower(*args)
    flat = dsl.tree_flatten(list(args))[0]
    want = low.program.run(*[a.copy() if isinstance(a, np.ndarray) else a for a in flat], compute_dtype="f64")
    plan = lower_program(low)
    (k,) = [k for k in plan.kernels if k.family == "contract"]
    assert len(plan.kernels) == 1, [x.name for x in plan.kernels]
    how = map_kernel(k, get_target(target)).launch.how
    if f32_weights:                        # the tile holds f16: f32 weights keep their precision elsewhere
        assert tiled(k, target) is None and how.startswith("a matmul"), how
        return k
    assert tiled(k, target) is not None, how
    bufs = {}
    for name, a in zip(plan.inputs, flat):
        bufs[name] = (a.device_bytes() if isinstance(a, dsl.QArray) else
                      np.array([a], np.int32) if isinstance(a, int) else np.ascontiguousarray(a).copy())
    for p in k.params:
        if p.name not in bufs:
            shape, dtype = plan.buffers[p.name]
            bufs[p.name] = np.full(shape, np.nan, {"f32": np.float32, "f16": np.float16}[dtype])
    emulate(k, target, [bufs[p.name] for p in k.params], tmp)
    for o, w in zip(plan.outputs, want):
        got = bufs[plan.aliases.get(o[1], o[1])].reshape(o[2]).astype(np.float64)
        np.testing.assert_allclose(got, w, rtol=0, atol=tol * max(1.0, np.abs(w).max()))
    return k


needs_gxx = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("T,N,dtype", [(64, 64, "f16"), (100, 37, "f16"), (40, 130, "f32"), (70, 64, "q4_1"),
                                       (16, 50, "q4_0"), (20, 64, "gptq_int4"), (30, 20, "q8_0")])
def test_rmsnorm_gate_up_silu_mul_residual(T, N, dtype, target, tmp_path_factory):
    """RMSNorm -> gate/up (two weight tiles) -> SiLU * mul -> residual; T and N whole tiles or
    ragged, f16 / f32 / quantized weights."""
    K = 96 if dtype != "q4_1" else 128
    args = (randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), weight(N, K, dtype), weight(N, K, dtype), randn(T, N))
    check(gate_up, args, target, str(tmp_path_factory.getbasetemp()), f32_weights=dtype == "f32")


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("T,wdtype", [(100, "f16"), (33, "q8_0")])
def test_qkv_bias_rope_pairs_and_kv_write(T, wdtype, target, tmp_path_factory):
    """Q/K/V with bias, RoPE as paired accumulators (rows j and j + hd/2) and k, v written into
    f16 caches at pos: three segments, each its own column tiles."""
    D, hq, hkv, hd, S = 128, 4, 2, 32, 256
    pos = int(rng.integers(0, S - T))
    ws = [weight(n, D, wdtype) for n in (hq * hd, hkv * hd, hkv * hd)]
    bs = [randn(n) for n in (hq * hd, hkv * hd, hkv * hd)]
    args = (randn(T, D), rng.uniform(0.5, 1.5, D).astype(np.float32), ws, bs,
            randn(hkv, S, hd, dtype=np.float16), randn(hkv, S, hd, dtype=np.float16), pos)
    k = check(qkv_rope(hd, 1e4), args, target, str(tmp_path_factory.getbasetemp()), donate=(4, 5))
    m = tiled(k, target)
    assert [len(g.accs) for g in m.segments] == [2, 1, 2]          # k (a RoPE pair), v, q (a RoPE pair)


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_ragged_k_and_a_plain_matmul(target, tmp_path_factory):
    """K not a multiple of the chunk (the last chunk padded with zeros), no prologue reductions."""
    T, K, N = 20, 40, 24
    check(lambda x, w: nn.linear(x, w), (randn(T, K), weight(N, K, "f16")), target, str(tmp_path_factory.getbasetemp()))


def _norm_linear(x, sum, sum8, w):
    """A layer norm before a linear layer whose inputs are named like the prologue's locals."""
    h = x * sum
    h = (h - h.mean(axis=-1, keepdims=True)) / dsl.sqrt(dsl.var(h, axis=-1, keepdims=True) + 0.5)
    return nn.linear(h, w) + sum8


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_prologue_locals_never_shadow_a_buffer(target, tmp_path_factory):
    """The prologue's reductions (a mean's ``sum``, their 8-element copies ``{buf}8``) take names
    clear of the kernel's buffers: a local ``sum`` once hid the input ``sum`` its loop read."""
    T, K, N = 40, 64, 48
    args = (randn(T, K), randn(K), randn(T, N), weight(N, K, "f16"))
    check(_norm_linear, args, target, str(tmp_path_factory.getbasetemp()))


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_buffers_named_like_the_templates_locals(target, tmp_path_factory):
    """Inputs named like the template's own locals (a weight ``k``, an activation ``row``, a
    residual ``col``) or like another input's register copy (``e`` beside ``e8``) are renamed in
    the kernel text: the locals hid them and the text did not compile."""
    T, K, N = 40, 64, 48

    def f(row, k, col, e, e8):
        return nn.linear(row * e, k) + col + e8
    check(f, (randn(T, K), weight(N, K, "f16"), randn(T, N), randn(K), randn(T, N)), target,
          str(tmp_path_factory.getbasetemp()))


def test_rule_and_switch(monkeypatch):
    """Fewer than MMA_ROWS rows keep the GEMV-style matmul, and VEGAFUSE_MMA=0 turns it off; the
    text is one for gfx906 and the NVIDIA wave-64 flavour."""
    K, N = 64, 64
    def kernel(T):
        low = dsl.jit(gate_up).lower(randn(T, K), randn(K), weight(N, K, "f16"), weight(N, K, "f16"), randn(T, N))
        return lower_program(low).kernels[0]
    assert tiled(kernel(mma.MMA_ROWS - 1), "sm_90") is None
    k = kernel(mma.MMA_ROWS)
    assert tiled(k, "sm_90") is not None
    assert render_hip(k, "gfx906").body == render_hip(k, "sm_90_wave64").body
    assert "#if" not in render_hip(k, "gfx906").body
    monkeypatch.setenv("VEGAFUSE_MMA", "0")
    assert tiled(k, "sm_90") is None and "a matmul" in map_kernel(k, get_target("sm_90")).launch.how




@pytest.mark.skipif(bool(HIP), reason=f"gfx906 compile skipped: {HIP}")
@pytest.mark.parametrize("wdtype", ["f16", "q4_0"])
def test_gfx906_isa_gates(wdtype):
    """Qwen2.5-1.5B's gate/up at T = 128: no scratch, 16-byte global loads of f16/f32 weights,
    v_dot2 in the main loop, at most 9 waves per SIMD, LDS reads free of bank conflicts."""
    T, K, N = 128, 1536, 256
    low = dsl.jit(gate_up).lower(randn(T, K), randn(K), weight(N, K, wdtype), weight(N, K, wdtype), randn(T, N))
    (k,) = lower_program(low).kernels
    it = Inspected(k, get_target("gfx906"))
    r, isa = it.res, it.isa()
    assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0 and "flat_load" not in isa, r
    assert "v_dot2_f32_f16" in isa
    assert 1 <= r["waves_per_simd"] <= 9, r
    if wdtype != "q4_0":                             # the activation's and the weights' rows: 16-byte loads only
        c = counts(main_loop(isa))
        assert c["dwordx4"] >= 2 and c["global_other"] == 0, c
    assert lds_banks(it) == "ok"


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_gathered_rows_and_an_expert_weight(target, tmp_path_factory):
    """A MoE-style matmul: the activation's rows gathered by token ids, the weight rows of one expert
    chosen by a runtime id (quantized), SiLU in the epilogue."""
    T, K, N, E = 24, 64, 40, 3
    x, ids = randn(50, K), rng.integers(0, 50, T).astype(np.int32)
    w, eid = weight(E * N, K, "q4_1"), np.array([2], np.int32)

    def f(x, ids, w, eid):
        rows = dsl.take(w, eid[0] * N + dsl.arange(N))
        return nn.silu(nn.linear(dsl.take(x, ids, axis=0), rows))
    k = check(f, (x, ids, w, eid), target, str(tmp_path_factory.getbasetemp()))
    assert tiled(k, target).siblings == 1


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("env", [{"VEGAFUSE_MMA_DOUBLE": "0"}, {"VEGAFUSE_MMA_DOUBLE": "0", "VEGAFUSE_MMA_PREFETCH": "0"}],
                         ids=["one_buffer", "no_prefetch"])
def test_pipeline_switches(env, target, monkeypatch, tmp_path_factory):
    """The A/B forms of the main loop (one LDS buffer with the next chunk in registers; no prefetch)
    compute the same values."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    T, K, N = 70, 96, 40
    args = (randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), weight(N, K, "f16"), weight(N, K, "q8_0"), randn(T, N))
    k = check(gate_up, args, target, str(tmp_path_factory.getbasetemp()))
    assert tiled(k, target).buffers == 1


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_random_shapes(target, tmp_path_factory):
    """Fresh random T, K, N and weight formats (ragged tiles and chunks among them) through the
    gate/up kernel."""
    for _ in range(2):
        dtype = str(rng.choice(["f16", "f32", "q4_0", "q8_0"]))
        T, N = int(rng.integers(mma.MMA_ROWS, 150)), int(rng.integers(1, 150))
        K = 32 * int(rng.integers(1, 6)) if dtype.startswith("q") else int(rng.integers(mma.KC, 200))
        args = (randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), weight(N, K, dtype), weight(N, K, dtype), randn(T, N))
        check(gate_up, args, target, str(tmp_path_factory.getbasetemp()), f32_weights=dtype == "f32")


@pytest.mark.skipif(bool(HIP), reason=f"gfx906 compile skipped: {HIP}")
@pytest.mark.parametrize("wdtype", ["f16", "q8_0"])
def test_gfx906_isa_gates_of_the_qkv_kernel(wdtype):
    """Qwen2.5-1.5B's Q/K/V with bias, RoPE pairs and the KV write at T = 512: no scratch, v_dot2,
    at most 9 waves per SIMD, 16-byte loads of the f16 rows, LDS reads free of bank conflicts."""
    D, hq, hkv, hd, S, T = 1536, 12, 2, 128, 1024, 512
    ws = [weight(n, D, wdtype) for n in (hq * hd, hkv * hd, hkv * hd)]
    bs = [randn(n) for n in (hq * hd, hkv * hd, hkv * hd)]
    args = (randn(T, D), randn(D), ws, bs, randn(hkv, S, hd, dtype=np.float16), randn(hkv, S, hd, dtype=np.float16), 0)
    (k,) = lower_program(dsl.jit(qkv_rope(hd, 1e6), donate_argnums=(4, 5)).lower(*args)).kernels
    it = Inspected(k, get_target("gfx906"))
    r, isa = it.res, it.isa()
    assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0 and "flat_load" not in isa, r
    assert "v_dot2_f32_f16" in isa and 1 <= r["waves_per_simd"] <= 9, r
    assert lds_banks(it) == "ok" and [len(g.accs) for g in tiled(k, "gfx906").segments] == [2, 1, 2]
    if wdtype == "f16":
        c = counts(main_loop(isa))
        assert c["dwordx4"] >= 2 and c["global_other"] == 0, c
