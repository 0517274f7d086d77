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
from dataclasses import dataclass, field, replace

import numpy as np

from codegen import loopir as L
from codegen.simplify import fold_expr
from dsl.core import Lit, Var, loop_key

from .loops import scan_kernel
from .lower import LOWER, Builder, Unfusable, fresh, grid_value, unravel, wrap_index
from .naming import buffer_name, c_safe, kernel_names
from .partition import UPDATES, Graph, enabled_rules, is_scalar_param, materialize, plan_epilogues, plan_stores
from codegen.env import switch



@dataclass
class Plan:
    """What the runtime needs: kernels in launch order and every buffer's name, shape and dtype."""
    kernels: list
    buffers: dict                  # name -> (shape, dtype); scalars have shape ()
    inputs: list                   # buffer name of each program input
    outputs: list                  # per program output: ("buf", name, shape) or ("lit", value, dtype)
    scalars: list                  # names of i32 scalar inputs
    aliases: dict = field(default_factory=dict)   # output buffer written in place -> the input it overwrites
    rules: frozenset = frozenset()
    computed: dict = field(default_factory=dict)  # index of an equation in the program -> the buffer of its value


def sanitize(name):
    s = re.sub(r"[^A-Za-z0-9_]", "_", str(name))
    return s if s and not s[0].isdigit() else "_" + s


class Lowering:
    def __init__(self, prog, rules, input_names, donated, materialized, refused=frozenset()):
        self.prog, self.rules, self.donated = prog, rules, set(donated)
        self.g = Graph.of(prog)
        self.materialized = set(materialized)
        self.epi = plan_epilogues(self.g, self.materialized, rules)
        self.stores = plan_stores(self.g, self.materialized, self.epi, rules, refused)
        self.segment = {f: r for r, fs in self.stores.items() for f in fs}     # store -> its epilogue root
        self.names = {}
        used = set()
        for v, n in zip(prog.inputs, input_names):
            n = c_safe(sanitize(n))
            while n in used:
                n += "_"
            used.add(n)
            self.names[v] = n
        self.used = used

    def buffer_of(self, v):
        """The buffer name of ``v``: an input's name, or the model's name for a computed value
        (``fusion.naming.buffer_name``: ``layers_3_q``), unique within the plan."""
        if v not in self.names:
            n = base = buffer_name(self.g, v, self.names)
            i = 1
            while n in self.used:
                i += 1
                n = f"{base}_{i}"
            self.used.add(n)
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
            e = self.g.producer.get(r)
            if e is not None and e.prim.kind == "loop":     # the results of one scan: one kernel
                key = loop_key(e)
                if items and items[-1][0] == "loop" and items[-1][1] == key:
                    items[-1][2].append(r)
                else:
                    items.append(("loop", key, [r]))
                continue
            seg = self.segment.get(r, r)            # a store of an epilogue cone: its root's kernel
            home = [i for i, it in enumerate(items) if it[0] == "contract"
                    and any(self.segment.get(x, x) is seg for x in it[2])] if seg is not r else []
            if ("horizontal" in self.rules or home) and seg in self.epi:
                a = self.g.producer[self.epi[seg][0]].inputs[0]
                for i, it in enumerate(items):
                    if it[0] == "contract" and it[1] is a and (not home or i == home[0]):
                        earlier = {x for j in range(i) for x in items[j][2]} | set(self.prog.inputs)
                        members = set(it[2])
                        d = self.deps(r)
                        if d <= earlier | {a} and not d & members:
                            it[2].append(r)
                            grouped = True
                            break
                if home and not grouped:            # it cannot join its segment's kernel
                    raise Unfusable(seg, cone=True)
            if not grouped:
                if seg in self.epi:
                    items.append(("contract", self.g.producer[self.epi[seg][0]].inputs[0], [r]))
                else:
                    items.append(("single", None, [r]))
            pos[r] = len(items) - 1
        return items

    def alias_in_place(self, items):
        """{root: the buffer it overwrites}: kernels that write their result into a buffer they read
        instead of a new one.  A ``dynamic_update_slice`` or ``scatter`` writes into its operand
        when that is donated (or a dead intermediate); a program output computed elementwise from a
        donated input of its shape (``state = state * decay + u``) writes into that input.  Either
        way only when no kernel launched later (nor another root of the same kernel) reads the
        buffer, and the kernel itself reads it only where it writes: an update (or offset, or
        index) computed from the operand is materialized first (``Unfusable``); an output that
        reads the input anywhere but at its own index (through a view, reduction, gather or
        contraction) is not aliased."""
        where = {r: i for i, it in enumerate(items) for r in it[2]}
        readers = {}
        for i, it in enumerate(items):
            for r in it[2]:
                for d in self.deps(r):
                    readers.setdefault(d, []).append((i, r))
        outputs = [o for o in self.prog.outputs if isinstance(o, Var)]
        aliases = {}
        for r in where:
            e = self.g.producer[r]
            if e.prim.name in UPDATES:
                o, *rest = e.inputs
                owner = (o in self.donated) or (o in self.g.producer and o not in self.g.outputs)
            else:
                o = self.elementwise_owner(r) if r in outputs else None
                rest, owner = (), o is not None
            if o is None or not owner or o in self.g.outputs or o in aliases.values():
                continue
            if e.prim.name == "scatter" and any(u is o for u in rest):
                continue                # x.at[ids].set(x): it reads x where it does not write: a copy
            if any(x is not r and i >= where[r] for i, x in readers.get(o, [])):
                continue
            for u in rest:              # hazard rule: the update must not read the elements it overwrites
                if isinstance(u, Var) and u is not o and u not in self.materialized and o in self.deps(u):
                    # materialize it first, then write in place (an epilogue root whose kernel was to
                    # store the update itself gives up those stores: its cone is refused)
                    raise Unfusable(u, cone=u in self.stores)
            aliases[r] = o
        return aliases

    def elementwise_owner(self, r):
        """The donated input that output ``r`` may overwrite: one of ``r``'s shape and dtype that
        ``r``'s kernel reads only at ``r``'s own index (every path to it inside the kernel goes
        through elementwise ops); None when there is none."""
        cands = [v for v in self.donated if v.shape == r.shape != () and v.dtype == r.dtype and v not in self.g.outputs]
        if not cands or self.g.producer[r].prim.kind not in ("elementwise", "contract"):
            return None
        bad, seen, stack = set(), set(), [(r, True)]
        contracts = set(self.epi.get(r, ()))
        while stack:
            v, aligned = stack.pop()
            if (v, aligned) in seen:
                continue
            seen.add((v, aligned))
            if v is not r and (v in self.materialized or v not in self.g.producer):
                if not aligned:
                    bad.add(v)
                continue
            e = self.g.producer[v]
            keep = aligned and e.prim.kind == "elementwise" and v not in contracts
            stack += [(a, keep) for a in e.inputs if isinstance(a, Var)]
        reads = {v for v, _ in seen}
        return next((v for v in cands if v in reads and v not in bad), None)


def _nest(loop_vars, extents, inner, parallel_outer=True):
    body = tuple(inner)
    for i in reversed(range(len(loop_vars))):
        body = (L.Loop(loop_vars[i], L.c(0), L.c(extents[i]), body, parallel=parallel_outer and i == 0),)
    return body


def _params(lw, b, writes):
    """Kernel parameters: buffers read (``b.reads``) and written (``writes``: name -> Var)."""
    params = []
    for name, v in b.reads.items():
        if is_scalar_param(v) and v not in lw.g.producer and name not in writes:
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


def section(title, eqns):
    """Comments that open a section of a kernel: its DSL ops and the source lines they came from
    (``dsl.core.source_text`` where it exists: ``stdlib/llama.py:21  q = linear(h, p["wq"])``)."""
    from dsl import core
    names = ", ".join(dict.fromkeys(e.prim.name for e in eqns))
    text = getattr(core, "source_text", None)
    if text is None:
        where = ", ".join(dict.fromkeys(e.source or "?" for e in eqns))
        return (L.Comment(f"{title}: {names}  ({where})"),)
    return (L.Comment(f"{title}: {names}"),) + tuple(L.Comment(f"  {t}") for t in dict.fromkeys(map(text, eqns)))


def short_name(buf):
    """A weight's name without its model path: ``params_layers_0_w_gate`` -> ``w_gate``."""
    return re.sub(r"^(params_)?(layers_\d+_)?", "", buf) or buf


def single_thread(k):
    """Does the kernel compute outside every parallel loop (a reduction to a scalar)?"""
    return not all(isinstance(s, L.Comment) or (isinstance(s, L.Loop) and s.parallel) for s in k.body)


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
            body = section(", ".join(writes), flat.ops) + (
                L.Loop(f, L.c(0), L.c(int(np.prod(shape))), tuple(stores), parallel=True),)
            params = _params(lw, flat, writes)
            return L.Kernel(name, family, params, body, _op_list(flat), 0)
    if shape:
        j = fresh("j")
        try:
            stores, writes = store_fn(b, b.row_idx + (L.Sym(j, "i32"),))
        except Unfusable as first:
            # reductions read at every index of the value (a vector of sums or maxes over its rows, a
            # count of sibling tests): each element is a row, its reductions one pass before its store
            b = Builder(lw, tuple(L.Sym(fresh("i"), "i32") for _ in shape))
            try:
                stores, writes = store_fn(b, b.row_idx)
            except Unfusable:
                raise first from None             # the value the first try named is materialized
            body = section(", ".join(writes), b.ops) + _nest([s.name for s in b.row_idx], shape, tuple(b.row_stmts) + tuple(stores))
            return L.Kernel(name, family, _params(lw, b, writes), body, _op_list(b), 0)
        # the row's elements are independent (only the outermost parallel loop is split on the CPU)
        inner = (L.Loop(j, L.c(0), L.c(shape[-1]), tuple(stores), parallel=True),)
    else:
        stores, writes = store_fn(b, ())
        inner = tuple(stores)
    body = section(", ".join(writes), b.ops) + _nest(rv, rows, tuple(b.row_stmts) + inner)
    params = _params(lw, b, writes)
    return L.Kernel(name, family, params, body, _op_list(b), 0)


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
        body = section(out, b.ops) + _nest(rv, r.shape, tuple(b.row_stmts) + (st,))
        params = _params(lw, b, {out: r})
        return L.Kernel(f"reduce_{out}", "reduce", params, body, _op_list(b), 0)

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


def _value(e, env):
    """The i32 value of index expression ``e`` with the symbols of ``env`` (others 0); loads are
    0 (a gathered row: held fixed).  None for what an index does not hold."""
    if isinstance(e, L.Const):
        return int(e.value)
    if isinstance(e, L.Sym):
        return env.get(e.name, 0)
    if isinstance(e, L.Load):
        return 0
    if isinstance(e, L.Cast) and e.dtype == "i32" and e.x.dtype == "i32":
        return _value(e.x, env)
    if isinstance(e, L.Bin):
        a, b = _value(e.a, env), _value(e.b, env)
        ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
               "max": lambda: max(a, b), "min": lambda: min(a, b),
               "idiv": lambda: int(a / b) if b else None, "mod": lambda: a - b * int(a / b) if b else None}
        return None if a is None or b is None or e.op not in ops else ops[e.op]()
    return None


def stride(index, var):
    """Elements ``index`` moves when loop variable ``var`` steps by one (the others at 0), or None
    when that is not one constant (over the first steps) or a gathered index depends on ``var``."""
    if any(isinstance(x, L.Load) and var in set(L.walk_exprs(x.index)) for x in L.walk_exprs(index)):
        return None
    v = [_value(index, {var.name: i}) for i in range(3)]
    return None if None in v or v[1] - v[0] != v[2] - v[1] else v[1] - v[0]


def access_order(weights, k, n):
    """The order of a contraction segment's loops (``codegen.loopir.ORDERS``) from its weight
    expressions (their loads indexed by the reduction variable ``k`` and the output column ``n``):
    "outer" when every weight load is contiguous along n and not along k (a (K, N) weight:
    ``x @ w``), so that each step of k reads a run of columns; else "inner" (dot products along k:
    the (N, K) layout of ``nn.linear``, ``x @ w.T``)."""
    loads = [x for w in weights for x in L.walk_exprs(w) if isinstance(x, L.Load)
             and ({k, n} & set(L.walk_exprs(x.index)))]
    if loads and all(stride(x.index, n) == 1 and stride(x.index, k) != 1 for x in loads):
        return "outer"
    return "inner"


def contract_orders(k) -> tuple:
    """The access orders (``codegen.loopir.ORDERS``) of a contraction kernel's segments, each once,
    in the order they appear."""
    return tuple(dict.fromkeys(r.order for r in _segment_reduces(k.body)))


def _segment_reduces(body):
    """The Reduce that opens each parallel loop of ``body`` (after its locals): a contraction's segments."""
    out = []
    for s in L.walk_stmts(body):
        if isinstance(s, L.Loop) and s.parallel:
            out += [x for x in s.body if isinstance(x, L.Reduce)][:1]
    return out


_COMBINE = {"add": "add", "mul": "mul", "min": "min", "max": "max"}


def index_scatter_kernel(lw, r, out):
    """scatter: ``out[ids(p)] = op(out[ids(p)], u[p])`` for every update element p whose indices
    (negative ones counted from the end) are all in bounds (the others are dropped).  The leading
    dims of ``u`` (from slices: distinct elements) run as one parallel loop; its last ``batch``
    dims (the index arrays' own, where indices may repeat) run serially inside it, in order, so
    repeated indices combine as in the reference (the last ``set`` wins, ``add`` accumulates)."""
    e = lw.g.producer[r]
    o, u, *ids = e.inputs
    op, batch = e.params["op"], e.params["batch"]
    par, ser = u.shape[:u.ndim - batch], u.shape[u.ndim - batch:]
    b = Builder(lw)
    b.ops.append(e)
    f, sv = fresh("p"), [fresh("b") for _ in ser]
    idx = (unravel(L.Sym(f, "i32"), par) if par else ()) + tuple(L.Sym(v, "i32") for v in sv)
    at, decl, ok = [], [], None
    loop_vars = {f, *sv}
    for i, n in zip(ids, o.shape):
        a = b.expr(i, idx)
        if any(isinstance(x, L.Load) or isinstance(x, L.Sym) and x.name not in loop_vars for x in L.walk_exprs(a)):
            decl.append(L.Declare(fresh("at"), "i32", wrap_index(a, n)))     # a runtime index: a local,
            a = L.Sym(decl[-1].name, "i32")                                   # tested, then used
            inside = L.Bin("and", L.Bin("ge", a, L.c(0)), L.Bin("lt", a, L.c(n)))
            ok = inside if ok is None else L.Bin("and", ok, inside)
        at.append(a)                # (slices and static ints are in bounds by construction)
    lin = L.linear_index(tuple(at), o.shape)
    val = b.expr(u, idx)
    if op != "set":
        b.reads[out] = r
        val = L.Bin(_COMBINE[op], L.Load(out, lin, o.dtype), val)
    store = L.Store(out, lin, val)
    body = _nest(sv, ser, tuple(decl) + ((L.If(ok, (store,)),) if ok is not None else (store,)), parallel_outer=False)
    if par:
        body = (L.Loop(f, L.c(0), L.c(int(np.prod(par))), body, parallel=True),)
    body = tuple(b.row_stmts) + body            # reductions to a scalar the updates read, computed first
    params = _params(lw, b, {out: r})
    return L.Kernel(f"scatter_{out}", "scatter", params, section(out, b.ops) + body, _op_list(b), 0)


def contract_kernel(lw, a, roots):
    """GEMV/matmul family: for rows: [row scalars]; act[k] = prologue; then one parallel n loop per
    segment of siblings: a Reduce over k of act[k] * B_i[n, k] per sibling, and the epilogue store."""
    rows, K = a.shape[:-1], a.shape[-1]
    rv = [fresh("i") for _ in rows]
    b = Builder(lw, tuple(L.Sym(v, "i32") for v in rv))
    k = fresh("k")
    act = fresh("act")
    pro = b.expr(a, b.row_idx + (L.Sym(k, "i32"),))
    pro = pro if pro.dtype == "f32" else L.Cast(pro, "f32")
    head = section("prologue", b.ops) if b.ops else ()
    stmts = [L.Array(act, "f32", K), L.Loop(k, L.c(0), L.c(K), (L.Store(act, L.Sym(k, "i32"), pro),))]
    writes, flops = {}, 0
    for r in dict.fromkeys(lw.segment.get(x, x) for x in roots):
        seen = len(b.ops)
        contracts = lw.epi[r]
        n = fresh("n")
        nsym = L.Sym(n, "i32")
        labels = {}
        for c in contracts:             # accumulators named after their weight (a buffer) or "dot"
            w = lw.g.producer[c].inputs[1]
            while w in lw.g.producer and w not in lw.materialized and (       # the weight read through views,
                    lw.g.producer[w].prim.kind == "view" or lw.g.producer[w].prim.name in ("dequantize", "take")):
                w = lw.g.producer[w].inputs[0]                  # a dequantization or a gather (an expert's rows)
            labels[c] = ("dot" if isinstance(w, Lit) else      # a weight broadcast from a literal (jnp.full)
                         short_name(lw.buffer_of(w)) if w in lw.materialized or w not in lw.g.producer else "dot")
        kk = fresh("k")
        ksym = L.Sym(kk, "i32")
        flops += sum(2 * int(np.prod(c.shape, dtype=np.int64)) * K for c in contracts)
        if r in lw.stores:
            loop, outs = cone_segment(lw, b, r, labels, act, ksym, K)
            writes.update(outs)
            stmts += section(f"{', '.join(labels.values())} -> {', '.join(outs)}", b.ops[seen:])
            stmts.append(loop)
            continue
        b.accs = {c: L.Sym(fresh(f"acc_{labels[c]}"), "f32") for c in contracts}
        b.n_idx = nsym
        accs = [accumulate(lw, b, c, b.accs[c].name, nsym, act, ksym) for c in contracts]
        order = access_order([a.value.b for a in accs], ksym, nsym) if K > 1 and r.shape[-1] > 1 else "inner"
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
        seg = (L.Reduce(kk, L.c(0), L.c(K), tuple(accs), order=order),
               L.Store(out, L.linear_index(b.row_idx + (nsym,), r.shape), val))
        stmts += section(f"{', '.join(labels.values())} -> {out}", b.ops[seen:])
        stmts.append(L.Loop(n, L.c(0), L.c(r.shape[-1]), seg, parallel=True))
    b.accs, b.n_idx = {}, None
    tiled = row_tiles(rv, rows, K, act, tuple(b.row_stmts), stmts)
    body = head + tiled if tiled else _nest(rv, rows, head + tuple(b.row_stmts) + tuple(stmts), parallel_outer=False)
    params = _params(lw, b, writes)
    name = "gemv" if int(np.prod(rows, dtype=np.int64)) == 1 else "matmul"
    return L.Kernel(f"{name}_{'_'.join(writes)}", "contract", params, body, _op_list(b), 0, flops)


def accumulate(lw, b, c, name, col, act, k):
    """The accumulator ``name += act[k] * w[col, k]`` of contraction ``c`` at output column ``col``."""
    ce = lw.g.producer[c]
    if ce not in b.ops:
        b.ops.append(ce)
    bidx = b.row_idx[:-1] + ((col, k) if ce.params["trans_b"] else (k, col))
    wv = b.expr(ce.inputs[1], bidx)
    wv = wv if wv.dtype == "f32" else L.Cast(wv, "f32")
    return L.Acc(name, "add", L.Bin("mul", L.Load(act, k, "f32"), wv))


class _NoPairing(Exception):
    """This pairing of output rows does not give every read of the accumulator a sibling."""


def _store_target(lw, b, f, idx):
    """(buffer, flat index, value) that store ``f`` of an epilogue cone writes at ``idx`` of its
    space: a ``dynamic_update_slice`` writes its update at the clamped offsets (in place when
    aliased); any other value its own element."""
    e = lw.g.producer[f]
    out = lw.buffer_of(f)
    if e not in b.ops:
        b.ops.append(e)
    if e.prim.name != "dynamic_update_slice":
        return out, L.linear_index(idx, f.shape), LOWER[e.prim.name](b, e, idx)
    o, u, *starts = e.inputs
    offs = [L.Bin("max", L.c(0), L.Bin("min", b.expr(s, ()), L.c(m - n))) for s, n, m in zip(starts, u.shape, o.shape)]
    return out, L.linear_index(tuple(L.add(a, i) for a, i in zip(offs, idx)), o.shape), b.expr(u, idx)


def _space(lw, f):
    """The index space a store of an epilogue cone iterates: a ``dynamic_update_slice``'s update."""
    e = lw.g.producer[f]
    return tuple(e.inputs[1].shape if e.prim.name == "dynamic_update_slice" else f.shape)


def _pairings(extent):
    """Ways to run the output rows along the innermost column dim of ``extent``: alone (None),
    then rows j and j + h side by side in blocks of 2h, h from the largest (RoPE's rotate-half:
    h = hd/2) to 1 (an interleaved rotation)."""
    out, h = [None], extent // 2
    while h >= 1:
        if extent % (2 * h) == 0:
            out.append(h)
        h = h // 2 if h > 1 else 0
    return out


def cone_segment(lw, b, root, labels, act, k, K):
    """The paired_epilogue rule's segment: the stores of ``root``'s cone (``lw.stores``: rotated q
    into its buffer, rotated k and v into the caches at ``pos``) computed from the accumulators of
    ``root``'s contractions.  The loop runs over the stores' space without the contraction's rows
    (the rows stay the kernel's outer loop); when an epilogue reads the accumulator at a partner
    row (RoPE's rotate-half reads row j +/- hd/2 of the head), rows j and j + h of the innermost dim
    run side by side, each read being one of the two rows' accumulators, siblings in one Reduce
    as gate and up are: every backend's GEMV mapping takes them unchanged.  Tries no pairing, then
    h = extent/2 down to 1 (``_pairings``); each read's column is checked over every loop value
    (``grid_value``).  Returns (the parallel loop, {buffer: stored Var}).  Raises
    ``Unfusable(root, cone=True)`` when no pairing works (the root then keeps its buffer)."""
    stores, contracts = lw.stores[root], lw.epi[root]
    space = _space(lw, stores[0])
    rows = contracts[0].shape[:-1]
    if any(_space(lw, f) != space for f in stores):
        raise Unfusable(root, cone=True)
    row_dims = _row_dims(lw, b, root, space, rows)
    cols = [d for d in range(len(space)) if d not in row_dims]
    if not cols:
        raise Unfusable(root, cone=True)
    for h in _pairings(space[cols[-1]]):
        try:
            return _paired_loop(lw, b, root, labels, act, k, K, space, row_dims, cols, h)
        except (_NoPairing, Unfusable):
            continue
    raise Unfusable(root, cone=True)


def _row_dims(lw, b, root, space, rows):
    """The dims of the stores' ``space`` that index the contraction's rows of extent > 1, in the
    rows' order: found by lowering the first store at one symbol per dim and reading where it reads
    the accumulator (the dim that steps the row by one)."""
    syms = tuple(L.Sym(fresh("s"), "i32") for _ in space)
    probe, reads = Builder(lw, b.row_idx), []
    for c in lw.epi[root]:
        probe.readers[c] = lambda idx: reads.append(idx) or L.Sym("probe", "f32")
    try:
        _store_target(lw, probe, lw.stores[root][0], syms)
    except Unfusable:
        raise Unfusable(root, cone=True)
    out = []
    for j, n in enumerate(rows):
        dims = [d for d, s in enumerate(syms) if reads and stride(reads[0][j], s) == 1 and space[d] == n]
        if n > 1 and len(dims) != 1:
            raise Unfusable(root, cone=True)
        out += dims[:1] if n > 1 else []
    return out


def _paired_loop(lw, b, root, labels, act, k, K, space, row_dims, cols, h):
    """``cone_segment`` for one pairing ``h`` (None: each row alone)."""
    contracts, stores = lw.epi[root], lw.stores[root]
    rows = contracts[0].shape[:-1]
    col_shape = tuple(space[d] for d in cols[:-1]) + (space[cols[-1]] // (2 if h else 1),)
    n = fresh("pair" if h else "n")
    p, P = L.Sym(n, "i32"), int(np.prod(col_shape, dtype=np.int64))
    comps = unravel(p, col_shape)
    q = comps[-1]                                   # row j of a pair: (q / h) * 2h + q % h; its partner j + h
    atoms = comps                                   # what a column is an affine function of
    lo = q
    if h and 2 * h < space[cols[-1]]:
        atoms = comps[:-1] + (L.Bin("idiv", q, L.c(h)), L.Bin("mod", q, L.c(h)))
        lo = L.add(L.mul(atoms[-2], L.c(2 * h)), atoms[-1])
    row_of = dict(zip(row_dims, [r for r, m in zip(b.row_idx, rows) if m > 1]))
    instances = []
    for last in [lo] + ([L.add(lo, L.c(h))] if h else []):
        it = iter(comps[:-1] + (last,))
        instances.append(tuple(row_of[d] if d in row_of else next(it) for d in range(len(space))))
    # the loop values the reads are checked at: every pair and every row; when that grid would be
    # large, the first, second and last row of each (then a concatenation is decided only by an
    # index free of the rows: ``decide``)
    ranges = {n: (0, P - 1), **{r.name: (0, m - 1) for r, m in zip(b.row_idx, rows)}}
    full = P * int(np.prod(rows, dtype=np.int64)) <= 1 << 18
    axes = [np.arange(P)] + [np.arange(m) if full else np.array(sorted({0, min(1, m - 1), m - 1})) for m in rows]
    mesh = [g.ravel() for g in np.meshgrid(*axes, indexing="ij")]
    env = {n: mesh[0], **{r.name: g for r, g in zip(b.row_idx, mesh[1:])}}
    decide = env if full else {n: np.arange(P)}
    columns = {}                                    # contraction -> [(its column's values, expression)]

    def column(c, idx):
        """Which of ``c``'s accumulators ``idx`` reads: the kernel's rows and a column seen before
        (a new one while there are fewer than the instances)."""
        for r, i in zip(b.row_idx, idx[:-1]):
            v = grid_value(i, env)
            if v is None or not np.array_equal(np.broadcast_to(v, mesh[0].shape), env[r.name]):
                raise _NoPairing()
        v = grid_value(idx[-1], env)
        if v is None:
            raise _NoPairing()
        v = np.broadcast_to(v, mesh[0].shape)
        seen = columns.setdefault(c, [])
        for j, (w, _) in enumerate(seen):
            if np.array_equal(w, v):
                return j
        if len(seen) == len(instances) or v.min() < 0 or v.max() >= c.shape[-1]:
            raise _NoPairing()
        seen.append((v, _affine(idx[-1], v, atoms, env, ranges)))
        return len(seen) - 1

    trial = Builder(lw, b.row_idx)                  # which columns the stores read, before building them
    trial.grid = decide
    for c in contracts:
        trial.readers[c] = lambda idx, c=c: (column(c, idx), L.Sym("probe", "f32"))[1]
    for idx in instances:
        for f in stores:
            _store_target(lw, trial, f, idx)
    accs, syms = [], {}                             # lowest column first: acc_wq_lo (row j), acc_wq_hi (j + h)
    for c in contracts:
        seen = columns.get(c, [])
        for rank, j in enumerate(sorted(range(len(seen)), key=lambda j: int(seen[j][0][0]))):
            syms[c, j] = L.Sym(fresh(f"acc_{labels[c]}{('_lo', '_hi')[rank] if len(seen) == 2 else ''}"), "f32")
            accs.append(accumulate(lw, b, c, syms[c, j].name, seen[j][1], act, k))
    b.grid = decide
    parts = tuple(r for r, m in zip(b.row_idx, rows) if m > 1) + atoms

    def index_form(e):
        """A load's index as an affine function of the rows and the pair's parts where it is one at
        every loop value (a bias read through RoPE's reshapes: ``bq[pair / 32 * 64 + pair % 32]``)."""
        v = grid_value(e, env) if full else None
        return e if v is None else _affine(e, np.broadcast_to(v, mesh[0].shape), parts, env, ranges)
    b.index_form = index_form
    for c in contracts:
        b.readers[c] = lambda idx, c=c: syms[c, column(c, idx)]
    body, outs = [], {}
    try:
        for idx in instances:
            for f in stores:
                buf, at, val = _store_target(lw, b, f, idx)
                body.append(L.Store(buf, at, val if val.dtype == f.dtype else L.Cast(val, f.dtype)))
                outs[buf] = f
    finally:
        b.grid, b.readers, b.index_form = None, {}, None
    order = access_order([a.value.b for a in accs], k, p) if K > 1 else "inner"
    red = L.Reduce(k.name, L.c(0), L.c(K), tuple(accs), order=order)
    return L.Loop(n, L.c(0), L.c(P), (red,) + tuple(body), parallel=True), outs


def _affine(e, v, comps, env, ranges):
    """Column ``e`` (its values ``v`` over the grid) written as ``c0 + sum(s_i * comps_i)`` of the
    loop's index components when that holds at every loop value (the weight row a person writes:
    ``pair / 32 * 64 + pair % 32 + 32``); else ``e`` folded."""
    vals = [np.broadcast_to(grid_value(x, env), v.shape) for x in comps]
    zero = np.all([x == 0 for x in vals], axis=0)
    if not zero.any():
        return fold_expr(e, ranges)
    c0 = int(v[zero][0])
    out, fit = L.c(0), np.full(v.shape, c0)
    for i, (x, xv) in enumerate(zip(comps, vals)):
        if isinstance(x, L.Const) or not xv.any():          # (q % 1 of an interleaved pairing: always 0)
            continue
        unit = (xv == 1) & np.all([w == 0 for j, w in enumerate(vals) if j != i], axis=0)
        if not unit.any():
            return fold_expr(e, ranges)
        s = int(v[unit][0]) - c0
        fit = fit + s * xv
        out = L.add(out, L.mul(x, L.c(s)))
    return L.add(out, L.c(c0)) if np.array_equal(fit, v) else fold_expr(e, ranges)


MATMUL_ROWS = 4             # a contraction of this many rows or more runs as a matmul (row tiles)
TILE_BYTES = 256 << 10      # a row tile's activation (f32) stays within this (L2 on the CPU)


def plan_switches() -> dict:
    """The environment switches that change a plan (part of the plan cache's key):
    ``VEGAFUSE_MATMUL=0`` keeps every contraction in the GEMV form; ``VEGAFUSE_MERGE_REDUCE=0``
    keeps sibling reductions in passes of their own (``codegen.simplify.merge_reductions``);
    ``VEGAFUSE_GATHER_KERNEL=0`` keeps a quantized table's gather inside the matmul that reads it
    (``fusion.partition._quantized_gathers``)."""
    return {"matmul": switch("VEGAFUSE_MATMUL", True),
            "merge_reduce": switch("VEGAFUSE_MERGE_REDUCE", True),
            "gather_kernel": switch("VEGAFUSE_GATHER_KERNEL", True)}


def row_tile(T: int, K: int) -> int:
    """Rows per tile of a T-row matmul over K: every row when they fit ``TILE_BYTES`` of f32
    activation (and 64 rows), else as few tiles as fit, of equal rows (a multiple of 4), so that the
    last tile computes few rows past T (T = 128 at K = 1536: 4 tiles of 32 rows, not 40 + 40 + 40 + 8)."""
    most = max(4, min(64, TILE_BYTES // (4 * K) // 4 * 4))
    if T <= most:
        return T
    tiles = -(-T // most)                  # as few tiles as fit, of equal rows: no tile mostly past T
    return -(-T // tiles) + 3 & ~3


def row_tiles(rv, rows, K, act, row_stmts, stmts):
    """The matmul family: a contraction of T >= ``MATMUL_ROWS`` rows over a 2-D activation as
    tiles of TR rows (``row_tile``), each a prologue of its TR rows into ``act[TR * K]`` and then,
    per output column n (parallel), the TR rows' dot products and epilogue stores::

        for row_tile in [0, ceil(T / TR)):
          f32 act[TR * K]; for r in [0, TR): row = row_tile * TR + r; [row scalars]; act[r * K + k] = prologue
          for parallel n in [0, N): for r in [0, TR): acc = sum_k act[r * K + k] * w[n, k]; out[row, n] = epilogue

    Each weight row is read once per tile (T / TR times in all, not T), and a backend tiles the
    (n, r) nest further (``codegen/llvm.py``'s ``micro_tiles``, ``codegen/mapping.py``'s ``_matmul_rows``).
    Rows past T (a last partial tile) read row T - 1 and store nothing.  None when the GEMV form
    stays: fewer rows, a batched activation, a (K, N) weight (order "outer") or an epilogue that
    reads a row scalar."""
    if len(rows) != 1 or rows[0] < MATMUL_ROWS or not plan_switches()["matmul"]:
        return None
    segs = [s for s in stmts if isinstance(s, L.Loop) and s.parallel]
    if any(r.order != "inner" for s in segs for r in s.body if isinstance(r, L.Reduce)):
        return None
    bound = set(L.local_names(row_stmts))
    if any(isinstance(x, L.Sym) and x.name in bound for s in segs for st in s.body[1:]
           for e in L.stmt_exprs(st) for x in L.walk_exprs(e)):
        return None
    T, (i,) = rows[0], rv
    TR = row_tile(T, K)
    tiles = -(-T // TR)
    rt, r = fresh("row_tile"), fresh("r")
    rsym = L.Sym(r, "i32")
    row = L.add(L.mul(L.Sym(rt, "i32"), L.c(TR)), rsym) if tiles > 1 else rsym
    at = L.Bin("min", row, L.c(T - 1)) if T % TR else row

    def tile(body):             # the row's index, and its slice of the activation
        body = L.substitute(body, {i: at})
        return L.rewrite(body, lambda e: L.rewrite_expr(e, lambda x: L.Load(act, L.add(L.mul(rsym, L.c(K)), x.index), x.dtype)
                                                        if isinstance(x, L.Load) and x.buf == act else None))
    out = []
    for s in stmts:
        if isinstance(s, L.Array) and s.name == act:
            out.append(L.Array(act, s.dtype, TR * K))
        elif isinstance(s, L.Loop) and not s.parallel:          # the prologue's fill
            fill = L.Loop(s.var, s.start, s.stop, tuple(L.Store(act, L.add(L.mul(rsym, L.c(K)), st.index), st.value)
                                                        for st in s.body))
            out.append(L.Loop(r, L.c(0), L.c(TR), tile(row_stmts + (fill,))))
        elif isinstance(s, L.Loop):
            red, *stores = tile(s.body)
            if T % TR:
                stores = [L.If(L.Bin("lt", row, L.c(T)), tuple(stores))]
            out.append(replace(s, body=(L.Loop(r, L.c(0), L.c(TR), (red, *stores)),)))
        else:
            out.append(s)
    if tiles == 1:
        return L.substitute(tuple(out), {rt: L.c(0)})
    return (L.Loop(rt, L.c(0), L.c(tiles), tuple(out)),)


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
    att = L.Attention(qn, kn, vn, out, (q.dtype, kc.dtype, vc.dtype), hq, hkv, t_len, s_len, d, p,
                      e.params["scale"])
    params = _params(lw, b, {out: r})
    flops = 4 * hq * t_len * d * s_len
    return L.Kernel(f"attention_{out}", "attention", params, section(out, b.ops) + (att,), _op_list(b), 0, flops)


def merge_loops(kernels):
    """Horizontal rule for loops: launch consecutive independent loop kernels as one."""
    out = []
    for k in kernels:
        prev = out[-1] if out else None
        if prev is not None and prev.family in ("elementwise", "scatter") and k.family in ("elementwise", "scatter") \
                and not single_thread(prev) and not single_thread(k):
            pw = {p.name for p in prev.params if p.role != "in"}
            pr = {p.name for p in prev.params if p.role != "out"}
            kw = {p.name for p in k.params if p.role != "in"}
            kr = {p.name for p in k.params if p.role != "out"}
            if not (pw & kr) and not (kw & pr) and not (pw & kw):
                params = {p.name: p for p in prev.params}
                for p in k.params:
                    params.setdefault(p.name, p)
                out[-1] = L.Kernel(f"{prev.name}__{k.name.split('_', 1)[1]}", "elementwise", tuple(params.values()),
                                   prev.body + k.body, prev.ops + k.ops, 0, prev.flops + k.flops)
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
    extra, refused = set(), set()
    while True:
        lw = Lowering(prog, rules, input_names, donated, materialize(g, rules) | extra, frozenset(refused))
        try:
            return _lower_all(lw)
        except Unfusable as u:
            done = refused if u.cone else extra
            if u.var in done:           # each retry must change the partition, or it would never end
                raise RuntimeError(f"fusion: {u.var} stays unfusable after it was "
                                   f"{'refused its stores' if u.cone else 'materialized'}") from u
            done.add(u.var)


def _lower_all(lw) -> Plan:
    items = lw.items()
    aliases = lw.alias_in_place(items)
    for r, o in aliases.items():
        lw.names[r] = lw.buffer_of(o)
    kernels = []
    for kind, a, roots in items:
        if kind == "contract":
            for r in roots:             # a cone's update of a buffer it may not overwrite: a copy first
                e = lw.g.producer[r]
                if e.prim.name in UPDATES and r not in aliases:
                    kernels.append(copy_kernel(lw, e.inputs[0], lw.buffer_of(r), r))
            kernels.append(contract_kernel(lw, a, roots))
            continue
        if kind == "loop":
            kernels.append(scan_kernel(lw, roots))
            continue
        (r,) = roots
        e = lw.g.producer[r]
        if e.prim.name in UPDATES:
            out = lw.buffer_of(r)
            if r not in aliases:
                kernels.append(copy_kernel(lw, e.inputs[0], out, r))
            kernels.append((scatter_kernel if e.prim.name == "dynamic_update_slice" else index_scatter_kernel)(lw, r, out))
        elif e.prim.kind == "opaque":
            kernels.append(attention_kernel(lw, r))
        elif e.prim.kind == "contract":
            kernels.append(contract_kernel(lw, e.inputs[0], [r]))
        else:
            kernels.append(root_kernel(lw, r))
    if "horizontal" in lw.rules:
        kernels = merge_loops(kernels)
    eqns = [sorted(set(k.ops), key=lw.g.order.get) for k in kernels]      # DSL ops, in program order
    for k, es, name in zip(kernels, eqns, kernel_names(kernels, eqns, lw.names)):
        k.name = name
        k.bytes = L.traffic(k)
        k.eqns = tuple(es)
        k.ops = tuple(describe(e) for e in es)
    buffers = {}
    for v, n in lw.names.items():
        buffers.setdefault(n, (tuple(v.shape), v.dtype))
    outputs = []
    for o in lw.prog.outputs:           # a view output names its base's buffer, with its own shape
        outputs.append(("lit", o.value, o.dtype) if isinstance(o, Lit) else
                       ("buf", lw.buffer_of(lw.g.views.get(o, o)), tuple(o.shape)))
    scalars = [lw.names[v] for v in lw.prog.inputs if is_scalar_param(v)]
    computed = {i: lw.names[e.out] for i, e in enumerate(lw.prog.eqns) if e.out in lw.names}
    return Plan(kernels, buffers, [lw.names[v] for v in lw.prog.inputs], outputs, scalars,
                {lw.buffer_of(r): lw.buffer_of(o) for r, o in aliases.items()}, lw.rules, computed)
