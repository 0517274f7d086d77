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


# ------------------------------------------------------------------ stream(): stop strings, finish reasons
class ScriptedModel:
    """Logits that make greedy decoding produce ``script`` id by id (prefill gives the first)."""

    def __init__(self, script, vocab):
        self.script, self.vocab, self.calls = list(script), vocab, 0

    def _next(self):
        x = np.zeros(self.vocab, np.float32)
        x[self.script[self.calls]] = 5.0
        self.calls += 1
        return x

    def prefill(self, ids):
        return self._next()

    def decode(self, token_id):
        return self._next()


class CharTokenizer:
    """Id i decodes to PIECES[i]; the last id is the EOS."""
    PIECES = ["a", "b", "ab", " ", "xy", "é", "\n", "</s>"]

    def decode(self, ids, skip_special=False):
        return "".join(self.PIECES[i] for i in ids)


def run_stream(script, stop, max_tokens=100):
    from engine.generate import Finished, stream
    eos = len(CharTokenizer.PIECES) - 1
    out = list(stream(ScriptedModel(script, eos + 1), CharTokenizer(), [0], max_tokens, eos_ids=(eos,), stop=stop))
    assert isinstance(out[-1], Finished) and all(isinstance(p, str) and p for p in out[:-1])
    return out[:-1], out[-1]


def test_stream_honours_stop_strings_against_a_plain_reference():
    """Fresh random id scripts and stop strings: decoding stops at the first id whose text completes a
    stop string, the yielded text is the text so far cut before the first stop string in it (or all of
    it at the EOS), and the ids end with the one that completed it."""
    rng = np.random.default_rng()
    pieces = CharTokenizer.PIECES[:-1]
    for _ in range(300):
        script = rng.integers(0, len(pieces), int(rng.integers(1, 25))).tolist() + [len(pieces)]
        full = "".join(pieces[i] for i in script[:-1])
        stop = tuple({full[a:a + int(rng.integers(1, 4))] if full and rng.random() < 0.7 else
                      "".join(rng.choice(["a", "b", "x", "y", " ", "é"], 3))
                      for a in rng.integers(0, max(1, len(full)), int(rng.integers(1, 3)))} - {""})
        got, fin = run_stream(script, stop)
        text_of = lambda k: "".join(pieces[i] for i in script[:k])            # noqa: E731
        done = [k for k in range(1, len(script)) if any(s in text_of(k) for s in stop)]   # completed at id k
        n_ids = done[0] if done else len(script) - 1
        cut = min(i for i in (text_of(n_ids).find(s) for s in stop) if i >= 0) if done else len(full)
        want = full[:cut]
        assert "".join(got) == want == fin.text, (script, stop)
        assert fin.finish_reason == "stop"
        assert fin.ids == script[:n_ids]


def test_stream_length_and_held_text_flushed_at_the_end():
    got, fin = run_stream([0, 1, 0, 1, 0], stop=("aX",), max_tokens=3)     # "a" held back, then released
    assert "".join(got) == "aba" and fin.finish_reason == "length" and fin.ids == [0, 1, 0]
    assert got[-1] == "a"
    got, fin = run_stream([0, 7], stop=("ab",))
    assert got == ["a"] and fin.finish_reason == "stop" and fin.ids == [0]
    got, fin = run_stream([2, 3, 2], stop=("b a",))                          # "ab ab" stops inside a token
    assert got == ["a"] and fin.text == "a" and fin.ids == [2, 3, 2]


def test_generate_is_stream_run_to_the_end():
    from engine.generate import generate
    script = np.random.default_rng().integers(0, 7, 12).tolist()
    seen = []
    ids, stats = generate(ScriptedModel(script, 8), CharTokenizer(), [0], 12, eos_ids=(7,), on_text=seen.append)
    assert ids == script and "".join(seen) == "".join(CharTokenizer.PIECES[i] for i in script)
    assert set(stats) == {"prefill_s", "decode_s", "decode_tokens_per_s"}
    with pytest.raises(ValueError, match="stop strings"):
        generate(ScriptedModel(script, 8), CharTokenizer(), [0], 4, stop=("",))


# ------------------------------------------------------------------ options, help, version, repo ids
def test_help_names_the_command_and_has_no_markup(tmp_path):
    r = cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m engine.generate")
    for option in ("--stop", "--repeat-penalty", "--min-p", "--version", "-m MODEL", "-n MAX_TOKENS", "--temp"):
        assert option in r.stdout
    assert not any(m in r.stdout for m in ("``", ":func:", ":class:", ".. ")), r.stdout
    script = tmp_path / "vegafuse-generate"                     # what pip's console script runs
    script.write_text("import sys\nfrom engine.generate import main\nsys.exit(main())\n")
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout.startswith("usage: vegafuse-generate"), r.stdout[:200]


def test_version():
    from engine.errors import package_version
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"vegafuse {package_version()}"


@pytest.mark.parametrize("args,needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--max-tokens", "x"], "--max-tokens"),
    (["--min-p", "1.5", "hi"], "--min-p"),
    (["--repeat-penalty", "0", "hi"], "--repeat-penalty"),
    (["--repeat-penalty", "inf", "hi"], "--repeat-penalty must be a finite number > 0 (1.0 is off), got inf"),
    (["--stop", "", "hi"], "--stop"),
    (["-p", "one", "two"], "prompt once"),
    (["-n", "-2", "hi"], "--max-tokens"),
    (["--top-p", "2", "hi"], "--top-p must lie in (0, 1]"),
    (["--temperature", "-1", "hi"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf", "hi"], "--temperature must be a finite number >= 0 (0 is greedy), got inf"),
    (["--temperature", "nan", "hi"], "--temperature must be a finite number >= 0"),
])
def test_bad_options_are_one_error_line(args, needle):
    assert_one_line_error(cli(*args), needle)


@pytest.mark.parametrize("args,needle", [(["--top-p", "0"], "--top-p must lie in (0, 1] (1.0 keeps every id), got 0.0"),
                                         (["--temp", "-0.5"], "--temperature must be a finite number >= 0 (0 is greedy), got -0.5")])
def test_the_chat_names_the_bad_sampling_option(args, needle):
    """engine.chat checks its sampling options as engine.generate does (engine.sampling.settings_error):
    the line names the option, not both."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "engine.chat", *args], cwd=ROOT, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert_one_line_error(r, needle)


def test_short_aliases_parse_as_the_long_options():
    from engine.generate import parse_args
    a = parse_args(["-m", "m.gguf", "-p", "hi", "-n", "5", "-c", "64", "-s", "3", "--temp", "0.5",
                    "--stop", "x", "--stop", "yz", "--min-p", "0.1", "--repeat-penalty", "1.2"])
    assert (a.model, a.prompt, a.max_tokens, a.context, a.seed, a.temperature) == ("m.gguf", "hi", 5, 64, 3, 0.5)
    assert a.stop == ["x", "yz"] and a.min_p == 0.1 and a.repeat_penalty == 1.2 and a.repeat_last_n == 64
    assert parse_args(["-n", "-1", "hi"]).max_tokens == sys.maxsize          # llama.cpp's -n -1: no limit


def test_a_fifo_as_model_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    r = cli("--model", str(fifo), "hello")                  # would block forever if opened
    assert_one_line_error(r, "model.gguf", "FIFO")
    from engine.errors import ModelError
    from engine.weights import load_model
    with pytest.raises(ModelError, match="is a FIFO"):      # the library call too
        load_model(str(fifo))


def fake_hf_cache(root, tiny):
    """A Hugging Face hub cache (blobs, snapshots, refs) holding a GGUF repo with the tiny model,
    a GGUF repo with two files and a repo of an unsupported architecture."""
    import hashlib
    import shutil

    def repo(repo_id, files):
        d = root / f"models--{repo_id.replace('/', '--')}"
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        (d / "refs").mkdir(parents=True)
        (d / "refs" / "main").write_text(commit)
        snap = d / "snapshots" / commit
        snap.mkdir(parents=True)
        (d / "blobs").mkdir()
        for name, src in files.items():
            blob = d / "blobs" / hashlib.sha256(name.encode() + repo_id.encode()).hexdigest()
            shutil.copy(src, blob) if isinstance(src, str) else blob.write_text(json.dumps(src))
            (snap / name).symlink_to(os.path.relpath(blob, snap))
    repo("tiny-org/Tiny-GGUF", {"tiny.Q8.gguf": tiny})
    repo("tiny-org/Two-GGUF", {"a.gguf": tiny, "b.gguf": tiny})
    repo("other/Bert", {"config.json": {"model_type": "bert"}})
    return root


def test_repo_ids_resolve_offline_in_the_hugging_face_cache(tmp_path, tiny):
    from engine.errors import ModelError
    from engine.models import local_models, resolve_model
    cache = fake_hf_cache(tmp_path / "hub", tiny)
    got = resolve_model("tiny-org/Tiny-GGUF", cache)
    assert got.endswith("tiny.Q8.gguf") and open(got, "rb").read() == open(tiny, "rb").read()
    assert resolve_model("tiny-org/Two-GGUF/b.gguf", cache).endswith("b.gguf")
    with pytest.raises(ModelError, match="2 GGUF files.*Two-GGUF/a.gguf"):
        resolve_model("tiny-org/Two-GGUF", cache)
    with pytest.raises(ModelError, match="no such file or directory, nor a Hugging Face repo id"):
        resolve_model("tiny-org/Missing", cache)
    assert [m[0] for m in local_models(cache)] == ["tiny-org/Tiny-GGUF", "tiny-org/Two-GGUF/a.gguf",
                                                   "tiny-org/Two-GGUF/b.gguf"]       # not the BERT
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "engine.models"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "--model tiny-org/Tiny-GGUF" in r.stdout and "Bert" not in r.stdout, r.stdout


def test_options_end_to_end_with_a_cached_repo_id(tmp_path, tiny):
    """-m REPO_ID, the short aliases, min-p and the repeat penalty through the command; --stop cuts the
    same sampled text before its stop string, and the stream equals the JSON text."""
    env = {**os.environ, "HF_HUB_CACHE": str(fake_hf_cache(tmp_path / "hub", tiny)), "HF_HUB_OFFLINE": "1"}
    base = ["-m", "tiny-org/Tiny-GGUF", "--temp", "1.0", "--top-k", "0", "-s", "1", "-n", "20", "--min-p", "0.02",
            "--repeat-penalty", "1.1", "-p", "ab c"]

    def go(*extra):
        return subprocess.run([sys.executable, "-m", "engine.generate", *base, *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env=env)
    full = json.loads(go("--json").stdout)
    assert full["text"], full
    stop = full["text"][-1]
    want = full["text"][:full["text"].find(stop)]
    cut = json.loads(go("--json", "--stop", stop).stdout)
    assert cut["text"] == want and cut["finish_reason"] == "stop"
    streamed = go("--stop", stop)
    assert streamed.returncode == 0 and streamed.stdout == want + "\n"
