"""The GPU check's benchmark (scripts/gpu_check.sh): in one process, paged_attn's CUDA kernels beside what the same
device and the same torch offer, so that every figure comes with its yardstick from the same run:

  limits   a device-to-device copy (bytes read + written / s: the bandwidth limit) and a bf16 torch.matmul (the
           tensor-core limit);
  decode   paged_attention, one query token per sequence, head dim 128, block 16, on a batch x context grid for
           MHA (32 heads / 32 kv heads), GQA-4 (32/8) and GQA-8 (64/8), bf16 and fp8 e4m3 caches (bf16 queries);
           peers on the same keys/values: SDPA over them laid out contiguously, flash and cuDNN backends (the
           unpaged upper bound; a backend that refuses a case says so);
  shared   64 rows sharing a 2,048-token prefix, 256 tokens each of their own: paged_attention with
           plan_shared_blocks' plan, without it, and on distinct copies of the prefix;
  prefill  a 4,096-token prompt and a 1,024-token chunk after a 3,072-token prefix (GQA-4, bf16): the tensor-core
           kernel (query_start_loc) in TFLOP/s against SDPA flash/cuDNN on contiguous keys/values and matmul;
  mla      mla_attention (DeepSeek-V3's latent row: 512 + 64, bf16, block 64) decode at 16 and 128 heads on a
           batch x context grid, in TFLOP/s against matmul and GB/s of latent rows against the copy;
  flex     FlexAttention over a paged cache (pages of 128 tokens, the size its block mask needs; compiled) on the
           bf16 decode cases of --flex-cases, last: each case compiles first.

Every case is checked against paged_attn.reference (a few rows) before it is timed; times are medians of CUDA-event
timings with the L2 cache flushed before each (bench/common.py's Timer). A case that fails its check, or that a peer
refuses, is recorded with its error and the run goes on. Once --budget seconds have passed, the remaining cases are
skipped and say so. Writes every figure to --json and a markdown summary (tables for bench/RESULTS.md) to --summary.

    python bench/bench_gpu.py --json gpu.json --summary gpu.md      # the GPU check: ~3 min on an H100
    python bench/bench_gpu.py --device cpu --tiny                   # the dry run: every step, tiny cases, CPU
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F

from common import (FP8_DTYPES, Timer, decode_case, dense_layout, describe_host, device_copy_bandwidth,
                    matmul_tflops, quantize_fp8_caches)

import paged_attn
from paged_attn import reference

HEADS = {"MHA": (32, 32), "GQA-4": (32, 8), "GQA-8": (64, 8)}  # (query heads, kv heads)
HEAD_DIM, BLOCK_SIZE, FLEX_PAGE = 128, 16, 128


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3")
    parser.add_argument("--flex-cases", default="GQA-4:64:1024,GQA-4:16:8192",
                        help="heads:batch:context of the bf16 decode cases FlexAttention runs (each compiles)")
    parser.add_argument("--mla-batch-sizes", default="1,32,128")
    parser.add_argument("--mla-contexts", default="1024,8192,32768")
    parser.add_argument("--mla-heads", default="16,128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-kv-gib", type=float, default=12.0,
                        help="skip decode cases whose bf16 keys/values are larger (the peers hold a second copy)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; later cases are skipped")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="the dry run: batch 2 x context 64/130, 2 repeats, small prefill, eager FlexAttention")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--summary", help="write the markdown summary here")
    args = parser.parse_args()
    if args.tiny:
        args.batch_sizes, args.contexts, args.repeats = "2", "64,130", 2
        args.flex_cases = "GQA-4:2:130"
        args.mla_batch_sizes, args.mla_contexts, args.mla_heads = "2", "130", "16"
    return args


class Run:
    """The figures of one run, the clock of its budget, and the checks and timings every case goes through."""

    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        self.timer = Timer(self.device)
        self.started = time.monotonic()
        self.results = {"host": describe_host(), "torch": torch.__version__, "cuda": torch.version.cuda,
                        "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "CPU",
                        "limits": {}, "decode": [], "shared": [], "prefill": [], "mla": [], "flex": [], "skipped": [],
                        "errors": []}

    def over_budget(self, what: str) -> bool:
        if time.monotonic() - self.started <= self.args.budget:
            return False
        self.results["skipped"].append(what)
        return True

    def time(self, name: str, fn, check=None):
        """Seconds of ``fn`` after ``check()`` (which raises on a wrong result); None, with the error recorded, if
        either fails."""
        try:
            if check is not None:
                check()
            return self.timer(fn, self.args.repeats)
        except Exception as e:  # a peer refusing a case, or a wrong result: recorded, the run goes on
            self.results["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            return None


def limits(run: Run) -> None:
    lim = run.results["limits"]
    lim["copy_GBps"] = device_copy_bandwidth(run.timer, run.device, run.args.repeats) / 1e9
    lim["matmul_bf16_TFLOPs"] = matmul_tflops(run.timer, torch.bfloat16, run.args.repeats, run.device,
                                               sizes=(512,) if run.args.tiny else (8192,))


def paged_case(batch, context, heads, device):
    """A bf16 decode case of HEADS[heads], head dim 128, block 16 (common.decode_case)."""
    return decode_case(batch, context, *HEADS[heads], HEAD_DIM, BLOCK_SIZE, device, torch.bfloat16)


def reference_rows(case, rows, **kwargs):
    """The float64 reference's output (as float32) for the case's ``rows``."""
    query, key_cache, value_cache, block_tables, seq_lens = case
    return reference.paged_attention(query[rows], key_cache, value_cache, block_tables[rows], seq_lens[rows],
                                     **kwargs).float()


def check_rows(output, rows, expected):
    """``output()`` (the whole batch's, [num_seqs, num_heads, head_dim]) on ``rows`` against ``expected``."""
    torch.testing.assert_close(output()[rows].float(), expected, rtol=2e-2, atol=2e-2)


def contiguous_kv(case, context):
    """The case's keys and values as [batch, kv_heads, context, head_dim] contiguous tensors (not timed)."""
    _, key_cache, value_cache, block_tables, _ = case
    return dense_layout(key_cache, block_tables, context), dense_layout(value_cache, block_tables, context)


def sdpa_peers(run: Run, name: str, query, keys, values, rows, expected) -> dict:
    """SDPA on contiguous keys/values with each backend that takes the case: {backend: seconds or None}; checked on
    ``rows`` against ``expected``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = query[:, :, None, :]
    times = {}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        def call(b=getattr(SDPBackend, backend)):
            with sdpa_kernel([b]):
                return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        check = lambda: check_rows(lambda: call()[:, :, 0], rows, expected)  # noqa: E731
        times[backend.split("_")[0].lower()] = run.time(f"{name} SDPA {backend}", call,
                                                        check if run.device.type == "cuda" else None)
    return times


def flex_paged(run: Run, case, context):
    """FlexAttention over a paged copy of the case's keys/values (pages of FLEX_PAGE tokens, scattered): the
    decode call, its block mask built once outside the timing. Each query row (one per sequence) sees its own
    pages' first ``context`` tokens."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    query, key_cache, value_cache, block_tables, _ = case
    batch, num_heads, _ = query.shape
    pages_per_seq = math.ceil(context / FLEX_PAGE)
    num_pages = batch * pages_per_seq
    order = torch.randperm(num_pages, device=query.device)  # physical page of (seq, logical page), flattened
    owner = torch.empty(num_pages, dtype=torch.long, device=query.device)
    position = torch.empty_like(owner)
    owner[order] = torch.arange(num_pages, device=query.device) // pages_per_seq
    position[order] = torch.arange(num_pages, device=query.device) % pages_per_seq
    keys, values = contiguous_kv(case, context)  # [batch, kv_heads, context, dim]
    pad = pages_per_seq * FLEX_PAGE - context
    paged = lambda x: F.pad(x, (0, 0, 0, pad)).unflatten(2, (pages_per_seq, FLEX_PAGE)).permute(  # noqa: E731
        1, 0, 2, 3, 4).flatten(1, 2)[:, torch.argsort(order)].flatten(1, 2)[None]  # [1, kv_heads, pages*P, dim]
    k_pages, v_pages = paged(keys), paged(values)

    def visible(b, h, q_idx, kv_idx):
        page = kv_idx // FLEX_PAGE
        return (owner[page] == q_idx) & (position[page] * FLEX_PAGE + kv_idx % FLEX_PAGE < context)

    q = query.transpose(0, 1)[None]  # [1, heads, batch, dim]: sequence b's row at position b
    mask = create_block_mask(visible, None, None, batch, num_pages * FLEX_PAGE, device=query.device,
                             BLOCK_SIZE=(16 if batch <= 16 else 64, FLEX_PAGE))
    attend = torch.compile(flex_attention) if run.device.type == "cuda" else flex_attention
    return lambda: attend(q, k_pages, v_pages, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)


def decode(run: Run) -> None:
    args = run.args
    for kv_dtype in args.kv_dtypes.split(","):
        for heads in HEADS:
            for batch in map(int, args.batch_sizes.split(",")):
                for context in map(int, args.contexts.split(",")):
                    name = f"decode {kv_dtype} {heads} {batch}x{context}"
                    if run.over_budget(name):
                        continue
                    if 2 * batch * context * HEADS[heads][1] * HEAD_DIM * 2 > args.max_kv_gib * 2**30:
                        run.results["skipped"].append(f"{name} (over --max-kv-gib)")
                        continue
                    try:
                        run.results["decode"].append(decode_row(run, name, kv_dtype, heads, batch, context))
                    except Exception as e:  # (out of memory, say): recorded, the grid goes on
                        run.results["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
                    if run.device.type == "cuda":
                        torch.cuda.empty_cache()


def decode_row(run: Run, name: str, kv_dtype: str, heads: str, batch: int, context: int) -> dict:
    """One decode case: paged_attention's time and bandwidth, and for a bf16 cache the SDPA peers' times."""
    fp8 = FP8_DTYPES.get(kv_dtype)
    case = paged_case(batch, context, heads, run.device)
    kv_bytes = 2 * batch * context * HEADS[heads][1] * HEAD_DIM * (1 if fp8 else 2)
    row = {"kv_dtype": kv_dtype, "heads": heads, "batch": batch, "context": context, "kv_MiB": kv_bytes / 2**20}
    kwargs = {}
    if fp8:
        caches, scales = quantize_fp8_caches(case[1], case[2], fp8)
        case = (case[0], *caches, case[3], case[4])
        kwargs = dict(k_scale=scales[0], v_scale=scales[1])
    out = torch.empty_like(case[0])
    call = lambda: paged_attn.paged_attention(*case, out=out, **kwargs)  # noqa: E731
    rows = sorted({0, batch - 1})
    seconds = run.time(name, call, lambda: check_rows(call, rows, reference_rows(case, rows, **kwargs)))
    row["paged_us"] = seconds and seconds * 1e6
    row["paged_GBps"] = seconds and kv_bytes / seconds / 1e9
    if not fp8:  # the peers read the bf16 keys/values: the same bytes as the bf16 cache
        keys, values = contiguous_kv(case, context)
        row["sdpa_us"] = {b: s and s * 1e6 for b, s in
                          sdpa_peers(run, name, case[0], keys, values, rows, reference_rows(case, rows)).items()}
    return row


def flex(run: Run) -> None:
    """FlexAttention over a paged cache on the --flex-cases (bf16), after the rest: each compiles first."""
    for spec in filter(None, run.args.flex_cases.split(",")):
        heads, batch, context = spec.split(":")
        batch, context = int(batch), int(context)
        name = f"decode bfloat16 {heads} {batch}x{context} FlexAttention"
        if run.over_budget(name):
            continue
        case = paged_case(batch, context, heads, run.device)
        rows = sorted({0, batch - 1})
        expected = reference_rows(case, rows)
        row = {"heads": heads, "batch": batch, "context": context}
        try:
            began = time.monotonic()
            call = flex_paged(run, case, context)
            seconds = run.time(name, call, lambda: check_rows(call, rows, expected))
            row["compile_and_check_s"] = round(time.monotonic() - began, 1)
        except Exception as e:
            run.results["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            seconds = None
        row["flex_us"] = seconds and seconds * 1e6
        paged = [r for r in run.results["decode"] if (r["kv_dtype"], r["heads"], r["batch"], r["context"]) ==
                 ("bfloat16", heads, batch, context)]
        row["paged_us"] = paged[0]["paged_us"] if paged else None
        run.results["flex"].append(row)


def shared(run: Run) -> None:
    num_heads, num_kv_heads = HEADS["GQA-4"]
    num_seqs, prefix, tail = (4, 64, 32) if run.args.tiny else (64, 2048, 256)
    name = f"shared GQA-4 {num_seqs}x({prefix}+{tail})"
    if run.over_budget(name):
        return
    prefix_blocks, tail_blocks = prefix // BLOCK_SIZE, tail // BLOCK_SIZE
    num_blocks = prefix_blocks * (num_seqs + 1) + tail_blocks * num_seqs
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_cache, value_cache = (torch.randn(shape, dtype=torch.bfloat16, device=run.device) for _ in "kv")
    perm = torch.randperm(num_blocks).to(torch.int32)
    common_prefix = perm[:prefix_blocks]
    own = perm[prefix_blocks:].view(num_seqs, -1)  # each row's copy of the prefix, then its own tail
    shared_tables = torch.cat([common_prefix.expand(num_seqs, -1), own[:, :tail_blocks]], 1)
    distinct_tables = torch.cat([own[:, tail_blocks:], own[:, :tail_blocks]], 1)
    for tables in (shared_tables, distinct_tables):  # the distinct copies hold the prefix's keys/values
        key_cache[tables[:, :prefix_blocks].long()] = key_cache[common_prefix.long()]
        value_cache[tables[:, :prefix_blocks].long()] = value_cache[common_prefix.long()]
    seq_lens = torch.full((num_seqs,), prefix + tail, dtype=torch.int32)
    plan = paged_attn.plan_shared_blocks(shared_tables, seq_lens, BLOCK_SIZE,
                                         num_queries_per_kv=num_heads // num_kv_heads).to(run.device)
    query = torch.randn(num_seqs, num_heads, HEAD_DIM, dtype=torch.bfloat16, device=run.device)
    shared_tables, distinct_tables, seq_lens = (t.to(run.device) for t in (shared_tables, distinct_tables, seq_lens))
    plan_kwargs = dict(shared_plan=plan) if run.device.type == "cuda" else {}  # (the CPU decode finds them itself)
    row = {"case": name}
    for method, tables, kwargs in (("with plan", shared_tables, plan_kwargs), ("without", shared_tables, {}),
                                   ("distinct copies", distinct_tables, {})):
        case = (query, key_cache, value_cache, tables, seq_lens)
        out = torch.empty_like(query)
        call = lambda: paged_attn.paged_attention(*case, out=out, **kwargs)  # noqa: E731
        seconds = run.time(f"{name} {method}", call,
                           lambda: check_rows(call, [0, num_seqs - 1], reference_rows(case, [0, num_seqs - 1])))
        row[method] = seconds and seconds * 1e6
    run.results["shared"].append(row)


def prefill(run: Run) -> None:
    num_heads, num_kv_heads = HEADS["GQA-4"]
    cases = {"prompt": (4096, 4096), "chunk": (4096, 1024)} if not run.args.tiny else {"prompt": (96, 96),
                                                                                        "chunk": (96, 32)}
    for label, (seq_len, query_len) in cases.items():
        name = f"prefill {label} {query_len} of {seq_len}"
        if run.over_budget(name):
            continue
        case = paged_case(1, seq_len, "GQA-4", run.device)
        query = torch.randn(query_len, num_heads, HEAD_DIM, dtype=torch.bfloat16, device=run.device)
        starts = torch.tensor([0, query_len], dtype=torch.int32, device=run.device)
        paged = (query, *case[1:])
        out = torch.empty_like(query)
        call = lambda: paged_attn.paged_attention(*paged, query_start_loc=starts, max_query_len=query_len,  # noqa
                                                  out=out)
        keys, values = contiguous_kv(case, seq_len)
        q = query.transpose(0, 1)[None]
        visible = torch.arange(seq_len, device=run.device)[None] <= torch.arange(
            seq_len - query_len, seq_len, device=run.device)[:, None]
        expected = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=visible,
                                                  enable_gqa=True)[0].transpose(0, 1)
        check = lambda: torch.testing.assert_close(call().float(), expected, rtol=2e-2, atol=2e-2)  # noqa: E731
        flops = 4.0 * num_heads * HEAD_DIM * sum(seq_len - query_len + i + 1 for i in range(query_len))
        row = {"case": name, "GFLOP": flops / 1e9}
        seconds = run.time(name, call, check)
        row["paged_TFLOPs"] = seconds and flops / seconds / 1e12
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            mask = dict(is_causal=True) if seq_len == query_len else dict(attn_mask=visible)

            def sdpa(b=getattr(SDPBackend, backend), mask=mask):
                with sdpa_kernel([b]):
                    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **mask)
            sdpa_check = lambda: torch.testing.assert_close(sdpa()[0].transpose(0, 1).float(), expected,  # noqa
                                                            rtol=2e-2, atol=2e-2)
            s = run.time(f"{name} SDPA {backend}", sdpa, sdpa_check if run.device.type == "cuda" else None)
            row[f"sdpa_{backend.split('_')[0].lower()}_TFLOPs"] = s and flops / s / 1e12
        run.results["prefill"].append(row)


MLA_RANK, MLA_ROPE, MLA_BLOCK = 512, 64, 64


def mla(run: Run) -> None:
    """mla_attention decode over a bf16 latent cache: per case its time, TFLOP/s (2 heads x (576 + 512) flops per
    latent row and head) and GB/s of latent rows read."""
    args, row_width = run.args, MLA_RANK + MLA_ROPE
    for heads in map(int, args.mla_heads.split(",")):
        for batch in map(int, args.mla_batch_sizes.split(",")):
            for context in map(int, args.mla_contexts.split(",")):
                name = f"mla {heads} heads {batch}x{context}"
                if run.over_budget(name):
                    continue
                cache_bytes = batch * context * row_width * 2
                if cache_bytes > args.max_kv_gib * 2**30:
                    run.results["skipped"].append(f"{name} (over --max-kv-gib)")
                    continue
                try:
                    blocks_per_seq = -(-context // MLA_BLOCK)
                    kv_cache = torch.randn(batch * blocks_per_seq, MLA_BLOCK, row_width, dtype=torch.bfloat16,
                                           device=run.device)
                    block_tables = torch.randperm(batch * blocks_per_seq, device=run.device).to(torch.int32)
                    block_tables = block_tables.view(batch, blocks_per_seq)
                    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=run.device)
                    query = torch.randn(batch, heads, row_width, dtype=torch.bfloat16, device=run.device)
                    kwargs = dict(kv_lora_rank=MLA_RANK, scale=0.1147)
                    out = torch.empty(batch, heads, MLA_RANK, dtype=torch.bfloat16, device=run.device)
                    call = lambda: paged_attn.mla_attention(query, kv_cache, block_tables, seq_lens, out=out,  # noqa
                                                            **kwargs)
                    rows = sorted({0, batch - 1})
                    expected = reference.mla_attention(query[rows], kv_cache, block_tables[rows], seq_lens[rows],
                                                       **kwargs).float()
                    seconds = run.time(name, call, lambda: check_rows(call, rows, expected))
                    flops = 2.0 * batch * heads * context * (row_width + MLA_RANK)
                    run.results["mla"].append({"heads": heads, "batch": batch, "context": context,
                                               "cache_MiB": cache_bytes / 2**20, "us": seconds and seconds * 1e6,
                                               "TFLOPs": seconds and flops / seconds / 1e12,
                                               "GBps": seconds and cache_bytes / seconds / 1e9})
                except Exception as e:  # (out of memory, say): recorded, the grid goes on
                    run.results["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()


def fmt(x, digits=0):
    return "-" if x is None else f"{x:.{digits}f}"


def summary(results) -> str:
    lim = results["limits"]
    copy, peak = lim.get("copy_GBps", math.nan), lim.get("matmul_bf16_TFLOPs", math.nan)
    lines = [f"# bench_gpu.py on {results['device']}, torch {results['torch']} (CUDA {results['cuda']})", "",
             f"- limits in this run: device copy {copy:.0f} GB/s (read + written); bf16 matmul {peak:.0f} TFLOP/s",
             f"- host: {results['host']}", "", "## decode (head dim 128, block 16; us, and GB/s of K/V read)", "",
             "| cache | heads | batch | context | KV MiB | paged us | GB/s | % of copy | SDPA flash us "
             "| SDPA cuDNN us |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["decode"]:
        sdpa = r.get("sdpa_us", {})
        lines.append(f"| {r['kv_dtype']} | {r['heads']} | {r['batch']} | {r['context']} | {r['kv_MiB']:.0f} | "
                     f"{fmt(r['paged_us'], 1)} | {fmt(r['paged_GBps'])} | "
                     f"{fmt(r['paged_GBps'] and 100 * r['paged_GBps'] / copy)}% | {fmt(sdpa.get('flash'), 1)} | "
                     f"{fmt(sdpa.get('cudnn'), 1)} |")
    lines += ["", "## shared prefix (us)", "", "| case | with plan | without | distinct copies |",
              "|---|---:|---:|---:|"]
    for r in results["shared"]:
        lines.append(f"| {r['case']} | {fmt(r['with plan'], 1)} | {fmt(r['without'], 1)} | "
                     f"{fmt(r['distinct copies'], 1)} |")
    lines += ["", "## prefill (GQA-4, bf16; TFLOP/s of the causal work)", "",
              "| case | paged | % of matmul | SDPA flash | SDPA cuDNN |", "|---|---:|---:|---:|---:|"]
    for r in results["prefill"]:
        lines.append(f"| {r['case']} | {fmt(r['paged_TFLOPs'], 1)} | "
                     f"{fmt(r['paged_TFLOPs'] and 100 * r['paged_TFLOPs'] / peak)}% | "
                     f"{fmt(r['sdpa_flash_TFLOPs'], 1)} | {fmt(r['sdpa_cudnn_TFLOPs'], 1)} |")
    lines += ["", "## MLA decode (512 + 64, bf16, block 64)", "",
              "| heads | batch | context | cache MiB | us | TFLOP/s | % of matmul | GB/s | % of copy |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["mla"]:
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['cache_MiB']:.0f} | {fmt(r['us'], 1)} | "
                     f"{fmt(r['TFLOPs'], 1)} | {fmt(r['TFLOPs'] and 100 * r['TFLOPs'] / peak)}% | "
                     f"{fmt(r['GBps'])} | {fmt(r['GBps'] and 100 * r['GBps'] / copy)}% |")
    lines += ["", "## FlexAttention over a paged cache (bf16, pages of 128; us)", "",
              "| heads | batch | context | paged_attention | FlexAttention | its compile and check, s |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in results["flex"]:
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {fmt(r['paged_us'], 1)} | "
                     f"{fmt(r['flex_us'], 1)} | {fmt(r.get('compile_and_check_s'), 1)} |")
    for key, title in (("skipped", "skipped (past the budget)"), ("errors", "errors and refusals")):
        if results[key]:
            lines += ["", f"## {title}", ""] + [f"- {x}" for x in results[key]]
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    torch.manual_seed(0)
    run = Run(args)
    for step in (limits, decode, shared, prefill, mla, flex):
        began = time.monotonic()
        try:
            step(run)
        except Exception:
            run.results["errors"].append(f"{step.__name__}: {traceback.format_exc()[-1500:]}")
        run.results.setdefault("step_seconds", {})[step.__name__] = round(time.monotonic() - began, 1)
    text = summary(run.results)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run.results, f, indent=1)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(text)
    # A wrong result of ours fails the run (a peer's refusal does not).
    ours = [e for e in run.results["errors"] if "SDPA" not in e and "FlexAttention" not in e]
    if ours:
        raise SystemExit(f"{len(ours)} case(s) of paged_attn failed: see the errors above")


if __name__ == "__main__":
    main()
