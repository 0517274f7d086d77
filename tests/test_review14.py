"""Adversarial checks of the int8 GEMV producer whose workgroups quantize the q8_1 blocks they store
whole (``codegen.mapping._whole_trips``, ``vf_quantize_own``): fresh random inputs, the GPU kernel
text through the CPU emulation against the numpy model of q8_1 and the float64 interpreter."""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.hip import render_hip
from codegen.targets import get_target
from engine.pipeline import lower_program
from fusion.q8 import quantize_at_producers
from tests.emulation import GXX, HIP
from tests.test_q8_producer import emulate, host_arrays, q8_blocks
from tests.test_quant_kernels import q8_1, quantized

rng = np.random.default_rng()
needs_gxx = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")


def gate_and_side(x, w_gate, w_side, w_down):
    """A producer of two segments: the down projection's activation (whole blocks from row 0) and a
    plain output of ``w_side``'s rows."""
    a = dsl.dot_t(x, w_gate)
    return dsl.dot_t(a * dsl.sigmoid(a), w_down), dsl.dot_t(x, w_side)


def run_plan(f, args, target, tmp):
    """The GPU plan of ``f`` with the producer's q8_1 blocks, its kernels' text run through the CPU
    emulation on ``target`` (twice: the workgroups in order, then reversed); checked against the
    numpy model of the blocks and the float64 interpreter.  Returns the rendered kernels."""
    prog = dsl.jit(f).lower(*args)
    plan = quantize_at_producers(lower_program(prog), L.int8_activation())
    want = prog.program.run(*args, compute_dtype="f64")
    named = {n: a.device_bytes() if isinstance(a, dsl.QArray) else a for n, a in zip(plan.inputs, args)}
    for run in range(2):
        bufs, hs = {}, []
        for k in plan.kernels:
            outs = {}
            hs.append(emulate(k, target, host_arrays(k, {**named, **bufs}, outs), tmp, reversed_=run == 1))
            bufs.update(outs)
        q8s = [n for n in bufs if n.endswith("_q8")]
        assert q8s
        for name in q8s:
            x = bufs[name[:-3]].reshape(-1)
            np.testing.assert_array_equal(q8_blocks(bufs[name], x.size)[0], q8_1(x), err_msg=f"{name} run {run}")
        for (name, buf, *_), w in zip(plan.outputs, want):
            w = np.asarray(w, np.float64).reshape(-1)
            np.testing.assert_allclose(bufs[buf].reshape(-1), w, rtol=0, atol=2e-2 * np.abs(w).max() + 1e-4,
                                       err_msg=f"{name} run {run}")
    return plan, hs


@needs_gxx
def test_the_emulated_wave_64_keeps_a_producer_within_its_15_waves(tmp_path):
    """gfx906's mapping of this producer takes 2 rows a lane (the side output's 34 rows), 8 rows a
    trip, and ``_whole_trips`` took workgroups of 1024 threads for it; the emulated wave 64 maps kernels
    as gfx906 does but holds at most 15 waves a workgroup: its producer keeps a workgroup it can launch
    (it failed to render), and its text computes the q8_1 blocks and outputs."""
    D, F, S = 1088, 128, 34
    args = (rng.standard_normal((1, D)).astype(np.float32), quantized((F, D), "q4_0"), quantized((S, D), "q4_0"),
            quantized((40, F), "q4_0"))
    plan = quantize_at_producers(lower_program(dsl.jit(gate_and_side).lower(*args)), L.int8_activation())
    producer = plan.kernels[0]
    assert any(p.dtype in L.ACT_Q8 and p.role == "out" for p in producer.params)
    t = get_target("sm_90_wave64", compute_units=3)
    assert render_hip(producer, t).block[0] <= 15 * 64
    run_plan(gate_and_side, args, t, str(tmp_path))


def test_a_wide_gate_up_renders_for_the_emulated_wave_64():
    """D = 8192, F = 1024: gfx906 splits each row over 2 waves (8 rows a trip), and ``_whole_trips``
    took workgroups of 1024 threads for whole blocks; the emulated wave 64 renders its producer
    within 15 waves."""
    from tests.test_q8_producer import mlp
    D, F = 8192, 1024
    x, g = rng.standard_normal((1, D)).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32)
    args = (x, g, quantized((F, D), "q4_0"), quantized((F, D), "q4_0"), quantized((D, F), "q4_0"))
    plan = quantize_at_producers(lower_program(dsl.jit(mlp).lower(*args)), L.int8_activation())
    producer = plan.kernels[0]
    h = render_hip(producer, get_target("sm_90_wave64"))
    assert h.block[0] <= 15 * 64 and "vf_quantize_" in h.body


@pytest.mark.skipif(bool(HIP), reason=f"gfx906 compile skipped: {HIP}")
def test_a_gfx906_producer_keeps_the_registers_of_its_8_rows_a_lane():
    """D = 8192, F = 1024 on gfx906: 8 rows a lane (about 90 VGPRs), 8 rows a trip; a workgroup of
    1024 threads holds 4 waves per SIMD, 64 VGPRs each, and spilled.  The producer's workgroup stays
    within the target's ``whole_block``: no scratch, no spills (the ISA gates)."""
    from codegen.inspect import Inspected
    from tests.test_q8_producer import mlp
    D, F = 8192, 1024
    x, g = rng.standard_normal((1, D)).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32)
    args = (x, g, quantized((F, D), "q4_0", 0.05), quantized((F, D), "q4_0", 0.05), quantized((D, F), "q4_0", 0.05))
    plan = quantize_at_producers(lower_program(dsl.jit(mlp).lower(*args)), L.int8_activation())
    t = get_target("gfx906")
    it = Inspected(plan.kernels[0], t)
    assert "vf_quantize_" in it.hip.body
    assert it.res["scratch_bytes"] == 0 and it.res["vgpr_spills"] == 0, (it.hip.block, it.res)
    assert it.hip.block[0] <= t.whole_block
