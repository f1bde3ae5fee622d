// The decode kernel's steps (logits, softmax, values) on the portable path, and the task body that walks a query
// row's tokens a tile at a time (attend); each unit (a tile and a kv head) goes to one path's steps (attend_unit):
// portable (attend_tile, below), AVX-512 bf16 (attend_tile_avx512, avx512_kernels.h) or AMX (attend_tile_amx,
// amx_kernels.h), picked per call (AttentionParams::avx512_bf16, AttentionParams::amx), with each path's set-up in a
// function of its own (prescale_queries, AmxRows).
// Cutting the rows into partitions, running them on the threads and merging each row's partitions: decode.cpp.
//
// Work mapping: a query row's keys are cut into partitions at fixed token positions (kPartitionTokens); a thread
// walks a run of consecutive partitions of a row (attend) a tile at a time: up to kTileTokens = 16 consecutive
// tokens at absolute positions [16 i, 16 (i + 1)), whatever the block size (a tile may span blocks; the tile holds
// each token's row pointers, looked up in the block table once), each partition from a fresh online-softmax state.
// Within a tile it serves each kv head's whole head group in turn, so every key/value row is read from memory once
// (GQA reuse); in shared blocks (several rows, decode.cpp), each row in turn, while the rows are in L1.
// Per (tile, kv head), in passes of up to 4 query heads of the head group:
//   1. logits of the heads for the tile's tokens,
//   2. online softmax: when a logit exceeds a head's running max, raise the max (rescaling the running sum and
//      the accumulator); p = exp(x - max), and the running sum (kept per tile lane) += p,
//   3. acc += p * v over the tile's tokens.
// Meanwhile the thread software-prefetches (see Prefetcher) the next tile's rows into L2 and the next (tile, kv head)
// unit's rows into L1, a few cache lines per token of work in steps 1 and 3.
//
// Three implementations of steps 1-3, picked per call:
//  - portable (at::vec, AVX2 on x86-64; float32, float16, and bfloat16 without AVX-512): q pre-scaled in float32,
//    one dot product per (token, head); p in float32.
//  - AVX-512 bf16: see avx512_kernels.h.
//  - AMX (bfloat16, opt-in with PAGED_ATTN_AMX=1 where the CPU has AMX-BF16): see amx_kernels.h; all the rows of
//    a unit at once.
#pragma once

#include "attention_common.h"
#include "amx_kernels.h"
#include "avx512_kernels.h"

namespace paged_attn {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Portable path

// Independent accumulators per query head, so that kHeads * kUnroll FMA chains hide the FMA latency.
template <int kHeads>
constexpr int kUnroll = kHeads <= 2 ? 4 : 2;

// logits[j * logits_stride] = q_j . k for one key row k and the kHeads query heads q_j = q + j * head_dim.
template <int kHeads, typename scalar_t>
inline void dot_heads(const float* q, const scalar_t* k, int64_t head_dim, float* logits, int64_t logits_stride) {
  constexpr int U = kUnroll<kHeads>;
  Vec acc[kHeads][U];
#pragma GCC unroll 8
  for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[j][u] = Vec(0.f);
  int64_t d = 0;
  for (; d + U * kVecSize <= head_dim; d += U * kVecSize) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const Vec key = load_float(k + d + u * kVecSize);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j)
        acc[j][u] = at::vec::fmadd(Vec::loadu(q + j * head_dim + d + u * kVecSize), key, acc[j][u]);
    }
  }
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    const Vec key = load_float(k + d);
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) acc[j][0] = at::vec::fmadd(Vec::loadu(q + j * head_dim + d), key, acc[j][0]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < kHeads; ++j) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) acc[j][0] = acc[j][0] + acc[j][u];
    float sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[j][0]);
    for (int64_t r = d; r < head_dim; ++r) sum += q[j * head_dim + r] * to_float(k[r]);
    logits[j * logits_stride] = sum;
  }
}

// acc_j += sum_i p_j[i] * v_i for the kHeads query heads (acc_j = acc + j * head_dim, p_j = p + j * kTileTokens)
// over the value rows v_i = rows[i] + offset, i < num_tokens. A prefetcher, if given, steps once per token and
// prefetches the next unit's value row of the token.
template <int kHeads, typename scalar_t>
inline void accumulate_values(const float* p, const scalar_t* const* rows, int64_t offset, int64_t num_tokens,
                              int64_t head_dim, float* acc, Prefetcher<scalar_t>* prefetcher) {
  constexpr int U = kUnroll<kHeads>;
  for (int64_t i = 0; prefetcher && head_dim < U * kVecSize && i < num_tokens; ++i) {
    prefetcher->step();
    prefetcher->values(i);
  }
  int64_t d = 0;
  for (; d + U * kVecSize <= head_dim; d += U * kVecSize) {
    Vec sum[kHeads][U];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum[j][u] = Vec::loadu(acc + j * head_dim + d + u * kVecSize);
    for (int64_t i = 0; i < num_tokens; ++i) {
      if (prefetcher && d == 0) prefetcher->step(), prefetcher->values(i);
      const scalar_t* v = rows[i] + offset + d;
      Vec row[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) row[u] = load_float(v + u * kVecSize);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) {
        const Vec weight(p[j * kTileTokens + i]);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) sum[j][u] = at::vec::fmadd(weight, row[u], sum[j][u]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum[j][u].store(acc + j * head_dim + d + u * kVecSize);
  }
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    Vec sum[kHeads];
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) sum[j] = Vec::loadu(acc + j * head_dim + d);
    for (int64_t i = 0; i < num_tokens; ++i) {
      const Vec row = load_float(rows[i] + offset + d);
#pragma GCC unroll 8
      for (int j = 0; j < kHeads; ++j) sum[j] = at::vec::fmadd(Vec(p[j * kTileTokens + i]), row, sum[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < kHeads; ++j) sum[j].store(acc + j * head_dim + d);
  }
  for (; d < head_dim; ++d)
    for (int64_t i = 0; i < num_tokens; ++i)
      for (int j = 0; j < kHeads; ++j)
        acc[j * head_dim + d] += p[j * kTileTokens + i] * to_float(rows[i][offset + d]);
}

// Steps 1-3 for the group of kv head `kv_head` over one tile (portable path).
template <typename scalar_t, typename cache_t>
void attend_tile(const AttentionParams<scalar_t, cache_t>& params, int64_t kv_head, const Tile<cache_t>& tile,
                 int64_t last_token, Scratch& sc, Prefetcher<cache_t>& prefetcher) {
  const int64_t group_size = params.group_size, head_dim = params.head_dim, first_head = kv_head * group_size;
  const int64_t head_dim_v = params.head_dim_v;
  const int64_t key_offset = kv_head * params.kv.key.head_stride, value_offset = kv_head * params.kv.value.head_stride;
  const int64_t num_tokens = tile.num_tokens;
  const float* q = sc.q + first_head * head_dim;
  float* acc = sc.acc + first_head * head_dim_v;

  // 1. Logits of every head of the group for the tile's tokens.
  for (int64_t i = 0; i < num_tokens; ++i) {
    prefetcher.step();
    prefetcher.keys(i);
    for_each_head_pass(group_size, [&](auto heads, int64_t first) {
      dot_heads<decltype(heads)::value>(q + first * head_dim, tile.keys[i] + key_offset, head_dim,
                                        sc.logits + first * kTileTokens + i, kTileTokens);
    });
  }
  for (int64_t i = num_tokens; i < kTileTokens; ++i) prefetcher.step();
  // 2. Softmax: soft cap, ALiBi, running max, p = exp(x - max). Lanes past num_tokens are set to -inf, so exp gives 0.
  const Vec num_valid(static_cast<float>(num_tokens));
  for (int64_t j = 0; j < group_size; ++j) {
    const int64_t head = first_head + j;
    float* x = sc.logits + j * kTileTokens;
    if (params.logits_soft_cap > 0 || params.alibi_slopes) apply_logit_mods(params, head, tile.first, last_token, x);
    Vec tile_max(kNegInf);
    for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
      const Vec lane = Vec::arange(static_cast<float>(i), 1.f);
      const Vec xi = Vec::blendv(Vec(kNegInf), Vec::loadu(x + i), lane < num_valid);
      tile_max = at::vec::maximum(tile_max, xi);
      xi.store(x + i);
    }
    const float old_max = sc.max_logit[head];
    const float new_max = std::max(
        old_max, at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, tile_max));
    if (new_max != old_max) {  // rescale only when the max grew (rarely, after the first tiles)
      const float alpha = std::exp(old_max - new_max);  // 0 on the first tile: old_max = -inf
      for (int64_t i = 0; i < kTileTokens; ++i) sc.exp_sums[head * kTileTokens + i] *= alpha;
      for (int64_t d = 0; d < head_dim_v; ++d) acc[j * head_dim_v + d] *= alpha;
      sc.max_logit[head] = new_max;
    }
    for (int64_t i = 0; i < kTileTokens; i += kVecSize) {
      const Vec p = (Vec::loadu(x + i) - Vec(new_max)).exp_u20();
      (Vec::loadu(sc.exp_sums + head * kTileTokens + i) + p).store(sc.exp_sums + head * kTileTokens + i);
      p.store(x + i);
    }
  }
  // 3. Values: acc += p * v over the tile's tokens.
  for_each_head_pass(group_size, [&](auto heads, int64_t first) {
    accumulate_values<decltype(heads)::value>(sc.logits + first * kTileTokens, tile.values, value_offset,
                                              num_tokens, head_dim_v, acc + first * head_dim_v,
                                              first == 0 ? &prefetcher : nullptr);
  });
  for (int64_t i = num_tokens; i < kTileTokens; ++i) prefetcher.step();
}

// ---------------------------------------------------------------------------------------------------------------
// Tasks

// The query of row `row`: [num_heads, head_dim] (head stride query_head_stride).
template <typename scalar_t, typename cache_t>
const scalar_t* row_query(const AttentionParams<scalar_t, cache_t>& params, int64_t row) {
  return params.query + params.token(row) * params.query_row_stride;
}

// Portable path: each row's queries, pre-scaled, in float32 into its scratch (sc.q). (The AVX-512 and AMX paths
// read the queries as they are.)
template <typename scalar_t, typename cache_t>
void prescale_queries(const AttentionParams<scalar_t, cache_t>& params, const int64_t* rows, int64_t n,
                      Scratch* const* scs) {
  const int64_t num_heads = params.num_heads, head_dim = params.head_dim;
  for (int64_t i = 0; i < n && !params.avx512_bf16; ++i) {
    const scalar_t* query = row_query(params, rows[i]);
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t d = 0; d < head_dim; ++d) {
        scs[i]->q[h * head_dim + d] = params.scale * static_cast<float>(query[h * params.query_head_stride + d]);
      }
    }
  }
}

// AMX path: the arguments of attend_tile_amx for one call's rows (empty unless params.amx): queries, per kv head
// the rows' heads of its head group stacked (entry i * group + j), padded to a multiple of 16 entries; each row's
// last token; the tile layout ([head_dim * 24] dwords), logits and p pairs; and the thread's tile-register
// configuration (released at the end of the call).
template <typename scalar_t>
struct AmxRows {
#if defined(CPU_CAPABILITY_AVX2)
  int64_t entries;  // per kv head
  std::vector<scalar_t> queries;
  std::vector<int64_t> last_tokens;
  std::vector<uint32_t> layout, p_pairs;
  std::vector<float> logits;
  AmxTiles tiles;

  template <typename cache_t>
  AmxRows(const AttentionParams<scalar_t, cache_t>& params, const int64_t* rows, int64_t n)
      : entries((n * params.group_size + kAmxRows - 1) / kAmxRows * kAmxRows) {
    if (!params.amx) return;
    const int64_t num_heads = params.num_heads, head_dim = params.head_dim;
    queries.assign(params.num_kv_heads * entries * head_dim, scalar_t(0));
    for (int64_t i = 0; i < n; ++i) {
      last_tokens.push_back(params.row_len(rows[i]) - 1);
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t kv_head = h / params.group_size, e = i * params.group_size + h % params.group_size;
        std::copy_n(row_query(params, rows[i]) + h * params.query_head_stride, head_dim,
                    queries.begin() + (kv_head * entries + e) * head_dim);
      }
    }
    layout.resize(head_dim * 24);
    logits.resize(entries * kTileTokens);
    p_pairs.resize(n * params.group_size * kTileTokens);
  }
#else
  template <typename cache_t>
  AmxRows(const AttentionParams<scalar_t, cache_t>&, const int64_t*, int64_t) {}
#endif
};

// Steps 1-3 of one unit (kv head `kv_head`'s group over one tile) for the rows rows[0..n), on the call's path: all
// the rows at once on the AMX path; else row after row, on the AVX-512 bf16 or the portable path (the last row
// prefetches with `prefetcher`, the others with `idle`).
template <typename scalar_t, typename cache_t>
void attend_unit(const AttentionParams<scalar_t, cache_t>& params, int64_t kv_head, const Tile<cache_t>& tile,
                 const int64_t* rows, int64_t n, Scratch* const* scs, AmxRows<scalar_t>& amx,
                 Prefetcher<cache_t>& prefetcher, Prefetcher<cache_t>& idle) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kHasAvx512Path<scalar_t, cache_t>) {
    if (params.amx) {
      attend_tile_amx(params, kv_head, tile, n, amx.queries.data() + kv_head * amx.entries * params.head_dim,
                      amx.last_tokens.data(), scs, amx.layout.data(), amx.logits.data(), amx.p_pairs.data(),
                      amx.tiles, prefetcher);
      return;
    }
  }
#else
  (void)amx;
#endif
  for (int64_t i = 0; i < n; ++i) {
    Prefetcher<cache_t>& pf = i + 1 == n ? prefetcher : idle;
    const int64_t last_token = params.row_len(rows[i]) - 1;
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kHasAvx512Path<scalar_t, cache_t>) {
      if (params.avx512_bf16) {
        attend_tile_avx512(params, row_query(params, rows[i]), kv_head, tile, last_token, *scs[i], pf);
        continue;
      }
    }
#endif
    attend_tile(params, kv_head, tile, last_token, *scs[i], pf);
  }
}

// Attends every query head of the query rows rows[0], ..., rows[n - 1] to their sequences' tokens [begin, end),
// which start at a partition boundary or at the rows' window start (or, with fresh = false, at a tile boundary where
// an earlier call left the rows' states in scs: the rest of a partition after a shared segment, see decode.cpp)
// and end at a partition boundary, at the rows' end, or at a tile boundary where a later call goes on; for n > 1
// these are the same tokens in the same physical blocks for every row (a shared segment), read once for all: each
// tile's rows are worked on by every row in turn while they are in L1. scs[i] is row i's scratch. The partitions
// [c kPartitionTokens, (c + 1) kPartitionTokens) the range overlaps are each attended from a fresh online-softmax
// state (the first from the states in scs if not fresh). The tiles lie at absolute positions too ([16 i,
// 16 (i + 1)), but the first, which starts at `begin`), so partition boundaries are tile boundaries. After each
// partition's last tile, partition_done(c) finds each row's partition state (max, lane sums, acc) in its scratch,
// then the states are reset for the next. The tiles run on across partition boundaries (the prefetch too): only the
// states restart. A row's sequence of steps, and so its bits, are the same for any n and any position in rows: each
// row's tiles, heads and head passes come in the same order.
template <typename scalar_t, typename cache_t, typename PartitionDone>
void attend(const AttentionParams<scalar_t, cache_t>& params, const int64_t* rows, int64_t n, int64_t begin,
            int64_t end, Scratch* const* scs, PartitionDone&& partition_done, bool fresh = true) {
  const int64_t num_heads = params.num_heads, head_dim_v = params.head_dim_v;
  prescale_queries(params, rows, n, scs);
  const auto reset = [&] {
    for (int64_t i = 0; i < n; ++i) {
      std::fill_n(scs[i]->acc, num_heads * head_dim_v, 0.f);
      std::fill_n(scs[i]->max_logit, num_heads, kNegInf);
      std::fill_n(scs[i]->exp_sums, num_heads * kTileTokens, 0.f);
    }
  };
  if (fresh) reset();
  if (begin >= end) {  // an empty row (length 0): one empty partition
    partition_done(int64_t{0});
    return;
  }
  const int32_t* block_table = params.block_table(rows[0]);  // the rows' tables agree on [begin, end)
  const int64_t aligned_begin = begin / kTileTokens * kTileTokens;
  const int64_t num_tiles = (end - aligned_begin + kTileTokens - 1) / kTileTokens;
  // Tile k: [max(begin, aligned_begin + 16 k), min(end, aligned_begin + 16 (k + 1))).
  const auto load_tile = [&](Tile<cache_t>& tile, int64_t k) {
    const int64_t tile_begin = aligned_begin + k * kTileTokens;
    tile.load(params.kv, block_table, params.block_size, std::max(begin, tile_begin),
              std::min(end, tile_begin + kTileTokens));
  };

  // tiles[k % kRing] is tile k; tile k + kPrefetchTiles is looked up while tile k is worked on.
  constexpr int64_t kRing = kPrefetchTiles + 1;
  Tile<cache_t> tiles[kRing];
  for (int64_t k = 0; k < std::min(kPrefetchTiles, num_tiles); ++k) load_tile(tiles[k], k);
  // The last row of a unit prefetches (the next unit's rows into L1 as late as they can come); the others not.
  Prefetcher<cache_t> prefetcher(params.kv, params.num_kv_heads, params.head_dim, params.head_dim_v);
  Prefetcher<cache_t> idle(params.kv, params.num_kv_heads, params.head_dim, params.head_dim_v);
  AmxRows<scalar_t> amx(params, rows, n);
  for (int64_t k = 0; k < num_tiles; ++k) {
    const Tile<cache_t>& tile = tiles[k % kRing];
    if (k + kPrefetchTiles < num_tiles) {
      Tile<cache_t>& ahead = tiles[(k + kPrefetchTiles) % kRing];
      load_tile(ahead, k + kPrefetchTiles);
      prefetcher.start_tile(&ahead);
    } else {
      prefetcher.start_tile(nullptr);
    }
    for (int64_t kv_head = 0; kv_head < params.num_kv_heads; ++kv_head) {
      // The next unit: the next kv head of this tile, or the first of the next tile (loaded: kPrefetchTiles >= 1).
      const bool last_head = kv_head + 1 == params.num_kv_heads;
      prefetcher.unit_tile = !last_head ? &tile : k + 1 < num_tiles ? &tiles[(k + 1) % kRing] : nullptr;
      prefetcher.key_offset = last_head ? 0 : (kv_head + 1) * params.kv.key.head_stride;
      prefetcher.value_offset = last_head ? 0 : (kv_head + 1) * params.kv.value.head_stride;
      attend_unit(params, kv_head, tile, rows, n, scs, amx, prefetcher, idle);
    }
    const int64_t tile_end = tile.first + tile.num_tokens;
    if (tile_end == end || tile_end % kPartitionTokens == 0) {
      partition_done((tile_end - 1) / kPartitionTokens);
      if (tile_end != end) reset();
    }
  }
}

}  // namespace
}  // namespace paged_attn
