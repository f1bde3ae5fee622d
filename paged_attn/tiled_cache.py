"""The tiled cache layout (issue 50): a second CPU KV-cache layout, laid out for the dot-product units (AVX-512
``vdpbf16ps``, AMX), which take bfloat16 in pairs. This docstring is its one full description; ``paged_attn/ops.py``
("The cache layout") describes the row-major layout and points here.

- Dtypes: bfloat16, float8_e4m3fn or float8_e5m2 (the same for both caches); ``block_size`` a multiple of 16
  (``TILE_TOKENS``), ``head_dim`` a multiple of 32; ``num_kv_heads``, ``block_size`` and ``head_dim`` positive,
  ``num_blocks`` may be 0. Keys and values have one ``head_dim``.
- Key cache: ``[num_blocks, num_kv_heads, block_size // 16, head_dim // 2, 16, 2]``. The element of block ``b``,
  token offset ``o``, kv head ``g``, dim ``d`` is at ``[b, g, o // 16, d // 2, o % 16, d % 2]``: per 16 tokens, each
  64-byte row (of bfloat16) holds one pair of dims for those 16 tokens, the operand of one ``vdpbf16ps`` against a
  query's pair of dims broadcast.
- Value cache: ``[num_blocks, num_kv_heads, block_size // 2, head_dim, 2]``. The element ``(b, o, g, d)`` is at
  ``[b, g, o // 2, d, o % 2]``: token pairs interleaved element by element, so that two tokens' weights multiply a
  row of dims in one instruction.
- Strides: each block is contiguous (dimensions 1.. have exactly the strides of a contiguous tensor, as
  :func:`pack_cache` makes them); the block stride may be larger than a block (at least a block's number of elements
  when there are two blocks or more), e.g. blocks carved from a larger allocation.
- Slots, block tables and fp8 scales are exactly as in the row-major layout: a slot is ``block * block_size +
  offset``.
- The rank tells the layouts apart (6 for a tiled key cache, 5 for a tiled value cache, 4 row-major): an op never
  reads a tiled cache as row-major or the reverse, and a pair of one tiled and one row-major cache is an error.
  The CPU ops ``reshape_and_cache``, ``copy_blocks``, ``swap_blocks`` and ``paged_attention`` take a tiled pair;
  CUDA ops refuse one, and the MLA ops (``concat_and_cache_mla``, ``mla_attention``) do not take one.
- Logical view: the checks of the ops (C++ and fakes) see a tiled cache as the 4-dim ``[num_blocks, block_size,
  num_kv_heads, head_dim]`` view with the tiled cache's block stride and contiguous rows (:func:`logical_view`): the
  same data pointer and exactly the same bytes, since a block is contiguous either way, so the row-major rules
  (shapes, dtypes, memory overlap) apply to it unchanged. Its elements are not the cache's: only the kernels know
  the real layout.

:func:`pack_cache` and :func:`unpack_cache` convert between the layouts (a bit-exact permutation).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

TILE_TOKENS = 16  # tokens per key tile: one 64-byte row of bfloat16 holds one pair of dims for 16 tokens
TILED_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
HEAD_DIM_MULTIPLE = 32  # a 64-byte vector of bfloat16: the kernels take the dims a whole vector at a time
KEY_SHAPE = "[num_blocks, num_kv_heads, block_size / 16, head_dim / 2, 16, 2]"
VALUE_SHAPE = "[num_blocks, num_kv_heads, block_size / 2, head_dim, 2]"
ROW_MAJOR_SHAPE = "[num_blocks, block_size, num_kv_heads, head_dim]"


def tiled_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a tiled key cache and value cache: ``([num_blocks, num_kv_heads, block_size // 16,
    head_dim // 2, 16, 2], [num_blocks, num_kv_heads, block_size // 2, head_dim, 2])``.

    Example::

        key_shape, value_shape = paged_attn.tiled_cache_shapes(num_blocks, 16, num_kv_heads, 128)
        key_cache = torch.empty(key_shape, dtype=torch.bfloat16)
        value_cache = torch.empty(value_shape, dtype=torch.bfloat16)
    """
    sizes = (num_blocks, block_size, num_kv_heads, head_dim)
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in sizes):
        raise ValueError(f"tiled_cache_shapes takes integer sizes, got {sizes}")
    num_blocks, block_size, num_kv_heads, head_dim = map(int, sizes)  # numpy's integers as Python's
    if num_blocks < 0 or min(block_size, num_kv_heads, head_dim) <= 0:
        raise ValueError(f"a tiled cache needs num_blocks >= 0 and positive block_size, num_kv_heads and head_dim, "
                         f"got {sizes}")
    if block_size % TILE_TOKENS != 0:
        raise ValueError(f"a tiled cache needs a block_size that is a multiple of {TILE_TOKENS}, got {block_size}")
    if head_dim % HEAD_DIM_MULTIPLE != 0:
        raise ValueError(f"a tiled cache needs a head_dim that is a multiple of {HEAD_DIM_MULTIPLE}, got {head_dim}")
    key_shape = (num_blocks, num_kv_heads, block_size // TILE_TOKENS, head_dim // 2, TILE_TOKENS, 2)
    value_shape = (num_blocks, num_kv_heads, block_size // 2, head_dim, 2)
    return key_shape, value_shape


def is_tiled(cache: torch.Tensor) -> bool:
    """Whether a cache is in the tiled layout: the rank says it (6: a tiled key cache, 5: a tiled value cache)."""
    return cache.dim() in (5, 6)


def logical_shape(cache: torch.Tensor) -> tuple:
    """The row-major shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` a tiled cache stands for, from its
    sizes alone (they are not checked: ops.paged_attention sizes its output with it before the op's checks)."""
    if cache.dim() == 6:
        return (cache.shape[0], cache.shape[2] * TILE_TOKENS, cache.shape[1], cache.shape[3] * 2)
    if cache.dim() == 5:
        return (cache.shape[0], cache.shape[2] * 2, cache.shape[1], cache.shape[3])
    raise ValueError(f"a tiled cache has 6 dims {KEY_SHAPE} or 5 dims {VALUE_SHAPE}, got shape {list(cache.shape)}")


def logical_view(cache: torch.Tensor) -> torch.Tensor:
    """A checked tiled cache as the 4-dim ``[num_blocks, block_size, num_kv_heads, head_dim]`` view over the same
    bytes (its block stride, contiguous rows), for checks and sizes only: its elements are not the cache's (read
    them with :func:`unpack_cache`). Works on fake and meta tensors. The C++ door makes the same view."""
    num_blocks, block_size, num_kv_heads, head_dim = logical_shape(cache)
    return cache.as_strided((num_blocks, block_size, num_kv_heads, head_dim),
                            (cache.stride(0), num_kv_heads * head_dim, head_dim, 1))


def tiled_pair_problem(key_cache: torch.Tensor, value_cache: torch.Tensor) -> Optional[tuple]:
    """The first rule of the tiled layout that a pair (at least one of them tiled) breaks, as the parts of its
    message (strings, shapes, dtypes, devices), or None. The one list of the rules in Python, in the order and with
    the messages of the C++ door (csrc/common.cpp: check_tiled_cache_pair): :func:`check_tiled_pair` raises it as a
    ValueError, the fake kernels (paged_attn/fakes.py) as the C++ door's RuntimeError."""
    k, v = key_cache, value_cache
    if not (k.dim() == 6 and v.dim() == 5):
        return ("key_cache and value_cache must have one layout: both tiled (pack_cache: key_cache ", KEY_SHAPE,
                ", value_cache ", VALUE_SHAPE, ") or both ", ROW_MAJOR_SHAPE, ", got shapes ", list(k.shape), " and ",
                list(v.shape))
    # A meta tensor stands for a tensor on any device (a shape-only run of the fakes): there is no device to judge.
    if not all(t.device.type in ("cpu", "meta") for t in (k, v)):
        return ("tiled caches are read by the CPU ops only, got key_cache on ", k.device, " and value_cache on ",
                v.device)
    if k.dtype not in TILED_DTYPES:
        return ("a tiled cache must be bfloat16, float8_e4m3fn or float8_e5m2 (the dot-product units' types), got ",
                k.dtype)
    if v.dtype != k.dtype:
        return ("key_cache and value_cache must have the same dtype, got ", k.dtype, " and ", v.dtype)
    num_blocks, block_size, num_kv_heads, head_dim = logical_shape(k)
    if not (k.shape[4] == TILE_TOKENS and k.shape[5] == 2 and v.shape[4] == 2 and v.shape[0] == num_blocks
            and v.shape[1] == num_kv_heads and v.shape[2] * 2 == block_size and v.shape[3] == head_dim):
        return ("tiled key_cache ", KEY_SHAPE, " and value_cache ", VALUE_SHAPE, " must describe one cache, got "
                "shapes ", list(k.shape), " and ", list(v.shape))
    if not (num_kv_heads > 0 and block_size > 0 and head_dim > 0 and head_dim % HEAD_DIM_MULTIPLE == 0):
        return ("a tiled cache needs num_kv_heads, block_size and head_dim positive and head_dim a multiple of ",
                HEAD_DIM_MULTIPLE, ", got key_cache shape ", list(k.shape))
    for cache, name in ((k, "key_cache"), (v, "value_cache")):
        layout = ("got shape ", list(cache.shape), " with strides ", list(cache.stride()))
        if list(cache.stride()[1:]) != _contiguous_strides(cache.shape[1:]):
            return (name, ": a tiled cache must be contiguous within each block (as pack_cache makes it), ") + layout
        if num_blocks > 1 and cache.stride(0) < math.prod(cache.shape[1:]):
            return (name, ": the block stride must reach past a block's elements, ") + layout
    return None


def check_tiled_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """ValueError unless key_cache and value_cache are a tiled pair as the ops take it (the rules of the module
    docstring; the message of :func:`tiled_pair_problem`)."""
    problem = tiled_pair_problem(key_cache, value_cache)
    if problem is not None:
        raise ValueError("".join(map(str, problem)))


def pack_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides) as new contiguous tiled
    ones, of the same dtype and device: a bit-exact permutation (NaN payloads, fp8 bytes and -0 kept).

    Example::

        key_tiled, value_tiled = paged_attn.pack_cache(key_cache, value_cache)
        out = paged_attn.paged_attention(query, key_tiled, value_tiled, block_tables, seq_lens)
    """
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(f"pack_cache takes row-major caches {ROW_MAJOR_SHAPE}, got shapes {list(key_cache.shape)} "
                         f"and {list(value_cache.shape)}")
    if (key_cache.shape, key_cache.dtype, key_cache.device) != (value_cache.shape, value_cache.dtype,
                                                                value_cache.device):
        raise ValueError(f"key_cache and value_cache must have the same shape, dtype and device, got "
                         f"{key_cache.dtype} {list(key_cache.shape)} on {key_cache.device} and {value_cache.dtype} "
                         f"{list(value_cache.shape)} on {value_cache.device}")
    if key_cache.dtype not in TILED_DTYPES:
        raise ValueError(f"a tiled cache must be bfloat16, float8_e4m3fn or float8_e5m2, got {key_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    tiled_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)  # the sizes' checks
    # Splitting a dimension is a view whatever the strides; clone writes the permutation into a new tensor.
    keys = key_cache.unflatten(1, (block_size // TILE_TOKENS, TILE_TOKENS)).unflatten(4, (head_dim // 2, 2))
    # keys: [b, o // 16, o % 16, g, d // 2, d % 2] -> [b, g, o // 16, d // 2, o % 16, d % 2]
    key_tiled = keys.permute(0, 3, 1, 4, 2, 5).clone(memory_format=torch.contiguous_format)
    # values: [b, o // 2, o % 2, g, d] -> [b, g, o // 2, d, o % 2]
    values = value_cache.unflatten(1, (block_size // 2, 2))
    value_tiled = values.permute(0, 3, 1, 4, 2).clone(memory_format=torch.contiguous_format)
    return key_tiled, value_tiled


def unpack_cache(key_tiled: torch.Tensor, value_tiled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_cache`: a tiled pair as new contiguous row-major caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` of the same dtype and device (ValueError unless it is a tiled pair the ops take)."""
    check_tiled_pair(key_tiled, value_tiled)
    shape = logical_shape(key_tiled)
    key_cache = key_tiled.permute(0, 2, 4, 1, 3, 5).clone(memory_format=torch.contiguous_format).reshape(shape)
    value_cache = value_tiled.permute(0, 2, 4, 1, 3).clone(memory_format=torch.contiguous_format).reshape(shape)
    return key_cache, value_cache


def _contiguous_strides(sizes) -> list:
    """The strides of a contiguous tensor of these sizes (a size-1 dimension's too: the C++ checks every stride)."""
    strides, step = [], 1
    for size in reversed(sizes):
        strides.insert(0, step)
        step *= size
    return strides
