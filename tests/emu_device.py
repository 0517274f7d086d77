"""A GPU device without a GPU: the sm_90 kernel text of every kernel run on the CPU by the emulation
(``tests/gpu_emulation.h``: a fiber per GPU thread, the workgroups in turn), behind the
engine's own GPU path (``engine.devices.gpu.GPUDevice``: render, build, buffers, plans, launches).
So whole programs run through the GPU mapping and its text on a machine with g++ only: the fuzzer's
``emu`` backend (``tests/fuzz.py``) and tests.  Device memory is host memory; a stream is the
calling thread.

    from tests.emu_device import emu_backend
    dsl.jit(f, backend=emu_backend())(x)
"""
from __future__ import annotations

import ctypes
import os
import re
import tempfile
import time

import numpy as np

from codegen import prelude
from codegen.hip import render_hip
from codegen.targets import get_target
from engine.build import Compiler
from engine.devices.gpu import GPUDevice
from tests.emulation import HEADER, compile_shared, emulation_source
from tests.test_gemv_gpu import DOT8
from tests.test_review13 import DOT4



def helpers() -> str:
    """The prelude's portable parts (wave and block reductions, quantized weights and activations,
    attention, the tiled matmul's dequantization) with the float GEMV's dots in plain C++."""
    act = prelude._OVER_STEP + prelude._Q8_1R
    return (prelude._NV_WAVE_SUM + prelude._COMMON.format() + DOT8 + DOT4 + prelude.nv_int8()
            + prelude._DEQUANT + prelude._DEQUANT8F + prelude._DOT8_W + prelude._DEQUANT8 + prelude._QUANT.format(activation=act, stored=prelude._STORED)
            + prelude._ATTENTION)


class EmuError(RuntimeError):
    """A kernel's emulation text did not compile."""


class EmuCompiler(Compiler):
    """The kernel text for the emulation: the rendered kernel without its prelude, after the
    emulation header and the portable helpers; compiled by g++ to a shared object."""

    identity = {"kind": "cpu-emulation", "arch": "sm_90"}

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.identity = {**self.identity, "header": open(HEADER).read(), "helpers": helpers() + prelude.RING}

    def render(self, kernel):
        h = render_hip(kernel, self.target)
        defines = "".join(line + "\n" for line in h.source[:h.body_start].splitlines()
                          if re.match(r"#define VF_(BLOCK|WAVES|ATT_WAVES) ", line))
        defines += f"#define VF_ATT_BLOCK {h.block[0]}\n#define VF_UNROLL_K\n"
        defines += "#define VF_ACT_F16\n" if h.kernel.launch.act == "f16" else ""
        grid = 1 if kernel.family == "persistent" else h.grid[0]    # the workgroups run in turn: a grid barrier needs one
        extra = ""
        if "vf_ring_start(" in h.body:               # a ring: __syncthreads is its consumers' barrier
            defines += f"#define VF_SYNC_THREADS {h.block[0] - 32}\n"
            extra = prelude.RING
        return emulation_source(h, defines, helpers() + extra) + f"// launch {grid} {h.block[0]}\n"

    def compile(self, source, name):
        with tempfile.TemporaryDirectory() as d:
            cpp, so = os.path.join(d, "k.cpp"), os.path.join(d, "k.so")
            open(cpp, "w").write(source)
            r = compile_shared(cpp, so)
            if r.returncode:
                raise EmuError(f"kernel {name}: g++ failed: {r.stderr[:2000]}")
            return open(so, "rb").read()


class EmuDevice(GPUDevice):
    """:class:`GPUDevice` over host memory and the CPU emulation of the sm_90 text (wave 32)."""

    name = "emu"
    Error = EmuError
    _SYNC = "emulation"

    def __init__(self):
        self.target = get_target("sm_90", pdl=False)
        self.stream, self.graphs, self.sync_each = None, False, False
        self._functions, self._resident, self._mem = {}, {}, {}
        self._compiler = EmuCompiler(self.target)
        self._dir = tempfile.mkdtemp(prefix="vf_emu_")

    @property
    def compiler(self):
        return self._compiler

    # host memory standing in for device memory (16-byte aligned, as cuMemAlloc's)
    def _malloc(self, n):
        buf = np.zeros(max(1, n) + 64, np.uint8)
        ptr = (buf.ctypes.data + 63) & ~63
        self._mem[ptr] = buf
        return ptr

    def _free_ptr(self, ptr):
        self._mem.pop(int(ptr), None)

    _host_alloc = _malloc

    def _memset_async(self, ptr, value, n):
        ctypes.memset(int(ptr), value, n)

    def _htod_async(self, dst, src, n, stream=None):
        ctypes.memmove(int(dst), int(src), n)

    _htod = _dtoh = _dtod_async = _dtoh_async = _htod_async

    def _sync(self, what, kernel=None):
        pass

    def _event(self):
        return [0.0]

    def _record(self, ev):
        ev[0] = time.perf_counter()

    def _elapsed_ms(self, ev0, ev1):
        return 1e3 * (ev1[0] - ev0[0])

    def _event_wait(self, ev):
        pass

    def _load(self, source, binary):
        path = os.path.join(self._dir, f"{len(self._functions)}.so")
        open(path, "wb").write(binary.code)
        lib = ctypes.CDLL(path)
        lib.emulate.argtypes = [ctypes.c_void_p, ctypes.c_int]
        m = re.search(r"// launch (\d+) (\d+)", binary.source)
        return lib, (lib, int(m.group(1))), binary.code

    def read_symbol(self, ck, name, n):
        """The first ``n`` uint64 of the kernel's file-scope array ``name`` (a global of its library)."""
        lib, _ = ck.function
        return np.ctypeslib.as_array((ctypes.c_uint64 * n).in_dll(lib, name)).copy()

    clock_mhz = 1000.0                    # the emulation's clock64: nanoseconds

    def _launch(self, ck, args):
        lib, grid = ck.function
        vals = (ctypes.c_void_p * len(args))(*[ctypes.c_uint64.from_address(int(a)).value for a in args])
        lib.emulate(vals, grid)


_DEVICE = []


def emu_backend() -> str:
    """Register the emulated device as backend "emu" (once) and return that name."""
    import importlib
    from engine import executable
    jit = importlib.import_module("dsl.jit")
    if not _DEVICE:
        _DEVICE.append(EmuDevice())
        executable._DEVICES["emu"] = _DEVICE[0]
        jit.BACKENDS = jit.BACKENDS + ("emu",)
    return "emu"
