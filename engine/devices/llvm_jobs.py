"""LLVM IR to host object code, in this process or in helper processes that compile side by side.

    obj = compile_object(text, symbol, host)        # here (llvmlite, under its process-wide lock)
    helper = Helper(); obj = helper.compile(text, symbol, host)   # the same, in another process

llvmlite serializes every call into LLVM behind one lock per process, so threads compile one
kernel at a time whatever the number of cores.  A :class:`Helper` is a child Python process
(``python -c "... serve()"``) that imports only this module and llvmlite (about 0.2 s to start)
and compiles what it is sent with the same function, so its objects are byte for byte those of
an in-process compile.  ``engine.devices.cpu.LLVMCompiler`` keeps ``jobs - 1`` of them
(``VEGAFUSE_COMPILE_WORKERS``: how many; 0 compiles in this process only, the A/B switch).

``host``: the target, a dict ``{"cpu", "features", "libmvec": {width: isa letter}, "unroll"}``;
the caller's, so both sides build for the same machine.  ``unroll``: LLVM's loop unroller on
(True) or off (full unrolls only where the IR asks for them).

Protocol (pipes, little-endian): a request is ``u64 length`` + JSON ``{"symbol", "host"}``, then
``u64 length`` + the IR text; the reply is one status byte (0: the object follows, 1: an error
line follows) + ``u64 length`` + the bytes.  End of input ends the helper.
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading

import llvmlite.binding as llvm

_LEN = struct.Struct("<Q")
_ready = False
_init_lock = threading.Lock()


def init_llvm() -> None:
    """Initialize LLVM's native target and assembly printer (once per process)."""
    global _ready
    with _init_lock:
        if not _ready:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _ready = True


def target_machine(host: dict, jit: bool = True):
    """A target machine for ``host``'s CPU and features at O3 (``jit``: the JIT's code model)."""
    init_llvm()
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=host["cpu"], features=host["features"], opt=3,
                                        codemodel="jitdefault" if jit else "default", jit=jit)


# The loop vectorizer widens llvm.exp/log/sin/cos to vector intrinsics that the backend would
# scalarize into libm calls; glibc's libmvec has vector versions (x86-64 vector ABI names).
_VEC_MATH = {"exp": "expf", "log": "logf", "sin": "sinf", "cos": "cosf"}


def vector_math(text: str, widths: dict) -> str:
    """Rename vector float math intrinsics to libmvec functions (``_ZGVeN16v_expf`` ...) for the
    ``widths`` libmvec has (``{16: "e", 8: "d", 4: "b"}``; keys may be strings, from JSON)."""
    if "f32(<" not in text:
        return text
    isa_of = {int(w): isa for w, isa in widths.items()}

    def sub(m):
        isa = isa_of.get(int(m.group(2)))
        return f"@_ZGV{isa}N{m.group(2)}v_{_VEC_MATH[m.group(1)]}" if isa else m.group(0)
    return re.sub(r"@llvm\.(exp|log|sin|cos)\.v(\d+)f32\b", sub, text)


def optimize(text: str, symbol: str, host: dict):
    """IR text -> (optimized module, its target machine), the exported function renamed ``symbol``:
    O3 with loop and SLP vectorization (and the loop unroller where ``host["unroll"]``), vector
    math through libmvec.  Thread-safe (own LLVM context and target machine).  RuntimeError or
    ValueError where the IR does not parse or verify."""
    ctx = llvm.create_context()
    mod = llvm.parse_assembly(text, context=ctx)
    exported = [f for f in mod.functions if not f.is_declaration and f.linkage == llvm.Linkage.external]
    if len(exported) != 1:
        raise ValueError(f"expected one exported function in the module, found {len(exported)}")
    exported[0].name = symbol
    tm = target_machine(host)
    mod.triple, mod.data_layout = tm.triple, str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = pto.slp_vectorization = True
    pto.loop_unrolling = bool(host.get("unroll", True))
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    text = str(mod)
    vectorized = vector_math(text, host["libmvec"])
    if vectorized != text:
        mod = llvm.parse_assembly(vectorized, context=ctx)
        mod.verify()
    return mod, tm


def compile_object(text: str, symbol: str, host: dict) -> bytes:
    """Object code of ``text`` (see :func:`optimize`)."""
    mod, tm = optimize(text, symbol, host)
    return tm.emit_object(mod)


# ----------------------------------------------------------------------------- helper processes
def _read(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _read_blob(f) -> bytes:
    (n,) = _LEN.unpack(_read(f, _LEN.size))
    return _read(f, n)


def serve(inp=None, out=None) -> None:
    """The helper's loop: compile each request, reply with the object or the error, until the
    input ends."""
    inp, out = inp or sys.stdin.buffer, out or sys.stdout.buffer
    while True:
        try:
            head = json.loads(_read_blob(inp))
            text = _read_blob(inp).decode()
        except EOFError:
            return
        try:
            status, payload = 0, compile_object(text, head["symbol"], head["host"])
        except Exception as e:                       # a bad module: the error travels back
            status, payload = 1, f"{type(e).__name__}: {e}".encode()
        out.write(bytes([status]) + _LEN.pack(len(payload)) + payload)
        out.flush()


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOT = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
         "from engine.devices.llvm_jobs import serve; serve()")


class HelperDied(RuntimeError):
    """A helper process ended (or its pipe broke) before replying."""


class Helper:
    """One helper process (started here; ends when this object is closed or this process exits)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)

    def compile(self, text: str, symbol: str, host: dict) -> bytes:
        """Object code of ``text``, compiled in the helper.  RuntimeError with LLVM's message
        where it does not compile; :class:`HelperDied` where the helper is gone."""
        head = json.dumps({"symbol": symbol, "host": host}).encode()
        body = text.encode()
        try:
            self.proc.stdin.write(_LEN.pack(len(head)) + head + _LEN.pack(len(body)) + body)
            self.proc.stdin.flush()
            status = _read(self.proc.stdout, 1)[0]
            payload = _read_blob(self.proc.stdout)
        except (EOFError, OSError, ValueError) as e:
            raise HelperDied(f"LLVM helper process {self.proc.pid} ended ({type(e).__name__})") from None
        if status:
            raise RuntimeError(payload.decode(errors="replace"))
        return payload

    def close(self) -> None:
        """End the helper (it exits at the end of its input)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
