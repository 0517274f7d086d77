"""From the partition to an ordered list of Loop IR kernels and a buffer plan.

Kernel families and their loop nests (``rows`` are the output's leading dims):

* loop (elementwise):  for rows: [row scalars]; for j: out[rows, j] = expr
* reduce:              for rows: [row scalars]; out[rows] = scalar
* contract (GEMV/matmul, with prologue and epilogue):
      for rows: [row scalars]; a[k] = prologue(rows, k)
                for n (parallel): acc_i = sum_k a[k] * B_i[n, k]; out[rows, n] = epilogue(acc)
  Siblings that share the activation get one segment each (Q/K/V) or share
  one n loop when an epilogue combines them (gate/up with SiLU*mul).
* scatter (dynamic_update_slice, in place when the operand is donated)
* attention (decode/prefill over the KV cache, online softmax)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from codegen import loopir as L
from dsl.core import Lit, Var

from .lower import LOWER, Builder, Unfusable, fresh, unravel
from .partition import Graph, enabled_rules, is_scalar_param, materialize, plan_epilogues



@dataclass
class Plan:
    """What the runtime needs: kernels in launch order and every buffer's name, shape and dtype."""
    kernels: list
    buffers: dict                  # name -> (shape, dtype); scalars have shape ()
    inputs: list                   # buffer name of each program input
    outputs: list                  # per program output: ("buf", name) or ("lit", value, dtype)
    scalars: list                  # names of i32 scalar inputs
    aliases: dict = field(default_factory=dict)   # DUS output buffer -> donated input it overwrites
    rules: frozenset = frozenset()


def sanitize(name):
    s = re.sub(r"[^A-Za-z0-9_]", "_", str(name))
    return s if s and not s[0].isdigit() else "_" + s


class Lowering:
    def __init__(self, prog, rules, input_names, donated, materialized):
        self.prog, self.rules, self.donated = prog, rules, set(donated)
        self.g = Graph.of(prog)
        self.materialized = set(materialized)
        self.epi = plan_epilogues(self.g, self.materialized, rules)
        self.names = {}
        used = set()
        for v, n in zip(prog.inputs, input_names):
            n = sanitize(n)
            while n in used:
                n += "_"
            used.add(n)
            self.names[v] = n
        self.used = used

    def buffer_of(self, v):
        if v not in self.names:
            e = self.g.producer[v]
            base = sanitize(e.prim.name)
            n = f"{base}_{len(self.names)}"
            self.names[v] = n
        return self.names[v]

    # ------------------------------------------------------------------ schedule
    def deps(self, v):
        """Materialized values read by the kernel rooted at ``v``."""
        out, stack, seen = set(), [a for a in self.g.producer[v].inputs if isinstance(a, Var)], set()
        for c in self.epi.get(v, ()):
            stack += [a for a in self.g.producer[c].inputs if isinstance(a, Var)]
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in self.materialized or a not in self.g.producer:
                out.add(a)
            else:
                stack += [x for x in self.g.producer[a].inputs if isinstance(x, Var)]
        return out

    def items(self):
        """Roots in launch order; GEMV siblings sharing an activation are grouped (horizontal rule)."""
        roots = [e.out for e in self.prog.eqns if e.out in self.materialized]
        pos, items = {}, []
        for r in roots:
            grouped = False
            if "horizontal" in self.rules and r in self.epi:
                a = self.g.producer[self.epi[r][0]].inputs[0]
                for i, it in enumerate(items):
                    if it[0] == "contract" and it[1] is a:
                        earlier = {x for j in range(i) for x in items[j][2]} | set(self.prog.inputs)
                        members = set(it[2])
                        d = self.deps(r)
                        if d <= earlier | {a} and not d & members:
                            it[2].append(r)
                            grouped = True
                            break
            if not grouped:
                if r in self.epi:
                    items.append(("contract", self.g.producer[self.epi[r][0]].inputs[0], [r]))
                else:
                    items.append(("single", None, [r]))
            pos[r] = len(items) - 1
        return items

    def alias_dus(self, items):
        """Write a dynamic_update_slice in place when its operand is donated (or a dead
        intermediate) and nothing launched later reads the operand."""
        where = {r: i for i, it in enumerate(items) for r in it[2]}
        readers = {}
        for i, it in enumerate(items):
            for r in it[2]:
                for d in self.deps(r):
                    readers.setdefault(d, []).append((i, r))
        aliases = {}
        for r in where:
            e = self.g.producer[r]
            if e.prim.name != "dynamic_update_slice":
                continue
            o = e.inputs[0]
            ok_owner = (o in self.donated) or (o in self.g.producer and o not in self.g.outputs)
            later = [x for i, x in readers.get(o, []) if x is not r and i >= where[r]]
            if ok_owner and o not in self.g.outputs and not later and o not in aliases.values():
                aliases[r] = o
        return aliases


def _nest(loop_vars, extents, inner, parallel_outer=True):
    body = tuple(inner)
    for i in reversed(range(len(loop_vars))):
        body = (L.Loop(loop_vars[i], L.c(0), L.c(extents[i]), body, parallel=parallel_outer and i == 0),)
    return body


def _params(lw, b, writes):
    """Kernel parameters: buffers read (``b.reads``) and written (``writes``: name -> Var)."""
    params = []
    for name, v in b.reads.items():
        if is_scalar_param(v) and name not in writes:
            params.append(L.Param(name, "i32", "scalar"))
        else:
            params.append(L.Param(name, v.dtype, "buffer", tuple(v.shape), "inout" if name in writes else "in"))
    for name, v in writes.items():
        if name not in b.reads:
            params.append(L.Param(name, v.dtype, "buffer", tuple(v.shape), "out"))
    return tuple(params)


def describe(e):
    """One DSL op as it appears in kernel headers: ``dot f32[1,576]  (stdlib/nn.py:39)``."""
    return f"{e.prim.name} {e.out.dtype}[{','.join(map(str, e.out.shape))}]  ({e.source or '?'})"


def _op_list(b):
    return tuple(b.ops)


def loop_kernel(lw, name, shape, store_fn, family="elementwise"):
    """for rows: [row scalars]; for j: stores produced by ``store_fn(builder, idx)``.

    Without row scalars the nest is one flat parallel loop over every element (so a GPU gives
    each element a thread); with them, rows are parallel and each row's reductions run first."""
    rows = shape[:-1] if shape else ()
    rv = [fresh("i") for _ in rows]
    b = Builder(lw, tuple(L.Sym(v, "i32") for v in rv))
    if shape and len(shape) > 1:
        flat = Builder(lw)
        f = fresh("f")
        try:
            stores, writes = store_fn(flat, unravel(L.Sym(f, "i32"), shape))
        except Unfusable:                       # it needs per-row reductions: keep the row nest
            flat.row_stmts = [None]
        if not flat.row_stmts:
            body = (L.Loop(f, L.c(0), L.c(int(np.prod(shape))), tuple(stores), parallel=True),)
            params = _params(lw, flat, writes)
            return L.Kernel(name, family, params, body, _op_list(flat), 0, meta={"single_thread": False})
    if shape:
        j = fresh("j")
        stores, writes = store_fn(b, b.row_idx + (L.Sym(j, "i32"),))
        inner = (L.Loop(j, L.c(0), L.c(shape[-1]), tuple(stores), parallel=not rows),)
    else:
        stores, writes = store_fn(b, ())
        inner = tuple(stores)
    body = _nest(rv, rows, tuple(b.row_stmts) + inner)
    params = _params(lw, b, writes)
    return L.Kernel(name, family, params, body, _op_list(b), 0,
                    meta={"single_thread": not shape})


def root_kernel(lw, r):
    """Kernel for a materialized elementwise/view/index/reduce root ``r``."""
    e = lw.g.producer[r]
    out = lw.buffer_of(r)
    if e.prim.kind == "reduce":
        rv = [fresh("i") for _ in r.shape]
        b = Builder(lw, tuple(L.Sym(v, "i32") for v in rv))
        b.ops.append(e)
        val = b.row_scalar(r, e, b.row_idx)
        st = L.Store(out, L.linear_index(b.row_idx, r.shape), val)
        body = _nest(rv, r.shape, tuple(b.row_stmts) + (st,))
        params = _params(lw, b, {out: r})
        return L.Kernel(f"reduce_{out}", "reduce", params, body, _op_list(b), 0,
                        meta={"single_thread": not r.shape})

    def store(b, idx):
        b.ops.append(e)
        val = LOWER[e.prim.name](b, e, idx)
        return [L.Store(out, L.linear_index(idx, r.shape), val)], {out: r}
    k = loop_kernel(lw, f"loop_{out}", r.shape, store)
    if any(op.prim.kind == "reduce" for op in k.ops):
        k.family = "reduce"
    return k


def copy_kernel(lw, src, dst_name, v):
    def store(b, idx):
        return [L.Store(dst_name, L.linear_index(idx, v.shape), b.load(src, idx))], {dst_name: v}
    return loop_kernel(lw, f"copy_{dst_name}", v.shape, store)


def scatter_kernel(lw, r, out):
    """dynamic_update_slice: write the update at clamped runtime offsets into ``out``."""
    e = lw.g.producer[r]
    o, u, *starts = e.inputs

    def store(b, idx):
        b.ops.append(e)
        offs = []
        for s, n, m in zip(starts, u.shape, o.shape):
            s = b.expr(s, ())
            offs.append(L.Bin("max", L.c(0), L.Bin("min", s, L.c(m - n))))
        at = tuple(L.add(a, i) for a, i in zip(offs, idx))
        return [L.Store(out, L.linear_index(at, o.shape), b.expr(u, idx))], {out: r}
    return loop_kernel(lw, f"scatter_{out}", u.shape, store, "scatter")


def contract_kernel(lw, a, roots):
    """GEMV/matmul family: shared prologue, one parallel n loop per segment of siblings."""
    rows, K = a.shape[:-1], a.shape[-1]
    rv = [fresh("i") for _ in rows]
    b = Builder(lw, tuple(L.Sym(v, "i32") for v in rv))
    k = fresh("k")
    act = fresh("a")
    pro = b.expr(a, b.row_idx + (L.Sym(k, "i32"),))
    pro = pro if pro.dtype == "f32" else L.Cast(pro, "f32")
    stmts = [L.Array(act, "f32", K), L.Loop(k, L.c(0), L.c(K), (L.Store(act, L.Sym(k, "i32"), pro),))]
    writes, flops, segments = {}, 0, []
    for r in roots:
        contracts = lw.epi[r]
        n = fresh("n")
        nsym = L.Sym(n, "i32")
        b.accs = {c: L.Sym(fresh("acc"), "f32") for c in contracts}
        b.n_idx = nsym
        kk = fresh("k")
        ksym = L.Sym(kk, "i32")
        upd, dots = [], []
        for c in contracts:
            ce = lw.g.producer[c]
            b.ops.append(ce)
            w = ce.inputs[1]
            bidx = b.row_idx[:-1] + ((nsym, ksym) if ce.params["trans_b"] else (ksym, nsym))
            wv = b.expr(w, bidx)
            wv = wv if wv.dtype == "f32" else L.Cast(wv, "f32")
            acc = b.accs[c]
            is_buffer = w in lw.materialized or w not in lw.g.producer
            rows_of_w = L.linear_index(b.row_idx[:-1] + (nsym,), w.shape[:-1])
            # a weight row contiguous in k: the GPU renderers load it 16 bytes at a time
            contig = (lw.buffer_of(w), w.dtype, rows_of_w) if is_buffer and ce.params["trans_b"] else None
            dots.append({"acc": acc.name, "b": wv, "contig": contig})
            upd.append(L.Assign(acc.name, L.Bin("add", acc, L.Bin("mul", L.Load(act, ksym, "f32"), wv))))
            flops += 2 * int(np.prod(c.shape, dtype=np.int64)) * K
        if r in b.accs:
            val = b.accs[r]
        else:
            re_ = lw.g.producer[r]
            b.ops.append(re_)
            val = LOWER[re_.prim.name](b, re_, b.row_idx + (nsym,))
        if val.dtype != r.dtype:
            val = L.Cast(val, r.dtype)
        out = lw.buffer_of(r)
        writes[out] = r
        seg = [L.Declare(acc.name, "f32", L.Const(0.0, "f32")) for acc in b.accs.values()]
        seg += [L.Loop(kk, L.c(0), L.c(K), tuple(upd)),
                L.Store(out, L.linear_index(b.row_idx + (nsym,), r.shape), val)]
        stmts.append(L.Loop(n, L.c(0), L.c(r.shape[-1]), tuple(seg), parallel=True))
        segments.append({"n": n, "N": r.shape[-1], "k": kk, "dots": dots, "out": out,
                         "index": seg[-1].index, "value": val})
    b.accs, b.n_idx = {}, None
    body = _nest(rv, rows, tuple(b.row_stmts) + tuple(stmts), parallel_outer=False)
    params = _params(lw, b, writes)
    name = "gemv" if int(np.prod(rows, dtype=np.int64)) == 1 else "matmul"
    return L.Kernel(f"{name}_{'_'.join(writes)}", "contract", params, body, _op_list(b), 0, flops,
                    meta={"K": K, "rows": rows, "row_vars": rv, "row_stmts": tuple(b.row_stmts), "act": act,
                          "kvar": k, "prologue": pro, "segments": segments})


def attention_kernel(lw, r):
    """Online-softmax attention of q [Hq,T,D] over k, v [Hkv,S,D]; query t sees keys 0..pos+t."""
    e = lw.g.producer[r]
    q, kc, vc, pos = e.inputs
    hq, t_len, d = q.shape
    hkv, s_len, _ = kc.shape
    b = Builder(lw)
    b.ops.append(e)
    qn, kn, vn, out = lw.buffer_of(q), lw.buffer_of(kc), lw.buffer_of(vc), lw.buffer_of(r)
    for name, v in ((qn, q), (kn, kc), (vn, vc)):
        b.reads[name] = v
    p = L.Bin("max", L.c(0), L.Bin("min", b.expr(pos, ()), L.c(s_len - t_len)))   # clamped, like the reference
    h, t, s, dd = fresh("h"), fresh("t"), fresh("s"), fresh("d")
    H, T, S, DD = (L.Sym(x, "i32") for x in (h, t, s, dd))
    m, lsum, o, dot, sc, mn, corr, pr = (fresh(x) for x in ("m", "l", "o", "dot", "sc", "mn", "corr", "p"))
    f = lambda name: L.Sym(name, "f32")  # noqa: E731
    kvh = L.Bin("idiv", H, L.c(hq // hkv))
    qrow = L.linear_index((H, T), (hq, t_len))
    kvrow = L.linear_index((kvh, S), (hkv, s_len))
    ld = lambda buf, row, dt: L.Cast(L.Load(buf, L.add(L.mul(row, L.c(d)), DD), dt), "f32") if dt != "f32" \
        else L.Load(buf, L.add(L.mul(row, L.c(d)), DD), dt)  # noqa: E731
    stop = L.Bin("min", L.add(L.add(p, T), L.c(1)), L.c(s_len))
    step = (
        L.Declare(dot, "f32", L.Const(0.0, "f32")),
        L.Loop(dd, L.c(0), L.c(d), (L.Assign(dot, L.Bin("add", f(dot), L.Bin("mul", ld(qn, qrow, q.dtype), ld(kn, kvrow, kc.dtype)))),)),
        L.Declare(sc, "f32", L.Bin("mul", f(dot), L.Const(e.params["scale"], "f32"))),
        L.Declare(mn, "f32", L.Bin("max", f(m), f(sc))),
        L.Declare(corr, "f32", L.Un("exp", L.Bin("sub", f(m), f(mn)))),
        L.Declare(pr, "f32", L.Un("exp", L.Bin("sub", f(sc), f(mn)))),
        L.Assign(lsum, L.Bin("add", L.Bin("mul", f(lsum), f(corr)), f(pr))),
        L.Loop(dd, L.c(0), L.c(d), (L.Store(o, DD, L.Bin("add", L.Bin("mul", L.Load(o, DD, "f32"), f(corr)),
                                                       L.Bin("mul", f(pr), ld(vn, kvrow, vc.dtype)))),)),
        L.Assign(m, f(mn)),
    )
    per_query = (
        L.Declare(m, "f32", L.Const(float("-inf"), "f32")),
        L.Declare(lsum, "f32", L.Const(0.0, "f32")),
        L.Array(o, "f32", d),
        L.Loop(dd, L.c(0), L.c(d), (L.Store(o, DD, L.Const(0.0, "f32")),)),
        L.Loop(s, L.c(0), stop, step),
        L.Loop(dd, L.c(0), L.c(d), (L.Store(out, L.add(L.mul(qrow, L.c(d)), DD),
                                            L.Bin("div", L.Load(o, DD, "f32"), f(lsum))),)),
    )
    body = (L.Loop(h, L.c(0), L.c(hq), (L.Loop(t, L.c(0), L.c(t_len), per_query),), parallel=True),)
    params = _params(lw, b, {out: r})
    flops = 4 * hq * t_len * d * s_len
    meta = {"q": qn, "k": kn, "v": vn, "out": out, "Hq": hq, "Hkv": hkv, "T": t_len, "S": s_len, "D": d,
            "pos": p, "scale": e.params["scale"], "dtypes": (q.dtype, kc.dtype, vc.dtype)}
    return L.Kernel(f"attention_{out}", "attention", params, body, _op_list(b), 0, flops, meta=meta)


def merge_loops(kernels):
    """Horizontal rule for loops: launch consecutive independent loop kernels as one."""
    out = []
    for k in kernels:
        prev = out[-1] if out else None
        if prev is not None and prev.family in ("elementwise", "scatter") and k.family in ("elementwise", "scatter") \
                and not prev.meta.get("single_thread") and not k.meta.get("single_thread"):
            pw = {p.name for p in prev.params if p.role != "in"}
            pr = {p.name for p in prev.params if p.role != "out"}
            kw = {p.name for p in k.params if p.role != "in"}
            kr = {p.name for p in k.params if p.role != "out"}
            if not (pw & kr) and not (kw & pr) and not (pw & kw):
                params = {p.name: p for p in prev.params}
                for p in k.params:
                    params.setdefault(p.name, p)
                merged = L.Kernel(f"{prev.name}__{k.name.split('_', 1)[1]}", "elementwise", tuple(params.values()),
                                  prev.body + k.body, prev.ops + k.ops, 0, prev.flops + k.flops)
                merged.meta["merged"] = prev.meta.get("merged", [prev.name]) + [k.name]
                out[-1] = merged
                continue
        out.append(k)
    return out


def build_plan(prog, rules=None, input_names=None, donated=()) -> Plan:
    """Partition ``prog`` into kernels and lower them to Loop IR.

    ``rules``: the enabled fusion rules (see ``fusion.partition.RULES``);
    ``donated``: input Vars whose buffers may be overwritten (KV caches)."""
    rules = enabled_rules() if rules is None else frozenset(rules)
    input_names = input_names or [f"in{i}" for i in range(len(prog.inputs))]
    g = Graph.of(prog)
    extra = set()
    while True:
        lw = Lowering(prog, rules, input_names, donated, materialize(g, rules) | extra)
        try:
            return _lower_all(lw)
        except Unfusable as u:
            extra.add(u.var)


def _lower_all(lw) -> Plan:
    items = lw.items()
    aliases = lw.alias_dus(items)
    for r, o in aliases.items():
        lw.names[r] = lw.buffer_of(o)
    kernels = []
    for kind, a, roots in items:
        if kind == "contract":
            kernels.append(contract_kernel(lw, a, roots))
            continue
        (r,) = roots
        e = lw.g.producer[r]
        if e.prim.name == "dynamic_update_slice":
            out = lw.buffer_of(r)
            if r not in aliases:
                kernels.append(copy_kernel(lw, e.inputs[0], out, r))
            kernels.append(scatter_kernel(lw, r, out))
        elif e.prim.kind == "opaque":
            kernels.append(attention_kernel(lw, r))
        elif e.prim.kind == "contract":
            kernels.append(contract_kernel(lw, e.inputs[0], [r]))
        else:
            kernels.append(root_kernel(lw, r))
    if "horizontal" in lw.rules:
        kernels = merge_loops(kernels)
    for i, k in enumerate(kernels):
        k.name = f"k{i:03d}_{k.name}"
        k.bytes = L.traffic(k)
        eqns = sorted(set(k.ops), key=lw.g.order.get)             # DSL ops, in program order
        k.meta["eqns"] = eqns
        k.ops = tuple(describe(e) for e in eqns)
    buffers = {}
    for v, n in lw.names.items():
        buffers.setdefault(n, (tuple(v.shape), v.dtype))
    outputs = []
    for o in lw.prog.outputs:
        outputs.append(("lit", o.value, o.dtype) if isinstance(o, Lit) else ("buf", lw.buffer_of(o)))
    scalars = [lw.names[v] for v in lw.prog.inputs if is_scalar_param(v)]
    return Plan(kernels, buffers, [lw.names[v] for v in lw.prog.inputs], outputs, scalars,
                {lw.buffer_of(r): lw.buffer_of(o) for r, o in aliases.items()}, lw.rules)
