"""Adversarial checks of the tiled matmul (``codegen/mma.py``), the q8_1 producer (``fusion/q8.py``) and
the GPU attention's budgets (``codegen/attention.py``): the fuzzer's tiled-matmul programs run as GPU
kernel text on the CPU (``tests/gpu_emulation.h``), and one test per bug found."""
import numpy as np
import pytest

import dsl
from dsl.core import DSLError
from engine.pipeline import lower_program
from tests import fuzz
from tests.test_mma import check, needs_gxx, tiled

rng = np.random.default_rng()


def tiled_program(seed, i):
    """A fuzz program of one ``tiled`` op (``tests/fuzz.py``) over a fresh (T, K) input: its source's
    function and inputs, or None when the op did not make one tiled kernel (an epilogue over a whole
    reduction is a second kernel)."""
    r = np.random.default_rng([seed, i])
    frac = lambda n: (np.floor(r.random(n) * 1000) / 1000).tolist()  # noqa: E731
    prog = {"inputs": [{"shape": [int(r.choice([15, 16, 40, 64, 65])), int(r.choice([32, 40, 64]))], "dtype": "f32"}],
            "ops": [{"op": "tiled", "pick": frac(3), "p": frac(4)}], "donate": False, "fusion": {}}
    try:
        src, _ = fuzz.program_source(seed, i, prog)
    except DSLError:
        return None
    ns = {}
    exec(src.split("jf = dsl.jit(")[0], ns)
    args = tuple(ns["args"])
    plan = lower_program(dsl.jit(ns["f"]).lower(*args))
    if len(plan.kernels) != 1 or tiled(plan.kernels[0], "gfx906") is None:
        return None
    return ns["f"], args, src


@needs_gxx
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
def test_the_fuzzers_tiled_matmuls_run_as_gpu_text(target, tmp_path_factory):
    """A fresh sample of the fuzzer's tiled-matmul programs (rows, K and N at the rule's and the tiles'
    edges, every weight format, prologues and epilogues), the kernel text for ``target`` run on the CPU
    against the float64 interpreter."""
    seed, done = int(np.random.SeedSequence().entropy % 2 ** 31), 0
    for i in range(40):
        found = tiled_program(seed, i)
        if found is None:
            continue
        f, args, src = found
        try:
            check(f, args, target, str(tmp_path_factory.getbasetemp()))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, program {i}:\n{src}\n{str(e)[:2000]}") from e
        done += 1
        if done == 4:
            break
    assert done == 4, f"seed {seed}: only {done} tiled programs in 40"
