"""The CUDA kernels' launch plans (csrc/cuda/launch_plan.h) through the test hook paged_attn._C._launch_plan.

The plans are plain C++, built into every extension (no GPU, no CUDA kernels needed); the CUDA launchers and the
emulated kernel tests launch with the same functions, so what is checked here is what runs there.
"""

import pytest

from paged_attn import _C

# ----------------------------------------------------------------------------------------------------------------
# Cache ops: no launch with zero threads, no grid past its limits


def test_reshape_and_cache_plan():
    assert _C._launch_plan("reshape_and_cache", 5, 2, 8) == dict(grid=(5, 1, 1), threads=32, shared_bytes=0,
                                                                  error=None)
    assert _C._launch_plan("reshape_and_cache", 5, 8, 40)["threads"] == 320
    assert _C._launch_plan("reshape_and_cache", 5, 64, 64)["threads"] == 512
    assert "grid.x = num_tokens" in _C._launch_plan("reshape_and_cache", 2**31, 2, 8)["error"]
    assert _C._launch_plan("reshape_and_cache", 5, 0, 8)["error"] == "num_kv_heads and head_dim must be positive"


def test_copy_blocks_plan():
    plan = _C._launch_plan("copy_blocks", 3, 128, 1000)
    assert plan == dict(grid=(3, 128, 2), threads=512, shared_bytes=0, error=None)
    empty = _C._launch_plan("copy_blocks", 3, 2, 0)
    assert empty["error"] == "blocks must not be empty" and empty["threads"] == 32
    assert _C._launch_plan("copy_blocks", 3, 129, 8)["error"] == "at most 128 layers per launch"
    assert "grid.x = num_pairs" in _C._launch_plan("copy_blocks", 2**31, 1, 8)["error"]


def test_unknown_kernel():
    with pytest.raises(TypeError, match="unknown kernel"):
        _C._launch_plan("nope", 1)
