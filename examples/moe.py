"""A top-2-of-8 mixture-of-experts layer for one token in the DSL, written as a JAX user writes it
(Mixtral-style: softmax over the two chosen router logits, SwiGLU experts).  The expert gather
``w[e]`` fuses into the GEMVs: the kernels read only the two chosen experts' weights (the fusion
report's bytes).  The JAX version is examples/jax/moe.py.

    python examples/moe.py
"""
import numpy as np

import dsl
import dsl.numpy as jnp
from dsl import lax, nn


def moe(p, x):                                                  # x (D,)
    w, e = lax.top_k(p["router"] @ x, 2)                         # (2,), (2,): the chosen experts
    w = nn.softmax(w)
    g = jnp.einsum("kfd,d->kf", p["w_gate"][e], x)               # expert weights (E, F, D)
    u = jnp.einsum("kfd,d->kf", p["w_up"][e], x)
    y = jnp.einsum("kdf,kf->kd", p["w_down"][e], nn.silu(g) * u)   # (2, D)
    return w @ y


moe = dsl.jit(moe)


def random_params(D=64, F=128, E=8, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(dtype)  # noqa: E731
    return {"router": r(E, D).astype(np.float32), "w_gate": r(E, F, D), "w_up": r(E, F, D), "w_down": r(E, D, F)}


if __name__ == "__main__":
    p, x = random_params(), np.random.default_rng(1).standard_normal(64).astype(np.float32)
    print("moe:", np.asarray(moe(p, x))[:4])
    print(moe.compile(p, x).fusion_report())
