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
