"""The reference interpreter: runs any Program equation by equation with numpy.

``compute_dtype="f64"`` runs every float value in float64: the independent
reference that kernels are tested against.
"""
from __future__ import annotations

import numpy as np

from .core import NP_DTYPES, QUANT_DTYPES, Lit, loop_key


def run_program(prog, args, compute_dtype=None):
    """Evaluate ``prog`` on numpy ``args`` (one per input Var); returns a list of arrays."""
    if len(args) != len(prog.inputs):
        raise ValueError(f"program takes {len(prog.inputs)} inputs, got {len(args)}")
    f64 = compute_dtype == "f64"

    def coerce(x, dtype):
        if dtype in QUANT_DTYPES:           # a dsl.QArray: only dequantize reads it
            return x
        x = np.asarray(x)
        if f64 and dtype in ("f16", "f32"):
            return x.astype(np.float64)
        return x.astype(NP_DTYPES[dtype], copy=False)

    env = {}
    for i, (v, a) in enumerate(zip(prog.inputs, args)):
        env[v] = coerce(a, v.dtype)
        if env[v].shape != tuple(v.shape):
            raise ValueError(f"input {i}: shape {list(env[v].shape)} != declared {list(v.shape)}")

    def read(a):
        return coerce(np.asarray(a.value), a.dtype) if isinstance(a, Lit) else env[a]

    loops = {}                  # the equations of one scan share one run: (body, operands) -> results
    with np.errstate(all="ignore"):
        for e in prog.eqns:
            if e.prim.kind == "loop":
                key = loop_key(e)
                if key not in loops:
                    p = e.params
                    loops[key] = run_scan(p["body"], [read(a) for a in e.inputs], p["length"], p["n_consts"],
                                          p["n_carry"], compute_dtype, p.get("reverse", False))
                env[e.out] = coerce(loops[key][e.params["out"]], e.out.dtype)
                continue
            params = dict(e.params)
            if f64 and e.prim.name in ("convert", "iota") and params["dtype"] in ("f16", "f32"):
                params["dtype"] = "f64"
            out = e.prim.impl(*[read(a) for a in e.inputs], **params)
            env[e.out] = coerce(out, e.out.dtype)
    return [read(o) for o in prog.outputs]


def run_scan(body, args, length, n_consts, n_carry, compute_dtype=None, reverse=False):
    """Run a scan's ``body`` Program ``length`` times: ``args`` are (constants..., initial
    carries..., xs...), each x sliced along its leading axis (from the last slice to the first
    with ``reverse``); returns (final carries..., stacked ys...) as numpy arrays, ``ys[t]`` the
    output of the step that read ``xs[t]``."""
    consts, carry, xs = args[:n_consts], list(args[n_consts:n_consts + n_carry]), args[n_consts + n_carry:]
    ys = [None] * length
    for t in (reversed(range(length)) if reverse else range(length)):
        outs = run_program(body, consts + carry + [np.asarray(x)[t] for x in xs], compute_dtype)
        carry = [np.asarray(o) for o in outs[:n_carry]]
        ys[t] = [np.asarray(o) for o in outs[n_carry:]]
    stacked = [np.stack([y[i] for y in ys]) for i in range(len(body.outputs) - n_carry)]
    return carry + stacked
