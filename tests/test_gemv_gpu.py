"""The float GEMV's balanced grid (``codegen.mapping._balanced``) and the NVIDIA load of quant blocks:
the kernel text run on the CPU (``tests/emulation.py``) against the float64 interpreter, and the
mapping's choices on the real tables."""
import re

import numpy as np
import pytest

import dsl
from codegen import prelude
from dsl.quant import quantize
from codegen.hip import render_hip
from codegen.mapping import map_kernel
from codegen.targets import get_target
from engine.pipeline import lower_program
from stdlib import nn
from tests.emulation import GXX, emulated, launch

rng = np.random.default_rng()

# the float GEMV's dot product in plain C++ (the prelude's versions use CUDA's half2 or clang's vector types);
# VF_ACT_F16: the activation kept as f16 in LDS (a long one, codegen.prelude.act_dtype)
DOT8 = """#define VF_UNROLL_K
#ifdef VF_ACT_F16
typedef vf_half vf_act_t;
#else
typedef float vf_act_t;
#endif
static inline vf_act_t vf_to_act(float x) { return (vf_act_t)x; }
static inline float vf_from_act(vf_act_t x) { return (float)x; }
static inline float vf_dot8_h(float acc, const vf_half* w, const vf_act_t* a) {
  for (int i = 0; i < 8; ++i) acc += (float)a[i] * vf_h2f(w[i]);
  return acc;
}
"""


def down(x, w, r):
    return r + nn.linear(x, w)


def lowered(K, N, dtype=np.float16):
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * K ** -0.5).astype(dtype)
    r = rng.standard_normal((1, N)).astype(np.float32)
    low = dsl.jit(down).lower(x, w, r)
    (k,) = lower_program(low).kernels
    return low, k, (x, w, r)


@pytest.mark.skipif(not GXX, reason="no g++ for the CPU emulation of the GPU kernel text")
@pytest.mark.parametrize("N", [36, 45])
def test_balanced_gemv_matches_float64(N, tmp_path_factory):
    """K = 8192 over 36 or 45 rows on a table of 4 CUs and 2 workgroups per CU: the default grid (5 or 6
    workgroups of 8 rows) would load the CUs unevenly, so each CU takes one workgroup of ceil(N / 4)
    waves; every row is written."""
    t = get_target("sm_90", compute_units=4, blocks_per_cu=2)
    low, k, (x, w, r) = lowered(8192, N)
    h = render_hip(k, t)
    waves = -(-N // 4)
    assert (h.block[0], h.grid[0]) == (32 * waves, -(-N // waves)), h.kernel.launch
    assert f"#define VF_BLOCK {32 * waves}\n" in h.source and "one workgroup per CU" in h.source
    want = low.program.run(x, w, r, compute_dtype="f64")[0]
    out = np.full((1, N), np.nan, np.float32)
    bufs = {"x": x, "w": w, "r": r}
    arrays = [bufs.get(p.name, out) if p.role == "in" else out for p in k.params]
    defines = f"#define VF_BLOCK {h.block[0]}\n#define VF_WAVES (VF_BLOCK / VF_WAVE)\n#define VF_ATT_BLOCK VF_BLOCK\n"
    helpers = prelude._NV_WAVE_SUM + prelude._COMMON.format() + DOT8
    launch(emulated(h, str(tmp_path_factory.mktemp("gemv")), defines, helpers), h, arrays)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-3 * max(1.0, np.abs(want).max()))


def test_balance_rule_on_the_tables(monkeypatch):
    """Qwen2.5-7B's down projection (K 18944, 3584 rows) on the H200: 128 workgroups of 28 waves, one
    per SM; its O projection (K 3584) keeps 448 of 8; gfx906, wave 64 emulated on NVIDIA and
    ``VEGAFUSE_GEMV_BALANCE=0`` keep the default grid."""
    def launch_of(K, N, target):
        k = lowered(K, N)[1]
        return map_kernel(k, get_target(target)).launch
    assert (launch_of(18944, 3584, "sm_90").grid, launch_of(18944, 3584, "sm_90").block) == (128, 896)
    assert (launch_of(3584, 3584, "sm_90").grid, launch_of(3584, 3584, "sm_90").block) == (448, 256)
    assert launch_of(18944, 3584, "gfx906").block == 256
    assert launch_of(18944, 3584, "sm_90_wave64").block == 256
    monkeypatch.setenv("VEGAFUSE_GEMV_BALANCE", "0")
    assert (launch_of(18944, 3584, "sm_90").grid, launch_of(18944, 3584, "sm_90").block) == (448, 256)


def test_nvidia_quant_blocks_through_ldg(monkeypatch):
    """The int8 GEMV loads a weight block's 16 bytes of integers through ``__ldg`` on NVIDIA (a plain load
    with ``VEGAFUSE_NV_LDG=0``), and by a plain 16-byte load on gfx906."""
    w = quantize("q4_0", rng.standard_normal((64, 256)).astype(np.float32))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    (k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(x, w)).kernels
    assert "__ldg((const int4*)p)" in render_hip(k, "sm_90").source
    assert "return *(const vf_int4*)p;" in render_hip(k, "gfx906").source
    monkeypatch.setenv("VEGAFUSE_NV_LDG", "0")
    src = render_hip(k, "sm_90").source
    assert "__ldg((const int4*)p)" not in src and "return *(const vf_int4*)p;" in src


def _tile_loop_unroll(src):
    """The unroll hint on the int8 GEMV's loop over its tiles (0: none)."""
    lines = src.splitlines()
    i = next(n for n, line in enumerate(lines) if "for (int tile = " in line)
    head = lines[i - 1].strip()
    return int(head.split()[-1]) if head.startswith("#pragma unroll") else 0


@pytest.mark.parametrize("fmt,K,want", [("q4_0", 1536, 4), ("q4_0", 3584, 0), ("gptq_int4", 3584, 2),
                                        ("q8_0", 576, 4)])
def test_trip_unroll_rule_on_the_tables(fmt, K, want, monkeypatch):
    """On sm_90 an int8 GEMV whose lanes fold at most 2 blocks of a row (Qwen2.5-1.5B's K 1536: 48
    blocks over 32 lanes) unrolls its loop over tiles by 4, gptq_int4 by 2 at any K, others not
    (4096 rows: enough that no waves share a row); gfx906 and the emulated wave 64 keep their loop as
    it is; ``VEGAFUSE_TRIP_UNROLL`` overrides.  (With half a wave a row, the default at K 1536, a lane
    folds 3 blocks: no unroll; the test of that rule is below.)"""
    from dsl.quant import random_qarray
    monkeypatch.setenv("VEGAFUSE_INT8_FULL_LANES", "0")
    w = random_qarray((4096, K), fmt, 1)
    x = rng.standard_normal((1, K)).astype(np.float32)
    (k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(x, w)).kernels
    assert _tile_loop_unroll(render_hip(k, "sm_90").source) == want
    assert _tile_loop_unroll(render_hip(k, "gfx906").source) == 0
    assert _tile_loop_unroll(render_hip(k, "sm_90_wave64").source) == 0
    monkeypatch.setenv("VEGAFUSE_TRIP_UNROLL", "0")
    assert _tile_loop_unroll(render_hip(k, "sm_90").source) == 0
    monkeypatch.setenv("VEGAFUSE_TRIP_UNROLL", "2")
    assert _tile_loop_unroll(render_hip(k, "sm_90").source) == 2


def test_programmatic_dependent_launch_waits_before_it_lets_the_next_kernel_start():
    """With ``Target.pdl`` a GEMV first asks L2 for its share of each weight's first bytes (not the
    norm's gain, not the activation), then waits for the previous kernel, then (``pdl_trigger="wait"``)
    lets the next one start; ``"exit"`` (the default) leaves the start to the workgroups' end; sm_90's
    text has it so (4 MiB, at exit); without pdl, and on gfx906, the macros are empty and nothing is
    prefetched."""
    from dataclasses import replace
    K, N = 1024, 512
    w = (rng.standard_normal((N, K)) * K ** -0.5).astype(np.float16)
    x, g = rng.standard_normal((1, K)).astype(np.float32), rng.uniform(0.5, 1.5, K).astype(np.float32)
    (k,) = lower_program(dsl.jit(lambda x, g, w: nn.linear(nn.rms_norm(x, g, 1e-6), w)).lower(x, g, w)).kernels
    t = replace(get_target("sm_90"), pdl=True, pdl_prefetch=1 << 20, pdl_trigger="wait")
    src = render_hip(k, t).source
    prefetches = [line.strip() for line in src.splitlines() if line.strip().startswith("vf_prefetch_l2(")]
    assert prefetches == [f"vf_prefetch_l2(w, {N * K * 2}ull);"], prefetches
    body = src[src.index('extern "C"'):]
    assert body.index("vf_prefetch_l2(w") < body.index("VF_GRID_WAIT();") < body.index("VF_GRID_LAUNCH_DEPENDENTS();")
    assert 'asm volatile("griddepcontrol.launch_dependents;"' in src
    small = render_hip(k, replace(t, pdl_prefetch=4096)).source
    assert "vf_prefetch_l2(w, 4096ull);" in small
    exit_ = render_hip(k, replace(t, pdl_trigger="exit")).source
    assert "griddepcontrol.launch_dependents" not in exit_ and "griddepcontrol.wait" in exit_
    assert render_hip(k, "sm_90").source == render_hip(k, replace(t, pdl_prefetch=4 << 20, pdl_trigger="exit")).source
    for plain in (render_hip(k, replace(t, pdl=False)).source, render_hip(k, "gfx906").source):
        assert "vf_prefetch_l2(w" not in plain and "griddepcontrol" not in plain


def test_trip_unroll_of_a_fused_kernel_does_not_depend_on_the_order_of_its_weights():
    """Two GEMVs on one activation fused into one kernel, a gptq_int4 and a q4_0 weight at K 3584
    (3.5 blocks a lane): the gptq_int4 rule (unroll 2) holds whichever segment comes first."""
    from dsl.quant import random_qarray
    K = 3584
    x = rng.standard_normal((1, K)).astype(np.float32)
    for a, b in (("gptq_int4", "q4_0"), ("q4_0", "gptq_int4")):
        wa, wb = random_qarray((512, K), a, 1), random_qarray((4096, K), b, 1)
        (k,) = lower_program(dsl.jit(lambda x, wa, wb: (nn.linear(x, wa), nn.linear(x, wb))).lower(x, wa, wb)).kernels
        assert _tile_loop_unroll(render_hip(k, "sm_90").source) == 2, (a, b)


def test_pdl_switches_are_checked(monkeypatch):
    """``VEGAFUSE_PDL_TRIGGER`` takes "exit" or "wait" and ``VEGAFUSE_PDL_PREFETCH`` a number of bytes
    (0: none); another value is one ValueError naming the switch, not a silent default."""
    from engine.devices.cuda import pdl_target
    t = get_target("sm_90")
    assert (pdl_target(t).pdl, pdl_target(t).pdl_trigger, pdl_target(t).pdl_prefetch) == (True, "exit", 4 << 20)
    monkeypatch.setenv("VEGAFUSE_PDL_TRIGGER", "wait")
    monkeypatch.setenv("VEGAFUSE_PDL_PREFETCH", "0")
    assert (pdl_target(t).pdl_trigger, pdl_target(t).pdl_prefetch) == ("wait", 0)
    monkeypatch.setenv("VEGAFUSE_PDL_TRIGGER", "wiat")
    with pytest.raises(ValueError, match="^VEGAFUSE_PDL_TRIGGER='wiat' is not"):
        pdl_target(t)
    monkeypatch.setenv("VEGAFUSE_PDL_TRIGGER", "exit")
    monkeypatch.setenv("VEGAFUSE_PDL_PREFETCH", "-1")
    with pytest.raises(ValueError, match="^VEGAFUSE_PDL_PREFETCH=-1 is negative"):
        pdl_target(t)


@pytest.mark.skipif(not GXX, reason="no g++ to run the prefetch's byte arithmetic on the CPU")
def test_the_prefetch_shares_tile_the_bytes(tmp_path):
    """``vf_prefetch_l2``'s arithmetic run on the CPU for every workgroup of a grid (the bulk prefetch
    recorded instead): each range 16-byte aligned, a multiple of 16 bytes, inside the first n bytes
    and apart from the others; on a 16-byte aligned buffer together they cover the n bytes' whole
    16-byte units, also where a share is below 32 bytes or the grid has more workgroups than units."""
    import ctypes
    import re
    import subprocess
    text = prelude._NV_PDL
    fn = text[text.index("__device__ __forceinline__ void vf_prefetch_l2"):text.rindex("}") + 1]
    fn = re.sub(r"asm volatile\(.*\);", "{ vf_lo[vf_n] = lo; vf_size[vf_n++] = (unsigned)(hi - lo); }", fn)
    src = ("#define __device__\n#define __forceinline__ inline\nstruct vf_dim { unsigned x; };\n"
           "static vf_dim threadIdx, blockIdx, gridDim;\nstatic unsigned long long vf_lo[1 << 16], vf_size[1 << 16];\n"
           "static int vf_n;\n" + fn + "\nextern \"C\" int run(unsigned long long p, unsigned long long n, "
           "unsigned grid, unsigned long long* lo, unsigned long long* size) {\n  vf_n = 0; gridDim.x = grid;\n"
           "  for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x) vf_prefetch_l2((const void*)p, n);\n"
           "  for (int i = 0; i < vf_n; ++i) { lo[i] = vf_lo[i]; size[i] = vf_size[i]; }\n  return vf_n;\n}\n")
    (tmp_path / "p.cpp").write_text(src)
    r = subprocess.run([GXX, "-O1", "-fPIC", "-shared", str(tmp_path / "p.cpp"), "-o", str(tmp_path / "p.so")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[:2000]
    lib = ctypes.CDLL(str(tmp_path / "p.so"))
    lib.run.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    lo, size = np.zeros(1 << 16, np.uint64), np.zeros(1 << 16, np.uint64)
    for off in (0, 8, 1):
        base = (1 << 40) + off
        for n, grid in ((4 << 20, 528), (4 << 20, 60000), (65536, 4096), (65536, 5000), (100, 3), (4096, 1), (20, 7)):
            count = lib.run(base, n, grid, lo.ctypes.data, size.ctypes.data)
            got = sorted(zip(lo[:count].tolist(), size[:count].tolist()))
            end = base
            for a, s in got:
                assert a % 16 == 0 and s % 16 == 0 and s > 0 and a >= end and a + s <= base + n, (off, n, grid, a, s)
                end = a + s
            if off == 0:
                assert sum(s for _, s in got) == n // 16 * 16, (n, grid)


def test_a_lane_of_few_weight_blocks_has_them_all_in_flight(monkeypatch):
    """On sm_90 an int8 GEMV lane that folds at most 8 blocks of a row (Qwen2.5-7B's K 3584: 3.5)
    takes them in a fully unrolled count of guarded steps, written for any wave width (gfx906 keeps
    its loop); a long row (K 18944: 18.5) keeps its loop unrolled by 4; ``VEGAFUSE_WHOLE_STEPS=0``
    keeps the loop everywhere (A/B)."""
    from dsl.quant import random_qarray
    x = rng.standard_normal((1, 3584)).astype(np.float32)
    w = random_qarray((4096, 3584), "q4_0", int(rng.integers(1 << 30)))
    (k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(x, w)).kernels
    src = render_hip(k, "sm_90").body
    assert "for (int vf_step = 0; vf_step < (112 + VF_WAVE - 1) / VF_WAVE; ++vf_step) {" in src
    assert re.search(r"const int (kb\w*) = vf_lane \+ vf_step \* VF_WAVE;\n\s*if \(\1 < 112\) \{", src)
    assert "vf_step" not in render_hip(k, "gfx906").body       # its LDS gate: not there
    long_x = rng.standard_normal((1, 18944)).astype(np.float32)
    long_w = random_qarray((3584, 18944), "q4_0", int(rng.integers(1 << 30)))
    (long_k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(long_x, long_w)).kernels
    src = render_hip(long_k, "sm_90").body
    assert "vf_step" not in src and "#pragma unroll 4\n" in src
    monkeypatch.setenv("VEGAFUSE_WHOLE_STEPS", "0")
    assert "vf_step" not in render_hip(k, "sm_90").body


@pytest.mark.parametrize("fmt,K,lanes", [("q4_0", 1536, 16), ("q4_1", 1536, 16), ("q8_0", 3584, 32),
                                         ("gptq_int4", 2048, 32), ("q4_0", 2560, 32)])
def test_a_row_whose_blocks_leave_lanes_idle_takes_half_the_wave(fmt, K, lanes, monkeypatch):
    """On sm_90 (``Target.int8_full_lanes``: 4) Qwen2.5-1.5B's K of 1536 (48 blocks: 32 lanes would
    leave 16 idle on their second step) takes 16 lanes a row, 3 blocks each; 3584 (112 blocks, 7 a
    lane at 16) and 2560 (80: 5) keep the wave, as do rows that fill it (2048: 64 blocks); gfx906 and
    the emulated wave 64 keep their mapping; ``VEGAFUSE_INT8_FULL_LANES=0`` turns it off.  16 lanes
    divide the blocks, so each of a lane's steps is written without a guard."""
    from dsl.quant import random_qarray
    w = random_qarray((256, K), fmt, 1)
    x = rng.standard_normal((1, K)).astype(np.float32)
    (k,) = lower_program(dsl.jit(lambda x, w: nn.linear(x, w)).lower(x, w)).kernels
    how = lambda t: render_hip(k, t).kernel.launch.how  # noqa: E731
    assert (f"{lanes} lanes per output row" if lanes < 32 else "a wave per output row") in how("sm_90")
    if lanes == 16:                            # every step whole: no guard on the block index
        body = render_hip(k, "sm_90").body
        assert f"vf_step < {K // 32 // 16};" in body and "if (kb <" not in body, body
    assert "16 lanes" not in how("gfx906") and "16 lanes" not in how("sm_90_wave64")
    monkeypatch.setenv("VEGAFUSE_INT8_FULL_LANES", "0")
    assert "a wave per output row" in how("sm_90")
