"""Adversarial checks of the tiled matmul (``codegen/mma.py``), the q8_1 producer (``fusion/q8.py``) and
the GPU attention's budgets (``codegen/attention.py``): the fuzzer's tiled-matmul programs run as GPU
kernel text on the CPU (``tests/gpu_emulation.h``), and one test per bug found."""
import numpy as np
import pytest

import dsl
from dsl.core import DSLError
from engine.pipeline import lower_program
from tests import fuzz
from tests.test_mma import check, needs_gxx, tiled

rng = np.random.default_rng()


def tiled_program(seed, i):
    """A fuzz program of one ``tiled`` op (``tests/fuzz.py``) over a fresh (T, K) input: its source's
    function and inputs, or None when the op did not make one tiled kernel (an epilogue over a whole
    reduction is a second kernel)."""
    r = np.random.default_rng([seed, i])
    frac = lambda n: (np.floor(r.random(n) * 1000) / 1000).tolist()  # noqa: E731
    prog = {"inputs": [{"shape": [int(r.choice([15, 16, 40, 64, 65])), int(r.choice([32, 40, 64]))], "dtype": "f32"}],
            "ops": [{"op": "tiled", "pick": frac(3), "p": frac(4)}], "donate": False, "fusion": {}}
    try:
        src, _ = fuzz.program_source(seed, i, prog)
    except DSLError:
        return None
    ns = {}
    exec(src.split("jf = dsl.jit(")[0], ns)
    args = tuple(ns["args"])
    plan = lower_program(dsl.jit(ns["f"]).lower(*args))
    if len(plan.kernels) != 1 or tiled(plan.kernels[0], "gfx906") is None:
        return None
    return ns["f"], args, src


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_the_fuzzers_tiled_matmuls_run_as_gpu_text(target, tmp_path_factory):
    """A fresh sample of the fuzzer's tiled-matmul programs (rows, K and N at the rule's and the tiles'
    edges, every weight format, prologues and epilogues), the kernel text for ``target`` run on the CPU
    against the float64 interpreter."""
    seed, done = int(np.random.SeedSequence().entropy % 2 ** 31), 0
    for i in range(40):
        found = tiled_program(seed, i)
        if found is None:
            continue
        f, args, src = found
        try:
            check(f, args, target, str(tmp_path_factory.getbasetemp()))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, program {i}:\n{src}\n{str(e)[:2000]}") from e
        done += 1
        if done == 4:
            break
    assert done == 4, f"seed {seed}: only {done} tiled programs in 40"


def two_buffers(x, w1, w2, w3, w4):
    """One GEMV kernel storing two buffers (a and b side by side), each the activation of an int8 GEMV."""
    a, b = dsl.dot_t(x, w1), dsl.dot_t(x, w2)
    return dsl.dot_t(a, w3), dsl.dot_t(b, w4)


@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_a_producer_of_two_quantized_buffers_quantizes_both_by_arrival(target, tmp_path_factory):
    """fusion/q8.py gives a kernel that stores two int8 activations two q8_1 buffers; the mapping once
    turned only the last into arrivals (QuantizeStored) and left the other as a loop of the CPU's form,
    which no GPU compiles.  Both are quantized by arrival, the blocks equal the numpy model of the q8_1
    arithmetic bit for bit, the consumers match the float64 interpreter."""
    import shutil
    from codegen import loopir as L
    from codegen.targets import get_target
    from fusion.q8 import quantize_at_producers
    from tests.test_q8_producer import emulate, host_arrays, q8_blocks
    from tests.test_quant_kernels import q8_1, quantized
    if L.int8_activation() != "q8_1r":
        pytest.skip("the residual plane is off")
    args = (rng.standard_normal((1, 128)).astype(np.float32), quantized((96, 128), "q4_0"), quantized((64, 128), "q8_0"),
            quantized((40, 96), "q4_1"), quantized((24, 64), "q4_0"))
    prog = dsl.jit(two_buffers).lower(*args)
    plan = quantize_at_producers(lower_program(prog), "q8_1r")
    (prod,) = [k for k in plan.kernels if sum(p.dtype == "q8_1r" and p.role == "out" for p in k.params) == 2]
    from codegen.mapping import _stored_q8, map_kernel
    m = map_kernel(prod, get_target(target))
    assert sum(isinstance(s, L.QuantizeStored) for s in m.body) == 2, m.launch.how
    assert not any(_stored_q8(s) for s in m.body)
    if not shutil.which("g++"):
        pytest.skip("no g++ for the CPU emulation of the GPU kernel text")
    named = {n: a.device_bytes() if isinstance(a, dsl.QArray) else a for n, a in zip(plan.inputs, args)}
    bufs = {}
    for k in plan.kernels:
        outs = {}
        emulate(k, get_target(target, compute_units=3), host_arrays(k, {**named, **bufs}, outs),
                str(tmp_path_factory.getbasetemp()))
        bufs.update(outs)
    for q8 in [p.name for p in prod.params if p.dtype == "q8_1r"]:
        x = bufs[q8.removesuffix("_q8")].reshape(-1)
        np.testing.assert_array_equal(q8_blocks(bufs[q8], x.size)[0], q8_1(x))
    for o, w in zip(plan.outputs, prog.program.run(*args, compute_dtype="f64")):
        np.testing.assert_allclose(bufs[o[1]].reshape(w.shape), w, rtol=0, atol=2e-3 * np.abs(w).max())


@pytest.mark.parametrize("whole", ["1", "0"])
def test_a_producer_of_two_quantized_buffers_compiles_for_gfx906(whole, monkeypatch):
    """The two-buffer producer above at Qwen2.5-7B's widths: gfx906 compiles it with no scratch, at most
    9 waves per SIMD, both buffers quantized by the workgroups that store them (vf_quantize_staged), or by
    arrivals (vf_quantize_stored) with VEGAFUSE_Q8_WHOLE=0."""
    monkeypatch.setenv("VEGAFUSE_Q8_WHOLE", whole)
    from codegen.targets import get_target
    from fusion.q8 import quantize_at_producers
    from tests.test_quant_kernels import quantized
    try:
        from codegen.inspect import Inspected
        from engine.devices.rocm import find_hiprtc
        find_hiprtc()
    except Exception as e:                             # pragma: no cover - depends on the host
        pytest.skip(f"gfx906 compile skipped: {e}")
    args = (rng.standard_normal((1, 3584)).astype(np.float32), quantized((512, 3584), "q4_0"),
            quantized((3584, 3584), "q4_0"), quantized((64, 512), "q4_0"), quantized((64, 3584), "q4_0"))
    plan = quantize_at_producers(lower_program(dsl.jit(two_buffers).lower(*args)), "q8_1r")
    it = Inspected(plan.kernels[0], get_target("gfx906"))
    call = "vf_quantize_staged(" if whole == "1" else "vf_quantize_stored("
    assert it.source.split('extern "C"')[1].count(call) == 2     # two calls in the kernel
    assert it.res["scratch_bytes"] == 0 and 1 <= it.res["waves_per_simd"] <= 9, it.res


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("wdtype,width", [("f16", 76), ("f32", 66)])
def test_weight_rows_not_16_bytes_apart_are_staged_element_by_element(wdtype, width, target, tmp_path_factory):
    """``linear(x, w[:, :64])`` of a (48, width) weight: its rows start 152 (f16) or 264 (f32) bytes apart, so
    16-byte loads of 8 elements would be misaligned (NVIDIA traps); the tiled matmul once loaded them so.
    The emulation counts every 16-byte access off a 16-byte boundary (``test_mma.emulate``)."""
    w = (rng.standard_normal((48, width)) / 8).astype({"f16": np.float16, "f32": np.float32}[wdtype])
    x = rng.standard_normal((20, 64)).astype(np.float32)
    check(lambda x, w: dsl.dot_t(x, w[:, :64]), (x, w), target, str(tmp_path_factory.getbasetemp()),
          f32_weights=wdtype == "f32")


@pytest.mark.parametrize("v,template", [((4, 1, 7, 64, 64, "f2"), "scalar"), ((5, 1, 7, 60, 20, "f2"), "blocked"),
                                        ((5, 1, 7, 60, 36, "f2"), "blocked"), ((7, 1, 7, 60, 64, "f2"), "scalar")],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
def test_the_tiled_attention_template_over_a_one_tile_cache_has_no_scratch(v, template, monkeypatch):
    """The tiled prefill template (``VEGAFUSE_ATT_PREFILL=scalar``, and every prefill whose head rows are
    not whole 16-byte loads: head dim 20 or 36 in f16) over a cache of at most one tile: with the tile
    loop gone, the compiler unrolled the values loop whole (256 VGPRs and up to 632 bytes of scratch on
    gfx906).  No scratch, at most 9 waves per SIMD."""
    from codegen.targets import get_target
    from tests.emulation import HIP
    from tests.test_attention_gpu import attention_kernel
    if HIP:
        pytest.skip(f"gfx906 compile skipped: {HIP}")
    from codegen.inspect import Inspected
    monkeypatch.setenv("VEGAFUSE_ATT_PREFILL", template)
    r = Inspected(attention_kernel(*v), get_target("gfx906")).res
    assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0 and 1 <= r["waves_per_simd"] <= 9, r


@pytest.mark.parametrize("name", ["VEGAFUSE_ATT_VGPRS", "VEGAFUSE_ATT_CHUNK"])
def test_an_attention_switch_that_is_not_a_number_is_one_clear_line(name, monkeypatch):
    """``VEGAFUSE_ATT_VGPRS=abc`` once raised int()'s own message; it names the switch and the fix."""
    from codegen.mapping import map_kernel
    from codegen.targets import get_target
    from tests.test_attention_gpu import attention_kernel
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ValueError, match=f"^{name}='abc' is not a whole number; set it to one"):
        map_kernel(attention_kernel(4, 1, 1, 640, 64, "f2"), get_target("gfx906"))
