// The CPU attention kernels' parameters, and the two kernels as the entry point (attention.cpp) calls them. Each
// kernel is compiled in a translation unit of its own (decode.cpp, prefill.cpp: they compile in parallel), for
// every (query dtype, cache dtype) pair that paged_attention accepts, PA_FOR_EACH_CPU_ATTENTION_TYPE.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "paged_cache.h"

namespace paged_attn {
namespace cpu {

// A varlen call's sequences with at least this many query tokens take the prefill kernel; the rows of the others
// (decodes, short chunks) the decode kernel, each row at its own position.
constexpr int64_t kMinPrefillQueryLen = 4;

// The call's tensors and sizes (as csrc/cuda's AttentionParams), and the work as query rows: row r is a query token
// at position row_len(r) - 1 of sequence row_seq(r), attending to that sequence's tokens [window_start(r),
// row_len(r)). Decode: row r is sequence r's last token.
template <typename scalar_t, typename cache_t>
struct AttentionParams {  // every field set by name (attention.cpp: paged_attention_cpu)
  PagedKV<cache_t> kv;
  const scalar_t* query = nullptr;  // [num_rows, num_heads, head_dim], strides query_row_stride, query_head_stride
  int64_t query_row_stride = 0, query_head_stride = 0;
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* row_lens = nullptr;      // [num_rows]: position + 1 (decode: seq_lens)
  const int32_t* row_seqs = nullptr;      // [num_rows]: the row's sequence, or nullptr: row r is sequence r (decode)
  const int32_t* row_tokens = nullptr;    // [num_rows]: the row's index in query and out, or nullptr: r
  const float* alibi_slopes = nullptr;    // [num_heads] or nullptr
  int64_t max_blocks_per_seq = 0, block_size = 0, num_heads = 0, num_kv_heads = 0, group_size = 0, head_dim = 0;
  int64_t head_dim_v = 0;  // the value rows' and the output's (head_dim but for MLA-style calls)
  int64_t sliding_window = 0;
  float scale = 0.f, logits_soft_cap = 0.f;  // scale includes k_scale (fp8 caches)
  float v_scale = 1.f;                       // multiplies the output (1 but for fp8 caches)
  float* lse = nullptr;  // [num_tokens, num_heads]: each row's log-sum-exp of its logits (return_lse), or nullptr
  const float* sinks = nullptr;  // [num_heads]: each head's sink logit (gpt-oss), or nullptr
  bool avx512_bf16 = false;  // take the AVX-512 bf16 path (and keep acc in its order, see acc_index)
  bool amx = false;          // and within it the AMX path for the decode steps (amx_kernels.h)
  bool tiled = false;        // the caches are tiled (paged_cache.h), read as they are on the AVX-512 bf16 path; acc
                             // then in the natural order
  // The bfloat16 terms of each softmax weight p in the AVX-512 path's P V products: 2 (hi + lo: p to about 2^-16,
  // as float32 math) or 1 (p rounded to bfloat16, half the products: MLA, whose heads make decode compute-bound).
  int p_terms = 2;

  int64_t row_len(int64_t row) const { return row_lens[row]; }
  int64_t token(int64_t row) const { return row_tokens ? row_tokens[row] : row; }
  const int32_t* block_table(int64_t row) const {
    return block_tables + (row_seqs ? row_seqs[row] : row) * max_blocks_per_seq;
  }
  // The first token a query at `position` sees (the sliding window's start; 0 without one).
  int64_t first_visible(int64_t position) const {
    return sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1) : 0;
  }
  int64_t window_start(int64_t row) const { return first_visible(row_lens[row] - 1); }
};


// The decode kernel (decode.cpp): each row one query token, at its own position.
template <typename scalar_t, typename cache_t>
void decode_attention(const AttentionParams<scalar_t, cache_t>& params, int64_t num_rows,
                      scalar_t* out);  // [num_tokens, num_heads, head_dim], contiguous; row r at token(r)

// The tiled prefill kernel (prefill.cpp): every query row of the sequences `seqs` (each with at least
// kMinPrefillQueryLen query tokens).
template <typename scalar_t, typename cache_t>
void prefill_attention(const AttentionParams<scalar_t, cache_t>& params,
                       const int32_t* query_start_loc,  // [num_seqs + 1]
                       const int32_t* seq_lens,         // [num_seqs]
                       const std::vector<int32_t>& seqs,
                       scalar_t* out);  // [num_tokens, num_heads, head_dim], contiguous

// The (query dtype, cache dtype) pairs: a cache of the query's dtype, or fp8 with any query dtype.
#define PA_FOR_EACH_CPU_ATTENTION_TYPE(X)                                              \
  X(float, float) X(float, c10::Float8_e4m3fn) X(float, c10::Float8_e5m2)               \
  X(c10::Half, c10::Half) X(c10::Half, c10::Float8_e4m3fn) X(c10::Half, c10::Float8_e5m2) \
  X(c10::BFloat16, c10::BFloat16) X(c10::BFloat16, c10::Float8_e4m3fn) X(c10::BFloat16, c10::Float8_e5m2)

}  // namespace cpu
}  // namespace paged_attn
