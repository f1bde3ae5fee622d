// The CPU tiled prefill kernel (the sequences of a varlen call with at least kMinPrefillQueryLen query tokens:
// attention.cpp), compiled here for every (query dtype, cache dtype) pair; the kernel: prefill_kernels.h.

#include "attention_common.h"  // first: it selects at::vec's implementation
#include "prefill_kernels.h"

namespace paged_attn {
namespace cpu {

template <typename scalar_t, typename cache_t>
void prefill_attention(const AttentionParams<scalar_t, cache_t>& params, const int32_t* query_start_loc,
                       const int32_t* seq_lens, const std::vector<int32_t>& seqs, scalar_t* out) {
  TORCH_INTERNAL_ASSERT(params.head_dim_v == params.head_dim, "the prefill kernel takes values as wide as the keys");
  prefill_kernel(params, query_start_loc, seq_lens, seqs, out);
}

#define PA_INSTANTIATE_PREFILL(scalar_t, cache_t)                                                                 \
  template void prefill_attention(const AttentionParams<scalar_t, cache_t>&, const int32_t*, const int32_t*, \
                                  const std::vector<int32_t>&, scalar_t*);
PA_FOR_EACH_CPU_ATTENTION_TYPE(PA_INSTANTIATE_PREFILL)

}  // namespace cpu
}  // namespace paged_attn
