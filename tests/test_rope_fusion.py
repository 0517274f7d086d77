"""The paired_epilogue rule: RoPE and the KV-cache write in the QKV GEMV's epilogue.

A Llama decoder layer (``stdlib.llama.block``) runs as five kernels with the rule on (QKV +
RoPE + KV write, attention, O, gate/up, down) and six with it off; both against the float64
interpreter on fresh random inputs, for decode and prefill, f16/f32/quantized weights, with and
without bias (Qwen2, SmolLM), f16 and f32 caches, grouped-query attention.
"""
import numpy as np
import pytest

import dsl
from stdlib import llama, nn
from stdlib.config import LlamaConfig

rng = np.random.default_rng()


def randn(*shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def weight(n, k, dtype):
    w = randn(n, k, scale=k ** -0.5)
    return dsl.QArray.quantize(w, dtype) if dtype.startswith("q") else w.astype(dtype)


def layer_args(T, bias, wdtype, cache_dtype, hq=4, hkv=2, hd=16, D=64, F=96, S=32):
    cfg = LlamaConfig(vocab_size=64, dim=D, n_layers=1, n_heads=hq, n_kv_heads=hkv, head_dim=hd, ffn_dim=F,
                      max_seq_len=S, qkv_bias=bias, rope_theta=10000.0)
    p = {"attn_norm": randn(D), "ffn_norm": randn(D), "wq": weight(hq * hd, D, wdtype),
         "wk": weight(hkv * hd, D, wdtype), "wv": weight(hkv * hd, D, wdtype), "wo": weight(D, hq * hd, wdtype),
         "w_gate": weight(F, D, wdtype), "w_up": weight(F, D, wdtype), "w_down": weight(D, F, wdtype)}
    if bias:
        p.update(bq=randn(hq * hd), bk=randn(hkv * hd), bv=randn(hkv * hd))
    kc, vc = randn(hkv, S, hd, dtype=cache_dtype), randn(hkv, S, hd, dtype=cache_dtype)
    return cfg, p, randn(T, D), kc, vc, int(rng.integers(0, S - T))


def run_layer(cfg, p, x, kc, vc, pos, rule, tol):
    """The layer fused (rule on or off) against the f64 interpreter; returns the compiled plan."""
    f = dsl.jit(lambda params, x, kc, vc, pos: llama.block(cfg, params, x, kc, vc, pos), backend="cpu",
                donate_argnums=(2, 3), fusion={"paired_epilogue": rule})
    args = (p, x, kc, vc, pos)
    low = f.lower(*args)
    want = low.program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = dsl.tree_flatten(f(p, x, kc.copy(), vc.copy(), pos))[0]
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()))
    return f.compile(*args)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("wdtype,cache_dtype", [("f2", "f4"), ("f4", "f2"), ("q8_0", "f2"), ("q4_1", "f4")])
def test_layer_with_rope_and_kv_write_in_the_qkv_gemv(T, bias, wdtype, cache_dtype):
    cfg, p, x, kc, vc, pos = layer_args(T, bias, wdtype, cache_dtype)
    tol = 2e-2 if wdtype.startswith("q") or cache_dtype == "f2" else 2e-3
    on = run_layer(cfg, p, x, kc, vc, pos, True, tol)
    off = run_layer(cfg, p, x, kc, vc, pos, False, tol)
    names = [k.name for k in on.plan.kernels]
    assert len(names) == 5, names
    assert len(off.plan.kernels) == 6
    qkv = on.plan.kernels[0]
    assert qkv.name.endswith("linear_wq_wk_wv_rope_kv_write"), qkv.name
    assert {"rope", "kv_write"} <= {w for e in qkv.eqns for w in e.scope}
    assert on.plan.aliases == {"kc": "kc", "vc": "vc"} or set(on.plan.aliases.values()) == {"kc", "vc"}


def test_paired_rows_are_sibling_accumulators_of_one_loop():
    """Rotate-half reads row j + hd/2: q and k each pair rows j and j + hd/2 in one output loop
    (two accumulators, like gate/up); v stores each row alone."""
    cfg, p, x, kc, vc, pos = layer_args(1, False, "f2", "f4", hq=2, hkv=1, hd=8)
    c = run_layer(cfg, p, x, kc, vc, pos, True, 2e-3)
    from codegen import loopir as L
    qkv = c.plan.kernels[0]
    loops = [s for s in L.walk_stmts(qkv.body) if isinstance(s, L.Loop) and s.parallel]
    accs = [[a.name for a in s.body[0].accs] for s in loops]
    assert [len(a) for a in accs] == [2, 2, 1], accs
    assert [s.stop.value for s in loops] == [8, 4, 8]          # q: 2 heads x 4 pairs; k: 1 x 4; v: 8 rows
    assert any(n.startswith("acc_wq_lo") for n in accs[0]) and any(n.startswith("acc_wq_hi") for n in accs[0])


def test_interleaved_rotation_pairs_neighbouring_rows():
    """A GPT-J style rotation (pairs 2i, 2i + 1) pairs rows at distance 1, by the same rule."""
    def rope_interleaved(x, pos):                         # x (H, T, hd)
        H, T, hd = x.shape
        inv = dsl.exp(dsl.arange(hd // 2, dtype="f32") * (-2.0 * np.log(10000.0) / hd))
        ang = (dsl.arange(T) + pos).astype("f32")[:, None] * inv[None, :]          # (T, hd/2)
        cos, sin = dsl.cos(ang), dsl.sin(ang)
        pairs = x.reshape(H, T, hd // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return dsl.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(H, T, hd)

    def f(x, g, wk, kc, pos):
        k = nn.linear(nn.rms_norm(x, g, 1e-5), wk)                                 # (T, H*hd)
        k = rope_interleaved(k.reshape(1, 2, 16).transpose(1, 0, 2), pos)
        return dsl.dynamic_update_slice(kc, k, [0, pos, 0])

    args = randn(1, 64), randn(64), randn(32, 64, dtype=np.float16), randn(2, 8, 16), 3
    jf = dsl.jit(f, backend="cpu", donate_argnums=(3,))
    want = jf.lower(*args).program.run(*args, compute_dtype="f64")[0]
    got = jf(*[a.copy() if isinstance(a, np.ndarray) else a for a in args])
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    (k,) = jf.compile(*args).plan.kernels
    assert k.family == "contract"
