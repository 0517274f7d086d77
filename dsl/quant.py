"""Quantized weight formats: the GGUF block layouts q4_0, q4_1 and q8_0, and ``QArray``, the host
array that holds a quantized weight.

A quantized matrix [N, K] is stored as N rows of K / 32 blocks; a block holds 32 consecutive
elements of one row (the layouts of ggml's ``block_q4_0``, ``block_q4_1``, ``block_q8_0``; the
authority is the ``gguf`` package's ``gguf.quants``)::

    q4_0  18 bytes: d f16, qs[16]          x[j] = d * ((qs[j % 16] >> 4 * (j >= 16) & 15) - 8)
    q4_1  20 bytes: d f16, m f16, qs[16]   x[j] = d * (qs[j % 16] >> 4 * (j >= 16) & 15) + m
    q8_0  34 bytes: d f16, qs[32] int8     x[j] = d * qs[j]

(products in float32, as ``gguf.quants.dequantize`` computes them).

Kernels read the *device layout* of the same bytes: the quants of every block first (16 or 32
bytes per block, so that each block's quants are one or two aligned 16-byte loads), then the
scales of every block (``d``, or ``d, m``), both in block order.  ``to_device_layout`` and
``from_device_layout`` convert; no value changes.
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
}
QUANT_DTYPES = tuple(FORMATS)


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


def dequantize_blocks(fmt: str, data: np.ndarray) -> np.ndarray:
    """float32 [n_blocks * 32] values of GGUF blocks ``data`` (uint8, any shape, n_blocks *
    block_bytes bytes), equal bit for bit to ``gguf.quants.dequantize``."""
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


class QArray:
    """A quantized array: logical ``shape`` (its last axis a multiple of 32), ``dtype`` the format
    name ("q4_0", "q4_1", "q8_0"), ``data`` the GGUF blocks as uint8 (row-major blocks; a
    memory map of a GGUF file works as it is).

    ``QArray.quantize(x, fmt)`` quantizes a float array; ``dequantize()`` gives float32 values;
    ``device_bytes()`` the bytes kernels read (``to_device_layout``), computed once.

    Raises ValueError for an unknown format, a last axis that is not a multiple of 32, or data
    of the wrong size."""

    def __init__(self, data, shape, dtype):
        if dtype not in FORMATS:
            raise ValueError(f"unknown quantized format {dtype!r}; use one of {', '.join(FORMATS)}")
        shape = tuple(int(d) for d in shape)
        if not shape or shape[-1] % BLOCK:
            raise ValueError(f"a {dtype} array needs a last axis that is a multiple of {BLOCK}, got shape {list(shape)}")
        n = int(np.prod(shape, dtype=np.int64))
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.size != nbytes(dtype, n):
            raise ValueError(f"{dtype} data for shape {list(shape)} must be {nbytes(dtype, n)} uint8 bytes, "
                             f"got {data.size} {data.dtype}")
        self.data, self.shape, self.dtype = data, shape, dtype
        self._device = None

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self):
        return self.data.size

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
        data = np.asarray(self.data).reshape(self.shape[0], per_row)[np.asarray(rows)]
        return QArray(data.reshape(-1), (len(rows),) + self.shape[1:], self.dtype)

    def __repr__(self):
        return f"QArray({self.dtype}{list(self.shape)}, {self.nbytes} bytes)"
