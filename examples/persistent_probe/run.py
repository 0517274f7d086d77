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
SPLIT = BPS; SKIP 1: RING_ONLY), with S or T it is timed but not checked.  A name starting with K
runs ``tiled.cu`` (2026-12-04 (afternoon)): ``K..:KV,BARRIER,416,MODE[,RING_ONLY[,FLIGHT[,LMHEAD[,SLOTS[,SPLIT]]]]]``,
KV 1: K and V asked of L2 before the wait (KV_AHEAD), 2: with MODE 4 and up, attention reads them from
global memory (ATTN_GLOBAL), FLIGHT the chunks a producer keeps in flight (10: the whole ring),
LMHEAD 1: the final norm, the LM head and the argmax after the layers (timed as a step), SLOTS the
ring's (10; fewer leave room for K and V of a longer context, ``--positions``), SPLIT (MODE 4 and
up) each head's positions over that many workgroups (ATTN_SPLIT, at most 8), MODE
  1  attention a phase of its own on workgroup 0, as ring.cu
  2  every workgroup computes all heads itself (LOCAL_ATTN)
  3  no attention at all (NO_ATTN: timing only)
  4  a workgroup a query head, its K and V bulk-copied before the wait (ATTN_WG)
  5  4, the barrier's arrival one release-add (RELEASE)
  6  5, O's and down's residuals read before their chunks (RES_EARLY)
  7  6, the producer quiet while its workgroup waits at a grid barrier (QUIET)
  8  7, the SiLU·mul output in f16 (M_HALF)
  9  7, each head's attention run by the last QKV workgroup of its rows to arrive, no grid barrier
     between QKV and attention (FOLD_ATTN); 10: 9 with M_HALF
``--trace`` prints a K variant's timeline of one layer (one workgroup's steps, every workgroup's
arrivals).  Each variant with barriers is first checked over 2 layers against numpy in float64 and
(but R and K) against a run on 12 workgroups (the same rows in another split).
"""
import argparse
import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from engine.devices.cuda import _check, _cu, _cuda_include_dirs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HID, NQKV, FF, NH, NKV, HD, POS, VOC = 1536, 2048, 8960, 12, 2, 128, 32, 151936
SLOT = 18432
VARIANTS = ("P0:0,1,512,1 P1:1,1,512,1 N0:0,0,512,1 N1:1,0,512,1 S8:0,0,512,1,8 S16:0,0,512,1,16 "
            "S5:0,0,512,1,5 S31:0,0,512,1,31 T31:0,1,512,1,31 M1:0,1,352,1 MN:0,0,352,1 R1:0,1,416,1 "
            "RN:0,0,416,1 SR:0,0,416,1,1 R2:0,1,416,2 RM:0,0,416,2 K1:0,1,416,1 KA:1,1,416,1 KN:0,0,416,1 "
            "KS:0,0,416,1,1 KF2:0,1,416,1,0,2 KX:0,1,416,3,0,2 KL2:0,1,416,2,0,2 KW:0,1,416,4,0,2 "
            "K6:0,1,416,6,0,2 K7:0,1,416,7,0,2 K73:0,1,416,7,0,3 KWN:0,0,416,4,0,2 KWS:0,1,416,4,1,2")

drv = nv = None                  # cuda-python's driver and NVRTC, loaded once the options are read


def _load():
    global drv, nv
    drv, nv = _cu()


def source(ring: bool, tiled: bool = False) -> str:
    files = ["common.cuh", "ring.cu" if ring else "layers.cu"] + (["tiled.cu"] if tiled else [])
    return "".join(open(os.path.join(HERE, f)).read() for f in files)


# the tiled layout of tiled.cu: per phase (QKV, O, gate/up, down) K, KC (columns a chunk), RP (rows a workgroup)
TILES = ((HID, 384, 16), (HID, 768, 12), (HID, 64, 144), (FF, 768, 12))


class Params(ctypes.Structure):
    """``Params`` of common.cuh, passed by value."""
    _fields_ = [(n, ctypes.c_uint64) for n in ("wqkv", "wo", "wg", "wu", "wd", "kv", "x", "q", "a", "h", "m",
                                               "count")] + [("layers", ctypes.c_int)]


class LmArgs(ctypes.Structure):
    """``LmArgs`` of tiled.cu, passed by value: the LM head's tiled weight, the logits, the argmax."""
    _fields_ = [(n, ctypes.c_uint64) for n in ("w", "logits", "best")]


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
        self.count, self.out = self.alloc(4 * (1 + layers * NH)), self.alloc(4)   # the grid's, then each head's
        self.wgu_arg = np.array([self.wgu], np.uint64)
        self.modules = {}
        self.lm_head = False          # set while a LMHEAD variant runs

    def alloc(self, n):
        return int(_check(drv.cuMemAlloc(max(n, 4)), "cuMemAlloc"))

    def put(self, a):
        p = self.alloc(a.nbytes)
        _check(drv.cuMemcpyHtoD(p, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
        return p

    def host_weights(self):
        """The weights as the device holds them, [L x (qkv, o, gate, up, down)] f16, read once."""
        if getattr(self, "_host", None) is None:
            self._host = np.empty(sum(self.sizes) * self.L, np.float16)
            _check(drv.cuMemcpyDtoH(self._host.ctypes.data, self.w, self._host.nbytes), "weights")
        return self._host

    def W(self, i, l, n, k):
        """Layer l's weight i (0 qkv, 1 o, 2 gate, 3 up, 4 down) as an (n, k) f16 array."""
        return self.host_weights()[self.offs[i] + l * n * k: self.offs[i] + (l + 1) * n * k].reshape(n, k)

    def tiled(self):
        """The weights in tiled.cu's layout, on the device: per layer, per phase, per workgroup b of G a region
        of RP rows x K padded to chunks of KC columns, chunk j holding rows [lo, hi) x columns [j KC, j KC + kc)
        one row after another (kc = KC but the last).  Gate/up rows come in pairs, gate then up."""
        if getattr(self, "_tiled", None) is not None:
            return self._tiled
        G = self.sms
        region = [-(-k // kc) * rp * kc for k, kc, rp in TILES]          # halves
        layer = sum(region) * G
        self._tiled = self.alloc(layer * 2 * self.L)
        buf = np.zeros(layer, np.float16)
        for l in range(self.L):
            gu = np.empty((2 * FF, HID), np.float16)
            gu[0::2], gu[1::2] = self.W(2, l, FF, HID), self.W(3, l, FF, HID)
            mats = (self.W(0, l, NQKV, HID), self.W(1, l, HID, HID), gu, self.W(4, l, HID, FF))
            off = 0
            for (k, kc, rp), m, reg in zip(TILES, mats, region):
                n = m.shape[0] // 2 if m is gu else m.shape[0]
                for b in range(G):
                    lo, hi = n * b // G, n * (b + 1) // G
                    rows = m[2 * lo:2 * hi] if m is gu else m[lo:hi]
                    assert rows.shape[0] <= rp
                    base = off + b * reg
                    for j in range(0, k, kc):
                        blk = rows[:, j:j + kc]
                        buf[base + j // kc * rp * kc: base + j // kc * rp * kc + blk.size] = blk.reshape(-1)
                off += reg * G
            _check(drv.cuMemcpyHtoD(self._tiled + l * layer * 2, buf.ctypes.data, buf.nbytes), "tiled")
        return self._tiled

    def lm(self):
        """The LM head (VOC x HID f16, distinct random rows) in tiled.cu's layout (a workgroup's rows in blocks
        of 144, each block's chunks of 64 columns its rows one after another), its logits and argmax buffers."""
        if getattr(self, "_lm", None) is not None:
            return self._lm
        G, rp, kc = self.sms, 144, 64
        rng = np.random.default_rng(11)
        self.w_lm = np.concatenate([(rng.standard_normal((16384, HID), np.float32) * 0.03).astype(np.float16)
                                    for _ in range(-(-VOC // 16384))])[:VOC]
        blocks = -(-(-(-VOC // G)) // rp)
        region = blocks * (HID // kc) * rp * kc                                   # halves a workgroup
        buf = np.zeros(region * G, np.float16)
        for b in range(G):
            lo, hi = VOC * b // G, VOC * (b + 1) // G
            for bk in range(0, hi - lo, rp):
                rows = self.w_lm[lo + bk:min(hi, lo + bk + rp)]
                for j in range(0, HID, kc):
                    at = b * region + (bk // rp * (HID // kc) + j // kc) * rp * kc
                    buf[at:at + rows.shape[0] * kc] = rows[:, j:j + kc].reshape(-1)
        self._lm = LmArgs(self.put(buf), self.alloc(VOC * 4), self.alloc(8))
        self.lm_blocks = blocks
        return self._lm

    def check_lm(self, x):
        """The last launch's logits and argmax (after the layers giving ``x``) against float64."""
        lm = self.lm()
        got = np.empty(VOC, np.float32)
        _check(drv.cuMemcpyDtoH(got.ctypes.data, lm.logits, got.nbytes), "logits")
        best = np.empty(1, np.uint64)
        _check(drv.cuMemcpyDtoH(best.ctypes.data, lm.best, 8), "best")
        n = x / np.sqrt(np.mean(x * x) + 1e-6)
        want = np.concatenate([self.w_lm[i:i + 16384].astype(np.float64) @ n for i in range(0, VOC, 16384)])
        err = np.abs(got - want).max() / np.abs(want).max()
        top = 0xffffffff - int(best[0] & 0xffffffff)
        print(f"    the LM head within {err:.1e} of float64; argmax {top}, float64's {int(np.argmax(want))}")
        assert err < 1e-3 and (top == np.argmax(want) or want[top] >= want.max() - 2e-3 * np.abs(want).max())

    def compile(self, defs: dict, ring: bool, entry: str = "layers", tiled: bool = False):
        """The ``layers`` function of the variant and its dynamic shared memory."""
        prog = _check(nv.nvrtcCreateProgram(source(ring, tiled).encode(), b"probe.cu", 0, [], []), "nvrtcCreateProgram")
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
        split = defs.get("ATTN_SPLIT") or 1          # K and V of a split's positions and the partial rows, copied in
        kv = 4 * -(-POS // split) * HD + 4 * 12 * HD if defs.get("ATTN_WG") and not defs.get("ATTN_GLOBAL") else 0
        smem = (defs["SLOTS"] * SLOT if ring else 0) + max(FF * 4, kv)    # the ring, the activation (or K and V)
        fa = drv.CUfunction_attribute
        _check(drv.cuFuncSetAttribute(f, fa.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "smem")
        regs = _check(drv.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_NUM_REGS, f), "regs")
        local = _check(drv.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "local")
        fit = _check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, defs["THREADS"], smem), "occupancy")
        print(f"  {defs}: {regs} registers, {local} bytes of local memory, {fit} workgroups an SM fit", flush=True)
        self.modules[f] = mod
        return f, smem, fit, (None if ring else _check(drv.cuModuleGetFunction(mod, b"stream_sum"), "stream_sum"))

    def launch(self, f, grid, threads, smem, layers, events=None, tiled=False):
        _check(drv.cuMemcpyHtoD(self.act[0], self.x0.ctypes.data, self.x0.nbytes), "x0")
        prm = Params(*self.ptrs, self.kv, *self.act, self.count, layers)
        extra = np.array([self.tiled()], np.uint64) if tiled else self.wgu_arg
        args = [ctypes.addressof(prm), extra.ctypes.data]
        if tiled:
            lm = self.lm() if self.lm_head else LmArgs(0, 0, 0)
            args.append(ctypes.addressof(lm))
            if self.lm_head:
                _check(drv.cuMemsetD32Async(lm.best, 0, 2, self.stream), "cuMemsetD32Async")
        args = np.array(args, np.uint64)
        _check(drv.cuMemsetD32Async(self.count, 0, 1 + self.L * NH, self.stream), "cuMemsetD32Async")
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
        kv = self.kv_host.astype(np.float64).reshape(self.L, 2, NKV, POS, HD)

        def W(i, l, n, k):
            return self.W(i, l, n, k).astype(np.float64)

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

    def time(self, f, grid, threads, smem, reps, tiled=False):
        """Median and best microseconds a layer over ``reps`` launches (the first left out)."""
        ev = [_check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        ts = []
        for _ in range(reps):
            self.launch(f, grid, threads, smem, self.L, ev, tiled)
            ts.append(_check(drv.cuEventElapsedTime(*ev), "cuEventElapsedTime"))
        return np.median(ts[1:]) * 1e3 / self.L, min(ts[1:]) * 1e3 / self.L

    def print_trace(self, name, f):
        """tiled.cu's TRACE timeline of the last launch of f: microseconds from the layer's start."""
        ptr, size = _check(drv.cuModuleGetGlobal(self.modules[f], b"trace_clk"), "trace_clk")
        tr = np.empty(size // 8, np.uint64)
        _check(drv.cuMemcpyDtoH(tr.ctypes.data, ptr, size), "trace")
        g0, c0, g1, c1 = (int(v) for v in tr[640:644])
        us = lambda c: (int(c) - c0) * (g1 - g0) / 1e3 / (c1 - c0)    # noqa: E731
        print(f"{name}: one workgroup's layer, {(g1 - g0) / 1e3:.2f} us ({(c1 - c0) / (g1 - g0):.2f} GHz); "
              "per phase, us from the layer's start: staged | first chunk in | last chunk in (chunks) | done | "
              "partials | stored | past the wait; producer's issues: first, last")
        nch = (4, 0, 2, 24, 12)
        for ph, pname in enumerate(("QKV", "attention", "O", "gate/up", "down")):
            c = tr[ph * 64:(ph + 1) * 64]
            row = f"  {pname:9s}"
            if nch[ph]:
                pr = tr[320 + ph * 64: 320 + ph * 64 + nch[ph]]
                row += (f" {us(c[1]):6.2f} | {us(c[2]):6.2f} | {us(c[1 + nch[ph]]):6.2f} ({nch[ph]:2d}) | {us(c[60]):6.2f} | "
                        f"{us(c[61]):6.2f} |")
                tail = f" | producer {us(pr[0]):6.2f} {us(pr[-1]):6.2f}"
            else:
                row += " " * 55 + "|"
                tail = ""
            print(row + f" {us(c[62]):6.2f} | {us(c[63]):6.2f}" + tail)
        ptr, size = _check(drv.cuModuleGetGlobal(self.modules[f], b"trace_all"), "trace_all")
        ta = np.empty(size // 8, np.int64)
        _check(drv.cuMemcpyDtoH(ta.ctypes.data, ptr, size), "trace_all")
        ta = (ta[:self.sms * 10].reshape(self.sms, 5, 2) - g0) / 1e3
        print("  every workgroup, us from the layer's start: stored min / median / max (the 6 last), past the wait min / max")
        for ph, pname in enumerate(("QKV", "attention", "O", "gate/up", "down")):
            st, pw = ta[:, ph, 0], ta[:, ph, 1]
            last = ",".join(str(b) for b in np.argsort(st)[-6:][::-1])
            print(f"  {pname:9s} {st.min():6.2f} / {np.median(st):6.2f} / {st.max():6.2f} ({last}), {pw.min():6.2f} / {pw.max():6.2f}")

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
    ap.add_argument("--order", default="P0 R1 K1 KF2 KW K7 K1 KF2 KW K7 R1 P0 KX KL2 K6 K73 KWN KWS")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--trace", action="store_true", help="K variants: print one workgroup's timeline of a layer")
    ap.add_argument("--trace-wg", type=int, default=5, help="the workgroup --trace follows")
    ap.add_argument("--positions", type=int, default=32, help="cached positions (K variants with MODE 4 and up; "
                    "the attention of P, M and R needs 32)")
    a = ap.parse_args(argv)
    global POS
    POS = a.positions
    _load()
    probe = Probe(a.layers, a.seed)
    print(f"weights {probe.total * 2 / 1e9:.3f} GB, {probe.sms} SMs", flush=True)
    variants, stream, defs_of = {}, None, {}
    for spec in a.variants.split():
        name, v = spec.split(":")
        prefetch, barrier, threads, bps, *skip = map(int, v.split(","))
        tiled = name[0] == "K"
        ring, split = name[0] in "MRK" or name[:2] == "SR", name[0] in "RK" or name[:2] == "SR"
        defs = {"THREADS": threads, "BARRIER": barrier, "POS": POS}
        if ring:
            defs.update({"SLOTS": 10, "SPLIT": bps, "RING_ONLY": skip[0] if skip else 0} if split
                        else {"SLOTS": threads // 32 - 1})
            if tiled:
                defs.update({"KV_AHEAD": int(prefetch == 1), "ATTN_GLOBAL": int(prefetch == 2), "TRACE": int(a.trace), "TRACE_WG": a.trace_wg, "SPLIT": 1,
                             "LOCAL_ATTN": int(bps == 2), "FLIGHT": skip[1] if len(skip) > 1 else 10, "NO_ATTN": int(bps == 3),
                             "ATTN_WG": int(bps >= 4), "RELEASE": int(bps >= 5),
                             "RES_EARLY": int(bps >= 6), "QUIET": int(bps >= 7),
                             "M_HALF": int(bps in (8, 10)), "FOLD_ATTN": int(bps >= 9),
                             "LMHEAD": skip[2] if len(skip) > 2 else 0})
                defs["SLOTS"] = skip[3] if len(skip) > 3 else 10
                defs["ATTN_SPLIT"] = skip[4] if len(skip) > 4 else 0
                if defs["LMHEAD"]:
                    probe.lm()
                    defs["LM_BLOCKS"] = probe.lm_blocks
        else:
            defs.update({"PREFETCH": prefetch, "BPS": bps, "SKIP": skip[0] if skip else 0})
        entry = "layers_tiled" if tiled else "layers_split" if split else "layers"
        f, smem, fit, g = probe.compile(defs, ring, entry, tiled)
        stream = stream or g
        if fit < (1 if ring else bps):
            print(f"  {name}: {fit} workgroups an SM fit, not {bps}: left out")
            continue
        defs_of[name] = defs
        variants[name] = (f, probe.sms * (1 if ring else bps), threads, smem, barrier, tiled)
    want = probe.reference(2)
    for name, (f, grid, threads, smem, barrier, tiled) in variants.items():
        probe.lm_head = bool(defs_of[name].get("LMHEAD"))
        if barrier and name[0] not in "ST" and not defs_of[name].get("NO_ATTN") and not defs_of[name].get("RING_ONLY"):
            got = probe.launch(f, grid, threads, smem, 2, tiled=tiled).astype(np.float64)
            err = np.abs(got - want).max() / np.abs(want).max()
            # R sums a row's partials with shared-memory atomics, in no fixed order: not bit for bit;
            # K's layout is cut for the full grid, so it runs on no other
            same = name[0] in "RK" or np.array_equal(probe.launch(f, NH, threads, smem, 2), got.astype(np.float32))
            print(f"  {name}: 2 layers within {err:.1e} of float64 (of the largest |x|); on 12 workgroups the same bits: {same}")
            assert err < 1e-3 and same, name
            if probe.lm_head:
                probe.check_lm(want)
    if stream is not None:
        us, gbs = probe.stream_us(stream)
        print(f"the same weights streamed: {us:.2f} us a layer ({gbs:.0f} GB/s)", flush=True)
    for name in a.order.split():
        if name in variants:
            f, grid, threads, smem, _, tiled = variants[name]
            probe.lm_head = bool(defs_of[name].get("LMHEAD"))
            med, best = probe.time(f, grid, threads, smem, a.reps, tiled)
            if probe.lm_head:
                step = med * probe.L
                print(f"{name:4s} {grid} x {threads}: {step:.1f} us a step of {probe.L} layers and the LM head (best "
                      f"{best * probe.L:.1f}): {1e6 / step:.0f} tok/s", flush=True)
            else:
                print(f"{name:4s} {grid} x {threads}: {med:.2f} us a layer (best {best:.2f}), "
                      f"{sum(probe.sizes) * 2 / med / 1e3:.0f} GB/s", flush=True)
    if a.trace:
        for name, (f, *_, tiled) in variants.items():
            if tiled:
                probe.print_trace(name, f)




if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:                      # no GPU or no cuda-python: one line, not a traceback
        sys.exit(f"error: {str(e).splitlines()[0]}")
