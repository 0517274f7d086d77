"""The GPU attention template (``codegen/hip.py`` ``_attention``, tiles from
``codegen.mapping.attention_tiles``): every variant compiles for gfx906 through hiprtc and passes
the ISA gates (no scratch, 16-byte K/V loads, at most 9 waves per SIMD, the LDS it declares); the
kernel text is one for gfx906 and the emulated wave 64; the text at wave 32 and 64, run on the CPU
by an emulation of the GPU's threads (``tests/gpu_emulation.h``), matches the float64 interpreter.
``tests/test_cuda.py`` runs it on an NVIDIA GPU."""

import numpy as np
import pytest

import dsl
from codegen import loopir as L
from codegen import prelude
from codegen.hip import render_hip
from codegen.inspect import Inspected, instructions, load_widths
from codegen.mapping import attention_lds, attention_tiles, map_kernel, prefill_lds
from codegen.targets import get_target
from fusion import build_plan
from tests.emulation import GXX, HIP, emulated, launch

# (query heads, KV heads, query rows, cache positions, head dim, cache dtype)
VARIANTS = [
    (12, 2, 1, 4096, 128, "f2"),      # Qwen2.5-1.5B decode: 6 heads per KV head, split over workgroups
    (28, 4, 1, 4096, 128, "f4"),      # Qwen2.5-7B decode, f32 cache
    (7, 1, 1, 512, 64, "f2"),         # GQA 7, head dim 64
    (4, 4, 1, 40, 128, "f4"),         # GQA 1, a short cache
    (14, 2, 7, 512, 64, "f2"),        # prefill T = 7, split over workgroups
    (8, 4, 64, 1024, 64, "f4"),       # T = 64, GQA 2
    (12, 2, 300, 2048, 128, "f2"),    # T = 300: query tiles, the last one partial
    (10, 2, 5, 300, 80, "f2"),        # head dim 80: a thread's output columns vary
    (12, 2, 4000, 4200, 128, "f2"),   # Qwen2.5-1.5B prefill of 4000 tokens
    (32, 2, 50, 512, 128, "f2"),      # 16 query heads per KV head
    (16, 1, 7, 128, 256, "f4"),       # 16 of 256 with an f32 cache: the group's heads over workgroups
    (24, 2, 33, 256, 256, "f2"),      # 12 of 256
]


def attention_kernel(hq, hkv, t, s, d, kv):
    """The attention kernel of ``dsl.attention`` at these shapes (unmapped Loop IR)."""
    q, kc = np.zeros((hq, t, d), "f4"), np.zeros((hkv, s, d), kv)
    low = dsl.jit(lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 1.0 / np.sqrt(d))).lower(q, kc, kc, 0)
    (k,) = [k for k in build_plan(low.program, None, low.in_names, low.donated).kernels if k.family == "attention"]
    return k


def tiles_of(k, target):
    (a,) = [s for s in map_kernel(k, get_target(target)).body if isinstance(s, L.Attention)]
    return a, a.tiles


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "x".join(map(str, v)))
def test_tiles_fit_and_cover_the_cache(v):
    """The tiles fit the LDS budget, the splits cover the cache, the launch takes a workgroup per
    (KV head, query tile, split); decode over a long cache is split, the text identical at wave 64."""
    k = attention_kernel(*v)
    for target in ("gfx906", "sm_90"):
        a, m = tiles_of(k, target)
        launch = map_kernel(k, get_target(target)).launch
        assert launch.lds <= get_target(target).attention_lds
        assert m.chunk % m.keys == 0 and (m.splits - 1) * m.chunk < a.s <= m.splits * m.chunk
        if m.block:                                   # prefill: a workgroup per (KV head, heads, query tile, split)
            rows, group = m.block[0] * m.threads // m.key_lanes, a.hq // a.hkv
            assert a.t > 1 and group % m.heads == 0 and m.rows_q * m.heads <= rows and m.keys == m.block[1] * m.key_lanes
            assert prefill_lds(a, rows, m.keys, m.splits > 1) == launch.lds
            assert launch.grid == a.hq // m.heads * -(-a.t // m.rows_q) * m.splits and launch.block == m.threads
        elif m.heads:                                 # decode: a workgroup per (KV head, heads, split)
            assert a.t == 1 and m.heads <= a.hq // a.hkv
            assert launch.grid == a.hkv * -(-a.hq // a.hkv // m.heads) * m.splits and launch.block == m.threads
        else:
            assert attention_lds(a, m.rows_q * a.hq // a.hkv, m.keys, m.splits > 1) == launch.lds and m.keys in (8, 16, 32, 64)
            assert launch.grid == a.hkv * -(-a.t // m.rows_q) * m.splits and launch.block == m.threads
        if a.t == 1 and a.s >= 4096:
            assert m.splits > 1, (target, m)
    assert render_hip(k, "gfx906").body == render_hip(k, "sm_90_wave64").body


def test_the_kernel_text_has_no_branch_decided_in_python():
    """Choices made in Python leave no trace in the text: decode has no causal test beyond the
    split's end, an unsplit attention no combine, a split one its file-scope partial rows."""
    dec = render_hip(attention_kernel(12, 2, 1, 4096, 128, "f2"), "gfx906").body
    assert "#if" not in dec and "vf_last_to_arrive(" in dec and "__device__ float" in dec
    assert "start + j <= p" not in dec and "if (lo >= hi) return;" in dec
    pre = render_hip(attention_kernel(8, 8, 300, 300, 64, "f2"), "gfx906").body
    assert "vf_last_to_arrive" not in pre and "__device__" not in pre and "j <= p + first + r" in pre


def test_a_buffer_named_like_a_local_of_the_template_is_still_read():
    """Buffers named ``p``, ``lo``, ``d`` (locals of the template) are read, not hidden."""
    def f(p, lo, d, pos):
        return dsl.attention(p, lo, d, pos, 0.125)
    q, kc = np.zeros((4, 1, 64), "f4"), np.zeros((2, 256, 64), "f2")
    low = dsl.jit(f).lower(q, kc, kc, 0)
    (k,) = build_plan(low.program, None, low.in_names, low.donated).kernels
    body = render_hip(k, "gfx906").body
    assert "p[" in body and "(lo + (size_t)" in body and "(d + (size_t)" in body and "const int p_ =" in body




@pytest.mark.skipif(bool(HIP), reason=f"gfx906 compile skipped: {HIP}")
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "x".join(map(str, v)))
def test_every_variant_compiles_for_gfx906_and_passes_the_isa_gates(v):
    """No scratch or generic loads, K and V move in 16-byte loads (no 2-byte global loads), at most
    9 waves per SIMD (decode at least 2), and the static LDS is the template's (as ``codegen.inspect`` reports it)."""
    k = attention_kernel(*v)
    it = Inspected(k, get_target("gfx906"))
    r, isa = it.res, it.isa()
    assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0 and "flat_load" not in isa, r
    widths = load_widths(instructions(isa))
    assert widths.get(16, 0) >= 4 and 2 not in widths and 1 not in widths, widths
    assert (2 if v[2] == 1 else 1) <= r["waves_per_simd"] <= 9, r    # decode: the register budget's two waves
    lds = map_kernel(k, get_target("gfx906")).launch.lds
    assert lds <= r["lds_bytes"] <= lds + 64 <= get_target("gfx906").attention_lds + 64, (r["lds_bytes"], lds)


def test_lds_budget_error_is_one_clear_line(monkeypatch):
    """Where not even 8 rows and 8 keys fit (head dim 1024, f32), one line names the head dim."""
    a = L.Attention("q", "k", "v", "o", ("f32", "f32", "f32"), 512, 1, 2, 64, 1024, L.c(0), 0.1)
    with pytest.raises(ValueError, match="head dim 1024 needs more than 32768 bytes of LDS for a tile of 8 query rows "
                       "and 8 keys; use a smaller head dim"):
        attention_tiles(a, get_target("gfx906"))
    monkeypatch.setenv("VEGAFUSE_ATT_PREFILL", "scalar")          # the tiled template's own error
    a = L.Attention("q", "k", "v", "o", ("f32", "f32", "f32"), 512, 1, 2, 64, 256, L.c(0), 0.1)
    with pytest.raises(ValueError, match="needs more than .* bytes of LDS for 8 keys; use fewer query heads"):
        attention_tiles(a, get_target("gfx906"))


def emulate(k, target, arrays, tmp):
    """Run the kernel text of ``k`` rendered for ``target`` on the CPU (``tests/emulation.py``: the
    prelude's target helpers in plain C++, its attention helpers as they are); ``arrays``: numpy
    arrays in the order of the parameters."""
    h = render_hip(k, target)
    launch(emulated(h, tmp, f"#define VF_ATT_BLOCK {h.block[0]}\n", prelude._ATTENTION), h, arrays)


def check_positions(k, target, v, positions, tmp, m):
    """Kernel ``k`` of attention ``v`` (heads, KV heads, T, S, D, cache dtype) run as ``target``'s text
    on the CPU at each of ``positions`` on fresh random inputs, against the float64 interpreter."""
    hq, hkv, t, s, d, kv = v
    rng = np.random.default_rng()
    f = dsl.jit(lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 1.0 / np.sqrt(d)))
    for pos in positions:
        q = rng.standard_normal((hq, t, d)).astype("f4")
        kc, vc = (rng.standard_normal((hkv, s, d)).astype(kv) for _ in range(2))
        out = np.full((hq, t, d), np.nan, np.float32)
        named = {"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32)}
        emulate(k, target, [named.get(p.name, out) for p in k.params], tmp)
        want = f.lower(q, kc, vc, pos).program.run(q, kc, vc, pos, compute_dtype="f64")[0]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"pos {pos} {m}")


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("v", [(4, 2, 1, 256, 64, "f2"), (4, 4, 1, 40, 128, "f4"), (8, 4, 20, 256, 64, "f2")],
                         ids=lambda v: "x".join(map(str, v)))
def test_inputs_named_like_vector_members_are_read(v, target, tmp_path_factory):
    """Inputs named ``x``, ``w``, ``oc`` (locals of the templates, and members such as ``pr.x`` or
    ``threadIdx.x``): the template's locals are renamed, its members are not."""
    hq, hkv, t, s, d, kv = v
    rng = np.random.default_rng()
    f = dsl.jit(lambda x, w, oc, pos: dsl.attention(x, w, oc, pos, 1.0 / np.sqrt(d)))
    q = rng.standard_normal((hq, t, d)).astype("f4")
    kc, vc = (rng.standard_normal((hkv, s, d)).astype(kv) for _ in range(2))
    pos = int(rng.integers(0, s - t + 1))
    low = f.lower(q, kc, vc, pos)
    (k,) = build_plan(low.program, None, low.in_names, low.donated).kernels
    out = np.full((hq, t, d), np.nan, np.float32)
    named = {"x": q, "w": kc, "oc": vc, "pos": np.array([pos], np.int32)}
    emulate(k, target, [named.get(p.name, out) for p in k.params], str(tmp_path_factory.getbasetemp()))
    want = low.program.run(q, kc, vc, pos, compute_dtype="f64")[0]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("template", ["blocked", "scalar"])
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("v", [(10, 2, 5, 300, 80, "f2"), (4, 2, 3, 200, 64, "f4")], ids=lambda v: "x".join(map(str, v)))
def test_the_kernel_text_computes_attention(v, target, template, tmp_path_factory, monkeypatch):
    """The prefill templates (register-blocked, and the tiled one of ``VEGAFUSE_ATT_PREFILL=scalar``) at
    wave 32 (sm_90's text) and 64 (gfx906's), run twice at positions that span
    several splits (the combine; the arrival counter set back for the next launch) and once at the
    last position, against the float64 interpreter on fresh random inputs."""
    monkeypatch.setenv("VEGAFUSE_ATT_PREFILL", template)
    t, s = v[2], v[3]
    k = attention_kernel(*v)
    _, m = tiles_of(k, target)
    check_positions(k, target, v, (min(2 * m.chunk + 3, s - t), m.chunk + 1 if t == 1 else 1, s - t),
                    str(tmp_path_factory.getbasetemp()), m)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("v", [
    (7, 1, 1024, 64, "f4"),     # GQA 7, head dim 64, f32 cache: 32 splits merged in blocks, then the blocks
    (12, 2, 300, 128, "f2"),    # Qwen2.5-1.5B's group of 6, f16 cache
    (4, 2, 200, 128, "f4"),     # GQA 2
    (3, 3, 100, 64, "f2"),      # GQA 1
    (10, 2, 300, 80, "f2"),     # head dim 80: lanes past the row's ten 16-byte loads
    (24, 2, 100, 128, "f2"),    # 12 heads per KV head: two workgroups of 6 heads each
    (16, 1, 150, 256, "f2"),    # 16 heads per KV head of 256: heads in workgroups by the register budget
    (8, 1, 200, 64, "f4"),      # 8 heads per KV head, f32 cache
    (12, 1, 150, 128, "f4"),    # 12 heads per KV head, f32 cache
    (14, 2, 200, 128, "f2"),    # Qwen2.5-7B's group of 7: on gfx906 workgroups of 3, 3 and 1 heads
    (11, 1, 150, 64, "f4"),     # a group of 11: on gfx906 workgroups of 4, 4 and 3 heads
], ids=lambda v: "x".join(map(str, v)))
def test_the_decode_text_computes_attention(v, target, tmp_path_factory):
    """The decode template (lane groups owning keys, no LDS tiles) at wave 32 and 64 at positions 0,
    1, both sides of the first split boundary, past the second, both sides of the short context that
    one split reads whole, and S - 1, each on fresh random inputs, against the float64 interpreter
    (one compiled kernel for all: the arrival counters set back)."""
    hq, hkv, s, d, kv = v
    rng = np.random.default_rng()
    k = attention_kernel(hq, hkv, 1, s, d, kv)
    _, m = tiles_of(k, target)
    assert m.heads and m.heads <= hq // hkv, m
    tmp = str(tmp_path_factory.getbasetemp())
    f = dsl.jit(lambda q, kc, vc, pos: dsl.attention(q, kc, vc, pos, 1.0 / np.sqrt(d)))
    short = {m.short - 2, m.short - 1, m.short} if m.short else set()
    for pos in sorted(({0, 1, m.chunk - 1, m.chunk, m.chunk + 1, 2 * m.chunk + 5, s - 1} | short) & set(range(s))):
        q = rng.standard_normal((hq, 1, d)).astype("f4")
        kc, vc = (rng.standard_normal((hkv, s, d)).astype(kv) for _ in range(2))
        out = np.full((hq, 1, d), np.nan, np.float32)
        named = {"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32)}
        emulate(k, target, [named.get(p.name, out) for p in k.params], tmp)
        want = f.lower(q, kc, vc, pos).program.run(q, kc, vc, pos, compute_dtype="f64")[0]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"pos {pos} {m}")


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
def test_decode_at_a_long_cache_of_two_workgroups_per_sm(tmp_path_factory):
    """sm_90's decode at Qwen2.5-1.5B's shape over a cache of 4200 positions: splits of 64 positions
    (two workgroups per SM at the full cache), 66 of them merged in blocks, the first split reading up
    to 256 positions whole (four steps of 64 keys: 8 waves); past the short read and across ten
    splits, against the float64 interpreter on fresh random inputs."""
    v = (12, 2, 1, 4200, 128, "f2")
    k = attention_kernel(*v)
    _, m = tiles_of(k, "sm_90")
    assert (m.chunk, m.splits, m.short, m.threads) == (64, 66, 256, 256), m
    check_positions(k, "sm_90", v, (257, 600), str(tmp_path_factory.getbasetemp()), m)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("target", ["sm_90", "gfx906"])
@pytest.mark.parametrize("v", [
    (16, 2, 13, 100, 64, "f2"),     # 8 query heads per KV head, head dim 64
    (12, 1, 9, 80, 128, "f4"),      # 12 per KV head, f32 cache
    (16, 1, 5, 40, 256, "f4"),      # 16 of 256, f32: the KV group's heads over two workgroups on gfx906
    (16, 1, 6, 60, 256, "f2"),      # 16 of 256, f16
    (12, 2, 37, 120, 128, "f2"),    # Qwen2.5-1.5B's group of 6, a ragged last query tile
], ids=lambda v: "x".join(map(str, v)))
def test_the_register_blocked_prefill_computes_attention(v, target, tmp_path_factory):
    """The register-blocked prefill at large KV groups, head dims 64-256 and both cache dtypes, causal
    with a ragged last query tile, at wave 32 and 64: positions 0, inside the cache and S - T, each on
    fresh random inputs, against the float64 interpreter."""
    t, s = v[2], v[3]
    k = attention_kernel(*v)
    _, m = tiles_of(k, target)
    assert m.block and m.rows_q * m.heads <= m.block[0] * m.threads // m.key_lanes, m
    check_positions(k, target, v, (0, (s - t) // 2 + 1, s - t), str(tmp_path_factory.getbasetemp()), m)


def test_a_forced_prefill_tile_is_checked(monkeypatch):
    """``VEGAFUSE_ATT_BLOCK`` sets the register-blocked tile; one that cannot run is one clear line."""
    a = L.Attention("q", "k", "v", "o", ("f32", "f16", "f16"), 12, 2, 40, 256, 128, L.c(0), 0.1)
    monkeypatch.setenv("VEGAFUSE_ATT_BLOCK", "2x2x16x128")
    m = attention_tiles(a, get_target("sm_90"))
    assert m.block == (2, 2) and m.key_lanes == 16 and m.threads == 128 and m.keys == 32, m
    for bad in ("4x4x16x256", "2x2x12x128", "2x2"):
        monkeypatch.setenv("VEGAFUSE_ATT_BLOCK", bad)
        with pytest.raises(ValueError, match="^VEGAFUSE_ATT_BLOCK="):
            attention_tiles(a, get_target("sm_90"))


def test_a_short_context_is_read_by_one_split(monkeypatch):
    """Decode at Qwen2.5-1.5B's shape: up to four steps of keys (256 positions on sm_90, whose
    workgroups of 3 query heads and 8 waves take steps of 64 keys and splits of 64 positions: two
    workgroups per SM over the full cache) the first split reads the whole context, so nothing is
    combined; the text names the bound; ``VEGAFUSE_ATT_SHORT=0`` keeps the splits; where a split is
    that long already (256 positions of a cache of 16384), nothing changes; a cache no longer than the
    bound is one split; gfx906 (not measured) keeps its splits."""
    for s, chunk, short in ((512, 64, 256), (4200, 64, 256), (16384, 256, 0)):
        k = attention_kernel(12, 2, 1, s, 128, "f2")
        _, m = tiles_of(k, "sm_90")
        assert (m.chunk, m.short, m.heads, m.keys) == (chunk, short, 3, 64), m
        src = render_hip(k, "sm_90").source
        assert ("SHORT = 256" in src and "const int ch = end <= SHORT ? SHORT : CH;" in src) == bool(short)
    one = tiles_of(attention_kernel(12, 2, 1, 100, 128, "f2"), "sm_90")[1]
    assert (one.chunk, one.splits, one.short) == (128, 1, 0), one
    assert tiles_of(attention_kernel(12, 2, 1, 512, 128, "f2"), "gfx906")[1].short == 0
    _, m = tiles_of(attention_kernel(12, 2, 1, 65536, 128, "f2"), "sm_90")
    assert m.chunk >= m.short and "SHORT" not in render_hip(attention_kernel(12, 2, 1, 65536, 128, "f2"), "sm_90").source
    monkeypatch.setenv("VEGAFUSE_ATT_SHORT", "0")
    k = attention_kernel(12, 2, 1, 512, 128, "f2")
    assert tiles_of(k, "sm_90")[1].short == 0 and "SHORT" not in render_hip(k, "sm_90").source
    monkeypatch.delenv("VEGAFUSE_ATT_SHORT")
    monkeypatch.setenv("VEGAFUSE_ATT_WAVES", "4")         # the A/B side: 4 waves, steps of 32 keys
    m = tiles_of(attention_kernel(12, 2, 1, 512, 128, "f2"), "sm_90")[1]
    assert (m.chunk, m.short, m.keys, m.threads) == (32, 128, 32, 128), m
    for bad, target in (("0", "sm_90"), ("-1", "sm_90"), ("9", "sm_90"), ("5", "gfx906")):   # past the launch bound
        monkeypatch.setenv("VEGAFUSE_ATT_WAVES", bad)
        with pytest.raises(ValueError, match=rf"^VEGAFUSE_ATT_WAVES={bad}: a decode attention workgroup on {target} "
                                             r"takes 1 to \d+ waves"):
            tiles_of(attention_kernel(12, 2, 1, 512, 128, "f2"), target)
