"""A top-2-of-8 MoE layer for one token: the expert gather fuses into the GEMVs.

``take(w, e)`` of stacked expert weights (E, N, K) with a routed id ``e`` (computed in the same
program) is read through its index inside the GEMV that consumes it: the kernels read the chosen
experts' rows only, and the fusion report charges each gather what it reaches (two experts of
one tensor add up), so the step's bytes are about k/E of the expert weights.
"""
import numpy as np
import pytest

import dsl
from codegen.loopir import buffer_traffic
from engine.pipeline import lower_program
from stdlib import nn

rng = np.random.default_rng()
E, TOP, D, F = 8, 2, 256, 512


def top2(logits):
    """The two largest of ``logits`` [E] (ids, values), largest first: two argmaxes."""
    e1 = dsl.argmax(logits)
    rest = dsl.where(dsl.arange(logits.shape[0]) == e1, float("-inf"), logits)
    e2 = dsl.argmax(rest)
    return (e1, e2), (dsl.max(logits), dsl.max(rest))


def moe(x, w_router, w_gate, w_up, w_down):
    """x [1, D]; w_router [E, D]; w_gate, w_up [E, F, D]; w_down [E, D, F] -> [1, D]."""
    (e1, e2), (l1, l2) = top2(dsl.dot_t(x, w_router).reshape(E))
    p2 = dsl.exp(l2 - l1)                                       # softmax over the two chosen
    out = 0.0
    for e, p in ((e1, 1.0 / (1.0 + p2)), (e2, p2 / (1.0 + p2))):
        h = nn.silu(dsl.dot_t(x, dsl.take(w_gate, e))) * dsl.dot_t(x, dsl.take(w_up, e))
        out = out + p * dsl.dot_t(h, dsl.take(w_down, e))
    return out


def numpy_moe(x, wr, wg, wu, wd):
    """The layer in float64 numpy, from the weights' float values."""
    x = x.astype(np.float64)[0]
    logits = wr.astype(np.float64) @ x
    top = np.argsort(-logits)[:TOP]
    p = np.exp(logits[top] - logits[top].max())
    p /= p.sum()
    out = np.zeros(D)
    for e, pe in zip(top, p):
        g, u = wg[e] @ x, wu[e] @ x
        out += pe * (wd[e] @ (g / (1 + np.exp(-g)) * u))
    return out[None]


def _weights(dtype):
    def make(shape, scale):
        w = rng.standard_normal(shape).astype(np.float32) * scale
        if dtype in ("q4_0", "q4_1", "q8_0"):
            q = dsl.QArray.quantize(w, dtype)
            return q, q.dequantize().astype(np.float64)
        w = w.astype(dtype)
        return w, w.astype(np.float64)
    return make((E, F, D), D ** -0.5), make((E, F, D), D ** -0.5), make((E, D, F), F ** -0.5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "q4_0", "q8_0"])
def test_top2_of_8_moe_matches_float64_and_reads_only_the_chosen_experts(dtype):
    x = rng.standard_normal((1, D)).astype(np.float32)
    wr = rng.standard_normal((E, D)).astype(np.float32)
    (wg, g64), (wu, u64), (wd, d64) = _weights(dtype)
    f = dsl.jit(moe)
    y = f(x, wr, wg, wu, wd)
    want = numpy_moe(x, wr, g64, u64, d64)
    # quantized experts: the GEMVs' int8 activation (q8_1 with its residual plane) is the error
    tol = 2e-5 if dtype == "float32" else 1e-3
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol * np.abs(want).max())

    c = f.compile(x, wr, wg, wu, wd)
    per_buffer = {}
    for k in c.plan.kernels:
        for name, n in buffer_traffic(k).items():
            per_buffer[name] = per_buffer.get(name, 0) + n
        if any(p.name in ("w_gate", "w_up", "w_down") for p in k.params):      # the gathers fuse into GEMVs
            assert k.family == "contract" and any(e.prim.name == "take" for e in k.eqns)
    for name, w in (("w_gate", wg), ("w_up", wu), ("w_down", wd)):
        assert per_buffer[name] == w.nbytes * TOP // E, name              # two experts of eight
    # the report's bytes: the chosen experts' weights, and little else
    report = c.fusion_report()
    total = sum(float(line.split()[2]) * 1e3 for line in report.splitlines()[1:])
    expert = (wg.nbytes + wu.nbytes + wd.nbytes) * TOP / E
    assert expert <= total + 1e3 and total < expert + wr.nbytes + 64e3, report
    inner = [shape for name, (shape, _) in c.plan.buffers.items() if name not in c.plan.inputs]
    assert all(np.prod(shape) < F * D for shape in inner), inner          # no copy of an expert is written


def test_batched_expert_gather_with_kn_down_weights():
    """``take(w, ids)`` of two experts feeding a batched matmul, the down weights stored (E, F, D)
    and read as (K, N): order k-outer, each gather charged its two experts."""
    from fusion.schedule import contract_orders
    x, ids = rng.standard_normal((1, D)).astype("f4"), np.array([5, 2], "i4")
    wg = rng.standard_normal((E, F, D)).astype("f2")
    wd = (rng.standard_normal((E, F, D)) * F ** -0.5).astype("f2")

    def f(x, ids, wg, wd):
        h = dsl.matmul(dsl.broadcast_to(x, (TOP, 1, D)), dsl.swapaxes(dsl.take(wg, ids), 1, 2))    # (2, 1, F)
        return dsl.matmul(h * dsl.sigmoid(h), dsl.take(wd, ids))                                  # (2, 1, D)
    j = dsl.jit(f)
    y = j(x, ids, wg, wd)
    g = np.einsum("d,efd->ef", x[0].astype("f8"), wg[ids].astype("f8"))
    want = np.einsum("ef,efd->ed", g / (1 + np.exp(-g)), wd[ids].astype("f8"))[:, None]
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    c = j.compile(x, ids, wg, wd)
    assert [contract_orders(k) for k in c.plan.kernels] == [("inner",), ("outer",)]
    for k in c.plan.kernels:
        for name in ("wg", "wd"):
            assert buffer_traffic(k).get(name, 0) in (0, wg.nbytes * TOP // E)


@pytest.mark.parametrize("dtype", ["float16", "q4_0"])
def test_fused_moe_kernels_compile_for_gfx906(dtype):
    """The gathered-expert GEMVs map like any GEMV: 16-byte loads of the expert's rows (f16), int8
    dot products over its blocks (q4_0), and compile for gfx906."""
    from codegen.hip import render_hip
    from codegen.mapping import map_kernel
    from codegen.targets import get_target
    x, wr = rng.standard_normal((1, D)).astype("f4"), rng.standard_normal((E, D)).astype("f4")
    (wg, _), (wu, _), (wd, _) = _weights(dtype)
    kernels = [k for k in lower_program(dsl.jit(moe).lower(x, wr, wg, wu, wd)).kernels
               if any(p.name == "w_gate" for p in k.params)]
    assert len(kernels) == 1
    m = map_kernel(kernels[0], get_target("gfx906"))
    src = render_hip(m, "gfx906")
    assert ("vf_dot8_h" if dtype == "float16" else "int8 dot products") in src.body + m.launch.how
    from engine.devices.rocm import HipUnavailable, compile_hip
    try:
        co = compile_hip(src.source, m.name)
    except HipUnavailable as err:                                  # pragma: no cover - depends on the host
        pytest.skip(f"gfx906 compile skipped: {err}")
    assert co.resources()["scratch_bytes"] == 0


@pytest.mark.parametrize("dtype", ["float16", "q4_0"])
@pytest.mark.parametrize("wave", [32, 64])
def test_moe_on_a_cuda_gpu(dtype, wave, monkeypatch):
    """The MoE layer on an NVIDIA GPU (at wave 64: gfx906's kernel text) against float64.
    Skipped without a CUDA device."""
    from engine.executable import get_device
    try:
        get_device("cuda", wave=wave)
    except Exception as err:                                       # no driver, no GPU, no cuda-python
        pytest.skip(f"CUDA test skipped: {err}")
    monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
    x, wr = rng.standard_normal((1, D)).astype("f4"), rng.standard_normal((E, D)).astype("f4")
    (wg, g64), (wu, u64), (wd, d64) = _weights(dtype)
    y = dsl.jit(moe, backend="cuda")(x, wr, wg, wu, wd)
    want = numpy_moe(x, wr, g64, u64, d64)
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
