// The same stack of decode layers with the weights through a ring in shared memory.  The last warp
// streams this workgroup's weight slices, phase after phase, into SLOTS slots by bulk copies
// (cp.async.bulk, completion on an mbarrier a slot); the other warps, one a slot, consume the chunks
// and follow the chain of phases.  The stream waits only for free slots, never for the grid: while
// the chain waits, the ring fills.  The gate and up rows come interleaved (wgu: row i of gate, then
// row i of up).  A warp consumes a slot's chunk alone (THREADS = (SLOTS + 1) * 32), or with SPLIT=G
// the 12 consumer warps in G groups share the chunks, a group on every G-th chunk together (G 1:
// half a row a warp, a lane 3 of the 16-byte weight loads against 24 activation values it holds in
// registers for the whole phase; G 2: a row a warp, 6 loads, 48 values; THREADS = 13 * 32).
#ifndef SLOTS
#define SLOTS 10
#endif
#define SLOT 18432          // one down row (17920 B), 6 hidden rows, 3 gate/up row pairs
#ifndef SPLIT
#define SPLIT 0             // G >= 1: the consumer warps in G groups, a group on every G-th chunk together,
#endif                      // the activation in registers
#define NCW (WARPS - 1)     // consumer warps
#if SPLIT
static_assert(NCW == 12 && SLOTS % SPLIT == 0 && (SPLIT == 1 || SPLIT == 2),
              "SPLIT: THREADS must be 13 * 32 (12 warps: a group of 12 or 6 on a 6-row chunk), SLOTS a multiple of SPLIT");
#define GW (NCW / (SPLIT ? SPLIT : 1))    // warps a group
#define NJ (36 / GW)                      // 16-byte weight loads a lane a chunk
#else
static_assert(NCW == SLOTS, "THREADS must be (SLOTS + 1) * 32 (a warp a slot: it waits on its own slot's fills)");
#endif

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long *b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long *b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long *b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long *b, unsigned parity) {
  unsigned ok;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(sa(b)), "r"(parity) : "memory");
  } while (!ok);
}
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes, unsigned long long *b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b)) : "memory");
}
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(NCW * 32) : "memory"); }

// a phase's slice for this workgroup: rows [lo, hi), bytes a row, rows a chunk
struct Slice { const char *base; int lo, hi, row_bytes, per_chunk; };
__device__ __forceinline__ int nchunks(const Slice &s) { return (s.hi - s.lo + s.per_chunk - 1) / s.per_chunk; }
__device__ __forceinline__ Slice slice_of(const Params &p, const uint4 *wgu, int ph, int l) {
  Slice s;
  if (ph == 0) { s.base = (const char *)(p.wqkv + (size_t)l * NQKV * VH); s.lo = lo_row(NQKV); s.hi = hi_row(NQKV); s.row_bytes = HID * 2; s.per_chunk = 6; }
  else if (ph == 1) { s.base = (const char *)(p.wo + (size_t)l * HID * VH); s.lo = lo_row(HID); s.hi = hi_row(HID); s.row_bytes = HID * 2; s.per_chunk = 6; }
  else if (ph == 2) { s.base = (const char *)(wgu + (size_t)l * FF * 2 * VH); s.lo = lo_row(FF); s.hi = hi_row(FF); s.row_bytes = HID * 4; s.per_chunk = 3; }
  else { s.base = (const char *)(p.wd + (size_t)l * HID * VF); s.lo = lo_row(HID); s.hi = hi_row(HID); s.row_bytes = FF * 2; s.per_chunk = 1; }
  return s;
}

__device__ void producer(const Params &p, const uint4 *wgu, char *ring, unsigned long long *full, unsigned long long *empty) {
  if ((threadIdx.x & 31) != 0) return;
  unsigned c = 0;
  for (int l = 0; l < p.layers; ++l)
    for (int ph = 0; ph < 4; ++ph) {
      Slice s = slice_of(p, wgu, ph, l);
      for (int r = s.lo; r < s.hi; r += s.per_chunk, ++c) {
        int slot = c % SLOTS;
        if (c >= SLOTS) mbar_wait(&empty[slot], ((c / SLOTS) - 1) & 1);
        unsigned bytes = (unsigned)(min(s.per_chunk, s.hi - r) * s.row_bytes);
        mbar_expect(&full[slot], bytes);
        bulk_load(ring + (size_t)slot * SLOT, s.base + (size_t)r * s.row_bytes, bytes, &full[slot]);
      }
    }
}

// consume the chunks of one phase: warp w takes chunks c0 + w, c0 + w + NCW, ...
template <int PH>
__device__ void consume(const Slice &s, unsigned c0, const char *ring, unsigned long long *full,
                        unsigned long long *empty, const float *xs, float *y, const float *res) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int n = nchunks(s);
  for (int k = warp; k < n; k += NCW) {
    unsigned c = c0 + k;
    int slot = c % SLOTS;
    mbar_wait(&full[slot], (c / SLOTS) & 1);
    const uint4 *w = (const uint4 *)(ring + (size_t)slot * SLOT);
    int r0 = s.lo + k * s.per_chunk, rows = min(s.per_chunk, s.hi - r0);
    for (int j = 0; j < rows; ++j) {
      if (PH == 3) {
        const uint4 *row = w;
        float acc = 0.f;
#pragma unroll 5
        for (int i = 0; i < VF / 32; ++i) acc += dot8(row[i * 32 + lane], xs + 8 * (i * 32 + lane));
        acc = warp_sum(acc);
        if (lane == 0) y[r0] = __ldcg(res + r0) + acc;
      } else if (PH == 2) {
        uint4 v[12];
#pragma unroll
        for (int i = 0; i < 12; ++i) v[i] = w[j * 2 * VH + i * 32 + lane];
        float g = warp_sum(dot6(v, xs, lane)), u = warp_sum(dot6(v + 6, xs, lane));
        if (lane == 0) y[r0 + j] = g / (1.f + __expf(-g)) * u;
      } else {
        uint4 v[6];
#pragma unroll
        for (int i = 0; i < 6; ++i) v[i] = w[j * VH + i * 32 + lane];
        float acc = warp_sum(dot6(v, xs, lane));
        if (lane == 0) y[r0 + j] = (res ? __ldcg(res + r0 + j) : 0.f) + acc;
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
}

// stage for consumer warps only (named barrier 1)
__device__ void cstage(float *xs, const float *src, int n, bool norm) {
  __shared__ float red[NCW];
  float ss = 0.f;
  for (int i = threadIdx.x; i < n / 4; i += NCW * 32) {
    float4 v = __ldcg((const float4 *)src + i);
    ((float4 *)xs)[i] = v;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  if (norm) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    cbar();
    float t = 0.f;
    for (int w = 0; w < NCW; ++w) t += red[w];
    float r = rsqrtf(t / n + 1e-6f);
    for (int i = threadIdx.x; i < n; i += NCW * 32) xs[i] *= r;
  }
  cbar();
}

__device__ __forceinline__ void cbarrier(unsigned *count, unsigned &target) {
  target += gridDim.x;
  cbar();
#if BARRIER
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    while (ld_acquire(count) < target) {}
  }
  cbar();
#endif
}

#if SPLIT
// ---------------------------------------------------------------- SPLIT: groups of warps on each chunk
#define YS 160              // output rows a workgroup accumulates in a phase (gate/up: 68 pairs, 136 rows)
#ifndef RING_ONLY
#define RING_ONLY 0         // 1: the consumers take each chunk and compute nothing (timing the stream alone)
#endif

// this thread's part of a chunk: row `row` of it (down: its one row), 16-byte columns idx[0..n)
struct Part { int row, n, idx[NJ]; };
__device__ __forceinline__ Part part_of(int ph) {
  int w = threadIdx.x / 32 % GW, lane = threadIdx.x & 31, per_row = GW / 6;   // warps on a row
  Part q;
  if (ph == 3) {
    q.row = 0;
    q.n = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) q.idx[j] = w * 32 + lane + GW * 32 * j, q.n += q.idx[j] < VF;
  } else {
    q.row = w / per_row;
    q.n = NJ;
#pragma unroll
    for (int j = 0; j < NJ; ++j) q.idx[j] = w % per_row * (VH / per_row) + 32 * j + lane;
  }
  return q;
}

// the activation values of this thread's columns, scaled by rsqrt(mean square) with norm
__device__ void activation(float *a, const Part &q, const float *src, int n, bool norm) {
  __shared__ float red[NCW];
  float r = 1.f;
  if (norm) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += NCW * 32) { float v = __ldcg(src + i); ss += v * v; }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    cbar();
    float t = 0.f;
    for (int w = 0; w < NCW; ++w) t += red[w];
    r = rsqrtf(t / n + 1e-6f);
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (j < q.n) {
      float4 x0 = __ldcg((const float4 *)(src + 8 * q.idx[j])), x1 = __ldcg((const float4 *)(src + 8 * q.idx[j] + 4));
      a[8 * j + 0] = x0.x * r, a[8 * j + 1] = x0.y * r, a[8 * j + 2] = x0.z * r, a[8 * j + 3] = x0.w * r;
      a[8 * j + 4] = x1.x * r, a[8 * j + 5] = x1.y * r, a[8 * j + 6] = x1.z * r, a[8 * j + 7] = x1.w * r;
    }
}

// the chunks of one phase, every warp on each: partial dot products summed into ys
__device__ void consume_split(int ph, const Slice &s, unsigned c0, const char *ring, unsigned long long *full,
                              unsigned long long *empty, const float *a, float *ys) {
  int lane = threadIdx.x & 31;
  Part q = part_of(ph);
  int n = nchunks(s), per = ph == 3 ? 1 : 6;            // rows of 3072 B a chunk (gate/up: 3 pairs)
  for (int k = 0; k < n; ++k) {
    unsigned c = c0 + k;
    if (c % SPLIT != threadIdx.x / 32 / GW) continue;     // another group's chunk
    int slot = c % SLOTS;
    mbar_wait(&full[slot], (c / SLOTS) & 1);
    const uint4 *w = (const uint4 *)(ring + (size_t)slot * SLOT);
    int rows = ph == 3 ? 1 : min(s.per_chunk, s.hi - (s.lo + k * s.per_chunk)) * (ph == 2 ? 2 : 1);
    if (!RING_ONLY && q.row < rows) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (j < q.n) acc += dot8(w[q.row * VH + q.idx[j]], a + 8 * j);
      acc = warp_sum(acc);
      if (lane == 0) atomicAdd(&ys[k * per + q.row], acc);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) layers_split(Params p, const uint4 *wgu) {
  extern __shared__ __align__(128) char smem[];
  char *ring = smem;
  __shared__ __align__(8) unsigned long long full[SLOTS], empty[SLOTS];
  __shared__ float ys[YS];
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) { mbar_init(&full[i], 1); mbar_init(&empty[i], GW); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < YS; i += THREADS) ys[i] = 0.f;
  __syncthreads();
  if (threadIdx.x >> 5 == NCW) { producer(p, wgu, ring, full, empty); return; }
  unsigned target = 0, c = 0;
  float a[8 * NJ];
  const int t = threadIdx.x;
  for (int l = 0; l < p.layers; ++l) {
    // QKV: q = W_qkv . rmsnorm(x)
    Slice s = slice_of(p, wgu, 0, l);
    activation(a, part_of(0), p.x, HID, true);
    consume_split(0, s, c, ring, full, empty, a, ys);
    c += nchunks(s);
    cbar();
    if (t < s.hi - s.lo) p.q[s.lo + t] = ys[t], ys[t] = 0.f;
    cbarrier(p.count, target);
    attention(p, l, NCW);
    cbarrier(p.count, target);
    // O: h = x + W_o . a
    s = slice_of(p, wgu, 1, l);
    activation(a, part_of(1), p.a, HID, false);
    consume_split(1, s, c, ring, full, empty, a, ys);
    c += nchunks(s);
    cbar();
    if (t < s.hi - s.lo) p.h[s.lo + t] = __ldcg(p.x + s.lo + t) + ys[t], ys[t] = 0.f;
    cbarrier(p.count, target);
    // gate/up: m = silu(W_g . n) * (W_u . n), n = rmsnorm(h)
    s = slice_of(p, wgu, 2, l);
    activation(a, part_of(2), p.h, HID, true);
    consume_split(2, s, c, ring, full, empty, a, ys);
    c += nchunks(s);
    cbar();
    if (t < s.hi - s.lo) {
      float g = ys[2 * t], u = ys[2 * t + 1];
      p.m[s.lo + t] = g / (1.f + __expf(-g)) * u;
    }
    cbar();
    for (int i = t; i < YS; i += NCW * 32) ys[i] = 0.f;
    cbarrier(p.count, target);
    // down: x = h + W_d . m
    s = slice_of(p, wgu, 3, l);
    activation(a, part_of(3), p.m, FF, false);
    consume_split(3, s, c, ring, full, empty, a, ys);
    c += nchunks(s);
    cbar();
    if (t < s.hi - s.lo) p.x[s.lo + t] = __ldcg(p.h + s.lo + t) + ys[t], ys[t] = 0.f;
    cbarrier(p.count, target);
  }
}

#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) layers(Params p, const uint4 *wgu) {
  extern __shared__ __align__(128) char smem[];
  char *ring = smem;
  float *xs = (float *)(smem + SLOTS * SLOT);
  __shared__ __align__(8) unsigned long long full[SLOTS], empty[SLOTS];
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) { mbar_init(&full[i], 1); mbar_init(&empty[i], 1); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >> 5 == NCW) { producer(p, wgu, ring, full, empty); return; }
  unsigned target = 0, c = 0;
  for (int l = 0; l < p.layers; ++l) {
    Slice s = slice_of(p, wgu, 0, l);
    cstage(xs, p.x, HID, true);
    consume<0>(s, c, ring, full, empty, xs, p.q, nullptr);
    c += nchunks(s);
    cbarrier(p.count, target);
    attention(p, l, NCW);
    cbarrier(p.count, target);
    s = slice_of(p, wgu, 1, l);
    cstage(xs, p.a, HID, false);
    consume<1>(s, c, ring, full, empty, xs, p.h, p.x);
    c += nchunks(s);
    cbarrier(p.count, target);
    s = slice_of(p, wgu, 2, l);
    cstage(xs, p.h, HID, true);
    consume<2>(s, c, ring, full, empty, xs, p.m, nullptr);
    c += nchunks(s);
    cbarrier(p.count, target);
    s = slice_of(p, wgu, 3, l);
    cstage(xs, p.m, FF, false);
    consume<3>(s, c, ring, full, empty, xs, p.x, p.h);
    c += nchunks(s);
    cbarrier(p.count, target);
  }
}

