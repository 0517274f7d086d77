"""Qwen3 decode attention as a JAX user writes it: one token, QK-norm (RMSNorm per head), RoPE,
GQA with 16 query and 8 key/value heads, a KV cache updated in place.  For comparison with
``examples/qwen3_attention.py``."""
import jax
import jax.numpy as jnp


def rms_norm(x, g, eps=1e-6):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rope(x, pos, theta=1e6):                                    # x (H, hd)
    hd = x.shape[-1]
    ang = pos * theta ** (-jnp.arange(0, hd, 2) / hd)            # (hd/2,)
    x1, x2 = x[:, : hd // 2], x[:, hd // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def qwen3_attention(p, x, pos, k_cache, v_cache):               # x (D,); caches (Hkv, S, hd)
    Hkv, S, hd = k_cache.shape
    q = rope(rms_norm((p["wq"] @ x).reshape(-1, hd), p["q_norm"]), pos)   # (Hq, hd)
    k = rope(rms_norm((p["wk"] @ x).reshape(Hkv, hd), p["k_norm"]), pos)  # (Hkv, hd)
    v = (p["wv"] @ x).reshape(Hkv, hd)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k[:, None], (0, pos, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v[:, None], (0, pos, 0))
    qg = q.reshape(Hkv, -1, hd)                                   # (Hkv, Hq/Hkv, hd): GQA groups
    s = jnp.einsum("gqd,gsd->gqs", qg, k_cache) / jnp.sqrt(hd)
    s = jnp.where(jnp.arange(S) <= pos, s, -jnp.inf)
    o = jnp.einsum("gqs,gsd->gqd", jax.nn.softmax(s, axis=-1), v_cache)
    return p["wo"] @ o.reshape(-1), k_cache, v_cache


qwen3_attention = jax.jit(qwen3_attention, donate_argnums=(3, 4))
