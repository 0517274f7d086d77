"""GPTQ-int4 weights end to end: ``from_gptq`` against the GPTQ reference (``gptq_dequantize``) bit
for bit, GEMVs whose activation is gathered by a desc_act permutation, and a tiny GPTQ checkpoint
(SmolLM2 cut to two layers, its linear layers quantized by ``gptq_quantize``) that loads from a
Hugging Face directory and decodes as the same model with the GPTQ weights dequantized to f32."""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import dsl
from dsl.quant import QArray, from_gptq, gptq_dequantize, gptq_quantize
from engine.errors import ModelError
from engine.model import Model
from engine.weights import (_LAYER_TENSORS, default_dtype, default_model_path, export_hf_dir, load_model,
                            resident_bytes)
from stdlib.nn import linear

rng = np.random.default_rng()
COMBOS = [(sym, desc_act, fmt) for sym in (True, False) for desc_act in (False, True) for fmt in ("gptq", "gptq_v2")]


def gptq_layer(n, k, group, sym, desc_act, fmt="gptq"):
    """A fresh GPTQ layer [n, k]: (its tensors, the reference values gptq_dequantize gives)."""
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1))).astype(np.float32)
    parts = gptq_quantize(w, group, sym, desc_act, rng=rng, checkpoint_format=fmt)
    return parts, gptq_dequantize(*parts, sym=sym, checkpoint_format=fmt)


# ------------------------------------------------------------------------------------ from_gptq
@pytest.mark.parametrize("sym,desc_act,fmt", COMBOS)
@pytest.mark.parametrize("group", [32, 96, -1])
def test_from_gptq_equals_the_reference_bit_for_bit(sym, desc_act, fmt, group):
    parts, ref = gptq_layer(24, 192, group, sym, desc_act, fmt)
    w, perm = from_gptq(*parts, sym=sym, checkpoint_format=fmt)
    assert isinstance(w, QArray) and w.dtype == "gptq_int4" and w.shape == (24, 192) and w.nbytes == 24 * 6 * 20
    assert (perm is not None) == (desc_act and group != -1)
    inv = np.arange(192) if perm is None else np.argsort(perm)
    if perm is not None:
        assert perm.dtype == np.int32 and sorted(perm) == list(range(192))
        g_idx = parts[3][perm]
        assert (np.diff(g_idx) >= 0).all()                            # columns sorted by group
    np.testing.assert_array_equal(w.dequantize()[:, inv].view(np.uint32), ref.view(np.uint32))
    x = rng.standard_normal((3, 192))
    p = slice(None) if perm is None else perm
    np.testing.assert_allclose(x[:, p] @ w.dequantize().T.astype(np.float64), x @ ref.T.astype(np.float64),
                               rtol=1e-12, atol=1e-12)
    # every block holds its group's scale and zero point: the f16 bits of scales, an exact integer
    blocks = w.data.reshape(24, 6, 20)
    groups = (parts[3] if perm is None else parts[3][perm])[::32]
    np.testing.assert_array_equal(blocks[:, :, :2].copy().view(np.float16)[..., 0], parts[2][groups].T)
    z = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    assert (z == np.round(z)).all() and z.min() >= 0 and z.max() <= 16
    if sym:
        assert (z == 8).all()


def test_from_gptq_errors():
    parts, _ = gptq_layer(8, 64, 16, sym=True, desc_act=False)
    with pytest.raises(ValueError, match="multiple of 32 inputs, but group 0 has 16"):
        from_gptq(*parts)
    parts, _ = gptq_layer(8, 64, 32, sym=False, desc_act=False)
    with pytest.raises(ValueError, match="symmetric GPTQ checkpoint"):
        from_gptq(*parts, sym=True)
    parts8 = gptq_quantize(rng.standard_normal((8, 64)), 32, bits=8)
    with pytest.raises(ValueError, match="only 4-bit checkpoints"):
        from_gptq(*parts8, bits=8)
    with pytest.raises(ValueError, match="gptq_int4 weights come from GPTQ checkpoints"):
        dsl.quant.quantize("gptq_int4", np.ones((2, 32)))


# ---------------------------------------------------------------------------------- kernels
def rms_norm(x, g):
    return x * dsl.rsqrt(dsl.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g


@pytest.mark.parametrize("act", ["q8_1", "float"])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("desc_act", [False, True])
def test_linear_gathers_the_activation_by_perm_inside_the_gemv(t, desc_act, act, monkeypatch):
    """On the CPU: with the q8_1 activation (the default), against that arithmetic in float64 on
    the permuted activation; with ``VEGAFUSE_QUANT_ACT=float``, against the float64 interpreter."""
    from tests.test_quant_kernels import check_int8, rms_norm_np
    monkeypatch.setenv("VEGAFUSE_QUANT_ACT", act)
    n, k = 96, 256
    parts, ref = gptq_layer(n, k, 64, False, desc_act)
    w, perm = from_gptq(*parts, sym=False)
    x, g = rng.standard_normal((t, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    args = (x, g, w, b) + (() if perm is None else (perm,))
    jf = dsl.jit(lambda x, g, w, b, *perm: linear(rms_norm(x, g), w, b, *perm))
    got = np.asarray(jf(*args), np.float64)
    want = jf.lower(*args).program.run(*args, compute_dtype="f64")[0]
    h = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(want, h @ ref.T.astype(np.float64) + b, rtol=1e-9, atol=1e-9)
    if act == "q8_1":
        check_int8(got, rms_norm_np(x, g)[:, slice(None) if perm is None else perm], w, b)
    else:
        scale = np.abs(h) @ np.abs(ref.T)
        assert (np.abs(got - want) <= 2e-5 * scale.max()).all()
    kernels = jf.compile(*args).plan.kernels
    if t == 1:
        assert len(kernels) == 1 and kernels[0].family == "contract"  # norm, gather, GEMV, bias: one kernel


def test_gfx906_gemv_with_a_permuted_activation_keeps_the_isa_gates():
    from engine.devices.rocm import HipUnavailable, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:                                    # pragma: no cover - depends on the host
        pytest.skip(f"gfx906 tests skipped: {e}")
    from codegen.inspect import Inspected, counts, main_loop
    from codegen.targets import get_target
    from engine.pipeline import lower_program
    parts, _ = gptq_layer(576, 1536, 128, False, True)
    w, perm = from_gptq(*parts, sym=False)
    x, g = rng.standard_normal((1, 1536)).astype(np.float32), rng.uniform(0.5, 1.5, 1536).astype(np.float32)
    prog = dsl.jit(lambda x, g, w, perm: linear(rms_norm(x, g), w, perm=perm)).lower(x, g, w, perm)
    (kern,) = [k for k in lower_program(prog).kernels if k.family == "contract"]
    it = Inspected(kern, get_target("gfx906"))
    c = counts(main_loop(it.isa()))
    assert "vf_dot_gptq_int4" in it.source and c["dot4"] >= 8 and c["dwordx4"] >= 1
    assert c["lds_per_byte"] <= 0.056 and it.res["scratch_bytes"] == 0, (c, it.res)


@pytest.mark.parametrize("act", ["q8_1", "float"])
@pytest.mark.parametrize("wave", [32, 64])
def test_cuda_gemv_with_a_permuted_activation(wave, act, monkeypatch):
    """On a CUDA GPU (skipped without one), at wave 32 and gfx906's wave 64: the q8_1 activation
    path errs by at most half a q8_1 step per activation element; the float path by f16 rounding of
    the activation."""
    from engine.executable import get_device
    try:
        get_device("cuda", wave=32)
    except Exception as e:                                   # no driver, no GPU, no cuda-python
        pytest.skip(f"CUDA tests skipped: {e}")
    monkeypatch.setenv("VEGAFUSE_CUDA_WAVE", str(wave))
    monkeypatch.setenv("VEGAFUSE_QUANT_ACT", act)
    n, k = 4096, 3584
    parts, ref = gptq_layer(n, k, 128, False, True)
    w, perm = from_gptq(*parts, sym=False)
    x, g = rng.standard_normal((1, k)).astype(np.float32), rng.uniform(0.5, 1.5, k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    got = np.asarray(dsl.jit(lambda x, g, w, b, perm: linear(rms_norm(x, g), w, b, perm), backend="cuda")(
        x, g, w, b, perm), np.float64)
    h = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
    want = h @ ref.T.astype(np.float64) + b
    scale = (np.abs(h) @ np.abs(ref.T)).max()
    if act == "q8_1":                                        # half a step of each block's scale max|h| / 127
        from tests.test_quant_kernels import q8_1_gemv
        np.testing.assert_allclose(got, q8_1_gemv(h[:, perm].astype(np.float32), w) + b, rtol=0,
                                   atol=1e-5 * scale + 1e-6)   # the same arithmetic in float64
        step = np.repeat(np.abs(h[:, perm]).reshape(1, -1, 32).max(axis=2), 32, axis=1) / 127
        bound = (step / 2) @ np.abs(w.dequantize().T) + 1e-4 * scale
    else:                                                    # the activation may sit in LDS as f16
        bound = 2.0 ** -11 * (np.abs(h) @ np.abs(ref.T)) + 1e-4 * scale
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


# ------------------------------------------------------------------------- a tiny checkpoint
N_LAYERS, GROUP, N_TOKENS = 2, 64, 16
# (sym, desc_act, checkpoint_format, where the settings are)
CHECKPOINTS = [(True, False, "gptq", "config.json"), (False, False, "gptq_v2", "quantize_config.json"),
               (True, True, "gptq_v2", "config.json"), (False, True, "gptq", "quantize_config.json")]


@pytest.fixture(scope="module")
def smol_hf(tmp_path_factory):
    """SmolLM2 exported as a Hugging Face directory, cut to N_LAYERS layers: (directory, its
    tensors by name, its config.json)."""
    d = tmp_path_factory.mktemp("smol-hf")
    export_hf_dir(default_model_path(), str(d))
    with open(d / "config.json") as fh:
        config = json.load(fh)
    config["num_hidden_layers"] = N_LAYERS
    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < N_LAYERS}
    os.remove(d / "model.safetensors")
    return d, tensors, config


def write_dir(d, base, tensors, config, extra=None):
    """A model directory ``d``: ``base``'s tokenizer files, ``config`` (plus the files ``extra``:
    name -> JSON object) and ``tensors`` in two shards (so no tensor is written twice)."""
    os.makedirs(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.symlink(base / name, d / name)
    for name, obj in {"config.json": config, **(extra or {})}.items():
        with open(d / name, "w") as fh:
            json.dump(obj, fh)
    layers = {k: v for k, v in tensors.items() if k.startswith("model.layers.")}
    save_file(layers, str(d / "model-00002.safetensors"))
    others = d.parent / "others.safetensors"
    if not others.exists():
        save_file({k: v for k, v in tensors.items() if k not in layers}, str(others))
    os.symlink(others, d / "model-00001.safetensors")


def gptq_checkpoint(smol_hf, tmp_path, sym, desc_act, fmt, where):
    """The GPTQ directory of SmolLM2's first layers (AutoGPTQ names, settings in ``where``) and the
    float directory of the same model with the GPTQ weights dequantized (gptq_dequantize)."""
    base, tensors, config = smol_hf
    quantized, dequantized = dict(tensors), dict(tensors)
    for i in range(N_LAYERS):
        for _, _, hname in _LAYER_TENSORS:
            x = f"model.layers.{i}.{hname[:-len('.weight')]}"
            w = tensors[x + ".weight"]
            if w.ndim != 2:
                continue
            qweight, qzeros, scales, g_idx = gptq_quantize(w, GROUP, sym, desc_act, rng=rng, checkpoint_format=fmt)
            del quantized[x + ".weight"]
            quantized.update({x + ".qweight": qweight, x + ".qzeros": qzeros, x + ".scales": scales,
                              x + ".g_idx": g_idx})
            dequantized[x + ".weight"] = gptq_dequantize(qweight, qzeros, scales, g_idx, sym=sym,
                                                         checkpoint_format=fmt)
    settings = {"bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": sym, "checkpoint_format": fmt,
                "quant_method": "gptq", "damp_percent": 0.01, "true_sequential": True}
    qdir, fdir = tmp_path / "gptq", tmp_path / "float"
    if where == "config.json":
        write_dir(qdir, base, quantized, {**config, "quantization_config": settings})
    else:
        write_dir(qdir, base, quantized, config, {"quantize_config.json": settings})
    write_dir(fdir, base, dequantized, config)
    return qdir, fdir


def decode(cfg, params, tok, n=N_TOKENS, feed=None):
    """Greedy ids and the logits of each step, token by token on the CPU; with ``feed`` (another
    run's ids) each step reads those ids instead of its own, so both runs see the same inputs."""
    m = Model(cfg, params, context=64, backend="cpu")
    logits = [np.asarray(m.prefill(tok.encode("The capital of France is")))]
    ids = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        logits.append(np.asarray(m.decode(ids[-1] if feed is None else feed[i])))
        ids.append(int(np.argmax(logits[-1])))
    return ids, np.array(logits)


def assert_same_argmax(ids, fids, flogits, tol):
    """The argmax ids agree at every step whose reference top two are more than ``tol`` apart (a
    step closer than that is a tie within the logits' tolerance, and either id is right)."""
    top2 = np.sort(flogits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > tol
    assert clear.sum() >= len(fids) // 2, "too many near-ties to compare argmaxes"
    assert [a for a, c in zip(ids, clear) if c] == [b for b, c in zip(fids, clear) if c]


@pytest.mark.parametrize("sym,desc_act,fmt,where", CHECKPOINTS)
def test_tiny_gptq_checkpoint_loads_and_decodes_as_its_dequantized_weights(smol_hf, tmp_path, monkeypatch, sym,
                                                                           desc_act, fmt, where):
    """The GPTQ model decodes as its f32 copy, fed the same ids: the same argmax at every step that
    is not a tie within the tolerance (the random desc_act grouping can make one), the logits within 0.05% of the
    largest (measured 0.004-0.007%: the int8 path's activation with its residual plane) and, each
    weight dequantized as it is loaded (``VEGAFUSE_QUANT_ACT=float``), within float rounding."""
    qdir, fdir = gptq_checkpoint(smol_hf, tmp_path, sym, desc_act, fmt, where)
    assert default_dtype(str(qdir)) == "native" and default_dtype(str(fdir)) == "f16"
    cfg, params, tok = load_model(str(qdir), "native")
    assert set(resident_bytes(params)) == {"f16", "gptq_int4", "f32"} | ({"i32"} if desc_act else set())
    fcfg, fparams, _ = load_model(str(fdir), "f32")
    assert cfg == fcfg and cfg.n_layers == N_LAYERS
    for p, fp in zip(params["layers"], fparams["layers"]):
        for key, _, _ in _LAYER_TENSORS:
            if fp[key].ndim == 1:
                np.testing.assert_array_equal(p[key], fp[key])
                continue
            w, perm = p[key], p.get(key + "_perm")
            assert isinstance(w, QArray) and w.dtype == "gptq_int4" and w.shape == fp[key].shape
            assert (perm is not None) == desc_act
            inv = np.arange(w.shape[1]) if perm is None else np.argsort(perm)
            np.testing.assert_array_equal(w.dequantize()[:, inv], fp[key])     # loaded without a float step
    assert params["embed"].dtype == np.float16                   # "native": float tensors as f16
    np.testing.assert_array_equal(params["embed"], fparams["embed"].astype(np.float16))
    fparams["embed"] = params["embed"]                           # the same embedding in both models
    _, floats, _ = load_model(str(qdir), "f32")                 # dequantized at load, columns as in the QArray
    for p, fp in zip(floats["layers"], fparams["layers"]):
        assert p.keys() == params["layers"][0].keys()
        np.testing.assert_array_equal(p["w_down"], fp["w_down"][:, p.get("w_down_perm", slice(None))])
    fids, flogits = decode(fcfg, fparams, tok)
    assert len(set(fids)) >= 2                                   # a continuation, not one token repeated
    ids, logits = decode(cfg, params, tok, feed=fids)            # integer dot products, the reference's inputs
    tol = 5e-4 * np.abs(flogits).max()
    np.testing.assert_allclose(logits, flogits, rtol=0, atol=tol)
    assert_same_argmax(ids, fids, flogits, 2 * tol)
    monkeypatch.setenv("VEGAFUSE_QUANT_ACT", "float")
    ids, float_logits = decode(cfg, params, tok, feed=fids)
    assert not np.array_equal(float_logits, logits)
    np.testing.assert_allclose(float_logits, flogits, rtol=1e-4, atol=1e-4 * np.abs(flogits).max())
    assert_same_argmax(ids, fids, flogits, 2e-4 * np.abs(flogits).max())


def test_gptq_settings_and_tensors_are_checked(smol_hf, tmp_path):
    base, tensors, config = smol_hf
    settings = {"bits": 4, "group_size": 64, "desc_act": False, "sym": True}
    bad = [({"bits": 8}, r"key 'quantization_config.bits' = 8: only 4-bit"),
           ({"group_size": 48}, r"key 'quantization_config.group_size' = 48: must be -1 or a multiple of 32"),
           ({"quant_method": "awq"}, r"quant_method' = \"awq\": only GPTQ"),
           ({"checkpoint_format": "marlin"}, r"checkpoint_format' = \"marlin\": must be one of gptq, gptq_v2"),
           ({"desc_act": "yes"}, r"desc_act' = \"yes\": must be true or false"),
           ({"is_marlin_format": True}, r"is_marlin_format' = true: Marlin-packed")]
    small = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
    for i, (change, message) in enumerate(bad):
        d = tmp_path / f"bad{i}"
        write_dir(d, base, small, {**config, "quantization_config": {**settings, **change}})
        with pytest.raises(ModelError, match=message) as e:
            load_model(str(d), "f32")
        assert "config.json" in str(e.value) and "\n" not in str(e.value)
    qdir, _ = gptq_checkpoint(smol_hf, tmp_path, True, False, "gptq", "quantize_config.json")
    with safe_open(str(qdir / "model-00002.safetensors"), framework="numpy") as f:
        layers = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.up_proj.qzeros"}
    save_file(layers, str(qdir / "model-00002.safetensors"))
    with pytest.raises(ModelError, match=r"layer model.layers.1.mlp.up_proj has no model.layers.1.mlp.up_proj.qzeros"):
        load_model(str(qdir), "f32")


def test_damaged_or_ambiguous_gptq_layers_are_one_line(smol_hf, tmp_path):
    """Each would load and decode wrongly without a word: a desc_act checkpoint without g_idx (its
    columns in the wrong order), a layer stored both as float and as GPTQ tensors, a NaN scale, and GPTQ
    tensors with no quantization settings at all."""
    def rewrite(qdir, change):
        path = str(qdir / "model-00002.safetensors")
        with safe_open(path, framework="numpy") as f:
            layers = {k: f.get_tensor(k) for k in f.keys()}
        change(layers)
        os.remove(path)
        save_file(layers, path)
        return qdir

    x = "model.layers.0.mlp.gate_proj"

    def nan_scale(t):
        s = t[x + ".scales"].copy()
        s[0, int(rng.integers(s.shape[1]))] = np.float16(np.nan)
        t[x + ".scales"] = s
    cases = [(True, lambda t: [t.pop(k) for k in list(t) if k.endswith(".g_idx")], r"g_idx, but \S*quantize_config.json says desc_act"),
             (False, lambda t: t.__setitem__(x + ".weight", smol_hf[1][x + ".weight"]), "stored twice"),
             (False, nan_scale, "NaN or infinite scale")]
    for i, (desc_act, change, needle) in enumerate(cases):
        qdir, _ = gptq_checkpoint(smol_hf, tmp_path / f"case{i}", True, desc_act, "gptq", "quantize_config.json")
        with pytest.raises(ModelError, match=needle) as e:
            load_model(str(rewrite(qdir, change)), "f32")
        assert "\n" not in str(e.value)
    qdir, _ = gptq_checkpoint(smol_hf, tmp_path / "group", True, False, "gptq", "quantize_config.json")
    settings = json.loads((qdir / "quantize_config.json").read_text())
    (qdir / "quantize_config.json").write_text(json.dumps({**settings, "group_size": 2 * GROUP}))
    with pytest.raises(ModelError, match=rf"scale groups over its \d+ inputs, but \S*quantize_config.json says "
                                         rf"group_size {2 * GROUP}") as e:
        load_model(str(qdir), "f32")
    assert "\n" not in str(e.value)
    qdir, _ = gptq_checkpoint(smol_hf, tmp_path / "nosettings", True, False, "gptq", "quantize_config.json")
    os.remove(qdir / "quantize_config.json")
    with pytest.raises(ModelError, match="quantize_config.json") as e:
        load_model(str(qdir), "f32")
    assert "is a GPTQ layer's" in str(e.value)
