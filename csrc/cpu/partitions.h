// The CPU decode kernel's rows as partitions (decode.cpp includes it): a row's online-softmax state (RowState) and
// the exact merge of two, the partitions of every row at fixed token positions (Partitions), and their split among
// the threads by cost (split_among_threads).
#pragma once

#include "attention_common.h"
#include "avx512_kernels.h"  // store_head_avx512

namespace paged_attn {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The decode kernel's host side: cut the rows into partitions, run them on the threads, merge each row's
// partitions.

// The online-softmax state of one query row's heads over some of its keys (a view): per query head the max logit
// m, the sum s = sum_t e^(x_t - m) and the unnormalized acc = sum_t e^(x_t - m) v_t (in acc_index order), over
// a float buffer of num_heads * (head_dim_v + 2) (head_dim_v: the value rows' width). The row's log-sum-exp of its
// logits, per head, is m + log(s).
struct RowState {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_dim_v]
  static int64_t size(int64_t num_heads, int64_t head_dim_v) { return num_heads * (head_dim_v + 2); }
  RowState(float* p, int64_t num_heads, int64_t head_dim_v)
      : max(p), sum(p + num_heads), acc(p + 2 * num_heads) {}
  RowState(float* max_logit, float* exp_sum, float* acc_) : max(max_logit), sum(exp_sum), acc(acc_) {}
};

// The partition state attend leaves in sc, as a RowState over sc's max and acc and `sums` [num_heads], into which
// its lane sums are added up (lane by lane).
inline RowState partition_state(Scratch& sc, int64_t num_heads, float* sums) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* lane_sums = sc.exp_sums + h * kTileTokens;
    sums[h] = std::accumulate(lane_sums, lane_sums + kTileTokens, 0.f);
  }
  return RowState(sc.max_logit, sums, sc.acc);
}

inline void copy_state(RowState src, int64_t num_heads, int64_t head_dim, RowState dst) {
  std::copy_n(src.max, num_heads, dst.max);
  std::copy_n(src.sum, num_heads, dst.sum);
  std::copy_n(src.acc, num_heads * head_dim, dst.acc);
}

// dst = the merge of dst (the keys before the partition's) and the partition's state src, exactly:
//   M = max(m_dst, m_src),  s = w_dst s_dst + w_src s_src,  acc = w_dst acc_dst + w_src acc_src,  w = e^(m - M),
// w = 1 exactly for the state whose max is M (so that two states of max -inf, rows that saw nothing, add up to an
// empty state rather than NaN; a NaN anywhere stays NaN). Explicit FMAs, so that every caller gets the same bits.
inline void merge_into(RowState dst, RowState src, int64_t num_heads, int64_t head_dim) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float m_dst = dst.max[h], m_src = src.max[h], m = std::max(m_dst, m_src);
    const float w_dst = m_dst == m ? 1.f : std::exp(m_dst - m), w_src = m_src == m ? 1.f : std::exp(m_src - m);
    dst.max[h] = m;
    dst.sum[h] = std::fma(w_dst, dst.sum[h], w_src * src.sum[h]);
    float* a = dst.acc + h * head_dim;
    const float* b = src.acc + h * head_dim;
    int64_t d = 0;
    for (; d + kVecSize <= head_dim; d += kVecSize) {
      at::vec::fmadd(Vec(w_dst), Vec::loadu(a + d), Vec(w_src) * Vec::loadu(b + d)).store(a + d);
    }
    for (; d < head_dim; ++d) a[d] = std::fma(w_dst, a[d], w_src * b[d]);
  }
}

// out = acc / sum for every head of the row (0 for a row that saw no key), and if asked lse = max + log(sum) (-inf
// for a row that saw no key: max = -inf, sum = 0); with a sink, as finish_row says.
template <typename scalar_t, typename cache_t>
void write_row(const AttentionParams<scalar_t, cache_t>& params, int64_t row, RowState state, scalar_t* out) {
  const int64_t num_heads = params.num_heads, head_dim = params.head_dim_v;  // the output's
  for (int64_t h = 0; h < num_heads; ++h) {
    const RowFinish finish = finish_row(state.max[h], state.sum[h], params.v_scale, params.sinks, h);
    if (params.lse) params.lse[params.token(row) * num_heads + h] = finish.lse;
    const float inv_sum = finish.out_scale;
    const float* acc = state.acc + h * head_dim;
    scalar_t* dst = out + (params.token(row) * num_heads + h) * head_dim;
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (params.avx512_bf16) {
        store_head_avx512(acc, inv_sum, dst, head_dim, /*acc_index_order=*/!params.tiled);
        continue;
      }
    }
#endif
    for (int64_t d = 0; d < head_dim; ++d) {
      dst[d] = static_cast<scalar_t>(acc[acc_index(d, params.avx512_bf16 && !params.tiled)] * inv_sum);
    }
  }
}

// The rows' partitions, in order: row r's are items [first_item[r], first_item[r + 1]), its partitions
// first_partition(r), first_partition(r) + 1, ... (an empty row has one, empty).
template <typename scalar_t, typename cache_t>
struct Partitions {
  const AttentionParams<scalar_t, cache_t>& params;
  std::vector<int64_t> first_item;  // [num_rows + 1]
  Partitions(const AttentionParams<scalar_t, cache_t>& call, int64_t num_rows)
      : params(call), first_item(num_rows + 1) {
    first_item[0] = 0;
    for (int64_t r = 0; r < num_rows; ++r) first_item[r + 1] = first_item[r] + num_partitions(r);
  }
  int64_t num_items() const { return first_item.back(); }
  int64_t first_partition(int64_t row) const { return params.window_start(row) / kPartitionTokens; }
  int64_t num_partitions(int64_t row) const {
    const int64_t len = params.row_len(row), start = params.window_start(row);
    return len > start ? (len - 1) / kPartitionTokens - start / kPartitionTokens + 1 : 1;
  }
  // The tokens of the row's partition c (an absolute partition index), within its window.
  int64_t partition_begin(int64_t row, int64_t c) const {
    return std::max(params.window_start(row), c * kPartitionTokens);
  }
  int64_t partition_end(int64_t row, int64_t c) const {
    return std::min(params.row_len(row), (c + 1) * kPartitionTokens);
  }
  int64_t row_of(int64_t item) const {  // the row that holds `item`
    return std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
  }
};

// Parts of about equal cost for the threads: part p is items [part_begin[p], part_begin[p + 1]) of the
// cost_before.size() - 1 items, cost_before[i] the cost of the items before i; as many parts as there are threads
// worth waking for kv_bytes of keys and values (kMinBytesPerCpuTask each), at most one per item.
inline std::vector<int64_t> split_by_cost(const std::vector<int64_t>& cost_before, int64_t kv_bytes) {
  const int64_t num_items = static_cast<int64_t>(cost_before.size()) - 1;
  const int64_t num_parts = threads_worth_waking(kv_bytes, num_items);
  std::vector<int64_t> part_begin(num_parts + 1);
  for (int64_t p = 0; p <= num_parts; ++p) {  // the first item whose cost ends past p / num_parts of the total
    const int64_t target = cost_before.back() * p / num_parts;
    part_begin[p] = std::lower_bound(cost_before.begin(), cost_before.end(), target) - cost_before.begin();
  }
  part_begin[0] = 0, part_begin[num_parts] = num_items;
  return part_begin;
}

// The threads' shares: part p is items [part_begin[p], part_begin[p + 1]), about equal in tokens. Threads only for
// work worth waking them (kMinBytesPerCpuTask of keys and values each). Which thread computes a partition never
// changes a bit of the result (see decode_attention, decode.cpp), only the time.
template <typename scalar_t, typename cache_t>
std::vector<int64_t> split_among_threads(const Partitions<scalar_t, cache_t>& partitions, int64_t num_rows,
                                         const std::vector<int64_t>& item_state) {
  const AttentionParams<scalar_t, cache_t>& params = partitions.params;
  const int64_t num_items = partitions.num_items();
  // An item's cost: its tokens (none if it was attended in a shared segment) and a tile's worth for its set-up.
  std::vector<int64_t> cost_before(num_items + 1, 0);
  int64_t total_tokens = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t c0 = partitions.first_partition(r);
    for (int64_t i = 0; i < partitions.num_partitions(r); ++i) {
      const int64_t item = partitions.first_item[r] + i;
      const int64_t span = partitions.partition_end(r, c0 + i) - partitions.partition_begin(r, c0 + i);
      const int64_t tokens = item_state[item] < 0 ? std::max<int64_t>(0, span) : 0;
      total_tokens += tokens;
      cost_before[item + 1] = cost_before[item] + tokens + kTileTokens;
    }
  }
  return split_by_cost(cost_before,
                       total_tokens * params.num_kv_heads * (params.head_dim + params.head_dim_v) *
                           int64_t{sizeof(cache_t)});
}

}  // namespace
}  // namespace paged_attn
