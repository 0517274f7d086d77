"""What the GPU devices share (``cuda.py``: NVRTC + CUDA driver; ``hip.py``: hiprtc + HIP runtime).

Device arrays, named i32 scalars in device memory, prepared launches, plans (with optional graph
capture and replay), and the device interface the executable and the model call (``empty``,
``put``, ``copy_in``, ``copy``, ``to_host``, ``resident``, ``synchronize``, ``is_device_array``,
``scalar_slots``, ``prepare``, ``plan``, ``time_launches``, ``copy_bandwidth``) are written once
here over a handful of driver primitives that each backend supplies:

=====================================  ===========================================================
``_malloc(n) -> int``                  device memory
``_free_ptr(ptr)``                     release it (errors ignored: it runs from ``__del__``)
``_memset_async(ptr, value, n)``       bytes on the stream
``_htod_async(dst, src, n, stream)``   host -> device on ``stream``; ``src`` a host address
``_htod(dst, src, n)``                 host -> device, synchronous
``_dtoh(dst, src, n)``                 device -> host, synchronous
``_dtod_async(dst, src, n)``           device -> device on the stream
``_dtoh_async(dst, src, n)``           device -> pinned host memory on the stream
``_host_alloc(n) -> int``              pinned host memory (the scalar upload ring, the id ring)
``_sync(what, kernel=None)``           wait for the stream; a failure names ``what`` and the kernel
``_event()``, ``_record(ev)``,         events on the stream: timing, and waiting for one step
``_elapsed_ms(ev0, ev1)``,
``_event_wait(ev)``
``_launch(ck, args)``                  launch ``ck`` on the stream; ``args``: uint64 array of the
                                       addresses of each parameter's value (``kernelParams``)
``_capture(launches) -> (graph, exec)`` record the launches into a graph
``_graph_launch(exec)``                replay it on the stream
``_load(source, binary)``              load a built kernel: ``(module, function, binary)``
``read_symbol(ck, name, n)``           the first ``n`` uint64 of kernel ``ck``'s ``__device__`` array
                                       ``name`` (a traced persistent kernel's stamps); optional
``clock_mhz``                          the clock those stamps count (MHz); optional
=====================================  ===========================================================

A backend also sets ``Error`` (its exception class), ``stream``, ``graphs``, ``sync_each`` and
``compiler`` (an :class:`engine.build.Compiler`: NVRTC, hiprtc).
"""
from __future__ import annotations

import ctypes

import numpy as np

from codegen import loopir as L
from dsl.quant import storage

from engine.build import build, render


def _storage(p) -> tuple:
    """(shape, numpy dtype) of the device memory behind kernel parameter ``p``: a weight's or a
    producer's q8_1 activation blocks (``fusion/q8.py``) are bytes, others their own shape and dtype."""
    if p.dtype in L.ACT_Q8:
        return (int(int(np.prod(p.shape)) * L.ITEMSIZE[p.dtype]),), np.dtype(np.uint8)
    return storage(p.dtype, p.shape)


NP_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32),
             "bool": np.dtype(np.bool_)}


class DeviceArray:
    """A buffer in GPU memory with a numpy shape and dtype.  ``np.asarray(x)`` copies it to the host."""

    def __init__(self, device, ptr, shape, dtype):
        self.device, self.ptr, self.shape, self.dtype = device, int(ptr), tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self):
        return self.device.to_host(self)

    def reshape(self, shape):
        """The same memory under another shape of as many elements; the view keeps ``self`` alive."""
        view = _DeviceView(self.device, self.ptr, shape, self.dtype)
        if view.nbytes != self.nbytes:
            raise ValueError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        view.base = self
        return view

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


class _DeviceView(DeviceArray):
    """A reshaped DeviceArray: the memory belongs to ``base`` and is not freed here."""

    def __del__(self):
        pass


class ScalarSlots:
    """Named i32 scalars in device memory.  ``slots["pos"] = 7`` is uploaded before the next plan
    runs, from a ring of pinned host slots so that no upload overwrites one still in flight."""

    def __init__(self, device, names=(), capacity=64, ring=4096):
        self.device, self.capacity = device, capacity
        self.index = {n: i for i, n in enumerate(names)}
        self.values = np.zeros(capacity, np.int32)
        self.buf = device.empty((capacity,), "i32")
        self.ring, self.ring_n, self.ring_i = device._host_alloc(capacity * 4 * ring), ring, 0
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
        self.device._htod_async(self.buf.ptr, host, n, stream)
        self.dirty = False


class IdRing:
    """``n`` slots of pinned host memory for i32 values read back a few steps late: ``post(i, src)``
    queues, on the stream, a copy of the first i32 of device array ``src`` into slot ``i % n`` and
    records the slot's event; ``read(i)`` waits for that event only and returns the value.  The
    caller keeps fewer than ``n`` posts unread (a slot is reused ``n`` posts later)."""

    def __init__(self, device, n=16):
        self.device, self.n = device, n
        self.host = device._host_alloc(4 * n)
        self.events = [device._event() for _ in range(n)]

    def post(self, i, src):
        d, slot = self.device, i % self.n
        d._dtoh_async(int(self.host) + 4 * slot, src.ptr, 4)
        d._record(self.events[slot])

    def read(self, i) -> int:
        slot = i % self.n
        self.device._event_wait(self.events[slot])
        return int(ctypes.c_int32.from_address(int(self.host) + 4 * slot).value)


class GPUKernel:
    """A compiled kernel: ``.source`` is the readable HIP of this kernel (the target's flavour);
    ``.function`` the loaded function (shared by kernels equal up to names); ``.binary`` what was
    loaded (a cubin on CUDA, a :class:`~codegen.codeobject.CodeObject` on HIP)."""

    def __init__(self, kernel, hip, function, binary):
        self.kernel, self.hip, self.function, self.binary = kernel, hip, function, binary

    @property
    def cubin(self):
        return self.binary

    @property
    def source(self):
        return self.hip.source

    def isa(self) -> str:
        """Disassembly of the loaded code object (HIP: gfx906 ISA through llvm-objdump)."""
        if not hasattr(self.binary, "isa"):
            raise NotImplementedError("disassembly is available for HIP code objects; for a cubin use cuobjdump")
        return self.binary.isa("canonical")

    def resources(self) -> dict:
        """VGPRs, SGPRs, LDS, scratch, waves per SIMD, code size of the loaded code object (HIP),
        for this kernel's workgroup size and launch LDS."""
        if not hasattr(self.binary, "resources"):
            raise NotImplementedError("resources are read from HIP code objects only")
        return self.binary.resources("canonical", workgroup_size=self.hip.block[0],
                                     dynamic_lds_bytes=self.hip.dynamic_lds)

    def __repr__(self):
        return f"<GPUKernel {self.kernel.name} grid={self.hip.grid} block={self.hip.block}>"


class Launch:
    """One prepared launch: ``vals`` holds each parameter's value (a device address), ``args``
    the address of each value, as ``kernelParams`` wants them."""

    def __init__(self, device, ck, args, keep):
        self.device, self.ck, self.args, self.keep = device, ck, args, keep

    @property
    def values(self):
        return self.keep[0]

    def __call__(self):
        d = self.device
        d._launch(self.ck, self.args)
        if d.sync_each:
            d._sync("kernel execution", self.ck.kernel.name)


class Plan:
    """A fixed sequence of launches.  With graphs on, the first call captures them into a graph
    and every call replays it (one driver call per step)."""

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
            self.graph, self.exec = d._capture(self.launches)
        d._graph_launch(self.exec)


class GPUDevice:
    """The device interface over the backend's primitives (see the module docstring)."""

    Error = RuntimeError
    stream = None
    graphs = False
    sync_each = False

    # ------------------------------------------------------------------ memory
    def empty(self, shape, dtype):
        dt = NP_DTYPES[dtype] if dtype in NP_DTYPES else np.dtype(dtype)
        n = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        ptr = self._malloc(n)
        self._memset_async(ptr, 0, n)
        return DeviceArray(self, ptr, shape, dt)

    def _free(self, a):
        self._free_ptr(a.ptr)

    def put(self, a):
        """Copy a numpy array (or a pytree of them) to the GPU."""
        if isinstance(a, (dict, list, tuple)):
            from dsl.pytree import tree_map
            return tree_map(self.put, a)
        a = np.ascontiguousarray(a)
        d = self.empty(a.shape, a.dtype)
        self._htod_async(d.ptr, a.ctypes.data, a.nbytes, self.stream)
        self.synchronize()
        return d

    def copy_in(self, dst, a):
        a = np.ascontiguousarray(a, dst.dtype)
        self._htod(dst.ptr, a.ctypes.data, a.nbytes)

    def copy(self, dst, src, nbytes=None):
        """Device-to-device copy on the stream (no host synchronization).  ``dst``/``src``:
        DeviceArrays or int addresses (then ``nbytes`` is needed)."""
        self._dtod_async(dst.ptr if hasattr(dst, "ptr") else dst, src.ptr if hasattr(src, "ptr") else src,
                         nbytes or src.nbytes)

    def to_host(self, d):
        out = np.empty(d.shape, d.dtype)
        self.synchronize()
        self._dtoh(out.ctypes.data, d.ptr, d.nbytes)
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
        self._sync(self._SYNC)

    def id_ring(self, n=16):
        """An :class:`IdRing` of ``n`` pinned slots (generated ids read while the GPU runs ahead)."""
        return IdRing(self, n)

    def is_device_array(self, x):
        return isinstance(x, DeviceArray)

    def scalar_slots(self, names):
        return ScalarSlots(self, names)

    # ------------------------------------------------------------------ timing
    def time_launches(self, launches, reps=5):
        """Average GPU time in µs of each prepared launch, run one at a time between events."""
        ev = [self._event() for _ in range(2)]
        out = []
        for launch in launches:
            launch()
            self._record(ev[0])
            for _ in range(reps):
                launch()
            self._record(ev[1])
            self.synchronize()
            out.append(1e3 * self._elapsed_ms(ev[0], ev[1]) / reps)
        return out

    def copy_bandwidth(self, nbytes=1 << 30, reps=10):
        """Device-to-device copy bandwidth in GB/s, read + write counted (the roofline ceiling)."""
        a, b = self.empty((nbytes,), np.uint8), self.empty((nbytes,), np.uint8)
        self.copy(b, a)
        ev = [self._event() for _ in range(2)]
        self._record(ev[0])
        for _ in range(reps):
            self.copy(b, a)
        self._record(ev[1])
        self.synchronize()
        ms = self._elapsed_ms(ev[0], ev[1])
        return 2 * nbytes * reps / (ms * 1e-3) / 1e9

    # ------------------------------------------------------------------ compile
    def compile_many(self, kernels):
        """Render, build (:mod:`engine.build`: one compile per kernel distinct up to names, through
        the disk cache) and load every Loop IR kernel; :class:`GPUKernel`\\ s in order."""
        sources = render(kernels, self.compiler)
        return self.load(sources, build(sources, self.compiler))

    def load(self, sources, binaries):
        """:class:`GPUKernel`\\ s for built kernels; each binary is loaded once per device."""
        out = []
        for s, b in zip(sources, binaries):
            if b.source not in self._functions:
                self._functions[b.source] = self._load(s, b)
            _, fn, code = self._functions[b.source]
            out.append(GPUKernel(s.kernel, s.readable, fn, code))
        return out

    # ------------------------------------------------------------------ launch
    def kernel_values(self, ck, buffers, scalars=None):
        """The value of each of ``ck``'s parameters, in order: buffer addresses (checked against
        the kernel's shapes and dtypes) and, for scalars, their address in ``scalars``."""
        vals = []
        for p in ck.kernel.params:
            if p.kind == "scalar":
                vals.append(scalars.ptr(p.name))
            else:
                b = buffers.get(p.name)
                if b is None:
                    raise self.Error(f"kernel {ck.kernel.name}: buffer {p.name!r} missing")
                want = _storage(p)
                if (tuple(b.shape), b.dtype) != want:
                    raise self.Error(f"kernel {ck.kernel.name}: buffer {p.name!r} is {b.dtype}{list(b.shape)}, "
                                     f"expected {want[1]}{list(want[0])}")
                vals.append(b.ptr)
        return vals

    def prepare(self, ck, buffers, scalars=None):
        vals = np.array(self.kernel_values(ck, buffers, scalars) or [0], np.uint64)
        args = np.array([vals.ctypes.data + 8 * i for i in range(len(vals))], np.uint64)
        return Launch(self, ck, args, (vals, buffers))

    def plan(self, launches, slots=None):
        return Plan(self, launches, slots, self.graphs)
