"""Adversarial checks of the device-side sampler (``stdlib.sampling.sample``), ``Model.decode_ids``
and ``engine.generate.stream`` drawing its ids on the device: fresh random inputs, each draw id for
id against the float64 reference distribution's inverse CDF (``tests/test_sampling.py``), or the
host sampler (``engine.sampling.sample``) where that distribution has no finite maximum."""
import numpy as np
import pytest

import dsl
from engine.sampling import sample as host_sample
from stdlib.sampling import sample as draw
from tests.emulation import GXX
from tests.test_device_sampling import emulate_plan, inverse_cdf
from tests.test_sampling import reference_probs

rng = np.random.default_rng()
needs_gxx = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")


def expected(logits, u, kw):
    """The id the device must draw at ``u``: the reference's inverse CDF, or the host's argmax when
    no logit is finite or one is +inf; None when ``u`` lies within f32 rounding of a CDF step."""
    x = np.where(np.isnan(logits), -np.inf, logits.astype(np.float64))
    if not np.isfinite(x.max()):
        return host_sample(logits, kw["temperature"], kw["top_k"], kw["top_p"], np.random.default_rng(), kw["min_p"])
    q = reference_probs(logits, **kw)
    if np.min(np.abs(np.cumsum(q) - u)) < 1e-4:
        return None
    return inverse_cdf(q, u)


def check(logits, backend="cpu", n=12, **kw):
    """Draws of the device sampler on ``backend`` against :func:`expected` for ``n`` fresh u's."""
    kw = dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **kw)
    f = dsl.jit(lambda lg, u, s: draw(lg, u, s, kw["top_k"]), backend=backend)
    s = np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32)
    for u in rng.random(n).astype(np.float32):
        want = expected(logits, u, kw)
        if want is not None:
            got = int(np.asarray(f(logits, u, s)))
            assert got == want, (float(u), got, want, kw)


def masked(V, value):
    """Random logits with a third of the ids masked by a large finite negative ``value`` (as a
    grammar or a vocabulary mask writes them): the brackets must not stretch down to it."""
    lg = (rng.standard_normal(V) * 2).astype(np.float32)
    lg[rng.choice(V, V // 3, replace=False)] = value
    return lg


@pytest.mark.parametrize("value", [-1e9, np.finfo(np.float32).min, -3e4])
@pytest.mark.parametrize("kw", [dict(top_k=20), dict(top_p=0.6), dict(temperature=0.7, top_k=50, top_p=0.9)])
def test_a_large_finite_mask_keeps_the_cuts_exact(value, kw):
    """A bracket from the masked ids' z (-1e9 / temperature) up to 1 left 24 bisection steps a
    resolution of about 60: top-k and top-p kept nearly every id (the floor now sits at z = -104)."""
    check(masked(int(rng.integers(200, 500)), value), **kw)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=5, top_p=0.5, min_p=0.1), dict(temperature=0.01)])
@pytest.mark.parametrize("case", ["all -inf", "all nan", "+inf", "+inf twice", "-inf and nan"])
def test_no_finite_maximum_draws_the_hosts_argmax(case, kw):
    """No finite logit, or a +inf one: the host draws argmax (the first of the maximum); the device
    drew the last id V - 1 (z = NaN dropped every id, and an empty CDF ends at V - 1)."""
    V = int(rng.integers(20, 300))
    lg = (rng.standard_normal(V) * 2).astype(np.float32)
    if case == "all -inf":
        lg[:] = -np.inf
    elif case == "all nan":
        lg[:] = np.nan
    elif case == "-inf and nan":
        lg[:] = -np.inf
        lg[rng.choice(V, V // 2, replace=False)] = np.nan
    else:
        lg[rng.choice(V, 1 if case == "+inf" else 2, replace=False)] = np.inf
    check(lg, n=4, **kw)


@pytest.mark.parametrize("kw", [
    dict(temperature=1e-3), dict(temperature=1e-3, top_k=10, top_p=0.9), dict(temperature=50.0, top_k=30, top_p=0.5),
    dict(top_p=1e-6), dict(top_k=-1), dict(min_p=1.0, top_k=7), dict(temperature=0.8, min_p=0.3, top_p=0.99)])
def test_extreme_settings_draw_the_reference(kw):
    check((rng.standard_normal(int(rng.integers(100, 400))) * 3).astype(np.float32), **kw)


@pytest.mark.parametrize("V", [1, 2, 3, 5, 255, 257, 1000])
def test_small_and_odd_vocabularies_draw_the_reference(V):
    """Every top_k around V (V - 1, V, V + 1), f32 and f16 logits, wide ranges (1e4)."""
    for top_k in {0, 1, max(1, V - 1), V, V + 1}:
        check((rng.standard_normal(V) * 2).astype(np.float32), n=6, temperature=0.9, top_k=top_k, top_p=0.9)
    check((rng.standard_normal(V) * 3).astype(np.float16), n=6, temperature=0.7, top_k=min(V, 4))
    check((rng.standard_normal(V) * 1e4).astype(np.float32), n=6, top_p=0.95)


def test_the_docstring_names_where_the_device_differs_by_design():
    """Ties at a cut are kept whole on the device (the host keeps the lower ids): said in the docstring."""
    doc = " ".join(draw.__doc__.split())
    assert "tied at a top-k or top-p cut are all kept" in doc and "-104" in doc
    lg = np.zeros(50, np.float32)
    f = dsl.jit(lambda a, u, s: draw(a, u, s, 5), backend="cpu")
    got = {int(np.asarray(f(lg, u, np.array([1.0, 1.0, 0.0], np.float32)))) for u in rng.random(40).astype(np.float32)}
    assert len(got) > 5                                     # the 50 tied ids are all kept


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_the_gpu_kernel_text_handles_masks_and_infinities(target, tmp_path_factory):
    """The sampler's kernels as the GPU runs them (CPU emulation): a -1e9 mask under top-k and
    top-p, a +inf logit, and a row of -inf, against the reference and the host's argmax."""
    from codegen.targets import get_target
    tmp = str(tmp_path_factory.mktemp("sampler"))
    V = int(rng.integers(300, 700))
    kw = dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.0)
    s = np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32)
    pinf = (rng.standard_normal(V) * 2).astype(np.float32)
    pinf[rng.choice(V, 2, replace=False)] = np.inf
    rows = [masked(V, -1e9), masked(V, -1e9), pinf, np.full(V, -np.inf, np.float32)]
    for lg in rows:
        u = np.float32(rng.random())
        want = expected(lg, u, kw)
        if want is None:
            continue
        (got,) = emulate_plan(lambda a, u, s: draw(a, u, s, kw["top_k"]), (lg, u, s), get_target(target), tmp)
        assert int(got[0]) == want, (float(u), int(got[0]), want)
