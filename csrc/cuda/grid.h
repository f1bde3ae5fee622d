// CUDA grids and kernel variants for the launch plans (launch_plan.h, copy_plan.h): the grid's limits, and
// compile-time lists of instantiated variants with a run-time dispatch over them. Plain C++17 (no CUDA, no torch).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace paged_attn {

// ---------------------------------------------------------------------------------------------------------------
// Grids.

// CUDA's limits on the grid: x < 2^31, y and z <= 65535.
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxGridYZ = 65535;

struct Grid {
  int64_t x = 1, y = 1, z = 1;
};

// "" when every dimension of grid is within CUDA's limits; otherwise names the first that is not, with the
// quantity it stands for (e.g. x_name = "num_seqs").
inline std::string grid_error(const Grid& grid, const char* x_name, const char* y_name, const char* z_name) {
  const auto over = [](const char* axis, const char* name, int64_t value, int64_t limit) {
    return std::string("grid.") + axis + " = " + name + " = " + std::to_string(value) + " is outside [1, " +
           std::to_string(limit) + "]";
  };
  if (grid.x < 1 || grid.x > kMaxGridX) return over("x", x_name, grid.x, kMaxGridX);
  if (grid.y < 1 || grid.y > kMaxGridYZ) return over("y", y_name, grid.y, kMaxGridYZ);
  if (grid.z < 1 || grid.z > kMaxGridYZ) return over("z", z_name, grid.z, kMaxGridYZ);
  return "";
}

// Compile-time lists of the instantiated kernel variants, and a run-time dispatch over them:
// dispatch(value, IntList<...>{}, f) calls f(std::integral_constant<int, value>{}) and returns true when value is
// in the list; returns false (and calls nothing) otherwise.
template <int... Values>
struct IntList {};

template <int... Values, typename F>
bool dispatch(int value, IntList<Values...>, F&& f) {
  return ((value == Values ? (f(std::integral_constant<int, Values>{}), true) : false) || ...);
}

template <int... Values>
constexpr bool contains(IntList<Values...>, int64_t value) {
  return ((value == Values) || ...);
}

template <int... Values>
std::string to_string(IntList<Values...>) {  // "32, 64, 80"
  std::string s;
  ((s += (s.empty() ? "" : ", ") + std::to_string(Values)), ...);
  return s;
}

}  // namespace paged_attn
