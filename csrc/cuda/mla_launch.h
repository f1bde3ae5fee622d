// The launches of mla_attention's kernels (defined per dtype in instantiations/mla_attention_*.cu, from
// mla_launch.cuh): declared without device code, so that the torch-facing launcher (csrc/cuda/attention.cpp)
// compiles as plain C++ (as attention_launch.h for paged_attention).
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"
#include "mla_plan.h"

namespace paged_attn {

// Launches mla_attention_kernel (then, in split-KV, paged_attention_reduce_kernel at HEAD_DIM = kv_lora_rank) on
// `stream`: params as mla_kernels.cuh describes them, holding the plan of plan_mla_attention; returns the launch
// error, cudaErrorInvalidValue when (kv_lora_rank, rope_dim) is not instantiated (MlaShapes).
cudaError_t launch_mla_attention(const AttentionParams<__half>& params, const AttentionPlan& plan, int kv_lora_rank,
                                 cudaStream_t stream);
cudaError_t launch_mla_attention(const AttentionParams<__nv_bfloat16>& params, const AttentionPlan& plan,
                                 int kv_lora_rank, cudaStream_t stream);

// The thread blocks of mla_attention_kernel for (kv_lora_rank, rope_dim) that one SM of `device` holds at once
// (plan_mla_attention's blocks_per_sm), cached per (device, instantiation); the first argument picks the dtype.
cudaError_t mla_attention_blocks_per_sm(__half, int kv_lora_rank, int rope_dim, int device, int* blocks);
cudaError_t mla_attention_blocks_per_sm(__nv_bfloat16, int kv_lora_rank, int rope_dim, int device, int* blocks);

}  // namespace paged_attn
