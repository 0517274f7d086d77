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

from .lower import Builder, Unfusable, fresh
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
    """``dst[offset + f] = src[f]`` for f < n (``src`` a buffer name or a Const)."""
    f = fresh("f")
    fs = L.Sym(f, "i32")
    val = src if isinstance(src, L.Const) else L.Load(src[0], fs, src[1])
    at = fs if offset is None else L.add(offset, fs)
    return L.Loop(f, L.c(0), L.c(n), (L.Store(dst, at, val),), parallel=True)


def scan_kernel(lw, roots) -> L.Kernel:
    """The kernel of one scan: ``roots`` are its equations' outputs (one per result)."""
    from .schedule import build_plan, section
    e0 = lw.g.producer[roots[0]]
    p = e0.params
    length, nk, nc = p["length"], p["n_consts"], p["n_carry"]
    body = _copied_outputs(p["body"])
    by_out = {lw.g.producer[r].params["out"]: r for r in roots}
    names = [lw.buffer_of(a) if isinstance(a, Var) else f"c{i}" for i, a in enumerate(e0.inputs)]
    for i in range(nk, nk + nc):                        # a carry is named after the scan's result
        names[i] = lw.buffer_of(by_out[i - nk]) if i - nk in by_out else f"carry{i - nk}"
    names[nk + nc:] = [n + "_t" for n in names[nk + nc:]]
    sub = build_plan(body, lw.rules, names)

    info = {}                                           # buffer name -> (shape, dtype)
    outer_scalars = {lw.names[v] for v in lw.prog.inputs if is_scalar_param(v)}

    def outer(v):
        name = lw.buffer_of(v)
        info[name] = (tuple(v.shape), v.dtype)
        return name

    def scratch(name, shape, dtype):                    # a buffer of the plan, allocated if the kernel uses it
        n, i = f"scan_{name}", 1
        while n in lw.used:
            i += 1
            n = f"scan_{name}_{i}"
        lw.used.add(n)
        info[n] = (tuple(shape), dtype)
        made.append(n)
        return n
    made = []

    t = fresh("t")
    tsym = L.Sym(t, "i32")                              # the step; it reads x[at] and writes ys[at]
    at = L.Bin("sub", L.c(length - 1), tsym) if p.get("reverse") else tsym
    rename, syms, slices = {}, {}, {}                   # body buffer -> outer; body Sym -> expr; body x -> (xs, size)
    scalars, xb = {}, Builder(lw)                       # scalar x[t] -> its expression (built by xb)
    results = []                                        # the buffer of each result (carries, then ys)
    for j in range(len(body.outputs)):
        o = body.outputs[j]
        r = by_out.get(j)
        shape = tuple(o.shape) if j < nc else (length,) + tuple(o.shape)
        results.append(outer(r) if r is not None else scratch(f"out{j}", shape, o.dtype))
    for i, (bv, a) in enumerate(zip(body.inputs, e0.inputs)):
        name = sub.inputs[i]
        if i < nk:                                      # a constant: the outer buffer itself
            if isinstance(a, Lit):
                syms[name] = L.Const(a.value, a.dtype)
                continue
            rename[name] = outer(a)
            if is_scalar_param(bv) and rename[name] not in outer_scalars:
                syms[name] = L.Load(rename[name], L.c(0), "i32")
            elif is_scalar_param(bv):
                syms[name] = L.Sym(rename[name], "i32")
        elif i < nk + nc:                               # a carry: the scan's result buffer
            rename[name] = results[i - nk]
            info[rename[name]] = (tuple(bv.shape), bv.dtype)
            if is_scalar_param(bv):
                syms[name] = L.Load(rename[name], L.c(0), "i32")
        elif bv.shape == ():                            # a scalar x[t]: its expression at t, inlined
            syms[name] = scalars[name] = xb.expr(a, (at,))
            if xb.row_stmts:                            # it needs a reduction first: read it from a buffer
                raise Unfusable(a)
        else:                                           # a slice x[t] of xs
            slices[name] = (outer(a), bv.size)
    for name, (shape, dtype) in sub.buffers.items():
        if name not in sub.inputs:
            rename[name] = scratch(name, shape, dtype)
            if tuple(shape) == () and dtype == "i32":   # a computed i32 scalar, read as a Sym by the body
                syms[name] = L.Load(rename[name], L.c(0), "i32")

    def ex_node(x):
        if isinstance(x, L.Sym) and x.name in syms:
            return syms[x.name]
        if isinstance(x, L.Load) and x.buf in scalars:
            return scalars[x.buf]
        if isinstance(x, L.Load) and x.buf in slices:
            xs, size = slices[x.buf]
            return replace(x, buf=xs, index=L.add(L.mul(at, L.c(size)), x.index))
        if isinstance(x, L.Load) and x.buf in rename:
            return replace(x, buf=rename[x.buf])
        return None

    def ex(e):
        return L.fold(L.rewrite_expr(e, ex_node))

    kernels = []
    for k in sub.kernels:
        stmts = _collapse_rows(k.body) if k.family in ("elementwise", "reduce", "scatter") else k.body
        kernels.append((k.name, L.rewrite(_expand_attention(stmts), ex, lambda n: rename.get(n, n))))
    srcs = [rename.get(o[1], o[1]) for o in sub.outputs]
    inplace = {srcs[j]: results[j] for j in range(nc)
               if srcs.count(srcs[j]) == 1 and _in_place([b for _, b in kernels], srcs[j], results[j])}

    def to_carry(e):
        return L.rewrite_expr(e, lambda x: replace(x, buf=inplace[x.buf]) if isinstance(x, L.Load)
                              and x.buf in inplace else None)
    steps = []
    for name, stmts in kernels:
        steps += [L.Comment(name), *L.rewrite(stmts, to_carry, lambda n: inplace.get(n, n)), L.Barrier()]
    for j, src in enumerate(srcs):
        src = inplace.get(src, src)
        n = int(np.prod(body.outputs[j].shape, dtype=np.int64))
        if src != results[j]:
            steps.append(_copy(results[j], (src, info[src][1]), n, None if j < nc else L.mul(at, L.c(n))))
    steps.append(L.Barrier())
    flops = sum(k.flops for k in sub.kernels)
    init = []
    for i in range(nc):
        a = e0.inputs[nk + i]
        src = L.Const(a.value, a.dtype) if isinstance(a, Lit) else (outer(a), a.dtype)
        init.append(_copy(results[i], src, max(1, int(np.prod(a.shape, dtype=np.int64)))))
    for name, v in xb.reads.items():
        info[name] = (tuple(v.shape), v.dtype)
    eqns = [lw.g.producer[r] for r in roots] + list(xb.ops)
    order = ", last x first" if p.get("reverse") else ""
    body_stmts = section(f"scan of {length} steps{order} -> {', '.join(results)}", eqns) + tuple(init) + (
        (L.Barrier(),) if init else ()) + (L.Loop(t, L.c(0), L.c(length), tuple(steps)),)
    params = _params(body_stmts, info, outer_scalars)
    used = {q.name for q in params}
    for n in made:
        if n in used:
            lw.names[Var(*info[n])] = n
    return L.Kernel(f"scan_{results[0]}", "loop", params, body_stmts, tuple(eqns), 0, flops * length)


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
