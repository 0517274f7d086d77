"""Kernel names from the model's structure, not from counters.

A name reads as the kernel does: the layer, then the building blocks and plain ops it
runs, in program order, with the weights each ``linear`` reads::

    layers_3_rms_norm_linear_w_gate_w_up_silu_mul      RMSNorm -> gate/up GEMVs -> SiLU * mul
    layers_3_rope_kv_write                             RoPE on q and k, then the KV-cache write
    layers_3_causal_attention
    rms_norm_linear_embed                              the final norm and the (tied) LM head

* the layer comes from the weights a kernel reads (``params_layers_3_w_gate`` ->
  ``layers_3``); a kernel that touches no layer's weights (attention reads the cache and q)
  takes the layer of the kernels that read its outputs, else of those that computed its
  inputs, unless it reads a weight that belongs to no layer (the final norm): ``kernel_layers``;
* an op traced inside a ``stdlib/nn.py`` building block is named after the innermost block
  (``Eqn.scope``); a plain op after its primitive; a plain ``dynamic_update_slice`` after the
  buffer it writes; views, gathers and casts only move data and are named only when a kernel
  does nothing else;
* each word appears once, at its first op; names are at most ``MAX_LEN`` characters, valid C
  identifiers, and unique within a plan (``_2`` only on a true clash).
"""
from __future__ import annotations

import re

MAX_LEN = 60
_LAYER = re.compile(r"(?:^|_)((?:layers|layer|blocks|block|h)_\d+)(?:_|$)")
_WORDS = {"reduce_sum": "sum", "reduce_max": "max", "select": "where", "dot": "matmul"}
_QUIET = ("view", "index")                      # primitive kinds that only move data
# names a kernel may not take: C/C++ keywords and the math functions a kernel calls
_RESERVED = set("""auto break case char const continue default do double else enum extern float for goto if
int long register return short signed sizeof static struct switch typedef union unsigned void volatile
while bool true false class delete new operator private public template this throw try typename using
virtual abs exp expf log logf sqrt sqrtf rsqrt rsqrtf sin sinf cos cosf tanh tanhf max min fmaxf fminf
main and or not xor bitand bitor compl and_eq or_eq xor_eq not_eq floor floorf fmodf asm inline restrict
threadIdx blockIdx blockDim gridDim warpSize size_t""".split())


def c_safe(name: str) -> str:
    """``name`` as an identifier the generated C may declare: a trailing ``_`` when it is a C/C++
    word, a name the kernels call, or in the prelude's (``vf_``, ``VF_``) or the compiler's
    (``__``, ``_Float16``) space."""
    reserved = name in _RESERVED or name.startswith(("vf_", "VF_", "__")) or re.match(r"_[A-Z]", name)
    return name + "_" if reserved else name


def layer_of(name):
    """``layers_3`` for a buffer name such as ``params_layers_3_w_gate``, else None."""
    m = _LAYER.search(name)
    return m.group(1) if m else None


def weight_name(name):
    """A weight's own name: ``params_layers_3_w_gate`` -> ``w_gate``, ``params_embed`` -> ``embed``."""
    m = _LAYER.search(name)
    if m and name[m.end():]:
        return name[m.end():]
    return name[len("params_"):] if name.startswith("params_") and len(name) > 7 else name


def _word(e, buffers):
    if e.scope:
        return e.scope[-1]
    if e.prim.name in ("dynamic_update_slice", "scatter") and e.out in buffers:
        return weight_name(buffers[e.out])
    return _WORDS.get(e.prim.name, e.prim.name)


def _quiet(e):
    return not e.scope and (e.prim.kind in _QUIET and e.prim.name not in ("dynamic_update_slice", "scatter")
                            or e.prim.name in ("convert", "iota"))


_INDEXED = ("take", "gather", "scatter")       # primitives whose operands past the first are indices


def _index_math(eqns, made):
    """The integer and bool ops of a kernel that only compute indices of a take, gather or scatter
    (``where(ids < 0, ids + n, ids)``): they only move data, and are not named."""
    users = {}
    for e in eqns:
        for a in e.inputs:
            users.setdefault(a, []).append(e)
    out = set()
    for e in reversed(eqns):                      # consumers first
        if e.prim.kind in ("elementwise", "view") and e.out.dtype in ("i32", "bool") and users.get(e.out) and all(
                u in out or (u.prim.name in _INDEXED and e.out in u.inputs[1:] and e.out is not u.inputs[0]
                             and not (u.prim.name == "scatter" and e.out is u.inputs[1]))
                for u in users[e.out]):
            out.add(e)
    return out


def kernel_name(eqns, buffers, layer=None) -> str:
    """The name of one kernel.

    ``eqns``: the DSL equations fused into it, in program order; ``buffers``: Var -> buffer name
    for its parameters (the weight of a contraction is looked up here); ``layer``: the layer
    prefix (``layers_3``) or None.  Returns a C identifier of at most ``MAX_LEN`` characters."""
    made = {e.out: e for e in eqns}
    index = _index_math(eqns, made)
    words = {}                                             # word -> weight names, in first-use order
    for e in [e for e in eqns if not _quiet(e) and e not in index] or [e for e in eqns if e not in index] or eqns:
        ws = words.setdefault(_word(e, buffers), [])
        if e.prim.kind == "contract" and len(e.inputs) > 1:
            w = e.inputs[1]
            while w not in buffers and w in made and (made[w].prim.kind == "view"            # w.T, w.astype
                                                      or made[w].prim.name in ("dequantize", "take")):
                w = made[w].inputs[0]
            if w in buffers and weight_name(buffers[w]) not in ws:
                ws.append(weight_name(buffers[w]))
    parts = [layer] if layer else []
    parts += ["_".join([w] + ws) for w, ws in words.items()] or ["kernel"]
    while len(parts) > 1 and len("_".join(parts)) > MAX_LEN:
        parts.pop()
    name = re.sub(r"[^A-Za-z0-9_]", "_", "_".join(parts))[:MAX_LEN].strip("_") or "kernel"
    if name[0].isdigit():
        name = "k_" + name
    return name + "_k" if c_safe(name) != name else name


_UNKNOWN = "?"                                  # no weight says, and no input's kernel did


_TARGET = re.compile(r"([A-Za-z_]\w*)\s*(?:[-+*/@]?=)(?!=)")      # `q = ...`, `x += ...`
_LAYER_DEPTH = 6                                # producers searched back for a layer's weights


def _nearest_layer(graph, v, names):
    """The layer of the weights nearest to ``v`` among the program inputs it is computed from
    (the highest layer at the nearest depth), or None."""
    level, seen = [v], {v}
    for _ in range(_LAYER_DEPTH):
        found, nxt = [], []
        for x in level:
            e = graph.producer.get(x)
            # a quantized weight, or a cast (the KV write to an f16 cache), stands for its input
            while e is not None and e.prim.name in ("dequantize", "convert"):
                x = e.inputs[0]
                e = graph.producer.get(x)
            if e is None:
                found += [layer_of(names[x])] if x in names else []
                continue
            for a in e.inputs:
                if hasattr(a, "shape") and a not in seen and hasattr(a, "size"):
                    seen.add(a)
                    nxt.append(a)
        found = [f for f in found if f]
        if found:
            return max(found, key=lambda f: int(f.rsplit("_", 1)[1]))
        level = nxt
    return None


def buffer_name(graph, v, names) -> str:
    """The name of the buffer that holds the computed value ``v``: the model's variable when
    ``v`` is what its source line assigns (``q = linear(h, p["wq"])`` -> ``q``), else its
    primitive, after the layer whose weights it is computed from: ``layers_3_q``, ``layers_3_x``,
    ``layers_3_mul``.  ``graph``: ``fusion.partition.Graph``; ``names``: Var -> buffer name of
    the buffers named so far (the program's inputs at least).  Not unique: the caller adds a suffix."""
    from dsl.core import source_text
    e = graph.producer[v]
    base = _WORDS.get(e.prim.name, e.prim.name)
    if e.source and not any(u.source == e.source for u in graph.users.get(v, [])):
        m = _TARGET.match(source_text(e).partition("  ")[2])
        base = m.group(1) if m else base
    layer = _nearest_layer(graph, v, names)
    name = re.sub(r"[^A-Za-z0-9_]", "_", f"{layer}_{base}" if layer else base)
    return "_" + name if name[0].isdigit() else c_safe(name)


def kernel_layers(kernels) -> list:
    """The layer of each kernel (``layers_3`` or None), from the buffers it touches: its weights'
    names; None when it reads a weight outside every layer (the final norm); else the one layer
    that the kernels reading its outputs belong to (attention feeds layer 3's output projection);
    else the layer of the kernels that computed its inputs."""
    written = {p.name for k in kernels for p in k.params if p.role != "in"}
    reads = [{p.name for p in k.params if p.role != "out" and p.kind == "buffer"} for k in kernels]
    writes = [{p.name for p in k.params if p.role != "in"} for k in kernels]
    layers = []
    for k in kernels:                                     # the layers of the weights it reads
        named = [x for x in (layer_of(p.name) for p in k.params if p.kind == "buffer" and p.name not in written) if x]
        if named:
            layers.append(max(sorted(set(named)), key=named.count))
        elif any(n not in written for n in reads[len(layers)]):
            layers.append(None)                            # reads a weight outside every layer
        else:
            layers.append(_UNKNOWN)
    for i in reversed(range(len(kernels))):               # by the kernels that read its outputs
        if layers[i] == _UNKNOWN:
            users = {layers[j] for j in range(i + 1, len(kernels)) if reads[j] & writes[i]} - {_UNKNOWN}
            if len(users) == 1 and None not in users:
                layers[i] = users.pop()
    for i in range(len(kernels)):                          # by the kernels that computed its inputs
        if layers[i] == _UNKNOWN:
            inputs = [layers[j] for j in range(i) if writes[j] & reads[i]]
            layers[i] = next((x for x in reversed(inputs) if x not in (None, _UNKNOWN)), None)
    return layers


def kernel_names(kernels, eqns, names) -> list:
    """Names for every kernel of a plan, in launch order.

    ``kernels``: Loop IR kernels (their ``params`` say which buffers they read and write);
    ``eqns``: each kernel's DSL equations in program order; ``names``: Var -> buffer name."""
    out, used = [], {}
    for k, es, layer in zip(kernels, eqns, kernel_layers(kernels)):
        params = {p.name for p in k.params if p.kind == "buffer"}
        name = base = kernel_name(es, {v: n for v, n in names.items() if n in params}, layer)
        while name in used:
            used[base] = used.get(base, 1) + 1
            name = f"{base[:MAX_LEN - 4]}_{used[base]}"
        used.setdefault(name, 1)
        out.append(name)
    return out
