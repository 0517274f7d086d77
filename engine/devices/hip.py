"""HIP on AMD GPUs (main target: gfx906 / MI50): run-time compilation, code-object inspection, the device.

Usage::

    co = compile_hip(source, "gemv")             # hiprtc, gfx906, -O3; cached on disk
    co.resources()    # {'vgprs': 19, 'sgprs': 14, 'lds_bytes': 0, 'scratch_bytes': 0, 'waves_per_simd': 10, ...}
    print(co.isa())   # gfx906 disassembly (llvm-objdump)

    f = dsl.jit(fn, backend="hip")               # the executable runs on HIPDevice()
    dev = HIPDevice()                            # needs an AMD GPU: complete but untested on hardware
    dev = HIPDevice.offline()                    # compile only, no GPU: dev.compile_many(plan.kernels)

Compilation and inspection need no GPU, only the ROCm libraries (see
:func:`find_hiprtc`) and, for :meth:`CodeObject.isa`, an ``llvm-objdump`` that
knows AMDGPU.  Nothing here needs the ``hipcc`` driver.  :class:`HIPDevice` has the
device interface of the CUDA device (shared code in :mod:`engine.devices.gpu`).
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from codegen.hip import render_hip
from codegen.loopir import canonicalize
from codegen.targets import get_target
from engine.codecache import CodeCache, default_cache_dir
from engine.devices.gpu import NP_DTYPES, DeviceArray, GPUDevice, GPUKernel, ScalarSlots  # noqa: F401

INSTALL_HINT = ("install ROCm's HIP runtime and compiler: on Debian/Ubuntu "
                "`apt-get install hipcc libamdhip64-dev rocm-device-libs` (ROCm 5.2), or ROCm >= 5.3 "
                "from AMD (/opt/rocm/lib/libhiprtc.so); or set ROCM_PATH to an install")


class HipUnavailable(RuntimeError):
    """The ROCm libraries (hiprtc, HIP runtime) or tools needed for an operation are missing."""


class HipCompileError(RuntimeError):
    """hiprtc rejected a kernel.  ``str(err)`` names the kernel, the first error and the failing
    source lines; ``.log`` is the full compiler log, ``.source`` the source, ``.errors`` a list of
    ``(line, column, message)``."""

    def __init__(self, message, name="", log="", source="", errors=()):
        super().__init__(message)
        self.name, self.log, self.source, self.errors = name, log, source, list(errors)


class HipError(RuntimeError):
    """A HIP runtime call failed."""


# ----------------------------------------------------------------------------- library discovery
@dataclass(frozen=True)
class RocmLibs:
    """What :func:`find_hiprtc` found.

    ``rocm_path``: the directory hip-python loaded from (``rocm_path/lib`` holds
    ``libhiprtc.so`` and ``libamdhip64.so``, possibly as symlinks in a private shim);
    ``hiprtc``, ``amdhip64``: the real library files; ``install_root``: the ROCm
    install they belong to (e.g. ``/opt/rocm-6.2`` or ``/usr``), used to find its
    LLVM tools; ``identity``: compiler identity for cache keys (real paths, sizes
    and mtimes of hiprtc and comgr); ``shim``: whether ``rocm_path`` is our private
    symlink folder.
    """
    rocm_path: str
    hiprtc: str
    amdhip64: str
    install_root: str
    identity: str
    shim: bool


_LIBS: RocmLibs | None = None


def _lib_dirs(root: Path) -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    return [root / "lib", root / "lib" / multiarch, root / "lib64"]


def _has_hiprtc_symbols(path: Path) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(path)), "hiprtcCreateProgram")
    except OSError:
        return False


def _find_in(roots) -> tuple[Path, Path, Path] | None:
    """(install root, hiprtc library, amdhip64 library) in the first root that has them.

    ROCm >= 5.3 ships ``libhiprtc.so``; ROCm 5.2 (Debian) has the ``hiprtc*``
    functions inside ``libamdhip64.so.5`` and no ``libhiprtc.so``.
    """
    for root in roots:
        for d in _lib_dirs(Path(root)):
            amd = next((d / n for n in ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5")
                        if (d / n).exists()), None)
            if amd is None:
                continue
            rtc = next((d / n for n in ("libhiprtc.so", "libhiprtc.so.6", "libhiprtc.so.5")
                        if (d / n).exists()), None)
            if rtc is not None:
                return Path(root), rtc, amd
            if _has_hiprtc_symbols(amd):
                return Path(root), amd, amd
    return None


def _identity(rtc: Path) -> str:
    """Compiler identity: real path (with version suffix), size and mtime of hiprtc and of the
    comgr library next to it (comgr holds the clang that hiprtc drives)."""
    parts = []
    real = rtc.resolve()
    comgr = sorted(glob.glob(str(real.parent / "libamd_comgr.so*")))
    for p in [str(real)] + comgr[-1:]:
        st = os.stat(p)
        parts.append(f"{os.path.realpath(p)}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def _make_shim(rtc: Path, amd: Path) -> Path:
    """A private folder ``<cache>/rocm-shim/<id>/lib`` with ``libhiprtc.so`` and ``libamdhip64.so``
    symlinks, for hip-python, which dlopens ``$ROCM_PATH/lib/lib{hiprtc,amdhip64}.so``."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", str(rtc.resolve()).strip("/"))
    root = default_cache_dir() / "rocm-shim" / tag
    lib = root / "lib"
    try:
        lib.mkdir(parents=True, exist_ok=True)
    except OSError:                                   # read-only cache dir: use a per-user temp folder
        root = Path(tempfile.gettempdir()) / f"vegafuse-{os.getuid()}" / "rocm-shim" / tag
        lib = root / "lib"
        lib.mkdir(parents=True, exist_ok=True)
    for name, target in (("libhiprtc.so", rtc.resolve()), ("libamdhip64.so", amd.resolve())):
        link = lib / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        tmp = lib / f".{name}.{os.getpid()}.tmp"              # atomic: other processes may race us
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, link)
    return root


def _load_bindings(rocm_path: str):
    """Have hip-python open ``rocm_path/lib/lib{hiprtc,amdhip64}.so`` now.

    hip-python reads ``ROCM_PATH`` once, when a binding module first needs its library; it is
    set for that moment and then restored, so that tools started later (clang, hipcc read
    ``ROCM_PATH`` too) do not see the shim.  With a hip-python that lacks ``has_symbol`` (it
    cannot be made to load early) ``ROCM_PATH`` stays set.
    """
    try:
        from rocm.bindings import hip, hiprtc
    except ImportError as e:
        raise HipUnavailable(f"hip-python is not installed ({e}): `pip install hip-python`") from e
    old = os.environ.get("ROCM_PATH")
    os.environ["ROCM_PATH"] = rocm_path
    if not (hasattr(hiprtc, "has_symbol") and hasattr(hip, "has_symbol")):
        return
    try:
        ok = hiprtc.has_symbol("hiprtcCreateProgram") and hip.has_symbol("hipModuleLoadData")
    finally:
        if old is None:
            del os.environ["ROCM_PATH"]
        else:
            os.environ["ROCM_PATH"] = old
    if not ok:
        raise HipUnavailable(f"hip-python could not load hiprtc / the HIP runtime from {rocm_path}/lib "
                             f"(was hip-python used before find_hiprtc()? a library dependency "
                             f"missing?): {INSTALL_HINT}")


def find_hiprtc() -> RocmLibs:
    """Locate hiprtc and the HIP runtime, and point ``ROCM_PATH`` where hip-python will load them.

    Search order (first hit wins):

    1. ``$ROCM_PATH`` (``lib/``, ``lib/<multiarch>/``, ``lib64/``) when set; if it holds
       neither library this is an error (we do not silently override the user);
    2. ``/opt/rocm``, then ``/opt/rocm-*`` newest first (ROCm >= 5.3: ``lib/libhiprtc.so``);
    3. the system: ``/usr/lib/<multiarch>``, ``/usr/lib64``, ``/usr/lib``, ``/usr/local``
       (Debian's ROCm 5.2: ``libamdhip64.so.5`` that contains the ``hiprtc*`` functions).

    hip-python resolves ``$ROCM_PATH/lib/libhiprtc.so`` and ``.../libamdhip64.so`` the first time
    one of its functions is called.  When the found files do not sit there under those names
    (ROCm 5.2, multiarch dirs), a private folder of symlinks is made under the cache dir
    (``<cache>/rocm-shim/<lib>/lib/``).  ``ROCM_PATH`` is pointed at the folder while hip-python
    opens both libraries, then restored (see :func:`_load_bindings`).  Call this before any
    other hip-python use (``compile_hip`` and ``HIPDevice`` do).  The result is memoized.

    Raises :class:`HipUnavailable` (with what to install) when nothing is found.
    """
    global _LIBS
    if _LIBS is not None:
        return _LIBS
    env = os.environ.get("ROCM_PATH")
    if env:
        found = _find_in([env])
        if found is None:
            raise HipUnavailable(f"ROCM_PATH={env} holds no libhiprtc.so or libamdhip64.so(.5) with "
                                 f"hiprtc in lib/, lib/<multiarch>/ or lib64/: fix or unset ROCM_PATH, "
                                 f"or {INSTALL_HINT}")
    else:
        opt = sorted(glob.glob("/opt/rocm-*"), key=lambda p: [int(x) if x.isdigit() else -1
                                                             for x in re.split(r"[.-]", p[10:])],
                     reverse=True)
        found = _find_in(["/opt/rocm", *opt, "/usr", "/usr/local"])
        if found is None:
            raise HipUnavailable(f"no ROCm hiprtc library found (looked in ROCM_PATH, /opt/rocm*, "
                                 f"/usr/lib): {INSTALL_HINT}")
    install_root, rtc, amd = found
    direct = (rtc.name == "libhiprtc.so" and amd.name == "libamdhip64.so"
              and rtc.parent == amd.parent and rtc.parent.name == "lib")
    rocm_path = rtc.parent.parent if direct else _make_shim(rtc, amd)
    _load_bindings(str(rocm_path))
    _LIBS = RocmLibs(str(rocm_path), str(rtc), str(amd), str(install_root), _identity(rtc), not direct)
    return _LIBS


# ----------------------------------------------------------------------------- compilation
DEFAULT_OPTIONS = ("-O3",)
_cache: CodeCache | None = None
_ERROR_RE = re.compile(r"^(?P<file>[^\n]*?):(?P<line>\d+):(?P<col>\d+): (?:fatal )?error: (?P<msg>.*)$", re.M)


def code_cache() -> CodeCache:
    """The process-wide :class:`CodeCache` (re-created if ``VEGAFUSE_CACHE_DIR`` changed)."""
    global _cache
    if _cache is None or _cache.root != default_cache_dir():
        _cache = CodeCache()
    return _cache


def _check_rtc(result, what):
    from rocm.bindings import hiprtc
    if result != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
        raise HipCompileError(f"{what} failed: {result!r}")


def _hiprtc_compile(source: str, name: str, opts: list[str]) -> tuple[bytes, str, bool]:
    """(code object, log, ok) from one hiprtc run."""
    from rocm.bindings import hiprtc
    err, prog = hiprtc.hiprtcCreateProgram(source.encode(), f"{name}.hip".encode(), 0, None, None)
    _check_rtc(err, f"hiprtcCreateProgram({name})")
    try:
        (err,) = hiprtc.hiprtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        r, n = hiprtc.hiprtcGetProgramLogSize(prog)
        log = bytearray(n)
        if n:
            hiprtc.hiprtcGetProgramLog(prog, log)
        log = bytes(log).rstrip(b"\0").decode(errors="replace")
        if err != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            return b"", log or repr(err), False
        r, n = hiprtc.hiprtcGetCodeSize(prog)
        _check_rtc(r, "hiprtcGetCodeSize")
        code = bytearray(n)
        (r,) = hiprtc.hiprtcGetCode(prog, code)
        _check_rtc(r, "hiprtcGetCode")
        return bytes(code), log, True
    finally:                        # hiprtcDestroyProgram takes hiprtcProgram*: pass the handle's address
        handle = ctypes.c_void_p(int(prog))
        hiprtc.hiprtcDestroyProgram(ctypes.c_void_p(ctypes.addressof(handle)))


def _compile_error(name: str, arch: str, source: str, log: str) -> HipCompileError:
    errors = [(int(m["line"]), int(m["col"]), m["msg"].strip(), m["file"]) for m in _ERROR_RE.finditer(log)]
    lines = source.splitlines()
    if not errors:
        return HipCompileError(f"HIP kernel {name!r} ({arch}) failed to compile:\n{log.strip()}",
                               name, log, source)
    out = [f"HIP kernel {name!r} ({arch}) failed to compile: {errors[0][2]}"]
    width = len(str(len(lines)))
    for line, col, msg, file in errors[:5]:
        ours = 1 <= line <= len(lines) and (Path(file).name in ("CompileSource", f"{name}.hip")
                                            or file in ("<source>", f"{name}.hip"))
        if not ours:
            out.append(f"  {file}:{line}:{col}: error: {msg}")
            continue
        out.append(f"  line {line}, column {col}: {msg}")
        out.append(f"  {line:>{width}} | {lines[line - 1]}")
        out.append(f"  {'':>{width}} | {' ' * (col - 1)}^")
    if len(errors) > 5:
        out.append(f"  ... {len(errors) - 5} more errors (see .log)")
    return HipCompileError("\n".join(out), name, log, source, [(l, c, m) for l, c, m, _ in errors])


def compile_hip(source: str, name: str, arch: str = "gfx906", options=()) -> CodeObject:
    """Compile HIP C++ ``source`` to an AMDGPU code object with hiprtc (no GPU needed).

    Returns a :class:`CodeObject`, a ``bytes`` subclass (the ELF) with inspection methods.

    Options passed: ``--offload-arch=<arch> -O3`` then ``options``.  ``name`` is the kernel
    the :class:`CodeObject` refers to (declare it ``extern "C"`` to keep the name unmangled)
    and names the program in diagnostics.  Results are cached on disk (:func:`code_cache`),
    keyed by source, arch, compiler identity and options.  Under hiprtc do not include
    ``<hip/hip_fp16.h>`` (it clashes with hiprtc's built-in header); use ``_Float16``.

    Raises :class:`HipCompileError` on a compile error, :class:`HipUnavailable` if ROCm is missing.
    """
    libs = find_hiprtc()
    opts = [f"--offload-arch={arch}", *DEFAULT_OPTIONS, *options]
    key = {"kind": "hiprtc-code-object", "source": source, "arch": arch,
           "compiler": libs.identity, "options": opts}
    state = {}

    def build():
        t0 = time.perf_counter()
        code, log, ok = _hiprtc_compile(source, name, opts)
        state.update(seconds=time.perf_counter() - t0, log=log)
        if not ok:
            raise _compile_error(name, arch, source, log)
        return code

    code, hit = code_cache().get_or_build(key, build)
    return CodeObject(code, name, source, arch=arch, options=tuple(opts), cache_hit=hit,
                      compile_seconds=state.get("seconds", 0.0), log=state.get("log", ""))


# ----------------------------------------------------------------------------- ELF and msgpack
NT_AMDGPU_METADATA = 32          # note type of the code-object v3+ metadata (owner "AMDGPU"), msgpack


def _elf_sections(data: bytes) -> dict:
    """name -> (type, offset, size, link, entsize) of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def cstr(off):
        return data[off:data.index(b"\0", off)].decode()
    return {cstr(strtab + s[0]): (s[1], s[4], s[5], raw[s[6]][4] if s[6] < shnum else 0, s[9]) for s in raw}


def _elf_notes(data: bytes, sections: dict):
    """(owner, type, descriptor bytes) of every note in SHT_NOTE sections (4-byte aligned)."""
    for typ, off, size, _, _ in sections.values():
        if typ != 7:                                           # SHT_NOTE
            continue
        p, end = off, off + size
        while p + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, p)
            p += 12
            owner = data[p:p + namesz].rstrip(b"\0").decode()
            p += -(-namesz // 4) * 4
            yield owner, ntype, data[p:p + descsz]
            p += -(-descsz // 4) * 4


def _elf_symbols(data: bytes, sections: dict) -> dict:
    """name -> (value, size, type) from .symtab (or .dynsym)."""
    sec = sections.get(".symtab") or sections.get(".dynsym")
    if sec is None:
        return {}
    _, off, size, stroff, entsize = sec
    out = {}
    for p in range(off, off + size, entsize or 24):
        st_name, info, _, _, value, sz = struct.unpack_from("<IBBHQQ", data, p)
        if st_name:
            name = data[stroff + st_name:data.index(b"\0", stroff + st_name)].decode()
            out[name] = (value, sz, info & 0xF)
    return out


def msgpack_loads(buf: bytes):
    """Decode one msgpack value (the subset AMDGPU metadata uses: nil, bools, ints, floats,
    str, bin, arrays, maps).  Spec: https://github.com/msgpack/msgpack/blob/master/spec.md"""
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return buf[pos - n:pos]

    def unpack(fmt):
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def value():
        b = take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return {value(): value() for _ in range(b & 0x0F)}
        if 0x90 <= b <= 0x9F:
            return [value() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return take(b & 0x1F).decode()
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if b in fixed:
            return unpack(fixed[b])
        sized = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I",
                 0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
        if b in sized:
            n = unpack(sized[b])
            if b <= 0xC6:
                return bytes(take(n))
            if b <= 0xDB:
                return take(n).decode()
            if b <= 0xDD:
                return [value() for _ in range(n)]
            return {value(): value() for _ in range(n)}
        raise ValueError(f"msgpack: unsupported type byte 0x{b:02x} at offset {pos - 1}")
    return value()


# ----------------------------------------------------------------------------- occupancy
GFX906 = dict(
    simds_per_cu=4,            # GCN CU: 4 SIMD16 units, each runs 64-lane waves
    max_waves_per_simd=10,     # LLVM getMaxWavesPerEU (gfx9 before gfx90a)
    vgprs_per_simd=256,        # VGPRs per lane per SIMD (64 KiB VGPR file per SIMD)
    vgpr_granule=4,            # LLVM getVGPRAllocGranule (wave64, gfx9)
    sgprs_per_simd=800,        # LLVM getTotalNumSGPRs (gfx8+)
    sgpr_granule=16,           # LLVM getSGPRAllocGranule (gfx8-gfx9)
    lds_per_cu=65536,          # bytes
    lds_granule=512,           # bytes: LDS is allocated in 128-dword blocks (gfx7+)
    max_barriers=16,           # workgroups of >1 wave per CU (LLVM getMaxWorkGroupsPerCU)
    wave_size=64,
)


def gfx906_occupancy(vgprs: int, sgprs: int, lds_bytes: int = 0, workgroup_size: int = 256) -> dict:
    """Resident waves for a kernel on gfx906, from its register and LDS use.

    ``vgprs``: VGPRs per lane (metadata ``.vgpr_count``); ``sgprs``: SGPRs per wave including
    VCC/FLAT_SCRATCH/XNACK (``.sgpr_count``); ``lds_bytes``: LDS per workgroup (static
    ``.group_segment_fixed_size`` plus any dynamic shared memory); ``workgroup_size``: threads.

    Per-SIMD register bounds (constants in ``GFX906``, from LLVM's AMDGPU backend,
    ``AMDGPUBaseInfo.cpp``, and the Vega ISA manual):

    * VGPR: ``min(10, floor(256 / round_up(vgprs, 4)))``
    * SGPR: ``min(10, floor(800 / round_up(sgprs, 16)))``.  LLVM before 2026 used a step table
      (<=80: 10, <=88: 9, <=100: 8, else 7) that differs at 81..88 and 97..100 SGPRs.

    Then whole workgroups per CU (a workgroup is resident entirely or not at all), with
    ``w = ceil(workgroup_size / 64)`` waves per workgroup:

    * registers: ``floor(bound * 4 / w)`` for each register bound (4 SIMDs per CU);
    * LDS: ``floor(65536 / round_up(lds_bytes, 512))`` (none if no LDS; at least 1);
    * wave slots: ``floor(40 / w)``; barriers: at most 16 workgroups of more than one wave.

    Returns ``waves_per_simd = ceil(workgroups * w / 4)`` (waves on the busiest SIMD),
    ``waves_per_cu``, ``workgroups_per_cu`` and ``limiter`` (``"vgpr"``, ``"sgpr"``, ``"lds"``,
    ``"workgroup"`` (slots or barriers), or ``"none"`` when 10 waves per SIMD fit).
    """
    g = GFX906

    def round_up(n, granule):
        return max(granule, -(-n // granule) * granule)

    w = max(1, -(-workgroup_size // g["wave_size"]))
    slots = g["max_waves_per_simd"] * g["simds_per_cu"]                       # 40 waves per CU
    occ_v = min(g["max_waves_per_simd"], g["vgprs_per_simd"] // round_up(vgprs, g["vgpr_granule"]))
    occ_s = min(g["max_waves_per_simd"], g["sgprs_per_simd"] // round_up(sgprs, g["sgpr_granule"]))
    bounds = {                                                                 # workgroups per CU
        "vgpr": occ_v * g["simds_per_cu"] // w,
        "sgpr": occ_s * g["simds_per_cu"] // w,
        "lds": max(1, g["lds_per_cu"] // round_up(lds_bytes, g["lds_granule"])) if lds_bytes else slots,
        "workgroup": min(slots // w, slots if w == 1 else g["max_barriers"]),
    }
    wgs = max(1, min(bounds.values()))
    short = {"vgpr": occ_v < g["max_waves_per_simd"], "sgpr": occ_s < g["max_waves_per_simd"],
             "lds": bounds["lds"] * w < slots, "workgroup": bounds["workgroup"] * w < slots}
    limiter = next((k for k in bounds if short[k] and bounds[k] == wgs), "none")   # binding and scarce
    return {"waves_per_simd": -(-wgs * w // g["simds_per_cu"]), "waves_per_cu": wgs * w,
            "workgroups_per_cu": wgs, "limiter": limiter}


# ----------------------------------------------------------------------------- tools
def find_llvm_tool(name: str) -> str:
    """Path of an LLVM tool (e.g. ``llvm-objdump``) that knows AMDGPU.

    Looks in ``$VEGAFUSE_LLVM_BIN``, the ROCm install's ``llvm/bin`` (ROCm >= 5.3), then
    ``PATH`` for ``name-20`` ... ``name-14`` (Debian's ROCm 5.2 uses ``llvm-objdump-15``),
    then plain ``name`` if its ``--version`` lists the amdgcn target.
    """
    dirs = [os.environ.get("VEGAFUSE_LLVM_BIN", "")]
    try:
        dirs.append(str(Path(find_hiprtc().install_root) / "llvm" / "bin"))
    except HipUnavailable:
        pass
    dirs += ["/opt/rocm/llvm/bin"]
    for d in dirs:
        if d and os.access(Path(d) / name, os.X_OK):
            return str(Path(d) / name)
    for v in range(20, 13, -1):
        p = shutil.which(f"{name}-{v}")
        if p:
            return p
    p = shutil.which(name)
    if p:
        out = subprocess.run([p, "--version"], capture_output=True, text=True).stdout
        if "amdgcn" in out:
            return p
    raise HipUnavailable(f"no {name} with the AMDGPU target found (looked in $VEGAFUSE_LLVM_BIN, "
                         f"<rocm>/llvm/bin, PATH for {name}-N and {name}): on Debian/Ubuntu "
                         f"`apt-get install llvm-15` (comes with hipcc), or ROCm >= 5.3")


# ----------------------------------------------------------------------------- code objects
class CodeObject(bytes):
    """An AMDGPU code object (ELF) produced by :func:`compile_hip`: the ELF bytes themselves
    (what ``hipModuleLoadData`` takes; ``.code`` is a plain ``bytes`` copy) plus

    ``name``: the kernel this object is for; ``source``: the HIP source; ``arch``, ``options``:
    how it was compiled; ``cache_hit``: found in the disk cache; ``compile_seconds``: hiprtc wall
    time (0 on a hit); ``log``: the compiler's messages (warnings), empty on a cache hit.
    """

    def __new__(cls, code: bytes, name: str, source: str, arch="gfx906", options=(),
                cache_hit=False, compile_seconds=0.0, log=""):
        self = super().__new__(cls, code)
        self.name, self.source, self.arch, self.options = name, source, arch, tuple(options)
        self.cache_hit, self.compile_seconds, self.log = cache_hit, compile_seconds, log
        self._meta = None
        return self

    @property
    def code(self) -> bytes:
        return bytes(self)

    def metadata(self) -> dict:
        """The decoded AMDGPU metadata note (``amdhsa.kernels``, ``amdhsa.target``, ...)."""
        if self._meta is None:
            data = bytes(self)
            secs = _elf_sections(data)
            for owner, ntype, desc in _elf_notes(data, secs):
                if owner == "AMDGPU" and ntype == NT_AMDGPU_METADATA:
                    self._meta = msgpack_loads(desc)
                    break
            else:
                raise ValueError("code object has no AMDGPU metadata note (code object v3+ expected)")
            self._symbols = _elf_symbols(data, secs)
        return self._meta

    def kernel_symbols(self) -> list[str]:
        """Names of the kernels in this code object, in metadata order."""
        return [k[".name"] for k in self.metadata()["amdhsa.kernels"]]

    def kernel_metadata(self, kernel: str | None = None) -> dict:
        """The metadata map of ``kernel`` (default: ``self.name``, or the only kernel)."""
        kernels = self.metadata()["amdhsa.kernels"]
        want = kernel or self.name
        for k in kernels:
            if k[".name"] == want:
                return k
        if kernel is None and len(kernels) == 1:
            return kernels[0]
        raise KeyError(f"no kernel {want!r} in code object (has {self.kernel_symbols()})")

    def resources(self, kernel: str | None = None, workgroup_size: int | None = None,
                  dynamic_lds_bytes: int = 0) -> dict:
        """Register, memory and occupancy figures of one kernel, from the code object metadata.

        Keys: ``vgprs`` (per lane), ``sgprs`` (per wave, incl. VCC etc.), ``vgpr_spills``,
        ``sgpr_spills``, ``lds_bytes`` (static LDS per workgroup), ``scratch_bytes`` (private
        memory per lane; non-zero means spills or stack arrays), ``wavefront_size``,
        ``max_workgroup_size`` (``__launch_bounds__``; 1024 if none), ``kernarg_bytes``,
        ``code_bytes`` (size of the kernel's machine code: its symbol size in ``.text``), and the
        occupancy of :func:`gfx906_occupancy` (``waves_per_simd``, ``waves_per_cu``,
        ``workgroups_per_cu``, ``limiter``) for ``workgroup_size`` threads (default
        ``max_workgroup_size``) and ``lds_bytes + dynamic_lds_bytes`` of LDS.
        """
        k = self.kernel_metadata(kernel)
        sym = self._symbols.get(k[".name"]) or self._symbols.get(k[".symbol"].removesuffix(".kd"))
        r = {
            "vgprs": k[".vgpr_count"], "sgprs": k[".sgpr_count"],
            "vgpr_spills": k.get(".vgpr_spill_count", 0), "sgpr_spills": k.get(".sgpr_spill_count", 0),
            "lds_bytes": k[".group_segment_fixed_size"], "scratch_bytes": k[".private_segment_fixed_size"],
            "wavefront_size": k[".wavefront_size"], "max_workgroup_size": k[".max_flat_workgroup_size"],
            "kernarg_bytes": k[".kernarg_segment_size"], "code_bytes": sym[1] if sym else None,
        }
        r.update(gfx906_occupancy(r["vgprs"], r["sgprs"], r["lds_bytes"] + dynamic_lds_bytes,
                                  workgroup_size or r["max_workgroup_size"]))
        return r

    def isa(self, kernel: str | None = None) -> str:
        """Disassembly (``llvm-objdump -d --mcpu=<arch>``); of ``kernel`` only if given."""
        tool = find_llvm_tool("llvm-objdump")
        with tempfile.NamedTemporaryFile(suffix=".co") as f:
            f.write(self)
            f.flush()
            cmd = [tool, "-d", f"--mcpu={self.arch}", f.name]
            if kernel:
                cmd.insert(2, f"--disassemble-symbols={kernel}")
            p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
        return p.stdout.replace(f.name, f"{self.name}.co")

    def __repr__(self):
        return f"<CodeObject {self.name} {self.arch} {len(self)} bytes>"


def pack_kernargs(kernel_meta: dict, args) -> bytes:
    """The kernel-argument buffer for ``args`` laid out as the metadata's ``.args`` say.

    Pointers (``global_buffer``): anything with a ``.ptr`` (a :class:`DeviceArray`) or an int
    address, 8 bytes.  By-value arguments: a Python int (signed/unsigned to the arg's size), a
    float (4 bytes: f32, 8: f64) or a numpy scalar of exactly the arg's size.  Hidden arguments
    (``hidden_*``) are not packed: the runtime supplies them.
    """
    explicit = [a for a in kernel_meta[".args"] if not a[".value_kind"].startswith("hidden_")]
    if len(explicit) != len(args):
        raise ValueError(f"kernel {kernel_meta['.name']}: {len(explicit)} arguments expected, got {len(args)}")
    size = max((a[".offset"] + a[".size"] for a in explicit), default=0)
    buf = bytearray(-(-size // 8) * 8)
    for a, v in zip(explicit, args):
        off, n = a[".offset"], a[".size"]
        if hasattr(v, "ptr"):
            v = v.ptr
        if hasattr(v, "dtype") and hasattr(v, "tobytes"):      # numpy scalar / 0-d array
            raw = v.tobytes()
        elif isinstance(v, float):
            raw = struct.pack({4: "<f", 8: "<d"}[n], v)
        elif isinstance(v, int):
            raw = v.to_bytes(n, "little", signed=v < 0)
        else:
            raise TypeError(f"kernel argument {a.get('.name', off)}: cannot pass {type(v).__name__}")
        if len(raw) != n:
            raise ValueError(f"kernel argument at offset {off}: {len(raw)} bytes given, {n} expected")
        buf[off:off + n] = raw
    return bytes(buf)


# ----------------------------------------------------------------------------- device
def _check(res, what, kernel=None):
    """The values after the ``hipError_t`` of a hip-python result; :class:`HipError` naming the
    call and, when given, the kernel if the error is not ``hipSuccess``."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        where = f" in kernel {kernel}" if kernel else ""
        raise HipError(f"{what} failed{where}: {getattr(err, 'name', err)} ({int(err)})")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


class _Offline:
    """Stands in for the HIP runtime in a compile-only device: any call says why it cannot run."""

    def __getattr__(self, name):
        raise HipUnavailable(f"{name}: this HIPDevice was made by HIPDevice.offline() and only compiles; "
                             f"running kernels needs HIPDevice() on a machine with an AMD GPU")


def fill_values(start: int, n: int, seed: int = 0, scale: float = 0.02, shift: float = 0.0) -> np.ndarray:
    """float32 values ``start .. start + n - 1`` of the benchmark fill: an integer hash of the
    element index and ``seed`` mapped to ``[shift - scale, shift + scale)``.  The same formula as
    the CUDA device's ``vf_fill`` kernel, so both backends make the same random weights."""
    i = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (i * np.uint64(2654435761)).astype(np.uint32) ^ np.uint32(seed & 0xFFFFFFFF)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x7FEB352D)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x846CA68B)
        h ^= h >> np.uint32(16)
    u = np.float32(2.0) * (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0) - np.float32(1.0)
    return np.float32(shift) + np.float32(scale) * u


class HIPDevice(GPUDevice):
    """One AMD GPU (gfx906 / MI50 by default) through hip-python: kernels compiled by hiprtc, loaded
    with ``hipModuleLoadData`` and launched with ``hipModuleLaunchKernel`` on one stream.

    COMPLETE BUT UNTESTED ON HARDWARE: no AMD GPU was available when this was written.  Tested
    without a GPU (tests/test_hip_device.py): compiling the fused kernels (:meth:`compile_many` on
    :meth:`offline`), the argument layout against the code objects' metadata, the error when no GPU
    is present, and this class's calls into hip-python against a stand-in runtime on host memory.

    The device interface is the CUDA device's (shared in :mod:`engine.devices.gpu`): ``empty``,
    ``put``, ``copy_in``, ``copy``, ``to_host``, ``resident``, ``synchronize``, ``is_device_array``,
    ``scalar_slots``, ``compile_many``, ``prepare``, ``plan``, ``random``, ``time_launches``,
    ``copy_bandwidth``.  Scalars (the decode position) live in device memory and are uploaded
    from pinned host slots before each plan run.

    ``graphs``: capture a plan's launches once (``hipStreamBeginCapture``) and replay the graph
    (``hipGraphLaunch``).  Default OFF (``VEGAFUSE_HIP_GRAPHS=1`` turns it on): HIP graphs on
    gfx906 were reported both slower than plain launches and leaking memory (and elsewhere as a
    few per cent faster), so replay is a switch to measure, not a default.
    ``VEGAFUSE_SYNC=1`` synchronizes after every launch so that an error names its kernel.

    ``arch`` is not read from the device (``hipDeviceProp_t``'s layout changed across ROCm
    versions, and hip-python may be newer than the runtime); pass it if the GPU is not gfx906.
    """

    name = "hip"
    Error = HipError
    _SYNC = "hipStreamSynchronize"

    def __init__(self, index: int = 0, graphs: bool | None = None, arch: str = "gfx906"):
        self._setup(arch)
        find_hiprtc()                                             # HipUnavailable: ROCm missing
        from rocm.bindings import hip
        try:
            err, count = hip.hipGetDeviceCount()
        except Exception as e:                                    # the runtime itself failed to load
            raise HipUnavailable(f"the HIP runtime failed to start ({type(e).__name__}: {e}); "
                                 f"{INSTALL_HINT}") from e
        if int(err) != 0 or count == 0:
            raise HipUnavailable(
                f"no AMD GPU visible to HIP (hipGetDeviceCount: {getattr(err, 'name', err)}, {count} devices): "
                f"the hip backend runs kernels on an AMD GPU ({arch}) through the amdgpu kernel driver "
                f"(/dev/kfd, /dev/dri must be accessible); compiling needs no GPU "
                f"(HIPDevice.offline(), python -m codegen.inspect), and the cpu backend runs anywhere")
        if not 0 <= index < count:
            raise HipUnavailable(f"no HIP device {index}: {count} AMD GPU(s) visible")
        self.hip, self.index = hip, index
        _check(hip.hipSetDevice(index), "hipSetDevice")
        self.stream = _check(hip.hipStreamCreate(), "hipStreamCreate")
        if graphs is not None:
            self.graphs = graphs
        self.online = True

    def _setup(self, arch):
        self.arch = arch
        base = get_target("gfx906")
        self.target = base if arch == base.name else replace(base, name=arch)
        self.sync_each = os.environ.get("VEGAFUSE_SYNC", "0") == "1"
        self.graphs = os.environ.get("VEGAFUSE_HIP_GRAPHS", "0") == "1"          # default off: see the class
        self.online, self.stream, self.index = False, None, None
        self.hip = _Offline()
        self._functions = {}
        self._resident = {}

    @classmethod
    def offline(cls, arch: str = "gfx906") -> "HIPDevice":
        """A compile-only device that touches no GPU (tests, inspection): :meth:`compile_many`
        compiles and checks the code objects but loads nothing (``.function`` is None);
        :meth:`prepare` builds the argument arrays; anything that needs the GPU raises
        :class:`HipUnavailable`."""
        self = cls.__new__(cls)
        self._setup(arch)
        return self

    def __repr__(self):
        where = f"device {self.index}" if self.online else "offline, compile only"
        return f"<HIPDevice {self.arch} ({where})>"

    # ------------------------------------------------------------------ runtime primitives (gpu.GPUDevice)
    def _malloc(self, n):
        return int(_check(self.hip.hipMalloc(n), "hipMalloc"))

    def _free_ptr(self, ptr):
        self.hip.hipFree(ptr)

    def _memset_async(self, ptr, value, n):
        _check(self.hip.hipMemsetD8Async(ptr, value, n, self.stream), "hipMemsetD8Async")

    def _htod_async(self, dst, src, n, stream):
        _check(self.hip.hipMemcpyHtoDAsync(dst, src, n, stream), "hipMemcpyHtoDAsync")

    def _htod(self, dst, src, n):
        _check(self.hip.hipMemcpyHtoD(dst, src, n), "hipMemcpyHtoD")

    def _dtoh(self, dst, src, n):
        _check(self.hip.hipMemcpyDtoH(dst, src, n), "hipMemcpyDtoH")

    def _dtod_async(self, dst, src, n):
        _check(self.hip.hipMemcpyDtoDAsync(dst, src, n, self.stream), "hipMemcpyDtoDAsync")

    def _host_alloc(self, n):
        return int(_check(self.hip.hipHostMalloc(n, 0), "hipHostMalloc"))

    def _sync(self, what, kernel=None):
        _check(self.hip.hipStreamSynchronize(self.stream), what, kernel)

    def _event(self):
        return _check(self.hip.hipEventCreate(), "hipEventCreate")

    def _record(self, ev):
        _check(self.hip.hipEventRecord(ev, self.stream), "hipEventRecord")

    def _elapsed_ms(self, ev0, ev1):
        return _check(self.hip.hipEventElapsedTime(ev0, ev1), "hipEventElapsedTime")

    def _launch(self, ck, args):
        h = ck.hip
        _check(self.hip.hipModuleLaunchKernel(ck.function, *h.grid, *h.block, h.dynamic_lds, self.stream,
                                              args.ctypes.data, None), "hipModuleLaunchKernel", ck.kernel.name)

    def _capture(self, launches):
        hip = self.hip
        _check(hip.hipStreamBeginCapture(self.stream, hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal),
               "hipStreamBeginCapture")
        for launch in launches:
            launch()
        graph = _check(hip.hipStreamEndCapture(self.stream), "hipStreamEndCapture")
        exec_ = _check(hip.hipGraphInstantiate(graph, 0), "hipGraphInstantiate")
        return graph, exec_[0] if isinstance(exec_, tuple) else exec_

    def _graph_launch(self, exec_):
        _check(self.hip.hipGraphLaunch(exec_, self.stream), "hipGraphLaunch")

    # ------------------------------------------------------------------ data
    def random(self, shape, dtype, scale=0.02, seed=0, shift=0.0):
        """Uniform values in [shift - scale, shift + scale) (benchmark weights): the CUDA device's
        hash fill (:func:`fill_values`), made on the host in chunks and uploaded."""
        a = self.empty(shape, dtype)
        n, chunk = int(np.prod(shape, dtype=np.int64)), 1 << 22
        for start in range(0, n, chunk):
            part = np.ascontiguousarray(fill_values(start, min(chunk, n - start), seed, scale, shift), a.dtype)
            self._htod(a.ptr + start * a.dtype.itemsize, part.ctypes.data, part.nbytes)
        return a

    # ------------------------------------------------------------------ compile
    def compile_many(self, kernels):
        """Compile every Loop IR kernel for ``self.arch`` and load it.

        Each kernel is rendered twice: ``render_hip(canonicalize(k))`` is what is compiled (function
        ``canonical``), so kernels equal up to names (the same op in every layer) share one code
        object and one loaded function; ``render_hip(k)`` is the readable ``.source``.  Code objects
        come from :func:`compile_hip` and its disk cache.  Returns :class:`GPUKernel`\\ s whose
        ``.binary`` is the :class:`CodeObject` (``.resources()``, ``.isa()``).

        Checked against each code object's metadata, with errors that name the kernel: the
        argument layout (one 8-byte pointer per parameter, as :meth:`prepare` passes them), the
        workgroup size, and static plus launch LDS within the 64 KiB of a CU.
        """
        out = []
        for k in kernels:
            canon = render_hip(canonicalize(k), self.target)
            if canon.source not in self._functions:
                code = compile_hip(canon.source, k.name, self.arch)
                self._check_abi(code, canon, k)
                module = fn = None
                if self.online:
                    module = _check(self.hip.hipModuleLoadData(code), f"hipModuleLoadData (a code object for "
                                    f"{self.arch}; pass HIPDevice(arch=...) for another GPU)", k.name)
                    fn = _check(self.hip.hipModuleGetFunction(module, b"canonical"), "hipModuleGetFunction", k.name)
                self._functions[canon.source] = (module, fn, code)
            _, fn, code = self._functions[canon.source]
            out.append(GPUKernel(k, render_hip(k, self.target), fn, code))
        return out

    def _check_abi(self, code, hk, k):
        meta = code.kernel_metadata("canonical")
        explicit = [a for a in meta[".args"] if not a[".value_kind"].startswith("hidden_")]
        layout = [(a[".offset"], a[".size"], a[".value_kind"]) for a in explicit]
        want = [(8 * i, 8, "global_buffer") for i in range(len(k.params))]
        if layout != want:
            raise HipError(f"kernel {k.name}: the code object's arguments {layout} are not one 8-byte pointer "
                           f"per parameter ({len(k.params)} parameters) as launches pass them")
        block = hk.block[0] * hk.block[1] * hk.block[2]
        if block > meta[".max_flat_workgroup_size"]:
            raise HipError(f"kernel {k.name}: launched with {block} threads per workgroup but compiled "
                           f"for at most {meta['.max_flat_workgroup_size']}")
        lds = meta[".group_segment_fixed_size"] + hk.dynamic_lds
        if lds > GFX906["lds_per_cu"]:
            raise HipError(f"kernel {k.name}: {meta['.group_segment_fixed_size']} bytes of static LDS plus "
                           f"{hk.dynamic_lds} at launch exceed the {GFX906['lds_per_cu']} of a CU")

    def kernargs(self, launch) -> bytes:
        """The kernel-argument segment that ``launch`` (from :meth:`prepare`) makes the runtime build,
        laid out by its code object's metadata (:func:`pack_kernargs`): for inspection and tests."""
        meta = launch.ck.binary.kernel_metadata("canonical")
        return pack_kernargs(meta, [int(v) for v in launch.values[:len(launch.ck.kernel.params)]])
