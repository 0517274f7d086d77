"""CUDA device: the HIP source of every kernel, NVIDIA flavour, compiled by NVRTC and launched
through the CUDA driver (``cuda-python``: ``cuda.bindings.nvrtc`` and ``cuda.bindings.driver``).

Same interface as the CPU device (``compile_many``, ``prepare``, ``plan``) plus device memory:
``empty``, ``put`` (numpy -> DeviceArray), ``to_host``, ``copy_in``.  Scalars (the decode
position) live in device memory, so a captured CUDA graph replays with their current values.

Launch errors are asynchronous; ``VEGAFUSE_SYNC=1`` synchronizes after every launch so an error
names the kernel that caused it.
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import replace

import numpy as np

from codegen.hip import render_hip
from codegen.loopir import canonicalize
from codegen.targets import get_target
from engine.codecache import CodeCache

NP_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32),
             "bool": np.dtype(np.bool_)}


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


class DeviceArray:
    """A buffer in GPU memory with a numpy shape and dtype.  ``np.asarray(x)`` copies it to the host."""

    def __init__(self, device, ptr, shape, dtype):
        self.device, self.ptr, self.shape, self.dtype = device, int(ptr), tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self):
        return self.device.to_host(self)

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self):
        return f"DeviceArray({self.dtype}{list(self.shape)} at {self.ptr:#x})"

    def __del__(self):
        try:
            self.device._free(self)
        except Exception:                                         # interpreter shutdown
            pass


class ScalarSlots:
    """Named i32 scalars in device memory.  ``slots["pos"] = 7`` is uploaded before the next plan
    runs, from a ring of pinned host slots so that no upload overwrites one still in flight."""

    def __init__(self, device, names=(), capacity=64, ring=4096):
        self.device, self.capacity = device, capacity
        self.index = {n: i for i, n in enumerate(names)}
        self.values = np.zeros(capacity, np.int32)
        self.buf = device.empty((capacity,), "i32")
        drv = device.drv
        self.ring, self.ring_n, self.ring_i = _check(drv.cuMemHostAlloc(capacity * 4 * ring, 0), "cuMemHostAlloc"), ring, 0
        self.dirty = True

    def ptr(self, name):
        if name not in self.index:
            self.index[name] = len(self.index)
        return self.buf.ptr + 4 * self.index[name]

    def __setitem__(self, name, value):
        self.values[self.index[name]] = int(value)
        self.dirty = True

    def __getitem__(self, name):
        return int(self.values[self.index[name]])

    def __contains__(self, name):
        return name in self.index

    def flush(self, stream):
        if not self.dirty:
            return
        n = self.capacity * 4
        host = int(self.ring) + n * self.ring_i
        self.ring_i = (self.ring_i + 1) % self.ring_n
        ctypes.memmove(host, self.values.ctypes.data, n)
        _check(self.device.drv.cuMemcpyHtoDAsync(self.buf.ptr, host, n, stream), "cuMemcpyHtoDAsync")
        self.dirty = False


class GPUKernel:
    """A compiled kernel: ``.source`` is the readable HIP (NVIDIA flavour) of this kernel."""

    def __init__(self, kernel, hip, function, cubin):
        self.kernel, self.hip, self.function, self.cubin = kernel, hip, function, cubin

    @property
    def source(self):
        return self.hip.source

    def __repr__(self):
        return f"<GPUKernel {self.kernel.name} grid={self.hip.grid} block={self.hip.block}>"


class Launch:
    def __init__(self, device, ck, args, keep):
        self.device, self.ck, self.args, self.keep = device, ck, args, keep

    def __call__(self):
        d, h = self.device, self.ck.hip
        _check(d.drv.cuLaunchKernel(self.ck.function, *h.grid, *h.block, h.dynamic_lds, d.stream,
                                    self.args.ctypes.data, 0), "cuLaunchKernel", self.ck.kernel.name)
        if d.sync_each:
            _check(d.drv.cuStreamSynchronize(d.stream), "kernel execution", self.ck.kernel.name)


class Plan:
    """A fixed sequence of launches.  With graphs on, the first call captures them into a CUDA
    graph and every call replays it (one driver call per step)."""

    def __init__(self, device, launches, slots, graphs):
        self.device, self.launches, self.slots = device, list(launches), slots
        self.graphs = graphs and not device.sync_each
        self.exec = None

    def __call__(self):
        d = self.device
        if self.slots is not None:
            self.slots.flush(d.stream)
        if not self.graphs:
            for launch in self.launches:
                launch()
            return
        if self.exec is None:
            drv = d.drv
            _check(drv.cuStreamBeginCapture(d.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                   "cuStreamBeginCapture")
            for launch in self.launches:
                launch()
            graph = _check(drv.cuStreamEndCapture(d.stream), "cuStreamEndCapture")
            self.exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            self.graph = graph
        _check(d.drv.cuGraphLaunch(self.exec, d.stream), "cuGraphLaunch")


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


class CUDADevice:
    """One NVIDIA GPU.  ``graphs``: capture the decode step in a CUDA graph (default on;
    ``VEGAFUSE_CUDA_GRAPHS=0`` turns it off)."""

    name = "cuda"

    def __init__(self, index=0, graphs=None):
        self.drv, self.nvrtc = _cu()
        drv = self.drv
        _check(drv.cuInit(0), "cuInit")
        self.dev = _check(drv.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = _check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        _check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = drv.CUdevice_attribute
        major = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "attr")
        minor = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "attr")
        self.arch = f"sm_{major}{minor}"
        self.target = replace(get_target("sm_90"), name=self.arch)
        self.stream = _check(drv.cuStreamCreate(0), "cuStreamCreate")
        self.graphs = (os.environ.get("VEGAFUSE_CUDA_GRAPHS", "1") != "0") if graphs is None else graphs
        self.sync_each = os.environ.get("VEGAFUSE_SYNC", "0") == "1"
        self.cache = CodeCache()
        self._functions = {}
        self._resident = {}
        self.includes = _cuda_include_dirs()
        ver = _check(self.nvrtc.nvrtcVersion(), "nvrtcVersion")
        self.compiler = f"nvrtc {ver[0]}.{ver[1]}" if isinstance(ver, tuple) else f"nvrtc {ver}"

    # ------------------------------------------------------------------ memory
    def empty(self, shape, dtype):
        dt = NP_DTYPES[dtype] if dtype in NP_DTYPES else np.dtype(dtype)
        n = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        ptr = _check(self.drv.cuMemAlloc(n), "cuMemAlloc")
        _check(self.drv.cuMemsetD8Async(ptr, 0, n, self.stream), "cuMemsetD8Async")
        return DeviceArray(self, ptr, shape, dt)

    def _free(self, a):
        self.drv.cuMemFree(a.ptr)

    def put(self, a):
        """Copy a numpy array (or a pytree of them) to the GPU."""
        if isinstance(a, (dict, list, tuple)):
            from dsl.pytree import tree_map
            return tree_map(self.put, a)
        a = np.ascontiguousarray(a)
        d = self.empty(a.shape, a.dtype)
        _check(self.drv.cuMemcpyHtoDAsync(d.ptr, a.ctypes.data, a.nbytes, self.stream), "cuMemcpyHtoDAsync")
        self.synchronize()
        return d

    def copy_in(self, dst, a):
        a = np.ascontiguousarray(a, dst.dtype)
        _check(self.drv.cuMemcpyHtoD(dst.ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")

    def copy(self, dst, src, nbytes=None):
        """Device-to-device copy on the stream (no host synchronization)."""
        _check(self.drv.cuMemcpyDtoDAsync(dst.ptr if hasattr(dst, "ptr") else dst,
                                          src.ptr if hasattr(src, "ptr") else src,
                                          nbytes or src.nbytes, self.stream), "cuMemcpyDtoDAsync")

    def to_host(self, d):
        out = np.empty(d.shape, d.dtype)
        self.synchronize()
        _check(self.drv.cuMemcpyDtoH(out.ctypes.data, d.ptr, d.nbytes), "cuMemcpyDtoH")
        return out

    def resident(self, a):
        """The device copy of a host array that does not change (weights), uploaded once."""
        key = (id(a), a.ctypes.data, a.nbytes, a.dtype.str)
        hit = self._resident.get(key)
        if hit is None or hit[0] is not a:
            hit = (a, self.put(a))
            self._resident[key] = hit
        return hit[1]

    def synchronize(self):
        _check(self.drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def is_device_array(self, x):
        return isinstance(x, DeviceArray)

    def scalar_slots(self, names):
        return ScalarSlots(self, names)

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

    def time_launches(self, launches, reps=5):
        """Average GPU time in µs of each prepared launch, run one at a time between events."""
        ev = [_check(self.drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        out = []
        for launch in launches:
            launch()
            _check(self.drv.cuEventRecord(ev[0], self.stream), "cuEventRecord")
            for _ in range(reps):
                launch()
            _check(self.drv.cuEventRecord(ev[1], self.stream), "cuEventRecord")
            self.synchronize()
            out.append(1e3 * _check(self.drv.cuEventElapsedTime(ev[0], ev[1]), "cuEventElapsedTime") / reps)
        return out

    def copy_bandwidth(self, nbytes=1 << 30, reps=10):
        """Device-to-device copy bandwidth in GB/s, read + write counted (the roofline ceiling)."""
        a, b = self.empty((nbytes,), np.uint8), self.empty((nbytes,), np.uint8)
        self.copy(b, a)
        ev = [_check(self.drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        _check(self.drv.cuEventRecord(ev[0], self.stream), "cuEventRecord")
        for _ in range(reps):
            self.copy(b, a)
        _check(self.drv.cuEventRecord(ev[1], self.stream), "cuEventRecord")
        self.synchronize()
        ms = _check(self.drv.cuEventElapsedTime(ev[0], ev[1]), "cuEventElapsedTime")
        return 2 * nbytes * reps / (ms * 1e-3) / 1e9

    # ------------------------------------------------------------------ compile
    def _nvrtc_compile(self, source, name):
        nv = self.nvrtc
        prog = _check(nv.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
        opts = [f"--gpu-architecture={self.arch}".encode(), b"--std=c++17"]
        opts += [f"--include-path={d}".encode() for d in self.includes]
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

    def compile_many(self, kernels):
        """Compile every kernel (kernels equal up to names share one binary and one module)."""
        out = []
        for k in kernels:
            canon = render_hip(canonicalize(k), self.target)
            if canon.source not in self._functions:
                parts = {"source": canon.source, "arch": self.arch, "compiler": self.compiler, "options": "std=c++17"}
                cubin, _ = self.cache.get_or_build(parts, lambda: self._nvrtc_compile(canon.source, k.name))
                module = _check(self.drv.cuModuleLoadData(cubin), "cuModuleLoadData", k.name)
                fn = _check(self.drv.cuModuleGetFunction(module, b"canonical"), "cuModuleGetFunction", k.name)
                self._functions[canon.source] = (module, fn, cubin)
            _, fn, cubin = self._functions[canon.source]
            out.append(GPUKernel(k, render_hip(k, self.target), fn, cubin))
        return out

    # ------------------------------------------------------------------ launch
    def prepare(self, ck, buffers, scalars=None):
        vals = []
        for p in ck.kernel.params:
            if p.kind == "scalar":
                vals.append(scalars.ptr(p.name))
            else:
                b = buffers.get(p.name)
                if b is None:
                    raise CudaError(f"kernel {ck.kernel.name}: buffer {p.name!r} missing")
                want = (tuple(p.shape), NP_DTYPES[p.dtype])
                if (tuple(b.shape), b.dtype) != want:
                    raise CudaError(f"kernel {ck.kernel.name}: buffer {p.name!r} is {b.dtype}{list(b.shape)}, "
                                    f"expected {want[1]}{list(want[0])}")
                vals.append(b.ptr)
        vals = np.array(vals or [0], np.uint64)
        args = np.array([vals.ctypes.data + 8 * i for i in range(len(vals))], np.uint64)
        return Launch(self, ck, args, (vals, buffers))

    def plan(self, launches, slots=None):
        return Plan(self, launches, slots, self.graphs)


def _explain(log, source, name):
    """NVRTC's first error with the failing line of generated source."""
    lines = source.splitlines()
    m = re.search(r"\((\d+)\): error: (.*)", log)
    if not m:
        return f"NVRTC failed to compile kernel {name}: {log.strip()[:500]}"
    ln = int(m.group(1))
    text = lines[ln - 1].strip() if 0 < ln <= len(lines) else "?"
    return f"NVRTC failed to compile kernel {name}: line {ln}: {m.group(2)}\n    {text}"
