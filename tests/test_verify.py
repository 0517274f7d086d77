"""``--verify`` (engine/verify.py): every kernel of a real run checked against the float64 interpreter on
its own inputs, at its output's dtype; a kernel given one wrong index is caught and named."""
import dataclasses
import json
import re

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from engine import verify
from engine.generate import main
from stdlib import nn

rng = np.random.default_rng()
PROMPT = "The capital of France is"
SUMMARY = re.compile(r"\[verify: (\d+) buffers, ([\d,]+) elements compared in (\d+) kernel launches \((\d+) calls\); "
                     r"all within tolerance, the largest error ([\d.e+-]+)% of its tolerance \((\S+) in (\S+)\)\]")


def generate(capsys, *args):
    """engine.generate run in this process: (exit status, stdout, stderr)."""
    rc = main(["--temperature", "0", "-c", "64", *args, PROMPT])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("dtype", ["native", "f16", "f32"])
def test_verify_passes_on_smollm2_for_20_tokens(dtype, capsys):
    """SmolLM2 for 20 tokens on the CPU, its Q4_1 file as it is (the int8 GEMVs) and dequantized to f16
    and f32: every kernel of the prefill and of each decode step matches the reference; the summary
    counts every buffer of every launch (a kernel writes at least one), and the text is the one an
    unchecked run gives."""
    rc, out, err = generate(capsys, "--dtype", dtype, "-n", "20", "--json", "--verify")
    assert rc == 0, err
    m = SUMMARY.search(err)
    assert m, err
    buffers, elements, launches, calls = (int(m.group(i).replace(",", "")) for i in range(1, 5))
    checked = json.loads(out)
    assert calls == 1 + len(checked["ids"]) - (checked["finish_reason"] == "length")     # the prefill, then a step an id
    assert launches >= 151 * calls and buffers >= launches and elements > buffers
    assert float(m.group(5)) <= 100
    assert "not compared" not in err
    rc, out, _ = generate(capsys, "--dtype", dtype, "-n", "20", "--json")
    assert rc == 0 and json.loads(out)["ids"] == checked["ids"]


def wrong_residual_index(k: L.Kernel) -> L.Kernel:
    """``k`` with one wrong index in its epilogue: the first store into an output buffer that adds a
    buffer read at the index it writes (the residual) reads it mirrored, at element size - 1 - i of that
    buffer instead of i.  (Stores into the kernel's local arrays, the prologue's, are left alone.)"""
    sizes = {p.name: p.size for p in k.params}
    outputs = {p.name for p in k.params if p.role != "in"}

    def swap(store):
        def mirror(x):
            if isinstance(x, L.Load) and x.buf != store.buf and x.index == store.index:
                return dataclasses.replace(x, index=L.Bin("sub", L.c(sizes[x.buf] - 1), x.index))
        return dataclasses.replace(store, value=L.rewrite_expr(store.value, mirror))

    def walk(body):
        out, done = [], False
        for s in body:
            if not done and isinstance(s, L.Store) and s.buf in outputs and swap(s) != s:
                s, done = swap(s), True
            elif not done and isinstance(getattr(s, "body", None), tuple):
                inner, done = walk(s.body)
                s = dataclasses.replace(s, body=inner)
            out.append(s)
        return tuple(out), done
    body, done = walk(k.body)
    assert done, L.format_kernel(k)
    return dataclasses.replace(k, body=body)


def break_kernel(monkeypatch, name):
    """Compile every program with kernel ``name`` broken by :func:`wrong_residual_index` (the plan as
    lowered and cached stays right)."""
    from engine import pipeline
    lower = pipeline.lower_program

    def lower_broken(*args, **kw):
        plan = lower(*args, **kw)
        kernels = [wrong_residual_index(k) if k.name == name else k for k in plan.kernels]
        return dataclasses.replace(plan, kernels=kernels)
    monkeypatch.setattr(pipeline, "lower_program", lower_broken)


def test_a_kernel_with_one_wrong_index_stops_the_run_naming_it(capsys, monkeypatch):
    """Layer 3's down projection reading its residual mirrored (the prefill's row 0 reads row 7 backwards):
    the run stops at the prefill with one line naming the kernel, the tensor, the first bad index (in
    row 0: where the mirrored value is close enough, the next) and the errors."""
    break_kernel(monkeypatch, "layers_3_linear_w_down_add")
    rc, out, err = generate(capsys, "-n", "4", "--verify")
    assert rc == 2
    (line,) = err.strip().splitlines()[-1:]
    assert re.match(r"error: verify: kernel layers_3_linear_w_down_add wrote layers_3_x_2\[0, \d+\] = ", line), err
    abs_err, rel_err = (float(x) for x in re.search(r"max abs error (\S+), max rel error (\S+) ", line).groups())
    assert abs_err > 0.1 and rel_err > 0.1, line
    # the prefill's launches: the embedding gather, then five kernels a layer: layer 3's fifth is the 21st
    assert f"call 1, launch {1 + 3 * 5 + 5} of " in line
    rc, out, err = generate(capsys, "-n", "4")          # unchecked, the broken kernel runs to the end
    assert rc == 0


def block(x, g, w, r, cache, pos):
    """RMSNorm -> GEMV -> SiLU + residual, and a row written into a donated cache in place."""
    h = nn.rms_norm(x, g, 1e-5)
    y = r + nn.silu(nn.linear(h, w))
    return y, dsl.lax.dynamic_update_slice(cache, y.astype("f16"), (pos, 0))


def small_args():
    x, r = rng.standard_normal((1, 256)).astype(np.float32), rng.standard_normal((1, 128)).astype(np.float32)
    g, w = rng.standard_normal(256).astype(np.float32), rng.standard_normal((128, 256)).astype(np.float16)
    return x, g, w, r, rng.standard_normal((16, 128)).astype(np.float16), 3


def test_a_checked_call_compares_every_buffer_written_and_returns_what_an_unchecked_one_does():
    """A small program with a GEMV and an f16 cache updated in place (its elements compared as f16,
    against the reference computed from the cache as it was before the launch)."""
    x, g, w, r, cache, pos = small_args()
    f = dsl.jit(block, donate_argnums=(4,))
    want_y, want_c = f(x, g, w, r, cache.copy(), pos)
    with verify.checking() as v:
        got_y, got_c = f(x, g, w, r, cache.copy(), pos)
    np.testing.assert_array_equal(got_y, want_y)
    np.testing.assert_array_equal(got_c, want_c)
    ex = f.compile(x, g, w, r, cache, pos)
    assert v.calls == 1 and v.launches == len(ex.plan.kernels)
    written = {p.name: p.size for k in ex.plan.kernels for p in k.params if p.role != "in"}
    assert v.buffers == len(written) and v.elements == sum(written.values())
    assert verify.active() is None


def test_a_broken_epilogue_in_a_small_program_is_caught(monkeypatch):
    """The GEMV's epilogue adding the residual at the mirrored row: the check names the kernel, its
    output and the first bad index; an f16 cache row written from it is not reached."""
    args = small_args()
    (gemv,) = [k.name for k in dsl.jit(block, donate_argnums=(4,)).compile(*args).plan.kernels
               if k.family == "contract"]
    break_kernel(monkeypatch, gemv)
    f = dsl.jit(block, donate_argnums=(4,))
    with verify.checking(), pytest.raises(verify.Mismatch, match=rf"^verify: kernel {gemv} wrote \w+\[0, 0\] = "):
        f(*args)


def test_q8_1_blocks_are_read_back_as_the_values_they_hold():
    """The bytes of a q8_1 activation (with and without the residual plane), as a GPU producer writes
    them beside its float buffer, decode to the values the kernels' quantization gives."""
    from tests.test_quant_kernels import q8_1, round_half_away
    x = (rng.standard_normal(128) * np.repeat(rng.uniform(0.01, 10, 4), 32)).astype(np.float32)
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    step = amax / np.float32(127)
    t = (b * (np.float32(127) / amax)).astype(np.float32)
    q = round_half_away(t)
    r = round_half_away(((t - q) * np.float32(128)).astype(np.float32))
    for fmt, planes, scale in (("q8_1r", (q, r), step / 128), ("q8_1", (q,), step)):
        d = scale.astype(np.float32)
        raw = np.concatenate([p.astype(np.int8).view(np.uint8) for p in planes] + [d.view(np.uint8),
                             np.zeros_like(d).view(np.uint8)], axis=1).reshape(-1)
        np.testing.assert_allclose(verify.q8_values(raw, fmt, x.size), q8_1(x, fmt == "q8_1r"), rtol=1e-6)
        assert np.abs(verify.q8_values(raw, fmt, x.size) - x).max() <= amax.max() / 127 / (256 if fmt == "q8_1r" else 2)


def test_the_tolerance_allows_one_rounding_of_the_output_dtype_and_no_more():
    """An f16 value one ulp off passes (both sides round once); a copy must be bit for bit; an integer
    must be equal; NaN where the reference has a number fails."""
    want = rng.standard_normal(64).astype(np.float16)
    one_ulp = want.copy()
    one_ulp[5] = np.nextafter(want[5], np.float16(np.inf))
    assert verify._errors(one_ulp, want, 1e-6)[1] is None
    assert verify._errors(one_ulp, want, 0.0)[1] == 5
    two = one_ulp.copy()
    two[5] = np.nextafter(two[5], np.float16(np.inf))
    two[7] = np.nan
    assert verify._errors(two, want, 1e-6)[1] == 5
    assert verify._errors(np.array([1, 2, 4], np.int32), np.array([1, 2, 3], np.int32), 1.0)[1] == 2
