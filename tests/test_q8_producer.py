"""A GEMV activation quantized once, by the GEMV that produces it (``fusion/q8.py``; on GPUs): the plan
step, the kernel text of the producer (whole blocks by their workgroup, ``vf_quantize_staged``, or per-block
arrivals, ``vf_quantize_stored``) and of the consumer (its q8_1 blocks copied into LDS), run on the CPU
through ``tests/gpu_emulation.h`` at wave 32 (sm_90's text) and 64 (gfx906's) against the q8_1
arithmetic modelled in numpy and the float64 interpreter, and the gfx906 compile with its ISA gates.
``tests/test_cuda.py`` runs the same on an NVIDIA GPU."""

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen import prelude
from codegen.hip import render_hip
from codegen.inspect import Inspected, counts, main_loop
from codegen.targets import get_target
from engine.pipeline import lower_program
from fusion.q8 import quantize_at_producers
from tests.test_quant_kernels import q8_1, quantized, rms_norm
from tests.emulation import GXX, HIP, emulated, launch

rng = np.random.default_rng()


def mlp(x, g, w_gate, w_up, w_down):
    """A Llama MLP: RMSNorm, gate/up with SiLU * up, down with the residual."""
    h = rms_norm(x, g)
    a = dsl.dot_t(h, w_gate)
    return x + dsl.dot_t(a * dsl.sigmoid(a) * dsl.dot_t(h, w_up), w_down)


def two_segments(x, w_side, w_gate, w_down):
    """A producer whose quantized output is its second segment (rows after another weight's)."""
    a = dsl.dot_t(x, w_gate)
    return dsl.dot_t(x, w_side), dsl.dot_t(a * dsl.sigmoid(a), w_down)


def case(name, fmt="q4_0"):
    """(function, inputs) of a test program: ``mlp`` with D = 1088 (a wave per row) and F = 416 (not a
    multiple of a round of workgroup trips), or ``two_segments`` with the quantized buffer after 48 rows."""
    if name == "mlp":
        D, F = 1088, 416
        args = (rng.standard_normal((1, D)).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32),
                quantized((F, D), fmt), quantized((F, D), fmt), quantized((D, F), fmt))
        return mlp, args
    D, F = 1088, 352
    args = (rng.standard_normal((1, D)).astype(np.float32), quantized((48, D), fmt), quantized((F, D), fmt),
            quantized((40, F), fmt))
    return two_segments, args


def gpu_plan(f, args):
    return quantize_at_producers(lower_program(dsl.jit(f).lower(*args)), L.int8_activation())


def test_the_plan_quantizes_the_down_projections_activation_in_the_gate_up_kernel(monkeypatch):
    f, args = case("mlp")
    plan = gpu_plan(f, args)
    up, down = [k for k in plan.kernels if k.family == "contract"]
    (q8,) = [p for p in up.params if p.dtype == "q8_1r"]
    assert q8.role == "out" and [p.name for p in down.params if p.dtype == "q8_1r"] == [q8.name]
    assert plan.buffers[q8.name][0] == (416 * 72 // 32,)
    (mul,) = [p.name for p in up.params if p.role == "out" and p.dtype == "f32"]
    assert mul not in {p.name for p in down.params}          # the consumer reads only the q8_1 blocks
    fills = [s for s in L.walk_stmts(down.body) if isinstance(s, L.Store) and isinstance(s.value, L.QLoad)]
    assert len(fills) == 1 and fills[0].value.buf == q8.name
    monkeypatch.setenv("VEGAFUSE_Q8_PRODUCER", "0")
    base = lower_program(dsl.jit(f).lower(*args))
    assert quantize_at_producers(base, "q8_1r") is base


def normed(x, g, w1, w2):
    """A producer (a GEMV with a residual) whose output a second GEMV reads through RMSNorm."""
    y = x + dsl.dot_t(x, w1)
    return dsl.dot_t(rms_norm(y, g), w2)


def normed_case(D=1088, N=40, fmt="q4_0"):
    x = (rng.standard_normal((1, D)) * rng.uniform(0.5, 4)).astype(np.float32)
    return (x, rng.uniform(0.5, 1.5, D).astype(np.float32), quantized((D, D), fmt, 0.05), quantized((N, D), fmt))


def test_a_normalizing_consumer_reads_x_times_g_in_q8_1_blocks_and_the_block_sums_of_squares(monkeypatch):
    """RMSNorm before the GEMV: the producer quantizes ``y * g`` and stores each block's sum of ``y * y``;
    the consumer adds the sums, copies the blocks and no longer reads ``y`` or ``g``;
    ``VEGAFUSE_NORM_AT_PRODUCER=0`` leaves the consumer's own prologue."""
    args = normed_case()
    plan = gpu_plan(normed, args)
    up, down = plan.kernels
    g = plan.inputs[1]
    (q8,) = [p.name for p in up.params if p.dtype in L.ACT_Q8 and p.role == "out"]
    (ss,) = [p.name for p in up.params if p.name.endswith("_ss") and p.role == "out"]
    assert plan.buffers[ss][0] == (1088 // 32,) and g in {p.name for p in up.params}
    names = {p.name for p in down.params}
    assert {q8, ss} <= names and g not in names and not ({p.name for p in up.params if p.role == "out"} - {q8, ss}) & names
    fills = [s for s in L.walk_stmts(down.body) if isinstance(s, L.Store) and isinstance(s.value, L.QLoad)]
    assert len(fills) == 1 and fills[0].value.buf == q8
    monkeypatch.setenv("VEGAFUSE_NORM_AT_PRODUCER", "0")
    base = lower_program(dsl.jit(normed).lower(*args))
    assert quantize_at_producers(base, "q8_1r") is base


def test_a_norm_weight_not_ready_before_the_producer_or_a_single_block_keeps_the_consumers_quantization():
    """The norm weight ``g`` written by a later kernel or by the producer itself (the producer would read
    it before it is stored), and a row of one block (K = 32): the consumer quantizes its own input; the
    plan maps for both targets."""
    def g_later(x, z, w1, wg, w2):
        y = x + dsl.dot_t(x, w1)
        g = dsl.dot_t(z, wg)
        return dsl.dot_t(rms_norm(y, g), w2), g

    def g_beside(x, z, w1, wg, w2):
        y = x + dsl.dot_t(x, w1)
        g = dsl.dot_t(x, wg)
        return dsl.dot_t(rms_norm(y, g), w2), g
    D = 1088
    args = (rng.standard_normal((1, D)).astype(np.float32), rng.standard_normal((1, D)).astype(np.float32),
            quantized((D, D), "q4_0"), quantized((D, D), "q4_0"), quantized((40, D), "q4_0"))
    for f in (g_later, g_beside):
        plan = gpu_plan(f, args)
        assert not any(p.name.endswith("_ss") for k in plan.kernels for p in k.params), f.__name__
    args = normed_case(32, 8)
    for target in (None, get_target("sm_90"), get_target("gfx906")):
        plan = quantize_at_producers(lower_program(dsl.jit(normed).lower(*args)), "q8_1r", target)
        assert not any(p.name.endswith("_ss") for k in plan.kernels for p in k.params)
        for k in plan.kernels:
            render_hip(k, target or get_target("sm_90"))


def test_a_consumer_with_another_norm_keeps_its_own_quantization():
    """A norm whose reduction is not ``x * x`` (it adds ``|x|``): left alone."""
    x, g = rng.standard_normal((1, 64)).astype(np.float32), rng.uniform(0.5, 1.5, 64).astype(np.float32)
    w1, w2 = quantized((64, 64), "q4_0"), quantized((32, 64), "q4_0")

    def absnorm(x, g, w1, w2):
        y = x + dsl.dot_t(x, w1)
        return dsl.dot_t(y * dsl.rsqrt(dsl.sum(dsl.abs(y), axis=-1, keepdims=True) + 1.0) * g, w2)
    plan = gpu_plan(absnorm, (x, g, w1, w2))
    assert not any(p.dtype in L.ACT_Q8 for k in plan.kernels for p in k.params)


def emulate(k, target, arrays, tmp, reversed_=False):
    """Run the kernel text of ``k`` (mapped for ``target``) on the CPU: ``gpu_emulation.h`` with the
    portable int8 helpers of the NVIDIA prelude; ``arrays`` in the order of the parameters; the
    workgroups one after another, from the last when ``reversed_``."""
    h = render_hip(k, target)
    q8 = next(p.dtype for p in k.params if p.dtype in L.ACT_Q8 or p.dtype in L.QUANT_DTYPES)
    act = "q8_1" if L.int8_activation() == "q8_1" else "q8_1r"
    helpers = (prelude._NV_WAVE_SUM + prelude._COMMON.format() + prelude.nv_int8()
               + prelude._QUANT.format(activation=prelude._OVER_STEP + (prelude._Q8_1 if act == "q8_1" else prelude._Q8_1R),
                                       stored=prelude._STORED))
    assert q8
    defines = (f"#define VF_BLOCK {h.block[0]}\n#define VF_ATT_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n"
               "#define VF_UNROLL_K\ntypedef unsigned char vf_byte;\n")
    launch(emulated(h, tmp, defines, helpers), h, arrays, reversed_)
    return h


def q8_blocks(raw, n):
    """The values of n / 32 q8_1 blocks with a residual plane (72 bytes each: 32 int8 quants, 32 int8
    residuals, f32 d and s) in float64, and each block's s."""
    b = raw.reshape(n // 32, 72)
    q, r = b[:, :32].view(np.int8).astype(np.float64), b[:, 32:64].view(np.int8).astype(np.float64)
    d, s = (b[:, 64:72].copy().view(np.float32).astype(np.float64)[:, i] for i in (0, 1))
    return (d[:, None] * (128 * q + r)).reshape(-1), s, d[:, None] * (128 * q + r)


def host_arrays(k, named, outputs):
    """numpy arrays in the order of ``k``'s parameters: inputs by name, outputs (f32, or q8_1 bytes)
    filled with NaN / garbage so that anything left unwritten shows."""
    out = []
    for p in k.params:
        if p.name in named:
            out.append(named[p.name])
        elif p.dtype in L.ACT_Q8:
            outputs[p.name] = np.full(int(p.size * L.ITEMSIZE[p.dtype]), 0x7f, np.uint8)
            out.append(outputs[p.name])
        elif p.dtype in L.QUANT_DTYPES:
            raise AssertionError(p)
        else:
            outputs[p.name] = np.full(p.shape, np.nan, np.float32)
            out.append(outputs[p.name])
    return out


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("name", ["mlp", "two"])
@pytest.mark.parametrize("whole,stage", [("1", "1"), ("1", "0"), ("0", "1")])
def test_the_producer_writes_the_blocks_of_its_fill_and_the_consumer_reads_them(name, target, whole, stage,
                                                                               tmp_path_factory, monkeypatch):
    """Few compute units (workgroups take several trips, the last round ragged), run twice, the
    workgroups in order, then from the last to the first (a block completed early would show); the
    blocks quantized by the workgroup whose trips store them whole (from the values it also kept in
    LDS, ``vf_quantize_staged``, or with ``VEGAFUSE_Q8_STAGE=0`` read back, ``vf_quantize_own``), or with
    ``VEGAFUSE_Q8_WHOLE=0`` by the last of the workgroups that store into them (the counts set back to
    zero for the second run): the producer's q8_1 blocks are the numpy model of the fill's arithmetic
    of its float output, bit for bit; the consumer's output is the q8_1 GEMV of them and the float64
    interpreter's within the activation's quantization error."""
    if L.int8_activation() != "q8_1r":
        pytest.skip("the residual plane is off")
    monkeypatch.setenv("VEGAFUSE_Q8_WHOLE", whole)
    monkeypatch.setenv("VEGAFUSE_Q8_STAGE", stage)
    t = get_target(target, compute_units=3)
    tmp = str(tmp_path_factory.getbasetemp())
    for run in range(2):
        f, args = case(name)
        prog = dsl.jit(f).lower(*args)
        plan = quantize_at_producers(lower_program(prog), "q8_1r")
        named = {n: a.device_bytes() if isinstance(a, dsl.QArray) else a for n, a in zip(plan.inputs, args)}
        bufs = {}
        contracts = [k for k in plan.kernels if k.family == "contract"]
        assert len(contracts) == len(plan.kernels)
        for k in plan.kernels:
            outs = {}
            arrays = host_arrays(k, {**named, **bufs}, outs)
            h = emulate(k, t, arrays, tmp, reversed_=run == 1)
            bufs.update(outs)
            if k is plan.kernels[0]:                   # "two" stores its buffer from row 48: not whole blocks
                own = whole == "1" and name == "mlp"
                call = ("vf_quantize_staged(" if stage == "1" else "vf_quantize_own(") if own else "vf_quantize_stored("
                assert call in h.body, h.kernel.launch.how
        q8name = next(n for n in bufs if n.endswith("_q8"))
        (src,) = [p.name for p in plan.kernels[0].params if p.role == "out" and p.dtype == "f32" and q8name == p.name + "_q8"]
        x = bufs[src].reshape(-1)
        got, s, blocks = q8_blocks(bufs[q8name], x.size)
        np.testing.assert_array_equal(got, q8_1(x), err_msg=f"{target} run {run}")
        np.testing.assert_allclose(s, blocks.sum(axis=1), rtol=1e-6, atol=1e-30)
        want = prog.program.run(*args, compute_dtype="f64")
        final = bufs[plan.outputs[-1][1]].reshape(-1)
        w_down = args[-1]
        deq = w_down.dequantize().astype(np.float64)
        model = q8_1(x) @ deq.T + (args[0].astype(np.float64).reshape(-1) if name == "mlp" else 0.0)
        scale = np.abs(x.astype(np.float64)) @ np.abs(deq).T
        np.testing.assert_allclose(final, model, rtol=0, atol=1e-5 * scale.max() + 1e-6, err_msg=h.kernel.launch.how)
        np.testing.assert_allclose(final, np.asarray(want[-1]).reshape(-1), rtol=0, atol=2e-3 * scale.max() + 1e-5)




@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("D,whole,fmt", [(1088, "1", "q4_0"), (1088, "0", "q8_0"), (96, "1", "q4_0"), (1536, "1", "q8_0")])
def test_the_producer_quantizes_the_normalized_input_of_its_consumer(target, D, whole, fmt, tmp_path_factory,
                                                                    monkeypatch):
    """``y = x + x W1^T`` then ``RMSNorm(y, g) W2^T``: the producer's q8_1 blocks are those of ``y * g``
    bit for bit (the numpy model of the fill's arithmetic), its block sums of squares those of ``y``; the
    consumer's output is the q8_1 GEMV of ``y * g`` times ``rsqrt(mean(y^2) + eps)`` and the float64
    interpreter's within the activation's quantization error.  Whole trips or arrivals
    (``VEGAFUSE_Q8_WHOLE=0``), workgroups in order and reversed, few compute units."""
    if L.int8_activation() != "q8_1r":
        pytest.skip("the residual plane is off")
    monkeypatch.setenv("VEGAFUSE_Q8_WHOLE", whole)
    t = get_target(target, compute_units=3)
    tmp = str(tmp_path_factory.getbasetemp())
    for run in range(2):
        args = normed_case(D, 40, fmt)
        prog = dsl.jit(normed).lower(*args)
        plan = quantize_at_producers(lower_program(prog), "q8_1r")
        named = {n: a.device_bytes() if isinstance(a, dsl.QArray) else a for n, a in zip(plan.inputs, args)}
        bufs, texts = {}, []
        for k in plan.kernels:
            outs = {}
            h = emulate(k, t, host_arrays(k, {**named, **bufs}, outs), tmp, reversed_=run == 1)
            bufs.update(outs)
            texts.append(h.body)
        assert ("vf_quantize_staged(" if whole == "1" else "vf_quantize_stored(") in texts[0]
        assert "vf_copy_q8_1(" in texts[1] and "vf_quantize_q8_1(" not in texts[1]
        (q8,) = [n for n in bufs if n.endswith("_q8")]
        (ss,) = [n for n in bufs if n.endswith("_ss")]
        y = bufs[q8[:-3]].reshape(-1)
        g = args[1]
        got, _, _ = q8_blocks(bufs[q8], D)
        np.testing.assert_array_equal(got, q8_1(y * g), err_msg=f"{target} run {run}")
        y64 = y.astype(np.float64)
        np.testing.assert_allclose(bufs[ss], (y64 * y64).reshape(-1, 32).sum(axis=1), rtol=1e-5)
        s = 1 / np.sqrt(np.mean(y64 * y64) + 1e-5)
        deq = args[3].dequantize().astype(np.float64)
        final = bufs[plan.outputs[-1][1]].reshape(-1)
        mag = (np.abs(y64 * g) * s) @ np.abs(deq).T
        np.testing.assert_allclose(final, (q8_1(y * g) @ deq.T) * s, rtol=0, atol=1e-5 * mag.max() + 1e-6)
        want = np.asarray(prog.program.run(*args, compute_dtype="f64")[-1]).reshape(-1)
        np.testing.assert_allclose(final, want, rtol=0, atol=2e-3 * mag.max() + 1e-5)


@pytest.mark.skipif(bool(HIP), reason=f"gfx906 compile skipped: {HIP}")
@pytest.mark.parametrize("fmt,whole", [("q4_0", "1"), ("q4_1", "1"), ("q8_0", "1"), ("gptq_int4", "1"), ("q4_0", "0")])
def test_producer_and_consumer_compile_for_gfx906_and_pass_the_isa_gates(fmt, whole, monkeypatch):
    """Qwen2.5-7B's MLP shapes: the gate/up kernel that also writes the down projection's q8_1 blocks
    (by its own workgroups, or by arrivals with ``VEGAFUSE_Q8_WHOLE=0``), and the down projection that
    copies them: int8 dot products and 16-byte weight loads in the main loop, no scratch or generic
    loads, at most 9 waves per SIMD, LDS per weight byte within the gate."""
    monkeypatch.setenv("VEGAFUSE_Q8_WHOLE", whole)
    x, g = rng.standard_normal((1, 3584)).astype(np.float32), rng.uniform(0.5, 1.5, 3584).astype(np.float32)
    ws = [quantized((18944, 3584), fmt, 0.05), quantized((18944, 3584), fmt, 0.05), quantized((3584, 18944), fmt, 0.05)]
    plan = gpu_plan(mlp, (x, g, *ws))
    up, down = plan.kernels
    for k, text in ((up, "vf_quantize_staged(" if whole == "1" else "vf_quantize_stored("), (down, "vf_copy_q8_1(")):
        it = Inspected(k, get_target("gfx906"))
        isa, c = it.isa(), counts(main_loop(it.isa()))
        assert text in it.source, k.name
        assert c["dot4"] >= 8 and c["dwordx4"] >= 1 and c["flat"] == 0 and "flat_load" not in isa, (k.name, c)
        assert it.res["scratch_bytes"] == 0 and it.res["vgpr_spills"] == 0, (k.name, it.res)
        assert 1 <= it.res["waves_per_simd"] <= 9 and c["lds_per_byte"] <= 0.056, (k.name, it.res, c)
    assert "vf_quantize_q8_1(act" not in Inspected(down, get_target("gfx906")).source


def test_the_gpu_device_checks_a_q8_1_buffer_against_the_bytes_the_plan_allocates():
    """Every kernel parameter of the GPU plan that names an intermediate buffer agrees with the buffer's
    (shape, dtype), the producer's q8_1 blocks included (the device checks each launch's arguments
    this way: ``engine.devices.gpu._storage``)."""
    from engine.devices.gpu import NP_DTYPES, _storage
    f, args = case("mlp")
    plan = gpu_plan(f, args)
    seen = 0
    for k in plan.kernels:
        for p in k.params:
            if p.kind != "scalar" and p.name in plan.buffers and p.name not in plan.inputs:
                shape, dt = plan.buffers[p.name]
                assert _storage(p) == (tuple(shape), NP_DTYPES[dt] if isinstance(dt, str) else dt), (k.name, p.name)
                seen += p.dtype in L.ACT_Q8
    assert seen == 2                                    # written by gate/up, read by down
