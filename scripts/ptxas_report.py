"""Turns the ptxas resource lines of a build log (nvcc --resource-usage, which setup.py and CMakeLists.txt pass) into
a table: one row per kernel and architecture, with its registers per thread, spill stores/loads and stack frame
(bytes) and static shared memory (bytes). A kernel that spills is marked SPILLS.

    python scripts/ptxas_report.py build/build.log > build/registers.txt   # the table (scripts/setup.sh)
    python scripts/ptxas_report.py --summary build.log                      # one line (the other CI builds)

Needs only the standard library (c++filt, when present, demangles the names).
"""

import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\S+)' for '(\w+)'")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def short(name):
    """paged_attn::(anonymous namespace)::kernel<T, 128, 4>(args...) -> kernel<T, 128, 4>"""
    name = re.sub(r"\(anonymous namespace\)::|paged_attn::", "", name)
    depth, end = 0, len(name)
    for i, c in enumerate(name):  # drop the argument list: the first '(' outside template brackets
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            end = i
            break
    name = name[:end].replace("__nv_bfloat16", "bf16").replace("__half", "half")
    return re.sub(r"^void ", "", name)


def parse(lines):
    rows, current = [], None  # current: [name, arch, stack, spill stores, spill loads]
    for line in lines:
        if m := ENTRY.search(line):
            current = [m.group(1), m.group(2), 0, 0, 0]
        elif current and (m := SPILLS.search(line)):
            current[2:5] = [int(g) for g in m.groups()]
        elif current and (m := USED.search(line)):
            rows.append((*current, int(m.group(1)), int(m.group(2) or 0)))
            current = None
    names = demangle([r[0] for r in rows])
    table = {}
    for name, (_, arch, stack, stores, loads, regs, smem) in zip(names, rows):
        table[(short(name), arch)] = (regs, stores, loads, smem, stack)  # each .cu is compiled once per arch
    return table


def natural(key):
    """Sort key: numbers inside names compare as numbers (head dim 32 before 128)."""
    name, arch = key
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)], arch


def main():
    args = [a for a in sys.argv[1:] if a != "--summary"]
    path = args[0] if args else "build/build.log"
    with open(path, errors="replace") as f:
        table = parse(f)
    if not table:
        print("ptxas: no resource lines in " + path + " (no CUDA kernels built, or nvcc without --resource-usage)")
        return
    if "--summary" in sys.argv:
        regs = [row[0] for row in table.values()]
        rows = sorted(table.items(), key=lambda r: natural(r[0]))
        spills = [f"{name} ({row[1]}/{row[2]} B)" for (name, _), row in rows if row[1] or row[2]]
        archs = ", ".join(sorted({arch for _, arch in table}))
        print(f"ptxas: {len(table)} kernels ({archs}), {min(regs)}-{max(regs)} registers per thread; "
              f"spills in {len(spills)}" + (": " + ", ".join(spills) if spills else ""))
        return
    width = max(len(name) for name, _ in table)
    print(f"{'kernel':<{width}}  arch   regs  spill st/ld B  smem B  stack B")
    for (name, arch), (regs, stores, loads, smem, stack) in sorted(table.items(), key=lambda r: natural(r[0])):
        flag = "  SPILLS" if stores or loads else ""
        print(f"{name:<{width}}  {arch:<5} {regs:>5}  {stores:>6}/{loads:<6}  {smem:>6}  {stack:>7}{flag}")


if __name__ == "__main__":
    main()
