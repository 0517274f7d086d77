"""A long reduction to one value split over workgroups (``codegen.mapping._across``): each folds a
contiguous chunk, the last to arrive folds the partials in chunk order.  The GPU kernel text of both
targets runs in the CPU emulation against numpy (an argmax keeps the first of equal maxima and the
first NaN) and the float64 interpreter (a sum), with the workgroups in order and reversed."""
import numpy as np
import pytest

import dsl
from codegen import prelude
from codegen.hip import render_hip
from engine.pipeline import lower_program
from tests.emulation import GXX, emulated, launch

rng = np.random.default_rng()
needs_gxx = pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
N = 151936                                   # Qwen2.5's vocabulary: a decode step's argmax


def _run(f, x, target, tmp, reversed_):
    """``f(x)`` lowered to one kernel and its ``target`` text run by the emulation: (value, kernel)."""
    low = dsl.jit(f).lower(x)
    plan = lower_program(low)
    (k,) = plan.kernels
    h = render_hip(k, target)
    bufs = {plan.inputs[0]: x.copy()}
    for p in k.params:
        bufs.setdefault(p.name, np.full(max(1, int(np.prod(plan.buffers[p.name][0]))), -7,
                                        np.int32 if p.dtype == "i32" else np.float32))
    defines = f"#define VF_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n#define VF_ATT_BLOCK VF_BLOCK\n"
    helpers = prelude._NV_WAVE_SUM + prelude._COMMON.format() + prelude._ARRIVE
    launch(emulated(h, tmp, defines, helpers), h, [bufs[p.name] for p in k.params], reversed_)
    out = plan.outputs[0][1]
    return bufs[plan.aliases.get(out, out)][0], h


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("case", ["ties", "nan", "last"])
def test_an_argmax_over_workgroups_is_numpys(target, case, tmp_path_factory):
    x = rng.standard_normal(N).astype(np.float32)
    i, j = sorted(rng.choice(N, 2, replace=False))
    if case == "ties":                       # equal maxima in two chunks: the first wins
        x[i] = x[j] = 9.0
    elif case == "nan":                      # numpy: the first NaN
        x[i] = x[j] = np.nan
    else:                                    # the maximum in the last, short chunk
        x[N - 1] = 9.0
    want = int(np.argmax(x))
    for reversed_ in (False, True):
        got, h = _run(dsl.argmax, x, target, str(tmp_path_factory.mktemp("across")), reversed_)
        assert got == want, (case, reversed_, i, j)
    assert h.grid[0] > 1 and "vf_last_to_arrive(" in h.body


@needs_gxx
def test_a_sum_over_workgroups_is_the_float64_sum(tmp_path_factory):
    x = rng.standard_normal(N).astype(np.float32)
    got, h = _run(lambda v: v.sum(), x, "sm_90", str(tmp_path_factory.mktemp("across")), True)
    want = np.sum(x, dtype=np.float64)
    assert abs(got - want) <= 1e-5 * np.abs(x).sum() and h.grid[0] > 1


def test_the_split_is_a_switch_and_short_reductions_keep_one_workgroup(monkeypatch):
    x = rng.standard_normal(N).astype(np.float32)
    (k,) = lower_program(dsl.jit(dsl.argmax).lower(x)).kernels
    assert render_hip(k, "sm_90").grid[0] == 19                      # 8 logits a thread of 1024
    monkeypatch.setenv("VEGAFUSE_REDUCE_ACROSS", "0")
    assert render_hip(k, "sm_90").grid[0] == 1
    monkeypatch.delenv("VEGAFUSE_REDUCE_ACROSS")
    (short,) = lower_program(dsl.jit(dsl.argmax).lower(x[:4096])).kernels
    assert render_hip(short, "sm_90").grid[0] == 1


@needs_gxx
def test_an_input_named_like_the_partials_keeps_its_own_values(tmp_path_factory):
    """The partials' arrays are named with the codegen's ``vf_`` prefix, never a user's buffer."""
    x = rng.standard_normal(N).astype(np.float32)

    def f(sum_part):
        return sum_part.sum()
    got, h = _run(f, x, "sm_90", str(tmp_path_factory.mktemp("across")), False)
    assert abs(got - np.sum(x, dtype=np.float64)) <= 1e-5 * np.abs(x).sum() and h.grid[0] > 1
