"""Time ``ModelRunner.prepare`` (a step's paged metadata: token ids, positions, slot mapping, block tables) for a
decode step and a prefill step, on the CPU: median of repeats (after an untimed one), in microseconds.

    GOMP_SPINCOUNT=0 python bench/bench_prepare.py [--batch 64] [--repeats 7] [--iters 200]
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import torch

from common import describe_host, median_time

from paged_attn.engine.model_runner import ModelRunner
from paged_attn.engine.sequence import Sequence
from paged_attn.engine.step import ScheduledStep


def make_step(batch: int, block_size: int, decode: bool, rng: random.Random) -> ScheduledStep:
    step, next_block = ScheduledStep(), 0
    for _ in range(batch):
        length = rng.randint(100, 1000)
        seq = Sequence(list(range(length)), length // 2)
        num_blocks = -(-length // block_size)
        table = rng.sample(range(next_block, next_block + 2 * num_blocks), num_blocks)
        next_block += 2 * num_blocks
        seq.num_computed_tokens = length - 1 if decode else 0
        step.seqs.append(seq)
        step.num_new_tokens.append(1 if decode else length)
        step.block_tables.append([table])  # one KV-cache group (a Llama)
        # a decode's slot, reserved by the block manager; a prefill's come from the table
        step.reserved_slots.append([table[-1] * block_size + (length - 1) % block_size] if decode else None)
    return step


def time_prepare(step: ScheduledStep, block_size: int, repeats: int, iters: int) -> float:
    # what prepare reads of a runner: one KV-cache group of every layer, a model with GQA 32:8, no shared plans
    config = SimpleNamespace(num_heads=32, num_kv_heads=8)
    runner = SimpleNamespace(block_size=block_size, device=torch.device("cpu"), model=SimpleNamespace(config=config),
                             groups=SimpleNamespace(num_groups=1, layer_group=(0,)), plan_shared_blocks=False)

    def prepare_iters():
        for _ in range(iters):
            ModelRunner.prepare(runner, step)

    return median_time(prepare_iters, repeats) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe_host())
    for kind, decode, iters in (("decode", True, args.iters), ("prefill", False, max(1, args.iters // 20))):
        step = make_step(args.batch, args.block_size, decode, random.Random(0))
        print(f"prepare, {kind} step of {args.batch} sequences ({sum(step.num_new_tokens)} tokens): "
              f"{time_prepare(step, args.block_size, args.repeats, iters):.1f} us (median of {args.repeats})")


if __name__ == "__main__":
    main()
