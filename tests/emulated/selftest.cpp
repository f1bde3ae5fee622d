// Self-test of simt.h: small kernels that exercise the emulator, one case per run, driven by tests/test_emulator.py.
//
//   selftest <case> [forward|reverse|random] [seed]
//
// Exit status: 0 when the case ran and its own checks passed; 1 when a check failed (the mismatch is printed);
// 3 when the launch threw simt::Error (the message goes to stderr). Some cases print results that the Python side
// checks against its own model (shuffles, conversions, fp8, order).
#include "simt.h"  // first: the kernel headers then take its PA_SHARED / PA_EXTERN_SHARED

#include "../../csrc/cuda/cp_async.cuh"
#include "../../csrc/cuda/mma.cuh"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#if defined(__SANITIZE_THREAD__)
// TSan sleeps a second at exit when the program had threads (fibers count); nothing here needs that.
extern "C" const char* __tsan_default_options() { return "atexit_sleep_ms=0"; }
#endif

namespace {

// Reports a failed check and makes the case fail.
int g_failures = 0;
#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                              \
      std::fputc('\n', stderr);                                       \
      ++g_failures;                                                   \
    }                                                                 \
  } while (0)

// ---------------------------------------------------------------------------------------------------------------
// Shuffles: every combination of kind, width, mask and operand prints, per thread, the thread id it read (or -1
// for lanes outside the mask). The Python side checks them against its model of PTX shfl.sync.

enum ShuffleKind { kIdx, kUp, kDown, kXor };
const char* const kShuffleNames[] = {"idx", "up", "down", "xor"};

// A distinct value per thread id, and the id back from it; 64-bit types use their high bits.
template <typename T> struct Probe;
template <> struct Probe<float> {
  static constexpr const char* name = "float";
  static float make(int id) { return 0.5f + id; }
  static long long id(float v) { return static_cast<long long>(v - 0.5f); }
};
template <> struct Probe<double> {
  static constexpr const char* name = "double";
  static double make(int id) { return 1e10 + 0.25 + id; }
  static long long id(double v) { return static_cast<long long>(v - (1e10 + 0.25)); }
};
template <> struct Probe<int> {
  static constexpr const char* name = "int";
  static int make(int id) { return -1000 + id; }
  static long long id(int v) { return v + 1000; }
};
template <> struct Probe<unsigned> {
  static constexpr const char* name = "unsigned";
  static unsigned make(int id) { return 4000000000u + id; }
  static long long id(unsigned v) { return v - 4000000000u; }
};
template <> struct Probe<long long> {
  static constexpr const char* name = "long_long";
  static long long make(int id) { return (1LL << 40) + id; }
  static long long id(long long v) { return v - (1LL << 40); }
};
template <> struct Probe<__half> {
  static constexpr const char* name = "half";
  static __half make(int id) { return __float2half_rn(id - 64.0f); }
  static long long id(__half v) { return static_cast<long long>(__half2float(v)) + 64; }
};

template <typename T>
__global__ void shuffle_kernel(int kind, unsigned mask, int operand, int width, long long* out) {
  const int tid = threadIdx.x, lane = tid % 32;
  if (!(mask >> lane & 1u)) {  // lanes outside the mask take no part and exit at once
    out[tid] = -1;
    return;
  }
  const T v = Probe<T>::make(tid);
  T r = v;
  switch (kind) {
    case kIdx: r = __shfl_sync(mask, v, operand - lane, width); break;  // per-lane source, negative for some
    case kUp: r = __shfl_up_sync(mask, v, operand, width); break;
    case kDown: r = __shfl_down_sync(mask, v, operand, width); break;
    case kXor: r = __shfl_xor_sync(mask, v, operand, width); break;
  }
  out[tid] = Probe<T>::id(r);
}

// Prints "<type> <kind> <width> <mask> <operand>: <64 source ids>", or ": error <message>".
template <typename T>
void print_shuffles(const simt::Options& options, const std::vector<int>& widths, const std::vector<unsigned>& masks,
                    const std::vector<int>& operands) {
  for (int kind : {kIdx, kUp, kDown, kXor})
    for (int width : widths)
      for (unsigned mask : masks)
        for (int operand : operands) {
          std::vector<long long> out(64, -2);
          std::printf("%s %s %d 0x%08x %d:", Probe<T>::name, kShuffleNames[kind], width, mask, operand);
          try {
            simt::launch(options, shuffle_kernel<T>, dim3(1), dim3(64), 0, kind, mask, operand, width, out.data());
            for (long long id : out) std::printf(" %lld", id);
          } catch (const simt::Error& e) {
            std::printf(" error %s", e.what());
          }
          std::printf("\n");
        }
}

int shuffles(const simt::Options& options) {
  print_shuffles<int>(options, {32, 16, 8, 4, 2, 1}, {0xffffffffu, 0x0000ffffu, 0xffff0000u, 0x00ff00ffu, 0x0f0f0f0fu},
                      {0, 1, 3, 8, 17, 33});
  print_shuffles<float>(options, {32, 4}, {0xffffffffu}, {1, 5});
  print_shuffles<double>(options, {32, 4}, {0xffffffffu}, {1, 5});
  print_shuffles<unsigned>(options, {32, 4}, {0xffffffffu}, {1, 5});
  print_shuffles<long long>(options, {32, 4}, {0xffffffffu}, {1, 5});
  print_shuffles<__half>(options, {32, 4}, {0xffffffffu}, {1, 5});
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Votes: ballot/any/all over the whole warp, and over half of it while the other half does something else; the
// block-wide votes of __syncthreads_or / _and / _count.

__global__ void vote_kernel(unsigned* out) {  // [64][9]
  const int tid = threadIdx.x, lane = tid % 32;
  unsigned* o = out + 9 * tid;
  // block-wide votes: 1 = (true, false) each
  o[6] = __syncthreads_or(tid == 40);
  o[6] += 2 * __syncthreads_or(0);
  o[7] = __syncthreads_and(tid < 64);
  o[7] += 2 * __syncthreads_and(tid != 3);
  o[8] = __syncthreads_count(tid % 5 == 0);
  o[0] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  o[1] = __any_sync(0xffffffffu, tid == 40);  // true in warp 1 only
  o[2] = __all_sync(0xffffffffu, tid < 48);   // true in warp 0 only
  if (lane < 16) {
    o[3] = __ballot_sync(0x0000ffffu, lane & 1);
    o[4] = __all_sync(0x0000ffffu, lane < 16);
    o[5] = __any_sync(0x0000ffffu, lane == 99);
  } else {
    o[3] = __ballot_sync(0xffff0000u, lane >= 30);
    o[4] = __all_sync(0xffff0000u, lane != 20);
    o[5] = __any_sync(0xffff0000u, lane == 20);
  }
}

int votes(const simt::Options& options) {
  std::vector<unsigned> out(64 * 9);
  simt::launch(options, vote_kernel, dim3(1), dim3(64), 0, out.data());
  for (int tid = 0; tid < 64; ++tid) {
    const int lane = tid % 32, warp = tid / 32;
    const unsigned* o = &out[9 * tid];
    CHECK(o[6] == 1u, "thread %d __syncthreads_or %u", tid, o[6]);
    CHECK(o[7] == 1u, "thread %d __syncthreads_and %u", tid, o[7]);
    CHECK(o[8] == 13u, "thread %d __syncthreads_count %u", tid, o[8]);
    CHECK(o[0] == 0x49249249u, "thread %d ballot %08x", tid, o[0]);
    CHECK(o[1] == (warp == 1 ? 1u : 0u), "thread %d any %u", tid, o[1]);
    CHECK(o[2] == (warp == 0 ? 1u : 0u), "thread %d all %u", tid, o[2]);
    CHECK(o[3] == (lane < 16 ? 0x0000aaaau : 0xc0000000u), "thread %d half ballot %08x", tid, o[3]);
    CHECK(o[4] == (lane < 16 ? 1u : 0u), "thread %d half all %u", tid, o[4]);
    CHECK(o[5] == (lane < 16 ? 0u : 1u), "thread %d half any %u", tid, o[5]);
  }
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Block reductions on a 2-D block: a shared-memory tree with __syncthreads, and warp shuffles plus one barrier.

__global__ void block_reduce_kernel(const float* in, float* tree_out, float* warp_out) {  // block (16, 8)
  PA_SHARED(float, tree_s, [128]);
  PA_SHARED(float, partial_s, [4]);
  const int n = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
  const float v = in[blockIdx.x * n + tid];

  tree_s[tid] = v;
  __syncthreads();
  for (int stride = n / 2; stride > 0; stride /= 2) {
    if (tid < stride) tree_s[tid] += tree_s[tid + stride];
    __syncthreads();
  }
  if (tid == 0) tree_out[blockIdx.x] = tree_s[0];

  float w = v;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) w += __shfl_down_sync(0xffffffffu, w, offset);
  if (tid % 32 == 0) partial_s[tid / 32] = w;
  __syncthreads();
  if (tid < 32) {
    float total = tid < n / 32 ? partial_s[tid] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (tid == 0) warp_out[blockIdx.x] = total;
  }
}

int block_reduce(const simt::Options& options) {
  constexpr int kBlocks = 3, kThreads = 128;
  std::vector<float> in(kBlocks * kThreads), tree(kBlocks), warp(kBlocks);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i * 37) % 101) - 50.0f;  // exact sums
  simt::launch(options, block_reduce_kernel, dim3(kBlocks), dim3(16, 8), 0, in.data(), tree.data(), warp.data());
  for (int b = 0; b < kBlocks; ++b) {
    float expected = 0.0f;
    for (int t = 0; t < kThreads; ++t) expected += in[b * kThreads + t];
    CHECK(tree[b] == expected, "block %d tree %g expected %g", b, tree[b], expected);
    CHECK(warp[b] == expected, "block %d warp %g expected %g", b, warp[b], expected);
  }
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Warps that run different numbers of shuffles, and the two halves of a warp running different collectives under
// disjoint masks at the same time: legitimate, must pass.

__global__ void uneven_warps_kernel(int* out) {  // 96 threads: out [96][3]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int v = lane;
  for (int i = 0; i <= 2 * warp; ++i) v = __shfl_xor_sync(0xffffffffu, v, 1) + 1;  // warp w: 2w + 1 shuffles
  int half = lane;
  unsigned ballot = 0;
  if (warp == 0) {
    if (lane < 16) {
      for (int i = 0; i < 3; ++i) half = __shfl_down_sync(0x0000ffffu, half, 1, 16);
    } else {
      half = __shfl_up_sync(0xffff0000u, half, 2, 16);
      ballot = __ballot_sync(0xffff0000u, lane & 1);
    }
  }
  __syncthreads();
  out[3 * tid] = v, out[3 * tid + 1] = half, out[3 * tid + 2] = static_cast<int>(ballot);
}

int uneven_warps(const simt::Options& options) {
  std::vector<int> out(96 * 3);
  simt::launch(options, uneven_warps_kernel, dim3(1), dim3(96), 0, out.data());
  for (int tid = 0; tid < 96; ++tid) {
    const int warp = tid / 32, lane = tid % 32;
    CHECK(out[3 * tid] == (lane ^ 1) + 2 * warp + 1, "thread %d: %d", tid, out[3 * tid]);
    const int half = warp != 0 ? lane : lane < 16 ? std::min(lane + 3, 15) : lane - 2 >= 16 ? lane - 2 : lane;
    CHECK(out[3 * tid + 1] == half, "thread %d half %d expected %d", tid, out[3 * tid + 1], half);
    const int ballot = warp == 0 && lane >= 16 ? static_cast<int>(0xaaaa0000u) : 0;
    CHECK(out[3 * tid + 2] == ballot, "thread %d ballot %08x", tid, out[3 * tid + 2]);
  }
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Shared memory: NaN-filled at every block start (static and dynamic), one copy per block, shared by its threads.

constexpr int kDynamicBytes = 24;

__global__ void shared_poison_kernel(unsigned char* bytes, int* flags) {  // bytes [blocks][32 + 16 + 24]
  PA_SHARED(float, static_s, [8]);
  PA_SHARED(__half, half_s, [8]);
  PA_EXTERN_SHARED(unsigned char, dynamic_s);
  const int tid = threadIdx.x, b = blockIdx.x;
  // Read before any write: thread 0 copies what it finds, and tests it as floats.
  if (tid == 0) {
    unsigned char* o = bytes + b * (32 + 16 + kDynamicBytes);
    std::memcpy(o, static_s, 32);
    std::memcpy(o + 32, half_s, 16);
    std::memcpy(o + 48, dynamic_s, kDynamicBytes);
    flags[4 * b] = std::isnan(static_s[3]) && __hisnan(half_s[5]) && std::isnan(reinterpret_cast<float*>(dynamic_s)[1]);
  }
  __syncthreads();
  // The block's threads share one copy: the last thread writes, everybody reads it after the barrier.
  if (tid == 31) static_s[0] = 100.0f + b, dynamic_s[0] = static_cast<unsigned char>(b);
  __syncthreads();
  const bool seen = static_s[0] == 100.0f + b && dynamic_s[0] == b;
  if (tid == 0) flags[4 * b + 1] = 1;
  __syncthreads();
  if (!seen) flags[4 * b + 1] = 0;
  // The addresses are the same for every thread of the block.
  if (tid == 7) flags[4 * b + 2] = static_cast<int>(reinterpret_cast<uintptr_t>(&static_s[0]) & 0xfffffff);
  __syncthreads();
  const int address = static_cast<int>(reinterpret_cast<uintptr_t>(&static_s[0]) & 0xfffffff);
  if (tid == 0) flags[4 * b + 3] = flags[4 * b + 2] == address;
}

int shared_poison(const simt::Options& options) {
  constexpr int kBlocks = 4;
  std::vector<unsigned char> bytes(kBlocks * (32 + 16 + kDynamicBytes), 0);
  std::vector<int> flags(4 * kBlocks, -1);
  simt::launch(options, shared_poison_kernel, dim3(kBlocks), dim3(32), kDynamicBytes, bytes.data(), flags.data());
  for (size_t i = 0; i < bytes.size(); ++i) {
    CHECK(bytes[i] == 0xFF, "byte %zu of the blocks' shared memory: %02x", i, bytes[i]);
  }
  for (int b = 0; b < kBlocks; ++b) {
    CHECK(flags[4 * b] == 1, "block %d: unwritten shared memory is not NaN", b);
    CHECK(flags[4 * b + 1] == 1, "block %d: a thread did not see the block's shared write", b);
    CHECK(flags[4 * b + 3] == 1, "block %d: threads see different shared addresses", b);
  }
  return g_failures ? 1 : 0;
}

// A kernel that forgets to initialize its accumulator in shared memory: the NaN fill makes its result NaN.
__global__ void uninitialized_shared_kernel(float* out) {
  PA_SHARED(float, sum_s, [1]);  // BUG (on purpose): never set to 0
  __syncthreads();
  atomicAdd(&sum_s[0], 1.0f);
  __syncthreads();
  if (threadIdx.x == 0) *out = sum_s[0];
}

int uninitialized_shared(const simt::Options& options) {
  float out = 0.0f;
  simt::launch(options, uninitialized_shared_kernel, dim3(1), dim3(64), 0, &out);
  std::printf("result %g\n", out);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Atomics on global and shared memory from 3 blocks of 128 threads.

struct AtomicCounters {
  int i = 0;
  unsigned u = 0;
  unsigned long long ull = 0;
  float f = 0.0f, block_sums = 0.0f;
  double d = 0.0;
  int max = -1, min = 1, sub = 0, cas = -1, cas_winners = 0, exchanged = -1;
  unsigned long long exchanged_sum = 0;
};

__global__ void atomics_kernel(AtomicCounters* c) {
  PA_SHARED(float, block_sum_s, [1]);
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x == 0) block_sum_s[0] = 0.0f;
  __syncthreads();
  atomicAdd(&block_sum_s[0], 0.25f);
  atomicAdd(&c->i, 1);
  atomicAdd(&c->u, 2u);
  atomicAdd(&c->ull, 1ull << 33);
  atomicAdd(&c->f, 0.5f);
  atomicAdd(&c->d, 0.125);
  atomicMax(&c->max, gid);
  atomicMin(&c->min, -gid);
  atomicSub(&c->sub, 3);
  if (atomicCAS(&c->cas, -1, gid) == -1) atomicAdd(&c->cas_winners, 1);
  const int old = atomicExch(&c->exchanged, gid);
  atomicAdd(&c->exchanged_sum, static_cast<unsigned long long>(old + 1));
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(&c->block_sums, block_sum_s[0]);
}

int atomics(const simt::Options& options) {
  constexpr int kBlocks = 3, kThreads = 128, n = kBlocks * kThreads;
  AtomicCounters c;
  simt::launch(options, atomics_kernel, dim3(kBlocks), dim3(kThreads), 0, &c);
  CHECK(c.i == n, "%d", c.i);
  CHECK(c.u == 2u * n, "%u", c.u);
  CHECK(c.ull == (1ull << 33) * n, "%llu", c.ull);
  CHECK(c.f == 0.5f * n, "%g", c.f);
  CHECK(c.d == 0.125 * n, "%g", c.d);
  CHECK(c.block_sums == 0.25f * n, "%g", c.block_sums);
  CHECK(c.max == n - 1 && c.min == -(n - 1), "%d %d", c.max, c.min);
  CHECK(c.sub == -3 * n, "%d", c.sub);
  CHECK(c.cas_winners == 1 && c.cas >= 0, "%d winners, %d", c.cas_winners, c.cas);
  // Every old value (the initial -1 and all ids but the last one written) comes back exactly once.
  const unsigned long long all_ids = static_cast<unsigned long long>(n) * (n + 1) / 2;  // sum of id + 1
  CHECK(c.exchanged_sum + c.exchanged + 1 == all_ids, "%llu + %d", c.exchanged_sum, c.exchanged);
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Vector types keep their alignment everywhere: globals, shared memory, the fiber stacks.

static_assert(alignof(uint4) == 16 && alignof(float4) == 16 && sizeof(uint4) == 16, "16-byte vectors");
static_assert(alignof(uint2) == 8 && alignof(float2) == 8 && sizeof(float2) == 8, "8-byte vectors");
static_assert(alignof(__half2) == 4 && alignof(__nv_bfloat162) == 4, "paired halves");

bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

__global__ void alignment_kernel(const uint4* in, float* out, int* ok) {  // 32 threads; out [32][8]
  PA_SHARED(char, odd_s, [3]);
  PA_SHARED(uint4, vec_s, [32]);
  PA_SHARED(float2, pair_s, [3]);
  PA_EXTERN_SHARED(float4, dynamic_s);
  const int tid = threadIdx.x;
  uint4 local[3];
  float2 local_pair;
  if (tid < 3) odd_s[tid] = 0;
  vec_s[tid] = in[tid];  // 16-byte loads and stores
  __syncthreads();
  local[tid % 3] = vec_s[(tid + 1) % 32];
  // Read a vector as 8 halves, the way the attention kernel does.
  const __half2* h = reinterpret_cast<const __half2*>(&local[tid % 3]);
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(h[k]);
    out[8 * tid + 2 * k] = f.x, out[8 * tid + 2 * k + 1] = f.y;
  }
  local_pair = make_float2(1.0f, 2.0f);
  if (tid < 3) pair_s[tid] = local_pair;
  ok[tid] = aligned(vec_s, 16) && aligned(dynamic_s, 16) && aligned(pair_s, 8) && aligned(&local[tid % 3], 16) &&
            aligned(&local_pair, 8);
}

int alignment(const simt::Options& options) {
  alignas(16) uint4 in[32];
  std::vector<__half> halves(8 * 32);
  for (int i = 0; i < 8 * 32; ++i) halves[i] = __float2half_rn(i * 0.5f - 40.0f);
  std::memcpy(in, halves.data(), sizeof in);
  std::vector<float> out(8 * 32);
  std::vector<int> ok(32, 0);
  simt::launch(options, alignment_kernel, dim3(1), dim3(32), 64, in, out.data(), ok.data());
  for (int t = 0; t < 32; ++t) {
    CHECK(ok[t] == 1, "thread %d saw a misaligned vector", t);
    for (int k = 0; k < 8; ++k) {
      const float expected = __half2float(halves[8 * ((t + 1) % 32) + k]);
      CHECK(out[8 * t + k] == expected, "thread %d element %d: %g expected %g", t, k, out[8 * t + k], expected);
    }
  }
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// __syncwarp orders memory between the lanes of a warp (no race under TSan); a shuffle does not.

__global__ void syncwarp_exchange_kernel(int* out) {  // 64 threads
  PA_SHARED(int, buf_s, [64]);
  const int tid = threadIdx.x, lane = tid % 32, base = tid - lane;
  buf_s[tid] = 3 * tid;
  __syncwarp();
  const int neighbor = buf_s[base + (lane + 1) % 32];
  __syncwarp();
  buf_s[tid] = neighbor;  // overwrites what a neighbor has just read: ordered by the second __syncwarp
  __syncwarp();
  out[tid] = buf_s[base + (lane + 31) % 32];
}

int syncwarp_exchange(const simt::Options& options) {
  std::vector<int> out(64);
  simt::launch(options, syncwarp_exchange_kernel, dim3(1), dim3(64), 0, out.data());
  for (int t = 0; t < 64; ++t) CHECK(out[t] == 3 * t, "thread %d: %d", t, out[t]);
  return g_failures ? 1 : 0;
}

__global__ void race_over_shuffle_kernel(int* out) {  // 32 threads
  PA_SHARED(int, buf_s, [32]);
  const int lane = threadIdx.x;
  buf_s[lane] = lane;
  const int token = __shfl_xor_sync(0xffffffffu, lane, 1);  // exchanges a value, orders no memory
  out[lane] = buf_s[token];  // BUG (on purpose): reads a neighbor's write without __syncwarp
}

int race_over_shuffle(const simt::Options& options) {
  std::vector<int> out(32);
  simt::launch(options, race_over_shuffle_kernel, dim3(1), dim3(32), 0, out.data());
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Order: the last writer to one shared slot wins, so the answer depends on the thread order; blocks record the
// order in which they ran.

__global__ void last_writer_kernel(int* winner, int* position, int* counter) {
  PA_SHARED(int, slot_s, [1]);
  slot_s[0] = threadIdx.x;  // BUG (on purpose): every thread writes the one slot
  __syncthreads();
  if (threadIdx.x == 0) winner[blockIdx.x] = slot_s[0], position[blockIdx.x] = atomicAdd(counter, 1);
}

int order(const simt::Options& options) {
  constexpr int kBlocks = 5;
  std::vector<int> winner(kBlocks), position(kBlocks);
  int counter = 0;
  simt::launch(options, last_writer_kernel, dim3(kBlocks), dim3(64), 0, winner.data(), position.data(), &counter);
  std::printf("winners");
  for (int w : winner) std::printf(" %d", w);
  std::printf("\npositions");
  for (int p : position) std::printf(" %d", p);
  std::printf("\n");
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Launch limits: each refused launch prints its message; the limits themselves are accepted.

__global__ void empty_kernel() {}

__global__ void big_static_kernel() {
  PA_SHARED(float, big_s, [12 * 1024 + 1]);  // 48 KiB + 4 bytes
  big_s[0] = 0.0f;
}

__global__ void static_plus_dynamic_kernel() {
  PA_SHARED(float, s, [8 * 1024]);  // 32 KiB, plus the launch's dynamic bytes
  s[threadIdx.x] = 0.0f;
}

int launch_limits(const simt::Options& options) {
  auto refused = [&](const char* what, auto kernel, dim3 grid, dim3 block, size_t dynamic_bytes) {
    try {
      simt::launch(options, kernel, grid, block, dynamic_bytes);
      CHECK(false, "%s was accepted", what);
    } catch (const simt::Error& e) {
      std::printf("%s: %s\n", what, e.what());
    }
  };
  refused("block_1025", empty_kernel, dim3(1), dim3(1025), 0);
  refused("block_32x32x2", empty_kernel, dim3(1), dim3(32, 32, 2), 0);
  refused("block_z_65", empty_kernel, dim3(1), dim3(1, 1, 65), 0);
  refused("grid_x_2^31", empty_kernel, dim3(0x80000000u), dim3(1), 0);
  refused("grid_y_65536", empty_kernel, dim3(1, 65536), dim3(1), 0);
  refused("grid_z_65536", empty_kernel, dim3(1, 1, 65536), dim3(1), 0);
  refused("grid_x_0", empty_kernel, dim3(0), dim3(1), 0);
  refused("dynamic_shared", empty_kernel, dim3(1), dim3(1), simt::kMaxSharedBytes + 1);
  refused("static_shared", big_static_kernel, dim3(1), dim3(1), 0);
  refused("static_plus_dynamic", static_plus_dynamic_kernel, dim3(1), dim3(32), simt::kMaxSharedBytes - 32 * 1024 + 1);
  // At the limits: accepted.
  simt::launch(options, empty_kernel, dim3(2, 1, 1), dim3(1024), 0);
  simt::launch(options, empty_kernel, dim3(1), dim3(1, 1, 64), 0);
  simt::launch(options, static_plus_dynamic_kernel, dim3(1), dim3(32), simt::kMaxSharedBytes - 32 * 1024);
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Host conversions (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h compiled by g++). The Python side checks them with torch.

// stdin: float32 bit patterns in hex, one a line. stdout per line, all hex:
//   f32 half(rn) bf16(rn) f32(half) f32(bf16) fp8e4m3 fp8e5m2
// e4m3 saturates finite overflow to 448 and e5m2 overflows to infinity, as torch's conversions do.
int conversions(const simt::Options&) {
  unsigned bits;
  while (std::scanf("%x", &bits) == 1) {
    float x;
    std::memcpy(&x, &bits, 4);
    const __half h = __float2half_rn(x);
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    // The paired conversions agree with the scalar ones.
    const __half2 h2 = __floats2half2_rn(x, -x);
    const __nv_bfloat162 b2 = __float22bfloat162_rn(make_float2(x, -x));
    const float hf = __half2float(h), bf = __bfloat162float(b);
    CHECK(__half_as_ushort(h2.x) == __half_as_ushort(h) &&
              __half_as_ushort(h2.y) == __half_as_ushort(__float2half_rn(-x)),
          "half2 of %08x", bits);
    CHECK(__bfloat16_as_ushort(b2.x) == __bfloat16_as_ushort(b), "bfloat162 of %08x", bits);
    const float2 hf2 = __half22float2(h2), bf2 = __bfloat1622float2(b2);
    CHECK(std::memcmp(&hf2.x, &hf, 4) == 0 && std::memcmp(&bf2.x, &bf, 4) == 0, "x2 back of %08x", bits);
    unsigned hf_bits, bf_bits;
    std::memcpy(&hf_bits, &hf, 4);
    std::memcpy(&bf_bits, &bf, 4);
    std::printf("%08x %04x %04x %08x %08x %02x %02x\n", bits, __half_as_ushort(h), __bfloat16_as_ushort(b), hf_bits,
                bf_bits, __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3),
                __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2));
  }
  return g_failures ? 1 : 0;
}

// Every 16-bit pattern decoded as half and as bfloat16, and every fp8 byte decoded (to half) as e4m3 and e5m2:
//   "h <bits> <f32 of half> <f32 of bf16>" and "f8 <byte> <half of e4m3> <half of e5m2>" (hex).
int decodes(const simt::Options&) {
  for (unsigned bits = 0; bits < 65536; ++bits) {
    const float hf = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    const float bf = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
    unsigned hf_bits, bf_bits;
    std::memcpy(&hf_bits, &hf, 4);
    std::memcpy(&bf_bits, &bf, 4);
    std::printf("h %04x %08x %08x\n", bits, hf_bits, bf_bits);
  }
  for (unsigned byte = 0; byte < 256; ++byte) {
    const __half_raw e4m3 = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
    const __half_raw e5m2 = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E5M2);
    // The paired decode (the one the kernels will use) agrees with the single one, in both halves.
    const auto two_bytes = static_cast<__nv_fp8x2_storage_t>(byte << 8 | (255 - byte));
    const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(two_bytes, __NV_E4M3);
    const __half_raw other = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(255 - byte), __NV_E4M3);
    CHECK(pair.x == other.x && pair.y == e4m3.x, "fp8x2 of %02x", byte);
    std::printf("f8 %02x %04x %04x\n", byte, e4m3.x, e5m2.x);
  }
  return g_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Errors the emulator must report (each case is expected to exit with status 3 and a message).

__global__ void barrier_skipped_kernel(int* out) {
  if (threadIdx.x != 5) __syncthreads();  // BUG: thread 5 skips the first barrier...
  __syncthreads();                        // ...and meets the others' second one
  out[threadIdx.x] = 1;
}
__global__ void barrier_two_sites_kernel(int* out) {
  if (threadIdx.x < 32) {
    out[threadIdx.x] = 1;
    __syncthreads();  // BUG: two barriers, one per branch
  } else {
    __syncthreads();
  }
}
__global__ void barrier_early_return_kernel(int* out, int n) {
  if (static_cast<int>(threadIdx.x) >= n) return;  // BUG: returns before the barrier the others wait at
  out[threadIdx.x] = 1;
  __syncthreads();
}
__global__ void shuffle_divergent_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // BUG: full mask in a divergent branch
  out[threadIdx.x] = v;
}
__global__ void different_collectives_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 2 == 0) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);  // BUG: odd lanes run another collective
  } else {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}
__global__ void mismatched_masks_kernel(int* out) {
  const unsigned mask = threadIdx.x % 32 < 16 ? 0xffffffffu : 0xffff0000u;  // BUG: the lanes disagree
  out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<int>(threadIdx.x), 1);
}
__global__ void collective_vs_barrier_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x == 0) {
    __syncthreads();  // BUG: lane 0 leaves its warp's shuffle for a barrier
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}
__global__ void read_outside_mask_kernel(int* out) {
  if (threadIdx.x >= 16) return;  // lanes 16-31 are not in the mask: fine
  // BUG: lanes 8-15 read lanes 16-23, which are not in the mask.
  out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 8);
}
__global__ void mask_without_self_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  const unsigned mask = 1u << (lane == 3 ? 0 : lane);  // every lane alone; BUG: lane 3 names lane 0 instead
  out[threadIdx.x] = __shfl_sync(mask, lane, lane);
}
__global__ void partial_warp_full_mask_kernel(int* out) {  // 48 threads: warp 1 has lanes 0-15 only
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);  // BUG: names lanes 16-31
}
__global__ void bad_width_kernel(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1, 12);  // BUG: not a power of 2
}

template <typename... Params, typename... Args>
int run_error_kernel(const simt::Options& options, void (*kernel)(Params...), int threads, Args... args) {
  std::vector<int> out(threads);
  simt::launch(options, kernel, dim3(2), dim3(threads), 0, out.data(), args...);
  std::printf("no error was reported\n");
  return 1;
}

// ---------------------------------------------------------------------------------------------------------------
// nvcuda::wmma: D = A * B + C for half and bfloat16 inputs, A and B in row- or column-major memory, through shared
// memory, with leading dimensions wider than the matrix; fill_fragment; every element checked against the same sum
// on the host. Two warps, each its own matrices.

constexpr int kLd = 24;  // leading dimension of the inputs (a multiple of 8 elements, not 16)

template <typename T>
struct alignas(32) WmmaInputs {  // 256-bit aligned, as load_matrix_sync requires
  T a[16 * kLd], b[16 * kLd];
};

template <typename T, typename LayoutA, typename LayoutB>
__global__ void wmma_kernel(const WmmaInputs<T>* in, const float* c, float* d_row, float* d_col, float* filled) {
  namespace wmma = nvcuda::wmma;
  PA_SHARED(WmmaInputs<T>, in_s, [2]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = lane; i < 16 * kLd; i += 32) in_s[warp].a[i] = in[warp].a[i], in_s[warp].b[i] = in[warp].b[i];
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc, ones;
  wmma::load_matrix_sync(a, in_s[warp].a, kLd);
  wmma::load_matrix_sync(b, in_s[warp].b, kLd);
  wmma::load_matrix_sync(acc, c + 256 * warp, 16, wmma::mem_row_major);
  wmma::mma_sync(acc, a, b, acc);
  wmma::store_matrix_sync(d_row + 256 * warp, acc, 16, wmma::mem_row_major);
  wmma::store_matrix_sync(d_col + 256 * warp, acc, 16, wmma::mem_col_major);
  wmma::fill_fragment(ones, 0.5f);
  wmma::store_matrix_sync(filled + 256 * warp, ones, 16, wmma::mem_row_major);
}

template <typename T, typename LayoutA, typename LayoutB>
int wmma_case(const simt::Options& options, const char* name) {
  constexpr bool a_col = std::is_same_v<LayoutA, nvcuda::wmma::col_major>;
  constexpr bool b_col = std::is_same_v<LayoutB, nvcuda::wmma::col_major>;
  struct alignas(32) Matrices {  // two 16 x 16 float matrices, one per warp
    float x[2 * 256];
    float& operator[](int i) { return x[i]; }
  };
  std::vector<WmmaInputs<T>> in(2);
  std::vector<float> a(2 * 256), b(2 * 256);
  std::vector<Matrices> matrices(4);
  Matrices &c = matrices[0], &d_row = matrices[1], &d_col = matrices[2], &filled = matrices[3];
  for (int w = 0; w < 2; ++w) {
    for (int i = 0; i < 16 * kLd; ++i) in[w].a[i] = in[w].b[i] = T(-1.0f);  // padding, never read
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 16; ++k) {
        // small integers and halves: exact in half and bfloat16
        const float x = static_cast<float>((r * 7 + k * 3 + w) % 11 - 5) * 0.5f;
        const float y = static_cast<float>((r * 5 + k * 9 + 2 * w) % 13 - 6) * 0.25f;
        a[256 * w + 16 * r + k] = x, b[256 * w + 16 * r + k] = y;  // A[r][k], B[r][k] (row r of B is its k)
        in[w].a[a_col ? k * kLd + r : r * kLd + k] = T(x);
        in[w].b[b_col ? k * kLd + r : r * kLd + k] = T(y);
        c[256 * w + 16 * r + k] = static_cast<float>(r - k) * 0.125f;
      }
    }
  }
  simt::launch(options, wmma_kernel<T, LayoutA, LayoutB>, dim3(1), dim3(64), 0, in.data(), c.x, d_row.x, d_col.x,
               filled.x);
  for (int w = 0; w < 2; ++w) {
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 16; ++n) {
        float sum = c[256 * w + 16 * m + n];
        for (int k = 0; k < 16; ++k) sum = fmaf(a[256 * w + 16 * m + k], b[256 * w + 16 * k + n], sum);
        CHECK(d_row[256 * w + 16 * m + n] == sum, "%s warp %d D[%d][%d] = %g, expected %g", name, w, m, n,
              d_row[256 * w + 16 * m + n], sum);
        CHECK(d_col[256 * w + 16 * n + m] == sum, "%s warp %d column-major D[%d][%d]", name, w, m, n);
        CHECK(filled[256 * w + 16 * m + n] == 0.5f, "%s warp %d filled[%d][%d]", name, w, m, n);
      }
    }
  }
  return 0;
}

int wmma(const simt::Options& options) {
  using nvcuda::wmma::col_major;
  using nvcuda::wmma::row_major;
  wmma_case<__half, row_major, row_major>(options, "half row/row");
  wmma_case<__half, row_major, col_major>(options, "half row/col");
  wmma_case<__half, col_major, row_major>(options, "half col/row");
  wmma_case<__nv_bfloat16, row_major, col_major>(options, "bf16 row/col");
  wmma_case<__nv_bfloat16, col_major, col_major>(options, "bf16 col/col");
  return g_failures == 0 ? 0 : 1;
}

// Errors: every lane must take part, with the same arguments, and the pointer and ldm must suit the hardware.
struct alignas(32) HalfTile {
  __half x[16 * 32];
};

__global__ void wmma_divergent_kernel(int*) {  // only half the warp loads
  PA_SHARED(HalfTile, tile_s, [1]);
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> a;
  if (threadIdx.x % 32 < 16) nvcuda::wmma::load_matrix_sync(a, tile_s[0].x, 16);
}
__global__ void wmma_pointer_mismatch_kernel(int*) {  // lane 5 loads another tile
  PA_SHARED(HalfTile, tile_s, [1]);
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major> b;
  nvcuda::wmma::load_matrix_sync(b, tile_s[0].x + (threadIdx.x % 32 == 5 ? 16 : 0), 32);
}
__global__ void wmma_misaligned_kernel(int*) {  // 16 bytes past a 32-byte boundary
  PA_SHARED(HalfTile, tile_s, [1]);
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> a;
  nvcuda::wmma::load_matrix_sync(a, tile_s[0].x + 8, 16);
}
__global__ void wmma_bad_ldm_kernel(int*) {  // ldm 12 halves: 24 bytes
  PA_SHARED(HalfTile, tile_s, [1]);
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> a;
  nvcuda::wmma::load_matrix_sync(a, tile_s[0].x, 12);
}
__global__ void wmma_fill_nonuniform_kernel(int*) {  // a value per lane: the layout is unspecified
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  nvcuda::wmma::fill_fragment(acc, static_cast<float>(threadIdx.x % 32));
}
__global__ void wmma_mma_vs_shuffle_kernel(int* out) {  // lane 0 shuffles while the others multiply
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> a;
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::row_major> b;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  for (auto& x : a.x) x = __float2half(1.0f);
  for (auto& x : b.x) x = __float2half(1.0f);
  for (auto& x : acc.x) x = 0.0f;
  if (threadIdx.x % 32 == 0) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
  } else {
    nvcuda::wmma::mma_sync(acc, a, b, acc);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// ldmatrix, movmatrix and mma.sync m16n8k16 (csrc/cuda/mma.cuh): each lane's fragment holds exactly the elements
// that mma.cuh's opening comment (the PTX ISA's layouts) gives it, computed here on the host from those formulas;
// products through them match float64 sums, for half and bfloat16, and so does a chain like attention's
// (S = K Q^T, P = S rounded, O^T = V^T P^T). Two warps, each its own matrices.

constexpr int kTileLd = 24;  // row stride of a 16 x 16 tile of 16-bit elements: 48 bytes, rows 16-byte aligned

struct alignas(16) Tile16 {
  uint16_t x[16 * kTileLd];
  uint16_t& at(int r, int c) { return x[r * kTileLd + c]; }
};

// The row lane `lane` passes to ldmatrix_x4 for a tile's four 8 x 8 quadrants, matrix i = rows 8 (i % 2), columns
// 8 (i / 2): the order of the A fragment (a[1] rows g + 8, a[2] columns 2t + 8).
__device__ uint16_t* quadrant_row(uint16_t* tile, int lane) {
  const int matrix = lane / 8, row = lane % 8;
  return tile + (8 * (matrix % 2) + row) * kTileLd + 8 * (matrix / 2);
}

inline uint32_t pair(uint32_t low, uint32_t high) { return low | high << 16; }

__global__ void mma_layout_kernel(const Tile16* in, uint32_t* out) {  // 64 threads; out [64][13]
  PA_SHARED(Tile16, tile_s, [2]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * kTileLd; i += 32) tile_s[warp].x[i] = in[warp].x[i];
  __syncwarp();
  uint32_t r[4], rt[4];
  paged_attn::ldmatrix_x4(r, quadrant_row(tile_s[warp].x, lane));
  paged_attn::ldmatrix_x4_trans(rt, quadrant_row(tile_s[warp].x, lane));
  uint32_t* o = out + 13 * threadIdx.x;
  for (int i = 0; i < 4; ++i) o[i] = r[i], o[4 + i] = rt[i];
  // An 8 x 8 matrix of codes 0x100 w + 16 row + column, held as (row g, columns 2t, 2t + 1), transposed.
  const uint32_t code = 0x100u * warp + 16u * g + 2u * t;
  o[8] = paged_attn::movmatrix_trans(pair(code, code + 1));
  // movmatrix of a ldmatrix fragment is the ldmatrix_trans fragment.
  for (int i = 0; i < 4; ++i) o[9 + i] = paged_attn::movmatrix_trans(r[i]);
}

int mma_layout(const simt::Options& options) {
  std::vector<Tile16> in(2);
  for (int w = 0; w < 2; ++w) {
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < kTileLd; ++c) in[w].at(r, c) = c < 16 ? 0x1000 * w + 0x40 * r + c : 0xFFFF;  // distinct
    }
  }
  std::vector<uint32_t> out(64 * 13);
  simt::launch(options, mma_layout_kernel, dim3(1), dim3(64), 0, in.data(), out.data());
  for (int tid = 0; tid < 64; ++tid) {
    const int w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const uint32_t* o = &out[13 * tid];
    const auto element = [&](int i, int r, int c) -> uint32_t { return in[w].at(8 * (i % 2) + r, 8 * (i / 2) + c); };
    for (int i = 0; i < 4; ++i) {
      const uint32_t want = pair(element(i, g, 2 * t), element(i, g, 2 * t + 1));  // (row g, columns 2t, 2t + 1)
      const uint32_t want_trans = pair(element(i, 2 * t, g), element(i, 2 * t + 1, g));  // (rows 2t, 2t + 1, col g)
      CHECK(o[i] == want, "thread %d ldmatrix r[%d] = %08x, expected %08x", tid, i, o[i], want);
      CHECK(o[4 + i] == want_trans, "thread %d ldmatrix_trans r[%d] = %08x, expected %08x", tid, i, o[4 + i],
            want_trans);
      CHECK(o[9 + i] == want_trans, "thread %d movmatrix(r[%d]) = %08x, expected %08x", tid, i, o[9 + i], want_trans);
    }
    const uint32_t want = pair(0x100u * w + 16u * (2 * t) + g, 0x100u * w + 16u * (2 * t + 1) + g);
    CHECK(o[8] == want, "thread %d movmatrix = %08x, expected %08x", tid, o[8], want);
  }
  return g_failures ? 1 : 0;
}

// 16-bit elements: a float rounded to T, as bits, and back.
template <typename T>
uint16_t to_bits16(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half_as_ushort(__float2half_rn(x));
  } else {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}
template <typename T>
float from_bits16(uint16_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
}

// Random elements in [-2, 2) (a linear congruential generator), rounded to T: the tile's bits and their values.
template <typename T>
struct RandomTile {
  Tile16 bits;
  float value[16][16];
  explicit RandomTile(uint32_t seed) {
    for (int i = 0; i < 16 * kTileLd; ++i) bits.x[i] = 0xFFFF;  // padding: NaN, never read
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) {
        seed = seed * 1664525u + 1013904223u;
        bits.at(r, c) = to_bits16<T>(static_cast<float>(seed >> 8) / (1 << 24) * 4.0f - 2.0f);
        value[r][c] = from_bits16<T>(bits.at(r, c));
      }
    }
  }
};

// |got - want| within 1e-5 of the sum of the magnitudes of the terms: float sums of exact float products.
bool close(float got, double want, double magnitude) { return std::fabs(got - want) <= 1e-5 * magnitude + 1e-30; }

struct GemmTiles {
  Tile16 a, b, bt;  // A (m x k), B (k x n) and B^T (n x k), row-major
  float c[16][16];
};

// D = A B + C (16 x 16 x 16 as two n-tiles of 8): A by ldmatrix_x4, B by ldmatrix_x4_trans from row-major memory
// and again by ldmatrix_x4 from its transpose (the B fragment is column-major), C and D in the C layout.
template <typename T>
__global__ void mma_gemm_kernel(const GemmTiles* in, float* d_out) {  // 64 threads; d_out [2 warps][2][16][16]
  PA_SHARED(Tile16, tiles_s, [2][3]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * kTileLd; i += 32) {
    tiles_s[warp][0].x[i] = in[warp].a.x[i], tiles_s[warp][1].x[i] = in[warp].b.x[i];
    tiles_s[warp][2].x[i] = in[warp].bt.x[i];
  }
  __syncwarp();
  uint32_t a[4], b[4], bt[4];
  paged_attn::ldmatrix_x4(a, quadrant_row(tiles_s[warp][0].x, lane));
  paged_attn::ldmatrix_x4_trans(b, quadrant_row(tiles_s[warp][1].x, lane));  // n-tile j: b[2j], b[2j + 1]
  paged_attn::ldmatrix_x4(bt, quadrant_row(tiles_s[warp][2].x, lane));       // n-tile j: bt[j], bt[j + 2]
  for (int j = 0; j < 2; ++j) {
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) c[i] = in[warp].c[g + 8 * (i / 2)][8 * j + 2 * t + i % 2];
    const uint32_t b_j[2] = {b[2 * j], b[2 * j + 1]}, bt_j[2] = {bt[j], bt[j + 2]};
    paged_attn::mma_m16n8k16<T>(d, a, b_j, c);
    paged_attn::mma_m16n8k16<T>(c, a, bt_j, c);  // in place: D = C
    for (int i = 0; i < 4; ++i) {
      const int m = g + 8 * (i / 2), n = 8 * j + 2 * t + i % 2;
      d_out[((2 * warp + 0) * 16 + m) * 16 + n] = d[i];
      d_out[((2 * warp + 1) * 16 + m) * 16 + n] = c[i];
    }
  }
}

template <typename T>
void mma_gemm(const simt::Options& options, const char* name) {
  std::vector<GemmTiles> in(2);
  std::vector<RandomTile<T>> a, b;
  for (int w = 0; w < 2; ++w) {
    a.emplace_back(11u + 2 * w), b.emplace_back(12u + 2 * w);
    in[w].a = a[w].bits, in[w].b = b[w].bits;
    for (int i = 0; i < 16 * kTileLd; ++i) in[w].bt.x[i] = 0xFFFF;
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) in[w].bt.at(c, r) = b[w].bits.at(r, c), in[w].c[r][c] = 0.375f * (r - c) + w;
    }
  }
  std::vector<float> d(2 * 2 * 256);
  simt::launch(options, mma_gemm_kernel<T>, dim3(1), dim3(64), 0, in.data(), d.data());
  for (int w = 0; w < 2; ++w) {
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 16; ++n) {
        double want = in[w].c[m][n], magnitude = std::fabs(want);
        for (int k = 0; k < 16; ++k) {
          want += static_cast<double>(a[w].value[m][k]) * b[w].value[k][n];
          magnitude += std::fabs(static_cast<double>(a[w].value[m][k]) * b[w].value[k][n]);
        }
        for (int way = 0; way < 2; ++way) {
          const float got = d[((2 * w + way) * 16 + m) * 16 + n];
          CHECK(close(got, want, magnitude), "%s warp %d %s D[%d][%d] = %.9g, expected %.9g", name, w,
                way ? "(B^T, in place)" : "(B)", m, n, got, want);
        }
      }
    }
  }
}

struct ChainTiles {
  Tile16 k, q, v;  // K (16 keys x 16 dims), Q (rows 0-7: 8 queries x 16 dims; rows 8-15 unused), V (keys x dims)
};

// Attention's chain: S = K Q^T (keys x queries: A = K, and the B fragment of Q^T is Q's by ldmatrix_x4); P = S
// rounded to T; O^T = V^T P^T (dims x queries): A = V^T by ldmatrix_x4_trans of V (its quadrants reordered), and P^T =
// S's C fragment, whose 8 x 8 blocks (rows g, columns 2t, 2t + 1) movmatrix turns into the B layout.
template <typename T>
__global__ void mma_chain_kernel(const ChainTiles* in, float* s_out, float* o_out) {  // s [2][16][8], o [2][8][16]
  PA_SHARED(ChainTiles, tiles_s, [2]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * kTileLd; i += 32) {
    tiles_s[warp].k.x[i] = in[warp].k.x[i], tiles_s[warp].q.x[i] = in[warp].q.x[i];
    tiles_s[warp].v.x[i] = in[warp].v.x[i];
  }
  __syncwarp();
  uint32_t k[4], q[4], v[4];
  paged_attn::ldmatrix_x4(k, quadrant_row(tiles_s[warp].k.x, lane));
  paged_attn::ldmatrix_x4(q, quadrant_row(tiles_s[warp].q.x, lane));  // q[0], q[2]: queries 0-7, dims 0-7, 8-15
  paged_attn::ldmatrix_x4_trans(v, quadrant_row(tiles_s[warp].v.x, lane));
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint32_t q_b[2] = {q[0], q[2]};
  float s[4];
  paged_attn::mma_m16n8k16<T>(s, k, q_b, zero);
  for (int i = 0; i < 4; ++i) s_out[(warp * 16 + g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = s[i];
  const uint32_t p[2] = {paged_attn::movmatrix_trans(paged_attn::pack2<T>(s[0], s[1])),
                         paged_attn::movmatrix_trans(paged_attn::pack2<T>(s[2], s[3]))};
  const uint32_t v_a[4] = {v[0], v[2], v[1], v[3]};  // a[1] (dims 8-15, keys 0-7): V's quadrant 2 (keys 0-7, dims 8-15)
  float o[4];
  paged_attn::mma_m16n8k16<T>(o, v_a, p, zero);
  for (int i = 0; i < 4; ++i) o_out[(warp * 8 + 2 * t + i % 2) * 16 + g + 8 * (i / 2)] = o[i];
}

template <typename T>
void mma_chain(const simt::Options& options, const char* name) {
  std::vector<ChainTiles> in(2);
  std::vector<RandomTile<T>> k, q, v;
  for (int w = 0; w < 2; ++w) {
    k.emplace_back(21u + 3 * w), q.emplace_back(22u + 3 * w), v.emplace_back(23u + 3 * w);
    in[w] = ChainTiles{k[w].bits, q[w].bits, v[w].bits};
  }
  std::vector<float> s(2 * 16 * 8), o(2 * 8 * 16);
  simt::launch(options, mma_chain_kernel<T>, dim3(1), dim3(64), 0, in.data(), s.data(), o.data());
  for (int w = 0; w < 2; ++w) {
    float p[16][8];  // the kernel's S rounded to T, as pack2 rounds
    for (int key = 0; key < 16; ++key) {
      for (int query = 0; query < 8; ++query) {
        double want = 0.0, magnitude = 0.0;
        for (int dim = 0; dim < 16; ++dim) {
          want += static_cast<double>(k[w].value[key][dim]) * q[w].value[query][dim];
          magnitude += std::fabs(static_cast<double>(k[w].value[key][dim]) * q[w].value[query][dim]);
        }
        const float got = s[(w * 16 + key) * 8 + query];
        CHECK(close(got, want, magnitude), "%s warp %d S[%d][%d] = %.9g, expected %.9g", name, w, key, query, got,
              want);
        p[key][query] = from_bits16<T>(to_bits16<T>(got));
      }
    }
    for (int query = 0; query < 8; ++query) {
      for (int dim = 0; dim < 16; ++dim) {
        double want = 0.0, magnitude = 0.0;
        for (int key = 0; key < 16; ++key) {
          want += static_cast<double>(p[key][query]) * v[w].value[key][dim];
          magnitude += std::fabs(static_cast<double>(p[key][query]) * v[w].value[key][dim]);
        }
        const float got = o[(w * 8 + query) * 16 + dim];
        CHECK(close(got, want, magnitude), "%s warp %d O[%d][%d] = %.9g, expected %.9g", name, w, query, dim, got,
              want);
      }
    }
  }
}

int mma(const simt::Options& options) {
  mma_layout(options);
  mma_gemm<__half>(options, "half");
  mma_gemm<__nv_bfloat16>(options, "bf16");
  mma_chain<__half>(options, "half");
  mma_chain<__nv_bfloat16>(options, "bf16");
  return g_failures == 0 ? 0 : 1;
}

// Errors: every lane takes part; each lane's row is 16 bytes of shared memory, 16-byte aligned, with no cp.async
// pending; the lanes agree on trans.
alignas(16) unsigned char g_global_rows[32 * 16];  // global memory

__global__ void mma_divergent_kernel(int*) {  // only half the warp multiplies
  const uint32_t a[4] = {}, b[2] = {};
  float d[4] = {};
  if (threadIdx.x % 32 < 16) paged_attn::mma_m16n8k16<__half>(d, a, b, d);
}
__global__ void ldmatrix_misaligned_kernel(int*) {  // rows 8 bytes past a 16-byte boundary
  PA_SHARED(Tile16, tile_s, [1]);
  uint32_t r[4];
  paged_attn::ldmatrix_x4(r, quadrant_row(tile_s[0].x, threadIdx.x % 32) + 4);
}
__global__ void ldmatrix_global_kernel(int*) {  // rows in global memory
  uint32_t r[4];
  paged_attn::ldmatrix_x4(r, g_global_rows + 16 * (threadIdx.x % 32));
}
__global__ void ldmatrix_trans_mismatch_kernel(int*) {  // half the warp transposes
  PA_SHARED(Tile16, tile_s, [1]);
  uint32_t r[4];
  uint16_t* row = quadrant_row(tile_s[0].x, threadIdx.x % 32);
  if (threadIdx.x % 32 < 16) {
    paged_attn::ldmatrix_x4(r, row);
  } else {
    paged_attn::ldmatrix_x4_trans(r, row);
  }
}
__global__ void ldmatrix_pending_kernel(int*) {  // the rows' copies are committed but not waited for
  PA_SHARED(Tile16, tile_s, [1]);
  uint32_t r[4];
  uint16_t* row = quadrant_row(tile_s[0].x, threadIdx.x % 32);
  paged_attn::cp_async_16(row, g_global_rows + 16 * (threadIdx.x % 32), true);
  paged_attn::cp_async_commit();
  paged_attn::ldmatrix_x4(r, row);  // BUG: no cp_async_wait before
}

// ---------------------------------------------------------------------------------------------------------------
// cp.async (csrc/cuda/cp_async.cuh): wait<1> completes the older of two groups only (outside ASan the younger one's
// destination still reads 0xFF); wait<0> the rest; in_bounds false fills zeros and reads no
// source; wait_all commits first; a destination whose copy completed takes another. After its wait and a __syncwarp
// another lane reads the bytes (no race under TSan). Copies left pending at exit (committed or not) land there.

bool same(const uint4& x, const uint4& y) { return x.x == y.x && x.y == y.y && x.z == y.z && x.w == y.w; }

__global__ void cp_async_kernel(const uint4* src, uint4* out, int* ok) {  // 2 blocks of 64; src, out [2][64][4]
  PA_SHARED(uint4, buf_s, [64][4]);
  PA_SHARED(uint4, left_s, [64][2]);
  const int tid = threadIdx.x, lane = tid % 32, gid = blockIdx.x * 64 + tid;
  const uint4* s = src + 4 * gid;
  uint4* b = buf_s[tid];
  paged_attn::cp_async_16(&b[0], &s[0], true);
  paged_attn::cp_async_commit();  // group 1: b[0]
  paged_attn::cp_async_16(&b[1], &s[1], true);
  paged_attn::cp_async_16(&b[2], nullptr, false);  // zero-fill: no source
  paged_attn::cp_async_commit();                   // group 2: b[1], b[2]
  paged_attn::cp_async_wait<1>();
  bool good = same(b[0], s[0]);
#if !defined(__SANITIZE_ADDRESS__)  // (there, a read of b[1] now is ASan's report: case cp_async_early_read)
  good = good && b[1].x == 0xFFFFFFFFu && b[1].w == 0xFFFFFFFFu;  // still pending
#endif
  paged_attn::cp_async_wait<0>();
  good = good && same(b[1], s[1]) && same(b[2], make_uint4(0, 0, 0, 0));
  paged_attn::cp_async_16(&b[3], &s[3], true);  // not committed: wait_all commits it
  paged_attn::cp_async_wait_all();
  good = good && same(b[3], s[3]);
  paged_attn::cp_async_16(&b[0], &s[2], true);  // into b[0] again
  paged_attn::cp_async_wait_all();
  ok[gid] = good && same(b[0], s[2]);
  __syncwarp();
  const uint4* other = buf_s[tid - lane + (lane + 1) % 32];  // the next lane's copies
  for (int i = 0; i < 4; ++i) out[4 * gid + i] = other[i];
  paged_attn::cp_async_16(&left_s[tid][0], &s[0], true);
  paged_attn::cp_async_commit();
  paged_attn::cp_async_16(&left_s[tid][1], &s[1], true);  // exits with both pending
}

int cp_async(const simt::Options& options) {
  std::vector<uint4> src(2 * 64 * 4), out(2 * 64 * 4);
  for (size_t i = 0; i < src.size(); ++i) {
    const unsigned x = static_cast<unsigned>(4 * i);
    src[i] = make_uint4(x + 1, x + 2, x + 3, x + 4);
  }
  std::vector<int> ok(2 * 64, 0);
  simt::launch(options, cp_async_kernel, dim3(2), dim3(64), 0, src.data(), out.data(), ok.data());
  for (int gid = 0; gid < 2 * 64; ++gid) {
    CHECK(ok[gid] == 1, "thread %d of block %d saw a copy's bytes wrong", gid % 64, gid / 64);
    const int other = gid - gid % 32 + (gid % 32 + 1) % 32;
    const uint4 want[4] = {src[4 * other + 2], src[4 * other + 1], make_uint4(0, 0, 0, 0), src[4 * other + 3]};
    for (int i = 0; i < 4; ++i) {
      CHECK(same(out[4 * gid + i], want[i]), "thread %d of block %d read the next lane's copy %d as %08x",
            gid % 64, gid / 64, i, out[4 * gid + i].x);
    }
  }
  return g_failures ? 1 : 0;
}

// Errors: the destination is 16 aligned bytes of shared memory, and takes no second copy while one is pending.
__global__ void cp_async_misaligned_kernel(int*) {  // 8 bytes past a 16-byte boundary
  PA_SHARED(uint4, buf_s, [33]);
  paged_attn::cp_async_16(reinterpret_cast<char*>(&buf_s[threadIdx.x % 32]) + 8, g_global_rows, true);
}
__global__ void cp_async_not_shared_kernel(int*) {  // into global memory
  paged_attn::cp_async_16(g_global_rows + 16 * (threadIdx.x % 32), g_global_rows, true);
}
__global__ void cp_async_twice_kernel(int*) {
  PA_SHARED(uint4, buf_s, [64]);
  paged_attn::cp_async_16(&buf_s[threadIdx.x], g_global_rows, true);
  paged_attn::cp_async_commit();
  paged_attn::cp_async_16(&buf_s[threadIdx.x], g_global_rows + 16, true);  // BUG: the first is not waited for
}

// Sanitizer cases: the sanitizer, not the emulator, reports these.

// Indexing the array itself: UBSan's bounds check reports it. Through a pointer: only ASan can, from the heap
// allocation's redzone.
__global__ void shared_index_out_of_bounds_kernel(float* out) {
  PA_SHARED(float, row_s, [32]);
  row_s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = row_s[threadIdx.x + 1];  // BUG: thread 31 reads row_s[32]
}
__global__ void shared_out_of_bounds_kernel(float* out) {
  PA_SHARED(float, row_s, [32]);
  float* row = row_s;
  row[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = row[threadIdx.x + 1];  // BUG: thread 31 reads row_s[32]
}
__global__ void dynamic_out_of_bounds_kernel(float* out) {
  PA_EXTERN_SHARED(float, row_s);  // 32 floats
  row_s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = row_s[threadIdx.x + 1];  // BUG: thread 31 reads past the launch's 128 bytes
}
__global__ void stack_out_of_bounds_kernel(const int* index, float* out) {
  float local[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  const float* volatile p = local;  // opaque to UBSan's object-size check: ASan's stack redzone must catch it
  __syncthreads();                  // the frame stays live across switches to other threads
  out[threadIdx.x] = p[*index];  // BUG: index 4
}
__global__ void misaligned_load_kernel(const unsigned char* bytes, uint4* out) {
  out[threadIdx.x] = *reinterpret_cast<const uint4*>(bytes + 4 + 16 * threadIdx.x);  // BUG: 4 bytes off
}
__global__ void race_kernel(float* out) {
  PA_SHARED(float, sum_s, [1]);
  if (threadIdx.x == 0) sum_s[0] = 0.0f;
  __syncthreads();
  if (threadIdx.x < 2) sum_s[0] += 1.0f;  // BUG: two threads update one slot between barriers
  __syncthreads();
  if (threadIdx.x == 0) *out = sum_s[0];
}

int shared_index_out_of_bounds(const simt::Options& options) {
  std::vector<float> out(32);
  simt::launch(options, shared_index_out_of_bounds_kernel, dim3(1), dim3(32), 0, out.data());
  return 0;
}
int shared_out_of_bounds(const simt::Options& options) {
  std::vector<float> out(32);
  simt::launch(options, shared_out_of_bounds_kernel, dim3(1), dim3(32), 0, out.data());
  return 0;
}
int dynamic_out_of_bounds(const simt::Options& options) {
  std::vector<float> out(32);
  simt::launch(options, dynamic_out_of_bounds_kernel, dim3(1), dim3(32), 32 * sizeof(float), out.data());
  return 0;
}
int stack_out_of_bounds(const simt::Options& options) {
  std::vector<float> out(32);
  const int index = 4;
  simt::launch(options, stack_out_of_bounds_kernel, dim3(1), dim3(32), 0, &index, out.data());
  return 0;
}
int misaligned_load(const simt::Options& options) {
  alignas(16) unsigned char bytes[16 * 33] = {};
  std::vector<uint4> out(32);
  simt::launch(options, misaligned_load_kernel, dim3(1), dim3(32), 0, bytes, out.data());
  return 0;
}
int race(const simt::Options& options) {
  float out = 0.0f;
  simt::launch(options, race_kernel, dim3(1), dim3(64), 0, &out);
  return 0;
}

// A thread reads its cp.async destination before the wait: poisoned under ASan (which then lists the pending copies).
__global__ void cp_async_early_read_kernel(const uint4* src, uint4* out) {  // 32 threads
  PA_SHARED(uint4, buf_s, [32]);
  paged_attn::cp_async_16(&buf_s[threadIdx.x], &src[threadIdx.x], true);
  paged_attn::cp_async_commit();
  out[threadIdx.x] = buf_s[threadIdx.x];  // BUG: before cp_async_wait
  paged_attn::cp_async_wait<0>();
}
// A lane reads another lane's completed copy with no __syncwarp after that lane's wait: the read races with the
// copy's landing (the __syncwarp before the waits orders only the copies' start).
__global__ void cp_async_race_kernel(const uint4* src, uint4* out) {  // 32 threads
  PA_SHARED(uint4, buf_s, [32]);
  paged_attn::cp_async_16(&buf_s[threadIdx.x], &src[threadIdx.x], true);
  __syncwarp();
  paged_attn::cp_async_wait_all();
  out[threadIdx.x] = buf_s[threadIdx.x ^ 1];  // BUG: no __syncwarp between the neighbor's wait and this read
}

// The pipelining bug: a lane starts a copy into a slot its neighbor still reads, before the __syncwarp that ends the
// reads. The copy may land at once, so the read races with the copy's start (its 0xFF fill under the emulator),
// though the wait that lands it comes after the barrier.
__global__ void cp_async_overwrite_race_kernel(const uint4* src, uint4* out) {  // 32 threads
  PA_SHARED(uint4, buf_s, [32]);
  buf_s[threadIdx.x] = src[threadIdx.x];
  __syncwarp();
  out[threadIdx.x] = buf_s[threadIdx.x ^ 1];
  paged_attn::cp_async_16(&buf_s[threadIdx.x], &src[threadIdx.x], true);  // BUG: the neighbor may still read it
  __syncwarp();
  paged_attn::cp_async_wait_all();
}

int cp_async_sanitized(const simt::Options& options, void (*kernel)(const uint4*, uint4*)) {
  std::vector<uint4> src(32, make_uint4(1, 2, 3, 4)), out(32);
  simt::launch(options, kernel, dim3(1), dim3(32), 0, src.data(), out.data());
  return 0;
}

using Case = int (*)(const simt::Options&);

const std::map<std::string, Case> kCases = {
    {"shuffles", shuffles},
    {"votes", votes},
    {"block_reduce", block_reduce},
    {"uneven_warps", uneven_warps},
    {"shared_poison", shared_poison},
    {"atomics", atomics},
    {"alignment", alignment},
    {"syncwarp_exchange", syncwarp_exchange},
    {"launch_limits", launch_limits},
    {"order", order},
    {"uninitialized_shared", uninitialized_shared},
    {"conversions", conversions},
    {"decodes", decodes},
    {"barrier_skipped", [](const simt::Options& o) { return run_error_kernel(o, barrier_skipped_kernel, 64); }},
    {"barrier_two_sites", [](const simt::Options& o) { return run_error_kernel(o, barrier_two_sites_kernel, 64); }},
    {"barrier_early_return",
     [](const simt::Options& o) { return run_error_kernel(o, barrier_early_return_kernel, 64, 40); }},
    {"shuffle_divergent", [](const simt::Options& o) { return run_error_kernel(o, shuffle_divergent_kernel, 64); }},
    {"different_collectives",
     [](const simt::Options& o) { return run_error_kernel(o, different_collectives_kernel, 64); }},
    {"mismatched_masks", [](const simt::Options& o) { return run_error_kernel(o, mismatched_masks_kernel, 64); }},
    {"collective_vs_barrier",
     [](const simt::Options& o) { return run_error_kernel(o, collective_vs_barrier_kernel, 64); }},
    {"read_outside_mask", [](const simt::Options& o) { return run_error_kernel(o, read_outside_mask_kernel, 32); }},
    {"mask_without_self", [](const simt::Options& o) { return run_error_kernel(o, mask_without_self_kernel, 32); }},
    {"bad_width", [](const simt::Options& o) { return run_error_kernel(o, bad_width_kernel, 32); }},
    {"partial_warp_full_mask",
     [](const simt::Options& o) { return run_error_kernel(o, partial_warp_full_mask_kernel, 48); }},
    {"shared_index_out_of_bounds", shared_index_out_of_bounds},
    {"shared_out_of_bounds", shared_out_of_bounds},
    {"dynamic_out_of_bounds", dynamic_out_of_bounds},
    {"stack_out_of_bounds", stack_out_of_bounds},
    {"misaligned_load", misaligned_load},
    {"race", race},
    {"race_over_shuffle", race_over_shuffle},
    {"wmma", wmma},
    {"wmma_divergent", [](const simt::Options& o) { return run_error_kernel(o, wmma_divergent_kernel, 64); }},
    {"wmma_pointer_mismatch",
     [](const simt::Options& o) { return run_error_kernel(o, wmma_pointer_mismatch_kernel, 64); }},
    {"wmma_misaligned", [](const simt::Options& o) { return run_error_kernel(o, wmma_misaligned_kernel, 64); }},
    {"wmma_bad_ldm", [](const simt::Options& o) { return run_error_kernel(o, wmma_bad_ldm_kernel, 64); }},
    {"wmma_fill_nonuniform",
     [](const simt::Options& o) { return run_error_kernel(o, wmma_fill_nonuniform_kernel, 64); }},
    {"wmma_mma_vs_shuffle",
     [](const simt::Options& o) { return run_error_kernel(o, wmma_mma_vs_shuffle_kernel, 64); }},
    {"mma", mma},
    {"mma_divergent", [](const simt::Options& o) { return run_error_kernel(o, mma_divergent_kernel, 64); }},
    {"ldmatrix_misaligned", [](const simt::Options& o) { return run_error_kernel(o, ldmatrix_misaligned_kernel, 64); }},
    {"ldmatrix_global", [](const simt::Options& o) { return run_error_kernel(o, ldmatrix_global_kernel, 64); }},
    {"ldmatrix_trans_mismatch",
     [](const simt::Options& o) { return run_error_kernel(o, ldmatrix_trans_mismatch_kernel, 64); }},
    {"ldmatrix_pending", [](const simt::Options& o) { return run_error_kernel(o, ldmatrix_pending_kernel, 64); }},
    {"cp_async", cp_async},
    {"cp_async_misaligned", [](const simt::Options& o) { return run_error_kernel(o, cp_async_misaligned_kernel, 64); }},
    {"cp_async_not_shared", [](const simt::Options& o) { return run_error_kernel(o, cp_async_not_shared_kernel, 64); }},
    {"cp_async_twice", [](const simt::Options& o) { return run_error_kernel(o, cp_async_twice_kernel, 64); }},
    {"cp_async_early_read", [](const simt::Options& o) { return cp_async_sanitized(o, cp_async_early_read_kernel); }},
    {"cp_async_race", [](const simt::Options& o) { return cp_async_sanitized(o, cp_async_race_kernel); }},
    {"cp_async_overwrite_race",
     [](const simt::Options& o) { return cp_async_sanitized(o, cp_async_overwrite_race_kernel); }},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || kCases.count(argv[1]) == 0) {
    std::fprintf(stderr, "usage: selftest <case> [forward|reverse|random] [seed]; cases:");
    for (const auto& [name, run] : kCases) std::fprintf(stderr, " %s", name.c_str());
    std::fprintf(stderr, "\n");
    return 2;
  }
  simt::Options options;
  const std::string order = argc > 2 ? argv[2] : "forward";
  options.order = order == "reverse"  ? simt::Order::kReverse
                  : order == "random" ? simt::Order::kRandom
                                      : simt::Order::kForward;
  options.seed = argc > 3 ? std::stoull(argv[3]) : 0;
  try {
    return kCases.at(argv[1])(options);
  } catch (const simt::Error& e) {
    std::fprintf(stderr, "simt::Error: %s\n", e.what());
    return 3;
  }
}
