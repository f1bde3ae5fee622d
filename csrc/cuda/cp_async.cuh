// Asynchronous copies from global to shared memory (cp.async, sm_80+), as inline PTX, in commit groups:
//   cp_async_16(dst, src, in_bounds)  starts a copy of 16 bytes from global `src` to shared `dst` (both 16-byte
//                                     aligned); in_bounds false: `src` is not read and `dst` is filled with zeros
//                                     (src-size 0). The bytes land in `dst` at some time before the wait below.
//   cp_async_16(dst, src)             the same, always in bounds.
//   cp_async_commit()                 closes the copies this thread started since its last commit into a group.
//   cp_async_wait<N>()                waits until at most N of this thread's groups are pending (the oldest
//                                     complete first); copies not yet committed are in no group
//                                     and not waited for. cp_async_wait_all(): commit, then wait until none is.
// A copy's bytes are visible to the thread that started it after the wait, to the other threads after the wait and
// a barrier (__syncwarp, __syncthreads) between them. Until then `dst` must be neither read nor written.
// Under the CPU emulator (tests/emulated/simt.h, PAGED_ATTN_EMULATED) completion is deferred to the wait, and `dst`
// is poisoned until then: a read or write of it before the wait is an error naming both places.
#pragma once

#include <cstdint>

#include "device.cuh"

namespace paged_attn {

#ifdef PAGED_ATTN_EMULATED

inline void cp_async_16(void* dst, const void* src, bool in_bounds, simt::Site site = simt::Site::here()) {
  simt::cp_async_16(dst, src, in_bounds, site);
}
inline void cp_async_16(void* dst, const void* src, simt::Site site = simt::Site::here()) {
  simt::cp_async_16(dst, src, true, site);
}
inline void cp_async_commit(simt::Site site = simt::Site::here()) { simt::cp_async_commit(site); }
template <int N>
inline void cp_async_wait(simt::Site site = simt::Site::here()) {
  simt::cp_async_wait(N, site);
}
inline void cp_async_wait_all(simt::Site site = simt::Site::here()) { simt::cp_async_wait_all(site); }

#else

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool in_bounds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(in_bounds ? 16 : 0)
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src)
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

#endif  // PAGED_ATTN_EMULATED

}  // namespace paged_attn
