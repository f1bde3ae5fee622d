// The Python module paged_attn._C. Importing it loads this shared library, which runs the static op
// registrations (TORCH_LIBRARY / TORCH_LIBRARY_IMPL); besides that it only exposes the validation switch and, for
// the tests, the overlap predicate the ops' checks use, the CPU decode's count of shared tokens and the CUDA launch
// plans (csrc/cuda/launch_plan.h: plain C++, so they are built and tested without a GPU and without the CUDA
// kernels).
// Python's limited API only (setup.py builds with py_limited_api: -DPy_LIMITED_API=0x030A0000, no libtorch_python):
// the library, _C.abi3.so, loads in any CPython >= 3.10 with the torch it was built against (the GPU check's
// bundle is built here for the GPU machines' Python: scripts/check_torch_version.sh --bundle). Tensors therefore cross as plain
// numbers, never as torch's Python objects.
// The CMake build (a plain C++ library for libtorch users) leaves this file out.
#include <Python.h>
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "common.h"
#include "cuda/copy_plan.h"
#include "cuda/launch_plan.h"
#include "cuda/mla_plan.h"
#include "shared_blocks.h"

namespace {

// A switch of common.h (validation, batch invariance) as a pair of module functions: set_*(bool), *_enabled().
template <void (*Set)(bool)>
PyObject* set_switch(PyObject* /*self*/, PyObject* arg) {
  const int enabled = PyObject_IsTrue(arg);
  if (enabled < 0) return nullptr;
  Set(enabled != 0);
  Py_RETURN_NONE;
}

template <bool (*Get)()>
PyObject* switch_enabled(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(Get() ? 1 : 0);
}

// One tensor's memory as _tensors_overlap takes it: (data_ptr, sizes, strides, element_size). The tensor rebuilt
// over that address (never read) has the footprint of the one described.
bool tensor_of(PyObject* memory, at::Tensor* out) {
  unsigned long long address = 0;
  PyObject *sizes = nullptr, *strides = nullptr;
  int element_size = 0;
  if (!PyArg_ParseTuple(memory, "KOOi", &address, &sizes, &strides, &element_size)) return false;
  const auto ints = [](PyObject* sequence, std::vector<int64_t>* values) {
    PyObject* items = PySequence_Tuple(sequence);
    if (items == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_Size(items); ++i) {
      values->push_back(PyLong_AsLongLong(PyTuple_GetItem(items, i)));
    }
    Py_DECREF(items);
    return PyErr_Occurred() == nullptr;
  };
  std::vector<int64_t> size_values, stride_values;
  if (!ints(sizes, &size_values) || !ints(strides, &stride_values)) return false;
  const at::ScalarType dtypes[] = {at::kByte, at::kShort, at::kInt, at::kLong};
  const int log2 = element_size == 1 ? 0 : element_size == 2 ? 1 : element_size == 4 ? 2 : element_size == 8 ? 3 : -1;
  if (log2 < 0 || size_values.size() != stride_values.size()) {
    PyErr_SetString(PyExc_ValueError, "_tensors_overlap: (data_ptr, sizes, strides, element_size in 1/2/4/8)");
    return false;
  }
  *out = at::from_blob(reinterpret_cast<void*>(address), size_values, stride_values,
                       at::TensorOptions().dtype(dtypes[log2]));
  return true;
}

PyObject* tensors_overlap(PyObject* /*self*/, PyObject* args) {
  PyObject *a = nullptr, *b = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &a, &b)) return nullptr;
  at::Tensor ta, tb;
  if (!tensor_of(a, &ta) || !tensor_of(b, &tb)) return nullptr;
  return PyBool_FromLong(paged_attn::tensors_overlap(ta, tb) ? 1 : 0);
}

PyObject* linear_uses_avx512(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(paged_attn::cpu_avx512_bf16() ? 1 : 0);
}

PyObject* shared_tokens_saved(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromLongLong(paged_attn::shared_tokens_saved());
}

PyObject* grid_tuple(const paged_attn::Grid& grid) {
  return Py_BuildValue("(LLL)", static_cast<long long>(grid.x), static_cast<long long>(grid.y),
                       static_cast<long long>(grid.z));
}

// _launch_plan(kernel, *sizes) -> dict: the plan_* function of launch_plan.h for that kernel, its fields by name
// ("error" is None when the launch is possible):
//   "paged_attention": num_seqs, num_heads, num_kv_heads, max_blocks_per_seq, block_size, sliding_window, num_sms,
//                      blocks_per_sm [, partition_tokens [, num_shared_tasks [, batch_invariant]]]
//   "paged_attention_varlen": num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, element_bytes,
//                             max_blocks_per_seq, block_size, sliding_window
//   "mla_attention": num_items, num_heads, kv_lora_rank, rope_dim, max_blocks_per_seq, block_size, num_sms,
//                    blocks_per_sm [, partition_tokens [, batch_invariant]]
//   "decode_mma": head_dim   (the tensor-core decode kernel's dynamic shared memory: {"shared_bytes": ...})
//   "reshape_and_cache": num_tokens, num_kv_heads, head_units
//   "copy_blocks": num_pairs, launch_layers, block_units
PyObject* launch_plan(PyObject* /*self*/, PyObject* args) {
  const Py_ssize_t n = PyTuple_Size(args);
  PyObject* utf8 = n > 0 ? PyUnicode_AsUTF8String(PyTuple_GetItem(args, 0)) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "_launch_plan(kernel: str, *sizes: int)");
    return nullptr;
  }
  const std::string name = PyBytes_AsString(utf8);
  Py_DECREF(utf8);
  std::vector<int64_t> sizes;
  for (Py_ssize_t i = 1; i < n; ++i) {
    sizes.push_back(PyLong_AsLongLong(PyTuple_GetItem(args, i)));
    if (PyErr_Occurred()) return nullptr;
  }
  const auto error = [](const std::string& e) { return e.empty() ? nullptr : e.c_str(); };
  if (name == "paged_attention" && sizes.size() >= 8 && sizes.size() <= 11) {
    const int64_t partition_tokens = sizes.size() >= 9 ? sizes[8] : paged_attn::kPartitionSize;
    const int64_t num_shared_tasks = sizes.size() >= 10 ? sizes[9] : 0;
    const bool batch_invariant = sizes.size() == 11 && sizes[10] != 0;
    const auto plan = paged_attn::plan_attention(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6],
                                                 sizes[7], partition_tokens, num_shared_tasks, batch_invariant);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:L,s:i,s:i,s:i,s:N,s:N,s:i,s:i,s:i,s:z}", "group_size", plan.group_size,
                         "blocks_per_group", plan.blocks_per_group, "heads_per_block", plan.heads_per_block,
                         "group_variant", plan.group_variant, "max_context", static_cast<long long>(plan.max_context),
                         "sliding_window", plan.sliding_window, "num_partitions", plan.num_partitions,
                         "partition_size", plan.partition_size, "grid", grid_tuple(plan.grid), "reduce_grid",
                         grid_tuple(plan.reduce_grid), "threads", plan.threads, "shared_bytes", plan.shared_bytes,
                         "num_shared_tasks", plan.num_shared_tasks, "error", error(plan.error));
  }
  if (name == "mla_attention" && sizes.size() >= 8 && sizes.size() <= 10) {
    const int64_t partition_tokens = sizes.size() >= 9 ? sizes[8] : paged_attn::kPartitionSize;
    const bool batch_invariant = sizes.size() == 10 && sizes[9] != 0;
    const auto plan = paged_attn::plan_mla_attention(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5],
                                                     sizes[6], sizes[7], partition_tokens, batch_invariant);
    return Py_BuildValue("{s:i,s:i,s:i,s:N,s:N,s:i,s:i,s:z}", "heads_per_block", plan.heads_per_block,
                         "num_partitions", plan.num_partitions, "partition_size", plan.partition_size, "grid",
                         grid_tuple(plan.grid), "reduce_grid", grid_tuple(plan.reduce_grid), "threads", plan.threads,
                         "shared_bytes", plan.shared_bytes, "error", error(plan.error));
  }
  if (name == "paged_attention_varlen" && sizes.size() == 9) {
    const auto plan = paged_attn::plan_varlen_attention(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5],
                                                        sizes[6], sizes[7], sizes[8]);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:L,s:i,s:N,s:i,s:i,s:z}", "group_size", plan.group_size,
                         "blocks_per_group", plan.blocks_per_group, "heads_per_tile", plan.heads_per_tile,
                         "tokens_per_tile", plan.tokens_per_tile, "key_tile", plan.key_tile, "max_context",
                         static_cast<long long>(plan.max_context), "sliding_window", plan.sliding_window, "grid",
                         grid_tuple(plan.grid), "threads", plan.threads, "shared_bytes", plan.shared_bytes, "error",
                         error(plan.error));
  }
  if (name == "decode_mma" && sizes.size() == 1) {
    return Py_BuildValue("{s:i}", "shared_bytes", paged_attn::decode_mma_shared_bytes(sizes[0]));
  }
  if ((name == "reshape_and_cache" || name == "copy_blocks") && sizes.size() == 3) {
    const auto plan = name == "copy_blocks" ? paged_attn::plan_copy_blocks(sizes[0], sizes[1], sizes[2])
                                            : paged_attn::plan_reshape_and_cache(sizes[0], sizes[1], sizes[2]);
    return Py_BuildValue("{s:N,s:i,s:i,s:z}", "grid", grid_tuple(plan.grid), "threads", plan.threads, "shared_bytes",
                         plan.shared_bytes, "error", error(plan.error));
  }
  PyErr_Format(PyExc_TypeError, "_launch_plan: unknown kernel %s or wrong number of sizes (%zd)", name.c_str(),
               n - 1);
  return nullptr;
}

PyMethodDef methods[] = {
    {"set_validation", set_switch<paged_attn::set_validation_enabled>, METH_O,
     "Turn the CUDA index validation mode on or off."},
    {"validation_enabled", switch_enabled<paged_attn::validation_enabled>, METH_NOARGS,
     "Whether the CUDA index validation mode is on."},
    {"set_batch_invariant", set_switch<paged_attn::set_batch_invariant_enabled>, METH_O,
     "Turn the batch-invariant CUDA decode on or off."},
    {"batch_invariant_enabled", switch_enabled<paged_attn::batch_invariant_enabled>, METH_NOARGS,
     "Whether the CUDA decode is batch-invariant."},
    {"_tensors_overlap", tensors_overlap, METH_VARARGS, "Whether two tensors share memory (the ops' check; tests)."},
    {"_shared_tokens_saved", shared_tokens_saved, METH_NOARGS,
     "Key tokens the CPU decode read once for several rows, since loading (shared_blocks.h; tests)."},
    {"_linear_uses_avx512", linear_uses_avx512, METH_NOARGS,
     "Whether paged_attn.linear runs its AVX-512 micro-kernels on this CPU (csrc/cpu/linear.cpp)."},
    {"_launch_plan", launch_plan, METH_VARARGS, "The launch plan of a CUDA kernel for given sizes (tests)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "paged_attn kernels (ops live in torch.ops.paged_attn)", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
