// The host side of PagedCache (paged_cache.cuh, which stays torch-free for the CPU emulator): a cache tensor
// viewed as a PagedCache<T> by the CUDA launchers (attention.cpp, cache_ops.cpp). Cache layout: see paged_attn/ops.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "paged_cache.cuh"

namespace paged_attn {

// A checked cache ([num_blocks, block_size, num_kv_heads, head_dim], check_cache) as a PagedCache<T>, every count
// (the strides and head_dim) converted from elements to units of T: T the element type itself, a wider integer
// Unit that holds a whole number of elements (the caller has checked, with access_width, that the strides and
// head_dim in bytes are multiples of sizeof(T)), or char for counts in bytes.
template <typename T>
PagedCache<T> paged_cache_of(const at::Tensor& t) {
  const int64_t elem = t.element_size();
  const auto to_units = [elem](int64_t elements) { return elements * elem / static_cast<int64_t>(sizeof(T)); };
  return PagedCache<T>{static_cast<T*>(t.data_ptr()),          to_units(t.stride(0)),
                       to_units(t.stride(1)),                   to_units(t.stride(2)),
                       static_cast<int>(t.size(1)),             static_cast<int>(t.size(2)),
                       static_cast<int>(to_units(t.size(3)))};
}

}  // namespace paged_attn
