"""Builds paged_attn._C with torch.utils.cpp_extension.

CPU kernels are always built. CUDA kernels are built where they can run, or when asked: torch has CUDA, a CUDA
toolkit is found, and a GPU is visible (for its architecture) or PAGED_ATTN_FORCE_CUDA=1 (no GPU needed; CI and
the GPU check build them so). A machine with the toolkit but no GPU builds the CPU kernels only: the CUDA kernels
cost minutes of compiling there, for code that machine cannot run. Environment switches:
  PAGED_ATTN_NO_CUDA=1      skip the CUDA kernels
  PAGED_ATTN_FORCE_CUDA=1   build the CUDA kernels without a GPU, and fail unless they can be built
  TORCH_CUDA_ARCH_LIST      GPU architectures; a visible GPU's by default, else DEFAULT_ARCH_LIST
  MAX_JOBS                  parallel compile jobs (ninja)
  PAGED_ATTN_NVCC_CACHE     a directory: nvcc compiles through scripts/nvcc_cache.py, which keeps each object under
                            the hash of what it read (CI's torch 2.11 build takes the torch-free kernels' objects
                            from its torch 2.14 build)
"""

import glob
import os
import platform
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"  # Ampere and Ada (sm_80 code runs on 8.x), Hopper, PTX for newer GPUs


def find_cuda_home():
    """CUDA_HOME as torch would infer it, but following symlinks (a /usr/local/bin/nvcc link would give /usr/local)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def want_cuda():
    if os.environ.get("PAGED_ATTN_NO_CUDA", "0") == "1":
        return False
    import torch

    cuda_home = find_cuda_home()
    ok = torch.version.cuda is not None and cuda_home is not None
    forced = os.environ.get("PAGED_ATTN_FORCE_CUDA", "0") == "1"
    if forced and not ok:
        raise RuntimeError(
            f"PAGED_ATTN_FORCE_CUDA=1 but the CUDA kernels cannot be built: torch.version.cuda={torch.version.cuda}, "
            f"CUDA toolkit={cuda_home} (set CUDA_HOME)"
        )
    if ok and not forced and not torch.cuda.is_available():
        print("paged_attn: a CUDA toolkit but no GPU: the CUDA kernels are not built (PAGED_ATTN_FORCE_CUDA=1 "
              "builds them)")
        return False
    if ok:
        os.environ["CUDA_HOME"] = cuda_home  # read when torch.utils.cpp_extension is imported
        if os.environ.get("PAGED_ATTN_NVCC_CACHE"):  # torch's ninja rule calls $PYTORCH_NVCC for nvcc
            cache = os.path.join(ROOT, "scripts", "nvcc_cache.py")
            os.environ["PYTORCH_NVCC"] = f"{sys.executable} {cache} {os.path.join(cuda_home, 'bin', 'nvcc')}"
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    return ok


def extensions():
    with_cuda = want_cuda()
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = ["csrc/torch_bindings.cpp", "csrc/common.cpp", "csrc/attention_checks.cpp", "csrc/overlap.cpp",
               "csrc/shared_blocks.cpp", "csrc/python_module.cpp"]
    sources += sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx_flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        # AVX2 + FMA + F16C (any x86-64 server since ~2015): the CPU attention kernel's at::vec code uses them.
        cxx_flags.append("-march=x86-64-v3")
    kwargs = dict(
        name="paged_attn._C",
        sources=sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
        # Python's limited API (csrc/python_module.cpp): _C.abi3.so, one build for every CPython >= 3.10.
        py_limited_api=True,
    )
    if not with_cuda:
        print("paged_attn: building the CPU kernels only")
        return [CppExtension(**kwargs)]
    print(f"paged_attn: building CPU and CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}")
    kwargs["sources"] += (sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")) +
                          sorted(glob.glob("csrc/cuda/instantiations/*.cu")))
    # --resource-usage: ptxas prints each kernel's registers, spills and shared memory into the build log;
    # scripts/ptxas_report.py turns them into build/registers.txt.
    # -std=c++17: the .cu files read no torch header, so they need no more than C++17 (the emulator builds them so),
    # and one standard for every torch release (torch 2.11 would pass c++17, 2.14 c++20) lets a build against one
    # take the other's objects from scripts/nvcc_cache.py.
    kwargs["extra_compile_args"]["nvcc"] = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "--resource-usage",
                                            "-std=c++17"]
    return [CUDAExtension(**kwargs)]


def remove_stale_module():
    """An in-place build from before py_limited_api (_C.cpython-3XX-*.so) would shadow _C.abi3.so on import."""
    for path in glob.glob(os.path.join(ROOT, "paged_attn", "_C.cpython-*.so")):
        os.remove(path)


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


remove_stale_module()
setup(
    packages=find_packages(include=["paged_attn", "paged_attn.*"]),
    ext_modules=extensions(),
    cmdclass=cmdclass(),
)
