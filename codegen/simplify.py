"""Simplify a Loop IR kernel: ``simplify(kernel) -> kernel``, the same computation, less noise.

Four steps, each a short function over the IR:

1. ``fold``: constants fold and index arithmetic simplifies by the rules in ``RULES``
   (``x + 0``, ``x * 1``, ``min(c1, c2)``, ``(a * c) / c``, ``x % n`` when ``x`` is known to lie
   in [0, n), a clamp whose operand already lies inside it ...).  What an i32 expression can be
   is known from the bounds of the loops around it (``value_range``).  Loops that run once
   become their body (the variable replaced by the start value); loops that never run go.
2. ``hoist``: pure expressions that do not depend on a loop's variable, nor on anything written
   inside the loop, are computed once before it, into a ``Declare``d local.
3. ``share``: a load, clamp, math call, index split (``x / n``, ``x % n``) or condition repeated
   in one statement or across consecutive statements of one block is computed once, into a
   local named after what it holds, when nothing in between writes what it reads.
4. identical locals declared in one block, with nothing in between writing what they read,
   become one.
5. ``merge_reductions`` (kernels of the reduce and loop families): adjacent reductions over the
   same range, the second not reading the first's accumulators, become one pass with both
   accumulators (``sum(x)`` and ``sum(x * x)`` read x once).  ``VEGAFUSE_MERGE_REDUCE=0`` keeps them apart.

The passes rebuild nodes generically (``dataclasses.fields``/``replace``): statement and
expression kinds added to ``codegen/loopir.py`` are traversed without changes here (their
expressions fold; the names they hold count as written).  What is never done: a loop with a
hardware mapping (``map``, ``split``) is never inlined; a parallel loop is never removed; a
load never becomes unconditional (it moves only out of a loop that surely runs, from code
that surely runs in it: not from a ``Select`` arm, an ``If`` body or a ``Reduce``'s values),
and only from buffers the kernel never writes; a loop whose body is only accumulator updates
keeps that shape.
"""
from __future__ import annotations

import re
from dataclasses import MISSING, fields, is_dataclass, replace
from typing import get_args

from . import loopir as L
from .env import switch

I32_MIN, I32_MAX = -2 ** 31, 2 ** 31 - 1
FULL = (I32_MIN, I32_MAX)
CMP_OPS = ("lt", "le", "gt", "ge", "eq", "ne")      # the comparisons value ranges can decide


# ------------------------------------------------------------------------------ generic traversal
_PURE = (L.Const, L.Sym, L.Load, L.Un, L.Bin, L.Select, L.Cast)    # what may move or be shared
_KINDS = {}                          # node class -> ("expr" | "stmt" | None, its field names)


def _kind(x):
    cls = type(x)
    if cls not in _KINDS:
        if not is_dataclass(cls):
            _KINDS[cls] = (None, ())
        else:
            names = tuple(f.name for f in fields(cls))
            expr = "dtype" in names or hasattr(cls, "dtype")
            _KINDS[cls] = ("stmt" if issubclass(cls, get_args(L.Stmt)) or not expr else "expr", names)
    return _KINDS[cls]


def is_stmt(x) -> bool:
    """A statement node: one of ``loopir.Stmt``, or a dataclass without a dtype."""
    return _kind(x)[0] == "stmt"


def is_expr(x) -> bool:
    """An expression node: a dataclass with a dtype that is not a statement."""
    return _kind(x)[0] == "expr"


def _is_block(v) -> bool:
    """A tuple of statements (an unknown node kind inside one counts as a statement)."""
    return isinstance(v, tuple) and bool(v) and all(_kind(x)[0] for x in v) and any(is_stmt(x) for x in v)


def _values(node):
    return ((n, getattr(node, n)) for n in _kind(node)[1])


def map_node(node, fe, fb):
    """``node`` with each expression field rebuilt by ``fe`` and each nested block by ``fb``."""
    new = {}
    for name, v in _values(node):
        if is_expr(v):
            nv = fe(v)
        elif _is_block(v):
            nv = fb(v)
        elif isinstance(v, tuple) and v and all(is_expr(x) for x in v):
            nv = tuple(fe(x) for x in v)
        else:
            continue
        if nv is not v and nv != v:
            new[name] = nv
    return replace(node, **new) if new else node


def exprs_of(node):
    """The expression fields of a statement (not those of nested blocks)."""
    out = []
    for _, v in _values(node):
        if is_expr(v):
            out.append(v)
        elif isinstance(v, tuple) and v and all(is_expr(x) for x in v):
            out += list(v)
    return out


def blocks_of(node):
    return [v for _, v in _values(node) if _is_block(v)]


def subexprs(e):
    """``e`` and every sub-expression, parents first."""
    yield e
    for _, v in _values(e):
        if is_expr(v):
            yield from subexprs(v)


def substitute(e, old, new):
    """``e`` with every occurrence of expression ``old`` replaced by ``new``."""
    if e == old:
        return new
    return map_node(e, lambda x: substitute(x, old, new), lambda b: b)


def _strings(node) -> set:
    """Every string a statement holds, with those of the nodes inside it that are not pure
    expressions (a ``Reduce``'s accumulators): the names it may define or write."""
    out = set()
    for _, v in _values(node):
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, str):
                out.add(x)
            elif is_dataclass(x) and not isinstance(x, _PURE):
                out |= _strings(x)
    return out


def names_written(body) -> set:
    """Every name a block may write or define: locals, loop variables, accumulators, buffers,
    arrays (conservatively, every string its statements hold)."""
    return set().union(*(_strings(s) for s in body))


def names_read(e) -> set:
    return {x.name if isinstance(x, L.Sym) else x.buf for x in subexprs(e) if isinstance(x, (L.Sym, L.Load))}


def all_names(k) -> set:
    """Names taken in a kernel: parameters, and everything its statements define or read."""
    names = {p.name for p in k.params}

    def visit(body):
        for s in body:
            names.update(_strings(s))
            for e in exprs_of(s):
                names.update(x for y in subexprs(e) for x in (names_read(y) if isinstance(y, _PURE) else ()))
            for b in blocks_of(s):
                visit(b)
    visit(k.body)
    return names


# ------------------------------------------------------------------------------ value ranges
def value_range(e, env):
    """(lo, hi) bounds of an i32 expression (None for other dtypes); ``env`` maps loop variables
    to theirs.  Unknown values (scalar parameters, loads) span the whole i32 range."""
    if getattr(e, "dtype", None) != "i32":
        return None
    if isinstance(e, L.Const):
        return (int(e.value), int(e.value))
    if isinstance(e, L.Sym):
        return env.get(e.name, FULL)
    if isinstance(e, L.Select):
        a, b = value_range(e.a, env) or FULL, value_range(e.b, env) or FULL
        return (min(a[0], b[0]), max(a[1], b[1]))
    if not isinstance(e, L.Bin):
        return FULL
    a, b = value_range(e.a, env) or FULL, value_range(e.b, env) or FULL
    if e.op == "add":
        r = (a[0] + b[0], a[1] + b[1])
    elif e.op == "sub":
        r = (a[0] - b[1], a[1] - b[0])
    elif e.op == "mul":
        p = [x * y for x in a for y in b]
        r = (min(p), max(p))
    elif e.op in ("min", "max"):
        f = min if e.op == "min" else max
        r = (f(a[0], b[0]), f(a[1], b[1]))
    elif e.op == "idiv" and b[0] == b[1] and b[0] > 0 and a[0] >= 0:
        r = (a[0] // b[0], a[1] // b[0])
    elif e.op == "mod" and b[0] == b[1] and b[0] > 0 and a[0] >= 0:
        r = (0, min(a[1], b[0] - 1)) if a[1] >= b[0] else a
    else:
        return FULL
    return r if I32_MIN <= r[0] and r[1] <= I32_MAX else FULL


# ------------------------------------------------------------------------------ rewrite rules
def _const(e, v=None):
    return isinstance(e, L.Const) and (v is None or e.value == v)


def _int(e):
    return getattr(e, "dtype", None) in ("i32", "bool")


def _fold_const(e):
    """A Bin/Un/Select/Cast of constants, for i32 and bool (C semantics: truncating division)."""
    if isinstance(e, L.Bin) and _const(e.a) and _const(e.b) and _int(e.a):
        a, b = int(e.a.value), int(e.b.value)
        if e.op in ("idiv", "mod") and b == 0:
            return None
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1) if b else 0
        v = {"add": a + b, "sub": a - b, "mul": a * b, "max": max(a, b), "min": min(a, b),
             "idiv": q, "mod": a - q * b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b,
             "eq": a == b, "ne": a != b, "and": bool(a and b), "or": bool(a or b)}.get(e.op)
        if v is None or (e.dtype == "i32" and not I32_MIN <= v <= I32_MAX):
            return None
        return L.Const(bool(v) if e.dtype == "bool" else int(v), e.dtype)
    if isinstance(e, L.Select) and _const(e.cond):
        return e.a if e.cond.value else e.b
    if isinstance(e, L.Select) and e.dtype == "bool" and _const(e.a, True) and _const(e.b, False):
        return e.cond                                                  # c ? true : false
    if isinstance(e, L.Cast) and e.x.dtype == e.dtype:
        return e.x
    if isinstance(e, L.Cast) and _const(e.x) and _int(e.x) and e.dtype in L.FLOAT_DTYPES:
        return L.Const(float(e.x.value), e.dtype)
    return None


def _identity(e):
    """x + 0, 0 + x, x - 0, x * 1, 1 * x, 0 * x, x / 1, x % 1, (x / n) * n + x % n (i32);
    a + (b + c) and (x + c1) + c2 with the constants last, as ``x + c`` or ``x - c`` (c > 0)."""
    if not isinstance(e, L.Bin) or e.dtype != "i32":
        return None
    a, b, op = e.a, e.b, e.op
    if op == "add" and _const(a, 0) or op == "mul" and _const(a, 1):
        return b
    if op in ("add", "sub") and _const(b, 0) or op in ("mul", "idiv") and _const(b, 1):
        return a
    if op == "mul" and (_const(a, 0) or _const(b, 0)) or op == "mod" and _const(b, 1):
        return L.Const(0, "i32")
    if op == "add" and isinstance(a, L.Bin) and a.op == "mul" and isinstance(a.a, L.Bin) and a.a.op == "idiv" \
            and isinstance(b, L.Bin) and b.op == "mod" and a.a.a == b.a and _const(b.b) and a.b == a.a.b == b.b:
        return b.a                                                    # (x / n) * n + x % n
    if op == "add" and isinstance(b, L.Bin) and b.op in ("add", "sub") and _const(b.b) and not _const(a):
        return L.Bin(b.op, L.Bin("add", a, b.a), b.b)                # a + (b + c) -> (a + b) + c
    if op in ("add", "sub") and _const(b):                            # x + c1 + c2 -> x + c, x + -c -> x - c
        x, c = _offset(e)
        out = x if c == 0 else L.Bin("add" if c > 0 else "sub", x, L.Const(abs(c), "i32"))
        return out if out != e else None
    return None


def _offset(e):
    """(x, c) with ``e`` = x + c, folding nested constant offsets."""
    if isinstance(e, L.Bin) and e.op in ("add", "sub") and _const(e.b) and e.dtype == "i32":
        x, c = _offset(e.a)
        return x, c + (e.b.value if e.op == "add" else -e.b.value)
    return e, 0


def _by_range(e, env):
    """Rules that need what operands can be: min/max of ordered ranges (clamps that cannot
    clamp), x / n and x % n for x in [0, n), (a*n + b) / n and % n for b in [0, n),
    (a*m*n + b) / n = a*m + b / n and (a*m*n + b) % n = b % n for a*m*n, b >= 0 (C's division
    truncates: only where nothing is negative), x % (m*n) % n = x % n, comparisons decided by ranges."""
    if not isinstance(e, L.Bin) or e.a.dtype != "i32":
        return None
    ra, rb = value_range(e.a, env), value_range(e.b, env)
    if e.op in ("min", "max") and ra and rb:
        if ra[1] <= rb[0]:
            return e.a if e.op == "min" else e.b
        if rb[1] <= ra[0]:
            return e.b if e.op == "min" else e.a
    if e.op in ("idiv", "mod") and _const(e.b) and e.b.value > 0:
        n = e.b.value
        if e.op == "mod" and isinstance(e.a, L.Bin) and e.a.op == "mod" and _const(e.a.b) and e.a.b.value % n == 0:
            return L.Bin("mod", e.a.a, e.b)                                    # x % (m n) % n, any sign
        if ra and 0 <= ra[0] and ra[1] < n:
            return L.Const(0, "i32") if e.op == "idiv" else e.a
        if isinstance(e.a, L.Bin) and e.a.op == "mul" and _const(e.a.b, n):
            return e.a.a if e.op == "idiv" else L.Const(0, "i32")               # (a * n) / n, exact
        if isinstance(e.a, L.Bin) and e.a.op == "add" and isinstance(e.a.a, L.Bin) and e.a.a.op == "mul" \
                and _const(e.a.a.b, n):
            rm, rr = value_range(e.a.a, env), value_range(e.a.b, env)
            if rm and rr and rm[0] >= 0 and 0 <= rr[0] and rr[1] < n:          # (a * n + b) / n
                return e.a.a.a if e.op == "idiv" else e.a.b
        if isinstance(e.a, L.Bin) and e.a.op == "add" and isinstance(e.a.a, L.Bin) and e.a.a.op == "mul" \
                and _const(e.a.a.b) and e.a.a.b.value % n == 0:
            rm, rr = value_range(e.a.a, env), value_range(e.a.b, env)
            if rm and rr and rm[0] >= 0 and rr[0] >= 0:                        # (a * m n + b) / n, b >= 0
                if e.op == "mod":
                    return L.Bin("mod", e.a.b, e.b)
                return L.add(L.mul(e.a.a.a, L.Const(e.a.a.b.value // n, "i32")), L.Bin("idiv", e.a.b, e.b))
    if e.op in CMP_OPS and ra and rb:
        always = {"lt": ra[1] < rb[0], "le": ra[1] <= rb[0], "gt": ra[0] > rb[1], "ge": ra[0] >= rb[1],
                  "eq": ra[0] == ra[1] == rb[0] == rb[1], "ne": ra[1] < rb[0] or rb[1] < ra[0]}[e.op]
        never = {"lt": ra[0] >= rb[1], "le": ra[0] > rb[1], "gt": ra[1] <= rb[0], "ge": ra[1] < rb[0],
                 "eq": ra[1] < rb[0] or rb[1] < ra[0], "ne": ra[0] == ra[1] == rb[0] == rb[1]}[e.op]
        if always or never:
            return L.Const(bool(always), "bool")
    return None


def _logic(e):
    """x && true, true && x, x || false, false || x -> x; x && false -> false; x || true -> true."""
    if not isinstance(e, L.Bin) or e.op not in ("and", "or") or e.dtype != "bool":
        return None
    for x, c in ((e.a, e.b), (e.b, e.a)):
        if _const(c):
            return x if bool(c.value) == (e.op == "and") else c
    return None


RULES = (                           # (name, rule(expr, env) -> simpler expr or None)
    ("fold constants", lambda e, env: _fold_const(e)),
    ("identities", lambda e, env: _identity(e)),
    ("logic", lambda e, env: _logic(e)),
    ("ranges", _by_range),
)


def fold_expr(e, env):
    """``e`` simplified bottom-up by ``RULES`` until none applies."""
    e = map_node(e, lambda x: fold_expr(x, env), lambda b: b)
    for _, rule in RULES:
        r = rule(e, env)
        if r is not None and r != e:
            return fold_expr(r, env)
    return e


# ------------------------------------------------------------------------------ 1. fold
_LOOP_CORE = ("var", "start", "stop", "body", "parallel")


def _loop_extras_default(s) -> bool:
    """Only ``var, start, stop, body, parallel``: no hardware mapping recorded on the loop."""
    return all(f.name in _LOOP_CORE or (f.default is not MISSING and getattr(s, f.name) == f.default)
               for f in fields(s))


def _subst_block(body, var, value):
    """A block with loop variable ``var`` replaced by ``value`` (stops where a loop rebinds it)."""
    sym = L.Sym(var, "i32")

    def stmt(s):
        if isinstance(s, L.Loop) and s.var == var:
            return replace(s, start=substitute(s.start, sym, value), stop=substitute(s.stop, sym, value))
        return map_node(s, lambda e: substitute(e, sym, value), lambda b: tuple(stmt(x) for x in b))
    return tuple(stmt(s) for s in body)


def fold(body, env):
    """Fold every expression; drop zero-trip loops, inline one-trip loops, drop empty loops."""
    out = []
    for s in body:
        if isinstance(s, L.Loop):
            start, stop = fold_expr(s.start, env), fold_expr(s.stop, env)
            r0, r1 = value_range(start, env), value_range(stop, env)
            if r1[1] <= r0[0]:
                continue                                               # never runs
            inline = not s.parallel and _loop_extras_default(s)
            if inline and (fold_expr(L.Bin("sub", stop, start), env) == L.Const(1, "i32")):
                out += fold(_subst_block(s.body, s.var, start), env)    # runs once
                continue
            body2 = fold(s.body, dict(env, **{s.var: (r0[0], r1[1] - 1)}))
            if not body2 and _loop_extras_default(s):
                continue
            out.append(replace(s, start=start, stop=stop, body=body2))
        elif isinstance(s, L.Reduce):          # its values see the reduction variable's range
            start, stop = fold_expr(s.start, env), fold_expr(s.stop, env)
            r0, r1 = value_range(start, env), value_range(stop, env)
            inner = dict(env, **{s.var: (r0[0], r1[1] - 1)})
            out.append(replace(map_node(s, lambda e: fold_expr(e, inner), lambda b: b), start=start, stop=stop))
        else:
            out.append(map_node(s, lambda e: fold_expr(e, env), lambda b: fold(b, env)))
    return tuple(out)


# ------------------------------------------------------------------------------ naming locals
def _leaf(e):
    for x in subexprs(e):
        if isinstance(x, L.Load):
            return re.sub(r"^params_", "", x.buf)
        if isinstance(x, L.Sym):
            return re.sub(r"_\d+$", "", x.name) or x.name          # without the lowering's counter
    return "c"


def _is_clamp(e):
    """``max(lo, min(x, hi))``."""
    return isinstance(e, L.Bin) and e.op == "max" and isinstance(e.b, L.Bin) and e.b.op == "min"


def local_name(e, taken):
    """A fresh local named after what ``e`` holds: ``tokens_clamped``, ``rsqrt_acc4``, ``wq_v``."""
    if _is_clamp(e):
        base = f"{_leaf(e)}_clamped"
    elif isinstance(e, L.Un):
        base = f"{e.op}_{_leaf(e)}"
    elif isinstance(e, L.Load) or isinstance(e, L.Cast) and isinstance(e.x, L.Load):
        base = f"{_leaf(e)}_v"
    elif isinstance(e, L.Bin) and e.op in ("idiv", "mod") and _const(e.b):
        base = f"{_leaf(e)}_{'div' if e.op == 'idiv' else 'mod'}{e.b.value}"
    elif isinstance(e, L.Bin) and e.op in CMP_OPS and _const(e.b):
        base = f"{_leaf(e)}_{e.op}{e.b.value}"
    elif e.dtype == "i32":
        base = f"{_leaf(e)}_idx"
    else:
        base = f"{getattr(e, 'op', 'v')}_{_leaf(e)}"
    base = re.sub(r"[^A-Za-z0-9_]", "_", base)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


# ------------------------------------------------------------------------------ 2. hoist
def _movable(e, fixed, readonly, may_fault):
    """Pure, reads nothing in ``fixed`` (names written in the loop), loads only read-only buffers,
    divides only by nonzero constants; with ``may_fault`` False, no loads at all."""
    for x in subexprs(e):
        if not isinstance(x, _PURE) or isinstance(x, L.Sym) and x.name in fixed:
            return False
        if isinstance(x, L.Load) and (x.buf in fixed or x.buf not in readonly or not may_fault):
            return False
        if isinstance(x, L.Bin) and x.op in ("idiv", "mod") and not (_const(x.b) and x.b.value != 0):
            return False
    return True


def _worth(e):
    """Worth a local: it loads, clamps, calls a math function, or computes in floating point."""
    if isinstance(e, (L.Const, L.Sym)) or isinstance(e, L.Cast) and isinstance(e.x, (L.Const, L.Sym)):
        return False
    return any(isinstance(x, (L.Load, L.Un)) or isinstance(x, L.Bin) and x.dtype in L.FLOAT_DTYPES or _is_clamp(x)
               for x in subexprs(e))


def _invariants(e, ok, out, may_fault, cond=False):
    """Maximal sub-expressions of ``e`` that ``ok(x, may_fault)`` accepts and that are worth a
    local; loads only where ``e`` is surely evaluated and outside Select arms."""
    if ok(e, may_fault and not cond) and _worth(e):
        if e not in out:
            out.append(e)
        return
    for name, v in _values(e):
        if is_expr(v):
            _invariants(v, ok, out, may_fault, cond or isinstance(e, L.Select) and name in ("a", "b"))


def _loop_exprs(body, env, sure=True):
    """(expression, always evaluated when the block runs) for every expression in a block:
    a nested loop's body counts only if the loop runs at least once; the bodies of other
    statements (``If``, a ``Reduce``'s values, kinds unknown here) never do."""
    for s in body:
        plain = isinstance(s, (L.Loop, L.Declare, L.Assign, L.Store, L.Array))
        for e in exprs_of(s):
            yield e, sure and (plain or isinstance(e, _PURE))
        if isinstance(s, L.Loop):
            r0, r1 = value_range(s.start, env), value_range(s.stop, env)
            yield from _loop_exprs(s.body, dict(env, **{s.var: (r0[0], r1[1] - 1)}), sure and r0[1] < r1[0])
        else:
            for b in blocks_of(s):
                yield from _loop_exprs(b, env, False)


def hoist(body, env, readonly, taken, ours):
    """Compute loop invariants once, before their loop."""
    out = []
    for s in body:
        if not isinstance(s, L.Loop):
            out.append(map_node(s, lambda e: e, lambda b: hoist(b, env, readonly, taken, ours)))
            continue
        r0, r1 = value_range(s.start, env), value_range(s.stop, env)
        body2 = hoist(s.body, dict(env, **{s.var: (r0[0], r1[1] - 1)}), readonly, taken, ours)
        fixed = names_written(body2) | {s.var}
        runs = r0[1] < r1[0]                                           # at least once: loads may move
        pre, kept = [], []
        for x in body2:                   # our locals whose value is the same every iteration
            if isinstance(x, L.Declare) and x.name in ours and _movable(x.init, fixed - {x.name}, readonly, runs):
                pre.append(x)
            else:
                kept.append(x)
        fixed = names_written(tuple(kept)) | {s.var}
        cands = []
        for e, sure in _loop_exprs(tuple(kept), dict(env, **{s.var: (r0[0], r1[1] - 1)})):
            _invariants(e, lambda x, may: _movable(x, fixed, readonly, may), cands, runs and sure)
        cands.sort(key=lambda x: sum(1 for _ in subexprs(x)))          # an inner value first
        while cands:
            e = cands.pop(0)
            name = local_name(e, taken)
            ours.add(name)
            pre.append(L.Declare(name, e.dtype, e))
            kept = [_replace_in(x, e, L.Sym(name, e.dtype)) for x in kept]
            cands = [substitute(x, e, L.Sym(name, e.dtype)) for x in cands]
        out += pre
        out.append(replace(s, body=tuple(kept)))
    return tuple(out)


def _replace_in(s, old, new):
    return map_node(s, lambda e: substitute(e, old, new), lambda b: tuple(_replace_in(x, old, new) for x in b))


# ------------------------------------------------------------------------------ 3. share
def _shareable(e):
    """What hand-written code would name: loads, clamps, math calls, index splits, conditions."""
    return isinstance(e, (L.Load, L.Un)) or _is_clamp(e) or isinstance(e, L.Cast) and isinstance(e.x, L.Load) \
        or isinstance(e, L.Bin) and (e.op in ("idiv", "mod") or e.op in CMP_OPS)


def _occurrences(e, cands, cond=False):
    """Count the shareable sub-expressions of ``e`` outside Select arms."""
    if not cond and _shareable(e):
        cands[e] = cands.get(e, 0) + 1
    for name, v in _values(e):
        if is_expr(v) and isinstance(v, _PURE):
            _occurrences(v, cands, cond or isinstance(e, L.Select) and name in ("a", "b"))


def _count(s, e, unconditional=False):
    """Occurrences of ``e`` in statement ``s`` (only those outside Select arms if asked)."""
    if not unconditional:
        return sum(1 for y in exprs_of(s) for x in subexprs(y) if x == e)
    cands = {}
    for y in exprs_of(s):
        _occurrences(y, cands)
    return cands.get(e, 0)


def _simple(s):
    return isinstance(s, (L.Declare, L.Assign, L.Store))


def _written_by(s):
    return {s.buf} if isinstance(s, L.Store) else {s.name}


def share(body, taken, ours):
    """Common sub-expressions of consecutive statements of one block, computed once."""
    body = [map_node(s, lambda e: e, lambda b: share(b, taken, ours)) for s in body]
    if all(isinstance(s, L.Assign) for s in body):
        return tuple(body)                # accumulator updates: a reduction keeps its shape
    changed = True
    while changed:
        changed = False
        for i, s in enumerate(body):
            if not _simple(s):
                continue
            j = i                         # the run of plain statements from i on
            while j < len(body) and _simple(body[j]):
                j += 1
            cands = {}
            for t in body[i:j]:
                for e in exprs_of(t):
                    _occurrences(e, cands)
            for e in sorted(cands, key=lambda x: -sum(1 for _ in subexprs(x))):
                if not _count(body[i], e):
                    continue              # first met in an earlier statement: its turn has passed
                reads, end, total, plain = names_read(e), i, 0, 0
                for a in range(i, j):
                    n = _count(body[a], e)
                    if n:
                        end, total, plain = a, total + n, plain + _count(body[a], e, unconditional=True)
                    if _written_by(body[a]) & reads:
                        break
                if total < 2 or not plain:
                    continue
                name = local_name(e, taken)
                ours.add(name)
                sym = L.Sym(name, e.dtype)
                body[i:end + 1] = [L.Declare(name, e.dtype, e)] + [_replace_in(t, e, sym) for t in body[i:end + 1]]
                changed = True
                break
            if changed:
                break
    return tuple(body)


# ------------------------------------------------------------------------------ 4. merge locals
def merge_locals(body, ours):
    """Our locals declared twice in a block with the same value, or as copies, become one."""
    out, known, renames = [], {}, []      # known: init -> name, while nothing it reads is written
    for s in body:
        for old, new in renames:
            s = _replace_in(s, old, new)
        s = map_node(s, lambda e: e, lambda b: merge_locals(b, ours))
        if isinstance(s, L.Declare) and s.name in ours and s.init in known:
            renames.append((L.Sym(s.name, s.dtype), L.Sym(known[s.init], s.dtype)))
            continue
        if isinstance(s, L.Declare) and s.name in ours and isinstance(s.init, L.Sym) and s.init.name in ours:
            renames.append((L.Sym(s.name, s.dtype), s.init))           # a copy of another of ours
            continue
        written = names_written((s,))
        known = {e: n for e, n in known.items() if not names_read(e) & written}
        if isinstance(s, L.Declare) and s.name in ours:
            known[s.init] = s.name
        out.append(s)
    return tuple(out)


# ------------------------------------------------------------------------------ the pass
def _mergeable(a, b) -> bool:
    """Whether Reduce ``b`` can join the Reduce ``a`` just before it: the same range and mapping
    fields, and no value of ``b`` reads an accumulator of ``a``."""
    same = all(getattr(a, f.name) == getattr(b, f.name) for f in fields(L.Reduce) if f.name not in ("var", "accs"))
    theirs = {x.name for x in a.accs} | {x.arg for x in a.accs if x.arg}
    return same and not any(names_read(x.value) & theirs for x in b.accs)


def merge_reductions(body):
    """``body`` with each run of adjacent mergeable Reduces (``_mergeable``) as one Reduce, its
    accumulators in order (the later ones' loop variable renamed to the first's)."""
    out = []
    for s in body:
        s = map_node(s, lambda e: e, merge_reductions) if not isinstance(s, L.Reduce) else s
        if isinstance(s, L.Reduce) and out and isinstance(out[-1], L.Reduce) and _mergeable(out[-1], s):
            a, var = out[-1], L.Sym(out[-1].var, "i32")
            accs = tuple(replace(x, value=substitute(x.value, L.Sym(s.var, "i32"), var)) for x in s.accs)
            out[-1] = replace(a, accs=a.accs + accs)
            continue
        out.append(s)
    return tuple(out)


def simplify(kernel):
    """The kernel with folded constants and indices, no one- or zero-trip loops, loop invariants
    hoisted and common sub-expressions shared.  Same parameters, same results; ``bytes`` is
    re-estimated from the new body (``loopir.traffic``).  The pipeline runs it on every kernel
    (``engine.pipeline.lower_program``)."""
    body = fold(kernel.body, {})
    if kernel.family in ("reduce", "loop") and switch("VEGAFUSE_MERGE_REDUCE", True):
        body = merge_reductions(body)
    taken, ours = all_names(kernel), set()
    readonly = {p.name for p in kernel.params if p.role == "in" and p.kind == "buffer"}
    readonly -= names_written(body)
    body = hoist(body, {}, readonly, taken, ours)
    body = share(body, taken, ours)
    body = merge_locals(body, ours)
    out = replace(kernel, body=body)
    out.bytes = L.traffic(out)                # the estimate follows the body (hoisted loads move less)
    return out
