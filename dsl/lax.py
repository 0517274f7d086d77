"""``dsl.lax``: the names of ``jax.lax`` we support (control flow, slicing, top-k).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

# ---- slicing and indexing

# ---- control flow

# ---- sorting and top-k
