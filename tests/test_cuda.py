"""The generated HIP source (NVIDIA flavour) run on a CUDA GPU through NVRTC: every kernel family
against the float64 reference at sizes that fill the chip, and SmolLM2's greedy ids.

Every test runs twice: at wave 32 (the warp) and at wave 64, where each 64-lane wave of gfx906's
kernel text is emulated by two warps (``VEGAFUSE_CUDA_WAVE=64``, target ``sm_90_wave64``); at wave 64
every compiled kernel's text is checked to be the gfx906 kernel's, so what runs here is what gfx906
compiles.  Skipped where no CUDA device is present (CI)."""
import re

import numpy as np
import pytest

try:
    from engine.executable import get_device
    DEV = get_device("cuda", wave=32)
except Exception as e:                                   # no driver, no GPU, no cuda-python
    pytest.skip(f"CUDA tests skipped: {e}", allow_module_level=True)

import dsl  # noqa: E402
from codegen.hip import render_hip  # noqa: E402
from codegen.mma import MMA_ROWS  # noqa: E402
from codegen.prelude import act_dtype, prelude  # noqa: E402
from codegen.targets import get_target  # noqa: E402
from stdlib import nn  # noqa: E402
from tests.test_kernels import reference_attention  # noqa: E402

rng = np.random.default_rng()


@pytest.fixture(autouse=True, params=[32, 64], ids=["wave32", "wave64"])
def wave(request, monkeypatch):
    """Every test at both wave widths: ``dsl.jit(..., backend="cuda")`` compiles for the device that
    ``VEGAFUSE_CUDA_WAVE`` selects."""
    monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(request.param))
    dev = get_device("cuda")
    assert dev.target.wave == request.param and dev.target.emulated_wave == (request.param == 64)
    return request.param


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def gfx906_text(ck) -> bool:
    """Is the kernel text that ran gfx906's, up to where its LDS arrays are declared (beyond the
    48 KiB a kernel declares on NVIDIA, the largest are taken from dynamic LDS)?"""
    def text(body):
        return [line for line in body.splitlines() if not re.match(r"\s*(__shared__ |VF_DYNAMIC_LDS\(|\S+\* const \w+ = \(\S+\*\)\(vf_lds|// past the \d+ bytes of LDS)", line)]
    return text(ck.hip.body) == text(render_hip(ck.kernel, "gfx906").body)


def check(f, *args, rtol=1e-3, atol=1e-3, donate=(), gemv_k=None):
    """``f`` on the GPU against the float64 interpreter.  ``gemv_k``: the GEMV's K; where the target
    keeps the activation in LDS as f16 (gfx906's v_dot2_f32_f16, so the emulated wave 64 too; any
    kernel whose launch says so), each product carries a relative error up to 2^-11, and the
    tolerance widens to 1e-2."""
    jf = dsl.jit(f, backend="cuda", donate_argnums=donate)
    low = jf.lower(*args)
    want = low.program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = [np.asarray(g) for g in dsl.tree_flatten(jf(*args))[0]]
    c = jf.compile(*args)
    tiled = any(ck.hip.kernel.launch.how.startswith("a tiled matmul") for ck in c.kernels)
    half = any(ck.hip.kernel.launch.act == "f16" for ck in c.kernels)
    if tiled or half or gemv_k and act_dtype(get_target(c.device.target.maps_like or "sm_90"), gemv_k) == "f16":
        rtol, atol = max(rtol, 1e-2), max(atol, 1e-2)     # the tiled matmul holds activation and weights as f16
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=rtol, atol=atol)
    if c.device.target.emulated_wave:                    # what ran is gfx906's kernel text
        for ck in c.kernels:
            assert gfx906_text(ck), ck.kernel.name
    return c


def test_wave_helpers_exchange_the_right_lanes(wave):
    """The prelude's wave helpers alone, one workgroup: vf_shfl_xor for every mask (at wave 64 the
    masks >= 32 cross between the two warps of a wave), the wave and block reductions, the argmax
    with a tie (the smaller index wins) and vf_wave_sync's LDS ordering."""
    dev = get_device("cuda")
    t = dev.target
    B, W = t.block, t.wave
    body = r"""
extern "C" __global__ void __launch_bounds__(VF_BLOCK) vf_probe(const float* __restrict__ x, float* __restrict__ out) {
  __shared__ float vf_red[VF_WAVES];
  __shared__ int vf_redi[VF_WAVES];
  __shared__ float vf_buf[VF_BLOCK];
  const int t = threadIdx.x, lane = t % VF_WAVE;
  const float v = x[t];
  out[t] = (float)vf_shfl_xor_i(t, VF_WAVE - 1);
  for (int m = 1; m < VF_WAVE; ++m) out[m * VF_BLOCK + t] = vf_shfl_xor(v, m);
  out[VF_WAVE * VF_BLOCK + t] = vf_wave_sum(v);
  out[(VF_WAVE + 1) * VF_BLOCK + t] = vf_wave_max(v);
  out[(VF_WAVE + 2) * VF_BLOCK + t] = vf_block_sum(v, vf_red);
  out[(VF_WAVE + 3) * VF_BLOCK + t] = vf_block_max(v, vf_red);
  float bv = v;
  int bi = t;
  vf_block_argmax(&bv, &bi, vf_red, vf_redi);
  out[(VF_WAVE + 4) * VF_BLOCK + t] = (float)bi;
  for (int r = 0; r < 8; ++r) {               // a lane reads what the next lane of its wave wrote
    vf_buf[t] = v + r;
    vf_wave_sync();
    out[(VF_WAVE + 5 + r) * VF_BLOCK + t] = vf_buf[t - lane + (lane + 1) % VF_WAVE];
    vf_wave_sync();
  }
}
"""
    cubin = dev._nvrtc_compile(prelude(t) + body, "vf_probe")
    drv = dev.drv
    module = drv.cuModuleLoadData(cubin)[1]
    fn = drv.cuModuleGetFunction(module, b"vf_probe")[1]
    x = rng.standard_normal(B).astype(np.float32)
    x[B - 3] = x[5] = x.max() + 1.0                      # a tie: index 5 wins
    dx, dout = dev.put(x), dev.empty((W + 13, B), "f32")
    vals = [np.array([dx.ptr], np.uint64), np.array([dout.ptr], np.uint64)]
    args = np.array([v.ctypes.data for v in vals], np.uint64)
    assert int(drv.cuLaunchKernel(fn, 1, 1, 1, B, 1, 1, 0, dev.stream, args.ctypes.data, 0)[0]) == 0
    out = dev.to_host(dout)
    tid = np.arange(B)
    np.testing.assert_array_equal(out[0], tid ^ (W - 1))
    for m in range(1, W):
        np.testing.assert_array_equal(out[m], x[tid ^ m], err_msg=f"vf_shfl_xor(v, {m})")
    waves = x.reshape(-1, W).astype(np.float64)
    np.testing.assert_allclose(out[W], np.repeat(waves.sum(1), W), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[W + 1], np.repeat(x.reshape(-1, W).max(1), W))
    np.testing.assert_allclose(out[W + 2], x.astype(np.float64).sum(), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out[W + 3], x.max())
    np.testing.assert_array_equal(out[W + 4], 5)
    for r in range(8):
        np.testing.assert_array_equal(out[W + 5 + r], x[tid - tid % W + (tid % W + 1) % W] + np.float32(r))


def test_elementwise_large():
    check(lambda x, y: dsl.tanh(x * y + 1.0) - dsl.sigmoid(y) * dsl.exp(x * 0.1), randn(4096, 2048), randn(2048))


def test_max_min_propagate_nan_like_numpy():
    x, y = randn(300, 257), randn(300, 257)
    x[3, 5], y[7, 11], x[9] = np.nan, np.nan, np.nan
    check(lambda x, y: dsl.maximum(x, y) - dsl.minimum(y, x) + dsl.max(x, -1, keepdims=True), x, y)


def test_rmsnorm_and_softmax_rows():
    x = randn(2048, 4096)
    x[7] = -np.inf
    check(lambda x, w: nn.rms_norm(x, w, 1e-5), randn(2048, 4096), randn(4096))
    out = check(lambda x: nn.softmax(x), x)
    assert out is not None


@pytest.mark.parametrize("n,k", [(18944, 3584), (4096, 8960), (1536, 8960), (151936, 1536), (512, 27648)])
def test_gemv_with_prologue_and_epilogue(n, k):
    x, g, w, r = randn(1, k), randn(k), randn(n, k, dtype=np.float16, scale=0.05), randn(1, n)
    check(lambda x, g, w, r: r + nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w)), x, g, w, r, rtol=2e-3, atol=2e-3,
          gemv_k=k)


def test_qkv_siblings_with_bias_split_over_waves():
    x, g = randn(1, 3584), randn(3584)
    ws = [randn(n, 3584, dtype=np.float16, scale=0.05) for n in (1024, 256, 256)]
    bs = [randn(n) for n in (1024, 256, 256)]

    def qkv(x, g, ws, bs):
        h = nn.rms_norm(x, g, 1e-5)
        return [nn.linear(h, w, b) for w, b in zip(ws, bs)]
    c = check(qkv, x, g, ws, bs, rtol=2e-3, atol=2e-3, gemv_k=3584)
    assert [k.family for k in c.plan.kernels] == ["contract"]


def test_gate_up_siblings_and_matmul_rows():
    x, wg, wu = randn(8, 1536), randn(8960, 1536, dtype=np.float16, scale=0.05), randn(8960, 1536, dtype=np.float16, scale=0.05)
    check(lambda x, a, b: nn.silu(nn.linear(x, a)) * nn.linear(x, b), x, wg, wu, rtol=2e-3, atol=2e-3, gemv_k=1536)


@pytest.mark.parametrize("hq,hkv,t,pos,S", [(28, 4, 1, 3000, 4096), (12, 2, 16, 100, 512)])
def test_kv_write_and_attention(hq, hkv, t, pos, S):
    D = 128
    q, k, v = randn(hq, t, D), randn(hkv, t, D), randn(hkv, t, D)
    kc, vc = randn(hkv, S, D), randn(hkv, S, D)

    def f(q, k, v, kc, vc, pos):
        out, kc, vc = nn.causal_attention(q, kc, vc, k, v, pos)
        return out, kc, vc
    check(f, q, k, v, kc, vc, pos, rtol=2e-3, atol=2e-3)
    kc[:, pos:pos + t], vc[:, pos:pos + t] = k, v
    out = np.asarray(dsl.jit(f, backend="cuda")(q, k, v, kc, vc, pos)[0])
    np.testing.assert_allclose(out, reference_attention(q, kc, vc, pos), rtol=2e-3, atol=2e-3)


def test_gather_argmax():
    table, ids = randn(50000, 256), rng.integers(0, 50000, 64).astype(np.int32)
    check(lambda t, i: dsl.take(t, i) * 2.0, table, ids)
    x = randn(151936)
    assert int(np.asarray(dsl.jit(lambda x: dsl.argmax(x), backend="cuda")(x))) == int(np.argmax(x))


def test_smollm2_greedy_ids_match_the_reference():
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS, greedy
    ids, out, m = greedy(*load_model(default_model_path()), backend="cuda")
    assert ids == PROMPT_IDS and out == REFERENCE_IDS
    m.reset()                                   # the device-side loop: argmax and feedback on the GPU
    m.prefill(ids)
    assert [REFERENCE_IDS[0]] + m.decode_greedy(REFERENCE_IDS[0], 19) == REFERENCE_IDS


@pytest.mark.parametrize("sa,sb", [((4, 8), (8, 1)), ((3, 1), (1, 4)), ((1, 1), (1, 1)), ((1, 16), (16, 1))])
def test_matmul_with_unit_dims(sa, sb):
    check(lambda a, b: a @ b + 1.0, randn(*sa), randn(*sb))


def test_argmax_picks_the_first_nan_like_numpy():
    x = randn(64, 3001)
    x[1, 5], x[2, 0], x[3, 3000], x[3, 7], x[4] = np.nan, np.nan, np.nan, np.nan, np.nan
    got = np.asarray(dsl.jit(lambda x: dsl.argmax(x, -1), backend="cuda")(x))
    np.testing.assert_array_equal(got, np.argmax(x, -1))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (96, 576), (64, 1536), (1536, 576), (256, 8960), (256, 27648)])
def test_quantized_gemv_with_int8_dot_products(fmt, n, k):
    """RMSNorm -> GEMV with quantized weights -> residual: the activation is quantized to q8_1 in LDS
    and each lane folds whole weight blocks with dp4a.  Against the same arithmetic in float64
    (activation through q8_1, weights exact; only f32 rounding differs), and against the float64
    interpreter within the activation's quantization error."""
    from tests.test_quant_kernels import q8_1_gemv, quantized
    x, g = randn(1, k), rng.uniform(0.5, 1.5, k).astype(np.float32)
    res, w = randn(1, n), quantized((n, k), fmt)

    def f(x, g, w, res):
        return res + dsl.dot_t(nn.rms_norm(x, g, 1e-5), w)
    jf = dsl.jit(f, backend="cuda")
    got = np.asarray(jf(x, g, w, res), np.float64)
    h = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * g
    scale = np.abs(h) @ np.abs(w.dequantize().astype(np.float64)).T       # what each output sums
    want = res + q8_1_gemv(h.astype(np.float32), w)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale.max() + 1e-6)
    exact = jf.lower(x, g, w, res).program.run(x, g, w, res, compute_dtype="f64")[0]
    assert np.all(np.abs(got - exact) <= 2e-2 * scale + 1e-6)            # q8_1: 1/254 of each block's max
    c = jf.compile(x, g, w, res)
    (kern,) = [ck for ck in c.kernels if ck.kernel.family == "contract"]
    assert "vf_quantize_q8_1" in kern.hip.body and f"vf_dot_{fmt}" in kern.hip.body
    if c.device.target.emulated_wave:
        assert gfx906_text(kern)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quantized_mlp_and_embedding_on_the_gpu(fmt):
    """gate/up siblings with SiLU*mul in one kernel, down projection, and a quantized embedding gather."""
    from tests.test_quant_kernels import quantized
    D, F = 576, 1536
    x, g = randn(1, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    wg, wu, wd, emb = (quantized(s, fmt) for s in ((F, D), (F, D), (D, F), (300, D)))
    ids = rng.integers(0, 300, 3).astype(np.int32)

    def mlp(x, g, w_gate, w_up, w_down, emb, ids):
        h = nn.rms_norm(x, g, 1e-5)
        return x + nn.linear(nn.silu(nn.linear(h, w_gate)) * nn.linear(h, w_up), w_down), dsl.take(emb, ids)
    jf = dsl.jit(mlp, backend="cuda")
    out, rows = jf(x, g, wg, wu, wd, emb, ids)
    np.testing.assert_array_equal(np.asarray(rows), emb.dequantize()[ids])
    want = jf.lower(x, g, wg, wu, wd, emb, ids).program.run(x, g, wg, wu, wd, emb, ids, compute_dtype="f64")[0]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=3e-2 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["q4_0", "gptq_int4"])
@pytest.mark.parametrize("D,F", [(3584, 18944), (1536, 8960), (576, 1568)])
def test_the_down_projection_reads_the_q8_1_blocks_the_gate_up_kernel_wrote(fmt, D, F, monkeypatch):
    """fusion/q8.py: the gate/up kernel also writes SiLU * up as q8_1 blocks (each quantized by the
    workgroup that stores it whole, or else by the one that completes it) and the down projection
    copies them instead of quantizing: the same result bit for bit over several launches (the arrival
    counts set back to zero), and the float64 interpreter's within the activation's quantization
    error, as every workgroup's own fill (VEGAFUSE_Q8_PRODUCER=0).  The two differ in the last bits
    where the producer's workgroups are larger (``codegen.mapping._whole_trips``: its RMSNorm sums in
    another order); where they are not, they agree bit for bit."""
    from tests.test_quant_kernels import quantized
    x, g = randn(1, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    wg, wu, wd = (quantized(s, fmt, 0.05) for s in ((F, D), (F, D), (D, F)))

    def mlp(x, g, w_gate, w_up, w_down):
        h = nn.rms_norm(x, g, 1e-5)
        return x + nn.linear(nn.silu(nn.linear(h, w_gate)) * nn.linear(h, w_up), w_down)
    outs, blocks = {}, {}
    for on in ("1", "0"):
        monkeypatch.setenv("VEGAFUSE_Q8_PRODUCER", on)
        jf = dsl.jit(mlp, backend="cuda")
        c = jf.compile(x, g, wg, wu, wd)
        up, down = [ck.hip.body for ck in c.kernels if ck.kernel.family == "contract"]
        assert (("vf_quantize_staged(" in up or "vf_quantize_stored(" in up) and "vf_copy_q8_1(" in down) == (on == "1")
        runs = [np.asarray(jf(x, g, wg, wu, wd), np.float64) for _ in range(3)]
        for r in runs[1:]:
            np.testing.assert_array_equal(r, runs[0])
        outs[on] = runs[0]
        blocks[on] = next(ck.hip.kernel.launch.block for ck in c.kernels if ck.kernel.family == "contract")
    if blocks["1"] == blocks["0"]:
        np.testing.assert_array_equal(outs["1"], outs["0"])
    want = jf.lower(x, g, wg, wu, wd).program.run(x, g, wg, wu, wd, compute_dtype="f64")[0]
    for on in ("1", "0"):
        np.testing.assert_allclose(outs[on], want, rtol=0, atol=2e-2 * np.abs(want - x).max())


@pytest.mark.parametrize("D,N", [(1536, 8960), (3584, 512), (576, 1536)])
def test_a_normalizing_consumer_reads_the_blocks_its_producer_quantized(D, N, monkeypatch):
    """fusion/q8.py: ``y = x + x W1^T``, then ``RMSNorm(y, g) W2^T``: the producer also writes the q8_1
    blocks of ``y * g`` and each block's sum of ``y * y``, and the consumer copies them: the same result
    over several launches, and the float64 interpreter's within the activation's quantization error, as
    the consumer's own one-pass prologue (``VEGAFUSE_NORM_AT_PRODUCER=0``)."""
    from tests.test_quant_kernels import quantized
    x, g = randn(1, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    w1, w2 = quantized((D, D), "q4_0", 0.05), quantized((N, D), "q4_0", 0.05)

    def f(x, g, w1, w2):
        return nn.linear(nn.rms_norm(x + nn.linear(x, w1), g, 1e-6), w2)
    want = dsl.jit(f).lower(x, g, w1, w2).program.run(x, g, w1, w2, compute_dtype="f64")[0]
    for on in ("1", "0"):
        monkeypatch.setenv("VEGAFUSE_NORM_AT_PRODUCER", on)
        jf = dsl.jit(f, backend="cuda")
        up, down = [ck.hip.body for ck in jf.compile(x, g, w1, w2).kernels if ck.kernel.family == "contract"]
        # on: where the producer quantizes whole blocks itself (fusion.q8._whole; Qwen2.5-1.5B's O projection at wave 32)
        assert ("_ss[" in down) <= (on == "1") and ("_ss[" in down) == ("vf_copy_q8_1(" in down), down
        runs = [np.asarray(jf(x, g, w1, w2), np.float64) for _ in range(3)]
        for r in runs[1:]:
            np.testing.assert_array_equal(r, runs[0])
        np.testing.assert_allclose(runs[0], want, rtol=0, atol=1e-2 * np.abs(want).max())


def test_a_kernel_storing_two_int8_activations_quantizes_both(monkeypatch):
    """fusion/q8.py: one GEMV kernel stores a and b (two segments), each read by an int8 GEMV; both
    buffers' q8_1 blocks are quantized in that kernel (``tests/test_review12.py``): bit for bit
    the results of VEGAFUSE_Q8_PRODUCER=0 over several launches, and the float64 interpreter's within the
    activation's quantization error."""
    from tests.test_quant_kernels import quantized
    x = randn(1, 3584)
    ws = (quantized((1536, 3584), "q4_0", 0.05), quantized((3584, 3584), "q4_0", 0.05),
          quantized((512, 1536), "q4_0", 0.05), quantized((256, 3584), "q4_0", 0.05))

    def f(x, w1, w2, w3, w4):
        return nn.linear(nn.linear(x, w1), w3), nn.linear(nn.linear(x, w2), w4)
    outs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("VEGAFUSE_Q8_PRODUCER", on)
        jf = dsl.jit(f, backend="cuda")
        body = next(ck.hip.body for ck in jf.compile(x, *ws).kernels if ck.kernel.family == "contract")
        assert body.count("vf_quantize_staged(") + body.count("vf_quantize_stored(") == (2 if on == "1" else 0)
        runs = [[np.asarray(o, np.float64) for o in jf(x, *ws)] for _ in range(3)]
        for r in runs[1:]:
            for a, b in zip(r, runs[0]):
                np.testing.assert_array_equal(a, b)
        outs[on] = runs[0]
    want = jf.lower(x, *ws).program.run(x, *ws, compute_dtype="f64")
    for a, b, w in zip(outs["1"], outs["0"], want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, w, rtol=0, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_quantized_qkv_segments_with_bias(fmt):
    """Q, K and V as three segments of one kernel (the wave loop's tiles split between them), with
    the bias epilogue: against the q8_1 arithmetic in float64."""
    from tests.test_quant_kernels import q8_1_gemv, quantized
    D = 1536
    x, g = randn(1, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    ws = [quantized((n, D), fmt) for n in (1536, 256, 256)]
    bs = [randn(n) for n in (1536, 256, 256)]

    def qkv(x, g, wq, wk, wv, bq, bk, bv):
        h = nn.rms_norm(x, g, 1e-5)
        return nn.linear(h, wq, bq), nn.linear(h, wk, bk), nn.linear(h, wv, bv)
    got = dsl.jit(qkv, backend="cuda")(x, g, *ws, *bs)
    h = (x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * g).astype(np.float32)
    for out, w, b in zip(got, ws, bs):
        scale = (np.abs(h.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T).max()
        np.testing.assert_allclose(np.asarray(out, np.float64), q8_1_gemv(h, w) + b, rtol=0, atol=1e-5 * scale + 1e-6)


def test_the_examples_of_issue_9():
    """examples/ (GPT-2 block, Qwen3 attention, MoE, DeltaNet, perplexity) on the GPU against numpy in
    float64, as tests/test_examples.py does on the CPU."""
    from tests.test_examples import run_examples
    gfx906 = get_device("cuda").target.maps_like == "gfx906"          # f16 activations in LDS (v_dot2)
    run_examples("cuda", rtol=1e-2 if gfx906 else 2e-4)


def test_f16_elementwise_with_literals():
    """f16 arithmetic whose C spells half and float operands together (a literal, a libm call)."""
    x = randn(3, 40, dtype=np.float16)
    check(lambda x: dsl.exp(x) + 1.0, x, rtol=1e-2, atol=1e-2)
    check(lambda x: dsl.nn.gelu(x) * 0.5 - dsl.sqrt(dsl.abs(x)), x, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", ["qwen2", "smollm2"])
@pytest.mark.parametrize("wdtype", ["f16", "q8_0", "q4_1"])
@pytest.mark.parametrize("t,cache", [(1, "f2"), (1, "f4"), (16, "f4")])
def test_qkv_gemv_with_rope_and_kv_write_in_its_epilogue(shape, wdtype, t, cache):
    """The paired_epilogue rule: RMSNorm -> Q/K/V GEMVs whose epilogue rotates q and k (RoPE's
    rotate-half pairs rows j and j + hd/2 as sibling accumulators) and writes k and v into the caches
    at pos, in place: one kernel, on the float and the int8 (dp4a) GEMV paths, against the float64
    interpreter (Qwen2.5-1.5B's heads with bias and GQA 12/2; SmolLM2's 9/3 without)."""
    from tests.test_quant_kernels import quantized
    D, hq, hkv, hd, bias, theta = (1536, 12, 2, 128, True, 1e6) if shape == "qwen2" else (576, 9, 3, 64, False, 1e4)
    S, pos = 4096, int(rng.integers(0, 4096 - t))
    x, g = randn(t, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    ws = [quantized((n, D), wdtype) if wdtype != "f16" else randn(n, D, dtype=np.float16, scale=D ** -0.5)
          for n in (hq * hd, hkv * hd, hkv * hd)]
    bs = [randn(n) for n in (hq * hd, hkv * hd, hkv * hd)] if bias else [None] * 3
    kc, vc = randn(hkv, S, hd, dtype=cache), randn(hkv, S, hd, dtype=cache)

    def qkv_rope(x, g, ws, bs, kc, vc, pos):
        h = nn.rms_norm(x, g, 1e-6)
        q, k, v = (nn.linear(h, w, b).reshape(t, -1, hd).transpose(1, 0, 2) for w, b in zip(ws, bs))
        kc, vc = nn.kv_write(kc, vc, nn.rope(k, pos, theta), v, pos)
        return nn.rope(q, pos, theta), kc, vc
    args = (x, g, ws, bs, kc, vc, pos)
    jf = dsl.jit(qkv_rope, backend="cuda", donate_argnums=(4, 5))
    low = jf.lower(*args)
    want = low.program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = [np.asarray(a, np.float64) for a in dsl.tree_flatten(jf(x, g, ws, bs, kc.copy(), vc.copy(), pos))[0]]
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=0, atol=3e-2 * np.abs(w[..., pos:pos + t, :] if w.shape[1] == S
                                                                        else w).max())
    c = jf.compile(*args)
    (kern,) = c.kernels
    from codegen import loopir as L
    segs = [s for s in L.walk_stmts(kern.kernel.body) if isinstance(s, L.Loop) and s.parallel]
    accs = sorted(len(next(r for r in L.walk_stmts(s.body) if isinstance(r, L.Reduce)).accs) for s in segs)
    # q and k paired (two accumulators), v alone; for t > 1 the reduction sits in the matmul's row loop
    assert kern.kernel.name.endswith("rope_kv_write") and accs == [1, 2, 2], accs
    if t == 1:                                       # the GEMV's int8 path (the matmul dequantizes)
        assert ("vf_quantize_q8_1" in kern.hip.body) == (wdtype != "f16")
    if c.device.target.emulated_wave:
        assert gfx906_text(kern)


# ------------------------------------------------------------------------------ the matmul family
def matmul_weight(n, k, dtype):
    """An (n, k) weight of ``dtype`` scaled by 1 / sqrt(k) (outputs of order 1, so that f16
    activations in LDS stay within the tolerance), or quantized."""
    from tests.test_quant_kernels import quantized
    if dtype in ("f16", "f32"):
        return randn(n, k, dtype={"f16": np.float16, "f32": np.float32}[dtype], scale=k ** -0.5)
    return quantized((n, k), dtype, scale=k ** -0.5)


@pytest.mark.parametrize("T", [2, 17, 64, 200])
@pytest.mark.parametrize("dtype,K,N", [("f16", 576, 1536), ("f16", 1536, 37), ("f16", 99, 37), ("f32", 200, 37),
                                         ("q4_0", 576, 96)])
def test_matmul_rmsnorm_gate_up_silu_mul_residual(T, dtype, K, N):
    """A T-row RMSNorm -> gate/up -> SiLU * mul -> residual kernel (T >= 4: the matmul family, G
    activation rows in LDS per weight load; T = 2: GEMVs; the tiled matmul from MMA_ROWS rows, but not
    for f32 weights, which its f16 tiles would round) against the float64 interpreter."""
    from tests.test_matmul import gate_up
    x, g, r = randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), randn(T, N)
    c = check(gate_up, x, g, matmul_weight(N, K, dtype), matmul_weight(N, K, dtype), r, gemv_k=K)
    assert [ck.kernel.family for ck in c.kernels] == ["contract"]
    how = c.kernels[0].hip.kernel.launch.how
    tiled = T >= MMA_ROWS and dtype != "f32"
    assert ("a matmul" in how) == (4 <= T and not tiled) and how.startswith("a tiled matmul") == tiled, how


@pytest.mark.parametrize("T", [17, 64])
def test_matmul_qkv_with_bias_and_in_place_residual(T):
    """Q, K, V segments with a bias, then an O projection whose residual is written in place
    (donated): every row and column stored once."""
    from tests.test_matmul import qkv
    K = 512
    args = (randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), matmul_weight(512, K, "f16"),
            matmul_weight(128, K, "f16"), matmul_weight(128, K, "f16"), randn(512))
    check(qkv, *args, gemv_k=K)
    x, w, res = randn(T, K), matmul_weight(300, K, "f16"), randn(T, 300)
    check(lambda x, w, res: res + nn.linear(x, w), x, w, res, donate=(2,), gemv_k=K)


@pytest.mark.parametrize("dtype,K", [("f16", 8960), ("q4_0", 8960), ("f16", 27648)])
def test_matmul_long_rows_one_at_a_time_split_over_waves(dtype, K):
    """K = 8960 (Qwen2.5-1.5B's down projection): one activation row in LDS at a time, the few
    output columns split over waves (partial sums combined through LDS), several row tiles; at K
    27648 the row passes NVIDIA's 48 KiB of static LDS (dynamic LDS)."""
    T, N = 12, 64                                     # fewer than MMA_ROWS: the GEMV-style matmul
    x, w, res = randn(T, K, scale=0.5), matmul_weight(N, K, dtype), randn(T, N)
    c = check(lambda x, w, res: res + nn.linear(x, w), x, w, res, gemv_k=K)
    assert "a matmul" in c.kernels[0].hip.kernel.launch.how


# ------------------------------------------------------------------------------ the tiled matmul
@pytest.mark.parametrize("T", [16, 100, 512])
@pytest.mark.parametrize("dtype,K,N", [("f16", 1536, 1000), ("f16", 99, 37), ("f32", 256, 200), ("q4_0", 576, 96),
                                         ("q8_0", 256, 64)])
def test_mma_rmsnorm_gate_up_silu_mul_residual(T, dtype, K, N):
    """The tiled matmul (``codegen/mma.py``: mma.sync at wave 32, each warp one n8 half at the emulated
    wave 64): RMSNorm -> gate/up -> SiLU * mul -> residual over T rows; T, N and K whole tiles or
    ragged, f16 / quantized weights, against the float64 interpreter; f32 weights keep the row-group
    matmul (the tiles would round them to f16)."""
    from tests.test_matmul import gate_up
    x, g, r = randn(T, K), rng.uniform(0.5, 1.5, K).astype(np.float32), randn(T, N)
    c = check(gate_up, x, g, matmul_weight(N, K, dtype), matmul_weight(N, K, dtype), r)
    how = c.kernels[0].hip.kernel.launch.how
    assert how.startswith("a tiled matmul") == (dtype != "f32") and ("a matmul" in how) == (dtype == "f32"), how


@pytest.mark.parametrize("T", [16, 300])
@pytest.mark.parametrize("wdtype", ["f16", "q4_1"])
def test_mma_qkv_with_rope_pairs_and_kv_write(T, wdtype):
    """Qwen2.5-1.5B's Q/K/V with bias, RoPE pairs as sibling accumulators and the KV-cache write, as
    one tiled-matmul kernel of three segments, at a prompt of T tokens written at pos."""
    from tests.test_quant_kernels import quantized
    D, hq, hkv, hd, theta, S = 1536, 12, 2, 128, 1e6, 1024
    pos = int(rng.integers(0, S - T))
    x, g = randn(T, D), rng.uniform(0.5, 1.5, D).astype(np.float32)
    ws = [quantized((n, D), wdtype) if wdtype != "f16" else randn(n, D, dtype=np.float16, scale=D ** -0.5)
          for n in (hq * hd, hkv * hd, hkv * hd)]
    bs = [randn(n) for n in (hq * hd, hkv * hd, hkv * hd)]
    kc, vc = randn(hkv, S, hd, dtype=np.float16), randn(hkv, S, hd, dtype=np.float16)

    def qkv_rope(x, g, ws, bs, kc, vc, pos):
        h = nn.rms_norm(x, g, 1e-6)
        q, k, v = (nn.linear(h, w, b).reshape(T, -1, hd).transpose(1, 0, 2) for w, b in zip(ws, bs))
        kc, vc = nn.kv_write(kc, vc, nn.rope(k, pos, theta), v, pos)
        return nn.rope(q, pos, theta), kc, vc
    jf = dsl.jit(qkv_rope, backend="cuda", donate_argnums=(4, 5))
    args = (x, g, ws, bs, kc, vc, pos)
    want = jf.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = [np.asarray(a, np.float64) for a in dsl.tree_flatten(jf(x, g, ws, bs, kc.copy(), vc.copy(), pos))[0]]
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=0, atol=3e-2 * np.abs(w).max())
    (kern,) = jf.compile(*args).kernels
    assert kern.hip.kernel.launch.how.startswith("a tiled matmul")


@pytest.mark.parametrize("hq,hkv,t,pos,S,D", [(28, 4, 1, 4000, 4096, 128), (9, 3, 1, 2000, 2048, 64),
                                               (12, 2, 16, 100, 512, 128), (7, 1, 5, 506, 511, 64)])
def test_kv_write_into_an_f16_cache_and_attention(hq, hkv, t, pos, S, D):
    """The default f16 KV cache on the GPU: the write rounds to f16 (k and v are f16 values here, as
    the float64 interpreter does not round it) and attention reads f16 rows."""
    q = randn(hq, t, D)
    k, v = randn(hkv, t, D, dtype=np.float16).astype(np.float32), randn(hkv, t, D, dtype=np.float16).astype(np.float32)
    kc, vc = randn(hkv, S, D, dtype=np.float16), randn(hkv, S, D, dtype=np.float16)

    def f(q, k, v, kc, vc, pos):
        out, kc, vc = nn.causal_attention(q, kc, vc, k, v, pos)
        return out, kc, vc
    c = check(f, q, k, v, kc, vc, pos, rtol=2e-3, atol=2e-3)
    att = [x for x in c.plan.kernels if x.family == "attention"][0]
    assert [p.dtype for p in att.params if p.shape == (hkv, S, D)] == ["f16", "f16"]


def test_smollm2_greedy_ids_with_the_f32_cache():
    from engine.model import Model
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS
    cfg, params, _ = load_model(default_model_path())
    m = Model(cfg, params, backend="cuda", context=64, kv_dtype="f32")
    assert {c.dtype for pair in m.cache for c in pair} == {np.dtype(np.float32)}
    m.prefill(PROMPT_IDS)
    assert [REFERENCE_IDS[0]] + m.decode_greedy(REFERENCE_IDS[0], 19) == REFERENCE_IDS


# ------------------------------------------------------------------------------ attention (flash)
def _attention_tiles(c):
    """The AttentionTiles the compiled attention kernel of ``c`` runs with."""
    from codegen import loopir as L
    (ck,) = [ck for ck in c.kernels if ck.kernel.family == "attention"]
    (a,) = [s for s in ck.hip.kernel.body if isinstance(s, L.Attention)]
    return a.tiles


def _check_attention(hq, hkv, t, S, D, kv_dtype, positions, want_splits=None):
    """``dsl.attention`` on the GPU against the float64 interpreter at each position, every call on
    fresh random q, K and V (so that each position reads values no earlier call saw); the same
    compiled kernel serves every position (the grid is fixed, the position read on the device),
    which also checks that the last split resets its arrival counter for the next launch."""
    f = lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 1.0 / np.sqrt(D))  # noqa: E731
    jf = dsl.jit(f, backend="cuda")
    q, kc, vc = randn(hq, t, D), randn(hkv, S, D, dtype=kv_dtype), randn(hkv, S, D, dtype=kv_dtype)
    c = jf.compile(q, kc, vc, 0)
    tiles = _attention_tiles(c)
    if want_splits is not None:
        assert (tiles.splits > 1) == want_splits, tiles
    if c.device.target.emulated_wave:                    # what runs is gfx906's kernel text
        for ck in c.kernels:
            assert gfx906_text(ck), ck.kernel.name
    low = jf.lower(q, kc, vc, 0)
    for pos in positions(tiles):
        q, kc, vc = randn(hq, t, D), randn(hkv, S, D, dtype=kv_dtype), randn(hkv, S, D, dtype=kv_dtype)
        got = np.asarray(jf(q, kc, vc, pos), np.float64)
        want = low.program.run(q, kc, vc, pos, compute_dtype="f64")[0]
        np.testing.assert_allclose(got, want, rtol=5e-4, atol=5e-4, err_msg=f"pos {pos}, {tiles}")
    return tiles


def _decode_positions(S):
    """0, 1, both sides of the first split boundaries and of the short context one split reads
    whole (``AttentionTiles.short``), the middle and the last position."""
    return lambda m: sorted({0, 1, m.chunk - 1, m.chunk, m.chunk + 1, 2 * m.chunk, m.short - 1, m.short, S // 2 + 3,
                             S - 1} & set(range(S)))


@pytest.mark.parametrize("hq,hkv,D,kv_dtype", [
    (12, 2, 128, np.float16),        # Qwen2.5-1.5B: 6 query heads per KV head
    (28, 4, 128, np.float32),        # Qwen2.5-7B: 7 per KV head, f32 cache
    (7, 1, 64, np.float16),          # GQA 7, head dim 64
    (8, 4, 64, np.float32),          # GQA 2
    (4, 4, 128, np.float16),         # no sharing (GQA 1)
    (9, 3, 64, np.float32),          # SmolLM2: 3 per KV head, head dim 64
    (24, 2, 128, np.float16),        # 12 per KV head: two workgroups of 6 heads per KV head
    (10, 2, 80, np.float16),         # head dim 80: lanes past the row's ten 16-byte loads
])
def test_decode_attention_split_over_workgroups(hq, hkv, D, kv_dtype):
    """Flash-decoding: T = 1 over a 4096-position cache split over workgroups, the query heads of a
    KV head in one workgroup, the splits combined by the last to finish; positions 0, 1, around the
    split boundaries, the middle and S - 1."""
    S = 4096
    _check_attention(hq, hkv, 1, S, D, kv_dtype, _decode_positions(S), want_splits=True)


@pytest.mark.parametrize("hq,hkv,D,kv_dtype", [(12, 2, 128, np.float32), (6, 6, 64, np.float16)])
def test_decode_attention_over_a_short_cache(hq, hkv, D, kv_dtype):
    """A cache of 40 positions (one tile, a split or a few) at every position."""
    _check_attention(hq, hkv, 1, 40, D, kv_dtype, lambda m: range(40))


@pytest.mark.parametrize("t,S,hq,hkv,D,kv_dtype,pos", [
    (7, 512, 14, 2, 64, np.float16, 200),      # GQA 7: one query position per tile row block
    (7, 512, 12, 2, 128, np.float32, 1),
    (64, 1024, 12, 2, 128, np.float16, 500),   # GQA 2... 6, several query tiles, last one partial
    (64, 1024, 8, 4, 64, np.float32, 960),     # pos = S - T: the last positions of the cache
    (300, 2048, 12, 2, 128, np.float16, 1000),
    (300, 512, 4, 4, 128, np.float32, 37),     # GQA 1: 16 query positions per tile
    (300, 300, 7, 1, 64, np.float16, 0),       # a prompt filling the cache from position 0
])
def test_prefill_attention_as_flash_attention(t, S, hq, hkv, D, kv_dtype, pos):
    """Flash attention for T > 1: query tiles x key tiles in LDS, causal skipping, GQA; the query at
    row i sees positions 0..pos+i."""
    _check_attention(hq, hkv, t, S, D, kv_dtype, lambda m: [pos])


@pytest.mark.parametrize("template", ["blocked", "scalar"])
@pytest.mark.parametrize("t,S,hq,hkv,D,kv_dtype,pos", [
    (40, 256, 32, 2, 128, np.float16, 100),   # 16 query heads per KV head
    (33, 256, 16, 1, 256, np.float32, 50),    # 16 of 256, f32 cache: the group's heads over workgroups (gfx906)
    (21, 200, 24, 2, 256, np.float16, 0),     # 12 of 256
    (50, 300, 16, 2, 64, np.float32, 250),    # 8 of 64, the last positions of the cache
    (129, 512, 12, 2, 128, np.float16, 7),    # Qwen2.5-1.5B's group of 6, a ragged last query tile
])
def test_prefill_attention_at_large_groups_and_wide_heads(t, S, hq, hkv, D, kv_dtype, pos, template, monkeypatch):
    """The register-blocked prefill (and, for A/B, the tiled template of ``VEGAFUSE_ATT_PREFILL=scalar``
    where its tiles fit) at 8-16 query heads per KV head and head dims 64-256."""
    monkeypatch.setenv("VEGAFUSE_ATT_PREFILL", template)
    try:
        tiles = _check_attention(hq, hkv, t, S, D, kv_dtype, lambda m: [pos])
    except ValueError as e:                       # the tiled template's LDS limit (16 heads of 256, f32)
        assert template == "scalar" and "bytes of LDS" in str(e), e
        return
    assert bool(tiles.block) == (template == "blocked"), tiles


@pytest.mark.parametrize("hq,hkv,D,kv_dtype", [(32, 2, 128, np.float16), (16, 1, 256, np.float16), (16, 1, 256, np.float32)])
def test_decode_attention_at_large_groups(hq, hkv, D, kv_dtype):
    """Decode at 16 query heads per KV head, head dim up to 256: at wave 64 (gfx906's text) the group's
    heads go to several workgroups under the register budget."""
    S = 2048
    _check_attention(hq, hkv, 1, S, D, kv_dtype, _decode_positions(S), want_splits=True)


@pytest.mark.parametrize("template", ["blocked", "scalar"])
def test_prefill_attention_time_at_4000_tokens(template, wave, monkeypatch):
    """Qwen2.5-1.5B's prefill attention over a 4000-token prompt (12 query heads over 2 KV heads, head
    dim 128, f16 cache, position 0): the kernel's GPU time, printed with its FMA rate and the 28
    layers' total; the register-blocked template's 28 layers take at most 0.1 s (the whole prefill's
    target is 0.3 s).  ``pytest -s`` shows the line; run with both templates for A/B."""
    if wave == 64:
        pytest.skip("a speed at wave 32; the wave-64 emulation checks gfx906's text, not its speed")
    monkeypatch.setenv("VEGAFUSE_ATT_PREFILL", template)
    hq, hkv, T, S, D = 12, 2, 4000, 4096, 128
    f = lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 1.0 / np.sqrt(D))  # noqa: E731
    jf = dsl.jit(f, backend="cuda")
    q, kc, vc = randn(hq, T, D), randn(hkv, S, D, dtype=np.float16), randn(hkv, S, D, dtype=np.float16)
    c = jf.compile(q, kc, vc, 0)
    c(q, kc, vc, 0)
    (us,) = c.device.time_launches(c._plan_run.launches, reps=10)
    fmas = 2 * hq * D * T * (T + 1) / 2                       # Q K^T and P V over the causal triangle
    print(f"\nprefill attention, {template}, {_attention_tiles(c)}: {us:.0f} us per layer, "
          f"{fmas / us / 1e6:.2f} TFMA/s, 28 layers {28 * us / 1e3:.1f} ms")
    if template == "blocked":
        assert 28 * us * 1e-6 <= 0.1, us


def test_decode_attention_with_the_kv_write_in_a_graph_replayed_at_moving_positions():
    """The decode step's pair (KV write, attention) replayed as one launch plan while the position
    moves across split boundaries: every step sees what the earlier steps wrote."""
    hq, hkv, D, S = 12, 2, 128, 1024
    kc, vc = np.zeros((hkv, S, D), np.float16), np.zeros((hkv, S, D), np.float16)

    def step(q, k, v, kc, vc, pos):
        out, kc, vc = nn.causal_attention(q, kc, vc, k, v, pos)
        return out, kc, vc
    jf = dsl.jit(step, backend="cuda", donate_argnums=(3, 4))
    ref_k, ref_v = np.zeros((hkv, S, D)), np.zeros((hkv, S, D))
    for pos in range(0, 400):
        q, k, v = randn(hq, 1, D), randn(hkv, 1, D), randn(hkv, 1, D)
        out, kc, vc = jf(q, k, v, kc, vc, pos)
        ref_k[:, pos], ref_v[:, pos] = k[:, 0].astype(np.float16), v[:, 0].astype(np.float16)
        if pos % 37 == 0 or pos in (127, 128, 129, 399):
            want = reference_attention(q.astype(np.float64), ref_k, ref_v, pos)
            np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=5e-4, atol=5e-4, err_msg=f"pos {pos}")


def test_bench_table_and_generate_options_on_the_gpu():
    """engine.bench --backend cuda prints its llama-bench-style table with a positive rate; engine.generate
    --backend cuda with --min-p and --repeat-penalty, seeded, gives the same text cut before a --stop string."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def cmd(module, *args):
        r = subprocess.run([sys.executable, "-m", module, *args], cwd=root, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout
    out = cmd("engine.bench", "--backend", "cuda", "--model", "smollm2-135m", "--dtype", "f16", "--tokens", "16",
              "--no-peer")
    (row,) = [ln for ln in out.splitlines() if ln.startswith("| smollm2-135m f16")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "vegafuse cuda" and cells[3] == "tg16" and float(cells[4]) > 0, out
    args = ["--backend", "cuda", "--temperature", "0.7", "-s", "5", "-n", "24", "--repeat-penalty", "1.2",
            "--min-p", "0.05", "--json", "The capital of France is"]
    full = json.loads(cmd("engine.generate", *args))
    stop = full["text"][len(full["text"]) // 2:][:3]
    cut = json.loads(cmd("engine.generate", "--stop", stop, *args))
    assert cut["text"] == full["text"][:full["text"].find(stop)] and cut["finish_reason"] == "stop"


def test_smollm2_continuation_prefill_matches_a_fresh_prefill():
    """``Model.extend`` (the chat's KV cache kept across turns) on the GPU: a continuation at pos
    and a rewind give one fresh prefill's logits (tests/test_chat.py, where it runs on the CPU)."""
    from engine.weights import default_model_path, load_model
    from tests.test_chat import check_extend
    check_extend(*load_model(default_model_path()), backend="cuda")


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_p=0.95), dict(temperature=0.7, top_k=40, min_p=0.05)])
def test_device_sampler_draws_the_reference_inverse_cdf(kw):
    """stdlib.sampling.sample over a SmolLM2-sized row (49152 ids) on the GPU, id for id against
    the float64 reference's inverse CDF (tests/test_device_sampling.py runs it on the CPU)."""
    from tests.test_device_sampling import check_draws
    check_draws(kw, backend="cuda", V=49152, n=30)


def test_smollm2_streams_with_its_ids_drawn_on_the_device():
    """engine.generate.stream on the GPU draws its ids on the device and reads them behind: greedy,
    it gives the reference ids (and the host-drawn path's); seeded sampling repeats; stopping early
    leaves the model's position at the ids taken, from where decoding continues the reference."""
    import os
    from engine.generate import Finished, stream
    from engine.model import Model
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS
    cfg, params, tok = load_model(default_model_path())
    m = Model(cfg, params, backend="cuda", context=64)

    def run(**kw):
        out = [x for x in stream(m, tok, PROMPT_IDS, max_tokens=20, **kw)][-1]
        assert isinstance(out, Finished)
        return out.ids
    assert run(temperature=0.0) == REFERENCE_IDS
    os.environ["VEGAFUSE_DEVICE_SAMPLING"] = "0"
    try:
        assert run(temperature=0.0) == REFERENCE_IDS
        host = run(temperature=0.8, top_p=0.95, seed=3)
    finally:
        del os.environ["VEGAFUSE_DEVICE_SAMPLING"]
    a, b = run(temperature=0.8, top_p=0.95, seed=3), run(temperature=0.8, top_p=0.95, seed=3)
    assert a == b and len(a) == 20 and a[0] == host[0]     # the first id is drawn from the prefill's logits
    m.reset()
    m.prefill(PROMPT_IDS)
    ids = m.decode_ids(REFERENCE_IDS[0], 19)
    taken = [next(ids) for _ in range(5)]
    ids.close()
    assert taken == REFERENCE_IDS[1:6] and m.pos == len(PROMPT_IDS) + 5
    assert m.decode_greedy(REFERENCE_IDS[5], 14) == REFERENCE_IDS[6:]


def test_profile_smollm2_on_the_gpu(tmp_path):
    """engine.profile on the GPU (f16 weights): every kernel timed between device events with graphs
    off, the plan replayed as a graph beside it; the kernel count is the fusion report's, the bytes
    per token the weights' plus the KV reads within 5%, kernels plus gaps the token time within 10%,
    profile.json and roofline.png written (tests/test_profile.py runs it on the CPU)."""
    from tests.test_profile import check_profile
    report = check_profile("cuda", tmp_path, steps=16)
    assert report["ceilings"]["bandwidth_gbs"] > 100 and report["ceilings"]["gflops"] > 1000, report["ceilings"]


@pytest.mark.parametrize("dtype", ["native", "f16", "f32"])
def test_verify_passes_on_smollm2_for_20_tokens_on_the_gpu(dtype, capsys):
    """engine.generate --verify on the GPU (tests/test_verify.py runs it on the CPU): every kernel of the
    prefill and of 20 decode steps against the float64 interpreter on its own inputs, read back from the
    device, with the Q4_1 file as it is (int8 GEMVs, q8_1 blocks written by producers) and with f16 and
    f32 weights; the text is an unchecked run's."""
    import json
    from tests.test_verify import SUMMARY, generate
    rc, out, err = generate(capsys, "--backend", "cuda", "--dtype", dtype, "-n", "20", "--json", "--verify")
    assert rc == 0, err
    m = SUMMARY.search(err)
    assert m and "not compared" not in err, err
    checked = json.loads(out)
    assert int(m.group(4)) == 1 + len(checked["ids"]) - (checked["finish_reason"] == "length")
    rc, out, err = generate(capsys, "--backend", "cuda", "--dtype", dtype, "-n", "20", "--json")
    assert rc == 0 and json.loads(out)["ids"] == checked["ids"], err


def test_verify_names_a_broken_kernel_on_the_gpu(capsys, monkeypatch):
    """Layer 3's down projection reading its residual mirrored, rendered for the GPU: --verify stops at
    the prefill naming the kernel, its output and the first bad index."""
    import re
    from tests.test_verify import break_kernel, generate
    break_kernel(monkeypatch, "layers_3_linear_w_down_add")
    rc, out, err = generate(capsys, "--backend", "cuda", "--dtype", "f16", "-n", "2", "--verify")
    assert rc == 2 and re.search(r"error: verify: kernel layers_3_linear_w_down_add wrote layers_3_x_2\[0, \d+\] = ",
                                 err), err


@pytest.mark.parametrize("case", ["mask -1e9", "mask f32 min", "+inf", "all -inf", "all nan"])
def test_device_sampler_on_masks_and_infinities(case):
    """stdlib.sampling.sample over a 49152-id row on the GPU (tests/test_review15.py runs these on
    the CPU and the emulated kernel text): a large finite mask keeps top-k and top-p exact; with no
    finite maximum the draw is the host's argmax."""
    from tests.test_review15 import check, masked
    V = 49152
    if case.startswith("mask"):
        lg = masked(V, -1e9 if case == "mask -1e9" else np.finfo(np.float32).min)
        check(lg, backend="cuda", n=8, temperature=0.8, top_k=40, top_p=0.9)
        check(lg, backend="cuda", n=8, top_p=0.6)
        return
    lg = np.random.default_rng().standard_normal(V).astype(np.float32)
    if case == "+inf":
        lg[np.random.default_rng().choice(V, 2, replace=False)] = np.inf
    else:
        lg[:] = -np.inf if case == "all -inf" else np.nan
    check(lg, backend="cuda", n=3, temperature=0.8, top_k=40, top_p=0.9)


def test_smollm2_decode_ids_closed_late_and_the_chat_on_the_device():
    """A decode_ids generator closed after a newer prefill leaves the newer position; the chat
    draws on the device, and after Ctrl-C its cache and next answer equal the host-drawn chat's."""
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS
    from tests.test_review15 import check_chat_on_device, model
    smollm2 = load_model(default_model_path())
    m = model(smollm2, 40, "cuda")
    m.prefill(PROMPT_IDS)
    old = m.decode_ids(REFERENCE_IDS[0], 8)
    assert [next(old) for _ in range(3)] == REFERENCE_IDS[1:4]
    m.prefill(PROMPT_IDS[:3])
    old.close()
    assert m.pos == 3
    check_chat_on_device(smollm2, "cuda")


def test_integer_reductions_and_a_counted_search_on_one_workgroup():
    """i32 sum, max and argmax block-wide on one workgroup (``vf_block_sum_i`` and its kin, the
    target's ``one_workgroup_block`` threads), and a loop kernel whose steps count sibling tests
    (``stdlib/sampling.py``'s search shape), against the float64 interpreter (tests/test_one_workgroup.py
    runs the same on the CPU and the emulated kernel text)."""
    from tests.test_one_workgroup import counted_search, int_reductions
    n = int(rng.integers(3000, 9000))
    check(int_reductions, rng.integers(-50, 50, n).astype(np.int32), randn(n))
    V = 3000
    p = (rng.random(V) + 0.5).astype(np.float32)
    cdf = np.cumsum(p.astype(np.float64))
    j = int(rng.integers(1, V))
    target = np.float32((cdf[j - 1] + cdf[j]) / 2)
    check(counted_search, p, target)
    assert int(np.asarray(dsl.jit(counted_search, backend="cuda")(p, target))) == j


def test_marginal_costs_double_each_kernel_group_and_leave_the_ids_as_they_were():
    """engine.profile.marginal_costs on random SmolLM2-135M weights: one row per kernel group, whose
    calls add up to the step's kernels; the step with a group launched twice is slower in sum; the
    greedy ids decoded afterwards from the same position are those decoded before (a second launch of
    a decode kernel writes what the first wrote)."""
    from engine.bench import SHAPES, random_params
    from engine.executable import get_device
    from engine.model import Model
    from engine.profile import format_marginal, marginal_costs
    from stdlib.config import LlamaConfig
    dev = get_device("cuda")
    cfg = LlamaConfig(**SHAPES["smollm2-135m"], max_seq_len=64, name="smollm2-135m")
    m = Model(cfg, random_params(cfg, dev, "f16", seed=int(np.random.default_rng().integers(1 << 30))),
              backend="cuda", context=64)
    first = int(np.argmax(np.asarray(m.prefill([1, 2, 3, 4]))))
    before = m.decode_greedy(first, 8)
    rows = marginal_costs(m, first, steps=4, repeat=1)
    ex = m.greedy_step.compile(m.params, np.zeros(1, np.int32), 0, 0, m.cache)
    assert sum(r[1] for r in rows) == len(ex.kernels) and len({r[0] for r in rows}) == len(rows)
    assert sum(r[1] * r[2] for r in rows) > 0 and all(r[3] > 0 for r in rows)
    assert "layers_#_" in format_marginal(rows)
    m.pos = 4
    assert m.decode_greedy(first, 8) == before


@pytest.mark.parametrize("ring", ["0", "1"], ids=["scaffold", "ring"])
@pytest.mark.parametrize("shape", [{}, {"n_layers": 2, "context": 64, "vocab": 32000, "dim": 1536, "heads": (12, 2),
                                       "head_dim": 128, "ffn": 8960}], ids=["tiny", "qwen2.5-1.5b-layers"])
def test_a_persistent_decode_step_matches_the_float64_interpreter(shape, ring, monkeypatch):
    """``VEGAFUSE_PERSISTENT=1``: the step's kernels as phases of one launch, a workgroup on every SM,
    grid barriers between them (``tests/test_persistent.py`` runs the same on the CPU emulation); with
    ``VEGAFUSE_PERSISTENT_RING=1`` its GEMV phases' weights stream through the ring (``codegen/ring.py``)."""
    from tests.test_persistent import check_decode_steps
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", ring)
    check_decode_steps("cuda", (0, 7, 40) if shape else (0, 5, 11), **shape)


def test_smollm2_greedy_ids_from_the_persistent_kernel(monkeypatch):
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS, greedy
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    ids, out, m = greedy(*load_model(default_model_path()), backend="cuda")
    assert ids == PROMPT_IDS and out == REFERENCE_IDS
    m.reset()                                   # the device-side loop, replayed from a CUDA graph
    m.prefill(ids)
    assert [REFERENCE_IDS[0]] + m.decode_greedy(REFERENCE_IDS[0], 19) == REFERENCE_IDS
    (decode,) = m.greedy_step._cache.values()
    assert [ck.kernel.family for ck in decode.kernels] == ["persistent", "reduce"]
