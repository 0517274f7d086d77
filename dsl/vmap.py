"""``dsl.vmap``: map a function over a leading batch axis, by batching rules per primitive.

``f`` is traced once on one example (a sub-program), then each equation is re-emitted for the
whole batch by its primitive's rule, with the batch axis first:

* elementwise ops: unbatched operands are broadcast, the op is applied as it is;
* views (reshape, broadcast, transpose, slice, concatenate): the parameters gain the batch axis;
* reductions (over the last axis): unchanged;
* dot: a batched matmul; a shared weight is broadcast (a view: the kernel reads the one weight);
* attention: the batch folds into the heads (q [B*Hq, T, D] against k, v [B*Hkv, S, D]);
* take: a gather from the flattened batch of rows;
* dynamic_update_slice with static-per-batch offsets: one update of the batched operand;
* scan: the body is batched (every carry batched, xs scanned over their second axis): still one
  loop kernel.

Any other case (a primitive without a rule, batched offsets or positions, a quantized weight)
falls back to one copy of the op per batch index, stacked: B ops instead of one, which the
docstring of ``vmap`` states.  Values that do not depend on a batched input are not batched.
"""
from __future__ import annotations

import numpy as np

from .core import PRIMITIVES as P, DSLError, Lit, _TRACES, bind, current_trace, loop_key, trace_subprogram, user_source
from .pytree import flatten, unflatten


def vmap(f, in_axes=0, out_axes=0):
    """``jax.vmap`` over one axis.  ``in_axes``: an int or None for every argument, or a tuple
    with one int/None per positional argument (applied to each leaf of that argument); a batched
    axis other than 0 is moved first (a transpose).  ``out_axes``: an int (where the batch axis
    goes in every output) or None (outputs must not depend on batched inputs).  Keyword
    arguments are not batched.

    Called inside ``dsl.jit`` it traces; called on numpy arrays it jits and runs ``vmap(f)``.
    Differs from JAX: no ``axis_name``/``spmd_axis_name``; ``in_axes`` entries do not descend
    into pytrees (one axis per argument); primitives without a batching rule (and batched
    offsets of dynamic_update_slice, a batched attention position) run once per batch index and
    are stacked, which costs B ops instead of one."""
    eager = {}                                          # keyword arguments -> the jitted mapped function

    def batched(*args, **kwargs):
        if not _TRACES:                                 # eager call: jit the mapped function (once)
            from .jit import jit
            key = tuple(sorted(kwargs.items()))
            try:
                hash(key)
            except TypeError:
                key = None
            j = eager.get(key) if key is not None else None
            if j is None:
                j = jit(lambda *a: _vmap_call(f, in_axes, out_axes, a, kwargs))
                if key is not None:
                    eager[key] = j
            return j(*args)
        return _vmap_call(f, in_axes, out_axes, args, kwargs)
    batched.__name__ = f"vmap_{getattr(f, '__name__', 'f')}"
    batched.__doc__ = getattr(f, "__doc__", None)
    return batched


def _axis_list(in_axes, n):
    if in_axes is None or isinstance(in_axes, (int, np.integer)) and not isinstance(in_axes, bool):
        return [in_axes] * n
    if isinstance(in_axes, (tuple, list)):
        if len(in_axes) != n:
            raise DSLError(f"{user_source()}: vmap in_axes has {len(in_axes)} entries for {n} arguments; "
                           "give one int or None per positional argument")
        for a in in_axes:
            if not (a is None or isinstance(a, (int, np.integer)) and not isinstance(a, bool)):
                raise DSLError(f"{user_source()}: vmap in_axes entries must be ints or None (one per argument, "
                               f"not nested), got {a!r}")
        return list(in_axes)
    raise DSLError(f"{user_source()}: vmap in_axes must be an int, None or a tuple of them, got {in_axes!r}")


def _vmap_call(f, in_axes, out_axes, args, kwargs):
    from .array import Tracer, _dt, asarray
    axes = _axis_list(in_axes, len(args))
    leaves, flags, trees, sizes = [], [], [], []
    for i, (a, ax) in enumerate(zip(args, axes)):
        ls, tree = flatten(a)
        trees.append(tree)
        for x in ls:
            x = asarray(x) if isinstance(x, (Tracer, bool, int, float, np.number)) else x
            if not isinstance(x, (Tracer, Lit)):
                asarray(x)                              # raises the usual error for a numpy array
            if ax is not None:
                if x.ndim == 0:
                    raise DSLError(f"{user_source()}: vmap in_axes={ax} for argument {i}, a scalar; "
                                   "use in_axes=None for it")
                if not -x.ndim <= ax < x.ndim:
                    raise DSLError(f"{user_source()}: vmap in_axes={ax} is out of range for argument {i} of "
                                   f"shape {list(x.shape)}")
                x = _to_front(x, ax % x.ndim)
                sizes.append((i, int(x.shape[0])))
            leaves.append(x)
            flags.append(ax is not None)
    if not sizes:
        raise DSLError(f"{user_source()}: vmap needs at least one batched argument (in_axes all None)")
    if len({n for _, n in sizes}) > 1:
        raise DSLError(f"{user_source()}: vmap got batch sizes {', '.join(f'{n} (argument {i})' for i, n in sizes)}"
                       "; the mapped axes must have one size")
    B = sizes[0][1]
    counts = [len(flatten(a)[0]) for a in args]

    def example(*tracers):
        it, rebuilt = iter(tracers), []
        for tree, n in zip(trees, counts):
            rebuilt.append(unflatten(tree, [next(it) for _ in range(n)]))
        return f(*rebuilt, **kwargs)
    avals = [(tuple(x.shape[1:]) if b else tuple(x.shape), _dt(x)) for x, b in zip(leaves, flags)]
    prog, captured, out = trace_subprogram(example, avals)
    ins = [(Tracer(v), False) for v in captured] + list(zip(leaves, flags))
    res = batch_program(prog, ins, B)
    out_leaves, out_tree = flatten(out)
    if isinstance(out_axes, (tuple, list)):
        top = out if isinstance(out, (tuple, list)) else (out,)
        if len(out_axes) != len(top):
            raise DSLError(f"{user_source()}: vmap out_axes has {len(out_axes)} entries for {len(top)} outputs")
        per = [ax for ax, o in zip(out_axes, top) for _ in flatten(o)[0]]
    else:
        per = [out_axes] * len(out_leaves)
    final = []
    for (v, b), ax in zip(res, per):
        if ax is None:
            if b:
                raise DSLError(f"{user_source()}: vmap out_axes=None for an output that depends on the batch")
            final.append(v)
            continue
        v = v if b else _broadcast_batch(v, B)
        if isinstance(v, Lit):
            v = _broadcast_batch(v, B)
        nd = len(v.shape)
        if not -nd <= ax < nd:
            raise DSLError(f"{user_source()}: vmap out_axes={ax} is out of range for an output of rank {nd}")
        from .array import transpose
        ax %= nd
        final.append(v if ax == 0 else transpose(v, list(range(1, ax + 1)) + [0] + list(range(ax + 1, nd))))
    return unflatten(out_tree, final)


def _to_front(x, ax):
    """``x`` with axis ``ax`` moved first (a transpose view)."""
    from .array import transpose
    return x if ax == 0 else transpose(x, [ax] + [i for i in range(x.ndim) if i != ax])


# ----------------------------------------------------------------------------- the batching interpreter
def _shape(a):
    return tuple(a.shape)


def _broadcast_batch(a, B):
    """``a`` (unbatched: a Tracer or a Lit) repeated along a new leading axis of size B."""
    s = _shape(a)
    return bind(P["broadcast_in_dim"], a, shape=(B,) + s, dims=tuple(range(1, len(s) + 1)))


def batch_program(prog, ins, B):
    """Re-emit ``prog`` for a batch of B: ``ins`` are (value, batched) per input, a batched value
    having the batch axis first; returns (value, batched) per output."""
    env = dict(zip(prog.inputs, ins))
    done = {}                                           # a scan's results, shared by its equations

    def read(a):
        return (a, False) if isinstance(a, Lit) else env[a]
    for e in prog.eqns:
        vals = [read(a) for a in e.inputs]
        start = len(current_trace().eqns)
        if not any(b for _, b in vals):
            env[e.out] = (bind(e.prim, *[v for v, _ in vals], **e.params), False)
        elif e.prim.kind == "loop":
            key = loop_key(e)
            if key not in done:
                done[key] = _scan_rule(e, vals, B)
            env[e.out] = (done[key][e.params["out"]], True)
        else:
            rule = RULES.get(e.prim.name) or (_elementwise if e.prim.kind == "elementwise" else _unstacked)
            env[e.out] = (rule(e, vals, B), True)
        for new in current_trace().eqns[start:]:       # the user's line and scope, not vmap's
            new.source, new.scope = e.source, e.scope
    return [read(o) for o in prog.outputs]


def _all_batched(vals, B):
    return [v if b else _broadcast_batch(v, B) for v, b in vals]


def _elementwise(e, vals, B):
    return bind(e.prim, *_all_batched(vals, B), **e.params)


def _reshape(e, vals, B):
    return bind(e.prim, vals[0][0], shape=(B,) + tuple(e.params["shape"]))


def _broadcast(e, vals, B):
    p = e.params
    return bind(e.prim, vals[0][0], shape=(B,) + tuple(p["shape"]), dims=(0,) + tuple(d + 1 for d in p["dims"]))


def _transpose(e, vals, B):
    return bind(e.prim, vals[0][0], perm=(0,) + tuple(p + 1 for p in e.params["perm"]))


def _slice(e, vals, B):
    p = e.params
    return bind(e.prim, vals[0][0], start=(0,) + tuple(p["start"]), limit=(B,) + tuple(p["limit"]))


def _concatenate(e, vals, B):
    return bind(e.prim, *_all_batched(vals, B), axis=e.params["axis"] + 1)


def _same(e, vals, B):
    """Reductions over the last axis: the batch axis is just another row."""
    return bind(e.prim, vals[0][0], **e.params)


def _reshape_to(x, shape):
    return x if _shape(x) == tuple(shape) else bind(P["reshape"], x, shape=tuple(shape))


def _dot(e, vals, B):
    """A batched matmul; a shared weight is a broadcast view (read in place, never copied), so the
    kernel is one matmul whose rows are the batch's and whose epilogue still fuses."""
    return bind(e.prim, *_all_batched(vals, B), **e.params)


def _attention(e, vals, B):
    (q, k, v, pos) = [x for x, _ in vals]
    if vals[3][1]:
        return _unstacked(e, vals, B)                    # a position per batch index
    q, k, v = _all_batched(vals[:3], B)
    sq, sk = _shape(q), _shape(k)
    y = bind(e.prim, _reshape_to(q, (B * sq[1],) + sq[2:]), _reshape_to(k, (B * sk[1],) + sk[2:]),
             _reshape_to(v, (B * sk[1],) + sk[2:]), pos, **e.params)
    return _reshape_to(y, (B,) + sq[1:])


def _take(e, vals, B):
    (x, bx), (ids, bi) = vals
    if not bx:                                          # shared rows, a batch of indices
        return bind(e.prim, x, ids, **e.params)
    x = x if bx else _broadcast_batch(x, B)
    ids = ids if bi else _broadcast_batch(ids, B)
    sx, si = _shape(x), _shape(ids)
    V = sx[1]
    lo, hi = Lit(0, "i32"), Lit(V - 1, "i32")
    full = lambda c: bind(P["broadcast_in_dim"], c, shape=si, dims=())   # noqa: E731
    ids = bind(P["max"], full(lo), bind(P["min"], ids, full(hi)))         # clamp, as take does
    base = bind(P["mul"], bind(P["iota"], shape=si, dimension=0, dtype="i32"), full(Lit(V, "i32")))
    return bind(e.prim, _reshape_to(x, (B * V,) + sx[2:]), bind(P["add"], ids, base), **e.params)


def _dynamic_update_slice(e, vals, B):
    if any(b for _, b in vals[2:]):
        return _unstacked(e, vals, B)                    # offsets per batch index
    x, u = _all_batched(vals[:2], B)
    return bind(e.prim, x, u, Lit(0, "i32"), *[v for v, _ in vals[2:]], **e.params)


def _scan_rule(e, vals, B):
    """A scan of a batch: the body batched (every carry batched; xs scanned over their second
    axis): one loop kernel for the whole batch.  Returns every result of the scan."""
    from . import lax
    from .array import transpose
    p = e.params
    body, nk, nc, T = p["body"], p["n_consts"], p["n_carry"], p["length"]
    consts = vals[:nk]
    init = [v if b else _broadcast_batch(v, B) for v, b in vals[nk:nk + nc]]
    xs = [(transpose(v, [1, 0] + list(range(2, len(_shape(v))))) if b else v, b) for v, b in vals[nk + nc:]]

    def step(carry, x):
        ins = list(consts) + [(c, True) for c in carry] + [(xv, b) for xv, (_, b) in zip(x, xs)]
        outs = batch_program(body, ins, B)
        return ([v if b else _broadcast_batch(v, B) for v, b in outs[:nc]],
                [v if b else _broadcast_batch(v, B) for v, b in outs[nc:]])
    carry, ys = lax.scan(step, init, [x for x, _ in xs], length=T, reverse=p.get("reverse", False))
    ys = [transpose(y, [1, 0] + list(range(2, len(_shape(y))))) for y in ys]
    return list(carry) + list(ys)


def _unstacked(e, vals, B):
    """The fallback: the op once per batch index, stacked (B ops and a concatenate)."""
    cache = {}

    def at(v, b, i):
        if not b:
            return v
        if (id(v), i) not in cache:
            s = _shape(v)
            piece = bind(P["slice"], v, start=(i,) + (0,) * (len(s) - 1), limit=(i + 1,) + s[1:])
            cache[(id(v), i)] = _reshape_to(piece, s[1:])
        return cache[(id(v), i)]
    rows = []
    for i in range(B):
        y = bind(e.prim, *[at(v, b, i) for v, b in vals], **e.params)
        rows.append(_reshape_to(y, (1,) + _shape(y)))
    return bind(P["concatenate"], *rows, axis=0)


RULES = {
    "reshape": _reshape, "broadcast_in_dim": _broadcast, "transpose": _transpose, "slice": _slice,
    "concatenate": _concatenate, "reduce_sum": _same, "reduce_max": _same, "argmax": _same,
    "dot": _dot, "attention": _attention, "take": _take, "dynamic_update_slice": _dynamic_update_slice,
}
