"""Teacher-forced perplexity in the DSL, written as a JAX user writes it: final norm and LM head
over T hidden states, log-softmax, the targets' log-probabilities.  The JAX version is
examples/jax/perplexity.py.

    python examples/perplexity.py
"""
import numpy as np

import dsl
import dsl.numpy as jnp
from dsl import lax, nn


def perplexity(h, norm, w_lm, targets):                         # h (T, D), w_lm (V, D), targets (T,)
    h = h * lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-5) * norm
    logp = nn.log_softmax(h @ w_lm.T, axis=-1)                   # (T, V)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return jnp.exp(nll.mean())


perplexity = dsl.jit(perplexity)


def random_inputs(T=32, D=64, V=256, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, D)).astype(np.float32), rng.uniform(0.5, 1.5, D).astype(np.float32),
            (rng.standard_normal((V, D)) * 0.3).astype(np.float32), rng.integers(0, V, T).astype(np.int32))


if __name__ == "__main__":
    print("perplexity:", float(np.asarray(perplexity(*random_inputs()))))
