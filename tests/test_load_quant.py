"""Loading that keeps quantized weights quantized: the default Q4_1 GGUF as QArrays over the
file map (dtype "native"), --quant q4_0/q4_1/q8_0 at load, resident bytes, errors, the CLI."""
import json
import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from dsl import quant as dsl_quant
from dsl.quant import QArray
from engine.errors import ModelError
from engine.weights import (default_dtype, default_model_path, export_hf_dir, format_resident,
                            load_model, resident_bytes, unpermute_qk)
from tests.test_weights import one_line_error, tiny_hf_weights, write_tiny_gguf

rng = np.random.default_rng()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = gguf.GGMLQuantizationType
GGUF_TYPE = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0}
LAYER_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
               "wo": "attn_output", "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
               "w_down": "ffn_down", "bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}


def by_gguf_name(params):
    """{GGUF tensor name: leaf} of a params pytree."""
    out = {"token_embd.weight": params["embed"], "output_norm.weight": params["norm"]}
    if "lm_head" in params:
        out["output.weight"] = params["lm_head"]
    for i, layer in enumerate(params["layers"]):
        for k, v in layer.items():
            out[f"blk.{i}.{LAYER_NAMES[k]}.{'bias' if k[0] == 'b' else 'weight'}"] = v
    return out


def gguf_quantize(fmt, x):
    """The gguf package's quantizer as a QArray (the reference for ours, dsl.quant.quantize)."""
    x = np.asarray(x, np.float32)
    return QArray(gguf.quants.quantize(x, GGUF_TYPE[fmt]).reshape(-1), x.shape, fmt)


def map_of(a):
    """The np.memmap at the end of ``a``'s base chain, or None (a copy)."""
    while a is not None and not isinstance(a, np.memmap):
        a = getattr(a, "base", None)
    return a


# --------------------------------------------------------------------------- the default Q4_1 GGUF
@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def native(path):
    return load_model(path, "native")


@pytest.fixture(scope="module")
def f32(path):
    return load_model(path, "f32")


@pytest.fixture(scope="module")
def file_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_native_matrices_are_qarrays_of_the_file_type_equal_to_the_f32_load(native, f32, file_tensors):
    cfg, got, _ = native
    want = by_gguf_name(f32[1])
    seen = set()
    for name, a in by_gguf_name(got).items():
        t = file_tensors[name]
        if a.ndim == 1:
            assert isinstance(a, np.ndarray) and a.dtype == np.float32, name
            np.testing.assert_array_equal(a, want[name])
            continue
        assert isinstance(a, QArray) and a.dtype == t.tensor_type.name.lower(), (name, a)
        assert a.shape == want[name].shape
        d = a.dequantize()
        assert d.dtype == np.float32
        np.testing.assert_array_equal(d.view(np.uint32), want[name].view(np.uint32), err_msg=name)
        seen.add(a.dtype)
    assert seen == {"q4_1", "q8_0"} and cfg.arch == "llama"


def test_native_keeps_the_file_bytes_in_place(native, path, file_tensors):
    """QArray data are views of the file map; Q/K are the file's rows, un-permuted."""
    cfg, params, _ = native
    real = os.path.realpath(path)
    for name, a in by_gguf_name(params).items():
        if a.ndim == 1:
            continue
        raw = np.asarray(file_tensors[name].data)
        if ".attn_q." in name or ".attn_k." in name:
            assert map_of(a.data) is None                     # whole rows taken: a copy of blocks
            rows = unpermute_qk(np.arange(a.shape[0]), cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads)
            np.testing.assert_array_equal(a.data.reshape(raw.shape), raw[rows])
        else:
            m = map_of(a.data)
            assert m is not None and os.path.realpath(m.filename) == real, name
            np.testing.assert_array_equal(a.data.reshape(raw.shape), raw)


def test_native_load_dequantizes_nothing(path, monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError("dequantized at load")
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(dsl_quant, "dequantize_blocks", refuse)
    monkeypatch.setattr(QArray, "dequantize", refuse)
    _, params, _ = load_model(path, "native")
    assert isinstance(params["layers"][7]["wq"], QArray)


def test_resident_bytes_match_the_gguf_tensor_bytes(native, file_tensors):
    _, params, _ = native
    file_bytes = sum(int(t.n_bytes) for t in file_tensors.values())
    by_kind = {}
    for t in file_tensors.values():
        kind = {"F32": "f32"}.get(t.tensor_type.name, t.tensor_type.name.lower())
        by_kind[kind] = by_kind.get(kind, 0) + int(t.n_bytes)
    r = resident_bytes(params)
    assert r == by_kind and list(r) == ["q4_1", "q8_0", "f32"]
    assert abs(sum(r.values()) - file_bytes) <= 0.05 * file_bytes
    assert format_resident(params) == (f"weights: q4_1 {r['q4_1'] / 1e6:.1f} MB, q8_0 {r['q8_0'] / 1e6:.1f} MB, "
                                       f"f32 {r['f32'] / 1e6:.1f} MB")


def test_resident_bytes_of_float_params(f32):
    _, params, _ = f32
    r = resident_bytes(params)
    n = sum(a.size for a in by_gguf_name(params).values())
    assert r == {"f32": 4 * n}


# --------------------------------------------------------------------------- tiny models
D, HQ, HKV, HD, F, V = 64, 4, 2, 16, 256, 8


def tiny(seed, arch="llama"):
    return tiny_hf_weights(arch, D=D, Hq=HQ, Hkv=HKV, hd=HD, F=F, V=V, tied=False, seed=seed)


def write(tmp_path, w, arch="llama", **kw):
    return write_tiny_gguf(tmp_path / f"{arch}.gguf", w, arch=arch, D=D, Hq=HQ, Hkv=HKV, F=F,
                           permute=arch == "llama", **kw)


def f16_model(w):
    """The float weights as an f16 model stores them (matrices f16, norms and biases f32)."""
    return {k: v.astype(np.float16) if v.ndim == 2 else v for k, v in w.items()}


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quant_of_an_f16_gguf_equals_the_gguf_quantizer(tmp_path, fmt, arch):
    w = f16_model(tiny(seed=int.from_bytes(os.urandom(2), "little"), arch=arch))
    path = write(tmp_path, w, arch)
    _, params, _ = load_model(path, "native", quant=fmt)
    got = by_gguf_name(params)
    assert got.keys() == w.keys()
    for name, want in w.items():
        a = got[name]
        if want.ndim == 1:                         # norms and biases stay float32
            assert isinstance(a, np.ndarray) and a.dtype == np.float32
            np.testing.assert_array_equal(a, want)
            continue
        ref = gguf_quantize(fmt, want)             # HF row order: Q/K un-permuted before quantizing
        assert isinstance(a, QArray) and (a.dtype, a.shape) == (fmt, ref.shape), name
        np.testing.assert_array_equal(np.asarray(a.data).reshape(-1), ref.data, err_msg=name)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quant_of_an_f16_hf_dir_equals_the_gguf_quantizer(tmp_path, fmt):
    from safetensors.numpy import load_file, save_file
    w = f16_model(tiny(seed=int.from_bytes(os.urandom(2), "little")))
    d = tmp_path / "hf"
    export_hf_dir(write(tmp_path, w), str(d))
    st = d / "model.safetensors"
    save_file({k: v.astype(np.float16) if v.ndim == 2 else v for k, v in load_file(str(st)).items()}, str(st))
    _, params, _ = load_model(str(d), quant=fmt)
    got = by_gguf_name(params)
    for name, want in w.items():
        if want.ndim == 2:
            np.testing.assert_array_equal(np.asarray(got[name].data).reshape(-1), gguf_quantize(fmt, want).data)
        else:
            np.testing.assert_array_equal(got[name], want)
    assert resident_bytes(params) == {fmt: sum(dsl_quant.nbytes(fmt, v.size) for v in w.values() if v.ndim == 2),
                                      "f32": sum(4 * v.size for v in w.values() if v.ndim == 1)}


def test_quantized_gguf_native_and_requantized(tmp_path):
    """A Q4_0 / Q8_0 / F16 / F32 file: native keeps each as stored (Q/K rows un-permuted as blocks);
    --quant keeps a tensor already in its format and requantizes the others from their values."""
    w = tiny(seed=int.from_bytes(os.urandom(2), "little"))
    types = {k: (T.Q4_0 if i % 3 == 0 else T.Q8_0 if i % 3 == 1 else T.F16)
             for i, k in enumerate(n for n in w if w[n].ndim == 2)}
    path = write(tmp_path, w, types=types)
    _, ref, _ = load_model(path, "f32")
    ref = by_gguf_name(ref)
    _, native, _ = load_model(path, "native")
    for name, a in by_gguf_name(native).items():
        kind = types.get(name)
        if kind in (T.Q4_0, T.Q8_0):
            assert isinstance(a, QArray) and a.dtype == kind.name.lower()
            np.testing.assert_array_equal(a.dequantize(), ref[name])
        else:
            assert a.dtype == (np.float16 if kind == T.F16 else np.float32)
            np.testing.assert_array_equal(a, ref[name].astype(a.dtype))
    _, requant, _ = load_model(path, "native", quant="q8_0")
    for name, a in by_gguf_name(requant).items():
        if types.get(name) == T.Q8_0:              # kept: the very blocks of the native load
            np.testing.assert_array_equal(a.data, by_gguf_name(native)[name].data)
        elif name in types:                        # Q4_0 dequantized, F16 values: quantized again
            np.testing.assert_array_equal(np.asarray(a.data).reshape(-1), gguf_quantize("q8_0", ref[name]).data)


def test_other_gguf_quantizations_become_f16_with_a_warning(tmp_path, capfd):
    w = tiny(seed=3)
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, (D, F // 256, 144), dtype=np.uint8)        # Q4_K: 256 per block
    blocks[..., :4] = np.array([0.01, 0.002], np.float16).view(np.uint8)     # finite d, dmin
    w["blk.1.ffn_down.weight"] = blocks.reshape(D, -1)
    path = write(tmp_path, w, types={"blk.1.ffn_down.weight": T.Q4_K})
    _, p, _ = load_model(path, "native")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blk.1.ffn_down.weight" in err[0] and "Q4_K" in err[0] and "f16" in err[0]
    values = gguf.quants.dequantize(blocks.reshape(D, -1), T.Q4_K)
    np.testing.assert_array_equal(p["layers"][1]["w_down"], values.astype(np.float16))
    _, p, _ = load_model(path, "native", quant="q4_1")                        # requantized, silently
    assert capfd.readouterr().err == ""
    np.testing.assert_array_equal(np.asarray(p["layers"][1]["w_down"].data).reshape(-1),
                                  gguf_quantize("q4_1", values).data)


def test_qk_unpermute_of_quantized_rows_matches_the_float_one(tmp_path):
    w = tiny(seed=int.from_bytes(os.urandom(2), "little"))
    path = write(tmp_path, w, types={n: T.Q8_0 for n in w if ".attn_q." in n or ".attn_k." in n})
    _, p, _ = load_model(path, "native")
    for i in range(2):
        for key, name in (("wq", "attn_q"), ("wk", "attn_k")):
            want = gguf.quants.dequantize(gguf.quants.quantize(w[f"blk.{i}.{name}.weight"], T.Q8_0), T.Q8_0)
            assert isinstance(p["layers"][i][key], QArray)
            np.testing.assert_allclose(p["layers"][i][key].dequantize(), w[f"blk.{i}.{name}.weight"],
                                       atol=np.abs(w[f"blk.{i}.{name}.weight"]).max() / 100)
            # quantizing rows is row-local, so the permuted file's blocks un-permute exactly
            np.testing.assert_array_equal(p["layers"][i][key].dequantize(), want)


# --------------------------------------------------------------------------- errors and the CLI
def test_error_bad_quant_and_dtype(path):
    with pytest.raises(ModelError) as e:
        load_model(path, "native", quant="q5_0")
    assert "\n" not in str(e.value) and "'q5_0'" in str(e.value) and "q4_0, q4_1, q8_0" in str(e.value)
    msg = one_line_error(path, "bf16", "native, f16, f32", dtype="bf16")
    assert msg.startswith("unknown dtype")


def test_error_quant_needs_a_multiple_of_32(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights())        # D = 16
    with pytest.raises(ModelError) as e:
        load_model(path, quant="q4_0")
    msg = str(e.value)
    assert "\n" not in msg and "token_embd.weight" in msg and "(8, 16)" in msg and "32" in msg, msg


def test_error_quant_of_a_non_finite_weight(tmp_path):
    w = tiny(seed=7)
    w["blk.1.ffn_up.weight"][5, 40] = np.inf
    path = write(tmp_path, w)
    for kw in ({"dtype": "f32"}, {"quant": "q8_0"}):                         # refused as stored, before any --quant
        with pytest.raises(ModelError) as e:
            load_model(path, **kw)
        msg = str(e.value)
        assert "\n" not in msg and "blk.1.ffn_up.weight" in msg and "at [5, 40]" in msg and "infinite" in msg, msg


def test_default_dtype(path, tmp_path):
    assert default_dtype(path, "cpu") == "native"
    assert default_dtype(path, "cuda") == "native" and default_dtype(path, "hip") == "native"   # loaded as stored
    assert default_dtype(str(tmp_path), "cpu") == "f16"                    # a Hugging Face directory


def cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_cli_reports_resident_weights(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights())
    r = cli("--model", path, "--dtype", "f32", "--max-tokens", "2", "--temperature", "0", "ab")
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if "weights:" in x]
    n = sum(v.size for v in tiny_hf_weights().values())
    assert len(line) == 1 and f"weights: f32 {4 * n / 1e3:.1f} kB" in line[0], r.stderr
    r = cli("--model", path, "--quant", "q4_0", "ab")                    # D = 16
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "multiple of 32" in r.stderr


def test_cli_native_weights_by_default(path):
    """The default model runs with its own q4_1 / q8_0 weights, and its greedy ids are the f16
    path's (tests/test_model.py checks the default CLI against the reference ids, too)."""
    from tests.test_weights import GREEDY
    args = ("--max-tokens", "8", "--temperature", "0", "--json", "The capital of France is")
    native, f16 = cli(*args), cli("--dtype", "f16", *args)
    assert native.returncode == 0 and f16.returncode == 0, native.stderr + f16.stderr
    assert "weights: q4_1 66.4 MB, q8_0 30.1 MB, f32 0.1 MB" in native.stderr
    assert "weights: f16 269.0 MB, f32 0.1 MB" in f16.stderr
    assert json.loads(native.stdout)["ids"] == json.loads(f16.stdout)["ids"] == GREEDY[:8]


def test_cli_quant(tmp_path):
    path = write(tmp_path, f16_model(tiny(seed=8)))
    r = cli("--model", path, "--quant", "q4_0", "--max-tokens", "3", "--temperature", "0", "--json", "ab")
    assert r.returncode == 0, r.stderr
    assert "weights: q4_0 " in r.stderr and len(json.loads(r.stdout)["ids"]) <= 3


# --------------------------------------------------------------------------- the GGUF header reader
def assert_same_as_gguf_reader(path):
    """engine.weights' reader gives the fields and tensors gguf.GGUFReader gives."""
    from engine.weights import _open_gguf
    ours, ref = _open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for k, f in ours.fields.items():
        a, b = f.contents(), ref.fields[k].contents()
        assert a == b and type(a) is type(b), k
        if isinstance(a, list) and a:
            assert [type(x) for x in a] == [type(x) for x in b], k
    assert len(ours.tensors) == len(ref.tensors)
    for x, y in zip(ours.tensors, ref.tensors):
        assert (x.name, list(x.shape), x.tensor_type, x.n_bytes, x.data_offset) == \
               (y.name, list(y.shape), y.tensor_type, int(y.n_bytes), int(y.data_offset))
        assert (x.data.shape, x.data.dtype) == (y.data.shape, y.data.dtype), x.name
        np.testing.assert_array_equal(x.data, y.data)


def test_header_reader_equals_gguf_on_the_default_model(path):
    assert_same_as_gguf_reader(path)


def test_header_reader_equals_gguf_on_every_value_type(tmp_path):
    V = gguf.GGUFValueType
    rng = np.random.default_rng()
    meta = {"test.u8": (int(rng.integers(256)), V.UINT8), "test.i8": (-int(rng.integers(128)), V.INT8),
            "test.u16": (int(rng.integers(2**16)), V.UINT16), "test.i16": (-int(rng.integers(2**15)), V.INT16),
            "test.u32": (int(rng.integers(2**32)), V.UINT32), "test.u64": (2**64 - int(rng.integers(9)) - 1, V.UINT64),
            "test.i64": (-2**63 + int(rng.integers(9)), V.INT64), "test.f32": (float(rng.standard_normal()), V.FLOAT32),
            "test.f64": (float(rng.standard_normal()), V.FLOAT64), "test.bool": (True, V.BOOL),
            "test.text": ("héllo wörld ✓", V.STRING),
            "test.floats": ([float(x) for x in rng.standard_normal(5)], V.ARRAY),
            "test.bools": ([True, False, True], V.ARRAY), "test.strings": (["a", "", "ü"], V.ARRAY)}
    w = tiny(seed=5)
    types = {"blk.0.ffn_up.weight": T.Q4_1, "blk.1.attn_v.weight": T.Q8_0, "blk.0.attn_output.weight": T.F16,
             "blk.1.ffn_gate.weight": T.Q4_0}
    path = write(tmp_path, w, meta=meta, types=types)
    assert_same_as_gguf_reader(path)


def test_header_reader_cut_anywhere_is_one_line(tmp_path):
    """A file cut at any byte of its header (or data) gives one ModelError line, never a crash."""
    data = open(write(tmp_path, tiny(seed=6)), "rb").read()
    for cut in sorted(set(np.random.default_rng().integers(4, len(data), 40).tolist()) | {4, 8, 24, 25}):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:cut])
        msg = one_line_error(bad, "cut.gguf", "re-download")
        assert "truncated" in msg or "corrupt" in msg, (cut, msg)


# --------------------------------------------------------------------------- damaged files
def _q4_0_file(tmp_path, seed):
    w = tiny_hf_weights("llama", D=64, Hq=4, Hkv=2, hd=16, F=256, V=8, tied=False, seed=seed)
    path = write_tiny_gguf(tmp_path / "q.gguf", w, D=64, Hq=4, Hkv=2, F=256,
                           types={k: T.Q4_0 for k, v in w.items() if v.ndim == 2})
    return path, {t.name: t for t in gguf.GGUFReader(path).tensors}


def _edited(path, name, edit):
    b = bytearray(open(path, "rb").read())
    edit(b)
    out = os.path.join(os.path.dirname(path), name)
    with open(out, "wb") as fh:
        fh.write(b)
    return out


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_block_scale_that_is_not_finite_is_one_line_naming_tensor_and_block(tmp_path, value):
    """A damaged quant block (its f16 d NaN or infinite) would make every logit NaN, and greedy
    decoding stop at once with no error: the loader names the tensor, the block and its row, for every
    dtype (native keeps the blocks; f16 / f32 would dequantize NaN)."""
    seed = int(rng.integers(1 << 30))
    path, t = _q4_0_file(tmp_path, seed)
    gate = t["blk.0.ffn_gate.weight"]
    block = int(rng.integers(1, gate.n_bytes // 18))
    at = int(gate.data_offset) + 18 * block
    bad = _edited(path, "bad.gguf", lambda b: b.__setitem__(slice(at, at + 2), np.float16(value).tobytes()))
    for dtype in ("native", "f16"):
        one_line_error(bad, "blk.0.ffn_gate.weight", f"block {block} ", f"row {block * 32 // 64}", "NaN or infinite",
                       dtype=dtype)
    assert load_model(path, "native")[1]["layers"][0]["w_gate"].dtype == "q4_0"     # the undamaged file loads


def test_tensor_offsets_out_of_order_or_overlapping_are_one_line(tmp_path):
    """gguf.md: each tensor's data follows the one before it, aligned.  Offsets swapped in the header (or
    one tensor pointed at another's data, or misaligned) would load the wrong weights silently."""
    path, t = _q4_0_file(tmp_path, int(rng.integers(1 << 30)))
    gate, up = t["blk.0.ffn_gate.weight"], t["blk.0.ffn_up.weight"]
    base = min(int(x.data_offset) for x in t.values())
    header = open(path, "rb").read()[:base]

    def field(name):                    # the byte offset of the tensor's data-offset field in the header
        return header.index(name.encode()) + len(name) + 4 + 8 * 2 + 4

    og, ou = int(gate.data_offset) - base, int(up.data_offset) - base
    swapped = _edited(path, "swapped.gguf", lambda b: (struct.pack_into("<Q", b, field(gate.name), ou),
                                                       struct.pack_into("<Q", b, field(up.name), og)))
    overlapping = _edited(path, "overlap.gguf", lambda b: struct.pack_into("<Q", b, field(up.name), og))
    shifted = _edited(path, "shifted.gguf", lambda b: struct.pack_into("<Q", b, field(up.name), ou + 32))
    for bad in (swapped, overlapping, shifted):
        one_line_error(bad, "starts at data offset", "damaged", dtype="native")


def test_alignment_written_as_a_bool_is_refused_and_f64_weights_load(tmp_path):
    w = tiny_hf_weights(seed=int(rng.integers(1 << 30)))
    bad = write_tiny_gguf(tmp_path / "align.gguf", w, meta={"general.alignment": (True, gguf.GGUFValueType.BOOL)})
    one_line_error(bad, "general.alignment")
    f64 = write_tiny_gguf(tmp_path / "f64.gguf", {**w, "blk.0.ffn_up.weight": w["blk.0.ffn_up.weight"].astype(np.float64)})
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(f64).tensors}["blk.0.ffn_up.weight"] == T.F64
    cfg, params, _ = load_model(f64, "f32")
    want = load_model(write_tiny_gguf(tmp_path / "f32.gguf", w), "f32")[1]
    np.testing.assert_array_equal(params["layers"][0]["w_up"], want["layers"][0]["w_up"])


def test_a_float_weight_that_is_not_finite_is_one_line_naming_tensor_and_element(tmp_path):
    """NaN or inf in an F32 / F16 GGUF tensor or a safetensors weight would decode to NaN logits and stop
    greedy decoding at once without a word: the loader names the tensor and the element."""
    w = tiny_hf_weights(seed=int(rng.integers(1 << 30)))
    for value, dtype in ((np.nan, np.float32), (np.inf, np.float16), (-np.inf, np.float32)):
        bad = dict(w)
        up = w["blk.0.ffn_up.weight"].astype(dtype)
        at = tuple(int(rng.integers(n)) for n in up.shape)
        up[at] = value
        bad["blk.0.ffn_up.weight"] = up
        path = write_tiny_gguf(tmp_path / "bad.gguf", bad)
        one_line_error(path, "blk.0.ffn_up.weight", f"at {list(at)}", "NaN or infinite")
    good = write_tiny_gguf(tmp_path / "good.gguf", w)
    out = tmp_path / "hf"
    export_hf_dir(good, str(out))
    from safetensors.numpy import load_file, save_file
    st = str(out / "model.safetensors")
    tensors = load_file(st)
    name = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[name][0, 1] = np.nan
    save_file(tensors, st, metadata={"format": "pt"})
    one_line_error(out, name, "at [0, 1]", "NaN or infinite")


def test_a_header_whose_tensor_count_lies_is_one_line(tmp_path):
    """One tensor more than the entries (the data's first bytes read as an entry) or one fewer (the last
    entry's bytes left where the padding should be): the count is named, not a tensor's data."""
    path, t = _q4_0_file(tmp_path, int(rng.integers(1 << 30)))
    count = struct.unpack_from("<Q", open(path, "rb").read(), 8)[0]
    for n in (count + 1, count - 1):
        bad = _edited(path, f"count{n}.gguf", lambda b: struct.pack_into("<Q", b, 8, n))
        one_line_error(bad, "tensor count", dtype="native")
