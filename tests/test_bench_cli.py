"""engine.bench's command line: bad input is one line ``error: ...`` with exit status 2, decided
before anything heavy is imported (so within 0.5 s on an idle machine), and the results are a
llama-bench-style table whose rates are all positive."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.test_weights import tiny_hf_weights, write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("dsl", "engine.weights", "engine.model", "torch", "llvmlite")

# runs engine.bench's main in a fresh interpreter; reports its status and the heavy modules it imported
PROBE = """
import json, sys
from engine.bench import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def bench(*args, probe=False):
    cmd = [sys.executable, "-c", PROBE, *args] if probe else [sys.executable, "-m", "engine.bench", *args]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return r, time.perf_counter() - t


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny_hf_weights())


@pytest.mark.parametrize("args,needle", [
    (["--model", "qwen2.5-1.5b"], "--backend cuda"),
    (["--random-weights"], "--backend cuda"),
    (["--reference-tokens", "0"], "at least 1 token"),
    (["--tokens", "0"], "at least 1 token"),
    (["--tokens", "-3", "--no-hf"], "at least 1 token"),
    (["--repeat", "0", "--prefill", "8"], "--repeat"),
    (["--prefill", "0"], "--prefill"),
    (["--backend", "cuda", "--position", "10"], "--position 10"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--model", "no/such-repo"], "no such file or directory"),
])
def test_bad_input_is_one_error_line_before_anything_heavy_loads(args, needle):
    r, seconds = bench(*args, probe=True)
    out = json.loads(r.stdout)
    lines = r.stderr.strip().splitlines()
    assert out["code"] == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert out["heavy"] == [], out                        # the DSL, the model, torch: none imported
    assert seconds < 10                                   # 0.5 s idle; generous for a loaded machine


def test_a_fifo_as_model_is_one_error_line(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    r, _ = bench("--model", str(fifo), "--no-hf", probe=True)
    assert json.loads(r.stdout) == {"code": 2, "heavy": []}
    assert r.stderr.startswith("error: ") and "FIFO" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def table_rows(out):
    """{(model, backend, test): t/s} of the Markdown table in ``out``, checking its header."""
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["model", "size", "backend", "test", "t/s"]
    assert re.fullmatch(r"\|( -+[-:] \|)+", lines[1]), lines[1]
    rows = {}
    for ln in lines[2:]:
        model, size, backend, test, tps = (c.strip() for c in ln.strip("|").split("|"))
        assert size.endswith("MiB") or size.endswith("GiB") or size == ""
        rows[(model, backend, test)] = float(tps)
    return rows


@pytest.mark.parametrize("tokens,reference", [(1, 1), (3, 2)])
def test_the_table_has_positive_rates_even_for_one_token(tiny, tokens, reference):
    """``--tokens 1`` and ``--reference-tokens 1`` time one decode step each (they printed 0 tokens/s
    or crashed before)."""
    r, _ = bench("--model", tiny, "--tokens", str(tokens), "--reference-tokens", str(reference), "--no-hf",
                 "--prompt", "ab c")
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout)
    assert set(rows) == {("tiny f16", "vegafuse cpu", f"tg{tokens}"), ("tiny f32", "vegafuse cpu", f"tg{tokens}"),
                         ("tiny f16", "vegafuse reference (numpy)", f"tg{reference}")}, rows
    assert all(v > 0 for v in rows.values()), rows
    assert "ids agree with the f16 run: f32 True, reference True" in r.stdout


def test_the_prefill_table(tiny):
    r, _ = bench("--model", tiny, "--prefill", "5", "--repeat", "2", "--no-hf")
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout)
    assert list(rows) == [("tiny f16", "vegafuse cpu", "pp5")] and rows[("tiny f16", "vegafuse cpu", "pp5")] > 0


def test_the_table_never_divides_by_zero():
    from engine.bench import Table, rate, ratio
    assert rate(0, 1.0) is None and rate(5, 0.0) is None and rate(5, -1e-9) is None and rate(4, 2.0) == 2.0
    assert ratio(None, 3.0) == "n/a" and ratio(3.0, 0.0) == "n/a" and ratio(3.0, 1.5) == "2.00x"
    Table().row("m", "", "b", "tg1", None)


def test_quant_dtypes_are_the_dsl_s():
    from dsl.quant import QUANT_DTYPES
    from engine import bench
    assert bench.QUANT_DTYPES == QUANT_DTYPES
