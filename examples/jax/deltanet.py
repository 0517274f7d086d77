"""A gated DeltaNet layer's recurrence as a JAX user writes it: one decode step, and a prefill of T
steps through ``lax.scan``.  State S (H, dk, dv); per step q, k (H, dk), v (H, dv), the gate
g = log decay (H,) and beta (H,).  For comparison with ``examples/deltanet.py``."""
import jax
import jax.numpy as jnp


def deltanet_step(S, q, k, v, g, beta):
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) / jnp.sqrt(q.shape[-1])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    S = S * jnp.exp(g)[:, None, None]                            # decay
    delta = (v - jnp.einsum("hk,hkv->hv", k, S)) * beta[:, None]  # the delta rule's correction
    S = S + jnp.einsum("hk,hv->hkv", k, delta)
    return S, jnp.einsum("hk,hkv->hv", q, S)                    # (H, dv)


def deltanet_prefill(S, q, k, v, g, beta):                      # q, k (T, H, dk); v (T, H, dv); g, beta (T, H)
    return jax.lax.scan(lambda S, x: deltanet_step(S, *x), S, (q, k, v, g, beta))


deltanet_step = jax.jit(deltanet_step, donate_argnums=0)
deltanet_prefill = jax.jit(deltanet_prefill, donate_argnums=0)
