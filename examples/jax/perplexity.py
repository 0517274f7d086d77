"""Teacher-forced perplexity as a JAX user writes it: final norm and LM head over T hidden states,
log-softmax, the targets' log-probabilities.  For comparison with ``examples/perplexity.py``."""
import jax
import jax.numpy as jnp


def perplexity(h, norm, w_lm, targets):                         # h (T, D), w_lm (V, D), targets (T,)
    h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-5) * norm
    logp = jax.nn.log_softmax(h @ w_lm.T, axis=-1)               # (T, V)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return jnp.exp(nll.mean())


perplexity = jax.jit(perplexity)
