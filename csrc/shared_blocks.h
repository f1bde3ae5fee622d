// Shared blocks, found on the host: which rows of a call hold the same physical blocks at the same positions of
// their block tables (the samples or beams of one prompt, requests behind one cached prompt, the rows of one
// sequence in a variable-length call), so that a kernel reads those blocks once for all of them. One search serves
// both kernels:
//   sort_by_blocks (here): the rows sorted lexicographically by their block-table entries, and the tokens each two
//     neighbours hold in common from the first. Rows that share a prefix lie next to each other (a row that is a
//     prefix of another sorts just before it), and sorted rows i < j share min(common[i], ..., common[j - 1])
//     tokens: the rows' prefix tree, as an array.
//   The CPU decode (cpu/decode.cpp: find_shared_blocks) cuts it into shared segments per partition, and
//   plan_shared_blocks (shared_blocks.cpp: the op, the CUDA kernel's shared_plan) into groups of rows, and each
//   group's tree into tasks per node.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace paged_attn {

struct SortedRows {
  std::vector<int64_t> order;   // the rows, by their entries (then by row)
  std::vector<int64_t> common;  // [order.size() - 1]: the tokens sorted rows i and i + 1 share from the first
};

// rows: the rows to sort. entries(row): a pointer to the row's block-table entries. tokens(row): the row's tokens;
// entries [0, ceil(tokens / block_size)) are read. Two rows share min(tokens of each, block_size * the entries they
// agree on from the first): all their tokens where they hold as many in the same blocks (partial last block
// included).
template <typename Entries, typename Tokens>
SortedRows sort_by_blocks(std::vector<int64_t> rows, const Entries& entries, const Tokens& tokens, int64_t block_size) {
  const auto num_entries = [&](int64_t row) { return (tokens(row) + block_size - 1) / block_size; };
  std::sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) {
    const int32_t *ea = entries(a), *eb = entries(b);
    const int64_t na = num_entries(a), nb = num_entries(b);
    if (std::lexicographical_compare(ea, ea + na, eb, eb + nb)) return true;
    if (std::lexicographical_compare(eb, eb + nb, ea, ea + na)) return false;
    return a < b;
  });
  SortedRows sorted{std::move(rows), {}};
  for (size_t i = 1; i < sorted.order.size(); ++i) {
    const int64_t a = sorted.order[i - 1], b = sorted.order[i];
    const int32_t *ea = entries(a), *eb = entries(b);
    const int64_t same = std::mismatch(ea, ea + std::min(num_entries(a), num_entries(b)), eb).first - ea;
    sorted.common.push_back(std::min({tokens(a), tokens(b), same * block_size}));
  }
  return sorted;
}

// The key tokens the CPU decode read once for several rows instead of once per row ((rows - 1) * (split - begin) per
// shared segment), added up since the library was loaded: how tests and benchmarks see that sharing was found
// (paged_attn._C._shared_tokens_saved()), as the bits are the same either way.
int64_t shared_tokens_saved();
void add_shared_tokens_saved(int64_t tokens);

}  // namespace paged_attn
