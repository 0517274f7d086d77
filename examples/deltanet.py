"""A gated DeltaNet layer's recurrence in the DSL, written as a JAX user writes it: one decode
step, and a prefill of T steps through ``lax.scan`` (one kernel loop, not T copies).  State S
(H, dk, dv); per step q, k (H, dk), v (H, dv), the gate g = log decay (H,) and beta (H,).  The JAX
version is examples/jax/deltanet.py.

    python examples/deltanet.py
"""
import numpy as np

import dsl
import dsl.numpy as jnp
from dsl import lax


def deltanet_step(S, q, k, v, g, beta):
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) / jnp.sqrt(q.shape[-1])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    S = S * jnp.exp(g)[:, None, None]                            # decay
    delta = (v - jnp.einsum("hk,hkv->hv", k, S)) * beta[:, None]  # the delta rule's correction
    S = S + jnp.einsum("hk,hv->hkv", k, delta)
    return S, jnp.einsum("hk,hkv->hv", q, S)                    # (H, dv)


def deltanet_prefill(S, q, k, v, g, beta):                      # q, k (T, H, dk); v (T, H, dv); g, beta (T, H)
    return lax.scan(lambda S, x: deltanet_step(S, *x), S, (q, k, v, g, beta))


deltanet_step = dsl.jit(deltanet_step, donate_argnums=0)
deltanet_prefill = dsl.jit(deltanet_prefill, donate_argnums=0)


def random_inputs(T=64, H=4, dk=16, dv=16, seed=0):
    """(S, q, k, v, g, beta) for a T-step prefill: g = log of a decay in (0.9, 1), beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return (r(H, dk, dv) * 0.1, r(T, H, dk), r(T, H, dk), r(T, H, dv),
            np.log(rng.uniform(0.9, 1.0, (T, H))).astype(np.float32), rng.uniform(0, 1, (T, H)).astype(np.float32))


if __name__ == "__main__":
    S, *xs = random_inputs()
    S, o = deltanet_prefill(S, *xs)
    print("deltanet prefill:", np.asarray(o).shape, "kernels:", len(deltanet_prefill.compile(S, *xs).kernels))
