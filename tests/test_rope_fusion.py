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


def decode_step(cfg, params, S, rule):
    """One decode step of ``llama.forward`` (a random token at a random position, random caches)
    fused with the rule on or off, against the float64 interpreter: logits and caches."""
    from dataclasses import replace
    L = len(params["layers"])
    cfg = replace(cfg, n_layers=L)
    cache = [(randn(cfg.n_kv_heads, S, cfg.head_dim), randn(cfg.n_kv_heads, S, cfg.head_dim)) for _ in range(L)]
    tokens, pos = rng.integers(0, cfg.vocab_size, 1).astype(np.int32), int(rng.integers(0, S))
    f = dsl.jit(lambda params, tokens, pos, last, cache: llama.forward(cfg, params, tokens, pos, last, cache),
                backend="cpu", donate_argnums=(4,), fusion={"paired_epilogue": rule})
    args = (params, tokens, pos, 0, cache)
    want = f.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    got = dsl.tree_flatten(f(params, tokens, pos, 0, [(k.copy(), v.copy()) for k, v in cache]))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0, atol=2e-2 * np.abs(w).max())
    kernels = f.compile(*args).plan.kernels
    assert len(kernels) == (5 if rule else 6) * L + 1, [k.name for k in kernels]
    return kernels


def test_smollm2_decode_step_with_the_rule_on_and_off():
    """SmolLM2-135M's first two layers with its own Q4_1 weights (the int8 GEMV path): five kernels
    per layer with the rule, six without, both against the float64 interpreter."""
    from engine.weights import default_model_path, load_model
    cfg, params, _ = load_model(default_model_path(), "native")
    params = dict(params, layers=params["layers"][:2])
    on = decode_step(cfg, params, 64, True)
    assert on[0].name == "layers_0_rms_norm_linear_wq_wk_wv_rope_kv_write"
    decode_step(cfg, params, 64, False)


def test_qwen2_shaped_decode_step_with_the_rule_on_and_off():
    """Qwen2.5-1.5B's attention shapes (12 query heads, 2 KV heads of 128, q/k/v bias), two layers
    of random f16 weights."""
    cfg, p, *_ = layer_args(1, True, "f2", "f4", hq=12, hkv=2, hd=128, D=1536, F=256)
    params = {"embed": randn(96, 1536, dtype=np.float16), "norm": randn(1536),
              "layers": [p, layer_args(1, True, "f2", "f4", hq=12, hkv=2, hd=128, D=1536, F=256)[1]]}
    from dataclasses import replace
    decode_step(replace(cfg, vocab_size=96), params, 48, True)
    decode_step(replace(cfg, vocab_size=96), params, 48, False)


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
    from codegen import loopir as L
    (seg,) = [s for s in L.walk_stmts(k.body) if isinstance(s, L.Loop) and s.parallel]
    assert k.family == "contract" and len(seg.body[0].accs) == 2 and seg.stop.value == 16


@pytest.mark.parametrize("wdtype,cache_dtype", [("f2", "f2"), ("q8_0", "f4"), ("q4_1", "f2")])
def test_qwen2_shaped_fused_qkv_kernel_passes_the_gfx906_gates(wdtype, cache_dtype):
    """Qwen2.5-1.5B's heads (12/2 of 128, bias): the fused QKV + RoPE + KV-write kernel compiles for
    gfx906 with no scratch, 16-byte weight loads (v_dot2 or v_dot4 in the main loop) and at most 9
    waves per SIMD."""
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 compile skipped: {e}")
    from codegen.inspect import Inspected, counts, main_loop
    from codegen.targets import get_target
    from fusion import build_plan
    cfg, p, x, kc, vc, pos = layer_args(1, True, wdtype, cache_dtype, hq=12, hkv=2, hd=128, D=1536, F=256, S=64)
    low = dsl.jit(lambda params, x, kc, vc, pos: llama.block(cfg, params, x, kc, vc, pos),
                  donate_argnums=(2, 3)).lower(p, x, kc, vc, pos)
    qkv = build_plan(low.program, None, low.in_names, low.donated).kernels[0]
    assert qkv.name.endswith("rope_kv_write")
    it = Inspected(qkv, get_target("gfx906"))
    c = counts(main_loop(it.isa()))
    assert it.res["scratch_bytes"] == 0 and "flat_load" not in it.isa() and c["dwordx4"] >= 1, c
    assert ("v_dot4_i32_i8" if wdtype.startswith("q") else "v_dot2_f32_f16") in it.isa()
    assert 1 <= it.res["waves_per_simd"] <= 9, it.res


def test_caches_not_donated_are_copied_before_the_fused_kernel_writes_them():
    """Without donation the new caches are fresh buffers: each is copied from the old one, then the
    QKV kernel writes its k and v rows into the copy; the caller's arrays are unchanged."""
    cfg, p, x, kc, vc, pos = layer_args(1, False, "f2", "f4")
    f = dsl.jit(lambda params, x, kc, vc, pos: llama.block(cfg, params, x, kc, vc, pos), backend="cpu")
    args = (p, x, kc, vc, pos)
    want = f.lower(*args).program.run(*dsl.tree_flatten(list(args))[0], compute_dtype="f64")
    k0, v0 = kc.copy(), vc.copy()
    got = dsl.tree_flatten(f(*args))[0]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-3, atol=2e-3 * max(1.0, np.abs(w).max()))
    np.testing.assert_array_equal(kc, k0)
    np.testing.assert_array_equal(vc, v0)
    kernels = f.compile(*args).plan.kernels                 # the two copies launch as one loop kernel
    assert [k.family for k in kernels[:2]] == ["elementwise", "contract"], [k.name for k in kernels]
    copies = {p.name for p in kernels[0].params if p.role == "out"}
    assert len(copies) == 2 and copies <= {p.name for p in kernels[1].params if p.role != "in"}
