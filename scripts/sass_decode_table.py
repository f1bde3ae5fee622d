"""The before/after table of the CUDA decode kernels by the SASS report (scripts/sass_report.py), as markdown.

    .venv/bin/python scripts/sass_decode_table.py [--baseline scripts/sass_baseline.json] \
        [--report build/sass_report.json]

The table in bench/LOG.md (2026-12-03) compares with the baseline of a5ad90d, before the tensor-core decode (the
baseline was then bench/sass_baseline.json):
    git show f5cdf9b:bench/sass_baseline.json > /tmp/a5ad90d.json
    .venv/bin/python scripts/sass_decode_table.py --baseline /tmp/a5ad90d.json

One row per decode variant of the baseline (query dtype, cache dtype, head dim, query heads per thread block):
the kernel that served it then (paged_attention_kernel<T, C, D, G>) against the one that serves it now, which is
decode_mma_kernel<T, D> where the current report has one (float16 / bfloat16 with a cache of the same dtype, on
GPUs of compute capability 8.0+; it serves every group size) and the same CUDA-core kernel otherwise. Columns: the
modelled issue ceiling (fraction of 4.8 TB/s), bytes in flight per SM, resident blocks per SM, registers, local
memory. The report's model and its assumptions: scripts/sass_report.py's docstring.
"""

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODE = re.compile(r"^paged_attention_kernel<(\w+), ([\w ]+), (\d+), (\d+)>$")


def figures(kernel):
    ceiling = "-" if kernel["ceiling"] is None else f"{kernel['ceiling']:.0%}"
    in_flight = "-" if kernel["in_flight_per_sm"] is None else f"{kernel['in_flight_per_sm'] / 1024:.0f}"
    return ceiling, in_flight, str(kernel["blocks_per_sm"]), str(kernel["registers"]), str(kernel["local_bytes"])


def table(baseline, report, groups=None):
    before = {k["name"]: k for k in baseline}
    now = {k["name"]: k for k in report}
    lines = ["| query, cache, head dim, heads | kernel now | ceiling | KB in flight / SM | blocks / SM | registers | "
             "local B |", "| --- | --- | --- | --- | --- | --- | --- |"]
    variants = sorted((m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), name)
                      for name in before if (m := DECODE.match(name)))
    for dtype, cache, head_dim, group, name in variants:
        if groups and group not in groups:
            continue
        mma = f"decode_mma_kernel<{dtype}, {head_dim}>"
        current = now.get(mma) if dtype == cache else None
        current_name = mma if current else name
        current = current or now.get(name)
        if current is None:
            continue
        cells = [f"{a} → {b}" for a, b in zip(figures(before[name]), figures(current))]
        kernel = "tensor cores" if current_name == mma else "CUDA cores"
        lines.append(f"| {dtype}, {cache}, {head_dim}, {group} | {kernel} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=ROOT / "scripts" / "sass_baseline.json")
    parser.add_argument("--report", default=ROOT / "build" / "sass_report.json",
                        help="scripts/sass_report.py --json-out of the build (scripts/setup.sh writes this one)")
    parser.add_argument("--groups", default="", help="only these heads per block, e.g. 1,4,8")
    args = parser.parse_args()
    groups = {int(g) for g in args.groups.split(",") if g}
    print(table(json.loads(Path(args.baseline).read_text()), json.loads(Path(args.report).read_text()), groups))


if __name__ == "__main__":
    main()
