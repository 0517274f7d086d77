"""Quantized weights (q4_0, q4_1, q8_0, gptq_int4) in kernels: GEMVs, matmuls and gathers on the CPU against
the float64 interpreter, the fusion rule that keeps a float copy from being written, and the
gfx906 quantized GEMV's ISA gates (int8 dot products, 16-byte weight loads, LDS per weight byte).
Weights are quantized by the gguf package's quantizer, an independent reference; gptq_int4
weights are a GPTQ checkpoint of them (gptq_quantize) repacked by from_gptq, whose values
gptq_dequantize computes."""
import gguf
import numpy as np
import pytest

import dsl
from dsl.core import DSLError
from dsl.quant import QArray, from_gptq, gptq_dequantize, gptq_quantize
from engine.pipeline import lower_program

rng = np.random.default_rng()
FORMATS = ("q4_0", "q4_1", "q8_0", "gptq_int4")
GGML = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
        "q8_0": gguf.GGMLQuantizationType.Q8_0}


def quantized_and_values(shape, fmt, scale=0.5):
    """Fresh normal weights quantized by gguf's reference quantizer, and their float32 values by
    gguf's dequantization.  gptq_int4: an asymmetric GPTQ checkpoint (groups of 32 in order, so no
    column permutation; rows padded to GPTQ's multiple of 8, then dropped) repacked by from_gptq,
    and its values by gptq_dequantize."""
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    if fmt == "gptq_int4":
        n = shape[0]
        parts = gptq_quantize(np.pad(w, ((0, -n % 8), (0, 0))), 32, sym=False)
        q, perm = from_gptq(*parts, sym=False)
        assert perm is None
        return q.take_rows(np.arange(n)), gptq_dequantize(*parts, sym=False)[:n]
    q = QArray(gguf.quants.quantize(w, GGML[fmt]).reshape(-1), shape, fmt)
    return q, gguf.quants.dequantize(q.data, GGML[fmt]).reshape(shape)


def quantized(shape, fmt, scale=0.5):
    """``quantized_and_values``' quantized array."""
    return quantized_and_values(shape, fmt, scale)[0]


def check(f, *args, rtol=2e-5, **jit):
    """``f`` compiled for the CPU against the float64 interpreter; the error is measured against the
    size of what was summed (|x| @ |w|)."""
    jf = dsl.jit(f, **jit)
    want = jf.lower(*args).program.run(*args, compute_dtype="f64")
    got = dsl.tree_flatten(jf(*args))[0]
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float64), r, rtol=rtol, atol=rtol * max(1.0, np.abs(r).max()))
    return jf


def rms_norm(x, g):
    return x * dsl.rsqrt(dsl.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g


def check_int8(got, h, w, extra=0.0):
    """A GEMV on quantized weights against the int8 path's arithmetic in float64 (``q8_1_gemv``: the
    activation ``h`` through q8_1 with its residual plane) and against the exact product within
    the activation's quantization error (step / 256 per element, step = block max / 127).  The
    error is measured against what each output sums, |h| @ |w|."""
    got = np.asarray(got, np.float64)
    scale = np.abs(np.atleast_2d(h).astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
    want = q8_1_gemv(h, w) + extra
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * scale.max() + 1e-6)
    exact = np.atleast_2d(h).astype(np.float64) @ w.dequantize().astype(np.float64).T + extra
    assert np.all(np.abs(got - exact) <= 1e-4 * scale + 1e-6)


def rms_norm_np(x, g):
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * g).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 32), (3, 64), (64, 96), (256, 576), (40, 1536)])
def test_gemv_with_rms_norm_prologue_and_bias_residual_epilogue(fmt, n, k):
    x, g = rng.standard_normal((1, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    b, res = rng.standard_normal(n).astype(np.float32), rng.standard_normal((1, n)).astype(np.float32)
    w = quantized((n, k), fmt)
    jf = dsl.jit(lambda x, g, w, b, res: res + dsl.dot_t(rms_norm(x, g), w) + b)
    check_int8(jf(x, g, w, b, res), rms_norm_np(x, g), w, res.astype(np.float64) + b)
    (kern,) = jf.compile(x, g, w, b, res).plan.kernels           # one kernel: prologue, GEMV, epilogue
    assert kern.family == "contract"


@pytest.mark.parametrize("vnni", ["0", "256", "512"])
@pytest.mark.parametrize("accs", ["1", "2"])
def test_cpu_int8_dot_products_with_and_without_vnni(vnni, accs, monkeypatch):
    """The CPU's generic vector code and, where the host has them, 256-bit ``vpdpbusd`` a block at a
    time and 512-bit ``vpdpbusd`` two blocks at a time (q8_0 through the +128 offset), with one or
    two accumulators per output, give the same arithmetic: block counts odd (one at a time), 2 (one
    pair), 18 (a pair left over) and 8 (pairs in twos); with and without the residual plane."""
    monkeypatch.setenv("VEGAFUSE_CPU_VNNI", vnni)
    monkeypatch.setenv("VEGAFUSE_CPU_ACCS", accs)
    for fmt in FORMATS:
        for k in (160, 64, 576, 256):
            x, w = rng.standard_normal((2, k)).astype(np.float32), quantized((24, k), fmt)
            check_int8(dsl.jit(lambda x, w: dsl.dot_t(x, w))(x, w), x, w)
    monkeypatch.setenv("VEGAFUSE_QUANT_RESIDUAL", "0")
    for fmt in FORMATS:
        x, w = rng.standard_normal((1, 192)).astype(np.float32), quantized((40, 192), fmt)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        got = np.asarray(dsl.jit(lambda x, w: dsl.dot_t(x, w))(x, w), np.float64)
        np.testing.assert_allclose(got, q8_1_gemv(x, w, residual=False), rtol=0, atol=1e-5 * scale.max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_int8_gemv_renders_two_blocks_per_512_bit_dot_product(fmt):
    """With 512-bit VNNI a pair of weight blocks meets the activation in one vpdpbusd per plane, and
    no 256-bit one is left (with an even block count); the 256-bit form renders a block at a time."""
    from codegen.llvm import render_llvm
    x, w = rng.standard_normal((1, 576)).astype(np.float32), quantized((64, 576), fmt)
    (kern,) = dsl.jit(lambda x, w: dsl.dot_t(x, w)).compile(x, w).plan.kernels
    wide, narrow = render_llvm(kern, vnni=512), render_llvm(kern, vnni=256)
    assert "call <16 x i32> @\"llvm.x86.avx512.vpdpbusd.512\"" in wide and "vpdpbusd.256\"(" not in wide
    assert "vpdpbusd.512" not in narrow and "vpdpbusd.256\"(" in narrow


def test_without_the_residual_plane_the_activation_is_plain_q8_1(monkeypatch):
    """``VEGAFUSE_QUANT_RESIDUAL=0``: half the integer work, each activation within half a q8_1 step."""
    monkeypatch.setenv("VEGAFUSE_QUANT_RESIDUAL", "0")
    for fmt in FORMATS:
        x, w = rng.standard_normal((2, 96)).astype(np.float32), quantized((40, 96), fmt)
        got = np.asarray(dsl.jit(lambda x, w: dsl.dot_t(x, w))(x, w), np.float64)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.dequantize().astype(np.float64)).T
        np.testing.assert_allclose(got, q8_1_gemv(x, w, residual=False), rtol=0, atol=1e-5 * scale.max())
        assert np.abs(got - q8_1_gemv(x, w)).max() > 1e-3 * scale.max()        # the residual plane is gone


def test_the_float_activation_switch_matches_the_float64_interpreter(monkeypatch):
    """``VEGAFUSE_QUANT_ACT=float``: each weight dequantized as it is loaded, the activation in f32."""
    monkeypatch.setenv("VEGAFUSE_QUANT_ACT", "float")
    for fmt in FORMATS:
        x, w = rng.standard_normal((2, 96)).astype(np.float32), quantized((40, 96), fmt)
        check(lambda x, w: dsl.dot_t(x, w), x, w)


def test_the_float_activation_switch_on_gpus_dequantizes_8_weights_then_v_dot2(monkeypatch):
    """``VEGAFUSE_QUANT_ACT=float`` on GPUs (issue 8's f16-activation path for A/B): each lane takes 8
    weights at a time, dequantized together (``vf_dequant8f_*``), against the activation in LDS; on gfx906
    (f16 activation) through ``v_dot2_f32_f16``.  The sm_90 text, run by the CPU emulation on the
    engine's GPU path, matches the float64 interpreter."""
    from tests.emu_device import emu_backend
    from tests.emulation import GXX
    monkeypatch.setenv("VEGAFUSE_QUANT_ACT", "float")
    for fmt in FORMATS:
        x, g = rng.standard_normal((1, 192)).astype(np.float32), rng.uniform(0.5, 1.5, 192).astype(np.float32)
        w = quantized((72, 192), fmt)
        f = lambda x, g, w: dsl.dot_t(rms_norm(x, g), w)                          # noqa: E731
        if GXX:
            want = dsl.jit(f).lower(x, g, w).program.run(x, g, w, compute_dtype="f64")[0]
            got = np.asarray(dsl.jit(f, backend=emu_backend())(x, g, w), np.float64)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        if _have_gfx906():
            from codegen.inspect import Inspected
            from codegen.targets import get_target
            (kern,) = lower_program(dsl.jit(f).lower(x, g, w)).kernels
            it = Inspected(kern, get_target("gfx906"))
            assert f"vf_dequant8f_{fmt}(" in it.source and "v_dot2_f32_f16" in it.isa(), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_and_up_siblings_share_one_kernel(fmt):
    x, g = rng.standard_normal((1, 192)).astype(np.float32), rng.uniform(0.5, 1.5, 192).astype(np.float32)
    wg, wu = quantized((128, 192), fmt), quantized((128, 192), fmt)

    def mlp(x, g, w_gate, w_up):
        h = rms_norm(x, g)
        return dsl.dot_t(h, w_gate), dsl.dot_t(h, w_up)
    jf = dsl.jit(mlp)
    gate, up = jf(x, g, wg, wu)
    h = rms_norm_np(x, g)
    check_int8(gate, h, wg)
    check_int8(up, h, wu)
    (kern,) = jf.compile(x, g, wg, wu).plan.kernels
    assert "w_gate" in kern.name and "w_up" in kern.name


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_rows_and_matmul_with_weights_stored_k_by_n(fmt):
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = quantized((48, 64), fmt)
    check_int8(dsl.jit(lambda x, w: dsl.dot_t(x, w))(x, w), x, w)
    wkn = quantized((64, 96), fmt)                                 # blocks along N: x @ W
    check(lambda x, w: x @ w, x, wkn)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_gather_and_dequantize_are_exact(fmt):
    emb, values = quantized_and_values((50, 64), fmt)
    ids = rng.integers(0, 50, 7).astype(np.int32)
    rows = dsl.jit(lambda e, i: dsl.take(e, i))(emb, ids)
    np.testing.assert_array_equal(rows, values[ids])               # f32 bits of the reference dequantization
    full = dsl.jit(lambda e: dsl.dequantize(e))(emb)
    np.testing.assert_array_equal(full, values)
    half = dsl.jit(lambda e: e.astype("f16"))(emb)
    np.testing.assert_array_equal(half, emb.dequantize().astype(np.float16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_dequantize_rule_keeps_the_float_copy_out_of_memory(fmt):
    x, w = rng.standard_normal((1, 96)).astype(np.float32), quantized((32, 96), fmt)
    on = dsl.jit(lambda x, w: dsl.dot_t(x, w))
    check_int8(on(x, w), x, w)
    off = check(lambda x, w: dsl.dot_t(x, w), x, w, fusion={"dequantize": False})   # a float GEMV
    plan_on, plan_off = on.compile(x, w).plan, off.compile(x, w).plan
    assert len(plan_on.kernels) == 1 and len(plan_off.kernels) == 2
    assert all(dt != "f32" or shape != (32, 96) for shape, dt in plan_on.buffers.values())
    # the GEMV's traffic counts the quantized bytes, not 4 per weight
    assert plan_on.kernels[0].bytes < 96 * 32 * 2


def test_quantized_arrays_only_enter_through_dequantize():
    w = quantized((4, 32), "q4_0")
    with pytest.raises(DSLError, match=r"q4_0\[4, 32\] array is quantized.*dsl.dequantize"):
        dsl.jit(lambda w: w + 1.0)(w)
    with pytest.raises(DSLError, match="multiple of 32"):
        prog = dsl.parse_ir("{ lambda a:q4_0[2,40] ; let b:f32[2,40] = dequantize[dtype=f32] a in ( b ) }")
        from engine.pipeline import typecheck
        typecheck(prog)
    with pytest.raises(ValueError, match="multiple of 32"):
        QArray(np.zeros(18, np.uint8), (1, 31), "q4_0")
    with pytest.raises(ValueError, match="must be 18 uint8 bytes"):
        QArray(np.zeros(17, np.uint8), (1, 32), "q4_0")


def test_ir_text_round_trips_quantized_inputs():
    x, w = rng.standard_normal((1, 64)).astype(np.float32), quantized((8, 64), "q8_0")
    text = dsl.jit(lambda x, w: dsl.dot_t(x, w)).lower(x, w).as_text()
    assert "q8_0[8,64]" in text and "dequantize" in text
    assert dsl.parse_ir(text).as_text() == text


# ------------------------------------------------------------------------------------------ gfx906
def _gfx906():
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:                                    # pragma: no cover - depends on the host
        pytest.skip(f"gfx906 tests skipped: {e}")


def _have_gfx906() -> bool:
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
        return True
    except HipUnavailable:                                         # pragma: no cover - depends on the host
        return False


def quant_gemv_kernels(fmt):
    """Quantized GEMVs of the shapes a Llama decode step has: short K (several rows per wave),
    long K (a loop over blocks), gate/up siblings with SiLU*mul, Q/K/V segments."""
    out = []
    for n, k in ((576, 576), (64, 1536), (256, 8960)):
        x, g = rng.standard_normal((1, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
        w = quantized((n, k), fmt)
        out += lower_program(dsl.jit(lambda x, g, w: dsl.dot_t(rms_norm(x, g), w)).lower(x, g, w)).kernels
    x, g = rng.standard_normal((1, 576)).astype(np.float32), rng.uniform(0.5, 1.5, 576).astype(np.float32)
    wg, wu, wk = quantized((1536, 576), fmt), quantized((1536, 576), fmt), quantized((192, 576), fmt)

    def block(x, g, w_gate, w_up, wk):
        h = rms_norm(x, g)
        a = dsl.dot_t(h, w_gate)
        return a * dsl.sigmoid(a) * dsl.dot_t(h, w_up), dsl.dot_t(h, wk)
    out += [k for k in lower_program(dsl.jit(block).lower(x, g, wg, wu, wk)).kernels if k.family == "contract"]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_gfx906_quantized_gemv_isa_gates(fmt):
    _gfx906()
    from codegen.inspect import Inspected, counts, main_loop
    from codegen.targets import get_target
    for kern in quant_gemv_kernels(fmt):
        it = Inspected(kern, get_target("gfx906"))
        isa = it.isa()
        c = counts(main_loop(isa))
        where = f"{fmt} {kern.name} {[p.shape for p in kern.params]}"
        assert "vf_quantize_q8_1" in it.source and f"vf_dot_{fmt}" in it.source, where
        assert c["dot4"] >= 8, where                             # v_dot4_i32_i8 in the main loop
        assert c["dwordx4"] >= 1, where                          # weights through global_load_dwordx4
        assert c["flat"] == 0 and "flat_load" not in isa, where
        assert it.res["scratch_bytes"] == 0 and it.res["vgpr_spills"] == 0, where
        assert 1 <= it.res["waves_per_simd"] <= 9, (where, it.res)
        assert c["lds_per_byte"] <= 0.056, (where, c)
        assert "ds_bpermute" not in isa and "_dpp" in isa, where  # wave reductions through DPP (issue 8)


# ------------------------------------------------------------------------------ the q8_1 path's arithmetic
def round_half_away(v):
    """C's roundf, in float32."""
    return (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.float32)


def q8_1(x, residual=True):
    """x [K] (f32) as the kernels quantize it: per block of 32, step = max|x| / 127, t = x / step as
    x * (127 / max|x|) (divided when max|x| < 1e-30), q = roundf(t), r = roundf(128 (t - q)), all in
    float32.  Returns the float64 values step / 128 * (128 q + r), or step * q without the residual
    plane (``VEGAFUSE_QUANT_RESIDUAL=0``)."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    step = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        t = np.where(amax >= np.float32(1e-30), b * (np.float32(127) / amax),
                     np.where(step != 0, b / np.where(step != 0, step, 1), np.float32(0))).astype(np.float32)
    q = round_half_away(t)
    if not residual:
        return (step.astype(np.float64) * q).reshape(-1)
    r = round_half_away(((t - q) * np.float32(128)).astype(np.float32))
    return (step.astype(np.float64) / 128 * (128 * q.astype(np.float64) + r)).reshape(-1)


def q8_1_gemv(x, w, residual=True):
    """The int8 GEMV's result in float64: the activation through q8_1 (with its residual plane), the
    weights exact."""
    return np.stack([q8_1(row, residual) for row in np.atleast_2d(x)]) @ w.dequantize().astype(np.float64).T


def _shadowed(body, bound=()):
    """Names a statement binds while an enclosing statement already bound them (C would shadow)."""
    from codegen import loopir as L
    out, bound = [], set(bound)
    for s in body:
        names = [s.var] if isinstance(s, (L.Loop, L.Reduce)) else [s.name] if isinstance(s, (L.Declare, L.Array)) else []
        if isinstance(s, L.Reduce):
            names += [n for a in s.accs for n in (a.name, a.arg) if n]
        out += [n for n in names if n in bound]
        bound |= set(names)
        for sub in L.sub_bodies(s):
            out += _shadowed(sub, bound)
    return out


@pytest.mark.parametrize("target", ["gfx906", "sm_90", "sm_90_wave64"])
def test_mapped_segments_bind_fresh_names_in_canonical_form(target):
    """Kernels compile in canonical form (locals v0, v1, ...): the mapping's own names (a segment's
    tile, the fill's group) must not shadow another name there either."""
    from codegen.loopir import canonicalize
    from codegen.mapping import map_kernel
    from codegen.targets import get_target
    x, g = rng.standard_normal((1, 576)).astype(np.float32), rng.uniform(0.5, 1.5, 576).astype(np.float32)
    ws = [quantized((n, 576), "q4_0") for n in (576, 192, 192)]

    def qkv(x, g, wq, wk, wv):
        h = rms_norm(x, g)
        return dsl.dot_t(h, wq), dsl.dot_t(h, wk), dsl.dot_t(h, wv)
    (kern,) = lower_program(dsl.jit(qkv).lower(x, g, *ws)).kernels
    for k in (kern, canonicalize(kern)):
        assert _shadowed(map_kernel(k, get_target(target)).body) == []
