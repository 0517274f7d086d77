"""Model configuration for the Llama family (Llama, Qwen2, SmolLM, Mistral)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder.

    Field meanings follow Hugging Face ``LlamaConfig`` / GGUF ``llama.*`` keys.
    ``head_dim`` defaults to ``dim // n_heads``.  ``qkv_bias`` is True for Qwen2.
    """
    vocab_size: int
    dim: int                      # hidden size (GGUF embedding_length)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int                  # intermediate size (GGUF feed_forward_length)
    head_dim: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    arch: str = "llama"
    bos_id: int | None = None
    eos_ids: tuple = ()
    chat_template: str | None = None
    name: str = ""

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
