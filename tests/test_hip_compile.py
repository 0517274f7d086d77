"""HIP run-time compilation for gfx906 (no GPU needed): hiprtc, code-object metadata, ISA, disk cache.

Skipped as a whole, with the install hint, when the ROCm libraries are missing.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegen import codeobject
from codegen.targets import get_target, occupancy
from engine import codecache
from engine.build import code_cache
from engine.devices import rocm as R

try:
    LIBS = R.find_hiprtc()
except R.HipUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent

# fp16 GEMV, one wave per row, 4 rows per 256-thread workgroup: 16-byte loads of weights and
# activation, v_dot2_f32_f16 on packed halves, butterfly reduction across the wave.
GEMV = r"""
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));

extern "C" __global__ void __launch_bounds__(256)
gemv_f16(const _Float16* __restrict__ w, const _Float16* __restrict__ x, float* __restrict__ y,
         int rows, int cols) {
  const int row = blockIdx.x * 4 + threadIdx.x / 64;
  const int lane = threadIdx.x % 64;
  if (row >= rows) return;
  float acc = 0.0f;
  for (int c = lane * 8; c < cols; c += 64 * 8) {
    uint4 wv = *(const uint4*)(w + (size_t)row * cols + c);
    uint4 xv = *(const uint4*)(x + c);
    const half2_t* wh = (const half2_t*)&wv;
    const half2_t* xh = (const half2_t*)&xv;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc = __builtin_amdgcn_fdot2(wh[i], xh[i], acc, false);
  }
  for (int o = 32; o > 0; o >>= 1) acc += __shfl_xor(acc, o);
  if (lane == 0) y[row] = acc;
}
"""

# Run in a child process: compile the source in file argv[1] and report.  argv[2]: wall-clock
# time to start compiling at (to line up concurrent processes).  argv[3]: "nobuild" replaces the
# compiler by a function that fails, so only a cache hit can succeed; "slow" adds 0.5 s to it.
CHILD = r"""
import hashlib, json, sys, time
from engine.build import code_cache
from engine.devices import rocm as R
src = open(sys.argv[1]).read()
if sys.argv[3] == "nobuild":
    def forbidden(*a):
        raise AssertionError("compiled although the cache should have hit")
    R._hiprtc_compile = forbidden
if sys.argv[3] == "slow":                      # widen the window in which both processes build
    real = R._hiprtc_compile
    R._hiprtc_compile = lambda *a: (time.sleep(0.5), real(*a))[1]
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
co = R.compile_hip(src, "gemv_f16")
print(json.dumps({"hit": co.cache_hit, "stats": code_cache().stats,
                  "sha": hashlib.sha256(co.code).hexdigest(), "vgprs": co.resources()["vgprs"]}))
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(tmp_path))
    return tmp_path


def child(tmp: Path, extra: str, start: float = 0.0, mode: str = "build") -> subprocess.Popen:
    """Start CHILD compiling GEMV + extra."""
    src = tmp / f"src-{time.time_ns()}.hip"
    src.write_text(GEMV + extra)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(start), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def entries(root: Path) -> list:
    return sorted((root / "objects").glob("*/*.bin"))


def need_objdump():
    try:
        return codeobject.find_llvm_tool("llvm-objdump")
    except R.HipUnavailable as e:
        pytest.skip(str(e))


# ----------------------------------------------------------------------------- discovery
def test_discovery_loads_libs_and_restores_rocm_path():
    from rocm.bindings import hip, hiprtc
    for name in ("libhiprtc.so", "libamdhip64.so"):
        assert (Path(LIBS.rocm_path) / "lib" / name).exists()
    assert hiprtc.has_symbol("hiprtcCompileProgram") and hip.has_symbol("hipModuleLaunchKernel")
    if LIBS.shim:
        assert os.environ.get("ROCM_PATH") != LIBS.rocm_path      # the shim does not leak to tools
    assert LIBS.identity


def test_missing_rocm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_LIBS", None)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    with pytest.raises(R.HipUnavailable, match="apt-get install hipcc libamdhip64-dev rocm-device-libs"):
        R.find_hiprtc()


# ----------------------------------------------------------------------------- code object
def test_gemv_resources(cache_dir):
    co = R.compile_hip(GEMV, "gemv_f16")
    assert isinstance(co, bytes) and co[:4] == b"\x7fELF" and not co.cache_hit
    assert co.kernel_symbols() == ["gemv_f16"]
    r = co.resources()
    assert r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0 and r["sgpr_spills"] == 0
    assert 4 <= r["vgprs"] <= 64 and 4 <= r["sgprs"] <= 102
    assert r["lds_bytes"] == 0 and r["wavefront_size"] == 64 and r["max_workgroup_size"] == 256
    assert r["kernarg_bytes"] == 32 and 0 < r["code_bytes"] < 4096
    assert r["waves_per_simd"] == occupancy(get_target("gfx906"), r["vgprs"], r["sgprs"], 0, 256)["waves_per_simd"]


def test_gemv_isa(cache_dir):
    need_objdump()
    isa = R.compile_hip(GEMV, "gemv_f16").isa()
    assert "<gemv_f16>:" in isa
    assert "global_load_dwordx4" in isa
    assert "v_dot2_f32_f16" in isa
    assert "flat_load" not in isa and "scratch_" not in isa


def test_pack_kernargs_follows_metadata(cache_dir):
    meta = R.compile_hip(GEMV, "gemv_f16").kernel_metadata()
    buf = codeobject.pack_kernargs(meta, [0x1000, 0x2000, 0x3000, 18944, -1])
    assert len(buf) == 32
    assert buf[:8] == (0x1000).to_bytes(8, "little") and buf[16:24] == (0x3000).to_bytes(8, "little")
    assert buf[24:28] == (18944).to_bytes(4, "little") and buf[28:32] == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError, match="5 arguments"):
        codeobject.pack_kernargs(meta, [0, 0])


def test_compile_error_names_kernel_and_line(cache_dir):
    src = GEMV.replace("acc += __shfl_xor(acc, o);", "acc += __shfl_xor(acc, o) + undefined_thing;")
    with pytest.raises(R.HipCompileError) as ei:
        R.compile_hip(src, "gemv_f16")
    msg = str(ei.value)
    assert "gemv_f16" in msg
    assert "undefined_thing" in msg
    bad = next(i for i, l in enumerate(src.splitlines(), 1) if "undefined_thing" in l)
    assert f"{bad} |   for (int o = 32; o > 0; o >>= 1) acc += __shfl_xor(acc, o) + undefined_thing;" in msg
    assert ei.value.errors[0][0] == bad
    assert entries(cache_dir) == []                      # failures are not cached


# ----------------------------------------------------------------------------- occupancy model
@pytest.mark.parametrize("vgprs,sgprs,lds,wg,waves,limiter", [
    (19, 14, 0, 256, 10, "none"),        # 20 VGPRs: 256 // 20 = 12 -> capped at 10
    (25, 14, 0, 64, 9, "vgpr"),          # 28 VGPRs: 256 // 28 = 9
    (32, 14, 0, 64, 8, "vgpr"),
    (128, 14, 0, 256, 2, "vgpr"),
    (20, 81, 0, 64, 8, "sgpr"),          # 81 -> 96 SGPRs: 800 // 96 = 8
    (20, 80, 0, 64, 10, "none"),
    (20, 14, 32768, 256, 2, "lds"),      # 2 workgroups of 4 waves per CU = 8 waves / 4 SIMDs
    (20, 14, 100, 64, 10, "none"),       # 512-byte granule: 128 groups fit; the 40 wave slots bind
    (20, 14, 0, 1024, 8, "workgroup"),   # 16 waves per group: 2 groups = 32 waves per CU
    (20, 14, 65536, 64, 1, "lds"),       # one 1-wave group per CU
])
def test_gfx906_occupancy(vgprs, sgprs, lds, wg, waves, limiter):
    occ = occupancy(get_target("gfx906"), vgprs, sgprs, lds, wg)
    assert (occ["waves_per_simd"], occ["limiter"]) == (waves, limiter)


def test_msgpack_subset():
    blob = bytes([0x83, 0xA1, 0x61, 0x01, 0xA1, 0x62, 0x92, 0xC3, 0xD0, 0xFE, 0xA1, 0x63,
                  0xCD, 0x01, 0x00])
    assert codeobject.msgpack_loads(blob) == {"a": 1, "b": [True, -2], "c": 256}


# ----------------------------------------------------------------------------- disk cache
def test_second_process_hits_cache(cache_dir, tmp_path):
    co = R.compile_hip(GEMV, "gemv_f16")
    assert not co.cache_hit and co.compile_seconds > 0
    report = finish(child(tmp_path, "", mode="nobuild"))
    assert report["hit"] and report["stats"]["hits"] == 1 and report["stats"]["misses"] == 0
    assert report["sha"] == __import__("hashlib").sha256(co.code).hexdigest()


def test_truncated_entry_is_rebuilt(cache_dir):
    good = R.compile_hip(GEMV, "gemv_f16").code
    (path,) = entries(cache_dir)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    before = dict(code_cache().stats)
    again = R.compile_hip(GEMV, "gemv_f16")
    stats = code_cache().stats
    assert not again.cache_hit and again.code == good
    assert stats["corrupt"] == before["corrupt"] + 1 and stats["misses"] == before["misses"] + 1
    assert path.read_bytes() == blob                       # rewritten whole
    assert R.compile_hip(GEMV, "gemv_f16").cache_hit


def test_concurrent_processes_both_succeed(cache_dir, tmp_path):
    tag = f"\n// concurrent {time.time_ns()}\n"
    start = time.time() + 1.5                            # both start compiling at the same moment
    procs = [child(tmp_path, tag, start, "slow") for _ in range(2)]
    reports = [finish(p) for p in procs]
    assert not reports[0]["hit"] and not reports[1]["hit"]          # both built and stored
    assert reports[0]["sha"] == reports[1]["sha"]
    (path,) = entries(cache_dir)
    assert codecache.unpack_entry(path.read_bytes()) is not None
    assert not list(path.parent.glob("*.tmp"))


def test_cache_dir_that_is_a_file_does_not_break_compilation(tmp_path, monkeypatch):
    root = tmp_path / "not-a-dir"
    root.write_bytes(b"")
    monkeypatch.setenv("VEGAFUSE_CACHE_DIR", str(root))
    co = R.compile_hip(GEMV, "gemv_f16")
    assert co[:4] == b"\x7fELF" and not co.cache_hit
    stats = code_cache().stats
    assert stats["read_errors"] == 1 and stats["write_errors"] == 1 and stats["misses"] == 1

def test_codecache_unit(tmp_path):
    cache = codecache.CodeCache(tmp_path)
    key = {"source": "x", "arch": "gfx906", "compiler": "test", "options": ["-O3"]}
    calls = []

    def build():
        calls.append(1)
        return b"payload"
    assert cache.get_or_build(key, build) == (b"payload", False)
    assert cache.get_or_build(key, build) == (b"payload", True)
    assert cache.get_or_build({**key, "options": ["-O2"]}, build) == (b"payload", False)
    path = cache.path(key)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF                                     # same length, bad checksum
    path.write_bytes(bytes(blob))
    assert cache.get_or_build(key, build) == (b"payload", False)
    assert len(calls) == 3 and cache.stats == {"hits": 1, "misses": 3, "corrupt": 1, "read_errors": 0,
                                             "write_errors": 0}

# The device (memory, launches, plans; on a GPU and on a stand-in runtime): tests/test_hip_device.py
