"""Tests for dsl/quant.py: our q4_0/q4_1/q8_0 quantizer against gguf's byte for byte, our
dequantization against gguf's bit for bit on random bytes, the device layout, and the GPTQ
reference against hand-computed examples and a scalar loop."""
import warnings

import gguf
import gguf.quants
import numpy as np
import pytest

from dsl.quant import (BLOCK, FORMATS, GGUF_FORMATS, QArray, dequantize_blocks, from_device_layout, from_gptq,
                       gptq_dequantize, gptq_quantize, quantize, to_device_layout)

GGML = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
        "q8_0": gguf.GGMLQuantizationType.Q8_0}


def gguf_quantize(fmt, x):
    with warnings.catch_warnings():                 # gguf warns on the overflowing blocks
        warnings.simplefilter("ignore")
        return gguf.quants.quantize(x, GGML[fmt]).reshape(-1)


def gguf_dequantize(fmt, data):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return gguf.quants.dequantize(data.reshape(-1, FORMATS[fmt].block_bytes), GGML[fmt]).reshape(-1)


def special_blocks(rng):
    """[n, 32] float32 blocks where the rounding rules matter, each row one case."""
    n = rng.standard_normal(BLOCK).astype(np.float32)
    rows = [
        n, rng.uniform(-1, 1, BLOCK), rng.uniform(0, 5, BLOCK), rng.uniform(-5, 0, BLOCK),
        n * 1e30, n * 1e38, n * 3e4, n * 1e5,                        # d beyond f16, x * inv near f32 max
        n * 1e-6, n * 1e-30, n * 1e-37, n * 1e-39, n * 1e-44,        # subnormal f16 d, d = 0, 1/d = inf
        np.full(BLOCK, 0.3), np.full(BLOCK, -7.0), np.full(BLOCK, 1e-40), np.zeros(BLOCK),
        np.where(np.arange(BLOCK) == 7, 1000.0, n),                     # one outlier
        np.where(np.arange(BLOCK) == 30, -1000.0, n),
        np.r_[3.0, -3.0, n[2:] * 0.1], np.r_[-3.0, 3.0, n[2:] * 0.1],  # largest |x| tied: the first wins
        np.arange(BLOCK) - 15.5,                                        # evenly spaced
        np.r_[127.0, np.arange(BLOCK - 1) * 4.0 - 60.5],               # q8_0: d = 1, exact halves
        np.r_[-8.0, np.arange(BLOCK - 1) * 0.5 - 7.5],                  # q4_0: d = 1, exact halves
        np.r_[3e38, -3e38, n[2:]], np.r_[np.full(16, 3e38), np.full(16, -3e38)],   # q4_1 range overflows
        np.r_[-0.0, n[1:] * 0.0], np.r_[65504.0, -65504.0, n[2:]],
    ]
    return np.array(rows, np.float32)


def near_halves(fmt, rng, nb):
    """[nb, 32] blocks whose values sit on, or one float32 ulp beside, the halfway points between
    two codes, where float32 rounding of ``x * (1 / d)`` decides the code."""
    a = (rng.choice([-1, 1], (nb, 1)) * 10.0 ** rng.uniform(-3, 3, (nb, 1))).astype(np.float32)
    if fmt == "q4_1":
        lo, hi = -np.abs(a), np.abs(a) * np.float32(rng.uniform(0.2, 2))
        d = (hi - lo) / np.float32(15)
        x = lo + d * (rng.integers(0, 15, (nb, BLOCK)) + np.float32(0.5))
        x[:, 0], x[:, 1] = lo[:, 0], hi[:, 0]
    else:
        top = {"q4_0": 8, "q8_0": 127}[fmt]
        d = a / np.float32(-top) if fmt == "q4_0" else np.abs(a) / np.float32(top)
        x = d * (rng.integers(-top, top - 1, (nb, BLOCK)) + np.float32(0.5))
        x[:, 0] = a[:, 0]
    x = x.astype(np.float32)
    step = rng.integers(-1, 2, (nb, BLOCK - 2))                      # one ulp down, none, one up
    beside = np.nextafter(x[:, 2:], np.where(step < 0, -np.inf, np.inf).astype(np.float32))
    x[:, 2:] = np.where(step == 0, x[:, 2:], beside)
    return x


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_quantize_equals_gguf(fmt):
    rng = np.random.default_rng(11)
    scale = 10.0 ** rng.uniform(-8, 8, (300, 1))                      # a different scale per block
    random = (rng.standard_normal((300, BLOCK)) * scale).astype(np.float32)
    x = np.concatenate([random, special_blocks(rng), near_halves(fmt, rng, 300)]).reshape(-1, 4 * BLOCK)
    q = quantize(fmt, x)
    assert q.shape == x.shape and q.dtype == fmt
    np.testing.assert_array_equal(q.data, gguf_quantize(fmt, x))
    np.testing.assert_array_equal(QArray.quantize(x, fmt).data, q.data)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_quantize_other_float_dtypes_equals_gguf(fmt, dtype):
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((3, 50, 32 * BLOCK)) * rng.uniform(0.01, 100, (3, 50, 1))).astype(dtype)  # 4800 blocks
    np.testing.assert_array_equal(quantize(fmt, x).data, gguf_quantize(fmt, x))


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_quantize_then_dequantize_within_a_step(fmt):
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((64, 8 * BLOCK)) * rng.uniform(0.1, 10, (64, 1))).astype(np.float32)
    q = quantize(fmt, x)
    b = q.data.reshape(-1, FORMATS[fmt].block_bytes)
    d = np.abs(b[:, :2].copy().view(np.float16).astype(np.float32))                 # [nb, 1]
    err = np.abs(q.dequantize() - x).reshape(-1, BLOCK)
    # half a step (q4_0 a whole one on the side opposite its largest |x|: codes -8..7), plus f16's
    # rounding of d times the largest code (and of q4_1's m)
    half, code = {"q4_0": (1.0, 8), "q4_1": (0.5, 15), "q8_0": (0.5, 127)}[fmt]
    bound = half * d + code * d * 2.0 ** -11
    if fmt == "q4_1":
        bound = bound + np.abs(x.reshape(-1, BLOCK).min(axis=1, keepdims=True)) * 2.0 ** -11
    assert (err <= bound).all()
    assert err.max() > 0.1 * d.max()                                               # not lossless by accident


def random_blocks(fmt, rng, nb):
    """Random GGUF bytes whose f16 scales (d, and q4_1's m) include ±0, subnormals, the largest
    and smallest normals, ordinary values, and ±inf and NaN."""
    f = FORMATS[fmt]
    b = rng.integers(0, 256, (nb, f.block_bytes), dtype=np.uint8)
    special = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x7C00, 0xFC00,
                        0x7E00, 0x7C01, 0xFE00], np.uint16)
    for off in range(0, f.scale_bytes, 2):
        h = rng.integers(0, 1 << 16, nb).astype(np.uint16)                           # every pattern
        sub = rng.integers(1, 0x400, nb).astype(np.uint16) | (rng.integers(0, 2, nb) << 15).astype(np.uint16)
        pick = rng.integers(0, 3, nb)
        h = np.where(pick == 0, special[rng.integers(0, len(special), nb)], np.where(pick == 1, sub, h))
        b[:, off:off + 2] = h.astype(np.uint16).view(np.uint8).reshape(nb, 2)
    return b.reshape(-1)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_equals_gguf_bit_for_bit(fmt):
    import gguf
    rng = np.random.default_rng()
    data = random_blocks(fmt, rng, 4000).reshape(4000, -1)
    q = FORMATS[fmt].scale_bytes
    same = rng.random(4000) < 0.1                          # blocks whose quants are all one byte
    data[same, q:] = rng.integers(0, 256, (int(same.sum()), 1), dtype=np.uint8)
    consts = np.repeat(np.array([0.0, 1.0, -3.5, 1e-8, -6e4, rng.standard_normal()], np.float32), 32).reshape(-1, 32)
    constant = gguf.quants.quantize(consts, getattr(gguf.GGMLQuantizationType, fmt.upper()))   # constant inputs
    data = np.concatenate([data, constant.reshape(len(consts), -1)]).reshape(-1)
    with np.errstate(all="ignore"):
        ours = dequantize_blocks(fmt, data)
    ref = gguf_dequantize(fmt, data)
    assert np.isnan(ref).any() and np.isinf(ref).any() and (ref != 0).mean() > 0.5
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))      # NaN bits too


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_device_layout_and_take_rows(fmt):
    rng = np.random.default_rng(15)
    x = rng.standard_normal((6, 3 * BLOCK)).astype(np.float32)
    q = quantize(fmt, x)
    f = FORMATS[fmt]
    blocks = q.data.reshape(-1, f.block_bytes)
    dev = q.device_bytes()
    assert dev.dtype == np.uint8 and dev.size == q.nbytes == blocks.size
    nb = len(blocks)
    np.testing.assert_array_equal(dev[:nb * f.quant_bytes].reshape(nb, -1), blocks[:, f.scale_bytes:])
    np.testing.assert_array_equal(dev[nb * f.quant_bytes:].reshape(nb, -1), blocks[:, :f.scale_bytes])
    np.testing.assert_array_equal(from_device_layout(fmt, dev), q.data)
    np.testing.assert_array_equal(to_device_layout(fmt, from_device_layout(fmt, dev)), dev)
    rows = np.array([4, 0, 5, 5, 2])
    t = q.take_rows(rows)
    assert t.shape == (5, 3 * BLOCK) and t.dtype == fmt
    np.testing.assert_array_equal(t.dequantize(), q.dequantize()[rows])
    np.testing.assert_array_equal(t.data, quantize(fmt, x[rows]).data)


def test_quantize_errors():
    x = np.ones((2, 48), np.float32)
    with pytest.raises(ValueError, match=r"multiple of 32 \(pad it\)"):
        quantize("q4_0", x)
    with pytest.raises(ValueError, match="unknown quantized format 'q5_0'"):
        quantize("q5_0", np.ones(32))
    x = np.random.default_rng(16).standard_normal((3, 64))
    x[1, 40] = np.nan
    x[2, 3] = np.inf
    with pytest.raises(ValueError, match=r"x\[1, 40\] = nan is not finite"):
        quantize("q8_0", x)
    x[1, 40] = 1e39                                                   # finite in float64, not in float32
    with pytest.raises(ValueError, match=r"x\[1, 40\] = 1e\+39 is not finite in float32"):
        quantize("q4_1", x)
    x = np.random.default_rng(17).standard_normal((2, 300, 512)).astype(np.float16)   # past the first chunk
    x[1, 299, 500] = -np.inf
    with pytest.raises(ValueError, match=r"x\[1, 299, 500\] = -inf is not finite"):
        quantize("q4_0", x)


# --- GPTQ ---------------------------------------------------------------------------------------

def u32(words):
    return np.array(words, np.uint32).view(np.int32)


# K = 16 inputs, N = 8 outputs, group size 8, so G = 2 groups.
# q[k, n] = k for n < 7 and 15 - k for n = 7 (nibble k % 8 of qweight[k // 8, n]).
QWEIGHT = u32([[0x76543210] * 7 + [0x89ABCDEF],
               [0xFEDCBA98] * 7 + [0x01234567]])
SCALES = np.array([[1, 2, 3, 4, 5, 6, 7, 8],
                   [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25]], np.float16)
ZEROS_SYM = u32([[0x77777777], [0x77777777]])          # stored zero - 1 = 7: zero 8 everywhere
ZEROS_ASYM = u32([[0x76543210], [0x01234567]])         # zero[0, n] = n + 1, zero[1, n] = 8 - n
G_IDX = np.array([0] * 8 + [1] * 8, np.int32)
G_IDX_DESC = np.array([1, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 1, 1, 0], np.int32)

# Expected rows 0, 2 and 7 of W [8, 16], computed by hand as scale * (q - zero).
HAND = {
    (False, True): {                                    # (desc_act, sym)
        0: [-8, -7, -6, -5, -4, -3, -2, -1, 0, .5, 1, 1.5, 2, 2.5, 3, 3.5],
        2: [-24, -21, -18, -15, -12, -9, -6, -3, 0, .5, 1, 1.5, 2, 2.5, 3, 3.5],
        7: [56, 48, 40, 32, 24, 16, 8, 0, -.25, -.5, -.75, -1, -1.25, -1.5, -1.75, -2]},
    (False, False): {
        0: [-1, 0, 1, 2, 3, 4, 5, 6, 0, .5, 1, 1.5, 2, 2.5, 3, 3.5],
        2: [-9, -6, -3, 0, 3, 6, 9, 12, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5],
        7: [56, 48, 40, 32, 24, 16, 8, 0, 1.5, 1.25, 1, .75, .5, .25, 0, -.25]},
    (True, True): {
        0: [-4, -3.5, -6, -2.5, -4, -3, -2, -.5, 0, .5, 1, 3, 4, 2.5, 3, 7],
        2: [-4, -3.5, -18, -2.5, -12, -9, -6, -.5, 0, .5, 1, 9, 12, 2.5, 3, 21],
        7: [1.75, 1.5, 40, 1, 24, 16, 8, 0, -8, -.5, -.75, -32, -40, -1.5, -1.75, -64]},
    (True, False): {
        0: [-4, -3.5, 1, -2.5, 3, 4, 5, -.5, 7, .5, 1, 10, 11, 2.5, 3, 14],
        2: [-3, -2.5, -3, -1.5, 3, 6, 9, .5, 15, 1.5, 2, 24, 27, 3.5, 4, 36],
        7: [3.5, 3.25, 40, 2.75, 24, 16, 8, 1.75, -8, 1.25, 1, -32, -40, .25, 0, -64]},
}


def gptq_loop(qweight, qzeros, scales, g_idx, bits, checkpoint_format):
    """W [N, K] one element at a time, straight from the packing rules."""
    per, mask = 32 // bits, (1 << bits) - 1
    K, N = qweight.shape[0] * per, qweight.shape[1]
    w = np.zeros((N, K), np.float64)
    for n in range(N):
        for k in range(K):
            g = int(g_idx[k])
            q = (int(qweight[k // per, n]) & 0xFFFFFFFF) >> (bits * (k % per)) & mask
            z = (int(qzeros[g, n // per]) & 0xFFFFFFFF) >> (bits * (n % per)) & mask
            w[n, k] = float(scales[g, n]) * (q - z - (checkpoint_format == "gptq"))
    return w


@pytest.mark.parametrize("desc_act,sym", list(HAND))
def test_gptq_hand_example(desc_act, sym):
    g_idx = G_IDX_DESC if desc_act else G_IDX
    zeros = ZEROS_SYM if sym else ZEROS_ASYM
    w = gptq_dequantize(QWEIGHT, zeros, SCALES, g_idx, bits=4, sym=sym)
    assert w.shape == (8, 16) and w.dtype == np.float32
    for n, row in HAND[desc_act, sym].items():
        np.testing.assert_array_equal(w[n], np.array(row, np.float32), err_msg=f"row {n}")
    np.testing.assert_array_equal(w, gptq_loop(QWEIGHT, zeros, SCALES, g_idx, 4, "gptq"))
    if not desc_act:                                                    # no g_idx: groups in order
        np.testing.assert_array_equal(gptq_dequantize(QWEIGHT, zeros, SCALES, None, sym=sym), w)
    # gptq_v2 stores the zeros themselves: one more in every field
    v2 = (zeros.view(np.uint32) + np.uint32(0x11111111)).view(np.int32)
    np.testing.assert_array_equal(gptq_dequantize(QWEIGHT, v2, SCALES, g_idx, sym=sym,
                                                  checkpoint_format="gptq_v2"), w)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_round_trip(sym, desc_act, checkpoint_format):
    rng = np.random.default_rng(17)
    N, K, group = 24, 256, 64
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 1, (N, 1))).astype(np.float32)
    w[3, :group] = np.abs(w[3, :group])              # a group with no negative value: asymmetric zero 0
    qweight, qzeros, scales, g_idx = gptq_quantize(w, group, sym, desc_act, rng=rng,
                                                   checkpoint_format=checkpoint_format)
    assert qweight.dtype == qzeros.dtype == g_idx.dtype == np.int32 and scales.dtype == np.float16
    assert (qweight.shape, qzeros.shape, scales.shape, g_idx.shape) == ((K // 8, N), (K // group, N // 8),
                                                                        (K // group, N), (K,))
    assert np.bincount(g_idx).tolist() == [group] * (K // group)
    assert (np.diff(g_idx) < 0).any() == desc_act
    deq = gptq_dequantize(qweight, qzeros, scales, g_idx, sym=sym, checkpoint_format=checkpoint_format)
    np.testing.assert_array_equal(deq, gptq_loop(qweight, qzeros, scales, g_idx, 4, checkpoint_format))
    step = scales.astype(np.float32)[g_idx].T                                         # [N, K]
    err = np.abs(deq - w) / step
    assert err.max() <= 0.51 and err.max() > 0.4


def test_gptq_8_bit_and_one_group():
    rng = np.random.default_rng(18)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    parts = gptq_quantize(w, -1, sym=False, bits=8)
    assert parts[0].shape == (16, 8) and parts[2].shape == (1, 8) and (parts[3] == 0).all()
    deq = gptq_dequantize(*parts, bits=8, sym=False)
    np.testing.assert_array_equal(deq, gptq_loop(*parts, 8, "gptq"))
    assert (np.abs(deq - w) <= 0.51 * parts[2].astype(np.float32).T).all()


def test_gptq_errors():
    qweight, qzeros, scales, g_idx = QWEIGHT, ZEROS_ASYM, SCALES, G_IDX
    with pytest.raises(ValueError, match="symmetric GPTQ checkpoint .* zeros 8, but these range 1..8"):
        gptq_dequantize(qweight, qzeros, scales, g_idx, sym=True)
    with pytest.raises(ValueError, match="shapes do not fit together"):
        gptq_dequantize(qweight, qzeros, scales[:1], g_idx, sym=False)
    with pytest.raises(ValueError, match=r"g_idx must lie in 0..1"):
        gptq_dequantize(qweight, qzeros, scales, g_idx + 1, sym=False)
    with pytest.raises(ValueError, match="unknown GPTQ checkpoint_format 'awq'"):
        gptq_dequantize(qweight, qzeros, scales, g_idx, checkpoint_format="awq")
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        gptq_dequantize(qweight, qzeros, scales, g_idx, bits=3)
    with pytest.raises(ValueError, match="2-D int32"):
        gptq_dequantize(qweight.astype(np.float32), qzeros, scales, g_idx)
    w = np.random.default_rng(19).standard_normal((8, 48)).astype(np.float32)
    with pytest.raises(ValueError, match="K a multiple of group_size 32"):
        gptq_quantize(w, 32)
    with pytest.raises(ValueError, match="perm must be a permutation"):
        gptq_quantize(w, 16, desc_act=True, perm=np.zeros(48, int))


def test_qarray_and_gptq_arguments_are_checked():
    """The Python API's bad arguments are one clear error, not a wrong array or a numpy traceback."""
    q = quantize("q4_0", np.random.default_rng().standard_normal((4, 64)).astype(np.float32))
    with pytest.raises(IndexError, match="outside the 4 rows"):
        q.take_rows([1, 99])
    for shape in ((-1, 32), (1.5, 32)):
        with pytest.raises(ValueError, match="whole non-negative sizes"):
            QArray(np.zeros(36, np.uint8), shape, "q4_0")
    qweight, qzeros, scales, g_idx = gptq_quantize(np.random.default_rng().standard_normal((8, 64)).astype(np.float32), 32)
    with pytest.raises(ValueError, match="scales must be float16"):
        from_gptq(qweight, qzeros, scales.astype(np.float32), g_idx)
    with pytest.raises(ValueError, match="bits = '4'"):
        from_gptq(qweight, qzeros, scales, g_idx, bits="4")
