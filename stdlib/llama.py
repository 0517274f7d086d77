"""The Llama family (Llama, Qwen2, SmolLM, Mistral) in the DSL.

One function runs both prefill (T prompt tokens) and decode (T = 1): the
position ``pos`` is a runtime scalar, so decode never retraces.  The KV cache is
static ([Hkv, S, hd] per layer) and updated in place when donated.
"""
from __future__ import annotations

import dsl

from .config import LlamaConfig
from .nn import causal_attention, linear, rms_norm, rope, silu


def block(cfg: LlamaConfig, p, x, k_cache, v_cache, pos):
    """One decoder layer.  x f32 [T, D] -> (x, k_cache, v_cache).  A weight ``w`` may come with
    ``w_perm``, the input column each of its columns reads (GPTQ desc_act; see ``linear``)."""
    T = x.shape[0]
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    h = rms_norm(x, p["attn_norm"], cfg.norm_eps)                       # (T, D)
    q = linear(h, p["wq"], p.get("bq"), p.get("wq_perm"))               # (T, hq*hd)
    k = linear(h, p["wk"], p.get("bk"), p.get("wk_perm"))               # (T, hkv*hd)
    v = linear(h, p["wv"], p.get("bv"), p.get("wv_perm"))               # (T, hkv*hd)
    q = q.reshape(T, hq, hd).transpose(1, 0, 2)                         # (hq, T, hd)
    k = k.reshape(T, hkv, hd).transpose(1, 0, 2)                        # (hkv, T, hd)
    v = v.reshape(T, hkv, hd).transpose(1, 0, 2)                        # (hkv, T, hd)
    q = rope(q, pos, cfg.rope_theta)                                    # (hq, T, hd)
    k = rope(k, pos, cfg.rope_theta)                                    # (hkv, T, hd)
    a, k_cache, v_cache = causal_attention(q, k_cache, v_cache, k, v, pos)   # (hq, T, hd)
    a = a.transpose(1, 0, 2).reshape(T, hq * hd)                        # (T, hq*hd)
    x = x + linear(a, p["wo"], perm=p.get("wo_perm"))                   # (T, D)

    h = rms_norm(x, p["ffn_norm"], cfg.norm_eps)                        # (T, D)
    gate = silu(linear(h, p["w_gate"], perm=p.get("w_gate_perm")))      # (T, F)
    up = linear(h, p["w_up"], perm=p.get("w_up_perm"))                  # (T, F)
    x = x + linear(gate * up, p["w_down"], perm=p.get("w_down_perm"))   # (T, D)
    return x, k_cache, v_cache


def forward(cfg: LlamaConfig, params, tokens, pos, last, cache):
    """Run T tokens starting at absolute position ``pos``.

    tokens i32 [T]; pos, last: i32 scalars (``last`` is the row whose logits are returned,
    so padded prefill buckets work); cache: list of (k, v) [Hkv, S, hd] per layer.
    Returns (logits f32 [V], new cache).
    """
    x = dsl.take(params["embed"], tokens).astype("f32")                 # (T, D)
    new_cache = []
    for p, (k_cache, v_cache) in zip(params["layers"], cache):
        x, k_cache, v_cache = block(cfg, p, x, k_cache, v_cache, pos)
        new_cache.append((k_cache, v_cache))
    x = dsl.take(x, dsl.reshape(last, (1,)))                            # (1, D)
    x = rms_norm(x, params["norm"], cfg.norm_eps)                       # (1, D)
    logits = linear(x, params.get("lm_head", params["embed"]))          # (1, V)
    return logits.reshape(-1), new_cache


def greedy_forward(cfg: LlamaConfig, params, tokens, pos, last, cache):
    """``forward`` followed by argmax on the device: returns (next id i32 [], logits, cache)."""
    logits, cache = forward(cfg, params, tokens, pos, last, cache)
    return dsl.argmax(logits), logits, cache
