"""Next-token sampling in the DSL, so that a decode step can draw its token on the device.

``sample`` draws from the distribution of ``engine.sampling.sample`` (temperature, top-k, top-p,
min-p; no repeat penalty) without sorting the vocabulary: each cut is a threshold found by a
search that cuts its bracket into ``WAYS`` parts each step (``WAYS - 1`` masked reductions over the
row, one pass), and the draw itself is an inverse-CDF search over token ids with one uniform
number.  A search carries its bracket as one [2] value through ``lax.fori_loop``, so each search
is one loop kernel.
"""
from __future__ import annotations

import dsl
from dsl import lax

WAYS = 4                  # parts a search step cuts its bracket into: WAYS - 1 tests in one pass over the row
THRESHOLD_BITS = 24       # a logit threshold's search shrinks its bracket 2^24 times
EXP_FLOOR = -104.0        # exp(z) is 0 in f32 below about -103.97: the thresholds' lowest bracket end


def _search(lo, hi, holds, point, steps):
    """Narrow the bracket [lo, hi] ``steps`` times.  ``point(lo, hi, i)`` is the i-th of the points
    that cut it into ``WAYS`` parts (i = 0: lo, i = WAYS: hi; ascending in i); ``holds`` is monotone
    (true up to some point, false after), true at ``lo`` and false at ``hi``.  A step tests the
    ``WAYS - 1`` interior points: when c of them hold, the points 1..c do, so the new bracket is
    [point c, point c + 1].  Returns the final bracket, (2,).  The tests of a step are sibling
    reductions, one pass over the row (``codegen.simplify.merge_reductions``); the bracket is one
    [2] carry of a ``fori_loop``, so a search is one loop kernel."""
    def step(_, bracket):                                                # bracket: (2,) = lo, hi
        lo, hi = bracket[0], bracket[1]
        c = sum(dsl.where(holds(point(lo, hi, i)), 1, 0) for i in range(1, WAYS))   # i32 []: tests that hold
        return dsl.stack([point(lo, hi, c), point(lo, hi, c + 1)])
    return lax.fori_loop(0, steps, step, dsl.stack([lo, hi]))


def _largest_threshold(lo, hi, holds):
    """The largest t in [lo, hi) (to within (hi - lo) / 2^THRESHOLD_BITS) where ``holds(t)``.
    A point is lo + (hi - lo) * (i / WAYS), computed alike for a constant i and a traced count, so
    the bracket's ends are points that were tested."""
    def point(a, b, i):
        return a + (b - a) * (i / WAYS if isinstance(i, int) else i.astype("f32") * (1 / WAYS))
    steps = -(-THRESHOLD_BITS // (WAYS.bit_length() - 1))               # WAYS is a power of two
    return _search(dsl.full((), lo, "f32"), dsl.full((), hi, "f32"), holds, point, steps)[0]


def _id_steps(n: int) -> int:
    """Steps of ``_search`` over n ids: each leaves at most 1 / WAYS (rounded up) of the bracket."""
    steps = 0
    while n > 1:
        n, steps = -(-n // WAYS), steps + 1
    return max(1, steps)


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
    the smallest id j whose prefix sum of kept probabilities exceeds u times their total.  A
    threshold is searched in [-104, 1] (below -104, exp(z) is 0 in f32: such ids are never drawn)
    to within 105 / 2^24, about 6e-6 in z: ids closer than that to a cut may fall on either side.
    Where it differs from ``engine.sampling.sample`` by design: ids tied at a top-k or top-p cut
    are all kept (the host keeps the lower ids), and ids below -104 are never drawn."""
    V = logits.shape[0]
    x = dsl.where(logits == logits, logits, -float("inf"))                # (V,)  NaN -> -inf
    temperature, top_p, min_p = settings[0], settings[1], settings[2]
    m = dsl.max(x)
    z = dsl.where(x == m, 0.0, (x - m) / temperature)                   # (V,)  <= 0; 0 at an infinite max
    keep = z > -float("inf")
    if 0 < top_k < V:
        count = lambda t: dsl.sum(dsl.where(z >= t, 1, 0)) >= top_k      # noqa: E731
        keep = keep & (z >= _largest_threshold(EXP_FLOOR, 1.0, count))
    p = dsl.where(keep, dsl.exp(z), 0.0)                                 # (V,)  unnormalized
    nucleus = top_p * dsl.sum(p)
    mass = lambda t: dsl.sum(dsl.where(z >= t, p, 0.0)) >= nucleus     # noqa: E731
    keep = keep & ((top_p >= 1.0) | (z >= _largest_threshold(EXP_FLOOR, 1.0, mass)))
    # logit >= max + ln(min_p); min_p 0 keeps every id (at an infinite temperature ln(0) / T is NaN)
    keep = keep & ((min_p <= 0.0) | (z >= dsl.log(min_p) / temperature))
    p = dsl.where(keep, p, 0.0)                                          # (V,)
    target = dsl.where(dsl.abs(m) < float("inf"), u, 0.0) * dsl.sum(p)  # no finite max: the first id of it

    def id_point(a, b, i):                    # exact in i32 (b >= a, i >= 0: C's division floors): point WAYS is b
        return a + lax.div((b - a) * i, WAYS)

    def prefix_within(j):                     # the kept probability of ids 0..j is at most the target
        return dsl.sum(dsl.where(dsl.iota((V,), dtype="i32") <= j, p, 0.0)) <= target
    ends = _search(dsl.full((), -1, "i32"), dsl.full((), V - 1, "i32"), prefix_within, id_point, _id_steps(V))
    return ends[1]                            # the first id whose prefix exceeds the target
