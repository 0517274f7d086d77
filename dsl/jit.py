"""``jit``: trace once per signature, fuse, compile, run.

    f = dsl.jit(fn, static_argnums=(), donate_argnums=(), backend="cpu", fusion=None)
    f(*args)                      # traces on the first call per signature, then reuses
    f.lower(*args).as_text()      # the traced IR
    c = f.compile(*args)          # the executable: c.kernels, c.fusion_report()

The signature (the cache key) is the pytree structure of the arguments, the
shape and dtype of every array leaf, the values of static arguments and the
fusion rules.  Python ints are runtime i32 scalars and Python floats f32
scalars: changing their value never retraces.
"""
from __future__ import annotations

import os

import numpy as np

from . import array as _array  # noqa: F401  (registers the primitives)
from .array import Tracer
from .core import _TRACES, DSLError, Lit, Program, Trace, Var, check_shape, dtype_of
from .pytree import flatten, unflatten

BACKENDS = ("cpu", "reference", "cuda", "hip")


def default_backend():
    b = os.environ.get("VEGAFUSE_BACKEND", "") or "cpu"
    if b not in BACKENDS:
        raise ValueError(f"VEGAFUSE_BACKEND={b!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    return b


def _paths(tree, prefix=""):
    """Dotted path of every leaf, in ``flatten`` order (used to name kernel parameters)."""
    if isinstance(tree, dict):
        return [p for k in sorted(tree) for p in _paths(tree[k], f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [p for i, x in enumerate(tree) for p in _paths(x, f"{prefix}{i}.")]
    if tree is None:
        return []
    return [prefix[:-1]]


def _aval(x):
    if isinstance(x, bool):
        raise DSLError("bool scalars must be static arguments (static_argnums)")
    if isinstance(x, (int, np.integer)) and not isinstance(x, np.ndarray):
        if not -2 ** 31 <= int(x) < 2 ** 31:
            raise DSLError(f"int argument {x} does not fit in i32")
        return (), "i32"
    if isinstance(x, (float, np.floating)) and not isinstance(x, np.ndarray):
        return (), "f32"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        shape = tuple(int(d) for d in x.shape)
        check_shape(shape, "argument")
        return shape, dtype_of(x)
    raise DSLError(f"unsupported argument of type {type(x).__name__}; pass numpy arrays, ints or floats")


class Lowered:
    """A traced program and how to call it."""
    def __init__(self, jitted, program, out_tree, in_names, donated):
        self.jitted, self.program, self.out_tree = jitted, program, out_tree
        self.in_names, self.donated = in_names, donated

    def as_text(self) -> str:
        return self.program.as_text()

    def compile(self):
        """The executable for this traced program (the rest of ``engine.pipeline``)."""
        from engine.pipeline import compile_program
        return compile_program(self.jitted, traced=self)


class jit:  # noqa: N801  (named like jax.jit)
    def __init__(self, fn, static_argnums=(), donate_argnums=(), backend=None, fusion=None):
        self.fn = fn
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if fusion is not None and not isinstance(fusion, dict):
            raise ValueError(f"fusion must be a dict {{rule: bool}}, got {fusion!r}")
        self.fusion = dict(fusion or {})
        for name, on in self.fusion.items():
            if not isinstance(on, bool):
                raise ValueError(f"fusion[{name!r}] must be True or False, got {on!r}")
        self._cache = {}
        self.__name__ = getattr(fn, "__name__", "f")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _split(self, args):
        dyn = [a for i, a in enumerate(args) if i not in self.static_argnums]
        static = tuple((i, type(args[i]).__name__, args[i]) for i in self.static_argnums if i < len(args))
        leaves, tree = flatten(dyn)
        avals = tuple(_aval(x) for x in leaves)
        fusion_env = os.environ.get("VEGAFUSE_FUSION_OFF", "")
        try:
            hash(static)
        except TypeError:
            raise DSLError("static arguments must be hashable") from None
        return dyn, leaves, (tree, avals, static, tuple(sorted(self.fusion.items())), fusion_env)

    def lower(self, *args) -> Lowered:
        dyn, leaves, key = self._split(args)
        tree, avals, static, _, _ = key
        in_vars = [Var(s, d) for s, d in avals]
        tracers = unflatten(tree, [Tracer(v) for v in in_vars])
        full, it, fixed = [], iter(tracers), {i: v for i, _, v in static}
        for i in range(len(args)):
            full.append(fixed[i] if i in fixed else next(it))
        trace = Trace()
        _TRACES.append(trace)
        try:
            out = self.fn(*full)
        finally:
            _TRACES.pop()
        out_leaves, out_tree = flatten(out)
        outs = []
        for o in out_leaves:
            if isinstance(o, Tracer):
                outs.append(o.var)
            elif isinstance(o, (int, float, bool, np.number)):
                outs.append(Lit(o, _aval(o)[1] if not isinstance(o, bool) else "bool"))
            else:
                raise DSLError(f"{self.__name__} returned {type(o).__name__}; return traced arrays")
        prog = Program(in_vars, trace.eqns, outs)
        argnames = self._argnames(len(args))
        names = [f"{argnames[i]}.{n}" if n else argnames[i] for i, a in enumerate(dyn) for n in _paths(a)]
        dyn_idx = [i for i in range(len(args)) if i not in self.static_argnums]
        donated = set()
        for pos, a in zip(dyn_idx, dyn):
            if pos in self.donate_argnums:
                n = len(flatten(a)[0])
                start = sum(len(flatten(dyn[j])[0]) for j in range(dyn_idx.index(pos)))
                donated.update(in_vars[start:start + n])
        return Lowered(self, prog, out_tree, names, donated)

    def _argnames(self, n):
        """Names of the dynamic arguments, from the function's signature."""
        import inspect
        try:
            names = list(inspect.signature(self.fn).parameters)
        except (TypeError, ValueError):
            names = []
        names = (names + [f"arg{i}" for i in range(len(names), n)])[:n]
        return [x for i, x in enumerate(names) if i not in self.static_argnums]

    def compile(self, *args):
        _, _, key = self._split(args)
        if key not in self._cache:
            self._cache[key] = self.lower(*args).compile()
        return self._cache[key]

    def __call__(self, *args):
        compiled = self.compile(*args)
        dyn = [a for i, a in enumerate(args) if i not in self.static_argnums]
        return compiled(*flatten(dyn)[0])
