// The memory-overlap geometry declared in overlap.h (what it decides and how: see there).
#include "overlap.h"

#include <algorithm>
#include <vector>

namespace paged_attn {

int64_t block_span_bytes(const at::Tensor& t) {
  int64_t last = 0;  // offset of a block's last element, in elements
  for (int64_t d = 1; d < t.dim(); ++d) {
    if (t.size(d) == 0) return 0;
    last += (t.size(d) - 1) * t.stride(d);
  }
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

bool has_self_overlap(const at::Tensor& t) {
  // Sufficient for no overlap: taken by increasing stride, each dimension steps past everything the dimensions
  // inside it cover. (Any layout a view of a contiguous tensor gives passes, e.g. the halves of a last dimension.)
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements covered by the dims so far, from the first to one past the last
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return true;
    extent += (size - 1) * stride;
  }
  return false;
}

// NOTE: PyTorch has no negative strides, so no element lies before data_ptr.
std::pair<int64_t, int64_t> byte_range(const at::Tensor& t) {
  int64_t last = 0;  // offset of the last element, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto begin = static_cast<int64_t>(address_of(t));
  return {begin, begin + (last + 1) * static_cast<int64_t>(t.element_size())};
}

Footprint footprint_of(const at::Tensor& t) {  // t is not empty
  const int64_t elem = t.element_size();
  Footprint f;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != 0) f.outer.push_back({t.stride(d) * elem, t.size(d)});
  }
  std::sort(f.outer.begin(), f.outer.end(), [](const auto& x, const auto& y) { return x.stride < y.stride; });
  f.begin = static_cast<int64_t>(address_of(t));
  f.run = elem;
  size_t inner = 0;  // dims that continue the run: their copies of it leave no gap
  for (; inner < f.outer.size() && f.outer[inner].stride <= f.run; ++inner) {
    f.run += (f.outer[inner].size - 1) * f.outer[inner].stride;
  }
  f.outer.erase(f.outer.begin(), f.outer.begin() + inner);
  return f;
}

namespace {

int64_t floor_div(int64_t x, int64_t y) {  // y > 0
  return x >= 0 ? x / y : -((-x + y - 1) / y);
}

// Runs of la bytes at a + i * s (i < na) and runs of lb bytes at b + j * s (j < nb) intersect iff some
// k = i - j in [-(nb - 1), na - 1] has b - a - la < k * s < b - a + lb. Checks the smallest k with k * s > b - a - la.
bool lattices_intersect(int64_t a, int64_t la, int64_t na, int64_t b, int64_t lb, int64_t nb, int64_t s) {
  const int64_t k = std::max(floor_div(b - a - la, s) + 1, -(nb - 1));
  return k <= na - 1 && k * s < b - a + lb;
}

// Every run of f as a [start, end) interval, sorted by start (runs may overlap when t's own elements do).
std::vector<std::pair<int64_t, int64_t>> runs_of(const Footprint& f) {
  int64_t count = 1;
  for (const auto& dim : f.outer) count *= dim.size;
  std::vector<std::pair<int64_t, int64_t>> runs;
  runs.reserve(count);
  c10::SmallVector<int64_t, 4> index(f.outer.size(), 0);
  int64_t start = f.begin;
  for (int64_t n = 0; n < count; ++n) {
    runs.emplace_back(start, start + f.run);
    for (size_t d = 0; d < f.outer.size(); ++d) {  // next index, first outer dim fastest
      if (++index[d] < f.outer[d].size) {
        start += f.outer[d].stride;
        break;
      }
      start -= (f.outer[d].size - 1) * f.outer[d].stride;
      index[d] = 0;
    }
  }
  std::sort(runs.begin(), runs.end());
  return runs;
}

bool same_lattice(const Footprint& a, const Footprint& b) {
  if (a.outer.empty() || a.outer.size() != b.outer.size()) return false;
  for (size_t d = 0; d < a.outer.size(); ++d) {
    if (a.outer[d].stride != b.outer[d].stride || a.outer[d].size != b.outer[d].size) return false;
  }
  return true;
}

bool nested(const Footprint& f) {
  for (size_t d = 0; d + 1 < f.outer.size(); ++d) {
    if (f.outer[d + 1].stride < f.outer[d].size * f.outer[d].stride) return false;
  }
  return true;
}

// For two footprints whose byte ranges intersect.
bool footprints_overlap(const Footprint& a, const Footprint& b) {
  if (a.outer.size() <= 1 && b.outer.size() <= 1) {
    if (a.outer.empty() && b.outer.empty()) return true;  // two single runs whose ranges intersect
    const int64_t s = a.outer.empty() ? b.outer[0].stride : a.outer[0].stride;
    if (b.outer.empty() || b.outer[0].stride == s) {  // one common stride: closed form
      return lattices_intersect(a.begin, a.run, a.outer.empty() ? 1 : a.outer[0].size, b.begin, b.run,
                                b.outer.empty() ? 1 : b.outer[0].size, s);
    }
  }
  // The same lattice of runs at two offsets (the K and V halves of vLLM's packed cache, whose rows step by
  // 2 * head_dim within a block): when each outer stride reaches past all the smaller ones' extents
  // (s[d+1] >= size[d] * s[d]), two run starts that differ at all differ by at least the smallest stride s0, so
  // when every difference that would make the runs intersect lies within (-s0, s0), only equal indices matter.
  if (same_lattice(a, b) && nested(a)) {
    const int64_t delta = b.begin - a.begin, s0 = a.outer[0].stride;
    if (delta - a.run >= -s0 && delta + b.run <= s0) return -b.run < delta && delta < a.run;
  }
  // Unusual layouts: sweep both lists of runs. A run is passed over only when it ends before the other list's
  // current run starts, and so before every later run of that list starts.
  const auto ra = runs_of(a), rb = runs_of(b);
  for (size_t i = 0, j = 0; i < ra.size() && j < rb.size();) {
    if (ra[i].second <= rb[j].first) {
      ++i;
    } else if (rb[j].second <= ra[i].first) {
      ++j;
    } else {
      return true;
    }
  }
  return false;
}

// [begin, end) of the bytes f covers.
std::pair<int64_t, int64_t> range_of(const Footprint& f) {
  int64_t end = f.begin + f.run;
  for (const auto& dim : f.outer) end += (dim.size - 1) * dim.stride;
  return {f.begin, end};
}

}  // namespace

Footprint block_spans_of(const at::Tensor& t) {
  Footprint f;
  f.begin = static_cast<int64_t>(address_of(t));
  f.run = block_span_bytes(t);
  const int64_t stride = t.stride(0) * static_cast<int64_t>(t.element_size());
  if (t.size(0) > 1 && stride != 0) {
    if (stride <= f.run) {
      f.run += (t.size(0) - 1) * stride;
    } else {
      f.outer.push_back({stride, t.size(0)});
    }
  }
  return f;
}

bool footprints_intersect(const Footprint& a, const Footprint& b) {
  const auto [a_begin, a_end] = range_of(a);
  const auto [b_begin, b_end] = range_of(b);
  if (a_end <= b_begin || b_end <= a_begin) return false;  // e.g. separate allocations: O(1)
  return footprints_overlap(a, b);
}

bool tensors_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  const auto [a_begin, a_end] = byte_range(a);
  const auto [b_begin, b_end] = byte_range(b);
  if (a_end <= b_begin || b_end <= a_begin) return false;  // e.g. separate allocations: O(1)
  return footprints_overlap(footprint_of(a), footprint_of(b));
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.device() == b.device() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
         a.strides() == b.strides();
}

}  // namespace paged_attn
