"""Neural-network building blocks written in the DSL.

Every function works on traced arrays inside ``dsl.jit``; shapes in comments.
"""
from __future__ import annotations

import math

import dsl


def rms_norm(x, weight, eps):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight.

    x [..., D] (any float dtype; statistics accumulate in float32), weight [D] -> f32 [..., D].
    """
    x = x.astype("f32")
    ms = dsl.mean(x * x, axis=-1, keepdims=True)            # (..., 1)
    return x * dsl.rsqrt(ms + eps) * weight.astype("f32")


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias over the last axis.

    x [..., D] (any float dtype; statistics in float32, two passes), weight, bias [D] or None
    -> f32 [..., D].
    """
    x = x.astype("f32")
    d = x - dsl.mean(x, axis=-1, keepdims=True)                 # (..., D)
    y = d * dsl.rsqrt(dsl.mean(d * d, axis=-1, keepdims=True) + eps)
    y = y if weight is None else y * weight.astype("f32")
    return y if bias is None else y + bias.astype("f32")


def silu(x):
    """SiLU / swish: x * sigmoid(x) (Elfwing et al. 2017)."""
    return x * dsl.sigmoid(x)


def softmax(x, axis=-1):
    """Numerically stable softmax in float32.  A fully masked row (all -inf) gives zeros, not NaN."""
    x = x.astype("f32")
    m = dsl.max(x, axis=axis, keepdims=True)
    m = dsl.where(m == float("-inf"), 0.0, m)
    e = dsl.exp(x - m)
    s = dsl.sum(e, axis=axis, keepdims=True)
    return e / dsl.where(s == 0.0, 1.0, s)


def linear(x, w, b=None, perm=None):
    """x [..., K] @ w[N, K]^T (+ b[N]) -> f32 [..., N]; ``w`` uses PyTorch's nn.Linear layout.

    ``perm`` (i32 [K], optional): column j of ``w`` multiplies input ``perm[j]``, so the product
    is ``x[..., perm] @ w^T`` (a GPTQ ``desc_act`` weight, whose columns are sorted by group:
    ``dsl.quant.from_gptq``).  The gather is fused into the kernel that reads ``x``."""
    if perm is not None:
        K = x.shape[-1]
        x = dsl.take(x.reshape(-1, K).T, perm).T.reshape(x.shape)     # x[..., perm]
    y = dsl.dot_t(x, w)
    return y if b is None else y + b.astype("f32")


def rope(x, pos, theta):
    """Rotary position embedding (Su et al. 2021), Hugging Face "rotate_half" layout.

    x [H, T, hd]: rows at absolute positions pos..pos+T-1 (pos: i32 scalar).
    inv_freq[i] = theta^(-2i/hd); x*cos + rotate_half(x)*sin.  Returns f32 [H, T, hd].
    """
    _, T, hd = x.shape
    half = hd // 2
    inv_freq = dsl.exp(dsl.arange(half, dtype="f32") * (-2.0 * math.log(theta) / hd))     # (half,)
    t = (dsl.arange(T) + pos).astype("f32")                                       # (T,)
    ang = t[:, None] * inv_freq[None, :]                                          # (T, half)
    cos = dsl.concatenate([dsl.cos(ang), dsl.cos(ang)], axis=-1)                  # (T, hd)
    sin = dsl.concatenate([dsl.sin(ang), dsl.sin(ang)], axis=-1)                  # (T, hd)
    x = x.astype("f32")
    rot = dsl.concatenate([-x[..., half:], x[..., :half]], axis=-1)               # (H, T, hd)
    return x * cos + rot * sin


def kv_write(k_cache, v_cache, k, v, pos):
    """Write k, v [Hkv, T, hd] at position ``pos`` into the caches [Hkv, S, hd]; returns them."""
    k_cache = dsl.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), [0, pos, 0])
    v_cache = dsl.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), [0, pos, 0])
    return k_cache, v_cache


def causal_attention(q, k_cache, v_cache, k, v, pos):
    """Write k, v at ``pos`` into the KV cache, then attend causally.

    q [Hq, T, hd]; k, v [Hkv, T, hd]; caches [Hkv, S, hd]; pos: i32 scalar.
    Query head h reads KV head h // (Hq // Hkv) (grouped-query attention).
    Returns (out f32 [Hq, T, hd], k_cache, v_cache).
    """
    k_cache, v_cache = kv_write(k_cache, v_cache, k, v, pos)
    out = dsl.attention(q, k_cache, v_cache, pos, 1.0 / math.sqrt(q.shape[-1]))
    return out, k_cache, v_cache
