"""The fake (meta) kernels of the paged_attn ops, registered with ``torch.library.register_fake`` when this module
is imported (``paged_attn/ops.py`` imports it, so ``import paged_attn`` registers them).

torch.compile traces the ops with them, and an eager call with an argument on the meta device dispatches to them
(meta wins over CPU and CUDA). The ops only mutate their arguments and return nothing, so all a fake does is check:
the shape, dtype and device rules of csrc/common.cpp and csrc/attention_checks.cpp, and their memory-overlap rule,
with the same exception type (RuntimeError) and messages, so that bad input fails while tracing and on meta tensors as
it fails eagerly, and an index tensor on the meta device next to real caches is refused instead of ignored.

Memory overlap: a tensor an op writes shares no byte with any other argument (swap_blocks: no byte its dst blocks
span, as it copies whole spans), decided as the kernels decide it (paged_attn/overlap.py, the geometry of
csrc/overlap.cpp, exact: interleaved views that share no byte are fine) on each tensor's storage, offset, sizes and
strides in place of its address. Under torch.compile this must be checked while tracing: functionalization
(aot_eager, inductor) hands the kernel a copy of what it writes, so the kernel's own check no longer sees the
aliasing. What a fake cannot see:
- memory shared by two storages (torch.from_blob, DLPack, two tensors made over one buffer): different storages
  never overlap for a fake;
- a size, stride or storage offset that depends on data (an unbacked SymInt: the output of plan_shared_blocks): that
  tensor is left out of the check;
- symbolic sizes (dynamic shapes) are judged on their values in the inputs being traced (their hints), without a
  guard: a graph reused for other sizes is not checked again (functionalized, it then runs on a copy of what the op
  writes, as any overlap a fake misses does, and gives the result of tensors apart);
- addresses: where the kernel's message names one (swap_blocks), the fake names the storage offset; and when pairs
  in several storages overlap, which one the error names can differ (the kernels take the lowest address first).
Strides (the kernels' layout rules, a tensor overlapping itself), index ranges and scale values need the real
tensors; the kernels check those when they run (on CUDA index ranges and scale values only with validation on). The
one value a fake can know: a scale made as a constant while tracing (torch.tensor([0.0]) inside the traced code)
carries it, and is checked (_known_value).
The messages are held to the C++ ones by tests/ops/test_torch_library.py, which runs every error case of the op tests
through both, and the overlap rule in every mode by tests/ops/test_fake_aliasing.py (the tiled layout's by
tests/ops/test_tiled_cache.py). Cache layout: see paged_attn/ops.py. Tiled caches (paged_attn/tiled_cache.py): a
pair is checked by that file's rules (tiled_pair_problem), then the row-major checks run on its logical views.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _C  # noqa: F401  (defines the ops the fakes are registered for)
from . import overlap, tiled_cache


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, torch.SymInt)) and not isinstance(x, bool)


_INT64_MAX = 2**63 - 1  # torch's schema type int is int64: a larger Python int fails its argument parsing


def _check_max_query_len(max_query_len, query_start_loc) -> None:
    """The wrappers' check of max_query_len (paged_attention, mla_attention): None, or with query_start_loc an int64."""
    if max_query_len is None:
        return
    if query_start_loc is None:
        raise ValueError("max_query_len is given without query_start_loc")
    if not (_is_int(max_query_len) and 0 <= max_query_len <= _INT64_MAX):
        raise ValueError(f"max_query_len must be a non-negative integer (at most 2**63 - 1: the op takes an int64) "
                         f"or None, got {max_query_len!r}")


def _is_finite(x) -> bool:
    return abs(x) < math.inf  # False for inf and NaN; unlike math.isfinite, torch.compile traces it on dynamic floats


_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A shared-blocks plan (ops.plan_shared_blocks): [num_tasks, SHARED_PLAN_COLUMNS] int32, as csrc/cuda/launch_plan.h.
SHARED_ROWS = 8  # kSharedRows
SHARED_PLAN_COLUMNS = 3 + SHARED_ROWS  # kSharedPlanColumns: ref, first_block, end_block, rows...
MAX_SHARED_TASKS = 1 << 20  # kMaxSharedTasks
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
                torch.int64: "Long", torch.int32: "Int", torch.float8_e4m3fn: "Float8_e4m3fn",
                torch.float8_e5m2: "Float8_e5m2"}  # as c10 prints them


def _require(condition, *message) -> None:
    if not condition:
        raise RuntimeError("".join(_DTYPE_NAMES.get(m, str(m)) if isinstance(m, torch.dtype) else str(m)
                                   for m in message))


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def _check_cache(cache, name) -> None:
    _require(cache.dim() == 4, name, " must have shape [num_blocks, block_size, num_kv_heads, head_dim]",
             " (a tiled cache, from pack_cache, is read by the CPU ops only, with both caches tiled)"
             if tiled_cache.is_tiled(cache) else "", ", got ", _shape(cache))
    _require(cache.dtype in _KV_DTYPES + _FP8_DTYPES, name,
             " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", cache.dtype)
    _require(all(n > 0 for n in cache.shape[1:]), name,
             ": block_size, num_kv_heads and head_dim must be positive, got shape ", _shape(cache))


def _check_same_layout(a, a_name, b, b_name) -> None:
    _require(a.device == b.device, a_name, " and ", b_name, " must be on the same device, got ", a.device, " and ",
             b.device)
    _require(a.dtype == b.dtype, a_name, " and ", b_name, " must have the same dtype, got ", a.dtype, " and ", b.dtype)
    _require(a.shape == b.shape, a_name, " and ", b_name, " must have the same shape, got ", _shape(a), " and ",
             _shape(b))


def _caches_for_checks(key_cache, value_cache) -> tuple:
    """csrc/common.cpp's caches_for_checks: a pair as it is, or, where either is tiled (paged_attn/tiled_cache.py),
    both checked as a tiled pair and replaced by their 4-dim logical views (the same bytes), on which the row-major
    checks then run unchanged. The CUDA kernels take no tiled caches and skip this door (dispatch goes to CUDA when
    any argument is there): their check_cache refuses a tiled cache, and so does the fake's."""
    if not (tiled_cache.is_tiled(key_cache) or tiled_cache.is_tiled(value_cache)):
        return key_cache, value_cache
    if key_cache.device.type == "cuda" or value_cache.device.type == "cuda":
        return key_cache, value_cache
    problem = tiled_cache.tiled_pair_problem(key_cache, value_cache)
    _require(problem is None, *(problem or ()))
    return tiled_cache.logical_view(key_cache), tiled_cache.logical_view(value_cache)


def _check_cache_pair(key_cache, value_cache) -> None:
    _check_cache(key_cache, "key_cache")
    _check_cache(value_cache, "value_cache")
    _check_same_layout(key_cache, "key_cache", value_cache, "value_cache")


def _check_index_tensor(t, name, dtype, dim, device) -> None:
    _require(t.dtype == dtype, name, " must be ", dtype, ", got ", t.dtype)
    _require(t.dim() == dim, name, " must have ", dim, " dimension(s), got shape ", _shape(t))
    _require(t.device == device, name, " must be on ", device, ", got ", t.device)


def _check_block_mapping_shape(block_mapping, device) -> None:
    _check_index_tensor(block_mapping, "block_mapping", torch.int64, 2, device)
    _require(block_mapping.shape[1] == 2, "block_mapping must have shape [num_pairs, 2] of (src_block, dst_block), got ",
             _shape(block_mapping))


def _check_dtype_for_cache(t, name, cache, cache_name="key_cache") -> None:
    """t (key, query, kv_c) with the cache's dtype (any of float32, float16, bfloat16 for fp8 caches)."""
    if cache.dtype in _FP8_DTYPES:
        _require(t.dtype in _KV_DTYPES, name, " must be float32, float16 or bfloat16 with an fp8 cache (",
                 cache.dtype, "), got ", t.dtype)
        return
    _require(t.dtype == cache.dtype, name, " and ", cache_name, " must have the same dtype, got ", t.dtype, " and ",
             cache.dtype)


def _check_like_cache(t, name, key_cache) -> None:
    """t (key or query) on key_cache's device, with its dtype (_check_dtype_for_cache)."""
    _require(t.device == key_cache.device, name, " and key_cache must be on the same device, got ", t.device, " and ",
             key_cache.device)
    _check_dtype_for_cache(t, name, key_cache)


def _check_scale(cache, scale, name) -> None:
    """An fp8 cache's scale (None: 1.0): float32, one element, on the cache's device; an error for other caches."""
    if scale is None:
        return
    _require(cache.dtype in _FP8_DTYPES, name, " is given but the cache is ", cache.dtype,
             ": scales apply only to fp8 caches (float8_e4m3fn, float8_e5m2)")
    _require(scale.dtype == torch.float32 and scale.numel() == 1, name,
             " must be a float32 tensor of one element, got ", scale.dtype, " of shape ", _shape(scale))
    _require(scale.device == cache.device, name, " must be on the cache's device ", cache.device, ", got ",
             scale.device)


def _check_kv_scales(key_cache, k_scale, v_scale) -> None:
    _check_scale(key_cache, k_scale, "k_scale")
    _check_scale(key_cache, v_scale, "v_scale")
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):  # values last, as the kernels check them
        value = None if scale is None else _known_value(scale)
        if value is not None:
            _require(_is_finite(value) and value != 0, name, " must be finite and nonzero, got ", f"{value:g}",
                     ": an fp8 cache stores x as the fp8 value nearest to x / ", name, " and reads it back times ",
                     name, " (0 would store NaN and +-max, inf zeros that read back NaN)")


def _known_value(t: torch.Tensor) -> Optional[float]:
    """The value of a one-element tensor, where a fake kernel can know it: a fake tensor made from a constant while
    tracing carries it (FakeTensor.constant); any other fake (an input, or computed) has none, and neither does a
    meta tensor."""
    constant = getattr(t, "constant", None)
    if constant is None:
        return None
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # constant is a real tensor
        return float(constant.reshape(()).item())


class _Placed(NamedTuple):
    """Where a tensor's elements lie: its storage, and its layout there in bytes (paged_attn/overlap.py)."""

    storage: StorageWeakRef
    begin: int  # storage_offset * elem: where the C++ has the data pointer
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    elem: int

    def footprint(self) -> overlap.Footprint:
        return overlap.footprint(self.begin, self.sizes, self.strides, self.elem)

    def block_spans(self) -> overlap.Footprint:
        return overlap.block_spans(self.begin, self.sizes, self.strides, self.elem)

    def block_span_bytes(self) -> int:
        return overlap.span_bytes(self.sizes[1:], self.strides[1:], self.elem)

    def layout(self) -> str:
        """As the C++ layout_of, with the offset in the storage in place of the address a fake tensor lacks."""
        return (f"shape {list(self.sizes)} with strides {[s // self.elem for s in self.strides]} at storage offset "
                f"{self.begin // self.elem}")


def _known_int(x) -> Optional[int]:
    """x as an int without adding a guard: a symbolic size, stride or offset as its value in the inputs being traced
    (its hint), None where it has none (it depends on data: an unbacked SymInt)."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    value = x.node.maybe_as_int()
    if value is None and x.node.has_hint():
        value = x.node.hint
    return int(value) if isinstance(value, int) else None


def _placed(t: Optional[torch.Tensor]) -> Optional[_Placed]:
    """Where t's elements lie, or None where the fake cannot tell (no tensor, a size, stride or offset that depends
    on data, no storage)."""
    if t is None:
        return None
    values = [_known_int(x) for x in (t.storage_offset(), *t.shape, *t.stride())]
    if any(value is None for value in values):
        return None
    try:
        storage = StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
        return None
    elem, ndim = t.element_size(), t.dim()
    return _Placed(storage, values[0] * elem, tuple(values[1:1 + ndim]), tuple(s * elem for s in values[1 + ndim:]),
                   elem)


def _check_no_overlap(*tensors) -> None:
    """csrc/common.cpp's check_no_overlap: no tensor an op writes shares a byte with any other argument (views of one
    storage that interleave without a common byte are fine); the ones it only reads may share memory. tensors:
    (tensor or None, name, written) in argument order; the error names the first overlapping pair by offset, then
    argument order, as the C++ does by address."""
    entries = []
    for index, (t, _, _) in enumerate(tensors):
        placed = _placed(t)
        if placed is not None and 0 not in placed.sizes:
            entries.append((placed.begin, index, placed, placed.footprint()))
    entries.sort(key=lambda entry: entry[0])  # stable: ties stay in argument order
    for i, (_, index_i, a, footprint_a) in enumerate(entries):
        for _, index_j, b, footprint_b in entries[i + 1:]:
            first, second = sorted((index_i, index_j))
            if a.storage != b.storage or not (tensors[first][2] or tensors[second][2]):
                continue
            _require(not overlap.intersect(footprint_a, footprint_b), tensors[first][1], " and ", tensors[second][1],
                     " must not overlap in memory, but they share at least one element")


def _check_swap_spans(src, dst, block_mapping) -> None:
    """check_swap_blocks_args' overlap checks: dst's blocks are written as the whole runs of bytes they span, so
    those must miss src's block spans (unless src and dst are one cache: the same memory) and block_mapping."""
    d = _placed(dst)
    if d is None or d.sizes[0] == 0:
        return  # nothing is written
    s = _placed(src)
    if s is not None and s.sizes[0] != 0 and s.storage == d.storage and (s.begin, s.sizes, s.strides) != (
            d.begin, d.sizes, d.strides):
        _require(not overlap.intersect(s.block_spans(), d.block_spans()),
                 "src and dst must not overlap in memory: swap_blocks copies each block as the ", s.block_span_bytes(),
                 " bytes it spans (from its first element to the end of its last, the bytes between its rows "
                 "included), and some block of src and some block of dst span a common byte; got src ", s.layout(),
                 " and dst ", d.layout(), " (", s.elem, "-byte elements)")
    m = _placed(block_mapping)
    if m is not None and 0 not in m.sizes and m.storage == d.storage:
        _require(not overlap.intersect(m.footprint(), d.block_spans()),
                 "dst and block_mapping must not overlap in memory: block_mapping lies within the bytes dst's blocks "
                 "span (each block is copied as the ", d.block_span_bytes(), " bytes it spans)")


@torch.library.register_fake("paged_attn::reshape_and_cache")
def _(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    key_cache, value_cache = _caches_for_checks(key_cache, value_cache)  # tiled: as 4 dims
    _check_cache_pair(key_cache, value_cache)
    _require(key.dim() == 3, "key must have shape [num_tokens, num_kv_heads, head_dim], got ", _shape(key))
    _check_same_layout(key, "key", value, "value")
    _check_like_cache(key, "key", key_cache)
    _require(key.shape[1:] == key_cache.shape[2:], "key is [num_tokens, num_kv_heads, head_dim] = ", _shape(key),
             " but the cache holds [num_kv_heads, head_dim] = ", _shape(key_cache)[2:])
    _check_index_tensor(slot_mapping, "slot_mapping", torch.int64, 1, key_cache.device)
    _require(slot_mapping.shape[0] == key.shape[0], "slot_mapping must have num_tokens = ", key.shape[0],
             " entries, got ", slot_mapping.shape[0])
    _check_kv_scales(key_cache, k_scale, v_scale)
    _check_no_overlap((key, "key", False), (value, "value", False), (key_cache, "key_cache", True),
                      (value_cache, "value_cache", True), (slot_mapping, "slot_mapping", False),
                      (k_scale, "k_scale", False), (v_scale, "v_scale", False))


@torch.library.register_fake("paged_attn::copy_blocks")
def _(key_caches, value_caches, block_mapping) -> None:
    # Each layer's tiled pair as its 4-dim views (a block is one contiguous run in both layouts, and copy_blocks
    # moves whole blocks), before any other check, as the C++ does.
    key_caches, value_caches = list(key_caches), list(value_caches)
    for layer in range(min(len(key_caches), len(value_caches))):
        key_caches[layer], value_caches[layer] = _caches_for_checks(key_caches[layer], value_caches[layer])
    _require(len(key_caches) == len(value_caches) or not value_caches, "key_caches and value_caches must have the "
             "same number of layers (or value_caches none: one cache per layer, as MLA's latent caches), got ",
             len(key_caches), " and ", len(value_caches))
    if not key_caches:
        return
    first = key_caches[0]
    written = []  # the caches in argument order: key_caches[0], value_caches[0], key_caches[1], ...
    for layer, key_cache in enumerate(key_caches):
        caches = [(key_cache, f"key_caches[{layer}]")]
        if value_caches:
            caches.append((value_caches[layer], f"value_caches[{layer}]"))
        for cache, name in caches:
            if not value_caches and cache.dim() == 3:
                _check_latent_cache(cache, name)
            else:
                _check_cache(cache, name)
            _check_same_layout(first, "key_caches[0]", cache, name)
            written.append((cache, name, True))
    _require(block_mapping.device.type == "cpu" or block_mapping.device == first.device,
             "block_mapping must be on the CPU or on the caches' device ", first.device, ", got ", block_mapping.device)
    _check_block_mapping_shape(block_mapping, block_mapping.device)
    _check_no_overlap(*written, (block_mapping, "block_mapping", False))  # any two caches of any layers, the mapping


@torch.library.register_fake("paged_attn::swap_blocks")
def _(src, dst, block_mapping) -> None:
    _require(src.dim() >= 1 and dst.dim() >= 1, "src and dst must be caches with a leading block dimension")
    _require(src.dtype == dst.dtype, "src and dst must have the same dtype, got ", src.dtype, " and ", dst.dtype)
    _require(src.shape[1:] == dst.shape[1:], "src and dst must have the same per-block shape, got ", _shape(src),
             " and ", _shape(dst))
    _require(all(n > 0 for n in src.shape[1:]), "src and dst must have positive sizes after the block dimension, got ",
             _shape(src))
    for t in (src, dst):
        _require(t.device.type in ("cpu", "cuda"), "swap_blocks supports CPU and CUDA tensors, got ", t.device)
    _check_block_mapping_shape(block_mapping, torch.device("cpu"))
    _check_swap_spans(src, dst, block_mapping)


@torch.library.register_fake("paged_attn::paged_attention")
def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, sliding_window,
      logits_soft_cap, query_start_loc=None, max_query_len=None, *, k_scale=None, v_scale=None, lse=None,
      sinks=None, shared_plan=None) -> None:
    key_cache, value_cache = _caches_for_checks(key_cache, value_cache)  # tiled: as 4 dims
    _check_cache(key_cache, "key_cache")
    _check_cache(value_cache, "value_cache")
    _require(value_cache.device == key_cache.device and value_cache.dtype == key_cache.dtype
             and value_cache.shape[:3] == key_cache.shape[:3],
             "key_cache and value_cache must have the same dtype, device and [num_blocks, block_size, num_kv_heads] ",
             "(head_dim may differ), got ", key_cache.dtype, " ", _shape(key_cache), " on ", key_cache.device,
             " and ", value_cache.dtype, " ", _shape(value_cache), " on ", value_cache.device)
    _require(query.dim() == 3, "query must have shape [num_tokens, num_heads, head_dim], got ", _shape(query))
    _check_like_cache(query, "query", key_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = num_tokens
    if query_start_loc is not None:
        _check_index_tensor(query_start_loc, "query_start_loc", torch.int32, 1, query.device)
        _require(query_start_loc.shape[0] >= 1, "query_start_loc must have num_seqs + 1 entries (at least 1), got 0")
        num_seqs = query_start_loc.shape[0] - 1
        _require(max_query_len is None or max_query_len >= 0, "max_query_len must be >= 0, got ", max_query_len)
    else:
        _require(max_query_len is None, "max_query_len is given without query_start_loc")
    _require(num_heads > 0 and head_dim > 0, "query must have positive num_heads and head_dim, got shape ",
             _shape(query))
    _require(key_cache.shape[3] == head_dim, "query has head_dim ", head_dim, " but the cache has head_dim ",
             key_cache.shape[3])
    _require(num_heads % num_kv_heads == 0, "num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
             num_kv_heads, ")")
    out_shape = [num_tokens, num_heads, value_cache.shape[3]]  # head_dim_v
    _require(_shape(out) == out_shape and out.dtype == query.dtype and out.device == query.device,
             "out must be a ", query.dtype, " tensor of shape ", out_shape, " on ", query.device, ", got ",
             out.dtype, " ", _shape(out), " on ", out.device)
    _require(out.is_contiguous(), "out must be contiguous")
    seqs_from = " (query_start_loc has num_seqs + 1 entries)" if query_start_loc is not None else " (query rows)"
    _check_index_tensor(block_tables, "block_tables", torch.int32, 2, query.device)
    _require(block_tables.shape[0] == num_seqs, "block_tables must have num_seqs = ", num_seqs, seqs_from,
             " rows, got ", block_tables.shape[0])
    _check_index_tensor(seq_lens, "seq_lens", torch.int32, 1, query.device)
    _require(seq_lens.shape[0] == num_seqs, "seq_lens must have num_seqs = ", num_seqs, seqs_from, " entries, got ",
             seq_lens.shape[0])
    if alibi_slopes is not None:
        _check_index_tensor(alibi_slopes, "alibi_slopes", torch.float32, 1, query.device)
        _require(alibi_slopes.shape[0] == num_heads, "alibi_slopes must have num_heads = ", num_heads,
                 " entries, got ", alibi_slopes.shape[0])
    _require(sliding_window >= 0, "sliding_window must be positive (or 0 for none), got ", sliding_window)
    _require(_is_finite(scale), "scale must be finite, got ", scale)
    _require(_is_finite(logits_soft_cap) and logits_soft_cap >= 0,
             "logits_soft_cap must be positive and finite (or 0 for none), got ", logits_soft_cap)
    _check_kv_scales(key_cache, k_scale, v_scale)
    if lse is not None:
        _require(lse.dtype == torch.float32 and lse.dim() == 2 and lse.shape[0] == num_tokens
                 and lse.shape[1] == num_heads and lse.device == query.device,
                 "lse must be a float32 tensor of shape [num_tokens, num_heads] = [", num_tokens, ", ", num_heads,
                 "] on ", query.device, ", got ", lse.dtype, " ", _shape(lse), " on ", lse.device)
        _require(lse.is_contiguous(), "lse must be contiguous")
    if shared_plan is not None:
        _check_index_tensor(shared_plan, "shared_plan", torch.int32, 2, query.device)
        _require(shared_plan.shape[1] == SHARED_PLAN_COLUMNS and shared_plan.is_contiguous()
                 and shared_plan.shape[0] <= MAX_SHARED_TASKS,
                 "shared_plan must be a contiguous int32 tensor of shape [num_tasks, ", SHARED_PLAN_COLUMNS,
                 "] with num_tasks <= ", MAX_SHARED_TASKS, " (paged_attn.plan_shared_blocks), got ",
                 _shape(shared_plan), " with strides ", tuple(shared_plan.stride()))
    if sinks is not None:
        _require(sinks.dtype in (torch.float32, torch.float16, torch.bfloat16),
                 "sinks must be float32, float16 or bfloat16 (one logit per query head), got ", sinks.dtype)
        _require(sinks.dim() == 1 and sinks.shape[0] == num_heads, "sinks must have shape [num_heads] = [",
                 num_heads, "], got ", _shape(sinks))
        _require(sinks.device == query.device, "sinks must be on the query's device ", query.device, ", got ",
                 sinks.device)
    _check_no_overlap((out, "out", True), (lse, "lse", True), (query, "query", False), (key_cache, "key_cache", False),
                      (value_cache, "value_cache", False), (block_tables, "block_tables", False),
                      (sinks, "sinks", False), (shared_plan, "shared_plan", False), (seq_lens, "seq_lens", False),
                      (alibi_slopes, "alibi_slopes", False), (query_start_loc, "query_start_loc", False),
                      (k_scale, "k_scale", False), (v_scale, "v_scale", False))


@torch.library.register_fake("paged_attn::merge_attention_states")
def _(out, lse, out_a, lse_a, out_b, lse_b) -> None:
    _require(out_a.dim() == 3, "out_a must have shape [num_tokens, num_heads, head_dim], got ", _shape(out_a))
    _require(out_a.dtype in _KV_DTYPES, "out_a must be float32, float16 or bfloat16, got ", out_a.dtype)
    _check_same_layout(out_a, "out_a", out_b, "out_b")
    _check_same_layout(out_a, "out_a", out, "out")
    lse_shape = _shape(out_a)[:2]
    for t, name in ((lse_a, "lse_a"), (lse_b, "lse_b"), (lse, "lse")):
        _require(t.dtype == torch.float32, name, " must be float32, got ", t.dtype)
        _require(_shape(t) == lse_shape, name, " must have shape [num_tokens, num_heads] = ", lse_shape, ", got ",
                 _shape(t))
        _require(t.device == out_a.device, name, " and out_a must be on the same device, got ", t.device, " and ",
                 out_a.device)
    _check_no_overlap((out, "out", True), (lse, "lse", True), (out_a, "out_a", False), (lse_a, "lse_a", False),
                      (out_b, "out_b", False), (lse_b, "lse_b", False))


@torch.library.register_fake("paged_attn::plan_shared_blocks")
def _(block_tables, seq_lens, block_size, num_queries_per_kv, min_shared_tokens) -> torch.Tensor:
    cpu = torch.device("cpu")
    _check_index_tensor(block_tables, "block_tables", torch.int32, 2, cpu)
    _check_index_tensor(seq_lens, "seq_lens", torch.int32, 1, cpu)
    _require(seq_lens.shape[0] == block_tables.shape[0], "seq_lens must have num_seqs = ", block_tables.shape[0],
             " entries (block_tables' rows), got ", seq_lens.shape[0])
    _require(block_size >= 1 and num_queries_per_kv >= 1 and min_shared_tokens >= 1,
             "block_size, num_queries_per_kv and min_shared_tokens must be positive, got ", block_size, ", ",
             num_queries_per_kv, " and ", min_shared_tokens)
    num_tasks = torch.library.get_ctx().new_dynamic_size(max=MAX_SHARED_TASKS)  # found from the tables' values
    return block_tables.new_empty((num_tasks, SHARED_PLAN_COLUMNS))


_LINEAR_BLOCK = 64  # outputs per column block of a CPU-packed weight (csrc/cpu/linear.cpp)


def _linear_dtypes(device) -> tuple:
    return (torch.float32, torch.bfloat16) + ((torch.float16,) if device.type == "cuda" else ())


@torch.library.register_fake("paged_attn::pack_linear_weight")
def _(weight) -> torch.Tensor:
    _require(weight.dim() == 2, "pack_linear_weight: expected a 2-D weight [out_features, in_features], got shape ",
             _shape(weight))
    _require(weight.dtype in _linear_dtypes(weight.device), "pack_linear_weight: expected a float32 or bfloat16 "
             "weight, got ", weight.dtype)
    if weight.device.type == "cuda":  # cuBLAS takes the weight as it is
        return weight.new_empty(weight.shape)
    kps = 2 if weight.dtype == torch.bfloat16 else 1
    n, k = weight.shape
    return weight.new_empty(((n + _LINEAR_BLOCK - 1) // _LINEAR_BLOCK, (k + kps - 1) // kps, _LINEAR_BLOCK, kps))


@torch.library.register_fake("paged_attn::linear")
def _(x, packed_weight, out_features) -> torch.Tensor:
    _require(x.dim() == 2, "linear: expected x of shape [num_rows, in_features], got ", _shape(x))
    _require(x.dtype == packed_weight.dtype and x.dtype in _linear_dtypes(x.device), "linear: expected x and "
             "packed_weight of one dtype, float32 or bfloat16, got ", x.dtype, " and ", packed_weight.dtype)
    if x.device.type != "cuda":
        kps = 2 if x.dtype == torch.bfloat16 else 1
        _require(packed_weight.dim() == 4 and packed_weight.shape[1:] == ((x.shape[1] + kps - 1) // kps,
                 _LINEAR_BLOCK, kps), "linear: packed_weight must be pack_linear_weight's output for ", x.shape[1],
                 " input features, got shape ", _shape(packed_weight))
        blocks = packed_weight.shape[0]
        _require((blocks - 1) * _LINEAR_BLOCK < out_features <= blocks * _LINEAR_BLOCK, "linear: out_features ",
                 out_features, " does not match packed_weight's ", blocks, " blocks of 64 outputs")
    else:
        _require(tuple(packed_weight.shape) == (out_features, x.shape[1]), "linear: on CUDA packed_weight must be "
                 "pack_linear_weight's output [", out_features, ", ", x.shape[1], "], got shape ",
                 _shape(packed_weight))
    return x.new_empty((x.shape[0], out_features))


def _check_elementwise_rows(x, op, name) -> None:
    _require(x.dim() == 2, op, ": expected ", name, " of shape [num_rows, width], got ", _shape(x))
    _require(x.dtype in (torch.float32, torch.bfloat16, torch.float16), op, ": expected ", name,
             " of dtype float32, bfloat16 or float16, got ", x.dtype)
    if x.device.type != "cuda":
        _require(x.shape[1] == 0 or x.stride(1) == 1, op, ": ", name, "'s rows must be contiguous, got strides ",
                 list(x.stride()))


def _check_norm_args(x, weight, op) -> None:
    _check_elementwise_rows(x, op, "x")
    ok = weight.device == x.device and weight.dim() == 1 and weight.shape[0] == x.shape[1] and weight.dtype == x.dtype
    if x.device.type != "cuda":
        _require(ok and weight.is_contiguous(), op, ": expected a contiguous CPU weight [", x.shape[1], "] of x's "
                 "dtype ", x.dtype, ", got shape ", _shape(weight), ", dtype ", weight.dtype, " on ", weight.device)
    else:
        _require(ok, op, ": expected a weight [", x.shape[1], "] of x's dtype ", x.dtype, " on ", x.device,
                 ", got shape ", _shape(weight), ", dtype ", weight.dtype, " on ", weight.device)
    _require(x.shape[1] > 0, op, ": expected rows of at least one element, got x of shape ", _shape(x))


@torch.library.register_fake("paged_attn::rms_norm")
def _(x, weight, eps) -> torch.Tensor:
    _check_norm_args(x, weight, "rms_norm")
    return x.new_empty(x.shape)


@torch.library.register_fake("paged_attn::add_rms_norm")
def _(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    _check_norm_args(x, weight, "add_rms_norm")
    _check_elementwise_rows(residual, "add_rms_norm", "residual")
    _require(residual.shape == x.shape and residual.dtype == x.dtype, "add_rms_norm: expected residual of x's shape ",
             _shape(x), " and dtype ", x.dtype, ", got ", _shape(residual), " and ", residual.dtype)
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake("paged_attn::silu_and_mul")
def _(gate_up) -> torch.Tensor:
    _check_elementwise_rows(gate_up, "silu_and_mul", "gate_up")
    _require(gate_up.shape[1] % 2 == 0, "silu_and_mul: expected gate_up [num_rows, 2 * width], got an odd width ",
             gate_up.shape[1])
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _check_latent_cache(kv_cache, name="kv_cache") -> None:
    _require(kv_cache.dim() == 3, name, " must have shape [num_blocks, block_size, kv_lora_rank + rope_dim], got ",
             _shape(kv_cache))
    _require(kv_cache.dtype in _KV_DTYPES + _FP8_DTYPES, name,
             " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", kv_cache.dtype)
    _require(kv_cache.shape[1] > 0 and kv_cache.shape[2] > 0, name,
             ": block_size and kv_lora_rank + rope_dim must be positive, got shape ", _shape(kv_cache))


@torch.library.register_fake("paged_attn::concat_and_cache_mla")
def _(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None) -> None:
    _check_latent_cache(kv_cache)
    _require(kv_c.dim() == 2 and k_pe.dim() == 2 and k_pe.shape[0] == kv_c.shape[0],
             "kv_c and k_pe must have shapes [num_tokens, kv_lora_rank] and [num_tokens, rope_dim], got ",
             _shape(kv_c), " and ", _shape(k_pe))
    _require(kv_c.shape[1] + k_pe.shape[1] == kv_cache.shape[2], "kv_c and k_pe hold ", kv_c.shape[1], " + ",
             k_pe.shape[1], " values per token but a row of kv_cache holds kv_lora_rank + rope_dim = ",
             kv_cache.shape[2])
    _require(kv_c.dtype == k_pe.dtype and kv_c.device == k_pe.device,
             "kv_c and k_pe must have the same dtype and device, got ", kv_c.dtype, " on ", kv_c.device, " and ",
             k_pe.dtype, " on ", k_pe.device)
    _require(kv_c.device == kv_cache.device, "kv_c and kv_cache must be on the same device, got ", kv_c.device,
             " and ", kv_cache.device)
    _check_dtype_for_cache(kv_c, "kv_c", kv_cache, "kv_cache")
    _check_index_tensor(slot_mapping, "slot_mapping", torch.int64, 1, kv_cache.device)
    _require(slot_mapping.shape[0] == kv_c.shape[0], "slot_mapping must have num_tokens = ", kv_c.shape[0],
             " entries, got ", slot_mapping.shape[0])
    _check_scale(kv_cache, scale, "scale")
    _check_no_overlap((kv_c, "kv_c", False), (k_pe, "k_pe", False), (kv_cache, "kv_cache", True),
                      (slot_mapping, "slot_mapping", False), (scale, "scale", False))


@torch.library.register_fake("paged_attn::mla_attention")
def _(out, query, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc=None, max_query_len=None,
      *, k_scale=None, lse=None) -> None:
    _check_latent_cache(kv_cache)
    row = kv_cache.shape[2]
    _require(query.dim() == 3 and query.shape[2] == row,
             "query must have shape [num_tokens, num_heads, kv_lora_rank + rope_dim] with the cache's row of ", row,
             ", got ", _shape(query))
    _require(query.device == kv_cache.device, "query and kv_cache must be on the same device, got ", query.device,
             " and ", kv_cache.device)
    _check_dtype_for_cache(query, "query", kv_cache, "kv_cache")
    _require(1 <= kv_lora_rank <= row, "kv_lora_rank must be in [1, ", row,
             "] (the cache's row: kv_lora_rank + rope_dim), got ", kv_lora_rank)
    expected = [query.shape[0], query.shape[1], kv_lora_rank]
    _require(_shape(out) == expected and out.dtype == query.dtype and out.device == query.device,
             "out must be a ", query.dtype, " tensor of shape [num_tokens, num_heads, kv_lora_rank] = ", expected,
             " on ", query.device, ", got ", out.dtype, " ", _shape(out), " on ", out.device)
    _require(out.is_contiguous(), "out must be contiguous")
    _check_scale(kv_cache, k_scale, "k_scale")
    _check_no_overlap((out, "out", True), (lse, "lse", True), (query, "query", False), (kv_cache, "kv_cache", False),
                      (block_tables, "block_tables", False), (seq_lens, "seq_lens", False),
                      (query_start_loc, "query_start_loc", False), (k_scale, "k_scale", False))
    # Then the kernel's own: paged attention over the cache as one kv head (csrc/cpu/attention.cpp).
    cache = kv_cache.unsqueeze(2)
    _paged_attention(query.new_empty(query.shape), query, cache, cache, block_tables, seq_lens, scale, None, 0, 0.0,
                     query_start_loc, max_query_len, k_scale=k_scale, v_scale=k_scale, lse=lse)
