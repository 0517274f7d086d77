"""Whole compiled programs on disk: a warm start neither traces, nor plans, nor renders.

    ex = compile_cached(jitted, args, kwargs, key)    # what dsl.jit(..., persistent=True) compiles through

An entry holds what ``engine.pipeline.compile_program`` makes before it compiles: the traced
program, its output pytree, the fused plan, and each kernel's rendered source and compile
options; loading one builds the executable from it (objects from the code cache, linked as
usual).  Its key holds everything that decides those (:func:`program_key`):

- the jitted function: its module, name and code (bytecode, constants, names, nested code), the
  values its closure and defaults hold, the text of the file that defines it;
- the call's signature as ``dsl.jit`` keys it (pytree structure, shapes and dtypes, static
  values, fusion rules and ``VEGAFUSE_FUSION_OFF``), the static and donated arguments;
- the package's own sources (``dsl``, ``fusion``, ``codegen``, ``stdlib``, ``engine``), the
  device's compiler identity and render key (its sources and every ``VEGAFUSE_*`` switch that
  may change code).

The entry also records a hash of each file whose lines the program's equations came from; one
that changed since makes the entry a miss.  A function the key cannot describe (a closure over
anything but plain values: numbers, strings, tuples, lists, dicts, dataclasses of them; a
user-defined primitive, a program that does not pickle) is compiled as usual, uncached, and so
is any program while a compile pass (a function of ``engine.pipeline`` or ``engine.build``) is
replaced by code from outside the package (a test's monkeypatch).  What the key cannot see:
another module-level value changed at run time.

Stored in the code cache (``engine/codecache.py``: atomic writes, a damaged entry is rebuilt).
``VEGAFUSE_PROGRAM_CACHE=0`` turns it off (A/B), as do ``VEGAFUSE_PLAN_CACHE=0`` and
``VEGAFUSE_RENDER_CACHE=0`` (an entry holds a plan and renders); ``VEGAFUSE_DEBUG`` above 0
bypasses it, so the debug report comes from a full compile.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import sys
import types

from codegen.env import switch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("dsl", "fusion", "codegen", "stdlib", "engine", os.path.join("engine", "devices"))
_SOURCES = None
_PLAIN = (int, float, str, bool, type(None), bytes)


COUNTS = {"hits": 0, "misses": 0}          # this process: programs loaded from disk, compiled anew


def enabled() -> bool:
    """On unless ``VEGAFUSE_PROGRAM_CACHE``, ``VEGAFUSE_PLAN_CACHE`` or ``VEGAFUSE_RENDER_CACHE``
    is 0 (an entry holds a plan and renders) or debug output is asked for."""
    from engine.pipeline import debug_level
    return all(switch(f"VEGAFUSE_{k}_CACHE", True) for k in ("PROGRAM", "PLAN", "RENDER")) and debug_level() == 0


def _file_hash(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def package_sources() -> str:
    """A hash of every ``.py`` file of the package (computed once per process)."""
    global _SOURCES
    if _SOURCES is None:
        h = hashlib.sha256()
        for d in _PACKAGES:
            folder = os.path.join(_ROOT, d)
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    h.update(name.encode() + (_file_hash(os.path.join(folder, name)) or "").encode())
        _SOURCES = h.hexdigest()
    return _SOURCES


class Unkeyable(Exception):
    """The function holds something the key cannot describe: it is compiled uncached."""


def _plain(x, depth=0):
    """A stable text of a plain value (see the module docstring); Unkeyable otherwise."""
    if depth > 8:
        raise Unkeyable("nested too deep")
    if isinstance(x, _PLAIN):
        return repr(x)
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__}({', '.join(_plain(v, depth + 1) for v in x)})"
    if isinstance(x, dict):
        items = sorted(x.items(), key=repr)
        return "{" + ", ".join(f"{_plain(k, depth + 1)}: {_plain(v, depth + 1)}" for k, v in items) + "}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = ", ".join(f"{f.name}={_plain(getattr(x, f.name), depth + 1)}" for f in dataclasses.fields(x))
        return f"{type(x).__module__}.{type(x).__qualname__}({fields})"
    raise Unkeyable(f"a {type(x).__name__} value")


def _code(co: types.CodeType) -> str:
    """The code object's behaviour as text: bytecode, names, constants, nested code, recursively."""
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in co.co_consts]
    return repr((co.co_name, co.co_code.hex(), co.co_names, co.co_varnames, co.co_freevars, consts))


def _function(fn) -> dict:
    """The key parts of the jitted function (Unkeyable where it holds more than plain values)."""
    fn = getattr(fn, "__wrapped__", fn)
    if not isinstance(fn, types.FunctionType):
        raise Unkeyable(f"a {type(fn).__name__}, not a function")
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    code = hashlib.sha256(_code(fn.__code__).encode()).hexdigest()
    return {"name": f"{fn.__module__}.{fn.__qualname__}", "code": code,
            "closure": _plain(cells), "defaults": _plain(list(fn.__defaults__ or ())),
            "kwdefaults": _plain(fn.__kwdefaults__ or {}), "file": _file_hash(fn.__code__.co_filename)}


def _foreign(v) -> bool:
    """Is ``v`` a function from outside the package and the Python installation (a closure, a
    test's or a script's function)?"""
    if not isinstance(v, types.FunctionType):
        return False
    if "<locals>" in v.__qualname__:
        return True
    f = os.path.abspath(v.__code__.co_filename)
    if f.startswith((sys.prefix + os.sep, sys.base_prefix + os.sep)):
        return False
    return not f.startswith(tuple(os.path.join(_ROOT, d) + os.sep for d in _PACKAGES))


def _replaced_pass() -> str | None:
    """The name of a compile pass (``engine.pipeline``'s and ``engine.build``'s functions) that
    code from outside the package replaced at run time (a test's monkeypatch), or None: such a
    compile is left uncached, as the key cannot see it."""
    from engine import build, pipeline
    for mod in (pipeline, build):
        for name, v in vars(mod).items():
            if _foreign(v):
                return f"{mod.__name__}.{name}"
    return None


def program_key(jitted, key, compiler) -> dict:
    """The cache key of ``jitted``'s program for a call whose ``dsl.jit`` signature is ``key``
    (see the module docstring).  Unkeyable where the function cannot be described, or where a
    compile pass was replaced at run time."""
    replaced = _replaced_pass()
    if replaced:
        raise Unkeyable(f"{replaced} replaced at run time")
    sig = repr(key)
    if " at 0x" in sig:
        raise Unkeyable("the signature holds an object without a stable text")
    return {"kind": "program", "function": _function(jitted.fn), "signature": sig,
            "static": [list(jitted.static_argnums), list(jitted.static_argnames)],
            "donate": [list(jitted.donate_argnums), list(jitted.donate_argnames)],
            "backend": jitted.backend, "package": package_sources(),
            "compiler": compiler.identity, "render": compiler.render_key()}


# ----------------------------------------------------------------------------- entries
def _primitive(name):
    from dsl.core import PRIMITIVES
    return PRIMITIVES[name]


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        from dsl.core import Primitive
        if isinstance(obj, Primitive):
            return _primitive, (obj.name,)
        return NotImplemented


def _site_files(program) -> dict:
    """``{path: sha256}`` of each file the program's equations (loop bodies' too) came from."""
    from dsl.core import Program, _ROOT as root
    paths, stack = set(), [program]
    while stack:
        for e in stack.pop().eqns:
            path = e.source.rpartition(":")[0]
            if path and not path.startswith("<"):
                paths.add(path)
            stack += [v for v in e.params.values() if isinstance(v, Program)]
    out = {}
    for p in sorted(paths):
        full = p if os.path.isabs(p) else os.path.join(root, p)
        out[p] = _file_hash(full if os.path.exists(full) else os.path.abspath(p))
    return out


def pack(executable) -> bytes:
    """An entry for ``executable`` (made by ``compile_program``): program, output tree, plan, and
    each kernel's source text and compile options."""
    from dsl.primitives import USER
    prog = executable.program
    if any(e.prim.name in USER for e in prog.eqns):
        raise Unkeyable("a user-defined primitive")
    sources = [ck._rendered for ck in executable.kernels]
    texts, index = [], {}
    for s in sources:
        index.setdefault(s.text, len(texts))
        if index[s.text] == len(texts):
            texts.append(s.text)
    body = {"program": prog, "out_tree": executable.out_tree, "plan": executable.plan,
            "texts": texts, "kernels": [(index[s.text], s.options) for s in sources],
            "sites": _site_files(prog)}
    f = io.BytesIO()
    _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(body)
    return f.getvalue()


def unpack(blob: bytes, jitted, spec, device):
    """The executable of an entry, or None where a file it came from has changed since."""
    from engine.build import Source, build
    from engine.executable import Executable
    body = pickle.loads(blob)
    if _site_files(body["program"]) != body["sites"]:
        return None
    plan, compiler = body["plan"], device.compiler
    sources = [Source(k, body["texts"][i], compiler, opts) for k, (i, opts) in zip(plan.kernels, body["kernels"])]
    kernels = device.load(sources, build(sources, compiler))
    return Executable(body["program"], body["out_tree"], plan, device, kernels, jitted.backend, spec)


def compile_cached(jitted, args, kwargs, key):
    """``jitted.lower(*args, **kwargs).compile()``, through the program cache where the backend's
    compiler caches renders (the CPU) and the function can be keyed."""
    from engine.build import code_cache
    from engine.executable import get_device
    device = get_device(jitted.backend)
    compiler = getattr(device, "compiler", None)
    if compiler is None or compiler.render_key() is None or not enabled():
        return jitted.lower(*args, **kwargs).compile()
    try:
        pkey = program_key(jitted, key, compiler)
    except Unkeyable:
        return jitted.lower(*args, **kwargs).compile()
    cache = code_cache()
    blob = cache.get(pkey)
    if blob is not None:
        try:
            ex = unpack(blob, jitted, jitted.spec_of(args, kwargs), device)
        except Exception:                        # an entry from another version, or damaged
            ex = None
        if ex is not None:
            COUNTS["hits"] += 1
            return ex
    COUNTS["misses"] += 1
    ex = jitted.lower(*args, **kwargs).compile()
    try:
        cache.put(pkey, pack(ex))
    except (Unkeyable, OSError, pickle.PicklingError, TypeError, AttributeError):
        pass                                     # kept in this process only
    return ex
