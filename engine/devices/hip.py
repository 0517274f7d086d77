"""HIP on AMD GPUs (main target: gfx906 / MI50): the device.

Usage::

    f = dsl.jit(fn, backend="hip")               # the executable runs on HIPDevice()
    dev = HIPDevice()                            # needs an AMD GPU: complete but untested on hardware
    dev = HIPDevice.offline()                    # compile only, no GPU: dev.compile_many(plan.kernels)
    ck = dev.compile_many(kernels)[0]
    ck.resources(), ck.isa()                     # from the code object (codegen.codeobject)

Kernels are compiled by :mod:`engine.build` with the hiprtc compiler of
:mod:`engine.devices.rocm` (which also finds ROCm); code objects are read by
:mod:`codegen.codeobject`.  :class:`HIPDevice` has the device interface of the CUDA device
(shared code in :mod:`engine.devices.gpu`).
"""
from __future__ import annotations

import numpy as np

from codegen.codeobject import CodeObject, pack_kernargs  # noqa: F401  (CodeObject: importable from here too)
from codegen.env import switch
from engine.devices.gpu import NP_DTYPES, DeviceArray, GPUDevice, GPUKernel, ScalarSlots  # noqa: F401
from engine.devices.rocm import (  # noqa: F401  (compile_hip, HipCompileError: importable from here too)
    INSTALL_HINT, HipCompileError, HiprtcCompiler, HipUnavailable, amd_target, compile_hip, find_hiprtc)


class HipError(RuntimeError):
    """A HIP runtime call failed."""


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
        self.target = amd_target(arch)
        self._compiler = None
        self.sync_each = switch("VEGAFUSE_SYNC", False)
        self.graphs = switch("VEGAFUSE_HIP_GRAPHS", False)          # default off: see the class
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

    def _dtoh_async(self, dst, src, n):
        _check(self.hip.hipMemcpyDtoHAsync(dst, src, n, self.stream), "hipMemcpyDtoHAsync")

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

    def _event_wait(self, ev):
        _check(self.hip.hipEventSynchronize(ev), "hipEventSynchronize")

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
    @property
    def compiler(self) -> HiprtcCompiler:
        """hiprtc for ``self.target`` (what :mod:`engine.build` compiles with); made again when the
        target changes."""
        if self._compiler is None or self._compiler.target != self.target:
            self._compiler = HiprtcCompiler(self.target)
        return self._compiler

    def _load(self, source, binary):
        """Check a built code object against its kernel and, on a GPU, load it: ``(module,
        function, CodeObject)``.  Offline nothing is loaded (function None).

        Checked against the code object's metadata, with errors that name the kernel: the
        argument layout (one 8-byte pointer per parameter, as :meth:`prepare` passes them), the
        workgroup size, and static plus launch LDS within the LDS of a CU."""
        k, code = source.kernel, self.compiler.code_object(binary)
        self._check_abi(code, source.canonical, k)
        module = fn = None
        if self.online:
            module = _check(self.hip.hipModuleLoadData(code), f"hipModuleLoadData (a code object for "
                            f"{self.arch}; pass HIPDevice(arch=...) for another GPU)", k.name)
            fn = _check(self.hip.hipModuleGetFunction(module, binary.entry.encode()), "hipModuleGetFunction", k.name)
        return module, fn, code

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
        if lds > self.target.lds_per_cu:
            raise HipError(f"kernel {k.name}: {meta['.group_segment_fixed_size']} bytes of static LDS plus "
                           f"{hk.dynamic_lds} at launch exceed the {self.target.lds_per_cu} of a CU")

    def kernargs(self, launch) -> bytes:
        """The kernel-argument segment that ``launch`` (from :meth:`prepare`) makes the runtime build,
        laid out by its code object's metadata (:func:`pack_kernargs`): for inspection and tests."""
        meta = launch.ck.binary.kernel_metadata("canonical")
        return pack_kernargs(meta, [int(v) for v in launch.values[:len(launch.ck.kernel.params)]])
