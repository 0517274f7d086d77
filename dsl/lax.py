"""``dsl.lax``: the names of ``jax.lax`` we support (control flow, slicing, top-k).

Each function's docstring says where it differs from JAX.
"""
from __future__ import annotations

import builtins   # max, min, abs and pow below are jax.lax's elementwise ops (bound at import)

import numpy as np

from .core import DSLError, Lit, Var, bind, primitive, trace_subprogram, user_source

# ---- slicing and indexing
from . import array as _a  # noqa: E402
from .core import DSLError as _DSLError, PRIMITIVES as _P, bind as _bind, user_source as _where  # noqa: E402

# (jax.lax.slice is left out: named `slice`, it would hide the builtin in this module; x[a:b:s] is it)


def _starts(operand, start_indices, sizes, what):
    """The start indices as i32 scalars, each clamped so that ``sizes`` fit (JAX's rule)."""
    if not isinstance(start_indices, (list, tuple)) or len(start_indices) != operand.ndim:
        raise _DSLError(f"{_where()}: {what} needs one start index per dimension of the operand "
                        f"({operand.ndim}), got {start_indices!r}")
    out = []
    for s, n, m in zip(start_indices, sizes, operand.shape):
        if isinstance(s, _a.Tracer) and (s.shape != () or _a._dt(s) != "i32"):
            raise _DSLError(f"{_where()}: {what} start indices must be i32 scalars, got {s.dtype}{list(s.shape)}")
        if isinstance(s, _a.Tracer):
            out.append(_a._binary("max", _a._binary("min", s, m - n), 0))
        elif isinstance(s, int) and not isinstance(s, bool):
            out.append(builtins.min(builtins.max(int(s), 0), m - n))
        else:
            raise _DSLError(f"{_where()}: {what} start index {s!r} is not an int or a traced i32 scalar")
    return out


def slice_in_dim(operand, start_index, limit_index, stride=1, axis=0):
    """``operand[..., start:limit:stride, ...]`` along ``axis``, as ``jax.lax.slice_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    return operand[(slice(None),) * axis + (slice(start_index, limit_index, stride),)]


def index_in_dim(operand, index, axis=0, keepdims=True):
    """``operand``'s static element ``index`` along ``axis``, as ``jax.lax.index_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    y = operand[(slice(None),) * axis + (index,)]
    return _a.expand_dims(y, axis) if keepdims else y


def dynamic_slice(operand, start_indices, slice_sizes):
    """``operand[s0:s0+n0, s1:s1+n1, ...]`` at runtime starts (ints or traced i32 scalars), as
    ``jax.lax.dynamic_slice``: each start is clamped so the slice fits.  Inlined into the kernel
    that reads it (a load at shifted indices), never a copy."""
    operand = _a.asarray(operand)
    sizes = tuple(int(n) for n in slice_sizes)
    if len(sizes) != operand.ndim or any(not 0 < n <= m for n, m in zip(sizes, operand.shape)):
        raise _DSLError(f"{_where()}: dynamic_slice sizes {list(sizes)} do not fit operand {list(operand.shape)}")
    starts = _starts(operand, start_indices, sizes, "dynamic_slice")
    if all(isinstance(s, int) for s in starts):
        return _a.slice_(operand, starts, [s + n for s, n in zip(starts, sizes)])
    ids = []
    for d, (s, n) in enumerate(zip(starts, sizes)):
        i = _a.iota(sizes, d)
        ids.append(i if isinstance(s, int) and s == 0 else _a._binary("add", i, s))
    return _bind(_P["gather"], _a._float(operand), *ids)


def dynamic_update_slice(operand, update, start_indices):
    """``operand`` with ``update`` written at runtime starts, as ``jax.lax.dynamic_update_slice``
    (starts clamped so the update fits).  In place when ``operand`` is donated and nothing later
    reads it; otherwise a copy is written first."""
    return _a.dynamic_update_slice(operand, update, list(start_indices))


def dynamic_index_in_dim(operand, index, axis=0, keepdims=True):
    """``operand``'s element ``index`` (clamped) along ``axis``, as ``jax.lax.dynamic_index_in_dim``."""
    y = dynamic_slice_in_dim(operand, index, 1, axis)
    return y if keepdims else _a.reshape(y, tuple(d for k, d in enumerate(y.shape) if k != _a.normalize_axis(axis, y.ndim)))


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
    """``slice_size`` elements from ``start_index`` (clamped) along ``axis``, as ``jax.lax.dynamic_slice_in_dim``."""
    operand = _a.asarray(operand)
    axis = _a.normalize_axis(axis, operand.ndim)
    starts = [start_index if k == axis else 0 for k in range(operand.ndim)]
    return dynamic_slice(operand, starts, [slice_size if k == axis else n for k, n in enumerate(operand.shape)])


def dynamic_update_slice_in_dim(operand, update, start_index, axis):
    """``update`` written from ``start_index`` (clamped) along ``axis``, as ``jax.lax.dynamic_update_slice_in_dim``."""
    axis = _a.normalize_axis(axis, operand.ndim)
    return dynamic_update_slice(operand, update, [start_index if k == axis else 0 for k in range(operand.ndim)])


def dynamic_update_index_in_dim(operand, update, index, axis):
    """``update`` (without, or with a size-1, ``axis``) written at ``index`` (clamped) along ``axis``,
    as ``jax.lax.dynamic_update_index_in_dim``."""
    axis = _a.normalize_axis(axis, operand.ndim)
    update = _a.asarray(update)
    if update.ndim == operand.ndim - 1:
        update = _a.expand_dims(update, axis)
    return dynamic_update_slice_in_dim(operand, update, index, axis)


# ---- control flow
# ``scan`` is one primitive whose parameter ``body`` is a Program (a sub-program in the IR text).
# It has one equation per result (every equation has one output): ``out=i`` picks result i of
# (final carries..., stacked ys...); the equations of one scan share their body and inputs, which
# are (closure constants..., initial carries..., xs...).  Fusion lowers them to ONE kernel whose
# serial loop runs the body's fused code ``length`` times (``fusion/loops.py``).

def _scan_rule(avals, *, body, length, n_consts, n_carry, out, reverse=False):
    from .core import Program
    if not isinstance(body, Program):
        raise DSLError(f"body must be a program, got {type(body).__name__}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise DSLError(f"length must be a positive int, got {length!r}")
    if len(avals) != len(body.inputs):
        raise DSLError(f"takes {len(body.inputs)} operands (the body's inputs), got {len(avals)}")
    n_ys = len(body.outputs) - n_carry
    if not (0 <= n_consts and 0 <= n_carry <= len(body.outputs) and n_consts + n_carry <= len(avals)):
        raise DSLError(f"bad n_consts={n_consts}, n_carry={n_carry} for {len(avals)} operands")
    for i, ((s, d), v) in enumerate(zip(avals, body.inputs)):
        want = tuple(v.shape) if i < n_consts + n_carry else (length,) + tuple(v.shape)
        if (tuple(s), d) != (want, v.dtype):
            raise DSLError(f"operand {i} is {d}{list(s)}, the body needs {v.dtype}{list(want)}")
    for i in range(n_carry):
        c, o = body.inputs[n_consts + i], body.outputs[i]
        if (tuple(c.shape), c.dtype) != (tuple(o.shape), o.dtype):
            raise DSLError(f"carry {i} enters as {c.dtype}{list(c.shape)} and leaves as {o.dtype}{list(o.shape)}")
    if not 0 <= out < n_carry + n_ys:
        raise DSLError(f"out={out} is not one of the {n_carry + n_ys} results")
    o = body.outputs[out]
    return (tuple(o.shape) if out < n_carry else (length,) + tuple(o.shape)), o.dtype


def _scan_impl(*args, body, length, n_consts, n_carry, out, reverse=False):
    from .interpreter import run_scan
    return run_scan(body, list(args), length, n_consts, n_carry, reverse=reverse)[out]


SCAN = primitive("scan", "loop", _scan_rule, _scan_impl)


def _leaf_atom(x, what):
    from .array import Tracer
    if isinstance(x, Tracer):
        return x.var
    if isinstance(x, (bool, np.bool_)):
        return Lit(bool(x), "bool")
    if isinstance(x, (int, np.integer)):
        return Lit(int(x), "i32")
    if isinstance(x, (float, np.floating)):
        return Lit(float(x), "f32")
    raise DSLError(f"{user_source()}: {what} holds a {type(x).__name__}; use traced arrays or Python scalars "
                   "(numpy arrays are passed as arguments of the jitted function)")


def _static_int(x, what):
    from .array import Tracer
    if isinstance(x, Tracer):
        raise DSLError(f"{user_source()}: {what} is a traced value; loops need a static trip count "
                       "(a Python int, or a static argument of the jitted function)")
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise DSLError(f"{user_source()}: {what} must be a Python int, got {x!r}")
    return int(x)


def _types(atoms):
    return [f"{a.dtype}{list(a.shape)}" for a in atoms]


def scan(f, init, xs=None, length=None, reverse=False, unroll=1):
    """``jax.lax.scan``: ``carry, y = f(carry, x)`` for each ``x`` of ``xs`` along its leading
    axis; returns ``(final carry, stacked ys)``.  ``init``, ``xs`` and the ys are pytrees (dicts,
    lists, tuples, None) of traced arrays; a Python scalar in ``init`` or a y is a constant.
    The trip count is static: ``length`` (needed when ``xs`` is None) or the leading dim of ``xs``.

    ``f`` is traced once, as a sub-program (the body, printed in the IR), and the whole loop
    compiles to one kernel whose serial loop runs the body's fused code (``fusion/loops.py``): the
    IR and the kernel count do not grow with the trip count.  On GPUs that kernel runs on one
    workgroup (the steps are serial; each step's work spreads over its threads).
    ``reverse=True`` runs the steps from the last x to the first (``ys[i]`` still belongs to ``xs[i]``).
    Differs from JAX: ``unroll`` other than 1 is not supported (DSLError); a carry must keep its
    shape and dtype exactly (as in JAX: no weak-type promotion).
    Errors name the line that called ``scan``."""
    from .array import Tracer
    from .pytree import flatten, unflatten
    if unroll != 1:
        raise DSLError(f"{user_source()}: scan(unroll={unroll!r}) is not supported; leave unroll=1")
    c_leaves, c_tree = flatten(init)
    x_leaves, x_tree = flatten(xs)
    c_atoms = [_leaf_atom(c, "scan's init") for c in c_leaves]
    x_atoms = [_leaf_atom(x, "scan's xs") for x in x_leaves]
    if length is not None:
        length = _static_int(length, "scan's length")
    for a in x_atoms:
        if a.ndim == 0:
            raise DSLError(f"{user_source()}: scan's xs holds a scalar; every x needs a leading axis to scan over")
        if length is None:
            length = int(a.shape[0])
        if int(a.shape[0]) != length:
            raise DSLError(f"{user_source()}: scan's xs have leading dims {[x.shape[0] for x in x_atoms]}"
                           f"{'' if length is None else f' and length={length}'}; they must all equal the trip count")
    if length is None:
        raise DSLError(f"{user_source()}: scan with no xs needs length=")
    if length < 1:
        raise DSLError(f"{user_source()}: scan of length {length}; the trip count must be at least 1")
    nc = len(c_atoms)
    box = {}

    def body(*tracers):
        carry = unflatten(c_tree, list(tracers[:nc]))
        x = unflatten(x_tree, list(tracers[nc:]))
        res = f(carry, x)
        if not (isinstance(res, (tuple, list)) and len(res) == 2):
            raise DSLError(f"{user_source()}: the scan body must return a pair (carry, y), "
                           f"got {type(res).__name__}")
        new_leaves, new_tree = flatten(res[0])
        if new_tree != c_tree:
            raise DSLError(f"{user_source()}: the scan body returns a carry of another structure than init "
                           f"({new_tree} vs {c_tree})")
        box["y_tree"] = flatten(res[1])[1]
        return list(new_leaves) + list(flatten(res[1])[0])

    avals = [(a.shape, a.dtype) for a in c_atoms] + [(tuple(a.shape[1:]), a.dtype) for a in x_atoms]
    prog, captured, outs = trace_subprogram(body, avals)
    new_c = outs[:nc]
    bad = [i for i, (a, b) in enumerate(zip(c_atoms, new_c)) if (a.shape, a.dtype) != (tuple(b.shape), b.dtype)]
    if bad:
        i = bad[0]
        raise DSLError(f"{user_source()}: the scan body changes carry {i} from {_types([c_atoms[i]])[0]} to "
                       f"{_types([new_c[i]])[0]}; a carry keeps its shape and dtype (convert with .astype, "
                       "or broadcast the initial value)")
    operands = captured + c_atoms + x_atoms
    params = dict(body=prog, length=length, n_consts=len(captured), n_carry=nc, **({"reverse": True} if reverse else {}))
    res = [bind(SCAN, *[Tracer(a) if isinstance(a, Var) else a for a in operands], out=i, **params)
           for i in range(len(outs))]
    return unflatten(c_tree, res[:nc]), unflatten(box["y_tree"], res[nc:])


def fori_loop(lower, upper, body_fun, init_val, unroll=None):
    """``jax.lax.fori_loop``: ``val = body_fun(i, val)`` for ``i`` in ``range(lower, upper)``, with
    static Python int bounds (a traced bound is a DSLError: only static trip counts are supported).
    ``i`` is a traced i32 scalar.  One kernel loop, as ``scan`` (no loop when ``upper <= lower``)."""
    from .array import arange
    lower, upper = _static_int(lower, "fori_loop's lower"), _static_int(upper, "fori_loop's upper")
    if upper <= lower:
        return init_val
    idx = arange(upper - lower) + lower if lower else arange(upper - lower)
    carry, _ = scan(lambda c, i: (body_fun(i, c), None), init_val, idx)
    return carry


def map(f, xs):  # noqa: A001  (jax.lax.map)
    """``jax.lax.map``: ``f`` applied to each slice of ``xs`` (a pytree) along its leading axis, the
    results stacked: a scan without a carry, so one loop kernel running the slices in order.
    ``dsl.vmap(f)(xs)`` computes the same with batched ops instead (parallel, one kernel per op)."""
    return scan(lambda c, x: (c, f(x)), None, xs)[1]


def cond(pred, true_fun, false_fun, *operands):
    """``jax.lax.cond``.  A static predicate (a Python or numpy bool/int) calls one branch only.
    A traced predicate (a bool or int scalar, or any size-1 array) is a select: BOTH branches are
    traced and computed, and each result leaf is ``where(pred, t, f)`` (differs from JAX, which runs
    one branch: a branch's cost is always paid, and a branch must be safe to compute).  Both
    branches must return the same structure, shapes and dtypes."""
    from .array import Tracer, _dt, reshape, where
    from .pytree import flatten, unflatten
    if not isinstance(pred, Tracer):
        if not isinstance(pred, (bool, int, np.bool_, np.integer)) and not (
                isinstance(pred, np.ndarray) and pred.size == 1):
            raise DSLError(f"{user_source()}: cond's predicate must be a bool scalar, got {type(pred).__name__}")
        return true_fun(*operands) if bool(pred) else false_fun(*operands)
    if pred.size != 1:
        raise DSLError(f"{user_source()}: cond's predicate has shape {list(pred.shape)}; it must be a scalar "
                       "(for an elementwise choice use dsl.where)")
    p = reshape(pred, ())
    if _dt(p) != "bool":
        p = p != (0.0 if _dt(p) in ("f16", "f32") else 0)
    t_leaves, t_tree = flatten(true_fun(*operands))
    f_leaves, f_tree = flatten(false_fun(*operands))
    if t_tree != f_tree:
        raise DSLError(f"{user_source()}: cond's branches return different structures ({t_tree} vs {f_tree})")
    out = []
    for i, (a, b) in enumerate(zip(t_leaves, f_leaves)):
        sa, sb = (tuple(getattr(x, "shape", ())) for x in (a, b))
        da, db = (_dt(x) if isinstance(x, Tracer) else None for x in (a, b))
        if sa != sb or (da and db and da != db):
            raise DSLError(f"{user_source()}: cond's branches return {da or type(a).__name__}{list(sa)} and "
                           f"{db or type(b).__name__}{list(sb)} for output {i}; they must match")
        out.append(where(p, a, b))
    return unflatten(t_tree, out)


def while_loop(cond_fun, body_fun, init_val):
    """Not supported: loops need a static trip count.  Use ``fori_loop`` or ``scan``."""
    raise DSLError(f"{user_source()}: lax.while_loop is not supported (a data-dependent trip count); "
                   "use lax.fori_loop or lax.scan with a static trip count")

# ---- sorting and top-k
# (issue 9, item 4)
_RANK_SORT_MAX = 1024       # rows up to this long are ranked in one fused pass of comparisons (O(n^2))


def top_k(operand, k):
    """The ``k`` largest entries along the last axis, largest first: (values, indices i32), each
    [..., k], as ``jax.lax.top_k``.  Equal values come in index order; NaN counts as the largest.
    A row of at most 1024 entries is ranked by one fused pass of comparisons (O(n^2)); a longer
    one (a vocabulary) is cut into blocks of max(128, 4k), each block's top k kept, and the
    candidates (a quarter of the row or fewer) taken the same way: O(n max(128, 4k)) in all."""
    from . import numpy_api as N
    from .array import _dt
    from .core import DSLError, user_source
    x = N._tracer(operand)
    if x.ndim == 0:
        raise DSLError(f"{user_source()}: top_k needs an array of rank >= 1")
    n = x.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise DSLError(f"{user_source()}: top_k needs a static int k in [1, {n}], got {k!r}")
    xs = N._barrier(x.astype("int32") if _dt(x) == "bool" else x)     # compared with itself: the same bits
    vals, ids = _top_k_ranked(xs, N.full(xs.shape, 0, "int32") + N.arange(n), k)
    return (vals != 0 if _dt(x) == "bool" else vals), ids


def _lowest(x):
    from .array import _dt
    return float("-inf") if _dt(x) in ("f16", "f32") else -2 ** 31


def _top_k_ranked(x, ids, k):
    """Top k of rows ``x`` (..., n) whose entries have original indices ``ids``, both ordered by
    index: one rank pass, or blocks whose top k are ranked again (equal values keep index order,
    since the candidates stay in block order)."""
    from . import array as A
    from . import numpy_api as N
    n = x.shape[-1]
    block = builtins.max(128, 4 * k)
    nb = -(-n // block)
    if n <= _RANK_SORT_MAX or nb * k >= n:
        return _ranked(x, ids, k)
    if nb * block > n:          # pad with the lowest value, after every real entry
        pad = x.shape[:-1] + (nb * block - n,)
        x = A.concatenate([x, N.full(pad, _lowest(x), x.dtype)], axis=-1)
        ids = A.concatenate([ids, N.full(pad, n, "int32")], axis=-1)
    lead = x.shape[:-1]
    v, i = _ranked(x.reshape(lead + (nb, block)), ids.reshape(lead + (nb, block)), k)     # each block's top k
    return _top_k_ranked(v.reshape(lead + (nb * k,)), i.reshape(lead + (nb * k,)), k)


def _ranked(x, ids, k):
    """Top k of rows ``x`` by one pass of comparisons: (values, ``ids`` at them)."""
    from . import numpy_api as N
    rank = N._ranks(x, descending=True)
    return N._by_rank(rank, x, k), N._by_rank(rank, ids, k)


def optimization_barrier(operand):
    """``operand`` (an array, or a tuple or list of arrays) unchanged, each computed once into a
    buffer that every reader loads, as ``jax.lax.optimization_barrier``: fusion does not recompute
    it inside its consumers (whose loops may vectorize it differently, so that a value compared
    with itself could differ in its last bit)."""
    from . import numpy_api as N
    if isinstance(operand, (tuple, list)):
        return type(operand)(N._barrier(N._tracer(x)) for x in operand)
    return N._barrier(N._tracer(operand))


# ---- elementwise and structural ops under their jax.lax names
def _lax_names():
    """jax.lax's elementwise names for our primitives (``lax.rsqrt``, ``lax.logistic``, ``lax.max``
    (elementwise, not a reduction), ...), bound at import."""
    import dsl as D
    from . import numpy_api as N
    names = {"abs": D.abs, "add": D.add, "sub": D.sub, "mul": D.mul, "div": div, "rem": rem, "neg": D.neg,
             "exp": D.exp, "log": D.log, "sqrt": D.sqrt, "rsqrt": D.rsqrt, "tanh": D.tanh, "logistic": D.sigmoid,
             "sin": D.sin, "cos": D.cos, "floor": D.floor, "erf": D.erf, "log1p": D.log1p, "expm1": D.expm1,
             "max": D.maximum, "min": D.minimum, "pow": N.power, "eq": D.equal, "ne": D.not_equal,
             "lt": D.less, "le": D.less_equal, "gt": D.greater, "ge": D.greater_equal,
             "transpose": D.transpose, "concatenate": D.concatenate}
    return {k: v for k, v in names.items() if callable(v)}


def select(pred, on_true, on_false):
    """``jax.lax.select``: ``on_true`` where ``pred`` (bool, the operands' shape), else ``on_false``."""
    import dsl as D
    return D.where(pred, on_true, on_false)


def convert_element_type(operand, new_dtype):
    """``jax.lax.convert_element_type``: ``operand.astype(new_dtype)``."""
    import dsl as D
    return D.astype(operand, new_dtype)


def integer_pow(x, y):
    """``jax.lax.integer_pow``: ``x ** y`` for a static int ``y`` (repeated multiplication)."""
    from . import numpy_api as N
    return N.power(x, int(y))


def square(x):
    """``jax.lax.square``: ``x * x``."""
    return x * x


def iota(dtype, size):
    """``jax.lax.iota``: 0, 1, ..., size - 1 of ``dtype`` (``dsl.iota(shape, dimension)`` is the
    n-dimensional form)."""
    import dsl as D
    return D.arange(size).astype(dtype)


def _same_dtype(x, y, what):
    from .array import Tracer, _dt, _promote_pair
    x, y = _promote_pair(x, y)
    if isinstance(x, Tracer) and isinstance(y, Tracer) and _dt(x) != _dt(y):
        raise DSLError(f"{user_source()}: lax.{what} needs operands of one dtype, got {_dt(x)} and {_dt(y)}; "
                       "convert with lax.convert_element_type")
    return x, y


def div(x, y):
    """``jax.lax.div``: ``x / y``; on integers it rounds toward zero (C's division, not numpy's
    floor: ``lax.div(-5, 2)`` is -2) and keeps the dtype.  An integer division by 0 gives 0."""
    from .array import _binary, _dt
    x, y = _same_dtype(x, y, "div")
    return _binary("idiv" if _dt(x) in ("i32", "bool") else "div", x, y)


def rem(x, y):
    """``jax.lax.rem``: the remainder of ``lax.div`` (C's ``fmod``: the sign of ``x``).  An integer
    remainder by 0 gives 0."""
    from .array import _binary
    return _binary("mod", *_same_dtype(x, y, "rem"))


def reshape(operand, new_sizes, dimensions=None):
    """``jax.lax.reshape``: ``operand`` (first transposed by ``dimensions`` when given) in the
    shape ``new_sizes``."""
    import dsl as D
    if dimensions is not None:
        operand = D.transpose(operand, tuple(dimensions))
    return D.reshape(operand, tuple(new_sizes))
