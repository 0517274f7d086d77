"""The SmolLM2 decode step as a fusion plan, shared by the codegen tests (built once)."""
import functools

from codegen.inspect import decode_plan as _decode_plan


@functools.lru_cache(maxsize=None)
def decode_plan(context=512, dtype="f16"):
    """Plan of one SmolLM2-135M decode step (1 token, KV cache of ``context`` positions), weights
    as ``dtype`` ("f16", or "native": the GGUF's q4_1/q8_0 tensors)."""
    return _decode_plan(None, context, dtype)
