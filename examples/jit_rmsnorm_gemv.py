"""A first taste of vegafuse: jit a small function, read its IR and kernel source, run it.

    python examples/jit_rmsnorm_gemv.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsl  # noqa: E402
from stdlib import nn  # noqa: E402


def mlp_block(x, g, w, r):
    """RMSNorm, then a GEMV, then SiLU and a residual add: one fused kernel."""
    h = nn.rms_norm(x, g, 1e-5)          # (1, K)
    return r + nn.silu(nn.linear(h, w))   # (1, N)


rng = np.random.default_rng()
K, N = 256, 128
x, g, r = rng.standard_normal((1, K), np.float32), rng.standard_normal(K, np.float32), rng.standard_normal((1, N), np.float32)
w = rng.standard_normal((N, K)).astype(np.float16)

f = dsl.jit(mlp_block)
print("== IR ==")
print(f.lower(x, g, w, r).as_text())
compiled = f.compile(x, g, w, r)
print("\n== fusion ==")
print(compiled.fusion_report())
print("\n== kernel source (LLVM IR, first 40 lines) ==")
print("\n".join(compiled.kernels[0].source.splitlines()[:40]))

y = f(x, g, w, r)
h = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
z = h @ w.astype(np.float64).T
want = r + z / (1 + np.exp(-z))
print("\nmax |error| vs numpy float64:", float(np.abs(y - want).max()))
