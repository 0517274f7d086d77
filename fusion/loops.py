"""The loop family: a ``scan`` (``dsl.lax.scan``, ``fori_loop``) as ONE kernel with a serial loop.

The body, a Program of its own, is partitioned and lowered by the same passes as any program
(``build_plan``: its kernels, fused by the same rules); the loop kernel then runs their Loop IR
one after the other inside ``for t in range(length)``::

    carry[...] = init[...]                                  (each carry: the scan's own output buffer)
    for t (serial):
        body kernel 1 .. n                                  (inputs renamed: constants, carries, xs[t])
        ys[t, ...] = y[...];  carry[...] = new_carry[...]   (after the body: no step reads a half-updated carry)

A barrier separates the phases (GPU: the kernel runs on one workgroup, so ``__syncthreads``
orders them; the CPU runs it on one thread).  The body's intermediates are buffers of the plan
(``<scan>_<name>``), allocated once; the kernel count and the IR do not grow with ``length``.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from codegen import loopir as L
from dsl.core import PRIMITIVES, Eqn, Lit, Program, Var

from .lower import Builder, Unfusable, fresh, unravel
from .partition import is_scalar_param


def _copied_outputs(body: Program) -> Program:
    """``body`` whose outputs are all values it computes: an output that is an input or a literal
    gets a copy (``convert`` to its own dtype), so that no carry is updated from a buffer that
    another carry's update overwrites (a swap), and every result has a buffer of its own."""
    eqns, outs = list(body.eqns), []
    ins = set(body.inputs)
    for o in body.outputs:
        if isinstance(o, Lit) or o in ins:
            v = Var(tuple(o.shape), o.dtype)
            eqns.append(Eqn(PRIMITIVES["convert"], [o], {"dtype": o.dtype}, v, "", ("scan",)))
            o = v
        outs.append(o)
    return Program(list(body.inputs), eqns, outs)


def _expand_attention(body):
    """Attention statements as plain loops: inside the loop their buffers may be slices of xs."""
    out = []
    for s in body:
        out += L.expand_attention(s) if isinstance(s, L.Attention) else [s]
    return tuple(out)


def _collapse_rows(body):
    """A parallel row loop whose body is one nested row loop becomes one parallel loop over both
    (``i, j = f / n, f % n``), so a workgroup's threads share all the rows of a step, not just the
    outer ones.  Only for the row nests of the elementwise, reduce and scatter families, whose
    rows are independent."""
    out = []
    for s in body:
        while (isinstance(s, L.Loop) and s.parallel and len(s.body) == 1 and isinstance(s.body[0], L.Loop)
               and all(isinstance(x, L.Const) for x in (s.start, s.stop, s.body[0].start, s.body[0].stop))
               and s.start.value == 0 and s.body[0].start.value == 0):
            inner, f = s.body[0], fresh("f")
            n, fs = inner.stop.value, L.Sym(f, "i32")
            merged = L.substitute(inner.body, {s.var: L.Bin("idiv", fs, L.c(n)), inner.var: L.Bin("mod", fs, L.c(n))})
            s = L.Loop(f, L.c(0), L.c(s.stop.value * n), merged, parallel=True)
        out.append(s)
    return tuple(out)


def _copy(dst, src, n, offset=None):
    """``dst[offset + f] = src[f]`` for f < n (``src``: (buffer name, dtype), or a function of f)."""
    f = fresh("f")
    fs = L.Sym(f, "i32")
    val = src(fs) if callable(src) else L.Load(src[0], fs, src[1])
    at = fs if offset is None else L.add(offset, fs)
    return L.Loop(f, L.c(0), L.c(n), (L.Store(dst, at, val),), parallel=True)


def scan_kernel(lw, roots) -> L.Kernel:
    """The kernel of one scan: ``roots`` are its equations' outputs (one per result)."""
    return _Scan(lw, roots).kernel()


class _Scan:
    """One scan lowered: its body's plan, and the names that plan's kernels take inside the loop
    (constants and xs: the outer buffers; carries: the scan's result buffers; intermediates:
    buffers of the plan named ``scan_<name>``)."""

    def __init__(self, lw, roots):
        from .schedule import build_plan
        self.lw, self.roots = lw, roots
        self.e = lw.g.producer[roots[0]]
        p = self.e.params
        self.length, self.nk, self.nc, self.reverse = p["length"], p["n_consts"], p["n_carry"], p.get("reverse", False)
        self.body = _copied_outputs(p["body"])
        by_out = {lw.g.producer[r].params["out"]: r for r in roots}
        nk, nc = self.nk, self.nc
        names = [lw.buffer_of(a) if isinstance(a, Var) else f"c{i}" for i, a in enumerate(self.e.inputs)]
        for i in range(nk, nk + nc):                    # a carry is named after the scan's result
            names[i] = lw.buffer_of(by_out[i - nk]) if i - nk in by_out else f"carry{i - nk}"
        names[nk + nc:] = [n + "_t" for n in names[nk + nc:]]
        self.sub = build_plan(self.body, lw.rules, names)
        self.info, self.made = {}, []                   # buffer name -> (shape, dtype); scratch buffers
        self.scalars = {lw.names[v] for v in lw.prog.inputs if is_scalar_param(v)}
        self.t = fresh("t")
        tsym = L.Sym(self.t, "i32")                     # the step; it reads x[at] and writes ys[at]
        self.at = L.Bin("sub", L.c(self.length - 1), tsym) if self.reverse else tsym
        self.results = []                               # the buffer of each result (carries, then ys)
        for j, o in enumerate(self.body.outputs):
            shape = tuple(o.shape) if j < nc else (self.length,) + tuple(o.shape)
            self.results.append(self.outer(by_out[j]) if j in by_out else self.scratch(f"out{j}", shape, o.dtype))
        self.bind_inputs()

    def outer(self, v):
        name = self.lw.buffer_of(v)
        self.info[name] = (tuple(v.shape), v.dtype)
        return name

    def scratch(self, name, shape, dtype):
        """A new buffer of the plan (allocated only if the kernel uses it)."""
        n, i = f"scan_{name}", 1
        while n in self.lw.used:
            i += 1
            n = f"scan_{name}_{i}"
        self.lw.used.add(n)
        self.info[n] = (tuple(shape), dtype)
        self.made.append(n)
        return n

    def bind_inputs(self):
        """What each name of the body's plan becomes: ``rename`` (buffer -> buffer), ``syms``
        (an i32 scalar read by value -> expression), ``slices`` (x -> (xs, slice size)),
        ``xs_scalar`` (a scalar x -> its expression at step ``at``, inlined, built by ``xb``)."""
        nk, nc, sub = self.nk, self.nc, self.sub
        self.rename, self.syms, self.slices, self.xs_scalar = {}, {}, {}, {}
        self.xb = Builder(self.lw)
        for i, (bv, a) in enumerate(zip(self.body.inputs, self.e.inputs)):
            name = sub.inputs[i]
            if isinstance(a, Lit) and i < nk:           # a literal constant (IR text may pass one)
                self.syms[name] = self.xs_scalar[name] = L.Const(a.value, a.dtype)
            elif i < nk:                                # a constant: the outer buffer itself
                self.rename[name] = self.outer(a)
                if is_scalar_param(bv):
                    n = self.rename[name]
                    self.syms[name] = L.Sym(n, "i32") if n in self.scalars else L.Load(n, L.c(0), "i32")
            elif i < nk + nc:                           # a carry: the scan's result buffer
                self.rename[name] = self.results[i - nk]
                self.info[self.rename[name]] = (tuple(bv.shape), bv.dtype)
                if is_scalar_param(bv):
                    self.syms[name] = L.Load(self.rename[name], L.c(0), "i32")
            elif bv.shape == ():                        # a scalar x[t]: its expression at t, inlined
                self.syms[name] = self.xs_scalar[name] = self.xb.expr(a, (self.at,))
                if self.xb.row_stmts:                   # it needs a reduction first: read it from a buffer
                    raise Unfusable(a)
            else:                                       # a slice x[t] of xs
                self.slices[name] = (self.outer(a), bv.size)
        for name, (shape, dtype) in sub.buffers.items():
            if name not in sub.inputs:
                self.rename[name] = self.scratch(name, shape, dtype)
                if tuple(shape) == () and dtype == "i32":   # a computed i32 scalar, read as a Sym by the body
                    self.syms[name] = L.Load(self.rename[name], L.c(0), "i32")

    def expr(self, e):
        """A body kernel's expression inside the loop."""
        def node(x):
            if isinstance(x, L.Sym) and x.name in self.syms:
                return self.syms[x.name]
            if isinstance(x, L.Load) and x.buf in self.xs_scalar:
                return self.xs_scalar[x.buf]
            if isinstance(x, L.Load) and x.buf in self.slices:
                xs, size = self.slices[x.buf]
                return replace(x, buf=xs, index=L.add(L.mul(self.at, L.c(size)), x.index))
            if isinstance(x, L.Load) and x.buf in self.rename:
                return replace(x, buf=self.rename[x.buf])
            return None
        return L.fold(L.rewrite_expr(e, node))

    def step(self):
        """One step: the body's kernels, a barrier after each; then ys[at] and the carries that
        were not updated in place are copied from the body's results."""
        kernels = []
        for k in self.sub.kernels:
            stmts = _collapse_rows(k.body) if k.family in ("elementwise", "reduce", "scatter") else k.body
            kernels.append((k.name, L.rewrite(_expand_attention(stmts), self.expr, lambda n: self.rename.get(n, n))))
        srcs = [self.rename.get(o[1], o[1]) for o in self.sub.outputs]
        res = self.results
        inplace = {srcs[j]: res[j] for j in range(self.nc)
                   if srcs.count(srcs[j]) == 1 and _in_place([b for _, b in kernels], srcs[j], res[j])}

        def to_carry(e):
            return L.rewrite_expr(e, lambda x: replace(x, buf=inplace[x.buf]) if isinstance(x, L.Load)
                                  and x.buf in inplace else None)
        steps = []
        for name, stmts in kernels:
            steps += [L.Comment(name), *L.rewrite(stmts, to_carry, lambda n: inplace.get(n, n)), L.Barrier()]
        for j, src in enumerate(srcs):
            src = inplace.get(src, src)
            n = int(np.prod(self.body.outputs[j].shape, dtype=np.int64))
            if src != res[j]:
                steps.append(_copy(res[j], (src, self.info[src][1]), n, None if j < self.nc else L.mul(self.at, L.c(n))))
        return tuple(steps) + (L.Barrier(),)

    def kernel(self):
        from .schedule import section
        init = []
        for i in range(self.nc):                        # each carry starts as its initial value, computed here
            a = self.e.inputs[self.nk + i]
            init.append(_copy(self.results[i], lambda f, a=a: self.xb.expr(a, unravel(f, a.shape)),
                              max(1, int(np.prod(a.shape, dtype=np.int64)))))
            if self.xb.row_stmts:                       # it needs a reduction first: read it from a buffer
                raise Unfusable(a)
        for name, v in self.xb.reads.items():
            self.info[name] = (tuple(v.shape), v.dtype)
        loop = L.Loop(self.t, L.c(0), L.c(self.length), self.step())
        eqns = [self.lw.g.producer[r] for r in self.roots] + list(self.xb.ops)
        order = ", last x first" if self.reverse else ""
        body = section(f"scan of {self.length} steps{order} -> {', '.join(self.results)}", eqns) + tuple(init) + (
            (L.Barrier(),) if init else ()) + (loop,)
        params = _params(body, self.info, self.scalars)
        used = {q.name for q in params}
        for n in self.made:
            if n in used:
                self.lw.names[Var(*self.info[n])] = n
        flops = sum(k.flops for k in self.sub.kernels) * self.length
        return L.Kernel(f"scan_{self.results[0]}", "loop", params, body, tuple(eqns), 0, flops)


def _loads(e, buf):
    return [x for x in L.walk_exprs(e) if isinstance(x, L.Load) and x.buf == buf]


def _in_place(kernels, src, carry) -> bool:
    """May the one step kernel that writes a carry's new value ``src`` write it into the carry's
    own buffer?  Yes when no later kernel of the step reads the carry (the old value), and the
    writer reads the carry only in the stores of ``src``, at the index it stores (an elementwise
    update: each element is read, then written, by one thread)."""
    writers = [i for i, b in enumerate(kernels) if any(isinstance(s, L.Store) and s.buf == src for s in L.walk_stmts(b))]
    if len(writers) != 1:
        return False
    w = writers[0]
    if any(_loads(e, carry) for b in kernels[w + 1:] for s in L.walk_stmts(b) for e in L.stmt_exprs(s)):
        return False
    for s in L.walk_stmts(kernels[w]):
        if isinstance(s, L.Store) and s.buf == src:
            if _loads(s.index, carry) or any(x.index != s.index for x in _loads(s.value, carry)):
                return False
        elif any(_loads(e, carry) for e in L.stmt_exprs(s)):
            return False
    return True


def _params(body, info, scalars):
    """Parameters from what the statements load and store: read-only "in", written "out" (or
    "inout" when also read); the program's i32 scalars by value."""
    reads, writes, syms = set(), set(), set()
    for s in L.walk_stmts(body):
        if isinstance(s, L.Store) and s.buf in info:
            writes.add(s.buf)
        for e in L.stmt_exprs(s):
            for x in L.walk_exprs(e):
                if isinstance(x, L.Load) and x.buf in info:
                    reads.add(x.buf)
                elif isinstance(x, L.Sym) and x.name in scalars:
                    syms.add(x.name)
    out = [L.Param(n, "i32", "scalar") for n in sorted(syms)]
    for n in sorted(reads | writes):
        role = "inout" if n in reads and n in writes else "out" if n in writes else "in"
        shape, dtype = info[n]
        out.append(L.Param(n, dtype, "buffer", shape, role))
    return tuple(out)
