"""A GPT-2 block as a JAX user writes it: prefill of T tokens, learned position embeddings,
LayerNorm, GELU (tanh), causal attention.  For comparison with ``examples/gpt2_block.py``."""
import jax
import jax.numpy as jnp


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * g + b


def gpt2_block(p, ids, n_head):                                  # ids (T,) int32
    T = ids.shape[0]
    x = p["wte"][ids] + p["wpe"][jnp.arange(T)]                  # (T, D)
    D = x.shape[-1]
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q, k, v = jnp.split(h @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)  # 3 x (T, D); w_qkv (D, 3D)
    q, k, v = (t.reshape(T, n_head, D // n_head).transpose(1, 0, 2) for t in (q, k, v))  # (H, T, hd)
    att = jnp.einsum("hqd,hkd->hqk", q, k) / jnp.sqrt(D // n_head)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
    y = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(att, axis=-1), v)
    x = x + y.transpose(1, 0, 2).reshape(T, D) @ p["w_o"] + p["b_o"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]


gpt2_block = jax.jit(gpt2_block, static_argnames="n_head")
