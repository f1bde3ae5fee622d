// The CUDA kernels of csrc/cuda, run by the SIMT emulator (simt.h) on cases that tests/test_emulated_kernels.py
// writes: the same launch plans (launch_plan.h, copy_plan.h) and kernels (attention_kernels.cuh,
// cache_ops_kernels.cuh) as the torch-facing launchers, on buffers read from files and written back after the run.
//
//   kernels CASE_FILE ORDER SEED     ORDER: forward | reverse | random
//
// A case file is a list of lines:
//   op attention | mla_attention | reshape_and_cache | concat_and_cache_mla | copy_blocks | merge_attention_states
//   dtype float | half | bfloat16                      (attention, mla_attention, merge_attention_states)
//   buffer ID BYTES PATH                              read into an exact-size heap allocation (64-byte aligned)
//   tensor NAME ID BYTE_OFFSET NDIM SIZES... STRIDES...  a view of a buffer (strides in elements)
//   scalar NAME VALUE
//   output ID PATH                                    written back after the kernels ran
// fp8 caches (attention, reshape_and_cache): the scalar fp8_format (1: e4m3, 2: e5m2; absent or 0: the caches have
// the dtype), and optional one-element float32 tensors k_scale, v_scale. attention: optional tensors alibi_slopes,
// sinks (float32 [num_heads]) and lse (float32 [num_tokens, num_heads], an output), shared_plan (int32
// [num_tasks, kSharedPlanColumns]: a shared-blocks plan, csrc/cuda/shared_blocks.cuh).
// mla_attention: tensors out, query, kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim], block_tables,
// seq_lens, optional query_start_loc and lse; scalars kv_lora_rank, scale, num_sms, partition_tokens and optional
// blocks_per_sm, batch_invariant.
// Exit status: 0 done; 2 bad case file or a plan that refuses the launch (message on stderr); 3 an emulator error
// (divergent barrier, collective mismatch, ...). Sanitizer reports abort the program on their own.
#include "simt.h"  // first: the kernel headers then take its PA_SHARED / PA_EXTERN_SHARED

#include "../../csrc/cuda/attention_kernels.cuh"
#include "../../csrc/cuda/cache_ops_kernels.cuh"
#include "../../csrc/cuda/decode_mma_kernels.cuh"
#include "../../csrc/cuda/merge_attention_states_kernels.cuh"
#include "../../csrc/cuda/mla_kernels.cuh"
#include "../../csrc/cuda/varlen_attention_kernels.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using paged_attn::access_width;
using paged_attn::to_dim3;

struct CaseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------------------------
// The attention instantiations this driver compiles: the ones the emulated tests launch (from a trace of the whole
// suite), not all of launch_plan.h's lists. nvcc compiles every instantiation; here each one costs sanitizer build
// time (all ~240 took 5 CPU-minutes under ASan+UBSan, 2026-12-06), and one that no case runs proves nothing more.
// A case that needs another fails with "... is not emulated": add it below.
template <int HEAD_DIM, int GROUP>
struct Decode {};  // paged_attention_kernel<T, C, HEAD_DIM, GROUP> (and its split-KV reduce at HEAD_DIM)
template <typename... Variants>
struct DecodeList {};

template <int... H, int... G, typename F>
bool dispatch_decode(int head_dim, int group, DecodeList<Decode<H, G>...>, F&& f) {
  return ((head_dim == H && group == G
               ? (f(std::integral_constant<int, H>{}, std::integral_constant<int, G>{}), true)
               : false) ||
          ...);
}

// Per query dtype T and cache element C (T, or paged_attn::Fp8): the CUDA-core decode's (head dim, GROUP) pairs,
// and for 16-bit queries the head dims of the tensor-core decode and of the varlen kernel.
template <typename T, typename C>
struct Emulated;
template <>
struct Emulated<float, float> {
  using decode = DecodeList<Decode<32, 1>, Decode<32, 4>, Decode<64, 4>, Decode<80, 4>, Decode<96, 4>, Decode<112, 8>,
                            Decode<120, 8>, Decode<128, 4>, Decode<128, 8>, Decode<192, 1>, Decode<256, 4>>;
};
template <>
struct Emulated<float, paged_attn::Fp8> {
  using decode = DecodeList<Decode<64, 1>, Decode<64, 4>, Decode<128, 4>>;
};
template <>
struct Emulated<__half, __half> {
  using decode = DecodeList<Decode<64, 8>, Decode<120, 4>, Decode<120, 8>, Decode<128, 1>, Decode<128, 4>,
                            Decode<128, 8>>;
  using mma = paged_attn::DecodeMmaHeadDims;
  using varlen = paged_attn::IntList<64, 128, 256>;
  using mla = paged_attn::MlaShapeList<paged_attn::MlaShape<128, 32>>;  // (512 + 64: bfloat16's)
};
template <>
struct Emulated<__half, paged_attn::Fp8> {
  using decode = DecodeList<Decode<64, 4>, Decode<64, 8>, Decode<256, 4>, Decode<256, 8>>;
  using varlen = paged_attn::IntList<64, 256>;
};
template <>
struct Emulated<__nv_bfloat16, __nv_bfloat16> {
  using decode = DecodeList<Decode<64, 4>, Decode<120, 1>, Decode<128, 1>, Decode<128, 4>, Decode<128, 8>>;
  using mma = paged_attn::DecodeMmaHeadDims;
  using varlen = paged_attn::VarlenHeadDims;
  using mla = paged_attn::MlaShapes;
};
template <>
struct Emulated<__nv_bfloat16, paged_attn::Fp8> {
  using decode = DecodeList<Decode<64, 4>, Decode<80, 1>, Decode<80, 4>, Decode<128, 4>>;
  using varlen = paged_attn::IntList<64, 80, 128>;
};

// A buffer of exactly its byte count (AddressSanitizer reports any access past it), 64-byte aligned.
struct Buffer {
  struct Free {
    void operator()(char* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<char, Free> data;
  int64_t bytes = 0;
};

struct View {
  char* data = nullptr;  // the first element
  std::vector<int64_t> sizes, strides;
  int64_t size(size_t d) const { return sizes.at(d); }
  int64_t stride(size_t d) const { return strides.at(d); }
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(data); }
};

struct Case {
  std::string op, dtype;
  std::map<int, Buffer> buffers;
  std::map<std::string, View> tensors;
  std::map<std::string, double> scalars;
  std::vector<std::pair<int, std::string>> outputs;

  const View& tensor(const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw CaseError("case has no tensor " + name);
    return it->second;
  }
  bool has(const std::string& name) const { return tensors.count(name) > 0; }
  double scalar(const std::string& name) const {
    auto it = scalars.find(name);
    if (it == scalars.end()) throw CaseError("case has no scalar " + name);
    return it->second;
  }
};

Case read_case(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw CaseError("cannot open " + path);
  Case c;
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream in(line);
    std::string kind;
    if (!(in >> kind)) continue;
    if (kind == "op") {
      in >> c.op;
    } else if (kind == "dtype") {
      in >> c.dtype;
    } else if (kind == "buffer") {
      int id;
      int64_t bytes;
      std::string buffer_path;
      in >> id >> bytes >> buffer_path;
      Buffer& buffer = c.buffers[id];
      buffer.bytes = bytes;
      buffer.data.reset(static_cast<char*>(::operator new(bytes > 0 ? bytes : 1, std::align_val_t(64))));
      std::ifstream data(buffer_path, std::ios::binary);
      if (!data.read(buffer.data.get(), bytes)) {
        throw CaseError("cannot read " + std::to_string(bytes) + " bytes from " + buffer_path);
      }
    } else if (kind == "tensor") {
      std::string name;
      int id, ndim;
      int64_t offset;
      in >> name >> id >> offset >> ndim;
      View view;
      view.sizes.resize(ndim);
      view.strides.resize(ndim);
      for (auto& size : view.sizes) in >> size;
      for (auto& stride : view.strides) in >> stride;
      auto it = c.buffers.find(id);
      if (it == c.buffers.end()) throw CaseError("tensor " + name + " names an unknown buffer");
      view.data = it->second.data.get() + offset;
      c.tensors[name] = view;
    } else if (kind == "scalar") {
      std::string name;
      double value;
      in >> name >> value;
      c.scalars[name] = value;
    } else if (kind == "output") {
      int id;
      std::string output_path;
      in >> id >> output_path;
      c.outputs.emplace_back(id, output_path);
    } else {
      throw CaseError("unknown line: " + line);
    }
    if (in.fail()) throw CaseError("malformed line: " + line);
  }
  return c;
}

void write_outputs(const Case& c) {
  for (const auto& [id, path] : c.outputs) {
    const Buffer& buffer = c.buffers.at(id);
    std::ofstream out(path, std::ios::binary);
    out.write(buffer.data.get(), buffer.bytes);
    if (!out) throw CaseError("cannot write " + path);
  }
}

// Scratch memory of a launch (split-KV partials): exact size, NaN bytes, so a read of an unwritten record shows.
std::vector<std::unique_ptr<float[]>> scratch;
float* nan_floats(int64_t count) {
  scratch.emplace_back(new float[count > 0 ? count : 1]);
  std::memset(scratch.back().get(), 0xff, sizeof(float) * (count > 0 ? count : 1));
  return scratch.back().get();
}

// ---------------------------------------------------------------------------------------------------------------
// The case's fp8 format: 0 (the caches have the query's dtype), __NV_E4M3 + 1 or __NV_E5M2 + 1.
int fp8_format(const Case& c) {
  return c.scalars.count("fp8_format") ? static_cast<int>(c.scalar("fp8_format")) : 0;
}
__nv_fp8_interpretation_t fp8_interpretation(const Case& c) { return fp8_format(c) == 2 ? __NV_E5M2 : __NV_E4M3; }
const float* scale_of(const Case& c, const char* name) {
  return c.has(name) ? c.tensor(name).as<const float>() : nullptr;
}

template <typename T>
paged_attn::PagedCache<const T> cache_of(const View& cache) {
  return {cache.as<const T>(), cache.stride(0), cache.stride(1), cache.stride(2), static_cast<int>(cache.size(1)),
          static_cast<int>(cache.size(2)), static_cast<int>(cache.size(3))};
}

// The decode kernels (and split-KV's reduce) over `num_items` items (see attention_params.cuh's QueryRows).
template <typename T, typename C>
void run_decode_kernels(const Case& c, const simt::Options& options, paged_attn::AttentionParams<T, C> p,
                        int64_t num_items) {
  const View& block_tables = c.tensor("block_tables");
  const int64_t num_heads = p.num_heads, head_dim = p.key_cache.head_dim;
  // As csrc/cuda/attention.cpp: the tensor-core decode kernel where decode_on_tensor_cores says so (the scalar
  // tensor_cores = 0 takes the CUDA-core kernel, as a GPU below compute capability 8.0 does).
  const bool tensor_cores = paged_attn::decode_on_tensor_cores(
      head_dim, sizeof(C), std::is_same_v<C, paged_attn::Fp8>,
      !c.scalars.count("tensor_cores") || c.scalar("tensor_cores") != 0, p.key_cache.token_stride,
      p.value_cache.token_stride);
  // A shared-blocks plan (the tensor shared_plan) serves decode on tensor cores; elsewhere it is not read.
  const bool sharing = c.has("shared_plan") && tensor_cores && p.rows == paged_attn::QueryRows::kLastOfEachSeq;
  paged_attn::AttentionPlan plan = paged_attn::plan_attention(
      num_items, num_heads, p.key_cache.num_kv_heads, block_tables.size(1), p.key_cache.block_size,
      static_cast<int64_t>(c.scalar("sliding_window")), static_cast<int64_t>(c.scalar("num_sms")),
      c.scalars.count("blocks_per_sm") ? static_cast<int64_t>(c.scalar("blocks_per_sm")) : 1,
      static_cast<int64_t>(c.scalar("partition_tokens")), sharing ? c.tensor("shared_plan").size(0) : 0,
      c.scalars.count("batch_invariant") && c.scalar("batch_invariant") != 0);
  if (!plan.error.empty()) throw CaseError("plan_attention: " + plan.error);
  if (plan.num_shared_tasks > 0) {
    p.shared_plan = c.tensor("shared_plan").as<const int32_t>();
    p.num_shared_tasks = plan.num_shared_tasks;
    // (the scalar drop_shared_tasks = 1: the tasks' thread blocks are not launched, so the records they own stay
    // NaN: the tests see which rows the tasks serve)
    if (c.scalars.count("drop_shared_tasks") && c.scalar("drop_shared_tasks") != 0) {
      plan.grid.x -= plan.num_shared_tasks;
    }
  }
  if (plan.split()) {
    const int64_t records = num_items * num_heads * plan.num_partitions;
    p.partial_out = nan_floats(records * head_dim);
    p.partial_max = nan_floats(records);
    p.partial_sum = nan_floats(records);
  }
  p.set_plan(plan);
  if constexpr (std::is_same_v<T, C> && sizeof(T) == 2) {
    if (tensor_cores) {
      paged_attn::use_tensor_cores(plan, head_dim);
      const auto head_dims = typename Emulated<T, C>::mma{};
      const bool found = paged_attn::dispatch(static_cast<int>(head_dim), head_dims, [&](auto hd) {
        constexpr int HEAD_DIM = decltype(hd)::value;
        simt::launch(options, paged_attn::decode_mma_kernel<T, HEAD_DIM>, to_dim3(plan.grid), dim3(plan.threads),
                     plan.shared_bytes, p);
        if (plan.split()) {
          simt::launch(options, paged_attn::paged_attention_reduce_kernel<T, C, HEAD_DIM>, to_dim3(plan.reduce_grid),
                       dim3(plan.threads), 0, p);
        }
      });
      if (!found) {
        throw CaseError("the tensor-core decode at head_dim " + std::to_string(head_dim) + " is not emulated");
      }
      std::printf("decode plan (tensor cores): %lld items, partitions %d of %d tokens in %lld slots, %d bytes, "
                  "%d shared tasks\n",
                  static_cast<long long>(num_items), plan.num_partitions, plan.partition_size,
                  static_cast<long long>(plan.grid.z), plan.shared_bytes, plan.num_shared_tasks);
      return;
    }
  }
  const bool found = dispatch_decode(
      static_cast<int>(head_dim), plan.group_variant, typename Emulated<T, C>::decode{},
      [&](auto head_dim_constant, auto group_constant) {
        constexpr int HEAD_DIM = decltype(head_dim_constant)::value, GROUP = decltype(group_constant)::value;
        simt::launch(options, paged_attn::paged_attention_kernel<T, C, HEAD_DIM, GROUP>, to_dim3(plan.grid),
                     dim3(plan.threads), plan.shared_bytes, p);
        if (plan.split()) {
          simt::launch(options, paged_attn::paged_attention_reduce_kernel<T, C, HEAD_DIM>,
                       to_dim3(plan.reduce_grid), dim3(plan.threads), plan.shared_bytes, p);
        }
      });
  if (!found) {
    throw CaseError("the decode at head_dim " + std::to_string(head_dim) + ", GROUP " +
                    std::to_string(plan.group_variant) + " is not emulated");
  }
  std::printf("decode plan: %lld items, partitions %d of %d tokens in %lld partition slots, group variant %d, "
              "blocks per group %d\n", static_cast<long long>(num_items), plan.num_partitions, plan.partition_size,
              static_cast<long long>(plan.grid.z), plan.group_variant, plan.blocks_per_group);
}

// The launches of csrc/cuda/attention.cpp: without query_start_loc the decode kernels; with it, for float16 and
// bfloat16 queries (caches of the same dtype or fp8) at a head dim with a tensor-core instantiation, the decode
// kernels for the one-row sequences and the tensor-core kernel for the others (or, with the scalar every_row = 1, the
// decode kernels for every row, as float32 and the other head dims take). C: the cache element type (T, or Fp8 with
// fp8_format).
template <typename T, typename C = T>
void run_attention(const Case& c, const simt::Options& options) {
  const View &out = c.tensor("out"), &query = c.tensor("query"), &key_cache = c.tensor("key_cache"),
             &value_cache = c.tensor("value_cache"), &block_tables = c.tensor("block_tables"),
             &seq_lens = c.tensor("seq_lens");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const bool varlen = c.has("query_start_loc");
  const int64_t num_seqs = varlen ? c.tensor("query_start_loc").size(0) - 1 : num_tokens;

  paged_attn::AttentionParams<T, C> p{};
  p.out = out.as<T>();
  p.query = query.as<const T>();
  p.query_row_stride = query.stride(0), p.query_head_stride = query.stride(1);
  p.key_cache = cache_of<C>(key_cache), p.value_cache = cache_of<C>(value_cache);
  p.k_scale = scale_of(c, "k_scale"), p.v_scale = scale_of(c, "v_scale");
  p.fp8_format = fp8_interpretation(c);
  p.block_tables = block_tables.as<const int32_t>();
  p.seq_lens = seq_lens.as<const int32_t>();
  p.query_start_loc = varlen ? c.tensor("query_start_loc").as<const int32_t>() : nullptr;
  p.alibi_slopes = c.has("alibi_slopes") ? c.tensor("alibi_slopes").as<const float>() : nullptr;
  p.sinks = c.has("sinks") ? c.tensor("sinks").as<const float>() : nullptr;
  p.lse = c.has("lse") ? c.tensor("lse").as<float>() : nullptr;
  p.num_seqs = static_cast<int>(num_seqs), p.num_tokens = static_cast<int>(num_tokens);
  p.num_heads = static_cast<int>(num_heads), p.max_blocks_per_seq = block_tables.size(1);
  p.scale = static_cast<float>(c.scalar("scale"));
  p.logits_soft_cap = static_cast<float>(c.scalar("soft_cap"));
  if (!varlen) {
    p.rows = paged_attn::QueryRows::kLastOfEachSeq;
    run_decode_kernels(c, options, p, num_seqs);
    return;
  }
  if (num_tokens == 0) return;
  const paged_attn::VarlenPlan plan = paged_attn::plan_varlen_attention(
      num_seqs, num_tokens, num_heads, key_cache.size(2), head_dim, sizeof(T), block_tables.size(1),
      key_cache.size(1), static_cast<int64_t>(c.scalar("sliding_window")));
  if (!plan.error.empty() || c.scalar("every_row") != 0) {
    std::printf("tensor-core kernel not taken: %s\n", !plan.error.empty() ? plan.error.c_str() : "every_row");
    p.rows = paged_attn::QueryRows::kEveryRow;
    run_decode_kernels(c, options, p, num_tokens);
    return;
  }
  p.rows = paged_attn::QueryRows::kSingleTokenSeqs;
  run_decode_kernels(c, options, p, num_seqs);
  if constexpr (sizeof(T) == 2) {
    paged_attn::AttentionParams<T, C> vp = p;
    vp.set_varlen_plan(plan);
    const auto head_dims = typename Emulated<T, C>::varlen{};
    const bool found = paged_attn::dispatch(static_cast<int>(head_dim), head_dims, [&](auto hd) {
      constexpr int HEAD_DIM = decltype(hd)::value;
      simt::launch(options, paged_attn::varlen_attention_kernel<T, C, HEAD_DIM>, to_dim3(plan.grid),
                   dim3(plan.threads), plan.shared_bytes, vp);
    });
    if (!found) throw CaseError("the varlen kernel at head_dim " + std::to_string(head_dim) + " is not emulated");
    std::printf("tensor-core plan: grid (%lld, %lld), %d tokens x %d heads per tile, %d keys per step, %d bytes\n",
                static_cast<long long>(plan.grid.x), static_cast<long long>(plan.grid.y), plan.tokens_per_tile,
                plan.heads_per_tile, plan.key_tile, plan.shared_bytes);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// mla_attention: the launches of csrc/cuda/attention.cpp (mla_attention_cuda): mla_attention_kernel over the items
// (decode: sequences; query_start_loc: every query row), then in split-KV the reduce at HEAD_DIM = kv_lora_rank.
template <typename T>
void run_mla_attention(const Case& c, const simt::Options& options) {
  const View &out = c.tensor("out"), &query = c.tensor("query"), &kv_cache = c.tensor("kv_cache"),
             &block_tables = c.tensor("block_tables"), &seq_lens = c.tensor("seq_lens");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), row = query.size(2);
  const int64_t kv_lora_rank = static_cast<int64_t>(c.scalar("kv_lora_rank"));
  const bool varlen = c.has("query_start_loc");
  const int64_t num_seqs = varlen ? c.tensor("query_start_loc").size(0) - 1 : num_tokens;
  const int64_t num_items = varlen ? num_tokens : num_seqs;
  if (num_items == 0) return;
  paged_attn::AttentionParams<T> p{};
  p.out = out.as<T>();
  p.query = query.as<const T>();
  p.query_row_stride = query.stride(0), p.query_head_stride = query.stride(1);
  p.key_cache = {kv_cache.as<const T>(), kv_cache.stride(0), kv_cache.stride(1), 0,
                 static_cast<int>(kv_cache.size(1)), 1, static_cast<int>(row)};
  p.value_cache = p.key_cache;
  p.block_tables = block_tables.as<const int32_t>();
  p.seq_lens = seq_lens.as<const int32_t>();
  p.query_start_loc = varlen ? c.tensor("query_start_loc").as<const int32_t>() : nullptr;
  p.lse = c.has("lse") ? c.tensor("lse").as<float>() : nullptr;
  p.rows = varlen ? paged_attn::QueryRows::kEveryRow : paged_attn::QueryRows::kLastOfEachSeq;
  p.num_seqs = static_cast<int>(num_seqs), p.num_tokens = static_cast<int>(num_tokens);
  p.num_heads = static_cast<int>(num_heads), p.max_blocks_per_seq = block_tables.size(1);
  p.scale = static_cast<float>(c.scalar("scale"));
  const paged_attn::AttentionPlan plan = paged_attn::plan_mla_attention(
      num_items, num_heads, kv_lora_rank, row - kv_lora_rank, block_tables.size(1), kv_cache.size(1),
      static_cast<int64_t>(c.scalar("num_sms")),
      c.scalars.count("blocks_per_sm") ? static_cast<int64_t>(c.scalar("blocks_per_sm")) : 1,
      static_cast<int64_t>(c.scalar("partition_tokens")),
      c.scalars.count("batch_invariant") && c.scalar("batch_invariant") != 0);
  if (!plan.error.empty()) throw CaseError("plan_mla_attention: " + plan.error);
  if (plan.split()) {
    const int64_t records = num_items * num_heads * plan.num_partitions;
    p.partial_out = nan_floats(records * kv_lora_rank);
    p.partial_max = nan_floats(records);
    p.partial_sum = nan_floats(records);
  }
  p.set_plan(plan);
  const bool found = paged_attn::dispatch_mla(kv_lora_rank, row - kv_lora_rank, typename Emulated<T, T>::mla{},
                                              [&](auto lora, auto rope) {
    constexpr int LORA = decltype(lora)::value, ROPE = decltype(rope)::value;
    simt::launch(options, paged_attn::mla_attention_kernel<T, LORA, ROPE>, to_dim3(plan.grid), dim3(plan.threads),
                 plan.shared_bytes, p);
    if (plan.split()) {
      simt::launch(options, paged_attn::paged_attention_reduce_kernel<T, T, LORA>, to_dim3(plan.reduce_grid),
                   dim3(plan.threads), 0, p);
    }
  });
  if (!found) throw CaseError("mla_attention at this kv_lora_rank + rope_dim is not emulated");
  std::printf("mla plan: %lld items, grid (%lld, %lld, %lld), partitions %d of %d tokens, %d bytes\n",
              static_cast<long long>(num_items), static_cast<long long>(plan.grid.x),
              static_cast<long long>(plan.grid.y), static_cast<long long>(plan.grid.z), plan.num_partitions,
              plan.partition_size, plan.shared_bytes);
}

// ---------------------------------------------------------------------------------------------------------------
uint64_t address(const View& v) { return reinterpret_cast<uint64_t>(v.data); }

// reshape_and_cache into fp8 caches (reshape_and_cache_fp8_kernel), keys and values of dtype T.
template <typename T>
void run_reshape_and_cache_fp8(const Case& c, const simt::Options& options) {
  const View &key = c.tensor("key"), &value = c.tensor("value"), &key_cache = c.tensor("key_cache"),
             &value_cache = c.tensor("value_cache"), &slot_mapping = c.tensor("slot_mapping");
  const int64_t num_tokens = key.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const auto plan = paged_attn::plan_reshape_and_cache(num_tokens, num_kv_heads, head_dim);
  if (!plan.error.empty()) throw CaseError("plan_reshape_and_cache: " + plan.error);
  const auto cache = [&](const View& v) {
    return paged_attn::PagedCache<__nv_fp8_storage_t>{v.as<__nv_fp8_storage_t>(), v.stride(0), v.stride(1),
                                                      v.stride(2), static_cast<int>(v.size(1)),
                                                      static_cast<int>(num_kv_heads), static_cast<int>(head_dim)};
  };
  const paged_attn::ReshapeAndCacheFp8Params<T> p{
      key.as<const T>(), value.as<const T>(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
      cache(key_cache), cache(value_cache), slot_mapping.as<const int64_t>(), scale_of(c, "k_scale"),
      scale_of(c, "v_scale"), fp8_interpretation(c)};
  if (num_tokens > 0) {
    simt::launch(options, paged_attn::reshape_and_cache_fp8_kernel<T>, to_dim3(plan.grid), dim3(plan.threads),
                 plan.shared_bytes, p);
  }
  std::printf("plan: fp8, %d threads\n", plan.threads);
}

void run_reshape_and_cache(const Case& c, const simt::Options& options) {
  if (fp8_format(c) != 0) {
    if (c.dtype == "float") return run_reshape_and_cache_fp8<float>(c, options);
    if (c.dtype == "half") return run_reshape_and_cache_fp8<__half>(c, options);
    if (c.dtype == "bfloat16") return run_reshape_and_cache_fp8<__nv_bfloat16>(c, options);
    throw CaseError("unknown dtype " + c.dtype);
  }
  const View &key = c.tensor("key"), &value = c.tensor("value"), &key_cache = c.tensor("key_cache"),
             &value_cache = c.tensor("value_cache"), &slot_mapping = c.tensor("slot_mapping");
  const int64_t elem = static_cast<int64_t>(c.scalar("element_size"));
  const int64_t num_tokens = key.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const int64_t width = access_width(
      {static_cast<uint64_t>(head_dim * elem), static_cast<uint64_t>(key.stride(0) * elem),
       static_cast<uint64_t>(key.stride(1) * elem), static_cast<uint64_t>(value.stride(0) * elem),
       static_cast<uint64_t>(value.stride(1) * elem), static_cast<uint64_t>(key_cache.stride(0) * elem),
       static_cast<uint64_t>(key_cache.stride(1) * elem), static_cast<uint64_t>(key_cache.stride(2) * elem),
       static_cast<uint64_t>(value_cache.stride(0) * elem), static_cast<uint64_t>(value_cache.stride(1) * elem),
       static_cast<uint64_t>(value_cache.stride(2) * elem), address(key), address(value), address(key_cache),
       address(value_cache)});
  const int64_t per_unit = width / elem;
  const auto plan = paged_attn::plan_reshape_and_cache(num_tokens, num_kv_heads, head_dim / per_unit);
  if (!plan.error.empty()) throw CaseError("plan_reshape_and_cache: " + plan.error);
  paged_attn::dispatch_unit(width, [&](auto unit) {
    using Unit = decltype(unit);
    paged_attn::ReshapeAndCacheParams<Unit> p{};
    p.key = key.as<const Unit>(), p.value = value.as<const Unit>();
    p.key_token_stride = key.stride(0) / per_unit, p.key_head_stride = key.stride(1) / per_unit;
    p.value_token_stride = value.stride(0) / per_unit, p.value_head_stride = value.stride(1) / per_unit;
    const auto cache = [&](const View& v) {
      return paged_attn::PagedCache<Unit>{v.as<Unit>(), v.stride(0) / per_unit, v.stride(1) / per_unit,
                                          v.stride(2) / per_unit, static_cast<int>(v.size(1)),
                                          static_cast<int>(num_kv_heads), static_cast<int>(head_dim / per_unit)};
    };
    p.key_cache = cache(key_cache), p.value_cache = cache(value_cache);
    p.slot_mapping = slot_mapping.as<const int64_t>();
    if (num_tokens > 0) {
      simt::launch(options, paged_attn::reshape_and_cache_kernel<Unit>, to_dim3(plan.grid), dim3(plan.threads),
                   plan.shared_bytes, p);
    }
  });
  std::printf("plan: access width %lld bytes, %d threads\n", static_cast<long long>(width), plan.threads);
}

// concat_and_cache_mla (concat_and_cache_mla_kernel, or into an fp8 cache the _fp8 kernel), as
// csrc/cuda/cache_ops.cpp launches it: tensors kv_c, k_pe, kv_cache [num_blocks, block_size, row], slot_mapping
// (and scale for fp8); scalars element_size, fp8_format.
template <typename T>
void run_concat_and_cache_mla_fp8(const Case& c, const simt::Options& options) {
  const View &kv_c = c.tensor("kv_c"), &k_pe = c.tensor("k_pe"), &kv_cache = c.tensor("kv_cache"),
             &slot_mapping = c.tensor("slot_mapping");
  const int64_t num_tokens = kv_c.size(0), rank = kv_c.size(1), rope_dim = k_pe.size(1);
  const auto plan = paged_attn::plan_reshape_and_cache(num_tokens, 1, rank + rope_dim);
  if (!plan.error.empty()) throw CaseError("plan_reshape_and_cache: " + plan.error);
  const paged_attn::ConcatAndCacheMlaFp8Params<T> p{
      kv_c.as<const T>(), k_pe.as<const T>(), kv_c.stride(0), k_pe.stride(0), static_cast<int>(rank),
      static_cast<int>(rope_dim),
      {kv_cache.as<__nv_fp8_storage_t>(), kv_cache.stride(0), kv_cache.stride(1), 0,
       static_cast<int>(kv_cache.size(1)), 1, static_cast<int>(rank + rope_dim)},
      slot_mapping.as<const int64_t>(), scale_of(c, "scale"), fp8_interpretation(c)};
  if (num_tokens > 0) {
    simt::launch(options, paged_attn::concat_and_cache_mla_fp8_kernel<T>, to_dim3(plan.grid), dim3(plan.threads),
                 plan.shared_bytes, p);
  }
  std::printf("plan: fp8, %d threads\n", plan.threads);
}

void run_concat_and_cache_mla(const Case& c, const simt::Options& options) {
  if (fp8_format(c) != 0) {
    if (c.dtype == "float") return run_concat_and_cache_mla_fp8<float>(c, options);
    if (c.dtype == "half") return run_concat_and_cache_mla_fp8<__half>(c, options);
    if (c.dtype == "bfloat16") return run_concat_and_cache_mla_fp8<__nv_bfloat16>(c, options);
    throw CaseError("unknown dtype " + c.dtype);
  }
  const View &kv_c = c.tensor("kv_c"), &k_pe = c.tensor("k_pe"), &kv_cache = c.tensor("kv_cache"),
             &slot_mapping = c.tensor("slot_mapping");
  const int64_t elem = static_cast<int64_t>(c.scalar("element_size"));
  const int64_t num_tokens = kv_c.size(0), rank = kv_c.size(1), rope_dim = k_pe.size(1);
  const int64_t width = access_width(
      {static_cast<uint64_t>(rank * elem), static_cast<uint64_t>(rope_dim * elem),
       static_cast<uint64_t>(kv_c.stride(0) * elem), static_cast<uint64_t>(k_pe.stride(0) * elem),
       static_cast<uint64_t>(kv_cache.stride(0) * elem), static_cast<uint64_t>(kv_cache.stride(1) * elem),
       address(kv_c), address(k_pe), address(kv_cache)});
  const int64_t per_unit = width / elem;
  const auto plan = paged_attn::plan_reshape_and_cache(num_tokens, 1, (rank + rope_dim) / per_unit);
  if (!plan.error.empty()) throw CaseError("plan_reshape_and_cache: " + plan.error);
  paged_attn::dispatch_unit(width, [&](auto unit) {
    using Unit = decltype(unit);
    const paged_attn::ConcatAndCacheMlaParams<Unit> p{
        kv_c.as<const Unit>(), k_pe.as<const Unit>(), kv_c.stride(0) / per_unit, k_pe.stride(0) / per_unit,
        static_cast<int>(rank / per_unit), static_cast<int>(rope_dim / per_unit),
        {kv_cache.as<Unit>(), kv_cache.stride(0) / per_unit, kv_cache.stride(1) / per_unit, 0,
         static_cast<int>(kv_cache.size(1)), 1, static_cast<int>((rank + rope_dim) / per_unit)},
        slot_mapping.as<const int64_t>()};
    if (num_tokens > 0) {
      simt::launch(options, paged_attn::concat_and_cache_mla_kernel<Unit>, to_dim3(plan.grid), dim3(plan.threads),
                   plan.shared_bytes, p);
    }
  });
  std::printf("plan: access width %lld bytes, %d threads\n", static_cast<long long>(width), plan.threads);
}

void run_copy_blocks(const Case& c, const simt::Options& options) {
  const int64_t num_layers = static_cast<int64_t>(c.scalar("num_layers"));
  const int64_t elem = static_cast<int64_t>(c.scalar("element_size"));
  const View& mapping = c.tensor("block_mapping");
  const View& first = c.tensor("key_caches.0");
  const int64_t num_pairs = mapping.size(0);
  const int64_t caches_per_layer = c.has("value_caches.0") ? 2 : 1;  // 1: one cache per layer (MLA's latent caches)
  uint64_t bits = static_cast<uint64_t>(first.size(3) * elem);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (int64_t k = 0; k < caches_per_layer; ++k) {
      const View& cache = c.tensor((k == 0 ? "key_caches." : "value_caches.") + std::to_string(layer));
      bits |= address(cache) | static_cast<uint64_t>(cache.stride(0) * elem) |
              static_cast<uint64_t>(cache.stride(1) * elem) | static_cast<uint64_t>(cache.stride(2) * elem);
    }
  }
  const int64_t width = access_width({bits});
  const int64_t block_units = first.size(1) * first.size(2) * first.size(3) * elem / width;
  const auto byte_cache = [&](const View& v) {
    return paged_attn::PagedCache<char>{v.data, v.stride(0) * elem, v.stride(1) * elem, v.stride(2) * elem,
                                        static_cast<int>(v.size(1)), static_cast<int>(v.size(2)),
                                        static_cast<int>(v.size(3) * elem)};
  };
  int launches = 0;
  for (int64_t first_layer = 0; first_layer < num_layers; first_layer += paged_attn::kMaxLayersPerLaunch) {
    const int64_t launch_layers = std::min<int64_t>(paged_attn::kMaxLayersPerLaunch, num_layers - first_layer);
    const auto plan = paged_attn::plan_copy_blocks(num_pairs, launch_layers, block_units, caches_per_layer);
    if (!plan.error.empty()) throw CaseError("plan_copy_blocks: " + plan.error);
    paged_attn::CopyBlocksParams p{};
    for (int64_t i = 0; i < launch_layers; ++i) {
      p.key[i] = byte_cache(c.tensor("key_caches." + std::to_string(first_layer + i)));
      if (caches_per_layer == 2) p.value[i] = byte_cache(c.tensor("value_caches." + std::to_string(first_layer + i)));
    }
    p.block_mapping = mapping.as<const int64_t>();
    paged_attn::dispatch_unit(width, [&](auto unit) {
      using Unit = decltype(unit);
      if (num_pairs > 0) {
        simt::launch(options, paged_attn::copy_blocks_kernel<Unit>, to_dim3(plan.grid), dim3(plan.threads),
                     plan.shared_bytes, p);
      }
    });
    ++launches;
  }
  std::printf("plan: access width %lld bytes, %d launches\n", static_cast<long long>(width), launches);
}

// merge_attention_states (merge_attention_states_kernel) on tensors out, lse, out_a, lse_a, out_b, lse_b.
template <typename T>
void run_merge_attention_states(const Case& c, const simt::Options& options) {
  const View &out = c.tensor("out"), &lse = c.tensor("lse"), &out_a = c.tensor("out_a"), &lse_a = c.tensor("lse_a"),
             &out_b = c.tensor("out_b"), &lse_b = c.tensor("lse_b");
  const int64_t num_tokens = out_a.size(0), num_heads = out_a.size(1);
  const auto plan = paged_attn::plan_merge_attention_states(num_tokens, num_heads);
  if (num_tokens == 0 || num_heads == 0) return;
  if (!plan.error.empty()) throw CaseError("plan_merge_attention_states: " + plan.error);
  const paged_attn::MergeAttentionStatesParams<T> p{
      out.as<T>(), lse.as<float>(), out_a.as<const T>(), lse_a.as<const float>(), out_b.as<const T>(),
      lse_b.as<const float>(), {out.stride(0), out.stride(1)}, {out_a.stride(0), out_a.stride(1)},
      {out_b.stride(0), out_b.stride(1)}, {lse.stride(0), lse.stride(1)}, {lse_a.stride(0), lse_a.stride(1)},
      {lse_b.stride(0), lse_b.stride(1)}, static_cast<int>(num_heads), static_cast<int>(out_a.size(2))};
  simt::launch(options, paged_attn::merge_attention_states_kernel<T>, to_dim3(plan.grid), dim3(plan.threads),
               plan.shared_bytes, p);
  std::printf("plan: grid (%lld, %lld), %d threads\n", static_cast<long long>(plan.grid.x),
              static_cast<long long>(plan.grid.y), plan.threads);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CASE_FILE forward|reverse|random SEED\n", argv[0]);
    return 2;
  }
  const std::string order = argv[2];
  simt::Options options;
  options.order = order == "forward" ? simt::Order::kForward
                  : order == "reverse" ? simt::Order::kReverse
                                       : simt::Order::kRandom;
  options.seed = std::strtoull(argv[3], nullptr, 10);
  try {
    const Case c = read_case(argv[1]);
    if (c.op == "attention" && fp8_format(c) != 0) {
      if (c.dtype == "float") run_attention<float, paged_attn::Fp8>(c, options);
      else if (c.dtype == "half") run_attention<__half, paged_attn::Fp8>(c, options);
      else if (c.dtype == "bfloat16") run_attention<__nv_bfloat16, paged_attn::Fp8>(c, options);
      else throw CaseError("unknown dtype " + c.dtype);
    } else if (c.op == "attention") {
      if (c.dtype == "float") run_attention<float>(c, options);
      else if (c.dtype == "half") run_attention<__half>(c, options);
      else if (c.dtype == "bfloat16") run_attention<__nv_bfloat16>(c, options);
      else throw CaseError("unknown dtype " + c.dtype);
    } else if (c.op == "mla_attention") {
      if (c.dtype == "half") run_mla_attention<__half>(c, options);
      else if (c.dtype == "bfloat16") run_mla_attention<__nv_bfloat16>(c, options);
      else throw CaseError("mla_attention takes half and bfloat16, got " + c.dtype);
    } else if (c.op == "reshape_and_cache") {
      run_reshape_and_cache(c, options);
    } else if (c.op == "concat_and_cache_mla") {
      run_concat_and_cache_mla(c, options);
    } else if (c.op == "copy_blocks") {
      run_copy_blocks(c, options);
    } else if (c.op == "merge_attention_states") {
      if (c.dtype == "float") run_merge_attention_states<float>(c, options);
      else if (c.dtype == "half") run_merge_attention_states<__half>(c, options);
      else if (c.dtype == "bfloat16") run_merge_attention_states<__nv_bfloat16>(c, options);
      else throw CaseError("unknown dtype " + c.dtype);
    } else {
      throw CaseError("unknown op " + c.op);
    }
    write_outputs(c);
  } catch (const CaseError& error) {
    std::fprintf(stderr, "case error: %s\n", error.what());
    return 2;
  } catch (const simt::Error& error) {
    std::fprintf(stderr, "emulator error: %s\n", error.what());
    return 3;
  }
  return 0;
}
