"""Lower each kernel root to Loop IR: expressions from the DSL graph, loops from the family.

``Builder.expr(var, idx)`` returns the Loop IR expression of ``var`` at the
multi-index ``idx`` (a tuple of i32 expressions), inlining everything that is
not materialized.  Views only remap the index; reductions that are fused become
per-row scalars computed before the loop that uses them; contractions fused
under an epilogue become accumulators.
"""
from __future__ import annotations

import itertools

import numpy as np

from codegen import loopir as L
from dsl.core import Lit

from .partition import is_scalar_param


class Unfusable(Exception):
    """A reduction was needed at an index other than the kernel's rows: materialize it.  With
    ``cone``: the stores of epilogue root ``var`` (``partition.plan_stores``) could not be lowered
    into its contraction's kernel: keep ``var`` in a buffer instead."""
    def __init__(self, var, cone=False):
        self.var, self.cone = var, cone


_counter = itertools.count()


def fresh(prefix):
    """A unique local name: ``prefix`` and a counter (``codegen.loopir.tidy_names`` drops it)."""
    return f"{prefix}_{next(_counter)}"


REDUCE_OPS = {"reduce_sum": "add", "reduce_max": "max", "argmax": "argmax"}   # primitive -> Acc op


class Builder:
    """Builds expressions for one kernel; collects the buffers it reads and the DSL ops it holds."""

    def __init__(self, ctx, row_idx=(), accs=None, n_idx=None):
        self.ctx = ctx                  # the Lowering: graph, materialized set, buffer names
        self.row_idx = tuple(row_idx)
        self.accs = accs or {}          # contraction Var -> Sym of its accumulator
        self.n_idx = n_idx              # the output-column index of a contraction kernel
        self.readers = {}               # contraction Var -> fn(idx): its accumulator at idx (an epilogue cone)
        self.grid = None                # loop variable -> its values (numpy): decides concatenations statically
        self.index_form = None          # fn(index) -> the same index as a person writes it (a paired epilogue)
        self.row_stmts = []             # statements computing per-row scalars, in order
        self.row_syms = {}              # reduce Var -> Sym
        self.reads = {}                 # buffer name -> Var
        self.ops = []                   # Eqns inlined here
        self.memo = {}

    # -------------------------------------------------------------- expressions
    def expr(self, v, idx):
        if isinstance(v, Lit):
            return L.Const(v.value, v.dtype)
        key = (id(v), idx)
        if key not in self.memo:
            self.memo[key] = self._expr(v, tuple(idx))
        return self.memo[key]

    def load(self, v, idx):
        name = self.ctx.buffer_of(v)
        if is_scalar_param(v) and v not in self.ctx.g.producer:     # an i32 scalar input; a computed one is a buffer
            self.reads[name] = v
            return L.Sym(name, "i32")
        self.reads[name] = v
        index = L.linear_index(idx, v.shape)
        return L.Load(name, self.index_form(index) if self.index_form else index, v.dtype)

    def _expr(self, v, idx):
        ctx = self.ctx
        if v in self.accs:
            assert self.at_rows(idx, v.shape[:-1] + (0,)) or idx[-1] == self.n_idx, "contraction index"
            acc = self.accs[v]              # f32; an f16 result is rounded before its epilogue uses it
            return acc if acc.dtype == v.dtype else L.Cast(acc, v.dtype)
        if v in self.readers:
            acc = self.readers[v](idx)
            return acc if acc.dtype == v.dtype else L.Cast(acc, v.dtype)
        if v in ctx.materialized or v not in ctx.g.producer:
            return self.load(v, idx)
        e = ctx.g.producer[v]
        if e not in self.ops:
            self.ops.append(e)
        rule = LOWER.get(e.prim.name)
        if e.prim.kind == "reduce":
            return self.row_scalar(v, e, idx)
        if rule is None:
            raise NotImplementedError(f"no lowering for {e.prim.name}")
        return rule(self, e, idx)

    def at_rows(self, idx, shape):
        """Is ``idx`` this kernel's row index?  (Any index is 0 along a dim of size 1.)"""
        return len(idx) == len(self.row_idx) and all(
            d == 1 or i == r for i, r, d in zip(idx, self.row_idx, shape))

    def row_scalar(self, v, e, idx):
        """The reduction ``v`` as a scalar computed once per row, before the loop that reads it.

        It is computed at ``v``'s own index: the row variables, except 0 along the size-1 dims
        of ``v`` (where the consumer's row variable may range wider than ``v``)."""
        if not self.at_rows(idx, v.shape):
            raise Unfusable(v)
        idx = tuple(L.c(0) if d == 1 else r for r, d in zip(self.row_idx, v.shape))
        if v in self.row_syms:
            return self.row_syms[v]
        (x,) = e.inputs
        k = fresh("k")
        body = self.expr(x, idx + (L.Sym(k, "i32"),))
        # floats accumulate in f32 whatever their storage dtype; integers in i32
        at = "f32" if x.dtype in ("f16", "f32") else "i32"
        val = body if body.dtype == at else L.Cast(body, at)
        op = REDUCE_OPS[e.prim.name]
        squares = isinstance(body, L.Bin) and body.op == "mul" and body.a == body.b
        acc = fresh({"add": "sum_sq" if squares else "sum", "max": "mx", "argmax": "best"}[op])
        arg = fresh("arg") if op == "argmax" else ""
        stmts = [L.Reduce(k, L.c(0), L.c(x.shape[-1]), (L.Acc(acc, op, val, at, arg),))]
        result = L.Sym(arg, "i32") if arg else L.Sym(acc, at)
        self.row_stmts += stmts
        if result.dtype != v.dtype:
            name = fresh("r")
            self.row_stmts.append(L.Declare(name, v.dtype, L.Cast(result, v.dtype)))
            result = L.Sym(name, v.dtype)
        self.row_syms[v] = result
        return result


# ------------------------------------------------------------------ per-primitive lowering rules
def _elementwise(op):
    def rule(b, e, idx):
        args = [b.expr(a, idx) for a in e.inputs]
        return L.Un(op, *args) if len(args) == 1 else L.Bin(op, *args)
    return rule


def _select(b, e, idx):
    return L.Select(*[b.expr(a, idx) for a in e.inputs])


def _convert(b, e, idx):
    x = b.expr(e.inputs[0], idx)
    return x if x.dtype == e.params["dtype"] else L.Cast(x, e.params["dtype"])


def _iota(b, e, idx):
    i = idx[e.params["dimension"]]
    return i if e.params["dtype"] == "i32" else L.Cast(i, e.params["dtype"])


def _broadcast(b, e, idx):
    (x,) = e.inputs
    shape, dims = e.params["shape"], e.params["dims"]
    sub = tuple(idx[d] if x.shape[j] == shape[d] else L.c(0) for j, d in enumerate(dims))
    return b.expr(x, sub)


def _transpose(b, e, idx):
    (x,) = e.inputs
    perm = e.params["perm"]
    sub = [None] * len(perm)
    for i, p in enumerate(perm):
        sub[p] = idx[i]
    return b.expr(x, tuple(sub))


def unravel(flat, shape):
    """Multi-index of flat offset ``flat`` in ``shape`` (i32 expressions)."""
    total = int(np.prod(shape, dtype=np.int64))
    out, stride = [], total
    for d in shape:
        stride //= d
        if d == 1:
            out.append(L.c(0))
            continue
        q = flat if stride == 1 else L.Bin("idiv", flat, L.c(stride))
        out.append(q if stride * d == total else L.Bin("mod", q, L.c(d)))
    return tuple(out)


def _reshape(b, e, idx):
    (x,) = e.inputs
    new = e.params["shape"]
    # fast path: only size-1 dims inserted or removed
    if [d for d in new if d != 1] == [d for d in x.shape if d != 1]:
        real = iter([i for i, d in zip(idx, new) if d != 1])
        return b.expr(x, tuple(L.c(0) if d == 1 else next(real) for d in x.shape))
    return b.expr(x, unravel(L.linear_index(idx, new), x.shape))


def _slice(b, e, idx):
    (x,) = e.inputs
    return b.expr(x, tuple(L.add(i, L.c(s)) for i, s in zip(idx, e.params["start"])))


def _concatenate(b, e, idx):
    """The input that holds ``idx``: a select over the inputs' ranges along the axis, or that
    input alone when the index's values over the builder's ``grid`` decide it (the rotate-half of a
    paired epilogue)."""
    ax = e.params["axis"]
    offs = np.cumsum([0] + [a.shape[ax] for a in e.inputs])
    at = grid_value(idx[ax], b.grid) if b.grid is not None else None
    for a, start, stop in zip(e.inputs, offs[:-1], offs[1:]):
        if at is not None and start <= np.min(at) and np.max(at) < stop:
            return b.expr(a, idx[:ax] + (L.add(idx[ax], L.c(-int(start))),) + idx[ax + 1:])
    out = None
    for a, lo in reversed(list(zip(e.inputs, offs[:-1]))):
        sub = idx[:ax] + (L.add(idx[ax], L.c(-int(lo))),) + idx[ax + 1:]
        val = b.expr(a, sub)
        out = val if out is None else L.Select(L.Bin("lt", idx[ax], L.c(int(offs[list(e.inputs).index(a) + 1]))), val, out)
    return out


def _dequantize(b, e, idx):
    (w,) = e.inputs
    if not (w in b.ctx.materialized or w not in b.ctx.g.producer):
        raise NotImplementedError("dequantize reads a quantized input buffer")
    name = b.ctx.buffer_of(w)
    b.reads[name] = w
    x = L.QLoad(name, L.linear_index(idx, w.shape), "f32", w.dtype, w.size)
    return x if e.params["dtype"] == "f32" else L.Cast(x, e.params["dtype"])


def _take(b, e, idx):
    x, ids = e.inputs
    row = b.expr(ids, idx[:ids.ndim])
    row = L.Bin("max", L.c(0), L.Bin("min", row, L.c(x.shape[0] - 1)))     # clamp like XLA gather
    return b.expr(x, (row,) + idx[ids.ndim:])


def wrap_index(i, n):
    """Index ``i`` counted from the end of a dim of size ``n`` when negative (numpy's rule)."""
    return L.Select(L.Bin("lt", i, L.c(0)), L.add(i, L.c(n)), i)


def _gather(b, e, idx):
    """x at its index arrays' values, each counted from the end when negative, then clamped into
    its dimension (like JAX's gathers)."""
    x, *ids = e.inputs
    at = tuple(L.Bin("max", L.c(0), L.Bin("min", wrap_index(b.expr(i, idx), n), L.c(n - 1)))
               for i, n in zip(ids, x.shape))
    return b.expr(x, at)


def grid_value(e, env):
    """The i32/bool expression ``e`` evaluated over numpy arrays of its symbols (``env``), with C's
    truncating division; None when it holds anything else (a load, an unknown symbol)."""
    if isinstance(e, L.Const):
        return np.int64(int(e.value))
    if isinstance(e, L.Sym):
        return env.get(e.name)
    if isinstance(e, L.Cast) and e.dtype == e.x.dtype == "i32":
        return grid_value(e.x, env)
    if isinstance(e, L.Select):
        c, a, b = (grid_value(x, env) for x in (e.cond, e.a, e.b))
        return None if c is None or a is None or b is None else np.where(c, a, b)
    if not isinstance(e, L.Bin):
        return None
    a, b = grid_value(e.a, env), grid_value(e.b, env)
    if a is None or b is None or (e.op in ("idiv", "mod") and np.any(b == 0)):
        return None
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
           "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
           "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
           "idiv": lambda x, y: np.trunc(np.true_divide(x, y)).astype(np.int64), "mod": np.fmod}
    return ops[e.op](a, b) if e.op in ops else None


class _Rules(dict):
    """``LOWER``: an op of ``L.OPS`` defined after this module was imported (a user's primitive,
    ``dsl.define_elementwise``) lowers like every other elementwise op."""
    def __missing__(self, name):
        if name not in L.OPS:
            raise KeyError(name)
        self[name] = _elementwise(name)
        return self[name]

    def get(self, name, default=None):
        return self[name] if name in self or name in L.OPS else default


LOWER = _Rules({name: _elementwise(name) for name in L.OPS})      # every op defined in dsl/primitives.py
LOWER.update(select=_select, convert=_convert, iota=_iota, broadcast_in_dim=_broadcast,
             transpose=_transpose, reshape=_reshape, slice=_slice, concatenate=_concatenate,
             take=_take, dequantize=_dequantize, gather=_gather,
             optimization_barrier=lambda b, e, idx: b.expr(e.inputs[0], idx))     # a copy (always materialized)
