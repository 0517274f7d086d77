"""Kernel names come from the model's structure; ops carry the model's source line and scope."""
import re

import numpy as np
import pytest

import dsl
from dsl.core import source_text
from fusion.naming import MAX_LEN, kernel_name, layer_of, weight_name
from stdlib import nn

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def layer(n):
    return [f"layers_{n}_rms_norm_linear_wq_wk_wv_rope_kv_write", f"layers_{n}_causal_attention",
            f"layers_{n}_linear_wo_add", f"layers_{n}_rms_norm_linear_w_gate_w_up_silu_mul",
            f"layers_{n}_linear_w_down_add"]


@pytest.fixture(scope="module")
def plan():
    from codegen.inspect import decode_plan
    return decode_plan(context=64)


def test_smollm2_decode_kernels_are_named_after_the_model(plan):
    names = [k.name for k in plan.kernels]
    assert names[:5] == layer(0)
    assert names[15:20] == layer(3)
    assert names[-1] == "rms_norm_linear_embed"
    assert len(names) == 30 * 5 + 1
    assert len(set(names)) == len(names)
    for n in names:
        assert IDENT.match(n) and len(n) <= MAX_LEN, n
        assert not re.match(r"k\d{3}", n), n


def test_ops_point_at_the_model_line_not_the_helper(plan):
    k = plan.kernels[0]
    texts = [source_text(e) for e in k.eqns if e.prim.name == "dot"]
    assert [t.split("  ")[1] for t in texts] == [f'{x} = linear(h, p["w{x}"], p.get("b{x}"), p.get("w{x}_perm"))' for x in "qkv"]
    assert all(t.startswith("stdlib/llama.py:") for t in texts)
    norm = [e for e in k.eqns if e.scope == ("rms_norm",)]
    assert norm and all('rms_norm(x, p["attn_norm"]' in source_text(e) for e in norm)
    ffn = [e for e in plan.kernels[3].eqns if e.scope == ("rms_norm",)]
    assert ffn and all('p["ffn_norm"]' in source_text(e) for e in ffn)
    writes = [e for e in plan.kernels[0].eqns if e.prim.name == "dynamic_update_slice"]
    assert [e.scope for e in writes] == [("causal_attention", "kv_write")] * 2


def test_user_program_names_and_scopes():
    def f(x, g, w, b, y):
        h = nn.rms_norm(x, g, 1e-5)                  # (4, 16)
        z = dsl.exp(y) + 1.0                         # (4, 8): a plain elementwise kernel
        return nn.silu(nn.linear(h, w, b)) + 1.0, z
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((4, 16), np.float32), rng.standard_normal(16, np.float32),
            rng.standard_normal((8, 16), np.float32), rng.standard_normal(8, np.float32),
            rng.standard_normal((4, 8), np.float32))
    lowered = dsl.jit(f).lower(*args)
    c = lowered.compile()
    assert sorted(k.name for k in c.plan.kernels) == ["exp_add", "rms_norm_linear_w_silu_add"]
    eqns = lowered.program.eqns
    assert eqns[0].scope == ("rms_norm",) and eqns[-1].scope == ()
    assert eqns[0].source.endswith(f":{f.__code__.co_firstlineno + 1}")
    assert "h = nn.rms_norm(x, g, 1e-5)" in source_text(eqns[0])
    out, z = c(*args)
    ref, zref = lowered.program.run(*args, compute_dtype="f64")
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(z, zref, rtol=1e-5)


def test_names_are_unique_short_and_never_reserved_words():
    f = dsl.jit(lambda a, b: (dsl.exp(a), dsl.exp(b)), fusion={"horizontal": False})
    x = np.random.default_rng(1).standard_normal((3, 5), np.float32)
    c = f.compile(x, x + 1)
    assert [k.name for k in c.plan.kernels] == ["exp_k", "exp_k_2"]
    a, b = c(x, x + 1)
    np.testing.assert_allclose(a, np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(b, np.exp(x + 1), rtol=1e-6)

    def long(x):
        for _ in range(3):
            x = dsl.tanh(dsl.sin(dsl.cos(dsl.exp(x)))) * 2.0 - 1.0
            x = dsl.abs(x) / 3.0
        return x
    (k,) = dsl.jit(long).compile(x).plan.kernels
    assert len(k.name) <= MAX_LEN and IDENT.match(k.name) and k.name.startswith("exp_cos_sin_tanh")


def test_name_helpers():
    assert layer_of("params_layers_12_w_gate") == "layers_12" and layer_of("params_embed") is None
    assert weight_name("params_layers_12_w_gate") == "w_gate" and weight_name("params_lm_head") == "lm_head"
    assert kernel_name([], {}) == "kernel"


# ---------------------------------------------------------------- an output that is a view costs no kernel
def test_decode_step_has_no_reshape_only_kernel(plan):
    assert not [k.name for k in plan.kernels if {e.prim.name for e in k.eqns} <= {"reshape"}]
    logits = plan.outputs[0]
    assert logits[0] == "buf" and len(logits[2]) == 1 and plan.buffers[logits[1]][0] == (1, logits[2][0])


def test_view_outputs_alias_their_base_buffer():
    rng = np.random.default_rng()
    x, w = rng.standard_normal((2, 8), np.float32), rng.standard_normal((3, 8), np.float32)

    def f(x, w):
        y = x @ w.T                                       # (2, 3): materialized by the matmul
        s = dsl.sum(x * x, -1)                            # (2,)
        return y.reshape(-1), y[None], s[:, None], y.T[None].reshape(3, 2)
    lowered = dsl.jit(f).lower(x, w)
    c = lowered.compile()
    assert len(c.plan.kernels) == 3                       # matmul, sum, and the transpose (not a view)
    assert [o[2] for o in c.plan.outputs] == [(6,), (1, 2, 3), (2, 1), (3, 2)]
    assert c.plan.outputs[0][1] == c.plan.outputs[1][1]
    for got, ref in zip(c(x, w), lowered.program.run(x, w, compute_dtype="f64")):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    bufs = c.output_buffers()
    assert [b.shape for b in bufs] == [(6,), (1, 2, 3), (2, 1), (3, 2)]


def test_view_of_an_input_still_copies():
    x = np.random.default_rng().standard_normal((2, 3), np.float32)
    c = dsl.jit(lambda x: x.reshape(6)).compile(x)
    assert len(c.plan.kernels) == 1
    out = c(x)
    np.testing.assert_array_equal(out, x.reshape(6))
    out[0] = 99.0
    assert x[0, 0] != 99.0


def test_device_array_views_share_memory_and_never_free_it():
    from engine.devices.gpu import DeviceArray
    freed = []

    class Fake:
        def _free(self, a):
            freed.append(a.ptr)
    base = DeviceArray(Fake(), 4096, (1, 6), "f4")
    view = base.reshape((6,))
    assert view.shape == (6,) and view.ptr == base.ptr and view.nbytes == base.nbytes and view.base is base
    with pytest.raises(ValueError, match="cannot reshape"):
        base.reshape((7,))
    del view
    assert freed == []
    del base
    assert freed == [4096]


def test_greedy_decode_on_the_cpu_reads_the_argmax_through_its_view():
    from engine.model import Model
    from engine.weights import default_model_path, load_model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS
    cfg, params, _ = load_model(default_model_path())
    m = Model(cfg, params, context=32)
    m.prefill(PROMPT_IDS)
    ex = m.greedy_step.compile(m.params, np.zeros(1, np.int32), 0, 0, m.cache)
    assert ex.plan.outputs[0][2] == (1,) and ex.plan.buffers[ex.plan.outputs[0][1]][0] == ()
    assert [REFERENCE_IDS[0]] + m.decode_greedy(REFERENCE_IDS[0], 7) == REFERENCE_IDS[:8]


def test_buffers_are_named_after_the_model_variables(plan):
    """The buffers between kernels carry the model's variable and layer, not counters."""
    params = {k.name: [p.name for p in k.params if not p.name.startswith("params_")] for k in plan.kernels}
    # (the GPU plan: the q8_1 blocks a producer quantizes for the next GEMV, and where that GEMV normalizes
    # them, their blocks' sums of squares, fusion/q8.py)
    q8 = lambda names: [n for n in names if not n.endswith(("_q8", "_ss"))]     # noqa: E731
    assert q8(params["layers_3_rms_norm_linear_wq_wk_wv_rope_kv_write"])[-3:] == ["layers_3_q", "cache_3_0", "cache_3_1"]
    assert "layers_3_attention" in params["layers_3_causal_attention"]
    assert params["layers_3_linear_w_down_add"][:3] == ["layers_3_x", "layers_3_x_2", "layers_3_mul_q8"]
    assert set(params["layers_3_linear_w_down_add"][3:]) <= {"layers_3_x_2_q8", "layers_3_x_2_ss"}
    assert q8(params["rms_norm_linear_embed"])[-1] == "logits"
    names = [p.name for k in plan.kernels for p in k.params]
    assert not [n for n in names if re.fullmatch(r"[a-z_]+_\d{3,}", n)]          # no add_400-style counters


def test_buffer_names_avoid_c_words_and_clashes():
    rng = np.random.default_rng()
    x, y = rng.standard_normal((4, 8)).astype("f4"), rng.standard_normal((4, 8)).astype("f4")

    def f(x, y):
        int = dsl.exp(x) @ y.T          # noqa: A001  (a C keyword as the model's variable)
        a = dsl.logical_or(x > 0, y > 0)
        return int * 2.0, a, dsl.sum(int, -1)      # read by a reduction: int keeps its buffer
    c = dsl.jit(f).compile(x, y)
    names = [p.name for k in c.plan.kernels for p in k.params]
    assert "int_" in names and "int" not in names and "or" not in names
    got = c(x, y)
    np.testing.assert_allclose(got[0], (np.exp(x.astype(np.float64)) @ y.T) * 2.0, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], (x > 0) | (y > 0))
