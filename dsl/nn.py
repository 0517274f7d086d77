"""``dsl.nn``: the names of ``jax.nn`` we support (activations, normalizers).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations
