"""Next-token sampling in the DSL, so that a decode step can draw its token on the device.

``sample`` draws from the distribution of ``engine.sampling.sample`` (temperature, top-k, top-p,
min-p; no repeat penalty) without sorting the vocabulary.  Each cut is a threshold found by a
search whose pass cuts its bracket into ``WAYS`` parts and tests the ``WAYS - 1`` inner points at
once: one reduction over a [WAYS - 1, V] grid, a workgroup per point on a GPU, so a pass is two
short kernels over the whole device.  The draw itself is the same search over ids, for the inverse
CDF of one uniform number: the first id whose prefix sum of kept probability exceeds the number
times their total.
"""
from __future__ import annotations

import dsl
from dsl import lax

WAYS = 64                 # parts a search pass cuts its bracket into (a power of two): WAYS - 1 points tested at once
THRESHOLD_BITS = 24       # a logit threshold's search shrinks its bracket 2^24 times
EXP_FLOOR = -104.0        # exp(z) is 0 in f32 below about -103.97: the thresholds' lowest bracket end


def _search(lo, hi, holds, point, passes):
    """Narrow the bracket [lo, hi] (scalars) ``passes`` times.  ``point(lo, hi, i)`` is the i-th of the
    points that cut it into ``WAYS`` parts (i = 0: lo, i = WAYS: hi; ascending in i; i an i32 array or
    scalar); ``holds`` takes points [n, 1] and returns bool [n], monotone (true up to some point, false
    after), true at ``lo`` and false at ``hi``.  A pass tests the ``WAYS - 1`` inner points at once
    (one reduction over a [WAYS - 1, V] grid: a workgroup per point on a GPU); when c of them hold,
    points 1 .. c do, and the bracket becomes [point c, point c + 1], computed as those points were.
    The bracket is stored after each pass but the last, so the next pass reads two numbers.  Returns (lo, hi)."""
    inner = dsl.iota((WAYS - 1, 1), dtype="i32") + 1                                  # (WAYS - 1, 1)
    for n in range(passes):
        c = dsl.sum(dsl.where(holds(point(lo, hi, inner)), 1, 0))                     # i32 []  points that hold
        lo, hi = point(lo, hi, c), point(lo, hi, c + 1)
        if n + 1 < passes:                    # the last bracket goes straight to its reader
            bracket = lax.optimization_barrier(dsl.stack([lo, hi]))                    # (2,)
            lo, hi = bracket[0], bracket[1]
    return lo, hi


def _largest_threshold(lo, hi, holds):
    """The largest t in [lo, hi) (to within (hi - lo) / 2^THRESHOLD_BITS) where ``holds(t)``.  A point
    is lo + (hi - lo) * (i / WAYS), exact in i / WAYS (WAYS is a power of two), so the bracket's ends
    are points that were tested.  Returns f32 []."""
    def point(a, b, i):
        return a + (b - a) * (i.astype("f32") * (1.0 / WAYS))
    passes = -(-THRESHOLD_BITS // (WAYS.bit_length() - 1))
    # stored: the cut's readers are elementwise over the row (else one workgroup would recount it)
    return lax.optimization_barrier(_search(dsl.full((), lo, "f32"), dsl.full((), hi, "f32"), holds, point, passes)[0])


def _id_passes(n: int) -> int:
    """Passes of ``_search`` over n ids: each leaves at most 1 / WAYS (rounded up) of the bracket."""
    passes = 0
    while n > 1:
        n, passes = -(-n // WAYS), passes + 1
    return max(1, passes)


def sample(logits, u, settings, top_k=0):
    """Draw one token id from ``logits`` f32 [V].

    Args:
        logits: f32 [V]; NaN counts as -inf (never drawn).  With no finite maximum (a +inf logit,
            or no finite logit) the draw is the first id of the maximum, as the host's argmax.
        u: f32 [] uniform in [0, 1): the draw's only randomness (the caller's seeded generator).
        settings: f32 [3]: temperature (> 0), top_p in (0, 1], min_p in [0, 1], as
            ``engine.sampling.sample`` takes them (runtime values: changing them never retraces).
        top_k: static int; 0 (or >= V) keeps every id.

    Returns: i32 [] the drawn id.

    The steps, as ``engine.sampling.sample``: z = (logits - max) / temperature; top-k keeps
    z >= the k-th largest z (ties at the k-th value all kept); top-p keeps z >= the largest t whose
    set {z >= t} holds at least top_p of the top-k set's probability (the nucleus; Holtzman et al.,
    arXiv:1904.09751); min-p keeps logits >= max + ln(min_p) (llama.cpp's ``min_p``).  The draw is
    the smallest id j whose prefix sum of kept probabilities exceeds u times their total, and never
    past the last kept id (u near 1 can round the target up to the total).  A
    threshold is searched in [-104, 1] (below -104, exp(z) is 0 in f32: such ids are never drawn)
    to within 105 / 2^24, about 6e-6 in z: ids closer than that to a cut may fall on either side.
    Where it differs from ``engine.sampling.sample`` by design: ids tied at a top-k or top-p cut
    are all kept (the host keeps the lower ids), and ids below -104 are never drawn."""
    V = logits.shape[0]
    x = dsl.where(logits == logits, logits, -float("inf"))                # (V,)  NaN -> -inf
    temperature, top_p, min_p = settings[0], settings[1], settings[2]
    m = dsl.max(x)
    # m, z, p and the nucleus are stored once: every pass of a search reads them (fusion would recompute them)
    m = lax.optimization_barrier(m)
    z = lax.optimization_barrier(dsl.where(x == m, 0.0, (x - m) / temperature))  # (V,)  <= 0; 0 at an infinite max
    keep = z > -float("inf")
    if 0 < top_k < V:
        count = lambda t: dsl.sum(dsl.where(z >= t, 1, 0), axis=1) >= top_k      # noqa: E731  t: (n, 1)
        keep = keep & (z >= _largest_threshold(EXP_FLOOR, 1.0, count))
    p = lax.optimization_barrier(dsl.where(keep, dsl.exp(z), 0.0))       # (V,)  unnormalized
    nucleus = lax.optimization_barrier(top_p * dsl.sum(p))
    mass = lambda t: dsl.sum(dsl.where(z >= t, p, 0.0), axis=1) >= nucleus     # noqa: E731  t: (n, 1)
    keep = keep & ((top_p >= 1.0) | (z >= _largest_threshold(EXP_FLOOR, 1.0, mass)))
    # logit >= max + ln(min_p); min_p 0 keeps every id (at an infinite temperature ln(0) / T is NaN)
    keep = keep & ((min_p <= 0.0) | (z >= dsl.log(min_p) / temperature))
    p = lax.optimization_barrier(dsl.where(keep, p, 0.0))                # (V,)
    # no finite max: the first id of it.  A target that rounds to the total or above (u just below 1)
    # would pass every id after the last kept one: the draw stops at the last kept id (one kernel stores
    # both, the id as f32: exact below 2^24 ids)
    last = dsl.max(dsl.where(p > 0.0, dsl.iota((V,), dtype="i32"), 0)).astype("f32")
    ends = lax.optimization_barrier(dsl.stack([dsl.where(dsl.abs(m) < float("inf"), u, 0.0) * dsl.sum(p), last]))
    target, last = ends[0], ends[1].astype("i32")

    def id_point(a, b, i):                    # exact in i32 (b >= a, i >= 0: C's division floors): point WAYS is b
        return a + lax.div((b - a) * i, WAYS)

    def prefix_within(j):                     # j: (n, 1); the kept probability of ids 0..j is at most the target
        return dsl.sum(dsl.where(dsl.iota((V,), dtype="i32") <= j, p, 0.0), axis=1) <= target
    hi = _search(dsl.full((), -1, "i32"), dsl.full((), V - 1, "i32"), prefix_within, id_point, _id_passes(V))[1]
    return dsl.minimum(hi, last)              # the first id whose prefix exceeds the target
