"""A quantized GEMV's prologue in one pass (``codegen/prologue.py``): RMSNorm's scale multiplies each
row's dot product, the sum of squares is taken in the loop that quantizes ``x * g``.  The kernel text
of sm_90 (wave 32) and gfx906 (wave 64) run on the CPU (``tests/gpu_emulation.h``) against the q8_1
arithmetic modelled in numpy and the float64 interpreter, with the rule on and off
(``VEGAFUSE_NORM_AFTER_DOT=0``); and where the rule must not apply."""
import re

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.hip import render_hip
from codegen.mapping import map_kernel
from codegen.targets import get_target
from engine.pipeline import lower_program
from tests.emulation import GXX
from tests.test_q8_producer import emulate, host_arrays
from tests.test_quant_kernels import q8_1, quantized, rms_norm

rng = np.random.default_rng()


def abs_norm(x, g):
    """A scale that is not RMSNorm's: x / sqrt(sum |x| + 1) * g (its reduction adds |x|, not x * x)."""
    return x * dsl.rsqrt(dsl.sum(dsl.abs(x), axis=-1, keepdims=True) + 1.0) * g


def program(norm, K, N, fmt):
    x = (rng.standard_normal((1, K)) * rng.uniform(0.5, 20)).astype(np.float32)
    g, b = rng.uniform(0.5, 1.5, K).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    w = quantized((N, K), fmt)
    return (lambda x, g, w, b: dsl.dot_t(norm(x, g), w) + b), (x, g, w, b)


def contract(f, args):
    (k,) = [k for k in lower_program(dsl.jit(f).lower(*args)).kernels if k.family == "contract"]
    return k


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("norm", ["rms", "abs"])
@pytest.mark.parametrize("fmt,K,N", [("q4_0", 1536, 40), ("q8_0", 96, 24), ("gptq_int4", 1088, 16)])
@pytest.mark.parametrize("on", ["1", "0"])
def test_one_pass_prologue_matches_float64(target, norm, fmt, K, N, on, tmp_path_factory, monkeypatch):
    """K of 1536 (384 groups of 4 over 256 threads: the last trip part idle), 96 (fewer groups than
    threads) and 1088; the norm's scale from x * x (x read once) or from |x|: the text reads the
    input in one loop and scales each row's sum after its wave reduction; the output is the q8_1
    GEMV of ``x * g`` times the scale (the numpy model, bit-level quantization) and the float64
    interpreter's within the activation's quantization error."""
    monkeypatch.setenv("VEGAFUSE_NORM_AFTER_DOT", on)
    f, args = program(rms_norm if norm == "rms" else abs_norm, K, N, fmt)
    x, g, w, b = args
    k = contract(f, args)
    named = {"x": x, "g": g, "w": w.device_bytes(), "b": b}
    outs = {}
    h = emulate(k, get_target(target, compute_units=3), host_arrays(k, named, outs), str(tmp_path_factory.getbasetemp()))
    (got,) = outs.values()
    body = h.body
    one = "multiplies each row's dot product" in body
    assert one == (on == "1"), body
    fill = body[body.index("vf_quantize_q8_1(") - 600:body.index("vf_quantize_q8_1(")]
    scale = re.search(r"float (rsqrt\w*) = ", body).group(1)
    if one:                                      # the fill does not wait on the scale; each row's sum takes it
        assert body.index(f"float {scale} = ") > body.index("vf_quantize_q8_1(") and f"* {scale}" in body
        assert body[:body.index("for (int tile")].count("for (int") == 1, body   # one loop before the rows
        if norm == "rms":
            assert "x0 * x0 + x1 * x1" in body and "x[" not in body[body.index("vf_quantize_q8_1("):
                                                                    body.index("vf_block_sum")], body
    else:
        assert scale in fill
    xs = x.astype(np.float64).reshape(-1)
    s = 1 / np.sqrt(np.mean(xs * xs) + 1e-5) if norm == "rms" else 1 / np.sqrt(np.abs(xs).sum() + 1.0)
    deq = w.dequantize().astype(np.float64)
    h_act = (x.reshape(-1) * g) if one else (x.reshape(-1) * np.float32(s) * g)
    model = (q8_1(h_act.astype(np.float32)) @ deq.T) * (s if one else 1.0) + b
    mag = (np.abs(xs * g) * s) @ np.abs(deq).T
    np.testing.assert_allclose(got.reshape(-1), model, rtol=0, atol=1e-5 * mag.max() + 1e-6)
    want = dsl.jit(f).lower(*args).program.run(*args, compute_dtype="f64")[0].reshape(-1)
    np.testing.assert_allclose(got.reshape(-1), want, rtol=0, atol=2e-3 * mag.max() + 1e-5)


def test_the_rule_leaves_other_prologues_alone():
    """The norm's scale also read by the epilogue, a float GEMV (its fill lost on the H200), and a GEMV
    without a norm: no Reduce carries a fill."""
    x, g = rng.standard_normal((1, 256)).astype(np.float32), rng.uniform(0.5, 1.5, 256).astype(np.float32)
    wq, wf = quantized((64, 256), "q4_0"), (rng.standard_normal((64, 256)) * 0.1).astype(np.float16)
    def twice(x, g, w):
        s = dsl.rsqrt(dsl.mean(x * x, axis=-1, keepdims=True) + 1e-5)
        return dsl.dot_t(x * s * g, w) * s
    cases = [(twice, (x, g, wq)),
             (lambda x, g, w: dsl.dot_t(rms_norm(x, g), w), (x, g, wf)),
             (lambda x, g, w: dsl.dot_t(x * g, w), (x, g, wq))]
    for f, args in cases:
        for k in lower_program(dsl.jit(f).lower(*args)).kernels:
            for t in ("sm_90", "gfx906"):
                m = map_kernel(k, get_target(t))
                assert not any(isinstance(s, L.Reduce) and s.body for s in L.walk_stmts(m.body)), (t, render_hip(k, t).body)
    f, args = program(rms_norm, 256, 64, "q4_0")
    m = map_kernel(contract(f, args), get_target("sm_90"))
    assert any(isinstance(s, L.Reduce) and s.body for s in L.walk_stmts(m.body))
