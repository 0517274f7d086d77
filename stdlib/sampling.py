"""Next-token sampling in the DSL, so that a decode step can draw its token on the device.

``sample`` draws from the distribution of ``engine.sampling.sample`` (temperature, top-k, top-p,
min-p; no repeat penalty) without sorting the vocabulary: each cut is a threshold found by
bisection, each bisection step one masked reduction over the row, and the draw itself is an
inverse-CDF search over token ids with one uniform number.  A bisection carries its bracket as
two scalars through ``lax.fori_loop``, so each search is one loop kernel.
"""
from __future__ import annotations

import dsl
from dsl import lax

THRESHOLD_STEPS = 24      # bisection steps of a logit threshold: the bracket shrinks 2^24 times
EXP_FLOOR = -104.0        # exp(z) is 0 in f32 below about -103.97: the thresholds' lowest bracket end


def _largest_threshold(lo, hi, holds, steps=THRESHOLD_STEPS):
    """The largest t in [lo, hi) (to within (hi - lo) / 2^steps) for which ``holds(t)`` is true,
    ``holds`` being true at ``lo``, false at ``hi`` and monotone (true below some t*).  The
    bracket is one f32 [2] carry, so each step computes ``holds`` once."""
    def step(_, bracket):                                                # bracket: (2,) = lo, hi
        mid = (bracket[0] + bracket[1]) * 0.5
        return dsl.where(holds(mid), dsl.stack([mid, bracket[1]]), dsl.stack([bracket[0], mid]))
    bracket = lax.fori_loop(0, steps, step, dsl.stack([lo, dsl.full((), hi, "f32")]))
    return bracket[0]


def sample(logits, u, settings, top_k=0):
    """Draw one token id from ``logits`` f32 [V].

    Args:
        logits: f32 [V]; NaN counts as -inf (never drawn).
        u: f32 [] uniform in [0, 1): the draw's only randomness (the caller's seeded generator).
        settings: f32 [3]: temperature (> 0), top_p in (0, 1], min_p in [0, 1], as
            ``engine.sampling.sample`` takes them (runtime values: changing them never retraces).
        top_k: static int; 0 (or >= V) keeps every id.

    Returns: i32 [] the drawn id.

    The steps, as ``engine.sampling.sample``: z = (logits - max) / temperature; top-k keeps
    z >= the k-th largest z (ties at the k-th value all kept); top-p keeps z >= the largest t whose
    set {z >= t} holds at least top_p of the top-k set's probability (the nucleus; Holtzman et al.,
    arXiv:1904.09751); min-p keeps logits >= max + ln(min_p) (llama.cpp's ``min_p``).  The draw is
    the smallest id j whose prefix sum of kept probabilities exceeds u times their total.  A
    threshold is searched in [-104, 1] (below -104, exp(z) is 0 in f32: such ids are never drawn)
    to within 105 / 2^24, about 6e-6 in z: ids closer than that to a cut may fall on either side."""
    V = logits.shape[0]
    x = dsl.where(logits == logits, logits, -float("inf"))                # (V,)  NaN -> -inf
    temperature, top_p, min_p = settings[0], settings[1], settings[2]
    z = (x - dsl.max(x)) / temperature                                   # (V,)  <= 0
    keep = z > -float("inf")
    if 0 < top_k < V:
        count = lambda t: dsl.sum(dsl.where(z >= t, 1, 0)) >= top_k      # noqa: E731
        keep = keep & (z >= _largest_threshold(EXP_FLOOR, 1.0, count))
    p = dsl.where(keep, dsl.exp(z), 0.0)                                 # (V,)  unnormalized
    nucleus = top_p * dsl.sum(p)
    mass = lambda t: dsl.sum(dsl.where(z >= t, p, 0.0)) >= nucleus     # noqa: E731
    keep = keep & ((top_p >= 1.0) | (z >= _largest_threshold(EXP_FLOOR, 1.0, mass)))
    keep = keep & (z >= dsl.log(min_p) / temperature)                    # logit >= max + ln(min_p)
    p = dsl.where(keep, p, 0.0)                                          # (V,)
    target = u * dsl.sum(p)

    def step(_, bracket):              # bracket: (2,) = lo, hi; prefix(lo) <= target < prefix(hi)
        mid = (bracket[0] + bracket[1]) // 2
        over = dsl.sum(dsl.where(dsl.iota((V,), dtype="i32") <= mid, p, 0.0)) > target
        return dsl.where(over, dsl.stack([bracket[0], mid]), dsl.stack([mid, bracket[1]]))
    bracket = lax.fori_loop(0, max(1, V.bit_length()), step, dsl.stack([dsl.full((), -1, "i32"),
                                                                        dsl.full((), V - 1, "i32")]))
    hi = bracket[1]
    return hi
