"""A compile cache for nvcc, keyed by what a compile reads: setup.py puts it in front of nvcc (torch's PYTORCH_NVCC)
when PAGED_ATTN_NVCC_CACHE names a directory. CI builds the package twice with CUDA, against torch 2.14 and 2.11;
the kernel files (csrc/cuda/instantiations/*.cu and the other torch-free .cu files) read no torch header, so the
second build takes their objects from the first instead of compiling them again.

    python scripts/nvcc_cache.py NVCC ARGS...   # as torch's ninja rule calls nvcc: -MD -MF DEP ... -c SRC -o OBJ ...

The key: nvcc's version, the arguments but the paths of this compile (-I/-isystem directories, the source, object
and dependency file), and the contents of the source and of every file it includes (`nvcc -M`, which lists the
host and device passes' includes: a header of another torch is another key). A hit copies the object, writes the
dependency file of this compile and replays the compile's output (ptxas' --resource-usage lines, which
scripts/ptxas_report.py reads from the build log). Any other call (no -c, or several sources) runs nvcc as it is.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile


def parse(args):
    """(source, object, depfile, the arguments without -MD/-MF/-c/-o and the source), or None: not one compile."""
    source = obj = depfile = None
    rest = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-MD":
            pass
        elif a == "-MF" and i + 1 < len(args):
            depfile = args[i + 1]
            i += 1
        elif a == "-o" and i + 1 < len(args):
            obj = args[i + 1]
            i += 1
        elif a == "-c":
            pass
        elif a.endswith(".cu") and not a.startswith("-"):
            if source is not None:
                return None
            source = a
        else:
            rest.append(a)
        i += 1
    if source is None or obj is None or "-c" not in args:
        return None
    return source, obj, depfile, rest


def keyed_arguments(rest):
    """The arguments that can change an object, without the include directories (the includes' contents count)."""
    out, skip = [], False
    for a in rest:
        if skip:
            skip = False
        elif a in ("-I", "-isystem"):
            skip = True
        elif not a.startswith(("-I", "-isystem")):
            out.append(a)
    return out


def dependencies(depfile_text):
    """The prerequisites of a make rule, as nvcc -M writes it (backslash-newlines, escaped spaces)."""
    body = depfile_text.replace("\\\n", " ").split(":", 1)[1]
    files, word = [], ""
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body) and body[i + 1] == " ":
            word += " "
            i += 1
        elif c.isspace():
            if word:
                files.append(word)
            word = ""
        else:
            word += c
        i += 1
    if word:
        files.append(word)
    return files


def main():
    nvcc, args = sys.argv[1], sys.argv[2:]
    cache = os.environ.get("PAGED_ATTN_NVCC_CACHE")
    parsed = parse(args)
    if not cache or parsed is None:
        os.execv(nvcc, [nvcc, *args])
    source, obj, depfile, rest = parsed

    # The includes of this compile, as a dependency file for it (written in place of -MD's on a hit).
    with tempfile.TemporaryDirectory() as tmp:
        listed = os.path.join(tmp, "deps.d")
        dep_args = [a for a in rest if a != "--resource-usage"]
        subprocess.run([nvcc, *dep_args, "-M", "-MT", obj, "-MF", listed, source], check=True)
        with open(listed) as f:
            depfile_text = f.read()
    key = hashlib.sha256()
    key.update(subprocess.run([nvcc, "--version"], capture_output=True, check=True).stdout)
    key.update("\0".join(keyed_arguments(rest)).encode())
    for path in dependencies(depfile_text):
        with open(path, "rb") as f:
            key.update(b"\0" + hashlib.sha256(f.read()).digest())
    entry = os.path.join(cache, key.hexdigest())

    if os.path.exists(os.path.join(entry, "obj")):
        shutil.copyfile(os.path.join(entry, "obj"), obj)
        if depfile:
            with open(depfile, "w") as f:
                f.write(depfile_text)
        with open(os.path.join(entry, "output")) as f:
            sys.stdout.write(f.read())
        print(f"nvcc_cache: {os.path.basename(source)} from the cache")
        return 0

    result = subprocess.run([nvcc, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(result.stdout)
    if result.returncode != 0:
        return result.returncode
    os.makedirs(cache, exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache)  # filled, then renamed: a concurrent build sees a whole entry or none
    shutil.copyfile(obj, os.path.join(staging, "obj"))
    with open(os.path.join(staging, "output"), "w") as f:
        f.write(result.stdout)
    try:
        os.rename(staging, entry)
    except OSError:  # another build stored it first
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
