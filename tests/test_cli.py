"""The command line: bad input gives one line on stderr and exit code 2, never a traceback;
a tiny synthetic model generates end to end and streams text."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_weights import tiny_hf_weights, write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "engine.generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, input=stdin)


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny_hf_weights())


def test_missing_model_file(tmp_path):
    assert_one_line_error(cli("--model", str(tmp_path / "missing.gguf"), "hello"), "missing.gguf")


def test_truncated_model_file(tmp_path, tiny):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(open(tiny, "rb").read()[:300])
    assert_one_line_error(cli("--model", str(bad), "hello"), "cut.gguf", "truncated")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(np.random.default_rng().bytes(4096))
    assert_one_line_error(cli("--model", str(bad), "hello"), "weights.bin", "GGUF")


def test_tensor_shape_contradicts_config(tmp_path):
    w = tiny_hf_weights()
    w["blk.0.ffn_gate.weight"] = np.ones((30, 16), np.float32)          # the config says 24 x 16
    path = write_tiny_gguf(tmp_path / "shape.gguf", w)
    assert_one_line_error(cli("--model", path, "hello"), "blk.0.ffn_gate.weight", "(30, 16)")


def test_unknown_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "arch.gguf", tiny_hf_weights(), arch="gptj")
    assert_one_line_error(cli("--model", path, "hello"), "gptj")


def test_empty_prompt(tiny):
    assert_one_line_error(cli("--model", tiny, ""), "empty")


def test_prompt_longer_than_context(tiny):
    assert_one_line_error(cli("--model", tiny, "--context", "4", "ab ab ab ab ab ab ab ab"), "context")


def test_tiny_model_generates_and_streams(tiny):
    r = cli("--model", tiny, "--temperature", "0.7", "--seed", "3", "--max-tokens", "6", "--top-k", "0", "ab c")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr
    j = cli("--model", tiny, "--temperature", "0.7", "--seed", "3", "--max-tokens", "6", "--top-k", "0",
            "--json", "ab c")
    out = json.loads(j.stdout)
    assert r.stdout.rstrip("\n") == out["text"]          # streamed text equals the decoded ids
    assert len(out["ids"]) <= 6 and all(0 <= i < 8 for i in out["ids"])
