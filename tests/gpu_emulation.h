// The GPU kernel text run on the CPU (tests/test_attention_gpu.py): each GPU thread of a workgroup is a fiber (a
// stack of its own) on the calling thread, the workgroups of a grid in turn.  A fiber runs until it waits (__syncthreads,
// the wave's lane exchange, an mbarrier, a poll), then the next one runs: a barrier of a workgroup's threads costs
// a switch a thread, not a wake-up of hundreds of OS threads.  __shared__ is a static (one workgroup at a time),
// and the prelude's target helpers are written out in plain C++.
#include <sys/mman.h>
#include <ucontext.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
using std::max;
using std::min;
struct vf_dim { unsigned x; };
static vf_dim threadIdx, blockIdx, gridDim;   // the running fiber's
// a fiber's saved context, and the switch from one to another: on x86-64 the callee-saved registers pushed on
// the old fiber's stack and popped from the new one's (no system call, unlike swapcontext's signal mask)
#if defined(__x86_64__)
struct vf_emu_context { void* sp; };
extern "C" void vf_emu_swap(void** save, void* to);
asm(".text\n.hidden vf_emu_swap\n.globl vf_emu_swap\n.type vf_emu_swap, @function\nvf_emu_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");
static inline void vf_emu_switch(vf_emu_context* from, vf_emu_context* to) { vf_emu_swap(&from->sp, to->sp); }
// a fresh fiber's stack: six zero registers to pop, then `entry` to return to, as if called (rsp 8 mod 16)
static void vf_emu_prepare(vf_emu_context* c, char* stack, size_t size, void (*entry)()) {
  void** top = (void**)((size_t)(stack + size) & ~(size_t)15);
  for (int i = 1; i <= 8; ++i) top[-i] = nullptr;
  top[-2] = (void*)entry;
  c->sp = top - 8;
}
#else
struct vf_emu_context { ucontext_t u; };
static inline void vf_emu_switch(vf_emu_context* from, vf_emu_context* to) { swapcontext(&from->u, &to->u); }
static void vf_emu_prepare(vf_emu_context* c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c->u);
  c->u.uc_stack = {stack, 0, size};
  c->u.uc_link = nullptr;
  makecontext(&c->u, entry, 0);
}
#endif
// the fibers' stacks of a launch, one mapping (the process's count of mappings is limited): each as large as an OS
// thread's (a kernel's local arrays may be large), taken from memory as it is touched, with a page below it that
// faults instead of an overflow writing into another fiber's stack; given back when the launch ends
static constexpr size_t VF_EMU_STACK = 8 << 20, VF_EMU_GUARD = 1 << 16;
struct vf_emu_stacks {
  char* region;
  size_t n;
  explicit vf_emu_stacks(size_t fibers) : n(fibers) {
    void* m = mmap(nullptr, n * (VF_EMU_GUARD + VF_EMU_STACK), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) { perror("emulation: the fibers' stacks"); abort(); }
    region = (char*)m;
    for (size_t i = 0; i < n; ++i) mprotect(region + i * (VF_EMU_GUARD + VF_EMU_STACK), VF_EMU_GUARD, PROT_NONE);
  }
  ~vf_emu_stacks() { munmap(region, n * (VF_EMU_GUARD + VF_EMU_STACK)); }
  char* operator[](size_t i) const { return region + i * (VF_EMU_GUARD + VF_EMU_STACK) + VF_EMU_GUARD; }
};
// the fibers: one a GPU thread of the workgroup
struct vf_emu_fiber { vf_emu_context context; bool done; };
static std::vector<vf_emu_fiber> vf_emu_fibers;
static vf_emu_context vf_emu_caller;           // the launch's own context, back when every fiber is done
static unsigned vf_emu_running, vf_emu_left;
static unsigned vf_emu_blocked;                // fibers waiting at a barrier not yet complete (vf_emu_barrier)
// `n` and `arrived`: the barrier the running thread waits at, or 0 when it has just returned
static void vf_emu_check_deadlock(unsigned n, unsigned arrived) {
  if (vf_emu_left && vf_emu_blocked == vf_emu_left) {
    fprintf(stderr, "emulation: workgroup %u deadlocks: its %u threads left all wait at barriers that the others "
            "(returned or at another barrier) never complete; thread %u ", blockIdx.x, vf_emu_blocked, threadIdx.x);
    if (n) fprintf(stderr, "waits at one of %u threads, %u arrived\n", n, arrived);
    else fprintf(stderr, "has just returned\n");
    abort();
  }
}
static void (*vf_emu_body)(void*);
static void* vf_emu_closure;
// the next fiber not done after the running one, round the workgroup (the running one when it is the last), in
// the order of vf_emu_step: up, then down after a workgroup barrier completes, and so on (so that a write and a read
// of LDS with no barrier between them meet in both orders, one of which gives a wrong value, as a GPU may)
static unsigned vf_emu_step = 1;
static inline unsigned vf_emu_next() {
  const unsigned n = (unsigned)vf_emu_fibers.size();
  unsigned f = vf_emu_running;
  do f = (f + vf_emu_step) % n; while (vf_emu_fibers[f].done && f != vf_emu_running);
  return f;
}
// the running fiber waits: the next one runs until it waits in turn
static inline void vf_emu_yield() {
  const unsigned from = vf_emu_running, to = vf_emu_next();
  if (to == from) return;
  vf_emu_running = threadIdx.x = to;
  vf_emu_switch(&vf_emu_fibers[from].context, &vf_emu_fibers[to].context);
}
// a fiber's life: the body, then the next fiber not done (or, after the last, the launch) for good
static void vf_emu_start() {
  vf_emu_body(vf_emu_closure);
  vf_emu_fiber& self = vf_emu_fibers[vf_emu_running];
  self.done = true;
  if (--vf_emu_left == 0) vf_emu_switch(&self.context, &vf_emu_caller);
  vf_emu_check_deadlock(0, 0);
  vf_emu_running = threadIdx.x = vf_emu_next();
  vf_emu_switch(&self.context, &vf_emu_fibers[vf_emu_running].context);
}
// run body(closure) as `threads` fibers on `stacks`, threadIdx.x 0 to threads - 1, until every one has returned
static void vf_emu_run(unsigned threads, void (*body)(void*), void* closure, const vf_emu_stacks& stacks) {
  vf_emu_fibers.resize(threads);
  vf_emu_body = body;
  vf_emu_closure = closure;
  for (unsigned t = 0; t < threads; ++t) {
    vf_emu_prepare(&vf_emu_fibers[t].context, stacks[t], VF_EMU_STACK, vf_emu_start);
    vf_emu_fibers[t].done = false;
  }
  vf_emu_left = threads;
  vf_emu_blocked = 0;
  vf_emu_step = 1;
  vf_emu_running = threadIdx.x = 0;
  vf_emu_switch(&vf_emu_caller, &vf_emu_fibers[0].context);
}
// a barrier of n fibers: the last to arrive goes on, the others wait until it has.  When every fiber not done
// waits at a barrier, none can complete: the kernel would hang on a GPU too (a barrier some of its threads
// never reach, or reach after returning), and the emulation stops with that line, not a hang
struct vf_emu_barrier;
static vf_emu_barrier* vf_emu_block;   // __syncthreads: VF_SYNC_THREADS (a persistent kernel's ring: its consumers)
struct vf_emu_barrier {
  unsigned n, arrived = 0, generation = 0;
  void arrive_and_wait() {
    const unsigned g = generation;
    if (++arrived == n) {
      vf_emu_blocked -= n - 1;
      arrived = 0;
      ++generation;
      if (this == vf_emu_block) vf_emu_step = vf_emu_fibers.size() - vf_emu_step;   // the other way round
      return;
    }
    ++vf_emu_blocked;
    vf_emu_check_deadlock(n, arrived);
    while (generation == g) vf_emu_yield();
  }
};
static vf_emu_barrier* vf_emu_all;     // every thread of the workgroup
#ifndef VF_SYNC_THREADS
#define VF_SYNC_THREADS VF_ATT_BLOCK
#endif
static std::vector<vf_emu_barrier> vf_emu_waves;
static float vf_emu_lanes[1024];
#define __shared__ static
// dynamic LDS: one buffer, which every declaration names (a persistent kernel's phases take it in turn)
static unsigned char vf_emu_dynamic_lds[256 * 1024] __attribute__((aligned(16)));
#define VF_DYNAMIC_LDS(name, bytes) \
  static_assert((bytes) <= sizeof(vf_emu_dynamic_lds)); unsigned char* const name = vf_emu_dynamic_lds
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define VF_GRID_LAUNCH_DEPENDENTS()
#define VF_GRID_WAIT()
#define vf_prefetch_l2(p, n)             // asks L2 for lines: no value changes
#define VF_INF INFINITY
typedef _Float16 vf_half;
struct vf_vec16 { unsigned x, y, z, w; };
struct vf_float4 { float x, y, z, w; };
static inline float vf_h2f(vf_half x) { return (float)x; }
static inline vf_half vf_f2h(float x) { return (vf_half)x; }
static inline vf_vec16 vf_zero16() { return vf_vec16{0, 0, 0, 0}; }
static inline void __syncthreads() { vf_emu_block->arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
// a persistent kernel's phases take their own workgroup index (codegen/persistent.py); its grid barrier, run
// here with a grid of one workgroup (the workgroups of a grid run in turn)
struct dim3 { unsigned x; explicit dim3(unsigned x_) : x(x_) {} };
#define VF_POLL_PAUSE() vf_emu_yield()
static inline void vf_grid_barrier(unsigned* arrived, unsigned n, volatile unsigned* quiet = nullptr) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (quiet) __atomic_store_n(quiet, 1u, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(arrived, 1u, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(arrived, __ATOMIC_ACQUIRE) < n * gridDim.x) vf_emu_yield();
    if (quiet) __atomic_store_n(quiet, 0u, __ATOMIC_SEQ_CST);
  }
  __syncthreads();
}
static inline void vf_grid_leave(unsigned* arrived, unsigned* left) {
  if (threadIdx.x == 0 && __atomic_fetch_add(left, 1u, __ATOMIC_SEQ_CST) == gridDim.x - 1) {
    __atomic_store_n(arrived, 0u, __ATOMIC_SEQ_CST);
    __atomic_store_n(left, 0u, __ATOMIC_SEQ_CST);
  }
}
static inline float vf_load_arrived(const float* p) { return *p; }
static inline vf_float4 vf_load_arrived4(const float* p) { vf_float4 r; std::memcpy(&r, p, 16); return r; }
static inline void vf_unpack_f16(vf_vec16 v, float* f) {
  vf_half h[8];
  std::memcpy(h, &v, 16);
  for (int i = 0; i < 8; ++i) f[i] = (float)h[i];
}
static inline void vf_unpack_f32(vf_vec16 v, float* f) { std::memcpy(f, &v, 16); }
static inline void vf_lds4(const vf_half* p, float* f) { for (int i = 0; i < 4; ++i) f[i] = (float)p[i]; }
static inline void vf_lds4(const float* p, float* f) { std::memcpy(f, p, 16); }
static inline float vf_shfl_xor(float v, int m) {          // every lane of the wave takes part
  vf_emu_barrier& wave = vf_emu_waves[threadIdx.x / VF_WAVE];
  vf_emu_lanes[threadIdx.x] = v;
  wave.arrive_and_wait();
  const float other = vf_emu_lanes[threadIdx.x ^ m];
  wave.arrive_and_wait();
  return other;
}
static inline float __shfl_xor_sync(unsigned, float v, int m) { return vf_shfl_xor(v, m); }
static inline int vf_shfl_xor_i(int v, int m) {            // the same for ints (the int8 GEMV's helpers)
  float f, o;
  std::memcpy(&f, &v, 4);
  o = vf_shfl_xor(f, m);
  std::memcpy(&v, &o, 4);
  return v;
}
// what the int8 GEMV's NVIDIA helpers use (codegen/prelude.py _NV_INT8)
struct int4 { int x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline float4 __ldcg(const float4* p) { float4 r; std::memcpy(&r, p, 16); return r; }
static inline int4 __ldg(const int4* p) { int4 r; std::memcpy(&r, p, 16); return r; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
  return c;
}
static inline float vf_dot_qk(float acc, const float* q, const vf_half* k) {
  for (int i = 0; i < 8; ++i) acc += q[i] * (float)k[i];
  return acc;
}
static inline float vf_dot_qk(float acc, const float* q, const float* k) {
  for (int i = 0; i < 4; ++i) acc += q[i] * k[i];
  return acc;
}
// the tiled matmul's fragments (codegen/mma.py), each lane computing its own elements: at wave 32 the
// layout of mma.sync (two n8 halves), at 64 gfx906's (lane l: row l % 16, columns l / 16 * 4 .. + 3)
#define VF_FRAG (256 / VF_WAVE)
static inline int vf_frag_row(int i) {
  return VF_WAVE == 32 ? threadIdx.x % 32 / 4 + (i & 2) * 4 : threadIdx.x % 16;
}
static inline int vf_frag_col(int i) {
  return VF_WAVE == 32 ? (i & 4) * 2 + threadIdx.x % 4 * 2 + (i & 1) : threadIdx.x % 64 / 16 * 4 + i;
}
static inline void vf_mma_tile(float* acc, const vf_half* a, int as, const vf_half* b, int bs, int kc) {
  for (int i = 0; i < VF_FRAG; ++i) {
    const vf_half* ar = a + vf_frag_row(i) * as;
    const vf_half* br = b + vf_frag_col(i) * bs;
    for (int k = 0; k < kc; ++k) acc[i] += (float)ar[k] * (float)br[k];
  }
}
// a GPU's 16-byte loads and stores need 16-byte aligned addresses (NVIDIA traps on others): counted here,
// read back through emulate_misaligned()
static std::atomic<int> vf_emu_misaligned{0};
extern "C" int emulate_misaligned() { return vf_emu_misaligned.exchange(0); }
static inline void vf_emu_align16(const void* p) { if ((size_t)p % 16) vf_emu_misaligned++; }
// the prelude's 16-byte copy of a float input into LDS (every 16-byte access checked); a macro, since
// VF_BLOCK is defined by the kernels that use it
#define vf_copy_f32(dst, src, n) vf_emu_copy_f32(dst, src, n, VF_BLOCK)
static inline void vf_emu_copy_f32(float* dst, const float* src, int n, int block) {
  for (int i = threadIdx.x; i < n / 4; i += block) {
    vf_emu_align16(dst + 4 * i);
    vf_emu_align16(src + 4 * i);
    std::memcpy(dst + 4 * i, src + 4 * i, 16);
  }
}
struct vf_h8 { vf_half h[8]; };
static inline vf_h8 vf_load8(const vf_half* w) { vf_emu_align16(w); vf_h8 v; std::memcpy(v.h, w, 16); return v; }
static inline vf_h8 vf_load8(const float* w) { vf_emu_align16(w); vf_h8 v; for (int i = 0; i < 8; ++i) v.h[i] = (vf_half)w[i]; return v; }
static inline void vf_store8(vf_half* dst, vf_h8 v) { vf_emu_align16(dst); std::memcpy(dst, v.h, 16); }
static inline void vf_load8f(float* v, const float* p) { vf_emu_align16(p); for (int i = 0; i < 8; ++i) v[i] = p[i]; }
static inline void vf_load8f(float* v, const vf_half* p) { vf_emu_align16(p); for (int i = 0; i < 8; ++i) v[i] = (float)p[i]; }
static inline vf_h8 vf_pack8(const float* v) { vf_h8 r; for (int i = 0; i < 8; ++i) r.h[i] = (vf_half)v[i]; return r; }
// a persistent kernel's ring (codegen/prelude.py RING): an mbarrier is one 64-bit word, its expected arrivals
// (bits 0-15), arrivals so far (16-31), bytes awaited (32-62) and phase parity (63); a bulk copy is a memcpy
// between its expected bytes and their completion
static inline void vf_mbar_init(unsigned long long* b, unsigned arrivals) { __atomic_store_n(b, arrivals, __ATOMIC_SEQ_CST); }
static inline void vf_mbar_update(unsigned long long* b, unsigned long long arrive, long long bytes) {
  unsigned long long v = __atomic_load_n(b, __ATOMIC_SEQ_CST), n;
  do {
    const unsigned long long expected = v & 0xffff, arrived = ((v >> 16) & 0xffff) + arrive;
    const long long tx = (long long)((v >> 32) & 0x7fffffff) + bytes;
    n = (v & (1ull << 63)) | (tx << 32) | (arrived << 16) | expected;
    if (arrived == expected && tx == 0) n = ((v & (1ull << 63)) ^ (1ull << 63)) | expected;   // the phase completes
  } while (!__atomic_compare_exchange_n(b, &v, n, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
}
static inline void vf_mbar_arrive(unsigned long long* b) { vf_mbar_update(b, 1, 0); }
static inline void vf_mbar_wait(unsigned long long* b, unsigned parity) {   // the others run until the phase completes
  while ((__atomic_load_n(b, __ATOMIC_SEQ_CST) >> 63) == parity) vf_emu_yield();
}
static inline void vf_bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  vf_emu_align16(dst);
  vf_emu_align16(src);
  vf_mbar_update(b, 1, bytes);
  std::memcpy(dst, src, bytes);
  vf_mbar_update(b, 0, -(long long)bytes);
}
static inline long long clock64() {   // nanoseconds (a traced persistent kernel's stamps)
  return std::chrono::steady_clock::now().time_since_epoch().count();
}
static inline void vf_all_threads_sync() { vf_emu_all->arrive_and_wait(); }
static inline void vf_mbar_init_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline void __syncwarp() { vf_emu_waves[threadIdx.x / VF_WAVE].arrive_and_wait(); }
// run KERNEL(ARGS) over `grid` workgroups of VF_ATT_BLOCK threads, in order or (after emulate_reversed(1))
// from the last to the first
static int vf_emu_reversed = 0;
#define VF_EMULATE(KERNEL, ...)                                                                    \
  extern "C" void emulate_reversed(int r) { vf_emu_reversed = r; }                                  \
  extern "C" void emulate(void** a, int grid) {                                                     \
    vf_emu_barrier block{VF_SYNC_THREADS}, all{VF_ATT_BLOCK};                                        \
    vf_emu_block = &block;                                                                          \
    vf_emu_all = &all;                                                                              \
    vf_emu_waves.assign(VF_ATT_BLOCK / VF_WAVE, vf_emu_barrier{VF_WAVE});                           \
    const vf_emu_stacks stacks(VF_ATT_BLOCK);                                                       \
    gridDim.x = grid;                                                                               \
    for (int b = 0; b < grid; ++b) {                                                               \
      blockIdx.x = vf_emu_reversed ? grid - 1 - b : b;                                              \
      vf_emu_run(VF_ATT_BLOCK, [](void* p) { void** a = (void**)p; KERNEL(__VA_ARGS__); }, a, stacks); \
    }                                                                                               \
  }
