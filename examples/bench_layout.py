"""CPU matmul time against a (K, N) weight (``x @ w``) and an (N, K) weight (``x @ w.T``, the
layout of ``nn.linear``), for decode GEMV shapes and a small prefill.

    python examples/bench_layout.py [--reps 200] [--dtype f16]

Prints, per shape, the microseconds of one call of each (20th percentile, calls alternating),
their ratio, and the access order the fusion report names for the (K, N) kernel.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsl  # noqa: E402

SHAPES = [(1, 576, 1536), (1, 1536, 576), (16, 576, 1536), (1, 2048, 8192)]


def times_us(fa, a, fb, b, reps):
    """Microseconds of one call of ``fa(*a)`` and of ``fb(*b)``: calls alternate (a machine shared
    with other work slows both alike), and each gets the 20th percentile of its times."""
    fa(*a), fb(*b)
    ta, tb = [], []
    for _ in range(reps):
        for f, args, out in ((fa, a, ta), (fb, b, tb)):
            t0 = time.perf_counter()
            f(*args)
            out.append(time.perf_counter() - t0)
    return 1e6 * float(np.percentile(ta, 20)), 1e6 * float(np.percentile(tb, 20))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", default="f16", choices=("f16", "f32"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    kn = dsl.jit(lambda x, w: x @ w)
    nk = dsl.jit(lambda x, w: dsl.dot_t(x, w))
    print(f"{'shape':<22} {'(K,N) us':>10} {'(N,K) us':>10} {'ratio':>6}  order")
    for t, k, n in SHAPES:
        x = rng.standard_normal((t, k), np.float32)
        w = rng.standard_normal((k, n)).astype(args.dtype.replace("f", "float"))
        wt = np.ascontiguousarray(w.T)
        a, b = times_us(kn, (x, w), nk, (x, wt), args.reps)
        report = kn.compile(x, w).fusion_report().splitlines()[1:]
        order = "; ".join(line.split("order: ")[1] for line in report if "order: " in line) or "?"
        shape = f"({t},{k})@({k},{n})"
        print(f"{shape:<22} {a:10.1f} {b:10.1f} {a / b:6.2f}  {order}")


if __name__ == "__main__":
    main()
