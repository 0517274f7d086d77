"""CPU backend: render a Loop IR ``Kernel`` as textual LLVM IR (built with ``llvmlite.ir``).

Function ABI (one exported symbol per kernel)::

    void NAME(ptr args, i32 tid, i32 nthreads)

``args`` is a table of ``len(kernel.params)`` pointers, one per parameter in
``kernel.params`` order: a buffer parameter's entry points at its first element
(contiguous, row-major, element type of its dtype, ``bool`` as one byte); a
scalar parameter's entry points at an ``i32`` that is read once at entry (so a
launch can be pre-bound and the scalar changed in place between launches).

``NAME`` unpacks the table and calls ``NAME.body(<one argument per param>, tid,
nthreads)`` whose buffer pointers carry ``noalias`` where that is safe (see
``_noalias``).  Every thread runs the whole body; the outermost ``parallel``
loop of each loop nest only runs its own contiguous chunk of iterations
(``tid`` of ``nthreads``).  Nothing in the generated code creates threads.
An ``Array`` in space "lds" is a module global that the launch's threads share (attention's
context parts, merged by the call that arrives last: ``_Renderer.last_arrival``); a kernel's
launches must therefore not overlap, as the CPU device guarantees.

Lowering: mutable locals (``Declare``) and local ``Array``s are allocas in the
entry block (mem2reg/SROA promote them); loops are header/body/latch with an
i32 induction variable; float arithmetic carries fast-math flags without
``nnan``/``ninf`` (masked softmax relies on -inf); float max/min are
``llvm.maximum``/``llvm.minimum`` (NaN-propagating, like numpy; a ``maxnum``
reduction without ``nnan`` crashes LLVM 22's loop vectorizer);
``idiv``/``mod`` are signed i32 ``sdiv``/``srem`` (C semantics, truncating);
``tanh`` and ``logistic`` are composed from ``llvm.exp``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import numpy as np
from llvmlite import ir

from .loopir import (Array, Assign, Attention, Barrier, Bin, Cast, Comment, Const, Declare, If, Kernel, Load, Loop,
                     Reduce, Select, Store, Sym, Un, expand_attention, format_expr, format_kernel, can_interchange,
                     interchange, serial_reduce)
from .loopir import attention_tiles, combine_attention
from .loopir import QDot, QLoad, QuantizeQ8, int8_activation, quantized_activations
from .loopir import spelling as op_spelling
from .loopir import fold, rewrite_expr, walk_exprs, walk_stmts
from dsl.quant import FORMATS, QUANT_DTYPES, nbytes
from .env import env_choice, env_int, switch

I1, I8, I32, PTR = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.PointerType()
VOID = ir.VoidType()
TYPES = {"f32": ir.FloatType(), "f16": ir.HalfType(), "i32": I32, "bool": I1}          # SSA value types
MEM_TYPES = {**TYPES, "bool": I8, "q8_1": I8, "q8_1r": I8, **{q: I8 for q in QUANT_DTYPES}}  # in-memory types
ELEM_BYTES = {"f32": 4, "f16": 2, "i32": 4, "bool": 1}                # quantized buffers: bytes, see _buffer_bytes
# bytes of an activation block in a local array (codegen.loopir.QuantizeQ8): 32 int8 quants, (q8_1r) 32 int8
# residuals (PLANE_BYTES), and its f32 d and s; the array holds every block's planes, then every block's
# (d, s), so that consecutive blocks' scales load as one vector
Q8_BYTES = {"q8_1r": 72, "q8_1": 40}
PLANE_BYTES = {"q8_1r": 64, "q8_1": 32}
KIND = {"f32": "float", "f16": "float", "i32": "int", "bool": "bool"}
FMF = ("reassoc", "nsz", "arcp", "contract", "afn")   # `fast` minus nnan/ninf
ACC_FMF = FMF[1:]                                     # an accumulator's adds: not reassociated
# an interchanged GEMV (a (K, N) weight): each thread's columns in chunks of COLUMNS accumulators in
# all (L1-resident), each pass over a chunk folding ROWS weight rows
COLUMNS = env_int("VEGAFUSE_CPU_COLUMNS", 4096, 1)
ROWS = env_int("VEGAFUSE_CPU_ROWS", 8, 1)
MAX_STACK_BYTES = 4 << 20                              # local Arrays live on the (thread's) stack


# ----------------------------------------------------------------------------- casts
# (from, to) -> builder call; looked up by exact dtype first, then by kind.
CAST_TABLE = {
    ("f16", "f32"): lambda r, x, ty: r.b.fpext(x, ty),
    ("f32", "f16"): lambda r, x, ty: r.b.fptrunc(x, ty),
    ("float", "int"): lambda r, x, ty: r.b.fptosi(x, ty),
    ("int", "float"): lambda r, x, ty: r.b.sitofp(x, ty),
    ("bool", "int"): lambda r, x, ty: r.b.zext(x, ty),
    ("bool", "float"): lambda r, x, ty: r.b.uitofp(x, ty),
    ("int", "bool"): lambda r, x, ty: r.b.icmp_signed("!=", x, ir.Constant(I32, 0)),
    ("float", "bool"): lambda r, x, ty: r.b.fcmp_unordered("!=", x, ir.Constant(x.type, 0.0)),
}


# ----------------------------------------------------------------------------- renderer
def _noalias(kernel: Kernel):
    """Params whose pointer may be marked noalias.

    "out" buffers never alias another parameter.  "in" and "inout" buffers are
    marked only when the kernel has no "inout" buffer (read-only pointers may
    alias each other freely; an inout one might be passed again as an input).
    """
    has_inout = any(p.kind == "buffer" and p.role == "inout" for p in kernel.params)
    return {p.name for p in kernel.params
            if p.kind == "buffer" and (p.role == "out" or not has_inout)}


class _Renderer:
    def __init__(self, module: ir.Module, kernel: Kernel, vnni: bool = False):
        self.module, self.kernel = module, kernel
        self.vnni = bool(vnni)               # the host has VNNI dot products (vpdpbusd)
        self.wide = vnni == 512              # ... and 512-bit ones (AVX-512 VNNI and BW): ``qdot_pair``
        self.b: ir.IRBuilder = None
        self.entry: ir.IRBuilder = None      # positioned in the entry block, for allocas
        self.tid = self.nthreads = None
        self.in_parallel = False
        self.stack_bytes = 0
        self.q8_blocks = {}                  # activation array -> its block count (where its (d, s) start)

    # ---- helpers
    def intr(self, name, *args):
        """Call the overloaded intrinsic ``name`` (suffix from the first argument's type)."""
        ty = args[0].type
        full = f"{name}.{ty.intrinsic_name}"
        fn = self.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ty, [a.type for a in args]), full)
        flags = FMF if isinstance(ty, (ir.FloatType, ir.HalfType)) else ()
        return self.b.call(fn, args, fastmath=flags)

    @staticmethod
    def float_value(v, ty):
        # LLVM rejects float literals that are not exactly representable in the type
        return float(np.float16(v) if isinstance(ty, ir.HalfType) else np.float32(v))

    def fail(self, msg, e=None):
        where = f" in `{format_expr(e)}`" if e is not None else ""
        raise TypeError(f"kernel {self.kernel.name}: {msg}{where}")

    def lookup(self, env, name, e=None):
        if name not in env:
            self.fail(f"unknown name {name!r}", e)
        return env[name]

    # ---- expressions
    def expr(self, e, env):
        return self.EXPR[type(e)](self, e, env)

    def sym(self, e, env):
        kind, val, dtype = self.lookup(env, e.name, e)
        if kind not in ("val", "var"):
            self.fail(f"{e.name!r} is not a scalar", e)
        if dtype != e.dtype:
            self.fail(f"{e.name!r} is {dtype}, used as {e.dtype}", e)
        return val if kind == "val" else self.b.load(val, typ=TYPES[dtype])

    def element_ptr(self, buf, index, env, e):
        kind, base, dtype = self.lookup(env, buf, e)
        if kind not in ("buf", "arr"):
            self.fail(f"{buf!r} is not a buffer or array", e)
        idx = self.expr(index, env)
        if idx.type != I32:
            self.fail("index must be i32", e)
        return self.b.gep(base, [idx], inbounds=True, source_etype=MEM_TYPES[dtype]), dtype

    def load(self, e, env):
        ptr, dtype = self.element_ptr(e.buf, e.index, env, e)
        v = self.b.load(ptr, typ=MEM_TYPES[dtype], align=ELEM_BYTES[dtype])
        return self.b.icmp_unsigned("!=", v, ir.Constant(I8, 0)) if dtype == "bool" else v

    def qload(self, e, env):
        """Element ``e.index`` of a quantized buffer (``dsl/quant.py``'s device layout): its quant
        from the block's 16 or 32 quant bytes, times the block's f16 scale ``d`` (plus ``m`` for
        q4_1; ``d * (q - z)`` for gptq_int4), in f32 without fast-math flags, as
        ``gguf.quants.dequantize`` computes it."""
        kind, base, dtype = self.lookup(env, e.buf, e)
        if kind != "buf" or dtype != e.fmt:
            self.fail(f"{e.buf!r} is not a {e.fmt} buffer", e)
        b, f = self.b, FORMATS[e.fmt]
        i = self.expr(e.index, env)
        blk, j = b.lshr(i, ir.Constant(I32, 5)), b.and_(i, ir.Constant(I32, 31))   # i >= 0

        def at(offset, ty, align):
            return b.load(b.gep(base, [offset], inbounds=True, source_etype=I8), typ=ty, align=align)
        scales = b.add(ir.Constant(I32, e.count // 32 * f.quant_bytes), b.mul(blk, ir.Constant(I32, f.scale_bytes)))
        d = b.fpext(at(scales, ir.HalfType(), 2), TYPES["f32"])
        if e.fmt == "q8_0":
            q = at(b.add(b.mul(blk, ir.Constant(I32, 32)), j), I8, 1)
            return b.fmul(b.sitofp(q, TYPES["f32"]), d)
        half = b.lshr(j, ir.Constant(I32, 4))                       # elements 16..31: the high nibbles
        at_byte = b.sub(b.add(b.mul(blk, ir.Constant(I32, 16)), j), b.shl(half, ir.Constant(I32, 4)))
        byte = b.zext(at(at_byte, I8, 1), I32)
        q = b.and_(b.lshr(byte, b.shl(half, ir.Constant(I32, 2))), ir.Constant(I32, 15))
        if e.fmt == "q4_0":
            return b.fmul(d, b.sitofp(b.sub(q, ir.Constant(I32, 8)), TYPES["f32"]))
        m = b.fpext(at(b.add(scales, ir.Constant(I32, 2)), ir.HalfType(), 2), TYPES["f32"])
        if e.fmt == "gptq_int4":                                    # m is the zero point z: d * (q - z)
            return b.fmul(d, b.fsub(b.uitofp(q, TYPES["f32"]), m))
        return b.fadd(b.fmul(d, b.uitofp(q, TYPES["f32"])), m)

    def byte_ptr(self, base, offset):
        return self.b.gep(base, [offset], inbounds=True, source_etype=I8)

    def qdot(self, e, env):
        """A ``QDot`` alone: its partial sums added up (``qdot_parts``)."""
        part, scalar = self.qdot_parts(e, env)
        total = self.reduce_fadd(part)
        return total if scalar is None else self.b.fadd(total, scalar, flags=FMF)

    def qdot_parts(self, e, env):
        """Weight block ``e.block`` . activation block ``e.ablock`` as (<8 x f32>, scalar or None):
        the 32 weight quants (q4: the 16 bytes' low then high nibbles) times each activation plane
        (``q``, ``r``), the four 8-lane quarters added (any partition of the 32 products into 8
        partial sums will do; contiguous quarters need no shuffles), ``128 q + r``, times
        ``d_w * a.d``; plus the
        scalar term of the format's offset (q4_0: ``-8 d_w a.s``; q4_1: ``m_w a.s``; gptq_int4:
        ``-z_w d_w a.s``)."""
        b, f = self.b, FORMATS[e.fmt]
        f32 = TYPES["f32"]
        _, w, _ = self.lookup(env, e.w, e)
        _, act, _ = self.lookup(env, e.act, e)
        blk, ab = self.expr(e.block, env), self.expr(e.ablock, env)
        vec = lambda ty, n=32: ir.VectorType(ty, n)  # noqa: E731
        i32 = lambda n: ir.Constant(I32, n)  # noqa: E731
        quants = self.byte_ptr(w, b.mul(blk, i32(f.quant_bytes), flags=["nsw"]))      # offsets fit i32: nsw
        if e.fmt == "q8_0":
            w8 = b.load(quants, typ=vec(I8), align=1)
            wq = b.sext(w8, vec(I32))
        else:
            raw = b.load(quants, typ=vec(I8, 16), align=1)
            lo = b.and_(raw, ir.Constant(vec(I8, 16), [15] * 16))
            hi = b.lshr(raw, ir.Constant(vec(I8, 16), [4] * 16))
            w8 = b.shuffle_vector(lo, hi, ir.Constant(vec(I32), list(range(32))))
            wq = b.zext(w8, vec(I32))
        _, _, adt = self.lookup(env, e.act, e)
        block, at = self.plane_at(e.act, act, adt, ab)
        # vpdpbusd multiplies unsigned bytes: q8_0's signed quants move up by 128 (w ^ 0x80), and
        # 128 * sum_j (128 q_j + r_j) = 128 a.s / a.d comes off again below
        unsigned = b.xor(w8, ir.Constant(vec(I8), [-128] * 32)) if e.fmt == "q8_0" else w8

        def dot8(p):                         # the products with plane ``p`` (0: q, 1: r), into 8 lanes
            if at(p, 16) == at(p, 0) + 16:   # contiguous, else two halves (an interleaved pair)
                plane8 = b.load(self.byte_ptr(block, i32(at(p, 0))), typ=vec(I8), align=1)
            else:
                halves = [b.load(self.byte_ptr(block, i32(at(p, h))), typ=vec(I8, 16), align=1) for h in (0, 16)]
                plane8 = b.shuffle_vector(*halves, ir.Constant(vec(I32), list(range(32))))
            if self.vnni:                    # unsigned weights x signed activation: one vpdpbusd
                return b.call(self.vpdpbusd(), [ir.Constant(vec(I32, 8), [0] * 8), b.bitcast(unsigned, vec(I32, 8)),
                                                b.bitcast(plane8, vec(I32, 8))])
            plane = b.sext(plane8, vec(I32))
            p = b.mul(wq, plane)
            eights = [b.shuffle_vector(p, p, ir.Constant(vec(I32, 8), [8 * k + j for j in range(8)])) for k in range(4)]
            return b.add(b.add(eights[0], eights[1]), b.add(eights[2], eights[3]))
        isum = b.add(b.mul(dot8(0), ir.Constant(vec(I32, 8), [128] * 8)), dot8(1)) if adt == "q8_1r" else dot8(0)
        ds = self.act_scales(e.act, act, adt, ab)
        ad = b.load(ds, typ=f32, align=4)
        asum = b.load(self.byte_ptr(ds, i32(4)), typ=f32, align=4)
        scales = b.add(i32(e.count // 32 * f.quant_bytes), b.mul(blk, i32(f.scale_bytes), flags=["nsw"]), flags=["nsw"])
        d = b.fpext(b.load(self.byte_ptr(w, scales), typ=ir.HalfType(), align=2), f32)
        fm = lambda x, y: b.fmul(x, y, flags=FMF)  # noqa: E731
        scale = fm(d, ad)
        splat = b.shuffle_vector(b.insert_element(ir.Constant(vec(f32, 8), None), scale, i32(0)),
                                 ir.Constant(vec(f32, 8), None), ir.Constant(vec(I32, 8), [0] * 8))
        part = b.fmul(b.sitofp(isum, vec(f32, 8)), splat, flags=FMF)
        if e.fmt == "q4_0":                  # sum_j d (n_j - 8) x_j = d a.d sum n (128 q + r) - 8 d a.s
            return part, fm(fm(d, ir.Constant(f32, -8.0)), asum)
        if e.fmt == "q4_1":                  # sum_j (d n_j + m) x_j = d a.d sum n (128 q + r) + m a.s
            m = b.fpext(b.load(self.byte_ptr(w, b.add(scales, i32(2), flags=["nsw"])), typ=ir.HalfType(), align=2), f32)
            return part, fm(m, asum)
        if e.fmt == "gptq_int4":             # sum_j d (n_j - z) x_j = d a.d sum n (128 q + r) - z d a.s
            z = b.fpext(b.load(self.byte_ptr(w, b.add(scales, i32(2), flags=["nsw"])), typ=ir.HalfType(), align=2), f32)
            return part, fm(fm(d, b.fneg(z, flags=FMF)), asum)
        return part, (fm(fm(d, ir.Constant(f32, -128.0)), asum) if self.vnni else None)

    def qdot_pair(self, e, env):
        """Weight blocks ``e.block`` and the next against activation blocks ``e.ablock`` (even) and
        the next, an interleaved pair (``plane_at``), with 512-bit vpdpbusd (``self.wide``):
        (<16 x f32>, <2 x f32>).  The two blocks' 64 weight quants are laid out as their activation
        pair (q4: one 32-byte load repeated, its words shifted by 0 then 4, masked); i32 lane k
        holds the same 4 products as ``qdot_parts``' lane 4 (k // 8) + k % 4 of block k // 4 % 2, as
        128 q + r (the q plane's vpdpbusd shifted left by 7 accumulates the r plane's), times its
        block's ``d_w * a.d``.  Both blocks' weight scales and activation (d, s) load as one
        vector each and multiply as vectors; the second value holds the blocks' scalar terms (as
        ``qdot_parts``)."""
        b, f, f32 = self.b, FORMATS[e.fmt], TYPES["f32"]
        _, w, _ = self.lookup(env, e.w, e)
        _, act, adt = self.lookup(env, e.act, e)
        blk, ab = self.expr(e.block, env), self.expr(e.ablock, env)
        vec = ir.VectorType
        i32 = lambda n: ir.Constant(I32, n)  # noqa: E731
        idx = lambda xs: ir.Constant(vec(I32, len(xs)), list(xs))  # noqa: E731
        quants = self.byte_ptr(w, b.mul(blk, i32(f.quant_bytes), flags=["nsw"]))
        if e.fmt == "q8_0":                                   # signed quants up by 128 (w ^ 0x80), as qdot_parts
            raw = b.load(quants, typ=vec(I8, 64), align=1)
            w8 = b.xor(b.shuffle_vector(raw, raw, idx([*range(16), *range(32, 48), *range(16, 32), *range(48, 64)])),
                       ir.Constant(vec(I8, 64), [-128] * 64))
        else:                                                 # low nibbles of both blocks, then high
            raw = b.load(quants, typ=vec(I8, 32), align=1)
            rep = b.bitcast(b.shuffle_vector(raw, raw, idx([*range(32)] * 2)), vec(ir.IntType(16), 32))
            shifted = b.lshr(rep, ir.Constant(vec(ir.IntType(16), 32), [0] * 16 + [4] * 16))
            w8 = b.and_(b.bitcast(shifted, vec(I8, 64)), ir.Constant(vec(I8, 64), [15] * 64))
        lanes = vec(I32, 16)
        block, at = self.plane_at(e.act, act, adt, ab)
        plane = lambda p: b.bitcast(b.load(self.byte_ptr(block, i32(at(p, 0))), typ=vec(I8, 64), align=1), lanes)  # noqa: E731
        isum = b.call(self.vpdpbusd(512), [ir.Constant(lanes, [0] * 16), b.bitcast(w8, lanes), plane(0)])
        if adt == "q8_1r":
            isum = b.call(self.vpdpbusd(512), [b.shl(isum, ir.Constant(lanes, [7] * 16)), b.bitcast(w8, lanes), plane(1)])
        nsc = f.scale_bytes // 2                              # f16 scales per block: d (and m or z)
        at_sc = b.add(i32(e.count // 32 * f.quant_bytes), b.mul(blk, i32(f.scale_bytes), flags=["nsw"]), flags=["nsw"])
        ws = b.fpext(b.load(self.byte_ptr(w, at_sc), typ=vec(ir.HalfType(), 2 * nsc), align=2), vec(f32, 2 * nsc))
        ads = b.load(self.act_scales(e.act, act, adt, ab), typ=vec(f32, 4), align=4)     # ad0 as0 ad1 as1
        fm = lambda x, y: b.fmul(x, y, flags=FMF)  # noqa: E731
        pick = lambda v, xs: b.shuffle_vector(v, v, idx(xs))  # noqa: E731
        d, asum = pick(ws, [0, nsc]), pick(ads, [1, 3])
        scale = fm(d, pick(ads, [0, 2]))
        part = b.fmul(b.sitofp(isum, vec(f32, 16)), pick(scale, ([0] * 4 + [1] * 4) * 2), flags=ACC_FMF)
        const = lambda c: ir.Constant(vec(f32, 2), [c, c])  # noqa: E731
        if e.fmt == "q4_1":
            return part, fm(pick(ws, [1, 3]), asum)
        if e.fmt == "gptq_int4":
            return part, fm(fm(d, b.fneg(pick(ws, [1, 3]), flags=FMF)), asum)
        return part, fm(fm(d, const(-8.0 if e.fmt == "q4_0" else -128.0)), asum)

    def un(self, e, env):
        return self.apply(e.op, e.x.dtype, [self.expr(e.x, env)], e)

    def bin(self, e, env):
        if e.a.dtype != e.b.dtype:
            self.fail(f"operand dtypes differ ({e.a.dtype} vs {e.b.dtype})", e)
        return self.apply(e.op, e.a.dtype, [self.expr(e.a, env), self.expr(e.b, env)], e)

    def apply(self, op, dtype, args, e):
        """The scalar op ``op`` on ``args``, as ``dsl/primitives.py`` spells it for LLVM (``OPS``)."""
        try:
            spelling = op_spelling(op, dtype, "llvm")
        except NotImplementedError as err:
            self.fail(str(err), e)
        if callable(spelling):
            return spelling(self, *args)
        return self.intr(spelling, *args) if spelling.startswith("llvm.") else self.inst(spelling, *args)

    # ---- the builder API that op spellings use
    def inst(self, spelling, *args):
        """One IRBuilder instruction: ``"fadd"``, ``"icmp_signed <"``, ``"add nsw"``; float
        instructions carry the fast-math flags ``FMF``."""
        name, *rest = spelling.split()
        pred = [w for w in rest if w != "nsw"]
        if isinstance(args[0].type, (ir.FloatType, ir.HalfType)):
            kw = {"flags": FMF}
        else:
            kw = {"flags": ["nsw"]} if "nsw" in rest else {}
        return getattr(self.b, name)(*pred, *args, **kw)

    def libm(self, name, *args):
        """Call the C math library's float function ``name`` (``erff``, ``log1pf``): half
        arguments are computed in float and rounded back.  The JIT resolves it from the process."""
        ty = args[0].type
        half = isinstance(ty, ir.HalfType)
        f32 = ir.FloatType()
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(f32, [f32] * len(args)), name)
        y = self.b.call(fn, [self.b.fpext(a, f32) if half else a for a in args])
        return self.b.fptrunc(y, ty) if half else y

    def const(self, value, like):
        """A constant of ``like``'s type: an LLVM value, or a dtype name such as ``"bool"``."""
        ty = TYPES[like] if isinstance(like, str) else like.type
        if isinstance(ty, (ir.FloatType, ir.HalfType)):
            return ir.Constant(ty, self.float_value(value, ty))
        return ir.Constant(ty, int(value))

    def select(self, cond, a, b):
        return self.b.select(cond, a, b)

    # ---- expressions, continued
    def const_expr(self, e, env):
        return self.const(e.value, e.dtype)

    def select_expr(self, e, env):
        """``cond ? a : b``.  An arm that loads is evaluated only when chosen (a branch and a phi,
        as C's ``?:``): the other arm's index may be out of its buffer (a concatenation's), and a
        load there could fault.  LLVM if-converts it back where it can prove the load safe."""
        if e.cond.dtype != "bool" or e.a.dtype != e.b.dtype:
            self.fail("select needs a bool condition and equal branch dtypes", e)
        cond = self.expr(e.cond, env)
        if not any(isinstance(x, (Load, QDot)) for arm in (e.a, e.b) for x in walk_exprs(arm)):
            return self.select(cond, self.expr(e.a, env), self.expr(e.b, env))
        b, fn = self.b, self.b.function
        then, other, done = (fn.append_basic_block(f"sel.{x}") for x in ("a", "b", "end"))
        b.cbranch(cond, then, other)
        values = []
        for block, arm in ((then, e.a), (other, e.b)):
            b.position_at_end(block)
            values.append((self.expr(arm, env), b.block))
            b.branch(done)
        b.position_at_end(done)
        phi = b.phi(values[0][0].type)
        for v, block in values:
            phi.add_incoming(v, block)
        return phi

    def cast(self, e, env):
        x, src, dst = self.expr(e.x, env), e.x.dtype, e.dtype
        if src == dst:
            return x
        for key in ((src, dst), (KIND[src], dst), (src, KIND[dst]), (KIND[src], KIND[dst])):
            if key in CAST_TABLE:
                return CAST_TABLE[key](self, x, TYPES[dst])
        self.fail(f"no cast {src} -> {dst}", e)

    EXPR = {Const: const_expr, Sym: sym, Load: load, QLoad: qload, QDot: qdot, Un: un, Bin: bin, Select: select_expr, Cast: cast}

    # ---- statements
    def stmts(self, body, env):
        for s in body:
            (self.STMT.get(type(s)) or self.STMT_CPU[type(s)])(self, s, env)

    def declare(self, s, env):
        slot = self.entry.alloca(TYPES[s.dtype], name=s.name)
        init = self.expr(s.init, env)
        if init.type != TYPES[s.dtype]:
            self.fail(f"Declare {s.name}: init has dtype {s.init.dtype}, expected {s.dtype}", s.init)
        self.b.store(init, slot)
        env[s.name] = ("var", slot, s.dtype)

    def assign(self, s, env):
        kind, slot, dtype = self.lookup(env, s.name)
        if kind != "var":
            self.fail(f"cannot assign to {s.name!r} (not a Declare'd local)")
        if s.value.dtype != dtype:
            self.fail(f"Assign {s.name}: value has dtype {s.value.dtype}, expected {dtype}", s.value)
        self.b.store(self.expr(s.value, env), slot)

    def array(self, s, env):
        if s.space == "lds":                      # shared by the launch's threads: a global
            slot = ir.GlobalVariable(self.module, ir.ArrayType(MEM_TYPES[s.dtype], s.size),
                                     self.module.get_unique_name(f"{self.b.function.name}.{s.name}"))
            slot.linkage, slot.initializer, slot.align = "internal", ir.Constant(slot.value_type, None), 64
            env[s.name] = ("arr", self.entry.gep(slot, [ir.Constant(I32, 0)] * 2, inbounds=True), s.dtype)
            return
        if s.dtype in Q8_BYTES:                   # bytes: one block per 32 values
            self.stack_bytes += s.size // 32 * Q8_BYTES[s.dtype]
            slot = self.entry.alloca(I8, size=s.size // 32 * Q8_BYTES[s.dtype], name=s.name)
            slot.align = 64
            env[s.name] = ("arr", slot, s.dtype)
            self.q8_blocks[s.name] = s.size // 32
            return
        self.stack_bytes += s.size * ELEM_BYTES[s.dtype]
        if self.stack_bytes > MAX_STACK_BYTES:
            self.fail(f"local arrays need {self.stack_bytes} bytes of stack (limit {MAX_STACK_BYTES})")
        slot = self.entry.alloca(MEM_TYPES[s.dtype], size=s.size, name=s.name)
        slot.align = 64
        env[s.name] = ("arr", slot, s.dtype)

    def store(self, s, env):
        ptr, dtype = self.element_ptr(s.buf, s.index, env, None)
        if s.value.dtype != dtype:
            self.fail(f"Store to {s.buf} ({dtype}) of a {s.value.dtype} value", s.value)
        v = self.expr(s.value, env)
        if dtype == "bool":
            v = self.b.zext(v, I8)
        self.b.store(v, ptr, align=ELEM_BYTES[dtype])

    def quantize_q8(self, s, env):
        """One activation block from its 32 values (``len(s.values) == 32`` on the CPU), as the GPU
        prelude's vf_quantize_q8_1: step = max|x| / 127 (NaN when a value is NaN), t = x / step computed
        as x * (127 / max|x|) when max|x| >= 1e-30 (one division per block), else divided (0 when the
        step is),
        q = round(t) (half away from zero, as C's roundf); q8_1r also r = round(128 (t - q)),
        d = step / 128 and s = d * sum(128 q + r); q8_1: d = step, s = d * sum(q)."""
        if len(s.values) != 32:
            self.fail(f"QuantizeQ8 of {len(s.values)} values: the CPU quantizes whole blocks of 32")
        b, f32 = self.b, TYPES["f32"]
        xs = [self.expr(v, env) for v in s.values]
        amax = None
        for x in xs:
            ax = self.intr("llvm.fabs", x)
            amax = ax if amax is None else self.intr("llvm.maximum", amax, ax)
        step = b.fdiv(amax, ir.Constant(f32, 127.0))
        nonzero = b.fcmp_ordered("!=", step, ir.Constant(f32, 0.0))
        normal = b.fcmp_ordered(">=", amax, ir.Constant(f32, 1e-30))      # 127 / max|x| cannot overflow
        inv = b.fdiv(ir.Constant(f32, 127.0), amax)
        _, base, dtype = self.lookup(env, s.arr)
        residual, group = dtype == "q8_1r", self.expr(s.group, env)
        block, at = self.plane_at(s.arr, base, dtype, group)
        ds = self.act_scales(s.arr, base, dtype, group)
        total = ir.Constant(I32, 0)
        for i, x in enumerate(xs):
            t = b.select(normal, b.fmul(x, inv), b.select(nonzero, b.fdiv(x, step), ir.Constant(f32, 0.0)))
            qf = self.intr("llvm.round", t)
            q = b.fptosi(qf, I32)
            b.store(b.trunc(q, I8), self.byte_ptr(block, ir.Constant(I32, at(0, i))))
            if residual:
                r = b.fptosi(self.intr("llvm.round", b.fmul(b.fsub(t, qf), ir.Constant(f32, 128.0))), I32)
                b.store(b.trunc(r, I8), self.byte_ptr(block, ir.Constant(I32, at(1, i))))
                q = b.add(b.mul(q, ir.Constant(I32, 128)), r)
            total = b.add(total, q)
        d = b.fmul(step, ir.Constant(f32, 1 / 128)) if residual else step
        b.store(d, b.bitcast(ds, f32.as_pointer()), align=4)
        b.store(b.fmul(d, b.sitofp(total, f32)), b.bitcast(self.byte_ptr(ds, ir.Constant(I32, 4)), f32.as_pointer()),
                align=4)

    def interleaved(self, arr):
        """Does the q8 array ``arr`` interleave its blocks in pairs (``qdot_pair``'s layout)?"""
        return self.wide and self.q8_blocks[arr] % 2 == 0

    def plane_at(self, arr, base, dtype, group):
        """(pointer, at) for activation block ``group`` of the q8 array ``arr``: byte i of plane p
        (0: q, 1: r) lies at pointer + at(p, i).  Contiguous: each block's planes in turn.
        Interleaved (``interleaved``): a pair of blocks' 64-byte plane holds block 0's bytes 0-15,
        block 1's 0-15, block 0's 16-31, block 1's 16-31, as ``qdot_pair`` lays out their weights."""
        b, planes, c = self.b, PLANE_BYTES[dtype] // 32, lambda n: ir.Constant(I32, n)
        if not self.interleaved(arr):
            return self.byte_ptr(base, b.mul(group, c(32 * planes), flags=["nsw"])), lambda p, i: 32 * p + i
        at = b.add(b.mul(b.lshr(group, c(1)), c(64 * planes), flags=["nsw"]), b.mul(b.and_(group, c(1)), c(16)))
        return self.byte_ptr(base, at), lambda p, i: 64 * p + i // 16 * 32 + i % 16

    def act_scales(self, arr, base, dtype, block):
        """Pointer to activation block ``block``'s f32 (d, s) in the q8 array ``arr`` (after all planes)."""
        start = ir.Constant(I32, self.q8_blocks[arr] * PLANE_BYTES[dtype])
        return self.byte_ptr(base, self.b.add(start, self.b.mul(block, ir.Constant(I32, 8), flags=["nsw"]), flags=["nsw"]))

    def chunk(self, start, stop):
        """[lo, hi) of this thread's contiguous share of [start, stop)."""
        b = self.b
        n = self.intr("llvm.smax", b.sub(stop, start), ir.Constant(I32, 0))
        per = b.sdiv(b.add(n, b.sub(self.nthreads, ir.Constant(I32, 1))), self.nthreads)
        lo = self.intr("llvm.smin", b.mul(self.tid, per), n)
        hi = self.intr("llvm.smin", b.add(lo, per), n)
        return b.add(start, lo, flags=["nsw"]), b.add(start, hi, flags=["nsw"])

    def loop(self, s, env, emit=None):
        """``s`` as header/body/latch blocks; ``emit(scope)`` renders the body (default: ``s.body``).
        A parallel loop that opens with a Reduce of order "outer" (a GEMV over a (K, N) weight) runs
        interchanged: k outside, chunks of ``COLUMNS`` consecutive columns inside (vector loads)."""
        if emit is None and s.parallel and can_interchange(s):
            return self.interchanged(s, env)
        if emit is None and s.parallel and not self.in_parallel and self.kernel.family == "contract" \
                and is_matmul_columns(s):
            return self.micro_tiled(s, env)
        b, fn = self.b, self.b.function
        lo, hi = self.expr(s.start, env), self.expr(s.stop, env)
        split = s.parallel and not self.in_parallel
        if split:
            lo, hi = self.chunk(lo, hi)
        pre = b.block
        header, body = fn.append_basic_block(f"{s.var}.header"), fn.append_basic_block(f"{s.var}.body")
        b.branch(header)
        b.position_at_end(header)
        i = b.phi(I32, name=s.var)
        i.add_incoming(lo, pre)
        cond = b.icmp_signed("<", i, hi)
        b.position_at_end(body)
        inner = dict(env)
        inner[s.var] = ("val", i, "i32")
        saved, self.in_parallel = self.in_parallel, self.in_parallel or split
        (emit or (lambda scope: self.stmts(s.body, scope)))(inner)
        self.in_parallel = saved
        latch, exit_ = fn.append_basic_block(f"{s.var}.latch"), fn.append_basic_block(f"{s.var}.exit")
        b.branch(latch)
        b.position_at_end(latch)
        i.add_incoming(b.add(i, ir.Constant(I32, 1), flags=["nsw"]), latch)
        b.branch(header)
        b.position_at_end(header)
        b.cbranch(cond, body, exit_)
        b.position_at_end(exit_)

    def interchanged(self, s, env):
        """A parallel loop of order "outer" (``loopir.interchange``): this thread's share of the
        columns (its contiguous run of every weight row), in chunks of ``COLUMNS`` accumulators in
        all, each pass over a chunk folding ``ROWS`` weight rows (one accumulator load and store
        per ``ROWS`` fused multiply-adds)."""
        lo, hi = self.expr(s.start, env), self.expr(s.stop, env)
        split = not self.in_parallel
        if split:
            lo, hi = self.chunk(lo, hi)
        inner = dict(env)
        inner[f"{s.var}_lo"], inner[f"{s.var}_hi"] = ("val", lo, "i32"), ("val", hi, "i32")
        saved, self.in_parallel = self.in_parallel, True
        r = next(x for x in s.body if isinstance(x, Reduce))
        chunk = max(16, COLUMNS // len(r.accs) // 16 * 16)
        self.stmts((interchange(s, chunk, Sym(f"{s.var}_lo", "i32"), Sym(f"{s.var}_hi", "i32"), ROWS),), inner)
        self.in_parallel = saved

    def micro_tiled(self, s, env):
        """A matmul's columns (``fusion.schedule.row_tiles``): this thread's share of them, in
        micro-tiles of ``MICRO_ROWS`` rows x a few columns (``micro_tiles``)."""
        lo, hi = self.chunk(self.expr(s.start, env), self.expr(s.stop, env))
        inner = dict(env)
        inner[f"{s.var}_lo"], inner[f"{s.var}_hi"] = ("val", lo, "i32"), ("val", hi, "i32")
        saved, self.in_parallel = self.in_parallel, True
        self.stmts((micro_tiles(s, Sym(f"{s.var}_lo", "i32"), Sym(f"{s.var}_hi", "i32")),), inner)
        self.in_parallel = saved

    def reduce(self, s, env):
        """A Reduce is a serial loop on the CPU (its GPU mapping is ignored); one that adds ``QDot``s
        keeps vector accumulators (``qdot_reduce``)."""
        if s.accs and all(a.op == "add" and isinstance(a.value, QDot) for a in s.accs):
            return self.qdot_reduce(s, env)
        self.stmts(serial_reduce(s), env)     # declares the results in ``env``

    def qdot_reduce(self, s, env):
        """``acc += QDot`` over weight blocks with a vector accumulator per Acc: each block's integer
        dot products stay 8 partial sums (``qdot_parts``; two blocks' 16 with the 512-bit
        ``qdot_pair``), scaled by the blocks' scales; the scalar terms (q4_0's -8 d a.s, q4_1's
        m a.s) add to a scalar (a <2 x f32> pair).  One horizontal add per output instead of one
        per block."""
        b, f32 = self.b, TYPES["f32"]
        # two accumulators per output (alternate blocks, or pairs of blocks) when the block count
        # allows: each add chain is half as long (the loop was bound by one chain's latency);
        # VEGAFUSE_CPU_ACCS=1: one
        n = s.stop.value - s.start.value if isinstance(s.start, Const) and isinstance(s.stop, Const) else 1
        even = n % 2 == 0 and n > 0
        pair = even and s.start.value == 0 and all(self.interleaved(a.value.act) for a in s.accs)
        ways = 2 if (n > 2 if pair else even) and env_choice("VEGAFUSE_CPU_ACCS", ("1", "2"), "2") != "1" else 1
        per = 2 if pair else 1                                # blocks per QDot rendered
        slots = []
        for a in s.accs:
            vty, sty = (ir.VectorType(f32, 16), ir.VectorType(f32, 2)) if pair else (ir.VectorType(f32, 8), f32)
            vecs, scs = [], []
            for w in range(ways):
                vec, sc = self.entry.alloca(vty, name=f"{a.name}.v{w}"), self.entry.alloca(sty, name=f"{a.name}.s{w}")
                b.store(ir.Constant(vty, [0.0] * vty.count), vec)
                b.store(ir.Constant(sty, [0.0, 0.0] if pair else 0.0), sc)
                vecs.append(vec)
                scs.append(sc)
            slots.append((a, vecs, scs))

        def add(slot, value):                 # in order (no reassoc): each accumulator stays its own chain
            b.store(b.fadd(b.load(slot, typ=value.type), value, flags=ACC_FMF), slot)

        def fold(scope, kb, w):               # QDots at block kb into accumulator w
            inner = {**scope, s.var: ("val", kb, "i32")}
            for a, vecs, scs in slots:
                part, scalar = (self.qdot_pair if pair else self.qdot_parts)(a.value, inner)
                add(vecs[w], part)
                if scalar is not None:
                    add(scs[w], scalar)

        def step(scope):
            i = scope[s.var][1]
            if ways == 1:
                return fold(scope, b.mul(i, ir.Constant(I32, per)) if pair else i, 0)
            for w in range(2):
                fold(scope, b.add(b.mul(i, ir.Constant(I32, 2 * per)), ir.Constant(I32, s.start.value + per * w)), w)
        steps = n // (per * ways)
        self.loop(Loop(s.var, s.start, s.stop, ()) if steps == n else Loop(s.var, Const(0, "i32"), Const(steps, "i32"), ()),
                  env, emit=step)
        if steps * per * ways < n:            # a pair left over (an odd count of pairs): the first accumulator
            fold(env, ir.Constant(I32, n - 2), 0)
        for a, vecs, scs in slots:
            vty, sty = vecs[0].allocated_type, scs[0].allocated_type
            vec, sc = b.load(vecs[0], typ=vty), b.load(scs[0], typ=sty)
            for w in range(1, ways):
                vec = b.fadd(vec, b.load(vecs[w], typ=vty), flags=ACC_FMF)
                sc = b.fadd(sc, b.load(scs[w], typ=sty), flags=ACC_FMF)
            if pair:
                sc = self.reduce_fadd(sc)
            slot = self.entry.alloca(f32, name=a.name)
            b.store(b.fadd(self.reduce_fadd(vec), sc, flags=FMF), slot)
            env[a.name] = ("var", slot, "f32")

    def vpdpbusd(self, bits=256):
        """x86's 4 x (u8 * s8) dot products into i32 lanes: 8 (AVX-512 VNNI / AVX-VNNI) or 16 (``bits`` 512)."""
        name = f"llvm.x86.avx512.vpdpbusd.{bits}"
        v = ir.VectorType(I32, bits // 32)
        return self.module.globals.get(name) or ir.Function(self.module, ir.FunctionType(v, [v, v, v]), name)

    def reduce_fadd(self, v):
        name = f"llvm.vector.reduce.fadd.v{v.type.count}f32"
        fn = self.module.globals.get(name) or ir.Function(
            self.module, ir.FunctionType(TYPES["f32"], [TYPES["f32"], v.type]), name)
        return self.b.call(fn, [ir.Constant(TYPES["f32"], 0.0), v], fastmath=FMF)

    def if_(self, s, env):
        b, fn = self.b, self.b.function
        cond = self.expr(s.cond, env)
        then, other, done = (fn.append_basic_block(x) for x in ("if.then", "if.else", "if.end"))
        b.cbranch(cond, then, other)
        for block, body in ((then, s.then), (other, s.orelse)):
            b.position_at_end(block)
            self.stmts(body, dict(env))
            b.branch(done)
        b.position_at_end(done)

    def nothing(self, s, env):
        pass

    def attention(self, s, env):
        """Flash attention as loops (``loopir.expand_attention``), tiled for this host's threads;
        when it cuts the context into parts (decode with few KV heads), the thread that finishes
        its share last merges them (``combine_attention``)."""
        qrows, keys, parts = attention_tiles(s, _host_threads())
        self.stmts(expand_attention(s, qrows, keys, parts), env)
        if parts > 1:
            self.last_arrival(combine_attention(s, parts), env)

    def last_arrival(self, body, env):
        """Run ``body`` on whichever of the launch's ``nthreads`` calls arrives here last (an
        atomic count in a global, reset by that call), after every call's stores before it."""
        b = self.b
        count = ir.GlobalVariable(self.module, I32, self.module.get_unique_name(f"{b.function.name}.arrivals"))
        count.linkage, count.initializer = "internal", ir.Constant(I32, 0)
        old = b.atomic_rmw("add", count, ir.Constant(I32, 1), "acq_rel")
        with b.if_then(b.icmp_signed("==", old, b.sub(self.nthreads, ir.Constant(I32, 1)))):
            b.store_atomic(ir.Constant(I32, 0), count, "monotonic", 4)
            self.stmts(body, dict(env))

    def dequant_row(self, s, env):
        """``DequantRow``: the K values of weight row ``s.row`` as f32, one block of 32 at a time
        with vector code (its 16 or 32 quant bytes loaded at once, q4's low then high nibbles), the
        arithmetic of ``qload`` (no fast-math flags: the values equal ``gguf.quants.dequantize``'s)."""
        b, f, f32 = self.b, FORMATS[s.fmt], TYPES["f32"]
        _, w, _ = self.lookup(env, s.buf)
        _, arr, _ = self.lookup(env, s.arr)
        i32 = lambda n: ir.Constant(I32, n)  # noqa: E731
        vec = lambda ty, n=32: ir.VectorType(ty, n)  # noqa: E731
        first = b.mul(self.expr(s.row, env), i32(s.K // 32), flags=["nsw"])        # the row's first block

        def splat(x):
            return b.shuffle_vector(b.insert_element(ir.Constant(vec(f32), None), x, i32(0)),
                                    ir.Constant(vec(f32), None), ir.Constant(vec(I32), [0] * 32))

        def block(scope):
            kb = scope[s.var][1]
            blk = b.add(first, kb, flags=["nsw"])
            quants = self.byte_ptr(w, b.mul(blk, i32(f.quant_bytes), flags=["nsw"]))
            scales = b.add(i32(s.count // 32 * f.quant_bytes), b.mul(blk, i32(f.scale_bytes), flags=["nsw"]), flags=["nsw"])
            d = splat(b.fpext(b.load(self.byte_ptr(w, scales), typ=ir.HalfType(), align=2), f32))
            if s.fmt == "q8_0":
                val = b.fmul(b.sitofp(b.load(quants, typ=vec(I8), align=1), vec(f32)), d)
            else:
                raw = b.load(quants, typ=vec(I8, 16), align=1)
                lo = b.and_(raw, ir.Constant(vec(I8, 16), [15] * 16))
                hi = b.lshr(raw, ir.Constant(vec(I8, 16), [4] * 16))
                q = b.uitofp(b.shuffle_vector(lo, hi, ir.Constant(vec(I32), list(range(32)))), vec(f32))
                if s.fmt == "q4_0":
                    val = b.fmul(d, b.fsub(q, ir.Constant(vec(f32), [8.0] * 32)))
                else:
                    m = splat(b.fpext(b.load(self.byte_ptr(w, b.add(scales, i32(2))), typ=ir.HalfType(), align=2), f32))
                    val = b.fmul(d, b.fsub(q, m)) if s.fmt == "gptq_int4" else b.fadd(b.fmul(d, q), m)
            at = b.add(i32(s.offset), b.mul(kb, i32(32), flags=["nsw"]), flags=["nsw"])
            ptr = b.gep(arr, [at], inbounds=True, source_etype=TYPES["f32"])
            b.store(val, b.bitcast(ptr, vec(f32).as_pointer()), align=4)
        self.loop(Loop(s.var, Const(0, "i32"), Const(s.K // 32, "i32"), ()), env, emit=block)

    STMT = {Loop: loop, Declare: declare, Assign: assign, Array: array, Store: store, Reduce: reduce, If: if_,
            QuantizeQ8: quantize_q8,
            Barrier: nothing, Comment: nothing, Attention: attention}
    STMT_CPU = {}                              # statements of the CPU's own rewrites (DequantRow)

    # ---- functions
    def render(self, symbol):
        k = self.kernel
        noalias = _noalias(k)
        arg_types = [PTR if p.kind == "buffer" else I32 for p in k.params] + [I32, I32]
        body_fn = ir.Function(self.module, ir.FunctionType(VOID, arg_types), f"{symbol}.body")
        body_fn.linkage = "internal"
        body_fn.attributes.add("nounwind")
        env = {}
        for p, a in zip(k.params, body_fn.args):
            a.name = p.name
            if p.kind == "buffer":
                if p.dtype not in MEM_TYPES:
                    self.fail(f"param {p.name}: unknown dtype {p.dtype}")
                if p.name in noalias:
                    a.add_attribute("noalias")
                a.attributes.align = ELEM_BYTES.get(p.dtype, 1)
                if p.size:
                    a.attributes.dereferenceable = _buffer_bytes(p)
                env[p.name] = ("buf", a, p.dtype)
            else:
                if p.dtype != "i32":
                    self.fail(f"scalar param {p.name} must be i32")
                env[p.name] = ("val", a, "i32")
        self.tid, self.nthreads = body_fn.args[-2], body_fn.args[-1]
        self.tid.name, self.nthreads.name = "tid", "nthreads"
        entry, start = body_fn.append_basic_block("entry"), body_fn.append_basic_block("start")
        self.entry, self.b = ir.IRBuilder(entry), ir.IRBuilder(start)
        self.stmts(k.body, env)
        self.b.ret_void()
        self.entry.branch(start)

        # exported wrapper: unpack the argument table
        fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR, I32, I32]), symbol)
        fn.attributes.add("nounwind")
        table, tid, nthreads = fn.args
        table.name, tid.name, nthreads.name = "args", "tid", "nthreads"
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        args = []
        for j, p in enumerate(k.params):
            ptr = b.load(b.gep(table, [ir.Constant(I32, j)], inbounds=True, source_etype=PTR), typ=PTR,
                         name=p.name, align=8)
            args.append(ptr if p.kind == "buffer" else b.load(ptr, typ=I32, align=4, name=p.name))
        b.call(body_fn, args + [tid, nthreads])
        b.ret_void()
        return fn


def _host_threads():
    """Threads a launch may use here (the CPU device's default): the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _buffer_bytes(p):
    return nbytes(p.dtype, p.size) if p.dtype in QUANT_DTYPES else p.size * ELEM_BYTES[p.dtype]


def symbol_name(name: str) -> str:
    """A C-identifier-like symbol for a kernel name."""
    s = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return s if s and not s[0].isdigit() else "k_" + s


def int8_gemv(k: Kernel) -> Kernel:
    """A contraction whose every weight is quantized, on the CPU: its f32 activation is quantized to
    q8_1 blocks once per row (``QuantizeQ8``), and each output folds whole weight blocks against
    them (``QDot``: integer dot products).  Other kernels, and all with ``VEGAFUSE_QUANT_ACT=float``,
    are returned as they are (each weight then dequantized as it is loaded)."""
    from .mapping import quant_weights
    if k.family != "contract" or not quantized_activations():
        return k
    acts = {s.name: s.size for s in walk_stmts(k.body) if isinstance(s, Array) and s.size % 32 == 0}
    segs = [s for s in walk_stmts(k.body) if isinstance(s, Loop) and s.parallel and s.body
            and isinstance(s.body[0], Reduce)]
    found = [next((a for a in acts if quant_weights(seg.body[0], a)), None) for seg in segs]
    if not segs or None in found or len(set(found)) != 1:
        return k
    act = found[0]
    K, q8 = acts[act], f"{act}_q8"

    def rewrite(body):
        out = []
        for s in body:
            if isinstance(s, Array) and s.name == act:
                out += [s, Array(q8, int8_activation(), K)]
            elif isinstance(s, Loop) and s.body and isinstance(s.body[-1], Store) and s.body[-1].buf == act:
                blk = Sym(f"{act}_blk", "i32")
                vals = tuple(Load(act, Bin("add", Bin("mul", blk, Const(32, "i32")), Const(i, "i32")), "f32")
                             for i in range(32))
                out += [s, Loop(blk.name, Const(0, "i32"), Const(K // 32, "i32"),
                                (QuantizeQ8(q8, blk, vals, Const(True, "bool")),))]
            elif isinstance(s, Loop) and s.parallel and s.body and isinstance(s.body[0], Reduce):
                red = s.body[0]
                kb = Sym(f"{red.var}_blk", "i32")
                accs = tuple(replace(a, value=QDot(q.buf, q.fmt, Bin("add", Bin("mul", row, Const(K // 32, "i32")), kb),
                                                   q.count, q8, kb))
                             for a, q, row in quant_weights(red, act))
                out.append(replace(s, body=(Reduce(kb.name, Const(0, "i32"), Const(K // 32, "i32"), accs),) + s.body[1:]))
            elif isinstance(s, Loop):
                out.append(replace(s, body=rewrite(s.body)))
            else:
                out.append(s)
        return tuple(out)
    return replace(k, body=rewrite(k.body))


MICRO_ROWS = env_int("VEGAFUSE_CPU_MICRO_ROWS", 4, 1)
MICRO_ACCS = env_int("VEGAFUSE_CPU_MICRO_ACCS", 16, 1)     # vector accumulators of a micro-tile
MICRO_COLUMNS = env_int("VEGAFUSE_CPU_MICRO_COLUMNS", 64, 1)  # columns whose epilogue runs as one loop


def is_matmul_columns(s: Loop) -> bool:
    """Is ``s`` a matmul's parallel column loop (``codegen.mapping.matmul_rows``)?"""
    from .mapping import matmul_rows
    return matmul_rows(s) is not None


def micro_tiles(s: Loop, lo, hi) -> Loop:
    """Columns [``lo``, ``hi``) of a matmul's column loop ``s`` (``is_matmul_columns``), in chunks of
    ``MICRO_COLUMNS`` columns.  Per chunk, micro-tiles of R rows x C columns: one Reduce over k
    folds R x C x (siblings) accumulators, so that each activation and weight vector loaded feeds
    several fused multiply-adds (LLVM vectorizes the k loop: one vector accumulator each), and
    stores them into the chunk's accumulator arrays (a copy past the last row or column reads and
    writes the last one again: the same value).  Then the rest of the body (the epilogue) runs
    once per (row, column) of the chunk, its column loop innermost, so that LLVM vectorizes it
    too (SiLU's exp through libmvec)::

        for n_c in [0, ceil((hi - lo) / NB)): n0 = lo + n_c NB; m = min(NB, hi - n0)
          for n_g in [0, ceil(m / C)): for r_g in [0, ceil(TR / R)):
            reduce k: acc_<i>_<j> += value(r = min(r_g R + i, TR - 1), n = n0 + min(n_g C + j, m - 1))
            acc_col[r * NB + n - n0] = acc_<i>_<j>        (each i, j)
          for r in [0, TR): for n_j in [0, m): n = n0 + n_j; acc = acc_col[r * NB + n_j]; the rest at (r, n)
    """
    from .mapping import matmul_rows
    rows = matmul_rows(s)
    red, *rest = rows.body
    TR, NB = rows.stop.value, MICRO_COLUMNS
    R = max(1, min(MICRO_ROWS, TR))
    C = max(1, min(NB, MICRO_ACCS // (R * len(red.accs))))
    i32 = lambda v: Const(v, "i32")  # noqa: E731
    nc, ng, rg, nj = (Sym(f"{s.var}_{x}", "i32") for x in ("c", "g", "j", "in"))
    rg = Sym(f"{rows.var}_g", "i32")
    n0 = Bin("add", lo, Bin("mul", nc, i32(NB)))
    m = Bin("min", i32(NB), Bin("sub", hi, n0))
    col = {a.name: f"{a.name}_col" for a in red.accs}
    accs, stores = [], []
    for i in range(R):
        for j in range(C):
            jj = Bin("min", Bin("add", Bin("mul", ng, i32(C)), i32(j)), Bin("sub", m, i32(1)))
            r = Bin("min", Bin("add", Bin("mul", rg, i32(R)), i32(i)), i32(TR - 1))
            vals = {s.var: Bin("add", n0, jj), rows.var: r}
            names = {a.name: f"{a.name}_{i}_{j}" for a in red.accs}

            def ex(e, vals=vals):
                return fold(rewrite_expr(e, lambda x: vals.get(x.name) if isinstance(x, Sym) else None))
            accs += [replace(a, name=names[a.name], value=ex(a.value)) for a in red.accs]
            at = Bin("add", Bin("mul", r, i32(NB)), jj)
            stores += [Store(col[a.name], at, Sym(names[a.name], a.dtype)) for a in red.accs]
    accs, fill = dequantized(accs, red.var, f"{s.var}_w", rg)
    body = (replace(red, accs=tuple(accs)),) + tuple(stores)
    groups = Bin("idiv", Bin("add", m, i32(C - 1)), i32(C))
    row_groups = i32(-(-TR // R))
    if fill or not switch("VEGAFUSE_CPU_ROWS_OUTER", True):      # each column's weights dequantized once
        tiles = Loop(ng.name, i32(0), groups, fill + (Loop(rg.name, i32(0), row_groups, body),))
    else:                                  # float weights: R rows' activation stays in L1 as the columns pass
        tiles = Loop(rg.name, i32(0), row_groups, (Loop(ng.name, i32(0), groups, body),))
    epilogue = Loop(rows.var, i32(0), i32(TR), (Loop(nj.name, i32(0), m, (
        Declare(s.var, "i32", Bin("add", n0, nj)),
        *(Declare(a.name, a.dtype, Load(col[a.name], Bin("add", Bin("mul", Sym(rows.var, "i32"), i32(NB)), nj), a.dtype))
          for a in red.accs),
        *rest)),))
    arrays = tuple(Array(col[a.name], a.dtype, TR * NB) for a in red.accs)
    chunks = Bin("idiv", Bin("add", Bin("sub", hi, lo), i32(NB - 1)), i32(NB))
    return Loop(nc.name, i32(0), chunks, arrays + (tiles, epilogue))


@dataclass(frozen=True)
class DequantRow:
    """(CPU only) ``arr[offset + k] = buf[row * K + k]`` for k in [0, K): one quantized weight row
    as f32 (``_Renderer.dequant_row``), ``var`` its block loop's variable."""
    arr: str
    offset: int
    buf: str
    fmt: str
    count: int
    row: object
    K: int
    var: str


def dequantized(accs, k, name, inner):
    """A micro-tile's accumulators with every quantized weight row they read (``QLoad`` at
    ``row * K + k``) taken from an f32 array ``name`` instead, and the statements that fill it (an
    Array and a ``DequantRow`` per row): each weight block is dequantized once per micro-tile column
    and read by all the tile's rows, never a float copy of the whole weight.  A row written in terms
    of ``inner`` (the micro-tile's row group, bound only inside the fill) stays a ``QLoad``."""
    ksym, rows = Sym(k, "i32"), {}
    for a in accs:
        for x in walk_exprs(a.value):
            i = getattr(x, "index", None)
            if isinstance(x, QLoad) and isinstance(i, Bin) and i.op == "add" and i.b == ksym and isinstance(i.a, Bin) \
                    and i.a.op == "mul" and isinstance(i.a.b, Const) and i.a.b.value % 32 == 0 \
                    and not {ksym, inner} & set(walk_exprs(i.a)):
                rows.setdefault((x.buf, x.fmt, x.count, i.a.a, i.a.b.value), len(rows))
    if not rows:
        return accs, ()
    K = max(key[4] for key in rows)

    def ex(e):
        def f(x):
            key = (x.buf, x.fmt, x.count, x.index.a.a, x.index.a.b.value) if isinstance(x, QLoad) and isinstance(x.index, Bin) \
                and isinstance(x.index.a, Bin) and isinstance(x.index.a.b, Const) else None
            return Load(name, Bin("add", Const(rows[key] * K, "i32"), ksym), "f32") if key in rows else None
        return rewrite_expr(e, f)
    fill = (Array(name, "f32", len(rows) * K),) + tuple(
        DequantRow(name, slot * K, buf, fmt, count, row, n, f"{name}_blk{slot}")
        for (buf, fmt, count, row, n), slot in rows.items())
    return [replace(a, value=ex(a.value)) for a in accs], fill


_Renderer.STMT_CPU[DequantRow] = _Renderer.dequant_row


def render_into(module: ir.Module, kernel: Kernel, symbol: str | None = None, vnni: bool = False) -> ir.Function:
    """Add ``kernel`` (exported as ``symbol``, default its sanitized name) to ``module``."""
    return _Renderer(module, int8_gemv(kernel), vnni).render(symbol or symbol_name(kernel.name))


def render_llvm(kernel: Kernel, symbol: str | None = None, vnni: bool = False) -> str:
    """Textual LLVM IR of ``kernel`` (no triple / data layout; ``vnni``: the host has AVX-512 VNNI
    or AVX-VNNI, and int8 dot products call ``vpdpbusd``)."""
    module = ir.Module(name=kernel.name)
    render_into(module, kernel, symbol, vnni)
    header = "".join(f"; {line}\n" for line in format_kernel_header(kernel))
    return header + str(module)


def format_kernel_header(kernel: Kernel):
    yield f"{kernel.name} [{kernel.family}] bytes={kernel.bytes} flops={kernel.flops}"
    for op in kernel.ops:
        yield f"  op: {op}"
    yield from format_kernel(kernel).splitlines()
