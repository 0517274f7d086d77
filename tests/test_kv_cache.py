"""The f16 KV cache (the default) and the f32 switch; the CPU's flash attention (query tiles x key
tiles, online softmax, causal tile skipping, GQA heads together, decode split over threads with a
log-sum-exp combine), each against the float64 interpreter on fresh random inputs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dsl
from codegen import llvm as cpu_render
from codegen import loopir as L
from engine.errors import ModelError
from engine.executable import get_device
from engine.model import Model
from stdlib import nn
from tests.test_kernels import check
from tests.test_simplify import execute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rng = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def f64_attention(q, kc, vc, pos, scale):
    """out[h, t] = softmax over s <= pos + t of q[h, t] . k[h // G, s] * scale, @ v: float64."""
    hq, T, _ = q.shape
    G = hq // kc.shape[0]
    out = np.zeros(q.shape)
    for h in range(hq):
        k, v = kc[h // G].astype(np.float64), vc[h // G].astype(np.float64)
        for t in range(T):
            s = k[:pos + t + 1] @ q[h, t].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[h, t] = p @ v[:pos + t + 1] / p.sum()
    return out


# (Hq, Hkv, T, S, head dim, pos, cache dtype): every T in {1, 5, 64, 130}, GQA ratio in {1, 3, 7}, head
# dim in {64, 128}, both cache dtypes, positions 0, in the middle and at the cache's end (pos = S - T)
CASES = [
    (9, 3, 1, 2100, 64, 2099, np.float16),       # SmolLM2-shaped decode at the last position
    (7, 1, 1, 300, 128, 123, np.float32),
    (12, 2, 1, 400, 128, 399, np.float16),
    (4, 4, 5, 40, 64, 35, np.float16),
    (21, 3, 5, 70, 128, 6, np.float32),
    (9, 3, 64, 200, 64, 0, np.float16),
    (6, 6, 64, 100, 128, 36, np.float32),
    (9, 3, 130, 300, 64, 170, np.float16),
    (14, 2, 130, 131, 64, 1, np.float16),
    (3, 1, 130, 260, 128, 77, np.float32),
]


@pytest.mark.parametrize("hq,hkv,T,S,d,pos,kv", CASES)
def test_attention_matches_float64(hq, hkv, T, S, d, pos, kv):
    q, kc, vc = randn(hq, T, d), randn(hkv, S, d, dtype=kv), randn(hkv, S, d, dtype=kv)
    f = dsl.jit(lambda q, k, v, p: dsl.attention(q, k, v, p, 1 / np.sqrt(d)))
    out = np.asarray(f(q, kc, vc, pos))
    np.testing.assert_allclose(out, f64_attention(q, kc, vc, pos, 1 / np.sqrt(d)), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("hq,hkv,T,pos", [(9, 3, 1, 37), (6, 2, 5, 11), (8, 8, 64, 20)])
def test_kv_write_into_an_f16_cache_then_attention(hq, hkv, T, pos):
    """The fused program with f16 caches against the float64 interpreter: k and v are f16 values
    (the interpreter's f64 mode does not round the write to the cache; the kernels do)."""
    S, d = 96, 64
    q = randn(hq, T, d)
    k, v = (randn(hkv, T, d, dtype=np.float16).astype(np.float32) for _ in range(2))
    kc, vc = randn(hkv, S, d, dtype=np.float16), randn(hkv, S, d, dtype=np.float16)

    def f(q, k, v, caches, pos):
        out, kc, vc = nn.causal_attention(q, caches[0], caches[1], k, v, pos)
        return out, [kc, vc]
    c = check(f, q, k, v, [kc, vc], pos, donate=(3,))
    att = [x for x in c.plan.kernels if x.family == "attention"][0]
    assert [p.dtype for p in att.params if p.shape == (hkv, S, d)] == ["f16", "f16"]


def test_attention_reads_only_positions_up_to_pos_plus_t():
    """Cache rows after the last query's position hold NaN: they must not be read."""
    hq, hkv, S, d = 9, 3, 300, 64
    for T, pos in ((1, 150), (40, 100)):
        q, kc, vc = randn(hq, T, d), randn(hkv, S, d, dtype=np.float16), randn(hkv, S, d, dtype=np.float16)
        kc[:, pos + T:], vc[:, pos + T:] = np.nan, np.nan
        out = np.asarray(dsl.jit(lambda q, k, v, p: dsl.attention(q, k, v, p, 0.125))(q, kc, vc, pos))
        np.testing.assert_allclose(out, f64_attention(q, kc, vc, pos, 0.125), rtol=2e-4, atol=2e-4)


class Reads(np.ndarray):
    """A float64 buffer that counts the element reads of the Loop IR interpreter."""
    count = 0

    def __getitem__(self, i):
        Reads.count += 1
        return super().__getitem__(i)


def interpret(a, q, k, v, pos, qrows, keys, parts):
    """``expand_attention`` (and ``combine_attention``) run by the Loop IR interpreter; returns
    (out, reads of k)."""
    mem = {"q": q.ravel().astype(np.float64), "k": k.ravel().astype(np.float64).view(Reads),
           "v": v.ravel().astype(np.float64), "out": np.zeros(q.size)}
    body = L.expand_attention(a, qrows, keys, parts)
    if parts > 1:
        body += L.combine_attention(a, parts)
    Reads.count = 0
    with np.errstate(all="ignore"):
        execute(body, {"pos": pos}, mem)
    return mem["out"].reshape(q.shape), Reads.count


@pytest.mark.parametrize("qrows,keys,parts", [(4, 8, 1), (3, 5, 1), (16, 64, 1), (1, 4, 2), (1, 3, 3)])
def test_tiles_skip_keys_after_the_query_tile_and_parts_combine(qrows, keys, parts):
    """Each query tile reads K for its rows up to its last row's position only (causal skipping:
    keys of later tiles are never loaded); parts of the context merge to the same rows."""
    hq, hkv, S, d, pos = 6, 2, 48, 8, 9
    T = 1 if parts > 1 else 11
    q, k, v = randn(hq, T, d), randn(hkv, S, d), randn(hkv, S, d)
    a = L.Attention("q", "k", "v", "out", ("f32", "f32", "f32"), hq, hkv, T, S, d,
                    L.Bin("max", L.c(0), L.Bin("min", L.Sym("pos", "i32"), L.c(S - T))), 0.3)
    out, reads = interpret(a, q, k, v, pos, qrows, keys, parts)
    np.testing.assert_allclose(out, f64_attention(q, k, v, pos, 0.3), rtol=1e-12, atol=1e-12)
    G = hq // hkv
    tiles = [(t0, min(qrows, T - t0)) for t0 in range(0, T, qrows)]
    assert reads == hkv * d * sum(G * tn * (pos + t0 + tn) for t0, tn in tiles)


def test_zigzag_order_balances_the_two_halves_of_the_items():
    """Query tiles go first, last, second, ...: the first half of a KV head's items does half the
    causal work."""
    a = L.Attention("q", "k", "v", "out", ("f32",) * 3, 3, 1, 128, 128, 8, L.c(0), 1.0)
    (loop,) = L.expand_attention(a, 16, 16, 1)
    body = loop.body
    tiles = []
    for item in range(8):
        env, mem = {"out_item": item}, {}
        execute(tuple(s for s in body if isinstance(s, L.Declare)), env, mem)
        tiles.append(env["out_t0"] // 16)
    assert tiles == [0, 7, 1, 6, 2, 5, 3, 4]
    work = [t + 1 for t in tiles]
    assert sum(work[:4]) == sum(work[4:])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_split_over_threads_merges_parts(monkeypatch, threads):
    """Decode with one KV head cuts the context into parts for the host's threads; the call that
    finishes last merges them, whether the launch runs on one thread or several."""
    monkeypatch.setattr(cpu_render, "_host_threads", lambda: 4)          # 4 parts
    hq, hkv, S, d, pos = 7, 1, 500, 128, 431
    q, kc, vc = randn(hq, 1, d), randn(hkv, S, d, dtype=np.float16), randn(hkv, S, d, dtype=np.float16)
    f = dsl.jit(lambda q, k, v, p: dsl.attention(q, k, v, p, 0.1))
    (k,) = f.compile(q, kc, vc, pos).plan.kernels
    assert L.attention_tiles(next(s for s in k.body if isinstance(s, L.Attention)), 4)[2] == 4
    ck = get_device("cpu").compile(k)
    names = [p.name for p in k.params if p.kind == "buffer"]
    for _ in range(3):                                   # the arrival count resets after each launch
        out = np.zeros((hq, 1, d), np.float32)
        ck(dict(zip(names, (q, kc, vc, out))), {next(p.name for p in k.params if p.kind == "scalar"): pos},
           nthreads=threads)
        np.testing.assert_allclose(out, f64_attention(q, kc, vc, pos, 0.1), rtol=2e-4, atol=2e-4)


# ----------------------------------------------------------------------------- the model's cache
@pytest.fixture(scope="module")
def smol():
    from engine.weights import default_model_path, load_model
    return load_model(default_model_path())


def test_model_cache_is_f16_by_default_and_f32_on_request(smol):
    cfg, params, _ = smol
    for kv_dtype, np_dtype in ((None, np.float16), ("f32", np.float32), ("f16", np.float16)):
        m = Model(cfg, params, context=16, **({"kv_dtype": kv_dtype} if kv_dtype else {}))
        assert {np.asarray(c).dtype for pair in m.cache for c in pair} == {np.dtype(np_dtype)}
    with pytest.raises(ModelError, match="kv_dtype 'bf16'.*f16 or f32"):
        Model(cfg, params, context=16, kv_dtype="bf16")


def test_greedy_ids_with_the_f32_cache_match_the_reference(smol):
    from tests.test_model import PROMPT, REFERENCE_IDS
    cfg, params, tok = smol
    m = Model(cfg, params, context=64, kv_dtype="f32")
    logits, out = np.asarray(m.prefill(tok.encode(PROMPT))), []
    for _ in range(len(REFERENCE_IDS)):
        out.append(int(np.argmax(logits)))
        logits = np.asarray(m.decode(out[-1]))
    assert out == REFERENCE_IDS


def test_generate_kv_dtype_flag():
    from tests.test_model import PROMPT, REFERENCE_IDS
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--temperature", "0", "--max-tokens", "6",
                        "--kv-dtype", "f32", "--json", PROMPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ids"] == REFERENCE_IDS[:6]
    r = subprocess.run([sys.executable, "-m", "engine.generate", "--kv-dtype", "f8", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--kv-dtype" in r.stderr


@pytest.mark.parametrize("p", [[0.1, 0.0, 0.1, 0.9], [0.5, 0.9, 0.95, 0.4], [0.8, 0.3, 0.5, 0.0], [0.2, 0.6, 0.3, 0.5]])
def test_fuzzer_attention_over_an_f16_or_f32_cache(p):
    """The fuzzer's attention op (tests/fuzz.py): written as a program, run against the float64
    interpreter."""
    from tests import fuzz
    prog = {"inputs": [{"shape": [4, 8], "dtype": "f32"}], "donate": False, "fusion": {},
            "ops": [{"op": "attention", "pick": [0, 0, 0], "p": p}, {"op": "tanh", "pick": [0, 0, 0], "p": p}]}
    src, _ = fuzz.program_source(int(rng.integers(1 << 30)), 0, prog)
    assert "dsl.attention(" in src and "dynamic_update_slice" in src and "dsl.tanh(v" in src
    status, detail = fuzz.run_source(src)
    assert status == "ok", f"{detail}\n{src}"
