"""Tests for engine.sampling: greedy, temperature, top-k, top-p, ties, determinism."""
import numpy as np
import pytest

from engine.sampling import is_eos, sample


def logits_of(seed, n=1000, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def draws(logits, n=3000, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return np.array([sample(logits, rng=rng, **kw) for _ in range(n)])


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_zero_is_argmax():
    for seed in range(5):
        lg = logits_of(seed)
        assert sample(lg, temperature=0.0, top_k=0, top_p=1.0, rng=None) == int(np.argmax(lg))


def test_ties_pick_first_index():
    lg = logits_of(1, n=50)
    lg[[7, 3, 30]] = lg.max() + 1.0
    assert sample(lg, temperature=0.0) == 3
    assert sample(lg, temperature=1.0, top_k=1, rng=np.random.default_rng(0)) == 3
    assert sample(lg, temperature=0.7, top_k=1, top_p=0.5, rng=np.random.default_rng(0)) == 3


def test_top_k_ties_at_the_boundary_keep_lower_ids():
    lg = logits_of(10, n=40) - 10.0                       # all well below the tied values
    lg[[30, 4, 17, 9, 22]] = 2.0
    lg[12] = 3.0
    got = set(draws(lg, n=2000, temperature=1.0, top_k=3).tolist())
    assert got == {12, 4, 9}


def test_top_k_one_equals_argmax():
    rng = np.random.default_rng(5)
    for seed in range(20):
        lg = logits_of(seed)
        assert sample(lg, temperature=2.0, top_k=1, top_p=1.0, rng=rng) == int(np.argmax(lg))


def test_top_k_restricts_support():
    lg = logits_of(2, scale=0.3)                          # flat: many ids would show up otherwise
    top5 = set(np.argsort(-lg)[:5].tolist())
    got = draws(lg, temperature=1.0, top_k=5)
    assert set(got.tolist()) == top5                      # only and all of the top 5
    assert len(set(draws(lg, temperature=1.0, top_k=0).tolist())) > 100   # no limit


def test_top_p_restricts_support_to_nucleus():
    lg = logits_of(3, n=200, scale=2.0)
    p = softmax(lg.astype(np.float64))
    order = np.argsort(-p)
    n_keep = int(np.searchsorted(np.cumsum(p[order]), 0.6)) + 1
    nucleus = set(order[:n_keep].tolist())
    got = draws(lg, n=4000, temperature=1.0, top_p=0.6)
    assert set(got.tolist()) <= nucleus
    assert len(set(got.tolist())) >= min(n_keep, 3)
    # tiny top_p keeps only the most likely id
    assert set(draws(lg, n=200, temperature=1.0, top_p=1e-6).tolist()) == {int(order[0])}


def test_top_p_one_keeps_everything_and_matches_softmax():
    lg = logits_of(4, n=8, scale=1.0)
    for temperature in (1.0, 0.5, 2.0):
        got = draws(lg, n=20000, seed=1, temperature=temperature, top_k=0, top_p=1.0)
        freq = np.bincount(got, minlength=8) / len(got)
        np.testing.assert_allclose(freq, softmax(lg.astype(np.float64) / temperature), atol=0.015)


def test_top_k_and_top_p_renormalize():
    lg = logits_of(6, n=8, scale=1.0)
    order = np.argsort(-lg)
    got = draws(lg, n=20000, seed=2, temperature=1.0, top_k=3)
    freq = np.bincount(got, minlength=8) / len(got)
    want = np.zeros(8)
    want[order[:3]] = softmax(lg[order[:3]].astype(np.float64))
    np.testing.assert_allclose(freq, want, atol=0.015)


def test_neg_inf_never_sampled():
    lg = logits_of(7, n=100)
    lg[::2] = -np.inf
    assert all(i % 2 == 1 for i in draws(lg, n=2000, temperature=1.5))


def test_seeded_rng_is_deterministic():
    lg = logits_of(8)
    a = draws(lg, n=100, seed=42, temperature=0.8, top_k=40, top_p=0.9)
    b = draws(lg, n=100, seed=42, temperature=0.8, top_k=40, top_p=0.9)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) > 1
    assert all(isinstance(sample(lg, 0.8, 40, 0.9, np.random.default_rng(0)), int) for _ in range(3))


def test_invalid_arguments():
    lg = logits_of(9)
    rng = np.random.default_rng(0)
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            sample(lg, rng=rng, **kw)
    with pytest.raises(ValueError):
        sample(lg.reshape(10, 100), temperature=0.0)
    with pytest.raises(ValueError):
        sample(lg, temperature=1.0, rng=None)


def test_is_eos():
    assert is_eos(2, (2,)) and is_eos(np.int64(0), (2, 0))
    assert not is_eos(1, (2, 0)) and not is_eos(5, ())


def test_degenerate_logits_and_temperatures_never_give_an_invalid_id():
    rng = np.random.default_rng()
    logits = rng.standard_normal(50)
    assert sample(logits, 1e-310, 0, 1.0, rng) == int(np.argmax(logits))
    for bad in (np.full(8, -np.inf), np.full(8, np.nan), np.array([1.0, np.inf, 2.0, np.inf])):
        i = sample(bad, 0.7, 0, 1.0, rng)
        assert 0 <= i < len(bad)
    x = rng.standard_normal(8)
    x[3] = np.nan
    assert sample(x, 0.0) == int(np.nanargmax(x))
    with pytest.raises(ValueError):
        sample(x, float("nan"), 0, 1.0, rng)


def reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, recent=()):
    """The distribution ``sample`` draws from, written out in float64 one step at a time: the
    repeat penalty on the raw logits (divide positive, multiply non-positive, each distinct id once),
    min-p against the most likely raw logit, then temperature, top-k, top-p."""
    x = np.array(logits, dtype=np.float64)
    for i in set(int(r) for r in recent):
        x[i] = x[i] * repeat_penalty if x[i] <= 0 else x[i] / repeat_penalty
    keep = np.ones(len(x), bool)
    if min_p > 0:
        p_raw = softmax(x)
        keep &= p_raw >= min_p * p_raw.max() * (1 - 1e-12)
    z = x / temperature
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k > 0:
        keep &= np.isin(np.arange(len(z)), order[:top_k])
    p = softmax(z)
    if top_p < 1:
        mass, nucleus = 0.0, []
        for i in order[:top_k or None]:
            nucleus.append(i)
            mass += p[i] / p[order[:top_k or None]].sum()
            if mass >= top_p:
                break
        keep &= np.isin(np.arange(len(z)), nucleus)
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.7, min_p=0.05, top_k=6),
    dict(temperature=1.3, repeat_penalty=1.8),
    dict(temperature=1.0, repeat_penalty=0.6, min_p=0.1, top_p=0.9),
])
def test_min_p_and_repeat_penalty_draw_from_the_reference_distribution(kw):
    rng = np.random.default_rng()
    lg = (rng.standard_normal(10) * 1.5).astype(np.float32)
    recent = rng.integers(0, 10, 6).tolist()
    want = reference_probs(lg, recent=recent, **kw)
    got = draws(lg, n=20000, seed=int(rng.integers(1 << 30)), recent=recent, **kw)
    freq = np.bincount(got, minlength=10) / len(got)
    np.testing.assert_allclose(freq, want, atol=0.015)
    assert set(np.flatnonzero(freq).tolist()) <= set(np.flatnonzero(want).tolist())   # nothing outside the support


def test_repeat_penalty_applies_to_greedy_and_to_each_id_once():
    rng = np.random.default_rng()
    lg = rng.standard_normal(50)
    best, second = np.argsort(-lg)[:2]
    lg[best] = abs(lg[best]) + 1.0                      # a positive logit: divided by the penalty
    lg[second] = 0.9 * lg[best]                         # still above every other logit
    rp = 1.01 / 0.9
    assert sample(lg, 0.0) == best
    assert sample(lg, 0.0, repeat_penalty=rp, recent=[int(best)] * 5) == second
    neg = -np.abs(rng.standard_normal(20)) - 0.1       # all negative: multiplied by the penalty
    b = int(np.argmax(neg))
    moved = sample(neg, 0.0, repeat_penalty=1e6, recent=[b])
    assert moved != b and moved == int(np.argmax(np.where(np.arange(20) == b, -np.inf, neg)))


def test_min_p_one_keeps_only_the_most_likely():
    rng = np.random.default_rng()
    lg = rng.standard_normal(300)
    assert set(draws(lg, n=200, temperature=5.0, min_p=1.0).tolist()) == {int(np.argmax(lg))}


def test_bad_min_p_and_repeat_penalty():
    lg, rng = logits_of(11), np.random.default_rng(0)
    for kw in ({"min_p": -0.1}, {"min_p": 1.5}, {"repeat_penalty": 0.0}, {"repeat_penalty": float("nan")},
               {"repeat_penalty": 1.2, "recent": [1000]}):
        with pytest.raises(ValueError):
            sample(lg, 1.0, rng=rng, **kw)


def test_top_p_weighs_the_distribution_before_min_p_cuts_it():
    # p = [.5, .3, .12, .08]: min-p 0.2 drops id 3 (.08 < .1); top-p 0.85 over the whole row keeps
    # ids 0-2 (.5 + .3 + .12 >= .85).  Cutting min-p first would renormalize to .54, .33, .13 and
    # let top-p stop at two ids, so id 2 (drawn .12 / .92 of the time here) would never appear.
    lg = np.log(np.array([0.5, 0.3, 0.12, 0.08]))
    got = draws(lg, n=20000, seed=int(np.random.default_rng().integers(1 << 30)),
                temperature=1.0, top_p=0.85, min_p=0.2)
    freq = np.bincount(got, minlength=4) / len(got)
    np.testing.assert_allclose(freq, np.array([0.5, 0.3, 0.12, 0.0]) / 0.92, atol=0.015)
