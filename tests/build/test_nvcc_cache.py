"""scripts/nvcc_cache.py: a compile of the same inputs from another directory (another checkout, another torch's
include paths) takes the cached object; a change to anything the compile reads, in its host or its device pass,
compiles again. Runs nvcc on a three-line kernel (~2 s a compile); skipped without a CUDA toolkit."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import nvcc_cache  # noqa: E402

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
needs_nvcc = pytest.mark.skipif(not os.path.exists(NVCC), reason="no CUDA toolkit")

KERNEL = """#ifdef __CUDA_ARCH__
#include "device_only.h"
#endif
#include "both.h"
__global__ void kernel(float* out) { out[threadIdx.x] = DEVICE_VALUE + BOTH_VALUE; }
"""


def make_tree(path, device_value="1.0f", both_value="2.0f"):
    os.makedirs(os.path.join(path, "include"), exist_ok=True)
    with open(os.path.join(path, "kernel.cu"), "w") as f:
        f.write(KERNEL)
    with open(os.path.join(path, "include", "device_only.h"), "w") as f:
        f.write(f"#define DEVICE_VALUE {device_value}\n")
    with open(os.path.join(path, "include", "both.h"), "w") as f:
        f.write(f"#ifndef __CUDA_ARCH__\n#define DEVICE_VALUE 0.0f\n#endif\n#define BOTH_VALUE {both_value}\n")


def compile_in(path, cache, extra=()):
    """Compiles path/kernel.cu as torch's ninja rule does, through the cache; (its output, the object's bytes)."""
    obj, dep = os.path.join(path, "kernel.o"), os.path.join(path, "kernel.o.d")
    args = [sys.executable, os.path.join(ROOT, "scripts", "nvcc_cache.py"), NVCC, "-MD", "-MF", dep,
            "-I" + os.path.join(path, "include"), "-c", os.path.join(path, "kernel.cu"), "-o", obj,
            "-gencode=arch=compute_90,code=sm_90", "--resource-usage", *extra]
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PAGED_ATTN_NVCC_CACHE": cache})
    assert result.returncode == 0, result.stdout + result.stderr
    with open(dep) as f:
        deps = nvcc_cache.dependencies(f.read())
    assert os.path.join(path, "include", "both.h") in deps  # the dependency file names this compile's files
    with open(obj, "rb") as f:
        return result.stdout, f.read()


@needs_nvcc
def test_same_inputs_elsewhere_hit_and_any_read_file_changed_misses(tmp_path):
    cache = str(tmp_path / "cache")
    make_tree(str(tmp_path / "a"))
    output, first = compile_in(str(tmp_path / "a"), cache)
    assert "from the cache" not in output and "ptxas info" in output

    make_tree(str(tmp_path / "b"))  # the same files under another directory
    output, again = compile_in(str(tmp_path / "b"), cache)
    assert "from the cache" in output and "ptxas info" in output  # the compile's output, replayed
    assert again == first

    make_tree(str(tmp_path / "c"), device_value="3.0f")  # a header only the device pass includes
    output, _ = compile_in(str(tmp_path / "c"), cache)
    assert "from the cache" not in output

    make_tree(str(tmp_path / "d"), both_value="4.0f")
    output, _ = compile_in(str(tmp_path / "d"), cache)
    assert "from the cache" not in output

    make_tree(str(tmp_path / "e"))  # the first inputs, another flag
    output, _ = compile_in(str(tmp_path / "e"), cache, extra=["-DEXTRA=1"])
    assert "from the cache" not in output
    shutil.rmtree(cache)


def test_only_single_compiles_are_cached():
    assert nvcc_cache.parse(["-MD", "-MF", "x.d", "-I/a", "-c", "k.cu", "-o", "k.o", "-O3"]) == (
        "k.cu", "k.o", "x.d", ["-I/a", "-O3"])
    assert nvcc_cache.parse(["--version"]) is None
    assert nvcc_cache.parse(["-c", "a.cu", "b.cu", "-o", "x.o"]) is None
    assert nvcc_cache.parse(["a.o", "-o", "lib.so", "-shared"]) is None  # a link
    assert nvcc_cache.keyed_arguments(["-I/x", "-I", "/y", "-isystem", "/z", "-O3", "-DA=1"]) == ["-O3", "-DA=1"]


def test_dependencies_read_make_rules():
    text = "k.o : k.cu \\\n    /a/b.h \\\n    /with\\ space/c.h\n"
    assert nvcc_cache.dependencies(text) == ["k.cu", "/a/b.h", "/with space/c.h"]
