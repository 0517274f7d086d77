"""GPTQ checkpoints in Hugging Face directories (AutoGPTQ / GPTQModel safetensors).

A GPTQ directory is a transformers directory whose linear layers ``X.weight`` are stored as
``X.qweight`` (I32), ``X.qzeros`` (I32), ``X.scales`` (F16) and ``X.g_idx`` (I32, absent in
some checkpoints: groups in order); the packing is described by ``dsl.quant.gptq_dequantize``.
The settings are config.json's ``quantization_config`` (transformers) or quantize_config.json
(AutoGPTQ, GPTQModel): ``bits`` (4 only), ``group_size`` (-1 or a multiple of 32),
``desc_act``, ``sym``, ``checkpoint_format`` ("gptq" or "gptq_v2").

Each layer becomes a ``gptq_int4`` QArray [N, K] (``dsl.quant.from_gptq``: an integer repack,
no dequantization) and, with ``desc_act``, a permutation ``perm`` (i32 [K]) that the params hold
as ``<key>_perm`` next to the weight (``wq_perm`` ...; ``stdlib.nn.linear`` gathers the
activation with it).  Embedding, norms and an unquantized lm_head load as float tensors.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from dsl.quant import GPTQ_FORMATS, from_gptq

from .errors import ModelError

PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")     # the tensors of one quantized layer
_DTYPES = {".qweight": ("I32", "U32"), ".qzeros": ("I32", "U32"), ".scales": ("F16",), ".g_idx": ("I32", "I64")}


@dataclass(frozen=True)
class GPTQConfig:
    """The settings of a GPTQ checkpoint, read from ``source`` (a file name, for messages)."""
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str
    source: str


def quant_config(d: str, hf: dict) -> GPTQConfig | None:
    """The GPTQ settings of the Hugging Face directory ``d`` (``hf``: its config.json): config.json's
    ``quantization_config``, else quantize_config.json; None for a float checkpoint.

    Raises ModelError (one line naming the file and key) for another quantization method, bits
    other than 4, a group size that is not -1 or a multiple of 32, a non-boolean desc_act / sym,
    or an unknown checkpoint_format."""
    if "quantization_config" in hf:
        src, q, key = os.path.join(d, "config.json"), hf["quantization_config"], "quantization_config."
        if not isinstance(q, dict):
            raise ModelError(f"{src}: key 'quantization_config' must be an object, got {type(q).__name__}; "
                             "fix config.json")
    else:
        src, key = os.path.join(d, "quantize_config.json"), ""
        if not os.path.isfile(src):
            return None
        try:
            with open(src, encoding="utf-8") as fh:
                q = json.load(fh)
        except (OSError, ValueError) as e:
            raise ModelError(f"{src}: unreadable ({e}); fix or re-download the file") from None
        if not isinstance(q, dict):
            raise ModelError(f"{src}: must hold a JSON object, got {type(q).__name__}; fix or re-download it")

    def bad(name, problem):
        return ModelError(f"{src}: key '{key}{name}' = {json.dumps(q.get(name))}: {problem}")
    method = q.get("quant_method", "gptq")
    if method != "gptq":
        raise bad("quant_method", "only GPTQ checkpoints are supported (quant_method \"gptq\"); "
                                  "use a GPTQ or float checkpoint")
    if q.get("is_marlin_format"):
        raise bad("is_marlin_format", "Marlin-packed GPTQ checkpoints are not supported; use the plain "
                                      "GPTQ checkpoint (qweight/qzeros/scales/g_idx)")
    if q.get("bits") != 4:
        raise bad("bits", "only 4-bit GPTQ checkpoints are supported; use a 4-bit one")
    group = q.get("group_size", -1)
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group > 0 and group % 32 == 0):
        raise bad("group_size", "must be -1 or a multiple of 32 (whole 32-element blocks per group); "
                                "use a checkpoint quantized with group_size 32, 64, 128 ...")
    flags = {}
    for name, default in (("desc_act", False), ("sym", True)):
        flags[name] = q.get(name, default)
        if not isinstance(flags[name], bool):
            raise bad(name, "must be true or false; fix the file")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise bad("checkpoint_format", f"must be one of {', '.join(GPTQ_FORMATS)}; "
                                       "re-save the checkpoint in one of those")
    return GPTQConfig(group, flags["desc_act"], flags["sym"], fmt, src)


def is_gptq_dir(d: str) -> bool:
    """Does the Hugging Face directory ``d`` hold a GPTQ checkpoint (config.json's
    ``quantization_config`` with quant_method "gptq", or quantize_config.json)?  Unreadable files
    answer False (loading reports them)."""
    try:
        with open(os.path.join(d, "config.json"), encoding="utf-8") as fh:
            q = json.load(fh).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    if q is not None:
        return isinstance(q, dict) and q.get("quant_method", "gptq") == "gptq"
    return os.path.isfile(os.path.join(d, "quantize_config.json"))


def is_packed(qcfg: GPTQConfig | None, name: str) -> bool:
    """Is tensor ``name`` part of a quantized layer of a GPTQ checkpoint (``qcfg`` not None)?"""
    return qcfg is not None and name.endswith(PACKED)


def load_gptq_tensors(handles: dict, qcfg: GPTQConfig | None) -> dict:
    """The quantized layers of a GPTQ checkpoint: ``{"X.weight": (QArray gptq_int4 [N, K], perm
    i32 [K] or None)}`` for every ``X.qweight``; {} when ``qcfg`` is None.

    ``handles``: tensor name -> (safetensors handle, file path, shape), as the loader collects
    them; it is updated in place: each layer's ``X.qweight/qzeros/scales/g_idx`` are replaced by
    one entry ``X.weight`` -> (None, file, (N, K)), so that the loader checks the names and shapes
    of quantized and float layers alike.

    Raises ModelError for a layer without qweight, qzeros or scales, a tensor of the wrong dtype,
    scales whose group count contradicts ``qcfg.group_size``, or tensors that do not fit together
    (naming the layer, the file and the problem)."""
    if qcfg is None:
        return {}
    layers = sorted({n[:-len(s)] for n in handles for s in PACKED if n.endswith(s)})
    out = {}
    for x in layers:
        parts = {s: handles.pop(x + s, None) for s in PACKED}
        path = next(p[1] for p in parts.values() if p is not None)
        if x + ".weight" in handles:
            raise ModelError(f"{path}: layer {x} is stored twice, as {x}.weight (in {handles[x + '.weight'][1]}) "
                             f"and as the GPTQ tensors {x}.qweight...; remove one")
        for s, p in parts.items():
            if p is None:
                if s == ".g_idx" and qcfg.desc_act:
                    raise ModelError(f"{path}: layer {x} has no {x}.g_idx, but {qcfg.source} says desc_act: the "
                                     "column order is lost; re-download the checkpoint")
                if s == ".g_idx":
                    continue
                raise ModelError(f"{path}: layer {x} has no {x}{s}; a GPTQ layer needs qweight, qzeros "
                                 "and scales, re-download the checkpoint")
            dt = p[0].get_slice(x + s).get_dtype()
            if dt not in _DTYPES[s]:
                raise ModelError(f"{p[1]}: tensor {x}{s} has dtype {dt}, a GPTQ checkpoint stores it as "
                                 f"{' or '.join(_DTYPES[s])}; re-download or re-quantize the checkpoint")
        get = {s: None if p is None else p[0].get_tensor(x + s) for s, p in parts.items()}
        bad = np.argwhere(~np.isfinite(get[".scales"]))
        if len(bad):
            raise ModelError(f"{path}: tensor {x}.scales holds a NaN or infinite scale at {list(map(int, bad[0]))} "
                             "(group, column); the checkpoint is damaged, re-download or re-quantize it")
        k, groups = get[".qweight"].shape[0] * 8, get[".scales"].shape[0]
        if groups != (1 if qcfg.group_size == -1 else -(-k // qcfg.group_size)):
            raise ModelError(f"{path}: GPTQ layer {x} holds {groups} scale groups over its {k} inputs, but "
                             f"{qcfg.source} says group_size {qcfg.group_size}; the checkpoint and its "
                             "quantization config disagree, fix group_size or re-download the checkpoint")
        try:
            w, perm = from_gptq(get[".qweight"].view(np.int32), get[".qzeros"].view(np.int32), get[".scales"],
                                get[".g_idx"], bits=4, sym=qcfg.sym, checkpoint_format=qcfg.checkpoint_format)
        except ValueError as e:
            raise ModelError(f"{path}: GPTQ layer {x}: {e}") from None
        out[x + ".weight"] = (w, perm)
        handles[x + ".weight"] = (None, path, w.shape)
    return out


def add_perms(params: dict, packed: dict, cfg) -> None:
    """Put each desc_act layer's ``perm`` into ``params`` next to its weight (``wq`` ->
    ``wq_perm``).  ``packed``: ``load_gptq_tensors``' result; ``cfg``: the LlamaConfig.

    Raises ModelError for a permuted weight the model cannot gather for (the embedding or the
    lm_head)."""
    from .weights import _tensor_specs
    for key, layer, _, hname, _ in _tensor_specs(cfg):
        perm = packed.get(hname, (None, None))[1]
        if perm is None:
            continue
        if layer is None:
            raise ModelError(f"{hname} is a desc_act GPTQ layer (its inputs permuted by g_idx), which the "
                             "model supports only in its decoder layers; use a checkpoint whose "
                             f"{hname} is not quantized, or quantized without desc_act")
        params["layers"][layer][key + "_perm"] = perm
