"""The decode profiler: where the time of a decode step goes, kernel by kernel, against the device's
measured ceilings (``engine.generate --profile [DIR]``, ``engine.bench --profile [DIR]``).

    report = profile_model(model, token, steps=32, out_dir="prof")   # model: an engine.model.Model

records ``steps`` greedy decode steps (``Model.decode_greedy``: the step that draws its id on the
device) in each of these modes, interleaved step by step so that all see the same machine:

* **kernels**: the step's kernels launched one by one, each between two marks, with marks around
  the whole step too.  On the CPU the marks are ``time.perf_counter_ns`` (each kernel its own native
  call instead of the plan's one), and the host's time between the calls is the step's gaps.  On a
  GPU they are device events (graphs off: a graph has no marks inside; programmatic dependent
  launch, where on, cannot overlap kernels across a mark), and the GPU is held busy by copies while
  the host queues the step (``_Hold``), so the kernels run back to back and each pair of events
  times a kernel, not the wait for its launch;
* **launches** (GPUs): the kernels launched one by one as a step without graphs runs, events around
  the step only: its time minus the kernels' is the gaps (launch-bound work shows here);
* **plan**: the executable's own plan (the CPU's single native call, a GPU's graph replay), timed
  around the whole step only: the rate a user gets.

From the timed kernels: per kernel (kernels of the same name up to their layer numbers grouped, so
``layers_#_linear_wo_add`` is called 30 times a token) the DSL ops held, calls per token, mean µs,
bytes moved and FLOPs (``Executable.cost_analysis``, with an attention's KV reads and FLOPs counted
up to the step's position rather than the whole cache), achieved GB/s and GFLOP/s and their
percentages of the ceilings, and a regime (``regime``: the two percentages read as in the regime
table of the founding case studies); per token, the same figures plus the gaps (the step's time
outside its kernels: between one kernel's end and the next one's start, and before the first and
after the last), the batch-1 ceiling (bandwidth / bytes per token) and the measured rate (the plan's)
as a percentage of it.

The ceilings are measured in the same run (``measure_ceilings``): bandwidth as the device's copy
(``GPUDevice.copy_bandwidth`` on a GPU; on the CPU a DSL kernel ``y = 2 x`` over 64 MiB of f32 on
all threads, or numpy's single-threaded copy where that is faster), read + write counted; the FLOP
rate as a matmul of ours (``stdlib.nn.linear``, x [M, K] f32 times w [N, K]^T: M = N = K = 512 with
f32 weights on the CPU, 4096 with f16 weights on a GPU, where it takes the tiled matmul), the best
of a few launches.

Output: ``format_table`` (the CLIs print it on stderr) and, with ``out_dir``, ``profile.json`` (the
report) and ``roofline.png`` (``roofline``: every kernel on the device's roofline; needs matplotlib,
the ``profile`` extra; without it one line says so and the rest is written).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

HIGH = 50.0            # % of a ceiling that counts as saturating it (the regime table's "high")
LAUNCH_BOUND = 25.0    # % of the step in gaps that makes unsaturated work launch-bound
STEPS = 32             # decode steps engine.generate --profile records
WARMUP = 2             # steps run in each mode before recording


# ------------------------------------------------------------------------------ regime
def regime(pct_bandwidth, pct_flops, gap_share=0.0) -> str:
    """The regime of work that reaches ``pct_bandwidth`` % of the bandwidth ceiling and
    ``pct_flops`` % of the FLOP ceiling (None: not measured, as 0), with ``gap_share`` % of its time
    outside kernels: "bandwidth-bound" (bandwidth high, FLOPs low), "compute-bound" (the reverse),
    "balanced" (both high: near the ridge), and with both low "launch-bound" when the gaps reach
    ``LAUNCH_BOUND`` %, else "latency-bound" (nothing saturated).  High is ``HIGH`` % or more."""
    bw, fl = (pct_bandwidth or 0) >= HIGH, (pct_flops or 0) >= HIGH
    if bw or fl:
        return "balanced" if bw and fl else "bandwidth-bound" if bw else "compute-bound"
    return "launch-bound" if gap_share >= LAUNCH_BOUND else "latency-bound"


def _rate(amount, us):
    """amount per µs / 1e3: bytes -> GB/s, FLOPs -> GFLOP/s; None for no time."""
    return amount / us / 1e3 if us > 0 else None


def _pct(value, ceiling):
    return 100.0 * value / ceiling if value is not None and ceiling else None


# ------------------------------------------------------------------------------ arithmetic
def kernel_group(name: str) -> str:
    """The group a kernel is reported in: its name with every number as ``#`` (the layers' kernels,
    ``layers_#_linear_wo_add``, one row)."""
    return re.sub(r"\d+", "#", name)


def analyze(launches, kernel_us, token_us, ceilings, gap_us=None, plan_us=None) -> dict:
    """The profile's figures from the recorded times (pure arithmetic, no device).

    ``launches``: one dict per kernel of the step, in launch order: ``name``, ``family``, ``ops``
    (list of DSL op names), ``bytes`` and ``flops`` per call.  ``kernel_us``: [steps, kernels] µs of
    each kernel at each timed step; ``token_us``: [steps] µs of each timed step; ``gap_us``: [steps]
    µs of each step outside its kernels, as recorded (None: ``token_us`` minus the kernels' sum);
    ``plan_us``: [steps] µs of the untimed plan's steps (None: the rate is the timed steps'; the
    token's ``plan_gap_us`` is the plan's step minus the kernels, ``plan_pct_bandwidth``,
    ``plan_pct_flops`` and ``plan_regime`` the token's figures at the plan's step time).
    ``ceilings``: ``bandwidth_gbs`` and ``gflops`` (plus any notes, copied).  Returns the report:
    ``ceilings``, ``kernels`` (one row per name up to layer numbers, the most time first),
    ``launches`` (every kernel with its mean µs) and ``token``.  Raises ValueError when the shapes
    disagree."""
    kernel_us, token_us = np.asarray(kernel_us, np.float64), np.asarray(token_us, np.float64)
    if kernel_us.ndim != 2 or kernel_us.shape != (len(token_us), len(launches)) or not len(token_us):
        raise ValueError(f"kernel_us must be [steps, kernels] = [{len(token_us)}, {len(launches)}] with "
                         f"steps >= 1, got {list(kernel_us.shape)}")
    bw, peak = float(ceilings["bandwidth_gbs"]), float(ceilings["gflops"])
    mean_us, token = kernel_us.mean(0), float(token_us.mean())
    gap = float(np.mean(gap_us)) if gap_us is not None else token - float(mean_us.sum())
    groups = {}
    for i, launch in enumerate(launches):
        groups.setdefault(kernel_group(launch["name"]), []).append(i)
    rows = []
    for name, idx in groups.items():
        us, calls = float(mean_us[idx].sum()), len(idx)
        nbytes = sum(launches[i]["bytes"] for i in idx) / calls
        flops = sum(launches[i]["flops"] for i in idx) / calls
        gbs, gflops = _rate(nbytes * calls, us), _rate(flops * calls, us)
        ops = list(dict.fromkeys(op for i in idx for op in launches[i]["ops"]))
        rows.append({"name": name, "kernels": [launches[i]["name"] for i in idx], "family": launches[idx[0]]["family"],
                     "ops": ops, "calls_per_token": calls, "mean_us": us / calls, "us_per_token": us,
                     "share": 100.0 * us / token if token > 0 else None, "bytes": nbytes, "flops": flops,
                     "intensity": flops / nbytes if nbytes else None, "gbs": gbs, "gflops": gflops,
                     "pct_bandwidth": _pct(gbs, bw), "pct_flops": _pct(gflops, peak)})
        rows[-1]["regime"] = regime(rows[-1]["pct_bandwidth"], rows[-1]["pct_flops"])
    rows.sort(key=lambda r: -r["us_per_token"])
    nbytes, flops = sum(l["bytes"] for l in launches), sum(l["flops"] for l in launches)
    gbs, gflops = _rate(nbytes, token), _rate(flops, token)
    gap_share = 100.0 * gap / token if token > 0 else 0.0
    step = float(np.mean(plan_us)) if plan_us is not None else token
    tps = 1e6 / step if step > 0 else None
    ceiling = bw * 1e9 / nbytes if nbytes else None
    tok = {"kernels": len(launches), "kernel_us": float(mean_us.sum()), "gap_us": gap, "gap_share": gap_share,
           "token_us": token, "bytes": nbytes, "flops": flops, "gbs": gbs, "gflops": gflops,
           "pct_bandwidth": _pct(gbs, bw), "pct_flops": _pct(gflops, peak),
           "plan_us": step if plan_us is not None else None,
           "plan_gap_us": step - float(mean_us.sum()) if plan_us is not None else None, "tokens_per_s": tps,
           "ceiling_tokens_per_s": ceiling, "pct_of_ceiling": _pct(tps, ceiling)}
    tok["regime"] = regime(tok["pct_bandwidth"], tok["pct_flops"], gap_share)
    if plan_us is not None:             # the same reading of the step as the plan runs it
        pct_bw, pct_fl = _pct(_rate(nbytes, step), bw), _pct(_rate(flops, step), peak)
        tok.update(plan_pct_bandwidth=pct_bw, plan_pct_flops=pct_fl,
                   plan_regime=regime(pct_bw, pct_fl, max(0.0, 100.0 * tok["plan_gap_us"] / step)))
    return {"ceilings": dict(ceilings), "kernels": rows, "token": tok,
            "launches": [{"name": l["name"], "mean_us": float(u), "bytes": l["bytes"], "flops": l["flops"]}
                         for l, u in zip(launches, mean_us)]}


def _int_value(e, scalars):
    """The value of the i32 Loop IR expression ``e`` (constants, scalar parameters, + - * min max)
    at ``scalars`` (name -> int); None for anything else."""
    from codegen import loopir as L
    if isinstance(e, L.Const):
        return int(e.value)
    if isinstance(e, L.Sym):
        return scalars.get(e.name)
    if isinstance(e, L.Bin) and e.op in ("add", "sub", "mul", "min", "max"):
        a, b = _int_value(e.a, scalars), _int_value(e.b, scalars)
        if a is None or b is None:
            return None
        return {"add": a + b, "sub": a - b, "mul": a * b, "min": min(a, b), "max": max(a, b)}[e.op]
    return None


def launch_cost(kernel, nbytes, flops, scalars):
    """(bytes, FLOPs) of one call of Loop IR ``kernel`` at the scalar values ``scalars``, from its
    static ``nbytes`` and ``flops`` (which count an attention's whole KV cache): each ``Attention``
    reads and multiplies the keys and values up to its position only (pos + t of its s positions)."""
    from codegen import loopir as L
    params = {p.name: p for p in kernel.params}
    for s in L.walk_stmts(kernel.body):
        if not isinstance(s, L.Attention):
            continue
        pos = _int_value(s.pos, scalars)
        if pos is None:
            continue
        unread = 1.0 - min(s.s, pos + s.t) / s.s
        nbytes -= unread * sum(params[b].size * L.ITEMSIZE[params[b].dtype] for b in {s.k, s.v})
        flops -= unread * 4 * s.hq * s.t * s.d * s.s
    return nbytes, flops


# ------------------------------------------------------------------------------ clocks
class _WallClock:
    """Marks in host time (the CPU: kernels have finished when their call returns)."""

    def __init__(self):
        self.t = []

    def mark(self):
        self.t.append(time.perf_counter_ns())

    def read(self):
        """µs of each mark since the first; starts over."""
        out = [(t - self.t[0]) / 1e3 for t in self.t]
        self.t = []
        return out


class _EventClock:
    """Marks as device events on the GPU's stream, ``n`` at most between reads."""

    def __init__(self, device, n):
        self.dev, self.events, self.i = device, [device._event() for _ in range(n)], 0

    def mark(self):
        self.dev._record(self.events[self.i])
        self.i += 1

    def read(self):
        """µs of each mark since the first, once the device has passed them; starts over."""
        self.dev.synchronize()
        ev, self.i = self.events[:self.i], 0
        return [0.0] + [1e3 * self.dev._elapsed_ms(ev[0], e) for e in ev[1:]]


def _clock(device, n):
    return _EventClock(device, n) if hasattr(device, "_event") else _WallClock()


class _Hold:
    """Keeps a GPU busy (device-to-device copies of 256 MiB) while the host queues a step, so that
    the step's kernels then run back to back and the events around each time the kernel alone, not
    the wait for its launch.  ``queued(seconds)`` learns how long the host takes to queue a step;
    the hold lasts twice that."""
    BYTES = 256 << 20

    def __init__(self, device, bandwidth_gbs):
        self.dev, self.n = device, 1
        self.src, self.dst = device.empty((self.BYTES,), np.uint8), device.empty((self.BYTES,), np.uint8)
        self.copy_s = 2 * self.BYTES / (bandwidth_gbs * 1e9)

    def __call__(self):
        for _ in range(self.n):
            self.dev.copy(self.dst, self.src)

    def queued(self, seconds):
        self.n = max(self.n, int(np.ceil(2 * seconds / self.copy_s)) + 1)


class _Recorder:
    """Stands in for an executable's plan: each call runs the step in ``mode`` and, when ``keep``,
    keeps its marks (µs since the step's start) and scalar values in ``steps[mode]``:

    * "kernels": kernel by kernel, a mark before and after each (after ``hold``: a GPU runs them
      back to back);
    * "launches": kernel by kernel, marks around the step only (a GPU as launched, graphs off);
    * "plan": the plan's own call (the CPU's one native call, a GPU's graph), marks around it."""

    def __init__(self, ex, plan, clock, hold=None):
        self.ex, self.plan, self.clock, self.hold = ex, plan, clock, hold
        self.mode, self.keep = "kernels", False
        self.steps = {"kernels": [], "launches": [], "plan": []}

    def __call__(self):
        ex, c, kernels = self.ex, self.clock, self.mode == "kernels"
        scalars = {n: ex._slots[n] for n in ex.plan.scalars if n in ex._slots}
        if kernels and self.hold:
            self.hold()
        t0 = time.perf_counter()
        c.mark()
        if self.mode == "plan":
            self.plan()
        else:
            slots = getattr(self.plan, "slots", None)          # a GPU plan uploads its scalars first
            if slots is not None:
                slots.flush(ex.device.stream)
            for launch in self.plan.launches:
                if kernels:
                    c.mark()
                launch()
                if kernels:
                    c.mark()
        c.mark()
        if kernels and self.hold:
            self.hold.queued(time.perf_counter() - t0)
        marks = c.read()
        if self.keep:
            self.steps[self.mode].append((marks, scalars))


# ------------------------------------------------------------------------------ ceilings
def _best_us(ex, leaves, reps):
    """The fastest of ``reps`` launches of executable ``ex`` on ``leaves``, in µs."""
    ex.bind(*leaves)
    ex.launch()
    clock, best = _clock(ex.device, 2), float("inf")
    for _ in range(reps):
        clock.mark()
        ex.launch()
        clock.mark()
        best = min(best, clock.read()[1])
    return best


def measure_ceilings(backend, reps=10) -> dict:
    """The device's ceilings, measured now (see the module docstring): ``bandwidth_gbs``,
    ``bandwidth_how``, ``gflops``, ``gflops_how``."""
    import dsl
    from stdlib import nn
    from .executable import get_device
    dev, rng = get_device(backend), np.random.default_rng(0)
    if hasattr(dev, "copy_bandwidth"):
        bw, bw_how = dev.copy_bandwidth(), "device-to-device copy of 1 GiB, read + write"
    else:
        x = rng.random(1 << 24, dtype=np.float32)                  # 64 MiB: far beyond the caches
        ex = dsl.jit(lambda x: x * 2.0, backend=backend).compile(x)
        bw, bw_how = _rate(ex.cost_analysis()["bytes accessed"], _best_us(ex, [x], reps)), \
            f"DSL kernel y = 2x over 64 MiB f32 on {dev.nthreads} threads, read + write"
        y = np.empty_like(x)
        t = min(_timed(lambda: np.copyto(y, x)) for _ in range(reps))
        if 2 * x.nbytes / t / 1e9 > bw:
            bw, bw_how = 2 * x.nbytes / t / 1e9, "numpy copy of 64 MiB f32, read + write"
    n, wdt = (512, np.float32) if backend == "cpu" else (4096, np.float16)
    a = rng.standard_normal((n, n), dtype=np.float32)
    w = (rng.standard_normal((n, n), dtype=np.float32) * n ** -0.5).astype(wdt)
    ex = dsl.jit(lambda x, w: nn.linear(x, w), backend=backend).compile(a, w)
    gflops = _rate(ex.cost_analysis()["flops"], _best_us(ex, [a, w], reps))
    return {"bandwidth_gbs": bw, "bandwidth_how": bw_how, "gflops": gflops,
            "gflops_how": f"DSL matmul {n}x{n}x{n}, {np.dtype(wdt).name} weights, best of {reps}"}


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


# ------------------------------------------------------------------------------ recording
def positions_needed(steps) -> int:
    """KV-cache positions that ``record`` of ``steps`` steps decodes through (three modes, warm-up)."""
    return 3 * (steps + WARMUP) + 1


def steps_fitting(context, most=STEPS) -> int:
    """The most steps, up to ``most``, whose ``positions_needed`` fit a cache of ``context`` positions
    (0: none do)."""
    return max(0, min(most, (context - 1) // 3 - WARMUP))


def record(model, token, steps, bandwidth_gbs=None):
    """Run ``steps`` greedy decode steps of ``model`` after ``token`` in each of ``_Recorder``'s
    modes ("launches" on GPUs only), interleaved step by step, after ``WARMUP`` steps of each, from
    the model's position, rewound where the cache has too little room (the cache's values do not
    change a step's time).  ``bandwidth_gbs``: the device's copy bandwidth (sizes a GPU's hold).
    Returns (executable, {mode: [(marks, scalars)] of each kept step}).  Raises ModelError for a
    backend without compiled kernels or a cache too small for the steps."""
    from .errors import ModelError
    if model.device is None:
        raise ModelError(f"--profile times compiled kernels: the {model.backend} backend has none; "
                         "use --backend cpu, cuda or hip")
    need = positions_needed(steps)
    if need > model.context:
        raise ModelError(f"profiling {steps} steps needs {need} cache positions, the context holds "
                         f"{model.context}: raise --context or profile fewer steps")
    model.pos = min(model.pos, model.context - need)
    token = model.decode_greedy(token, 1)[0]          # compiles and binds the step
    ex = model.greedy_step.compile(model.params, np.zeros(1, np.int32), 0, 0, model.cache)
    plan, dev = ex._plan_run, model.device
    gpu = hasattr(dev, "_event")
    hold = _Hold(dev, bandwidth_gbs or dev.copy_bandwidth()) if gpu else None
    rec = _Recorder(ex, plan, _clock(dev, 2 * len(plan.launches) + 2), hold)
    modes = ("kernels", "launches", "plan") if gpu else ("kernels", "plan")
    ex._plan_run = rec
    try:
        for i in range(WARMUP + steps):
            for rec.mode in modes:
                rec.keep = i >= WARMUP
                token = model.decode_greedy(token, 1)[0]
    finally:
        ex._plan_run = plan
    if any(len(rec.steps[m]) != steps for m in modes):
        raise RuntimeError("the decode step was bound again while it was profiled; its times are incomplete")
    return ex, {m: rec.steps[m] for m in modes}


def kernel_times(jitted, *args, steps=30, warmup=10) -> dict:
    """Each kernel of ``jitted``'s plan for ``args`` (a ``dsl.jit`` function on a compiled backend)
    timed alone, as ``record`` times a decode step's: events around each launch after a hold on a
    GPU, ``time.perf_counter_ns`` around each native call on the CPU; then the plan's own call (a
    GPU's graph).  ``steps`` calls of each, after ``warmup``.  Returns {"kernels": [(name, median
    µs)] in launch order, "plan_us": the plan's median µs}.  Raises ModelError on a backend without
    compiled kernels."""
    from .errors import ModelError
    if not (isinstance(steps, int) and steps >= 1 and isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"kernel_times needs steps >= 1 and warmup >= 0 (whole numbers), got steps={steps!r}, "
                         f"warmup={warmup!r}")
    jitted(*args)
    ex = jitted.compile(*args)
    dev = ex.device
    if dev is None:
        raise ModelError("kernel_times times compiled kernels: use backend cpu, cuda or hip")
    plan = ex._plan_run
    n = len(plan.launches)
    hold = _Hold(dev, dev.copy_bandwidth()) if hasattr(dev, "_event") else None
    rec = _Recorder(ex, plan, _clock(dev, 2 * n + 2), hold)
    ex._plan_run = rec
    try:
        for rec.mode in ("kernels", "plan"):
            for i in range(warmup + steps):
                rec.keep = i >= warmup
                jitted(*args)
    finally:
        ex._plan_run = plan
    alone = np.median([[m[2 * j + 2] - m[2 * j + 1] for j in range(n)] for m, _ in rec.steps["kernels"]], axis=0)
    whole = float(np.median([m[-1] - m[0] for m, _ in rec.steps["plan"]]))
    return {"kernels": [(ck.kernel.name, float(t)) for ck, t in zip(ex.kernels, alone)], "plan_us": whole}


def marginal_costs(model, token, steps=STEPS, repeat=3, position=None) -> list:
    """What each kernel costs inside the step as it runs (a GPU's graph, back to back with its
    neighbours): for each group of kernels (names equal up to their layer numbers), the step's plan
    with every kernel of the group launched twice, timed over ``steps`` greedy decode steps after
    ``token`` from cache position ``position`` (default: the model's), against the plan as it is,
    measured before and after it (A/B/A, the median of ``repeat`` runs each; one group's after is
    the next one's before).  The second launch reads what the first read, from L2 where it fits, so
    its cost is the kernel's latency with its inputs ready: the chain inside the kernel and the
    boundary to the next, not the time to stream its weights from memory.
    Returns [(group, calls per step, µs per call, step µs of the plain plan)] in launch order.
    The cache holds what the last (doubled) step wrote; a decode step's kernels write other buffers
    than they read, so a second launch leaves the values as one would.  Raises ModelError on a
    backend without a graph of kernels (the CPU's one native call), or where ``steps`` steps from
    ``position`` do not fit the cache."""
    from .errors import ModelError
    dev = model.device
    if dev is None or not hasattr(dev, "_event"):
        raise ModelError(f"marginal costs time a GPU's graph: the {model.backend} backend has none; "
                         "use a model on the cuda or hip backend")
    start = model.pos if position is None else position
    if not (isinstance(steps, int) and steps >= 1 and 0 <= start and start + steps <= model.context):
        raise ModelError(f"marginal costs of {steps!r} decode steps from position {start} need positions "
                         f"{start} to {start + steps if isinstance(steps, int) else '?'} of the cache, which holds "
                         f"{model.context}: raise --context or time fewer --tokens")
    model.pos = start
    token = model.decode_greedy(token, 1)[0]                      # compiles and binds the step
    ex = model.greedy_step.compile(model.params, np.zeros(1, np.int32), 0, 0, model.cache)
    plan = ex._plan_run
    names = [kernel_group(ck.kernel.name) for ck in ex.kernels]
    if len(names) != len(plan.launches):
        raise RuntimeError("the executable's kernels and its plan's launches disagree")

    def step_us(p):
        ex._plan_run = p
        try:
            times = []
            for _ in range(repeat + 1):                           # the first run captures the graph
                model.pos = start
                dev.synchronize()
                t0 = time.perf_counter()
                model.decode_greedy(token, steps)
                times.append((time.perf_counter() - t0) / steps * 1e6)
            return float(np.median(times[1:]))
        finally:
            ex._plan_run = plan
            model.pos = start

    out, before = [], step_us(plan)
    for group in dict.fromkeys(names):
        twice = [x for name, launch in zip(names, plan.launches) for x in [launch] * (1 + (name == group))]
        more, after = step_us(type(plan)(dev, twice, plan.slots, plan.graphs)), step_us(plan)
        calls, plain = names.count(group), (before + after) / 2
        out.append((group, calls, (more - plain) / calls, plain))
        before = after
    return out


def format_marginal(rows) -> str:
    """``marginal_costs``' rows as a table, with their sum per step against the step."""
    lines = [f"{'kernel (in the graph, launched twice)':56} {'calls':>5} {'us/call':>8} {'us/step':>8}"]
    for group, calls, us, _ in rows:
        lines.append(f"{group[:56]:56} {calls:5d} {us:8.2f} {us * calls:8.1f}")
    step = float(np.mean([r[3] for r in rows])) if rows else 0.0
    lines.append(f"{'sum of the kernels / the step':56} {'':5} {'':8} {sum(r[1] * r[2] for r in rows):8.1f} / {step:.1f}")
    return "\n".join(lines)


PHASE_FIELDS = ("staged", "dot", "epilogue", "work", "wait")


def phase_times(ex) -> list:
    """Where the last launch of ``ex``'s traced persistent kernel (``VEGAFUSE_PERSISTENT=1`` and
    ``VEGAFUSE_PERSISTENT_TRACE=1`` when it compiled: ``codegen.persistent.trace_on``) spent its time,
    from the clock thread 0 of each workgroup stamped.  One row per phase group (``kernel_group``: the
    layers' phases one row), in launch order: ``phase``, ``calls`` a launch, ``workgroups`` that
    stamped, and in µs (at the device's ``clock_mhz``), the mean over calls and workgroups of
    ``staged`` (from the phase's start, the previous grid barrier left, to its activation in LDS; ring
    phases), ``dot`` (then to its dot products from the ring: the first block's, where a workgroup takes
    several, as the LM head's), ``epilogue`` (then to its end), ``work`` (start to end), ``wait`` (end
    to the next barrier left: the barrier's own cost and the slowest workgroup's lead), and
    ``slowest``, the mean over calls of the slowest workgroup's ``work``.  A phase the ring does not
    feed has no ``staged`` or ``dot``: its ``epilogue`` is its work.  Several persistent kernels: each
    one's rows in turn.  ValueError (one line) where ``ex`` has no
    traced persistent kernel, or it has not run."""
    text = lambda c: getattr(c.hip, "source", c.hip)       # noqa: E731  (a device's readable source, or its text)
    traced = [c for c in ex.kernels if c.kernel.family == "persistent" and "VF_STAMP(" in text(c)]
    if not traced:
        raise ValueError("no traced persistent kernel: set VEGAFUSE_PERSISTENT=1 and VEGAFUSE_PERSISTENT_TRACE=1 "
                         "before the model compiles (engine.bench --phases does)")
    return [row for ck in traced for row in _phase_rows(ex.device, ck, text(ck))]


def _phase_rows(device, ck, text) -> list:
    """``phase_times``' rows of one traced persistent kernel ``ck`` (its source ``text``)."""
    from codegen import loopir as L
    grid, n = map(int, re.search(r"#define VF_TRACE_STAMPS (\d+)\n.*vf_trace\[(\d+) \*", text).groups()[::-1])
    rows = device.read_symbol(ck, "vf_trace", grid * n).reshape(grid, n)
    if not rows.any():
        raise ValueError(f"the persistent kernel {ck.kernel.name} has not run yet: time a step first")
    phases = [s for s in ck.kernel.body if isinstance(s, L.Phase)]
    us = 1.0 / device.clock_mhz
    calls = [[] for _ in phases]                    # per call: one dict a workgroup
    for w, row in enumerate(rows):
        if not row.any():                           # a workgroup the launch did not run (the emulation's one)
            continue
        clock, step = (row >> 4).astype(np.int64), [L.STAMP_STEPS[int(x)] for x in row & 15]
        if step[0] != "start":
            raise RuntimeError(f"workgroup {w}'s stamps begin with {step[0]!r}, not 'start'")
        prev, i = clock[0], 1
        for c in range(len(phases)):
            at = {}
            while i < n and step[i] != "end":
                at[step[i]] = clock[i]
                i += 1
            if i == n:
                raise RuntimeError(f"workgroup {w}'s stamps end inside phase {phases[c].name}")
            end, left, i = clock[i], clock[i], i + 1
            if c < len(phases) - 1:                 # a grid barrier between each two phases
                if i == n or step[i] != "left":
                    raise RuntimeError(f"workgroup {w}'s stamps: no barrier after phase {phases[c].name}")
                left, i = clock[i], i + 1
            staged, dot = at.get("staged", prev), at.get("dot", at.get("staged", prev))
            calls[c].append({"staged": staged - prev, "dot": dot - staged, "epilogue": end - dot, "work": end - prev,
                             "wait": left - end})
            prev = left
    out = {}
    for p, recs in zip(phases, calls):
        if not recs:
            continue
        name = kernel_group(p.name)
        row = out.setdefault(name, {"phase": name, "calls": 0, "sums": [], "slowest": []})
        row["calls"] += 1
        row["workgroups"] = len(recs)
        row["sums"] += recs
        row["slowest"].append(max(r["work"] for r in recs) * us)
    for row in out.values():
        for f in PHASE_FIELDS:
            row[f] = float(np.mean([r[f] for r in row["sums"]])) * us
        row["slowest"] = float(np.mean(row.pop("slowest")))
        del row["sums"]
    return list(out.values())


def format_phases(rows) -> str:
    """``phase_times``' rows as a table, with the launch's time they add up to."""
    lines = [f"{'phase (persistent kernel, µs a call)':52} {'calls':>5} " + " ".join(f"{f:>8}" for f in PHASE_FIELDS)
             + f" {'slowest':>8} {'us/step':>8}"]
    for r in rows:
        lines.append(f"{r['phase'][:52]:52} {r['calls']:5d} " + " ".join(f"{r[f]:8.2f}" for f in PHASE_FIELDS)
                     + f" {r['slowest']:8.2f} {(r['work'] + r['wait']) * r['calls']:8.1f}")
    total = sum((r["work"] + r["wait"]) * r["calls"] for r in rows)
    lines.append(f"{'the launch, from its stamps':52} {'':5} " + " ".join(f"{'':8}" for _ in PHASE_FIELDS)
                 + f" {'':8} {total:8.1f}")
    return "\n".join(lines)


def profile_model(model, token, steps=STEPS, out_dir=None, title=None, file=None) -> dict:
    """Profile ``steps`` decode steps of ``model`` (an ``engine.model.Model`` on a compiled backend)
    after ``token``: measure the ceilings, record, ``analyze``; print ``format_table`` to ``file``
    (default stderr) and, with ``out_dir``, write ``profile.json`` and ``roofline.png`` there
    (created if needed).  Returns the report (``analyze``'s, plus ``title``, ``backend``,
    ``device``, ``steps``, ``positions`` and ``fusion_report``)."""
    file = file or sys.stderr
    ceilings = measure_ceilings(model.backend)
    ex, steps_of = record(model, token, steps, ceilings["bandwidth_gbs"])
    timed = steps_of["kernels"]
    static = ex.cost_analysis()["per_kernel"]
    kernels = [ck.kernel for ck in ex.kernels]
    if [k.name for k in kernels] != [p["name"] for p in static]:
        raise RuntimeError("the executable's kernels and its plan's disagree")
    costs = np.array([[launch_cost(k, p["bytes accessed"], p["flops"], sc) for k, p in zip(kernels, static)]
                      for _, sc in timed])                             # [steps, kernels, (bytes, flops)]
    launches = [{"name": k.name, "family": k.family, "ops": list(dict.fromkeys(e.prim.name for e in k.eqns)),
                 "bytes": float(b), "flops": float(f)} for k, (b, f) in zip(kernels, costs.mean(0))]
    marks = np.array([m for m, _ in timed])                          # [steps, 2 + 2 kernels]
    starts, ends = marks[:, 1:-1:2], marks[:, 2:-1:2]
    kernel_us = ends - starts
    if "launches" in steps_of:          # a GPU: the kernels ran back to back; the step as launched has the gaps
        token_us, gap_us = np.array([m[-1] for m, _ in steps_of["launches"]]), None
    else:                               # the CPU: the gaps are the host's time between the kernel calls
        token_us = marks[:, -1]
        gap_us = (starts[:, 1:] - ends[:, :-1]).sum(1) + starts[:, 0] + (marks[:, -1] - ends[:, -1])
    report = analyze(launches, kernel_us, token_us, ceilings, gap_us, [m[-1] for m, _ in steps_of["plan"]])
    dev = model.device
    report.update(title=title or getattr(model.cfg, "name", "") or "decode step", backend=model.backend,
                  device=_device_name(dev), steps=steps, modes=list(steps_of),
                  timing="kernels queued back to back between device events, the step as launched one by one "
                         "(graphs off)" if "launches" in steps_of else
                         "each kernel its own native call, the gaps the host's time between the calls",
                  positions=[timed[0][1].get("pos"), timed[-1][1].get("pos")],
                  fusion_report=ex.fusion_report().splitlines()[0])
    print(format_table(report), file=file, flush=True)
    if out_dir is not None:
        write(report, out_dir, file)
    return report


def _device_name(dev) -> str:
    target = getattr(dev, "target", None)
    if target is not None:
        return f"{type(dev).__name__.replace('Device', '').lower()} {getattr(target, 'name', target)}"
    return f"cpu {getattr(dev, 'cpu_name', '')}, {getattr(dev, 'nthreads', 1)} threads"


# ------------------------------------------------------------------------------ output
def _f(v, spec, none="n/a"):
    return none if v is None else format(v, spec)


def format_table(report) -> str:
    """The report as text: the ceilings, one line per kernel row, the token's line and the batch-1
    ceiling."""
    c, t = report["ceilings"], report["token"]
    first = (report.get("positions") or ["?"])[0]
    lines = [f"decode profile: {report.get('title', '')} on {report.get('device', '')}, "
             f"{report.get('steps', '?')} steps from position {first}; {report.get('timing', '')}",
             f"ceilings: {c['bandwidth_gbs']:.1f} GB/s ({c.get('bandwidth_how', '')}); "
             f"{c['gflops']:.1f} GFLOP/s ({c.get('gflops_how', '')})",
             f"{'kernel':<48} {'calls':>5} {'µs/call':>8} {'µs/tok':>8} {'share':>6} {'kB/call':>9} "
             f"{'MFLOP/call':>10} {'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8} {'%flop':>5}  {'regime':<15} ops"]
    for r in report["kernels"]:
        ops = ", ".join(r["ops"])
        lines.append(f"{r['name'][:48]:<48} {r['calls_per_token']:>5} {r['mean_us']:8.2f} {r['us_per_token']:8.1f} "
                     f"{_f(r['share'], '5.1f')}% {r['bytes'] / 1e3:9.1f} {r['flops'] / 1e6:10.3f} "
                     f"{_f(r['gbs'], '7.1f')} {_f(r['pct_bandwidth'], '5.1f')} {_f(r['gflops'], '8.2f')} "
                     f"{_f(r['pct_flops'], '5.1f')}  {r['regime']:<15} {ops[:60]}{'...' if len(ops) > 60 else ''}")
    lines.append(f"token: {t['kernels']} kernels {t['kernel_us']:.0f} µs + gaps {t['gap_us']:.0f} µs "
                 f"({t['gap_share']:.1f}%) = {t['token_us']:.0f} µs timed; {t['bytes'] / 1e6:.2f} MB and "
                 f"{t['flops'] / 1e6:.1f} MFLOP a token: {_f(t['gbs'], '.1f')} GB/s "
                 f"({_f(t['pct_bandwidth'], '.1f')}% of the bandwidth), {_f(t['gflops'], '.2f')} GFLOP/s "
                 f"({_f(t['pct_flops'], '.2f')}% of the FLOP rate): {t['regime']}")
    plan = "the timed steps"
    if t["plan_us"] is not None:
        gap = t["plan_gap_us"]
        plan = (f"the plan's {t['plan_us']:.0f} µs a step, "
                + (f"{gap:.0f} µs of it outside the kernels" if gap >= 0 else
                   f"{-gap:.0f} µs less than the kernels timed alone")
                + f"; {_f(t['plan_pct_bandwidth'], '.1f')}% of the bandwidth, {_f(t['plan_pct_flops'], '.2f')}% "
                f"of the FLOP rate: {t['plan_regime']}")
    lines.append(f"batch-1 ceiling: {c['bandwidth_gbs']:.1f} GB/s / {t['bytes'] / 1e6:.2f} MB = "
                 f"{_f(t['ceiling_tokens_per_s'], '.1f')} tokens/s; measured {_f(t['tokens_per_s'], '.1f')} tokens/s "
                 f"({plan}) = {_f(t['pct_of_ceiling'], '.1f')}% of it")
    return "\n".join(lines)


def write(report, out_dir, file=None):
    """``profile.json`` and ``roofline.png`` in ``out_dir`` (created); one line on ``file`` (default
    stderr) names them, or says the plot was skipped because matplotlib is missing."""
    file = file or sys.stderr
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(report, f, indent=1)
    png = os.path.join(out_dir, "roofline.png")
    try:
        roofline(report, png)
    except ImportError:
        print(f"profile: wrote {out_dir}/profile.json; roofline.png skipped: matplotlib is not installed "
              "(pip install 'vegafuse[profile]')", file=file)
        return
    print(f"profile: wrote {out_dir}/profile.json and {png}", file=file)


def roofline(report, path):
    """Draw every kernel row of ``report`` and the token on the roofline of its ceilings (log-log:
    FLOP/byte against GFLOP/s; each kernel numbered as in the legend, which names it; a marker's
    area is its share of the step) into the PNG ``path``.
    Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    c, t = report["ceilings"], report["token"]
    bw, peak = c["bandwidth_gbs"], c["gflops"]
    rows = [r for r in report["kernels"] if r["intensity"] and r["gflops"]]
    xs = [r["intensity"] for r in rows] + [peak / bw]
    lo, hi = min(xs) / 4, max(xs) * 8
    fig = Figure(figsize=(11, 7), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(peak, bw * grid), color="black", lw=1.5,
            label=f"roofline: {bw:.0f} GB/s, {peak:.0f} GFLOP/s (ridge {peak / bw:.2f} FLOP/byte)")
    for i, r in enumerate(rows, 1):
        ax.scatter(r["intensity"], r["gflops"], s=30 + 6 * (r["share"] or 0), alpha=0.7, zorder=3,
                   label=f"{i}  {r['name']} x{r['calls_per_token']}: {r['share'] or 0:.1f}% of the step, {r['regime']}")
        ax.annotate(str(i), (r["intensity"], r["gflops"]), fontsize=8, xytext=(6, 2), textcoords="offset points")
    if t["bytes"] and t["gflops"]:
        ax.scatter(t["flops"] / t["bytes"], t["gflops"], marker="*", s=250, color="red", zorder=4,
                   label=f"token, kernels launched one by one: {t['regime']}")
    if t["bytes"] and t.get("plan_us"):
        ax.scatter(t["flops"] / t["bytes"], t["flops"] / t["plan_us"] / 1e3, marker="*", s=250, color="black",
                   zorder=4, label=f"token as the plan runs it: {t['plan_regime']}")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="GFLOP/s",
           title=f"{report.get('title', '')} decode on {report.get('device', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, bbox_inches="tight")
