// simt.h: a CPU emulator of the CUDA device API, so that our kernels' own source runs on the CPU, thread by thread,
// under AddressSanitizer, UndefinedBehaviorSanitizer and ThreadSanitizer. Header-only C++17; needs only the CUDA
// toolkit's headers (for dim3, uint4, __half, __nv_bfloat16, fp8) and, under a sanitizer, gcc's sanitizer headers.
//
// Use: include this header before the kernel header (it defines PA_SHARED / PA_EXTERN_SHARED, which the kernel
// headers define for nvcc only when they are not defined yet), then
//     simt::launch(simt::Options{simt::Order::kReverse}, my_kernel<float>, grid, block, dynamic_shared_bytes, args...);
// runs every block and thread of the grid, and throws simt::Error on an invalid launch or a synchronization error.
// Compile with g++ -std=c++17 -I$CUDA_HOME/include -Wno-unknown-pragmas (g++ does not know CUDA's #pragma unroll,
// and before gcc 13 a header cannot silence that warning), plus -fsanitize=address,undefined or -fsanitize=thread.
//
// The model
//   - Every CUDA thread is a fiber with its own mmap'd stack and a PROT_NONE guard page below it. On x86-64 a fiber
//     switch is a few instructions (callee-saved registers and the stack pointer, see fiber_switch); elsewhere it
//     is makecontext/swapcontext, which costs two signal-mask system calls per switch. Blocks run one after another; the threads of a block take turns on the calling OS thread.
//     threadIdx, blockIdx, blockDim and gridDim are macros reading the running fiber's record.
//   - A thread runs until it reaches a synchronization point (__syncthreads, a warp collective) or exits; then the
//     scheduler runs the next ready thread. Ready threads (and blocks) are taken in forward, reverse or seeded
//     random order: code that relies on an order the hardware does not promise gives different answers.
//   - Every synchronization point is a *meeting*: an operation (barrier, shuffle mode, vote, __syncwarp), its call
//     site (file:line) and its attendees (every thread of the block, or the lanes of the mask in one warp of 32
//     consecutive linear thread ids). It completes when all attendees have arrived; the last to arrive computes the
//     collective's results. A thread that must attend but has exited, or waits at another meeting (another site,
//     operation or mask), is an error at once: divergent barriers and collective mismatches cannot hang. Should no
//     thread be able to proceed anyway, that is an error listing where each thread waits.
//   - Shared memory is heap-allocated per block at exactly the declared (or launched) size and filled with 0xFF
//     bytes, a NaN as float, half and bfloat16: AddressSanitizer catches an index out of bounds, and a read before
//     any write yields NaN.
//   - AddressSanitizer is told about every fiber switch (it still warns once that it does not fully support
//     swapcontext: the warning is about programs that do not tell it). Under ThreadSanitizer every CUDA thread is
//     its own TSan fiber, switching creates no happens-before, and only __syncthreads and __syncwarp order memory,
//     as in CUDA's memory model (shuffles and votes exchange values but are not memory fences): TSan reports races
//     between the threads of a block. The emulator's own bookkeeping is hidden from TSan. (TSan sleeps a second
//     at exit when a program had threads, and fibers count: a test program may set atexit_sleep_ms=0.)
//
// What it cannot catch
//   - Races between blocks: blocks run one after another and TSan sees each block happen after the previous one.
//   - Weak memory ordering: every thread sees one coherent memory in program order.
//   - A thread spinning on a value another thread of its block will write: threads only switch at synchronization
//     points, so that loop never ends.
//   - Exact results of the fast-math intrinsics (__expf here is expf), register and occupancy limits, the static
//     shared memory limit beyond what the threads actually declare, bank conflicts, speed.
#pragma once

#if defined(PA_SHARED) || defined(PA_EXTERN_SHARED)
#error "include simt.h before the kernel headers: they define PA_SHARED / PA_EXTERN_SHARED for nvcc otherwise"
#endif
#define PAGED_ATTN_EMULATED 1  // the kernel headers then take the CUDA builtins and PA_SHARED from here

// cuda_runtime.h first: it names host function parameters gridDim and blockDim, which must be parsed before those
// names become macros below (a kernel header that includes it later then gets the already included copy).
#include <cuda_runtime.h>  // also dim3, uint4, float4, ... and crt/host_defines.h: __global__, __device__, ...
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <map>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin();  // exported by libtsan; not in gcc's public header
extern "C" void __tsan_ignore_thread_end();
#endif

// CUDA keywords. crt/host_defines.h already turns __global__, __device__, __host__, __forceinline__, __noinline__
// and __align__ into what the host compiler understands.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
// A plain __shared__ variable would silently become one copy per thread: refuse it.
#undef __shared__
#define __shared__ \
  _Pragma("GCC error \"plain __shared__ is not supported by the simt emulator: use PA_SHARED / PA_EXTERN_SHARED\"")

// Shared memory declarations, as the kernel headers write them:
//   PA_SHARED(float, logits_s, [kMaxGroup][kTile]);   nvcc: __shared__ float logits_s[kMaxGroup][kTile];
//   PA_EXTERN_SHARED(float, weights_s);               nvcc: extern __shared__ float weights_s[];
// Each declaration site is keyed by a static local; the first thread of a block to reach it allocates.
#ifndef PA_SHARED
#define PA_SHARED(type, name, dims)      \
  static char simt_shared_key_##name; \
  auto& name = ::simt::shared<type dims>(&simt_shared_key_##name)
#endif
#ifndef PA_EXTERN_SHARED
#define PA_EXTERN_SHARED(type, name) type* const name = ::simt::dynamic_shared<type>()
#endif

namespace simt {

// ---------------------------------------------------------------------------------------------------------------
// Public API.

// A launch CUDA would refuse, or a synchronization error found while running one.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The order in which ready threads run between synchronization points, and in which blocks run.
enum class Order { kForward, kReverse, kRandom };

struct Options {
  Order order = Order::kForward;
  uint64_t seed = 0;                // for Order::kRandom
  size_t stack_bytes = 128 << 10;   // per CUDA thread
};

// Runs kernel<<<grid, block, dynamic_shared_bytes>>>(args...) to completion (defined at the end of this file).
template <typename... Params, typename... Args>
void launch(const Options& options, void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_shared_bytes,
            Args&&... args);

// What the launch checks, as sm_90 defines it.
constexpr unsigned kMaxThreadsPerBlock = 1024, kMaxBlockDimXY = 1024, kMaxBlockDimZ = 64;
constexpr unsigned kMaxGridDimX = 0x7fffffff, kMaxGridDimYZ = 65535;
constexpr size_t kMaxStaticSharedBytes = 48 << 10;  // nvcc refuses more static shared memory
constexpr size_t kMaxSharedBytes = 227 << 10;       // per block, with the opt-in (228 KiB per SM, 1 KiB reserved)

// The running CUDA thread's built-in variables (threadIdx and friends read these).
struct Builtins {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
const Builtins& builtins();

// A synchronization point's call site: a default argument of every synchronizing function, so it is the caller's.
struct Site {
  const char* file;
  int line;
  static Site here(const char* file = __builtin_FILE(), int line = __builtin_LINE()) { return {file, line}; }
  bool operator==(const Site& other) const { return line == other.line && std::strcmp(file, other.file) == 0; }
  std::string str() const { return std::string(file) + ":" + std::to_string(line); }
};

// Shared memory behind PA_SHARED and PA_EXTERN_SHARED.
template <typename T>
T& shared(const void* key);
template <typename T>
T* dynamic_shared();

// ---------------------------------------------------------------------------------------------------------------
// The engine.
namespace detail {

#if defined(__x86_64__)
#define SIMT_FAST_SWITCH 1
// Saves the callee-saved registers and the stack pointer of the running context in *from_sp and resumes the context
// saved at to_sp (System V x86-64: everything else is caller-saved, so a call is a complete switch point).
__attribute__((naked, noinline)) static void fiber_switch(void** /*from_sp*/, void* /*to_sp*/) {
  asm volatile(
      "pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret\n\t");
}

// The stack pointer of a fiber that has not run yet: fiber_switch's pops take zeros, its `ret` enters `entry` with
// the stack aligned as after a call (rsp = 8 mod 16, above it a null return address that is never used).
inline void* fiber_stack(char* stack, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15});
  uintptr_t* sp = top - 2;
  sp[1] = 0;                                  // the entry function's return address: never used
  sp[0] = reinterpret_cast<uintptr_t>(entry);  // where fiber_switch's ret goes
  sp -= 6;                                    // rbp, rbx, r12-r15
  for (int i = 0; i < 6; ++i) sp[i] = 0;
  return sp;
}
#endif

// Bookkeeping shared between fibers is invisible to ThreadSanitizer: only the kernel's own accesses are checked.
struct Untracked {
#if defined(__SANITIZE_THREAD__)
  Untracked() { __tsan_ignore_thread_begin(); }
  ~Untracked() { __tsan_ignore_thread_end(); }
#else
  ~Untracked() {}  // not trivial, so that a guard is not an "unused variable"
#endif
};

enum class Op {
  kSyncthreads, kSyncwarp, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll,
  kWmmaFill, kWmmaLoad, kWmmaStore, kWmmaMma,  // nvcuda::wmma (whole-warp collectives)
  kLdmatrix, kLdmatrixTrans, kMovmatrix, kMma,  // ldmatrix, movmatrix, mma.sync (whole-warp collectives, mma.cuh)
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kSyncthreads: return "__syncthreads";
    case Op::kSyncwarp: return "__syncwarp";
    case Op::kShflIdx: return "__shfl_sync";
    case Op::kShflUp: return "__shfl_up_sync";
    case Op::kShflDown: return "__shfl_down_sync";
    case Op::kShflXor: return "__shfl_xor_sync";
    case Op::kBallot: return "__ballot_sync";
    case Op::kAny: return "__any_sync";
    case Op::kAll: return "__all_sync";
    case Op::kWmmaFill: return "wmma::fill_fragment";
    case Op::kWmmaLoad: return "wmma::load_matrix_sync";
    case Op::kWmmaStore: return "wmma::store_matrix_sync";
    case Op::kWmmaMma: return "wmma::mma_sync";
    case Op::kLdmatrix: return "ldmatrix_x4";
    case Op::kLdmatrixTrans: return "ldmatrix_x4_trans";
    case Op::kMovmatrix: return "movmatrix_trans";
    case Op::kMma: return "mma_m16n8k16";
  }
  return "?";
}

// Barriers and __syncwarp order memory between their attendees; shuffles and votes only exchange values.
inline bool orders_memory(Op op) { return op == Op::kSyncthreads || op == Op::kSyncwarp; }
// Collectives whose lanes pass their arguments as a payload and whose last lane runs a completion function.
inline bool is_wmma(Op op) { return op >= Op::kWmmaFill; }

struct Thread;
struct Meeting;
// A wmma collective's completion: called by the last lane to arrive, with the attendees in lane order (each lane's
// arguments in its Thread::payload); checks that the lanes agree and (mma_sync) computes every lane's result.
using WmmaComplete = void (*)(const Meeting&, const std::vector<Thread*>& lanes);

// Concatenates what an ostream prints: cat("lane ", 3, " of ", name).
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  return text.str();
}
inline std::string dims(unsigned x, unsigned y, unsigned z) { return cat("(", x, ",", y, ",", z, ")"); }

inline std::string hex(unsigned x) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", x);
  return text;
}

// One instance of a synchronization point.
struct Meeting {
  Op op;
  Site site;
  unsigned mask;  // attending lanes of `warp` (collectives); unused by __syncthreads
  int warp;       // -1 for __syncthreads
  int attendees, arrived = 0, left = 0;

  bool is(Op other_op, const Site& other_site, unsigned other_mask) const {
    return op == other_op && site == other_site && (op == Op::kSyncthreads || mask == other_mask);
  }
  // Whether this meeting waits for lane `lane` of warp `w`.
  bool needs(int w, int lane) const { return op == Op::kSyncthreads || (warp == w && (mask >> lane & 1u)); }
  std::string str() const {
    return std::string(op_name(op)) + (op == Op::kSyncthreads ? "()" : "(mask " + hex(mask) + ")") + " at " +
           site.str();
  }
};

enum class State { kReady, kWaiting, kExited };

// Thrown in a waiting thread to unwind it after another thread's error (deliberately not a std::exception).
struct Cancelled {};

struct Thread {
  Builtins builtins;
  int id = 0, warp = 0, lane = 0;   // id: linear index in the block; warp = id / 32, lane = id % 32
  State state = State::kReady;
  bool started = false;             // has entered the kernel
  Meeting* meeting = nullptr;       // while waiting, and until it leaves the completed meeting
  // A collective's operands and result; values travel as up to 8 raw bytes.
  uint64_t value = 0, result = 0;
  int operand = 0, width = 32;      // source lane, delta or lane mask; segment width
  const void* payload = nullptr;    // a wmma collective's arguments, and its completion
  WmmaComplete wmma_complete = nullptr;
  // cp.async (cp_async_16): this thread's copies started since its last commit, then its committed groups, oldest
  // first. A copy's source is read when it starts; its destination is written when a wait completes it.
  struct AsyncCopy {
    void* dst;
    Site site;
    unsigned char bytes[16];
  };
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> groups;
  // The fiber.
#if defined(SIMT_FAST_SWITCH)
  void* sp = nullptr;               // saved stack pointer while not running
#else
  ucontext_t context;
#endif
  char* stack = nullptr;            // lowest address of the usable stack (the guard page is just below)
  void* asan_fake_stack = nullptr;
  void* tsan_fiber = nullptr;

  std::string name() const {
    const uint3& t = builtins.thread_idx;
    return cat("thread ", id, " ", dims(t.x, t.y, t.z));
  }
};

// "threads 0-15, 17, 20-31" or "thread 5", for sorted ids.
inline std::string id_list(const std::vector<int>& ids) {
  std::string text;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    text += cat(text.empty() ? "" : ", ", ids[i], j > i ? cat("-", ids[j]) : "");
    i = j + 1;
  }
  return (ids.size() == 1 ? "thread " : "threads ") + text;
}
// "threads 0-4 wait" or "thread 5 waits"; "have" or "has".
inline std::string id_list(const std::vector<int>& ids, const char* plural_verb, const char* singular_verb) {
  return id_list(ids) + " " + (ids.size() == 1 ? singular_verb : plural_verb);
}

// Source lane of a shuffle, as PTX shfl.sync defines it. CUDA's wrappers pass c = ((32 - width) << 8) | clamp,
// clamp = 0 for up and 31 otherwise; PTX then takes segmask = c[12:8], b = the operand's low 5 bits, and
//   max_lane = (lane & segmask) | (clamp & ~segmask), min_lane = lane & segmask
//   up: j = lane - b, valid if j >= max_lane     down: j = lane + b, valid if j <= max_lane
//   xor: j = lane ^ b, valid if j <= max_lane    idx: j = min_lane | (b & ~segmask), valid if j <= max_lane
// An invalid j reads the caller's own value. So up/down stay within the width-lane segment, idx wraps within it,
// and xor may read an earlier segment but not a later one.
inline int source_lane(Op op, int lane, int operand, int width) {
  const int segmask = (32 - width) & 31, clamp = op == Op::kShflUp ? 0 : 31, b = operand & 31;
  const int max_lane = (lane & segmask) | (clamp & ~segmask), min_lane = lane & segmask;
  switch (op) {
    case Op::kShflUp: return lane - b >= max_lane ? lane - b : lane;
    case Op::kShflDown: return lane + b <= max_lane ? lane + b : lane;
    case Op::kShflXor: return (lane ^ b) <= max_lane ? lane ^ b : lane;
    default: return min_lane | (b & ~segmask);
  }
}

class Run;
inline thread_local Run* t_run = nullptr;        // the launch this OS thread runs
inline thread_local Thread* t_thread = nullptr;  // the CUDA thread running now; nullptr in the scheduler
// Completes `self`'s oldest cp.async groups until at most `keep` are pending, and at exit its uncommitted copies
// too (defined with cp_async_16 below).
inline void complete_copies(Thread& self, size_t keep, bool at_exit = false);

// One launch: its grid, the threads of the block being run, their stacks, and the block's shared memory.
class Run {
 public:
  // body(context) runs the kernel in the calling CUDA thread.
  Run(const Options& options, dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(void*), void* context)
      : options_(options), grid_(grid), block_(block), dynamic_bytes_(dynamic_shared_bytes), body_(body),
        context_(context), rng_(options.seed) {
    check_launch();
    threads_.resize(static_cast<size_t>(block.x) * block.y * block.z);
    map_stacks();
  }
  ~Run() {
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(stacks_, stacks_bytes_);  // fiber_main's last frames (it never returns)
#endif
    munmap(stacks_, stacks_bytes_);
  }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  // Runs every block in the chosen order; rethrows the first error.
  void run_grid() {
    const uint64_t blocks_per_slice = static_cast<uint64_t>(grid_.x) * grid_.y;
    for (uint64_t linear : in_order(blocks_per_slice * grid_.z)) {
      run_block(uint3{static_cast<unsigned>(linear % grid_.x), static_cast<unsigned>(linear / grid_.x % grid_.y),
                      static_cast<unsigned>(linear / blocks_per_slice)});
    }
  }

  // ---- Synchronization, called by the running CUDA thread.

  // `self` arrives at a meeting and returns once the meeting has completed. Throws Error on a mismatch.
  void meet(Thread& self, Op op, const Site& site, unsigned mask) {
    Meeting* meeting = op == Op::kSyncthreads ? find_barrier(self, site) : find_collective(self, op, site, mask);
    if (meeting == nullptr) {
      const int attendees = op == Op::kSyncthreads ? static_cast<int>(threads_.size()) : __builtin_popcount(mask);
      meeting = &meetings_.emplace_back(Meeting{op, site, mask, op == Op::kSyncthreads ? -1 : self.warp, attendees});
    }
    self.meeting = meeting;
    self.state = State::kWaiting;
#if defined(__SANITIZE_THREAD__)
    if (orders_memory(op)) __tsan_release(meeting);  // a fresh sync object per meeting, so that a thread leaving
#endif                                               // late cannot acquire what others did after the meeting
    if (++meeting->arrived == meeting->attendees) complete(*meeting);
    yield(self, /*exiting=*/false);
    if (cancelling_) throw Cancelled{};
#if defined(__SANITIZE_THREAD__)
    if (orders_memory(op)) __tsan_acquire(meeting);
#endif
    self.meeting = nullptr;
    if (++meeting->left == meeting->attendees) meetings_.remove_if([=](const Meeting& m) { return &m == meeting; });
  }

  // `self` returns from the kernel. Throws Error if a thread waits for it.
  void exit_kernel(Thread& self) {
    std::vector<int> at_barrier;
    for (Thread& other : threads_) {
      if (other.state != State::kWaiting) continue;
      if (other.meeting->op == Op::kSyncthreads) {
        at_barrier.push_back(other.id);
      } else if (other.meeting->needs(self.warp, self.lane)) {
        throw error(self.name(), " exits while lane ", other.lane, " = ", other.name(), " waits for it at ",
                    other.meeting->str());
      }
    }
    if (!at_barrier.empty()) {
      throw error(self.name(), " exits while ", id_list(at_barrier, "wait", "waits"), " at ",
                  threads_[at_barrier[0]].meeting->str());
    }
    self.state = State::kExited;
    ++exited_;
  }

  // ---- Shared memory of the running block.

  void* static_shared(const void* key, size_t bytes, size_t alignment) {
    auto found = static_shared_.find(key);
    if (found != static_shared_.end()) return found->second.data;
    static_bytes_ += bytes;
    if (static_bytes_ > kMaxStaticSharedBytes || static_bytes_ + dynamic_bytes_ > kMaxSharedBytes) {
      throw error("shared memory exceeds the limit: ", static_bytes_, " bytes static (at most ", kMaxStaticSharedBytes,
                  ") + ", dynamic_bytes_, " bytes dynamic (at most ", kMaxSharedBytes, " in all)");
    }
    return static_shared_.emplace(key, Allocation(bytes, alignment)).first->second.data;
  }
  void* dynamic_shared() const { return dynamic_.data; }

  // Whether [p, p + bytes) lies in one of the running block's shared memory allocations.
  bool in_shared(const void* p, size_t bytes) const {
    const auto inside = [&](const Allocation& a) {
      const auto begin = reinterpret_cast<uintptr_t>(a.data), at = reinterpret_cast<uintptr_t>(p);
      return a.data != nullptr && at >= begin && at + bytes <= begin + a.bytes;
    };
    if (inside(dynamic_)) return true;
    for (const auto& [key, allocation] : static_shared_) {
      if (inside(allocation)) return true;
    }
    return false;
  }

  // ---- cp.async copies not yet completed, by destination (16-byte aligned, so two overlap only if equal).
  struct PendingCopy {
    Site site;
    int thread;
  };
  std::map<const void*, PendingCopy>& pending_copies() { return pending_copies_; }
  std::string pending_copy(const void* dst) const {
    const auto found = pending_copies_.find(dst);
    if (found == pending_copies_.end()) return "";
    return cat("the cp.async of ", threads_[found->second.thread].name(), " at ", found->second.site.str());
  }
  // The pending copies as text, for a sanitizer's report (at most 8).
  std::string pending_copies_text() const {
    std::string text;
    int n = 0;
    for (const auto& [dst, copy] : pending_copies_) {
      if (n++ == 8) return text + "  ...\n";
      text += cat("  16 bytes at ", dst, ": cp.async of ", threads_[copy.thread].name(), " at ", copy.site.str(),
                  ", not yet waited for\n");
    }
    return text;
  }

  std::string block_name() const { return "block " + dims(block_idx_.x, block_idx_.y, block_idx_.z); }
  template <typename... Parts>
  Error error(const Parts&... message) const {
    return Error(cat("simt: ", block_name(), ": ", message...));
  }

 private:
  // Heap storage at exactly `bytes`, filled with 0xFF (NaN as float, half and bfloat16).
  struct Allocation {
    void* data = nullptr;
    size_t alignment = 16, bytes = 0;
    Allocation() = default;
    Allocation(size_t size, size_t align) : alignment(std::max<size_t>(align, 16)), bytes(size) {
      data = ::operator new(bytes, std::align_val_t(alignment));
      std::memset(data, 0xFF, bytes);
    }
    Allocation(Allocation&& other) noexcept
        : data(std::exchange(other.data, nullptr)), alignment(other.alignment), bytes(other.bytes) {}
    Allocation& operator=(Allocation&& other) noexcept {
      std::swap(data, other.data), std::swap(alignment, other.alignment), std::swap(bytes, other.bytes);
      return *this;
    }
    ~Allocation() {
      if (data != nullptr) ::operator delete(data, std::align_val_t(alignment));
    }
  };

  void check_launch() const {
    auto refuse = [](const std::string& what) { throw Error("simt: invalid launch: " + what); };
    const uint64_t threads = static_cast<uint64_t>(block_.x) * block_.y * block_.z;
    if (grid_.x == 0 || grid_.y == 0 || grid_.z == 0 || grid_.x > kMaxGridDimX || grid_.y > kMaxGridDimYZ ||
        grid_.z > kMaxGridDimYZ) {
      refuse(cat("grid ", dims(grid_.x, grid_.y, grid_.z),
                 " (each dimension at least 1, x at most 2^31-1, y and z at most 65535)"));
    }
    if (threads == 0 || threads > kMaxThreadsPerBlock || block_.x > kMaxBlockDimXY || block_.y > kMaxBlockDimXY ||
        block_.z > kMaxBlockDimZ) {
      refuse(cat("block ", dims(block_.x, block_.y, block_.z),
                 " (at most 1024 threads, x and y at most 1024, z at most 64)"));
    }
    if (dynamic_bytes_ > kMaxSharedBytes) {
      refuse(cat(dynamic_bytes_, " bytes of dynamic shared memory (at most ", kMaxSharedBytes, ")"));
    }
  }

  // 0, 1, ..., n - 1 in the chosen order.
  std::vector<uint64_t> in_order(uint64_t n) {
    std::vector<uint64_t> order(n);
    for (uint64_t i = 0; i < n; ++i) order[i] = options_.order == Order::kReverse ? n - 1 - i : i;
    if (options_.order == Order::kRandom) {
      for (uint64_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng_() % i]);  // Fisher-Yates
    }
    return order;
  }

  // ---- Blocks.

  void run_block(uint3 block_idx) {
    block_idx_ = block_idx;
    exited_ = 0;
    dynamic_ = Allocation(dynamic_bytes_, 16);
    for (size_t i = 0; i < threads_.size(); ++i) start_fiber(threads_[i], static_cast<int>(i));
#if defined(__SANITIZE_THREAD__)
    __tsan_release(&block_start_);  // whatever the host did before the launch happens before the block
#endif
    // Rounds: every thread ready at the start of a round runs, in order, until it waits or exits.
    while (exited_ < threads_.size() && !error_) {
      std::vector<Thread*> ready;
      for (uint64_t i : in_order(threads_.size())) {
        if (threads_[i].state == State::kReady) ready.push_back(&threads_[i]);
      }
      if (ready.empty()) error_ = std::make_exception_ptr(deadlock());
      for (Thread* thread : ready) {
        if (!error_) resume(*thread);
      }
    }
    if (error_) cancel();
#if defined(__SANITIZE_THREAD__)
    __tsan_acquire(&block_done_);  // the block's threads happen before what the host does next
#endif
    for (Thread& t : threads_) t.uncommitted.clear(), t.groups.clear();  // copies of an abandoned block
#if defined(__SANITIZE_ADDRESS__)
    for (const auto& [dst, copy] : pending_copies_) ASAN_UNPOISON_MEMORY_REGION(dst, 16);
#endif
    pending_copies_.clear();
    meetings_.clear();
    static_shared_.clear();
    static_bytes_ = 0;
    dynamic_ = Allocation();
    if (error_) std::rethrow_exception(error_);
  }

  // After an error: every thread still inside the kernel resumes and throws Cancelled from where it waits, so
  // that its frames unwind (destructors run, no sanitizer state is left behind) before its stack is reused.
  void cancel() {
    cancelling_ = true;
    for (Thread& t : threads_) {
      if (t.started && t.state != State::kExited) resume(t);
    }
    cancelling_ = false;
  }

  Error deadlock() const {
    std::map<const Meeting*, std::vector<int>> waiting;
    for (const Thread& t : threads_) {
      if (t.state == State::kWaiting) waiting[t.meeting].push_back(t.id);
    }
    std::string text;
    for (const auto& [meeting, ids] : waiting) {
      text += (text.empty() ? "" : "; ") + id_list(ids, "wait", "waits") + " at " + meeting->str();
    }
    return error("no thread can proceed: " + text);
  }

  // ---- Fibers.

  void map_stacks() {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    options_.stack_bytes = (options_.stack_bytes + page_ - 1) / page_ * page_;
    const size_t slot = page_ + options_.stack_bytes;  // guard page, then the stack
    stacks_bytes_ = slot * threads_.size();
    void* region = mmap(nullptr, stacks_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
    if (region == MAP_FAILED) throw Error(cat("simt: cannot map ", stacks_bytes_, " bytes of stacks"));
    stacks_ = static_cast<char*>(region);
    for (size_t i = 0; i < threads_.size(); ++i) {
      mprotect(stacks_ + i * slot, page_, PROT_NONE);
      threads_[i].stack = stacks_ + i * slot + page_;
    }
  }

  void start_fiber(Thread& t, int id) {
    t.id = id, t.warp = id / 32, t.lane = id % 32;
    t.builtins = Builtins{uint3{id % block_.x, id / block_.x % block_.y, id / (block_.x * block_.y)}, block_idx_,
                          block_, grid_};
    t.state = State::kReady;
    t.started = false;
    t.meeting = nullptr;
#if defined(SIMT_FAST_SWITCH)
    t.sp = fiber_stack(t.stack, options_.stack_bytes, &fiber_main);
#else
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack;
    t.context.uc_stack.ss_size = options_.stack_bytes;
    t.context.uc_link = nullptr;
    makecontext(&t.context, &fiber_main, 0);
    // makecontext has set up the stack; clearing uc_stack keeps ASan's swapcontext interceptor from unpoisoning
    // the whole stack (live frames included) at every switch.
    t.context.uc_stack = stack_t{};
#endif
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(t.stack, options_.stack_bytes);  // redzones left by the previous block
#endif
#if defined(__SANITIZE_THREAD__)
    t.tsan_fiber = tsan_fiber(id);
    __tsan_set_fiber_name(t.tsan_fiber, (t.name() + " of " + block_name()).c_str());  // for TSan's reports
#endif
  }

#if defined(__SANITIZE_THREAD__)
  // TSan fiber number `id` of this OS thread. Creating one costs about half a millisecond, so they are kept and
  // reused by every block and launch: that orders nothing new, since blocks already happen one after another.
  static void* tsan_fiber(int id) {
    static thread_local std::vector<void*> fibers;
    while (static_cast<int>(fibers.size()) <= id) fibers.push_back(__tsan_create_fiber(0));
    return fibers[id];
  }
#endif

  // The body of every fiber: the kernel, then the exit checks. Errors end the launch.
  static void fiber_main() {
    Run& run = *t_run;
    Thread& self = *t_thread;
    self.started = true;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, &run.scheduler_stack_, &run.scheduler_stack_bytes_);
#endif
#if defined(__SANITIZE_THREAD__)
    __tsan_acquire(&run.block_start_);
#endif
    try {
      run.body_(run.context_);
      complete_copies(self, 0, true);  // a thread's copies still land in shared memory after it exits
      Untracked untracked;
      run.exit_kernel(self);
    } catch (const Cancelled&) {
    } catch (...) {
      Untracked untracked;
      if (!run.error_) run.error_ = std::current_exception();
    }
    self.state = State::kExited;  // (exit_kernel has done so already unless the block is being abandoned)
    run.yield(self, /*exiting=*/true);
    std::abort();  // an exited fiber is never resumed
  }

  // Scheduler: runs `t` until it waits or exits.
  void resume(Thread& t) {
    t_thread = &t;
#if defined(__SANITIZE_ADDRESS__)
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, t.stack, options_.stack_bytes);
#endif
#if defined(__SANITIZE_THREAD__)
    __tsan_switch_to_fiber(t.tsan_fiber, __tsan_switch_to_fiber_no_sync);  // switching orders nothing
#endif
#if defined(SIMT_FAST_SWITCH)
    fiber_switch(&scheduler_sp_, t.sp);
#else
    swapcontext(&scheduler_, &t.context);
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    t_thread = nullptr;
  }

  // Running thread: back to the scheduler; returns when the scheduler resumes `self`.
  void yield(Thread& self, bool exiting) {
#if defined(__SANITIZE_THREAD__)
    __tsan_release(&block_done_);
    __tsan_switch_to_fiber(scheduler_tsan_fiber_, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(exiting ? nullptr : &self.asan_fake_stack, scheduler_stack_,
                                   scheduler_stack_bytes_);
#endif
#if defined(SIMT_FAST_SWITCH)
    fiber_switch(&self.sp, scheduler_sp_);
#else
    swapcontext(&self.context, &scheduler_);
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(self.asan_fake_stack, nullptr, nullptr);
#endif
    (void)exiting;
  }

  // ---- Matching arrivals to meetings. An arrival is checked against every thread that waits: it joins the
  // meeting it belongs to, or it is an error if it cannot complete (or keeps another meeting from completing).

  Meeting* find_barrier(Thread& self, const Site& site) {
    Meeting* found = nullptr;
    std::vector<int> exited;
    for (Thread& other : threads_) {
      if (other.state == State::kExited) exited.push_back(other.id);
      if (other.state != State::kWaiting) continue;
      const Meeting& at = *other.meeting;
      if (at.is(Op::kSyncthreads, site, 0)) {
        found = other.meeting;
      } else if (at.op == Op::kSyncthreads) {
        throw error("divergent __syncthreads: ", self.name(), " arrives at ", site.str(), " while ",
                    id_list(waiting_at(at), "wait", "waits"), " at ", at.site.str());
      } else if (at.needs(self.warp, self.lane)) {
        throw error(self.name(), " arrives at __syncthreads() at ", site.str(), " while lane ", other.lane, " = ",
                    other.name(), " waits for it at ", at.str());
      }
    }
    if (!exited.empty()) {
      throw error(self.name(), " arrives at __syncthreads() at ", site.str(), ", but ", id_list(exited, "have", "has"),
                  " exited");
    }
    return found;
  }

  Meeting* find_collective(Thread& self, Op op, const Site& site, unsigned mask) {
    const auto call = [&] { return cat(self.name(), " calls ", op_name(op), "(mask ", hex(mask), ") at ", site.str()); };
    const int lanes = std::min<int>(32, static_cast<int>(threads_.size()) - 32 * self.warp);
    const unsigned existing = lanes == 32 ? ~0u : (1u << lanes) - 1;
    if (!(mask >> self.lane & 1u)) {
      throw error(call(), ", whose mask leaves out its own lane ", self.lane);
    }
    if (mask & ~existing) {
      throw error(call(), ", whose mask names lanes past the end of the block (warp ", self.warp, " has ", lanes,
                  " lanes)");
    }
    Meeting* found = nullptr;
    for (int lane = 0; lane < lanes; ++lane) {
      Thread& other = threads_[32 * self.warp + lane];
      const bool attends = mask >> lane & 1u;
      if (&other == &self) continue;
      if (attends && other.state == State::kExited) {
        throw error(call(), ", but lane ", lane, " = ", other.name(), " has exited");
      }
      if (other.state != State::kWaiting) continue;
      const Meeting& at = *other.meeting;
      if (at.is(op, site, mask)) {
        found = other.meeting;
      } else if (attends) {
        throw error(call(), ", but lane ", lane, " = ", other.name(), " waits at ", at.str());
      } else if (at.op != Op::kSyncthreads && at.needs(self.warp, self.lane)) {
        throw error(call(), " while lane ", lane, " = ", other.name(), " waits for it at ", at.str());
      }
    }
    return found;
  }

  std::vector<int> waiting_at(const Meeting& meeting) const {
    std::vector<int> ids;
    for (const Thread& t : threads_) {
      if (t.state == State::kWaiting && t.meeting == &meeting) ids.push_back(t.id);
    }
    return ids;
  }

  // The last attendee has arrived: compute the collective's results and release everyone.
  void complete(Meeting& meeting) {
    std::vector<Thread*> attendees;
    for (Thread& t : threads_) {
      if (t.state == State::kWaiting && t.meeting == &meeting) attendees.push_back(&t);
    }
    if (is_wmma(meeting.op)) {
      attendees.front()->wmma_complete(meeting, attendees);  // the same for every lane: the same call site
      for (Thread* t : attendees) t->state = State::kReady;
      return;
    }
    unsigned ballot = 0;
    int count = 0;  // __syncthreads_or / _and / _count: the block's nonzero predicates
    for (Thread* t : attendees) ballot |= (t->value != 0 ? 1u : 0u) << t->lane, count += t->value != 0;
    for (Thread* t : attendees) {
      switch (meeting.op) {
        case Op::kSyncthreads: t->result = static_cast<uint64_t>(count); break;
        case Op::kBallot: t->result = ballot; break;
        case Op::kAny: t->result = ballot != 0; break;
        case Op::kAll: t->result = ballot == meeting.mask; break;
        case Op::kShflIdx:
        case Op::kShflUp:
        case Op::kShflDown:
        case Op::kShflXor: {
          const int source = source_lane(meeting.op, t->lane, t->operand, t->width);
          if (!(meeting.mask >> source & 1u)) {
            throw error("lane ", t->lane, " = ", t->name(), " reads lane ", source, ", which is not in the mask, with ",
                        meeting.str());
          }
          t->result = threads_[32 * meeting.warp + source].value;
          break;
        }
        default: break;
      }
    }
    for (Thread* t : attendees) t->state = State::kReady;
  }

  Options options_;
  const dim3 grid_, block_;
  const size_t dynamic_bytes_;
  void (*const body_)(void*);
  void* const context_;
  std::mt19937_64 rng_;

  std::vector<Thread> threads_;
  char* stacks_ = nullptr;
  size_t stacks_bytes_ = 0, page_ = 0;

  // The block being run.
  uint3 block_idx_{};
  size_t exited_ = 0;
  std::list<Meeting> meetings_;  // open meetings (stable addresses)
  std::map<const void*, Allocation> static_shared_;
  size_t static_bytes_ = 0;
  Allocation dynamic_;
  std::map<const void*, PendingCopy> pending_copies_;
  std::exception_ptr error_;
  bool cancelling_ = false;

  // The scheduler's side of the switches.
#if defined(SIMT_FAST_SWITCH)
  void* scheduler_sp_ = nullptr;
#else
  ucontext_t scheduler_{};  // zeroed: ASan's swapcontext interceptor reads its uc_stack
#endif
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_bytes_ = 0;
#if defined(__SANITIZE_THREAD__)
  void* scheduler_tsan_fiber_ = __tsan_get_current_fiber();
  char block_start_ = 0, block_done_ = 0;  // TSan sync objects (only their addresses matter)
#endif
};

inline Run& current_run() {
  if (t_run == nullptr || t_thread == nullptr) throw Error("simt: a device function was called outside a kernel");
  return *t_run;
}

// A collective of the running thread: `value` and `operand` in, the result's raw bytes out.
inline uint64_t collective(Op op, const Site& site, unsigned mask, uint64_t value, int operand = 0, int width = 32) {
  Untracked untracked;
  Run& run = current_run();
  Thread& self = *t_thread;
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    throw run.error(self.name(), " calls ", op_name(op), " at ", site.str(), " with width ", width,
                    " (a power of 2 from 1 to 32)");
  }
  self.value = value, self.operand = operand, self.width = width;
  run.meet(self, op, site, mask);
  return self.result;
}

template <typename T>
uint64_t to_bits(T value) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffled values are at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T value;
  std::memcpy(static_cast<void*>(&value), &bits, sizeof(T));
  return value;
}

// A read-modify-write as one atomic operation (a compare-and-swap loop), relaxed like CUDA's atomics.
template <typename T, typename F>
T atomic_update(T* address, F update) {
  T old, desired;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  do {
    desired = update(old);
  } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return old;
}

}  // namespace detail

inline const Builtins& builtins() {
  if (detail::t_thread == nullptr) throw Error("simt: threadIdx/blockIdx/blockDim/gridDim read outside a kernel");
  return detail::t_thread->builtins;
}

template <typename T>
T& shared(const void* key) {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_destructible_v<T>,
                "shared memory holds trivial types only (CUDA runs no constructors for it)");
  detail::Untracked untracked;
  return *static_cast<T*>(detail::current_run().static_shared(key, sizeof(T), alignof(T)));
}

template <typename T>
T* dynamic_shared() {
  static_assert(alignof(T) <= 16, "dynamic shared memory is 16-byte aligned");
  detail::Untracked untracked;
  return static_cast<T*>(detail::current_run().dynamic_shared());
}

namespace detail {
// A kernel and its parameters, copied once as CUDA copies them to the device; each thread gets its own copy.
template <typename... Params>
struct KernelCall {
  void (*kernel)(Params...);
  std::tuple<std::decay_t<Params>...> params;

  static void run(void* call) { static_cast<KernelCall*>(call)->invoke(std::index_sequence_for<Params...>{}); }
  template <size_t... I>
  void invoke(std::index_sequence<I...>) {
    kernel(std::get<I>(params)...);
  }
};
}  // namespace detail

template <typename... Params, typename... Args>
void launch(const Options& options, void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_shared_bytes,
            Args&&... args) {
  detail::KernelCall<Params...> call{kernel, {std::forward<Args>(args)...}};
  detail::Untracked untracked;
  detail::Run run(options, grid, block, dynamic_shared_bytes, &detail::KernelCall<Params...>::run, &call);
  detail::Run* outer = std::exchange(detail::t_run, &run);
  try {
    run.run_grid();
  } catch (...) {
    detail::t_run = outer;
    throw;
  }
  detail::t_run = outer;
}

}  // namespace simt

// ---------------------------------------------------------------------------------------------------------------
// The device API, in the global namespace as CUDA declares it.

#define threadIdx (::simt::builtins().thread_idx)
#define blockIdx (::simt::builtins().block_idx)
#define blockDim (::simt::builtins().block_dim)
#define gridDim (::simt::builtins().grid_dim)
constexpr int warpSize = 32;

// Waits until every thread of the block reaches this same __syncthreads.
inline void __syncthreads(simt::Site site = simt::Site::here()) {
  simt::detail::collective(simt::detail::Op::kSyncthreads, site, 0, 0);
}

// __syncthreads that also counts the threads of the block whose predicate is nonzero: _count returns that count,
// _or whether it is nonzero, _and whether it is every thread.
inline int __syncthreads_count(int predicate, simt::Site site = simt::Site::here()) {
  return static_cast<int>(simt::detail::collective(simt::detail::Op::kSyncthreads, site, 0, predicate != 0));
}
inline int __syncthreads_or(int predicate, simt::Site site = simt::Site::here()) {
  return __syncthreads_count(predicate, site) != 0;
}
inline int __syncthreads_and(int predicate, simt::Site site = simt::Site::here()) {
  return __syncthreads_count(predicate, site) == static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}

// Waits until every lane of `mask` (which must include the caller) reaches this same __syncwarp.
inline void __syncwarp(unsigned mask = 0xffffffffu, simt::Site site = simt::Site::here()) {
  simt::detail::collective(simt::detail::Op::kSyncwarp, site, mask, 0);
}

// Shuffles: every lane of `mask` calls the same shuffle with the same mask; see source_lane for the lane chosen.
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  return from_bits<T>(collective(Op::kShflIdx, site, mask, to_bits(var), src_lane, width));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  return from_bits<T>(collective(Op::kShflUp, site, mask, to_bits(var), static_cast<int>(delta), width));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  return from_bits<T>(collective(Op::kShflDown, site, mask, to_bits(var), static_cast<int>(delta), width));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  return from_bits<T>(collective(Op::kShflXor, site, mask, to_bits(var), lane_mask, width));
}

// Votes over the lanes of `mask`.
inline unsigned __ballot_sync(unsigned mask, int predicate, simt::Site site = simt::Site::here()) {
  return static_cast<unsigned>(simt::detail::collective(simt::detail::Op::kBallot, site, mask, predicate != 0));
}
inline int __any_sync(unsigned mask, int predicate, simt::Site site = simt::Site::here()) {
  return static_cast<int>(simt::detail::collective(simt::detail::Op::kAny, site, mask, predicate != 0));
}
inline int __all_sync(unsigned mask, int predicate, simt::Site site = simt::Site::here()) {
  return static_cast<int>(simt::detail::collective(simt::detail::Op::kAll, site, mask, predicate != 0));
}

// Atomics: real atomic operations (relaxed, as CUDA's are), so that ThreadSanitizer sees them as atomics.
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* address, float value) {
  return simt::detail::atomic_update(address, [=](float old) { return old + value; });
}
inline double atomicAdd(double* address, double value) {
  return simt::detail::atomic_update(address, [=](double old) { return old + value; });
}
inline int atomicSub(int* address, int value) { return __atomic_fetch_sub(address, value, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned* address, unsigned value) {
  return __atomic_fetch_sub(address, value, __ATOMIC_RELAXED);
}
template <typename T>
T atomicMax(T* address, T value) {
  static_assert(std::is_integral_v<T>, "CUDA declares atomicMax for integers only");
  return simt::detail::atomic_update(address, [=](T old) { return old < value ? value : old; });
}
template <typename T>
T atomicMin(T* address, T value) {
  static_assert(std::is_integral_v<T>, "CUDA declares atomicMin for integers only");
  return simt::detail::atomic_update(address, [=](T old) { return value < old ? value : old; });
}
template <typename T>
T atomicExch(T* address, T value) {
  T old;
  __atomic_exchange(address, &value, &old, __ATOMIC_RELAXED);
  return old;
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange(address, &compare, &value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;  // the old value either way
}

// Loads through the read-only cache are plain loads here.
template <typename T>
T __ldg(const T* address) {
  return *address;
}

// Math. expf, tanhf, fmaxf, fminf, fmaf and INFINITY come from <cmath>; the fast intrinsics are the exact
// functions here (CUDA's __expf is within 2 + 1.16 * |x| ulp of expf; that difference is not emulated).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// min and max with CUDA's overloads (same-type, plus signed/unsigned pairs that resolve to the unsigned type).
#define SIMT_MIN_MAX(R, A, B)                                                       \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(b) : static_cast<R>(a); }
SIMT_MIN_MAX(int, int, int)
SIMT_MIN_MAX(unsigned, unsigned, unsigned)
SIMT_MIN_MAX(unsigned, int, unsigned)
SIMT_MIN_MAX(unsigned, unsigned, int)
SIMT_MIN_MAX(long, long, long)
SIMT_MIN_MAX(unsigned long, unsigned long, unsigned long)
SIMT_MIN_MAX(unsigned long, long, unsigned long)
SIMT_MIN_MAX(unsigned long, unsigned long, long)
SIMT_MIN_MAX(long long, long long, long long)
SIMT_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
SIMT_MIN_MAX(unsigned long long, long long, unsigned long long)
SIMT_MIN_MAX(unsigned long long, unsigned long long, long long)
#undef SIMT_MIN_MAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------------------------------------
// nvcuda::wmma: warp matrix operations, shape m16n16k16, half or bfloat16 inputs, float accumulators (what the
// kernels use; other shapes and types do not compile here).
//
// Every operation is a collective of the whole warp: all 32 lanes call it at the same site, with the same pointer,
// leading dimension and layout (load/store) or the same value (fill), or the emulator reports an error, as for
// shuffles. load_matrix_sync / store_matrix_sync check CUDA's requirements: a 256-bit aligned pointer and ldm a
// multiple of 16 bytes. After the meeting each lane reads or writes its own elements itself, so the sanitizers see
// every lane's accesses (and, as on a GPU, lanes' shared-memory writes need a __syncwarp before another lane's
// load_matrix_sync reads them). mma_sync is computed by the last lane to arrive: D = A * B + C, float products
// summed in k order with fmaf.
//
// The element layout of a fragment is unspecified in CUDA, so a kernel may only use it through these operations,
// or element-wise the same way for all elements. Here lane l holds (row, column) of the fragment's 16 x 16 matrix:
//   matrix_a      row (8l + i) / 16, column (8l + i) % 16        (runs of rows)
//   matrix_b      row (8l + i) % 16, column (8l + i) / 16        (runs of columns)
//   accumulator   row l % 16,        column 8 (l / 16) + i       (a row over two lanes 16 apart)
// three different layouts, none that of a GPU, so a kernel that assumes one (or that A, B and C agree) fails here.
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "simt emulates the wmma shape m16n16k16 only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "simt emulates half/bfloat16 matrix_a/matrix_b and float accumulators");
  static_assert(std::is_same_v<Use, accumulator> == std::is_same_v<Layout, void>,
                "matrix_a and matrix_b take row_major or col_major; accumulators no layout");
  using element_type = T;
  using storage_element_type = T;
  enum { num_elements = 8 };  // 256 elements over 32 lanes
  T x[num_elements];
};

}  // namespace wmma
}  // namespace nvcuda

namespace simt {
namespace detail {

// (row, column) of element i of lane `lane` (the layouts above).
template <typename Use>
inline std::pair<int, int> wmma_element(int lane, int i) {
  const int index = 8 * lane + i;
  if constexpr (std::is_same_v<Use, nvcuda::wmma::matrix_a>) return {index / 16, index % 16};
  if constexpr (std::is_same_v<Use, nvcuda::wmma::matrix_b>) return {index % 16, index / 16};
  return {lane % 16, 8 * (lane / 16) + i};
}

template <typename T>
float wmma_to_float(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return __bfloat162float(x);
}

// d = a * b + c for 16 x K x N matrices in float, each sum from c in k order with fmaf (wmma::mma_sync and
// mma_m16n8k16 alike; d may not be c).
template <int K, int N>
void product_in_k_order(float (&d)[16][N], const float (&a)[16][K], const float (&b)[K][N], const float (&c)[16][N]) {
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < N; ++n) {
      float sum = c[m][n];
      for (int k = 0; k < K; ++k) sum = fmaf(a[m][k], b[k][n], sum);
      d[m][n] = sum;
    }
  }
}

// load_matrix_sync / store_matrix_sync: the lanes' arguments.
struct WmmaMemory {
  const void* pointer;
  unsigned ldm;
  bool col_major;
  size_t element_bytes;
};

inline void wmma_check_memory(const Meeting& meeting, const std::vector<Thread*>& lanes) {
  const auto& first = *static_cast<const WmmaMemory*>(lanes.front()->payload);
  const auto describe = [](const WmmaMemory& m) {
    return cat("pointer ", m.pointer, ", ldm ", m.ldm, ", ", m.col_major ? "column" : "row", " major");
  };
  for (const Thread* t : lanes) {
    const auto& mine = *static_cast<const WmmaMemory*>(t->payload);
    if (mine.pointer != first.pointer || mine.ldm != first.ldm || mine.col_major != first.col_major) {
      throw current_run().error(t->name(), " calls ", meeting.str(), " with ", describe(mine), ", but ",
                                lanes.front()->name(), " with ", describe(first), " (every lane must pass the same)");
    }
  }
  const std::string callers = cat("warp ", lanes.front()->warp, " (thread ", lanes.front()->id, " to thread ",
                                  lanes.back()->id, ") calls ", meeting.str());
  if (reinterpret_cast<uintptr_t>(first.pointer) % 32 != 0) {
    throw current_run().error(callers, " with the pointer ", first.pointer, ", which is not 256-bit aligned");
  }
  if (first.ldm * first.element_bytes % 16 != 0) {
    throw current_run().error(callers, " with ldm ", first.ldm, ", which is not a multiple of 16 bytes (",
                              16 / first.element_bytes, " elements)");
  }
}

inline void wmma_check_fill(const Meeting& meeting, const std::vector<Thread*>& lanes) {
  const uint64_t first = *static_cast<const uint64_t*>(lanes.front()->payload);
  for (const Thread* t : lanes) {
    if (*static_cast<const uint64_t*>(t->payload) != first) {
      throw current_run().error(t->name(), " calls ", meeting.str(), " with another value than ",
                                lanes.front()->name(), " (the fragment's layout is unspecified: fill it uniformly)");
    }
  }
}

template <typename D, typename A, typename B, typename C>
struct WmmaMma {
  D* d;
  const A* a;
  const B* b;
  const C* c;
};

template <typename D, typename A, typename B, typename C>
void wmma_compute_mma(const Meeting&, const std::vector<Thread*>& lanes) {
  float a[16][16], b[16][16], acc[16][16];
  for (const Thread* t : lanes) {
    const auto& args = *static_cast<const WmmaMma<D, A, B, C>*>(t->payload);
    for (int i = 0; i < 8; ++i) {
      const auto [ar, ac] = wmma_element<nvcuda::wmma::matrix_a>(t->lane, i);
      const auto [br, bc] = wmma_element<nvcuda::wmma::matrix_b>(t->lane, i);
      const auto [cr, cc] = wmma_element<nvcuda::wmma::accumulator>(t->lane, i);
      a[ar][ac] = wmma_to_float(args.a->x[i]);
      b[br][bc] = wmma_to_float(args.b->x[i]);
      acc[cr][cc] = args.c->x[i];
    }
  }
  float d[16][16];
  product_in_k_order(d, a, b, acc);
  for (const Thread* t : lanes) {  // after every input is read: d may be a or c
    const auto& args = *static_cast<const WmmaMma<D, A, B, C>*>(t->payload);
    for (int i = 0; i < 8; ++i) {
      const auto [r, c] = wmma_element<nvcuda::wmma::accumulator>(t->lane, i);
      args.d->x[i] = d[r][c];
    }
  }
}

inline void wmma_collective(Op op, const Site& site, const void* payload, WmmaComplete complete) {
  Untracked untracked;
  Run& run = current_run();
  Thread& self = *t_thread;
  self.payload = payload, self.wmma_complete = complete;
  run.meet(self, op, site, 0xffffffffu);  // the whole warp
}

// (row, column) of a fragment's element -> its address in a matrix at `pointer` with leading dimension ldm.
template <typename T>
T* wmma_address(T* pointer, unsigned ldm, bool col_major, std::pair<int, int> element) {
  const auto [row, column] = element;
  return pointer + (col_major ? static_cast<size_t>(column) * ldm + row : static_cast<size_t>(row) * ldm + column);
}

template <typename Layout>
constexpr bool is_col_major() {
  return std::is_same_v<Layout, nvcuda::wmma::col_major>;
}

}  // namespace detail
}  // namespace simt

namespace nvcuda {
namespace wmma {

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const T& value, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  const uint64_t bits = to_bits(value);
  wmma_collective(Op::kWmmaFill, site, &bits, &wmma_check_fill);
  for (auto& x : f.x) x = value;
}

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* pointer, unsigned ldm,
                      simt::Site site = simt::Site::here()) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator's load_matrix_sync takes a layout_t");
  using namespace simt::detail;
  constexpr bool col = is_col_major<Layout>();
  const WmmaMemory args{pointer, ldm, col, sizeof(T)};
  wmma_collective(Op::kWmmaLoad, site, &args, &wmma_check_memory);
  const int lane = t_thread->lane;
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = *wmma_address(pointer, ldm, col, wmma_element<Use>(lane, i));
}

// Accumulators: the layout is an argument.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* pointer, unsigned ldm,
                             layout_t layout, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  const WmmaMemory args{pointer, ldm, layout == mem_col_major, sizeof(float)};
  wmma_collective(Op::kWmmaLoad, site, &args, &wmma_check_memory);
  const int lane = t_thread->lane;
  for (int i = 0; i < f.num_elements; ++i) {
    f.x[i] = *wmma_address(pointer, ldm, args.col_major, wmma_element<accumulator>(lane, i));
  }
}

inline void store_matrix_sync(float* pointer, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout, simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  const WmmaMemory args{pointer, ldm, layout == mem_col_major, sizeof(float)};
  wmma_collective(Op::kWmmaStore, site, &args, &wmma_check_memory);
  const int lane = t_thread->lane;
  for (int i = 0; i < f.num_elements; ++i) {
    *wmma_address(pointer, ldm, args.col_major, wmma_element<accumulator>(lane, i)) = f.x[i];
  }
}

// d = a * b + c (d may be c).
template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b, const fragment<accumulator, 16, 16, 16, float>& c,
              simt::Site site = simt::Site::here()) {
  using namespace simt::detail;
  using Acc = fragment<accumulator, 16, 16, 16, float>;
  using A = fragment<matrix_a, 16, 16, 16, T, LayoutA>;
  using B = fragment<matrix_b, 16, 16, 16, T, LayoutB>;
  const WmmaMma<Acc, A, B, Acc> args{&d, &a, &b, &c};
  wmma_collective(Op::kWmmaMma, site, &args, &wmma_compute_mma<Acc, A, B, Acc>);
}

}  // namespace wmma
}  // namespace nvcuda

// ---------------------------------------------------------------------------------------------------------------
// cp.async (csrc/cuda/cp_async.cuh): asynchronous copies of 16 bytes from global to shared memory, in commit groups.
//
// cp_async_16 checks CUDA's requirements (dst in the block's shared memory, dst and a read src 16-byte aligned),
// reads the source at once (the sanitizers see that read at the call) and fills dst with 0xFF bytes (NaN), which
// ThreadSanitizer sees as this thread's write; under AddressSanitizer dst is then poisoned. The bytes land in dst
// only when a wait of the same thread completes the copy's group (cp_async_wait(n): the oldest groups until at
// most n are pending; copies not committed are in no group), written by the waiting thread: another thread sees
// them race-free only after a barrier between. So a kernel that reads dst too early reads NaN, or a poisoned
// address (ASan prints the pending copies and their sites beside its report); a ldmatrix of a row with a copy
// pending, or a second copy into a pending dst, is an error naming both sites. A thread's copies not waited for
// when it exits land at its exit.
namespace simt {
namespace detail {

#if defined(__SANITIZE_ADDRESS__)
// Printed beside an AddressSanitizer report in a launch: the copies that were not yet waited for.
inline void report_pending_copies(const char*) {
  if (t_run == nullptr) return;
  const std::string text = t_run->pending_copies_text();
  if (!text.empty()) std::fprintf(stderr, "simt: cp.async copies pending at this report:\n%s", text.c_str());
}
#endif

inline void complete_copies(Thread& self, size_t keep, bool at_exit) {
  std::vector<Thread::AsyncCopy> done;
  {
    Untracked untracked;
    while (self.groups.size() > keep) {
      for (const Thread::AsyncCopy& copy : self.groups.front()) done.push_back(copy);
      self.groups.pop_front();
    }
    if (at_exit) {
      for (const Thread::AsyncCopy& copy : self.uncommitted) done.push_back(copy);
      self.uncommitted.clear();
    }
    for (const Thread::AsyncCopy& copy : done) {
      t_run->pending_copies().erase(copy.dst);
#if defined(__SANITIZE_ADDRESS__)
      ASAN_UNPOISON_MEMORY_REGION(copy.dst, 16);
#endif
    }
  }
  for (const Thread::AsyncCopy& copy : done) std::memcpy(copy.dst, copy.bytes, 16);  // this thread's writes
}

}  // namespace detail

inline void cp_async_16(void* dst, const void* src, bool in_bounds, Site site = Site::here()) {
  using namespace detail;
  Thread::AsyncCopy copy{dst, site, {}};
  {
    Untracked untracked;
    Run& run = current_run();
#if defined(__SANITIZE_ADDRESS__)
    static const bool registered = (__asan_set_error_report_callback(&report_pending_copies), true);
    (void)registered;
#endif
    const std::string call = cat(t_thread->name(), " calls cp_async_16 at ", site.str());
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || !run.in_shared(dst, 16)) {
      throw run.error(call, " with the destination ", dst,
                      ", which is not 16 bytes of this block's shared memory at a 16-byte aligned address");
    }
    if (in_bounds && reinterpret_cast<uintptr_t>(src) % 16 != 0) {
      throw run.error(call, " with the source ", src, ", which is not 16-byte aligned");
    }
    const std::string pending = run.pending_copy(dst);
    if (!pending.empty()) {
      throw run.error(call, " into ", dst, ", where ", pending, " has not completed (no wait between)");
    }
  }
  if (in_bounds) std::memcpy(copy.bytes, src, 16);  // the global read: out of bounds is ASan's report here
  // NaN until the wait; a write a racing reader meets in TSan (a copy of constant bytes: GCC expands a memset of
  // 16 bytes after its TSan pass, uninstrumented, but turns this memcpy into an instrumented 16-byte store)
  static constexpr unsigned char kPendingBytes[16] = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
                                                      0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF};
  std::memcpy(dst, kPendingBytes, 16);
  Untracked untracked;
  t_run->pending_copies()[dst] = Run::PendingCopy{site, t_thread->id};
  t_thread->uncommitted.push_back(copy);
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(dst, 16);
#endif
}

inline void cp_async_commit(Site site = Site::here()) {
  (void)site;
  detail::Untracked untracked;
  detail::current_run();
  detail::Thread& self = *detail::t_thread;
  self.groups.push_back(std::move(self.uncommitted));
  self.uncommitted.clear();
}

inline void cp_async_wait(int pending, Site site = Site::here()) {
  (void)site;
  detail::current_run();
  detail::complete_copies(*detail::t_thread, static_cast<size_t>(pending));
}

inline void cp_async_wait_all(Site site = Site::here()) {
  cp_async_commit(site);
  cp_async_wait(0, site);
}

// ---------------------------------------------------------------------------------------------------------------
// ldmatrix, movmatrix and mma.sync m16n8k16 (csrc/cuda/mma.cuh, whose opening comment gives the fragment layouts
// of the PTX ISA, which these implement): collectives of the whole warp, at one site. ldmatrix: each lane reads its
// own 16-byte row (which must be 16-byte aligned, in the block's shared memory, and have no cp.async pending), the
// last lane to arrive hands out the elements. mma: the last lane computes D = A B + C, float products summed in k
// order with fmaf, then writes every lane's D (so D may be C).
namespace detail {

struct LdmatrixArgs {
  unsigned char row[16];
  uint32_t* r;
};

inline uint16_t half_of(uint32_t x, int high) { return static_cast<uint16_t>(high ? x >> 16 : x & 0xffffu); }
inline uint32_t two_halves(uint16_t low, uint16_t high) { return static_cast<uint32_t>(low) | uint32_t{high} << 16; }

template <bool TRANS>
void ldmatrix_complete(const Meeting&, const std::vector<Thread*>& lanes) {
  const auto row = [&](int lane) { return static_cast<const LdmatrixArgs*>(lanes[lane]->payload)->row; };
  const auto element = [&](int matrix, int r, int c) {  // element (r, c) of matrix `matrix`
    uint16_t x;
    std::memcpy(&x, row(8 * matrix + r) + 2 * c, 2);
    return x;
  };
  for (const Thread* t : lanes) {
    const int g = t->lane / 4, q = t->lane % 4;
    uint32_t* r = static_cast<const LdmatrixArgs*>(t->payload)->r;
    for (int i = 0; i < 4; ++i) {
      r[i] = TRANS ? two_halves(element(i, 2 * q, g), element(i, 2 * q + 1, g))
                   : two_halves(element(i, g, 2 * q), element(i, g, 2 * q + 1));
    }
  }
}

struct MovmatrixArgs {
  uint32_t x;
  uint32_t* y;
};

inline void movmatrix_complete(const Meeting&, const std::vector<Thread*>& lanes) {
  const auto element = [&](int r, int c) {  // (r, c) of the matrix: lane 4r + c / 2, half c % 2
    return half_of(static_cast<const MovmatrixArgs*>(lanes[4 * r + c / 2]->payload)->x, c % 2);
  };
  for (const Thread* t : lanes) {
    const int g = t->lane / 4, q = t->lane % 4;
    *static_cast<const MovmatrixArgs*>(t->payload)->y = two_halves(element(2 * q, g), element(2 * q + 1, g));
  }
}

struct MmaArgs {
  float* d;
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
};

// A 16-bit element of T (__half or __nv_bfloat16) given by its bits, as float.
template <typename T>
float element_to_float(uint16_t bits) {
  return wmma_to_float(from_bits<T>(bits));
}

template <typename T>
void mma_complete(const Meeting&, const std::vector<Thread*>& lanes) {
  float a[16][16], b[16][8], c[16][8];
  for (const Thread* t : lanes) {
    const auto& args = *static_cast<const MmaArgs*>(t->payload);
    const int g = t->lane / 4, q = t->lane % 4;
    for (int i = 0; i < 4; ++i) {  // a[i]: rows g (+ 8 for odd i), columns 2q, 2q + 1 (+ 8 for i >= 2)
      for (int h = 0; h < 2; ++h) {
        a[g + 8 * (i % 2)][2 * q + h + 8 * (i / 2)] = element_to_float<T>(half_of(args.a[i], h));
      }
    }
    for (int i = 0; i < 2; ++i) {  // b[i]: rows 2q, 2q + 1 (+ 8 for i = 1), column g
      for (int h = 0; h < 2; ++h) b[2 * q + h + 8 * i][g] = element_to_float<T>(half_of(args.b[i], h));
    }
    for (int i = 0; i < 4; ++i) c[g + 8 * (i / 2)][2 * q + i % 2] = args.c[i];  // c[i]: row g (+ 8), col 2q (+ 1)
  }
  float d[16][8];
  product_in_k_order(d, a, b, c);
  for (const Thread* t : lanes) {  // after every input is read: d may be c
    const auto& args = *static_cast<const MmaArgs*>(t->payload);
    const int g = t->lane / 4, q = t->lane % 4;
    for (int i = 0; i < 4; ++i) args.d[i] = d[g + 8 * (i / 2)][2 * q + i % 2];
  }
}

}  // namespace detail

// r = four 8 x 8 matrices of 16-bit elements (trans: transposed); lane l passes row l % 8 of matrix l / 8.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans, Site site = Site::here()) {
  using namespace detail;
  LdmatrixArgs args{{}, r};
  {
    Untracked untracked;
    Run& run = current_run();
    const std::string call = cat(t_thread->name(), " calls ", trans ? "ldmatrix_x4_trans" : "ldmatrix_x4", " at ",
                                 site.str());
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0 || !run.in_shared(row, 16)) {
      throw run.error(call, " with the row ", row,
                      ", which is not 16 bytes of this block's shared memory at a 16-byte aligned address");
    }
    const std::string pending = run.pending_copy(row);
    if (!pending.empty()) throw run.error(call, " with the row ", row, ", where ", pending, " has not completed");
  }
  std::memcpy(args.row, row, 16);  // this lane's read of its row, seen by the sanitizers
  wmma_collective(trans ? Op::kLdmatrixTrans : Op::kLdmatrix, site, &args,
                  trans ? &ldmatrix_complete<true> : &ldmatrix_complete<false>);
}

// The transpose of the 8 x 8 matrix the warp holds as (row lane / 4, columns 2 (lane % 4), + 1).
inline uint32_t movmatrix_trans(uint32_t x, Site site = Site::here()) {
  uint32_t y = 0;
  const detail::MovmatrixArgs args{x, &y};
  detail::wmma_collective(detail::Op::kMovmatrix, site, &args, &detail::movmatrix_complete);
  return y;
}

// d = a * b + c, 16 x 8 x 16, T = __half or __nv_bfloat16 inputs, float accumulators.
template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                  Site site = Site::here()) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "half or bfloat16 inputs");
  const detail::MmaArgs args{d, a, b, c};
  detail::wmma_collective(detail::Op::kMma, site, &args, &detail::mma_complete<T>);
}

}  // namespace simt
