"""ROCm on this machine: finding hiprtc and the HIP runtime, and compiling HIP C++ with hiprtc.

Usage::

    libs = find_hiprtc()                         # where ROCm is; hip-python pointed at it
    co = compile_hip(source, "gemv")             # hiprtc, gfx906, -O3; cached on disk; a CodeObject
    compiler = HiprtcCompiler(get_target("gfx906"))   # what engine.build uses for HIP kernels

No GPU is needed: only the ROCm libraries (see :func:`find_hiprtc`), not the ``hipcc``
driver.  The code objects are read by :mod:`codegen.codeobject`; the device that runs them is
:mod:`engine.devices.hip`.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sysconfig
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from codegen.codeobject import CodeObject
from codegen.hip import render_hip
from codegen.targets import TARGETS, Target, get_target
from engine.build import Binary, Compiler, compile_source
from engine.codecache import default_cache_dir

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
_ERROR_RE = re.compile(r"^(?P<file>[^\n]*?):(?P<line>\d+):(?P<col>\d+): (?:fatal )?error: (?P<msg>.*)$", re.M)


def amd_target(arch: str) -> Target:
    """The target table for ``arch``: its own if there is one, else gfx906's under that name."""
    return get_target(arch) if arch in TARGETS else replace(get_target("gfx906"), name=arch)


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


class HiprtcCompiler(Compiler):
    """HIP C++ to AMDGPU code objects with hiprtc, for ``target`` (a gfx906-like table).

    Options: ``--offload-arch=<arch> -O3`` then ``options``.  The cache identity is the arch,
    the options and hiprtc's identity (real paths, sizes and mtimes of hiprtc and comgr).
    Raises :class:`HipUnavailable` (what to install) when ROCm is missing."""

    def __init__(self, target: Target, options=()):
        super().__init__()
        self.target, self.arch = target, target.name
        self.options = [f"--offload-arch={self.arch}", *DEFAULT_OPTIONS, *options]
        self.identity = {"kind": "hiprtc-code-object", "arch": self.arch, "compiler": find_hiprtc().identity,
                         "options": self.options}

    def render(self, kernel):
        return render_hip(kernel, self.target)

    def compile(self, source: str, name: str) -> bytes:
        code, log, ok = _hiprtc_compile(source, name, self.options)
        if not ok:
            raise _compile_error(name, self.arch, source, log)
        return code

    def code_object(self, binary: Binary, name: str | None = None) -> CodeObject:
        """``binary`` as a :class:`CodeObject` (metadata, resources, ISA), named ``name``
        (default: the first kernel that needed it; its function is ``binary.entry``)."""
        return CodeObject(binary.code, name or binary.name, binary.source, arch=self.arch,
                          options=tuple(self.options), cache_hit=binary.cache_hit,
                          compile_seconds=binary.seconds, target=self.target)

    def disassemble(self, binary: Binary) -> str:
        return self.code_object(binary).isa(binary.entry)


def compile_hip(source: str, name: str, arch: str = "gfx906", options=()) -> CodeObject:
    """Compile HIP C++ ``source`` to an AMDGPU code object with hiprtc (no GPU needed).

    Returns a :class:`CodeObject`, a ``bytes`` subclass (the ELF) with inspection methods.

    Options passed: ``--offload-arch=<arch> -O3`` then ``options``.  ``name`` is the kernel
    the :class:`CodeObject` refers to (declare it ``extern "C"`` to keep the name unmangled)
    and names the program in diagnostics.  Results are cached on disk (``engine.build``'s
    ``code_cache()``), keyed by source, arch, compiler identity and options.  Under hiprtc do
    not include ``<hip/hip_fp16.h>`` (it clashes with hiprtc's built-in header); use ``_Float16``.

    Raises :class:`HipCompileError` on a compile error, :class:`HipUnavailable` if ROCm is missing.
    """
    compiler = HiprtcCompiler(amd_target(arch), options)
    return compiler.code_object(compile_source(compiler, source, name), name)
