"""GPU plan step: a run of the plan's kernels made one persistent kernel (docs/persistent.md).

A decode step is a chain of dependent kernels; each starts, stages its activation and drains its
last loads before the next may read its result.  One kernel that stays resident can instead meet
each dependence at a grid barrier.  This step builds that kernel from the plan's own kernels:

* a run of consecutive kernels that map onto one launch geometry (a workgroup of the target's
  block, the same activation dtype in LDS) becomes one kernel of family "persistent", whose body
  is a ``Phase`` per kernel in order with a ``GridBarrier`` between each two;
* a phase runs its kernel's mapped body unchanged (``codegen/persistent.py`` renders it: a GEMV's
  grid-stride loops over the persistent kernel's own workgroups, any other kernel's workgroups
  taken in turn by them);
* kernels equal up to names (the same layer again) share one phase kernel, whose parameters lose
  the layer numbers that differ (``params_layers_0_wq`` -> ``params_layers_wq``).

Off by default (``VEGAFUSE_PERSISTENT=1`` turns it on, NVIDIA only): built from the separate
kernels' bodies it runs at 0.87x of their speed (docs/performance.md); it is the scaffold the ring
of weights and the rest of docs/persistent.md are built on.
"""
from __future__ import annotations

import re
from dataclasses import replace

from codegen import loopir as L
from codegen.env import env_int, switch


def enabled(target) -> bool:
    """Is the step on for ``target`` (``VEGAFUSE_PERSISTENT=1`` and an NVIDIA target; ``target`` None
    for a device without one, the CPU)?  ValueError (one line naming it) for a bad value of the switch
    or of any other ``VEGAFUSE_PERSISTENT_*`` switch, whatever the device."""
    from codegen import persistent as P
    on = switch("VEGAFUSE_PERSISTENT", False, "a run of kernels as one persistent kernel")
    P.ring_on(target), P.phase_target(target)       # every switch's value checked here, whatever the device
    P.workgroups_per_cu(), P.ring_flight(), P.ring_quiet(), P.ring_evict_first(), P.trace_on()
    env_int("VEGAFUSE_PERSISTENT_PREFETCH", 0, 0, "a number of bytes (0: none)")
    return on and getattr(target, "vendor", "") == "nvidia"


def _geometry(k: L.Kernel, target):
    """``(block, act, dynamic, static)`` of ``k`` mapped for ``target`` when it can be a phase, else
    None.  ``act``: the dtype a GEMV keeps its activation in, the prelude's ``vf_act_t`` (None for
    other kernels); ``dynamic``: the bytes of its LDS arrays (in a persistent kernel, the phases take
    one dynamic buffer in turn); ``static``: the rest of its LDS, its templates' own arrays (each
    distinct phase keeps its own).  A kernel whose prelude helpers read the launch's own workgroup
    (a q8_1 producer's quantization), one that tiles a matmul for tensor cores and one of another
    workgroup size cannot be a phase."""
    from codegen import mma
    from codegen.mapping import map_kernel
    from codegen.persistent import phase_target
    m = map_kernel(k, phase_target(target))
    if m.launch.block != target.block or any(isinstance(s, (L.QuantizeStored, mma.MatmulTiles))
                                             for s in L.walk_stmts(m.body)):
        return None
    dynamic = sum(a.size * L.ITEMSIZE[a.dtype] for a in m.body if isinstance(a, L.Array) and a.space == "lds")
    return m.launch.block, m.launch.act if k.family == "contract" else None, dynamic, m.launch.lds - dynamic


def _runs(kernels, target):
    """The runs of consecutive kernels that can share a launch (one workgroup size, one GEMV
    activation dtype, and LDS for ``workgroups_per_cu()`` workgroups a compute unit: the largest
    phase's arrays and every distinct phase's template arrays, and with the ring two of its slots),
    each of at least two kernels."""
    from codegen.persistent import ring_grid, ring_on, workgroups_per_cu
    from codegen.ring import SLOT_BYTES
    room = target.lds_per_cu // workgroups_per_cu(False)          # as the phases run without a ring,
    if ring_on(target):                              # and with one: a workgroup a CU, two slots beside them
        per_cu = ring_grid(target) // target.compute_units
        room = min(room, target.lds_per_cu // per_cu - 2 * SLOT_BYTES - 1024)
    runs, run, act, dynamic, static = [], [], None, 0, {}
    for k in kernels:
        g = _geometry(k, target)
        if g is not None:
            key = repr(L.canonicalize(k)) if g[3] else ""
            need = max(dynamic, g[2]) + sum({**static, key: g[3]}.values())
            if g[2] + g[3] > room:
                g = None                             # it would keep the launch's workgroups from all being resident
        if g is None or (g[1] and act and g[1] != act) or (run and need > room):
            runs.append(run)
            run, act, dynamic, static = [], None, 0, {}
        if g is not None:
            run.append(k)
            act, dynamic = act or g[1], max(dynamic, g[2])
            static[key] = g[3]
    return [r for r in runs + [run] if len(r) > 1]


def _shared_names(names: list) -> list:
    """One name for each position of ``names`` (a list of names per kernel of a group): the name
    the kernels share, or where they differ only in numbers, the name without those numbers."""
    out = []
    for same in zip(*names):
        parts = [n.split("_") for n in same]
        if len({len(p) for p in parts}) > 1:
            out.append(same[0])
            continue
        cols = list(zip(*parts))
        differ = [len(set(c)) > 1 for c in cols]
        numbers = all(all(x.isdigit() for x in c) for c, d in zip(cols, differ) if d)
        out.append("_".join(c[0] for c, d in zip(cols, differ) if not d) if numbers else same[0])
    return out


def _phase_kernel(group: list) -> L.Kernel:
    """The kernel that every kernel of ``group`` (equal up to names) runs as: the first, named for
    all of them."""
    first = group[0]
    if len(group) == 1:
        return first
    names = _shared_names([[p.name for p in k.params] for k in group])
    if len(set(names)) < len(names):                  # two parameters would meet in one name
        names = [p.name for p in first.params]
    renamed = {p.name: n for p, n in zip(first.params, names) if p.name != n}
    renamed[first.name] = _shared_names([[g.name] for g in group])[0]
    k = L.rename_params(first, renamed)
    return replace(k, name=renamed[first.name], body=_comments_renamed(k.body, renamed))


def _comments_renamed(body, names: dict):
    """``body`` with the names in ``names`` ({old: new}) renamed in its comments too."""
    if not names:
        return body
    word = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    out = []
    for s in body:
        if isinstance(s, L.Comment):
            s = L.Comment(word.sub(lambda m: names[m.group(1)], s.text))
        elif isinstance(s, L.Loop):
            s = replace(s, body=_comments_renamed(s.body, names))
        elif isinstance(s, L.If):
            s = L.If(s.cond, _comments_renamed(s.then, names), _comments_renamed(s.orelse, names))
        out.append(s)
    return tuple(out)


def _merge(params: dict, p: L.Param) -> None:
    """Add ``p`` to ``params`` (by name): a buffer one phase writes and another reads is "inout"."""
    q = params.get(p.name)
    if q is None:
        params[p.name] = p
    elif q.role != p.role:
        params[p.name] = replace(q, role="inout")


def _ring_phases(phases, target, constant: set) -> set:
    """The ids of the phases whose GEMVs the ring can feed (``codegen.ring.ring_gemv``), their weights
    all ``constant`` (inputs no kernel writes: the tiles are made once, when they are bound)."""
    from codegen.mapping import map_kernel
    from codegen.persistent import phase_args, phase_target
    from codegen.ring import ring_gemv
    gemv, ok = {}, {}
    for s in phases:                                 # a phase kernel is fed in every call or in none
        if id(s.kernel) not in gemv:
            gemv[id(s.kernel)] = ring_gemv(map_kernel(s.kernel, phase_target(target)))
        g = gemv[id(s.kernel)]
        names = phase_args(s)
        ok[id(s.kernel)] = ok.get(id(s.kernel), True) and g is not None and all(
            names[w] in constant for seg in g.segments for w in seg.weights)
    return {id(s) for s in phases if ok[id(s.kernel)]}


def persistent_kernel(run: list, name: str, target=None, tiled_name: str = "", constant=frozenset()) -> L.Kernel:
    """One kernel of family "persistent" for ``run`` (consecutive kernels of the plan, in order):
    a ``Phase`` for each, a ``GridBarrier`` between each two.  With ``target`` and the ring on
    (``codegen.persistent.ring_on``), the GEMV phases whose weights are all ``constant`` (buffer names)
    take them tiled from one more parameter, ``tiled_name``, which those phases name (``Phase.tiled``)."""
    groups = {}
    for k in run:
        groups.setdefault(repr(L.canonicalize(k)), []).append(k)
    phase_of = {}
    for g in groups.values():
        pk = _phase_kernel(g)
        phase_of.update({id(k): pk for k in g})
    params, body = {}, []
    for i, k in enumerate(run):
        for p in k.params:
            _merge(params, p)
        body += ([L.GridBarrier()] if i else []) + [L.Phase(phase_of[id(k)], tuple(p.name for p in k.params), k.name)]
    from codegen.persistent import ring_grid, ring_on, shares
    ring = target is not None and ring_on(target)
    fed = _ring_phases([s for s in body if isinstance(s, L.Phase)], target, constant) if ring else set()
    if fed:
        tiled_name = tiled_name or f"{name}_tiled_weights"
        grid = ring_grid(target)
        body = [replace(s, tiled=tiled_name, grid=grid) if id(s) in fed else s for s in body]
        size = sum(g.slots * g.k for _, _, g, _ in shares([s for s in body if isinstance(s, L.Phase)], target))
        params[tiled_name] = L.Param(tiled_name, "f16", "buffer", (size,), "in")
    return L.Kernel(name, "persistent", tuple(params.values()), tuple(body),
                    ops=tuple(op for k in run for op in k.ops), bytes=sum(k.bytes for k in run),
                    flops=sum(k.flops for k in run), eqns=tuple(e for k in run for e in k.eqns))


def make_persistent(plan, target):
    """``plan`` with each run of kernels that can share a launch made one persistent kernel
    (named ``persistent``, then ``persistent1``, ...)."""
    runs = _runs(plan.kernels, target)
    if not runs:
        return plan
    first = {id(r[0]): r for r in runs}
    inside = {id(k) for r in runs for k in r}
    kernels, buffers, n = [], dict(plan.buffers), 0
    written = {p.name for k in plan.kernels for p in k.params if p.role != "in"}
    constant = set(plan.inputs) - written - set(plan.aliases.values())
    for k in plan.kernels:
        if id(k) in first:
            name = "persistent" + (str(n) if n else "")
            tiled = L.fresh_name(f"{name}_tiled_weights", buffers)
            kernels.append(persistent_kernel(first[id(k)], name, target, tiled, constant))
            buffers.update({p.name: (p.shape, p.dtype) for p in kernels[-1].params if p.name == tiled})
            n += 1
        elif id(k) not in inside:
            kernels.append(k)
    return replace(plan, kernels=kernels, buffers=buffers)
