import pytest
import torch

import paged_attn

HAS_GPU = torch.cuda.is_available()
HAS_CUDA_OPS = HAS_GPU and paged_attn.has_cuda_kernels()
CUDA_SKIP_REASON = (
    "no CUDA GPU visible" if not HAS_GPU else "paged_attn was built without its CUDA kernels"
)

# Parametrize over this to run a test on the CPU always and on CUDA when a GPU (and the CUDA build) is present;
# pytest's -ra prints the skip reason.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA_OPS, reason=CUDA_SKIP_REASON)),
]
requires_cuda = pytest.mark.skipif(not HAS_CUDA_OPS, reason=CUDA_SKIP_REASON)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def validation():
    """Turns CUDA index validation on for one test and restores the previous setting."""
    before = paged_attn.validation_enabled()
    paged_attn.set_validation(True)
    yield
    paged_attn.set_validation(before)


def snapshot(bm):
    """Everything the manager holds, to compare before and after a call that must fail."""
    blocks = [(b.ref_count, b.hash, b.token_ids, b.content_id, b.parent_content_id) for b in bm.gpu_blocks]
    seqs = {seq_id: (list(s.token_ids), list(s.block_table), s.swapped_out, s.prefix_hash, s.prefix_content_id)
            for seq_id, s in bm.seqs.items()}
    return (bm.stats(), blocks, [b.ref_count for b in bm.cpu_blocks], list(bm.free_gpu_block_ids),
            list(bm.evictable_block_ids), list(bm.free_cpu_block_ids), dict(bm.hash_to_block_id), seqs)
