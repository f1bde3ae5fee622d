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
