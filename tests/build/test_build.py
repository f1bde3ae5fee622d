"""The built extension: registered ops, and CUDA machine code for the requested architectures."""

import importlib.util
import os
import subprocess
import sys
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


def test_gpu_bundle_check(tmp_path):
    """scripts/check_gpu_bundle.py on this build, stripped as the GPU check's bundle is: a CUDA build passes every
    check with the torch it was built against; a CPU-only build fails the three that need the CUDA kernels."""
    if cuobjdump() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton) to list the machine code")
    subprocess.run(["strip", "--strip-debug", "-o", str(tmp_path / "_C.abi3.so"), paged_attn._C.__file__], check=True)
    script = Path(__file__).resolve().parents[2] / "scripts" / "check_gpu_bundle.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    if paged_attn.has_cuda_kernels():
        assert result.returncode == 0 and not failed, result.stdout + result.stderr
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(failed) == 3, result.stdout
    assert "no libcudart.so" in failed[0] and "no architecture" in failed[1] and "does not load" in failed[2]
    assert "no CUDA kernel for" in result.stdout and "all in CPython's stable ABI" in result.stdout
