// Shared by layers.cu and ring.cu (examples/persistent_probe/run.py puts it in front of each):
// Qwen2.5-1.5B's decode layer shapes, f16 weights, f32 activations, a KV cache of 32 positions.
#include <cuda_fp16.h>
#ifndef THREADS
#define THREADS 512
#endif
#ifndef BARRIER
#define BARRIER 1           // 0: phases do not wait for each other (wrong answers; what the streaming costs alone)
#endif
#define WARPS (THREADS / 32)
#define HID 1536            // hidden size
#define NQKV 2048           // q, k and v rows: 12 + 2 + 2 heads of 128
#define FF 8960             // MLP width
#define NH 12               // query heads
#define NKV 2               // KV heads
#define HD 128              // head dim
#ifndef POS
#define POS 32              // cached positions (run.py --positions; the attention of layers.cu and ring.cu needs 32)
#endif
#define VH (HID / 8)        // uint4 a hidden-wide row: 192 = 32 lanes x 6
#define VF (FF / 8)         // uint4 a down row: 1120 = 32 lanes x 35

struct Params {
  const uint4 *wqkv, *wo, *wg, *wu, *wd;  // [L][N][K] f16, as uint4
  const half *kv;                          // [L][2][NKV][POS][HD]
  float *x, *q, *a, *h, *m;
  unsigned *count;
  int layers;
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float dot8(uint4 w, const float *x) {
  float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
  float2 w0 = __half22float2(*(__half2 *)&w.x), w1 = __half22float2(*(__half2 *)&w.y);
  float2 w2 = __half22float2(*(__half2 *)&w.z), w3 = __half22float2(*(__half2 *)&w.w);
  return w0.x * a.x + w0.y * a.y + w1.x * a.z + w1.y * a.w + w2.x * b.x + w2.y * b.y + w3.x * b.z + w3.y * b.w;
}

// rows [lo, hi) of a phase with n rows for block b of g
__device__ __forceinline__ int lo_row(int n) { return (int)(((long long)n * blockIdx.x) / gridDim.x); }
__device__ __forceinline__ int hi_row(int n) { return (int)(((long long)n * (blockIdx.x + 1)) / gridDim.x); }

// first chunk of a hidden-width row (6 uint4 a lane)
__device__ __forceinline__ void load6(uint4 *v, const uint4 *row, int lane) {
#pragma unroll
  for (int i = 0; i < 6; ++i) v[i] = __ldg(row + i * 32 + lane);
}

__device__ __forceinline__ float dot6(const uint4 *v, const float *xs, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 6; ++i) acc += dot8(v[i], xs + 8 * (i * 32 + lane));
  return acc;
}

// one warp a query head over 32 positions; a lane holds 4 of the head's 128 dimensions
__device__ void attention(const Params &p, int l, int warps = WARPS) {
  int lane = threadIdx.x & 31, hd = blockIdx.x * warps + (threadIdx.x >> 5);
  if (hd >= NH) return;
  int kvh = hd / (NH / NKV);
  const uint2 *k = (const uint2 *)(p.kv + (((size_t)l * 2 + 0) * NKV + kvh) * POS * HD);
  const uint2 *v = (const uint2 *)(p.kv + (((size_t)l * 2 + 1) * NKV + kvh) * POS * HD);
  float4 q = __ldcg((const float4 *)(p.q + hd * HD) + lane);
  float s = 0.f;
#pragma unroll
  for (int half_ = 0; half_ < 2; ++half_) {
    uint2 kr[POS / 2];
#pragma unroll
    for (int j = 0; j < POS / 2; ++j) kr[j] = __ldg(k + (half_ * POS / 2 + j) * (HD / 4) + lane);
#pragma unroll
    for (int j = 0; j < POS / 2; ++j) {
      float2 a = __half22float2(*(__half2 *)&kr[j].x), b = __half22float2(*(__half2 *)&kr[j].y);
      float d = warp_sum(q.x * a.x + q.y * a.y + q.z * b.x + q.w * b.y);
      if (lane == half_ * POS / 2 + j) s = d * 0.08838834764831845f;
    }
  }
  float mx = s;
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float e = __expf(s - mx), pr = e / warp_sum(e);
  float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < POS; ++j) {
    float pj = __shfl_sync(0xffffffffu, pr, j);
    uint2 vj = __ldg(v + j * (HD / 4) + lane);
    float2 a = __half22float2(*(__half2 *)&vj.x), b = __half22float2(*(__half2 *)&vj.y);
    o4.x += pj * a.x; o4.y += pj * a.y; o4.z += pj * b.x; o4.w += pj * b.y;
  }
  ((float4 *)(p.a + hd * HD))[lane] = o4;
}

