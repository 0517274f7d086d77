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
    Array(name, dtype, size, space)     local scratch array: ``space`` "local" (registers/stack),
                                        "lds" (shared by the threads of a workgroup) or "global" (the
                                        workgroup's slice of a buffer in device memory)
    Store(buf, index, value)            ``buf[index] = value``
    Reduce(var, start, stop, accs)      a reduction loop as one statement: declares each ``Acc``
                                        (add | max | argmax), folds its value over ``var``;
                                        afterwards every thread holds the results; ``order``
                                        "outer": the scheduler's access order for a (K, N)
                                        weight (``ORDERS``, ``interchange``)
    If(cond, then, orelse)              conditional statements
    Barrier()                           every thread of the workgroup waits here (GPU only)
    Comment(text)                       a section comment in the rendered source
    Attention(...)                      online-softmax attention over a KV cache; the CPU renders
                                        ``expand_attention``, the GPU a template from its fields

Hardware mapping.  ``codegen/mapping.py`` records how a kernel runs on a GPU: ``Loop.map`` and
``Reduce.map`` say which hardware unit takes the iterations ("serial", "grid": workgroups,
"block": the threads of a workgroup, "wave": the waves of the grid, one iteration each, "lane":
the lanes of one wave, "thread": every thread of the grid); ``Reduce.vector`` the elements one
lane folds per step (a 16-byte load); ``split`` how many waves share one iteration of a wave loop
(and one lane reduction, combined through LDS); ``Kernel.launch`` the grid and block.  Mapped
expressions may use ``Hw("lane" | "wave" | "thread")``.  The CPU renders unmapped kernels.

All indices are flat element offsets (i32) into contiguous buffers.
"""
from __future__ import annotations

import math
import re

from dataclasses import dataclass, replace
from typing import Union

from .env import env_choice, switch

DTYPES = ("f32", "f16", "i32", "bool")
FLOAT_DTYPES = ("f32", "f16")
# buffers of quantized weights (dsl/quant.py), read by QLoad, QDot
QUANT_DTYPES = ("q4_0", "q4_1", "q8_0", "gptq_int4")
ACT_Q8 = ("q8_1r", "q8_1")                     # an int8 GEMV's activation: q8_1 with its residual plane, or without


def int8_activation() -> str:
    """The dtype an int8 GEMV quantizes its activation to: "q8_1r" (q8_1 with a residual plane:
    about f16's precision), or plain "q8_1" with ``VEGAFUSE_QUANT_RESIDUAL=0`` (half the integer
    work and LDS, 1/254 of each block's largest value per element; the A/B switch)."""
    return "q8_1r" if switch("VEGAFUSE_QUANT_RESIDUAL", True) else "q8_1"


def quantized_activations() -> bool:
    """Do int8 GEMVs quantize their activations (``VEGAFUSE_QUANT_ACT=q8_1``, the default), or do
    quantized weights meet float activations (``float``: the A/B switch)?"""
    return env_choice("VEGAFUSE_QUANT_ACT", ("q8_1", "float"), "q8_1") == "q8_1"


KINDS = {"f32": "float", "f16": "float", "i32": "int", "bool": "bool"}


def kind_of(dtype: str) -> str:
    """The dtype kind a scalar op is spelled for: ``float`` (f16, f32), ``int`` (i32) or ``bool``."""
    return KINDS[dtype]


@dataclass(frozen=True)
class ScalarOp:
    """One elementwise operation of ``Un``/``Bin``, with its spelling for every renderer.

    ``c`` and ``llvm`` map a dtype kind (``float``, ``int``, ``bool``) to the op's spelling for
    ``codegen/hip.py`` (a C expression template over ``{x}``, or ``{a}`` and ``{b}``; or a function
    ``(*operands) -> str`` of the operands' expressions, for an op composed of others) and for
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


def op_table() -> dict:
    """``OPS``, filled by the primitives' definitions (``dsl/primitives.py``) on first use."""
    if not OPS:
        import dsl.primitives  # noqa: F401
    return OPS


def spelling(op: str, dtype: str, renderer: str):
    """How ``renderer`` ("c" or "llvm") spells ``op`` on ``dtype`` operands; a clear error if it can't."""
    table = getattr(OPS[op], renderer) if op in op_table() else {}
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
class QLoad(Load):
    """Element ``index`` of a quantized buffer ``buf`` (format ``fmt``: "q4_0", "q4_1", "q8_0",
    "gptq_int4"; ``count`` elements in all), as its f32 value: its block's scale times its quant.
    The buffer holds the device layout of ``dsl/quant.py`` (every block's quants, then every block's
    scales, which start at byte ``count / 32 * quant_bytes``).  ``dtype`` is "f32"."""
    fmt: str = ""
    count: int = 0


@dataclass(frozen=True)
class QDot:
    """The f32 dot product of weight block ``block`` of the quantized buffer ``w`` (format ``fmt``,
    ``count`` elements in all) with block ``ablock`` of the q8_1 array ``act`` (32 values
    ``d * (128 q + r)`` with int8 quants ``q`` and residuals ``r``, and ``s = d * sum``): integer dot
    products of the quants, then the scales.  Made for a GEMV whose weights are quantized."""
    w: str
    fmt: str
    block: "Expr"
    count: int
    act: str
    ablock: "Expr"
    dtype: str = "f32"


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
        return "bool" if op_table()[self.op].compare else self.a.dtype


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


@dataclass(frozen=True)
class Hw:
    """A hardware index of a mapped GPU kernel: "lane" (in its wave), "wave" (in its workgroup),
    "thread" (in its workgroup), "workgroup" (in the grid), "grid" (the grid's workgroups)."""
    name: str
    dtype: str = "i32"


Expr = Union[Const, Sym, Load, QLoad, QDot, Un, Bin, Select, Cast, Hw]


# ----------------------------------------------------------------------------- statements
MAPS = ("serial", "grid", "block", "wave", "lane", "thread")


@dataclass(frozen=True)
class Loop:
    var: str
    start: Expr
    stop: Expr
    body: tuple
    parallel: bool = False        # iterations are independent (the CPU splits them across threads)
    map: str = "serial"           # MAPS: the GPU unit that takes the iterations
    split: int = 1                # map="wave": waves per iteration (uniform trip count for barriers)
    lanes: int = 0                # map="wave": lanes per iteration (0: the whole wave); a wave then takes
                                  # wave / lanes consecutive iterations side by side
    unroll: int = 0               # GPU unroll hint (loads in flight), recorded by the mapping; 0: the compiler's choice


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
    space: str = "local"          # "local" | "lds" | "device": one per module, zero when it loads (a split
                                  # reduction's partials, ``Arrive``) | "global": ``size`` values a workgroup
                                  # of one buffer in device memory (an activation that passes the LDS)
    align: int = 0                # bytes its start is aligned to beyond its element's (0: the element's)


@dataclass(frozen=True)
class QuantizeQ8:
    """Quantize ``values`` (f32 expressions: elements ``group * n .. group * n + n - 1`` of the
    q8_1 array ``arr``, n = len(values)) into q8_1 blocks of 32 with a residual plane: step =
    max|x| / 127, quants q = round(x / step), residuals r = round(128 (x / step - q)), d = step / 128
    and s = d * sum(128 q + r), so x = d * (128 q + r) within step / 256.  With n < 32 the 32 / n consecutive groups of a block
    are quantized together by 32 / n consecutive lanes of one wave, which all run this statement
    (``active`` False: a lane that only helps, storing nothing)."""
    arr: str
    group: "Expr"
    values: tuple
    active: "Expr"


@dataclass(frozen=True)
class CopyQ8:
    """GPU, made by the mapping: the threads of the workgroup copy the ``blocks`` q8_1 blocks of the
    buffer ``src`` (written by an earlier kernel) into the LDS array ``dst``, 16 bytes at a time."""
    dst: str
    src: str
    blocks: int


@dataclass(frozen=True)
class CopyF32:
    """GPU, made by the mapping: the threads of the workgroup copy the ``n`` f32 values of the buffer
    ``src`` (an earlier kernel's output or a program input; n a multiple of 4) into the LDS array
    ``dst``, 16 bytes at a time (a GEMV's fill that only reads its input: the down projection's
    SiLU * up)."""
    dst: str
    src: str
    n: int


@dataclass(frozen=True)
class QuantizeStored:
    """GPU, made by the mapping, after a GEMV's wave loop (every thread of the workgroup runs it): the
    q8_1 blocks of the ``n`` f32 values of ``src`` into the buffer ``dst``.  Trip j of workgroup b stored
    ``src[first + (b + j * grid) * rows .. + rows)`` (clipped to [0, n)), for j < ``trips``; a trip
    touches at most ``per_trip`` blocks.  The workgroup adds what it stored to each block's arrival count
    (``{dst}_count``, a file-scope counter per block) and quantizes the blocks it completes; ``done`` is
    its LDS list of them (``trips * per_trip`` slots)."""
    src: str
    dst: str
    n: int
    first: int
    rows: int
    trips: int
    per_trip: int
    done: str
    whole: bool = False      # every trip stores whole blocks (rows, first multiples of 32): each workgroup
                             # quantizes what it stored itself, with no arrivals (``vf_quantize_own``)
    staged: str = ""         # whole: the LDS array that holds the values the workgroup's trips stored, trip
                             # after trip (``rows`` each), read instead of src (``vf_quantize_staged``)
    scale: str = ""          # the blocks are of src * scale (elementwise), and ...
    sumsq: str = ""          # ... each block's sum of src * src goes to sumsq[block] (fusion.q8: a normalization's)


@dataclass(frozen=True)
class Store:
    buf: str
    index: Expr
    value: Expr


ACC_OPS = ("add", "max", "argmax")


@dataclass(frozen=True)
class Acc:
    """One result of a ``Reduce``: ``name`` (a new local of ``dtype``) = op over the loop of
    ``value``.  argmax: ``name`` holds the largest value, ``arg`` (a new i32 local) the first
    iteration that reached it."""
    name: str
    op: str
    value: Expr
    dtype: str = "f32"
    arg: str = ""

    @property
    def init(self):
        if self.op == "add":
            return Const(0.0 if self.dtype == "f32" else 0, self.dtype)
        return Const(float("-inf"), "f32") if self.dtype == "f32" else Const(-2 ** 31, "i32")


@dataclass(frozen=True)
class Reduce:
    """``for var in range(start, stop)``: fold every ``Acc``.  ``map``: serial, block or lane;
    ``vector``: elements per lane step (each Acc value is then ``act[var] * weight[row + var]``,
    checked by the mapping step); ``split``: waves sharing the range, combined through LDS."""
    var: str
    start: Expr
    stop: Expr
    accs: tuple
    map: str = "serial"
    vector: int = 1
    split: int = 1
    lanes: int = 0                # map="lane": the lanes that share the range (0: the whole wave)
    unroll: int = 0               # GPU unroll hint (loads in flight); 0: the compiler's choice
    whole: bool = False           # map="lane": a lane's few steps all unrolled, each guarded, so that all their
                                  # loads are in flight at once (codegen.mapping.whole_steps); map="block": the
                                  # range [0, stop) a whole number of the workgroup's steps, the body's leading
                                  # loads (its first Declares) taken for every step before its first store
    order: str = "inner"          # ORDERS: where the reduction's loop runs, chosen by the scheduler
    body: tuple = ()              # statements each iteration runs first: a GEMV's fill that shares the
                                  # reduction's loop (codegen.prologue; made by the GPU mapping, so the
                                  # passes before it, serial_reduce, plain, buffer_traffic, never see one)


# A Reduce that opens the body of a parallel loop (a GEMV's output columns n) runs
#   "inner": inside each iteration: one dot product along k per n (an (N, K) weight, rows contiguous in k);
#   "outer": outside the iterations: each step k updates the accumulators of a chunk of consecutive n
#            (a (K, N) weight, whose rows are contiguous in n: contiguous loads, vectors along n).
ORDERS = ("inner", "outer")


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple
    orelse: tuple = ()


@dataclass(frozen=True)
class Barrier:
    pass


@dataclass(frozen=True)
class Comment:
    text: str


@dataclass(frozen=True)
class Attention:
    """out[h, t, :] = softmax(q[h, t] . k[h / group, s] * scale over s <= pos + t) @ v[h / group, s].

    q [hq, t, d], k and v [hkv, s, d] (dtypes in ``dtypes``), out [hq, t, d] f32; ``pos`` an i32
    expression, already clamped to [0, s - t]."""
    q: str
    k: str
    v: str
    out: str
    dtypes: tuple
    hq: int
    hkv: int
    t: int
    s: int
    d: int
    pos: Expr
    scale: float
    tiles: "AttentionTiles" = None  # the GPU mapping's choices (codegen/mapping.py), None before it


@dataclass(frozen=True)
class AttentionTiles:
    """How the GPU runs an ``Attention`` (chosen by ``codegen/mapping.py``): a workgroup takes one
    KV head, ``rows_q`` query positions (times the heads of the group: the tile's rows) and the
    ``chunk`` positions of one of ``splits`` slices of the cache, in tiles of ``keys`` positions
    staged in LDS; ``key_lanes`` lanes share a row's scores.  ``vector``: K/V rows move 16 bytes
    at a time.  The kernel text follows from these fields alone."""
    rows_q: int
    keys: int
    chunk: int
    splits: int
    key_lanes: int
    vector: bool
    threads: int                  # of the workgroup
    wave: int                     # lanes per wave of the target the text is written for
    heads: int = 0                # decode (T = 1): the query heads a workgroup takes, read in registers, each
                                  # group of key_lanes lanes owning keys (no LDS tiles); 0: the tiled template
    unroll: int = 1               # decode: the keys a lane group has in flight per step
    block: tuple = ()             # prefill, register-blocked (rows, keys): each thread's rows x keys of the
                                  # scores and rows x columns of the outputs; ``heads`` then counts the KV
                                  # group's query heads a workgroup takes; (): the tiled template
    short: int = 0                # decode: positions up to which the first split reads the whole context
                                  # (its chunk is this long then), so no split's rows need combining


@dataclass(frozen=True)
class Arrive:
    """GPU, made by the mapping: the workgroup counts itself in the "device" array ``count`` (one
    counter); all but the last of the ``parts`` workgroups to arrive end here, and the last one sees
    every other's global writes from before its arrival (and sets the counter back to zero)."""
    count: str
    parts: int


@dataclass(frozen=True)
class Phase:
    """A step of a persistent kernel (``fusion/persistent.py``): ``kernel``, a kernel of the plan,
    run by the persistent kernel's workgroups as if it were launched alone (each takes its workgroups
    in turn), with ``args`` (names of the persistent kernel's parameters) bound to its parameters in
    order.  Phases equal up to names (the same layer again) share one ``kernel``; ``name`` is the
    plan's kernel the phase stands for.  ``tiled``: for a GEMV phase fed by the ring (``codegen/ring.py``),
    the persistent kernel's parameter that holds its weights tiled, else ""; ``grid``: then the launch's
    workgroups, which its tiles are made for (chosen once, by the plan step)."""
    kernel: "Kernel"
    args: tuple
    name: str
    tiled: str = ""
    grid: int = 0


@dataclass(frozen=True)
class RingDot:
    """GPU, a persistent kernel's GEMV phase fed by its ring (``codegen/ring.py``): the dot products of
    ``slots`` weight rows (a block's, stored tiled: each chunk ``kc`` columns of all of them) with the
    ``k`` values of ``act`` (LDS), the chunks taken from the ring in turn.  Thread t keeps the 8 columns
    ``t % cg`` of each chunk for the rows ``t / cg + i * (workgroup / cg)``, ``i < rpt``, summing in
    registers over the chunks; the ``min(cg, 32)`` lanes of a warp on a row add theirs, and row s's
    ``cg / min(cg, 32)`` partial sums end at ``sums[s * cg / min(cg, 32) ...]``."""
    k: int
    kc: int
    cg: int
    rpt: int
    act: str
    sums: str
    slots: "Expr"


@dataclass(frozen=True)
class RingProduce:
    """GPU, the producer warp's side of a ``RingDot``: the ``slots`` rows' chunks of ``kc`` columns (``k`` in
    all) from the tiled weights at element ``first`` (of the phase's share of the tiled buffer), each
    copied into the next free slot of the ring, at most ``flight`` of them in flight."""
    k: int
    kc: int
    first: "Expr"
    slots: "Expr"
    flight: int = 2


STAMP_STEPS = ("start", "staged", "dot", "end", "left")   # a traced persistent kernel's stamps, in a phase's order


@dataclass(frozen=True)
class Stamp:
    """GPU, a persistent kernel traced (``VEGAFUSE_PERSISTENT_TRACE``): thread 0 of the workgroup records
    its compute unit's clock with ``step`` (one of ``STAMP_STEPS``: the launch's start, a phase's activation
    staged, its dot products done, its end, the grid barrier left), read by ``engine.profile.phase_times``."""
    step: str


@dataclass(frozen=True)
class GridBarrier:
    """GPU: every workgroup of the grid waits here until all have arrived; the global writes of
    every workgroup before it are seen by every workgroup after it."""


Stmt = Union[Loop, Declare, Assign, Array, Store, Reduce, If, Barrier, Comment, Attention, QuantizeQ8,
             CopyQ8, CopyF32, QuantizeStored, Arrive, Phase, GridBarrier, RingDot, RingProduce, Stamp]


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


@dataclass(frozen=True)
class Launch:
    """How a mapped kernel launches: ``grid`` workgroups of ``block`` threads (``bounds``: the
    prelude macro naming that size); ``lds`` static LDS bytes; ``act`` the dtype a GEMV keeps its
    activation in (the prelude's ``vf_act_t``); ``how`` one line for the source header."""
    grid: int
    block: int
    bounds: str
    how: str
    lds: int = 0
    act: str = "f32"


@dataclass
class Kernel:
    """One launch.  ``ops`` describes the DSL equations fused into it (for reports), ``eqns`` holds
    them; ``launch`` is set by the GPU mapping step (``codegen/mapping.py``)."""
    name: str
    family: str                   # "elementwise" | "reduce" | "contract" | "scatter" | "attention" | "persistent"
    params: tuple
    body: tuple
    ops: tuple = ()
    bytes: int = 0                # bytes read + written per call (static estimate)
    flops: int = 0
    eqns: tuple = ()
    launch: Launch = None


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
    if isinstance(e, QDot):
        return (e.block, e.ablock)
    if isinstance(e, Un):
        return (e.x,)
    if isinstance(e, Bin):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Cast):
        return (e.x,)
    return ()


def sub_bodies(s):
    """The statement lists nested in ``s``."""
    if isinstance(s, Loop):
        return (s.body,)
    if isinstance(s, If):
        return (s.then, s.orelse)
    if isinstance(s, Reduce) and s.body:
        return (s.body,)
    return ()


def walk_stmts(body):
    """Yield every statement, depth first."""
    for s in body:
        yield s
        for b in sub_bodies(s):
            yield from walk_stmts(b)


def stmt_exprs(s):
    """The expressions a statement evaluates directly (not those of nested statements)."""
    if isinstance(s, Loop):
        return (s.start, s.stop)
    if isinstance(s, Declare):
        return (s.init,)
    if isinstance(s, Assign):
        return (s.value,)
    if isinstance(s, Store):
        return (s.index, s.value)
    if isinstance(s, Reduce):
        return (s.start, s.stop) + tuple(a.value for a in s.accs)
    if isinstance(s, If):
        return (s.cond,)
    if isinstance(s, Attention):
        return (s.pos,)
    if isinstance(s, QuantizeQ8):
        return (s.group, s.active) + tuple(s.values)
    if isinstance(s, RingDot):
        return (s.slots,)
    if isinstance(s, RingProduce):
        return (s.first, s.slots)
    return ()


# ----------------------------------------------------------------------------- rewriting
def rewrite_expr(e, fn):
    """Rebuild ``e`` bottom-up; ``fn(node)`` returns a replacement or None to keep the node."""
    if isinstance(e, Load):
        e = replace(e, index=rewrite_expr(e.index, fn))
    elif isinstance(e, QDot):
        e = replace(e, block=rewrite_expr(e.block, fn), ablock=rewrite_expr(e.ablock, fn))
    elif isinstance(e, Un):
        e = Un(e.op, rewrite_expr(e.x, fn))
    elif isinstance(e, Bin):
        e = Bin(e.op, rewrite_expr(e.a, fn), rewrite_expr(e.b, fn))
    elif isinstance(e, Select):
        e = Select(rewrite_expr(e.cond, fn), rewrite_expr(e.a, fn), rewrite_expr(e.b, fn))
    elif isinstance(e, Cast):
        e = Cast(rewrite_expr(e.x, fn), e.dtype)
    r = fn(e)
    return e if r is None else r


def rewrite(body, ex=lambda e: e, name=lambda n: n):
    """``body`` with every expression mapped by ``ex`` and every bound or referenced local,
    buffer and array name by ``name``."""
    def st(s):
        if isinstance(s, Loop):
            return replace(s, var=name(s.var), start=ex(s.start), stop=ex(s.stop), body=rewrite(s.body, ex, name))
        if isinstance(s, Declare):
            return Declare(name(s.name), s.dtype, ex(s.init))
        if isinstance(s, Assign):
            return Assign(name(s.name), ex(s.value))
        if isinstance(s, Array):
            return replace(s, name=name(s.name))
        if isinstance(s, Store):
            return Store(name(s.buf), ex(s.index), ex(s.value))
        if isinstance(s, Reduce):
            accs = tuple(replace(a, name=name(a.name), value=ex(a.value), arg=name(a.arg) if a.arg else "")
                         for a in s.accs)
            return replace(s, var=name(s.var), start=ex(s.start), stop=ex(s.stop), accs=accs,
                           body=rewrite(s.body, ex, name))
        if isinstance(s, If):
            return If(ex(s.cond), rewrite(s.then, ex, name), rewrite(s.orelse, ex, name))
        if isinstance(s, Attention):
            return replace(s, q=name(s.q), k=name(s.k), v=name(s.v), out=name(s.out), pos=ex(s.pos))
        if isinstance(s, QuantizeQ8):
            return QuantizeQ8(name(s.arr), ex(s.group), tuple(ex(v) for v in s.values), ex(s.active))
        if isinstance(s, Arrive):
            return Arrive(name(s.count), s.parts)
        if isinstance(s, Phase):
            return Phase(s.kernel, tuple(name(a) for a in s.args), s.name, name(s.tiled) if s.tiled else "", s.grid)
        if isinstance(s, RingDot):
            return replace(s, act=name(s.act), sums=name(s.sums), slots=ex(s.slots))
        if isinstance(s, RingProduce):
            return replace(s, first=ex(s.first), slots=ex(s.slots))
        if isinstance(s, CopyQ8):
            return CopyQ8(name(s.dst), name(s.src), s.blocks)
        if isinstance(s, CopyF32):
            return CopyF32(name(s.dst), name(s.src), s.n)
        if isinstance(s, QuantizeStored):
            return replace(s, src=name(s.src), dst=name(s.dst), done=name(s.done), staged=name(s.staged) if s.staged else "",
                           scale=name(s.scale) if s.scale else "", sumsq=name(s.sumsq) if s.sumsq else "")
        return s
    return tuple(st(s) for s in body)


def fold(e):
    """Fold i32 ``+ 0``, ``* 1``, ``* 0`` and constant operands (after a substitution)."""
    def f(x):
        if isinstance(x, Bin) and x.a.dtype == "i32" and x.op in ("add", "mul"):
            return (add if x.op == "add" else mul)(x.a, x.b)
        if isinstance(x, Bin) and x.op in ("min", "max") and isinstance(x.a, Const) and isinstance(x.b, Const):
            return Const((min if x.op == "min" else max)(x.a.value, x.b.value), x.a.dtype)
        return None
    return rewrite_expr(e, f)


def substitute_expr(e, values):
    """``e`` with each Sym named in ``values`` replaced by its expression, indices folded."""
    return fold(rewrite_expr(e, lambda x: values.get(x.name) if isinstance(x, Sym) else None))


def substitute(body, values):
    """``body`` with each Sym named in ``values`` replaced by its expression, indices folded."""
    return rewrite(body, lambda e: substitute_expr(e, values))


def drop_unit_loops(body, keep_parallel=False):
    """Loops of one trip become their body with the loop variable replaced by its start
    (``keep_parallel``: except parallel loops, such as a GEMV's output rows when N is 1)."""
    out = []
    for s in body:
        if isinstance(s, Loop) and isinstance(s.start, Const) and isinstance(s.stop, Const) \
                and s.stop.value - s.start.value == 1 and not (keep_parallel and s.parallel):
            out += drop_unit_loops(substitute(s.body, {s.var: s.start}), keep_parallel)
        elif isinstance(s, Loop):
            out.append(replace(s, body=drop_unit_loops(s.body, keep_parallel)))
        elif isinstance(s, If):
            out.append(If(s.cond, drop_unit_loops(s.then, keep_parallel), drop_unit_loops(s.orelse, keep_parallel)))
        else:
            out.append(s)
    return tuple(out)


def local_names(body):
    """Every name a statement list binds: loop variables, locals, arrays, reduction results."""
    out = []
    for s in walk_stmts(body):
        if isinstance(s, Loop):
            out.append(s.var)
        elif isinstance(s, (Declare, Array)):
            out.append(s.name)
        elif isinstance(s, Reduce):
            out.append(s.var)
            out += [n for a in s.accs for n in (a.name, a.arg) if n]
    return list(dict.fromkeys(out))


def fresh_name(base: str, taken) -> str:
    """``base``, or ``base1``, ``base2``, ... the first not in ``taken``."""
    new, i = base, 1
    while new in taken:
        new, i = f"{base}{i}", i + 1
    return new


def tidy_names(k: "Kernel", reserved=()) -> "Kernel":
    """Locals named after what they hold, without the counters that keep them unique while
    lowering (``acc_w_gate_47`` -> ``acc_w_gate``); a number is added back only on a clash."""
    taken = {p.name for p in k.params} | set(reserved)
    names = {}
    for n in local_names(k.body):
        new = fresh_name(re.sub(r"_\d+$", "", n) or n, taken)
        taken.add(new)
        names[n] = new

    def ex(e):
        return rewrite_expr(e, lambda x: Sym(names[x.name], x.dtype) if isinstance(x, Sym) and x.name in names
                            else replace(x, buf=names[x.buf]) if isinstance(x, Load) and x.buf in names
                            else replace(x, act=names[x.act]) if isinstance(x, QDot) and x.act in names
                            else None)
    return replace(k, body=rewrite(k.body, ex, lambda n: names.get(n, n)))


def rename_params(k: "Kernel", names: dict) -> "Kernel":
    """``k`` with the parameters named in ``names`` ({old: new}) renamed, with every read and write
    of them (a launch binds parameters by position, so only the kernel text changes)."""
    if not names:
        return k
    n = lambda x: names.get(x, x)  # noqa: E731

    def ex(e):
        return rewrite_expr(e, lambda x: Sym(names[x.name], x.dtype) if isinstance(x, Sym) and x.name in names
                            else replace(x, buf=names[x.buf]) if isinstance(x, Load) and x.buf in names
                            else replace(x, w=n(x.w), act=n(x.act)) if isinstance(x, QDot) and (x.w in names or x.act in names)
                            else None)
    return replace(k, params=tuple(replace(p, name=n(p.name)) for p in k.params), body=rewrite(k.body, ex, n))


def serial_reduce(r: Reduce):
    """A Reduce as plain statements: each Acc declared with its identity, then one loop.  An
    argmax step computes its value once (``{acc}_value``): it is compared three times, and two
    copies of it that fast math rounds differently would make ``x != x`` true, a NaN that is not."""
    v = Sym(r.var, "i32")
    decls, upd = [], []
    for a in r.accs:
        acc = Sym(a.name, a.dtype)
        decls.append(Declare(a.name, a.dtype, a.init))
        if a.op == "argmax":
            decls.append(Declare(a.arg, "i32", Const(0, "i32")))
            x = Sym(f"{a.name}_value", a.dtype)
            upd.append(Declare(x.name, a.dtype, a.value))
            # the first NaN wins, as in numpy: a value beats the best so far, or is the first NaN
            better = Bin("or", Bin("gt", x, acc), Bin("and", Bin("ne", x, x), Bin("eq", acc, acc)))
            upd.append(Assign(a.arg, Select(better, v, Sym(a.arg, "i32"))))
            upd.append(Assign(a.name, Bin("max", acc, x)))
        else:
            upd.append(Assign(a.name, Bin(a.op, acc, a.value)))
    return tuple(decls) + (Loop(r.var, r.start, r.stop, tuple(upd)),)


def can_interchange(loop: Loop) -> bool:
    """Does ``loop``'s body open with locals and a Reduce of order "outer" of "add"
    accumulators (what ``interchange`` takes)?  Any other body keeps its order."""
    at = next((i for i, s in enumerate(loop.body) if not isinstance(s, Declare)), None)
    r = loop.body[at] if at is not None else None
    return isinstance(r, Reduce) and r.order == "outer" and all(a.op == "add" for a in r.accs)


def interchange(loop: Loop, chunk: int, lo: Expr = None, hi: Expr = None, unroll: int = 1) -> Loop:
    """Iterations [``lo``, ``hi``) (default: all) of a parallel ``loop`` whose body opens with a
    Reduce of order "outer" (after locals it declares), as plain serial loops with the reduction
    outside: chunks of at most ``chunk`` consecutive iterations; per chunk each accumulator is a
    local array, each ``unroll`` steps of the reduction update the whole chunk, then the rest of
    the body runs per iteration.  The same sums in another order::

        for n_blk in [0, ceil((hi - lo) / chunk)):
          f32 acc_col[chunk]; for n_j in [0, m): acc_col[n_j] = 0
          for k_u in [0, K / unroll): for n_j in [0, m):
            n = lo + n_blk * chunk + n_j; acc_col[n_j] += value(unroll * k_u, n) + ... (unroll terms)
          (the last K % unroll steps one at a time)
          for n_j in [0, m): n = lo + n_blk * chunk + n_j; acc = acc_col[n_j]; the rest of the body

    (``m`` = min(chunk, hi - lo - n_blk * chunk)).  Accumulators "add" (and "max" with
    ``unroll`` 1) only."""
    at = next(i for i, s in enumerate(loop.body) if isinstance(s, Reduce))
    head, r, rest = loop.body[:at], loop.body[at], loop.body[at + 1:]
    ops = ("add",) if unroll > 1 else ("add", "max")
    if not all(isinstance(s, Declare) for s in head) or any(a.op not in ops for a in r.accs):
        raise ValueError(f"interchange: {loop.var}'s loop does not open with locals and a Reduce of {ops}")
    lo, hi = loop.start if lo is None else lo, loop.stop if hi is None else hi
    n, blk, j = loop.var, f"{loop.var}_blk", f"{loop.var}_j"
    first = add(lo, mul(Sym(blk, "i32"), c(chunk)))
    m = Bin("min", c(chunk), Bin("sub", hi, first))
    col = {a.name: f"{a.name}_col" for a in r.accs}
    jj = Sym(j, "i32")

    def per_column(body):          # n and the locals of the loop's head, then ``body``, for each n_j
        return (Loop(j, c(0), m, (Declare(n, "i32", add(first, jj)),) + tuple(head) + tuple(body)),)

    def at_k(e, kk):
        return substitute_expr(e, {r.var: kk})

    def steps(var, start, stop, u):          # acc_col[n_j] += the values of steps u * var .. u * var + u - 1
        ks = [add(mul(Sym(var, "i32"), c(u)), c(i)) for i in range(u)]
        upd = []
        for a in r.accs:
            terms = [at_k(a.value, x) for x in ks]
            total = terms[0]
            for t in terms[1:]:
                total = Bin("add", total, t)
            upd.append(Store(col[a.name], jj, Bin(a.op, Load(col[a.name], jj, a.dtype), total)))
        return Loop(var, start, stop, per_column(upd))
    init = tuple(Array(col[a.name], a.dtype, chunk) for a in r.accs) + (
        Loop(j, c(0), m, tuple(Store(col[a.name], jj, a.init) for a in r.accs)),)
    if isinstance(r.start, Const) and isinstance(r.stop, Const) and r.start.value == 0:
        K = r.stop.value
        body = (steps(r.var, c(0), c(K // unroll), unroll),) if K >= unroll else ()
        if K % unroll:
            body += (steps(r.var, c(K - K % unroll), c(K), 1),)
    else:
        body = (steps(r.var, r.start, r.stop, 1),)
    tail = per_column(tuple(Declare(a.name, a.dtype, Load(col[a.name], jj, a.dtype)) for a in r.accs) + tuple(rest))
    chunks = Bin("idiv", add(Bin("sub", hi, lo), c(chunk - 1)), c(chunk))
    return Loop(blk, c(0), chunks, init + body + tail)


def plain(body):
    """``body`` in the statements every CPU pass knows: each Reduce a serial loop, each Attention
    its loops (``expand_attention``), Comments and Barriers dropped."""
    out = []
    for s in body:
        if isinstance(s, Reduce):
            out += serial_reduce(s)
        elif isinstance(s, Attention):
            out += plain(expand_attention(s))
        elif isinstance(s, (Comment, Barrier)):
            continue
        elif isinstance(s, Loop):
            out.append(replace(s, body=plain(s.body)))
        elif isinstance(s, If):
            out.append(If(s.cond, plain(s.then), plain(s.orelse)))
        else:
            out.append(s)
    return tuple(out)


# ----------------------------------------------------------------------------- attention on loops
ATT_QROWS = 16              # query rows of a prefill tile (times the query heads of a KV head)
ATT_KEYS = 64               # keys of a tile


def attention_tiles(a: Attention, threads: int = 1):
    """How the CPU cuts ``a`` into work items: (query rows per tile, keys per tile, context parts).
    Tiles of ``ATT_QROWS`` query rows (all of them when fewer) against ``ATT_KEYS`` keys; one
    query tile per KV head (decode) cuts the context into parts, enough for every one of
    ``threads`` threads to take the same number of items (two parts for 3 KV heads on 2 threads)."""
    qt = min(a.t, ATT_QROWS)
    items = a.hkv * -(-a.t // qt)
    return qt, ATT_KEYS, threads // math.gcd(items, threads) if items == a.hkv else 1


def expand_attention(a: Attention, qrows: int = 0, keys: int = 0, parts: int = 1):
    """``a`` as plain loops (the CPU's rendering): flash attention.  One parallel loop over work
    items (KV head, tile of ``qrows`` query rows, part of the context); an item takes the query
    heads that share its KV head (GQA) together, so each K/V row is read once per item, and walks
    tiles of ``keys`` keys with an online softmax (running max ``m``, sum ``l`` and unnormalized
    output rows ``o``).  Key tiles wholly after the item's last query row are not visited
    (causal); query tiles go in zigzag order (first, last, second, ...), so the contiguous runs of
    items that threads take carry equal work.  The scores of a tile loop over keys outside rows
    (a key's K row, converted to f32 once, serves every row), each a dot product along d.
    ``parts`` > 1 cuts the context of every item into that many runs of key tiles and leaves each
    part's ``m``, ``l`` and ``o`` in the shared arrays ``{out}_part_m``, ``_part_l``, ``_part_o``,
    declared first; ``combine_attention`` then merges them.  Without ``qrows``: tiles of one row
    and one key, the smallest local arrays (a loop-family kernel inlines attention this way, and
    on a GPU each thread holds them); ``codegen/llvm.py`` asks ``attention_tiles``."""
    if not qrows:
        qrows, keys, parts = 1, 1, 1
    p = f"{a.out}_"
    i32, f32 = (lambda n: Sym(p + n, "i32")), (lambda n: Sym(p + n, "f32"))  # noqa: E731
    G, D, T, S, qt, kt = a.hq // a.hkv, a.d, a.t, a.s, qrows, keys
    nq, R = -(-T // qt), G * qt                       # query tiles; rows of an item (head-major)
    item, kvh, j, pos, t0, tn = (i32(n) for n in ("item", "kvh", "j", "pos", "t0", "tn"))
    g, i, r, x, dd, k0, kn = (i32(n) for n in ("g", "i", "r", "key", "d", "k0", "kn"))
    neg_inf, zero = Const(float("-inf"), "f32"), Const(0.0, "f32")

    def ld(buf, index, dtype):    # a q, k or v element as f32
        return Load(buf, index, dtype) if dtype == "f32" else Cast(Load(buf, index, dtype), "f32")

    def at(arr, row, col=c(0), width=1):            # the item's local arrays, row-major
        return Load(p + arr, add(mul(row, c(width)), col), "f32")

    def put(arr, row, col, width, value):
        return Store(p + arr, add(mul(row, c(width)), col), value)

    def loop(var, stop, *body):
        return Loop(var.name, c(0), stop, tuple(body))

    def rows(*body):              # every row of the item: r = g * qt + i for the tile's rows i < tn
        return loop(g, c(G), loop(i, tn, Declare(r.name, "i32", add(mul(g, c(qt)), i)), *body))

    # the item: its KV head, then its query tile (zigzag) or its part of the context
    head = [Declare(kvh.name, "i32", Bin("idiv", item, c(nq * parts))),
            Declare(j.name, "i32", Bin("mod", item, c(nq * parts)))]
    tile = c(0)
    if nq > 1:
        half = Bin("idiv", j, c(2))
        tile = Select(Bin("eq", Bin("mod", j, c(2)), c(0)), half, Bin("sub", c(nq - 1), half))
    head += [Declare(pos.name, "i32", a.pos),
             Declare(t0.name, "i32", mul(tile, c(qt))),
             Declare(tn.name, "i32", c(T) if nq == 1 else Bin("min", c(qt), Bin("sub", c(T), t0))),
             Declare(p + "kend", "i32", add(add(pos, t0), tn)),       # the tile's rows see keys < kend
             Declare(p + "tiles", "i32", Bin("idiv", add(i32("kend"), c(kt - 1)), c(kt)))]
    lo, hi = c(0), i32("tiles")
    if parts > 1:
        lo, hi = (Bin("idiv", mul(i32("tiles"), add(j, c(n))), c(parts)) for n in (0, 1))
    qrow = add(mul(add(mul(kvh, c(G)), g), c(T)), add(t0, i))          # row (head, t) of q and out
    kv = add(mul(add(mul(kvh, c(S)), add(k0, x)), c(D)), dd)          # element d of the tile's key x

    arrays = (Array(p + "q", "f32", R * D), Array(p + "o", "f32", R * D), Array(p + "m", "f32", R),
              Array(p + "l", "f32", R), Array(p + "s", "f32", R * kt))
    init = rows(Store(p + "m", r, neg_inf), Store(p + "l", r, zero),
                loop(dd, c(D), put("q", r, dd, D, Bin("mul", ld(a.q, add(mul(qrow, c(D)), dd), a.dtypes[0]),
                                                     Const(a.scale, "f32"))),
                     put("o", r, dd, D, zero)))
    scores = loop(x, kn, rows(
        Reduce(dd.name, c(0), c(D), (Acc(p + "dot", "add", Bin("mul", at("q", r, dd, D), ld(a.k, kv, a.dtypes[1]))),)),
        put("s", r, x, kt, f32("dot"))))
    visible = Bin("le", add(k0, x), add(pos, add(t0, i)))            # causal: key k0 + x <= pos + t
    mn, ms = f32("mn"), f32("msafe")
    softmax = rows(
        Declare(p + "mt", "f32", neg_inf),
        loop(x, kn, put("s", r, x, kt, Select(visible, at("s", r, x, kt), neg_inf)),
             Assign(p + "mt", Bin("max", f32("mt"), at("s", r, x, kt)))),
        Declare(mn.name, "f32", Bin("max", at("m", r), f32("mt"))),
        Declare(ms.name, "f32", Select(Bin("eq", mn, neg_inf), zero, mn)),     # no visible key yet: 0
        Declare(p + "corr", "f32", Un("exp", Bin("sub", at("m", r), ms))),
        Declare(p + "sum", "f32", zero),
        loop(x, kn, put("s", r, x, kt, Un("exp", Bin("sub", at("s", r, x, kt), ms))),
             Assign(p + "sum", Bin("add", f32("sum"), at("s", r, x, kt)))),
        Store(p + "l", r, Bin("add", Bin("mul", at("l", r), f32("corr")), f32("sum"))),
        Store(p + "m", r, mn),
        loop(dd, c(D), put("o", r, dd, D, Bin("mul", at("o", r, dd, D), f32("corr")))),
        loop(x, kn, Declare(p + "pk", "f32", at("s", r, x, kt)),
             loop(dd, c(D), put("o", r, dd, D, Bin("add", at("o", r, dd, D),
                                                   Bin("mul", f32("pk"), ld(a.v, kv, a.dtypes[2])))))))
    tiles = Loop(p + "tile", lo, hi, (Declare(k0.name, "i32", mul(i32("tile"), c(kt))),
                                      Declare(kn.name, "i32", Bin("min", c(kt), Bin("sub", i32("kend"), k0))),
                                      scores, softmax))
    if parts > 1:                 # this part's rows, unnormalized, for combine_attention
        slot = add(mul(qrow, c(parts)), j)
        done = rows(Store(p + "part_m", slot, at("m", r)), Store(p + "part_l", slot, at("l", r)),
                    loop(dd, c(D), Store(p + "part_o", add(mul(slot, c(D)), dd), at("o", r, dd, D))))
        shared = tuple(Array(f"{p}part_{n}", "f32", a.hq * T * parts * w, "lds") for n, w in (("m", 1), ("l", 1), ("o", D)))
    else:
        done = rows(loop(dd, c(D), Store(a.out, add(mul(qrow, c(D)), dd), Bin("div", at("o", r, dd, D), at("l", r)))))
        shared = ()
    body = tuple(head) + arrays + (init, tiles, done)
    return shared + (Loop(item.name, c(0), c(a.hkv * nq * parts), body, parallel=True),)


def combine_attention(a: Attention, parts: int):
    """The output rows from the ``parts`` partial rows ``expand_attention`` left in ``{out}_part_m``,
    ``_part_l``, ``_part_o``: with M the largest part's max, out = sum_p o_p e^(m_p - M) /
    sum_p l_p e^(m_p - M) (an empty part has m = -inf and weighs 0)."""
    p = f"{a.out}_"
    row, x, dd = Sym(p + "row", "i32"), Sym(p + "part", "i32"), Sym(p + "d", "i32")
    slot = add(mul(row, c(parts)), x)
    m = Load(p + "part_m", slot, "f32")
    w = Un("exp", Bin("sub", m, Sym(p + "mmax", "f32")))
    body = (
        Declare(p + "mmax", "f32", Const(float("-inf"), "f32")),
        Loop(x.name, c(0), c(parts), (Assign(p + "mmax", Bin("max", Sym(p + "mmax", "f32"), m)),)),
        Declare(p + "lsum", "f32", Const(0.0, "f32")),
        Loop(x.name, c(0), c(parts), (Assign(p + "lsum", Bin("add", Sym(p + "lsum", "f32"),
                                                              Bin("mul", Load(p + "part_l", slot, "f32"), w))),)),
        Loop(dd.name, c(0), c(a.d), (
            Declare(p + "acc", "f32", Const(0.0, "f32")),
            Loop(x.name, c(0), c(parts), (Assign(p + "acc", Bin("add", Sym(p + "acc", "f32"), Bin(
                "mul", Load(p + "part_o", add(mul(slot, c(a.d)), dd), "f32"), w))),)),
            Store(a.out, add(mul(row, c(a.d)), dd), Bin("div", Sym(p + "acc", "f32"), Sym(p + "lsum", "f32"))))),
    )
    return (Loop(row.name, c(0), c(a.hq * a.t), body),)


# ----------------------------------------------------------------------------- printing
def format_expr(e):
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Sym):
        return e.name
    if isinstance(e, Hw):
        return f"%{e.name}"
    if isinstance(e, QLoad):
        return f"{e.fmt}({e.buf}[{format_expr(e.index)}])"
    if isinstance(e, Load):
        return f"{e.buf}[{format_expr(e.index)}]"
    if isinstance(e, QDot):
        return f"dot_{e.fmt}_q8_1({e.w}.block[{format_expr(e.block)}], {e.act}.block[{format_expr(e.ablock)}])"
    if isinstance(e, Un):
        return f"{e.op}({format_expr(e.x)})"
    if isinstance(e, Bin):
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.x)})"
    raise TypeError(e)


def _mapping(s):
    m = [] if s.map == "serial" else [s.map]
    if getattr(s, "vector", 1) > 1:
        m.append(f"vector={s.vector}")
    if s.split > 1:
        m.append(f"split={s.split}")
    if getattr(s, "lanes", 0):
        m.append(f"lanes={s.lanes}")
    if getattr(s, "order", "inner") != "inner":
        m.append(f"order={s.order}")
    return f" [{', '.join(m)}]" if m else ""


def format_kernel(k: Kernel) -> str:
    """Readable pseudo-code of a kernel (for debugging and reports)."""
    lines = [f"kernel {k.name} [{k.family}]("
             + ", ".join(f"{p.name}:{p.dtype}{list(p.shape) if p.kind == 'buffer' else ''}" for p in k.params) + ")"]
    if k.launch is not None:
        lines.append(f"  launch grid={k.launch.grid} block={k.launch.block} lds={k.launch.lds}: {k.launch.how}")

    def emit(body, ind):
        for s in body:
            pad = "  " * ind
            if isinstance(s, Loop):
                par = " parallel" if s.parallel else ""
                lines.append(f"{pad}for{par} {s.var} in [{format_expr(s.start)}, {format_expr(s.stop)}){_mapping(s)}:")
                emit(s.body, ind + 1)
            elif isinstance(s, Reduce):
                lines.append(f"{pad}reduce {s.var} in [{format_expr(s.start)}, {format_expr(s.stop)}){_mapping(s)}:")
                emit(s.body, ind + 1)
                for a in s.accs:
                    arg = f", {a.arg}" if a.arg else ""
                    lines.append(f"{pad}  {a.dtype} {a.name}{arg} = {a.op}({format_expr(a.value)})")
            elif isinstance(s, If):
                lines.append(f"{pad}if {format_expr(s.cond)}:")
                emit(s.then, ind + 1)
                if s.orelse:
                    lines.append(f"{pad}else:")
                    emit(s.orelse, ind + 1)
            elif isinstance(s, Declare):
                lines.append(f"{pad}{s.dtype} {s.name} = {format_expr(s.init)}")
            elif isinstance(s, Assign):
                lines.append(f"{pad}{s.name} = {format_expr(s.value)}")
            elif isinstance(s, Array):
                space = {"lds": " lds", "device": " device", "global": " global"}.get(s.space, "")
                lines.append(f"{pad}{s.dtype}{space} {s.name}[{s.size}]")
            elif isinstance(s, Arrive):
                lines.append(f"{pad}arrive {s.count} of {s.parts}: the last goes on")
            elif isinstance(s, Store):
                lines.append(f"{pad}{s.buf}[{format_expr(s.index)}] = {format_expr(s.value)}")
            elif isinstance(s, Barrier):
                lines.append(f"{pad}barrier")
            elif isinstance(s, Stamp):
                lines.append(f"{pad}stamp {s.step}")
            elif isinstance(s, Comment):
                lines.append(f"{pad}# {s.text}")
            elif isinstance(s, QuantizeQ8):
                vals = ", ".join(format_expr(v) for v in s.values)
                lines.append(f"{pad}{s.arr}.group[{format_expr(s.group)}] = q8_1({vals}) if {format_expr(s.active)}")
            elif isinstance(s, CopyQ8):
                lines.append(f"{pad}{s.dst}[0:{s.blocks}] = {s.src}[0:{s.blocks}]  # q8_1 blocks")
            elif isinstance(s, CopyF32):
                lines.append(f"{pad}{s.dst}[0:{s.n}] = {s.src}[0:{s.n}]  # 16 bytes at a time")
            elif isinstance(s, QuantizeStored):
                how = f"by its workgroup, from {s.staged}" if s.staged else "by its workgroup" if s.whole else "by arrival"
                x = f"{s.src}[0:{s.n}] * {s.scale}[0:{s.n}]" if s.scale else f"{s.src}[0:{s.n}]"
                ss = f"; {s.sumsq}[b] = sum of {s.src}^2 over block b" if s.sumsq else ""
                lines.append(f"{pad}{s.dst} = q8_1({x}){ss} {how} (rows {s.rows} per trip from "
                             f"{s.first}, {s.trips} trips)")
            elif isinstance(s, Attention):
                lines.append(f"{pad}{s.out} = attention({s.q}, {s.k}, {s.v}, pos={format_expr(s.pos)}, "
                             f"heads={s.hq}/{s.hkv}, t={s.t}, s={s.s}, d={s.d}, scale={s.scale!r})")
            elif isinstance(s, RingDot):
                lines.append(f"{pad}{s.sums}[slot, part] = partial dots of {format_expr(s.slots)} tiled rows (k={s.k}) "
                             f"with {s.act}, from the ring ({s.kc} columns a chunk, {s.rpt} rows a thread)")
            elif isinstance(s, RingProduce):
                lines.append(f"{pad}ring <- {format_expr(s.slots)} tiled rows from element {format_expr(s.first)} "
                             f"(k={s.k}, {s.kc} columns a chunk, {s.flight} in flight)")
    emit(k.body, 1)
    return "\n".join(lines)


def canonicalize(k: Kernel) -> Kernel:
    """The same kernel with parameters named p0, p1, ... and locals v0, v1, ... in order of
    appearance, without comments.  Kernels that differ only in names (the same layer, 30 times)
    become equal, so a backend compiles each distinct kernel once."""
    names = {p.name: f"p{i}" for i, p in enumerate(k.params)}

    def n(x):
        if x not in names:
            names[x] = f"v{len(names)}"
        return names[x]

    def ex(e):
        return rewrite_expr(e, lambda x: Sym(n(x.name), x.dtype) if isinstance(x, Sym)
                            else replace(x, buf=n(x.buf)) if isinstance(x, Load)
                            else replace(x, w=n(x.w), act=n(x.act)) if isinstance(x, QDot) else None)

    def strip(body):
        out = []
        for s in body:
            if isinstance(s, Comment):
                continue
            if isinstance(s, Loop):
                s = replace(s, body=strip(s.body))
            elif isinstance(s, If):
                s = If(s.cond, strip(s.then), strip(s.orelse))
            out.append(s)
        return tuple(out)
    params = tuple(Param(names[p.name], p.dtype, p.kind, p.shape, p.role) for p in k.params)
    body = rewrite(strip(k.body), ex, n)
    return Kernel("canonical", k.family, params, body, (), k.bytes, k.flops, (), k.launch)


ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "bool": 1,
            # bytes per element of the block formats (dsl/quant.py), and of a q8_1 activation with its
            # residual plane in LDS (32 int8 quants, 32 int8 residuals, f32 d and s: 72 bytes per 32)
            "q4_0": 18 / 32, "q4_1": 20 / 32, "q8_0": 34 / 32, "gptq_int4": 20 / 32,
            "q8_1r": 72 / 32,
            "q8_1": 40 / 32}               # without the residual plane (VEGAFUSE_QUANT_RESIDUAL=0)


def traffic(k: Kernel) -> int:
    """Bytes a kernel reads and writes per call: the sum of ``buffer_traffic``."""
    return int(sum(buffer_traffic(k).values()))


def buffer_traffic(k: Kernel) -> dict:
    """{buffer: bytes it moves per call}, estimated from the kernel's loops: each buffer moves the
    elements its accesses can reach (the product of the static extents of the loops around them),
    at most its size.  Loops with a runtime extent count as reaching the whole buffer.  Accesses
    through a gathered index (one holding a load or a scalar parameter: an expert's weights at a
    routed id, an embedding row) reach their own elements: two gathers of one buffer at different
    ids add up, and a gather is charged what it reaches, not the whole buffer.  The step loop of a
    loop-family kernel (a scan) moves its body's bytes once per step."""
    if k.family == "loop":
        steps = [s for s in k.body if isinstance(s, Loop) and any(isinstance(x, Barrier) for x in s.body)
                 and isinstance(s.start, Const) and isinstance(s.stop, Const)]
        rest = tuple(s for s in k.body if not any(s is x for x in steps))
        out = dict(buffer_traffic(replace(k, body=rest, family="")))
        for s in steps:
            for name, n in buffer_traffic(replace(k, body=s.body, family="")).items():
                out[name] = out.get(name, 0) + (s.stop.value - s.start.value) * n
        return out
    params = {p.name: p for p in k.params if p.kind == "buffer"}
    scalars = {p.name for p in k.params if p.kind == "scalar"}
    reach = {}                                     # buffer -> {gathered index: elements}, None: all

    def gather(index):
        return frozenset(x for x in walk_exprs(index) if isinstance(x, Load)
                         or (isinstance(x, Sym) and x.name in scalars))

    def touch(name, extent, index=None, rows=False):
        if name in params and reach.get(name, 0) is not None:
            if extent is None:
                reach[name] = None
            else:
                key = gather(index) if index is not None else frozenset()
                key = (key, index) if rows else key        # a reduction's accumulators at other rows add up
                seen = reach.setdefault(name, {})
                seen[key] = max(seen.get(key, 0), extent)

    def visit_expr(e, extent, rows=False):
        for x in walk_exprs(e):
            if isinstance(x, Load):
                touch(x.buf, extent, x.index, rows)
            elif isinstance(x, QDot):                      # a block: 32 elements per step
                touch(x.w, None if extent is None else extent * 32, x.block, rows)

    def trips(s, extent):
        n = s.stop.value - s.start.value if isinstance(s.stop, Const) and isinstance(s.start, Const) else None
        return extent * n if n is not None and extent is not None else None

    def visit(body, extent):
        for s in body:
            if isinstance(s, Loop):
                visit(s.body, trips(s, extent))
            elif isinstance(s, Reduce):                    # (a paired epilogue's rows j and j + h: two
                for a in s.accs:                           # accumulators over one weight)
                    visit_expr(a.value, trips(s, extent), len(s.accs) > 1)
            elif isinstance(s, If):
                visit_expr(s.cond, extent)
                visit(s.then, extent)
                visit(s.orelse, extent)
            elif isinstance(s, Store):
                touch(s.buf, extent, s.index)
                visit_expr(s.value, extent)
                visit_expr(s.index, extent)
            elif isinstance(s, (Declare, Assign)):
                visit_expr(s.init if isinstance(s, Declare) else s.value, extent)
            elif isinstance(s, QuantizeQ8):
                for v in s.values:
                    visit_expr(v, extent)
                touch(s.arr, None)                         # a buffer's q8_1 blocks (fusion/q8.py)
            elif isinstance(s, (CopyQ8, CopyF32)):
                touch(s.src, None)
            elif isinstance(s, QuantizeStored):
                for name in (s.src, s.dst, s.scale, s.sumsq):
                    if name:
                        touch(name, None)
            elif isinstance(s, Attention):
                for name in (s.q, s.k, s.v, s.out):
                    touch(name, None)

    def cap(name, keys):
        size = params[name].size
        return size if keys is None else min(size, sum(keys.values()))
    visit(k.body, 1)
    return {name: int(cap(name, keys) * ITEMSIZE[params[name].dtype]) for name, keys in reach.items()}
