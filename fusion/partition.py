"""Partition a traced Program into kernels, by named rules.

Which values live in memory (are *materialized*) decides the partition: every
materialized value is the root of one kernel, and everything else is inlined as
an expression into the kernels that read it.  The rules below shrink the
materialized set; each can be switched off by name to measure it A/B.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsl.core import Var

RULES = {
    "elementwise": "chains of elementwise ops, views and gathers run as one loop",
    "reduce": "a reduction runs inside the kernel that consumes it, as a per-row scalar "
              "(RMSNorm and softmax are one kernel)",
    "prologue": "the activation operand of a GEMV/matmul is computed inside it (RMSNorm before Q/K/V)",
    "epilogue": "elementwise consumers of a GEMV/matmul run on its accumulator (bias, residual, SiLU*mul)",
    "dequantize": "a quantized weight is dequantized where it is read (inside the GEMV, the gather); "
                  "off: a kernel writes its float copy first",
    "paired_epilogue": "an epilogue also stores through views and into in-place updates, and reads the "
                       "accumulator of a partner row of the same block (RoPE's rotate-half: rows j and "
                       "j + hd/2 side by side), so RoPE and the KV-cache write run in the QKV GEMV",
    "horizontal": "sibling kernels launch as one: GEMVs sharing their input (Q/K/V, gate/up), "
                  "and independent loops (RoPE and KV-cache writes)",
}


def enabled_rules(overrides=None) -> frozenset:
    """All rules, minus those named in ``$VEGAFUSE_FUSION_OFF`` (comma-separated),
    then ``overrides`` ({rule: bool}) applied.  Unknown names raise ValueError."""
    on = set(RULES)
    env = [r.strip() for r in os.environ.get("VEGAFUSE_FUSION_OFF", "").split(",") if r.strip()]
    for name, val in [(r, False) for r in env] + list((overrides or {}).items()):
        if name not in RULES:
            where = f"VEGAFUSE_FUSION_OFF={os.environ['VEGAFUSE_FUSION_OFF']!r}: " if name in env else ""
            raise ValueError(f"{where}unknown fusion rule {name!r}; rules are: {', '.join(RULES)}")
        (on.add if val else on.discard)(name)
    return frozenset(on)


@dataclass
class Graph:
    prog: object
    producer: dict = field(default_factory=dict)     # Var -> Eqn
    users: dict = field(default_factory=dict)        # Var -> [Eqn]
    order: dict = field(default_factory=dict)        # Eqn -> index
    outputs: set = field(default_factory=set)        # values that leave the program in a buffer
    views: dict = field(default_factory=dict)        # output -> the computed value whose buffer it reuses

    @classmethod
    def of(cls, prog):
        g = cls(prog)
        for i, e in enumerate(prog.eqns):
            g.producer[e.out] = e
            g.order[e] = i
            for a in e.inputs:
                if isinstance(a, Var):
                    g.users.setdefault(a, []).append(e)
        for o in prog.outputs:
            base = view_base(g, o)
            if base is not None:
                g.views[o] = base
        g.outputs = {g.views.get(o, o) for o in prog.outputs if isinstance(o, Var)}
        return g

    def kind(self, v):
        e = self.producer.get(v)
        return None if e is None else e.prim.kind


def same_layout(e) -> bool:
    """Is view ``e`` its input's row-major buffer under another shape (a reshape, or a size-1
    axis added, dropped or moved)?"""
    x = e.inputs[0] if e.inputs else None
    if not isinstance(x, Var) or x.size != e.out.size:
        return False
    if e.prim.name == "reshape":
        return True
    if e.prim.name == "broadcast_in_dim":
        return list(e.params["dims"]) == sorted(e.params["dims"])
    if e.prim.name == "transpose":
        moved = [p for p in e.params["perm"] if x.shape[p] != 1]
        return moved == sorted(moved)
    return False


def view_base(g: Graph, v):
    """The computed value whose buffer program output ``v`` can reuse with ``v``'s shape (no kernel,
    no copy), through views that keep the layout; None when ``v`` is not such a view, or the
    chain ends at a program input or an in-place update (those buffers belong to the caller)."""
    base = v
    while isinstance(base, Var) and base in g.producer and same_layout(g.producer[base]):
        base = g.producer[base].inputs[0]
    e = g.producer.get(base)
    if base is v or e is None or e.prim.name in UPDATES:
        return None
    return base


UPDATES = ("dynamic_update_slice", "scatter")     # write into a copy of operand 0, or into it in place


def is_scalar_param(v):
    return isinstance(v, Var) and v.shape == () and v.dtype == "i32"


def materialize(g: Graph, rules) -> set:
    """The initial materialized set: inputs, outputs, anchors and operands that must be buffers."""
    m = set(g.prog.inputs) | set(g.outputs)
    for e in g.prog.eqns:
        kind, name = e.prim.kind, e.prim.name
        if kind in ("contract", "opaque") or name in UPDATES + ("optimization_barrier",) or (
                kind == "reduce" and "reduce" not in rules):
            m.add(e.out)
        if kind == "opaque":
            m.update(a for a in e.inputs if isinstance(a, Var) and not is_scalar_param(a))
        if kind == "loop":                      # a scan: its own kernel, reading and writing buffers;
            m.add(e.out)                        # initial carries and xs of scalars (fori_loop's index)
            nk, first_x = e.params["n_consts"], e.params["n_consts"] + e.params["n_carry"]   # are computed in it
            m.update(a for i, a in enumerate(e.inputs) if isinstance(a, Var) and (i < nk or i >= first_x and a.ndim > 1))
        if name in UPDATES and isinstance(e.inputs[0], Var):
            m.add(e.inputs[0])
        if "elementwise" not in rules and kind in ("elementwise", "index") and e.out.shape != ():
            m.add(e.out)
        if "dequantize" not in rules and name == "dequantize":
            m.add(e.out)
        if "prologue" not in rules and kind == "contract" and isinstance(e.inputs[0], Var):
            m.add(e.inputs[0])
        if "reduce" not in rules and kind == "reduce" and isinstance(e.inputs[0], Var):
            m.add(e.inputs[0])
        if kind == "contract" and isinstance(e.inputs[0], Var):
            m.update(_quantized_gathers(g, e.inputs[0]))
    return m


def _quantized_gathers(g: Graph, act) -> set:
    """The gathers from a quantized table (``take`` of a ``dequantize``: an embedding lookup) that
    the activation ``act`` of a matmul (``MATMUL_ROWS`` rows or more) is computed from: they are
    materialized, one small kernel of T x D values, so that the matmul's row tiles read floats.
    Each element dequantized inside a tile's load took a scale and a byte apart; on gfx906 the
    first layer's QKV matmul of a 512-token prefill spilled (256 VGPRs and 96 bytes of scratch,
    against 110 and none for the later layers).  A GEMV (decode) keeps its gather, and so does
    a matmul with ``VEGAFUSE_GATHER_KERNEL=0`` (A/B)."""
    from .schedule import MATMUL_ROWS, plan_switches
    if act.ndim != 2 or act.shape[0] < MATMUL_ROWS or not plan_switches()["gather_kernel"]:
        return set()
    out, seen, todo = set(), set(), [act]
    while todo:
        v = todo.pop()
        e = g.producer.get(v)
        if v in seen or e is None or e.prim.kind in ("contract", "opaque", "loop"):
            continue
        seen.add(v)
        src = g.producer.get(e.inputs[0]) if e.prim.name == "take" and isinstance(e.inputs[0], Var) else None
        if src is not None and src.prim.name == "dequantize":
            out.add(v)
            continue
        todo += [a for a in e.inputs if isinstance(a, Var)]
    return out


MAX_INLINE_DEPTH = 48       # ops inlined into one expression; deeper chains are split into kernels
MAX_INLINE_SIZE = 256       # ops in one inlined expression tree, a shared value counted at each use:
                            # bounds the doubling of `x = x * sigmoid(x)` chains (compile time, code size)
MAX_SHARED_LOADS = 4        # distinct buffers a value read in several kernels may load when inlined: past
                            # it, storing it once is cheaper than re-reading its inputs in every reader's kernel


def cap_depth(g: Graph, m: set, epilogues=()) -> set:
    """Materialize every value whose inlined expression would be more than ``MAX_INLINE_DEPTH``
    ops deep or hold more than ``MAX_INLINE_SIZE`` ops (shared values repeat), so lowering, Loop IR
    and the renderers stay shallow for chains of any length (and each kernel's expression stays a
    size a compiler handles quickly).  A value read by several ops whose expression, repeated at
    each read, would pass ``MAX_INLINE_SIZE`` is materialized where it is computed: cut further
    down, each reader's kernel would recompute it, reductions and all.  A reduction counts as one
    op in its readers' expressions: it is a statement of its own, computed once per row of the
    kernel that reads it (``fusion.lower.Builder.row_scalar``), so sibling reductions stay one pass
    over the row.  A value read in several kernels (``_read_in_kernels``) whose expression loads
    more than ``MAX_SHARED_LOADS`` distinct buffers is materialized too: with the epilogue rule
    off, the residual stream ``x = x + attn(x) + mlp(x)`` would otherwise be re-added from every
    earlier layer's outputs in each later layer's kernels (quadratic in depth; the last layers'
    matmuls spilled).  Values of an epilogue region (``epilogues``, at most
    ``MAX_INLINE_DEPTH // 2`` each) stay inlined.  Updates ``m``."""
    depth, size, loads = {}, {}, {}
    shared = _read_in_kernels(g, m)
    own = lambda v: frozenset((v,)) if v.size > 1 else frozenset()     # noqa: E731  (one element: no load)
    for e in g.prog.eqns:
        ins = [a for a in e.inputs if isinstance(a, Var)]
        d = 1 + max((depth.get(a, 0) for a in ins), default=0)
        n = 1 + sum(size.get(a, 0) for a in ins)
        ld = frozenset()            # the distinct buffers the inlined expression reads; None: past the cap
        for a in ins:
            la = loads.get(a, own(a))
            ld = None if la is None or ld is None or len(ld | la) > MAX_SHARED_LOADS else ld | la
        reduce = e.prim.kind == "reduce"
        repeated = not reduce and len(g.users.get(e.out, ())) * n
        if e.out in m or e.out in epilogues:
            d, n, ld = 0, 0, own(e.out)
        elif (d > MAX_INLINE_DEPTH or n > MAX_INLINE_SIZE or repeated > MAX_INLINE_SIZE
              or not reduce and ld is None and e.out in shared):
            m.add(e.out)
            d, n, ld = 0, 0, own(e.out)
        depth[e.out], size[e.out], loads[e.out] = d, 1 if reduce and n else n, ld
    return m


def _read_in_kernels(g: Graph, m: set) -> set:
    """The inlined values (not in ``m``) whose readers land in more than one kernel: each kernel
    is named by the materialized value it computes, found through the readers' own inlined
    readers; sibling contractions reading a value as their activation count as one kernel
    (the horizontal rule launches them together)."""
    many, kernel = object(), {}
    for e in reversed(g.prog.eqns):
        v = e.out
        if v in m:
            continue
        ks = {("act", v) if u.prim.kind == "contract" and u.inputs[0] is v else
              u.out if u.out in m else kernel.get(u.out, many) for u in g.users.get(v, ())}
        kernel[v] = ks.pop() if len(ks) == 1 else many if ks else None
    return {v for v, k in kernel.items() if k is many}


def _tree_size(g: Graph, v, region) -> int:
    """Ops in ``v``'s expression with the values of ``region`` inlined (a shared one at each use)."""
    memo = {}

    def size(x):
        if x not in memo:
            memo[x] = 1 + sum(size(a) for a in g.producer[x].inputs if isinstance(a, Var) and a in region)
        return memo[x]
    return size(v)


def _depends_on(g: Graph, v, region, memo):
    """Does ``v`` read (through any chain of producers) a value of ``region``?  Iterative."""
    if not isinstance(v, Var):
        return False
    stack = [v]
    while stack:
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        if x in region:
            memo[x] = True
            stack.pop()
            continue
        e = g.producer.get(x)
        ins = [a for a in e.inputs if isinstance(a, Var)] if e is not None else []
        todo = [a for a in ins if a not in memo and a not in region]
        if todo:
            stack += todo
            continue
        memo[x] = any(a in region or memo[a] for a in ins)
        stack.pop()
    return memo[v]


def _sibling(g, c, v):
    """Is ``v`` a contraction with the same activation operand and shape as ``c``?"""
    e, ce = g.producer.get(v), g.producer[c]
    return (e is not None and e.prim.kind == "contract" and e.inputs[0] is ce.inputs[0]
            and e.params == ce.params and v.shape == c.shape and v not in g.outputs)


def epilogue_region(g: Graph, c: Var):
    """Grow the elementwise region that consumes contraction ``c`` at its own index.

    Returns (root, contracts): the single value of the region read outside it, and the
    contractions (``c`` and same-input siblings, e.g. gate and up) it holds.
    """
    region, contracts = {c}, [c]
    later = [e for e in g.prog.eqns if g.order[e] > g.order[g.producer[c]]]
    grown = True
    while grown:
        grown = False
        for e in later:
            if e.out in region or e.prim.kind != "elementwise" or e.out.shape != c.shape:
                continue
            if len(region) >= MAX_INLINE_DEPTH // 2:    # keeps the epilogue expression shallow
                break
            if not any(a in region for a in e.inputs if isinstance(a, Var)):
                continue
            memo, new = {}, []
            for a in e.inputs:
                if not isinstance(a, Var) or a in region:
                    continue
                if _sibling(g, c, a) and a not in contracts:
                    new.append(a)
                elif _depends_on(g, a, region, memo):
                    break
            else:
                if _tree_size(g, e.out, region | set(new)) > MAX_INLINE_SIZE:
                    continue
                region.add(e.out)
                region.update(new)
                contracts += new
                grown = True

    def outs(reg):
        return [v for v in reg if v in g.outputs
                or any(u.out not in reg for u in g.users.get(v, []))]

    # prune the latest elementwise values until one value leaves the region
    while len(outs(region)) > 1:
        latest = max((v for v in region if v not in contracts), key=lambda v: g.order[g.producer[v]], default=None)
        if latest is None:
            break
        region.discard(latest)
        changed = True
        while changed:               # drop what no longer connects, and unused siblings
            changed = False
            for v in list(region):
                if v is c:
                    continue
                e = g.producer[v]
                if v in contracts:
                    if not any(u.out in region for u in g.users.get(v, [])):
                        region.discard(v), contracts.remove(v)
                        changed = True
                elif any(isinstance(a, Var) and a not in region and _depends_on(g, a, region - {a}, {})
                         for a in e.inputs):
                    region.discard(v)
                    changed = True
    out = outs(region)
    if len(out) != 1:
        return c, [c], {c}
    return out[0], contracts, region


def plan_epilogues(g: Graph, m: set, rules) -> dict:
    """Apply the epilogue rule: {root: [contractions fused under it]}; updates ``m``, then caps
    the depth of inlined expressions (``cap_depth``)."""
    epi, taken, claimed = {}, set(), set()
    for e in g.prog.eqns:
        c = e.out
        if e.prim.kind != "contract" or c in taken:
            continue
        if "epilogue" not in rules or c in g.outputs:
            epi[c] = [c]
            taken.add(c)
            continue
        root, contracts, region = epilogue_region(g, c)
        if any(x in taken for x in contracts) or region & claimed:     # a value has one epilogue
            root, contracts, region = c, [c], {c}
        claimed |= region
        for x in region:
            if x is not root:
                m.discard(x)
        taken.update(contracts)
        m.add(root)
        epi[root] = contracts
    cap_depth(g, m, claimed)            # after the epilogues: their roots cut the residual stream
    return epi



def _computes(g: Graph, v, m, kind) -> bool:
    """Does the expression inlined for ``v`` (up to materialized values) hold an op of ``kind``?"""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x in seen or x in m or x not in g.producer:
            continue
        seen.add(x)
        if g.producer[x].prim.kind == kind:
            return True
        stack += [a for a in g.producer[x].inputs if isinstance(a, Var)]
    return False


CONE_KINDS = ("elementwise", "view")        # what an epilogue cone computes (no gather, reduction, contraction)


def plan_stores(g: Graph, m: set, epi: dict, rules, refused=frozenset()) -> dict:
    """Apply the paired_epilogue rule: {epilogue root R: the materialized values its kernel stores
    instead of R}.  R's users are followed through elementwise ops and views (RoPE: reshape,
    transpose, the rotate-half's slices and concatenate, cos/sin) up to the first materialized
    values, the *stores*: a ``dynamic_update_slice`` whose update comes from R (the KV-cache write,
    in place when donated) or an elementwise/view value (rotated q, read by attention).  Taken
    only when every value on the way is read by nothing else, so R itself needs no buffer; R then
    leaves ``m`` (updated) and its contraction's epilogue computes the stores, the accumulator
    read at whatever rows they need (``schedule.cone_segment``).  ``refused``: roots whose cone
    failed to lower (``Unfusable(R, cone=True)``)."""
    if "paired_epilogue" not in rules or "epilogue" not in rules:
        return {}
    out, claimed = {}, set()
    for r in epi:
        if r in g.outputs or r in refused or r not in m:
            continue
        cone, stores, ok, todo = set(), [], True, [r]
        while todo and ok:
            v = todo.pop()
            for u in g.users.get(v, []):
                x = u.out
                if x in cone or x in stores:
                    continue
                if x in m:
                    upd = u.prim.name == "dynamic_update_slice" and u.inputs[1] is v and all(
                        a is not v for i, a in enumerate(u.inputs) if i != 1)
                    ok = ok and (upd or u.prim.kind in CONE_KINDS)
                    stores.append(x)
                elif u.prim.kind in CONE_KINDS:
                    cone.add(x)
                    todo.append(x)
                else:
                    ok = False
        inlined = {a for x in cone | set(stores) for a in g.producer[x].inputs
                   if isinstance(a, Var) and a not in cone and a is not r and a not in m}
        ok = ok and not any(_computes(g, a, m, "contract") for a in inlined)    # another GEMV's epilogue
        if ok and stores and not (cone | set(stores)) & claimed:
            claimed |= cone | set(stores)
            out[r] = stores
            m.discard(r)
    return out
