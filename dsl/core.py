"""The traced IR: ``Var``, ``Lit``, ``Eqn``, ``Program``, and the tracer that builds them.

A program is a typed list of SSA equations, in the spirit of a jaxpr::

    { lambda a:f32[4,8] b:i32[] ;
      let c:f32[4,8] = mul a a
          d:f32[4] = reduce_sum c
      in ( d ) }

Every equation has exactly one output.  Shapes are static; runtime integers
(such as the decode position) are inputs of shape ``()``.
"""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field

import numpy as np

DTYPES = ("f32", "f16", "i32", "bool")
NP_DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "bool": np.bool_, "f64": np.float64}
FLOATS = ("f16", "f32", "f64")
_RANK = {"bool": 0, "i32": 1, "f16": 2, "f32": 3, "f64": 4}


class DSLError(Exception):
    """A user error found while tracing; the message starts with the user's ``file:line``."""


QUANT_DTYPES = ("q4_0", "q4_1", "q8_0", "gptq_int4")   # quantized weights (dsl/quant.py): read through dequantize


def dtype_of(x) -> str:
    """Our dtype name for a numpy array or dtype, or a quantized array (``dsl.QArray``: "q4_0",
    "q4_1", "q8_0", "gptq_int4"); raises DSLError for unsupported dtypes.  A bfloat16 array
    (``ml_dtypes.bfloat16``) is a storage dtype: it is traced as f32 and converted on load; float64
    and int64 arrays are traced as f32 and i32 (JAX's default without x64)."""
    d = getattr(x, "dtype", x)
    try:
        return _DTYPE_NAMES[d]                 # a dtype met before (every call of a jitted function
    except (KeyError, TypeError):              # looks up each leaf's: hundreds of weights)
        pass
    name = _dtype_name(d)
    try:
        _DTYPE_NAMES[d] = name
    except TypeError:
        pass
    return name


_DTYPE_NAMES: dict = {}


def _dtype_name(d) -> str:
    if d in QUANT_DTYPES:
        return d
    dt = np.dtype(d)
    if dt.name == "bfloat16":
        return "f32"
    if dt in (np.float64, np.int64):          # as JAX without x64: float32 and int32, converted on load
        return "f32" if dt == np.float64 else "i32"
    for name in DTYPES:
        if dt == np.dtype(NP_DTYPES[name]):
            return name
    raise DSLError(f"unsupported dtype {dt}; use one of {', '.join(DTYPES)}")


# ---- numpy dtypes (item 1 of issue 9: arrays and dtypes)
_DTYPE_ALIASES = {"f32": "f32", "f16": "f16", "i32": "i32", "bool": "bool", "f64": "f64"}


def dtype_name(dtype, what="dtype") -> str:
    """Our dtype name ("f32", "f16", "i32", "bool", or a quantized format) for anything numpy
    accepts as a dtype: our names, numpy names and codes ('float32', 'f4', 'int32'), numpy types
    and dtype objects (``np.float16``, ``np.dtype('bool')``) and Python's ``float``, ``int`` and
    ``bool`` (float32 and int32 here, as in JAX without x64).  ``bfloat16`` (``ml_dtypes``) is a
    storage dtype only: DSLError, like any other dtype the kernels do not compute in."""
    if isinstance(dtype, str) and (dtype in _DTYPE_ALIASES or dtype in QUANT_DTYPES):
        return dtype
    if dtype is float:
        return "f32"
    if dtype is int:
        return "i32"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise DSLError(f"{user_source()}: {what} {dtype!r} is not a dtype; use one of "
                       "'float32', 'float16', 'int32', 'bool' (or numpy's types)") from None
    if dt.name == "bfloat16":
        raise DSLError(f"{user_source()}: bfloat16 is a storage dtype only (bf16 inputs are converted to f32 "
                       "on load); compute in float32 or float16")
    if dt == np.int64:          # Python ints and numpy's default int: int32, as in JAX without x64
        return "i32"
    if dt == np.float64:
        return "f32"
    for name in DTYPES:
        if dt == np.dtype(NP_DTYPES[name]):
            return name
    raise DSLError(f"{user_source()}: {what} {dt} is not supported; use one of float32, float16, int32, bool")


def np_dtype(name: str):
    """The numpy dtype object of our dtype name ("f32" -> np.dtype('float32')); a quantized format
    has no numpy dtype and stays its name ("q4_0")."""
    return name if name in QUANT_DTYPES else np.dtype(NP_DTYPES[name])


def promote(a: str, b: str) -> str:
    """The dtype two operands compute in (numpy's order: bool < i32 < f16 < f32 < f64)."""
    if a in QUANT_DTYPES or b in QUANT_DTYPES:
        raise DSLError(f"{user_source()}: a {a if a in QUANT_DTYPES else b} array is quantized; read it through "
                       "dsl.dequantize (linear, dot_t, matmul, take and astype do that for you)")
    return a if _RANK[a] >= _RANK[b] else b


@dataclass(eq=False)
class Var:
    """An SSA value of static ``shape`` and ``dtype``.  Hashed by identity."""
    shape: tuple
    dtype: str

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def __call__(self, *args, **kwargs):
        # a traced array's ``x.var`` is this Var: ``x.var(axis)`` (numpy's variance method) lands here
        raise DSLError(f"{user_source()}: x.var(...) is not the variance here (x.var is the traced IR variable); "
                       "use dsl.var(x, axis) or x.std(axis) ** 2")


@dataclass(frozen=True)
class Lit:
    """A scalar literal, printed as ``2.0:f32``."""
    value: object
    dtype: str
    shape: tuple = ()

    @property
    def ndim(self):
        return 0


@dataclass(eq=False)
class Eqn:
    prim: "Primitive"
    inputs: list
    params: dict
    out: Var
    source: str = ""              # "stdlib/llama.py:21": the model's (or user's) line that traced it
    scope: tuple = ()             # building-block functions it was traced inside: ("rms_norm",)


@dataclass
class Program:
    """Inputs, equations in topological order, outputs (Vars or Lits)."""
    inputs: list
    eqns: list
    outputs: list
    meta: dict = field(default_factory=dict)

    def as_text(self) -> str:
        from .irtext import print_program
        return print_program(self)

    def __str__(self):
        return self.as_text()

    def run(self, *args, compute_dtype=None):
        """Evaluate with the numpy reference interpreter (see ``dsl.interpreter``)."""
        from .interpreter import run_program
        return run_program(self, list(args), compute_dtype=compute_dtype)


# ----------------------------------------------------------------------------- primitives
@dataclass(eq=False)
class Primitive:
    """One primitive, defined in one place.

    ``rule(avals, **params) -> (shape, dtype)`` checks inputs and gives the output type;
    ``impl(*arrays, **params) -> np.ndarray`` is the numpy reference;
    ``kind`` is the fusion class: elementwise | view | index | reduce | contract | opaque.
    """
    name: str
    kind: str
    rule: object
    impl: object

    def __repr__(self):
        return self.name


PRIMITIVES: dict = {}


def primitive(name, kind, rule, impl):
    p = Primitive(name, kind, rule, impl)
    PRIMITIVES[name] = p
    return p


# ----------------------------------------------------------------------------- tracing
_DSL_DIR = os.path.dirname(os.path.abspath(__file__))


_ROOT = os.path.dirname(_DSL_DIR)
# Modules of building blocks (ours, and jax.nn's names): an op traced inside one is attributed to
# the line that called it (the model's line), and the block's public function names become the
# op's ``scope`` (kernel names: ``layer_norm_matmul_p_w_fc_add_gelu``).
BUILDING_BLOCKS = (os.path.join(_ROOT, "stdlib", "nn.py"), os.path.join(_DSL_DIR, "nn.py"))
MAX_ELEMENTS = 2 ** 31 - 1          # kernels index with 32-bit integers


def _relpath(fn):
    """Project files relative to the project root (``stdlib/llama.py``), others to the cwd."""
    if fn.startswith("<"):
        return fn
    return os.path.relpath(fn, _ROOT if fn.startswith(_ROOT + os.sep) else os.curdir)


def _site():
    """(source, scope, inner) of the op being traced: ``source`` is ``file:line`` of the innermost
    frame outside ``dsl/`` and the building blocks; ``scope`` the building-block functions it was
    traced inside, outermost first; ``inner`` the ``file:line`` inside the innermost of them."""
    f, scope, inner = sys._getframe(1), [], None
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn in BUILDING_BLOCKS:
            if not f.f_code.co_name.startswith(("<", "_")):    # private helpers are not blocks
                scope.append(f.f_code.co_name)
            inner = inner or f"{_relpath(fn)}:{f.f_lineno}"
        elif not fn.startswith(_DSL_DIR + os.sep):
            return f"{_relpath(fn)}:{f.f_lineno}", tuple(reversed(scope)), inner
        f = f.f_back
    return inner or "<unknown>", tuple(reversed(scope)), None


def user_source() -> str:
    """``file:line`` of the user's line (the innermost frame outside ``dsl/`` and the building
    blocks), for error messages.  When the error happens inside a building block, its line
    follows: ``model.py:12 (in stdlib/nn.py:39)``."""
    src, _, inner = _site()
    return src if inner is None else f"{src} (in {inner})"


def source_text(eqn) -> str:
    """The equation's source line with its text: ``stdlib/llama.py:21  q = linear(h, p["wq"])``
    (just ``file:line`` when the file cannot be read)."""
    path, _, line = eqn.source.rpartition(":")
    if not path or not line.isdigit():
        return eqn.source
    full = path if os.path.isabs(path) else os.path.join(_ROOT, path)
    if not os.path.exists(full):
        full = os.path.abspath(path)
    text = linecache.getline(full, int(line)).strip()
    return f"{eqn.source}  {text}" if text else eqn.source


def check_shape(shape, where):
    """Reject zero-size arrays and arrays too large for 32-bit indexing (DSLError)."""
    n = 1
    for d in shape:
        n *= int(d)
    if any(int(d) <= 0 for d in shape):
        raise DSLError(f"{where}: zero-size or negative shape {list(shape)} is not supported")
    if n > MAX_ELEMENTS:
        raise DSLError(f"{where}: shape {list(shape)} has {n} elements; kernels index with 32 bits, "
                       f"so at most {MAX_ELEMENTS} are supported")


class Trace:
    """Collects equations while a function is traced."""
    def __init__(self):
        self.eqns = []


_TRACES: list = []


def current_trace() -> Trace:
    if not _TRACES:
        raise DSLError("DSL operations need a traced function: wrap it in dsl.jit")
    return _TRACES[-1]


def bind(prim: Primitive, *inputs, **params):
    """Apply ``prim`` to tracers/literals, check types, record the equation, return a Tracer."""
    from .array import Tracer
    src, scope, inner = _site()
    where = src if inner is None else f"{src} (in {inner})"
    atoms = [x.var if isinstance(x, Tracer) else x for x in inputs]
    quant = [a for a in atoms if a.dtype in QUANT_DTYPES]
    if quant and prim.name != "dequantize":
        a = next((a for a in quant if isinstance(a, Var)), quant[0])     # not a literal promoted to it
        raise DSLError(f"{where}: {prim.name}: a {a.dtype}{list(a.shape)} array is quantized; read it through "
                       "dsl.dequantize (linear, dot_t, matmul, take and astype do that for you)")
    try:
        shape, dtype = prim.rule([(a.shape, a.dtype) for a in atoms], **params)
    except DSLError as e:
        raise DSLError(f"{where}: {prim.name}: {e}") from None
    out = Var(tuple(int(d) for d in shape), dtype)
    check_shape(out.shape, f"{where}: {prim.name}")
    current_trace().eqns.append(Eqn(prim, atoms, params, out, src, scope))
    return Tracer(out)


def trace_call(fn, args, kwargs, refuse):
    """Call ``fn(*args, **kwargs)`` (tracers among them) in a trace of its own: returns ``(trace,
    atoms, tree)``, the output pytree's leaves as atoms (a Tracer's Var; a Python or numpy scalar
    as a Lit of its dtype) and its structure.  Any other leaf raises DSLError(``refuse(leaf)``)."""
    from .array import Tracer
    from .pytree import flatten
    trace = Trace()
    _TRACES.append(trace)
    try:
        out = fn(*args, **kwargs)
    finally:
        _TRACES.pop()
    leaves, tree = flatten(out)
    atoms = []
    for x in leaves:
        if isinstance(x, Tracer):
            atoms.append(x.var)
        elif isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating)):
            d = "bool" if isinstance(x, (bool, np.bool_)) else "i32" if isinstance(x, (int, np.integer)) else "f32"
            atoms.append(Lit(bool(x) if d == "bool" else int(x) if d == "i32" else float(x), d))
        else:
            raise DSLError(refuse(x))
    return trace, atoms, tree


# ----------------------------------------------------------------------------- sub-programs (control flow)
def trace_subprogram(fn, avals):
    """Trace ``fn(*tracers)`` on fresh inputs of ``avals`` [(shape, dtype)] as a Program of its own
    (the body of a loop primitive).  Values of the enclosing trace that ``fn`` reads (closures)
    become extra inputs placed first: returns ``(program, captured, out)`` where ``captured`` are
    the enclosing trace's Vars to pass for them and ``out`` is what ``fn`` returned, its traced
    leaves replaced by the program's output atoms (Var or Lit)."""
    from .array import Tracer
    from .pytree import unflatten
    ins = [Var(tuple(s), d) for s, d in avals]
    trace, atoms, tree = trace_call(fn, [Tracer(v) for v in ins], {}, lambda x: (
        f"{user_source()}: a loop body returned {type(x).__name__}; return traced arrays "
        "(numpy arrays are passed as arguments of the jitted function)"))
    defined = set(ins) | {e.out for e in trace.eqns}
    captured = {}
    for e in trace.eqns:
        for a in e.inputs:
            if isinstance(a, Var) and a not in defined and a not in captured:
                captured[a] = Var(a.shape, a.dtype)
    for a in atoms:
        if isinstance(a, Var) and a not in defined and a not in captured:
            captured[a] = Var(a.shape, a.dtype)
    for e in trace.eqns:
        e.inputs = [captured.get(a, a) if isinstance(a, Var) else a for a in e.inputs]
    atoms = [captured.get(a, a) if isinstance(a, Var) else a for a in atoms]
    prog = Program(list(captured.values()) + ins, trace.eqns, atoms)
    return prog, list(captured), unflatten(tree, atoms)


def loop_key(e) -> tuple:
    """The equations of one loop (one per result) share this key: the body and the operands."""
    return (id(e.params["body"]),) + tuple(("lit", a.value, a.dtype) if isinstance(a, Lit) else id(a)
                                           for a in e.inputs)
