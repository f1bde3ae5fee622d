// merge_attention_states' kernel parameters (no torch, no device code: the torch-facing launcher,
// csrc/cuda/merge_attention_states.cpp, compiles them as plain C++; the kernel, merge_attention_states_kernels.cuh,
// and the emulator read them too).
#pragma once

#include <cstdint>

#include "device.cuh"

namespace paged_attn {

// Strides in elements; the last dimension of out, out_a and out_b is contiguous.
template <typename T>
struct MergeAttentionStatesParams {
  T* out;               // [num_tokens, num_heads, head_dim]
  float* lse;           // [num_tokens, num_heads]
  const T* out_a;       // [num_tokens, num_heads, head_dim]
  const float* lse_a;   // [num_tokens, num_heads]
  const T* out_b;       // [num_tokens, num_heads, head_dim]
  const float* lse_b;   // [num_tokens, num_heads]
  int64_t out_stride[2], out_a_stride[2], out_b_stride[2];  // token, head
  int64_t lse_stride[2], lse_a_stride[2], lse_b_stride[2];  // token, head
  int num_heads, head_dim;
};

}  // namespace paged_attn
