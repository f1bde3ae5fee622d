"""Checks the GPU check's bundle: paged_attn's library built on this GPU-less machine for the GPU machines' software
(torch 2.11.0+cu130 on CPython 3.12, an H100 or H200), so that a lent GPU spends its minutes running, not compiling.
Run it with the torch the bundle was built against (scripts/check_torch_version.sh --bundle DIR does):

    python scripts/check_gpu_bundle.py DIR            # DIR/_C.abi3.so

It fails unless:
- the library is small enough to travel with the working tree (64 MiB in all, the sources included);
- it needs the CUDA runtime of torch's CUDA major version, and besides only torch's own libraries and the C/C++
  runtime:
  no libpython, no libtorch_python; its Python symbols are the stable ABI's (built with Py_LIMITED_API), so any
  CPython >= 3.10 loads it;
- it carries sm_90 machine code;
- it loads into this torch as ``paged_attn._C`` (every symbol resolves), registers a CUDA kernel for every op that
  has a CPU kernel, and its CPU paged_attention matches the float64 reference on random data.
Prints one line per check and the library's size.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from sass_report import find_cuobjdump  # (scripts/ is on sys.path: this file's folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = "_C.abi3.so"
MAX_MIB = 56  # of the 64 MiB that travel; the tree is ~3 MiB (the sm_90 code, with -lineinfo, ~48 MiB of it)
SYSTEM_LIBRARIES = re.compile(r"^(libstdc\+\+\.so\.6|libm\.so\.6|libgomp\.so\.1|libgcc_s\.so\.1|libc\.so\.6|"
                              r"ld-linux-x86-64\.so\.2|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$")
TORCH_LIBRARIES = {"libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libc10_cuda.so"}
# CPython's own underscore names that the stable ABI exports (Py_DECREF, Py_None, Py_True/False expand to them).
STABLE_PRIVATE = {"_Py_Dealloc", "_Py_NoneStruct", "_Py_TrueStruct", "_Py_FalseStruct", "_Py_IncRef", "_Py_DecRef"}


def needed_libraries(path: str) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)


def undefined_python_symbols(path: str) -> list[str]:
    symbols = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in symbols.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(("Py", "_Py", "THP")) or "pybind11" in n]


HOST_OPS = ["plan_shared_blocks"]  # ops that take CPU tensors in every build (tests/build/test_build.py's too)
LOAD_CHECK = f"HOST_OPS = {HOST_OPS!r}" + r"""
import sys, torch
import paged_attn
from paged_attn import reference
assert paged_attn._C.__file__.endswith("_C.abi3.so"), paged_attn._C.__file__
ops = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("paged_attn::"))
has = torch._C._dispatch_has_kernel_for_dispatch_key
cpu = [op for op in ops if has(f"paged_attn::{op}", "CPU")]
device_ops = [op for op in cpu if op not in HOST_OPS]
missing = [op for op in device_ops if not has(f"paged_attn::{op}", "CUDA")]
if not cpu or missing:
    sys.exit(f"no CUDA kernel for {missing} (ops with a CPU kernel: {cpu})")
torch.manual_seed(0)
q = torch.randn(3, 4, 64)
k, v = torch.randn(2, 9, 16, 2, 64)
tables = torch.randperm(9, dtype=torch.int32)[:6].view(3, 2)
lens = torch.tensor([5, 32, 17], dtype=torch.int32)
torch.testing.assert_close(paged_attn.paged_attention(q, k, v, tables, lens),
                           reference.paged_attention(q, k, v, tables, lens).float(), rtol=1e-4, atol=1e-4)
print(f"loads into torch {torch.__version__} (CUDA {torch.version.cuda}): "
      f"{len(device_ops)} ops with CPU and CUDA kernels; "
      "CPU paged_attention matches the reference")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", help="the folder holding _C.abi3.so")
    args = parser.parse_args()
    import torch

    path = os.path.join(args.bundle, LIBRARY)
    failures = []

    def check(ok: bool, line: str) -> None:
        print(("ok   " if ok else "FAIL ") + line)
        if not ok:
            failures.append(line)

    if not os.path.exists(path):
        print(f"FAIL no {path}")
        return 1
    mib = os.path.getsize(path) / 2**20
    check(mib <= MAX_MIB, f"{path}: {mib:.1f} MiB (at most {MAX_MIB}: it travels with the tree, 64 MiB in all)")

    cuda_major = (torch.version.cuda or "").split(".")[0]
    cudart = f"libcudart.so.{cuda_major}"
    needed = needed_libraries(path)
    foreign = [n for n in needed if n not in TORCH_LIBRARIES | {cudart} and not SYSTEM_LIBRARIES.match(n)]
    line = f"needs {', '.join(needed)}"
    if foreign:
        line += f"; not torch's, CUDA {cuda_major}'s or the C/C++ runtime's: {foreign}"
    if cudart not in needed:
        line += f"; no {cudart}: no CUDA kernels"
    check(not foreign and cudart in needed, line)
    python = undefined_python_symbols(path)
    unstable = [n for n in python if not n.startswith("Py") and n not in STABLE_PRIVATE]
    check(not unstable, f"{len(python)} Python symbols, all in CPython's stable ABI"
          if not unstable else f"Python symbols outside the stable ABI (libtorch_python's or CPython's): {unstable}")

    listing = subprocess.run([find_cuobjdump(), "--list-elf", path], capture_output=True, text=True)
    arches = sorted(set(re.findall(r"\.(sm_\d+a?)\.", listing.stdout)))
    check("sm_90" in arches or "sm_90a" in arches, f"machine code for {', '.join(arches) or 'no architecture'}")

    # Load it as paged_attn._C: a copy of the package's Python files beside the bundle's library, in a fresh process.
    with tempfile.TemporaryDirectory() as work:
        package = os.path.join(work, "paged_attn")
        shutil.copytree(os.path.join(ROOT, "paged_attn"), package,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        shutil.copy(path, os.path.join(package, LIBRARY))
        env = dict(os.environ, PYTHONPATH=work)
        loaded = subprocess.run([sys.executable, "-c", LOAD_CHECK], capture_output=True, text=True, env=env, cwd=work)
        check(loaded.returncode == 0, (loaded.stdout.strip() or "does not load") +
              ("" if loaded.returncode == 0 else "\n" + loaded.stderr[-3000:]))
    if glob.glob(os.path.join(args.bundle, "*.so")) != [path]:
        check(False, f"{args.bundle} holds other libraries too: {glob.glob(os.path.join(args.bundle, '*.so'))}")
    print("bundle ok" if not failures else f"bundle FAILED: {len(failures)} check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
