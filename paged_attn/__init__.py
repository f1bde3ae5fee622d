"""paged-attn: PagedAttention for PyTorch.

The kernels are registered as ``torch.ops.paged_attn.*`` when ``paged_attn._C`` is imported; this package wraps
them with typed functions (``paged_attn.ops``) and keeps pure-PyTorch references beside them
(``paged_attn.reference``).
"""

import torch  # noqa: F401  (load libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.paged_attn.*)
from .block_manager import BlockManager, OutOfBlocksError
from .ops import (
    batch_invariant,
    concat_and_cache_mla,
    copy_blocks,
    has_cuda_kernels,
    is_tiled,
    merge_attention_states,
    mla_attention,
    pack_cache,
    paged_attention,
    plan_shared_blocks,
    reshape_and_cache,
    set_batch_invariant,
    set_validation,
    swap_blocks,
    tiled_cache_shapes,
    unpack_cache,
    validation_enabled,
)

__all__ = [
    "BlockManager",
    "OutOfBlocksError",
    "batch_invariant",
    "concat_and_cache_mla",
    "copy_blocks",
    "has_cuda_kernels",
    "is_tiled",
    "merge_attention_states",
    "mla_attention",
    "pack_cache",
    "paged_attention",
    "plan_shared_blocks",
    "reshape_and_cache",
    "set_batch_invariant",
    "set_validation",
    "swap_blocks",
    "tiled_cache_shapes",
    "unpack_cache",
    "validation_enabled",
]
__version__ = "0.1.0"
