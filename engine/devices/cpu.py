"""CPU device: JIT-compile Loop IR kernels with LLVM (llvmlite, MCJIT) and launch them.

Usage::

    dev = CPUDevice()
    ck = dev.compile(kernel)                     # or dev.compile_many([k1, k2, ...]) (batched)
    ck({"x": x, "w": w, "out": out}, {"pos": 3}) # checked, convenient launch
    pos = ScalarSlots(["pos"])
    run = dev.prepare(ck, {"x": x, "w": w, "out": out}, pos)   # pointers bound once
    pos["pos"] = 7; run()                        # cheap launch; scalars read at launch time
    step = dev.plan([run, run2, ...]); step()    # a whole sequence in one native call

Kernel ABI: see ``codegen/llvm.py`` (``void NAME(ptr args, i32 tid, i32 nthreads)``).

Threads: a kernel whose outermost ``parallel`` loops can be split (see
``threadable``) and that moves more than ``parallel_bytes`` runs on
``nthreads`` threads: the iteration range is cut into ``nthreads`` chunks
(the kernel's ``tid``/``nthreads``) that the calling thread and persistent
worker threads claim with an atomic compare-and-swap, so a late worker never
stalls a launch (the caller simply runs the chunk itself).  Workers are Python
threads that sit inside a small native dispatcher (ctypes releases the GIL): it
spins on a job word in a shared control block and calls the kernel function
itself, so a hand-off costs well under a microsecond.  After ``spin_us``
without work a worker returns to Python and sleeps on a semaphore; the next
launch wakes it.  Launches must come from one Python thread at a time.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import ctypes.util
import functools
import os
import queue
import re
import threading
import time

import numpy as np

from dsl.quant import storage
import llvmlite.binding as llvm

from codegen.env import env_choice, env_int
from codegen.llvm import render_llvm
from codegen.loopir import Attention, Const, Kernel, Load, Loop, Reduce, Store, plain, walk_exprs, walk_stmts
from engine.build import Compiler, build, render, render_switches
from engine.devices import llvm_jobs

NP_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32),
             "bool": np.dtype(np.bool_)}
KERNEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
_TABLES = {}                      # n -> ctypes array type of n pointers

_HOST = {}


def _init_llvm():
    llvm_jobs.init_llvm()


def _host() -> dict:
    """This machine as the compiler targets it: CPU name, features, libmvec's vector widths (the
    library is loaded here: cached objects may call it) and whether LLVM's loop unroller runs."""
    if not _HOST:
        _init_llvm()
        _HOST.update(cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
                     libmvec=_libmvec_widths())
    return _HOST


def _host_target_machine(jit=False):
    return llvm_jobs.target_machine(_host(), jit)


def host_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- vector math
def _libmvec_widths():
    """glibc libmvec's vector widths on this host, ``{lanes: x86-64 vector ABI isa letter}`` (the
    library loaded into the process); {} where there is none."""
    if not llvm.get_default_triple().startswith("x86_64"):
        return {}
    lib = ctypes.util.find_library("mvec")
    try:
        llvm.load_library_permanently(lib)
    except Exception:                       # no libmvec (or lib is None): keep libm calls
        return {}
    feats = llvm.get_host_cpu_features()
    isa = {4: "b"}
    if feats.get("avx2"):
        isa[8] = "d"
    if feats.get("avx512f"):
        isa[16] = "e"
    return isa


def _vector_math(text):
    """Rename vector float math intrinsics to libmvec functions (``_ZGVeN16v_expf`` ...)."""
    return llvm_jobs.vector_math(text, _host()["libmvec"])


# ----------------------------------------------------------------------------- analysis
def threadable(kernel: Kernel) -> bool:
    """Can the kernel's outermost parallel loops be split across threads without a barrier?

    Needs a parallel loop, every Store to a parameter inside an outermost
    parallel loop, and each written buffer written and read only inside one
    such loop (so no thread reads what another thread writes).
    """
    params = {p.name for p in kernel.params}
    writes, reads = {}, []                  # region: id of the enclosing outermost parallel loop, or None

    def walk(body, region):
        for s in body:
            for f in ("start", "stop", "init", "index", "value"):
                e = getattr(s, f, None)
                if e is not None:
                    reads.extend((x.buf, region) for x in walk_exprs(e) if isinstance(x, Load))
            if isinstance(s, Store) and s.buf in params:
                writes.setdefault(s.buf, set()).add(region)
            if isinstance(s, Loop):
                walk(s.body, id(s) if s.parallel and region is None else region)

    body = plain(kernel.body)               # Reduce and Attention as the loops the CPU runs
    walk(body, None)
    if not any(isinstance(s, Loop) and s.parallel for s in walk_stmts(body)):
        return False
    if any(len(r) > 1 or None in r for r in writes.values()):
        return False
    return all(buf not in writes or writes[buf] == {region} for buf, region in reads)


def over_rows(kernel: Kernel) -> bool:
    """Does the kernel work over several rows: an attention over more than one query, or a
    serial loop of more than one iteration around a reduction (a prefill's GEMM and norms)?"""
    for s in walk_stmts(kernel.body):
        if isinstance(s, Attention) and s.t > 1:
            return True
        if (isinstance(s, Loop) and not s.parallel and isinstance(s.start, Const) and isinstance(s.stop, Const)
                and s.stop.value - s.start.value > 1 and any(isinstance(x, Reduce) for x in walk_stmts(s.body))):
            return True
    return False


# ----------------------------------------------------------------------------- scalars
class ScalarSlots:
    """Named i32 scalars living in one numpy array whose addresses launches bind once.

    ``slots["pos"] = 7`` changes the value every prepared launch that bound
    ``pos`` sees at its next launch.  Names get a slot on first use (up to
    ``capacity``; the array never moves).
    """

    def __init__(self, names=(), capacity=64, **values):
        self.array = np.zeros(capacity, np.int32)
        self.index = {}
        for n in names:
            self.add(n)
        for n, v in values.items():
            self[n] = v

    def add(self, name):
        if name not in self.index:
            if len(self.index) == len(self.array):
                raise ValueError(f"ScalarSlots full ({len(self.array)} names)")
            self.index[name] = len(self.index)
        return self.index[name]

    def __setitem__(self, name, value):
        self.array[self.add(name)] = value

    def __getitem__(self, name):
        return int(self.array[self.index[name]])

    def __contains__(self, name):
        return name in self.index

    def address(self, name):
        return self.array.ctypes.data + 4 * self.index[name]


# ----------------------------------------------------------------------------- worker pool
# Control block (int64 slots), written by the launching thread unless noted:
#   0  job word: seq (bits 32..63) | nchunks (16..31) | next unclaimed chunk (0..15; workers CAS it)
#   1  fn   2 args   4 quit   5 wake mask (out of vf_launch)
#   8  chunks done (workers add)   16+8w sleeping flag of worker w   17+8w last seq worker w finished
# A job is split into nchunks chunks (the kernel's tid / nthreads); every participant, the
# launching thread included, claims chunks with a CAS on the job word, so a worker that is
# late (descheduled, asleep) never delays the launch beyond the chunk it actually took.
_DISPATCH_IR = r"""
declare i64 @llvm.readcyclecounter()
{pause_decl}

define i64 @vf_ticks() {{
  %t = call i64 @llvm.readcyclecounter()
  ret i64 %t
}}

; claim and run chunks of job `seq` until none is left (or a newer job was published)
define internal void @vf_drain(ptr %ctl, ptr %fn, ptr %args, i64 %seq) alwaysinline {{
entry:
  %donep = getelementptr i64, ptr %ctl, i64 8
  br label %look
look:
  %word = load atomic i64, ptr %ctl acquire, align 8
  %s = lshr i64 %word, 32
  %same = icmp eq i64 %s, %seq
  %k = and i64 %word, 65535
  %n16 = lshr i64 %word, 16
  %n = and i64 %n16, 65535
  %avail = icmp ult i64 %k, %n
  %go = and i1 %same, %avail
  br i1 %go, label %claim, label %out
claim:
  %next = add i64 %word, 1
  %pair = cmpxchg ptr %ctl, i64 %word, i64 %next acq_rel acquire
  %ok = extractvalue {{ i64, i1 }} %pair, 1
  br i1 %ok, label %run, label %look
run:
  %f = load ptr, ptr %fn
  %a = load ptr, ptr %args
  %k32 = trunc i64 %k to i32
  %n32 = trunc i64 %n to i32
  call void %f(ptr %a, i32 %k32, i32 %n32)
  %old = atomicrmw add ptr %donep, i64 1 release
  br label %look
out:
  ret void
}}

; worker loop: returns 0 when the caller must sleep on its semaphore, 1 on quit
define i32 @vf_worker(ptr %ctl, i32 %w, i64 %limit) {{
entry:
  %w64 = sext i32 %w to i64
  %b = mul i64 %w64, 8
  %si = add i64 %b, 16
  %li = add i64 %b, 17
  %sleepp = getelementptr i64, ptr %ctl, i64 %si
  %lastp = getelementptr i64, ptr %ctl, i64 %li
  %fnp = getelementptr i64, ptr %ctl, i64 1
  %argsp = getelementptr i64, ptr %ctl, i64 2
  %quitp = getelementptr i64, ptr %ctl, i64 4
  br label %wait
wait:
  %t0 = call i64 @llvm.readcyclecounter()
  br label %spin
spin:
  %last = load i64, ptr %lastp
  %word = load atomic i64, ptr %ctl acquire, align 8
  %seq = lshr i64 %word, 32
  %new = icmp ne i64 %seq, %last
  br i1 %new, label %work, label %idle
work:
  call void @vf_drain(ptr %ctl, ptr %fnp, ptr %argsp, i64 %seq)
  store i64 %seq, ptr %lastp
  br label %wait
idle:
  %q = load atomic i64, ptr %quitp monotonic, align 8
  %quit = icmp ne i64 %q, 0
  br i1 %quit, label %exit, label %pause
pause:
  {pause}
  %t = call i64 @llvm.readcyclecounter()
  %dt = sub i64 %t, %t0
  %tired = icmp ugt i64 %dt, %limit
  br i1 %tired, label %sleep, label %spin
sleep:
  store atomic i64 1, ptr %sleepp seq_cst, align 8
  %word2 = load atomic i64, ptr %ctl seq_cst, align 8
  %seq2 = lshr i64 %word2, 32
  %last2 = load i64, ptr %lastp
  %still = icmp eq i64 %seq2, %last2
  br i1 %still, label %block, label %cancel
cancel:
  %old = atomicrmw xchg ptr %sleepp, i64 0 seq_cst
  %ours = icmp eq i64 %old, 1
  br i1 %ours, label %wait, label %block
block:
  ret i32 0
exit:
  ret i32 1
}}

; publish a job of nchunks chunks; returns the mask of sleeping workers the caller must wake
; (then call vf_finish), or runs the job (vf_finish) and returns 0
define i32 @vf_launch(ptr %ctl, ptr %fn, ptr %args, i32 %nchunks, i32 %nw) {{
entry:
  %fnp = getelementptr i64, ptr %ctl, i64 1
  %argsp = getelementptr i64, ptr %ctl, i64 2
  %maskp = getelementptr i64, ptr %ctl, i64 5
  %donep = getelementptr i64, ptr %ctl, i64 8
  store atomic i64 0, ptr %donep monotonic, align 8
  store ptr %fn, ptr %fnp
  store ptr %args, ptr %argsp
  %old = load atomic i64, ptr %ctl monotonic, align 8
  %s = lshr i64 %old, 32
  %s1 = add i64 %s, 1
  %hi = shl i64 %s1, 32
  %n64 = zext i32 %nchunks to i64
  %mid = shl i64 %n64, 16
  %word = or i64 %hi, %mid
  store atomic i64 %word, ptr %ctl seq_cst, align 8
  br label %check
check:
  %w = phi i32 [0, %entry], [%w1, %next]
  %mask = phi i32 [0, %entry], [%mask2, %next]
  %more = icmp slt i32 %w, %nw
  br i1 %more, label %look, label %decide
look:
  %w64 = sext i32 %w to i64
  %b = mul i64 %w64, 8
  %si = add i64 %b, 16
  %sleepp = getelementptr i64, ptr %ctl, i64 %si
  %sl = load atomic i64, ptr %sleepp seq_cst, align 8
  %asleep = icmp ne i64 %sl, 0
  br i1 %asleep, label %take, label %next
take:
  %was = atomicrmw xchg ptr %sleepp, i64 0 seq_cst
  %ours = icmp eq i64 %was, 1
  %bit = shl i32 1, %w
  %m1 = or i32 %mask, %bit
  %mask1 = select i1 %ours, i32 %m1, i32 %mask
  br label %next
next:
  %mask2 = phi i32 [%mask, %look], [%mask1, %take]
  %w1 = add i32 %w, 1
  br label %check
decide:
  %mask64 = zext i32 %mask to i64
  store i64 %mask64, ptr %maskp
  %wake = icmp ne i32 %mask, 0
  br i1 %wake, label %ret_mask, label %finish
ret_mask:
  ret i32 %mask
finish:
  call void @vf_finish(ptr %ctl, ptr %fn, ptr %args, i32 %nchunks, i32 %nw)
  ret i32 0
}}

; run the launching thread's share of the current job, then wait until every chunk is done
define void @vf_finish(ptr %ctl, ptr %fn, ptr %args, i32 %nchunks, i32 %nw) {{
entry:
  %fnp = getelementptr i64, ptr %ctl, i64 1
  %argsp = getelementptr i64, ptr %ctl, i64 2
  %donep = getelementptr i64, ptr %ctl, i64 8
  %word = load atomic i64, ptr %ctl monotonic, align 8
  %seq = lshr i64 %word, 32
  call void @vf_drain(ptr %ctl, ptr %fnp, ptr %argsp, i64 %seq)
  %n64 = zext i32 %nchunks to i64
  br label %spin
spin:
  %d = load atomic i64, ptr %donep acquire, align 8
  %busy = icmp ult i64 %d, %n64
  br i1 %busy, label %pause, label %out
pause:
  {pause}
  br label %spin
out:
  ret void
}}

; run plan entries [start, n) (int64 triples fn, args, nthreads); returns n when done, or the
; index i of a multi-threaded entry whose workers must be woken (mask in ctl[5]): the caller
; wakes them, calls vf_finish for entry i and resumes at i + 1.
define i32 @vf_run_plan(ptr %ctl, ptr %plan, i32 %start, i32 %n, i32 %nw) {{
entry:
  br label %head
head:
  %i = phi i32 [%start, %entry], [%i1, %step]
  %more = icmp slt i32 %i, %n
  br i1 %more, label %body, label %out
body:
  %i64 = sext i32 %i to i64
  %o = mul i64 %i64, 3
  %fnp = getelementptr i64, ptr %plan, i64 %o
  %o1 = add i64 %o, 1
  %argsp = getelementptr i64, ptr %plan, i64 %o1
  %o2 = add i64 %o, 2
  %ntp = getelementptr i64, ptr %plan, i64 %o2
  %fn = load ptr, ptr %fnp
  %args = load ptr, ptr %argsp
  %nt64 = load i64, ptr %ntp
  %nt = trunc i64 %nt64 to i32
  %par = icmp sgt i32 %nt, 1
  br i1 %par, label %multi, label %single
single:
  call void %fn(ptr %args, i32 0, i32 1)
  br label %step
multi:
  %mask = call i32 @vf_launch(ptr %ctl, ptr %fn, ptr %args, i32 %nt, i32 %nw)
  %wake = icmp ne i32 %mask, 0
  br i1 %wake, label %out, label %step
step:
  %i1 = add i32 %i, 1
  br label %head
out:
  ret i32 %i
}}
"""


def _dispatch_object(text: str, tm) -> bytes:
    """The dispatcher's object code for the host, through the disk cache (a warm start compiles
    nothing)."""
    from engine.build import code_cache, compile_source
    return compile_source(_DispatchCompiler(tm), text, "the thread pool's dispatcher", code_cache()).code


class _Pool:
    """``nworkers`` persistent threads running ``vf_worker``; one control block."""

    def __init__(self, nworkers: int, spin_us: float):
        self.nworkers = nworkers
        x86 = llvm.get_default_triple().startswith(("x86_64", "i686", "i386"))
        text = _DISPATCH_IR.format(pause_decl="declare void @llvm.x86.sse2.pause()" if x86 else "",
                                   pause="call void @llvm.x86.sse2.pause()" if x86 else "")
        tm = _host_target_machine(jit=True)
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
        self._engine.add_object_file(llvm.ObjectFileRef.from_data(_dispatch_object(text, tm)))
        self._engine.finalize_object()
        addr = self._engine.get_function_address
        self.ticks = ctypes.CFUNCTYPE(ctypes.c_int64)(addr("vf_ticks"))
        self.worker_fn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64)(
            addr("vf_worker"))
        sig = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                               ctypes.c_int32)
        self.launch_fn = sig(addr("vf_launch"))
        self.finish_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                          ctypes.c_int32)(addr("vf_finish"))
        self.run_plan_fn = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                            ctypes.c_int32, ctypes.c_int32)(addr("vf_run_plan"))
        self.spin_ticks = int(spin_us * self._ticks_per_us())
        self.ctl = np.zeros(16 + 8 * nworkers + 8, np.int64)
        self.ctl_addr = self.ctl.ctypes.data
        self.sems = [threading.Semaphore(0) for _ in range(nworkers)]
        old = threading.stack_size(64 << 20)          # kernels keep local Arrays on the stack
        try:
            self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True, name=f"vf-cpu-{w + 1}")
                            for w in range(nworkers)]
            for t in self.threads:
                t.start()
        finally:
            threading.stack_size(old)
        atexit.register(self.close)

    def _ticks_per_us(self):
        t0, c0 = time.perf_counter(), self.ticks()
        time.sleep(0.005)
        t1, c1 = time.perf_counter(), self.ticks()
        return max(1.0, (c1 - c0) / ((t1 - t0) * 1e6))

    def _work(self, w):
        while self.worker_fn(self.ctl_addr, w, self.spin_ticks) == 0:
            self.sems[w].acquire()

    def wake_from_ctl(self):
        """Wake the workers whose sleep the last ``vf_launch`` cancelled (mask in ctl[5])."""
        mask = int(self.ctl[5])
        for w in range(self.nworkers):
            if mask >> w & 1:
                self.sems[w].release()

    def close(self):
        if self.ctl[4]:
            return
        self.ctl[4] = 1
        for s in self.sems:
            s.release()
        for t in self.threads:
            t.join(timeout=1.0)


_pools: dict = {}


def _pool(nworkers, spin_us) -> _Pool:
    """The process-wide pool with ``nworkers`` workers (0: just the native dispatcher, for plans)."""
    key = (nworkers, spin_us)
    if key not in _pools:
        _pools[key] = _Pool(nworkers, spin_us)
    return _pools[key]


# ----------------------------------------------------------------------------- compiled kernels
class CompiledKernel:
    """A kernel JIT-compiled for the host.  Call it with ``(buffers, scalars)``.

    ``symbol``: its function in the JIT (shared by kernels equal up to names); ``binary``: the
    :class:`engine.build.Binary` it was loaded from."""

    def __init__(self, device, source, binary, address):
        self.device, self.kernel, self.binary = device, source.kernel, binary
        self.symbol, self.address = binary.entry, address
        self.fn = KERNEL_FN(address)
        self._rendered = source
        if self.symbol not in device._threadable:         # the same for kernels equal up to names
            device._threadable[self.symbol] = threadable(self.kernel)
        self.threadable = device._threadable[self.symbol]
        self.nthreads = device.default_nthreads(self.kernel, self.threadable)

    @property
    def source(self) -> str:
        """The LLVM IR of this kernel, with its own names, as rendered (before optimization)."""
        return self._rendered.readable

    def asm(self) -> str:
        """Host assembly of this kernel's function (inlined body included)."""
        return self.device.compiler.disassemble(self.binary)

    def __call__(self, buffers: dict, scalars: dict | None = None, nthreads: int | None = None):
        self.device.prepare(self, buffers, scalars, nthreads)()

    def __repr__(self):
        return f"<CompiledKernel {self.kernel.name} as {self.symbol}, nthreads={self.nthreads}>"


class Launch:
    """A prepared launch (argument table bound once).  ``launch()`` runs the kernel; ``launch.run``
    is the bare callable (one Python frame less, for hot loops)."""

    __slots__ = ("compiled", "nthreads", "table", "keep", "fn_addr", "table_addr", "run")

    def __init__(self, compiled, table, keep, nthreads, pool):
        self.compiled, self.table, self.keep, self.nthreads = compiled, table, keep, nthreads
        self.fn_addr = fn = compiled.address
        self.table_addr = args = ctypes.addressof(table)
        if nthreads > 1:
            launch, finish, ctl, nw = pool.launch_fn, pool.finish_fn, pool.ctl_addr, pool.nworkers

            def run():
                if launch(ctl, fn, args, nthreads, nw):      # some workers were asleep: wake them, join in
                    pool.wake_from_ctl()
                    finish(ctl, fn, args, nthreads, nw)
            self.run = run
        else:
            self.run = functools.partial(compiled.fn, args, 0, 1)

    def __call__(self):
        self.run()


class Plan:
    """A fixed sequence of prepared launches run by one native call: ``plan()``."""

    def __init__(self, launches, pool):
        self.launches, self.pool = list(launches), pool
        self.entries = np.array([(l.fn_addr, l.table_addr, l.nthreads) for l in self.launches],
                                np.int64).reshape(-1, 3)

    def __call__(self):
        pool, n = self.pool, len(self.launches)
        plan, ctl, nw = self.entries.ctypes.data, pool.ctl_addr, pool.nworkers
        i = pool.run_plan_fn(ctl, plan, 0, n, nw)
        while i < n:                                       # entry i found sleeping workers
            pool.wake_from_ctl()
            fn, args, nt = (int(v) for v in self.entries[i])
            pool.finish_fn(ctl, fn, args, nt, nw)
            i = pool.run_plan_fn(ctl, plan, i + 1, n, nw)


# ----------------------------------------------------------------------------- compiler
def compile_workers(jobs: int) -> int:
    """How many helper processes compile beside this one: ``VEGAFUSE_COMPILE_WORKERS`` if set (0:
    compile in this process only, the A/B switch), else ``jobs - 1``.  ValueError, one line, for
    a value that is not a whole number >= 0."""
    return env_int("VEGAFUSE_COMPILE_WORKERS", max(0, jobs - 1), 0,
                   "0 (compile in this process) or the number of helper processes")


_PLACES: dict = {}                    # helper count -> queue of free compile places (None: this process)
_PLACES_LOCK = threading.Lock()


def _places(workers: int) -> queue.SimpleQueue:
    """The process-wide free places to compile in: this process and ``workers`` helper processes
    (started at the first compile that needs them; ended at exit)."""
    with _PLACES_LOCK:
        if workers not in _PLACES:
            q = queue.SimpleQueue()
            q.put(None)
            for _ in range(workers):
                helper = llvm_jobs.Helper()
                atexit.register(helper.close)
                q.put(helper)
            _PLACES[workers] = q
        return _PLACES[workers]


class LLVMCompiler(Compiler):
    """LLVM IR to host object code with llvmlite: O3 with loop and SLP vectorization for the host
    CPU, vector math through libmvec (``engine/devices/llvm_jobs.py``).

    llvmlite lets one thread at a time into LLVM, so compiles run side by side in helper
    processes: ``jobs`` compiles at once, here and in ``jobs - 1`` helpers
    (``VEGAFUSE_COMPILE_WORKERS`` sets their number; 0: here only, one at a time).  A helper
    compiles with the same code and target, so its object is the one this process would build;
    a helper that dies is replaced by this process, with one warning line.

    Each object exports one kernel function, named ``vf_<hash of the source>`` so that objects
    from the disk cache never clash in one JIT.  The cache identity: llvmlite's and LLVM's
    versions, the host triple, CPU and features, the libmvec widths, and a hash of this file
    and ``llvm_jobs.py`` (the optimization pipeline is written there)."""

    def __init__(self, jobs: int = 1):
        super().__init__()
        self.host = _host()
        self.workers = compile_workers(jobs)
        self.jobs = 1 + self.workers
        self.identity = self.identity_of()

    @staticmethod
    def identity_of() -> dict:
        """The cache identity of this host's objects (see the class)."""
        import llvmlite
        h = hashlib.sha256()
        for path in (__file__, llvm_jobs.__file__):
            with open(path, "rb") as f:
                h.update(f.read())
        host = _host()
        return {"kind": "llvm-object", "compiler": f"llvmlite {llvmlite.__version__}, LLVM "
                + ".".join(map(str, llvm.llvm_version_info)), "arch": llvm.get_process_triple(),
                "cpu": host["cpu"], "features": host["features"],
                "libmvec": sorted(host["libmvec"].items()), "pipeline": h.hexdigest()[:16]}

    def render(self, kernel: Kernel) -> str:
        """LLVM IR of ``kernel``; int8 dot products call ``vpdpbusd`` where the host has VNNI
        (``VEGAFUSE_CPU_VNNI=0``: the generic vector code LLVM lowers itself, the A/B switch), its
        512-bit form, two weight blocks a step, where it has AVX-512 VNNI and BW
        (``VEGAFUSE_CPU_VNNI=256``: the 256-bit form, a block at a time)."""
        feats, mode = llvm.get_host_cpu_features(), env_choice("VEGAFUSE_CPU_VNNI", ("512", "256", "0"), "512")
        vnni = bool(feats.get("avx512vnni") and feats.get("avx512vl") or feats.get("avxvnni")) and mode != "0"
        wide = vnni and bool(feats.get("avx512vnni") and feats.get("avx512bw")) and mode != "256"
        return render_llvm(kernel, vnni=512 if wide else 256 if vnni else 0)

    def render_key(self) -> dict:
        """What :meth:`render` depends on besides the kernel: the compiler's sources (dsl, fusion,
        codegen) and the ``VEGAFUSE_*`` switches; with the identity (host CPU features decide
        VNNI) it keys the rendered LLVM IR in the disk cache, so a warm start renders nothing."""
        from engine.pipeline import _compiler_sources
        return {"renderer": _compiler_sources(), "switches": render_switches()}

    def entry(self, source: str) -> str:
        return "vf_" + hashlib.sha256(source.encode()).hexdigest()[:16]

    def compile_options(self, kernel: Kernel) -> dict:
        """``{"unroll": False}`` (LLVM's loop unroller off) for a kernel over several rows (a
        prefill's, see :func:`over_rows`) unless ``VEGAFUSE_CPU_UNROLL=all``: their compile takes a
        third of the time, and their speed measured the same within the shared machine's noise
        (docs/performance.md); one-row kernels (decode: their int8 GEMVs need the full unroll) keep
        it.  ValueError, one line, for another value of the switch."""
        mode = env_choice("VEGAFUSE_CPU_UNROLL", ("one-row", "all"), "one-row")
        return {"unroll": False} if mode == "one-row" and over_rows(kernel) else {}

    def optimize(self, text: str, symbol: str, unroll: bool = True):
        """IR text -> (optimized module, its target machine), the exported function renamed
        ``symbol`` (``llvm_jobs.optimize``).  Thread-safe: own LLVM context and target machine."""
        return llvm_jobs.optimize(text, symbol, {**self.host, "unroll": unroll})

    def holds(self, code: bytes, entry: str) -> bool:
        """An ELF object whose symbol table names ``entry`` (loading anything else into the JIT
        could crash the process)."""
        return code[:4] == b"\x7fELF" and entry.encode() + b"\0" in code

    def expect_compiles(self) -> None:
        """Start the helper processes now (a render missed): they are ready when compiles begin."""
        _places(self.workers)

    def compile(self, source: str, name: str, unroll: bool = True) -> bytes:
        """Object code of ``source`` (``unroll``: LLVM's loop unroller on), compiled in the first
        free place (this process or a helper); a RuntimeError naming kernel ``name`` and LLVM's
        first complaint (with its line) if the IR does not parse or verify."""
        host = {**self.host, "unroll": unroll}
        places = _places(self.workers)
        place = places.get()
        try:
            if place is not None:
                try:
                    return place.compile(source, self.entry(source), host)
                except llvm_jobs.HelperDied as e:
                    from engine.codecache import warn
                    warn(f"{e}; kernel {name} compiles in this process")
                    place = None                       # this process takes the dead helper's place
                except RuntimeError as e:
                    raise _compile_error(name, e) from None
            try:
                return llvm_jobs.compile_object(source, self.entry(source), host)
            except (RuntimeError, ValueError) as e:
                raise _compile_error(name, e) from None
        finally:
            places.put(place)

    def disassemble(self, binary) -> str:
        """Host assembly of ``binary``'s kernel function (optimized again from its source)."""
        mod, _ = self.optimize(binary.source, binary.entry, **binary.options)
        text = _host_target_machine(jit=False).emit_assembly(mod)
        sym = re.escape(binary.entry)
        m = re.search(rf'^"?{sym}"?:.*?(?=^\.Lfunc_end|\Z)', text, re.S | re.M)
        return m.group(0) if m else text


def _compile_error(name: str, e: Exception) -> RuntimeError:
    lines = str(e).strip().splitlines() or ["(no message)"]
    return RuntimeError(f"LLVM kernel {name!r} failed to compile: " + "\n  ".join(lines[:4]))


class _DispatchCompiler(LLVMCompiler):
    """The worker pool's dispatcher (``_DISPATCH_IR``, several functions) compiled as it is."""

    def __init__(self, tm):
        Compiler.__init__(self)
        self.tm = tm
        ident = self.identity_of()
        ident.pop("libmvec")                          # calls no vector math
        self.identity = {**ident, "kind": "llvm-dispatch"}

    def entry(self, source: str) -> str:
        return "vf_run_plan"

    def compile(self, source: str, name: str) -> bytes:
        mod = llvm.parse_assembly(source)
        mod.triple, mod.data_layout = self.tm.triple, str(self.tm.target_data)
        mod.verify()
        return self.tm.emit_object(mod)


# ----------------------------------------------------------------------------- device
class _IdRing:
    """Generated ids kept for ``Model.decode_ids`` (see ``CPUDevice.id_ring``)."""

    def __init__(self, n):
        self.n, self.slots = n, [0] * n

    def post(self, i, src):
        self.slots[i % self.n] = int(src.reshape(-1)[0])

    def read(self, i) -> int:
        return self.slots[i % self.n]


class CPUDevice:
    """JIT compiler + launcher for the host CPU.

    ``nthreads``: threads for multi-threaded launches (default: usable cores).
    ``parallel_bytes``: kernels moving more bytes than this (``Kernel.bytes``) run multi-threaded.
    ``spin_us``: how long idle workers spin before sleeping.
    """

    name = "cpu"

    def __init__(self, nthreads: int | None = None, parallel_bytes: int = 256 << 10, spin_us: float | None = None):
        _init_llvm()
        self.nthreads = max(1, nthreads or host_threads())
        self.parallel_bytes = parallel_bytes
        self.spin_us = env_int("VEGAFUSE_SPIN_US", 2000, 0, "microseconds from 0 to 1000000", 10 ** 6) \
            if spin_us is None else spin_us
        self.triple = llvm.get_process_triple()
        self.cpu_name = llvm.get_host_cpu_name()
        self.compiler = LLVMCompiler(jobs=self.nthreads)
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _host_target_machine(jit=True))
        self._addresses = {}              # symbol -> address of a function loaded into the JIT
        self._threadable = {}             # symbol -> threadable(kernel) of the kernels it runs
        self._pool = None

    # ---- compilation
    def default_nthreads(self, kernel, can_thread):
        return self.nthreads if can_thread and kernel.bytes > self.parallel_bytes else 1

    def compile(self, kernel: Kernel) -> CompiledKernel:
        """Render, optimize (O3, host CPU) and JIT one kernel."""
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels) -> list:
        """Render, build (:mod:`engine.build`: kernels equal up to names, the same layer thirty
        times, compile once; distinct ones on ``nthreads`` threads; through the disk cache) and
        load every kernel."""
        sources = render(kernels, self.compiler)
        return self.load(sources, build(sources, self.compiler))

    def load(self, sources, binaries) -> list:
        """:class:`CompiledKernel`\\ s for built kernels; each object is added to the JIT once."""
        new = {b.entry: b for b in binaries if b.entry not in self._addresses}
        for b in new.values():
            self._engine.add_object_file(llvm.ObjectFileRef.from_data(b.code))
        if new:
            self._engine.finalize_object()
            for sym in new:
                self._addresses[sym] = self._engine.get_function_address(sym)
        return [CompiledKernel(self, s, b, self._addresses[b.entry]) for s, b in zip(sources, binaries)]

    # ---- launching
    def _pool_for(self, nthreads):
        """The worker pool (``self.nthreads - 1`` workers, shared process-wide) for multi-chunk launches."""
        if nthreads <= 1:
            return None
        if self._pool is None:
            self._pool = _pool(min(self.nthreads, 32) - 1, self.spin_us)   # wake masks are 32-bit
        return self._pool

    def prepare(self, compiled: CompiledKernel, buffers: dict, scalars=None, nthreads: int | None = None) -> Launch:
        """Check and bind arguments once; ``launch()`` then runs the kernel.

        ``buffers``: name -> C-contiguous ndarray with the param's dtype and shape.
        ``scalars``: a ``ScalarSlots`` (bound by address: later changes are seen by the launch),
        or a dict name -> int (copied now) or name -> int32 ndarray (bound by address).
        ``nthreads``: chunks to split the parallel loops into (default: the compiled choice;
        always 1 for kernels that are not ``threadable``).
        """
        k = compiled.kernel
        n = max(1, len(k.params))
        if n not in _TABLES:
            _TABLES[n] = ctypes.c_void_p * n
        table = _TABLES[n]()
        keep, spans, private = [table, scalars], [], None
        for j, p in enumerate(k.params):
            if p.kind == "buffer":
                a = buffers.get(p.name)
                self._check_buffer(k, p, a)
                table[j] = ptr = a.__array_interface__["data"][0]
                spans.append((p, ptr, ptr + a.nbytes))
                keep.append(a)
            elif isinstance(scalars, ScalarSlots):
                if p.name not in scalars:
                    raise ValueError(f"kernel {k.name}: missing scalar {p.name!r}")
                table[j] = scalars.address(p.name)
            else:
                v = (scalars or {}).get(p.name)
                if isinstance(v, np.ndarray) and v.dtype == np.int32 and v.size >= 1:
                    table[j] = v.__array_interface__["data"][0]
                    keep.append(v)
                elif isinstance(v, (int, np.integer)) and -2 ** 31 <= v < 2 ** 31:
                    private = private or ScalarSlots(capacity=len(k.params))
                    private[p.name] = v
                    table[j] = private.address(p.name)
                    keep.append(private)
                else:
                    raise ValueError(f"kernel {k.name}: scalar {p.name!r} must be an i32 int or int32 array, "
                                     f"got {v!r}")
        if len(spans) != len(buffers):
            extra = set(buffers) - {p.name for p in k.params}
            raise ValueError(f"kernel {k.name}: unknown buffers {sorted(extra)}")
        self._check_aliasing(k, spans)
        nt = max(1, compiled.nthreads if nthreads is None else nthreads) if compiled.threadable else 1
        return Launch(compiled, table, keep, nt, self._pool_for(nt))

    def plan(self, launches, slots=None) -> Plan:
        """Bundle prepared launches; ``plan()`` runs them in order with a single native call.
        (``slots``: the ScalarSlots they read, already bound by address.)"""
        return Plan(launches, self._pool_for(2))

    # ---- memory: host memory is device memory here
    def empty(self, shape, dtype):
        return np.zeros(shape, NP_DTYPES[dtype] if isinstance(dtype, str) else dtype)

    def copy_in(self, dst, a):
        np.copyto(dst, a, casting="same_kind")

    def to_host(self, a):
        return a.copy()

    def resident(self, a):
        return a

    def copy(self, dst, src, nbytes=None):
        """Copy ``src`` into ``dst`` (numpy arrays; ``nbytes`` from the start)."""
        n = nbytes or src.nbytes
        dst.view(np.uint8).reshape(-1)[:n] = src.view(np.uint8).reshape(-1)[:n]

    def synchronize(self):
        pass

    def random(self, shape, dtype, scale=0.02, seed=0, shift=0.0):
        """Uniform values in [shift - scale, shift + scale) (benchmarks with random weights)."""
        rng = np.random.default_rng(seed)
        return (shift + rng.uniform(-scale, scale, shape)).astype(NP_DTYPES[dtype])

    def put(self, a):
        return a

    def is_device_array(self, x):
        return False

    def scalar_slots(self, names):
        return ScalarSlots(names)

    def id_ring(self, n=16):
        """``gpu.IdRing``'s interface where the kernels have already run: ``post(i, src)`` keeps the
        first value of ``src`` (a numpy array), ``read(i)`` returns it."""
        return _IdRing(n)

    @staticmethod
    def _check_buffer(k, p, a):
        where = f"kernel {k.name}: buffer {p.name!r}"
        if a is None:
            raise ValueError(f"{where} missing")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{where} must be a numpy array, got {type(a).__name__}")
        shape, dt = storage(p.dtype, p.shape)
        if a.dtype != dt:
            raise TypeError(f"{where} must be {dt} ({p.dtype}), got {a.dtype}")
        if tuple(a.shape) != shape:
            raise ValueError(f"{where} must have shape {shape}, got {a.shape}")
        if not (a.flags.c_contiguous and a.flags.aligned):
            raise ValueError(f"{where} must be C-contiguous and aligned")
        if p.role != "in" and not a.flags.writeable:
            raise ValueError(f"{where} ({p.role}) must be writeable")

    @staticmethod
    def _check_aliasing(k, spans):
        for p, lo, hi in spans:
            if p.role != "out" or lo == hi:
                continue
            for q, lo2, hi2 in spans:
                if q is not p and lo2 < hi and lo < hi2:
                    raise ValueError(f"kernel {k.name}: output {p.name!r} overlaps buffer {q.name!r}")
