"""The device sampler (``stdlib.sampling.sample``) kernel by kernel over one row of logits.

Each kernel of the sampler's plan is timed alone (``engine.profile.kernel_times``: device events
around each launch on a GPU, the host's clock around each native call on the CPU), then the plan as
a decode step runs it (a GPU's graph).  ``--ways`` sets the parts a search pass cuts its bracket
into (``stdlib.sampling.WAYS``, for A/B: 64 is the default; each pass tests WAYS - 1 points at once).

    python3 examples/bench_sampler.py [--backend cuda] [--vocab 49152] [--top-k 40] [--ways 64] [--steps 30]

(SmolLM2's vocabulary by default; temperature 0.8, top-p 0.95, no min-p.)
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsl  # noqa: E402
import stdlib.sampling as sampling  # noqa: E402
from engine.errors import run_cli  # noqa: E402
from engine.profile import kernel_times  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip"])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--ways", type=int, default=sampling.WAYS, help="parts a search pass cuts its bracket into")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args(argv)
    if a.ways < 2 or a.ways & (a.ways - 1):
        ap.error(f"--ways {a.ways}: use a power of two, at least 2")
    if a.vocab < 1 or a.steps < 1:
        ap.error(f"--vocab and --steps must be >= 1, got --vocab {a.vocab} --steps {a.steps}")
    return run_cli(run, a)


def run(a):
    sampling.WAYS = a.ways
    os.environ["VEGAFUSE_PROGRAM_CACHE"] = "0"        # --ways changes a constant the cache's key cannot see
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(a.vocab) * 3).astype(np.float32)
    settings = np.array([0.8, 0.95, 0.0], np.float32)              # temperature, top_p, min_p
    draw = dsl.jit(lambda lg, u, s: sampling.sample(lg, u, s, a.top_k), backend=a.backend)
    t = kernel_times(draw, logits, np.float32(0.37), settings, steps=a.steps)
    print(f"{a.backend}: {a.vocab} ids, top-k {a.top_k}, {a.ways} parts a search pass: "
          f"{len(t['kernels'])} kernels, {sum(us for _, us in t['kernels']):.1f} µs alone, the plan {t['plan_us']:.1f} µs")
    width = max(len(name) for name, _ in t["kernels"])
    for name, us in t["kernels"]:
        print(f"  {name:<{width}} {us:9.2f} µs")


if __name__ == "__main__":
    sys.exit(main())
