"""Quantized weight formats: the GGUF block layouts q4_0, q4_1 and q8_0, and ``QArray``, the host
array that holds a quantized weight.

A quantized matrix [N, K] is stored as N rows of K / 32 blocks; a block holds 32 consecutive
elements of one row (the layouts of ggml's ``block_q4_0``, ``block_q4_1``, ``block_q8_0``; the
authority is the ``gguf`` package's ``gguf.quants``)::

    q4_0  18 bytes: d f16, qs[16]          x[j] = d * ((qs[j % 16] >> 4 * (j >= 16) & 15) - 8)
    q4_1  20 bytes: d f16, m f16, qs[16]   x[j] = d * (qs[j % 16] >> 4 * (j >= 16) & 15) + m
    q8_0  34 bytes: d f16, qs[32] int8     x[j] = d * qs[j]
    gptq_int4  20 bytes: d f16, z f16, qs[16]   x[j] = d * ((qs[j % 16] >> 4 * (j >= 16) & 15) - z)

(products in float32, as ``gguf.quants.dequantize`` computes them).  ``gptq_int4`` is ours, for
GPTQ checkpoints (``from_gptq``): the group's scale ``d`` and its zero point ``z`` (an integer,
exact in f16) are copied into each of the group's blocks.

Kernels read the *device layout* of the same bytes: the quants of every block first (16 or 32
bytes per block, so that each block's quants are one or two aligned 16-byte loads), then the
scales of every block (``d``, or ``d, m``), both in block order.  ``to_device_layout`` and
``from_device_layout`` convert; no value changes.

``quantize`` writes the bytes llama.cpp's reference quantizer writes (``quantize_row_q4_0_ref``
and friends in ggml-quants.c; ``gguf.quants.quantize`` is its numpy copy and our test oracle).
All arithmetic is float32 in this order, with ``inv = 1 / d`` (0 where ``d == 0``)::

    q4_0  a = the element of largest |x| (the first on ties)   d = a / -8
          q = min(15, trunc(x * inv + 8.5))
    q4_1  d = (max - min) / 15, m = min                         q = min(15, trunc((x - m) * inv + 0.5))
    q8_0  d = max |x| / 127                                     q = round(x * inv), halves away from 0

and ``d``, ``m`` stored as f16 (round to nearest even).  Where the reference converts inf or NaN
to an integer (a block whose ``1 / d`` overflows float32, below about 2e-38, or a q4_1 range
beyond float32) the quant is 0, as x86's conversion makes it there.

GPTQ: the safetensors tensors of AutoGPTQ / GPTQModel checkpoints (``gptq_dequantize``, the
reference) become ``gptq_int4`` arrays through ``from_gptq``, an integer repack.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32                                  # elements per block, every format


@dataclass(frozen=True)
class Format:
    name: str
    quant_bytes: int                        # bytes of quants per block
    scale_bytes: int                        # bytes of scales per block (d, or d and m)

    @property
    def block_bytes(self):
        return self.quant_bytes + self.scale_bytes


FORMATS = {
    "q4_0": Format("q4_0", 16, 2),
    "q4_1": Format("q4_1", 16, 4),
    "q8_0": Format("q8_0", 32, 2),
    "gptq_int4": Format("gptq_int4", 16, 4),
}
QUANT_DTYPES = tuple(FORMATS)
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0")     # ggml's block formats: the ones ``quantize`` writes


def nbytes(fmt: str, n: int) -> int:
    """Bytes of ``n`` elements (a multiple of 32) in format ``fmt``."""
    return n // BLOCK * FORMATS[fmt].block_bytes


def storage(dtype: str, shape) -> tuple:
    """(shape, numpy dtype) of the memory that holds an array of ``dtype`` and ``shape`` on a
    device: a quantized array is its bytes, uint8 [nbytes]; others are themselves."""
    if dtype in FORMATS:
        return (nbytes(dtype, int(np.prod(shape, dtype=np.int64))),), np.dtype(np.uint8)
    from .core import NP_DTYPES
    return tuple(shape), np.dtype(NP_DTYPES[dtype])


def _blocks(fmt, data):
    """The raw GGUF bytes as [n_blocks, block_bytes] uint8."""
    f = FORMATS[fmt]
    return np.ascontiguousarray(data, np.uint8).reshape(-1, f.block_bytes)


def first_bad_scale(fmt: str, data: np.ndarray) -> int:
    """The index of the first block of GGUF blocks ``data`` (uint8, ``fmt`` q4_0 / q4_1 / q8_0) whose
    f16 scale (``d``, and ``m`` for q4_1) is NaN or infinite, or -1 when every one is finite.  The
    scales are read in place, a strided view of the bytes (no copy of the quants)."""
    f = FORMATS[fmt]
    block = np.dtype([("scales", "<u2", (f.scale_bytes // 2,)), ("quants", f"V{f.quant_bytes}")])
    halves = np.asarray(data).reshape(-1).view(np.uint8).view(block)["scales"]   # GGUF blocks open with them
    bad = (halves & 0x7C00) == 0x7C00                          # exponent all ones: inf or NaN
    if not bad.any():
        return -1
    return int(np.flatnonzero(bad.reshape(len(halves), -1).any(axis=1))[0])


def dequantize_blocks(fmt: str, data: np.ndarray) -> np.ndarray:
    """float32 [n_blocks * 32] values of GGUF blocks ``data`` (uint8, any shape, n_blocks *
    block_bytes bytes), equal bit for bit to ``gguf.quants.dequantize`` (for gptq_int4, to
    ``gptq_dequantize``)."""
    b = _blocks(fmt, data)
    f = FORMATS[fmt]
    d = b[:, :2].copy().view(np.float16).astype(np.float32)                     # [nb, 1]
    qs = b[:, f.scale_bytes:]
    if fmt == "q8_0":
        return (qs.view(np.int8).astype(np.float32) * d).reshape(-1)
    q = np.concatenate([qs & 15, qs >> 4], axis=1)                              # elements 0..15, 16..31
    if fmt == "q4_0":
        return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(-1)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    if fmt == "gptq_int4":
        return (d * (q.astype(np.float32) - m)).reshape(-1)
    return (d * q.astype(np.float32) + m).reshape(-1)


def to_device_layout(fmt: str, data: np.ndarray) -> np.ndarray:
    """GGUF blocks -> the device layout (all quants, then all scales): uint8 of the same size."""
    b = _blocks(fmt, data)
    f = FORMATS[fmt]
    return np.concatenate([b[:, f.scale_bytes:].reshape(-1), b[:, :f.scale_bytes].reshape(-1)])


def from_device_layout(fmt: str, dev: np.ndarray) -> np.ndarray:
    """The inverse of ``to_device_layout``: GGUF blocks as uint8 [n_blocks * block_bytes]."""
    f = FORMATS[fmt]
    dev = np.ascontiguousarray(dev, np.uint8).reshape(-1)
    nb = dev.size // f.block_bytes
    qs = dev[:nb * f.quant_bytes].reshape(nb, f.quant_bytes)
    sc = dev[nb * f.quant_bytes:].reshape(nb, f.scale_bytes)
    return np.concatenate([sc, qs], axis=1).reshape(-1)


def _inverse(d):
    """1 / d in float32, 0 where d == 0 (overflow to inf is kept, as in the reference)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _to_int(v, lo, hi):
    """Integers of float32 ``v`` (already truncated or rounded) clipped to [lo, hi]; a
    non-finite ``v`` gives 0, as the reference's float-to-int conversion gives on x86."""
    return np.clip(np.where(np.isfinite(v), v, 0), lo, hi)


def _f16_bytes(v):
    """float32 [nb] -> its f16 as uint8 [nb, 2] (round to nearest even, overflow to inf)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _nibbles(q):
    """[nb, 32] values 0..15 -> [nb, 16] bytes: element j in the low nibble of byte j, element
    j + 16 in its high nibble."""
    q = q.astype(np.uint8)
    return q[:, :16] | q[:, 16:] << 4


def _quantize_q4_0(b):
    a = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]                        # [nb], signed
    d = a / np.float32(-8)
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.trunc(b * _inverse(d)[:, None] + np.float32(8.5))
    return _f16_bytes(d), _nibbles(_to_int(v, 0, 15))


def _quantize_q4_1(b):
    lo, hi = b.min(axis=1), b.max(axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        d = (hi - lo) / np.float32(15)
        v = np.trunc((b - lo[:, None]) * _inverse(d)[:, None] + np.float32(0.5))
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo)], axis=1), _nibbles(_to_int(v, 0, 15))


def _quantize_q8_0(b):
    d = np.abs(b).max(axis=1) / np.float32(127)
    with np.errstate(invalid="ignore", over="ignore"):
        v = b * _inverse(d)[:, None]
        t = np.trunc(v)
        v = t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0)                # halves away from 0
    return _f16_bytes(d), _to_int(v, -127, 127).astype(np.int8).view(np.uint8)


_QUANTIZERS = {"q4_0": _quantize_q4_0, "q4_1": _quantize_q4_1, "q8_0": _quantize_q8_0}
_CHUNK = 4096                               # blocks quantized at a time (512 KiB of float32)


def quantize(fmt: str, x, strict: bool = False) -> "QArray":
    """Quantize a float array ``x`` (any float dtype, converted to float32 first; last axis a
    multiple of 32) to ``fmt`` ("q4_0", "q4_1", "q8_0"): a ``QArray`` of ``x``'s shape whose
    bytes equal ``gguf.quants.quantize``'s (the rules are in the module docstring).

    Raises ValueError for an unknown format, a last axis that is not a multiple of 32, a value
    that is not finite in float32, or (``strict``) a block whose scale passes f16's range, naming
    the index; without ``strict`` such a block's scale is inf, as gguf's quantizer writes it."""
    if fmt not in GGUF_FORMATS:
        what = ("gptq_int4 weights come from GPTQ checkpoints (from_gptq), not from this quantizer"
                if fmt in FORMATS else f"unknown quantized format {fmt!r}")
        raise ValueError(f"{what}; quantize to one of {', '.join(GGUF_FORMATS)}")
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"{fmt} quantizes blocks of {BLOCK} along the last axis; shape {list(x.shape)} "
                         f"needs a last axis that is a multiple of {BLOCK} (pad it)")
    blocks = x.reshape(-1, BLOCK)
    out = np.empty((len(blocks), FORMATS[fmt].block_bytes), np.uint8)
    for start in range(0, len(blocks), _CHUNK):                              # cache-sized pieces
        with np.errstate(over="ignore"):
            b = blocks[start:start + _CHUNK].astype(np.float32)
        if not np.isfinite(b).all():
            i = np.unravel_index(start * BLOCK + np.flatnonzero(~np.isfinite(b))[0], x.shape)
            raise ValueError(f"cannot quantize to {fmt}: x{[int(j) for j in i]} = {x[i]} is not finite "
                             "in float32; quantized formats hold finite values only")
        scales, quants = _QUANTIZERS[fmt](b)
        halves = scales.copy().view(np.float16)                              # d (and m): f16 each
        if strict and not np.isfinite(halves).all():
            blk = start + int(np.flatnonzero(~np.isfinite(halves).all(axis=1))[0])
            i = np.unravel_index(blk * BLOCK + int(np.argmax(np.abs(b[blk - start]))), x.shape)
            raise ValueError(f"cannot quantize to {fmt}: the block of x{[int(j) for j in i]} = {x[i]} needs a "
                             "scale beyond f16's range (65504); scale the tensor down or keep it in float")
        out[start:start + _CHUNK] = np.concatenate([scales, quants], axis=1)
    return QArray(out.reshape(-1), x.shape, fmt)


class QArray:
    """A quantized array: logical ``shape`` (its last axis a multiple of 32), ``dtype`` the format
    name ("q4_0", "q4_1", "q8_0", "gptq_int4"), ``data`` the GGUF blocks as uint8 (row-major blocks; a
    memory map of a GGUF file works as it is).

    ``QArray.quantize(x, fmt)`` quantizes a float array; ``dequantize()`` gives float32 values;
    ``device_bytes()`` the bytes kernels read (``to_device_layout``), computed once.

    Raises ValueError for an unknown format, a last axis that is not a multiple of 32, or data
    of the wrong size."""

    def __init__(self, data, shape, dtype):
        if dtype not in FORMATS:
            raise ValueError(f"unknown quantized format {dtype!r}; use one of {', '.join(FORMATS)}")
        if any(int(d) != d or d < 0 for d in shape):
            raise ValueError(f"a {dtype} array's shape must be whole non-negative sizes, got {list(shape)}")
        shape = tuple(int(d) for d in shape)
        if not shape or shape[-1] % BLOCK:
            raise ValueError(f"a {dtype} array needs a last axis that is a multiple of {BLOCK}, got shape {list(shape)}")
        n = int(np.prod(shape, dtype=np.int64))
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.size != nbytes(dtype, n):
            raise ValueError(f"{dtype} data for shape {list(shape)} must be {nbytes(dtype, n)} uint8 bytes, "
                             f"got {data.size} {data.dtype}")
        self._data, self.shape, self.dtype = data, shape, dtype
        self._device = None

    @classmethod
    def from_device(cls, dev, shape, dtype) -> "QArray":
        """A QArray from bytes in the device layout (``to_device_layout``); ``data`` is made from
        them when it is first read."""
        q = cls(np.zeros(nbytes(dtype, int(np.prod(shape, dtype=np.int64))), np.uint8), shape, dtype)
        dev = np.ascontiguousarray(dev, np.uint8).reshape(-1)
        if dev.size != q._data.size:
            raise ValueError(f"{dtype} device bytes for shape {list(shape)} must be {q._data.size}, got {dev.size}")
        q._data, q._device = None, dev
        return q

    @property
    def data(self) -> np.ndarray:
        """The GGUF blocks, uint8."""
        if self._data is None:
            self._data = from_device_layout(self.dtype, self._device)
        return self._data

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self):
        return nbytes(self.dtype, self.size)

    @classmethod
    def quantize(cls, x, fmt: str, sym: bool = True) -> "QArray":
        """``quantize(fmt, x)``: float array ``x`` quantized to ``fmt``, bytes equal to gguf's.  For
        "gptq_int4", a GPTQ checkpoint of ``x`` [N, K] by round to nearest (``gptq_quantize``: groups of
        32 in order, symmetric or not by ``sym``; rows padded to GPTQ's multiple of 8, then dropped),
        repacked by ``from_gptq``: for tests and examples, not quality."""
        if fmt != "gptq_int4":
            return quantize(fmt, x)
        x = np.asarray(x, np.float32)
        n = x.shape[0]
        parts = gptq_quantize(np.pad(x, ((0, -n % 8), (0, 0))), 32, sym=sym)
        return from_gptq(*parts, sym=sym)[0].take_rows(np.arange(n))

    def dequantize(self) -> np.ndarray:
        """float32 values of ``shape`` (bit for bit ``gguf.quants.dequantize``)."""
        return dequantize_blocks(self.dtype, self.data).reshape(self.shape)

    def device_bytes(self) -> np.ndarray:
        """The device layout (see the module docstring), uint8, computed once and kept."""
        if self._device is None:
            self._device = to_device_layout(self.dtype, self.data)
        return self._device

    def take_rows(self, rows) -> "QArray":
        """Rows ``rows`` of the leading axis (e.g. a permutation), still quantized."""
        per_row = nbytes(self.dtype, self.size // self.shape[0])
        rows = np.asarray(rows)
        if rows.size and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
            raise IndexError(f"take_rows: rows {rows.min()}..{rows.max()} are outside the {self.shape[0]} rows of "
                             f"this {self.dtype}{list(self.shape)}")
        data = np.asarray(self.data).reshape(self.shape[0], per_row)[rows]
        return QArray(data.reshape(-1), (len(rows),) + self.shape[1:], self.dtype)

    def __repr__(self):
        return f"QArray({self.dtype}{list(self.shape)}, {self.nbytes} bytes)"


def random_qarray(shape, fmt: str, seed: int = 0, scale: float = 0.02) -> QArray:
    """Random quantized weights of ``shape`` for benchmarks (speed depends on bytes, not values):
    uniform random quants, block scales that give values of about +-``scale``."""
    rng = np.random.default_rng(seed)
    f, nb = FORMATS[fmt], int(np.prod(shape, dtype=np.int64)) // BLOCK
    quants = np.frombuffer(rng.bytes(nb * f.quant_bytes), np.uint8)
    d = (scale / (127 if fmt == "q8_0" else 8) * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    m = (-8 * d).astype(np.float16) if fmt == "q4_1" else np.full(nb, 8, np.float16)     # gptq_int4: z = 8
    scales = d[:, None] if f.scale_bytes == 2 else np.stack([d, m], axis=1)
    return QArray.from_device(np.concatenate([quants, scales.view(np.uint8).reshape(-1)]), shape, fmt)


# --- GPTQ (AutoGPTQ / GPTQModel safetensors) -----------------------------------------------------

GPTQ_FORMATS = ("gptq", "gptq_v2")


def _unpack(packed, bits, axis):
    """int32 words -> their 32 / bits fields (lowest bits first), unpacked along ``axis`` (0 or 1)
    as int32: [R, C] -> [R * 32 / bits, C] or [R, C * 32 / bits]."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    w = np.ascontiguousarray(packed).view(np.uint32)
    if axis == 0:
        fields = w[:, None, :] >> shifts[None, :, None]                          # [R, per, C]
        shape = (w.shape[0] * per, w.shape[1])
    else:
        fields = w[:, :, None] >> shifts[None, None, :]                          # [R, C, per]
        shape = (w.shape[0], w.shape[1] * per)
    return (fields & np.uint32((1 << bits) - 1)).astype(np.int32).reshape(shape)


def _pack(values, bits, axis):
    """The inverse of ``_unpack``: values 0 .. 2**bits - 1 -> int32 words, packed along ``axis``."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    v = np.asarray(values).astype(np.uint32)
    if axis == 0:
        words = np.bitwise_or.reduce(v.reshape(-1, per, v.shape[1]) << shifts[None, :, None], axis=1)
    else:
        words = np.bitwise_or.reduce(v.reshape(v.shape[0], -1, per) << shifts[None, None, :], axis=2)
    return words.view(np.int32)


def _gptq_fields(qweight, qzeros, scales, g_idx, bits, sym, checkpoint_format):
    """Check a GPTQ layer (see ``gptq_dequantize``) and unpack its zeros: qweight uint32 [K / F, N],
    zero int32 [G, N] (the zero point itself, whatever the checkpoint format), scales f16 [G, N],
    g_idx int64 [K]."""
    if bits not in (2, 4, 8):
        raise ValueError(f"GPTQ bits must be 2, 4 or 8 (fields that tile an int32), got {bits!r}")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; use 'gptq' or 'gptq_v2'")
    qweight, qzeros, scales = (np.asarray(a) for a in (qweight, qzeros, scales))
    per = 32 // bits
    for name, a in (("qweight", qweight), ("qzeros", qzeros)):
        if a.ndim != 2 or a.dtype not in (np.int32, np.uint32):
            raise ValueError(f"GPTQ {name} must be a 2-D int32 array, got {a.dtype}{list(a.shape)}")
    if scales.dtype != np.float16:                 # a checkpoint's scales are f16; others would round silently
        raise ValueError(f"GPTQ scales must be float16, as checkpoints store them, got {scales.dtype}")
    K, N = qweight.shape[0] * per, qweight.shape[1]
    G = scales.shape[0] if scales.ndim == 2 else -1
    g_idx = np.arange(K) * G // K if g_idx is None else np.asarray(g_idx)       # None: groups in order
    if scales.shape != (G, N) or qzeros.shape != (G, N // per) or N % per or g_idx.shape != (K,):
        raise ValueError(f"GPTQ shapes do not fit together: qweight {list(qweight.shape)}, qzeros "
                         f"{list(qzeros.shape)}, scales {list(scales.shape)}, g_idx {list(g_idx.shape)}; "
                         f"expected [K/{per}, N], [G, N/{per}], [G, N], [K]")
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= G):
        raise ValueError(f"GPTQ g_idx must lie in 0..{G - 1} (one per group of scales), got "
                         f"{g_idx.min()}..{g_idx.max()}")
    zero = _unpack(qzeros, bits, axis=1) + (checkpoint_format == "gptq")          # [G, N]
    if sym and (zero != 1 << (bits - 1)).any():
        raise ValueError(f"a symmetric GPTQ checkpoint ({checkpoint_format}) has zeros "
                         f"{1 << (bits - 1)}, but these range {zero.min()}..{zero.max()}; "
                         "check 'sym' and 'checkpoint_format' in quantize_config.json")
    return np.ascontiguousarray(qweight).view(np.uint32), zero, scales, g_idx.astype(np.int64)


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits=4, sym=True, checkpoint_format="gptq") -> np.ndarray:
    """float32 [N, K] (PyTorch's [out, in] layout) of a GPTQ-quantized linear layer.

    The tensors of an AutoGPTQ / GPTQModel safetensors checkpoint, for K inputs, N outputs and
    G groups (G = K / group_size, or 1 for group_size -1), with F = 32 / bits fields per int32
    word, lowest bits first:

    - ``qweight`` int32 [K / F, N]: q[k, n] is field k % F of qweight[k // F, n] (packed along K);
    - ``qzeros``  int32 [G, N / F]: z[g, n] is field n % F of qzeros[g, n // F] (packed along N);
    - ``scales``  f16 [G, N];
    - ``g_idx``   int32 [K]: the group of input k (k // group_size, or with ``desc_act`` the group
      of k's place in the activation order, so not sorted); None for k // (K / G).

    ``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with ``g = g_idx[k]``, in float32 (exact:
    an f16 times a small integer).  ``checkpoint_format`` "gptq" (AutoGPTQ's, GPTQModel's v1)
    stores ``zero - 1``, so ``zero = z + 1``; "gptq_v2" (GPTQModel) stores ``zero = z``.  A
    symmetric checkpoint (``sym``) has ``zero = 2**(bits - 1)`` everywhere, which is checked.
    Sources: AutoGPTQ's ``QuantLinear.pack``/``forward`` (auto_gptq/nn_modules/qlinear) and
    GPTQModel's v1/v2 conversion (gptqmodel/utils/model.py).

    Raises ValueError for bits other than 2, 4, 8, an unknown ``checkpoint_format``, shapes or
    dtypes that do not fit together, a ``g_idx`` out of range, or a symmetric checkpoint whose
    zeros are not 2**(bits - 1)."""
    qweight, zero, scales, g = _gptq_fields(qweight, qzeros, scales, g_idx, bits, sym, checkpoint_format)
    q = _unpack(qweight, bits, axis=0)                                            # [K, N]
    w = scales.astype(np.float32)[g] * (q - zero[g]).astype(np.float32)        # [K, N]
    return np.ascontiguousarray(w.T)


def _repack_words(qweight):
    """GPTQ 4-bit words [K / 8, N] (element 8r + i in nibble i of word r) -> our quant bytes
    [N * K / 32, 16] (``_nibbles`` of each row's blocks), without unpacking: per block of a row,
    words 0, 1 hold elements 0..15 and words 2, 3 elements 16..31, so byte j joins nibble j % 8
    of word j // 8 (low) and of word 2 + j // 8 (high)."""
    w = np.ascontiguousarray(qweight.T).reshape(-1, 4)                            # [N * K / 32, 4]
    lo, hi, m = w[:, :2], w[:, 2:], np.uint32(0x0F0F0F0F)
    even = (lo & m) | (hi & m) << 4                  # byte i: nibbles 2i of lo (low) and of hi (high)
    odd = (lo >> 4 & m) | (hi >> 4 & m) << 4         # byte i: nibbles 2i + 1
    pairs = np.stack([even.view(np.uint8).reshape(-1, 2, 4), odd.view(np.uint8).reshape(-1, 2, 4)], axis=-1)
    return pairs.reshape(-1, 16)                                                  # byte 8p + 2i + parity


def from_gptq(qweight, qzeros, scales, g_idx, bits=4, sym=True, checkpoint_format="gptq"):
    """A GPTQ layer (the tensors ``gptq_dequantize`` describes) as a ``QArray`` of format
    ``gptq_int4`` [N, K], and the column order ``perm``: returns ``(w, perm)``.

    An integer repack, no float arithmetic: each 32-element block of a row takes its 32 quants
    and its group's scale and zero point (copied into every block of the group), so
    ``w.dequantize()`` holds ``scales[g, n] * (q - zero[g, n])`` exactly as ``gptq_dequantize``.
    Without ``desc_act`` (``g_idx`` sorted, or None) the columns stay in order and ``perm`` is
    None.  With it, the columns are sorted by group (a stable argsort of ``g_idx``) so that each
    group is contiguous, and ``perm`` (int32 [K]) says which input column each weight column
    reads: ``x @ W.T == x[..., perm] @ w.dequantize().T``, and ``w.dequantize()[:, argsort(perm)]``
    equals ``gptq_dequantize(...)`` bit for bit.

    Raises ValueError as ``gptq_dequantize`` does, for bits other than 4, and for a group whose
    size is not a multiple of 32 (a block must not span two groups)."""
    if bits != 4:
        raise ValueError(f"gptq_int4 holds 4-bit GPTQ weights, got bits = {bits!r}; only 4-bit checkpoints run quantized")
    qweight, zero, scales, g = _gptq_fields(qweight, qzeros, scales, g_idx, bits, sym, checkpoint_format)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    counts = np.bincount(g, minlength=scales.shape[0])
    if (counts % BLOCK).any():
        bad = int(np.flatnonzero(counts % BLOCK)[0])
        raise ValueError(f"gptq_int4 needs GPTQ groups of a multiple of {BLOCK} inputs, but group {bad} has "
                         f"{counts[bad]} of K = {K}; use a checkpoint with group_size 32, 64, 128 ...")
    perm = None if (np.diff(g) >= 0).all() else np.argsort(g, kind="stable").astype(np.int32)
    if perm is None:
        quants = _repack_words(qweight)
    else:
        g = g[perm]
        q = _unpack(qweight, 4, axis=0)[perm].astype(np.uint8)                     # [K, N], columns by group
        quants = _nibbles(np.ascontiguousarray(q.T).reshape(-1, BLOCK))           # [N * K / 32, 16]
    gb = g[::BLOCK]                                                               # [K / 32]: each block's group
    d = np.ascontiguousarray(scales[gb].T, np.float16)                             # [N, K / 32], the bits as stored
    z = np.ascontiguousarray(zero[gb].T, np.float16)                              # small integers: exact
    data = np.concatenate([d.reshape(-1, 1).view(np.uint8), z.reshape(-1, 1).view(np.uint8), quants], axis=1)
    return QArray(data.reshape(-1), (N, K), "gptq_int4"), perm


def gptq_quantize(w, group_size=128, sym=True, desc_act=False, perm=None, rng=None, bits=4,
                  checkpoint_format="gptq"):
    """A valid GPTQ checkpoint of float weights ``w`` [N, K] (PyTorch layout) by round to nearest
    (for tests, not quality): returns ``(qweight, qzeros, scales, g_idx)`` as ``gptq_dequantize``
    describes them.

    ``group_size`` divides K (-1: one group).  With ``desc_act`` the groups follow the order
    ``perm`` (a permutation of range(K); GPTQ takes it from the Hessian, here it is given or
    drawn from ``rng``): input ``perm[i]`` is in group ``i // group_size``.  Each group's range
    [min(w, 0), max(w, 0)] (symmetric: [-max|w|, max|w|]) maps onto 0 .. 2**bits - 1; the f16
    scale is used for the rounding, so |dequantized - w| <= about half a step (scale).  The
    "gptq" format cannot store a zero of 0 (it writes zero - 1), so there such groups use zero 1
    and a step of max / (2**bits - 2).

    Raises ValueError for shapes that do not pack (K or N not a multiple of 32 / bits, K not a
    multiple of ``group_size``), a ``perm`` that is not a permutation, or a weight whose scale
    overflows f16."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    per, maxq = 32 // bits, (1 << bits) - 1
    gs = K if group_size == -1 else group_size
    if K % per or N % per or K % gs:
        raise ValueError(f"GPTQ packs {per} values per int32: w [N={N}, K={K}] needs N and K multiples "
                         f"of {per}, and K a multiple of group_size {gs}")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; use 'gptq' or 'gptq_v2'")
    order = np.arange(K)
    if desc_act:
        rng = rng if rng is not None else np.random.default_rng(0)
        order = np.asarray(perm) if perm is not None else rng.permutation(K)
        if not np.array_equal(np.sort(order), np.arange(K)):
            raise ValueError(f"GPTQ perm must be a permutation of range({K}), the activation order of the inputs")
    g_idx = np.empty(K, np.int32)
    g_idx[order] = np.arange(K) // gs
    wg = w[:, order].reshape(N, K // gs, gs)                                      # [N, G, gs]
    lo, hi = np.minimum(wg.min(axis=2), 0).T, np.maximum(wg.max(axis=2), 0).T     # [G, N]
    if sym:
        hi = np.maximum(-lo, hi)
        lo = -hi
    step = (hi - lo) / maxq
    if not sym and checkpoint_format == "gptq":
        step = np.where(-lo < step / 2, hi / (maxq - 1), step)                  # zero would be 0
    scales = np.maximum(step, np.float32(2.0 ** -14)).astype(np.float16)          # [G, N]
    if not np.isfinite(scales).all():
        raise ValueError(f"GPTQ scales overflow f16: a group's step (its range / {maxq}) exceeds 65504; "
                         "these weights are too large for f16 scales")
    s = scales.astype(np.float32)
    if sym:
        zero = np.full(s.shape, 1 << (bits - 1))
    else:
        zero = np.clip(np.round(-lo / s), 1 if checkpoint_format == "gptq" else 0, maxq).astype(np.int64)
    q = np.clip(np.round(w.T / s[g_idx]) + zero[g_idx], 0, maxq)                # [K, N]
    stored = zero - (checkpoint_format == "gptq")
    return _pack(q, bits, axis=0), _pack(stored, bits, axis=1), scales, g_idx
