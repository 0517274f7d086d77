"""A GPT-2 block in the DSL, written as a JAX user writes it: prefill of T tokens, learned position
embeddings, LayerNorm, GELU (tanh), causal attention.  The JAX version is examples/jax/gpt2_block.py;
tests/test_examples.py checks both the values (numpy in float64) and the line counts.

    python examples/gpt2_block.py
"""
import numpy as np

import dsl
import dsl.numpy as jnp
from dsl import nn
from stdlib.nn import layer_norm


def gpt2_block(p, ids, n_head):                                  # ids (T,) int32
    T = ids.shape[0]
    x = p["wte"][ids] + p["wpe"][jnp.arange(T)]                  # (T, D)
    D = x.shape[-1]
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q, k, v = jnp.split(h @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)  # 3 x (T, D); w_qkv (D, 3D)
    q, k, v = (t.reshape(T, n_head, D // n_head).transpose(1, 0, 2) for t in (q, k, v))  # (H, T, hd)
    att = jnp.einsum("hqd,hkd->hqk", q, k) / jnp.sqrt(D // n_head)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
    y = jnp.einsum("hqk,hkd->hqd", nn.softmax(att, axis=-1), v)
    x = x + y.transpose(1, 0, 2).reshape(T, D) @ p["w_o"] + p["b_o"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]


gpt2_block = dsl.jit(gpt2_block, static_argnames="n_head")


def random_params(D=64, V=96, S=32, seed=0):
    """GPT-2's parameter names and layouts (weights stored (in, out), as its Conv1D), random values."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    return {"wte": r(V, D), "wpe": r(S, D), "ln1_g": 1 + r(D), "ln1_b": r(D), "ln2_g": 1 + r(D), "ln2_b": r(D),
            "w_qkv": r(D, 3 * D), "b_qkv": r(3 * D), "w_o": r(D, D), "b_o": r(D),
            "w_fc": r(D, 4 * D), "b_fc": r(4 * D), "w_proj": r(4 * D, D), "b_proj": r(D)}


if __name__ == "__main__":
    p = random_params()
    ids = np.random.default_rng(1).integers(0, 96, 16).astype(np.int32)
    y = gpt2_block(p, ids, n_head=4)
    print("gpt2_block:", np.asarray(y).shape, float(np.abs(np.asarray(y)).mean()))
    print(gpt2_block.compile(p, ids, n_head=4).fusion_report())
