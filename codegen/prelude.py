"""The prelude of every generated GPU kernel: all that differs between targets, written from the
target table (``codegen/targets.py``).

The kernel text that ``codegen/hip.py`` renders is the same for every target.  Wave width, the
half-precision types, the 16-byte weight load with its dot product (``v_dot2_f32_f16`` on gfx906),
the wave-level communication (``vf_shfl_xor``, ``vf_wave_sum``, ...) and the block reductions are
defined here, so that all communication inside a wave goes through these helpers.

NVIDIA targets run at wave 32 (one warp) or, with ``emulated_wave``, at gfx906's wave 64: two warps
joined through LDS and a named barrier per wave, so that the kernel text rendered for gfx906 runs
unchanged on an NVIDIA GPU.  The helpers that lanes of one wave talk through:

* ``vf_shfl_xor(v, m)`` / ``vf_shfl_xor_i``: lane l gets lane l ^ m's value (f32 / i32);
* ``vf_wave_sum(v)`` / ``vf_wave_max(v)``: every lane gets the wave's sum / max;
* ``vf_wave_sync()``: LDS written by lanes of the wave before it is read safely after it;
* ``vf_block_sum`` / ``vf_block_max`` / ``vf_block_argmax``: the same over the workgroup, through LDS
  (``_i``: of i32 values, through the int scratch).
"""
from __future__ import annotations

from .env import switch
from .targets import Target

_DEFINES = r"""#define VF_WAVE {wave}
#define VF_BLOCK {block}
#define VF_WAVES (VF_BLOCK / VF_WAVE)
#define VF_ATT_BLOCK {att}
#define VF_ATT_WAVES (VF_ATT_BLOCK / VF_WAVE)
#define VF_UNROLL_K _Pragma("unroll {unroll}")
"""

_COMMON = r"""// max and min as numpy computes them: NaN when either operand is NaN (fmaxf and fminf drop it)
__device__ __forceinline__ float vf_max(float a, float b) {{ return a != a || b != b ? a + b : fmaxf(a, b); }}
__device__ __forceinline__ float vf_min(float a, float b) {{ return a != a || b != b ? a + b : fminf(a, b); }}
__device__ __forceinline__ float vf_wave_max(float v) {{
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v = vf_max(v, vf_shfl_xor(v, m));
  return v;
}}
// block-wide reductions through LDS (every thread gets the result)
// (each wave's partial goes through LDS; then every wave folds the partials, one a lane: VF_WAVES <= VF_WAVE)
__device__ __forceinline__ float vf_block_sum(float v, float* red) {{
  v = vf_wave_sum(v);
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) red[threadIdx.x / VF_WAVE] = v;
  __syncthreads();
  return vf_wave_sum(threadIdx.x % VF_WAVE < VF_WAVES ? red[threadIdx.x % VF_WAVE] : 0.0f);
}}
// one step of a thread's argmax, its indices k growing: a larger value wins, and the first NaN while
// the best is none (NaN is the largest value, as in numpy); v is computed once, by the caller
__device__ __forceinline__ void vf_argmax_step(float v, int k, float* best, int* arg) {{
  if (!(v <= *best) && *best == *best) {{ *best = v; *arg = k; }}
}}
__device__ __forceinline__ void vf_argmax_step_i(int v, int k, int* best, int* arg) {{
  if (v > *best) {{ *best = v; *arg = k; }}
}}
// argmax over the block: does (ov, oi) win against (v, i)?  NaN is the largest value, as in numpy;
// ties go to the smaller index
__device__ __forceinline__ bool vf_argmax_better(float ov, int oi, float v, int i) {{
  const bool onan = ov != ov, nan = v != v;
  return onan != nan ? onan : (onan || ov == v) ? oi < i : ov > v;
}}
__device__ __forceinline__ void vf_wave_argmax(float* v, int* i) {{
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) {{
    const float ov = vf_shfl_xor(*v, m);
    const int oi = vf_shfl_xor_i(*i, m);
    if (vf_argmax_better(ov, oi, *v, *i)) {{ *v = ov; *i = oi; }}
  }}
}}
__device__ __forceinline__ void vf_block_argmax(float* v, int* i, float* red, int* redi) {{
  vf_wave_argmax(v, i);
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) {{ red[threadIdx.x / VF_WAVE] = *v; redi[threadIdx.x / VF_WAVE] = *i; }}
  __syncthreads();
  const int w = threadIdx.x % VF_WAVE;              // the lanes past the waves hold -inf at the last index
  *v = w < VF_WAVES ? red[w] : -VF_INF;
  *i = w < VF_WAVES ? redi[w] : 2147483647;
  vf_wave_argmax(v, i);
}}
// i32 reductions over the block (a count, an integer max or argmax): the same through the int scratch
// red, 2 x VF_WAVES ints (an argmax keeps each wave's index in the second half)
__device__ __forceinline__ int vf_block_sum_i(int v, int* red) {{
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v += vf_shfl_xor_i(v, m);
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) red[threadIdx.x / VF_WAVE] = v;
  __syncthreads();
  v = threadIdx.x % VF_WAVE < VF_WAVES ? red[threadIdx.x % VF_WAVE] : 0;
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v += vf_shfl_xor_i(v, m);
  return v;
}}
__device__ __forceinline__ int vf_block_max_i(int v, int* red) {{
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v = max(v, vf_shfl_xor_i(v, m));
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) red[threadIdx.x / VF_WAVE] = v;
  __syncthreads();
  v = threadIdx.x % VF_WAVE < VF_WAVES ? red[threadIdx.x % VF_WAVE] : -2147483647 - 1;
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v = max(v, vf_shfl_xor_i(v, m));
  return v;
}}
__device__ __forceinline__ void vf_wave_argmax_i(int* v, int* i) {{
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) {{
    const int ov = vf_shfl_xor_i(*v, m), oi = vf_shfl_xor_i(*i, m);
    if (ov > *v || (ov == *v && oi < *i)) {{ *v = ov; *i = oi; }}
  }}
}}
__device__ __forceinline__ void vf_block_argmax_i(int* v, int* i, int* red) {{
  vf_wave_argmax_i(v, i);
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) {{ red[threadIdx.x / VF_WAVE] = *v; red[VF_WAVES + threadIdx.x / VF_WAVE] = *i; }}
  __syncthreads();
  const int w = threadIdx.x % VF_WAVE;
  *v = w < VF_WAVES ? red[w] : -2147483647 - 1;
  *i = w < VF_WAVES ? red[VF_WAVES + w] : 2147483647;
  vf_wave_argmax_i(v, i);
}}
__device__ __forceinline__ float vf_block_max(float v, float* red) {{
  v = vf_wave_max(v);
  __syncthreads();
  if (threadIdx.x % VF_WAVE == 0) red[threadIdx.x / VF_WAVE] = v;
  __syncthreads();
  return vf_wave_max(threadIdx.x % VF_WAVE < VF_WAVES ? red[threadIdx.x % VF_WAVE] : -VF_INF);
}}
"""

_AMD = r"""// target {name}: AMD, wave{wave}, v_dot2_f32_f16 {dot2}
typedef _Float16 vf_half;
typedef _Float16 vf_half2 __attribute__((ext_vector_type(2)));
typedef _Float16 vf_half8 __attribute__((ext_vector_type(8)));
typedef float vf_float4 __attribute__((ext_vector_type(4)));
#define VF_INF __builtin_inff()
__device__ __forceinline__ float vf_h2f(vf_half x) {{ return (float)x; }}
__device__ __forceinline__ vf_half vf_f2h(float x) {{ return (vf_half)x; }}
__device__ __forceinline__ float vf_shfl_xor(float v, int m) {{ return __shfl_xor(v, m, VF_WAVE); }}
__device__ __forceinline__ int vf_shfl_xor_i(int v, int m) {{ return __shfl_xor(v, m, VF_WAVE); }}
// v from another lane through DPP (no LDS): ctrl 0xB1 / 0x4E swap lanes 1 / 2 apart in each quad, 0x141
// mirrors each 8 lanes, 0x140 each row of 16, 0x142 / 0x143 broadcast lane 15 / 31 to the rows in row_mask
#define VF_DPP(v, ctrl, row_mask) __int_as_float(__builtin_amdgcn_update_dpp(0, __float_as_int(v), ctrl, row_mask, 0xF, false))
// the sum over each group of n lanes (n a power of two), held by the group's last lane: butterflies
// inside a row of 16, then row broadcasts (every lane holds it for n <= 16)
__device__ __forceinline__ float vf_lanes_sum(float v, int n) {{
  if (n > 1) v += VF_DPP(v, 0xB1, 0xF);
  if (n > 2) v += VF_DPP(v, 0x4E, 0xF);
  if (n > 4) v += VF_DPP(v, 0x141, 0xF);
  if (n > 8) v += VF_DPP(v, 0x140, 0xF);
  if (n > 16) v += VF_DPP(v, 0x142, 0xA);          // rows 1 and 3 add lane 15 of rows 0 and 2
  if (n > 32) v += VF_DPP(v, 0x143, 0xC);          // rows 2 and 3 add lane 31: lane 63 has all 64
  return v;
}}
// every lane gets the wave's sum: DPP, then the last lane's value read into a scalar register
__device__ __forceinline__ float vf_wave_sum(float v) {{
  return __int_as_float(__builtin_amdgcn_readlane(__float_as_int(vf_lanes_sum(v, VF_WAVE)), VF_WAVE - 1));
}}
// vf_wave_sync(): the LDS writes of every lane of this wave before it are seen by every lane after it
// (a wave runs in lockstep: a wave-scope fence keeps the compiler and the LDS queue in order)
__device__ __forceinline__ void vf_wave_sync() {{
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}}
#define VF_GRID_LAUNCH_DEPENDENTS()
#define VF_GRID_WAIT()
"""

_AMD_DOT2 = r"""// the activation lives in LDS as f16 pairs; one v_dot2_f32_f16 per pair
typedef vf_half vf_act_t;
__device__ __forceinline__ vf_act_t vf_to_act(float x) { return (vf_half)x; }
__device__ __forceinline__ float vf_from_act(vf_act_t x) { return (float)x; }
__device__ __forceinline__ float vf_dot8_h(float acc, const vf_half* __restrict__ w, const vf_act_t* a) {
  const vf_half8 wv = *(const vf_half8*)w;          // one 16-byte global load
  const vf_half8 av = *(const vf_half8*)a;          // one 16-byte LDS read
  acc = __builtin_amdgcn_fdot2(av.s01, wv.s01, acc, false);
  acc = __builtin_amdgcn_fdot2(av.s23, wv.s23, acc, false);
  acc = __builtin_amdgcn_fdot2(av.s45, wv.s45, acc, false);
  acc = __builtin_amdgcn_fdot2(av.s67, wv.s67, acc, false);
  return acc;
}
__device__ __forceinline__ float vf_dot4_f(float acc, const float* __restrict__ w, const vf_act_t* a) {
  const vf_float4 wv = *(const vf_float4*)w;
  for (int i = 0; i < 4; ++i) acc += (float)a[i] * wv[i];
  return acc;
}
"""

_AMD_F32ACT = r"""typedef float vf_act_t;
__device__ __forceinline__ vf_act_t vf_to_act(float x) { return x; }
__device__ __forceinline__ float vf_from_act(vf_act_t x) { return x; }
__device__ __forceinline__ float vf_dot8_h(float acc, const vf_half* __restrict__ w, const vf_act_t* a) {
  const vf_half8 wv = *(const vf_half8*)w;
  for (int i = 0; i < 8; ++i) acc += a[i] * (float)wv[i];
  return acc;
}
__device__ __forceinline__ float vf_dot4_f(float acc, const float* __restrict__ w, const vf_act_t* a) {
  const vf_float4 wv = *(const vf_float4*)w;
  for (int i = 0; i < 4; ++i) acc += a[i] * wv[i];
  return acc;
}
// n floats of a buffer (n a multiple of 4), copied into LDS by the workgroup's threads 16 bytes at a time
__device__ __forceinline__ void vf_copy_f32(float* dst, const float* __restrict__ src, int n) {
  #pragma unroll 8
  for (int i = threadIdx.x; i < n / 4; i += VF_BLOCK) ((vf_float4*)dst)[i] = ((const vf_float4*)src)[i];
}
"""

_NVIDIA = r"""// target {name}: NVIDIA, {how}
#include <cuda_fp16.h>
typedef __half vf_half;
#define VF_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float vf_h2f(vf_half x) {{ return __half2float(x); }}
__device__ __forceinline__ vf_half vf_f2h(float x) {{ return __float2half(x); }}
{wave}{pdl}"""

_NV_WARP = r"""__device__ __forceinline__ float vf_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int vf_shfl_xor_i(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
// vf_wave_sync(): the LDS writes of every lane of this wave (warp) before it are seen by every lane after it
__device__ __forceinline__ void vf_wave_sync() { __syncwarp(); }
"""

# gfx906's 64-lane wave on 32-lane warps: every helper that lets lanes of one wave talk to each other
_NV_WAVE64 = r"""// A wave is 64 lanes made of two warps: wave w = threadIdx.x / 64 is warps 2w (lanes 0-31) and 2w+1
// (lanes 32-63).  Inside a warp lanes exchange by shuffles; across the two warps through LDS, ordered by
// a named barrier that only the wave's 64 threads wait on: id 1 + w (id 0 is __syncthreads, so at most
// 15 waves per workgroup).  Like a wave on gfx906, all 64 lanes must call every helper below together.
#define VF_XCHG_SLOTS {slots}   // threads of the largest workgroup: one exchange slot each
static_assert(VF_BLOCK / VF_WAVE <= 15 && VF_ATT_BLOCK / VF_WAVE <= 15, "at most 15 waves per workgroup");
// vf_wave_sync(): the LDS writes of every lane of this wave before it are seen by every lane after it
__device__ __forceinline__ void vf_wave_sync() {{
  asm volatile("barrier.sync %0, 64;" :: "r"(1 + (int)(threadIdx.x / VF_WAVE)) : "memory");
}}
// vf_shfl_xor_bits(v, m): lane l gets lane (l ^ m)'s v, for 0 < m < 64: a warp shuffle when m < 32, else
// each lane leaves v in its LDS slot, the wave syncs, reads its partner's slot and syncs again (so that
// the next exchange may overwrite the slot)
__device__ __forceinline__ int vf_shfl_xor_bits(int v, int m) {{
  if (m < 32) return __shfl_xor_sync(0xffffffffu, v, m);
  __shared__ int vf_xchg[VF_XCHG_SLOTS];
  vf_xchg[threadIdx.x] = v;
  vf_wave_sync();
  const int other = vf_xchg[threadIdx.x ^ m];
  vf_wave_sync();
  return other;
}}
__device__ __forceinline__ float vf_shfl_xor(float v, int m) {{ return __int_as_float(vf_shfl_xor_bits(__float_as_int(v), m)); }}
__device__ __forceinline__ int vf_shfl_xor_i(int v, int m) {{ return vf_shfl_xor_bits(v, m); }}
"""

_NVIDIA_F32ACT = r"""typedef float vf_act_t;
__device__ __forceinline__ vf_act_t vf_to_act(float x) { return x; }
__device__ __forceinline__ float vf_from_act(vf_act_t x) { return x; }
__device__ __forceinline__ float vf_dot8_h(float acc, const vf_half* __restrict__ w, const vf_act_t* a) {
  const uint4 raw = *(const uint4*)w;               // one 16-byte global load
  const __half2* h = (const __half2*)&raw;
  const float4 a0 = *(const float4*)a, a1 = *(const float4*)(a + 4);
  float2 f;
  f = __half22float2(h[0]); acc = fmaf(a0.x, f.x, acc); acc = fmaf(a0.y, f.y, acc);
  f = __half22float2(h[1]); acc = fmaf(a0.z, f.x, acc); acc = fmaf(a0.w, f.y, acc);
  f = __half22float2(h[2]); acc = fmaf(a1.x, f.x, acc); acc = fmaf(a1.y, f.y, acc);
  f = __half22float2(h[3]); acc = fmaf(a1.z, f.x, acc); acc = fmaf(a1.w, f.y, acc);
  return acc;
}
__device__ __forceinline__ float vf_dot4_f(float acc, const float* __restrict__ w, const vf_act_t* a) {
  const float4 wv = *(const float4*)w, av = *(const float4*)a;
  return fmaf(av.x, wv.x, fmaf(av.y, wv.y, fmaf(av.z, wv.z, fmaf(av.w, wv.w, acc))));
}
// n floats of a buffer (n a multiple of 4), copied into LDS by the workgroup's threads 16 bytes at a time
__device__ __forceinline__ void vf_copy_f32(float* dst, const float* __restrict__ src, int n) {
  #pragma unroll 8
  for (int i = threadIdx.x; i < n / 4; i += VF_BLOCK) ((float4*)dst)[i] = ((const float4*)src)[i];
}
"""

_NVIDIA_F16ACT = r"""// the activation is too long for LDS in f32: it lives there as f16
typedef __half vf_act_t;
__device__ __forceinline__ vf_act_t vf_to_act(float x) { return __float2half(x); }
__device__ __forceinline__ float vf_from_act(vf_act_t x) { return __half2float(x); }
__device__ __forceinline__ float vf_dot8_h(float acc, const vf_half* __restrict__ w, const vf_act_t* a) {
  const uint4 wr = *(const uint4*)w, ar = *(const uint4*)a;
  const __half2* wh = (const __half2*)&wr;
  const __half2* ah = (const __half2*)&ar;
  for (int i = 0; i < 4; ++i) {
    const float2 fw = __half22float2(wh[i]), fa = __half22float2(ah[i]);
    acc = fmaf(fa.x, fw.x, acc); acc = fmaf(fa.y, fw.y, acc);
  }
  return acc;
}
__device__ __forceinline__ float vf_dot4_f(float acc, const float* __restrict__ w, const vf_act_t* a) {
  const float4 wv = *(const float4*)w;
  return fmaf(__half2float(a[0]), wv.x, fmaf(__half2float(a[1]), wv.y,
              fmaf(__half2float(a[2]), wv.z, fmaf(__half2float(a[3]), wv.w, acc))));
}
"""

# the tiled matmul (codegen/mma.py): vf_mma_tile(acc, a, as, b, bs, kc) adds A[16 x kc] * B[16 x kc]^T (f16 rows
# in LDS, strides as / bs halves) into the calling wave's 16 x 16 fragment, VF_FRAG = 256 / VF_WAVE elements
# per lane; the lane's element i sits at (vf_frag_row(i), vf_frag_col(i)) of the fragment.  vf_load8 loads 8
# weight elements (one 16-byte load of f16, two of f32) as 8 halves (vf_h8), vf_store8 puts them in LDS.
_MMA_AMD = r"""// tiled matmul fragments (gfx906, no matrix cores): lane l owns row l % 16, columns l / 16 * 4 .. + 3;
// 16-byte LDS reads (a row's 8 halves: 8 consecutive rows of 80 bytes meet no bank twice; the 16 lanes of
// a column read one address) and v_dot2_f32_f16
#define VF_FRAG 4
__device__ __forceinline__ int vf_frag_row(int i) { return threadIdx.x % 16; }
__device__ __forceinline__ int vf_frag_col(int i) { return threadIdx.x % 64 / 16 * 4 + i; }
__device__ __forceinline__ void vf_mma_tile(float* acc, const vf_half* a, int as, const vf_half* b, int bs, int kc) {
  const vf_half* ar = a + vf_frag_row(0) * as;
  const vf_half* br = b + vf_frag_col(0) * bs;
  #pragma unroll
  for (int k = 0; k < kc; k += 8) {
    const vf_half8 av = *(const vf_half8*)(ar + k);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const vf_half8 bv = *(const vf_half8*)(br + i * bs + k);
      float c = __builtin_amdgcn_fdot2(av.s01, bv.s01, acc[i], false);
      c = __builtin_amdgcn_fdot2(av.s23, bv.s23, c, false);
      c = __builtin_amdgcn_fdot2(av.s45, bv.s45, c, false);
      acc[i] = __builtin_amdgcn_fdot2(av.s67, bv.s67, c, false);
    }
  }
}
typedef vf_half8 vf_h8;
__device__ __forceinline__ vf_h8 vf_load8(const vf_half* __restrict__ w) { return *(const vf_half8*)w; }
__device__ __forceinline__ vf_h8 vf_load8(const float* __restrict__ w) {
  const vf_float4 lo = *(const vf_float4*)w, hi = *(const vf_float4*)(w + 4);
  vf_half8 h;
  h.s0 = (vf_half)lo.x; h.s1 = (vf_half)lo.y; h.s2 = (vf_half)lo.z; h.s3 = (vf_half)lo.w;
  h.s4 = (vf_half)hi.x; h.s5 = (vf_half)hi.y; h.s6 = (vf_half)hi.z; h.s7 = (vf_half)hi.w;
  return h;
}
__device__ __forceinline__ void vf_store8(vf_half* dst, vf_h8 v) { *(vf_half8*)dst = v; }
// 8 consecutive activation values as floats (16-byte loads), and 8 floats as halves
__device__ __forceinline__ void vf_load8f(float* v, const float* __restrict__ p) {
  const vf_float4 lo = *(const vf_float4*)p, hi = *(const vf_float4*)(p + 4);
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}
__device__ __forceinline__ void vf_load8f(float* v, const vf_half* __restrict__ p) {
  const vf_half8 h = *(const vf_half8*)p;
  v[0] = h.s0; v[1] = h.s1; v[2] = h.s2; v[3] = h.s3; v[4] = h.s4; v[5] = h.s5; v[6] = h.s6; v[7] = h.s7;
}
__device__ __forceinline__ vf_h8 vf_pack8(const float* v) {
  vf_half8 h;
  h.s0 = (vf_half)v[0]; h.s1 = (vf_half)v[1]; h.s2 = (vf_half)v[2]; h.s3 = (vf_half)v[3];
  h.s4 = (vf_half)v[4]; h.s5 = (vf_half)v[5]; h.s6 = (vf_half)v[6]; h.s7 = (vf_half)v[7];
  return h;
}
"""

_MMA_NV = r"""// tiled matmul fragments on tensor cores: mma.sync m16n8k16 (f16 x f16 -> f32), {how}
#define VF_FRAG {frag}
// mma.sync's C layout: lane g * 4 + t of a warp holds rows g and g + 8, columns 2t and 2t + 1 of an n8 half
__device__ __forceinline__ int vf_frag_row(int i) {{ return threadIdx.x % 32 / 4 + (i & 2) * 4; }}
__device__ __forceinline__ int vf_frag_col(int i) {{ return {col}threadIdx.x % 4 * 2 + (i & 1); }}
// c[4] += A[16 x 16] * B[8 x 16]^T: a[4] is A's fragment (rows g, g + 8 x k 2t, 2t + 1, then k + 8), b0 / b1
// B's (its row g, k 2t, 2t + 1 and k + 8)
__device__ __forceinline__ void vf_mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {{
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}}
{loads}__device__ __forceinline__ void vf_mma_tile(float* acc, const vf_half* a, int as, const vf_half* b, int bs, int kc) {{
  const int l = threadIdx.x % 32;
  #pragma unroll
  for (int k = 0; k < kc; k += 16) {{
{body}  }}
}}
typedef uint4 vf_h8;
__device__ __forceinline__ vf_h8 vf_load8(const vf_half* __restrict__ w) {{ return *(const uint4*)w; }}
__device__ __forceinline__ vf_h8 vf_load8(const float* __restrict__ w) {{
  const float4 lo = *(const float4*)w, hi = *(const float4*)(w + 4);
  const __half2 h[4] = {{__floats2half2_rn(lo.x, lo.y), __floats2half2_rn(lo.z, lo.w), __floats2half2_rn(hi.x, hi.y),
                        __floats2half2_rn(hi.z, hi.w)}};
  vf_h8 v;
  v.x = *(const unsigned*)&h[0]; v.y = *(const unsigned*)&h[1]; v.z = *(const unsigned*)&h[2]; v.w = *(const unsigned*)&h[3];
  return v;
}}
__device__ __forceinline__ void vf_store8(vf_half* dst, vf_h8 v) {{ *(uint4*)dst = v; }}
// 8 consecutive activation values as floats (16-byte loads), and 8 floats as halves
__device__ __forceinline__ void vf_load8f(float* v, const float* __restrict__ p) {{
  const float4 lo = *(const float4*)p, hi = *(const float4*)(p + 4);
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}}
__device__ __forceinline__ void vf_load8f(float* v, const vf_half* __restrict__ p) {{
  const uint4 raw = *(const uint4*)p;
  const __half2* h = (const __half2*)&raw;
  for (int i = 0; i < 4; ++i) {{ const float2 f = __half22float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }}
}}
__device__ __forceinline__ vf_h8 vf_pack8(const float* v) {{
  vf_h8 r;
  const __half2 h0 = __floats2half2_rn(v[0], v[1]), h1 = __floats2half2_rn(v[2], v[3]);
  const __half2 h2 = __floats2half2_rn(v[4], v[5]), h3 = __floats2half2_rn(v[6], v[7]);
  r.x = *(const unsigned*)&h0; r.y = *(const unsigned*)&h1; r.z = *(const unsigned*)&h2; r.w = *(const unsigned*)&h3;
  return r;
}}
"""
# the fragments from LDS: ldmatrix (one instruction per 8 x 8 matrices, lane 8 * matrix + row addressing a
# 16-byte row), or 4-byte loads where VEGAFUSE_MMA_LDMATRIX=0
_LDSM = r"""// ldmatrix: 4 (2) 8 x 8 matrices of halves, row r of matrix m addressed by lane 8 m + r (16 bytes), element
// (row, 2w, 2w + 1) of matrix m in r[m] of lane 4 row + w: the mma fragments' layout
__device__ __forceinline__ void vf_ldsm4(unsigned* r, const vf_half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
}
__device__ __forceinline__ void vf_ldsm2(unsigned* r, const vf_half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
}
"""
_LD32 = r"""// the fragments by 4-byte LDS loads: a[4] rows g, g + 8 of A at k 2t (and + 8); b[2] row g of B at k 2t (and + 8)
__device__ __forceinline__ void vf_frag_a(unsigned* r, const vf_half* a, int as) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  r[0] = *(const unsigned*)(a + g * as + 2 * t); r[1] = *(const unsigned*)(a + (g + 8) * as + 2 * t);
  r[2] = *(const unsigned*)(a + g * as + 8 + 2 * t); r[3] = *(const unsigned*)(a + (g + 8) * as + 8 + 2 * t);
}
__device__ __forceinline__ void vf_frag_b(unsigned* r, const vf_half* b, int bs) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  r[0] = *(const unsigned*)(b + g * bs + 2 * t); r[1] = *(const unsigned*)(b + g * bs + 8 + 2 * t);
}
"""
# A: lane l addresses row l % 16 at k (l / 16) * 8 (matrices: rows 0-7 k 0-7, rows 8-15, then k 8-15)
_A_LDSM = "    unsigned fa[4], fb[4];\n    vf_ldsm4(fa, a + (l % 16) * as + k + l / 16 * 8);\n"
_A_LD32 = "    unsigned fa[4], fb[4];\n    vf_frag_a(fa, a + k, as);\n"
_MMA_NV32 = dict(how="a warp computes both n8 halves of a 16 x 16 fragment", frag=8, col="(i & 4) * 2 + ", body={
    # B: matrices n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15: lane l at n l % 8 + l / 16 * 8, k l / 8 % 2 * 8
    True: _A_LDSM + "    vf_ldsm4(fb, b + (l % 8 + l / 16 * 8) * bs + k + l / 8 % 2 * 8);\n"
          "    vf_mma16816(acc, fa, fb[0], fb[1]);\n    vf_mma16816(acc + 4, fa, fb[2], fb[3]);\n",
    False: _A_LD32 + "    vf_frag_b(fb, b + k, bs);\n    vf_frag_b(fb + 2, b + 8 * bs + k, bs);\n"
           "    vf_mma16816(acc, fa, fb[0], fb[1]);\n    vf_mma16816(acc + 4, fa, fb[2], fb[3]);\n"})
_MMA_NV64 = dict(how="a 64-lane wave is two warps, each computing one n8 half", frag=4,
                 col="threadIdx.x % 64 / 32 * 8 + ", body={
    # B: this warp's n8 half h, matrices k 0-7 and 8-15: lane l at n h * 8 + l % 8, k l / 8 % 2 * 8
    True: _A_LDSM + "    vf_ldsm2(fb, b + (threadIdx.x % 64 / 32 * 8 + l % 8) * bs + k + l / 8 % 2 * 8);\n"
          "    vf_mma16816(acc, fa, fb[0], fb[1]);\n",
    False: _A_LD32 + "    vf_frag_b(fb, b + threadIdx.x % 64 / 32 * 8 * bs + k, bs);\n    vf_mma16816(acc, fa, fb[0], fb[1]);\n"})


def ldmatrix() -> bool:
    """NVIDIA fragments loaded by ldmatrix; ``VEGAFUSE_MMA_LDMATRIX=0``: by 4-byte LDS loads (A/B)."""
    return switch("VEGAFUSE_MMA_LDMATRIX", True)


def _mma_nv(t: Target) -> str:
    """The NVIDIA fragment helpers for ``t``'s wave width."""
    table, ldsm = (_MMA_NV64 if t.emulated_wave else _MMA_NV32), ldmatrix()
    return _MMA_NV.format(how=table["how"], frag=table["frag"], col=table["col"], body=table["body"][ldsm],
                          loads=_LDSM if ldsm else _LD32)


def act_dtype(t: Target, K: int) -> str:
    """The dtype of a GEMV's activation in LDS: f16 where the target has fp16 dot products
    (v_dot2_f32_f16), or where K f32 values would not fit the static LDS limit."""
    return "f16" if t.dot2 or 4 * K > t.max_static_lds - 1024 else "f32"


_DEQUANT = r"""// quantized weights (dsl/quant.py): every block's quants, then every block's f16 scales (nb blocks)
typedef unsigned char vf_byte;
// element i of a quantized weight: its block's scale times its quant
__device__ __forceinline__ float vf_dequant_q4_0(const vf_byte* __restrict__ w, int i, int nb) {
  const int b = i / 32, j = i % 32;
  const int q = (w[16 * b + j % 16] >> (j / 16 * 4)) & 15;        // low nibbles: elements 0..15, high: 16..31
  return vf_h2f(((const vf_half*)(w + 16 * nb))[b]) * (float)(q - 8);
}
__device__ __forceinline__ float vf_dequant_q4_1(const vf_byte* __restrict__ w, int i, int nb) {
  const int b = i / 32, j = i % 32;
  const int q = (w[16 * b + j % 16] >> (j / 16 * 4)) & 15;
  const vf_half* dm = (const vf_half*)(w + 16 * nb) + 2 * b;      // d, m
  return vf_h2f(dm[0]) * (float)q + vf_h2f(dm[1]);
}
__device__ __forceinline__ float vf_dequant_gptq_int4(const vf_byte* __restrict__ w, int i, int nb) {
  const int b = i / 32, j = i % 32;
  const int q = (w[16 * b + j % 16] >> (j / 16 * 4)) & 15;
  const vf_half* dz = (const vf_half*)(w + 16 * nb) + 2 * b;      // d, z (the zero point)
  return vf_h2f(dz[0]) * ((float)q - vf_h2f(dz[1]));
}
__device__ __forceinline__ float vf_dequant_q8_0(const vf_byte* __restrict__ w, int i, int nb) {
  return vf_h2f(((const vf_half*)(w + 32 * nb))[i / 32]) * (float)(signed char)w[i];
}
"""

_DEQUANT8F = r"""// 8 consecutive elements i .. i + 7 of a quantized weight (i a multiple of 8) as floats: one 8-byte load of
// quants (q4: bytes 0-7 or 8-15 of the block, low nibbles for elements 0-15, high for 16-31) and the block's scales
struct vf_f8 { float v[8]; };
__device__ __forceinline__ unsigned long long vf_q4_nibbles8(const vf_byte* __restrict__ w, int i) {
  const int b = i / 32, p = i % 32 / 8;
  return *(const unsigned long long*)(w + 16 * b + 8 * (p % 2)) >> (p / 2 * 4);
}
__device__ __forceinline__ vf_f8 vf_dequant8f_q4_0(const vf_byte* __restrict__ w, int i, int nb) {
  const unsigned long long q = vf_q4_nibbles8(w, i);
  const float d = vf_h2f(((const vf_half*)(w + 16 * nb))[i / 32]);
  vf_f8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = d * (float)((int)(q >> 8 * j & 15) - 8);
  return r;
}
__device__ __forceinline__ vf_f8 vf_dequant8f_q4_1(const vf_byte* __restrict__ w, int i, int nb) {
  const unsigned long long q = vf_q4_nibbles8(w, i);
  const vf_half* dm = (const vf_half*)(w + 16 * nb) + 2 * (i / 32);
  const float d = vf_h2f(dm[0]), m = vf_h2f(dm[1]);
  vf_f8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = d * (float)(int)(q >> 8 * j & 15) + m;
  return r;
}
__device__ __forceinline__ vf_f8 vf_dequant8f_gptq_int4(const vf_byte* __restrict__ w, int i, int nb) {
  const unsigned long long q = vf_q4_nibbles8(w, i);
  const vf_half* dz = (const vf_half*)(w + 16 * nb) + 2 * (i / 32);
  const float d = vf_h2f(dz[0]), z = vf_h2f(dz[1]);
  vf_f8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = d * ((float)(int)(q >> 8 * j & 15) - z);
  return r;
}
__device__ __forceinline__ vf_f8 vf_dequant8f_q8_0(const vf_byte* __restrict__ w, int i, int nb) {
  const unsigned long long q = *(const unsigned long long*)(w + i);
  const float d = vf_h2f(((const vf_half*)(w + 32 * nb))[i / 32]);
  vf_f8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = d * (float)(signed char)(q >> 8 * j & 255);
  return r;
}
"""
# the float GEMV over quantized weights (VEGAFUSE_QUANT_ACT=float): 8 dequantized weights times 8 activations
# from LDS; where the activation is f16 on gfx906, the weights rounded to f16 pairs and v_dot2_f32_f16
_DOT8_W = r"""__device__ __forceinline__ float vf_dot8_w(float acc, vf_f8 w, const vf_act_t* a) {
  for (int i = 0; i < 8; ++i) acc = fmaf(vf_from_act(a[i]), w.v[i], acc);
  return acc;
}
"""
_DOT8_W_DOT2 = r"""__device__ __forceinline__ float vf_dot8_w(float acc, vf_f8 w, const vf_act_t* a) {
  const vf_half8 av = *(const vf_half8*)a;          // one 16-byte LDS read
  vf_half8 wv;
  for (int i = 0; i < 8; ++i) wv[i] = (vf_half)w.v[i];
  acc = __builtin_amdgcn_fdot2(av.s01, wv.s01, acc, false);
  acc = __builtin_amdgcn_fdot2(av.s23, wv.s23, acc, false);
  acc = __builtin_amdgcn_fdot2(av.s45, wv.s45, acc, false);
  return __builtin_amdgcn_fdot2(av.s67, wv.s67, acc, false);
}
"""
# the same elements as halves, for the tiled matmul's weight tiles
_DEQUANT8 = "".join(f"__device__ __forceinline__ vf_h8 vf_dequant8_{f}(const vf_byte* __restrict__ w, int i, int nb) {{ "
                    f"return vf_pack8(vf_dequant8f_{f}(w, i, nb).v); }}\n" for f in ("q4_0", "q4_1", "gptq_int4", "q8_0"))


_QUANT = r"""{activation}{stored}// the 32 nibbles n of a q4 block (one 16-byte load): element j of nibble word i is byte j of
// (w[i] & 0x0F0F0F0F), element 16 + j of ((w[i] >> 4) & 0x0F0F0F0F)
__device__ __forceinline__ int vf_dot_q4_q8(vf_int4 w, const vf_q8_1& a) {{
  const int n[8] = {{w.x & 0x0F0F0F0F, w.y & 0x0F0F0F0F, w.z & 0x0F0F0F0F, w.w & 0x0F0F0F0F,
                    (w.x >> 4) & 0x0F0F0F0F, (w.y >> 4) & 0x0F0F0F0F, (w.z >> 4) & 0x0F0F0F0F, (w.w >> 4) & 0x0F0F0F0F}};
  return vf_dot_q8(n, a);
}}
// weight block b (of nb) with activation block a (x_j = a.d v_j, v_j its integers): sum_j d (n_j - 8) x_j = d (a.d sum_j n_j v_j - 8 a.s)
__device__ __forceinline__ float vf_dot_q4_0(const vf_byte* __restrict__ w, int b, int nb, const vf_q8_1& a) {{
  const vf_int4 q = vf_load_quants(w + 16 * b);
  const float d = vf_h2f(((const vf_half*)(w + 16 * nb))[b]);
  return d * (a.d * (float)vf_dot_q4_q8(q, a) - 8.0f * a.s);
}}
// sum_j (d n_j + m) x_j = d a.d sum_j n_j v_j + m a.s
__device__ __forceinline__ float vf_dot_q4_1(const vf_byte* __restrict__ w, int b, int nb, const vf_q8_1& a) {{
  const vf_int4 q = vf_load_quants(w + 16 * b);
  const vf_half* dm = (const vf_half*)(w + 16 * nb) + 2 * b;
  return vf_h2f(dm[0]) * a.d * (float)vf_dot_q4_q8(q, a) + vf_h2f(dm[1]) * a.s;
}}
// sum_j d (n_j - z) x_j = d (a.d sum_j n_j (128 q_j + r_j) - z a.s)
__device__ __forceinline__ float vf_dot_gptq_int4(const vf_byte* __restrict__ w, int b, int nb, const vf_q8_1& a) {{
  const vf_int4 q = vf_load_quants(w + 16 * b);
  const vf_half* dz = (const vf_half*)(w + 16 * nb) + 2 * b;
  return vf_h2f(dz[0]) * (a.d * (float)vf_dot_q4_q8(q, a) - vf_h2f(dz[1]) * a.s);
}}
__device__ __forceinline__ float vf_dot_q8_0(const vf_byte* __restrict__ w, int b, int nb, const vf_q8_1& a) {{
  const vf_int4 w0 = vf_load_quants(w + 32 * b), w1 = vf_load_quants(w + 32 * b + 16);
  const int n[8] = {{w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w}};
  return vf_h2f(((const vf_half*)(w + 32 * nb))[b]) * a.d * (float)vf_dot_q8(n, a);
}}
"""

_OVER_STEP = r"""// the 8 consecutive lanes of a block, 4 values each: the block's step = max|x| / 127 (NaN when a value
// is NaN), and t = x / step for this lane's values, as x * (127 / max|x|): one division per block;
// divided when max|x| is tiny (or NaN), where 127 / max|x| may overflow
__device__ __forceinline__ float vf_block_step(float x0, float x1, float x2, float x3,
                                               float& t0, float& t1, float& t2, float& t3) {
  const float amax = vf_max8(vf_max(vf_max(fabsf(x0), fabsf(x1)), vf_max(fabsf(x2), fabsf(x3))));
  const float step = amax / 127.0f;
  if (amax >= 1e-30f) {
    const float inv = 127.0f / amax;
    t0 = x0 * inv; t1 = x1 * inv; t2 = x2 * inv; t3 = x3 * inv;
  } else {
    t0 = step != 0.0f ? x0 / step : 0.0f; t1 = step != 0.0f ? x1 / step : 0.0f;
    t2 = step != 0.0f ? x2 / step : 0.0f; t3 = step != 0.0f ? x3 / step : 0.0f;
  }
  return step;
}
"""

_Q8_1R = r"""// a q8_1 activation block with a residual plane: 32 values x_j = d * (128 q_j + r_j), q_j = round(x_j / step)
// with step = max|x| / 127, and r_j = round(128 (x_j / step - q_j)) in [-64, 64] (so |error| <= step / 256,
// about f16's precision); int8 quants 4 per int (element 4i in the low byte of q[i] and r[i]),
// d = step / 128 and s = d * sum(128 q + r)
struct vf_q8_1 { int q[8]; int r[8]; float d, s; };
__device__ __forceinline__ int vf_pack4(int a, int b, int c, int d) {
  return (a & 255) | (b & 255) << 8 | (c & 255) << 16 | (int)((unsigned)d << 24);
}
// the 8 consecutive lanes of a block quantize it together, 4 values each (group g: elements 4g..4g+3);
// the step is NaN when a value is NaN; a lane with active false only helps
__device__ __forceinline__ void vf_quantize_q8_1(vf_q8_1* a, int g, float x0, float x1, float x2, float x3, bool active) {
  float t0, t1, t2, t3;
  const float step = vf_block_step(x0, x1, x2, x3, t0, t1, t2, t3);
  const int q0 = (int)roundf(t0), q1 = (int)roundf(t1), q2 = (int)roundf(t2), q3 = (int)roundf(t3);
  const int r0 = (int)roundf((t0 - q0) * 128.0f), r1 = (int)roundf((t1 - q1) * 128.0f);
  const int r2 = (int)roundf((t2 - q2) * 128.0f), r3 = (int)roundf((t3 - q3) * 128.0f);
  const int sum = vf_sum8(128 * (q0 + q1 + q2 + q3) + r0 + r1 + r2 + r3);
  if (active) {
    a[g / 8].q[g % 8] = vf_pack4(q0, q1, q2, q3);
    a[g / 8].r[g % 8] = vf_pack4(r0, r1, r2, r3);
    if (g % 8 == 0) { a[g / 8].d = step * 0.0078125f; a[g / 8].s = step * 0.0078125f * (float)sum; }
  }
}
// element i of q8_1 blocks with a residual plane (a producer's, read as floats): d * (128 q + r)
__device__ __forceinline__ float vf_dequant_q8_1r(const vf_q8_1* __restrict__ a, int i, int nb) {
  const vf_q8_1& b = a[i / 32];
  const int j = i % 32, shift = 8 * (j % 4);
  return b.d * (float)(128 * (int)(signed char)(b.q[j / 4] >> shift) + (int)(signed char)(b.r[j / 4] >> shift));
}
// sum_j n_j (128 q_j + r_j) over a block's 32 weight integers n (4 per int, as the quants)
__device__ __forceinline__ int vf_dot_q8(const int* n, const vf_q8_1& a) {
  int q = 0, r = 0;
  for (int i = 0; i < 8; ++i) { q = vf_dot4_i8(n[i], a.q[i], q); r = vf_dot4_i8(n[i], a.r[i], r); }
  return 128 * q + r;
}
"""

_Q8_1 = r"""// a q8_1 activation block: 32 values x_j = d q_j, q_j = round(x_j / d) with d = max|x| / 127; int8 quants
// 4 per int (element 4i in the low byte of q[i]) and s = d * sum(q)
struct vf_q8_1 { int q[8]; float d, s; };
// the 8 consecutive lanes of a block quantize it together, 4 values each (group g: elements 4g..4g+3);
// d is NaN when a value is NaN; a lane with active false only helps
__device__ __forceinline__ void vf_quantize_q8_1(vf_q8_1* a, int g, float x0, float x1, float x2, float x3, bool active) {
  float t0, t1, t2, t3;
  const float d = vf_block_step(x0, x1, x2, x3, t0, t1, t2, t3);
  const int q0 = (int)roundf(t0), q1 = (int)roundf(t1), q2 = (int)roundf(t2), q3 = (int)roundf(t3);
  const int sum = vf_sum8(q0 + q1 + q2 + q3);
  if (active) {
    a[g / 8].q[g % 8] = (q0 & 255) | (q1 & 255) << 8 | (q2 & 255) << 16 | (int)((unsigned)q3 << 24);
    if (g % 8 == 0) { a[g / 8].d = d; a[g / 8].s = d * (float)sum; }
  }
}
// element i of q8_1 blocks (a producer's, read as floats): d q
__device__ __forceinline__ float vf_dequant_q8_1(const vf_q8_1* __restrict__ a, int i, int nb) {
  const vf_q8_1& b = a[i / 32];
  return b.d * (float)(int)(signed char)(b.q[i % 32 / 4] >> (8 * (i % 4)));
}
// sum_j n_j q_j over a block's 32 weight integers n (4 per int, as the quants)
__device__ __forceinline__ int vf_dot_q8(const int* n, const vf_q8_1& a) {
  int q = 0;
  for (int i = 0; i < 8; ++i) q = vf_dot4_i8(n[i], a.q[i], q);
  return q;
}
"""

_STORED = r"""// a GEMV activation quantized once, by the kernel that stores it (fusion/q8.py):
// the q8_1 blocks of the n values x (n / 32 blocks) that a GEMV's workgroups store, trip j of workgroup b storing
// x[first + (b + j gridDim.x) rows .. + rows) (clipped to [0, n)); every thread of the workgroup runs it after its
// last store.  For a normalizing consumer the blocks are of x * g, and each block's sum of x * x goes to ss[block];
// the overloads without g and ss quantize x as it is (g and ss null: those branches fold away when inlined).
// 4 values of x at i, 8 threads a block, every thread of the wave taking part (active false: it only helps)
__device__ __forceinline__ void vf_quantize4(const float* __restrict__ g, vf_q8_1* __restrict__ q,
                                             float* __restrict__ ss, int i, const float* v, bool active) {
  if (ss) {
    const float sum_sq = vf_sum8(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]);
    if (active && i % 32 == 0) ss[i / 32] = sum_sq;
  }
  if (!g) {
    vf_quantize_q8_1(q, i / 4, v[0], v[1], v[2], v[3], active);
    return;
  }
  const float* w = g + (active ? i : 0);
  vf_quantize_q8_1(q, i / 4, v[0] * w[0], v[1] * w[1], v[2] * w[2], v[3] * w[3], active);
}
// by arrivals: the workgroup adds the values each trip stored to their blocks' arrival counts, and quantizes the
// blocks it completes (one its trip stored whole at once); the one that completes a block sets its count back
// to zero for the next launch.  done: LDS for trips * per_trip block numbers
__device__ __forceinline__ void vf_quantize_stored(const float* x, const float* __restrict__ g, vf_q8_1* __restrict__ q,
                                                   float* __restrict__ ss, unsigned int* count, int n, int first,
                                                   int rows, int trips, int per_trip, int* done) {
  __threadfence();                       // this thread's stores reach the device before the counts below
  __syncthreads();
  const int slots = trips * per_trip;
  for (int i = threadIdx.x; i < slots; i += VF_BLOCK) {
    const int r = first + ((int)blockIdx.x + i / per_trip * (int)gridDim.x) * rows;
    const int lo = max(r, 0), hi = min(r + rows, n), b = lo / 32 + i % per_trip;
    const int mine = min(hi, 32 * b + 32) - max(lo, 32 * b);          // the values of block b this trip stored
    bool complete = mine == 32;
    if (mine > 0 && mine < 32 && atomicAdd(count + b, (unsigned int)mine) + mine == 32) {
      atomicExch(count + b, 0u);
      complete = true;
    }
    done[i] = complete ? b : -1;
  }
  __syncthreads();
  __threadfence();                       // the values other workgroups stored are seen after it
  for (int t = threadIdx.x; t < (8 * slots + VF_BLOCK - 1) / VF_BLOCK * VF_BLOCK; t += VF_BLOCK) {
    const int b = done[min(t / 8, slots - 1)];
    const bool active = t < 8 * slots && b >= 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (active) vf_load_stored4(x + 32 * b + 4 * (t % 8), v);
    vf_quantize4(g, q, ss, 32 * max(b, 0) + 4 * (t % 8), v, active);
  }
}
__device__ __forceinline__ void vf_quantize_stored(const float* x, vf_q8_1* __restrict__ q, unsigned int* count, int n,
                                                   int first, int rows, int trips, int per_trip, int* done) {
  vf_quantize_stored(x, nullptr, q, nullptr, count, n, first, rows, trips, per_trip, done);
}
// the same when every trip stores whole blocks (rows and first multiples of 32): the workgroup quantizes the
// blocks it stored itself, once the barrier has made its threads' stores seen by all of them; no arrivals
__device__ __forceinline__ void vf_quantize_own(const float* x, const float* __restrict__ g, vf_q8_1* __restrict__ q,
                                                float* __restrict__ ss, int n, int first, int rows, int trips) {
  __syncthreads();
  const int groups = trips * rows / 4;   // 4 values a thread, 8 threads a block
  for (int t = threadIdx.x; t < (groups + VF_BLOCK - 1) / VF_BLOCK * VF_BLOCK; t += VF_BLOCK) {
    const int r = first + ((int)blockIdx.x + t / (rows / 4) * (int)gridDim.x) * rows + 4 * (t % (rows / 4));
    const bool active = t < groups && r >= 0 && r < n;                 // the same for a block's 8 threads
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (active) vf_load_stored4(x + r, v);
    vf_quantize4(g, q, ss, max(r, 0), v, active);
  }
}
__device__ __forceinline__ void vf_quantize_own(const float* x, vf_q8_1* __restrict__ q, int n, int first, int rows,
                                                int trips) {
  vf_quantize_own(x, nullptr, q, nullptr, n, first, rows, trips);
}
// the same from the LDS array the workgroup's trips also stored their values in, trip after trip (rows each):
// no second read of global memory
__device__ __forceinline__ void vf_quantize_staged(const float* stage, const float* __restrict__ g,
                                                   vf_q8_1* __restrict__ q, float* __restrict__ ss, int n, int first,
                                                   int rows, int trips) {
  __syncthreads();
  const int groups = trips * rows / 4;
  for (int t = threadIdx.x; t < (groups + VF_BLOCK - 1) / VF_BLOCK * VF_BLOCK; t += VF_BLOCK) {
    const int r = first + ((int)blockIdx.x + t / (rows / 4) * (int)gridDim.x) * rows + 4 * (t % (rows / 4));
    const bool active = t < groups && r >= 0 && r < n;
    vf_quantize4(g, q, ss, max(r, 0), stage + 4 * min(t, groups - 1), active);
  }
}
__device__ __forceinline__ void vf_quantize_staged(const float* stage, vf_q8_1* __restrict__ q, int n, int first,
                                                   int rows, int trips) {
  vf_quantize_staged(stage, nullptr, q, nullptr, n, first, rows, trips);
}
// the n q8_1 blocks that an earlier kernel wrote, copied into LDS by the threads of the workgroup 16 bytes at
// a time (both arrays 16-byte aligned; an odd count of blocks leaves 8 bytes, copied by thread 0)
__device__ __forceinline__ void vf_copy_q8_1(vf_q8_1* dst, const vf_q8_1* __restrict__ src, int n) {
  const int bytes = n * (int)sizeof(vf_q8_1);
  #pragma unroll 8
  for (int i = threadIdx.x; i < bytes / 16; i += VF_BLOCK) ((vf_int4*)dst)[i] = ((const vf_int4*)src)[i];
  if (bytes % 16 && threadIdx.x == 0) ((long long*)dst)[bytes / 8 - 1] = ((const long long*)src)[bytes / 8 - 1];
}
"""

_AMD_INT8 = r"""typedef int vf_int4 __attribute__((ext_vector_type(4)));
// 16 bytes of a weight block's integers (global_load_dwordx4)
__device__ __forceinline__ vf_int4 vf_load_quants(const void* p) { return *(const vf_int4*)p; }
// c + the dot product of the 4 signed bytes of a and b: v_dot4_i32_i8
__device__ __forceinline__ int vf_dot4_i8(int a, int b, int c) { return __builtin_amdgcn_sdot4(a, b, c, false); }
// the max / sum over each 8 consecutive lanes, held by all of them (DPP: no LDS)
#define VF_DPP_I(v, ctrl, row_mask) __builtin_amdgcn_update_dpp(0, v, ctrl, row_mask, 0xF, false)
__device__ __forceinline__ float vf_max8(float v) {
  v = vf_max(v, VF_DPP(v, 0xB1, 0xF));
  v = vf_max(v, VF_DPP(v, 0x4E, 0xF));
  return vf_max(v, VF_DPP(v, 0x141, 0xF));
}
__device__ __forceinline__ int vf_sum8(int v) {
  v += VF_DPP_I(v, 0xB1, 0xF);
  v += VF_DPP_I(v, 0x4E, 0xF);
  return v + VF_DPP_I(v, 0x141, 0xF);
}
__device__ __forceinline__ float vf_sum8(float v) {
  v += VF_DPP(v, 0xB1, 0xF);
  v += VF_DPP(v, 0x4E, 0xF);
  return v + VF_DPP(v, 0x141, 0xF);
}
// 4 floats other workgroups of this launch stored, after a __threadfence (it invalidated this CU's cache)
__device__ __forceinline__ void vf_load_stored4(const float* p, float* v) {
  const vf_float4 x = *(const vf_float4*)p;
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}
"""

# 16 bytes of a weight block's integers.  Through __ldg on NVIDIA: Qwen2.5-7B q4_0 decode on an H200 ran at
# 424.6/424.5 tok/s against 399.5 with a plain load (A/B/A, 2026-12-01); in the SASS the only change is
# that the block scales are then loaded by LDG.E.U16 rather than LDG.E.U16.CONSTANT.
# VEGAFUSE_NV_LDG=0 gives the plain load back.
_NV_LOAD_QUANTS = {True: "__device__ __forceinline__ vf_int4 vf_load_quants(const void* p) { return __ldg((const int4*)p); }\n",
                   False: "__device__ __forceinline__ vf_int4 vf_load_quants(const void* p) { return *(const vf_int4*)p; }\n"}

_NV_INT8 = r"""typedef int4 vf_int4;
// c + the dot product of the 4 signed bytes of a and b: dp4a
__device__ __forceinline__ int vf_dot4_i8(int a, int b, int c) { return __dp4a(a, b, c); }
// the max / sum over each 8 consecutive lanes, held by all of them
__device__ __forceinline__ float vf_max8(float v) {
  for (int m = 1; m < 8; m <<= 1) v = vf_max(v, vf_shfl_xor(v, m));
  return v;
}
__device__ __forceinline__ int vf_sum8(int v) {
  for (int m = 1; m < 8; m <<= 1) v += vf_shfl_xor_i(v, m);
  return v;
}
__device__ __forceinline__ float vf_sum8(float v) {
  for (int m = 1; m < 8; m <<= 1) v += vf_shfl_xor(v, m);
  return v;
}
// 4 floats other workgroups of this launch stored: read from L2, past this SM's L1
__device__ __forceinline__ void vf_load_stored4(const float* p, float* v) {
  const float4 x = __ldcg((const float4*)p);
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}
// the sum over each group of n lanes (n a power of two), held by the group's last lane (here: by all)
__device__ __forceinline__ float vf_lanes_sum(float v, int n) {
  for (int m = n / 2; m > 0; m >>= 1) v += vf_shfl_xor(v, m);
  return v;
}
"""


_NV_WAVE_SUM = r"""// every lane gets the wave's sum
__device__ __forceinline__ float vf_wave_sum(float v) {
  for (int m = VF_WAVE / 2; m > 0; m >>= 1) v += vf_shfl_xor(v, m);
  return v;
}
"""

_NV_PDL = r"""// programmatic dependent launch: this kernel's workgroups may start while the previous kernel runs;
// VF_GRID_WAIT() waits until that kernel has ended and its stores are seen; the next kernel may start once
// every workgroup of this one has passed VF_GRID_LAUNCH_DEPENDENTS() (placed after the wait, so that at most
// one kernel waits) or ended
{trigger}
#define VF_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
// before the wait: this workgroup's share of the first n bytes of a weight, asked of L2 in one bulk prefetch
// (whole 16-byte units inside the buffer; the weights do not depend on the previous kernel)
__device__ __forceinline__ void vf_prefetch_l2(const void* p, unsigned long long n) {
  if (threadIdx.x != 0) return;
  // whole 16-byte units per workgroup, so that on a 16-byte aligned buffer the shares tile the n bytes
  const unsigned long long share = ((n + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
  const unsigned long long base = (unsigned long long)p;
  const unsigned long long lo = (base + blockIdx.x * share + 15) & ~15ull;
  const unsigned long long end = base + (blockIdx.x + 1) * share, hi = (end < base + n ? end : base + n) & ~15ull;
  if (hi > lo) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(lo), "r"((unsigned)(hi - lo)) : "memory");
}
"""


def _nv_pdl(t) -> str:
    """The programmatic-dependent-launch macros of an NVIDIA target (empty without ``t.pdl``)."""
    if not t.pdl:
        return _NV_NO_PDL
    trigger = ('#define VF_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")'
               if t.pdl_trigger == "wait" else
               "#define VF_GRID_LAUNCH_DEPENDENTS()   // the next kernel starts as this one's workgroups end")
    return _NV_PDL.replace("{trigger}", trigger)


_NV_NO_PDL = r"""#define VF_GRID_LAUNCH_DEPENDENTS()
#define VF_GRID_WAIT()
"""


_ATTENTION = r"""// attention (codegen/attention.py): the max / sum over each group of n consecutive lanes (n a power of two, at
// most the wave), held by every lane of the group; every lane of the wave calls it
__device__ __forceinline__ float vf_group_max(float v, int n) {
  for (int m = n / 2; m > 0; m >>= 1) v = fmaxf(v, vf_shfl_xor(v, m));
  return v;
}
__device__ __forceinline__ float vf_group_sum(float v, int n) {
  for (int m = n / 2; m > 0; m >>= 1) v += vf_shfl_xor(v, m);
  return v;
}
"""

_ARRIVE = r"""// the last of n workgroups to arrive at *count (zero before the first) gets true and sets it back to zero
// for the next launch; the global writes of every workgroup before its arrival are seen by the last one
// after it (each thread fences its own writes, thread 0 counts, the last workgroup fences again)
__device__ __forceinline__ bool vf_last_to_arrive(unsigned int* count, int n, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(count, 1u) == (unsigned int)(n - 1);
    if (last) atomicExch(count, 0u);
    *flag = last;
  }
  __syncthreads();
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}
"""

_ATTENTION += _ARRIVE                      # the splits of a decode attention combine by arrival

_GRID_POLL = {
    "nvidia": r"""// a counter in device memory read with acquire semantics at the GPU's scope; nothing to do between polls
// (a 100 ns __nanosleep there measured the same)
__device__ __forceinline__ unsigned int vf_load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#define VF_POLL_PAUSE()
""",
    "amd": r"""// a counter in device memory read with acquire semantics (from L2); the wave sleeps briefly between polls
__device__ __forceinline__ unsigned int vf_load_acquire(const unsigned int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
#define VF_POLL_PAUSE() __builtin_amdgcn_s_sleep(1)
"""}

_GRID_BARRIER = r"""// a persistent kernel's grid barrier (every workgroup resident): the n-th barrier of a launch returns once
// all gridDim.x workgroups have arrived at it, and every thread's global writes before it are seen by every
// thread after it (the workgroup's writes meet at __syncthreads; thread 0 fences them, counts, polls with
// acquire loads and fences again before the workgroup goes on)
// (`quiet`, unless null, is 1 meanwhile: a ring's producer pauses)
__device__ __forceinline__ void vf_grid_barrier(unsigned int* arrived, unsigned int n, volatile unsigned int* quiet = 0) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (quiet) *quiet = 1;
    __threadfence();
    atomicAdd(arrived, 1u);
    while (vf_load_acquire(arrived) < n * gridDim.x) VF_POLL_PAUSE();
    __threadfence();
    if (quiet) *quiet = 0;
  }
  __syncthreads();
}
// after the last barrier: the last workgroup to leave sets the count back to zero for the next launch
__device__ __forceinline__ void vf_grid_leave(unsigned int* arrived, unsigned int* left) {
  if (threadIdx.x == 0 && atomicAdd(left, 1u) == gridDim.x - 1) {
    atomicExch(arrived, 0u);
    atomicExch(left, 0u);
  }
}
"""


_RING_NV = r"""// the ring's barriers and copies (sm_90): an mbarrier a slot in LDS, completed by arrivals and by the bytes
// of the bulk copy (cp.async.bulk) it waits for
__device__ __forceinline__ unsigned int vf_lds_address(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void vf_mbar_init(unsigned long long* b, unsigned int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(vf_lds_address(b)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void vf_mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(vf_lds_address(b)) : "memory");
}
__device__ __forceinline__ void vf_mbar_wait(unsigned long long* b, unsigned int parity) {
  unsigned int done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(vf_lds_address(b)), "r"(parity) : "memory");
  } while (!done);
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into LDS; completes b
__device__ __forceinline__ void vf_bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(vf_lds_address(b)), "r"(bytes) : "memory");
{copy}
}
// every thread of the workgroup, the producer warp too (the consumers' barrier is a named one)
__device__ __forceinline__ void vf_all_threads_sync() { asm volatile("bar.sync 0;" ::: "memory"); }
__device__ __forceinline__ void vf_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
"""

RING = r"""// a persistent kernel's ring (codegen/ring.py): its GEMV phases' weights stream through `slots` LDS slots of
// `slot_bytes`, chunk c in slot c % slots, copied in by the producer warp ahead of the consumers (the
// workgroup's other threads); a slot's full barrier completes when its chunk has landed, its empty one when
// every consumer warp is done with it.
// With `quiet`, the producer issues nothing while the consumers wait at a grid barrier, so that the barrier's add
// and polls cross an idle memory system (the consumers are done with their phase's chunks then: none waits for
// a chunk the pause holds back).
struct vf_ring_t {
  unsigned char* data;
  unsigned long long* full;
  unsigned long long* empty;
  unsigned int slots, slot_bytes;
  volatile unsigned int* quiet;                     // null: the producer never pauses
};
__device__ __forceinline__ vf_ring_t vf_ring_start(unsigned char* data, unsigned long long* bars, unsigned int slots,
                                                  unsigned int slot_bytes, volatile unsigned int* quiet) {
  const vf_ring_t r = {data, bars, bars + slots, slots, slot_bytes, quiet};
  if (threadIdx.x == 0) {
    if (quiet) *quiet = 0;
    for (unsigned int i = 0; i < slots; ++i) {
      vf_mbar_init(&r.full[i], 1);                  // the producer's arrival, with its copy's bytes
      vf_mbar_init(&r.empty[i], VF_BLOCK / 32);     // each consumer warp's
    }
    vf_mbar_init_fence();
  }
  vf_all_threads_sync();
  return r;
}
// the producer: `slots` rows' chunks of KC columns (K in all) from src (chunk by chunk, each row-major), each
// into the next slot once it is free, at most `flight` of them in flight (more only lengthen the queue every
// latency-bound load of the phases waits in); returns the next chunk's number
__device__ __forceinline__ unsigned int vf_ring_produce(const vf_ring_t r, unsigned int c, const vf_half* src, int slots,
                                                       int K, int KC, unsigned int flight) {
  for (int j = 0; j < K; j += KC, ++c) {
    const unsigned int slot = c % r.slots, bytes = 2u * slots * min(KC, K - j);
    if (c >= r.slots) vf_mbar_wait(&r.empty[slot], (c / r.slots - 1) & 1);
    if (flight < r.slots && c >= flight)
      vf_mbar_wait(&r.full[(c - flight) % r.slots], ((c - flight) / r.slots) & 1);
    if (r.quiet)
      while (*r.quiet) VF_POLL_PAUSE();
    vf_bulk_copy(r.data + slot * r.slot_bytes, src, bytes, &r.full[slot]);
    src += bytes / 2;
  }
  return c;
}
// the consumers: a block's `slots` rows of K columns dotted with act, their chunks of KC columns from the ring;
// thread t sums columns 8 (t % CG) .. 8 (t % CG) + 7 of each chunk for rows t / CG + i (VF_BLOCK / CG), i < RPT,
// in registers; then the W = min(CG, 32) lanes of a warp on a row add theirs, and row s's CG / W partial sums
// end in sums[s CG / W ...]; returns the next chunk's number
template <int K, int KC, int CG, int RPT>
__device__ __forceinline__ unsigned int vf_ring_dot(const vf_ring_t r, unsigned int c, const vf_act_t* act, float* sums,
                                                   int slots) {
  constexpr int RG = VF_BLOCK / CG;                 // rows side by side
  const int col = threadIdx.x % CG * 8, rg = threadIdx.x / CG;
  float acc[RPT];
  #pragma unroll
  for (int i = 0; i < RPT; ++i) acc[i] = 0.0f;
  for (int j = 0; j < K; j += KC, ++c) {
    const unsigned int slot = c % r.slots;
    const int kc = min(KC, K - j);
    vf_mbar_wait(&r.full[slot], (c / r.slots) & 1);
    const vf_half* w = (const vf_half*)(r.data + slot * r.slot_bytes);
    if (col < kc) {
      #pragma unroll
      for (int i = 0; i < RPT; ++i)
        if (rg + i * RG < slots) acc[i] = vf_dot8_h(acc[i], w + (rg + i * RG) * kc + col, act + j + col);
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) vf_mbar_arrive(&r.empty[slot]);
  }
  constexpr int W = CG < 32 ? CG : 32;
  #pragma unroll
  for (int i = 0; i < RPT; ++i) {
    float v = acc[i];
    #pragma unroll
    for (int o = W / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (rg + i * RG < slots && threadIdx.x % W == 0) sums[(rg + i * RG) * (CG / W) + threadIdx.x % CG / W] = v;
  }
  return c;
}
"""


_COPY = {False: r"""  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(vf_lds_address(dst)), "l"(src), "r"(bytes), "r"(vf_lds_address(b)) : "memory");""",
         True: r"""  // read once a step: first out of L2, so that what the phases' chains read there (activations, norms'
  // gains, biases, the KV cache) stays
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               :: "r"(vf_lds_address(dst)), "l"(src), "r"(bytes), "r"(vf_lds_address(b)), "l"(policy) : "memory");"""}


def ring(t, evict_first: bool = False) -> str:
    """The ring's helpers (``codegen/ring.py``): NVIDIA's barriers and bulk copies, then the producer's and
    the consumers' loops; with ``evict_first``, the copies mark the weights' lines first to leave L2.
    Raises ValueError for a target without bulk copies."""
    if t.vendor != "nvidia":
        raise ValueError(f"{t.name}: the persistent kernel's ring needs bulk copies into LDS (sm_90)")
    return _RING_NV.replace("{copy}", _COPY[evict_first]) + RING


def grid_barrier(t) -> str:
    """The prelude's grid barrier of a persistent kernel for ``t`` (its poll is the vendor's)."""
    return _GRID_POLL[t.vendor] + _GRID_BARRIER


_AMD_ATTENTION = r"""typedef unsigned int vf_vec16 __attribute__((ext_vector_type(4)));    // 16 bytes: global_load_dwordx4
__device__ __forceinline__ vf_vec16 vf_zero16() { return (vf_vec16)(0u); }
// acc + 8 query values (f32, LDS) times 8 f16 keys (one 16-byte LDS read), or 4 values times 4 f32 keys
__device__ __forceinline__ float vf_dot_qk(float acc, const float* q, const vf_half* k) {
  const vf_half8 kv = *(const vf_half8*)k;
  const vf_float4 q0 = *(const vf_float4*)q, q1 = *(const vf_float4*)(q + 4);
  acc += q0.x * (float)kv.s0 + q0.y * (float)kv.s1 + q0.z * (float)kv.s2 + q0.w * (float)kv.s3;
  return acc + q1.x * (float)kv.s4 + q1.y * (float)kv.s5 + q1.z * (float)kv.s6 + q1.w * (float)kv.s7;
}
__device__ __forceinline__ float vf_dot_qk(float acc, const float* q, const float* k) {
  const vf_float4 kv = *(const vf_float4*)k, qv = *(const vf_float4*)q;
  return acc + qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
}
// a value other workgroups wrote before vf_last_to_arrive (its fence invalidated this CU's cache)
__device__ __forceinline__ float vf_load_arrived(const float* p) { return *p; }
__device__ __forceinline__ vf_float4 vf_load_arrived4(const float* p) { return *(const vf_float4*)p; }
// the 8 f16 (or 4 f32) values of a 16-byte load as floats
__device__ __forceinline__ void vf_unpack_f16(vf_vec16 v, float* f) {
  const vf_half8 h = __builtin_bit_cast(vf_half8, v);
  for (int i = 0; i < 8; ++i) f[i] = (float)h[i];
}
__device__ __forceinline__ void vf_unpack_f32(vf_vec16 v, float* f) {
  const vf_float4 x = __builtin_bit_cast(vf_float4, v);
  f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
}
// 4 consecutive f16 (one 8-byte LDS read) or f32 values (16 bytes) as floats
__device__ __forceinline__ void vf_lds4(const vf_half* p, float* f) {
  typedef _Float16 vf_half4 __attribute__((ext_vector_type(4)));
  const vf_half4 h = *(const vf_half4*)p;
  f[0] = (float)h.x; f[1] = (float)h.y; f[2] = (float)h.z; f[3] = (float)h.w;
}
__device__ __forceinline__ void vf_lds4(const float* p, float* f) {
  const vf_float4 x = *(const vf_float4*)p;
  f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
}
"""

_NV_ATTENTION = r"""typedef uint4 vf_vec16;                                                 // 16 bytes: one vector load
typedef float4 vf_float4;
__device__ __forceinline__ vf_vec16 vf_zero16() { vf_vec16 z; z.x = z.y = z.z = z.w = 0u; return z; }
// acc + 8 query values (f32, LDS) times 8 f16 keys (one 16-byte LDS read), or 4 values times 4 f32 keys
__device__ __forceinline__ float vf_dot_qk(float acc, const float* q, const vf_half* k) {
  const uint4 raw = *(const uint4*)k;
  const __half2* h = (const __half2*)&raw;
  const float4 q0 = *(const float4*)q, q1 = *(const float4*)(q + 4);
  float2 f;
  f = __half22float2(h[0]); acc = fmaf(q0.x, f.x, acc); acc = fmaf(q0.y, f.y, acc);
  f = __half22float2(h[1]); acc = fmaf(q0.z, f.x, acc); acc = fmaf(q0.w, f.y, acc);
  f = __half22float2(h[2]); acc = fmaf(q1.x, f.x, acc); acc = fmaf(q1.y, f.y, acc);
  f = __half22float2(h[3]); acc = fmaf(q1.z, f.x, acc); return fmaf(q1.w, f.y, acc);
}
__device__ __forceinline__ float vf_dot_qk(float acc, const float* q, const float* k) {
  const float4 kv = *(const float4*)k, qv = *(const float4*)q;
  return fmaf(qv.w, kv.w, fmaf(qv.z, kv.z, fmaf(qv.y, kv.y, fmaf(qv.x, kv.x, acc))));
}
// a value other workgroups wrote before vf_last_to_arrive: read from L2, past this SM's L1
__device__ __forceinline__ float vf_load_arrived(const float* p) { return __ldcg(p); }
__device__ __forceinline__ vf_float4 vf_load_arrived4(const float* p) { return __ldcg((const float4*)p); }
// the 8 f16 (or 4 f32) values of a 16-byte load as floats
__device__ __forceinline__ void vf_unpack_f16(vf_vec16 v, float* f) {
  const __half2* h = (const __half2*)&v;
  for (int i = 0; i < 4; ++i) { const float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
}
__device__ __forceinline__ void vf_unpack_f32(vf_vec16 v, float* f) {
  f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
// 4 consecutive f16 (one 8-byte shared-memory read) or f32 values (16 bytes) as floats
__device__ __forceinline__ void vf_lds4(const vf_half* p, float* f) {
  const uint2 raw = *(const uint2*)p;
  const float2 a = __half22float2(*(const __half2*)&raw.x), b = __half22float2(*(const __half2*)&raw.y);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}
__device__ __forceinline__ void vf_lds4(const float* p, float* f) {
  const float4 x = *(const float4*)p;
  f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
}
"""


def _nv_how(t: Target) -> str:
    return f"wave{t.wave} emulated by {t.wave // 32} warps" if t.emulated_wave else f"warp{t.wave}"


def _nv_wave(t: Target) -> str:
    """The wave helpers of an NVIDIA target: native warp shuffles at wave 32, or the emulated 64-lane wave.
    Raises ValueError for any other width or for a workgroup of more than 15 emulated waves."""
    if not t.emulated_wave:
        if t.wave != 32:
            raise ValueError(f"target {t.name}: NVIDIA warps have 32 lanes, not {t.wave}; "
                             "use emulated_wave=True (e.g. target 'sm_90_wave64') for a 64-lane wave")
        return _NV_WARP
    waves = max(t.block, t.attention_block) // t.wave
    if t.wave != 64 or waves > 15:
        raise ValueError(f"target {t.name}: an emulated wave has 64 lanes and a workgroup at most 15 waves "
                         f"(got wave {t.wave}, {waves} waves); lower block or attention_block")
    return _NV_WAVE64.format(slots=max(t.block, t.attention_block))


def nv_int8() -> str:
    """The int8 GEMV's NVIDIA helpers (``VEGAFUSE_NV_LDG=0``: quant blocks by a plain load)."""
    return _NV_INT8 + _NV_LOAD_QUANTS[switch("VEGAFUSE_NV_LDG", True)]


def prelude(t: Target, act: str | None = None, quant: bool = False, attention: bool = False, mma: bool = False,
            q8: str | None = None, arrive: bool = False) -> str:
    """Everything target-specific in a kernel's source, from the target table
    (``act``: the GEMV activation dtype in LDS, see ``act_dtype``; ``quant``: the kernel reads
    quantized weights, so the helpers that read them are included; ``attention``: the helpers of
    the attention template; ``mma``: the tiled matmul's fragment helpers; ``q8``: the dtype of q8_1
    buffers the kernel reads or writes, "q8_1r" or "q8_1", when its own activation is not one;
    ``arrive``: the last-to-arrive count of a reduction split over workgroups, which attention has too)."""
    act, int8 = (act_dtype(t, 0), act) if act in (None, "q8_1", "q8_1r") else (act, q8)
    if t.vendor == "amd":
        head = _AMD.format(name=t.name, wave=t.wave, dot2="on" if t.dot2 else "off")
        head += _AMD_DOT2 if act == "f16" else _AMD_F32ACT
    else:
        head = _NVIDIA.format(name=t.name, how=_nv_how(t), wave=_nv_wave(t),
                              pdl=_nv_pdl(t)) + _NV_WAVE_SUM
        head += _NVIDIA_F16ACT if act == "f16" else _NVIDIA_F32ACT
    activation = _OVER_STEP + (_Q8_1 if int8 == "q8_1" else _Q8_1R)   # the int8 GEMV's activation blocks
    dot8 = _DOT8_W_DOT2 if t.vendor == "amd" and act == "f16" else _DOT8_W
    tail = ((_AMD_INT8 if t.vendor == "amd" else nv_int8()) + _DEQUANT + _DEQUANT8F + dot8
            + _QUANT.format(activation=activation, stored=_STORED)) if quant else ""
    if attention:
        tail += (_AMD_ATTENTION if t.vendor == "amd" else _NV_ATTENTION) + _ATTENTION
    elif arrive:
        tail += _ARRIVE
    if mma:
        tail += (_MMA_AMD if t.vendor == "amd" else _mma_nv(t)) + (_DEQUANT8 if quant else "")
    return _DEFINES.format(wave=t.wave, block=t.block, att=t.attention_block, unroll=t.unroll) + head + _COMMON.format() + tail
