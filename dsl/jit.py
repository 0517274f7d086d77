"""``jit``: trace once per signature, fuse, compile, run (``jax.jit``).

    f = dsl.jit(fn, static_argnums=(), donate_argnums=(), backend="cpu", fusion=None,
                static_argnames=(), donate_argnames=(), persistent=False)
    @dsl.jit(static_argnames="n")                # or functools.partial(dsl.jit, static_argnames="n")
    f(*args, **kwargs)            # traces on the first call per signature, then reuses
    f.lower(*args).as_text()      # the traced IR
    c = f.compile(*args)          # the executable: c(*args), c.fusion_report(), c.cost_analysis()

The signature (the cache key) is the pytree structure of the arguments (dicts, lists, tuples,
namedtuples, registered dataclasses and nodes: ``dsl.tree_util``), the shape and dtype of every
array leaf, the values of static arguments and the fusion rules.  Python ints are runtime i32
scalars and Python floats f32 scalars: changing their value never retraces.  A jitted function
called inside another traced function is traced inline.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from . import array as _array  # noqa: F401  (registers the primitives)
from .array import Tracer
from .core import _TRACES, MAX_ELEMENTS, DSLError, Program, Var, check_shape, dtype_of, trace_call
from .pytree import flatten, tree_flatten_with_path, unflatten

BACKENDS = ("cpu", "reference", "cuda", "hip")


def default_backend():
    b = os.environ.get("VEGAFUSE_BACKEND", "") or "cpu"
    if b not in BACKENDS:
        raise ValueError(f"VEGAFUSE_BACKEND={b!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    return b


def _aval(x):
    if isinstance(x, bool):
        raise DSLError("bool scalars must be static arguments (static_argnums)")
    if isinstance(x, (int, np.integer)) and not isinstance(x, np.ndarray):
        if not -2 ** 31 <= int(x) < 2 ** 31:
            raise DSLError(f"int argument {x} does not fit in i32")
        return (), "i32"
    if isinstance(x, (float, np.floating)) and not isinstance(x, np.ndarray):
        return (), "f32"
    if type(x) is np.ndarray and 0 < x.size <= MAX_ELEMENTS:     # the common case: a plain array
        return x.shape, dtype_of(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        shape = tuple(int(d) for d in x.shape)
        check_shape(shape, "argument")
        return shape, dtype_of(x)
    raise DSLError(f"unsupported argument of type {type(x).__name__}; pass numpy arrays, ints or floats"
                   + _UNREGISTERED(x))



def _argnums(x, what):
    x = (x,) if isinstance(x, int) else tuple(x or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise ValueError(f"{what} must be ints (positions of arguments), got {x!r}")
    return x


def _argnames(x, what):
    x = (x,) if isinstance(x, str) else tuple(x or ())
    if not all(isinstance(n, str) for n in x):
        raise ValueError(f"{what} must be strings (names of parameters), got {x!r}")
    return x


class CallSpec:
    """How a traced program's inputs come from a call: the static values it was traced for and the
    pytree of its dynamic arguments (``(positional, keyword)``).  ``leaves(args, kwargs)`` maps a
    call of the compiled object to the program's inputs."""

    def __init__(self, jitted, args, kwargs, treedef, n_leaves):
        self.jitted, self.treedef, self.n_leaves = jitted, treedef, n_leaves
        self.n_args = len(args)
        self.static_pos = {i: a for i, a in enumerate(args) if i in jitted.static_argnums}
        self.static_kw = {k: v for k, v in kwargs.items() if k in jitted.static_argnames}

    def leaves(self, args, kwargs):
        """The program's input leaves for a call with ``args``/``kwargs``: the jitted function's own
        arguments (static ones equal to those compiled for, or left out as in JAX), or the flat
        leaves themselves.  TypeError, one line, for anything else."""
        name = self.jitted.__name__
        if len(args) == self.n_args:
            for i, v in self.static_pos.items():
                if not _same_static(args[i], v):
                    raise TypeError(f"{name} was compiled for static argument {i} = {v!r}, called with {args[i]!r}; "
                                    "call the jitted function, which compiles for each static value")
            args = [a for i, a in enumerate(args) if i not in self.static_pos]
        for k, v in kwargs.items():
            if k in self.static_kw and not _same_static(v, self.static_kw[k]):
                raise TypeError(f"{name} was compiled for static argument {k} = {self.static_kw[k]!r}, called with "
                                f"{v!r}; call the jitted function, which compiles for each static value")
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self.jitted.static_argnames}
        leaves, treedef = flatten((tuple(args), dyn_kw))
        if treedef == self.treedef:
            return leaves
        from .pytree import _node, describe
        if not kwargs and len(args) == self.n_leaves and all(_node(a) is None for a in args):
            return list(args)                       # the flat leaves (what Executable.bind takes)
        raise TypeError(f"{name} was compiled for arguments {describe(self.treedef)}, called with "
                        f"{describe(treedef)}; pass the same pytree of arguments as to the jitted function")


def _same_static(a, b):
    return type(a) is type(b) and a == b


class Lowered:
    """A traced program and how to call it (``jax.stages.Lowered``)."""
    def __init__(self, jitted, program, out_tree, in_names, donated, spec=None):
        self.jitted, self.program, self.out_tree = jitted, program, out_tree
        self.in_names, self.donated, self.spec = in_names, donated, spec

    def as_text(self) -> str:
        return self.program.as_text()

    def compile(self):
        """The executable for this traced program (the rest of ``engine.pipeline``)."""
        from engine.pipeline import compile_program
        return compile_program(self.jitted, traced=self)

    def cost_analysis(self) -> dict:
        """The fused plan's cost, as ``Compiled.cost_analysis`` (no code is compiled)."""
        from engine.executable import cost_of
        from engine.pipeline import lower_program
        return cost_of(lower_program(self, self.jitted.fusion))


class jit:  # noqa: N801  (named like jax.jit)
    """``jax.jit``: ``jit(fn, static_argnums=..., static_argnames=..., donate_argnums=...,
    donate_argnames=..., backend=None, fusion=None)``; without ``fn`` (``@dsl.jit(static_argnums=1)``)
    a decorator.

    Static arguments (by position or by name: each is inferred from the other through ``fn``'s
    signature, as in JAX) are Python values that select the trace (hashable); every other
    argument, positional or keyword, is a pytree of arrays, ints (i32 scalars) and floats (f32
    scalars).  Donated arguments may be updated in place.  Called while another function is traced,
    it traces inline (no nested compile; static/donate options are then moot).

    Where we differ from JAX: ints and floats passed as dynamic arguments are i32/f32 scalars
    whose value never retraces; bools must be static; ``backend`` and ``fusion`` select our
    device and fusion rules (see ``engine.pipeline``); ``persistent=True`` keeps each compiled
    program on disk, so that a later process loads it without tracing (``engine.programcache``:
    for functions whose behaviour follows from their code, plain closure values and the files
    that trace them)."""

    def __new__(cls, fn=None, *args, **kwargs):
        if fn is None:                                # @dsl.jit(static_argnums=...): a decorator
            import functools
            return functools.partial(cls, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, fn, static_argnums=(), donate_argnums=(), backend=None, fusion=None, *,
                 static_argnames=(), donate_argnames=(), persistent=False):
        if not callable(fn):
            raise TypeError(f"jit needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "f")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn                         # inspect.signature(jitted) is fn's
        self._params = self._signature()
        self.static_argnums, self.static_argnames = self._infer(
            _argnums(static_argnums, "static_argnums"), _argnames(static_argnames, "static_argnames"), "static")
        self.donate_argnums, self.donate_argnames = self._infer(
            _argnums(donate_argnums, "donate_argnums"), _argnames(donate_argnames, "donate_argnames"), "donate")
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
        self.persistent = bool(persistent)            # compiled programs kept on disk (engine/programcache.py)

    def _signature(self):
        import inspect
        try:
            return list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            return []

    def _infer(self, nums, names, what):
        """Positions and names of the ``what`` (static/donate) arguments, each completed from the
        other through the signature, as JAX does.  ValueError for a name that is not a parameter."""
        import inspect
        pos = [p.name for p in self._params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named = {p.name for p in self._params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if self._params and not any(p.kind == p.VAR_KEYWORD for p in self._params):
            for n in names:
                if n not in named:
                    raise ValueError(f"{what}_argnames: {n!r} is not a parameter of {self.__name__}"
                                     f"{inspect.signature(self.fn)}")
        nums = set(nums) | {pos.index(n) for n in names if n in pos}
        names = set(names) | {pos[i] for i in nums if 0 <= i < len(pos) and pos[i] in named}
        return tuple(sorted(nums)), tuple(sorted(names))

    # ------------------------------------------------------------------ calls
    def _split(self, args, kwargs):
        """(dynamic positional args, dynamic keyword args, leaves, cache key) of a call."""
        dyn = [a for i, a in enumerate(args) if i not in self.static_argnums]
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static = (tuple((i, type(args[i]).__name__, args[i]) for i in self.static_argnums if i < len(args))
                  + tuple((k, type(v).__name__, v) for k, v in sorted(kwargs.items()) if k in self.static_argnames))
        leaves, tree = flatten((tuple(dyn), dyn_kw))
        avals = tuple(_aval(x) for x in leaves)
        fusion_env = os.environ.get("VEGAFUSE_FUSION_OFF", "")
        key = (tree, avals, static, tuple(sorted(self.fusion.items())), fusion_env, len(args))
        try:
            hash(key)
        except TypeError:
            raise DSLError(f"{self.__name__}: static arguments (and the metadata of pytree nodes) must be "
                           "hashable; pass arrays as dynamic arguments") from None
        return dyn, dyn_kw, leaves, key

    def lower(self, *args, **kwargs) -> Lowered:
        """Trace for these arguments: the program, its inputs' names and donations."""
        dyn, dyn_kw, leaves, key = self._split(args, kwargs)
        tree, avals = key[0], key[1]
        in_vars = [Var(s, d) for s, d in avals]
        t_args, t_kw = unflatten(tree, [Tracer(v) for v in in_vars])
        it = iter(t_args)
        full = [a if i in self.static_argnums else next(it) for i, a in enumerate(args)]
        full_kw = {k: (v if k in self.static_argnames else t_kw[k]) for k, v in kwargs.items()}
        trace, outs, out_tree = trace_call(self.fn, full, full_kw, lambda o: (
            f"{self.__name__} returned {type(o).__name__}; return traced arrays" + _UNREGISTERED(o)))
        prog = Program(in_vars, trace.eqns, outs)
        names, donated, start = [], set(), 0
        argnames = self._positional_names(len(args))
        dyn_pos = [i for i in range(len(args)) if i not in self.static_argnums]
        for label, a, donate in ([(argnames[i], a, i in self.donate_argnums) for i, a in zip(dyn_pos, dyn)]
                                 + [(k, dyn_kw[k], k in self.donate_argnames) for k in sorted(dyn_kw)]):
            paths = [p for p, _ in tree_flatten_with_path(a)[0]]
            names += [".".join([label, *map(str, p)]) for p in paths]
            if donate:
                donated.update(in_vars[start:start + len(paths)])
            start += len(paths)
        spec = CallSpec(self, args, kwargs, tree, len(leaves))
        return Lowered(self, prog, out_tree, names, donated, spec)

    def _positional_names(self, n):
        """Names of the positional arguments, from the function's signature."""
        names = [p.name for p in self._params]
        return (names + [f"arg{i}" for i in range(len(names), n)])[:n]

    def compile(self, *args, **kwargs):
        """The executable for these arguments (cached per signature); call it with the same arguments."""
        key = self._split(args, kwargs)[3]
        if key not in self._cache:
            self._cache[key] = self._compile_new(args, kwargs, key)
        return self._cache[key]

    def _compile_new(self, args, kwargs, key):
        """Trace, fuse and compile for a signature new to this object; with ``persistent``, through
        the disk's program cache (``engine.programcache``: a later process skips the trace)."""
        if self.persistent and self.backend != "reference":
            from engine.programcache import compile_cached
            return compile_cached(self, args, kwargs, key)
        return self.lower(*args, **kwargs).compile()

    def spec_of(self, args, kwargs) -> CallSpec:
        """How a call with these arguments maps to the inputs (what ``lower`` records)."""
        _, _, leaves, key = self._split(args, kwargs)
        return CallSpec(self, args, kwargs, key[0], len(leaves))

    def __get__(self, obj, objtype=None):
        """A jitted function defined in a class is a method, as in JAX: ``obj.f(x)`` calls
        ``f(obj, x)`` (``obj`` is usually static: ``static_argnums=0``)."""
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        if _TRACES:                                   # inside another trace: inline
            return self.fn(*args, **kwargs)
        _, _, leaves, key = self._split(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._compile_new(args, kwargs, key)
        return self._cache[key].call_flat(*leaves)


def _UNREGISTERED(x) -> str:  # noqa: N802
    import dataclasses
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (f"; a dataclass is a pytree node once registered: dsl.tree_util.register_dataclass("
                f"{type(x).__name__}) (as in JAX)")
    return ""
