"""GPU target tables: every target-specific choice of the HIP renderer lives here.

The renderer emits the same kernel body for every target; what differs is the
prelude it writes from this table (wave width, half-precision types, the
16-byte vector load, the dot-product and wave-reduction primitives) and the
launch parameters (workgroup size, occupancy cap).  A test renders every
kernel for two tables and checks that the sources differ only there.

gfx906 facts (AMD Instinct MI50, Vega 20): wave64, 4 SIMDs and 64 KiB LDS per
CU, at most 10 waves per SIMD, 256 VGPRs per lane and 800 SGPRs per SIMD;
``v_dot2_f32_f16``; bandwidth fell 2.3x at 10 waves per SIMD against 9 in a
measured GEMV (shared/reference/000), hence the occupancy cap.  Sources: AMD
"Vega ISA" reference, ROCm hardware tables, LLVM's ``AMDGPUBaseInfo.cpp``.
These facts live only in the table; :func:`occupancy` (waves per SIMD from a
kernel's registers and LDS) and :func:`occupancy_lds` (the cap's launch pad)
compute from it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Target:
    name: str                    # offload arch: "gfx906", "sm_90"
    vendor: str                  # "amd" | "nvidia"
    wave: int                    # lanes per wavefront / warp
    block: int = 256             # threads per workgroup
    load_bytes: int = 16         # widest global load: 16 bytes = 8 halves (global_load_dwordx4)
    dot2: bool = False           # fp16 dot2 into f32 (v_dot2_f32_f16): activation kept as f16 in LDS
    int8_dot: bool = True        # 4 x int8 dot products into i32 (v_dot4_i32_i8, NVIDIA's dp4a): a GEMV with
                                 # quantized weights quantizes its activation to q8_1 (off: f32/f16 activation,
                                 # each weight dequantized as it is loaded; VEGAFUSE_QUANT_ACT=float)
    rows_per_wave: int = 1       # GEMV output rows per wave (several rows per workgroup = block/wave * this)
    max_waves_per_simd: int = 0  # occupancy cap for bandwidth-bound kernels (0: none)
    simds_per_cu: int = 4
    lds_per_cu: int = 65536      # bytes
    lds_granule: int = 512       # LDS allocation granularity, bytes
    max_waves_hw: int = 10       # hardware limit of waves per SIMD
    vgprs_per_simd: int = 0      # register model for occupancy() (0: none): VGPRs per lane in a SIMD
    vgpr_granule: int = 0        #   VGPR allocation granule
    sgprs_per_simd: int = 0      #   SGPRs per SIMD
    sgpr_granule: int = 0        #   SGPR allocation granule
    max_barriers: int = 0        #   workgroups of more than one wave resident per CU
    max_static_lds: int = 65536  # bytes of __shared__ a kernel may declare statically
    max_lds: int = 0             # bytes of LDS one workgroup may take, static and dynamic together (0: max_static_lds):
                                 # a GEMV's arrays beyond max_static_lds are declared in dynamic LDS (codegen.hip)
    compute_units: int = 60      # CUs / SMs: GEMV grids are capped at compute_units * blocks_per_cu
    blocks_per_cu: int = 8       # workgroups resident per CU that a GEMV grid aims for
    int8_rows_per_lane: int = 4  # rows a lane of an int8 GEMV folds against each activation block it reads from LDS
                                 # (at most; codegen.mapping.rows_per_lane): gfx906 takes 8, so that its main loop
                                 # reads LDS at most 0.056 times per weight byte (the reference's metric)
    int8_blocks_per_cu: int = 0  # the same for GEMVs on int8 dot products (0: blocks_per_cu); on an H200 they take
                                 # 64 registers, so 4 workgroups of 256 fit an SM and a grid of 8 per SM ran a second
                                 # round: 4 gave 427.8 against 410.3/410.5 tok/s (Qwen2.5-7B q4_0, A/B/A, 2026-12-01)
    int8_trip_unroll: int = 0    # unroll of an int8 GEMV's loop over its tiles where a lane folds at most 2 blocks of
                                 # a row (codegen.mapping.trip_unroll): other tiles' loads in flight (0: none)
    int8_whole_steps: int = 0    # an int8 GEMV lane's loop over at most this many blocks is written fully unrolled, its
                                 # loads in flight together (codegen.mapping.whole_steps; 0: never)
    int8_full_lanes: int = 0     # an int8 GEMV row whose blocks leave a wave's lanes idle takes half the wave when
                                 # a lane then folds at most this many blocks (codegen.mapping._lanes_per_row; 0: never)
    int8_balance: bool = False   # rows per lane chosen for the grid (codegen.mapping.rows_per_lane): as few as
                                 # keep the waves busy (more loads in flight), fewer when the tiles would leave
                                 # waves idle in a last round; gfx906 keeps 8 for its LDS metric
    int8_prologue_budget: int = 0  # activation elements the int8 GEMV prologues of one CU quantize (0: no limit):
                                 # every workgroup quantizes the whole activation, so a long one takes fewer
                                 # workgroups per CU (codegen.mapping._blocks_per_cu)
    balance_k: int = 0           # float GEMVs of a wave per row and K >= this (0: never) whose grid fits one round
                                 # unevenly take one workgroup per CU of ceil(rows / CUs) waves instead
                                 # (codegen.mapping._balanced); see the sm_90 entry
    whole_block: int = 1024      # the largest workgroup codegen.mapping._whole_trips takes so that a GEMV's trips
                                 # store whole q8_1 blocks: its registers a lane shrink as the workgroup grows
                                 # (see the gfx906 entry)
    unroll: int = 4              # GEMV k-loop unroll: independent 16-byte loads in flight per lane
    prologue_unroll: int = 8     # unroll of the GEMV prologue that fills the activation in LDS
    norm_after_dot: bool = False  # a float GEMV's RMSNorm prologue in one pass, its scale after the dot products
                                 # (codegen/prologue.py; the int8 path always): set for the persistent kernel's
                                 # phases (codegen.persistent.phase_target)
    one_workgroup_block: int = 0  # threads of a kernel that runs on one workgroup (the loop family, a reduction
                                 # to a scalar; codegen.mapping.one_workgroup_block): its passes over a row are
                                 # latency-bound, so it takes as many loads in flight as a workgroup holds (0: block)
    attention_block: int = 256   # threads of an attention workgroup (codegen.mapping.attention_tiles)
    attention_lds: int = 32 * 1024  # LDS an attention workgroup may take (its tiles' size): two fit a gfx906 CU
    attention_waves: int = 4     # waves of a decode attention workgroup (codegen.mapping.decode_tiles;
                                 # VEGAFUSE_ATT_WAVES sets it: A/B)
    attention_short: int = 0     # decode attention: up to this many steps of keys the first split reads the whole
                                 # context, no combine (codegen.mapping.decode_tiles; 0: the splits as they fall)
    attention_workgroups_per_cu: int = 1  # decode attention: workgroups per CU when the cache is full, which sets
                                 # the positions of a split (codegen.mapping.decode_tiles)
    attention_vgprs: int = 0     # registers per lane a decode attention may take (0: no limit; decode_tiles
                                 # takes fewer query heads per workgroup, or fewer keys in flight, to fit)
    attention_decode_vgprs: int = 0  # the decode attention's register budget where it differs from the prefill's
                                 # (0: attention_vgprs)
    pdl: bool = False            # programmatic dependent launch (Hopper): a kernel starts while the previous
                                 # one drains, then waits for its inputs (on for sm_90, see its entry;
                                 # VEGAFUSE_CUDA_PDL=0 turns it off, =1 on)
    pdl_trigger: str = "exit"    # with pdl: when the next kernel may start: "exit" (as each workgroup ends) or
                                 # "wait" (once this one has waited: 0.929x at 1.5B f16); VEGAFUSE_PDL_TRIGGER
    pdl_prefetch: int = 4 << 20  # with pdl: the first bytes of each weight a GEMV asks L2 for before it waits,
                                 # shared among its workgroups (0: none; 4 MiB 1.032x against 1 MiB at 1.5B
                                 # q4_0); VEGAFUSE_PDL_PREFETCH
    maps_like: str = ""          # map kernels (codegen/mapping.py) as for this target, so that its kernel text
                                 # runs here; only the prelude and the workgroup limits come from this table
    emulated_wave: bool = False  # NVIDIA only: a wave of ``wave`` = 64 lanes made of two 32-lane warps, joined
                                 # through LDS and a named barrier per wave (codegen/prelude.py), so that
                                 # gfx906's wave-64 kernel text runs on an NVIDIA GPU

    @property
    def waves_per_block(self):
        return self.block // self.wave


TARGETS = {
    "gfx906": Target("gfx906", "amd", wave=64, dot2=True, max_waves_per_simd=9, int8_rows_per_lane=8,
                     simds_per_cu=4,          # GCN CU: 4 SIMD16 units, each runs 64-lane waves
                     max_waves_hw=10,         # LLVM getMaxWavesPerEU (gfx9 before gfx90a)
                     lds_per_cu=65536, lds_granule=512,   # LDS is allocated in 128-dword blocks (gfx7+)
                     vgprs_per_simd=256,      # 64 KiB VGPR file per SIMD
                     vgpr_granule=4,          # LLVM getVGPRAllocGranule (wave64, gfx9)
                     sgprs_per_simd=800,      # LLVM getTotalNumSGPRs (gfx8+)
                     sgpr_granule=16,         # LLVM getSGPRAllocGranule (gfx8-gfx9)
                     max_barriers=16,         # LLVM getMaxWorkGroupsPerCU
                     # 1024 threads are 4 waves per SIMD, 64 VGPRs each; the int8 GEMV of 8 rows a lane takes
                     # about 90 (D 8192, F 1024 gate/up spilled 32 VGPRs); 512: 128 VGPRs a lane
                     whole_block=512,
                     one_workgroup_block=512,  # 8 waves: at most 15 fit the wave-64 emulation on an NVIDIA GPU
                     attention_vgprs=128),    # two waves per SIMD (6 heads x 4 keys took 220: one wave)
    "sm_90": Target("sm_90", "nvidia", wave=32, block=256, rows_per_wave=1, max_static_lds=48 * 1024,
                    max_lds=227 * 1024,        # the opt-in limit of a Hopper block (cudaFuncSetAttribute)
                    attention_lds=46 * 1024,   # tiles of 64 keys for decode at head dim 128 (4 workgroups per SM)
                    lds_per_cu=228 * 1024, max_waves_hw=16, compute_units=132, int8_blocks_per_cu=4,
                    # measured on an H200 (Qwen2.5-7B q4_0, one layer, 2026-12-01): gate/up 41.6 -> 28.9 us with
                    # the balance (4736 tiles of 4 rows ran 1.12 rounds of 4224 waves); down (K 18944)
                    # 30.4 -> 24.1 us at 2 workgroups per SM
                    int8_balance=True, int8_prologue_budget=40960,
                    # Qwen2.5-7B's down projection (K 18944, 3584 rows): 448 workgroups of 8 rows left 52 SMs
                    # with 4 and 80 with 3; 128 workgroups of 28 rows took 37.2 against 41.7 us, and decode ran
                    # at 242.2/243.9 against 238.2 tok/s (A/B/A, 2026-12-01).  At K 3584 (its O projection)
                    # the same took 10.1 against 9.0 us, so only long rows
                    balance_k=8192,
                    # A/B/A on an H200 (2026-12-02, --ab VEGAFUSE_TRIP_UNROLL=N, every GEMV): Qwen2.5-1.5B
                    # q4_0 (1.5 blocks a lane) 915 -> 937 tok/s by 4, 923 by 2; 7B q4_0 (3.5) 474 -> 468 by 2;
                    # 7B gptq_int4 (3.5) 401 -> 421 by 2; 1.5B f16 (a float GEMV) 677 -> 657 by 2
                    int8_trip_unroll=4,
                    # A/B/A on an H200 (2026-12-03, VEGAFUSE_WHOLE_STEPS=0 as B): Qwen2.5-7B q4_0 517 against 473
                    # tok/s, gptq_int4 468 against 418, 1.5B q4_0 959 against 934
                    int8_whole_steps=8,
                    # A/B/A on an H200 (2026-12-03, VEGAFUSE_INT8_FULL_LANES as B): Qwen2.5-1.5B q4_0 (48 blocks
                    # a row: 16 lanes of 3 against 32 lanes with 16 idle on the second step) 1114.8 against
                    # 1071.9/1073.8 tok/s; 7B q4_0 (112 blocks: 16 lanes of 7) lost, 536.4 against 542.5/543.7
                    int8_full_lanes=4,
                    # A/B/A on an H200 (2026-12-02, VEGAFUSE_ATT_SHORT=0 as B): Qwen2.5-1.5B f16 decode at 32
                    # positions 679.3 against 670.1 tok/s (attention 8.5 -> 7.0 us alone), 7B q4_0 474.6 / 471.8
                    attention_short=4,
                    # a decode attention of fewer query heads per workgroup (Qwen2.5-1.5B: 3 of 6, 4 keys in flight;
                    # 7B: 4 of 7, 2 keys), so that a short context takes more workgroups.  On an H200 (2026-12-03):
                    # a budget of 128 (3 heads, 2 keys) ran 7B q4_0 at 534.5/533.5 against 516.7 tok/s with none and
                    # 1.5B f16 at 686.7/686.2 against 675.0 (A/B/A), but decode at position 4000 fell from 1.654 to
                    # 2.304 ms a token; 170 kept it (1.658) and ran 7B q4_0 at 1.888 ms (529.7 tok/s)
                    attention_decode_vgprs=170,
                    # two workgroups per SM over a full cache: Qwen2.5-1.5B f16 at position 4000 of 4200 ran
                    # 632.8 against 599.1/600.3 tok/s with one (splits of 64 positions against 128; A/B/A on an
                    # H200, 2026-12-03, --ab VEGAFUSE_ATT_CHUNK=64; 32 positions lost, 0.971x), at 3 query heads
                    # a workgroup.  On 2026-12-01, at 6 heads a workgroup, 64 positions was also best (then
                    # one workgroup per SM; 32 lost).  Other shapes not measured
                    attention_workgroups_per_cu=2,
                    # 8 waves a decode attention workgroup: 64 keys a step, so a short context takes fewer
                    # serial steps (Qwen2.5-1.5B at 32-160 positions: 3 steps or fewer instead of 5).  A/B/A on
                    # an H200 (2026-12-03, VEGAFUSE_ATT_WAVES=8 as B against 4): 1.5B q4_0 1192.4 against
                    # 1163.9/1170.0 tok/s, f16 732.6 against 729.0/720.3, f16 at position 4000 of 4200 655.1
                    # against 651.9/648.0; 16 waves exceed the kernel's launch bound (attention_block).  7B not
                    # measured
                    attention_waves=8,
                    # programmatic dependent launch, the trigger at exit and 4 MiB asked of L2 before the wait:
                    # on an H200 (2026-12-03, --ab VEGAFUSE_CUDA_PDL=1 before it was the default) Qwen2.5-1.5B
                    # q4_0 1041.9 against 1005.1/1004.0 tok/s, 1.5B f16 710.6 against 703.7/694.7, 7B q4_0
                    # 527.0 against 524.2/525.2 (7B q4_0 had lost 1.6% before its int8 lanes took whole steps)
                    pdl=True,
                    one_workgroup_block=1024),
}
# gfx906's wave width on an NVIDIA GPU: named barrier 0 is __syncthreads and ids 1..15 are one per wave,
# so a workgroup holds at most 15 waves; the wave exchange's LDS comes out of the kernel's static budget
# (1 int per thread of the largest workgroup)
TARGETS["sm_90_wave64"] = replace(TARGETS["sm_90"], name="sm_90_wave64", wave=64, emulated_wave=True,
                                  max_static_lds=48 * 1024 - 4 * 512, max_lds=227 * 1024 - 4 * 512,
                                  maps_like="gfx906", pdl=False)


def lds_budget(t: Target) -> int:
    """Bytes of LDS one workgroup of ``t`` may take, static and dynamic together."""
    return t.max_lds or t.max_static_lds


def get_target(name: str, **overrides) -> Target:
    """The table for ``name`` ("gfx906", "sm_90", "sm_90_wave64"); keyword overrides (e.g. ``wave=32``) for tests
    and A/B switches such as ``max_waves_per_simd=0``."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return replace(TARGETS[name], **overrides) if overrides else TARGETS[name]


def occupancy_lds(t: Target, static_lds: int = 0, block: int = 0) -> int:
    """Dynamic LDS bytes to request at launch so that at most ``t.max_waves_per_simd`` waves run per
    SIMD (the occupancy-cliff switch).  Workgroups per CU = floor(lds_per_cu / lds_per_wg); waves per
    SIMD = workgroups per CU * waves per workgroup / SIMDs per CU."""
    if not t.max_waves_per_simd or t.max_waves_per_simd >= t.max_waves_hw:
        return 0
    waves = (block or t.block) // t.wave
    max_wgs = max(1, t.max_waves_per_simd * t.simds_per_cu // waves)
    need = t.lds_per_cu // (max_wgs + 1) + 1                 # so that max_wgs + 1 workgroups do not fit
    need = -(-need // t.lds_granule) * t.lds_granule
    return max(0, need - static_lds)


def occupancy(t: Target, vgprs: int, sgprs: int, lds_bytes: int = 0, workgroup_size: int = 256) -> dict:
    """Resident waves of a kernel on target ``t`` (an AMD table with a register model), from its
    register and LDS use.

    ``vgprs``: VGPRs per lane (metadata ``.vgpr_count``); ``sgprs``: SGPRs per wave including
    VCC/FLAT_SCRATCH/XNACK (``.sgpr_count``); ``lds_bytes``: LDS per workgroup (static
    ``.group_segment_fixed_size`` plus any dynamic shared memory); ``workgroup_size``: threads.

    Per-SIMD register bounds (gfx906 numbers in brackets):

    * VGPR: ``min(max_waves_hw, floor(vgprs_per_simd / round_up(vgprs, vgpr_granule)))``
      [``min(10, floor(256 / round_up(vgprs, 4)))``]
    * SGPR: ``min(max_waves_hw, floor(sgprs_per_simd / round_up(sgprs, sgpr_granule)))``
      [``min(10, floor(800 / round_up(sgprs, 16)))``].  LLVM before 2026 used a step table
      (<=80: 10, <=88: 9, <=100: 8, else 7) that differs at 81..88 and 97..100 SGPRs.

    Then whole workgroups per CU (a workgroup is resident entirely or not at all), with
    ``w = ceil(workgroup_size / wave)`` waves per workgroup:

    * registers: ``floor(bound * simds_per_cu / w)`` for each register bound;
    * LDS: ``floor(lds_per_cu / round_up(lds_bytes, lds_granule))`` (none if no LDS; at least 1);
    * wave slots: ``floor(max_waves_hw * simds_per_cu / w)``; barriers: at most ``max_barriers``
      workgroups of more than one wave.

    Returns ``waves_per_simd = ceil(workgroups * w / simds_per_cu)`` (waves on the busiest SIMD),
    ``waves_per_cu``, ``workgroups_per_cu`` and ``limiter`` (``"vgpr"``, ``"sgpr"``, ``"lds"``,
    ``"workgroup"`` (slots or barriers), or ``"none"`` when ``max_waves_hw`` waves per SIMD fit).
    Raises ValueError for a table without a register model.
    """
    if not (t.vgprs_per_simd and t.sgprs_per_simd):
        raise ValueError(f"target {t.name} has no register model for occupancy (vgprs_per_simd, sgprs_per_simd)")

    def round_up(n, granule):
        return max(granule, -(-n // granule) * granule)

    w = max(1, -(-workgroup_size // t.wave))
    slots = t.max_waves_hw * t.simds_per_cu                                       # wave slots per CU
    occ_v = min(t.max_waves_hw, t.vgprs_per_simd // round_up(vgprs, t.vgpr_granule))
    occ_s = min(t.max_waves_hw, t.sgprs_per_simd // round_up(sgprs, t.sgpr_granule))
    bounds = {                                                                     # workgroups per CU
        "vgpr": occ_v * t.simds_per_cu // w,
        "sgpr": occ_s * t.simds_per_cu // w,
        "lds": max(1, t.lds_per_cu // round_up(lds_bytes, t.lds_granule)) if lds_bytes else slots,
        "workgroup": min(slots // w, slots if w == 1 else t.max_barriers),
    }
    wgs = max(1, min(bounds.values()))
    short = {"vgpr": occ_v < t.max_waves_hw, "sgpr": occ_s < t.max_waves_hw,
             "lds": bounds["lds"] * w < slots, "workgroup": bounds["workgroup"] * w < slots}
    limiter = next((k for k in bounds if short[k] and bounds[k] == wgs), "none")   # binding and scarce
    return {"waves_per_simd": -(-wgs * w // t.simds_per_cu), "waves_per_cu": wgs * w,
            "workgroups_per_cu": wgs, "limiter": limiter}
