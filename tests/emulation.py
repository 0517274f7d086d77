"""GPU kernel text run on the CPU (``tests/gpu_emulation.h``: a fiber per GPU thread), and
whether gfx906 code can be compiled here: shared by the tests of the GPU templates."""
import ctypes
import hashlib
import os
import shutil
import subprocess

from codegen.hip import CTYPE

GXX = shutil.which("g++")
HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_emulation.h")


def _hip_missing() -> str:
    """Why gfx906 code cannot be compiled here ("" when hiprtc is found)."""
    try:
        from engine.devices.rocm import find_hiprtc
        find_hiprtc()
        return ""
    except Exception as e:                                 # pragma: no cover - depends on the host
        return str(e)


HIP = _hip_missing()


def emulated(h, tmp: str, defines: str = "", helpers: str = "") -> ctypes.CDLL:
    """The kernel text of ``h`` (a ``codegen.hip.HipKernel``) compiled for the CPU with the emulation
    header, ``defines`` before it and ``helpers`` (plain C++ parts of the prelude) after it, cached in
    ``tmp`` by its source.  The library's ``emulate(args, grid)`` runs ``grid`` workgroups."""
    src = emulation_source(h, defines, helpers)
    name = os.path.join(tmp, hashlib.sha1(src.encode()).hexdigest()[:16])
    if not os.path.exists(name + ".so"):
        with open(name + ".cpp", "w") as f:
            f.write(src)
        r = compile_shared(name + ".cpp", name + ".so")
        assert r.returncode == 0, r.stderr[:3000]
    return ctypes.CDLL(name + ".so")


def emulation_source(h, defines: str = "", helpers: str = "") -> str:
    """The C++ of ``h``'s kernel for the emulation: ``defines``, the header, ``helpers``, the kernel
    text and its ``emulate(args, grid)`` entry."""
    args = ", ".join(f"({'int' if p.kind == 'scalar' else CTYPE[p.dtype]}*)a[{i}]" for i, p in enumerate(h.kernel.params))
    return (f"#define VF_WAVE {h.target.wave}\n" + defines + open(HEADER).read() + helpers
            + h.body.replace('extern "C" __global__ void', "static void") + f"\nVF_EMULATE({h.kernel.name}, {args})\n")


def compile_shared(cpp: str, so: str) -> subprocess.CompletedProcess:
    """g++ ``cpp`` into the shared object ``so`` (C++20, threads)."""
    return subprocess.run([GXX, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", cpp, "-o", so],
                          capture_output=True, text=True)


def launch(lib, h, arrays, reversed_=False):
    """Run ``h``'s grid on the CPU with ``arrays`` (numpy arrays in the order of its parameters), the
    workgroups in order or, ``reversed_``, from the last to the first; every 16-byte access the header
    counts (``vf_load8``, ``vf_store8``, ``vf_load8f``) must be 16-byte aligned, as on a GPU."""
    assert all(a.ctypes.data % 16 == 0 for a in arrays)
    lib.emulate_reversed(int(reversed_))
    lib.emulate((ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays]), h.grid[0])
    assert lib.emulate_misaligned() == 0, "a 16-byte load or store at an address not a multiple of 16"
