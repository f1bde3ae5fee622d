// Calls the paged_attn ops through the PyTorch dispatcher from C++, checks the results against plain indexing,
// and checks that a bad slot raises an error. Built and run by CMake (ctest); exits non-zero on any failure.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <iostream>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  std::cout << (ok ? "ok    " : "FAIL  ") << what << "\n";
  if (!ok) ++failures;
}

}  // namespace

int main() {
  auto& dispatcher = c10::Dispatcher::singleton();
  auto reshape_and_cache =
      dispatcher.findSchemaOrThrow("paged_attn::reshape_and_cache", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  auto copy_blocks = dispatcher.findSchemaOrThrow("paged_attn::copy_blocks", "")
                         .typed<void(at::TensorList, at::TensorList, const at::Tensor&)>();
  auto swap_blocks = dispatcher.findSchemaOrThrow("paged_attn::swap_blocks", "")
                         .typed<void(const at::Tensor&, at::Tensor&, const at::Tensor&)>();

  // [num_blocks = 4, block_size = 8, num_kv_heads = 2, head_dim = 64], NaN-poisoned.
  at::Tensor key_cache = at::full({4, 8, 2, 64}, NAN);
  at::Tensor value_cache = at::full({4, 8, 2, 64}, NAN);
  at::Tensor key = at::randn({3, 2, 64}), value = at::randn({3, 2, 64});
  at::Tensor slot_mapping = at::tensor({9, -1, 30}, at::kLong);  // block 1 offset 1, padding, block 3 offset 6

  reshape_and_cache.call(key, value, key_cache, value_cache, slot_mapping, std::nullopt, std::nullopt);
  expect(at::equal(key_cache[1][1], key[0]) && at::equal(value_cache[3][6], value[2]), "reshape_and_cache writes");
  expect(key_cache.isnan().sum().item<int64_t>() == (4 * 8 - 2) * 2 * 64, "reshape_and_cache leaves other slots");

  at::Tensor block_mapping = at::tensor({1, 2}, at::kLong).view({1, 2});
  copy_blocks.call({key_cache}, {value_cache}, block_mapping);
  expect(at::equal(key_cache[2][1], key[0]), "copy_blocks copies block 1 to block 2");

  at::Tensor cpu_cache = at::zeros({2, 8, 2, 64});
  at::Tensor swap_mapping = at::tensor({3, 0}, at::kLong).view({1, 2});
  swap_blocks.call(value_cache, cpu_cache, swap_mapping);
  expect(at::equal(cpu_cache[0][6], value[2]), "swap_blocks copies block 3 to block 0");

  bool raised = false;
  try {
    reshape_and_cache.call(key, value, key_cache, value_cache, at::tensor({0, 1, 32}, at::kLong), std::nullopt,
                           std::nullopt);
  } catch (const c10::Error& e) {
    raised = std::string(e.what_without_backtrace()).find("out of range") != std::string::npos;
  }
  expect(raised, "an out-of-range slot raises an error");

  std::cout << (failures == 0 ? "all passed" : "FAILED") << "\n";
  return failures == 0 ? 0 : 1;
}
