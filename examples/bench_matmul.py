"""The prefill matmul on the CPU against numpy (OpenBLAS) in the same run.

Ours: one fused kernel, RMSNorm -> gate and up projections (f16 weights, as a model keeps them) ->
SiLU(gate) * up, T rows (the matmul family).  numpy's: the bare f32 matmul of the same rows against
both weights (converted to f32 beforehand, outside the timing), with no norm and no SiLU.  Rounds
alternate (ours, numpy, ours, numpy, ...) so that both see the same machine; each round pauses
0.3 s, so that the other side's idle threads have stopped spinning (OpenBLAS's spin for about
0.1 s after a call, and took a core from the call that followed), runs once and times the second
call.  We print the median and the 10th/90th percentiles of each.

    python3 examples/bench_matmul.py [--rows 128] [--dim 1536] [--ffn 8960] [--repeat 15]

(Qwen2.5-1.5B's shapes by default; ``--dim 576 --ffn 1536`` for SmolLM2's.)
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsl  # noqa: E402
from stdlib import nn  # noqa: E402


def gate_up(x, g, w_gate, w_up):
    h = nn.rms_norm(x, g, 1e-6)
    return nn.silu(nn.linear(h, w_gate)) * nn.linear(h, w_up)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=8960)
    p.add_argument("--repeat", type=int, default=15)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    T, K, N = a.rows, a.dim, a.ffn
    x = rng.standard_normal((T, K)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    wg = (rng.standard_normal((N, K)) * K ** -0.5).astype(np.float16)
    wu = (rng.standard_normal((N, K)) * K ** -0.5).astype(np.float16)
    w32 = np.concatenate([wg, wu]).astype(np.float32).T.copy()          # (K, 2N) f32, numpy's layout
    f = dsl.jit(gate_up)
    out = np.asarray(f(x, g, wg, wu))                                    # compile, warm up
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * g
    ref = (h @ wg.astype(np.float64).T)
    ref = ref / (1 + np.exp(-ref)) * (h @ wu.astype(np.float64).T)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    x @ w32
    ours, theirs = [], []
    for _ in range(a.repeat):
        for run, times in ((lambda: f(x, g, wg, wu), ours), (lambda: x @ w32, theirs)):
            time.sleep(0.3)                # the other side's idle threads stop spinning (OpenBLAS: ~0.1 s)
            run()                          # this side's threads awake
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    flops = 2 * T * K * 2 * N
    print(f"T={T} x K={K} x N={N} gate/up ({os.cpu_count()} CPU threads; max error {err:.1e} of the largest output)")
    for name, ts in (("vegafuse: RMSNorm + gate/up (f16) + SiLU*mul", ours), ("numpy f32 matmul (OpenBLAS)", theirs)):
        q = np.percentile(np.array(ts) * 1e3, [10, 50, 90])
        print(f"  {name:<46} median {q[1]:7.2f} ms  (p10 {q[0]:.2f}, p90 {q[2]:.2f})  {flops / q[1] / 1e6:6.1f} GFLOP/s")
    print(f"  ratio (numpy / vegafuse, medians): {np.median(theirs) / np.median(ours):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
