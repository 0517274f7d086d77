"""Kernels that run on one workgroup (a reduction to a scalar, the loop family): integer reductions
are block-wide like float ones, the workgroup takes the target's ``one_workgroup_block`` threads,
and a shared count of sibling reductions stays one pass over the row (``fusion.partition.cap_depth``)."""
import numpy as np
import pytest

import dsl
from codegen import loopir as L
from dsl import lax

from tests.emulation import GXX
from tests.test_device_sampling import emulate_plan

rng = np.random.default_rng()


def int_reductions(x, w):
    """i32 sum, max and argmax of a row (x: i32 [n]) and an f32 argmax beside them (w: f32 [n])."""
    return dsl.stack([dsl.sum(x), dsl.max(x), dsl.argmax(x), dsl.argmax(w), dsl.sum(dsl.where(w > 0.0, 1, 0))])


def reference(x, w):
    return np.array([x.astype(np.int64).sum(), x.max(), np.argmax(x), np.argmax(w), (w > 0).sum()])


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_integer_reductions_run_block_wide_on_the_gpu_kernel_text(target, tmp_path):
    """Each thread folds its share of the row, then the workgroup combines (``vf_block_sum_i``,
    ``vf_block_max_i``, ``vf_block_argmax_i``): the kernel text, run by the CPU emulation at the
    target's wave and workgroup, gives numpy's values, ties of the max going to the first index."""
    from codegen.hip import render_hip
    from codegen.mapping import one_workgroup_block
    from codegen.targets import get_target
    from engine.pipeline import lower_program
    t = get_target(target)
    n = int(rng.integers(3000, 9000))
    x = rng.integers(-50, 50, n).astype(np.int32)            # many ties at the max
    w = rng.standard_normal(n).astype(np.float32)
    plan = lower_program(dsl.jit(int_reductions).lower(x, w))
    (k,) = [k for k in plan.kernels if "argmax" in k.name or "max" in k.name]
    h = render_hip(k, t)
    assert h.block[0] == one_workgroup_block(t) and "vf_block_sum_i(" in h.body and "vf_block_argmax_i(" in h.body
    assert "for (int k = 0;" not in h.body, "a thread runs the whole row alone"
    (got,) = emulate_plan(int_reductions, (x, w), t, str(tmp_path))
    np.testing.assert_array_equal(np.asarray(got).astype(np.int64), reference(x, w))


def test_the_workgroup_size_switch_is_checked(monkeypatch):
    """``VEGAFUSE_ONE_WORKGROUP_BLOCK`` sets the threads of a one-workgroup kernel (A/B); a value that
    is no multiple of the wave gives one line naming the switch."""
    from codegen.mapping import one_workgroup_block
    from codegen.targets import get_target
    assert one_workgroup_block(get_target("sm_90")) == 1024 and one_workgroup_block(get_target("gfx906")) == 512
    monkeypatch.setenv("VEGAFUSE_ONE_WORKGROUP_BLOCK", "256")
    assert one_workgroup_block(get_target("gfx906")) == 256
    monkeypatch.setenv("VEGAFUSE_ONE_WORKGROUP_BLOCK", "100")
    with pytest.raises(ValueError, match="VEGAFUSE_ONE_WORKGROUP_BLOCK=100 is not a multiple of the wave"):
        one_workgroup_block(get_target("sm_90"))


def test_the_workgroup_size_switch_is_checked_against_an_emulated_wave(monkeypatch, tmp_path):
    """gfx906's kernel text on an NVIDIA GPU (target ``sm_90_wave64``) holds at most 15 emulated waves
    a workgroup: 1024 threads are refused naming the switch (it was refused later, naming the
    target's block), 960 render and run."""
    from codegen.hip import render_hip
    from codegen.targets import get_target
    from engine.pipeline import lower_program
    x = rng.integers(-9, 9, int(rng.integers(2000, 5000))).astype(np.int32)
    w = rng.standard_normal(x.size).astype(np.float32)
    plan = lower_program(dsl.jit(int_reductions).lower(x, w))
    monkeypatch.setenv("VEGAFUSE_ONE_WORKGROUP_BLOCK", "1024")
    with pytest.raises(ValueError, match=r"VEGAFUSE_ONE_WORKGROUP_BLOCK=1024 .* between it and 960"):
        render_hip(plan.kernels[0], get_target("sm_90_wave64"))
    monkeypatch.setenv("VEGAFUSE_ONE_WORKGROUP_BLOCK", "960")
    assert render_hip(plan.kernels[0], get_target("sm_90_wave64")).block[0] == 960
    if GXX:
        (got,) = emulate_plan(int_reductions, (x, w), get_target("gfx906"), str(tmp_path))
        np.testing.assert_array_equal(np.asarray(got).astype(np.int64), reference(x, w))


def counted_search(p, target):
    """A search as stdlib/sampling.py runs one: each step 15 sibling reductions whose count c picks the
    bracket [point c, point c + 1] (c read twice)."""
    V = p.shape[0]

    def step(_, b):
        c = sum(dsl.where(dsl.sum(dsl.where(dsl.iota((V,), dtype="i32") <= b[0] + lax.div((b[1] - b[0]) * i, 16),
                                            p, 0.0)) <= target, 1, 0) for i in range(1, 16))
        return dsl.stack([b[0] + lax.div((b[1] - b[0]) * c, 16), b[0] + lax.div((b[1] - b[0]) * (c + 1), 16)])
    return lax.fori_loop(0, 4, step, dsl.stack([dsl.full((), -1, "i32"), dsl.full((), V - 1, "i32")]))[1]


def test_a_shared_count_of_sibling_reductions_is_one_pass_a_step():
    """The count's expression is big (15 tests) and read twice: inlined into both readers after a cut
    further down, each would repeat the 15 reductions.  The loop kernel makes one pass a step, and the
    search finds the inverse CDF (the first id whose prefix sum exceeds the target)."""
    from engine.pipeline import lower_program
    V = 3000
    p = (rng.random(V) + 0.5).astype(np.float32)
    cdf = np.cumsum(p.astype(np.float64))
    j = int(rng.integers(1, V))
    target = np.float32((cdf[j - 1] + cdf[j]) / 2)              # far from every prefix sum: exact either way
    plan = lower_program(dsl.jit(counted_search).lower(p, target))
    (scan,) = [k for k in plan.kernels if k.family == "loop"]
    passes = [s for s in L.walk_stmts(scan.body) if isinstance(s, L.Reduce)]
    assert len(passes) == 1 and len(passes[0].accs) == 15, [len(r.accs) for r in passes]
    got = int(np.asarray(dsl.jit(counted_search)(p, target)))
    assert got == j


def row_statistics(x):
    """A value per row of x (R, N), each from several reductions of its row."""
    return dsl.sum(x, axis=-1) - dsl.max(x, axis=-1) * dsl.min(x, axis=-1) + dsl.argmax(x, axis=-1).astype("f32")


def shared_count(x, n=24):
    """A count per row of n sibling tests (each a reduction of the row), read twice."""
    c = sum(dsl.where(dsl.sum(dsl.where(x > (i / n - 0.5), x, 0.0), axis=-1) > 0.0, 1, 0) for i in range(n))
    c = c.astype("f32")
    return c * c + c


def test_a_vector_of_row_reductions_is_one_pass_a_row():
    """A vector whose elements each combine reductions of a row (row statistics, a count of sibling
    tests, materialized where it is computed since it is read twice) computes its reductions in one
    kernel: each element a row whose reductions run before its store.  It took a kernel a reduction
    (a count of 24 tests: 26 kernels)."""
    from engine.pipeline import lower_program
    R, N = int(rng.integers(2, 9)), int(rng.integers(200, 700))
    x = rng.standard_normal((R, N)).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64.sum(-1) - x64.max(-1) * x64.min(-1) + np.argmax(x64, -1)
    n = 24
    c = sum((np.where(x64 > i / n - 0.5, x64, 0).sum(-1) > 0).astype(np.float64) for i in range(n))
    for f, ref, reductions in ((row_statistics, want, 4), (shared_count, c * c + c, n)):
        plan = lower_program(dsl.jit(f).lower(x))
        accs = [sum(len(s.accs) for s in L.walk_stmts(k.body) if isinstance(s, L.Reduce)) for k in plan.kernels]
        assert reductions in accs and sum(accs) == reductions and len(accs) <= 2, (f.__name__, accs)
        np.testing.assert_allclose(np.asarray(dsl.jit(f)(x), np.float64), ref, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_a_vector_of_row_reductions_on_the_gpu_kernel_text(target, tmp_path):
    """The same kernel as the GPU runs it (a workgroup a row, its reductions block-wide), rows
    shorter and longer than the workgroup."""
    from codegen.targets import get_target
    for N in (int(rng.integers(2, 60)), int(rng.integers(1100, 3000))):
        x = rng.standard_normal((int(rng.integers(2, 6)), N)).astype(np.float32)
        x64 = x.astype(np.float64)
        (got,) = emulate_plan(row_statistics, (x,), get_target(target), str(tmp_path))
        want = x64.sum(-1) - x64.max(-1) * x64.min(-1) + np.argmax(x64, -1)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-3)


def grid_test(x, t):
    """Threshold tests at once, as a search pass of the device sampler runs them: for each t_i
    (t: f32 [n, 1]) the sum of x (f32 [V]) over {x >= t_i}, one reduction over an [n, V] grid."""
    return dsl.sum(dsl.where(x >= t, x, 0.0), axis=1)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_few_long_rows_take_a_workgroup_of_one_workgroup_block_threads(monkeypatch, tmp_path):
    """Rows no more than the compute units and at least 8 x 1024 long take 1024 threads a row on
    sm_90 (``codegen.mapping._few_long_rows``); the text computes the sums; short rows, more rows
    than compute units and ``VEGAFUSE_WIDE_ROWS=0`` keep the target's 256."""
    from codegen.hip import render_hip
    from codegen.targets import get_target
    from engine.pipeline import lower_program
    sm90 = get_target("sm_90")

    def blocks(x, t):
        return [render_hip(k, sm90).block[0] for k in lower_program(dsl.jit(grid_test).lower(x, t)).kernels]
    V = int(rng.integers(8192, 9000))
    x = rng.standard_normal(V).astype(np.float32)
    t = np.sort(rng.standard_normal((3, 1)).astype(np.float32), axis=0)
    assert blocks(x, t) == [1024]
    (got,) = emulate_plan(grid_test, (x, t), sm90, str(tmp_path))
    want = np.array([x[x >= ti].astype(np.float64).sum() for ti in t[:, 0]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    assert blocks(x[:4000], t) == [256]                                    # short rows
    assert blocks(x, np.zeros((140, 1), np.float32)) == [256]              # more rows than 132 SMs
    monkeypatch.setenv("VEGAFUSE_WIDE_ROWS", "0")
    assert blocks(x, t) == [256]
