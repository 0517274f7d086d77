"""Loop IR: the small imperative language every fused kernel is lowered to.

Fusion (``fusion/``) turns a partition of the traced program into one
``Kernel`` per launch.  Each backend renders the same ``Kernel``:

* ``codegen/llvm.py``  -> LLVM IR through llvmlite (CPU);
* ``codegen/hip.py``   -> HIP C++ (gfx906, and the NVIDIA flavour).

The language is deliberately tiny:

Expressions (immutable, hashable, every node knows its dtype)
    Const(value, dtype)                 literal
    Sym(name, dtype)                    loop variable, local scalar or scalar parameter
    Load(buf, index, dtype)             ``buf[index]``: a buffer parameter or a local Array
    Un(op, x)                           a unary op of ``OPS``
    Bin(op, a, b)                       a binary op of ``OPS`` (comparisons give ``bool``)
    Select(cond, a, b)                  ``cond ? a : b``
    Cast(x, dtype)                      numeric conversion (f16 <-> f32, int -> float, ...)

Statements
    Loop(var, start, stop, body, parallel)   ``for var in range(start, stop)``; ``var`` is i32.
        Iterations of a ``parallel`` loop are independent: the CPU splits them
        across threads, a GPU maps them to workgroups/lanes.  Statements
        outside every parallel loop are executed by every thread, so they may
        only compute locals (no Store), unless the kernel runs on one thread.
    Declare(name, dtype, init)          mutable local scalar
    Assign(name, value)                 ``name = value``
    Array(name, dtype, size)            local scratch array (registers/LDS/stack)
    Store(buf, index, value)            ``buf[index] = value``

All indices are flat element offsets (i32) into contiguous buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

DTYPES = ("f32", "f16", "i32", "bool")
FLOAT_DTYPES = ("f32", "f16")

KINDS = {"f32": "float", "f16": "float", "i32": "int", "bool": "bool"}


def kind_of(dtype: str) -> str:
    """The dtype kind a scalar op is spelled for: ``float`` (f16, f32), ``int`` (i32) or ``bool``."""
    return KINDS[dtype]


@dataclass(frozen=True)
class ScalarOp:
    """One elementwise operation of ``Un``/``Bin``, with its spelling for every renderer.

    ``c`` and ``llvm`` map a dtype kind (``float``, ``int``, ``bool``) to the op's spelling for
    ``codegen/hip.py`` (a C expression template over ``{x}``, or ``{a}`` and ``{b}``) and for
    ``codegen/llvm.py`` (an intrinsic such as ``"llvm.exp"``; an IRBuilder instruction with an
    optional predicate and ``nsw``, such as ``"fadd"``, ``"icmp_signed <"``, ``"add nsw"``; or a
    function ``(renderer, *values) -> value``).  ``compare``: the result is ``bool``.
    Ops are defined with their primitive, in ``dsl/primitives.py``.
    """
    name: str
    arity: int
    c: dict
    llvm: dict
    compare: bool = False


OPS: dict = {}          # name -> ScalarOp: the one table every renderer keys on


def define_op(name, arity, c, llvm, compare=False) -> ScalarOp:
    """Register the scalar op ``name`` (see ``ScalarOp``); its kinds must match in ``c`` and ``llvm``."""
    if set(c) != set(llvm) or not set(c) <= set(KINDS.values()):
        raise ValueError(f"op {name}: spell it for the same dtype kinds in c {sorted(c)} and llvm {sorted(llvm)}")
    OPS[name] = ScalarOp(name, arity, dict(c), dict(llvm), compare)
    return OPS[name]


def spelling(op: str, dtype: str, renderer: str):
    """How ``renderer`` ("c" or "llvm") spells ``op`` on ``dtype`` operands; a clear error if it can't."""
    table = getattr(OPS[op], renderer) if op in OPS else {}
    if kind_of(dtype) not in table:
        raise NotImplementedError(f"op {op!r} has no {renderer} spelling for {dtype} operands: "
                                  f"add one to its definition in dsl/primitives.py")
    return table[kind_of(dtype)]


# ----------------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Const:
    value: Union[float, int, bool]
    dtype: str


@dataclass(frozen=True)
class Sym:
    name: str
    dtype: str


@dataclass(frozen=True)
class Load:
    buf: str
    index: "Expr"
    dtype: str


@dataclass(frozen=True)
class Un:
    op: str
    x: "Expr"

    @property
    def dtype(self):
        return self.x.dtype


@dataclass(frozen=True)
class Bin:
    op: str
    a: "Expr"
    b: "Expr"

    @property
    def dtype(self):
        return "bool" if OPS[self.op].compare else self.a.dtype


@dataclass(frozen=True)
class Select:
    cond: "Expr"
    a: "Expr"
    b: "Expr"

    @property
    def dtype(self):
        return self.a.dtype


@dataclass(frozen=True)
class Cast:
    x: "Expr"
    dtype: str


Expr = Union[Const, Sym, Load, Un, Bin, Select, Cast]


# ----------------------------------------------------------------------------- statements
@dataclass(frozen=True)
class Loop:
    var: str
    start: Expr
    stop: Expr
    body: tuple
    parallel: bool = False


@dataclass(frozen=True)
class Declare:
    name: str
    dtype: str
    init: Expr


@dataclass(frozen=True)
class Assign:
    name: str
    value: Expr


@dataclass(frozen=True)
class Array:
    name: str
    dtype: str
    size: int


@dataclass(frozen=True)
class Store:
    buf: str
    index: Expr
    value: Expr


Stmt = Union[Loop, Declare, Assign, Array, Store]


@dataclass(frozen=True)
class Param:
    """A kernel parameter: a buffer (``shape`` in elements) or an i32 scalar."""
    name: str
    dtype: str
    kind: str = "buffer"          # "buffer" | "scalar"
    shape: tuple = ()
    role: str = "in"              # "in" | "out" | "inout"

    @property
    def size(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Kernel:
    """One launch.  ``ops`` lists the DSL equations fused into it (for reports and source headers)."""
    name: str
    family: str                   # "elementwise" | "reduce" | "contract" | "scatter" | "attention"
    params: tuple
    body: tuple
    ops: tuple = ()
    bytes: int = 0                # bytes read + written per call (static estimate)
    flops: int = 0
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- helpers
def c(v, dtype="i32"):
    return Const(v, dtype)


def add(a, b):
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(b, Const) and b.value == 0:
        return a
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value + b.value, a.dtype)
    return Bin("add", a, b)


def mul(a, b):
    if isinstance(a, Const) and a.value == 1:
        return b
    if isinstance(b, Const) and b.value == 1:
        return a
    if (isinstance(a, Const) and a.value == 0) or (isinstance(b, Const) and b.value == 0):
        return Const(0, a.dtype)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value * b.value, a.dtype)
    return Bin("mul", a, b)


def linear_index(idx, shape):
    """Row-major flat offset of multi-index ``idx`` (tuple of i32 Exprs) in ``shape``."""
    off = c(0)
    for i, d in zip(idx, shape):
        off = add(mul(off, c(d)), i)
    return off


def walk_exprs(e):
    """Yield ``e`` and every sub-expression."""
    yield e
    for ch in children(e):
        yield from walk_exprs(ch)


def children(e):
    if isinstance(e, Load):
        return (e.index,)
    if isinstance(e, Un):
        return (e.x,)
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Cast):
        return (e.x,)
    return ()


def walk_stmts(body):
    """Yield every statement, depth first."""
    for s in body:
        yield s
        if isinstance(s, Loop):
            yield from walk_stmts(s.body)


def format_expr(e):
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Sym):
        return e.name
    if isinstance(e, Load):
        return f"{e.buf}[{format_expr(e.index)}]"
    if isinstance(e, Un):
        return f"{e.op}({format_expr(e.x)})"
    if isinstance(e, Bin):
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.x)})"
    raise TypeError(e)


def format_kernel(k: Kernel) -> str:
    """Readable pseudo-code of a kernel (for debugging and reports)."""
    lines = [f"kernel {k.name} [{k.family}]("
             + ", ".join(f"{p.name}:{p.dtype}{list(p.shape) if p.kind == 'buffer' else ''}" for p in k.params) + ")"]

    def emit(body, ind):
        for s in body:
            pad = "  " * ind
            if isinstance(s, Loop):
                par = " parallel" if s.parallel else ""
                lines.append(f"{pad}for{par} {s.var} in [{format_expr(s.start)}, {format_expr(s.stop)}):")
                emit(s.body, ind + 1)
            elif isinstance(s, Declare):
                lines.append(f"{pad}{s.dtype} {s.name} = {format_expr(s.init)}")
            elif isinstance(s, Assign):
                lines.append(f"{pad}{s.name} = {format_expr(s.value)}")
            elif isinstance(s, Array):
                lines.append(f"{pad}{s.dtype} {s.name}[{s.size}]")
            elif isinstance(s, Store):
                lines.append(f"{pad}{s.buf}[{format_expr(s.index)}] = {format_expr(s.value)}")
    emit(k.body, 1)
    return "\n".join(lines)


def canonicalize(k: Kernel) -> Kernel:
    """The same kernel with parameters named p0, p1, ... and locals v0, v1, ... in order of
    appearance.  Kernels that differ only in names (the same layer, 30 times) become equal,
    so a backend compiles each distinct kernel once."""
    names = {p.name: f"p{i}" for i, p in enumerate(k.params)}

    def n(x):
        if x not in names:
            names[x] = f"v{len(names)}"
        return names[x]

    def ex(e):
        if isinstance(e, Sym):
            return Sym(n(e.name), e.dtype)
        if isinstance(e, Load):
            return Load(n(e.buf), ex(e.index), e.dtype)
        if isinstance(e, Un):
            return Un(e.op, ex(e.x))
        if isinstance(e, Bin):
            return Bin(e.op, ex(e.a), ex(e.b))
        if isinstance(e, Select):
            return Select(ex(e.cond), ex(e.a), ex(e.b))
        if isinstance(e, Cast):
            return Cast(ex(e.x), e.dtype)
        return e

    def st(s):
        if isinstance(s, Loop):
            return Loop(n(s.var), ex(s.start), ex(s.stop), tuple(st(b) for b in s.body), s.parallel)
        if isinstance(s, Declare):
            return Declare(n(s.name), s.dtype, ex(s.init))
        if isinstance(s, Assign):
            return Assign(n(s.name), ex(s.value))
        if isinstance(s, Array):
            return Array(n(s.name), s.dtype, s.size)
        return Store(n(s.buf), ex(s.index), ex(s.value))

    def meta(v):            # family metadata (GPU templates): rename the names it mentions
        if isinstance(v, (Const, Sym, Load, Un, Bin, Select, Cast)):
            return ex(v)
        if isinstance(v, (Loop, Declare, Assign, Array, Store)):
            return st(v)
        if isinstance(v, str):
            return names.get(v, v)
        if isinstance(v, dict):
            return {key: meta(x) for key, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v

    params = tuple(Param(names[p.name], p.dtype, p.kind, p.shape, p.role) for p in k.params)
    body = tuple(st(s) for s in k.body)
    info = {key: meta(v) for key, v in k.meta.items() if key != "eqns"}
    return Kernel("canonical", k.family, params, body, (), k.bytes, k.flops, info)


ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "bool": 1}


def traffic(k: Kernel) -> int:
    """Bytes a kernel reads and writes per call, estimated from its loops: each buffer moves the
    elements its accesses can reach (the product of the static extents of the loops around them),
    at most its size.  Loops with a runtime extent count as reaching the whole buffer."""
    params = {p.name: p for p in k.params if p.kind == "buffer"}
    reach = {}

    def visit_expr(e, extent):
        for x in walk_exprs(e):
            if isinstance(x, Load) and x.buf in params and reach.get(x.buf, 0) is not None:
                reach[x.buf] = None if extent is None else max(reach[x.buf] if x.buf in reach else 0, extent)

    def visit(body, extent):
        for s in body:
            if isinstance(s, Loop):
                n = s.stop.value - s.start.value if isinstance(s.stop, Const) and isinstance(s.start, Const) else None
                visit(s.body, extent * n if n is not None and extent is not None else None)
            elif isinstance(s, Store):
                if s.buf in params and reach.get(s.buf, 0) is not None:
                    reach[s.buf] = None if extent is None else max(reach.get(s.buf, 0), extent)
                visit_expr(s.value, extent)
                visit_expr(s.index, extent)
            elif isinstance(s, (Declare, Assign)):
                visit_expr(s.init if isinstance(s, Declare) else s.value, extent)

    def cap(name, n):
        size = params[name].size
        return size if n is None else min(size, n)
    visit(k.body, 1)
    return sum(cap(name, n) * ITEMSIZE[params[name].dtype] for name, n in reach.items())
