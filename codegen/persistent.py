"""Render a persistent kernel (``fusion/persistent.py``) to HIP C++: NVIDIA's flavour, which runs, and
gfx906's, which compiles (the plan step runs only for NVIDIA: no AMD GPU has run it).

The kernel is its phases in order, a grid barrier between each two.  Each distinct phase kernel is
mapped as it would launch alone and rendered, in a namespace of its own (its file-scope buffers and
names apart from every other phase's), as a device function ``run`` whose body is that kernel's
text: the function takes its own ``blockIdx`` and ``gridDim`` as parameters, so the text reads the
phase's workgroup where the kernel read the launch's.  The persistent kernel's workgroups (a few a
compute unit, all resident) call it once each with their own index where the kernel shares its work
only through grid-stride loops (``any_grid``: the GEMVs), else for the phase's own workgroups in
turn.  A phase's LDS arrays come from the one dynamic LDS buffer, which the phases take in turn.

A buffer that one phase writes and a later one reads is passed to the phases without
``const __restrict__``: its reads may not take the read-only cache path, which does not see
another workgroup's writes within a launch.
"""
from __future__ import annotations

from dataclasses import replace

from . import loopir as L
from . import ring
from .hip import (CTYPE, HipKernel, _lds_size, _signature, _weights, file_scope, function_body, parameter, prelude_parts,
                  stmts)
from .mapping import _lds_bytes, clear_of_templates, map_kernel
from .prelude import grid_barrier, prelude
from .prelude import ring as prelude_ring
from .env import env_int, switch


def _phase_signature(k: L.Kernel, coherent: set, ring_phase: bool = False) -> str:
    """``k``'s parameters, those in ``coherent`` (written by a phase) without ``__restrict__``; a phase
    fed by the ring takes the ring and the number of its next chunk first."""
    args = []
    for p in k.params:
        if p.kind == "buffer" and p.name in coherent:
            args.append(f"{'const ' if p.role == 'in' else ''}{CTYPE[p.dtype]}* {p.name}")
        else:
            args.append(parameter(p))
    ring_args = ["const vf_ring_t vf_ring", "unsigned int vf_chunk"] if ring_phase else []
    return ", ".join(["const dim3 blockIdx", "const dim3 gridDim"] + ring_args + args)


def any_grid(m: L.Kernel) -> bool:
    """Does the mapped kernel ``m`` compute the same for any grid: its workgroups share the work
    only through grid-stride loops (the rows of a GEMV), and nothing else reads the workgroup's
    index or the grid's size (attention's heads, a split reduction's arrivals, per-workgroup
    slices do)?  Then a persistent kernel's own grid runs it in one call a workgroup."""
    if not any(isinstance(s, L.Loop) and s.map in ("grid", "thread", "wave") for s in m.body):
        return False
    for s in L.walk_stmts(m.body):
        if isinstance(s, (L.Attention, L.Arrive, L.QuantizeStored)) or getattr(s, "space", "") in ("global", "device"):
            return False
        if any(isinstance(x, L.Hw) and x.name in ("workgroup", "grid") for e in L.stmt_exprs(s) for x in L.walk_exprs(e)):
            return False
    return True


def prefetch_bytes(t) -> int:
    """Bytes of each weight of the next phase a persistent kernel asks of L2 before a grid barrier
    (``VEGAFUSE_PERSISTENT_PREFETCH``; default the target's prefetch before a dependent launch's wait,
    none on a target without one)."""
    n = env_int("VEGAFUSE_PERSISTENT_PREFETCH", t.pdl_prefetch if t.pdl else 0, 0, "a number of bytes (0: none)")
    if n and not t.pdl:
        raise ValueError(f"VEGAFUSE_PERSISTENT_PREFETCH={n}: {t.name} has no L2 prefetch here (no dependent "
                         "launch: VEGAFUSE_CUDA_PDL=0 or not Hopper); unset it")
    return n


def _prefetch(s: L.Phase, n: int, pad="  ") -> list:
    """Before the barrier ahead of phase ``s``: the first ``n`` bytes of each of its weights asked of L2,
    a share a workgroup (the weights do not depend on the phases before)."""
    names = phase_args(s)
    weights = _weights(clear_of_templates(s.kernel)) if n else []
    if not weights:
        return []
    return ([f"{pad}// before the barrier: the first {n} bytes (at most) of each weight of {s.name} into L2, a share a workgroup"]
            + [f"{pad}vf_prefetch_l2({names[p.name]}, {min(n, int(p.size * L.ITEMSIZE[p.dtype]))}ull);" for p in weights])


def _call(s: L.Phase, m: L.Kernel, ns: str, pad="  ", ring: bool = False) -> list:
    """A phase (its function ``ns::run``) run by the launch's workgroups: in one call each
    where it computes the same for any grid (``any_grid``), else its own workgroups taken in turn."""
    args = ", ".join(a + ("_" if p.kind == "scalar" else "") for p, a in zip(m.params, s.args))
    if ring:
        return [f"{pad}// {s.name}: its blocks of rows over the launch's workgroups, their weights from the ring",
                f"{pad}vf_chunk = {ns}::run(dim3(blockIdx.x), dim3(gridDim.x), vf_ring, vf_chunk, {args});"]
    if any_grid(m):
        return [f"{pad}// {s.name}: its grid-stride loops over the launch's workgroups",
                f"{pad}{ns}::run(dim3(blockIdx.x), dim3(gridDim.x), {args});"]
    g = m.launch.grid                                # taken in turn: right for a launch of any size
    return [f"{pad}// {s.name}: {g} workgroup{'s' if g > 1 else ''}, taken in turn",
            f"{pad}for (unsigned int w = blockIdx.x; w < {g}; w += gridDim.x)",
            f"{pad}  {ns}::run(dim3(w), dim3({g}), {args});"]


def ring_on(t) -> bool:
    """Do a persistent kernel's GEMV phases for ``t`` take their weights from a ring (``codegen/ring.py``):
    an NVIDIA target (bulk copies into LDS) and ``VEGAFUSE_PERSISTENT_RING`` 1, the default (0.99x of
    the separate kernels where the phases without it run at 0.87x, docs/performance.md)?"""
    return switch("VEGAFUSE_PERSISTENT_RING", True, "GEMV phases fed by a ring of weights") and \
        getattr(t, "vendor", "") == "nvidia"


def workgroups_per_cu(ring: bool = False) -> int:
    """Workgroups of a persistent kernel resident on each compute unit (``VEGAFUSE_PERSISTENT_PER_CU``):
    by default 2 (measured against 1, 3 and 4 in docs/performance.md: more hide more of each phase's
    latency, at fewer registers a thread), or 1 with a ring (``ring``), whose producer hides it and
    whose slots take the LDS (1 against 2: docs/performance.md)."""
    return env_int("VEGAFUSE_PERSISTENT_PER_CU", 1 if ring else 2, 1, "1 or more workgroups a compute unit")


def _occupancy(t, block: int, per_cu: int) -> str:
    """The second argument of ``__launch_bounds__`` that keeps ``per_cu`` workgroups resident on a
    compute unit: NVIDIA counts workgroups an SM, HIP waves a SIMD (``amdgpu_waves_per_eu``)."""
    n = per_cu if t.vendor == "nvidia" else max(1, per_cu * block // t.wave // t.simds_per_cu)
    return f", {n}" if n > 1 else ""


def phase_target(t):
    """The target a persistent kernel's phases are mapped for: ``t``, with a float GEMV's RMSNorm in one
    pass where the ring is on (``Target.norm_after_dot``, every GEMV phase whose activation stays f32,
    ``mapping._float_norm_after_dot``; ``VEGAFUSE_PERSISTENT_NORM=0`` keeps two)."""
    one = switch("VEGAFUSE_PERSISTENT_NORM", True, "the ring phases' RMSNorm in one pass") and ring_on(t)
    return replace(t, norm_after_dot=True) if one else t


def ring_flight() -> int:
    """Bytes of a phase's chunks the ring's producer keeps in flight at most (``VEGAFUSE_PERSISTENT_FLIGHT``,
    default 36864, two of the probe's chunks: more lengthen the queue every latency-bound load of the chain
    waits in, docs/performance.md)."""
    return env_int("VEGAFUSE_PERSISTENT_FLIGHT", 36864, 1, "a number of bytes")


def ring_evict_first() -> bool:
    """Do the ring's copies mark the weights first to leave L2 (``VEGAFUSE_PERSISTENT_EVICT_FIRST``, default 1):
    a step streams its weights once, through an L2 far smaller than they are, and each phase's chain of
    small reads (activations, the norms' gains, biases, the KV cache) waits on HBM's latency under
    load where they have been pushed out (docs/performance.md)?"""
    return switch("VEGAFUSE_PERSISTENT_EVICT_FIRST", True, "the ring's weights first out of L2")


def ring_quiet() -> bool:
    """Does the ring's producer pause while its consumers wait at a grid barrier
    (``VEGAFUSE_PERSISTENT_QUIET``, default 1)?"""
    return switch("VEGAFUSE_PERSISTENT_QUIET", True, "the ring's producer pauses at grid barriers")


def _ring_slots(t, per_cu: int, lds: int, static: int) -> int:
    """Slots of ``SLOT_BYTES`` the ring has beside ``lds`` dynamic and ``static`` bytes, at most 10,
    with ``per_cu`` workgroups a compute unit."""
    room = min(t.lds_per_cu // per_cu, t.max_lds or t.lds_per_cu) - lds - static - 1024
    return max(0, min(10, room // ring.SLOT_BYTES))


def ring_grid(t) -> int:
    """The workgroups of a persistent kernel with a ring on ``t``: ``workgroups_per_cu(True)`` a compute
    unit.  ValueError where that leaves no room in LDS for two of the ring's slots."""
    per_cu = workgroups_per_cu(True)
    most = t.lds_per_cu // (2 * ring.SLOT_BYTES + 4096)
    if per_cu > most:
        raise ValueError(f"VEGAFUSE_PERSISTENT_PER_CU={per_cu}: set it to at most {most} with the ring of weights "
                         f"(two {ring.SLOT_BYTES}-byte slots a workgroup), or set VEGAFUSE_PERSISTENT_RING=0")
    return t.compute_units * per_cu


def shares(phases, t, mapped=None) -> list:
    """``(element offset, phase, RingGemv, Tiles)`` of each phase fed by the ring (``tiled`` set by the plan
    step), in order: its share of the tiled weights, its tiles made for the phase's ``grid``.  ``mapped``:
    ``{id(phase kernel): mapped kernel}`` (else they are mapped for ``t`` here)."""
    out, at, made = [], 0, {}
    for s in phases:
        if not s.tiled:
            continue
        if (id(s.kernel), s.grid) not in made:
            m = mapped[id(s.kernel)] if mapped else map_kernel(s.kernel, phase_target(t))
            g = ring.ring_gemv(m)
            made[id(s.kernel), s.grid] = g, ring.tiles(g, s.grid, m.launch.block)
        g, tl = made[id(s.kernel), s.grid]
        out.append((at, s, g, tl))
        at += g.slots * g.k
    return out


def tiling(k: L.Kernel, t) -> list:
    """How the persistent kernel ``k`` (the plan's, with its own names) for ``t`` lays out its tiled
    weights: ``(element offset, RingGemv, Tiles, {phase weight: k's buffer})`` per ring phase, in order
    (``codegen.ring.tile`` fills each share)."""
    phases = [s for s in k.body if isinstance(s, L.Phase)]
    return [(at, g, tl, {w: phase_args(s)[w] for seg in g.segments for w in seg.weights})
            for at, s, g, tl in shares(phases, t)]


def phase_args(s: L.Phase) -> dict:
    """The buffer bound to each parameter of phase ``s``'s kernel, by the name its mapped kernel gives it
    (``mapping.clear_of_templates``: a weight named ``k`` is ``k_`` there)."""
    return dict(zip((p.name for p in clear_of_templates(s.kernel).params), s.args))


def render_persistent(k: L.Kernel, t) -> HipKernel:
    """HIP source of the persistent kernel ``k`` for ``t`` (a Target), with its launch:
    ``workgroups_per_cu()`` workgroups a compute unit, the dynamic LDS its largest phase takes.
    Its phases marked ``tiled`` by the plan step take their weights from a ring (``codegen/ring.py``),
    filled by one more warp a workgroup.
    Raises ValueError when its phases do not map onto one workgroup size and activation dtype."""
    phases = [s for s in k.body if isinstance(s, L.Phase)]
    distinct = list({id(s.kernel): s.kernel for s in phases}.values())
    mapped = {id(pk): L.tidy_names(map_kernel(pk, phase_target(t)), reserved=("vf_lane", "vf_wave")) for pk in distinct}
    geometry = {(m.launch.block, m.launch.act if m.family == "contract" else "") for m in mapped.values()}
    blocks, acts = {b for b, _ in geometry}, {a for _, a in geometry} - {""}
    if len(blocks) != 1 or len(acts) > 1:
        raise ValueError(f"persistent kernel {k.name}: its phases map onto {sorted(geometry)} (workgroup size, "
                         "GEMV activation dtype); a persistent kernel has one of each")
    (block,), act = blocks, (acts or {"f32"}).pop()
    static = sum(m.launch.lds - _lds_bytes([a for a in m.body if isinstance(a, L.Array)]) for m in mapped.values())
    fed = shares(phases, t, mapped)
    rings = {id(s.kernel): (g, tl) for _, s, g, tl in fed}           # phase kernel -> (RingGemv, Tiles)
    grid = fed[0][1].grid if fed else t.compute_units * workgroups_per_cu(False)
    n, per_cu = sum(isinstance(s, L.GridBarrier) for s in k.body), grid // t.compute_units
    trace = trace_on()
    for i, (g, tl) in rings.items():
        body = _stamped(ring.consumer(g, tl)) if trace else ring.consumer(g, tl)
        mapped[i] = replace(mapped[i], body=body, launch=replace(mapped[i].launch, how=ring.how(tl)))
    stamps = 1 + n + sum(3 if id(s.kernel) in rings else 1 for s in phases)   # start, each barrier left, each
                                                                                 # phase's end (staged, dot)
    head = (f"// vegafuse kernel for {t.name}; prelude generated from the target table\n"
            + (_CONSUMERS if rings else "")
            + prelude(replace(t, block=block), act, **prelude_parts(distinct, list(mapped.values())))
            + grid_barrier(t) + (prelude_ring(t, ring_evict_first()) if rings else "")
            + "// the phases' arrays in dynamic LDS: declared in each, sized at launch\n#define VF_DYNAMIC_LDS(name, bytes) "
            "extern __shared__ __attribute__((aligned(16))) unsigned char name[]\n")
    written = {p.name for p in k.params if p.role != "in"}
    lines, lds, space = _TRACE.format(grid=grid, n=stamps).splitlines() if trace else [], 0, {}
    for pk in distinct:
        m = mapped[id(pk)]
        coherent = {p.name for s in phases if s.kernel is pk for p, a in zip(m.params, s.args) if a in written}
        dynamic = [a for a in m.body if isinstance(a, L.Array) and a.space == "lds"]
        lds = max(lds, sum(map(_lds_size, dynamic)))
        ns = space[id(pk)] = L.fresh_name(f"phase_{m.name}", set(space.values()))
        lines += _phase(k, m, ns, coherent, dynamic, rings.get(id(pk)))
    slots = _ring_slots(t, per_cu, lds, static) if rings else 0
    if rings and slots < 2:
        raise ValueError(f"persistent kernel {k.name}: no room for a ring of two {ring.SLOT_BYTES}-byte slots beside "
                         f"{lds} bytes of LDS with {per_cu} workgroups a compute unit; set VEGAFUSE_PERSISTENT_RING=0")
    ring_at = -(-lds // 128) * 128
    total = ring_at + slots * ring.SLOT_BYTES if rings else lds
    threads = block + (32 if rings else 0)
    lines += [f"// {k.name}: {len(phases)} phases of one launch, a grid barrier between each two; "
              f"{k.bytes} bytes moved, {k.flops} flops per call",
              f"// the grid: {per_cu} workgroup{'s' if per_cu > 1 else ''} a compute unit, all resident",
              "__device__ unsigned int vf_grid_arrived, vf_grid_left;   // zero between launches",
              f'extern "C" __global__ void __launch_bounds__({threads}{_occupancy(t, threads, per_cu)}) {k.name}({_signature(k)}) {{']
    if rings:
        lines += _ring_start(fed, space, slots, lds, total)
    lines += ["  VF_GRID_WAIT();                // from here on, the previous kernel's outputs are ready",
              "  VF_GRID_LAUNCH_DEPENDENTS();"]
    stamp = (lambda step: stmts((L.Stamp(step),))) if trace else (lambda step: [])   # noqa: E731
    lines += (["  if (threadIdx.x == 0) vf_trace_at = vf_trace + blockIdx.x * VF_TRACE_STAMPS;"] if trace else []) \
        + stamp("start")
    at, ahead = 0, prefetch_bytes(t) if not rings else 0
    for i, s in enumerate(k.body):
        if isinstance(s, L.Phase):
            lines += _call(s, mapped[id(s.kernel)], space[id(s.kernel)], ring=id(s.kernel) in rings) + stamp("end")
        elif isinstance(s, L.GridBarrier):
            lines += _prefetch(next(x for x in k.body[i:] if isinstance(x, L.Phase)), ahead)
            at += 1
            barrier = f"vf_grid_barrier(&vf_grid_arrived, {at}{', vf_ring.quiet' if rings else ''});"
            lines.append(f"  {barrier}" + (f"   // {at} of {n}" if at == 1 else ""))
            lines += stamp("left")
    lines += ["  vf_grid_leave(&vf_grid_arrived, &vf_grid_left);", "}"]
    how = (f"{len(phases)} phases, {per_cu} workgroup{'s' if per_cu > 1 else ''} a compute unit"
           + (f", a ring of {slots} slots" if rings else ""))
    m = replace(k, launch=L.Launch(grid, threads, str(threads), how, 0, act))
    src = head + "\n" + "\n".join(lines) + "\n"
    return HipKernel(k.name, src, (grid, 1, 1), (threads, 1, 1), total, m, t, len(head) + 1)


def trace_on() -> bool:
    """Does the persistent kernel stamp each phase's steps (``VEGAFUSE_PERSISTENT_TRACE=1``; off by default):
    thread 0 of each workgroup records its compute unit's clock at the launch's start, at each ring
    phase's activation staged and dot products done, at each phase's end and as it leaves each grid
    barrier (``engine.profile.phase_times`` reads them)?"""
    return switch("VEGAFUSE_PERSISTENT_TRACE", False, "stamp each phase's steps")


_TRACE = """// VEGAFUSE_PERSISTENT_TRACE: thread 0 of each workgroup stamps its compute unit's clock at each step of each
// phase (codegen.loopir.STAMP_STEPS, in the low 4 bits), in order, into its row of vf_trace: the last launch's
// (engine.profile.phase_times reads them)
#define VF_TRACE_STAMPS {n}
__device__ unsigned long long vf_trace[{grid} * VF_TRACE_STAMPS];
__shared__ unsigned long long* vf_trace_at;
#define VF_STAMP(step) do {{ if (threadIdx.x == 0) *vf_trace_at++ = (unsigned long long)clock64() << 4 | (step); }} while (0)
"""


def _stamped(body: tuple) -> tuple:
    """A ring phase's consumer body (``codegen.ring.consumer``: its prologue, then its loop over blocks)
    with stamps where its activation is staged and after its first block's dot products (a row of
    stamps a workgroup holds the same count whatever blocks it takes)."""
    *prologue, blocks = body
    first = L.Bin("lt", L.Sym(blocks.var, "i32"), L.Hw("grid"))
    inner = tuple(x for b in blocks.body
                  for x in ((b, L.If(first, (L.Stamp("dot"),))) if isinstance(b, L.RingDot) else (b,)))
    return tuple(prologue) + (L.Stamp("staged"), replace(blocks, body=inner))


def _phase(k: L.Kernel, m: L.Kernel, ns: str, coherent: set, dynamic: list, fed=None) -> list:
    """The namespace ``ns`` of phase kernel ``m`` (mapped) of the persistent kernel ``k``: its file-scope
    lines and its function ``run``; a phase ``fed`` by the ring (its RingGemv and Tiles) also has the
    producer's walk over it, ``produce``, and both return the number of the next chunk."""
    lines = [f"namespace {ns} {{   // a phase of {k.name}"] + file_scope(m)
    if fed:
        lines += _producer(ring.producer(*fed, ring_flight()))
    lines += ["// blockIdx and gridDim are the phase's own, given by the caller",
              f"__device__ __noinline__ {'unsigned int' if fed else 'void'} run({_phase_signature(m, coherent, bool(fed))}) {{"]
    lines += function_body(m, dynamic, why="the phases take one buffer in turn")
    return lines + (["  return vf_chunk;"] if fed else []) + ["}", f"}}  // namespace {ns}", ""]


def _ring_start(fed: list, space, slots: int, lds: int, total: int) -> list:
    """The kernel's first lines with a ring: the ring of ``slots`` slots after the phases' ``lds`` bytes
    (``total`` dynamic LDS in all), then the producer warp's walk over every ring phase (``fed``:
    ``shares``), in order."""
    quiet = ring_quiet()
    lines = [f"  // the ring: {slots} slots of {ring.SLOT_BYTES} bytes after the phases' {lds} bytes of LDS",
             f"  __shared__ unsigned long long vf_ring_barriers[{2 * slots}];"]
    lines += ["  __shared__ unsigned int vf_quiet;   // 1 while the consumers wait at a grid barrier"] if quiet else []
    lines += [f"  VF_DYNAMIC_LDS(vf_lds, {total});",
              f"  const vf_ring_t vf_ring = vf_ring_start(vf_lds + {-(-lds // 128) * 128}, vf_ring_barriers, {slots}, "
              f"{ring.SLOT_BYTES}, {'&vf_quiet' if quiet else '0'});",
              "  if (threadIdx.x >= VF_BLOCK) {   // the producer warp: every ring phase's chunks, in the phases' order",
              "    if (threadIdx.x == VF_BLOCK) {",
              "      unsigned int vf_chunk = 0;"]
    for at, s, g, tl in fed:
        lines.append(f"      vf_chunk = {space[id(s.kernel)]}::produce(dim3(blockIdx.x), dim3(gridDim.x), vf_ring, "
                     f"vf_chunk, {s.tiled} + {at});   // {s.name}")
    return lines + ["    }", "    return;", "  }", "  unsigned int vf_chunk = 0;"]


_CONSUMERS = """// a workgroup of VF_BLOCK threads that run the phases and one warp that fills the ring of weights: the
// phases' workgroup barrier is named barrier 1 of the VF_BLOCK threads, which the producer warp never joins
#define __syncthreads() asm volatile("bar.sync 1, %0;" :: "n"(VF_BLOCK) : "memory")
"""


def _producer(body) -> list:
    """The producer warp's walk over a ring phase (``codegen.ring.producer``), as the phase's function
    ``produce``."""
    return ["// the producer warp's side: this workgroup's blocks' chunks into the ring, in the consumers' order",
            "__device__ __noinline__ unsigned int produce(const dim3 blockIdx, const dim3 gridDim, const vf_ring_t vf_ring, "
            "unsigned int vf_chunk, const vf_half* __restrict__ vf_tiled) {"] + stmts(body) + ["  return vf_chunk;", "}"]
