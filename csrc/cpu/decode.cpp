// The CPU decode kernel's host side (paged_attn::paged_attention without query_start_loc, and the short rows of a
// varlen call: attention.cpp): cut the rows into partitions of kPartitionTokens keys at fixed token positions, share
// (row, partition) items out among the threads, attend the shared segments of rows that read the same blocks once
// for them, and merge each row's partition states strictly left to right (batch-invariant: see attention.cpp).
// The steps of a partition (logits, softmax, values): decode_kernels.h, avx512_kernels.h, amx_kernels.h.

#include "attention_common.h"  // first: it selects at::vec's implementation
#include "decode_kernels.h"
#include "partitions.h"
#include "../shared_blocks.h"

namespace paged_attn {
namespace {

// Shared blocks: several rows whose first tokens [begin, split) of a partition lie in the same physical blocks for
// all of them (their block-table entries over it are equal), as a prompt's blocks shared by n samples or beams, a
// cached system prompt shared by many requests, or the rows of one sequence in a varlen call. Such a shared segment
// is attended once for its rows (decode_kernels.h: attend with n rows) up to `split`, each row from its own fresh
// state, then each row alone on to its own end (the rest of its partition, where its tokens or blocks differ), so
// each row's partition state has the bits it has when the row reads the partition alone: the same tiles in the same
// order (split is a tile boundary, or the rows' common end). The rows merge it in partition order as any other
// (decode_attention). Found on the host from the block tables by the search plan_shared_blocks also uses
// (../shared_blocks.h: the rows sorted by their blocks), for every partition at any depth and in any number of
// segments; a segment holds at most kMaxSharedRows rows, or fewer when that leaves threads idle (a larger run of rows
// makes several segments, each reading the shared tokens once).
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
  // The rows sorted by their blocks (shared_blocks.h); then their (row, partition) items, partition by partition,
  // by begin (a window's start can cut a partition) and then in the rows' order. common[j]: the tokens the rows of
  // items j - 1 and j share from the first, the least common tokens of the sorted rows from one to the other.
  const int64_t bs = params.block_size;
  std::vector<int64_t> rows(num_rows);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  const SortedRows sorted = sort_by_blocks(
      std::move(rows), [&](int64_t r) { return params.block_table(r); }, [&](int64_t r) { return params.row_len(r); },
      bs);
  struct Item {
    int64_t item, row, begin, end, place;  // place: the row's in sorted.order
  };
  std::vector<Item> items;
  std::vector<int64_t> common;
  items.reserve(partitions.num_items());
  common.reserve(partitions.num_items());
  int64_t num_partitions = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    num_partitions = std::max(num_partitions, partitions.first_partition(r) + partitions.num_partitions(r));
  }
  for (int64_t c = 0; c < num_partitions; ++c) {
    const size_t first = items.size();
    for (int64_t k = 0; k < num_rows; ++k) {
      const int64_t r = sorted.order[k], i = c - partitions.first_partition(r);
      if (i < 0 || i >= partitions.num_partitions(r)) continue;
      const int64_t begin = partitions.partition_begin(r, c), end = partitions.partition_end(r, c);
      if (begin < end) items.push_back({partitions.first_item[r] + i, r, begin, end, k});
    }
    const auto by_begin = [](const Item& a, const Item& b) { return a.begin < b.begin; };
    std::stable_sort(items.begin() + first, items.end(), by_begin);
    for (size_t j = first; j < items.size(); ++j) {
      const bool after = j > first && items[j - 1].begin == items[j].begin;
      common.push_back(after ? *std::min_element(sorted.common.begin() + items[j - 1].place,
                                                 sorted.common.begin() + items[j].place)
                             : 0);
    }
  }
  // The tokens two neighbouring items can share: their common end if they hold all tokens up to it in the same
  // blocks, else the tile boundary at or before the end of their common tokens (and their ends); begin if none.
  const auto shared_until = [&](size_t j) -> int64_t {
    const Item &a = items[j - 1], &b = items[j];
    if (a.begin != b.begin) return a.begin;
    const int64_t tokens = std::min({a.end, b.end, common[j]});
    if (a.end == b.end && tokens == a.end) return a.end;
    return std::max(a.begin, tokens / kTileTokens * kTileTokens);
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
      const int64_t s = std::min(split, shared_until(j)), begin = items[i].begin;
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
      add_shared_tokens_saved((e - b - 1) * (run.split - items[b].begin));
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
  const int64_t num_heads = params.num_heads, head_dim_v = params.head_dim_v;
  const int64_t state_size = RowState::size(num_heads, head_dim_v);
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
  const int64_t kv_bytes =
      total_tokens * params.num_kv_heads * (params.head_dim + params.head_dim_v) * int64_t{sizeof(cache_t)};
  const int64_t num_workers = threads_worth_waking(kv_bytes, num_segments);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_workers, 1, [&](int64_t worker_begin, int64_t worker_end) {
    if (worker_begin >= worker_end) return;
    std::vector<Scratch> scratch;
    std::vector<Scratch*> scs;
    std::vector<float> sums(num_heads);
    const auto keep_state = [&](int64_t i, int64_t j) {  // scratch i's partition state into states[j]
      copy_state(partition_state(scratch[i], num_heads, sums.data()), num_heads, head_dim_v,
                 RowState(states + j * state_size, num_heads, head_dim_v));
    };
    for (int64_t k = next++; k < num_segments; k = next++) {
      const SharedBlocks::Segment& segment = shared.segments[order[k]];
      while (static_cast<int64_t>(scratch.size()) < segment.num_rows) {
        scratch.emplace_back(num_heads, params.group_size, params.head_dim, head_dim_v);
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

}  // namespace

namespace cpu {

// The decode kernel over rows [0, num_rows) of params (attention_params.h).
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
void decode_attention(const AttentionParams<scalar_t, cache_t>& params, int64_t num_rows,
                      scalar_t* out) {  // [num_tokens, num_heads, head_dim_v], contiguous; row r at token(r)
  const int64_t num_heads = params.num_heads, head_dim_v = params.head_dim_v;
  const int64_t state_size = RowState::size(num_heads, head_dim_v);
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
      return RowState(cut_states.data() + (cut.first_state + i) * state_size, num_heads, head_dim_v);
    }
    TORCH_INTERNAL_ASSERT(false, "unreachable: a row shared by parts is in cut_rows");
  };

  at::parallel_for(0, num_parts, 1, [&](int64_t part_begin_index, int64_t part_end_index) {
    Scratch sc(num_heads, params.group_size, params.head_dim, head_dim_v);
    Scratch* sc_ptr = &sc;
    std::vector<float> running_buffer(state_size), partition_sums(num_heads);
    const RowState running(running_buffer.data(), num_heads, head_dim_v);
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
            copy_state(partition, num_heads, head_dim_v, cut_state(row, 1 + c - c0));
          } else if (c == c0) {
            copy_state(partition, num_heads, head_dim_v, running);
          } else {
            merge_into(running, partition, num_heads, head_dim_v);
          }
        };
        // Runs of the row's own partitions in one attend call each; a shared segment's from shared_states.
        for (int64_t item = begin; item < end;) {
          if (const int64_t j = shared.item_state[item]; j >= 0) {
            absorb(c0 + item - row_first, RowState(shared_states.data() + j * state_size, num_heads, head_dim_v));
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
          copy_state(running, num_heads, head_dim_v, cut_state(row, 0));
        }
      }
    }
  });

  for (const CutRow& cut : cut_rows) {
    const int64_t row_first = partitions.first_item[cut.row], row_end = partitions.first_item[cut.row + 1];
    const RowState running = cut_state(cut.row, 0);
    for (int64_t item = cut.first_unmerged_item; item < row_end; ++item) {
      merge_into(running, cut_state(cut.row, 1 + item - row_first), num_heads, head_dim_v);
    }
    write_row(params, cut.row, running, out);
  }
}

#define PA_INSTANTIATE_DECODE(scalar_t, cache_t) \
  template void decode_attention(const AttentionParams<scalar_t, cache_t>&, int64_t, scalar_t*);
PA_FOR_EACH_CPU_ATTENTION_TYPE(PA_INSTANTIATE_DECODE)

}  // namespace cpu
}  // namespace paged_attn
