// A stack of decode layers as one persistent kernel: the grid moves from phase to phase (QKV,
// attention, O, gate/up, down) on a counter every workgroup raises and waits on.  Each phase gives a
// workgroup a contiguous slice of its rows, a warp a row (or a gate/up pair) at a time.
//   PREFETCH=1  between raising the counter and waiting on it, a warp loads its first row of the next
//               phase into registers
//   SKIP=mask   leave out the GEMV of phases 1 QKV, 2 attention, 4 O, 8 gate/up, 16 down (timing only)
//   BPS         workgroups per SM (the launch bound)
#ifndef BPS
#define BPS 1
#endif
#ifndef PREFETCH
#define PREFETCH 1
#endif
#ifndef SKIP
#define SKIP 0
#endif
#define DU 7                // down: uint4 a lane a chunk (5 chunks a row)
#define PRE 12              // registers of uint4 a lane holds for the next phase (a gate/up pair)

// arrive: every thread's stores of this phase made visible, then counted
__device__ __forceinline__ void arrive(unsigned *count, unsigned &target) {
  target += gridDim.x;
  __syncthreads();
#if BARRIER
  if (threadIdx.x == 0) { __threadfence(); atomicAdd(count, 1u); }
#endif
}
// wait: until every workgroup has arrived
__device__ __forceinline__ void wait(unsigned *count, unsigned target) {
#if BARRIER
  if (threadIdx.x == 0) while (ld_acquire(count) < target) {}
#endif
  __syncthreads();
}

// stage src[0..n) into smem, scaled by rsqrt(mean square) when norm; every load in flight at once
#define STAGE_MAX ((FF / 4 + THREADS - 1) / THREADS)
__device__ void stage(float *xs, const float *src, int n, bool norm) {
  __shared__ float red[WARPS];
  float4 buf[STAGE_MAX];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < STAGE_MAX; ++j) {
    int i = threadIdx.x + j * THREADS;
    if (i < n / 4) buf[j] = __ldcg((const float4 *)src + i);
  }
#pragma unroll
  for (int j = 0; j < STAGE_MAX; ++j) {
    int i = threadIdx.x + j * THREADS;
    if (i < n / 4) {
      ((float4 *)xs)[i] = buf[j];
      ss += buf[j].x * buf[j].x + buf[j].y * buf[j].y + buf[j].z * buf[j].z + buf[j].w * buf[j].w;
    }
  }
  if (norm) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < WARPS; ++w) t += red[w];
    float r = rsqrtf(t / n + 1e-6f);
    for (int i = threadIdx.x; i < n; i += THREADS) xs[i] *= r;
  }
  __syncthreads();
}

// the first loads of phase `ph` of layer `l` for this warp (its first row), into pre
__device__ __forceinline__ void prefetch(const Params &p, int ph, int l, uint4 *pre) {
#if PREFETCH
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (l >= p.layers) return;
  if (ph == 0) {
    int r = lo_row(NQKV) + warp;
    if (r < hi_row(NQKV)) load6(pre, p.wqkv + ((size_t)l * NQKV + r) * VH, lane);
  } else if (ph == 2) {
    int r = lo_row(HID) + warp;
    if (r < hi_row(HID)) load6(pre, p.wo + ((size_t)l * HID + r) * VH, lane);
  } else if (ph == 3) {
    int r = lo_row(FF) + warp;
    if (r < hi_row(FF)) { load6(pre, p.wg + ((size_t)l * FF + r) * VH, lane); load6(pre + 6, p.wu + ((size_t)l * FF + r) * VH, lane); }
  } else if (ph == 4) {
    int r = lo_row(HID) + warp;
    if (r < hi_row(HID)) {
      const uint4 *row = p.wd + ((size_t)l * HID + r) * VF;
#pragma unroll
      for (int i = 0; i < DU; ++i) pre[i] = __ldg(row + i * 32 + lane);
    }
  }
#endif
}

// y[r] = (res ? res[r] : 0) + W[r] . xs over rows of this block, K = HID
__device__ void gemv_hid(const uint4 *w, const float *xs, float *y, const float *res, int n, uint4 *pre) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int hi = hi_row(n);
  bool first = PREFETCH;
  for (int r = lo_row(n) + warp; r < hi; r += WARPS) {
    uint4 *v = pre;                      // the first row's loads were issued before the barrier
    if (!first) load6(v, w + (size_t)r * VH, lane);
    first = false;
    float s = warp_sum(dot6(v, xs, lane));
    if (lane == 0) y[r] = (res ? __ldcg(res + r) : 0.f) + s;
  }
}

__device__ void gate_up(const uint4 *wg, const uint4 *wu, const float *xs, float *m, uint4 *pre) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int hi = hi_row(FF);
  bool first = PREFETCH;
  for (int r = lo_row(FF) + warp; r < hi; r += WARPS) {
    uint4 *v = pre;
    if (!first) { load6(v, wg + (size_t)r * VH, lane); load6(v + 6, wu + (size_t)r * VH, lane); }
    first = false;
    float g = warp_sum(dot6(v, xs, lane)), u = warp_sum(dot6(v + 6, xs, lane));
    if (lane == 0) m[r] = g / (1.f + __expf(-g)) * u;
  }
}

__device__ void down(const uint4 *w, const float *xs, float *y, const float *res, uint4 *pre) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int hi = hi_row(HID);
  bool first = PREFETCH;
  for (int r = lo_row(HID) + warp; r < hi; r += WARPS) {
    const uint4 *row = w + (size_t)r * VF;
    float acc = 0.f;
#pragma unroll 1
    for (int c = 0; c < VF / 32 / DU; ++c) {
      uint4 *v = pre;
      if (!first) {
#pragma unroll
        for (int i = 0; i < DU; ++i) v[i] = __ldg(row + (c * DU + i) * 32 + lane);
      }
      first = false;
#pragma unroll
      for (int i = 0; i < DU; ++i) acc += dot8(v[i], xs + 8 * ((c * DU + i) * 32 + lane));
    }
    float s = warp_sum(acc);
    if (lane == 0) y[r] = __ldcg(res + r) + s;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, BPS) layers(Params p) {
  extern __shared__ float xs[];
  uint4 pre[PRE];
  unsigned target = 0;
  prefetch(p, 0, 0, pre);
  for (int l = 0; l < p.layers; ++l) {
    // QKV: q = W_qkv . rmsnorm(x)
    stage(xs, p.x, HID, true);
    if (!(SKIP & 1)) gemv_hid(p.wqkv + (size_t)l * NQKV * VH, xs, p.q, nullptr, NQKV, pre);
    arrive(p.count, target);
    wait(p.count, target);
    if (!(SKIP & 2)) attention(p, l);
    arrive(p.count, target);
    prefetch(p, 2, l, pre);                      // O's first rows load while the others arrive
    wait(p.count, target);
    // O: h = x + W_o . a
    stage(xs, p.a, HID, false);
    if (!(SKIP & 4)) gemv_hid(p.wo + (size_t)l * HID * VH, xs, p.h, p.x, HID, pre);
    arrive(p.count, target);
    prefetch(p, 3, l, pre);
    wait(p.count, target);
    // gate/up: m = silu(W_g . n) * (W_u . n), n = rmsnorm(h)
    stage(xs, p.h, HID, true);
    if (!(SKIP & 8)) gate_up(p.wg + (size_t)l * FF * VH, p.wu + (size_t)l * FF * VH, xs, p.m, pre);
    arrive(p.count, target);
    prefetch(p, 4, l, pre);
    wait(p.count, target);
    // down: x = h + W_d . m
    stage(xs, p.m, FF, false);
    if (!(SKIP & 16)) down(p.wd + (size_t)l * HID * VF, xs, p.x, p.h, pre);
    arrive(p.count, target);
    prefetch(p, 0, l + 1, pre);
    wait(p.count, target);
  }
}

// the same bytes streamed with nothing between: every weight summed
extern "C" __global__ void __launch_bounds__(THREADS) stream_sum(const uint4 *w, size_t n, float *out) {
  float acc = 0.f;
  for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS) {
    uint4 v = __ldg(w + i);
    acc += __half2float(*(half *)&v.x) + __half2float(*(half *)&v.w);
  }
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
