"""CPU backend: hand-built Loop IR kernels vs numpy (float64 references, fresh random inputs)."""
import re
import time

import numpy as np
import pytest
import llvmlite.binding as llvm

import dsl  # noqa: F401  (its primitives fill codegen.loopir.OPS)
from codegen.llvm import render_llvm
from codegen.loopir import (Acc, Array, Assign, Attention, Barrier, Bin, Cast, Comment, Const, Declare, If, Kernel,
                            Load, Loop, Param, Reduce, Select, Store, Sym, Un, add, c, mul)
from engine.devices.cpu import CPUDevice, ScalarSlots, threadable

rng = np.random.default_rng()
NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "bool": np.bool_}


@pytest.fixture(scope="module")
def dev():
    return CPUDevice()


def i_(name="i"):
    return Sym(name, "i32")


def rand(dtype, n, lo=-3.0, hi=3.0, positive=False):
    """Random values, never zero (|x| >= 0.05 for floats, ints in [-1000, 1000] \\ {0})."""
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype == "i32":
        v = rng.integers(1, 1000, n) * (1 if positive else rng.choice([-1, 1], n))
        return v.astype(np.int32)
    mag = rng.uniform(max(lo, 0.05) if positive else 0.05, hi, n)
    return (mag if positive else mag * rng.choice([-1, 1], n)).astype(NP[dtype])


def elementwise(dev, fn, in_dtypes, out_dtype, inputs, nthreads=None):
    """out[i] = fn(a[i], b[i], ...) over a parallel loop; returns the output."""
    n = len(inputs[0])
    names = "abcd"[:len(in_dtypes)]
    loads = [Load(nm, i_(), dt) for nm, dt in zip(names, in_dtypes)]
    params = tuple(Param(nm, dt, shape=(n,)) for nm, dt in zip(names, in_dtypes)) + \
        (Param("out", out_dtype, shape=(n,), role="out"),)
    k = Kernel("ew", "elementwise", params, (Loop("i", c(0), c(n), (Store("out", i_(), fn(*loads)),), parallel=True),))
    out = np.zeros(n, NP[out_dtype])
    dev.compile(k)({**dict(zip(names, inputs)), "out": out}, nthreads=nthreads)
    return out


# ----------------------------------------------------------------------------- elementwise
UN_REF = {
    "neg": (np.negative, {}), "exp": (np.exp, {}), "log": (np.log, {"positive": True}),
    "sqrt": (np.sqrt, {"positive": True}), "rsqrt": (lambda x: 1 / np.sqrt(x), {"positive": True}),
    "sin": (np.sin, {}), "cos": (np.cos, {}), "tanh": (np.tanh, {"lo": 1e-4, "hi": 12.0}),
    "logistic": (lambda x: 1 / (1 + np.exp(-x)), {"hi": 30.0}), "abs": (np.abs, {}),
}


@pytest.mark.parametrize("op", sorted(UN_REF))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_unary_float(dev, op, dtype):
    ref, kw = UN_REF[op]
    x = rand(dtype, 1000, **kw)
    out = elementwise(dev, lambda a: Un(op, a), [dtype], dtype, [x])
    want = ref(x.astype(np.float64))
    tol = 2e-6 if dtype == "f32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)


def test_transcendental_extremes(dev):
    """inf / large / tiny inputs, long enough to go through the vectorized (libmvec) paths too."""
    x = rng.permutation(np.tile(np.array([-np.inf, -100, -20, -1e-3, 1e-7, 3e-2, 0.0625, 20, 80, 100, np.inf],
                                         np.float32), 40))
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        cases = {"tanh": np.tanh(x64), "logistic": 1 / (1 + np.exp(-x64)), "exp": np.exp(x64)}
        cases = {op: want.astype(np.float32) for op, want in cases.items()}
    for op, want in cases.items():
        out = elementwise(dev, lambda a: Un(op, a), ["f32"], "f32", [x])
        np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-7, err_msg=op)
    pos = np.abs(x)
    out = elementwise(dev, lambda a: Un("log", a), ["f32"], "f32", [pos])
    np.testing.assert_allclose(out, np.log(pos.astype(np.float64)), rtol=2e-6, atol=1e-7)


FBIN_REF = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
            "max": np.maximum, "min": np.minimum, "mod": np.fmod}
CMP_REF = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}


@pytest.mark.parametrize("op", sorted(FBIN_REF))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_binary_float(dev, op, dtype):
    a, b = rand(dtype, 777), rand(dtype, 777)
    out = elementwise(dev, lambda x, y: Bin(op, x, y), [dtype, dtype], dtype, [a, b])
    want = FBIN_REF[op](a.astype(np.float64), b.astype(np.float64))
    tol = 1e-6 if dtype == "f32" else 1e-3
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", sorted(CMP_REF))
@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_compare(dev, op, dtype):
    a = rand(dtype, 500)
    b = np.where(rng.random(500) < 0.3, a, rand(dtype, 500)).astype(NP[dtype])   # some ties
    out = elementwise(dev, lambda x, y: Bin(op, x, y), [dtype, dtype], "bool", [a, b])
    np.testing.assert_array_equal(out, CMP_REF[op](a, b))


def test_max_min_with_inf(dev):
    a = np.where(rng.random(300) < 0.5, -np.inf, rand("f32", 300)).astype(np.float32)
    b = np.where(rng.random(300) < 0.5, -np.inf, rand("f32", 300)).astype(np.float32)
    for op, ref in (("max", np.maximum), ("min", np.minimum)):
        out = elementwise(dev, lambda x, y: Bin(op, x, y), ["f32", "f32"], "f32", [a, b])
        np.testing.assert_array_equal(out, ref(a, b))


def test_int_math(dev):
    a, b = rand("i32", 999), rand("i32", 999)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    q = np.sign(a64) * np.sign(b64) * (np.abs(a64) // np.abs(b64))      # C (truncating) division
    want = {"add": a64 + b64, "sub": a64 - b64, "mul": a64 * b64, "idiv": q, "mod": a64 - b64 * q,
            "max": np.maximum(a64, b64), "min": np.minimum(a64, b64), "and": a64 & b64, "or": a64 | b64}
    for op, w in want.items():
        out = elementwise(dev, lambda x, y: Bin(op, x, y), ["i32", "i32"], "i32", [a, b])
        np.testing.assert_array_equal(out, w, err_msg=op)
    for op, w in {"neg": -a64, "abs": np.abs(a64), "not": ~a64}.items():
        out = elementwise(dev, lambda x: Un(op, x), ["i32"], "i32", [a])
        np.testing.assert_array_equal(out, w, err_msg=op)


def test_bool_ops_and_select(dev):
    p, q = rand("bool", 400), rand("bool", 400)
    for op, ref in (("and", np.logical_and), ("or", np.logical_or), ("eq", np.equal), ("ne", np.not_equal)):
        out = elementwise(dev, lambda x, y: Bin(op, x, y), ["bool", "bool"], "bool", [p, q])
        np.testing.assert_array_equal(out, ref(p, q), err_msg=op)
    np.testing.assert_array_equal(elementwise(dev, lambda x: Un("not", x), ["bool"], "bool", [p]), ~p)
    a, b = rand("f32", 400), rand("f32", 400)
    out = elementwise(dev, lambda x, y: Select(Bin("gt", x, y), Bin("mul", x, y), Un("neg", y)),
                      ["f32", "f32"], "f32", [a, b])
    np.testing.assert_allclose(out, np.where(a > b, a.astype(np.float64) * b, -b), rtol=1e-6)
    out = elementwise(dev, lambda s, x, y: Select(s, x, y), ["bool", "f32", "f32"], "f32", [p, a, b])
    np.testing.assert_array_equal(out, np.where(p, a, b))


def test_casts(dev):
    x32 = (rand("f32", 1000) * rng.choice([1e-3, 1, 100, 1e4], 1000)).astype(np.float32)
    x16 = rand("f16", 1000)
    xi = rand("i32", 1000)
    xb = rand("bool", 1000)
    cast = lambda dt: (lambda x: Cast(x, dt))
    np.testing.assert_array_equal(elementwise(dev, cast("f16"), ["f32"], "f16", [x32]), x32.astype(np.float16))
    np.testing.assert_array_equal(elementwise(dev, cast("f32"), ["f16"], "f32", [x16]), x16.astype(np.float32))
    np.testing.assert_array_equal(elementwise(dev, cast("i32"), ["f32"], "i32", [x32 / 7]),
                                  np.trunc(x32 / 7).astype(np.int32))
    np.testing.assert_array_equal(elementwise(dev, cast("f32"), ["i32"], "f32", [xi]), xi.astype(np.float32))
    np.testing.assert_array_equal(elementwise(dev, cast("f16"), ["i32"], "f16", [xi]), xi.astype(np.float16))
    np.testing.assert_array_equal(elementwise(dev, cast("i32"), ["bool"], "i32", [xb]), xb.astype(np.int32))
    np.testing.assert_array_equal(elementwise(dev, cast("f32"), ["bool"], "f32", [xb]), xb.astype(np.float32))
    xz = np.where(xb, 0, xi).astype(np.int32)
    np.testing.assert_array_equal(elementwise(dev, cast("bool"), ["i32"], "bool", [xz]), xz != 0)
    xf = np.where(xb, 0, x32).astype(np.float32)
    np.testing.assert_array_equal(elementwise(dev, cast("bool"), ["f32"], "bool", [xf]), xf != 0)


def test_fused_expression_f16_io(dev):
    """silu(a) * b with f16 I/O and f32 math (the usual fused pattern)."""
    a, b = rand("f16", 3000), rand("f16", 3000)
    f = lambda x, y: Cast(Bin("mul", Bin("mul", Cast(x, "f32"), Un("logistic", Cast(x, "f32"))), Cast(y, "f32")),
                          "f16")
    for nt in (1, 2):
        out = elementwise(dev, f, ["f16", "f16"], "f16", [a, b], nthreads=nt)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        np.testing.assert_allclose(out.astype(np.float64), a64 / (1 + np.exp(-a64)) * b64, rtol=2e-3, atol=1e-3)


# ----------------------------------------------------------------------------- reductions
def row_reduce_kernel(R, C, op, init):
    r, j = i_("r"), i_("j")
    acc = Sym("acc", "f32")
    return Kernel(f"row_{op}", "reduce",
                  (Param("x", "f32", shape=(R, C)), Param("out", "f32", shape=(R,), role="out")),
                  (Loop("r", c(0), c(R), (
                      Declare("acc", "f32", Const(init, "f32")),
                      Loop("j", c(0), c(C), (Assign("acc", Bin(op, acc, Load("x", add(mul(r, c(C)), j), "f32"))),)),
                      Store("out", r, acc)), parallel=True),),
                  bytes=R * C * 4)


@pytest.mark.parametrize("nt", [1, 2])
def test_typed_reduce_if_and_comment(dev, nt):
    """Reduce (add, max, argmax with its index) is a serial loop on the CPU; If branches; Comment
    and Barrier emit nothing.  Per row: sum, max, argmax (first of equal maxima), and sum or max by
    the sign of the sum."""
    R, C = 37, 203
    x = rand("f32", R * C).reshape(R, C)
    x[5, 7] = x[5, 9] = 50.0                          # a tie: the first index wins
    r, j = i_("r"), i_("j")
    v = Load("x", add(mul(r, c(C)), j), "f32")
    red = Reduce("j", c(0), c(C), (Acc("s", "add", v), Acc("m", "max", v), Acc("b", "argmax", v, arg="a")))
    s, m = Sym("s", "f32"), Sym("m", "f32")
    body = (Comment("rows"), Loop("r", c(0), c(R), (
        red, Barrier(),
        Store("sums", r, s), Store("maxs", r, Bin("max", m, Sym("b", "f32"))), Store("args", r, Sym("a", "i32")),
        If(Bin("gt", s, Const(0.0, "f32")), (Store("pick", r, s),), (Store("pick", r, m),))), parallel=True))
    params = (Param("x", "f32", shape=(R, C)),) + tuple(
        Param(n, dt, shape=(R,), role="out") for n, dt in (("sums", "f32"), ("maxs", "f32"), ("args", "i32"),
                                                            ("pick", "f32")))
    out = {n: np.zeros(R, NP[p.dtype]) for n, p in zip(("sums", "maxs", "args", "pick"), params[1:])}
    dev.compile(Kernel("typed", "reduce", params, body))({"x": x, **out}, nthreads=nt)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out["sums"], x64.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out["maxs"], x.max(1))
    np.testing.assert_array_equal(out["args"], x.argmax(1))
    np.testing.assert_allclose(out["pick"], np.where(x64.sum(1) > 0, x64.sum(1), x64.max(1)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qd, kd", [("f32", "f32"), ("f16", "f16")])
def test_attention_statement_expands_on_the_cpu(dev, qd, kd):
    from tests.test_kernels import reference_attention
    hq, hkv, t, S, d, pos = 4, 2, 3, 16, 8, 9
    q = rand(qd, hq * t * d).reshape(hq, t, d)
    k, v = (rand(kd, hkv * S * d).reshape(hkv, S, d) for _ in range(2))
    params = (Param("q", qd, shape=q.shape), Param("k", kd, shape=k.shape), Param("v", kd, shape=v.shape),
              Param("pos", "i32", "scalar"), Param("out", "f32", shape=q.shape, role="out"))
    att = Attention("q", "k", "v", "out", (qd, kd, kd), hq, hkv, t, S, d, Sym("pos", "i32"), 0.3)
    out = np.zeros(q.shape, np.float32)
    kernel = Kernel("att", "attention", params, (Comment("attention"), att))
    assert threadable(kernel)                  # its heads split across threads, as the loops it expands to
    dev.compile(kernel)({"q": q, "k": k, "v": v, "out": out}, {"pos": pos}, nthreads=2)
    scale = 0.3 * np.sqrt(d)                   # the reference divides by sqrt(d)
    want = reference_attention(q.astype(np.float64) * scale, k.astype(np.float64), v.astype(np.float64), pos)
    np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("nt", [1, 2])
def test_row_sum_and_max(dev, nt):
    R, C = 67, 301
    x = rand("f32", R * C).reshape(R, C)
    x[rng.random((R, C)) < 0.2] = -np.inf            # masked entries
    x[3] = -np.inf                                   # a fully masked row
    out = np.zeros(R, np.float32)
    dev.compile(row_reduce_kernel(R, C, "max", -np.inf))({"x": x, "out": out}, nthreads=nt)
    np.testing.assert_array_equal(out, x.max(axis=1))
    y = rand("f32", R * C).reshape(R, C)
    dev.compile(row_reduce_kernel(R, C, "add", 0.0))({"x": y, "out": out}, nthreads=nt)
    np.testing.assert_allclose(out, y.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nt", [1, 2])
def test_masked_softmax_rows(dev, nt):
    """max / exp / sum / divide over rows with -inf masks and a local Array scratch per row."""
    R, C = 9, 203
    r, j = i_("r"), i_("j")
    m, sm = Sym("m", "f32"), Sym("s", "f32")
    at = add(mul(r, c(C)), j)
    k = Kernel("softmax", "reduce",
               (Param("x", "f32", shape=(R, C)), Param("out", "f32", shape=(R, C), role="out")),
               (Loop("r", c(0), c(R), (
                   Array("e", "f32", C),
                   Declare("m", "f32", Const(float("-inf"), "f32")),
                   Loop("j", c(0), c(C), (Assign("m", Bin("max", m, Load("x", at, "f32"))),)),
                   Declare("s", "f32", Const(0.0, "f32")),
                   Loop("j", c(0), c(C), (Store("e", j, Un("exp", Bin("sub", Load("x", at, "f32"), m))),
                                          Assign("s", Bin("add", sm, Load("e", j, "f32"))))),
                   Loop("j", c(0), c(C), (Store("out", at, Bin("div", Load("e", j, "f32"), sm)),))),
                   parallel=True),))
    x = rand("f32", R * C).reshape(R, C) * 4
    x[rng.random((R, C)) < 0.3] = -np.inf
    x[:, 0] = 1.0                                      # no fully masked row
    out = np.zeros((R, C), np.float32)
    dev.compile(k)({"x": x, "out": out}, nthreads=nt)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- GEMV
def gemv_kernel(N, K, name="gemv"):
    """out[n] = sum_k x[k] * w[n, k]; x staged in a local Array; w f16; parallel over n."""
    n, k = i_("n"), i_("k")
    acc = Sym("acc", "f32")
    return Kernel(name, "contract",
                  (Param("x", "f32", shape=(K,)), Param("w", "f16", shape=(N, K)),
                   Param("out", "f32", shape=(N,), role="out")),
                  (Array("xs", "f32", K),
                   Loop("k", c(0), c(K), (Store("xs", k, Load("x", k, "f32")),)),
                   Loop("n", c(0), c(N), (
                       Declare("acc", "f32", Const(0.0, "f32")),
                       Loop("k", c(0), c(K), (Assign("acc", Bin("add", acc, Bin(
                           "mul", Load("xs", k, "f32"), Cast(Load("w", add(mul(n, c(K)), k), "f16"), "f32")))),)),
                       Store("out", n, acc)), parallel=True)),
                  bytes=N * K * 2 + K * 4 + N * 4, flops=2 * N * K)


@pytest.mark.parametrize("N,K", [(1, 1), (37, 100), (576, 576), (1000, 333)])
@pytest.mark.parametrize("nt", [1, 2])
def test_gemv(dev, N, K, nt):
    ck = dev.compile(gemv_kernel(N, K))
    x, w = rand("f32", K), rand("f16", N * K).reshape(N, K)
    out = np.full(N, np.nan, np.float32)
    ck({"x": x, "w": w, "out": out}, nthreads=nt)
    want = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.sqrt(K))


def test_gemv_vectorizes(dev):
    ck = dev.compile(gemv_kernel(1536, 576))
    asm = ck.asm()
    feats = llvm.get_host_cpu_features()
    if feats.get("f16c") and feats.get("fma") and feats.get("avx2"):
        assert re.search(r"vcvtph2ps\s+[^\n]*%[yz]mm", asm), "f16 -> f32 conversion not vectorized"
        assert re.search(r"vfmadd\w*ps\s+[^\n]*%[yz]mm", asm), "no vector FMA in the GEMV"
    print(f"\nGEMV asm: {len(asm.splitlines())} lines, vcvtph2ps x{asm.count('vcvtph2ps')}, "
          f"vfmadd*ps x{len(re.findall('vfmadd[0-9]+ps', asm))}, zmm={'zmm' in asm}, ymm={'ymm' in asm}")


def _best(f, reps):
    f()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


@pytest.mark.parametrize("N,K", [(1536, 576), (49152, 576)])
def test_gemv_perf_report(dev, N, K, capsys):
    ck = dev.compile(gemv_kernel(N, K))
    x, w = rand("f32", K), rand("f16", N * K).reshape(N, K)
    out = np.zeros(N, np.float32)
    w32 = w.astype(np.float32)
    nbytes = w.nbytes + x.nbytes + out.nbytes
    reps = max(3, int(5e7 // nbytes))
    lines = []
    for nt in (1, 2):
        run = dev.prepare(ck, {"x": x, "w": w, "out": out}, nthreads=nt)
        t = _best(run, reps)
        lines.append(f"vegafuse f16 GEMV {N}x{K} nt={nt}: {t * 1e6:9.1f} us {nbytes / t / 1e9:6.1f} GB/s")
    t = _best(lambda: np.matmul(w32, x, out=out), reps)
    lines.append(f"numpy f32 matvec {N}x{K}:      {t * 1e6:9.1f} us {(w32.nbytes + x.nbytes) / t / 1e9:6.1f} GB/s")
    print("\n" + "\n".join(lines))                # shown with pytest -s


# ----------------------------------------------------------------------------- scalars, dynamic extents
def test_scalar_param_store_at_pos(dev):
    n = 64
    pos = Sym("pos", "i32")
    k = Kernel("put", "scatter",
               (Param("cache", "f32", shape=(n,), role="inout"), Param("v", "f32", shape=(1,)),
                Param("pos", "i32", kind="scalar")),
               (Store("cache", pos, Bin("mul", Load("v", c(0), "f32"), Cast(pos, "f32"))),))
    ck = dev.compile(k)
    assert not ck.threadable
    cache, v = rand("f32", n), rand("f32", 1)
    before = cache.copy()
    ck({"cache": cache, "v": v}, {"pos": 17})
    want = before.copy()
    want[17] = v[0] * 17
    np.testing.assert_array_equal(cache, want)
    slots = ScalarSlots(["pos"])
    run = dev.prepare(ck, {"cache": cache, "v": v}, slots)
    for p in rng.permutation(n)[:10]:
        slots["pos"] = int(p)          # updated in place, pointer bound once
        run()
        want[p] = v[0] * np.float32(p)
    np.testing.assert_array_equal(cache, want)


@pytest.mark.parametrize("nt", [1, 2])
def test_dynamic_extent(dev, nt):
    n = 500
    ln, i = Sym("len", "i32"), i_()
    acc = Sym("acc", "f32")
    k = Kernel("prefix", "reduce",
               (Param("x", "f32", shape=(n,)), Param("y", "f32", shape=(n,), role="out"),
                Param("s", "f32", shape=(1,), role="out"), Param("len", "i32", kind="scalar")),
               (Declare("acc", "f32", Const(0.0, "f32")),
                Loop("i", c(0), ln, (Assign("acc", Bin("add", acc, Load("x", i, "f32"))),)),
                Loop("i", c(0), ln, (Store("y", i, Bin("add", Load("x", i, "f32"), acc)),), parallel=True),
                Loop("i", c(0), c(1), (Store("s", i, acc),), parallel=True)),
               bytes=10 << 20)
    ck = dev.compile(k)
    assert ck.threadable
    x = rand("f32", n)
    slots = ScalarSlots(["len"])
    y, s = np.full(n, -7, np.float32), np.zeros(1, np.float32)
    run = dev.prepare(ck, {"x": x, "y": y, "s": s}, slots, nthreads=nt)
    for ln_ in (0, 1, 3, 255, 499, 500):
        y[:] = -7
        slots["len"] = ln_
        run()
        tot = x[:ln_].astype(np.float64).sum()
        np.testing.assert_allclose(s[0], tot, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y[:ln_], x[:ln_] + tot, rtol=1e-5, atol=1e-5)
        assert (y[ln_:] == -7).all()


# ----------------------------------------------------------------------------- device plumbing
def test_threadable_analysis():
    i = i_()
    par = lambda *b: Loop("i", c(0), c(4), tuple(b), parallel=True)
    ps = (Param("a", "f32", shape=(4,)), Param("b", "f32", shape=(4,), role="out"))
    mk = lambda *body: Kernel("t", "elementwise", ps, tuple(body))
    assert threadable(mk(par(Store("b", i, Load("a", i, "f32")))))
    assert not threadable(mk(Store("b", c(0), Const(1.0, "f32"))))                       # store outside
    assert not threadable(mk(par(Store("b", i, Load("a", i, "f32"))),
                             par(Store("b", i, Load("b", add(i, c(1)), "f32")))))         # cross-loop dependency
    assert not threadable(mk(Loop("i", c(0), c(4), (Store("b", i, Load("a", i, "f32")),))))  # no parallel loop


def test_argument_checks(dev):
    ck = dev.compile(gemv_kernel(8, 16, name="chk"))
    x, w, out = rand("f32", 16), rand("f16", 128).reshape(8, 16), np.zeros(8, np.float32)
    with pytest.raises(TypeError, match=r"chk.*'w'.*float16"):
        ck({"x": x, "w": w.astype(np.float32), "out": out})
    with pytest.raises(ValueError, match=r"chk.*'w'.*shape"):
        ck({"x": x, "w": w.reshape(-1), "out": out})
    with pytest.raises(ValueError, match=r"chk.*'w'.*contiguous"):
        ck({"x": x, "w": np.asfortranarray(w), "out": out})
    with pytest.raises(ValueError, match=r"chk.*'out'.*missing"):
        ck({"x": x, "w": w})
    with pytest.raises(ValueError, match=r"chk.*overlaps"):
        buf = np.zeros(16, np.float32)
        ck({"x": buf, "w": w, "out": buf[:8]})


def test_compile_many_and_plan():
    n = 256
    i = i_()

    def axpb(j, name):
        return Kernel(name, "elementwise",
                      (Param("x", "f32", shape=(n,)), Param("y", "f32", shape=(n,), role="out"),
                       Param("pos", "i32", kind="scalar")),
                      (Loop("i", c(0), c(n), (Store("y", i, Bin("add", Bin("mul", Load("x", i, "f32"),
                                                                           Const(float(j), "f32")),
                                                                 Cast(Sym("pos", "i32"), "f32"))),), parallel=True),))
    kernels = [axpb(j, f"axpb_{j}") for j in range(200)]
    dev = CPUDevice()
    t = time.perf_counter()
    cks = dev.compile_many(kernels)
    t_many = time.perf_counter() - t
    dev_one = CPUDevice()
    t = time.perf_counter()
    for k in kernels[:20]:
        dev_one.compile(k)
    t_one = (time.perf_counter() - t) / 20
    print(f"\ncompile_many(200 small kernels): {t_many:.2f} s; compile() one at a time: {t_one * 1e3:.1f} ms/kernel")
    assert len({ck.symbol for ck in cks}) == 200
    again = dev.compile_many([axpb(5, "renamed"), axpb(5, "other")])      # structurally equal: shared
    assert again[0].symbol == again[1].symbol == cks[5].symbol and again[0].kernel.name == "renamed"
    slots = ScalarSlots(pos=0)
    bufs = [np.zeros(n, np.float32) for _ in range(201)]
    bufs[0][:] = rand("f32", n)
    launches = [dev.prepare(ck, {"x": bufs[j], "y": bufs[j + 1]}, slots, nthreads=1 + j % 2)
                for j, ck in enumerate(cks[:8])]
    plan = dev.plan(launches)
    for p in (3, -2):
        slots["pos"] = p
        plan()
        want = bufs[0].astype(np.float64)
        for j in range(8):
            want = want * j + p
        np.testing.assert_allclose(bufs[8], want, rtol=1e-5, atol=1e-3)


def test_pool_stress_sleep_wake():
    """Workers that fall asleep between launches must be woken correctly, many times."""
    dev = CPUDevice(nthreads=2, spin_us=3.0)
    N, K = 64, 32
    ck = dev.compile(gemv_kernel(N, K, name="stress"))
    x, w = rand("f32", K), rand("f16", N * K).reshape(N, K)
    out = np.zeros(N, np.float32)
    run = dev.prepare(ck, {"x": x, "w": w, "out": out}, nthreads=2)
    want = w.astype(np.float64) @ x
    for j in range(3000):
        out[:] = np.nan
        run()
        if j % 500 == 0:
            time.sleep(0.001)
        assert not np.isnan(out).any()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


def test_chunks_without_workers():
    """nthreads > 1 on a one-thread device: the launching thread claims every chunk itself."""
    dev1 = CPUDevice(nthreads=1)
    ck = dev1.compile(gemv_kernel(50, 40, name="solo"))
    x, w = rand("f32", 40), rand("f16", 2000).reshape(50, 40)
    out = np.zeros(50, np.float32)
    for nt in (1, 3, 7):
        out[:] = np.nan
        ck({"x": x, "w": w, "out": out}, nthreads=nt)
        np.testing.assert_allclose(out, w.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
    launch = dev1.prepare(ck, {"x": x, "w": w, "out": out}, nthreads=4)
    out[:] = np.nan
    dev1.plan([launch, launch])()
    np.testing.assert_allclose(out, w.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)


def test_source_is_textual_llvm(dev):
    ck = dev.compile(gemv_kernel(4, 8, name="src"))
    assert "define void @\"src" in ck.source and "noalias" in ck.source
    assert "fadd reassoc nsz arcp contract" in ck.source
    assert render_llvm(ck.kernel).count("define") == 2


def _rope_argmax(x):
    """An argmax over the rows of a RoPE-like expression (recomputed inside the argmax kernel)
    beside a stored value that kernel also reads."""
    angle = (dsl.arange(16) % 8 + 3).astype("f32") * 0.77
    v = x.reshape((8, 3, 16))
    rot = (v * dsl.cos(angle) + dsl.concatenate([-v[..., 8:], v[..., :8]], axis=-1) * dsl.sin(angle)).reshape((8, 48))
    low = dsl.minimum(rot, 1.02)
    return dsl.argmax(rot + low, 0), low


def test_an_argmax_step_computes_its_value_once():
    """The argmax step compares its value three times (larger? NaN?); computed three times, fast
    math rounded the copies differently, ``x != x`` held for numbers and the last row won."""
    x = rng.standard_normal((8, 48)).astype(np.float32)
    jf = dsl.jit(_rope_argmax)
    want = jf.lower(x).program.run(x, compute_dtype="f64")
    np.testing.assert_array_equal(np.asarray(jf(x)[0]), want[0])
