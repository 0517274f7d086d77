"""The SmolLM2 decode step as a fusion plan, shared by the codegen tests (loaded once)."""
import functools

import numpy as np

import dsl
from engine.weights import default_model_path, load_model
from fusion import build_plan
from stdlib import llama


@functools.lru_cache(maxsize=None)
def decode_plan(context=512):
    """Plan of one SmolLM2-135M decode step (1 token, KV cache of ``context`` positions)."""
    cfg, params, _ = load_model(default_model_path())
    cache = [(np.zeros((cfg.n_kv_heads, context, cfg.head_dim), np.float32),) * 2 for _ in range(cfg.n_layers)]

    def step(params, tokens, pos, last, cache):
        return llama.forward(cfg, params, tokens, pos, last, cache)
    low = dsl.jit(step, donate_argnums=(4,)).lower(params, np.zeros(1, np.int32), 0, 0, cache)
    return build_plan(low.program, None, low.in_names, low.donated)
