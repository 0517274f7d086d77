"""CUDA device: the HIP source of every kernel, NVIDIA flavour, compiled by NVRTC and launched
through the CUDA driver (``cuda-python``: ``cuda.bindings.nvrtc`` and ``cuda.bindings.driver``).

Same interface as the CPU device (``compiler``, ``load``, ``compile_many``, ``prepare``, ``plan``)
plus device memory:
``empty``, ``put`` (numpy -> DeviceArray), ``to_host``, ``copy_in``.  What it shares with the
HIP device (memory, scalar slots, launches, plans) is in ``engine/devices/gpu.py``.  Scalars (the decode
position) live in device memory, so a captured CUDA graph replays with their current values.

Launch errors are asynchronous; ``VEGAFUSE_SYNC=1`` synchronizes after every launch so an error
names the kernel that caused it.
"""
from __future__ import annotations

import os
import re
from dataclasses import replace

import numpy as np

from codegen.env import env_int, switch
from codegen.hip import render_hip
from codegen.targets import get_target
from engine.build import Compiler
from engine.devices.gpu import NP_DTYPES, DeviceArray, GPUDevice, GPUKernel, Launch, Plan, ScalarSlots  # noqa: F401


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed; the message names the call and, when known, the kernel."""


def _cu():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:                                   # pragma: no cover - depends on the host
        raise CudaError("the cuda backend needs cuda-python: pip install cuda-bindings") from e
    return driver, nvrtc


def _check(res, what, kernel=None):
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        where = f" in kernel {kernel}" if kernel else ""
        raise CudaError(f"{what} failed{where}: {err!r}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def _cuda_include_dirs():
    """Folders holding cuda_fp16.h for NVRTC (CUDA toolkit or the nvidia-* wheels)."""
    dirs = [os.path.join(p, "include") for p in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda")]
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in ("cuda_runtime", "cu13", "cuda_nvrtc", "cu12"):
                dirs.append(os.path.join(base, sub, "include"))
    except ImportError:
        pass
    return [d for d in dirs if os.path.exists(os.path.join(d, "cuda_fp16.h"))]


def cuda_wave(wave=None) -> int:
    """The wave width a CUDA device renders kernels at: ``wave`` if given, else ``VEGAFUSE_CUDA_WAVE``
    (default 32).  Raises ValueError for anything but 32 or 64."""
    raw = (os.environ.get("VEGAFUSE_CUDA_WAVE", "") or "32") if wave is None else str(wave)
    if raw not in ("32", "64"):
        raise ValueError(f"CUDA wave width {raw!r}: use 32 (native warps) or 64 (gfx906's wave, emulated); "
                         "set VEGAFUSE_CUDA_WAVE or pass wave=")
    return int(raw)


def pdl_target(target):
    """``target`` with programmatic dependent launch on: its trigger from ``VEGAFUSE_PDL_TRIGGER``
    ("exit" or "wait") and its prefetch from ``VEGAFUSE_PDL_PREFETCH`` (bytes, 0: none) where they
    are set; ValueError naming the switch for a value it does not take."""
    prefetch = env_int("VEGAFUSE_PDL_PREFETCH", target.pdl_prefetch)
    if prefetch < 0:
        raise ValueError(f"VEGAFUSE_PDL_PREFETCH={prefetch} is negative; set it to bytes (0: no prefetch) or unset it")
    trigger = os.environ.get("VEGAFUSE_PDL_TRIGGER") or target.pdl_trigger
    if trigger not in ("exit", "wait"):
        raise ValueError(f"VEGAFUSE_PDL_TRIGGER={trigger!r} is not 'exit' or 'wait'; set it to one or unset it")
    return replace(target, pdl=True, pdl_prefetch=prefetch, pdl_trigger=trigger)


class CUDADevice(GPUDevice):
    """One NVIDIA GPU.  ``graphs``: capture the decode step in a CUDA graph (default on;
    ``VEGAFUSE_CUDA_GRAPHS=0`` turns it off).

    ``wave``: 32 (default) renders at the warp's width; 64 runs gfx906's wave-64 kernel text, each
    64-lane wave emulated by two warps joined through LDS and a named barrier (target ``sm_90_wave64``,
    see ``codegen/prelude.py``).  Without ``wave`` it comes from ``VEGAFUSE_CUDA_WAVE`` (32 or 64),
    read when the device is made; ``engine.executable.get_device("cuda", wave=64)`` keeps a wave-64
    device beside the default one, so that one process can run both."""

    name = "cuda"

    def __init__(self, index=0, graphs=None, wave=None):
        self.wave = cuda_wave(wave)
        self.drv, self.nvrtc = _cu()
        drv = self.drv
        try:
            _check(drv.cuInit(0), "cuInit")
        except CudaError:
            raise
        except Exception as e:                         # no driver library, no device
            raise CudaError(f"no usable NVIDIA GPU: {str(e).splitlines()[0]}") from None
        self.dev = _check(drv.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = _check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        _check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = drv.CUdevice_attribute
        major = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "attr")
        minor = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "attr")
        self.arch = f"sm_{major}{minor}"
        if self.wave == 64:
            self.target = replace(get_target("sm_90_wave64"), name=f"{self.arch}_wave64")
        else:
            self.target = replace(get_target("sm_90"), name=self.arch)
        self.stream = _check(drv.cuStreamCreate(0), "cuStreamCreate")
        self.graphs = switch("VEGAFUSE_CUDA_GRAPHS", True) if graphs is None else graphs
        self.sync_each = switch("VEGAFUSE_SYNC", False)
        # programmatic dependent launch on Hopper and newer, as the target table says (sm_90: on; see
        # Target.pdl); VEGAFUSE_CUDA_PDL=0 turns it off, =1 on, for A/B runs; VEGAFUSE_PDL_PREFETCH=BYTES
        # sets how much of each weight a GEMV asks of L2 before its wait (Target.pdl_prefetch)
        env = os.environ.get("VEGAFUSE_CUDA_PDL", "")
        self.pdl = major >= 9 and (env == "1" or (env == "" and self.target.pdl))
        self.target = pdl_target(self.target) if self.pdl else replace(self.target, pdl=False)

        self._functions = {}
        self._resident = {}
        self._compiler = None

    # ------------------------------------------------------------------ driver primitives (gpu.GPUDevice)
    Error = CudaError
    _SYNC = "cuStreamSynchronize"

    def _malloc(self, n):
        return _check(self.drv.cuMemAlloc(n), "cuMemAlloc")

    def _free_ptr(self, ptr):
        self.drv.cuMemFree(ptr)

    def _memset_async(self, ptr, value, n):
        _check(self.drv.cuMemsetD8Async(ptr, value, n, self.stream), "cuMemsetD8Async")

    def _htod_async(self, dst, src, n, stream):
        _check(self.drv.cuMemcpyHtoDAsync(dst, src, n, stream), "cuMemcpyHtoDAsync")

    def _htod(self, dst, src, n):
        _check(self.drv.cuMemcpyHtoD(dst, src, n), "cuMemcpyHtoD")

    def _dtoh(self, dst, src, n):
        _check(self.drv.cuMemcpyDtoH(dst, src, n), "cuMemcpyDtoH")

    def _dtod_async(self, dst, src, n):
        _check(self.drv.cuMemcpyDtoDAsync(dst, src, n, self.stream), "cuMemcpyDtoDAsync")

    def _dtoh_async(self, dst, src, n):
        _check(self.drv.cuMemcpyDtoHAsync(dst, src, n, self.stream), "cuMemcpyDtoHAsync")

    def _host_alloc(self, n):
        return _check(self.drv.cuMemHostAlloc(n, 0), "cuMemHostAlloc")

    def _sync(self, what, kernel=None):
        _check(self.drv.cuStreamSynchronize(self.stream), what, kernel)

    def _event(self):
        return _check(self.drv.cuEventCreate(0), "cuEventCreate")

    def _record(self, ev):
        _check(self.drv.cuEventRecord(ev, self.stream), "cuEventRecord")

    def _elapsed_ms(self, ev0, ev1):
        return _check(self.drv.cuEventElapsedTime(ev0, ev1), "cuEventElapsedTime")

    def _event_wait(self, ev):
        _check(self.drv.cuEventSynchronize(ev), "cuEventSynchronize")

    def _launch(self, ck, args):
        h = ck.hip
        if self.pdl:
            _check(self.drv.cuLaunchKernelEx(self._config(h), ck.function, args.ctypes.data, 0),
                   "cuLaunchKernelEx", ck.kernel.name)
            return
        _check(self.drv.cuLaunchKernel(ck.function, *h.grid, *h.block, h.dynamic_lds, self.stream,
                                       args.ctypes.data, 0), "cuLaunchKernel", ck.kernel.name)

    def _config(self, h):
        """Launch configuration with programmatic stream serialization (Hopper): the kernel may
        start before the previous one ends; it waits for its inputs with griddepcontrol.wait."""
        drv = self.drv
        c = drv.CUlaunchConfig()
        c.gridDimX, c.gridDimY, c.gridDimZ = h.grid
        c.blockDimX, c.blockDimY, c.blockDimZ = h.block
        c.sharedMemBytes, c.hStream = h.dynamic_lds, self.stream
        a = drv.CUlaunchAttribute()
        a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        c.attrs, c.numAttrs = [a], 1
        return c

    def _capture(self, launches):
        drv = self.drv
        _check(drv.cuStreamBeginCapture(self.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        for launch in launches:
            launch()
        graph = _check(drv.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        return graph, _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def _graph_launch(self, exec_):
        _check(self.drv.cuGraphLaunch(exec_, self.stream), "cuGraphLaunch")

    _FILL = r"""
extern "C" __global__ void vf_fill(void* out, unsigned long long n, unsigned int seed, float scale, float shift,
                                   int half) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned int h = (unsigned int)(i * 2654435761ull) ^ seed;     // integer hash -> uniform [0, 1)
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    const float v = shift + scale * (2.0f * (h >> 8) * (1.0f / 16777216.0f) - 1.0f);
    if (half) ((__half*)out)[i] = __float2half(v); else ((float*)out)[i] = v;
  }
}
"""

    def random(self, shape, dtype, scale=0.02, seed=0, shift=0.0):
        """Uniform values in [shift - scale, shift + scale) made on the GPU (benchmark weights)."""
        if not hasattr(self, "_fill"):
            cubin = self._nvrtc_compile("#include <cuda_fp16.h>\n" + self._FILL, "vf_fill")
            module = _check(self.drv.cuModuleLoadData(cubin), "cuModuleLoadData")
            self._fill = (module, _check(self.drv.cuModuleGetFunction(module, b"vf_fill"), "cuModuleGetFunction"))
        a = self.empty(shape, dtype)
        n = int(np.prod(shape, dtype=np.int64))
        vals = [np.array([a.ptr], np.uint64), np.array([n], np.uint64), np.array([seed & 0xFFFFFFFF], np.uint32),
                np.array([scale], np.float32), np.array([shift], np.float32),
                np.array([int(a.dtype == np.float16)], np.int32)]
        args = np.array([v.ctypes.data for v in vals], np.uint64)
        _check(self.drv.cuLaunchKernel(self._fill[1], 1024, 1, 1, 256, 1, 1, 0, self.stream, args.ctypes.data, 0),
               "cuLaunchKernel", "vf_fill")
        self.synchronize()
        return a

    # ------------------------------------------------------------------ compile
    @property
    def compiler(self) -> "NVRTCCompiler":
        """NVRTC for ``self.target`` (what :mod:`engine.build` compiles with); made again when the
        target changes."""
        if self._compiler is None or self._compiler.target != self.target:
            self._compiler = NVRTCCompiler(self.nvrtc, self.target, self.arch)
        return self._compiler

    def _nvrtc_compile(self, source, name):
        return self.compiler.compile(source, name)

    def _load(self, source, binary):
        """Load a built cubin: ``(module, function, cubin)``."""
        name = source.kernel.name
        module = _check(self.drv.cuModuleLoadData(binary.code), "cuModuleLoadData", name)
        fn = _check(self.drv.cuModuleGetFunction(module, binary.entry.encode()), "cuModuleGetFunction", name)
        dynamic = source.readable.dynamic_lds
        if dynamic > 48 * 1024:                 # beyond the default: the kernel opts in (codegen.hip.dynamic_arrays)
            attr = self.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(self.drv.cuFuncSetAttribute(fn, attr, dynamic), "cuFuncSetAttribute", name)
        if source.kernel.family == "persistent":
            self._check_resident(fn, source.readable, name)
        return module, fn, binary.code

    def read_symbol(self, ck, name, n):
        """The first ``n`` uint64 of the ``__device__`` array ``name`` in the module of the loaded kernel
        ``ck`` (a ``GPUKernel``), after the stream's work."""
        module = next(m for m, fn, _ in self._functions.values() if fn is ck.function)
        ptr, size = _check(self.drv.cuModuleGetGlobal(module, name.encode()), "cuModuleGetGlobal", ck.kernel.name)
        out = np.zeros(min(n, int(size) // 8), np.uint64)
        self.synchronize()
        self._dtoh(out.ctypes.data, ptr, out.nbytes)
        return out

    @property
    def clock_mhz(self) -> float:
        """The SMs' clock (``clock64``) in MHz: the device's peak, which a busy H200 runs at."""
        attr = self.drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE
        return _check(self.drv.cuDeviceGetAttribute(attr, self.dev), "cuDeviceGetAttribute") / 1e3

    def _check_resident(self, fn, h, name):
        """A persistent kernel's workgroups meet at grid barriers, so all must be resident at once:
        raise CudaError where this GPU holds fewer than its grid."""
        drv = self.drv
        sms = _check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                              self.dev), "attr")
        per_sm = _check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, h.block[0], h.dynamic_lds),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor", name)
        if sms * per_sm < h.grid[0]:
            raise CudaError(f"kernel {name}: a persistent kernel of {h.grid[0]} workgroups, but this GPU holds "
                            f"{sms * per_sm} at once ({sms} SMs x {per_sm}); lower VEGAFUSE_PERSISTENT_PER_CU or "
                            "unset VEGAFUSE_PERSISTENT")


class NVRTCCompiler(Compiler):
    """HIP C++ (NVIDIA flavour, from ``target``'s prelude) to cubins with NVRTC, for the target's
    ``arch`` (``sm_XX``: the device's; the target may be a flavour of it, such as the emulated wave
    64).  The cache identity is NVRTC's version, the arch and the options."""

    def __init__(self, nvrtc, target, arch):
        super().__init__()
        self.nvrtc, self.target, self.arch = nvrtc, target, arch
        self.includes = _cuda_include_dirs()
        self.options = [f"--gpu-architecture={self.arch}", "--std=c++17"]
        ver = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        version = f"nvrtc {ver[0]}.{ver[1]}" if isinstance(ver, tuple) else f"nvrtc {ver}"
        self.identity = {"kind": "nvrtc-cubin", "arch": self.arch, "compiler": version, "options": self.options}

    def render(self, kernel):
        return render_hip(kernel, self.target)

    def compile(self, source, name):
        """NVRTC ``source`` to a cubin; :class:`CudaError` with the first error and its line."""
        nv = self.nvrtc
        prog = _check(nv.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
        opts = [o.encode() for o in self.options] + [f"--include-path={d}".encode() for d in self.includes]
        res = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = _check(nv.nvrtcGetProgramLogSize(prog), "log")
            log = b" " * size
            nv.nvrtcGetProgramLog(prog, log)
            raise CudaError(_explain(log.decode(errors="replace"), source, name))
        size = _check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin


def _explain(log, source, name):
    """NVRTC's first error with the failing line of generated source."""
    lines = source.splitlines()
    m = re.search(r"\((\d+)\): error: (.*)", log)
    if not m:
        return f"NVRTC failed to compile kernel {name}: {log.strip()[:500]}"
    ln = int(m.group(1))
    text = lines[ln - 1].strip() if 0 < ln <= len(lines) else "?"
    return f"NVRTC failed to compile kernel {name}: line {ln}: {m.group(2)}\n    {text}"
