"""A top-2-of-8 mixture-of-experts layer for one token as a JAX user writes it (Mixtral-style:
softmax over the two chosen router logits, SwiGLU experts).  For comparison with ``examples/moe.py``."""
import jax
import jax.numpy as jnp


def moe(p, x):                                                  # x (D,)
    w, e = jax.lax.top_k(p["router"] @ x, 2)                     # (2,), (2,): the chosen experts
    w = jax.nn.softmax(w)
    g = jnp.einsum("kfd,d->kf", p["w_gate"][e], x)               # expert weights (E, F, D)
    u = jnp.einsum("kfd,d->kf", p["w_up"][e], x)
    y = jnp.einsum("kdf,kf->kd", p["w_down"][e], jax.nn.silu(g) * u)   # (2, D)
    return w @ y


moe = jax.jit(moe)
