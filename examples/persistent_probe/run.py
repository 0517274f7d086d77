"""A design probe, written by hand in CUDA: what would a persistent decode kernel gain at Qwen2.5-1.5B f16?

Every layer of the decode step (QKV, attention, O, gate/up, down; 93.6 MB of f16 weights) runs in one
kernel whose workgroups pass from phase to phase on a counter in global memory instead of at kernel
boundaries (``layers.cu``), or with the weights streamed through a ring in shared memory by bulk
copies that never wait for the grid (``ring.cu``).  It prints the microseconds a layer of each variant
takes over 28 layers, beside the same bytes streamed by a kernel that only sums them.  These kernels
are not vegafuse's: they measure a design before the compiler generates it (docs/performance.md,
2026-12-04 (morning)).  NVIDIA sm_90 only, through NVRTC (``pip install cuda-bindings``).

    python examples/persistent_probe/run.py [--order "P0 P1 P0 P1 N0 ..."]

A variant is ``NAME:PREFETCH,BARRIER,THREADS,BPS[,SKIP]`` (``--variants``); a name starting with M
runs ``ring.cu`` (THREADS = (slots + 1) * 32), with R its SPLIT consumers (THREADS 416, 10 slots,
SPLIT = BPS; SKIP 1: RING_ONLY), with S or T it is timed but not checked.  Each
variant with barriers is first checked over 2 layers against numpy in float64 and against a run
on 12 workgroups (the same rows in another split).
"""
import argparse
import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from engine.devices.cuda import _check, _cu, _cuda_include_dirs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HID, NQKV, FF, NH, NKV, HD, POS = 1536, 2048, 8960, 12, 2, 128, 32
SLOT = 18432
VARIANTS = ("P0:0,1,512,1 P1:1,1,512,1 N0:0,0,512,1 N1:1,0,512,1 S8:0,0,512,1,8 S16:0,0,512,1,16 "
            "S5:0,0,512,1,5 S31:0,0,512,1,31 T31:0,1,512,1,31 M1:0,1,352,1 MN:0,0,352,1 R1:0,1,416,1 "
            "RN:0,0,416,1 SR:0,0,416,1,1 R2:0,1,416,2 RM:0,0,416,2")

drv = nv = None                  # cuda-python's driver and NVRTC, loaded once the options are read


def _load():
    global drv, nv
    drv, nv = _cu()


def source(ring: bool) -> str:
    common = open(os.path.join(HERE, "common.cuh")).read()
    return common + open(os.path.join(HERE, "ring.cu" if ring else "layers.cu")).read()


class Params(ctypes.Structure):
    """``Params`` of common.cuh, passed by value."""
    _fields_ = [(n, ctypes.c_uint64) for n in ("wqkv", "wo", "wg", "wu", "wd", "kv", "x", "q", "a", "h", "m",
                                               "count")] + [("layers", ctypes.c_int)]


class Probe:
    def __init__(self, layers: int, seed: int):
        _check(drv.cuInit(0), "cuInit")
        dev = _check(drv.cuDeviceGet(0), "cuDeviceGet")
        _check(drv.cuCtxSetCurrent(_check(drv.cuDevicePrimaryCtxRetain(dev), "ctx")), "cuCtxSetCurrent")
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self.sms = _check(drv.cuDeviceGetAttribute(attr, dev), "SMs")
        self.stream = _check(drv.cuStreamCreate(0), "cuStreamCreate")
        self.L = layers
        rng = np.random.default_rng(seed)
        self.sizes = [NQKV * HID, HID * HID, FF * HID, FF * HID, HID * FF]   # halves a layer: qkv, o, gate, up, down
        self.total = sum(self.sizes) * layers
        self.w = self.alloc(self.total * 2)
        piece = (rng.standard_normal(1 << 27) * 0.03).astype(np.float16)     # one random block, repeated
        for off in range(0, self.total, piece.size):
            _check(drv.cuMemcpyHtoD(self.w + off * 2, piece.ctypes.data, min(piece.size, self.total - off) * 2), "fill")
        self.offs = list(np.cumsum([0] + [s * layers for s in self.sizes[:-1]]))
        self.ptrs = [self.w + 2 * int(o) for o in self.offs]
        self.wgu = self.alloc(2 * FF * HID * 2 * layers)                      # gate and up rows interleaved
        for l in range(layers):
            for j, src in enumerate(self.ptrs[2:4]):
                cp = drv.CUDA_MEMCPY2D()
                cp.srcMemoryType = cp.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
                cp.srcDevice, cp.srcPitch = src + l * FF * HID * 2, HID * 2
                cp.dstDevice, cp.dstPitch = self.wgu + l * FF * HID * 4 + j * HID * 2, HID * 4
                cp.WidthInBytes, cp.Height = HID * 2, FF
                _check(drv.cuMemcpy2D(cp), "cuMemcpy2D")
        self.kv_host = (rng.standard_normal(layers * 2 * NKV * POS * HD) * 0.5).astype(np.float16)
        self.kv = self.put(self.kv_host)
        self.x0 = rng.standard_normal(HID).astype(np.float32)
        self.act = [self.alloc(n * 4) for n in (HID, NQKV, HID, HID, FF)]      # x, q, a, h, m
        self.count, self.out = self.alloc(4), self.alloc(4)
        self.wgu_arg = np.array([self.wgu], np.uint64)

    def alloc(self, n):
        return int(_check(drv.cuMemAlloc(max(n, 4)), "cuMemAlloc"))

    def put(self, a):
        p = self.alloc(a.nbytes)
        _check(drv.cuMemcpyHtoD(p, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        return p

    def compile(self, defs: dict, ring: bool, entry: str = "layers"):
        """The ``layers`` function of the variant and its dynamic shared memory."""
        prog = _check(nv.nvrtcCreateProgram(source(ring).encode(), b"probe.cu", 0, [], []), "nvrtcCreateProgram")
        opts = [b"--gpu-architecture=sm_90", b"--std=c++17"] + [f"-D{k}={v}".encode() for k, v in defs.items()]
        opts += [f"--include-path={d}".encode() for d in _cuda_include_dirs()]
        if int(nv.nvrtcCompileProgram(prog, len(opts), opts)[0]) != 0:
            log = b" " * _check(nv.nvrtcGetProgramLogSize(prog), "log")
            nv.nvrtcGetProgramLog(prog, log)
            raise SystemExit(log.decode())
        cubin = b" " * _check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _check(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        mod = _check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        f = _check(drv.cuModuleGetFunction(mod, entry.encode()), entry)
        smem = (defs["SLOTS"] * SLOT if ring else 0) + FF * 4
        fa = drv.CUfunction_attribute
        _check(drv.cuFuncSetAttribute(f, fa.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "smem")
        regs = _check(drv.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_NUM_REGS, f), "regs")
        local = _check(drv.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "local")
        fit = _check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, defs["THREADS"], smem), "occupancy")
        print(f"  {defs}: {regs} registers, {local} bytes of local memory, {fit} workgroups an SM fit", flush=True)
        return f, smem, fit, (None if ring else _check(drv.cuModuleGetFunction(mod, b"stream_sum"), "stream_sum"))

    def launch(self, f, grid, threads, smem, layers, events=None):
        _check(drv.cuMemcpyHtoD(self.act[0], self.x0.ctypes.data, self.x0.nbytes), "x0")
        prm = Params(*self.ptrs, self.kv, *self.act, self.count, layers)
        args = np.array([ctypes.addressof(prm), self.wgu_arg.ctypes.data], np.uint64)
        _check(drv.cuMemsetD32Async(self.count, 0, 1, self.stream), "cuMemsetD32Async")
        if events:
            _check(drv.cuEventRecord(events[0], self.stream), "cuEventRecord")
        _check(drv.cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, smem, self.stream, args.ctypes.data, 0), "launch")
        if events:
            _check(drv.cuEventRecord(events[1], self.stream), "cuEventRecord")
        _check(drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        out = np.empty(HID, np.float32)
        _check(drv.cuMemcpyDtoH(out.ctypes.data, self.act[0], out.nbytes), "cuMemcpyDtoH")
        return out

    def reference(self, layers):
        """The probe's layers in float64 numpy, from the device's weights."""
        w = np.empty(sum(self.sizes) * self.L, np.float16)
        _check(drv.cuMemcpyDtoH(w.ctypes.data, self.w, w.nbytes), "weights")
        kv = self.kv_host.astype(np.float64).reshape(self.L, 2, NKV, POS, HD)

        def W(i, l, n, k):
            return w[self.offs[i] + l * n * k: self.offs[i] + (l + 1) * n * k].reshape(n, k).astype(np.float64)

        def rms(v):
            return v / np.sqrt(np.mean(v * v) + 1e-6)
        x = self.x0.astype(np.float64)
        for l in range(layers):
            q = W(0, l, NQKV, HID) @ rms(x)
            a = np.zeros(HID)
            for hd in range(NH):
                kh = hd // (NH // NKV)
                s = kv[l, 0, kh] @ q[hd * HD:(hd + 1) * HD] / np.sqrt(HD)
                p = np.exp(s - s.max())
                a[hd * HD:(hd + 1) * HD] = p / p.sum() @ kv[l, 1, kh]
            h = x + W(1, l, HID, HID) @ a
            n = rms(h)
            g, u = W(2, l, FF, HID) @ n, W(3, l, FF, HID) @ n
            x = h + W(4, l, HID, FF) @ (g / (1 + np.exp(-g)) * u)
        return x

    def time(self, f, grid, threads, smem, reps):
        """Median and best microseconds a layer over ``reps`` launches (the first left out)."""
        ev = [_check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        ts = []
        for _ in range(reps):
            self.launch(f, grid, threads, smem, self.L, ev)
            ts.append(_check(drv.cuEventElapsedTime(*ev), "cuEventElapsedTime"))
        return np.median(ts[1:]) * 1e3 / self.L, min(ts[1:]) * 1e3 / self.L

    def stream_us(self, g, reps=10):
        """Microseconds a layer to read the same weights with nothing between, and GB/s."""
        ev = [_check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        vals = [np.array([v], np.uint64) for v in (self.w, self.total // 8, self.out)]
        args = np.array([v.ctypes.data for v in vals], np.uint64)
        ts = []
        for _ in range(reps):
            _check(drv.cuEventRecord(ev[0], self.stream), "cuEventRecord")
            _check(drv.cuLaunchKernel(g, self.sms * 4, 1, 1, 512, 1, 1, 0, self.stream, args.ctypes.data, 0), "launch")
            _check(drv.cuEventRecord(ev[1], self.stream), "cuEventRecord")
            _check(drv.cuEventSynchronize(ev[1]), "cuEventSynchronize")
            ts.append(_check(drv.cuEventElapsedTime(*ev), "cuEventElapsedTime"))
        ms = np.median(ts[1:])
        return ms * 1e3 / self.L, self.total * 2 / ms / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--order", default="P0 P1 P0 P1 N0 N1 S8 S16 S5 S31 T31 P0 M1 P0 M1 MN P0 R1 P0 R1 RN")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    _load()
    probe = Probe(a.layers, a.seed)
    print(f"weights {probe.total * 2 / 1e9:.3f} GB, {probe.sms} SMs", flush=True)
    variants, stream = {}, None
    for spec in a.variants.split():
        name, v = spec.split(":")
        prefetch, barrier, threads, bps, *skip = map(int, v.split(","))
        ring, split = name[0] in "MR" or name[:2] == "SR", name[0] == "R" or name[:2] == "SR"
        defs = {"THREADS": threads, "BARRIER": barrier}
        if ring:
            defs.update({"SLOTS": 10, "SPLIT": bps, "RING_ONLY": skip[0] if skip else 0} if split
                        else {"SLOTS": threads // 32 - 1})
        else:
            defs.update({"PREFETCH": prefetch, "BPS": bps, "SKIP": skip[0] if skip else 0})
        f, smem, fit, g = probe.compile(defs, ring, "layers_split" if split else "layers")
        stream = stream or g
        if fit < (1 if ring else bps):
            print(f"  {name}: {fit} workgroups an SM fit, not {bps}: left out")
            continue
        variants[name] = (f, probe.sms * (1 if ring else bps), threads, smem, barrier)
    want = probe.reference(2)
    for name, (f, grid, threads, smem, barrier) in variants.items():
        if barrier and name[0] not in "ST":
            got = probe.launch(f, grid, threads, smem, 2).astype(np.float64)
            err = np.abs(got - want).max() / np.abs(want).max()
            # R sums a row's partials with shared-memory atomics, in no fixed order: not bit for bit
            same = name[0] == "R" or np.array_equal(probe.launch(f, NH, threads, smem, 2), got.astype(np.float32))
            print(f"  {name}: 2 layers within {err:.1e} of float64 (of the largest |x|); on 12 workgroups the same bits: {same}")
            assert err < 1e-3 and same, name
    if stream is not None:
        us, gbs = probe.stream_us(stream)
        print(f"the same weights streamed: {us:.2f} us a layer ({gbs:.0f} GB/s)", flush=True)
    for name in a.order.split():
        if name in variants:
            f, grid, threads, smem, _ = variants[name]
            med, best = probe.time(f, grid, threads, smem, a.reps)
            print(f"{name:4s} {grid} x {threads}: {med:.2f} us a layer (best {best:.2f}), "
                  f"{sum(probe.sizes) * 2 / med / 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
