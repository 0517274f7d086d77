// The ring of ring.cu (SPLIT=1: 12 consumer warps, a producer warp) with the weights laid out for it
// (run.py, Probe.tiled): a workgroup's rows of a phase are stored as chunks of KC columns, each chunk
// its rows one after another, so a chunk is one bulk copy.  A consumer thread keeps the same RPT rows
// and the same eight columns of every chunk and sums into registers over the whole phase; the rows'
// partial sums meet once, in shared memory, at the end of the phase.  The RMSNorm scale multiplies
// the sums (W (x r) = r (W x)), so the activation is staged as it is, in one pass.
// The switches (run.py's MODE sets them):
//   FLIGHT=n     chunks the producer keeps in flight at most, the rest of the ring is storage (every byte
//                in flight lengthens the queue each latency-bound load of the chain waits in)
//   ATTN_WG=1    query head h on workgroup h, its K and V bulk-copied into shared memory before the
//                grid's wait, a position a warp; else attention() of common.cuh on workgroup 0
//   ATTN_GLOBAL=1 with ATTN_WG: K and V asked of L2 before the wait and read from global memory after it
//                (a context whose K and V pass the activation buffer)
//   ATTN_SPLIT=S query head h's positions over S workgroups (h S .. h S + S - 1), each copying its share of K
//                and V into xs before the wait; their partial rows (max, sum, output) are combined where O
//                stages its activation (flash-decoding inside the phase)
//   LOCAL_ATTN=1 every workgroup computes the 12 heads itself and goes on to O with no grid wait
//   NO_ATTN=1    the attention phase computes nothing (wrong answers: what its work costs)
//   KV_AHEAD=1   the attention warps ask L2 for their layer's K and V before the grid's wait
//   RELEASE=1    a grid barrier's arrival is one release-add (red.release.gpu), not a fence and an add
//   RES_EARLY=1  O's and down's residual rows read before their chunks, not after
//   QUIET=1      the producer issues nothing while its consumers wait at a grid barrier, so the barrier's
//                add and polls cross an idle memory system
//   FOLD_ATTN=1  no grid barrier between QKV and attention: each QKV workgroup counts itself in for the
//                query heads its rows touch, and the last of a head's workgroups runs that head's attention
//                (K and V from global memory); p.count[1 + l * NH + h] counts them
//   LMHEAD=1     after the layers, the final RMSNorm, the LM head (151936 rows, tiled like gate/up in blocks
//                of 144 rows) and the argmax over all workgroups (one 64-bit atomic max)
//   M_HALF=1     the SiLU·mul output m stored in f16, so that down's staging reads half the bytes
//   TRACE=1      workgroup TRACE_WG's clock at each step of layer 10 (trace_clk), every workgroup's
//                global timer at each phase's store and release (trace_all)
#ifndef FLIGHT
#define FLIGHT SLOTS
#endif
#ifndef ATTN_WG
#define ATTN_WG 0
#endif
#ifndef ATTN_GLOBAL
#define ATTN_GLOBAL 0
#endif
#ifndef ATTN_SPLIT
#define ATTN_SPLIT 0
#endif
#ifndef LOCAL_ATTN
#define LOCAL_ATTN 0
#endif
#ifndef NO_ATTN
#define NO_ATTN 0
#endif
#ifndef KV_AHEAD
#define KV_AHEAD 0
#endif
#ifndef RELEASE
#define RELEASE 0
#endif
#ifndef RES_EARLY
#define RES_EARLY 0
#endif
#ifndef QUIET
#define QUIET 0
#endif
#ifndef FOLD_ATTN
#define FOLD_ATTN 0
#endif
#ifndef LMHEAD
#define LMHEAD 0
#endif
#ifndef M_HALF
#define M_HALF 0
#endif
#ifndef TRACE
#define TRACE 0
#endif
#ifndef TRACE_WG
#define TRACE_WG 5
#endif
#define TRACE_LAYER 10
#define CT (NCW * 32)       // consumer threads: 384
// trace_clk[ph * 64 + i]: the consumers' thread 0 in phase ph (0 QKV, 1 attention, 2 O, 3 gate/up, 4 down):
// i 0 start, 1 staged, 2 + k chunk k in the ring, 60 chunks done, 61 partials in, 62 stored, 63 past the wait;
// trace_clk[320 + ph * 64 + k]: the producer's issue of phase ph's chunk k; 640, 641: globaltimer, clock at
// the layer's start, 642, 643 at its end
__device__ unsigned long long trace_clk[648];
// trace_all[b * 10 + 2 ph]: workgroup b's globaltimer when its phase ph is stored, + 1 when past the wait
__device__ unsigned long long trace_all[1320];
#define TA(ph, i) do { if (TRACE && l == TRACE_LAYER && threadIdx.x == 0) trace_all[blockIdx.x * 10 + 2 * (ph) + (i)] = gtimer(); } while (0)
#define TR(ph, i) do { if ((i) >= 62) TA(ph, ((i) - 62) & 1); if (TRACE && l == TRACE_LAYER && blockIdx.x == TRACE_WG && threadIdx.x == 0) trace_clk[(ph) * 64 + (i)] = clock64(); } while (0)
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long v;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(v));
  return v;
}

template <int PH> struct Tile;
//                                             K        KC         CG (threads on a row)  RPT (rows a thread)
template <> struct Tile<0> { static constexpr int K = HID, KC = 384, CG = 48, RPT = 2; };   // QKV: 16 rows
template <> struct Tile<1> { static constexpr int K = HID, KC = 768, CG = 96, RPT = 3; };   // O: 12 rows
template <> struct Tile<2> { static constexpr int K = HID, KC = 64, CG = 8, RPT = 3; };     // gate/up: 144 rows
template <> struct Tile<3> { static constexpr int K = FF, KC = 768, CG = 96, RPT = 3; };    // down: 12 rows
template <> struct Tile<4> { static constexpr int K = HID, KC = 64, CG = 8, RPT = 3; };     // LM head: blocks of 144 rows
template <int PH> constexpr int RP = CT / Tile<PH>::CG * Tile<PH>::RPT;                    // rows a workgroup, at most
template <int PH> constexpr int NCH = (Tile<PH>::K + Tile<PH>::KC - 1) / Tile<PH>::KC;     // chunks a phase
template <int PH> constexpr size_t REGION = (size_t)NCH<PH> * RP<PH> * Tile<PH>::KC * 2;  // bytes a workgroup
constexpr size_t LAYER_BYTES = REGION<0> + REGION<1> + REGION<2> + REGION<3>;              // a workgroup's layer
#define VOC 151936          // LM head rows
#ifndef LM_BLOCKS
#define LM_BLOCKS 8         // blocks of RP<4> rows a workgroup at most (run.py sets it from the SMs: 8 for 132)
#endif
constexpr size_t LM_REGION = LM_BLOCKS * REGION<4>;                                         // bytes a workgroup
struct LmArgs { const char *w; float *logits; unsigned long long *best; };                // LMHEAD's tiled weight, outputs
static_assert(RP<2> * Tile<2>::KC * 2 <= SLOT && RP<1> * Tile<1>::KC * 2 <= SLOT && RP<3> * Tile<3>::KC * 2 <= SLOT,
              "a chunk fills at most a slot");

// rows of phase PH this workgroup computes (gate/up: its pairs' rows, gate then up)
template <int PH> __device__ __forceinline__ int lo_of() {
  return PH == 0 ? lo_row(NQKV) : PH == 2 ? lo_row(FF) : lo_row(HID);
}
template <int PH> __device__ __forceinline__ int rows_of() {
  return PH == 0 ? hi_row(NQKV) - lo_row(NQKV) : PH == 2 ? 2 * (hi_row(FF) - lo_row(FF)) : hi_row(HID) - lo_row(HID);
}
// this workgroup's region of phase PH in layer l (the layout of Probe.tiled)
template <int PH> __device__ __forceinline__ const char *region(const char *tw, int l) {
  size_t before = PH > 0 ? REGION<0> : 0;
  before += PH > 1 ? REGION<1> : 0;
  before += PH > 2 ? REGION<2> : 0;
  return tw + ((size_t)l * LAYER_BYTES + before) * gridDim.x + (size_t)blockIdx.x * REGION<PH>;
}

__shared__ volatile unsigned quiet;   // QUIET: 1 while the consumers wait at a grid barrier

template <int PH>
__device__ void produce(const char *tw, int l, unsigned &c, char *ring, unsigned long long *full, unsigned long long *empty) {
  constexpr int TP = PH == 0 ? 0 : PH + 1;
  using T = Tile<PH>;
  const char *base = region<PH>(tw, l);
  int n = rows_of<PH>();
  for (int j = 0; j < NCH<PH>; ++j, ++c) {
    int slot = c % SLOTS, kc = min(T::KC, T::K - j * T::KC);
    if (c >= SLOTS) mbar_wait(&empty[slot], ((c / SLOTS) - 1) & 1);
    if (FLIGHT < SLOTS && c >= FLIGHT) mbar_wait(&full[(c - FLIGHT) % SLOTS], ((c - FLIGHT) / SLOTS) & 1);
    if (QUIET) while (quiet) {}
    if (TRACE && l == TRACE_LAYER && blockIdx.x == TRACE_WG) trace_clk[320 + TP * 64 + j] = clock64();
    unsigned bytes = (unsigned)(n * kc * 2);
    mbar_expect(&full[slot], bytes);
    bulk_load(ring + (size_t)slot * SLOT, base + (size_t)j * RP<PH> * T::KC * 2, bytes, &full[slot]);
  }
}

// the LM head's chunks: this workgroup's rows in blocks of RP<4>, each block's chunks in turn
__device__ void produce_lm(const LmArgs &lm, unsigned &c, char *ring, unsigned long long *full, unsigned long long *empty) {
  using T = Tile<4>;
  const char *base = lm.w + (size_t)blockIdx.x * LM_REGION;
  int rows = hi_row(VOC) - lo_row(VOC);
  for (int bk = 0; bk * RP<4> < rows; ++bk)
    for (int j = 0; j < NCH<4>; ++j, ++c) {
      int slot = c % SLOTS, n = min(RP<4>, rows - bk * RP<4>);
      if (c >= SLOTS) mbar_wait(&empty[slot], ((c / SLOTS) - 1) & 1);
      if (FLIGHT < SLOTS && c >= FLIGHT) mbar_wait(&full[(c - FLIGHT) % SLOTS], ((c - FLIGHT) / SLOTS) & 1);
      if (QUIET) while (quiet) {}
      mbar_expect(&full[slot], (unsigned)(n * T::KC * 2));
      bulk_load(ring + (size_t)slot * SLOT, base + ((size_t)bk * NCH<4> + j) * RP<4> * T::KC * 2, n * T::KC * 2, &full[slot]);
    }
}

__device__ void producer_tiled(const Params &p, const char *tw, const LmArgs &lm, char *ring, unsigned long long *full,
                               unsigned long long *empty) {
  if ((threadIdx.x & 31) != 0) return;
  unsigned c = 0;
  for (int l = 0; l < p.layers; ++l) {
    produce<0>(tw, l, c, ring, full, empty);
    produce<1>(tw, l, c, ring, full, empty);
    produce<2>(tw, l, c, ring, full, empty);
    produce<3>(tw, l, c, ring, full, empty);
  }
  if (LMHEAD) produce_lm(lm, c, ring, full, empty);
}

// stage src[0..n) into xs as it is, every load in flight at once; each warp's sum of squares to ssw
__device__ void stage_raw(float *xs, const float *src, int n, float *ssw) {
  constexpr int MAXJ = (FF / 4 + CT - 1) / CT;
  float4 buf[MAXJ];
  float ss = 0.f;
  int t = threadIdx.x;
#pragma unroll
  for (int j = 0; j < MAXJ; ++j)
    if (t + j * CT < n / 4) buf[j] = __ldcg((const float4 *)src + t + j * CT);
#pragma unroll
  for (int j = 0; j < MAXJ; ++j)
    if (t + j * CT < n / 4) {
      ((float4 *)xs)[t + j * CT] = buf[j];
      ss += buf[j].x * buf[j].x + buf[j].y * buf[j].y + buf[j].z * buf[j].z + buf[j].w * buf[j].w;
    }
  ss = warp_sum(ss);
  if ((t & 31) == 0) ssw[t >> 5] = ss;
  cbar();
}

// stage n f16 values of src into xs as floats, every load in flight at once (M_HALF: down's m)
__device__ void stage_half(float *xs, const __half *src, int n) {
  constexpr int MAXJ = (FF / 8 + CT - 1) / CT;
  uint4 buf[MAXJ];
  int t = threadIdx.x;
#pragma unroll
  for (int j = 0; j < MAXJ; ++j)
    if (t + j * CT < n / 8) buf[j] = __ldcg((const uint4 *)src + t + j * CT);
#pragma unroll
  for (int j = 0; j < MAXJ; ++j)
    if (t + j * CT < n / 8) {
      const __half2 *h = (const __half2 *)&buf[j];
      float2 a = __half22float2(h[0]), b = __half22float2(h[1]), c = __half22float2(h[2]), d = __half22float2(h[3]);
      ((float4 *)xs)[2 * (t + j * CT)] = make_float4(a.x, a.y, b.x, b.y);
      ((float4 *)xs)[2 * (t + j * CT) + 1] = make_float4(c.x, c.y, d.x, d.y);
    }
  cbar();
}

__device__ __forceinline__ float rms_scale(const float *ssw, int n) {
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < NCW; ++w) s += ssw[w];
  return rsqrtf(s / n + 1e-6f);
}

// the chunks of phase PH from the ring; each thread's RPT row partials to part[row][CG]
template <int PH>
__device__ void consume_tiled(unsigned c0, const char *ring, unsigned long long *full, unsigned long long *empty,
                              const float *xs, float *part, int l, int n) {
  using T = Tile<PH>;
  constexpr int TP = PH == 0 ? 0 : PH + 1;
  int t = threadIdx.x, cg = t % T::CG, rg = t / T::CG;
  float acc[T::RPT];
#pragma unroll
  for (int i = 0; i < T::RPT; ++i) acc[i] = 0.f;
  for (int k = 0; k < NCH<PH>; ++k) {
    unsigned c = c0 + k;
    int slot = c % SLOTS, kc = min(T::KC, T::K - k * T::KC);
    mbar_wait(&full[slot], (c / SLOTS) & 1);
    TR(TP, 2 + k);
    if (!RING_ONLY && cg * 8 < kc) {
      const uint4 *w = (const uint4 *)(ring + (size_t)slot * SLOT) + cg;
      const float *x = xs + k * T::KC + cg * 8;
#pragma unroll
      for (int i = 0; i < T::RPT; ++i)
        if (rg * T::RPT + i < n) acc[i] += dot8(w[(rg * T::RPT + i) * (kc / 8)], x);
    }
    __syncwarp();
    if ((t & 31) == 0) mbar_arrive(&empty[slot]);
  }
  TR(TP, 60);
#pragma unroll
  for (int i = 0; i < T::RPT; ++i) part[(rg * T::RPT + i) * T::CG + cg] = acc[i];
  cbar();
  TR(TP, 61);
}

// row r of phase PH: its CG partials summed
template <int PH> __device__ __forceinline__ float row_sum(const float *part, int r) {
  constexpr int CG = Tile<PH>::CG;
  const float4 *v = (const float4 *)(part + r * CG);
  float4 s = v[0];
#pragma unroll
  for (int g = 1; g < CG / 4; ++g) s.x += v[g].x, s.y += v[g].y, s.z += v[g].z, s.w += v[g].w;
  return (s.x + s.y) + (s.z + s.w);
}

// ask L2 for layer l's K and V rows of this warp's query head (attention's reads after the wait)
__device__ __forceinline__ void kv_ahead(const Params &p, int l) {
  int hd = blockIdx.x * NCW + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (hd >= NH) return;
  int kvh = hd / (NH / NKV);
  for (int kv = 0; kv < 2; ++kv) {     // POS * HD halves: 8 KB, 64 lines of 128 B, two a lane
    const char *b = (const char *)(p.kv + (((size_t)l * 2 + kv) * NKV + kvh) * POS * HD);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(b + lane * 256));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(b + lane * 256 + 128));
  }
}

// attention() of common.cuh into this workgroup's shared memory: warp w computes query head w
__device__ void attention_local(const Params &p, int l, float *a) {
  int lane = threadIdx.x & 31, hd = threadIdx.x >> 5;
  int kvh = hd / (NH / NKV);
  const uint2 *k = (const uint2 *)(p.kv + (((size_t)l * 2 + 0) * NKV + kvh) * POS * HD);
  const uint2 *v = (const uint2 *)(p.kv + (((size_t)l * 2 + 1) * NKV + kvh) * POS * HD);
  uint2 kr[POS], vr[POS];
#pragma unroll
  for (int j = 0; j < POS; ++j) kr[j] = __ldg(k + j * (HD / 4) + lane);
#pragma unroll
  for (int j = 0; j < POS; ++j) vr[j] = __ldg(v + j * (HD / 4) + lane);
  float4 q = __ldcg((const float4 *)(p.q + hd * HD) + lane);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < POS; ++j) {
    float2 x = __half22float2(*(__half2 *)&kr[j].x), y = __half22float2(*(__half2 *)&kr[j].y);
    float d = warp_sum(q.x * x.x + q.y * x.y + q.z * y.x + q.w * y.y);
    if (lane == j) s = d * 0.08838834764831845f;
  }
  float mx = s;
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float e = __expf(s - mx), pr = e / warp_sum(e);
  float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < POS; ++j) {
    float pj = __shfl_sync(0xffffffffu, pr, j);
    float2 x = __half22float2(*(__half2 *)&vr[j].x), y = __half22float2(*(__half2 *)&vr[j].y);
    o4.x += pj * x.x; o4.y += pj * x.y; o4.z += pj * y.x; o4.w += pj * y.y;
  }
  ((float4 *)(a + hd * HD))[lane] = o4;
}

// query head h = blockIdx.x < NH: the scores a position a warp (lanes over the head's dimensions), the
// softmax and the weighted sum of V a dimension a thread; K and V of the layer are in kv (bulk-copied
// before the wait), sc holds the POS scores
__device__ void attention_wg(const Params &p, const __half *kb, const __half *vb, float *sc, float *vpart) {
  int h = blockIdx.x, t = threadIdx.x, lane = t & 31, w = t >> 5;
  float4 q = __ldcg((const float4 *)(p.q + h * HD) + lane);
#pragma unroll 4
  for (int j = w; j < POS; j += NCW) {                 // the scores: a position a warp
    uint2 k = ((const uint2 *)(kb + j * HD))[lane];
    float2 x = __half22float2(*(__half2 *)&k.x), y = __half22float2(*(__half2 *)&k.y);
    float d = warp_sum(q.x * x.x + q.y * x.y + q.z * y.x + q.w * y.y);
    if (lane == 0) sc[j] = d * 0.08838834764831845f;
  }
  cbar();
  if (w == 0) {                                        // the softmax: POS / 32 positions a lane
    float mx = sc[0], sum = 0.f;
    for (int j = lane; j < POS; j += 32) mx = fmaxf(mx, sc[j]);
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int j = lane; j < POS; j += 32) sum += __expf(sc[j] - mx);
    sum = warp_sum(sum);
    __syncwarp();
    for (int j = lane; j < POS; j += 32) sc[j] = __expf(sc[j] - mx) / sum;
  }
  cbar();
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);           // the values: a position a warp, four dimensions a lane
#pragma unroll 4
  for (int j = w; j < POS; j += NCW) {
    uint2 v = ((const uint2 *)(vb + j * HD))[lane];
    float2 x = __half22float2(*(__half2 *)&v.x), y = __half22float2(*(__half2 *)&v.y);
    float pj = sc[j];
    o.x += pj * x.x; o.y += pj * x.y; o.z += pj * y.x; o.w += pj * y.y;
  }
  ((float4 *)(vpart + w * HD))[lane] = o;
  cbar();
  if (t < HD) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < NCW; ++i) acc += vpart[i * HD + t];
    p.a[h * HD + t] = acc;
  }
}

// ATTN_SPLIT: each split's partial row of each head (its max and sum of exp, and its unnormalized output)
__device__ float att_o[NH * 8 * HD], att_ml[NH * 8 * 2];

// ATTN_SPLIT: head h over the n positions of split s, K and V in shared memory: the partial row to att_o, att_ml
__device__ void attention_part(const Params &p, int h, int s, const __half *kb, const __half *vb, int n, float *sc,
                               float *vpart) {
  int t = threadIdx.x, lane = t & 31, w = t >> 5, at = h * ATTN_SPLIT + s;
  float4 q = __ldcg((const float4 *)(p.q + h * HD) + lane);
#pragma unroll 4
  for (int j = w; j < n; j += NCW) {
    uint2 k = ((const uint2 *)(kb + j * HD))[lane];
    float2 x = __half22float2(*(__half2 *)&k.x), y = __half22float2(*(__half2 *)&k.y);
    float d = warp_sum(q.x * x.x + q.y * x.y + q.z * y.x + q.w * y.y);
    if (lane == 0) sc[j] = d * 0.08838834764831845f;
  }
  cbar();
  if (w == 0) {
    float mx = sc[0], sum = 0.f;
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sc[j]);
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    __syncwarp();
    for (int j = lane; j < n; j += 32) sum += (sc[j] = __expf(sc[j] - mx));
    sum = warp_sum(sum);
    if (lane == 0) att_ml[2 * at] = mx, att_ml[2 * at + 1] = sum;
  }
  cbar();
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int j = w; j < n; j += NCW) {
    uint2 v = ((const uint2 *)(vb + j * HD))[lane];
    float2 x = __half22float2(*(__half2 *)&v.x), y = __half22float2(*(__half2 *)&v.y);
    float pj = sc[j];
    o.x += pj * x.x; o.y += pj * x.y; o.z += pj * y.x; o.w += pj * y.y;
  }
  ((float4 *)(vpart + w * HD))[lane] = o;
  cbar();
  if (t < HD) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < NCW; ++i) acc += vpart[i * HD + t];
    att_o[at * HD + t] = acc;
  }
}

// ATTN_SPLIT: O's activation, each head's splits combined (log-sum-exp); every load in flight at once: the
// splits' maxima and sums into shared memory, a thread's outputs of every split into registers
__device__ void stage_attn(float *xs) {
  constexpr int PER = (NH * HD + CT - 1) / CT;                  // values a thread
  constexpr int S = ATTN_SPLIT ? ATTN_SPLIT : 1;              // (ATTN_SPLIT 0: never called)
  __shared__ float ml[NH * S * 2];
  int t = threadIdx.x;
  float o[PER][S];
  if (t < NH * ATTN_SPLIT * 2) ml[t] = __ldcg(&att_ml[t]);
#pragma unroll
  for (int i = 0; i < PER; ++i)
#pragma unroll
    for (int s = 0; s < ATTN_SPLIT; ++s)
      o[i][s] = __ldcg(&att_o[((t + i * CT) / HD * ATTN_SPLIT + s) * HD + (t + i * CT) % HD]);
  cbar();
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    int h = (t + i * CT) / HD;
    float mx = ml[2 * h * ATTN_SPLIT], num = 0.f, den = 0.f;
#pragma unroll
    for (int s = 1; s < ATTN_SPLIT; ++s) mx = fmaxf(mx, ml[2 * (h * ATTN_SPLIT + s)]);
#pragma unroll
    for (int s = 0; s < ATTN_SPLIT; ++s) {
      float f = __expf(ml[2 * (h * ATTN_SPLIT + s)] - mx);
      num += f * o[i][s];
      den += f * ml[2 * (h * ATTN_SPLIT + s) + 1];
    }
    xs[t + i * CT] = num / den;
  }
  cbar();
}

// cbarrier of ring.cu, the arrival a release-add with RELEASE
__device__ __forceinline__ void gbarrier(unsigned *count, unsigned &target) {
  target += gridDim.x;
  cbar();
#if BARRIER
  if (threadIdx.x == 0) {
    if (QUIET) quiet = 1;
#if RELEASE
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
#else
    __threadfence();
    atomicAdd(count, 1u);
#endif
    while (ld_acquire(count) < target) {}
    if (QUIET) quiet = 0;
  }
  cbar();
#endif
}

// FOLD_ATTN: query head h by this workgroup, K and V read from global memory; the scores a position a
// warp, the weighted sum of V a dimension a thread (sc: POS floats of shared memory)
__device__ void attention_folded(const Params &p, int l, int h, float *sc) {
  int t = threadIdx.x, lane = t & 31, w = t >> 5, kvh = h / (NH / NKV);
  const uint2 *k = (const uint2 *)(p.kv + (((size_t)l * 2 + 0) * NKV + kvh) * POS * HD);
  const __half *v = p.kv + (((size_t)l * 2 + 1) * NKV + kvh) * POS * HD;
  float4 q = __ldcg((const float4 *)(p.q + h * HD) + lane);
  for (int j = w; j < POS; j += NCW) {
    uint2 kk = __ldg(k + j * (HD / 4) + lane);
    float2 x = __half22float2(*(__half2 *)&kk.x), y = __half22float2(*(__half2 *)&kk.y);
    float d = warp_sum(q.x * x.x + q.y * x.y + q.z * y.x + q.w * y.y);
    if (lane == 0) sc[j] = d * 0.08838834764831845f;
  }
  cbar();
  if (t < HD) {
    float s = sc[lane], mx = s;
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float e = __expf(s - mx), pr = e / warp_sum(e), acc = 0.f;
#pragma unroll
    for (int j = 0; j < POS; ++j) acc += __shfl_sync(0xffffffffu, pr, j) * __half2float(__ldg(v + j * HD + t));
    p.a[h * HD + t] = acc;
  }
  cbar();
}

// FOLD_ATTN: after this workgroup's QKV rows are stored, count it in for each query head its rows touch;
// the last to arrive runs the head's attention
__device__ void fold_attention(const Params &p, int l, float *sc) {
  __shared__ unsigned last[NH];
  int lo = lo_row(NQKV), hi = hi_row(NQKV), t = threadIdx.x;
  cbar();                                   // every thread's rows stored
  if (t < NH) {
    int a = t * HD, b = a + HD;             // head t's q rows
    last[t] = 0;
    if (lo < b && hi > a) {
      int need = 0;                         // workgroups whose rows touch [a, b)
      for (int g = 0; g < (int)gridDim.x; ++g) {
        int glo = (int)(((long long)NQKV * g) / gridDim.x), ghi = (int)(((long long)NQKV * (g + 1)) / gridDim.x);
        need += glo < b && ghi > a;
      }
      unsigned ticket;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(p.count + 1 + l * NH + t) : "memory");
      last[t] = ticket == (unsigned)need - 1;
    }
  }
  cbar();
  for (int h = 0; h < NH; ++h)
    if (last[h]) attention_folded(p, l, h, sc);
}

// LMHEAD: the final RMSNorm, the LM head's logits and their argmax (the largest, the first of equals) over the grid
__device__ void lm_head(const Params &p, const LmArgs &lm, unsigned &c, const char *ring, unsigned long long *full,
                        unsigned long long *empty, float *xs, float *part, float *ssw) {
  __shared__ float wv[NCW];
  __shared__ int wi[NCW];
  int t = threadIdx.x, lo = lo_row(VOC), rows = hi_row(VOC) - lo;
  stage_raw(xs, p.x, HID, ssw);
  float r = rms_scale(ssw, HID), bv = -__int_as_float(0x7f800000);
  int bi = 0x7fffffff;
  for (int bk = 0; bk * RP<4> < rows; ++bk) {
    int n = min(RP<4>, rows - bk * RP<4>);
    consume_tiled<4>(c, ring, full, empty, xs, part, -1, n);
    c += NCH<4>;
    if (t < n) {
      float v = row_sum<4>(part, t) * r;
      lm.logits[lo + bk * RP<4> + t] = v;
      if (v > bv) bv = v, bi = lo + bk * RP<4> + t;
    }
    cbar();
  }
  for (int o = 16; o; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
  }
  if ((t & 31) == 0) wv[t >> 5] = bv, wi[t >> 5] = bi;
  cbar();
  if (t == 0) {
    for (int w = 1; w < NCW; ++w)
      if (wv[w] > bv || (wv[w] == bv && wi[w] < bi)) bv = wv[w], bi = wi[w];
    unsigned u = __float_as_uint(bv);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);          // ordered as unsigned
    atomicMax(lm.best, ((unsigned long long)u << 32) | (0xffffffffu - (unsigned)bi));
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) layers_tiled(Params p, const char *tw, LmArgs lm) {
  extern __shared__ __align__(128) char smem[];
  char *ring = smem;
  float *xs = (float *)(smem + SLOTS * SLOT);
  __shared__ __align__(8) unsigned long long full[SLOTS], empty[SLOTS];
  __shared__ __align__(16) float part[RP<2> * Tile<2>::CG];
  __shared__ float ssw[NCW];
  __shared__ __align__(8) unsigned long long kvbar;
  static_assert(RP<0> * Tile<0>::CG <= RP<2> * Tile<2>::CG && RP<3> * Tile<3>::CG <= RP<2> * Tile<2>::CG &&
                RP<4> * Tile<4>::CG <= RP<2> * Tile<2>::CG, "part");
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) { mbar_init(&full[i], 1); mbar_init(&empty[i], NCW); }
    mbar_init(&kvbar, 1);
    quiet = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >> 5 == NCW) { producer_tiled(p, tw, lm, ring, full, empty); return; }
  unsigned target = 0, c = 0;
  const int t = threadIdx.x;
  for (int l = 0; l < p.layers; ++l) {
    if (TRACE && l == TRACE_LAYER && blockIdx.x == TRACE_WG && t == 0) trace_clk[640] = gtimer(), trace_clk[641] = clock64();
    // QKV: q = W_qkv . rmsnorm(x)
    TR(0, 0);
    stage_raw(xs, p.x, HID, ssw);
    TR(0, 1);
    consume_tiled<0>(c, ring, full, empty, xs, part, l, rows_of<0>());
    c += NCH<0>;
    if (t < rows_of<0>()) p.q[lo_of<0>() + t] = row_sum<0>(part, t) * rms_scale(ssw, HID);
    if (FOLD_ATTN) {
      fold_attention(p, l, part);
      gbarrier(p.count, target);
    } else {                              // attention a phase of its own (or every workgroup's, LOCAL_ATTN)
      if (KV_AHEAD) kv_ahead(p, l);
      if (ATTN_SPLIT && blockIdx.x < NH * ATTN_SPLIT) {          // this split's K and V into xs
        int h = blockIdx.x / ATTN_SPLIT, sp = blockIdx.x % ATTN_SPLIT, lo = sp * POS / ATTN_SPLIT;
        int n = (sp + 1) * POS / ATTN_SPLIT - lo;
        const __half *k = p.kv + (((size_t)l * 2 + 0) * NKV + h / (NH / NKV)) * POS * HD + (size_t)lo * HD;
        if (t == 0) {
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          mbar_expect(&kvbar, 2 * n * HD * 2);
          bulk_load(xs, k, n * HD * 2, &kvbar);
          bulk_load((char *)xs + n * HD * 2, k + NKV * POS * HD, n * HD * 2, &kvbar);
        }
      } else if (ATTN_WG && !ATTN_SPLIT && blockIdx.x < NH) {
        const __half *k = p.kv + (((size_t)l * 2 + 0) * NKV + blockIdx.x / (NH / NKV)) * POS * HD;
        const __half *v = p.kv + (((size_t)l * 2 + 1) * NKV + blockIdx.x / (NH / NKV)) * POS * HD;
        if (ATTN_GLOBAL) {                           // this head's K and V asked of L2, read after the wait
          for (int i = t; i < 2 * POS * HD * 2 / 128; i += CT)
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)(i < POS * HD * 2 / 128 ? k : v) + i % (POS * HD * 2 / 128) * 128));
        } else if (t == 0) {                         // this head's K and V into xs, free until O's stage
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // xs's reads before the copies' writes
          mbar_expect(&kvbar, 2 * POS * HD * 2);
          bulk_load(xs, k, POS * HD * 2, &kvbar);
          bulk_load((char *)xs + POS * HD * 2, v, POS * HD * 2, &kvbar);
        }
      }
      TR(0, 62);
      gbarrier(p.count, target);
      TR(0, 63);
      if (LOCAL_ATTN) {
        attention_local(p, l, xs);
        TR(1, 62);
        cbar();
        TR(1, 63);
      } else {
        if (ATTN_SPLIT) {
          if (blockIdx.x < NH * ATTN_SPLIT) {
            int sp = blockIdx.x % ATTN_SPLIT, n = (sp + 1) * POS / ATTN_SPLIT - sp * POS / ATTN_SPLIT;
            mbar_wait(&kvbar, l & 1);
            attention_part(p, blockIdx.x / ATTN_SPLIT, sp, (const __half *)xs, (const __half *)xs + n * HD, n, part,
                           xs + n * HD);
          }
        } else if (ATTN_WG) {
          if (blockIdx.x < NH && ATTN_GLOBAL) {
            const __half *k = p.kv + (((size_t)l * 2 + 0) * NKV + blockIdx.x / (NH / NKV)) * POS * HD;
            attention_wg(p, k, k + NKV * POS * HD, part, xs);
          } else if (blockIdx.x < NH) {
            mbar_wait(&kvbar, l & 1);
            attention_wg(p, (const __half *)xs, (const __half *)xs + POS * HD, part, xs + POS * HD);
          }
        } else if (!NO_ATTN) {
          attention(p, l, NCW);
        }
        TR(1, 62);
        gbarrier(p.count, target);
        TR(1, 63);
        // O: h = x + W_o . a
        if (ATTN_SPLIT) stage_attn(xs);
        else stage_raw(xs, p.a, HID, ssw);
      }
    }
    if (FOLD_ATTN) stage_raw(xs, p.a, HID, ssw);
    TR(2, 1);
    float res = RES_EARLY && t < rows_of<1>() ? __ldcg(p.x + lo_of<1>() + t) : 0.f;
    consume_tiled<1>(c, ring, full, empty, xs, part, l, rows_of<1>());
    c += NCH<1>;
    if (t < rows_of<1>()) p.h[lo_of<1>() + t] = (RES_EARLY ? res : __ldcg(p.x + lo_of<1>() + t)) + row_sum<1>(part, t);
    TR(2, 62);
    gbarrier(p.count, target);
    TR(2, 63);
    // gate/up: m = silu(W_g . n) * (W_u . n), n = rmsnorm(h)
    stage_raw(xs, p.h, HID, ssw);
    TR(3, 1);
    consume_tiled<2>(c, ring, full, empty, xs, part, l, rows_of<2>());
    c += NCH<2>;
    if (2 * t < rows_of<2>()) {
      float r = rms_scale(ssw, HID), g = row_sum<2>(part, 2 * t) * r, u = row_sum<2>(part, 2 * t + 1) * r;
      float mv = g / (1.f + __expf(-g)) * u;
      if (M_HALF) ((__half *)p.m)[lo_of<2>() + t] = __float2half(mv);
      else p.m[lo_of<2>() + t] = mv;
    }
    TR(3, 62);
    gbarrier(p.count, target);
    TR(3, 63);
    // down: x = h + W_d . m
    if (M_HALF) stage_half(xs, (const __half *)p.m, FF);
    else stage_raw(xs, p.m, FF, ssw);
    TR(4, 1);
    res = RES_EARLY && t < rows_of<3>() ? __ldcg(p.h + lo_of<3>() + t) : 0.f;
    consume_tiled<3>(c, ring, full, empty, xs, part, l, rows_of<3>());
    c += NCH<3>;
    if (t < rows_of<3>()) p.x[lo_of<3>() + t] = (RES_EARLY ? res : __ldcg(p.h + lo_of<3>() + t)) + row_sum<3>(part, t);
    TR(4, 62);
    gbarrier(p.count, target);
    TR(4, 63);
    if (TRACE && l == TRACE_LAYER && blockIdx.x == TRACE_WG && t == 0) trace_clk[642] = gtimer(), trace_clk[643] = clock64();
  }
  if (LMHEAD) lm_head(p, lm, c, ring, full, empty, xs, part, ssw);
}
