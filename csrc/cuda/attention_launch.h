// The launches of the attention kernels (defined per dtype under instantiations/, from attention_launch.cuh):
// declared without device code, so that the torch-facing launcher (csrc/cuda/attention.cpp) compiles as plain C++
// and the kernels compile once for every torch release (they read no torch header: scripts/nvcc_cache.py keys them
// by what they read).
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"
#include "launch_plan.h"

namespace paged_attn {

// Launches paged_attention_kernel (decode_mma_kernel when plan.tensor_cores), then (split-KV)
// paged_attention_reduce_kernel, on `stream`; returns the launch error (cudaGetLastError), cudaErrorInvalidValue when
// the head dim or group variant is not instantiated. params must hold the plan (params.set_plan(plan)).
cudaError_t launch_paged_attention(const AttentionParams<float>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__half>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
// fp8 caches (attention_fp8_float.cu, attention_fp8_half.cu, attention_fp8_bf16.cu).
cudaError_t launch_paged_attention(const AttentionParams<float, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__half, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);
cudaError_t launch_paged_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const AttentionPlan& plan,
                                   cudaStream_t stream);

// The thread blocks of the paged_attention_kernel instantiation for params' head dim and group_variant (or, with
// tensor_cores, of decode_mma_kernel for the head dim) that one SM of the current device (`device`) holds at once,
// into *blocks: cudaOccupancyMaxActiveBlocksPerMultiprocessor at kAttentionThreads threads and the kernel's dynamic
// shared memory, cached per (device, instantiation); plan_attention's blocks_per_sm. cudaErrorInvalidValue when the
// head dim or group variant is not instantiated.
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<float>& params, int group_variant, bool tensor_cores,
                                          int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__half>& params, int group_variant, bool tensor_cores,
                                          int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<float, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__half, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);
cudaError_t paged_attention_blocks_per_sm(const AttentionParams<__nv_bfloat16, Fp8>& params, int group_variant,
                                          bool tensor_cores, int device, int* blocks);

// Launches varlen_attention_kernel on `stream` (float16 and bfloat16 queries; caches of the same dtype, or fp8:
// varlen_attention_fp8_half.cu, varlen_attention_fp8_bf16.cu); returns the launch error, cudaErrorInvalidValue when
// the head dim is not instantiated. params must hold the plan (params.set_varlen_plan).
cudaError_t launch_varlen_attention(const AttentionParams<__half>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__nv_bfloat16>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__half, Fp8>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);
cudaError_t launch_varlen_attention(const AttentionParams<__nv_bfloat16, Fp8>& params, const VarlenPlan& plan,
                                    cudaStream_t stream);

}  // namespace paged_attn
