"""Render and build: Loop IR kernels to compiled code, once per distinct kernel, through the disk cache.

    sources  = render(kernels, compiler)    # each kernel's readable source, and its canonical source
    binaries = build(sources, compiler)     # [Binary]: one compile per distinct canonical source

Written once for every device.  A kernel is compiled in its canonical form
(``codegen.loopir.canonicalize``: parameters ``p0, p1, ...``, locals ``v0, ...``, named
``canonical``), so kernels that differ only in names (the same layer thirty times) share one
compile and one binary.  The canonical source, with the compiler's identity, keys the on-disk
cache (``engine/codecache.py``: atomic writes, checked reads, corrupt entries rebuilt), so a
second process compiles nothing.  Within a process each compiler keeps what it built.

A compiler whose source is plain text (the CPU's LLVM IR) also caches what it renders: keyed
by the canonical Loop IR, its ``render_key()`` (the compiler's own sources and the
``VEGAFUSE_*`` switches) and its identity, so that a warm start renders nothing either
(``VEGAFUSE_RENDER_CACHE=0`` renders every kernel again, for A/B).  ``VEGAFUSE_CACHE=0`` turns
the disk cache off altogether (plans, sources, code: a cold start every run).  ``COUNTS`` holds
this process's renders and compiles, and the compiles the disk cache saved; kernels that miss
compile under a progress bar on a terminal (``engine/progress.py``).

A device supplies a :class:`Compiler`: how it renders a kernel (LLVM IR for the CPU, HIP C++
for the GPUs), ``compile(source, name, **options) -> bytes`` (llvmlite, hiprtc, NVRTC), its
``identity``, the cache-key parts other than the source (compiler version, target, options),
and, where it chooses them per kernel, ``compile_options(kernel)`` (part of that kernel's key).
Misses compile ``compiler.jobs`` at a time, the longest sources first.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from codegen.loopir import Kernel, canonicalize
from engine.codecache import CodeCache, cache_key, default_cache_dir, warn
from engine.progress import progress
from codegen.env import switch

# Switches that never change generated code: left out of render keys.
_NOT_CODEGEN = {"VEGAFUSE_CACHE", "VEGAFUSE_CACHE_DIR", "VEGAFUSE_DEBUG", "VEGAFUSE_PLAN_CACHE",
                "VEGAFUSE_RENDER_CACHE", "VEGAFUSE_PROGRESS", "VEGAFUSE_SPIN_US", "VEGAFUSE_BACKEND",
                "VEGAFUSE_COMPILE_WORKERS", "VEGAFUSE_PREFILL_FIRST", "VEGAFUSE_PROGRAM_CACHE",
                "VEGAFUSE_CPU_UNROLL"}

COUNTS = {"renders": 0, "compiles": 0, "cached": 0}      # this process: kernels rendered, compiled, read from disk
_COUNTS_LOCK = threading.Lock()                          # compiles run on several threads


def _count(what: str, n: int = 1) -> None:
    with _COUNTS_LOCK:
        COUNTS[what] += n


class Compiler:
    """What a device supplies to :func:`render` and :func:`build` (subclass and fill in).

    ``identity``: dict of cache-key parts besides the source (e.g. ``{"compiler": "hiprtc ...",
    "arch": "gfx906", "options": [...]}``); ``jobs``: how many compiles may run at once (more
    than 1 only where the compiler releases the GIL and is thread-safe).
    """

    identity: dict = {}
    jobs: int = 1

    def __init__(self):
        self.built = {}                     # cache-key hash -> Binary: what this compiler built here

    def render(self, kernel: Kernel):
        """The kernel's source: a ``str``, or an object whose ``.source`` is the text (a
        ``HipKernel`` also carries its launch geometry)."""
        raise NotImplementedError

    def compile_options(self, kernel: Kernel) -> dict:
        """Compile options chosen for this (canonical) kernel, given to ``compile`` as keywords and
        part of its cache key; {} (the default): the compiler's defaults."""
        return {}

    def render_key(self) -> dict | None:
        """What ``render`` depends on besides the kernel, as cache-key parts, where its result is
        a ``str`` that may be cached (see :func:`render_switches`); None (the default): rendered
        every time."""
        return None

    def expect_compiles(self) -> None:
        """A render missed the disk cache, so compiles are likely to follow: start what they need
        (the CPU's helper processes) while the rest renders.  The default does nothing."""

    def compile(self, source: str, name: str, **options) -> bytes:
        """Compile ``source`` with ``options`` (from :meth:`compile_options`); ``name`` (the first
        kernel that needs it) is for diagnostics.
        Raises the device's compile error, naming the kernel and the failing line."""
        raise NotImplementedError

    def entry(self, source: str) -> str:
        """Symbol of the kernel function in the compiled code."""
        return "canonical"

    def holds(self, code: bytes, entry: str) -> bool:
        """Is ``code`` plausibly this compiler's output with symbol ``entry``?  A cache entry that
        passes its checksum but fails this (another kernel's object, garbage) is rebuilt."""
        return True

    def disassemble(self, binary: "Binary") -> str | None:
        """The machine code as text, where the target has a disassembler; else None."""
        return None


def text_of(rendered) -> str:
    """The source text of a render result (a ``str``, or an object with ``.source``)."""
    return rendered if isinstance(rendered, str) else rendered.source


class Source:
    """One kernel rendered: ``canonical`` (what is compiled; shared by kernels equal up to
    names), ``text`` (its source text), ``options`` (how it is compiled:
    ``Compiler.compile_options``)
    and ``readable``, the kernel with its own names (rendered when first read)."""

    def __init__(self, kernel: Kernel, canonical, compiler: Compiler, options: dict | None = None):
        self.kernel, self.canonical, self.compiler = kernel, canonical, compiler
        self.text = text_of(canonical)
        self.options = options or {}
        self._readable = None

    @property
    def readable(self):
        if self._readable is None:
            self._readable = self.compiler.render(self.kernel)
        return self._readable

    def __repr__(self):
        return f"<Source {self.kernel.name}: {len(self.text)} chars>"


@dataclass(eq=False)
class Binary:
    """Compiled code of one canonical source.  ``name``: the first kernel that needed it;
    ``entry``: the kernel function's symbol; ``cache_hit``: read from the disk cache;
    ``seconds``: compile wall time (0 on a hit); ``options``: the compile options."""
    code: bytes
    source: str
    name: str
    entry: str
    cache_hit: bool
    seconds: float = 0.0
    options: dict = field(default_factory=dict)

    def __repr__(self):
        return f"<Binary {self.name} {len(self.code)} bytes{' (cached)' if self.cache_hit else ''}>"


_cache: CodeCache | None = None


def code_cache() -> CodeCache:
    """The process-wide :class:`CodeCache` (made again if ``VEGAFUSE_CACHE_DIR`` or
    ``VEGAFUSE_CACHE`` changed; ``VEGAFUSE_CACHE=0``: a cache that holds nothing)."""
    global _cache
    enabled = switch("VEGAFUSE_CACHE", True)
    if _cache is None or _cache.root != default_cache_dir() or _cache.enabled != enabled:
        _cache = CodeCache(enabled=enabled)
    return _cache


def render_switches() -> dict:
    """The ``VEGAFUSE_*`` environment switches that may change generated code (all but the
    cache's, debug output's and the thread pool's own), part of every render key: a switch
    that does not change the code only costs a render."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VEGAFUSE_") and k not in _NOT_CODEGEN}


def render(kernels, compiler: Compiler, cache: CodeCache | None = None) -> list[Source]:
    """Render each kernel's canonical form (once per distinct one) for ``compiler``; a compiler
    with a ``render_key`` reads the text from the disk cache where it was rendered before."""
    seen, out = {}, []
    for k in kernels:
        c = canonicalize(k)
        key = repr(c)                       # every field: equal canonical kernels render equally
        if key not in seen:
            seen[key] = _render_cached(compiler, c, key, cache), compiler.compile_options(c)
        rendered, options = seen[key]
        out.append(Source(k, rendered, compiler, options))
    return out


def _render_cached(compiler: Compiler, canonical: Kernel, loop_ir: str, cache: CodeCache | None):
    """``compiler.render(canonical)``, through the disk cache where the compiler has a render key."""
    parts = compiler.render_key()
    if parts is None or not switch("VEGAFUSE_RENDER_CACHE", True):
        _count("renders")
        return compiler.render(canonical)

    def fresh():
        _count("renders")
        compiler.expect_compiles()
        return compiler.render(canonical).encode()
    key = {**compiler.identity, **parts, "kind": "render", "loop_ir": loop_ir, "user_ops": _user_ops(loop_ir)}
    return (cache or code_cache()).get_or_build(key, fresh)[0].decode()


def _user_ops(loop_ir: str) -> dict:
    """The definitions (``codegen.loopir.OPS`` entries) of the primitives a user defined
    (``dsl.define_elementwise``) whose names the kernel's Loop IR text holds: the Loop IR names
    such an op, and its rendering comes from the definition, which a user may redefine."""
    from codegen import loopir as L
    from dsl.primitives import USER
    return {n: repr(L.OPS[n]) for n in sorted(USER) if n in L.OPS and n in loop_ir}


def compile_source(compiler: Compiler, source: str, name: str, cache: CodeCache | None = None,
                   options: dict | None = None) -> Binary:
    """Compile one source with ``options`` (``Compiler.compile_options``) through the disk cache
    (the path every build takes).  A cached entry that is not this compiler's code for ``source``
    (``compiler.holds``) is built again, with one warning line."""
    cache = cache or code_cache()
    options = options or {}
    key = {**compiler.identity, "source": source, **({"options": options} if options else {})}
    t0 = time.perf_counter()

    def fresh():
        _count("compiles")
        return compiler.compile(source, name, **options)
    code, hit = cache.get_or_build(key, fresh)
    if hit and not compiler.holds(code, compiler.entry(source)):         # a wrong entry: rebuild it
        warn(f"cache entry {cache.path(key)} holds no code for kernel {name}; built again")
        code, hit = fresh(), False
        try:
            cache.put(key, code)
        except OSError:
            pass
    _count("cached", hit)
    return Binary(code, source, name, compiler.entry(source), hit, 0.0 if hit else time.perf_counter() - t0,
                  options)


def build(sources, compiler: Compiler, cache: CodeCache | None = None) -> list[Binary]:
    """One :class:`Binary` per source; each distinct canonical source is compiled once (looked up
    in ``compiler.built``, then in the disk cache).  Misses compile on ``compiler.jobs`` threads,
    under a progress bar on a terminal (drawn when this takes more than 0.3 s).  A compile error
    raises the compiler's exception, naming the kernel."""
    cache = cache or code_cache()
    ident = cache_key(compiler.identity)
    keys, todo = [], {}
    for s in sources:
        h = hashlib.sha256(f"{ident}:{sorted(s.options.items())}:{s.text}".encode()).hexdigest()
        keys.append(h)
        if h not in compiler.built and h not in todo:
            todo[h] = s
    if todo:
        def one(s):
            return compile_source(compiler, s.text, s.kernel.name, cache, s.options)
        order = list(todo)
        if compiler.jobs > 1 and len(order) > 1:
            order.sort(key=lambda h: -len(todo[h].text))               # longest first: none starts last
        items = [todo[h] for h in order]
        if compiler.jobs > 1 and len(items) > 1:
            with ThreadPoolExecutor(min(compiler.jobs, len(items))) as ex:
                done = list(progress(ex.map(one, items), "building kernels", len(items), "kernel"))
        else:
            done = [one(s) for s in progress(items, "building kernels", unit="kernel")]
        compiler.built.update(zip(order, done))
    return [compiler.built[h] for h in keys]
