"""The built extension: registered ops, and CUDA machine code for the requested architectures."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

import paged_attn

_spec = importlib.util.spec_from_file_location("sass_report", Path(__file__).resolve().parents[2] / "scripts" /
                                               "sass_report.py")
sass_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_report)

OPS = ["reshape_and_cache", "copy_blocks", "swap_blocks", "paged_attention", "merge_attention_states",
       "concat_and_cache_mla", "mla_attention", "pack_linear_weight", "linear", "rms_norm", "add_rms_norm",
       "silu_and_mul"]
HOST_OPS = ["plan_shared_blocks"]  # they take CPU tensors in every build


@pytest.mark.parametrize("op", OPS + HOST_OPS)
def test_ops_registered_for_cpu(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"paged_attn::{op}", "CPU")


def cuobjdump():
    """cuobjdump from the CUDA toolkit, or the copy that Triton's package ships (scripts/sass_report.py finds it)."""
    try:
        return sass_report.find_cuobjdump()
    except FileNotFoundError:
        return None


def expected_archs():
    """sm_XY for each architecture in TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0+PTX" -> sm_80, sm_90)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    return ["sm_" + a.split("+")[0].replace(".", "") for a in archs.replace(" ", ";").split(";") if a[:1].isdigit()]


@pytest.mark.skipif(
    os.environ.get("PAGED_ATTN_FORCE_CUDA") != "1" and not paged_attn.has_cuda_kernels(),
    reason="built without CUDA kernels (set PAGED_ATTN_FORCE_CUDA=1 to require them)",
)
def test_cuda_kernels_built():
    assert paged_attn.has_cuda_kernels(), "PAGED_ATTN_FORCE_CUDA=1 but the extension has no CUDA kernels"
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"paged_attn::{op}", "CUDA")
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to list the machine code")
    listing = subprocess.run([tool, "--list-elf", paged_attn._C.__file__], capture_output=True, text=True, check=True)
    archs = expected_archs() or ["sm_"]
    for arch in archs:
        assert arch in listing.stdout, f"no {arch} machine code in {paged_attn._C.__file__}:\n{listing.stdout}"
