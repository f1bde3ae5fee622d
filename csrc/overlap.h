// Memory-overlap geometry of strided tensors: which bytes a tensor's elements cover, and whether two tensors (or
// the block spans swap_blocks copies) share a byte. The checks in common.cpp ask these questions; nothing here
// raises.
//
// How: a tensor's elements cover a lattice of contiguous runs (Footprint): the innermost dims that continue a run
// without a gap are folded into it, the rest are the lattice's outer dims. Two footprints overlap iff some run of
// one intersects some run of the other, decided exactly (not by [min, max) ranges), so the interleaved halves of
// one [num_blocks, 2, ...] allocation, or the key and value slices of one fused QKV tensor, do not overlap.
// O(1): tensors whose byte ranges are disjoint (e.g. separate allocations); two lattices of runs with one common
// stride (a closed form over the index difference); one nested lattice at two nearby offsets (the K and V halves
// of vLLM's packed [num_blocks, block_size, num_kv_heads, 2 * head_dim] cache). Other layouts list both sets of
// runs and sweep them in order, O(n log n) in the number of runs.
// NOTE: PyTorch has no negative strides, so no element lies before data_ptr.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <utility>

namespace paged_attn {

inline uint64_t address_of(const at::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr());
}

// Whether some layouts' elements could share memory: false when, dims taken by increasing stride, each stride
// reaches past everything the smaller-stride dims cover (what views of contiguous tensors satisfy).
bool has_self_overlap(const at::Tensor& t);

// The bytes one block of t ([num_blocks, ...]) spans, from its first element to the end of its last one: the
// block's size when it is contiguous, more for a strided view (e.g. the K half of a packed K|V block spans the V
// rows between its own). 0 when a block is empty.
int64_t block_span_bytes(const at::Tensor& t);

// [begin, end): the bytes from t's first element to the end of its last one. t is not empty.
std::pair<int64_t, int64_t> byte_range(const at::Tensor& t);

// Whether a and b share at least one byte of memory, exactly (see the opening comment; O(1) in the cases listed
// there). Empty tensors, and tensors on different devices, never overlap.
bool tensors_overlap(const at::Tensor& a, const at::Tensor& b);

// a and b are exactly the same memory: same device, data pointer, sizes and strides (e.g. two views of one cache).
bool same_memory(const at::Tensor& a, const at::Tensor& b);

// The bytes a tensor's elements cover, as a lattice of contiguous runs: a run of `run` bytes starts at
// begin + sum(i_d * stride_d) for every index i_d < size_d of the outer dims. The run is made of the innermost
// dims that continue it without a gap; dims of size 1 or stride 0 add no bytes and are dropped.
struct Footprint {
  struct Dim {
    int64_t stride, size;  // stride in bytes
  };
  int64_t begin = 0, run = 0;
  c10::SmallVector<Dim, 4> outer;  // by increasing stride
};

// The footprint of t's elements. t is not empty.
Footprint footprint_of(const at::Tensor& t);

// The bytes swap_blocks copies of t's blocks: one run of block_span_bytes(t) bytes per block, a block stride apart
// (runs that touch or overlap merge into one). t has at least one block, and positive sizes after the first dim.
Footprint block_spans_of(const at::Tensor& t);

// Whether a and b cover a common byte (O(1) when their byte ranges are disjoint).
bool footprints_intersect(const Footprint& a, const Footprint& b);

}  // namespace paged_attn
