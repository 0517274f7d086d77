"""stdlib.sampling.sample, the sampler a decode step runs on the device, against the float64
reference distribution of engine.sampling.sample: for each uniform number u the draw must be
the inverse CDF of the reference's kept probabilities (ids in order), so every setting is checked
id for id, not by counting frequencies."""
import numpy as np
import pytest

import dsl
from stdlib.sampling import sample as draw

from tests.emulation import GXX
from tests.test_sampling import reference_probs

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=0.5, min_p=0.1),
    dict(temperature=2.0, top_p=0.3),
]


def inverse_cdf(q, u):
    """The smallest id whose prefix sum of q exceeds u."""
    return int(np.searchsorted(np.cumsum(q), u, side="right"))


# the device's threshold searches resolve z to 105 / 2^24 (``stdlib.sampling.sample``): ids closer than
# that to a top-k or top-p cut may fall on either side, and so may the draw
CUT = 2 * 105 / 2 ** 24


def near_a_cut(x, kw):
    """Whether the top-k or top-p cut of finite-max logits ``x`` (float64) lies within :data:`CUT` in
    z of the next id down, or the top-p mass within f32 rounding of ``top_p``: either set is a draw."""
    z = np.sort((x - x.max()) / kw["temperature"])[::-1]
    k = kw["top_k"] if 0 < kw["top_k"] < len(z) else len(z)
    if k < len(z) and z[k - 1] - z[k] < CUT:
        return True
    if kw["top_p"] >= 1:
        return False
    p = np.exp(z[:k] - z[0])
    mass = np.cumsum(p) / p.sum()
    j = int(np.argmax(mass >= kw["top_p"]))                 # the last id of the nucleus
    return bool(np.min(np.abs(mass - kw["top_p"])) < 1e-5 or (j + 1 < len(z) and z[j] - z[j + 1] < CUT))


def check_draws(kw, backend="cpu", V=None, n=60):
    """The device sampler on ``backend`` against the reference's inverse CDF for ``n`` fresh u's."""
    rng = np.random.default_rng()
    V = V or int(rng.integers(200, 700))
    kw = dict(dict(top_k=0, top_p=1.0, min_p=0.0), **kw)
    logits = (rng.standard_normal(V) * rng.uniform(1.0, 4.0)).astype(np.float32)
    while near_a_cut(logits.astype(np.float64), kw):            # a cut the device may place either way
        logits = (rng.standard_normal(V) * rng.uniform(1.0, 4.0)).astype(np.float32)
    q = reference_probs(logits, **kw)
    f = dsl.jit(lambda lg, u, s: draw(lg, u, s, kw["top_k"]), backend=backend)
    settings = np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32)
    cdf = np.cumsum(q)
    near = min(1e-4, 0.1 / V)       # f32 sums may fall either side of a boundary this close (dense at large V)
    checked = 0
    for u in rng.random(n).astype(np.float32):
        if np.min(np.abs(cdf - u)) < near:
            continue
        got = int(np.asarray(f(logits, u, settings)))
        assert got == inverse_cdf(q, u), (u, got, inverse_cdf(q, u), q[got])
        checked += 1
    assert checked > n // 3


@pytest.mark.parametrize("kw", SETTINGS)
def test_draws_are_the_reference_inverse_cdf(kw):
    check_draws(kw)


def test_nan_and_masked_logits_are_never_drawn():
    rng = np.random.default_rng()
    logits = rng.standard_normal(64).astype(np.float32)
    logits[rng.choice(64, 20, replace=False)] = np.nan
    logits[rng.choice(64, 10, replace=False)] = -np.inf
    bad = ~np.isfinite(logits)
    f = dsl.jit(lambda lg, u, s: draw(lg, u, s), backend="cpu")
    s = np.array([1.5, 1.0, 0.0], np.float32)
    got = {int(np.asarray(f(logits, u, s))) for u in rng.random(40).astype(np.float32)}
    assert not any(bad[i] for i in got) and len(got) > 3


def test_min_p_one_keeps_only_the_most_likely_id():
    rng = np.random.default_rng()
    logits = rng.standard_normal(100).astype(np.float32)
    f = dsl.jit(lambda lg, u, s: draw(lg, u, s, 7), backend="cpu")
    s = np.array([1.0, 0.9, 1.0], np.float32)
    assert {int(np.asarray(f(logits, u, s))) for u in rng.random(10).astype(np.float32)} == {int(np.argmax(logits))}


def test_the_cpu_model_keeps_drawing_on_the_host(monkeypatch):
    from engine.generate import _on_device

    class GPUModel:
        backend = "cuda"

        def decode_ids(self):
            pass
    assert _on_device(GPUModel(), 1.0) and not _on_device(GPUModel(), 1.1)
    monkeypatch.setenv("VEGAFUSE_DEVICE_SAMPLING", "0")
    assert not _on_device(GPUModel(), 1.0)
    monkeypatch.delenv("VEGAFUSE_DEVICE_SAMPLING")
    GPUModel.backend = "cpu"
    assert not _on_device(GPUModel(), 1.0)


def emulate_plan(f, args, target, tmp):
    """Every kernel of ``f``'s plan as ``target``'s GPU kernel text, run in order by the CPU emulation
    (``tests/gpu_emulation.h``); returns the outputs (buffers start as NaN: one never written shows)."""
    from codegen import prelude
    from codegen.hip import render_hip
    from engine.pipeline import lower_program
    from tests.emulation import emulated, launch
    plan = lower_program(dsl.jit(f).lower(*args))
    bufs = {n: np.atleast_1d(np.ascontiguousarray(a)).copy() for n, a in zip(plan.inputs, args)}
    for k in plan.kernels:
        h = render_hip(k, target)
        for p in k.params:
            if p.name not in bufs:
                bufs[p.name] = np.full(max(1, int(np.prod(p.shape))), np.nan if p.dtype == "f32" else -7,
                                       np.float32 if p.dtype == "f32" else np.int32)
        defines = f"#define VF_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n#define VF_ATT_BLOCK VF_BLOCK\n"
        launch(emulated(h, tmp, defines, prelude._NV_WAVE_SUM + prelude._COMMON.format()), h,
               [bufs[p.name] for p in k.params])
    return [bufs[plan.aliases.get(o[1], o[1])] for o in plan.outputs]


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_the_gpu_kernel_text_draws_the_reference_inverse_cdf(target, tmp_path_factory):
    """The sampler's kernels as the GPU runs them (wave 32 on sm_90, 64 on gfx906: block reductions,
    the search passes over [63, V] grids and the one-workgroup counts), on top-k + top-p + min-p,
    id for id against the reference."""
    from codegen.targets import get_target
    rng = np.random.default_rng()
    V = int(rng.integers(300, 900))
    kw = dict(temperature=0.9, top_k=60, top_p=0.9, min_p=0.02)
    logits = (rng.standard_normal(V) * 2.5).astype(np.float32)
    while near_a_cut(logits.astype(np.float64), kw):            # a cut the device may place either way
        logits = (rng.standard_normal(V) * 2.5).astype(np.float32)
    q = reference_probs(logits, **kw)
    cdf = np.cumsum(q)
    settings = np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32)
    tmp = str(tmp_path_factory.mktemp("sampler"))
    us = [u for u in rng.random(12).astype(np.float32) if np.min(np.abs(cdf - u)) > 1e-4][:4]
    for u in us:
        (got,) = emulate_plan(lambda lg, u, s: draw(lg, u, s, kw["top_k"]), (logits, u, settings),
                              get_target(target), tmp)
        assert int(got[0]) == inverse_cdf(q, u), (u, int(got[0]), inverse_cdf(q, u))


@pytest.fixture(scope="module")
def smollm2():
    from engine.weights import default_model_path, load_model
    return load_model(default_model_path())


def test_decode_ids_greedy_gives_the_reference_and_stops_where_it_is_closed(smollm2):
    """Model.decode_ids on the CPU backend (the loop the GPU runs: ids fed back on the device, read a
    few steps behind): the reference greedy ids; closed early, the position counts the ids taken and
    decoding continues the reference from there; a full cache raises after the ids that fitted."""
    from engine.model import ContextFull, Model
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS
    cfg, params, _ = smollm2
    m = Model(cfg, params, backend="cpu", context=64)
    m.prefill(PROMPT_IDS)
    assert list(m.decode_ids(REFERENCE_IDS[0], 19, lag=3)) == REFERENCE_IDS[1:]
    assert m.pos == len(PROMPT_IDS) + 19
    m.prefill(PROMPT_IDS)
    ids = m.decode_ids(REFERENCE_IDS[0], 19, lag=4)
    taken = [next(ids) for _ in range(5)]
    ids.close()
    assert taken == REFERENCE_IDS[1:6] and m.pos == len(PROMPT_IDS) + 5
    assert list(m.decode_ids(REFERENCE_IDS[5], 14)) == REFERENCE_IDS[6:]
    m = Model(cfg, params, backend="cpu", context=len(PROMPT_IDS) + 4)
    m.prefill(PROMPT_IDS)
    got = []
    with pytest.raises(ContextFull):
        for i in m.decode_ids(REFERENCE_IDS[0], 19):
            got.append(i)
    assert got == REFERENCE_IDS[1:5] and m.pos == m.context


def test_decode_ids_sampled_draws_each_step_from_the_reference_distribution(smollm2):
    """Sampled decode_ids: step p's id is the inverse CDF, at the uniform number the seeded generator
    gave position p, of the reference distribution of that step's logits (the same ids fed through
    Model.decode on the host)."""
    from engine.model import Model
    from tests.test_model import PROMPT_IDS
    cfg, params, _ = smollm2
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02)
    m = Model(cfg, params, backend="cpu", context=48)
    first = int(np.argmax(m.prefill(PROMPT_IDS)))
    seed = int(np.random.default_rng().integers(1 << 30))
    ids = list(m.decode_ids(first, 12, sampling=kw, rng=np.random.default_rng(seed)))
    u = np.random.default_rng(seed).random(48, dtype=np.float32)
    m.prefill(PROMPT_IDS)
    fed, checked = [first] + ids, 0
    for step, got in enumerate(ids):
        q = reference_probs(np.asarray(m.decode(fed[step])), **kw)
        p = len(PROMPT_IDS) + step
        assert q[got] > 0
        if np.min(np.abs(np.cumsum(q) - u[p])) > 1e-4:
            assert got == inverse_cdf(q, u[p]), (step, got, inverse_cdf(q, u[p]))
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("V", [1, 2, 3, 5, 17, 64, 65, 4097])
def test_small_rows_draw_the_inverse_cdf(V):
    """The id search's pass count (each pass keeps 1 / WAYS of the bracket, rounded up) reaches
    one id at every row length, the smallest included."""
    check_draws(dict(temperature=1.0), V=V, n=24)


def test_an_infinite_temperature_draws_uniformly_as_the_host_does():
    """At temperature inf every id is equally likely (the host's z is 0 for every id): the draw for
    u is id floor(u * V), min-p off or on.  With min-p 0 the cut ln(0) / inf was NaN, which kept no
    id, and every draw was the last id."""
    rng = np.random.default_rng()
    V = int(rng.integers(200, 700))
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    f = dsl.jit(lambda lg, u, s: draw(lg, u, s, 0), backend="cpu")
    host_rng = np.random.default_rng()
    from engine.sampling import sample as host
    host_ids = [host(logits, float("inf"), 0, 1.0, rng=host_rng) for _ in range(400)]
    assert len(set(host_ids)) > V // 4                      # the host draws all over the vocabulary
    us = [u for u in rng.random(20) if abs(u * V - round(u * V)) > 1e-3][:6]
    for min_p in (0.0, 0.3):
        settings = np.array([np.inf, 1.0, min_p], np.float32)
        got = [int(np.asarray(f(logits, np.float32(u), settings))) for u in us]
        assert got == [int(np.float32(u) * np.float64(V)) for u in us], (min_p, got)


def tail_cases(rng):
    """Rows whose last ids are never drawn (masked, NaN, or cut by top-k, top-p or min-p), with the
    settings that cut them: (logits, kw)."""
    V = int(rng.integers(40, 300))
    x = (rng.standard_normal(V) * 2).astype(np.float32)
    masked, nan = x.copy(), x.copy()
    masked[-5:], nan[-3:] = -np.inf, np.nan
    return [(masked, dict(temperature=1.0)), (nan, dict(temperature=0.9)), (x, dict(temperature=1.0, top_k=7)),
            (x, dict(temperature=0.8, top_p=0.5)), (x, dict(temperature=1.2, min_p=0.3))]


def test_u_just_below_one_draws_the_last_kept_id():
    """u = 1 - 2^-24 (a uniform f32 the generator can give): u times the total may round to the total,
    where every prefix after the last kept id is within the target; the draw is the last id the
    reference keeps, never a masked id after it (it was id V - 1)."""
    rng = np.random.default_rng()
    u = np.nextafter(np.float32(1), np.float32(0))
    for logits, kw in tail_cases(rng):
        kw = dict(dict(top_k=0, top_p=1.0, min_p=0.0), **kw)
        q = reference_probs(np.where(np.isnan(logits), -np.inf, logits), **kw)     # NaN counts as -inf
        f = dsl.jit(lambda lg, u, s: draw(lg, u, s, kw["top_k"]), backend="cpu")
        got = int(np.asarray(f(logits, u, np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32))))
        assert got == int(np.flatnonzero(q > 0)[-1]), (kw, got, np.flatnonzero(q > 0)[-3:])


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_the_gpu_kernel_text_draws_the_last_kept_id_at_u_just_below_one(tmp_path):
    """The same on the sampler's GPU kernel text (sm_90, CPU emulation), a trailing -inf and a top-k cut."""
    from codegen.targets import get_target
    rng = np.random.default_rng()
    u = np.nextafter(np.float32(1), np.float32(0))
    for logits, kw in [c for i, c in enumerate(tail_cases(rng)) if i in (0, 2)]:
        kw = dict(dict(top_k=0, top_p=1.0, min_p=0.0), **kw)
        q = reference_probs(logits, **kw)
        settings = np.array([kw["temperature"], kw["top_p"], kw["min_p"]], np.float32)
        (got,) = emulate_plan(lambda lg, u, s: draw(lg, u, s, kw["top_k"]), (logits, u, settings),
                              get_target("sm_90"), str(tmp_path))
        assert int(got[0]) == int(np.flatnonzero(q > 0)[-1]), (kw, int(got[0]))
