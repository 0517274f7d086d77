"""Every primitive: its shape/dtype rule, its numpy reference, its fusion class.

Elementwise primitives are defined by ``elementwise``: with the rule and the reference they
give their scalar Loop IR op (``codegen.loopir.OPS``) and how each renderer spells it, so adding
one touches this file and its test only.
"""
from __future__ import annotations

import re

import numpy as np

from codegen import loopir as L

from .core import DTYPES, DSLError, FLOATS, NP_DTYPES, QUANT_DTYPES, primitive, promote


def _np(dtype):
    return NP_DTYPES[dtype]


# ----------------------------------------------------------------------------- elementwise
def _unary_rule(avals, **_):
    (shape, dtype), = avals
    if dtype == "bool":
        raise DSLError("arithmetic on bool values; convert with .astype('i32') or use dsl.where")
    return shape, dtype


def _not_rule(avals, **_):
    (shape, dtype), = avals
    if dtype not in ("bool", "i32"):
        raise DSLError(f"needs a bool (logical) or i32 (bitwise) input, got {dtype}")
    return shape, dtype


def _float_unary_rule(avals, **_):
    (shape, dtype), = avals
    if dtype not in FLOATS:
        raise DSLError(f"needs a float input, got {dtype}; convert with .astype('f32')")
    return shape, dtype


def _same_rule(avals, **_):
    (sa, da), (sb, db) = avals
    if sa != sb:
        raise DSLError(f"shapes {list(sa)} and {list(sb)} differ (broadcast first)")
    if da != db:
        raise DSLError(f"dtypes {da} and {db} differ (convert with .astype)")
    return sa, da


def _binary_rule(avals, **_):
    shape, dtype = _same_rule(avals)
    if dtype == "bool":
        raise DSLError("arithmetic on bool values; convert with .astype('i32') or use logical_and/or")
    return shape, dtype


def _float_binary_rule(avals, **_):
    shape, dtype = _same_rule(avals)
    if dtype not in FLOATS:
        raise DSLError(f"needs float inputs, got {dtype}; convert with .astype('f32')")
    return shape, dtype


def _compare_rule(avals, **_):
    return _binary_rule(avals)[0], "bool"


def _equal_rule(avals, **_):
    return _same_rule(avals)[0], "bool"


def _bool_rule(avals, **_):
    shape, dtype = _same_rule(avals)
    if dtype not in ("bool", "i32"):
        raise DSLError(f"needs bool (logical) or i32 (bitwise) inputs, got {dtype}")
    return shape, dtype


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _cast_like(f):
    # keep the input dtype (numpy would promote f16 math to f16 anyway, but keep it explicit)
    def g(*xs):
        return np.asarray(f(*xs)).astype(xs[0].dtype, copy=False)
    return g


def elementwise(name, rule, impl, *, api=None, compare=False, arity=None, **spellings):
    """Define an elementwise primitive, all of it in one place.

    ``rule``: the shape/dtype rule; ``impl``: the numpy reference; ``api``: the public name that
    ``dsl`` exports (``dsl.<api>(x)`` or ``dsl.<api>(a, b)``, with numpy broadcasting and dtype
    promotion), None for internal ops.  ``spellings``: per dtype kind it accepts (``float``,
    ``int``, ``bool``), a pair ``(c, llvm)`` giving the scalar Loop IR op to each renderer (see
    ``codegen.loopir.ScalarOp``).  Fusion, the Loop IR and both renderers need nothing else.
    """
    arity = arity or (1 if "{x}" in next(iter(spellings.values()))[0] else 2)     # from the C template
    L.define_op(name, arity, {k: c for k, (c, _) in spellings.items()},
                {k: ll for k, (_, ll) in spellings.items()}, compare)
    prim = primitive(name, "elementwise", rule, impl)
    if api:
        API[api] = (name, arity)
    return prim


API: dict = {}          # public name -> (primitive name, arity); dsl/array.py makes the functions


# LLVM spellings composed from several instructions, over codegen/llvm.py's builder API
def _tanh_llvm(r, x):
    """tanh = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|); odd Taylor polynomial for |x| < 1/16."""
    ax = r.intr("llvm.fabs", x)
    e = r.intr("llvm.exp", r.inst("fmul", ax, r.const(-2.0, x)))
    one = r.const(1.0, x)
    big = r.intr("llvm.copysign", r.inst("fdiv", r.inst("fsub", one, e), r.inst("fadd", one, e)), x)
    x2 = r.inst("fmul", x, x)
    poly = r.inst("fadd", r.const(-1 / 3, x), r.inst("fmul", x2, r.const(2 / 15, x)))
    small = r.inst("fadd", x, r.inst("fmul", r.inst("fmul", x, x2), poly))
    return r.select(r.inst("fcmp_ordered <", ax, r.const(1 / 16, x)), small, big)


def _logistic_llvm(r, x):
    one = r.const(1.0, x)
    return r.inst("fdiv", one, r.inst("fadd", one, r.intr("llvm.exp", r.inst("fneg", x))))


elementwise("neg", _unary_rule, _cast_like(np.negative), api="neg",
            float=("(-{x})", "fneg"), int=("(-{x})", lambda r, x: r.inst("sub", r.const(0, x), x)))
elementwise("abs", _unary_rule, _cast_like(np.abs), api="abs",
            float=("fabsf({x})", "llvm.fabs"), int=("abs({x})", lambda r, x: r.intr("llvm.abs", x, r.const(0, "bool"))))
elementwise("exp", _float_unary_rule, _cast_like(np.exp), api="exp", float=("expf({x})", "llvm.exp"))
elementwise("log", _float_unary_rule, _cast_like(np.log), api="log", float=("logf({x})", "llvm.log"))
elementwise("sqrt", _float_unary_rule, _cast_like(np.sqrt), api="sqrt", float=("sqrtf({x})", "llvm.sqrt"))
elementwise("rsqrt", _float_unary_rule, _cast_like(lambda x: 1.0 / np.sqrt(x)), api="rsqrt",
            float=("rsqrtf({x})", lambda r, x: r.inst("fdiv", r.const(1.0, x), r.intr("llvm.sqrt", x))))
elementwise("sin", _float_unary_rule, _cast_like(np.sin), api="sin", float=("sinf({x})", "llvm.sin"))
elementwise("cos", _float_unary_rule, _cast_like(np.cos), api="cos", float=("cosf({x})", "llvm.cos"))
elementwise("tanh", _float_unary_rule, _cast_like(np.tanh), api="tanh", float=("tanhf({x})", _tanh_llvm))
elementwise("logistic", _float_unary_rule, _cast_like(_sigmoid), api="sigmoid",
            float=("(1.0f / (1.0f + expf(-({x}))))", _logistic_llvm))
elementwise("floor", _float_unary_rule, _cast_like(np.floor), api="floor", float=("floorf({x})", "llvm.floor"))
elementwise("not", _not_rule, np.invert, api="logical_not",
            bool=("(!{x})", lambda r, x: r.inst("xor", x, r.const(1, x))),
            int=("(~{x})", lambda r, x: r.inst("xor", x, r.const(-1, x))))      # bitwise on i32 (dsl's ~)


# ---- numpy functions (issue 9): erf, log1p, expm1 and pow, through the C math library on every
# backend (the CPU's LLVM calls libm; HIP and NVRTC have the same functions on the device)
def _libm(name):
    """An LLVM spelling that calls the C math library's float function ``name`` (``erff``)."""
    return lambda r, *xs: r.libm(name, *xs)


def _erf(x):
    from math import erf
    return np.vectorize(erf, otypes=[np.float64])(x)


elementwise("erf", _float_unary_rule, _cast_like(_erf), api="erf", float=("erff({x})", _libm("erff")))
elementwise("log1p", _float_unary_rule, _cast_like(np.log1p), api="log1p", float=("log1pf({x})", _libm("log1pf")))
elementwise("expm1", _float_unary_rule, _cast_like(np.expm1), api="expm1", float=("expm1f({x})", _libm("expm1f")))
# a float base to a float power (dsl.power turns integer and 0.5 exponents into products and sqrt first)
elementwise("pow", _float_binary_rule, _cast_like(np.power), float=("powf({a}, {b})", "llvm.pow"))


# its value is computed once and stored (fusion/partition.py materializes it): every reader sees the
# same bits, which comparisons of a value with itself (sort, top_k ranks) need when the value's
# expression would otherwise be recomputed in differently vectorized loops
primitive("optimization_barrier", "elementwise", lambda avals: avals[0], lambda x: x)


def _idiv(a, b):
    """C division (truncating toward zero) for ints, with a defined result where C has none:
    x / 0 is 0 and INT_MIN / -1 wraps to INT_MIN.  Floats: a / b."""
    if a.dtype.kind != "i":
        return a / b
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    q = np.abs(a64) // np.where(b64 == 0, 1, np.abs(b64)) * np.sign(a64) * np.sign(b64)
    return np.where(b64 == 0, 0, q).astype(np.int64).astype(a.dtype)     # wraps like two's complement


def _mod(a, b):
    """C remainder (the sign of ``a``); x % 0 is 0 for ints."""
    if a.dtype.kind != "i":
        return np.fmod(a, b)
    return np.where(b == 0, 0, np.fmod(a.astype(np.int64), np.where(b == 0, 1, b))).astype(a.dtype)


def _safe_int(op):
    """sdiv/srem that cannot trap: a zero divisor gives 0, INT_MIN / -1 wraps (INT_MIN, rem 0).
    With a constant divisor (every index computation) it is the bare instruction."""
    def f(r, a, b):
        if getattr(b, "constant", None) not in (None, 0, -1):
            return r.inst(op, a, b)
        zero, one = r.const(0, a), r.const(1, a)
        bad = r.inst("or_", r.inst("icmp_signed ==", b, zero),
                     r.inst("and_", r.inst("icmp_signed ==", b, r.const(-1, a)),
                            r.inst("icmp_signed ==", a, r.const(-2 ** 31, a))))
        q = r.inst(op, a, r.select(bad, one, b))
        special = r.select(r.inst("icmp_signed ==", b, zero), zero, a if op == "sdiv" else zero)
        return r.select(bad, special, q)
    return f


elementwise("add", _binary_rule, _cast_like(np.add), api="add", float=("({a} + {b})", "fadd"), int=("({a} + {b})", "add nsw"))
elementwise("sub", _binary_rule, _cast_like(np.subtract), api="sub",
            float=("({a} - {b})", "fsub"), int=("({a} - {b})", "sub nsw"))
elementwise("mul", _binary_rule, _cast_like(np.multiply), api="mul",
            float=("({a} * {b})", "fmul"), int=("({a} * {b})", "mul nsw"))
elementwise("div", _float_binary_rule, _cast_like(np.divide), float=("({a} / {b})", "fdiv"))   # dsl.div: ints -> f32
# NaN propagates like numpy: llvm.maximum/minimum on the CPU (llvm.maxnum in a loop-carried reduction
# without `nnan` also makes LLVM 22's loop vectorizer abort or miscompile gathers), vf_max/vf_min on GPUs
elementwise("max", _binary_rule, _cast_like(np.maximum), api="maximum",
            float=("vf_max({a}, {b})", "llvm.maximum"), int=("max({a}, {b})", "llvm.smax"))
elementwise("min", _binary_rule, _cast_like(np.minimum), api="minimum",
            float=("vf_min({a}, {b})", "llvm.minimum"), int=("min({a}, {b})", "llvm.smin"))
# integer division and remainder are Loop IR index arithmetic, reachable by users only through IR text
elementwise("idiv", _binary_rule, _idiv, float=("({a} / {b})", "fdiv"), int=("({a} / {b})", _safe_int("sdiv")))
elementwise("mod", _binary_rule, _mod, float=("fmodf({a}, {b})", "frem"), int=("({a} % {b})", _safe_int("srem")))
_C_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}
for _name, _f in COMPARE.items():
    _c = "({a} %s {b})" % _C_CMP[_name]
    # ordered float comparisons, except `ne`, which is true for NaN (as in C and numpy)
    _fl = f"fcmp_unordered {_C_CMP[_name]}" if _name == "ne" else f"fcmp_ordered {_C_CMP[_name]}"
    _kinds = dict(float=(_c, _fl), int=(_c, f"icmp_signed {_C_CMP[_name]}"))
    if _name in ("eq", "ne"):
        _kinds["bool"] = (_c, f"icmp_unsigned {_C_CMP[_name]}")
    elementwise(_name, _equal_rule if _name in ("eq", "ne") else _compare_rule, _f, compare=True, **_kinds)
elementwise("and", _bool_rule, np.bitwise_and, api="logical_and",
            bool=("({a} && {b})", "and_"), int=("({a} & {b})", "and_"))               # bitwise on i32 (dsl's &)
elementwise("or", _bool_rule, np.bitwise_or, api="logical_or", bool=("({a} || {b})", "or_"), int=("({a} | {b})", "or_"))


def _select_rule(avals, **_):
    (sc, dc), (sa, da), (sb, db) = avals
    if dc != "bool":
        raise DSLError(f"condition must be bool, got {dc}")
    if not (sc == sa == sb):
        raise DSLError(f"shapes {list(sc)}, {list(sa)}, {list(sb)} differ (broadcast first)")
    if da != db:
        raise DSLError(f"dtypes {da} and {db} differ")
    return sa, da


primitive("select", "elementwise", _select_rule, lambda c, a, b: np.where(c, a, b))


def _convert_rule(avals, *, dtype):
    (shape, _), = avals
    if dtype not in DTYPES:
        raise DSLError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return shape, dtype


primitive("convert", "elementwise", _convert_rule, lambda x, *, dtype: x.astype(_np(dtype)))


def _iota_rule(avals, *, shape, dimension, dtype):
    if dtype not in DTYPES:
        raise DSLError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if not 0 <= dimension < len(shape):
        raise DSLError(f"dimension {dimension} out of range for shape {list(shape)}")
    return tuple(shape), dtype


def _iota_impl(*, shape, dimension, dtype):
    v = np.arange(shape[dimension]).astype(_np(dtype))
    return np.broadcast_to(v.reshape([-1 if i == dimension else 1 for i in range(len(shape))]), shape).copy()


primitive("iota", "elementwise", _iota_rule, _iota_impl)


# ----------------------------------------------------------------------------- views
def _broadcast_rule(avals, *, shape, dims):
    (s, d), = avals
    if len(dims) != len(s) or any(not 0 <= k < len(shape) for k in dims) or list(dims) != sorted(set(dims)):
        raise DSLError(f"bad dims {dims} for input {list(s)} -> {list(shape)}")
    for k, n in zip(dims, s):
        if n != 1 and n != shape[k]:
            raise DSLError(f"cannot broadcast {list(s)} to {list(shape)}")
    return tuple(shape), d


def _broadcast_impl(x, *, shape, dims):
    x = x.reshape([x.shape[dims.index(k)] if k in dims else 1 for k in range(len(shape))])
    return np.broadcast_to(x, shape)


primitive("broadcast_in_dim", "view", _broadcast_rule, _broadcast_impl)


def _reshape_rule(avals, *, shape):
    (s, d), = avals
    if any(int(x) < 0 for x in shape) or int(np.prod(s, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)):
        raise DSLError(f"cannot reshape {list(s)} to {list(shape)}")
    return tuple(shape), d


primitive("reshape", "view", _reshape_rule, lambda x, *, shape: x.reshape(shape))


def _transpose_rule(avals, *, perm):
    (s, d), = avals
    if sorted(perm) != list(range(len(s))):
        raise DSLError(f"bad permutation {perm} for rank {len(s)}")
    return tuple(s[p] for p in perm), d


primitive("transpose", "view", _transpose_rule, lambda x, *, perm: np.transpose(x, perm))


def _slice_rule(avals, *, start, limit):
    (s, d), = avals
    if len(start) != len(s) or len(limit) != len(s) or any(
            not 0 <= a <= b <= n for a, b, n in zip(start, limit, s)):
        raise DSLError(f"bad slice {start}:{limit} of {list(s)}")
    return tuple(b - a for a, b in zip(start, limit)), d


primitive("slice", "view", _slice_rule,
          lambda x, *, start, limit: x[tuple(slice(a, b) for a, b in zip(start, limit))])


def _concat_rule(avals, *, axis):
    s0, d0 = avals[0]
    for s, d in avals[1:]:
        if d != d0:
            raise DSLError(f"dtypes {[d for _, d in avals]} differ; convert with .astype first")
        if len(s) != len(s0) or any(a != b for i, (a, b) in enumerate(zip(s, s0)) if i != axis):
            raise DSLError(f"cannot concatenate {[list(s) for s, _ in avals]} on axis {axis}")
    shape = list(s0)
    shape[axis] = sum(s[axis] for s, _ in avals)
    return tuple(shape), d0


primitive("concatenate", "view", _concat_rule, lambda *xs, axis: np.concatenate(xs, axis))


# ----------------------------------------------------------------------------- index
def _take_rule(avals, **_):
    (sx, dx), (si, di) = avals
    if di != "i32":
        raise DSLError(f"indices must be i32, got {di}")
    if len(sx) < 1:
        raise DSLError("cannot take rows of a scalar")
    return tuple(si) + tuple(sx[1:]), dx


primitive("take", "index", _take_rule, lambda x, ids: x[np.clip(ids, 0, x.shape[0] - 1)])   # clamps, like XLA


def _dus_rule(avals, **_):
    (so, do), (su, du), *starts = avals
    if len(starts) != len(so):
        raise DSLError(f"needs {len(so)} start indices, got {len(starts)}")
    if any(s != () or d != "i32" for s, d in starts):
        raise DSLError("start indices must be i32 scalars")
    if len(su) != len(so) or any(u > o for u, o in zip(su, so)):
        raise DSLError(f"update {list(su)} does not fit operand {list(so)}")
    if du != do:
        raise DSLError(f"update dtype {du} differs from operand dtype {do}")
    return so, do


def _dus_impl(x, u, *starts):
    out = x.copy()
    idx = []
    for s, n, m in zip(starts, u.shape, x.shape):
        s = int(min(max(int(s), 0), m - n))     # clamp like XLA
        idx.append(slice(s, s + n))
    out[tuple(idx)] = u
    return out


primitive("dynamic_update_slice", "index", _dus_rule, _dus_impl)



# ---- indexing: gather and scatter (x[ids], x[i, :, j], take(axis=), take_along_axis, .at[...])
def _index_arrays(ids, shape, what):
    """Check the per-dimension index arrays of a gather or scatter: one i32 array per dim of the
    operand, all of shape ``shape``."""
    if any(d != "i32" for _, d in ids):
        raise DSLError(f"{what} indices must be i32, got {', '.join(sorted({d for _, d in ids} - {'i32'}))}")
    if any(tuple(s) != tuple(shape) for s, _ in ids):
        raise DSLError(f"{what} index arrays {[list(s) for s, _ in ids]} must all have shape {list(shape)}")


def _gather_rule(avals, **_):
    (sx, dx), *ids = avals
    if len(ids) != len(sx) or not ids:
        raise DSLError(f"needs one index array per dimension of the operand {list(sx)}, got {len(ids)}")
    _index_arrays(ids, ids[0][0], "gather")
    return tuple(ids[0][0]), dx


def _wrap(i, n):
    """Negative indices count from the end, once (numpy's and JAX's rule)."""
    return np.where(i < 0, i.astype(np.int64) + n, i)


def _gather_impl(x, *ids):
    """out[p] = x[ids[0][p], ids[1][p], ...], each index counted from the end when negative, then
    clamped into its dimension (like JAX's gathers)."""
    return x[tuple(np.clip(_wrap(i, n), 0, n - 1) for i, n in zip(ids, x.shape))]


# an index op: inlined where it is read (each element is a load at the clamped indices)
primitive("gather", "index", _gather_rule, _gather_impl)

SCATTER_OPS = ("set", "add", "mul", "min", "max")


def _scatter_rule(avals, *, op, batch):
    (sx, dx), (su, du), *ids = avals
    if op not in SCATTER_OPS:
        raise DSLError(f"unknown scatter op {op!r}; use one of {', '.join(SCATTER_OPS)}")
    if len(ids) != len(sx) or not ids:
        raise DSLError(f"needs one index array per dimension of the operand {list(sx)}, got {len(ids)}")
    _index_arrays(ids, su, "scatter")
    if du != dx:
        raise DSLError(f"update dtype {du} differs from operand dtype {dx}")
    if not 0 <= batch <= len(su):
        raise DSLError(f"batch {batch} out of range for updates of rank {len(su)}")
    if op != "set" and dx == "bool":
        raise DSLError(f"scatter {op} on bool values; convert with .astype('i32')")
    return tuple(sx), dx


_SCATTER_UFUNC = {"add": np.add, "mul": np.multiply, "min": np.minimum, "max": np.maximum}


def _scatter_impl(x, u, *ids, op, batch):
    """``x`` with ``u[p]`` combined (``op``) into ``x[ids[0][p], ids[1][p], ...]`` for every p, in
    row-major order of p (so with repeated indices the last ``set`` wins and ``add`` accumulates);
    negative indices count from the end once, and a p with any index still out of its dimension
    is dropped (like JAX's scatters)."""
    out = x.copy()
    ids = [_wrap(i, n) for i, n in zip(ids, x.shape)]
    ok = np.ones(u.shape, bool)
    for i, n in zip(ids, x.shape):
        ok &= (i >= 0) & (i < n)
    where = tuple(i[ok] for i in ids)
    vals = u[ok].astype(x.dtype)
    if op == "set":
        flat = np.ravel_multi_index(where, x.shape) if x.ndim else np.zeros(len(vals), np.int64)
        _, first = np.unique(flat[::-1], return_index=True)          # the last write of each element
        last = len(flat) - 1 - first
        out.reshape(-1)[flat[last]] = vals[last]
    else:
        _SCATTER_UFUNC[op].at(out, where, vals)
    return out


# its own kernel family (fusion/schedule.py scatter_kernel): the operand is copied (or, donated and
# read by no later kernel, updated in place), then each update element is combined into it
primitive("scatter", "index", _scatter_rule, _scatter_impl)
# ---- end of indexing


# ----------------------------------------------------------------------------- reductions (last axis)
def _reduce_rule(avals, **_):
    (s, d), = avals
    if len(s) < 1:
        raise DSLError("cannot reduce a scalar")
    return tuple(s[:-1]), d


def _argmax_rule(avals, **_):
    s, _ = _reduce_rule(avals)
    return s, "i32"


primitive("reduce_sum", "reduce", _reduce_rule, lambda x: np.sum(x, axis=-1).astype(x.dtype, copy=False))
primitive("reduce_max", "reduce", _reduce_rule, lambda x: np.max(x, axis=-1))
primitive("argmax", "reduce", _argmax_rule, lambda x: np.argmax(x, axis=-1).astype(np.int32))


# ----------------------------------------------------------------------------- quantized weights
def _dequantize_rule(avals, *, dtype):
    (shape, src), = avals
    if src not in QUANT_DTYPES:
        raise DSLError(f"needs a quantized array ({', '.join(QUANT_DTYPES)}), got {src}")
    if dtype not in FLOATS:
        raise DSLError(f"dequantizes to a float dtype, not {dtype!r}")
    return shape, dtype


def _dequantize_impl(w, *, dtype):
    """The float values of a ``dsl.QArray`` (bit for bit ``gguf.quants.dequantize``, then ``dtype``)."""
    return w.dequantize().astype(_np(dtype))


# an index op: each element is a load through the format (its block's scale times its quant), inlined
# into the kernel that reads it (the GEMV), so that no float copy of a weight is ever written
primitive("dequantize", "index", _dequantize_rule, _dequantize_impl)


# ----------------------------------------------------------------------------- contraction
def _dot_rule(avals, *, trans_b):
    (sa, da), (sb, db) = avals
    if len(sa) < 2 or len(sb) < 2 or len(sa) != len(sb):
        raise DSLError(f"needs operands of equal rank >= 2, got {list(sa)} and {list(sb)}")
    if sa[:-2] != sb[:-2]:
        raise DSLError(f"batch dims {list(sa[:-2])} and {list(sb[:-2])} differ")
    k_b, n = (sb[-1], sb[-2]) if trans_b else (sb[-2], sb[-1])
    if sa[-1] != k_b:
        raise DSLError(f"contracting dims differ: {list(sa)} @ {list(sb)}{'^T' if trans_b else ''}")
    if da not in FLOATS or db not in FLOATS:
        raise DSLError(f"needs float operands, got {da} and {db}")
    # like JAX: the result has the promoted operand dtype (f16 @ f16 -> f16); kernels accumulate in f32
    return tuple(sa[:-1]) + (n,), promote(da, db)


def _dot_impl(a, b, *, trans_b):
    bt = np.swapaxes(b, -1, -2) if trans_b else b
    acc = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
    out = np.matmul(a.astype(acc), bt.astype(acc))
    return out.astype(np.promote_types(a.dtype, b.dtype) if acc == np.float64 else np.float32)


primitive("dot", "contract", _dot_rule, _dot_impl)


# ----------------------------------------------------------------------------- decode attention
def _attention_rule(avals, *, scale):
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise DSLError(f"scale must be a number, got {scale!r}")
    (sq, dq), (sk, dk), (sv, dv), (sp, dp) = avals
    if len(sq) != 3 or len(sk) != 3 or sk != sv:
        raise DSLError(f"needs q [Hq,T,D], k and v [Hkv,S,D]; got {list(sq)}, {list(sk)}, {list(sv)}")
    if sq[0] % sk[0] or sq[2] != sk[2]:
        raise DSLError(f"query heads {sq[0]} must be a multiple of kv heads {sk[0]}, head dims equal")
    if sp != () or dp != "i32":
        raise DSLError("pos must be an i32 scalar")
    if sq[1] > sk[1]:
        raise DSLError(f"{sq[1]} query rows do not fit a cache of {sk[1]} positions")
    return sq, "f32"


def _attention_impl(q, k, v, pos, *, scale):
    """Causal GQA attention: query t (absolute position pos+t) sees keys 0..pos+t.
    Query head h reads kv head h // (Hq // Hkv).  Softmax in float64/float32 accumulate.
    ``pos`` is clamped to [0, S - T], as dynamic_update_slice clamps its offsets."""
    acc = np.float64 if q.dtype == np.float64 else np.float32
    hq, t, _ = q.shape
    pos = min(max(int(pos), 0), k.shape[1] - t)      # clamped so the queries fit, like the kernels
    group = hq // k.shape[0]
    out = np.zeros(q.shape, acc)
    for h in range(hq):
        kh, vh = k[h // group].astype(acc), v[h // group].astype(acc)
        for i in range(t):
            n = int(pos) + i + 1
            s = kh[:n] @ q[h, i].astype(acc) * scale
            p = np.exp(s - s.max())
            out[h, i] = (p / p.sum()) @ vh[:n]
    return out.astype(np.float32) if acc == np.float32 else out


primitive("attention", "opaque", _attention_rule, _attention_impl)


# ----------------------------------------------------------------------------- user-defined primitives
# A user's elementwise primitive is defined by ``elementwise`` like a built-in: its scalar op's
# spellings render the Loop IR expression it is written as, with each renderer's own expressions.
USER: dict = {}         # name -> the Loop IR expression text of each primitive defined by a user
_ARGS = {1: ("x",), 2: ("a", "b")}
_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf\b|nan\b)|(?P<name>[A-Za-z_]\w*)|(?P<punct>[(),]))")


def _parse_expr(text, where):
    """``text`` (Loop IR's printed form: ``add(max(x, 0.0), log(add(1.0, exp(neg(abs(x))))))``) as
    a tree of ``("arg", name)``, ``("num", value)``, ``("call", op, children)``."""
    toks, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise DSLError(f"{where}: cannot read {text[pos:].strip()[:20]!r} in the expression {text!r}")
        toks.append(m.group("num") or m.group("name") or m.group("punct"))
        pos = m.end()
    toks.append(None)

    def term(i):
        t = toks[i]
        if t is None or t in "(),":
            raise DSLError(f"{where}: the expression {text!r} is cut short or has a stray {t!r}")
        if t[0].isdigit() or t[0] in "+-." or t in ("inf", "nan"):
            return ("num", float(t)), i + 1
        if toks[i + 1] != "(":
            return (("num", t == "true") if t in ("true", "false") else ("arg", t)), i + 1
        children, i = [], i + 2
        while True:
            child, i = term(i)
            children.append(child)
            if toks[i] == ")":
                return ("call", t, children), i + 1
            if toks[i] != ",":
                raise DSLError(f"{where}: expected ',' or ')' after an argument of {t}( in {text!r}")
            i += 1
    tree, i = term(0)
    if toks[i] is not None:
        raise DSLError(f"{where}: unexpected {toks[i]!r} after the end of the expression {text!r}")
    return tree


def _typed(tree, dtype, where, operands=None):
    """The Loop IR expression of ``tree`` on inputs of ``dtype`` (literals take that dtype, ``true``
    and ``false`` are bool), its operands ``operands[name]`` (Loop IR expressions) or placeholders
    ``Sym("{x}")``; DSLError for an op that is not a Loop IR op or not spelled for its operands'
    dtype, or operands of different dtypes."""
    kind = tree[0]
    if kind == "arg":
        return operands[tree[1]] if operands else L.Sym("{%s}" % tree[1], dtype)
    if kind == "num":
        v = tree[1]
        if isinstance(v, bool):
            return L.Const(v, "bool")
        if dtype == "bool" or (dtype == "i32" and v != int(v)):
            raise DSLError(f"{where}: the literal {v} does not fit {dtype} inputs"
                           + (" (write true or false)" if dtype == "bool" else ""))
        return L.Const(int(v) if dtype == "i32" else v, dtype)
    op, args = tree[1], [_typed(c, dtype, where, operands) for c in tree[2]]
    if op == "select":
        if len(args) != 3 or args[0].dtype != "bool" or args[1].dtype != args[2].dtype:
            raise DSLError(f"{where}: select takes (bool condition, a, b) with a and b of one dtype")
        return L.Select(*args)
    if op not in L.op_table():
        raise DSLError(f"{where}: {op!r} is not a Loop IR op; use one of {', '.join(sorted(L.OPS))}, select")
    if L.OPS[op].arity != len(args):
        raise DSLError(f"{where}: {op} takes {L.OPS[op].arity} operand(s), got {len(args)}")
    if len(args) == 2 and args[0].dtype != args[1].dtype:
        raise DSLError(f"{where}: {op} of {args[0].dtype} and {args[1].dtype} operands; operands share one dtype")
    try:
        L.spelling(op, args[0].dtype, "c"), L.spelling(op, args[0].dtype, "llvm")
    except NotImplementedError:
        raise DSLError(f"{where}: {op} is not defined on {args[0].dtype} operands; "
                       "refuse that dtype in the shape rule") from None
    return L.Un(op, args[0]) if len(args) == 1 else L.Bin(op, *args)


def _evaluate(e, env):
    """A typed expression evaluated with the primitives' numpy references (float64 inputs)."""
    if isinstance(e, L.Sym):
        return env[e.name]
    if isinstance(e, L.Const):
        return np.asarray(e.value, np.float64 if e.dtype in FLOATS else _np(e.dtype))
    if isinstance(e, L.Select):
        return np.where(*[_evaluate(x, env) for x in (e.cond, e.a, e.b)])
    from .core import PRIMITIVES
    return PRIMITIVES[e.op].impl(*[_evaluate(x, env) for x in ((e.x,) if isinstance(e, L.Un) else (e.a, e.b))])


def _c_spelling(tree, where):
    """The C spelling of a composed op: the expression on the operands, rendered by
    ``codegen/hip.py`` (literals in the operands' dtype, as a hand-written composition has them)."""
    def spell(*operands):
        from codegen import hip
        return hip.expr(_typed(tree, operands[0].dtype, where, dict(zip(_ARGS[len(operands)], operands))))
    return spell


def _llvm_spelling(trees):
    """The LLVM spelling of a composed op: the renderer renders the expression itself, its
    placeholders bound to the operands' values."""
    names = {"float": "f32", "half": "f16", "i32": "i32", "i1": "bool"}

    def spell(r, *vals):
        dtype = names[str(vals[0].type)]
        env = {"{%s}" % n: ("val", v, dtype) for n, v in zip(_ARGS[len(vals)], vals)}
        return r.expr(trees[dtype], env)
    return spell


def define_elementwise(name, rule, reference, expr):
    """Define an elementwise primitive from user code, in one call; returns its function.

    ``name``: a new primitive name (not a built-in's).  ``rule(avals) -> (shape, dtype)``: the
    shape/dtype rule, ``avals`` a list of ``(shape, dtype)`` pairs (dtype names such as ``"f32"``),
    raising ``dsl.DSLError`` for inputs it refuses (an elementwise primitive keeps its inputs'
    shape).  ``reference(*arrays) -> array``: the numpy reference (the interpreter, and the tests'
    float64 oracle).  ``expr``: its scalar expression in Loop IR ops (``codegen.loopir.OPS``, as
    ``format_kernel`` prints them, and ``select(c, a, b)``), over ``x`` for one input or ``a`` and
    ``b`` for two; literals take the inputs' dtype (``true``, ``false``: bool).  Example::

        def float_rule(avals):
            (shape, dtype), = avals
            if dtype not in ("f32", "f16"):
                raise dsl.DSLError(f"needs a float input, got {dtype}")
            return shape, dtype
        softplus = dsl.define_elementwise("my_softplus", float_rule, lambda x: np.logaddexp(0, x),
                                          "add(max(x, 0.0), log(add(1.0, exp(neg(abs(x))))))")

    The primitive is then a built-in in every respect: it fuses (into a GEMV epilogue, say), the
    Loop IR shows it as one op, each renderer spells it from the expression, ``dsl.parse_ir``
    reads it back, and the function broadcasts and promotes like ``dsl.add``.  Checked here, each
    failure one ``DSLError`` line: the name, the expression (ops, arity, dtypes), the rule's result
    for each dtype (f32, f16, i32, bool) it accepts, the reference's shape, and the reference and
    the expression agreeing in float64 on random inputs.  Redefining a user primitive replaces it.

    Differs from JAX (``jax.core.Primitive`` with ``def_impl``, ``def_abstract_eval`` and lowering
    rules): one call, elementwise only, and no differentiation."""
    from .core import PRIMITIVES
    where = f"primitive {name!r}"
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise DSLError(f"{where}: a primitive name is lowercase letters, digits and _")
    if (name in PRIMITIVES or name in L.op_table()) and name not in USER:
        raise DSLError(f"{where}: a built-in primitive has that name; choose another")
    if not isinstance(expr, str):
        raise DSLError(f"{where}: expr must be a Loop IR expression string, got {type(expr).__name__}")
    tree = _parse_expr(expr, where)

    def args_of(t):
        return {t[1]} if t[0] == "arg" else set().union(*map(args_of, t[2])) if t[0] == "call" else set()
    used = args_of(tree)
    arity = 1 if used <= {"x"} else 2 if used <= {"a", "b"} else 0
    if not arity or not used:
        raise DSLError(f"{where}: the expression names its operands x (one input), or a and b (two); "
                       f"it uses {sorted(used) or 'none'}")

    def checked_rule(avals, **params):
        out = rule(avals, **params)
        try:
            shape, dtype = out
            shape, dtype = tuple(int(d) for d in shape), dtype if dtype in DTYPES else _dtype_name(dtype)
        except (TypeError, ValueError, DSLError):
            raise _BadRule(f"its shape rule returned {out!r}; return (shape, dtype), dtype one of "
                           f"{', '.join(DTYPES)}") from None
        if shape != tuple(avals[0][0]):
            raise _BadRule(f"its shape rule gives shape {list(shape)} for inputs of shape {list(avals[0][0])}; "
                           "an elementwise primitive keeps its inputs' shape")
        return shape, dtype

    trees, accepted = {}, {}
    rng = np.random.default_rng(0)
    for dt in DTYPES:
        try:
            out = checked_rule([((2, 3), dt)] * arity)
        except _BadRule as e:
            raise DSLError(f"{where}: {e}") from None
        except DSLError:                    # the rule refuses this dtype
            continue
        except Exception as e:              # a rule refuses with DSLError; anything else is a bug in it
            raise DSLError(f"{where}: its shape rule raised {type(e).__name__}: {e}; refuse inputs with "
                           "dsl.DSLError") from None
        t = _typed(tree, dt, where)
        if t.dtype != out[1] or (arity == 1 and t.dtype != dt) or t.dtype not in (dt, "bool"):
            raise DSLError(f"{where}: on {dt} inputs the expression gives {t.dtype} but the rule gives {out[1]}"
                           + ("; a one-input op keeps its input's dtype" if arity == 1 else ""))
        trees[dt], accepted[dt] = t, out
    if not trees:
        raise DSLError(f"{where}: its shape rule accepts none of {', '.join(DTYPES)}")
    for dt in trees:                        # the reference against the expression, in float64
        xs = [(rng.uniform(-4, 4, (2, 3)) if dt in FLOATS else rng.integers(-50, 50, (2, 3)) if dt == "i32"
               else rng.integers(0, 2, (2, 3)).astype(bool)) for _ in range(arity)]
        xs = [x.astype(np.float64) if dt in FLOATS else x.astype(_np(dt)) for x in xs]
        try:
            got = np.asarray(reference(*xs))
        except Exception as e:
            raise DSLError(f"{where}: its reference raised {type(e).__name__} on {dt} inputs: {e}") from None
        if got.shape != accepted[dt][0]:
            raise DSLError(f"{where}: its reference returned shape {list(got.shape)} for inputs of shape [2, 3]; "
                           f"the rule gives {list(accepted[dt][0])}")
        with np.errstate(all="ignore"):
            want = _evaluate(trees[dt], {"{%s}" % n: x for n, x in zip(_ARGS[arity], xs)})
            bad = ~np.isclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=1e-4, atol=1e-6,
                              equal_nan=True)
        if bad.any():
            i = tuple(int(k) for k in np.argwhere(bad)[0])
            at = ", ".join(f"{n}={_show(x[i])}" for n, x in zip(_ARGS[arity], xs))
            raise DSLError(f"{where}: the reference gives {_show(got[i])} and the expression {_show(want[i])} "
                           f"at {at} ({dt}); make them agree")
    compare = any(t.dtype != dt for dt, t in trees.items())         # gives bool on other inputs
    if compare and any(t.dtype != "bool" for t in trees.values()):
        raise DSLError(f"{where}: the expression gives bool on some input dtypes and not on others; "
                       "restrict the rule to one kind")
    spelled = (_c_spelling(tree, where), _llvm_spelling(trees))
    kinds = {L.kind_of(dt): spelled for dt in trees}
    USER[name] = expr
    elementwise(name, lambda avals, **_: checked_rule(avals), reference, compare=compare, arity=arity, **kinds)
    from .array import _make_api
    f = _make_api(name, name, arity)
    f.__doc__ = f"``{name}``: a user-defined elementwise primitive, {expr}"
    return f


class _BadRule(DSLError):
    """A shape rule's result that is not a valid one (not a refusal)."""


def _show(v) -> str:
    v = np.asarray(v).item()
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _dtype_name(dtype) -> str:
    from .core import dtype_of
    return dtype_of(np.dtype(dtype))
