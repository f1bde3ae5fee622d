// CPU kernels of paged attention (paged_attn::paged_attention). Decode: one query token per sequence, the kernel
// of decode_kernels.h. With query_start_loc (variable-length queries: prefills, prefill chunks, decodes in one call),
// the rows of sequences with fewer than kMinPrefillQueryLen query tokens (decodes, short chunks) still take the
// decode kernel, each as a row at its own position, and sequences with more take the tiled prefill kernel
// (prefill_kernels.h), where a query tile shares each key/value tile among its rows.
//
// The decode kernel is batch-invariant: a query row's keys are cut into partitions at fixed token positions (the
// multiples of kPartitionTokens = 512), each partition is attended from a fresh online-softmax state (max, sum, acc
// in float32), and the partitions' states are merged strictly left to right, M = max(M, m), s = e^(M_old - M) s +
// e^(m - M) s_partition, acc likewise; always, whatever the batch and the thread count (see paged_attention_kernel).
// So a row's output bits do not depend on the other rows of the call, on the thread count, or on which physical
// blocks hold its keys. Threads share out (row, partition) items, so that a few long rows still keep every thread
// busy.
// Shared blocks: where several rows read a partition's first tokens (or all) as the same tokens in the same physical
// blocks, that shared segment is attended once for them, then each row goes on alone to its partition's end
// (find_shared_blocks, attend_shared_blocks), each row from its own state, before the rest; the rows merge its state
// in partition order like any other, so sharing changes no bit either.
// Only tokens t < L (and in the window) are ever read: unused cache slots and block-table entries may hold
// anything, NaN included.
//
// This file: the entry point (argument checks, the dispatch by dtype, the split of a varlen batch between the
// decode and the prefill kernels), the decode kernel's partitions, their split among the threads, and the merge of
// a row's partitions. The pieces, all included into this one translation unit:
//  - attention_common.h: the at::vec setup (first: it must precede any include of Vectorized), constants, fp8
//    tables and load helpers, AttentionParams, Tile, Prefetcher, Scratch (addresses: paged_cache.h, shared with
//    cache_ops.cpp);
//  - decode_kernels.h: the decode steps (logits, softmax, values) on the portable path, and a task's tile loop;
//  - avx512_kernels.h: the same steps as AVX-512 bf16 micro-kernels;
//  - prefill_kernels.h: the tiled prefill kernel.

#include "attention_common.h"  // first: it selects at::vec's implementation
#include "decode_kernels.h"
#include "prefill_kernels.h"

#include <torch/library.h>

namespace paged_attn {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The decode kernel's host side: cut the rows into partitions, run them on the threads, merge each row's
// partitions.

// The online-softmax state of one query row's heads over some of its keys (a view): per query head the max logit
// m, the sum s = sum_t e^(x_t - m) and the unnormalized acc = sum_t e^(x_t - m) v_t (in acc_index order), over
// a float buffer of num_heads * (head_dim + 2). The row's log-sum-exp of its logits, per head, is m + log(s).
struct RowState {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_dim]
  static int64_t size(int64_t num_heads, int64_t head_dim) { return num_heads * (head_dim + 2); }
  RowState(float* p, int64_t num_heads, int64_t head_dim)
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
  const int64_t num_heads = params.num_heads, head_dim = params.head_dim;
  for (int64_t h = 0; h < num_heads; ++h) {
    const RowFinish finish = finish_row(state.max[h], state.sum[h], params.v_scale, params.sinks, h);
    if (params.lse) params.lse[params.token(row) * num_heads + h] = finish.lse;
    const float inv_sum = finish.out_scale;
    const float* acc = state.acc + h * head_dim;
    scalar_t* dst = out + (params.token(row) * num_heads + h) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      dst[d] = static_cast<scalar_t>(acc[acc_index(d, params.avx512_bf16)] * inv_sum);
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
// changes a bit of the result (see paged_attention_kernel), only the time.
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
                       total_tokens * 2 * params.num_kv_heads * params.head_dim * int64_t{sizeof(cache_t)});
}

// Shared blocks: several rows whose first tokens [begin, split) of a partition lie in the same physical blocks for
// all of them (their block-table entries over it are equal), as a prompt's blocks shared by n samples or beams, a
// cached system prompt shared by many requests, or the rows of one sequence in a varlen call. Such a shared segment
// is attended once for its rows (decode_kernels.h: attend with n rows) up to `split`, each row from its own fresh
// state, then each row alone on to its own end (the rest of its partition, where its tokens or blocks differ), so
// each row's partition state has the bits it has when the row reads the partition alone: the same tiles in the same
// order (split is a tile boundary, or the rows' common end). The rows merge it in partition order as any other
// (paged_attention_kernel). Found on the host from the block tables, for every partition at any depth and in any
// number of segments; a segment holds at most kMaxSharedRows rows, or fewer when that leaves threads idle (a larger
// run of rows makes several segments, each reading the shared tokens once).
constexpr int64_t kMaxSharedRows = 16;  // rows per segment: their scratch (~35 KB each at 32 x 128) stays in L2

struct SharedBlocks {
  struct Segment {
    int64_t begin, split;     // the tokens its rows share: [begin, split)
    int64_t first, num_rows;  // its rows: rows[first, first + num_rows), each to its partition's end ends[first + i]
  };
  std::vector<Segment> segments;
  std::vector<int64_t> rows;        // the segments' rows; rows[j]'s partition state is shared state j
  std::vector<int64_t> ends;        // [rows.size()]: the end of the row's partition
  std::vector<int64_t> item_state;  // [num_items]: the (row, partition) item's shared state, -1 if not shared
};

template <typename scalar_t, typename cache_t>
SharedBlocks find_shared_blocks(const Partitions<scalar_t, cache_t>& partitions, int64_t num_rows) {
  const AttentionParams<scalar_t, cache_t>& params = partitions.params;
  SharedBlocks shared;
  shared.item_state.assign(partitions.num_items(), -1);
  // PAGED_ATTN_NO_SHARED_BLOCKS=1: every row reads every partition alone (for measuring; the bits are the same).
  if (num_rows < 2 || std::getenv("PAGED_ATTN_NO_SHARED_BLOCKS") != nullptr) return shared;
  struct Item {
    int64_t item, row, begin, end;
  };
  std::vector<Item> items;
  items.reserve(partitions.num_items());
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t c0 = partitions.first_partition(r);
    for (int64_t i = 0; i < partitions.num_partitions(r); ++i) {
      const int64_t begin = partitions.partition_begin(r, c0 + i), end = partitions.partition_end(r, c0 + i);
      if (begin < end) items.push_back({partitions.first_item[r] + i, r, begin, end});
    }
  }
  const int64_t bs = params.block_size;
  const auto entries = [&](const Item& it) { return params.block_table(it.row) + it.begin / bs; };
  const auto num_entries = [&](const Item& it) { return (it.end - 1) / bs - it.begin / bs + 1; };
  // By begin, then the block-table entries from there (lexicographically: items that share more entries lie
  // closer), then end and row.
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    const int32_t *ea = entries(a), *eb = entries(b);
    const int64_t na = num_entries(a), nb = num_entries(b);
    if (std::lexicographical_compare(ea, ea + na, eb, eb + nb)) return true;
    if (std::lexicographical_compare(eb, eb + nb, ea, ea + na)) return false;
    return a.end != b.end ? a.end < b.end : a.row < b.row;
  });
  // The tokens two items (of one begin) can share: their common end if they agree on every entry up to it, else
  // the tile boundary at or before the end of their common entries (and their ends); begin if none.
  const auto shared_until = [&](const Item& a, const Item& b) -> int64_t {
    if (a.begin != b.begin) return a.begin;
    const int32_t *ea = entries(a), *eb = entries(b);
    const int64_t n = std::min(num_entries(a), num_entries(b));
    const int64_t same = std::mismatch(ea, ea + n, eb).first - ea;  // entries in common
    const int64_t common = std::min({a.end, b.end, (a.begin / bs + same) * bs});
    if (a.end == b.end && common == a.end) return a.end;
    return std::max(a.begin, common / kTileTokens * kTileTokens);
  };
  // Runs of items sharing [begin, split), greedily: the next item joins while the tokens the run saves, (rows - 1)
  // * (split - begin), do not shrink.
  struct Run {
    size_t first, last;  // [first, last) in items
    int64_t split;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < items.size();) {
    size_t j = i + 1;
    int64_t split = std::numeric_limits<int64_t>::max();
    for (; j < items.size(); ++j) {
      const int64_t s = std::min(split, shared_until(items[j - 1], items[j])), begin = items[i].begin;
      const int64_t rows = static_cast<int64_t>(j - i);  // before items[j] joins
      const bool first_pair = split == std::numeric_limits<int64_t>::max();
      if (s <= begin || (!first_pair && rows * (s - begin) < (rows - 1) * (split - begin))) break;
      split = s;
    }
    if (j - i >= 2) runs.push_back({i, j, split});
    i = j;
  }
  if (runs.empty()) return shared;
  // Segments per run: at most kMaxSharedRows rows each; then, while the segments would keep some threads idle (their
  // greedy schedule, largest first, ends more than 10% after the even share), the run whose segments cost most gets
  // one more segment (if it has 2 rows per segment left), each reading the shared tokens once.
  const auto run_cost = [&](const Run& run) {  // tokens attended by its rows
    int64_t cost = 0;
    for (size_t k = run.first; k < run.last; ++k) cost += items[k].end - items[k].begin;
    return cost;
  };
  std::vector<int64_t> num_segments(runs.size()), cost(runs.size());
  int64_t total_cost = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const int64_t n = static_cast<int64_t>(runs[r].last - runs[r].first);
    num_segments[r] = (n + kMaxSharedRows - 1) / kMaxSharedRows;
    cost[r] = run_cost(runs[r]);
    total_cost += cost[r];
  }
  const int64_t threads = at::get_num_threads();
  const auto makespan = [&] {  // of the segments over the threads, largest first, each to the least loaded thread
    std::vector<int64_t> segment_costs;
    for (size_t r = 0; r < runs.size(); ++r) {
      segment_costs.insert(segment_costs.end(), num_segments[r], cost[r] / num_segments[r]);
    }
    std::sort(segment_costs.rbegin(), segment_costs.rend());
    std::vector<int64_t> load(threads, 0);
    for (const int64_t c : segment_costs) *std::min_element(load.begin(), load.end()) += c;
    return *std::max_element(load.begin(), load.end());
  };
  while (threads > 1 && makespan() * 10 > total_cost * 11 / threads) {
    size_t widest = runs.size();  // the run with the costliest segments that can take one more
    for (size_t r = 0; r < runs.size(); ++r) {
      const int64_t n = static_cast<int64_t>(runs[r].last - runs[r].first);
      if (n / (num_segments[r] + 1) < 2) continue;
      if (widest == runs.size() || cost[r] * num_segments[widest] > cost[widest] * num_segments[r]) widest = r;
    }
    if (widest == runs.size()) break;
    ++num_segments[widest];
  }
  for (size_t r = 0; r < runs.size(); ++r) {
    const Run& run = runs[r];
    const int64_t n = static_cast<int64_t>(run.last - run.first);
    for (int64_t g = 0; g < num_segments[r]; ++g) {
      const int64_t b = run.first + n * g / num_segments[r], e = run.first + n * (g + 1) / num_segments[r];
      shared.segments.push_back({items[b].begin, run.split, static_cast<int64_t>(shared.rows.size()), e - b});
      for (int64_t k = b; k < e; ++k) {
        shared.item_state[items[k].item] = static_cast<int64_t>(shared.rows.size());
        shared.rows.push_back(items[k].row);
        shared.ends.push_back(items[k].end);
      }
    }
  }
  return shared;
}

// Attends the shared segments (each segment's shared tokens read once for its rows, then each row's own rest),
// the threads taking the next segment in turn, the costliest first; row j of the segments' rows leaves its partition
// state in states[j]. (Which thread attends a segment changes no bit.)
template <typename scalar_t, typename cache_t>
void attend_shared_blocks(const AttentionParams<scalar_t, cache_t>& params, const SharedBlocks& shared,
                          float* states) {
  const int64_t num_heads = params.num_heads, head_dim = params.head_dim;
  const int64_t state_size = RowState::size(num_heads, head_dim);
  const int64_t num_segments = static_cast<int64_t>(shared.segments.size());
  std::vector<int64_t> cost(num_segments), order(num_segments);  // tokens attended; the segments, costliest first
  int64_t total_tokens = 0;
  for (int64_t g = 0; g < num_segments; ++g) {
    const SharedBlocks::Segment& segment = shared.segments[g];
    cost[g] = (segment.split - segment.begin) * segment.num_rows;
    for (int64_t i = 0; i < segment.num_rows; ++i) cost[g] += shared.ends[segment.first + i] - segment.split;
    total_tokens += cost[g];
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  // Threads only for work worth waking them (kMinBytesPerCpuTask of keys and values each); each takes the next
  // segment in turn.
  const int64_t kv_bytes = total_tokens * 2 * params.num_kv_heads * params.head_dim * int64_t{sizeof(cache_t)};
  const int64_t num_workers = threads_worth_waking(kv_bytes, num_segments);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t worker_begin, int64_t worker_end) {
    if (worker_begin >= worker_end) return;
    std::vector<Scratch> scratch;
    std::vector<Scratch*> scs;
    std::vector<float> sums(num_heads);
    const auto keep_state = [&](int64_t i, int64_t j) {  // scratch i's partition state into states[j]
      copy_state(partition_state(scratch[i], num_heads, sums.data()), num_heads, head_dim,
                 RowState(states + j * state_size, num_heads, head_dim));
    };
    for (int64_t k = next++; k < num_segments; k = next++) {
      const SharedBlocks::Segment& segment = shared.segments[order[k]];
      while (static_cast<int64_t>(scratch.size()) < segment.num_rows) {
        scratch.emplace_back(num_heads, params.group_size, head_dim);
      }
      scs.clear();
      for (int64_t i = 0; i < segment.num_rows; ++i) scs.push_back(&scratch[i]);
      const int64_t* rows = shared.rows.data() + segment.first;
      const int64_t* ends = shared.ends.data() + segment.first;
      attend(params, rows, segment.num_rows, segment.begin, segment.split, scs.data(), [&](int64_t) {
        for (int64_t i = 0; i < segment.num_rows; ++i) {
          if (ends[i] == segment.split) keep_state(i, segment.first + i);
        }
      });
      for (int64_t i = 0; i < segment.num_rows; ++i) {  // each row on alone, from its state at split
        if (ends[i] == segment.split) continue;
        attend(params, rows + i, 1, segment.split, ends[i], scs.data() + i,
               [&](int64_t) { keep_state(i, segment.first + i); }, /*fresh=*/false);
      }
    }
  });
}

// The decode kernel over rows [0, num_rows) of params.
//
// Fixed summation order: row r's visible keys [window_start(r), row_len(r)) are cut into partitions at the multiples
// of kPartitionTokens, absolute token positions; each partition is attended from a fresh online-softmax state, its
// tiles at absolute positions too (decode_kernels.h: attend), and the row's result is the merge of its partitions'
// states strictly left to right: R_0 = C_0, R_c = merge(R_(c-1), C_c) (merge_into), out = acc / sum of the last.
// Always: one thread or many, a short row (one partition) or a long one. So a row's output bits depend on its own
// query, keys, values and length only: not on the other rows of the batch, their number or lengths, the thread
// count, or which physical blocks hold its keys.
//
// Work mapping: the (row, partition) items, in row order, are split into as many parts of about equal tokens as
// there are threads worth waking (split_among_threads); a part walks each of its rows' partitions in one attend
// call. A row whose partitions all fall in one part is merged and written there. A row cut between parts (at most
// one per part boundary): the part holding its first partition leaves its running state R in row scratch, the later
// parts leave each partition's own state C there, and after the parallel pass these are merged on in partition
// order.
// Shared segments (find_shared_blocks) are attended first, for their rows, into the shared states; a row's walk
// takes their states from there in their turn, and attends its own partitions between them in runs.
template <typename scalar_t, typename cache_t>
void paged_attention_kernel(const AttentionParams<scalar_t, cache_t>& params, int64_t num_rows,
                            scalar_t* out) {  // [num_tokens, num_heads, head_dim], contiguous; row r at token(r)
  const int64_t num_heads = params.num_heads, head_dim = params.head_dim;
  const int64_t state_size = RowState::size(num_heads, head_dim);
  const Partitions<scalar_t, cache_t> partitions(params, num_rows);
  // The shared segments first: their rows' partition states, in shared_states.
  const SharedBlocks shared = find_shared_blocks(partitions, num_rows);
  std::vector<float> shared_states(shared.rows.size() * state_size);
  if (!shared.segments.empty()) attend_shared_blocks(params, shared, shared_states.data());
  const std::vector<int64_t> part_begin = split_among_threads(partitions, num_rows, shared.item_state);
  const int64_t num_parts = static_cast<int64_t>(part_begin.size()) - 1;

  // Rows cut between parts, and their states: state 0 the running state R of the part with the row's first
  // partition, state 1 + i the state of the row's partition i for the partitions of later parts.
  struct CutRow {
    int64_t row, first_unmerged_item, first_state;
  };
  std::vector<CutRow> cut_rows;
  int64_t num_states = 0;
  for (int64_t p = 1; p < num_parts; ++p) {
    const int64_t item = part_begin[p];
    const int64_t row = partitions.row_of(item);
    if (item == partitions.first_item[row] || (!cut_rows.empty() && cut_rows.back().row == row)) continue;
    cut_rows.push_back({row, item, num_states});
    num_states += 1 + partitions.num_partitions(row);
  }
  std::vector<float> cut_states(num_states * state_size);
  const auto cut_state = [&](int64_t row, int64_t i) {
    for (const CutRow& cut : cut_rows) {
      if (cut.row != row) continue;
      return RowState(cut_states.data() + (cut.first_state + i) * state_size, num_heads, head_dim);
    }
    TORCH_INTERNAL_ASSERT(false, "unreachable: a row shared by parts is in cut_rows");
  };

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin_index, int64_t part_end_index) {
    Scratch sc(num_heads, params.group_size, head_dim);
    Scratch* sc_ptr = &sc;
    std::vector<float> running_buffer(state_size), partition_sums(num_heads);
    const RowState running(running_buffer.data(), num_heads, head_dim);
    for (int64_t part = part_begin_index; part < part_end_index; ++part) {
      const int64_t item_begin = part_begin[part], item_end = part_begin[part + 1];
      for (int64_t row = item_begin < item_end ? partitions.row_of(item_begin) : num_rows;
           row < num_rows && partitions.first_item[row] < item_end; ++row) {
        // This part's partitions of the row: items [begin, end), item first_item[row] + i being partition c0 + i.
        const int64_t row_first = partitions.first_item[row], row_end = partitions.first_item[row + 1];
        const int64_t begin = std::max(item_begin, row_first), end = std::min(item_end, row_end);
        const int64_t c0 = partitions.first_partition(row);
        const bool has_first = begin == row_first, has_last = end == row_end;
        const auto absorb = [&](int64_t c, RowState partition) {  // partition c's state, in partition order
          if (!has_first) {
            copy_state(partition, num_heads, head_dim, cut_state(row, 1 + c - c0));
          } else if (c == c0) {
            copy_state(partition, num_heads, head_dim, running);
          } else {
            merge_into(running, partition, num_heads, head_dim);
          }
        };
        // Runs of the row's own partitions in one attend call each; a shared segment's from shared_states.
        for (int64_t item = begin; item < end;) {
          if (const int64_t j = shared.item_state[item]; j >= 0) {
            absorb(c0 + item - row_first, RowState(shared_states.data() + j * state_size, num_heads, head_dim));
            ++item;
            continue;
          }
          int64_t run_end = item + 1;
          while (run_end < end && shared.item_state[run_end] < 0) ++run_end;
          attend(params, &row, 1, partitions.partition_begin(row, c0 + item - row_first),
                 partitions.partition_end(row, c0 + run_end - 1 - row_first), &sc_ptr,
                 [&](int64_t c) { absorb(c, partition_state(sc, num_heads, partition_sums.data())); });
          item = run_end;
        }
        if (has_first && has_last) {
          write_row(params, row, running, out);
        } else if (has_first) {
          copy_state(running, num_heads, head_dim, cut_state(row, 0));
        }
      }
    }
  });

  for (const CutRow& cut : cut_rows) {
    const int64_t row_first = partitions.first_item[cut.row], row_end = partitions.first_item[cut.row + 1];
    const RowState running = cut_state(cut.row, 0);
    for (int64_t item = cut.first_unmerged_item; item < row_end; ++item) {
      merge_into(running, cut_state(cut.row, 1 + item - row_first), num_heads, head_dim);
    }
    write_row(params, cut.row, running, out);
  }
}

}  // namespace

void paged_attention_cpu(at::Tensor& out,                 // [num_tokens, num_heads, head_dim], contiguous
                         const at::Tensor& query,         // [num_tokens, num_heads, head_dim], last dim contiguous
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim]
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq], int32
                         const at::Tensor& seq_lens,      // [num_seqs], int32
                         double scale,
                         const std::optional<at::Tensor>& alibi_slopes,  // [num_heads], float32
                         int64_t sliding_window, double logits_soft_cap,
                         const std::optional<at::Tensor>& query_start_loc,  // [num_seqs + 1], int32, or none
                         std::optional<int64_t> max_query_len,
                         const std::optional<at::Tensor>& k_scale,    // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& v_scale,  // [1], float32 (fp8 caches only)
                         const std::optional<at::Tensor>& lse,      // [num_tokens, num_heads], float32, or none
                         const std::optional<at::Tensor>& sinks,  // [num_heads], float32/16, bfloat16, or none
                         // [num_tasks, 11], int32, or none: checked, not read (this kernel finds the sharing itself)
                         const std::optional<at::Tensor>& shared_plan) {
  check_paged_attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                             sliding_window, logits_soft_cap, query_start_loc, max_query_len, k_scale, v_scale, lse,
                             sinks, shared_plan);
  const int64_t block_size = key_cache.size(1);
  if (query_start_loc.has_value()) check_query_start_loc_range(*query_start_loc, seq_lens, query.size(0), max_query_len);
  check_block_table_range(block_tables, seq_lens, key_cache.size(0), block_size, query_start_loc, sliding_window);
  check_kv_scale_values(k_scale, v_scale);
  check_sink_values(sinks);
  if (out.numel() == 0) return;
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);

  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto slopes = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  const auto sinks_f32 = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();  // exact
  // With query_start_loc: sequences with at least kMinPrefillQueryLen query tokens go to the tiled prefill kernel;
  // the rows of those with fewer (decodes, short chunks) to the decode kernel: row i of the q_s rows of sequence s,
  // at position L_s - q_s + i, as a row of length L_s - q_s + i + 1.
  std::vector<int32_t> decode_lens, decode_seqs, decode_tokens, prefill_seqs;
  const auto starts = query_start_loc.has_value() ? query_start_loc->contiguous() : at::Tensor();
  if (starts.defined()) {
    const int32_t* qsl = starts.const_data_ptr<int32_t>();
    const int32_t* len = lens.const_data_ptr<int32_t>();
    for (int32_t s = 0; s + 1 < starts.size(0); ++s) {
      const int32_t query_len = qsl[s + 1] - qsl[s];
      if (query_len >= kMinPrefillQueryLen) {
        prefill_seqs.push_back(s);
        continue;
      }
      for (int32_t i = 0; i < query_len; ++i) {
        decode_lens.push_back(len[s] - query_len + i + 1);
        decode_seqs.push_back(s);
        decode_tokens.push_back(qsl[s] + i);
      }
    }
  }
  const float k_scale_value = k_scale.has_value() ? k_scale->item<float>() : 1.f;
  const float v_scale_value = v_scale.has_value() ? v_scale->item<float>() : 1.f;
  const auto run = [&](auto dtype_tag, auto cache_tag) {
    using scalar_t = decltype(dtype_tag);
    using cache_t = decltype(cache_tag);
    AttentionParams<scalar_t, cache_t> params;
    params.kv.key = cpu::paged_cache_of<const cache_t>(key_cache);
    params.kv.value = cpu::paged_cache_of<const cache_t>(value_cache);
    params.query = query.const_data_ptr<scalar_t>();
    params.query_row_stride = query.stride(0);
    params.query_head_stride = query.stride(1);
    params.block_tables = tables.const_data_ptr<int32_t>();
    params.row_lens = lens.const_data_ptr<int32_t>();  // decode: row r is sequence r (row_seqs, row_tokens nullptr)
    params.alibi_slopes = slopes.defined() ? slopes.const_data_ptr<float>() : nullptr;
    params.max_blocks_per_seq = tables.size(1);
    params.block_size = block_size;
    params.num_heads = num_heads;
    params.num_kv_heads = num_kv_heads;
    params.group_size = num_heads / num_kv_heads;
    params.head_dim = head_dim;
    params.sliding_window = sliding_window;
    params.scale = static_cast<float>(scale) * k_scale_value;
    params.logits_soft_cap = static_cast<float>(logits_soft_cap);
    params.v_scale = v_scale_value;
    params.avx512_bf16 = avx512_bf16_path<scalar_t, cache_t>(head_dim);
    params.amx = params.avx512_bf16 && use_amx();
    params.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
    params.sinks = sinks_f32.defined() ? sinks_f32.const_data_ptr<float>() : nullptr;
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    if (!starts.defined()) return paged_attention_kernel(params, num_rows, out_ptr);
    if (!prefill_seqs.empty()) {
      prefill_kernel(params, starts.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), prefill_seqs, out_ptr);
    }
    if (!decode_seqs.empty()) {
      params.row_lens = decode_lens.data(), params.row_seqs = decode_seqs.data();
      params.row_tokens = decode_tokens.data();
      paged_attention_kernel(params, static_cast<int64_t>(decode_seqs.size()), out_ptr);
    }
  };
  // The cache's dtype: the query's, or fp8 (check_paged_attention_args allows exactly these).
  const auto by_cache = [&](auto dtype_tag) {
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: return run(dtype_tag, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return run(dtype_tag, c10::Float8_e5m2{});
      default: return run(dtype_tag, dtype_tag);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: by_cache(float{}); break;
    case at::kHalf: by_cache(at::Half{}); break;
    case at::kBFloat16: by_cache(at::BFloat16{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unreachable: dtype checked above");
  }
}

}  // namespace paged_attn

TORCH_LIBRARY_IMPL(paged_attn, CPU, m) {
  m.impl("paged_attention", &paged_attn::paged_attention_cpu);
}
