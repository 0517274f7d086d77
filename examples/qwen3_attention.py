"""Qwen3 decode attention in the DSL, written as a JAX user writes it: one token, QK-norm (RMSNorm
per head), RoPE, GQA with 16 query and 8 key/value heads, the KV cache updated in place (donated).
The JAX version is examples/jax/qwen3_attention.py.

    python examples/qwen3_attention.py
"""
import numpy as np

import dsl
import dsl.numpy as jnp
from dsl import lax, nn


def rms_norm(x, g, eps=1e-6):
    return x * lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * g


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
    k_cache = lax.dynamic_update_slice(k_cache, k[:, None], (0, pos, 0))
    v_cache = lax.dynamic_update_slice(v_cache, v[:, None], (0, pos, 0))
    qg = q.reshape(Hkv, -1, hd)                                   # (Hkv, Hq/Hkv, hd): GQA groups
    s = jnp.einsum("gqd,gsd->gqs", qg, k_cache) / jnp.sqrt(hd)
    s = jnp.where(jnp.arange(S) <= pos, s, -jnp.inf)
    o = jnp.einsum("gqs,gsd->gqd", nn.softmax(s, axis=-1), v_cache)
    return p["wo"] @ o.reshape(-1), k_cache, v_cache


qwen3_attention = dsl.jit(qwen3_attention, donate_argnums=(3, 4))


def random_params(D=128, Hq=16, Hkv=8, hd=16, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    return {"wq": r(Hq * hd, D), "wk": r(Hkv * hd, D), "wv": r(Hkv * hd, D), "wo": r(D, Hq * hd),
            "q_norm": 1 + r(hd), "k_norm": 1 + r(hd)}


if __name__ == "__main__":
    p, rng = random_params(), np.random.default_rng(1)
    kc, vc = (rng.standard_normal((8, 32, 16)).astype(np.float32) for _ in range(2))
    y, kc, vc = qwen3_attention(p, rng.standard_normal(128).astype(np.float32), 5, kc, vc)
    print("qwen3_attention:", np.asarray(y).shape)
