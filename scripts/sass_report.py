"""The performance report of the CUDA kernels, read from their sm_90 machine code (SASS), without a GPU.

    python scripts/sass_report.py paged_attn/_C*.so            # the report (scripts/setup.sh: build/sass_report.txt)
    python scripts/sass_report.py --json FILE                  # the same, as JSON
    python scripts/sass_report.py --check-decode FILE          # exit 1 unless the decode targets below are met
    python scripts/sass_report.py --check-prefill FILE         # the same for the prefill targets
    python scripts/sass_report.py --check-mla FILE             # the same for the MLA targets
    python scripts/sass_report.py --kernels 'decode_mma_kernel<bf16' FILE   # only these kernels (faster)
    python scripts/sass_report.py --baseline scripts/sass_baseline.json FILE      # before -> after; exit 1 if worse
    (FILE may also be a report saved with --json or --json-out: nothing is disassembled then)

For every kernel of the binary (a shared library or a cubin): registers, local memory (stack frame and local
variables), static and dynamic shared memory, threads per block (from __launch_bounds__) and the resident blocks and
warps per SM on sm_90. For every innermost loop that streams from global memory (found from the branches of the SASS:
a backward branch closes a loop; a loop that contains no other is innermost; it streams when it has vector loads,
LDG.64/.128 or LDGSTS.64/.128 = cp.async, as the K/V loops of the attention kernels do): its instructions, its
global loads by width (LDG .128/.64/.32 and narrower, LDGSTS), generic loads and stores (LD/ST, which may be to
shared memory), shared accesses (LDS, LDSM = ldmatrix, STS), HMMA, shuffles, the bytes a lane streams per
iteration (its vector loads: the cache rows; scalar loads, block-table entries and lengths, are counted as
instructions but not as bytes, being mostly cache hits), instructions per 16 bytes streamed, and the bytes a lane
has in flight at the loop's peak. For each kernel, from its loops:

  issue ceiling   = 4 instructions per clock per SM x bytes per warp instruction x 132 SMs x 1.98 GHz / 4.8 TB/s
                    (bytes per warp instruction = 32 lanes x 16 B / the loops' mean instructions per 16 B)
  bytes in flight = peak bytes in flight per lane x 32 lanes x resident warps per SM

The model's assumptions (it is a ceiling and a proxy, not a prediction of speed):
- The loops dominate: the instructions outside them (the softmax between tiles, the prologue, the write-back) are
  not counted, nor are slow paths reached by CALL. Predicated-off instructions take an issue slot like any other.
- Every warp issues at most one instruction per clock on each of the SM's 4 schedulers, with no stall: the ceiling
  is the bandwidth at which issue alone would stop the kernel. Above 100% the kernel is not issue-bound; the
  margin is what latency, bank conflicts and the code outside the loops may take. It says nothing about DRAM.
- The loops of a kernel move equal byte totals (the K loop and the V loop read one row each per token), so the
  kernel's instructions per 16 B is the mean over its loops.
- A (vector) load is in flight from its issue until the first instruction that reads or overwrites one of its destination
  registers (LDG), or until the DEPBAR that waits for its commit group (LDGSTS: LDGDEPBAR closes a group,
  DEPBAR.LE SB0, N leaves N groups in flight); the loop runs four times from an empty state (software pipelining
  carries loads across the back edge) and the peak of the last iteration counts. Real scoreboards are coarser.
- Every lane of every resident warp runs the loop at once (resident warps from the occupancy below).
- sm_90 (H100/H200 SXM): 132 SMs at 1.98 GHz (boost), 4.8 TB/s of HBM (H200), 65,536 registers per SM allocated
  per warp in units of 256, 228 KB of shared memory per SM with 1 KB reserved per block, at most 32 blocks and 64
  warps per SM.

Finds cuobjdump in $CUDA_HOME/bin, /usr/local/cuda/bin, on PATH, or inside Triton's package. Needs only the
standard library (and c++filt for readable names); the dynamic shared memory of the tensor-core kernel comes from
paged_attn._C._launch_plan when the package imports.
"""

import argparse
import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ptxas_report import demangle, natural, short  # noqa: E402  (the same names as the ptxas table)

SM90 = dict(sms=132, clock_hz=1.98e9, hbm_bytes_per_s=4.8e12, issue_per_clock=4, regs_per_sm=65536, reg_unit=256,
            smem_per_sm=228 * 1024, smem_reserved_per_block=1024, max_blocks=32, max_warps=64)

# The decode targets (issue 22): bfloat16 and float16, head dim 128, MHA / GQA-4 / GQA-8. One tensor-core kernel
# serves every group (its heads are the N = 8 columns of the products, a run-time count), so the three variants are
# the same machine code.
DECODE_TARGETS = dict(ceiling=1.5, in_flight_bytes=32 * 1024, local_bytes=0)
DECODE_KERNEL = re.compile(r"^decode_mma_kernel<(bf16|half), 128>$")

# The prefill targets (issue 23): the tensor-core kernel of query_start_loc, bfloat16 and float16 over caches of the
# same dtype, head dims 64, 128 and 256. Its main loop is the streaming loop with the largest HMMA share (the
# unmasked key steps without soft cap or ALiBi); "issued per key step" is its instruction count, every instruction
# of the loop body counted once.
PREFILL_TARGETS = dict(hmma_share=0.15, blocks_per_sm=2, local_bytes=0, generic=0)
PREFILL_KERNEL = re.compile(r"^varlen_attention_kernel<(bf16|half), (bf16|half), (64|128|256)>$")

# The MLA targets (issue 51): the latent-attention kernel at DeepSeek-V3's 512 + 64, bfloat16 and float16. Its
# main loop is the streaming loop with the largest HMMA share (its only one: the step loop); bytes in flight per SM
# at its resident blocks.
MLA_TARGETS = dict(hmma_share=0.30, blocks_per_sm=1, in_flight_bytes=64 * 1024, local_bytes=0, generic=0)
MLA_KERNEL = re.compile(r"^mla_attention_kernel<(bf16|half), 512, 64>$")


# ---------------------------------------------------------------------------------------------------------------
# Reading the binary.

def find_cuobjdump():
    candidates = [os.path.join(d, "bin", "cuobjdump") for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d]
    candidates.append(shutil.which("cuobjdump"))
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "cuobjdump"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("cuobjdump not found (looked in $CUDA_HOME/bin, /usr/local/cuda/bin, PATH and "
                            "Triton's package)")


def cuobjdump(path, *args):
    result = subprocess.run([find_cuobjdump(), *args, path], capture_output=True, text=True)
    if result.returncode != 0 and not result.stdout:
        raise RuntimeError(f"cuobjdump {' '.join(args)} {path} failed: {result.stderr.strip()}")
    return result.stdout


@dataclasses.dataclass
class Instruction:
    address: int
    predicate: str  # "" or e.g. "@!P0"
    opcode: str     # with modifiers: "LDG.E.128.CONSTANT"
    operands: list  # strings, the destination first (stores: the address first)

    @property
    def base(self):
        return self.opcode.split(".")[0]


INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")


def parse_sass(text):
    """cuobjdump -sass output -> {mangled function name: [Instruction]} (sm_90 code only when several archs)."""
    functions, current, arch = {}, None, None
    for line in text.splitlines():
        if line.strip().startswith("code for sm_"):
            arch = line.strip().split()[-1]
            continue
        if m := FUNCTION.match(line):
            current = None if arch not in (None, "sm_90", "sm_90a") else functions.setdefault(m.group(1), [])
            continue
        if current is not None and (m := INSTRUCTION.match(line)):
            operands = [o.strip() for o in m.group(4).split(",") if o.strip()]
            current.append(Instruction(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), operands))
    return functions


RESOURCES = re.compile(r"^\s*Function\s+(\S+):\s*$")
RESOURCE_VALUES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_resources(text):
    """cuobjdump -res-usage -> {name: (registers, stack bytes, shared bytes incl. the 1 KB reserved, local bytes)}."""
    table, name = {}, None
    for line in text.splitlines():
        if m := RESOURCES.match(line):
            name = m.group(1)
        elif name and (m := RESOURCE_VALUES.search(line)):
            table[name] = tuple(int(g) for g in m.groups())
            name = None
    return table


def parse_max_threads(text):
    """cuobjdump -elf -> {name: threads per block from __launch_bounds__ (EIATTR_MAX_THREADS)}."""
    threads, section, attribute = {}, None, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(".nv.info."):
            section = line[len(".nv.info."):]
        elif line.startswith("Attribute:"):
            attribute = line.split()[-1]
        elif line.startswith("Value:") and attribute == "EIATTR_MAX_THREADS" and section:
            values = [int(v, 16) for v in line.split()[1:]]
            threads[section] = math.prod(values)
            attribute = None
    return threads


# ---------------------------------------------------------------------------------------------------------------
# Loops and what they load.

def branch_target(ins):
    if ins.base not in ("BRA", "BRX", "JMP") or not ins.operands:
        return None
    m = re.match(r"^(0x[0-9a-f]+)$", ins.operands[-1])
    return int(m.group(1), 16) if m else None


def find_loops(instructions):
    """Loops as (first, last) indices into instructions: a backward branch closes a loop from its target to itself
    (several back edges to one target make one loop). Innermost loops contain no other."""
    index = {ins.address: i for i, ins in enumerate(instructions)}
    ends = {}
    for i, ins in enumerate(instructions):
        target = branch_target(ins)
        if target is not None and target < ins.address and target in index:
            ends[index[target]] = max(ends.get(index[target], i), i)
        # (a branch to itself after EXIT is the end-of-code trap, not a loop: target == address)
    loops = sorted(ends.items())
    return [(a, b) for a, b in loops if not any(c >= a and d <= b and (c, d) != (a, b) for c, d in loops)]


def load_width(ins):
    """Bytes per lane of a global (LDG, LDGSTS) or generic (LD) load; None for other instructions."""
    if ins.base not in ("LDG", "LDGSTS", "LD"):
        return None
    mods = ins.opcode.split(".")[1:]
    for mod, width in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if mod in mods:
            return width
    return 4


def registers(operand, width=1):
    """The registers an operand names: R4 -> [4]; R4.64 -> [4, 5]; with width w, R4 -> R4..R4+w-1."""
    found = []
    for m in re.finditer(r"\bR(\d+)(\.64)?", operand):
        n = int(m.group(1))
        found.extend(range(n, n + max(width, 2 if m.group(2) else 1)))
    return found


def operand_width(ins):
    """Registers per register operand: 4 for the fragments of HMMA, else from a .64/.128 suffix of the opcode."""
    if ins.base in ("HMMA", "IMMA", "HGMMA"):
        return 4
    mods = ins.opcode.split(".")
    return 4 if "128" in mods else 2 if "64" in mods else 1


STORES = ("STG", "STS", "ST", "STL", "RED", "ATOM", "ATOMS", "ATOMG", "LDGSTS")


def destinations_and_sources(ins):
    width = operand_width(ins)
    if ins.base in STORES or not ins.operands:
        return [], [r for o in ins.operands for r in registers(o, 1 if "[" in o else width)]
    return registers(ins.operands[0], width), [r for o in ins.operands[1:] for r in registers(o, 1 if "[" in o else width)]


def bytes_in_flight(body, iterations=4):
    """Peak bytes per lane in flight during the last of `iterations` runs of the loop body (see the model)."""
    pending = {}                  # LDG: destination register -> (load id, bytes)
    group, committed = 0, []      # LDGSTS: bytes of the open group; bytes of each committed group, oldest first
    peak = 0
    for iteration in range(iterations):
        for n, ins in enumerate(body):
            dests, sources = destinations_and_sources(ins)
            done = {pending[r][0] for r in dests + sources if r in pending}
            if done:
                pending = {r: v for r, v in pending.items() if v[0] not in done}
            width = load_width(ins)
            if ins.base == "LDGSTS":
                group += width if width >= 8 else 0
            elif ins.base == "LDGDEPBAR":
                committed.append(group)
                group = 0
            elif ins.base == "DEPBAR":
                m = re.search(r"SB0,\s*(0x[0-9a-f]+|\d+)", ",".join(ins.operands))
                keep = int(m.group(1), 0) if m else 0
                committed = committed[len(committed) - keep:] if keep else []
            elif ins.base == "LDG" and width >= 8:
                for r in dests:
                    pending[r] = ((iteration, n), width)
            now = sum(dict(pending.values()).values()) + group + sum(committed)
            if iteration == iterations - 1:
                peak = max(peak, now)
    return peak


@dataclasses.dataclass
class Loop:
    first: int       # address of the first and last instruction
    last: int
    instructions: int
    loads: dict      # "LDG.128" / "LDG.64" / "LDG.32" / "LDG.16" / "LDG.8" / "LDGSTS.128" ... -> count
    generic: int     # LD / ST (generic addressing) instructions
    shared: int      # LDS / LDSM / STS instructions
    hmma: int
    shuffles: int
    bytes_per_lane: int       # streamed from global memory (vector LDG and LDGSTS), per iteration
    in_flight_per_lane: int   # peak bytes per lane (see the model)

    @property
    def per_16_bytes(self):
        return self.instructions * 16 / self.bytes_per_lane if self.bytes_per_lane else math.inf

    @property
    def hmma_share(self):
        return self.hmma / self.instructions if self.instructions else 0.0


def analyse_loop(body):
    loads, generic, shared, hmma, shuffles, nbytes = {}, 0, 0, 0, 0, 0
    for ins in body:
        width = load_width(ins)
        if ins.base in ("LDG", "LDGSTS"):
            key = f"{ins.base}.{width * 8}"
            loads[key] = loads.get(key, 0) + 1
            nbytes += width if width >= 8 else 0
        elif ins.base in ("LD", "ST"):
            generic += 1
        elif ins.base in ("LDS", "LDSM", "STS"):
            shared += 1
        elif ins.base in ("HMMA", "HGMMA"):
            hmma += 1
        elif ins.base == "SHFL":
            shuffles += 1
    return Loop(body[0].address, body[-1].address, len(body), loads, generic, shared, hmma, shuffles, nbytes,
                bytes_in_flight(body) if nbytes else 0)


# ---------------------------------------------------------------------------------------------------------------
# The model.

def occupancy(registers_per_thread, threads, shared_bytes, arch=SM90):
    """(resident blocks per SM, the limiting resource) on sm_90."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers_per_thread * 32 // arch["reg_unit"]) * arch["reg_unit"]
    limits = {
        "blocks": arch["max_blocks"],
        "warps": arch["max_warps"] // warps,
        "registers": (arch["regs_per_sm"] // regs_per_warp) // warps if regs_per_warp else arch["max_blocks"],
        "shared memory": arch["smem_per_sm"] // (shared_bytes + arch["smem_reserved_per_block"]),
    }
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


def issue_ceiling(per_16_bytes, arch=SM90):
    """The fraction of HBM bandwidth at which issuing the loops' instructions alone would limit the kernel."""
    bytes_per_instruction = 32 * 16 / per_16_bytes
    return (arch["issue_per_clock"] * bytes_per_instruction * arch["sms"] * arch["clock_hz"]
            / arch["hbm_bytes_per_s"])


@dataclasses.dataclass
class Kernel:
    name: str
    registers: int
    local_bytes: int     # stack frame + local variables, per thread
    static_shared: int   # bytes, without the 1 KB the runtime reserves
    dynamic_shared: int  # bytes, from the launch plan (None: unknown)
    threads: int         # per block, from __launch_bounds__ (None: not declared)
    loops: list          # [Loop]: innermost loops that stream from global memory
    blocks_per_sm: int = None
    limiter: str = None
    ceiling: float = None              # fraction of HBM bandwidth
    in_flight_per_sm: int = None       # bytes

    def finish(self):
        if self.threads:
            self.blocks_per_sm, self.limiter = occupancy(self.registers, self.threads,
                                                         self.static_shared + (self.dynamic_shared or 0))
        if self.loops:
            self.ceiling = issue_ceiling(sum(loop.per_16_bytes for loop in self.loops) / len(self.loops))
            if self.blocks_per_sm is not None:
                warps = self.blocks_per_sm * -(-self.threads // 32)
                self.in_flight_per_sm = max(loop.in_flight_per_lane for loop in self.loops) * 32 * warps
        return self


def dynamic_shared(name):
    """The dynamic shared memory a kernel is launched with: the tensor-core kernels' from their launch plans."""
    varlen = re.match(r"varlen_attention_kernel<(bf16|half), [^,]+, (\d+)", name)
    decode = re.match(r"decode_mma_kernel<(bf16|half), (\d+)>", name)
    mla = re.match(r"mla_attention_kernel<(bf16|half), (\d+), (\d+)>", name)
    if not varlen and not decode and not mla:
        return 0
    try:
        from paged_attn import _C
    except ImportError:
        return None
    if mla:
        plan = _C._launch_plan("mla_attention", 1, 16, int(mla.group(2)), int(mla.group(3)), 1, 64, 1, 1)
        return None if plan["error"] else plan["shared_bytes"]
    if decode:
        return _C._launch_plan("decode_mma", int(decode.group(2)))["shared_bytes"]
    plan = _C._launch_plan("paged_attention_varlen", 1, 2, 1, 1, int(varlen.group(2)), 2, 1, 16, 0)
    return None if plan["error"] else plan["shared_bytes"]


def report(path, only=None):
    """The kernels of a binary, analysed: [Kernel], in natural order of their names; only: a regular expression
    their short names must match (the others are not disassembled, which takes most of the time)."""
    resources = parse_resources(cuobjdump(path, "-res-usage"))
    names = dict(zip(resources, (short(n) for n in demangle(list(resources)))))
    if only:
        chosen = [n for n in resources if re.search(only, names[n])]
        if not chosen:
            return []
        selection = ("-fun", ",".join(chosen))
    else:
        selection = ()
    functions = parse_sass(cuobjdump(path, "-sass", *selection))
    threads = parse_max_threads(cuobjdump(path, "-elf", *selection))
    mangled = sorted(set(functions) & set(names))
    kernels = []
    for name in mangled:
        regs, stack, shared, local = resources.get(name, (0, 0, 0, 0))
        instructions = functions[name]
        loops = [analyse_loop(instructions[a:b + 1]) for a, b in find_loops(instructions)]
        loops = [loop for loop in loops if loop.bytes_per_lane]
        kernels.append(Kernel(names[name], regs, stack + local, max(shared - SM90["smem_reserved_per_block"], 0),
                              dynamic_shared(names[name]), threads.get(name), loops).finish())
    return sorted(kernels, key=lambda k: natural((k.name, "")))


def decode_targets(kernels):
    """[(kernel, [failed target, ...])] for the decode kernels the targets apply to."""
    rows = []
    for k in kernels:
        if DECODE_KERNEL.match(k.name):
            failed = []
            if k.ceiling is None or k.ceiling < DECODE_TARGETS["ceiling"]:
                failed.append("issue ceiling")
            if k.in_flight_per_sm is None or k.in_flight_per_sm < DECODE_TARGETS["in_flight_bytes"]:
                failed.append("bytes in flight")
            if k.local_bytes > DECODE_TARGETS["local_bytes"]:
                failed.append("local memory")
            rows.append((k, failed))
    return rows


def main_loop(kernel):
    """The streaming loop with the largest HMMA share (None: none has HMMA)."""
    loops = [loop for loop in kernel.loops if loop.hmma]
    return max(loops, key=lambda loop: loop.hmma_share) if loops else None


def loop_targets(kernels, pattern, targets):
    """[(kernel, main loop, [failed target, ...])] for the kernels whose names match ``pattern``, against the
    ``targets`` of its keys (hmma_share, generic, blocks_per_sm, in_flight_bytes, local_bytes)."""
    rows = []
    for k in kernels:
        if pattern.match(k.name):
            loop = main_loop(k)
            failed = []
            if loop is None or loop.hmma_share < targets["hmma_share"]:
                failed.append("HMMA share")
            if loop is None or loop.generic > targets["generic"]:
                failed.append("generic loads/stores")
            if k.blocks_per_sm is None or k.blocks_per_sm < targets["blocks_per_sm"]:
                failed.append("blocks per SM")
            if "in_flight_bytes" in targets and (k.in_flight_per_sm is None or
                                                 k.in_flight_per_sm < targets["in_flight_bytes"]):
                failed.append("bytes in flight")
            if k.local_bytes > targets["local_bytes"]:
                failed.append("local memory")
            rows.append((k, loop, failed))
    return rows


def prefill_targets(kernels):
    """[(kernel, main loop, [failed target, ...])] for the prefill kernels the targets apply to."""
    return loop_targets(kernels, PREFILL_KERNEL, PREFILL_TARGETS)


def mla_targets(kernels):
    """[(kernel, main loop, [failed target, ...])] for the MLA kernels the targets apply to."""
    return loop_targets(kernels, MLA_KERNEL, MLA_TARGETS)


# ---------------------------------------------------------------------------------------------------------------
# Printing.

def fmt(value, spec=""):
    return "-" if value is None else format(value, spec)


def print_report(kernels, out=sys.stdout):
    width = max([len(k.name) for k in kernels] + [6])
    print(f"{'kernel':<{width}}  regs  local B  smem B  dyn B  threads  blocks/SM (limit)  warps/SM  "
          f"ceiling  in flight/SM", file=out)
    for k in kernels:
        warps = k.blocks_per_sm * -(-k.threads // 32) if k.blocks_per_sm is not None else None
        limit = f"{k.blocks_per_sm} ({k.limiter})" if k.blocks_per_sm is not None else "-"
        ceiling = f"{k.ceiling:.0%}" if k.ceiling is not None else "-"
        flight = f"{k.in_flight_per_sm / 1024:.1f} KB" if k.in_flight_per_sm is not None else "-"
        print(f"{k.name:<{width}}  {k.registers:>4}  {k.local_bytes:>7}  {k.static_shared:>6}  "
              f"{fmt(k.dynamic_shared):>5}  {fmt(k.threads):>7}  {limit:<17}  {fmt(warps):>8}  {ceiling:>7}  "
              f"{flight:>12}", file=out)
    print(file=out)
    print("Innermost loops that stream from global memory (per iteration, per lane; bytes: of vector loads):",
          file=out)
    for k in kernels:
        for loop in k.loops:
            loads = " ".join(f"{key}x{n}" for key, n in sorted(loop.loads.items()))
            print(f"  {k.name} [{loop.first:#06x}-{loop.last:#06x}]: {loop.instructions} instructions, "
                  f"{loop.bytes_per_lane} B ({loads}), {loop.per_16_bytes:.1f} per 16 B, HMMA {loop.hmma} "
                  f"({loop.hmma_share:.1%}), "
                  f"SHFL {loop.shuffles}, LDS/STS {loop.shared}, generic LD/ST {loop.generic}, "
                  f"in flight {loop.in_flight_per_lane} B", file=out)
    rows = decode_targets(kernels)
    if rows:
        print(file=out)
        print(f"Decode targets (bf16/fp16, head dim 128, MHA/GQA-4/GQA-8): issue ceiling >= "
              f"{DECODE_TARGETS['ceiling']:.0%}, >= {DECODE_TARGETS['in_flight_bytes'] // 1024} KB in flight per "
              f"SM, no local memory", file=out)
        for k, failed in rows:
            verdict = "met" if not failed else "NOT met: " + ", ".join(failed)
            print(f"  {k.name}: {fmt(k.ceiling and round(100 * k.ceiling))}%, "
                  f"{fmt(k.in_flight_per_sm and k.in_flight_per_sm / 1024, '.1f')} KB, local {k.local_bytes} B: "
                  f"{verdict}", file=out)
    rows = prefill_targets(kernels)
    if rows:
        print(file=out)
        print(f"Prefill targets (tensor-core kernel, bf16/fp16, head dims 64/128/256; its main loop = the streaming "
              f"loop with the largest HMMA share): HMMA >= {PREFILL_TARGETS['hmma_share']:.0%} of its instructions, "
              f"no generic loads/stores in it, >= {PREFILL_TARGETS['blocks_per_sm']} blocks per SM, no local memory",
              file=out)
        for k, loop, failed in rows:
            verdict = "met" if not failed else "NOT met: " + ", ".join(failed)
            share = f"{loop.hmma} HMMA of {loop.instructions} = {loop.hmma_share:.1%}" if loop else "no HMMA loop"
            print(f"  {k.name}: {share}, {fmt(k.blocks_per_sm)} blocks/SM, local {k.local_bytes} B: {verdict}",
                  file=out)
    rows = mla_targets(kernels)
    if rows:
        print(file=out)
        print(f"MLA targets (latent-attention kernel, bf16/fp16, 512 + 64; its main loop = the streaming loop with the "
              f"largest HMMA share): HMMA >= {MLA_TARGETS['hmma_share']:.0%} of its instructions, no generic "
              f"loads/stores in it, >= {MLA_TARGETS['blocks_per_sm']} block per SM with >= "
              f"{MLA_TARGETS['in_flight_bytes'] // 1024} KB in flight, no local memory", file=out)
        for k, loop, failed in rows:
            verdict = "met" if not failed else "NOT met: " + ", ".join(failed)
            share = f"{loop.hmma} HMMA of {loop.instructions} = {loop.hmma_share:.1%}" if loop else "no HMMA loop"
            print(f"  {k.name}: {share}, {fmt(k.blocks_per_sm)} blocks/SM, "
                  f"{fmt(k.in_flight_per_sm and k.in_flight_per_sm / 1024, '.1f')} KB in flight, "
                  f"local {k.local_bytes} B: {verdict}", file=out)


def to_json(kernels):
    """One kernel per line (diffs of a stored baseline stay readable)."""
    def row(k):
        d = dataclasses.asdict(k)
        for loop, raw in zip(k.loops, d["loops"]):
            raw["per_16_bytes"] = round(loop.per_16_bytes, 2)
        d["ceiling"] = None if k.ceiling is None else round(k.ceiling, 4)
        return json.dumps(d, separators=(",", ":"))
    return "[\n" + ",\n".join(row(k) for k in kernels) + "\n]"


def compare(kernels, baseline, out=sys.stdout):
    """Prints each kernel's figures against a baseline (the --json output of an earlier build); returns the names
    of the kernels that got worse: a lower issue ceiling, fewer bytes in flight or resident blocks, more local
    memory (or a loop that the baseline had no longer found)."""
    before = {k["name"]: k for k in baseline}
    worse = []
    width = max([len(k.name) for k in kernels] + [6])
    print(f"{'kernel':<{width}}  {'ceiling':>15}  {'in flight/SM KB':>17}  {'blocks/SM':>9}  {'regs':>9}  local B", file=out)
    for k in kernels:
        b = before.get(k.name)
        if b is None:
            continue
        got_worse = ((b["ceiling"] is not None and (k.ceiling is None or k.ceiling < b["ceiling"] - 0.005))
                     or (b["in_flight_per_sm"] or 0) > (k.in_flight_per_sm or 0)
                     or (b["blocks_per_sm"] or 0) > (k.blocks_per_sm or 0)
                     or k.local_bytes > b["local_bytes"])
        if got_worse:
            worse.append(k.name)

        def pair(x, y, f):
            return f"{'-' if x is None else f(x)} -> {'-' if y is None else f(y)}"

        percent = lambda v: f"{v:.0%}"  # noqa: E731
        kb = lambda v: f"{v / 1024:.1f}"  # noqa: E731
        print(f"{k.name:<{width}}  {pair(b['ceiling'], k.ceiling, percent):>15}  "
              f"{pair(b['in_flight_per_sm'], k.in_flight_per_sm, kb):>17}  "
              f"{pair(b['blocks_per_sm'], k.blocks_per_sm, str):>9}  {pair(b['registers'], k.registers, str):>9}  "
              f"{pair(b['local_bytes'], k.local_bytes, str)}{'  WORSE' if got_worse else ''}", file=out)
    return worse


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary", nargs="?", help="a shared library or cubin (default: paged_attn/_C*.so), or a "
                        "report saved as JSON")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--json-out", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--check-decode", action="store_true", help="exit 1 unless the decode targets are met")
    parser.add_argument("--check-prefill", action="store_true", help="exit 1 unless the prefill targets are met")
    parser.add_argument("--check-mla", action="store_true", help="exit 1 unless the MLA targets are met")
    parser.add_argument("--kernels", metavar="REGEX", help="only the kernels whose short names match")
    parser.add_argument("--baseline", metavar="JSON", help="compare with an earlier --json report; exit 1 if a "
                        "kernel got worse")
    args = parser.parse_args()
    path = args.binary or next(iter(sorted(glob.glob("paged_attn/_C*.so"))), None)
    if not path:
        sys.exit("sass_report: no binary given and no paged_attn/_C*.so")
    if path.endswith(".json"):
        with open(path) as f:
            kernels = [Kernel(**{**k, "loops": [Loop(**{f: v for f, v in loop.items() if f != "per_16_bytes"})
                                                for loop in k["loops"]]}) for k in json.load(f)]
        kernels = [k for k in kernels if not args.kernels or re.search(args.kernels, k.name)]
    else:
        kernels = report(path, args.kernels)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(to_json(kernels) + "\n")
    if not kernels:
        print(f"sass_report: no sm_90 kernels in {path}")
        return
    if args.json:
        print(to_json(kernels))
    elif args.baseline:
        with open(args.baseline) as f:
            worse = compare(kernels, json.load(f))
        if worse:
            sys.exit(f"sass_report: {len(worse)} kernels worse than {args.baseline}: " + ", ".join(worse))
    else:
        print_report(kernels)
    if args.check_decode:
        rows = decode_targets(kernels)
        if not rows or any(failed for _, failed in rows):
            sys.exit("sass_report: decode targets not met" if rows else "sass_report: no decode kernels found")
    if args.check_prefill:
        rows = prefill_targets(kernels)
        if not rows or any(failed for _, _, failed in rows):
            sys.exit("sass_report: prefill targets not met" if rows else "sass_report: no prefill kernels found")
    if args.check_mla:
        rows = mla_targets(kernels)
        if not rows or any(failed for _, _, failed in rows):
            sys.exit("sass_report: MLA targets not met" if rows else "sass_report: no MLA kernels found")


if __name__ == "__main__":
    main()
