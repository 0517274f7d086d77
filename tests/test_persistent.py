"""The persistent kernel (``fusion/persistent.py``, ``codegen/persistent.py``): a decode step's kernels
as phases of one launch with grid barriers between them, against the float64 interpreter on the CPU
emulation of the sm_90 text (a grid of one workgroup there; the H200 runs it on every SM in
``tests/test_cuda.py``)."""
import re

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen.hip import render_hip
from codegen.targets import get_target
from fusion.persistent import make_persistent
from stdlib import llama, nn
from stdlib.config import LlamaConfig
from tests.emulation import GXX

rng = np.random.default_rng()


def tiny_qwen2(n_layers=3, context=16, vocab=320, dim=64, heads=(4, 2), head_dim=16, ffn=128):
    """A Qwen2-shaped model (QKV bias, GQA; small unless told) with fresh random f16 weights and
    KV cache, and its greedy decode step, a function of (params, tokens, pos, last, cache)."""
    hq, hkv = heads
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=hq, n_kv_heads=hkv, ffn_dim=ffn,
                      head_dim=head_dim, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                      arch="qwen2", max_seq_len=context, name="tiny-qwen2")
    D, hd, F = cfg.dim, cfg.head_dim, cfg.ffn_dim
    mat = lambda n, k: (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)   # noqa: E731
    vec = lambda n, shift=0.0: (shift + 0.05 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    layers = [{"attn_norm": vec(D, 1.0), "ffn_norm": vec(D, 1.0), "wq": mat(hq * hd, D), "wk": mat(hkv * hd, D),
               "wv": mat(hkv * hd, D), "wo": mat(D, hq * hd), "w_gate": mat(F, D), "w_up": mat(F, D), "w_down": mat(D, F),
               "bq": vec(hq * hd), "bk": vec(hkv * hd), "bv": vec(hkv * hd)} for _ in range(n_layers)]
    params = {"embed": mat(vocab, D), "layers": layers, "norm": vec(D, 1.0)}
    cache = [tuple((rng.standard_normal((hkv, context, hd)) * 0.5).astype(np.float16) for _ in range(2))
             for _ in range(n_layers)]

    def step(params, tokens, pos, last, cache):
        nxt, logits, cache = llama.greedy_forward(cfg, params, tokens, pos, last, cache)
        return nxt, logits, cache
    return step, params, cache


@pytest.mark.parametrize("ring", ["1", "0"], ids=["ring", "scaffold"])
def test_a_decode_plan_becomes_one_persistent_kernel_with_a_phase_a_kernel(ring, monkeypatch):
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", ring)
    step, params, cache = tiny_qwen2()
    from engine.pipeline import lower_program
    plan = lower_program(dsl.jit(step).lower(params, np.array([5], np.int32), 3, 0, cache))
    t = get_target("sm_90")
    (k, *rest) = make_persistent(plan, t).kernels
    assert k.family == "persistent" and [r.name for r in rest] == ["argmax"]       # a workgroup of 1024: its own launch
    phases = [s for s in k.body if isinstance(s, L.Phase)]
    assert [s.name for s in phases] == [x.name for x in plan.kernels[:-1]]
    assert sum(isinstance(s, L.GridBarrier) for s in k.body) == len(phases) - 1
    # layers 1 and 2 run one phase kernel, its parameters named without the layer number
    qkv = [s.kernel for s in phases if "wq_wk_wv" in s.name]
    assert qkv[1] is qkv[2] and qkv[0] is not qkv[1]
    assert "params_layers_wq" in [p.name for p in qkv[1].params]
    src = render_hip(k, t).source
    assert src.count("namespace phase_layers_causal_attention {") == 1 and src.count("phase_layers_causal_attention::run(") == 3
    assert len(re.findall(r"vf_grid_barrier\(&vf_grid_arrived, \d+" + (", vf_ring.quiet" if ring == "1" else "") + r"\);",
                          src)) == len(phases) - 1
    # with the ring, every GEMV phase (QKV, O, gate/up, down a layer, the LM head) takes its weights from it
    fed = [s.name for s in phases if s.tiled]
    assert len(fed) == (3 * 4 + 1 if ring == "1" else 0) and all("causal_attention" not in n for n in fed)
    assert src.count("::produce(dim3(blockIdx.x)") == len(fed) and ("persistent_tiled_weights" in src) == (ring == "1")


def check_decode_steps(backend, positions, **shape):
    """The decode step of ``tiny_qwen2(**shape)`` at each of ``positions`` in turn (the cache each
    wrote feeding the next) as one persistent kernel and the argmax, against the float64
    interpreter: logits, the greedy id and every layer's K and V cache.  Returns the last executable."""
    step, params, cache = tiny_qwen2(**shape)
    jf = dsl.jit(step, backend=backend)
    tokens = np.array([int(rng.integers(shape.get("vocab", 320)))], np.int32)
    for pos in positions:                  # the barrier's count goes back to zero between launches
        args = (params, tokens, pos, 0, cache)
        flat = dsl.tree_flatten(list(args))[0]
        want = jf.lower(*args).program.run(*flat, compute_dtype="f64")
        got = [np.asarray(g, np.float64) for g in dsl.tree_flatten(jf(*args))[0]]
        ex = jf.compile(*args)
        assert [ck.kernel.family for ck in ex.kernels] == ["persistent", "reduce"]
        # a GEMV keeping its activation as f16 in LDS (gfx906's v_dot2, so the emulated wave 64): 2^-11 a product
        tol = 1e-2 if render_hip(ex.kernels[0].kernel, ex.device.target).kernel.launch.act == "f16" else 2e-3
        logits, want_logits = got[1], want[1]
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=tol * np.abs(want_logits).max())
        assert int(got[0]) == int(np.argmax(logits))                 # the argmax of the logits it wrote
        for g, w in zip(got[2:], want[2:]):              # every layer's K and V cache, as f16
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
        cache = [(np.asarray(a, np.float16), np.asarray(b, np.float16)) for a, b in zip(got[2::2], got[3::2])]
    return ex


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("ring", ["0", "1"], ids=["scaffold", "ring"])
def test_a_persistent_decode_step_matches_the_float64_interpreter_over_positions(ring, monkeypatch):
    """The scaffold, and with ``VEGAFUSE_PERSISTENT_RING=1`` its GEMV phases fed by the ring: on a grid of
    one workgroup every block of rows goes through the ring's slots in turn (their chunks wrap around
    it many times)."""
    from tests.emu_device import emu_backend
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", ring)
    check_decode_steps(emu_backend(), (0, 5, 11))


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_smollm2_decodes_hugging_faces_greedy_ids_through_one_persistent_kernel_with_the_ring(monkeypatch):
    """SmolLM2-135M (its GGUF's weights in f16), prefilled and then decoded token by token, each step one
    persistent kernel whose GEMV phases take their weights from the ring, run by the CPU emulation:
    Hugging Face's greedy ids (``tests/test_model.py``; all 20 matched when this was written, 6 are
    checked here to keep the test short)."""
    from engine.weights import default_model_path, load_model
    from tests.emu_device import emu_backend
    from tests.test_model import PROMPT_IDS, REFERENCE_IDS, greedy
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", "1")
    cfg, params, tok = load_model(default_model_path(), "f16")
    ids, out, m = greedy(cfg, params, tok, n=6, context=32, backend=emu_backend())
    assert ids == PROMPT_IDS and out == REFERENCE_IDS[:6]
    (k,) = m.compile().plan.kernels                  # the logits' step: every kernel a phase of one
    phases = [s for s in k.body if isinstance(s, L.Phase)]
    assert k.family == "persistent" and len(phases) == 5 * cfg.n_layers + 1
    assert sum(bool(s.tiled) for s in phases) == 4 * cfg.n_layers + 1      # each GEMV (and the LM head) fed by the ring


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_a_traced_persistent_decode_step_reports_each_phase(monkeypatch):
    """With ``VEGAFUSE_PERSISTENT_TRACE=1`` the step computes as before, and ``engine.profile.phase_times``
    reads its stamps: every phase group in launch order with its calls a launch, a ring phase's steps
    adding up to its work, attention's only its work; the last phase waits at no barrier.  Without
    the switch: one line saying how to turn it on."""
    from engine.profile import format_phases, phase_times
    from tests.emu_device import emu_backend
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_TRACE", "1")
    x, g = rng.standard_normal((1, 256)).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    w1, w2 = (rng.standard_normal((64, 256)) / 16).astype(np.float16), (rng.standard_normal((64, 64)) / 8).astype(np.float16)
    not_run = dsl.jit(lambda x, g, w1, w2: nn.linear(nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w1)), w2),
                      backend=emu_backend()).compile(x, g, w1, w2)
    with pytest.raises(ValueError, match=r"^the persistent kernel persistent has not run yet: time a step first$"):
        phase_times(not_run)
    ex = check_decode_steps(emu_backend(), (4,))
    rows = phase_times(ex)
    names = [re.sub(r"\d+", "#", s.name) for s in ex.kernels[0].kernel.body if isinstance(s, L.Phase)]
    assert [(r["phase"], r["calls"]) for r in rows] == [(n, names.count(n)) for n in dict.fromkeys(names)]
    assert {n: names.count(n) for n in names if n.startswith("layers_#")} == dict.fromkeys(
        ["layers_#_rms_norm_linear_wq_wk_wv_rope_kv_write", "layers_#_causal_attention", "layers_#_linear_wo_add",
         "layers_#_rms_norm_linear_w_gate_w_up_silu_mul", "layers_#_linear_w_down_add"], 3)
    ring_fed = {re.sub(r"\d+", "#", s.name) for s in ex.kernels[0].kernel.body if isinstance(s, L.Phase) and s.tiled}
    assert "rms_norm_linear_embed" in ring_fed and "layers_#_causal_attention" not in ring_fed
    for r in rows:                                   # the emulation runs one workgroup
        fed = r["phase"] in ring_fed
        assert r["workgroups"] == 1 and r["work"] > 0 and r["wait"] >= 0 and r["slowest"] == pytest.approx(r["work"])
        assert (r["staged"] > 0 and r["dot"] > 0) == fed and r["epilogue"] > 0
        assert r["staged"] + r["dot"] + r["epilogue"] == pytest.approx(r["work"])
    assert rows[-1]["wait"] == 0 and all(r["wait"] > 0 for r in rows[:-1])
    assert format_phases(rows).splitlines()[-1].startswith("the launch, from its stamps")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_TRACE", "0")
    with pytest.raises(ValueError, match=r"^no traced persistent kernel: set VEGAFUSE_PERSISTENT=1 and "
                                         r"VEGAFUSE_PERSISTENT_TRACE=1 before the model compiles \(engine.bench --phases does\)$"):
        phase_times(check_decode_steps(emu_backend(), (4,)))


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("backend", ["emu-persistent", "emu-ring"])
def test_fresh_random_programs_through_persistent_kernels_match_the_float64_interpreter(backend):
    """The fuzzer's programs (about half make a persistent kernel: runs of elementwise, reduction and
    contraction kernels as phases) on the emulated GPU path with ``VEGAFUSE_PERSISTENT=1``, and with the
    ring feeding the GEMV phases (``emu-ring``)."""
    from tests import fuzz
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    print(f"fuzz seed {seed}: rerun with python -m tests.fuzz -n 6 --seed {seed} --backend {backend}")
    counts, failures, _ = fuzz.run_many(6, seed, jobs=2, batch=6, backend=backend, progress=False)
    report = "\n".join(f"program {f['index']}: {f['status']}: {f['detail']}\n{f.get('repro', '')}" for f in failures)
    assert not failures, f"seed {seed}:\n{report}"
    assert sum(counts[k] for k in fuzz.STATUSES) == 6, counts


def test_the_persistent_decode_kernel_compiles_for_gfx906():
    """The same text for gfx906 through hiprtc (the plan step is on only for NVIDIA, where it runs):
    two workgroups of four waves a CU, so at most 128 VGPRs and no VGPR spills."""
    from engine.devices.rocm import HipUnavailable, compile_hip, find_hiprtc
    try:
        find_hiprtc()
    except HipUnavailable as e:
        pytest.skip(f"gfx906 tests skipped: {e}")
    from engine.pipeline import lower_program
    from fusion.persistent import _runs, persistent_kernel
    step, params, cache = tiny_qwen2()
    plan = lower_program(dsl.jit(step).lower(params, np.array([5], np.int32), 3, 0, cache))
    t = get_target("gfx906")
    (run,) = _runs(plan.kernels, t)
    h = render_hip(persistent_kernel(run, "persistent"), t)
    assert h.grid == (2 * t.compute_units, 1, 1) and "__launch_bounds__(256, 2)" in h.source
    (meta,) = compile_hip(h.source, "persistent").metadata()["amdhsa.kernels"]
    assert meta[".wavefront_size"] == 64 and meta[".vgpr_count"] <= 128 and meta[".vgpr_spill_count"] == 0


@pytest.mark.parametrize("name,value", [("VEGAFUSE_PERSISTENT", "yes"), ("VEGAFUSE_PERSISTENT_PER_CU", "0"),
                                        ("VEGAFUSE_PERSISTENT_PER_CU", "1.5"), ("VEGAFUSE_PERSISTENT_PREFETCH", "-5"),
                                        ("VEGAFUSE_PERSISTENT_RING", "2"), ("VEGAFUSE_PERSISTENT_FLIGHT", "0"),
                                        ("VEGAFUSE_PERSISTENT_QUIET", "on"), ("VEGAFUSE_PERSISTENT_NORM", "2"),
                                        ("VEGAFUSE_PERSISTENT_EVICT_FIRST", "yes"), ("VEGAFUSE_PERSISTENT_TRACE", "2")])
def test_a_bad_switch_value_is_one_line_naming_the_switch(name, value, monkeypatch):
    from codegen.persistent import (phase_target, prefetch_bytes, ring_evict_first, ring_flight, ring_on, ring_quiet,
                                    trace_on, workgroups_per_cu)
    from fusion.persistent import enabled
    monkeypatch.setenv(name, value)
    t = get_target("sm_90")
    with pytest.raises(ValueError, match=f"^{name}='{re.escape(value)}': set it to .*") as e:
        enabled(t), workgroups_per_cu(), prefetch_bytes(t), ring_on(t), ring_flight(), ring_quiet(), phase_target(t), \
            ring_evict_first(), trace_on()
    assert "\n" not in str(e.value)


def test_kernels_sharing_a_name_or_a_parameter_each_keep_their_own_phase(monkeypatch):
    """Two phase kernels whose names meet once the differing numbers are dropped (``linear_p_w_1``,
    ``linear_p_w_2`` shared as ``linear_p_w`` beside a kernel of that name), and a phase parameter that
    one call binds to a kernel input and another to a buffer a phase writes, against the float64
    interpreter on the emulation."""
    from tests.emu_device import emu_backend
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    m = lambda n: (rng.standard_normal((n, 256)) / 16).astype(np.float16)      # noqa: E731
    p = {"w0": m(256), "w_1": m(256), "w_2": m(256), "w": m(128)}
    x = rng.standard_normal((1, 256)).astype(np.float32)

    def f(p, x):
        x = x + nn.linear(x, p["w_1"])                    # reads the input x, then (below) the x it wrote
        x = x + nn.linear(x, p["w_2"])
        h = nn.linear(nn.silu(nn.linear(x, p["w0"])), p["w_1"])
        return nn.linear(nn.linear(h, p["w_2"]), p["w"])
    jf = dsl.jit(f, backend=emu_backend())
    want = jf.lower(p, x).program.run(*dsl.tree_flatten([p, x])[0], compute_dtype="f64")[0]
    got = np.asarray(jf(p, x), np.float64)
    assert [ck.kernel.family for ck in jf.compile(p, x).kernels] == ["persistent"]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_a_run_ends_where_its_phases_lds_would_keep_a_workgroup_off_its_compute_unit(monkeypatch):
    """The LDS a persistent kernel needs is its largest phase's arrays (the phases take one dynamic
    buffer in turn) plus each distinct phase's template arrays (kept apart): a run is cut before the
    kernel that would pass the room of ``VEGAFUSE_PERSISTENT_PER_CU`` workgroups."""
    from fusion import persistent
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", "0")
    t = get_target("sm_90")
    room = t.lds_per_cu // 2
    geometry = {"a": (256, "f32", 9000, 0), "b": (256, "f32", 2000, room // 2), "c": (256, "f32", 8000, room // 2 - 10000),
                "d": (256, "f32", 1000, room // 4), "e": (256, "f32", room, 1), "f": (256, None, 100, 0)}
    monkeypatch.setattr(persistent, "_geometry", lambda k, t: geometry[k.name])
    monkeypatch.setattr(L, "canonicalize", lambda k: k.name)
    kernels = [L.Kernel(n, "contract", (), ()) for n in "abcdbef"]
    names = [[k.name for k in r] for r in persistent._runs(kernels, t)]
    # a, b, c: 9000 + room // 2 + room // 2 - 10000 fits, d's templates would pass it; d, b fit, b
    # counted once; e alone passes the room (a launch of its own), so f is left alone
    assert names == [["a", "b", "c"], ["d", "b"]]
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_PER_CU", "1")          # twice the room: e's arrays pass it beside the rest
    assert [[k.name for k in r] for r in persistent._runs(kernels, t)] == [["a", "b", "c", "d", "b"], ["e", "f"]]
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_RING", "1")            # a workgroup a CU, less two slots of the ring
    assert [[k.name for k in r] for r in persistent._runs(kernels, t)] == [["a", "b", "c", "d", "b"], ["e", "f"]]
    monkeypatch.delenv("VEGAFUSE_PERSISTENT_PER_CU")               # the room of two (a kernel may have no GEMV
    assert [[k.name for k in r] for r in persistent._runs(kernels, t)] == names      # the ring feeds: 2 a CU)


def _mlp_phase(k, n):
    """The mapped sm_90 GEMV kernel of ``silu(h @ w1.T) * (h @ w2.T)`` (h one row of ``k``, ``n`` outputs),
    its RingGemv (None where the ring cannot feed it) and fresh random weights."""
    from codegen.mapping import map_kernel
    from codegen.ring import ring_gemv
    from engine.pipeline import lower_program
    w1, w2 = (rng.standard_normal((n, k)).astype(np.float16) for _ in range(2))
    x = rng.standard_normal((1, k)).astype(np.float32)
    plan = lower_program(dsl.jit(lambda x, w1, w2: nn.silu(nn.linear(x, w1)) * nn.linear(x, w2)).lower(x, w1, w2))
    (kernel,) = [q for q in plan.kernels if q.family == "contract"]
    m = map_kernel(kernel, get_target("sm_90"))
    names = [p.name for p in kernel.params if p.dtype == "f16"]
    return ring_gemv(m), dict(zip(names, (w1, w2)))


def test_the_tiled_weights_hold_each_blocks_rows_chunk_by_chunk():
    """``codegen.ring.tile`` against the layout written out by hand: for each block of rows, for each chunk of
    ``kc`` columns (the last one short: k = 136), each row's gate and up weight rows in turn."""
    from codegen.ring import tile, tiles
    g, weights = _mlp_phase(136, 37)
    assert g is not None and [len(s.accs) for s in g.segments] == [2]
    t = tiles(g, 5, 256)                       # 5 workgroups: blocks of 8 rows, the last of 5
    assert (t.rows, t.kc) == (8, 128)
    w1, w2 = weights.values()
    want = []
    for b in range(0, 37, t.rows):
        rows = range(b, min(b + t.rows, 37))
        for j in range(0, 136, t.kc):
            for r in rows:
                want += [w1[r, j:j + t.kc], w2[r, j:j + t.kc]]
    np.testing.assert_array_equal(tile(g, t, weights), np.concatenate(want))


def test_a_gemv_narrower_than_a_chunk_is_not_fed_by_the_ring():
    """A chunk is at least 64 columns (8 lanes of 8): a GEMV of k = 48 stays a plain phase (the fuzzer found
    the tiles' search looping for ever on one)."""
    assert _mlp_phase(48, 16)[0] is None
    assert _mlp_phase(64, 16)[0] is not None


@pytest.mark.parametrize("name,value", [("VEGAFUSE_PERSISTENT", "yes"), ("VEGAFUSE_PERSISTENT_RING", "2"),
                                        ("VEGAFUSE_PERSISTENT_TRACE", "on"), ("VEGAFUSE_PERSISTENT_NORM", "2"),
                                        ("VEGAFUSE_PERSISTENT_EVICT_FIRST", "x"), ("VEGAFUSE_PERSISTENT_QUIET", "no"),
                                        ("VEGAFUSE_PERSISTENT_PER_CU", "abc"), ("VEGAFUSE_PERSISTENT_FLIGHT", "0"),
                                        ("VEGAFUSE_PERSISTENT_PREFETCH", "-1")])
def test_a_bad_persistent_switch_is_one_line_on_the_cpu_too(name, value, monkeypatch):
    """The CPU backend ignores the switches but not a bad value of any of them."""
    monkeypatch.setenv(name, value)
    x = rng.standard_normal(8).astype(np.float32)
    with pytest.raises(ValueError, match=f"^{name}='{value}': set it to ") as e:
        dsl.jit(lambda x: x * 2.0)(x)
    assert "\n" not in str(e.value)


def _emu_check(f, *args):
    """``f`` on the emulated GPU against the float64 interpreter (its first output)."""
    from tests.emu_device import emu_backend
    jf = dsl.jit(f, backend=emu_backend())
    want = np.asarray(jf.lower(*args).program.run(*args, compute_dtype="f64")[0], np.float64)
    out = jf(*args)
    got = np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    return jf


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_the_rings_tiles_follow_the_weights_they_are_made_from(monkeypatch):
    """Small weights are copied into reused staging buffers call after call: the tiles are made again
    from the new ones.  A GEMV whose f16 "weight" a phase writes (a KV cache) is not fed by the ring.
    The tiles made for the grid chosen when the plan was made, whatever the switches say at binding."""
    import dsl.lax as lax
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    x = rng.standard_normal((1, 72)).astype(np.float32)
    jf = None
    for _ in range(2):
        w1, w2 = (rng.standard_normal((64, 72)) / 8).astype(np.float16), (rng.standard_normal((64, 64)) / 8).astype(np.float16)
        jf = _emu_check(lambda x, w1, w2: nn.linear(nn.silu(nn.linear(x, w1)), w2), x, w1, w2) if jf is None else jf
        want = jf.lower(x, w1, w2).program.run(x, w1, w2, compute_dtype="f64")[0]
        np.testing.assert_allclose(np.asarray(jf(x, w1, w2), np.float64), want, rtol=0, atol=2e-3 * np.abs(want).max())
    (k,) = [ck.kernel for ck in jf.compile(x, w1, w2).kernels]
    assert sum(bool(s.tiled) for s in k.body if isinstance(s, L.Phase)) == 2

    def written(wq, x, cache, pos):
        q = nn.linear(x, wq)
        return nn.linear(q, lax.dynamic_update_slice(cache, q.astype("f16"), (pos, 0))),
    wq, x64 = (rng.standard_normal((64, 64)) / 8).astype(np.float16), rng.standard_normal((1, 64)).astype(np.float32)
    _emu_check(written, wq, x64, (rng.standard_normal((16, 64)) / 8).astype(np.float16), 3)

    w1, w2 = (rng.standard_normal((300, 256)) / 16).astype(np.float16), (rng.standard_normal((64, 300)) / 16).astype(np.float16)
    x256 = rng.standard_normal((1, 256)).astype(np.float32)
    from tests.emu_device import emu_backend
    jf = dsl.jit(lambda x, w1, w2: nn.linear(nn.silu(nn.linear(x, w1)), w2), backend=emu_backend())
    jf.compile(x256, w1, w2)
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_PER_CU", "2")          # after the plan, before the first binding
    want = jf.lower(x256, w1, w2).program.run(x256, w1, w2, compute_dtype="f64")[0]
    np.testing.assert_allclose(np.asarray(jf(x256, w1, w2), np.float64), want, rtol=0, atol=2e-3 * np.abs(want).max())


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_the_rings_names_keep_clear_of_the_users(monkeypatch):
    """A bias named ``slots`` (a name the ring's consumer declares) and a weight named
    ``persistent_tiled_weights`` (the tiled weights' own) each keep their meaning."""
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    x, w = rng.standard_normal((1, 64)).astype(np.float32), (rng.standard_normal((64, 64)) / 8).astype(np.float16)
    b = rng.standard_normal(64).astype(np.float32)
    _emu_check(lambda x, w, slots: nn.linear(nn.silu(nn.linear(x, w, slots)), w, slots), x, w, b)
    _emu_check(lambda x, persistent_tiled_weights, w2: nn.linear(nn.silu(nn.linear(x, persistent_tiled_weights)), w2),
               x, w, (rng.standard_normal((64, 64)) / 8).astype(np.float16))
    # the one-pass RMSNorm's fill takes its loads into locals of its own; a weight named k (the tiled
    # matmul's template name: "k_" in the mapped kernel) is still found for the tiles
    x5, g = rng.standard_normal((1, 512)).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    w1, w2 = (rng.standard_normal((96, 512)) / 23).astype(np.float16), (rng.standard_normal((64, 96)) / 10).astype(np.float16)
    _emu_check(lambda x, x_0, w1, w2: nn.linear(nn.silu(nn.linear(nn.rms_norm(x, x_0, 1e-5), w1)), w2), x5, g, w1, w2)
    _emu_check(lambda x_0, g, w1, w2: nn.linear(nn.silu(nn.linear(nn.rms_norm(x_0, g, 1e-5), w1)), w2), x5, g, w1, w2)
    _emu_check(lambda x_steps, vf_x, w1, k: nn.linear(nn.silu(nn.linear(nn.rms_norm(x_steps, vf_x, 1e-5), w1)), k),
               x5, g, w1, w2)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("norm,steps,evict", [("1", "1", "1"), ("1", "0", "1"), ("0", "1", "0")],
                         ids=["one-pass-steps", "one-pass", "two-pass"])
def test_a_ring_phases_rmsnorm_in_one_pass_matches_the_float64_interpreter(norm, steps, evict, monkeypatch):
    """A ring phase's RMSNorm prologue in one pass, its scale after the dot products
    (``VEGAFUSE_PERSISTENT_NORM``), its fill's steps each loaded before the first store (k = 512: two
    steps of 256; ``VEGAFUSE_FILL_STEPS``), the weights' copies first out of L2
    (``VEGAFUSE_PERSISTENT_EVICT_FIRST``): each in the text as switched, and the values right."""
    monkeypatch.setenv("VEGAFUSE_PERSISTENT", "1")
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_NORM", norm)
    monkeypatch.setenv("VEGAFUSE_FILL_STEPS", steps)
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_EVICT_FIRST", evict)
    x = (rng.standard_normal((1, 512)) * 30 + 5).astype(np.float32)       # far from unit scale: the scale matters
    g = (1 + rng.standard_normal(512) / 4).astype(np.float32)
    w1, w2 = (rng.standard_normal((96, 512)) / 16).astype(np.float16), (rng.standard_normal((64, 96)) / 8).astype(np.float16)
    jf = _emu_check(lambda x, g, w1, w2: nn.linear(nn.silu(nn.linear(nn.rms_norm(x, g, 1e-5), w1)), w2), x, g, w1, w2)
    (k,) = [ck.kernel for ck in jf.compile(x, g, w1, w2).kernels]
    assert sum(bool(s.tiled) for s in k.body if isinstance(s, L.Phase)) == 2
    src = render_hip(k, get_target("sm_90")).source
    assert ("rsqrt_sum_sq multiplies each row's dot product instead" in src) == (norm == "1")
    assert ("_steps[512 / VF_BLOCK];   // every step" in src) == (norm == steps == "1")
    assert ("L2::evict_first" in src) == (evict == "1")


def test_a_phases_rmsnorm_stays_two_passes_where_its_activation_is_f16():
    """In one pass the activation holds ``x * g`` unnormalized: where it is kept as f16 in LDS (the emulated
    wave 64's v_dot2 text) a residual stream's outliers would pass f16's range, so such a phase keeps
    both passes; in f32 (wave 32) it takes one."""
    from codegen.mapping import map_kernel
    from codegen.persistent import phase_target
    from engine.pipeline import lower_program
    x, g = rng.standard_normal((1, 512)).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    w = rng.standard_normal((64, 512)).astype(np.float16)
    plan = lower_program(dsl.jit(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-5), w)).lower(x, g, w))
    (kernel,) = [k for k in plan.kernels if k.family == "contract"]
    for target, act in (("sm_90", "f32"), ("sm_90_wave64", "f16")):
        m = map_kernel(kernel, phase_target(get_target(target)))
        one_pass = any(isinstance(s, L.Reduce) and s.body for s in L.walk_stmts(m.body))
        assert m.launch.act == act and one_pass == (act == "f32"), target


def test_the_rings_switches_at_their_edges(monkeypatch):
    """As many chunks in flight as the ring holds at most, whatever ``VEGAFUSE_PERSISTENT_FLIGHT`` asks; more
    workgroups a compute unit than leave two slots of LDS each is one line naming the switch."""
    from codegen.persistent import ring_grid
    from codegen.ring import producer, tiles
    g, _ = _mlp_phase(136, 37)
    (loop,) = producer(g, tiles(g, 5, 256), 1 << 40)
    assert next(s for s in loop.body if isinstance(s, L.RingProduce)).flight == 1 << 16
    monkeypatch.setenv("VEGAFUSE_PERSISTENT_PER_CU", "7")
    with pytest.raises(ValueError, match=r"^VEGAFUSE_PERSISTENT_PER_CU=7: set it to at most 5 with the ring"):
        ring_grid(get_target("sm_90"))
