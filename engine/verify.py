"""Live verification (``--verify``): every kernel of a real run checked against the reference interpreter.

While a :func:`checking` block is open (``engine.generate --verify`` opens one around the whole
generation), every call of an executable runs its kernels one at a time.  Before each launch the
kernel's input buffers are read back from the device and the DSL equations the kernel holds
(``Kernel.eqns``, the fused region) are evaluated on them by ``dsl.interpreter`` in float64; after
the launch each buffer the kernel wrote is read back and compared with that reference.  Taking the
inputs before the launch is what makes in-place kernels (the KV-cache write, a donated state)
checkable: the reference sees the buffer as it was.  Quantized weights are given to the interpreter
as the host's ``dsl.QArray`` (the device holds them in another layout); every other input, weights
included, is the device's own copy.

The comparison is made at the buffer's dtype, because a check catches only what it compares: the
float64 reference is rounded to the buffer's dtype (an f16 KV cache is compared as f16), integers
must be equal, and a q8_1 activation that a GPU producer writes beside its float buffer
(``fusion/q8.py``, ``{buf}_q8``) is decoded from its bytes (quants, residuals, scale) and compared
with the reference of that float buffer, times the next normalization's weight where the producer
quantizes ``x * g`` for it; the block sums of squares it writes then (``{buf}_ss``) are compared
with those of the float buffer's reference.  A kernel without equations that writes a buffer (the copy
before an update that cannot run in place) must copy its one input bit for bit.

**Tolerance.**  Element i fails when

    |got_i - ref_i| > ulp(ref_i) + TOL * (|ref_i| + rms(ref)),   TOL = SAFETY * (U_F32 * sqrt(L) + U_ACT)

* ``ulp``: the spacing of the buffer's dtype at ref_i: both sides round once to it, so an f16 value
  may differ by one ulp (a copy gets no ulp: it must be bit for bit; integers must be equal);
* ``rms(ref)``: the root mean square of the reference's finite nonzero elements, the size of the
  tensor's values (a reduction's rounding error scales with its terms, not with a result that
  cancels; zeros left by an in-place update do not dilute it);
* ``U_F32`` = 2^-24, the unit roundoff of the kernels' f32 arithmetic, and ``L`` the kernel's
  reduction length: the sum over its equations of what each folds (a dot its contracted axis, a
  reduction its last axis, attention its keys plus its head dim, a scan its length times its
  body's), so that a random-walk rounding error grows as sqrt(L);
* ``U_ACT``: an operand rounded on its way in, relative to the tensor's size: a q8_1 activation
  where quantized weights meet integer dot products (``VEGAFUSE_QUANT_ACT`` not ``float``), whose
  error is half of 1/256 of a step (max / 127) of its block with the residual plane, 2^-16 of the
  block's largest value, taken as 2^-11 of the tensor's size because a block's largest value can be
  30 times the rms (outlier channels); without the plane (``VEGAFUSE_QUANT_RESIDUAL=0``) half a step,
  2^-6, and the check is loose (it catches gross errors only); an activation or tile a GPU kernel holds as f16 (gfx906's
  v_dot2_f32_f16, a tiled matmul), 2^-11; else 0;
* ``SAFETY`` = 32 covers approximate transcendentals (a few ulp) and errors that compound in an
  epilogue (SiLU(gate) * up carries both GEMVs' errors).

On SmolLM2 (CPU, 20 tokens) the largest error stays under 15% of this tolerance with Q4_1 weights;
with f16 or f32 weights the largest is an f16 KV-cache element one ulp off (up to 100%, allowed by
the ulp term).  A wrong index moves an element by about the tensor's rms, 60 times the loosest of
these tolerances on the default paths (Q4_1's: 2^-6, 1.6%; 50% without the residual plane).  The relative error reported is |got - ref| / (|ref| + rms(ref)), the
quantity the tolerance bounds.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np

from codegen.loopir import quantized_activations
from dsl.core import NP_DTYPES

from .errors import ModelError

U_F32 = 2.0 ** -24
U_ACT = {"q8_1r": 2.0 ** -11, "q8_1": 2.0 ** -6}
U_HALF = 2.0 ** -11
SAFETY = 32


class Mismatch(ModelError):
    """A kernel's output differs from the reference interpreter's beyond the tolerance (one line:
    the kernel, the tensor, the first bad index, the largest absolute and relative errors)."""


class Verifier:
    """Counts of a checked run: ``calls`` (executable calls), ``launches`` (kernels run and
    checked), ``buffers`` and ``elements`` compared, ``worst`` (the largest error as a fraction of
    its tolerance, and where); ``unchecked``: buffers written that hold no DSL value (scratch)."""

    def __init__(self):
        self.calls = self.launches = self.buffers = self.elements = 0
        self.worst = (0.0, "")
        self.unchecked = set()
        self._checks = weakref.WeakKeyDictionary()        # Executable -> [KernelCheck]

    def summary(self) -> str:
        """One line: what was compared, and how close the largest error came to its tolerance."""
        frac, where = self.worst
        line = (f"verify: {self.buffers} buffers, {self.elements:,} elements compared in {self.launches} kernel "
                f"launches ({self.calls} calls); all within tolerance, the largest error {100 * frac:.2g}% "
                f"of its tolerance ({where})")
        if self.unchecked:
            line += f"; not compared (scratch): {', '.join(sorted(self.unchecked))}"
        return line

    def run(self, ex, by_name, leaves):
        """Run ``ex``'s bound kernels one at a time, each checked (``Executable.call_flat``'s hook)."""
        checks = self._checks.get(ex)
        if checks is None:
            checks = self._checks[ex] = kernel_checks(ex)
        self.calls += 1
        dev, run = ex.device, ex._plan_run
        slots = getattr(run, "slots", None)
        if hasattr(slots, "flush"):                        # a GPU's scalar slots, as the plan would
            slots.flush(dev.stream)
        for i, (check, launch) in enumerate(zip(checks, run.launches)):
            ref = check.reference(ex, by_name, leaves)
            launch()
            self.compare(ex, check, ref, f"call {self.calls}, launch {i + 1} of {len(checks)}")

    def compare(self, ex, check, ref, when):
        """Compare each buffer ``check.kernel`` wrote with its reference; raise :class:`Mismatch`."""
        for name, want, tol in ref:
            got = read(ex, name).reshape(-1)
            if check.q8.get(name):
                got = q8_values(got, check.q8[name], want.size)
            frac, first = _errors(got, want.reshape(-1), tol)
            if first is not None:
                raise Mismatch(mismatch_line(check.kernel.name, name, want, got, first, when))
            self.buffers += 1
            self.elements += want.size
            if frac > self.worst[0]:
                self.worst = (frac, f"{name} in {check.kernel.name}")
        self.unchecked |= check.scratch
        self.launches += 1


class KernelCheck:
    """What checking one kernel takes: its ``program`` (the kernel's equations as a ``dsl.Program``
    from the values it reads to the buffers it writes), where each input comes from
    (``sources``: a buffer name, or a program input index for a quantized weight), the buffer of
    each output, its reduction length, the activation's quantization error ``u_act``, the q8_1
    buffers it writes (name -> format) and, for a copy, the buffer it copies."""

    def __init__(self, kernel, program, sources, outputs, length, u_act, q8, copy_of, scratch, blocks=None):
        self.kernel, self.program, self.sources, self.outputs = kernel, program, sources, outputs
        self.length, self.u_act, self.q8, self.copy_of, self.scratch = length, u_act, q8, copy_of, scratch
        self.blocks = blocks or {}        # q8 buffer -> (x, its norm weight g, the block sums' buffer) (q8_producers)

    def tolerance(self) -> float:
        return SAFETY * (U_F32 * math.sqrt(self.length) + self.u_act)

    def reference(self, ex, by_name, leaves):
        """``[(buffer name, reference values at the buffer's dtype, TOL)]`` from the inputs as
        they are now (before the launch)."""
        if self.copy_of is not None:
            src, dst = self.copy_of
            return [(dst, read(ex, src, by_name).copy(), 0.0)]
        args = [leaves[s] if isinstance(s, int) else read(ex, s, by_name) for s in self.sources]
        outs = self.program.run(*args, compute_dtype="f64")
        tol, ref = self.tolerance(), []
        for (name, v), o in zip(self.outputs, outs):
            ref.append((name, np.asarray(o).astype(NP_DTYPES[v.dtype]), tol))
        values = {name: np.asarray(o, np.float64) for (name, _), o in zip(self.outputs, outs)}
        for name, fmt in self.q8.items():
            base, g, ss = self.blocks[name]
            x = values[base]
            if g is not None:                  # x * g in blocks, and each block's sum of x * x
                ref.append((ss, (x.reshape(-1, 32) ** 2).sum(-1).astype(np.float32), 2 * tol))
                x = x * np.asarray(read(ex, g, by_name), np.float64).reshape(x.shape)
            ref.append((name, x.astype(np.float32), tol + SAFETY * U_ACT[fmt]))
        return ref


def read(ex, name, by_name=None):
    """The contents of buffer ``name`` of ``ex`` as a host array (a scalar input as an int)."""
    b = (by_name or {}).get(name, ex._buffers.get(name))
    if b is None:
        b = dict(zip(ex.plan.inputs, ex._bound_refs or []))[name]
    if isinstance(b, (int, np.integer)):
        return int(b)
    return ex.device.to_host(b) if ex.device.is_device_array(b) else b


def kernel_checks(ex) -> list:
    """A :class:`KernelCheck` for each kernel of ``ex``'s plan, in launch order."""
    from dsl.core import QUANT_DTYPES, Program, Var
    from codegen.loopir import ACT_Q8, int8_activation
    plan, prog = ex.plan, ex.program
    where = dict(zip(prog.inputs, plan.inputs))
    where.update({prog.eqns[i].out: name for i, name in plan.computed.items()})
    quant_input = {v: i for i, v in enumerate(prog.inputs) if v.dtype in QUANT_DTYPES}
    int8 = quantized_activations()
    checks = []
    for k, ck in zip(plan.kernels, ex.kernels):
        eqns = list(k.eqns)
        made = {e.out for e in eqns}
        ins = list(dict.fromkeys(a for e in eqns for a in e.inputs if isinstance(a, Var) and a not in made))
        for a in ins:
            if a not in where:
                raise ModelError(f"verify: kernel {k.name} reads a {a.dtype}{list(a.shape)} value that no buffer "
                                 "holds; it cannot be checked on its own")
        written = [p for p in k.params if p.kind == "buffer" and p.role != "in"]
        names = {p.name for p in written}        # a buffer written twice holds its last value
        outputs = list({where[e.out]: e.out for e in eqns if where.get(e.out) in names}.items())
        blocks = q8_producers(k)
        q8 = {p.name: p.dtype for p in written if p.dtype in ACT_Q8 and blocks.get(p.name, ("",))[0] in
              {n for n, _ in outputs}}
        blocks = {n: b for n, b in blocks.items() if n in q8}
        rest = {p.name for p in written} - {n for n, _ in outputs} - set(q8) - {ss for _, _, ss in blocks.values()}
        inputs = [p.name for p in k.params if p.kind == "buffer" and p.role == "in"]
        copy_of = None
        if not eqns and len(rest) == 1 and len(inputs) == 1:
            copy_of, rest = (inputs[0], rest.pop()), set()
        sources = [quant_input.get(a, where[a]) for a in ins]
        u_act = U_ACT[int8_activation()] if int8 and any(e.prim.name == "dequantize" for e in eqns) and any(
            e.prim.name == "dot" for e in eqns) else 0.0
        u_act = max(u_act, U_HALF if _half_operands(ck) else 0.0)
        program = Program(ins, eqns, [v for _, v in outputs])
        checks.append(KernelCheck(k, program, sources, outputs, reduction_length(eqns), u_act, q8, copy_of, rest,
                                  blocks))
    return checks


def q8_producers(k) -> dict:
    """Each q8_1 buffer kernel ``k`` fills (``fusion.q8``: a trailing loop over blocks) -> ``(x, g, ss)``:
    the blocks are of buffer ``x``, or of ``x * g`` with each block's sum of ``x * x`` in ``ss`` (a
    normalization's input quantized by its producer; else g and ss are None)."""
    from codegen import loopir as L
    out = {}
    for s in L.walk_stmts(k.body):
        if isinstance(s, L.Loop) and s.body and isinstance(s.body[0], L.QuantizeQ8):
            v = s.body[0].values[0]
            sums = [t.buf for t in s.body[1:] if isinstance(t, L.Store)]
            if isinstance(v, L.Load):
                out[s.body[0].arr] = (v.buf, None, None)
            elif isinstance(v, L.Bin) and v.op == "mul" and isinstance(v.a, L.Load) and isinstance(v.b, L.Load) and sums:
                out[s.body[0].arr] = (v.a.buf, v.b.buf, sums[0])
    return out


def _half_operands(ck) -> bool:
    """Does the compiled GPU kernel ``ck`` hold an operand as f16 (an activation kept in LDS as f16 for
    gfx906's v_dot2_f32_f16, or a tiled matmul's f16 tiles)?"""
    launch = getattr(getattr(getattr(ck, "hip", None), "kernel", None), "launch", None)
    return launch is not None and (launch.act == "f16" or launch.how.startswith("a tiled matmul"))


def reduction_length(eqns) -> int:
    """How many terms the equations fold, summed (see the module docstring): at least 1."""
    n = 0
    for e in eqns:
        if e.prim.name == "dot":
            n += e.inputs[0].shape[-1]
        elif e.prim.kind == "reduce":
            n += e.inputs[0].shape[-1]
        elif e.prim.name == "attention":
            n += e.inputs[1].shape[1] + e.inputs[0].shape[-1]
        elif e.prim.kind == "loop":
            n += e.params["length"] * reduction_length(e.params["body"].eqns)
    return max(n, 1)


def q8_values(raw, fmt, n):
    """The float64 values that ``n`` / 32 q8_1 blocks (``fmt`` "q8_1r": 32 int8 quants, 32 int8
    residuals, f32 d and s; "q8_1": quants, d, s) hold: d (128 q + r), or d q."""
    width = 72 if fmt == "q8_1r" else 40
    b = np.ascontiguousarray(raw).view(np.uint8)[:n // 32 * width].reshape(n // 32, width)
    q = b[:, :32].view(np.int8).astype(np.float64)
    d = b[:, width - 8:width - 4].copy().view(np.float32).astype(np.float64)
    if fmt == "q8_1r":
        return (d * (128 * q + b[:, 32:64].view(np.int8))).reshape(-1)
    return (d * q).reshape(-1)


def _errors(got, want, tol):
    """(the largest error as a fraction of its tolerance, the first index beyond it or None); only
    the elements that differ are looked at closely (an updated cache is mostly unchanged)."""
    differ = np.flatnonzero((got != want) & ~(_isnan(got) & _isnan(want)))
    if not differ.size:
        return 0.0, None
    if want.dtype.kind not in "fc":
        return math.inf, int(differ[0])
    g, w = got[differ].astype(np.float64), want[differ].astype(np.float64)
    ulp = np.spacing(np.abs(want[differ])).astype(np.float64) if tol else 0.0      # a copy: bit for bit
    allowed = ulp + tol * (np.abs(w) + _scale(want))
    err = np.abs(g - w)
    bad = ~(err <= allowed)                         # NaN against a number is bad
    if bad.any():
        return math.inf, int(differ[np.argmax(bad)])
    return float(np.max(err / allowed)), None


def _isnan(a):
    return np.isnan(a) if a.dtype.kind in "fc" else np.zeros(a.shape, bool)


def _scale(w) -> float:
    """The root mean square of the finite nonzero elements of ``w`` (0.0 for none): the size of a
    tensor's values, not diluted by the positions an in-place update left alone."""
    v = w[(w != 0) & np.isfinite(w)].astype(np.float64)
    return math.sqrt(float(np.mean(np.square(v)))) if v.size else 0.0


def mismatch_line(kernel, name, want, got, first, when) -> str:
    """The one line a mismatch stops the run with."""
    g, w = got.astype(np.float64).reshape(-1), want.astype(np.float64).reshape(-1)
    err = np.abs(g - w)
    err = np.where(np.isnan(err) & ~(np.isnan(g) & np.isnan(w)), np.inf, np.nan_to_num(err, nan=0.0))
    rms = _scale(w)
    rel = err / (np.abs(np.nan_to_num(w)) + rms) if rms else err
    index = tuple(int(i) for i in np.unravel_index(first, want.shape))
    return (f"verify: kernel {kernel} wrote {name}{list(index)} = {g[first]:.6g} where the reference has "
            f"{w[first]:.6g}; max abs error {float(err.max()):.3g}, max rel error {float(np.max(rel)):.3g} "
            f"(|err| / (|ref| + rms)) over {want.size} elements ({when}; the tolerance rule: engine/verify.py)")


_ACTIVE = []


def active():
    """The :class:`Verifier` of the innermost open :func:`checking` block, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def checking():
    """Check every kernel launch of every executable call inside the block; yields the
    :class:`Verifier` (its counts, ``summary()``).  A mismatch raises :class:`Mismatch`."""
    from . import executable
    v, before = Verifier(), executable.RUN_HOOK
    _ACTIVE.append(v)
    executable.RUN_HOOK = v.run
    try:
        yield v
    finally:
        _ACTIVE.remove(v)
        executable.RUN_HOOK = before
