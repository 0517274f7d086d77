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
from .hip import CTYPE, HipKernel, _lds_size, _signature, _weights, file_scope, function_body, parameter, prelude_parts
from .mapping import clear_of_templates, env_int, map_kernel
from .prelude import grid_barrier, prelude


def _phase_signature(k: L.Kernel, coherent: set) -> str:
    """``k``'s parameters, those in ``coherent`` (written by a phase) without ``__restrict__``."""
    args = []
    for p in k.params:
        if p.kind == "buffer" and p.name in coherent:
            args.append(f"{'const ' if p.role == 'in' else ''}{CTYPE[p.dtype]}* {p.name}")
        else:
            args.append(parameter(p))
    return ", ".join(["const dim3 blockIdx", "const dim3 gridDim"] + args)


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
    names = dict(zip((p.name for p in s.kernel.params), s.args))
    weights = _weights(clear_of_templates(s.kernel)) if n else []
    if not weights:
        return []
    return ([f"{pad}// before the barrier: the first {n} bytes (at most) of each weight of {s.name} into L2, a share a workgroup"]
            + [f"{pad}vf_prefetch_l2({names[p.name]}, {min(n, int(p.size * L.ITEMSIZE[p.dtype]))}ull);" for p in weights])


def _call(s: L.Phase, m: L.Kernel, ns: str, pad="  ") -> list:
    """A phase (its function ``ns::run``) run by the launch's workgroups: in one call each
    where it computes the same for any grid (``any_grid``), else its own workgroups taken in turn."""
    args = ", ".join(a + ("_" if p.kind == "scalar" else "") for p, a in zip(m.params, s.args))
    if any_grid(m):
        return [f"{pad}// {s.name}: its grid-stride loops over the launch's workgroups",
                f"{pad}{ns}::run(dim3(blockIdx.x), dim3(gridDim.x), {args});"]
    g = m.launch.grid                                # taken in turn: right for a launch of any size
    return [f"{pad}// {s.name}: {g} workgroup{'s' if g > 1 else ''}, taken in turn",
            f"{pad}for (unsigned int w = blockIdx.x; w < {g}; w += gridDim.x)",
            f"{pad}  {ns}::run(dim3(w), dim3({g}), {args});"]


def workgroups_per_cu() -> int:
    """Workgroups of a persistent kernel resident on each compute unit (``VEGAFUSE_PERSISTENT_PER_CU``,
    default 2, measured against 1, 3 and 4 in docs/performance.md): more hide more of each phase's
    latency, at fewer registers a thread."""
    return env_int("VEGAFUSE_PERSISTENT_PER_CU", 2, 1, "1 or more workgroups a compute unit")


def _occupancy(t, block: int, per_cu: int) -> str:
    """The second argument of ``__launch_bounds__`` that keeps ``per_cu`` workgroups resident on a
    compute unit: NVIDIA counts workgroups an SM, HIP waves a SIMD (``amdgpu_waves_per_eu``)."""
    n = per_cu if t.vendor == "nvidia" else max(1, per_cu * block // t.wave // t.simds_per_cu)
    return f", {n}" if n > 1 else ""


def render_persistent(k: L.Kernel, t) -> HipKernel:
    """HIP source of the persistent kernel ``k`` for ``t`` (a Target), with its launch:
    ``workgroups_per_cu()`` workgroups a compute unit, the dynamic LDS its largest phase takes.
    Raises ValueError when its phases do not map onto one workgroup size and activation dtype."""
    phases = [s for s in k.body if isinstance(s, L.Phase)]
    distinct = list({id(s.kernel): s.kernel for s in phases}.values())
    mapped = {id(pk): L.tidy_names(map_kernel(pk, t), reserved=("vf_lane", "vf_wave")) for pk in distinct}
    geometry = {(m.launch.block, m.launch.act if m.family == "contract" else "") for m in mapped.values()}
    blocks, acts = {b for b, _ in geometry}, {a for _, a in geometry} - {""}
    if len(blocks) != 1 or len(acts) > 1:
        raise ValueError(f"persistent kernel {k.name}: its phases map onto {sorted(geometry)} (workgroup size, "
                         "GEMV activation dtype); a persistent kernel has one of each")
    (block,), act = blocks, (acts or {"f32"}).pop()
    head = (f"// vegafuse kernel for {t.name}; prelude generated from the target table\n"
            + prelude(replace(t, block=block), act, **prelude_parts(distinct, list(mapped.values())))
            + grid_barrier(t)
            + "// the phases' arrays in dynamic LDS: declared in each, sized at launch\n#define VF_DYNAMIC_LDS(name, bytes) "
            "extern __shared__ __attribute__((aligned(16))) unsigned char name[]\n")
    written = {p.name for p in k.params if p.role != "in"}
    lines, lds, space = [], 0, {}
    for pk in distinct:
        m = mapped[id(pk)]
        coherent = {p.name for s in phases if s.kernel is pk for p, a in zip(m.params, s.args) if a in written}
        dynamic = [a for a in m.body if isinstance(a, L.Array) and a.space == "lds"]
        lds = max(lds, sum(map(_lds_size, dynamic)))
        ns = space[id(pk)] = L.fresh_name(f"phase_{m.name}", set(space.values()))
        lines += [f"namespace {ns} {{   // a phase of {k.name}"] + file_scope(m)
        lines += ["// blockIdx and gridDim are the phase's own, given by the caller",
                  f"__device__ __noinline__ void run({_phase_signature(m, coherent)}) {{"]
        lines += function_body(m, dynamic, why="the phases take one buffer in turn") + ["}", f"}}  // namespace {ns}", ""]
    n, per_cu = sum(isinstance(s, L.GridBarrier) for s in k.body), workgroups_per_cu()
    grid = t.compute_units * per_cu
    lines += [f"// {k.name}: {len(phases)} phases of one launch, a grid barrier between each two; "
              f"{k.bytes} bytes moved, {k.flops} flops per call",
              f"// the grid: {per_cu} workgroup{'s' if per_cu > 1 else ''} a compute unit, all resident",
              "__device__ unsigned int vf_grid_arrived, vf_grid_left;   // zero between launches",
              f'extern "C" __global__ void __launch_bounds__({block}{_occupancy(t, block, per_cu)}) {k.name}({_signature(k)}) {{',
              "  VF_GRID_WAIT();                // from here on, the previous kernel's outputs are ready",
              "  VF_GRID_LAUNCH_DEPENDENTS();"]
    at, ahead = 0, prefetch_bytes(t)
    for i, s in enumerate(k.body):
        if isinstance(s, L.Phase):
            lines += _call(s, mapped[id(s.kernel)], space[id(s.kernel)])
        elif isinstance(s, L.GridBarrier):
            lines += _prefetch(next(x for x in k.body[i:] if isinstance(x, L.Phase)), ahead)
            at += 1
            lines.append(f"  vf_grid_barrier(&vf_grid_arrived, {at});" + (f"   // {at} of {n}" if at == 1 else ""))
    lines += ["  vf_grid_leave(&vf_grid_arrived, &vf_grid_left);", "}"]
    m = replace(k, launch=L.Launch(grid, block, str(block), f"{len(phases)} phases, {per_cu} workgroups a compute unit",
                                   0, act))
    src = head + "\n" + "\n".join(lines) + "\n"
    return HipKernel(k.name, src, (grid, 1, 1), (block, 1, 1), lds, m, t, len(head) + 1)
