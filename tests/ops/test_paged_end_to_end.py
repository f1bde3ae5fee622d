"""The block manager driving the real ops: forked sequences with copy-on-write, swapping out and back in, and
prefix caching, checked step by step against attention over each sequence's keys/values kept contiguously.

Every token of every sequence gets its own random key/value; a sequence's truth is the list of its tokens' rows.
Nothing here knows about blocks except through BlockManager, so a wrong slot, a missed copy-on-write or a bad
swap shows up as a wrong attention output.
"""

import pytest
import torch
from conftest import DEVICES

import paged_attn
from paged_attn import BlockManager

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 4


def dense_attention(query, keys, values):
    """query [num_heads, head_dim]; keys, values [seq_len, num_kv_heads, head_dim]; float64."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    values = values.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,thd->ht", query.double(), keys) * HEAD_DIM**-0.5
    return torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), values)


class PagedWorld:
    """GPU-side caches (on `device`), CPU swap space, a BlockManager, and the contiguous truth per sequence."""

    def __init__(self, device, num_kv_blocks=24, num_swap_blocks=16, enable_prefix_caching=False):
        self.device = torch.device(device)
        shape = (num_kv_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.key_cache = torch.full(shape, float("nan"), device=device)
        self.value_cache = torch.full(shape, float("nan"), device=device)
        pin = self.device.type == "cuda"
        self.cpu_key_cache = torch.full((num_swap_blocks,) + shape[1:], float("nan")).pin_memory() if pin else \
            torch.full((num_swap_blocks,) + shape[1:], float("nan"))
        self.cpu_value_cache = self.cpu_key_cache.clone()
        self.manager = BlockManager(num_kv_blocks, BLOCK_SIZE, num_swap_blocks=num_swap_blocks,
                                    enable_prefix_caching=enable_prefix_caching)
        self.prefix_caching = enable_prefix_caching
        self.tokens, self.keys, self.values = {}, {}, {}  # truth per sequence
        self.token_kv = {}  # (prefix) -> the KV its last token gets

    def kv_for(self, prefix):
        """The key/value a token gets depends on the whole prefix up to it (as in a real model)."""
        if prefix not in self.token_kv:
            self.token_kv[prefix] = (torch.randn(NUM_KV_HEADS, HEAD_DIM), torch.randn(NUM_KV_HEADS, HEAD_DIM))
        return self.token_kv[prefix]

    def write(self, seq_tokens):
        """Write the KV of (seq_id, position, token prefix) entries with one reshape_and_cache call."""
        keys, values, slots = [], [], []
        for seq_id, position, prefix in seq_tokens:
            key, value = self.kv_for(prefix)
            keys.append(key)
            values.append(value)
            slots += self.manager.slot_mapping(seq_id, position, position + 1)
        paged_attn.reshape_and_cache(torch.stack(keys).to(self.device), torch.stack(values).to(self.device),
                                     self.key_cache, self.value_cache, torch.tensor(slots, device=self.device))

    def add(self, seq_id, prompt):
        cached = self.manager.allocate(seq_id, prompt)
        self.write([(seq_id, i, tuple(prompt[: i + 1])) for i in range(cached, len(prompt))])
        self.manager.mark_computed(seq_id)
        self.keys[seq_id] = [self.kv_for(tuple(prompt[: i + 1]))[0] for i in range(len(prompt))]
        self.values[seq_id] = [self.kv_for(tuple(prompt[: i + 1]))[1] for i in range(len(prompt))]
        self.tokens[seq_id] = list(prompt)
        return cached

    def fork(self, parent, child):
        self.manager.fork(parent, child)
        self.keys[child], self.values[child] = list(self.keys[parent]), list(self.values[parent])
        self.tokens[child] = list(self.tokens[parent])

    def step(self, new_tokens):
        """Append one token to each sequence: reserve slots (copy-on-write first), then write their KV."""
        cows, entries = [], []
        for seq_id, token in new_tokens.items():
            slot, cow = self.manager.append_slot(seq_id, token)
            if cow is not None:
                cows.append(cow)
            self.tokens[seq_id].append(token)
            prefix = (seq_id,) + tuple(self.tokens[seq_id])  # generated tokens differ per sequence
            entries.append((seq_id, len(self.tokens[seq_id]) - 1, prefix))
            key, value = self.kv_for(prefix)
            self.keys[seq_id].append(key)
            self.values[seq_id].append(value)
        if cows:
            paged_attn.copy_blocks([self.key_cache], [self.value_cache], cows)
        self.write(entries)
        for seq_id in new_tokens:
            self.manager.mark_computed(seq_id)
        return cows

    def swap_out(self, seq_ids):
        mapping = self.manager.swap_out(seq_ids)
        paged_attn.swap_blocks(self.key_cache, self.cpu_key_cache, mapping)
        paged_attn.swap_blocks(self.value_cache, self.cpu_value_cache, mapping)
        # Blocks that no resident sequence holds any more are free: poison them, so a stale read would show.
        resident = {b for s in self.tokens if not self.manager.is_swapped_out(s) for b in self.manager.block_table(s)}
        if not self.prefix_caching:
            for gpu_block, _ in mapping:
                if gpu_block not in resident:
                    self.key_cache[gpu_block] = float("nan")
                    self.value_cache[gpu_block] = float("nan")
        return mapping

    def swap_in(self, seq_ids):
        mapping = self.manager.swap_in(seq_ids)
        paged_attn.swap_blocks(self.cpu_key_cache, self.key_cache, mapping)
        paged_attn.swap_blocks(self.cpu_value_cache, self.value_cache, mapping)
        for seq_id in seq_ids:
            self.manager.mark_computed(seq_id)
        return mapping

    def check_attention(self, seq_ids):
        query = torch.randn(len(seq_ids), NUM_HEADS, HEAD_DIM)
        block_tables = self.manager.block_tables_tensor(seq_ids, self.device)
        seq_lens = torch.tensor([len(self.keys[s]) for s in seq_ids], dtype=torch.int32, device=self.device)
        out = paged_attn.paged_attention(query.to(self.device), self.key_cache, self.value_cache, block_tables,
                                         seq_lens)
        for i, seq_id in enumerate(seq_ids):
            expected = dense_attention(query[i], torch.stack(self.keys[seq_id]), torch.stack(self.values[seq_id]))
            torch.testing.assert_close(out[i].cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_parallel_sampling_with_copy_on_write_and_swapping(device):
    world = PagedWorld(device)
    world.add("a", list(range(10)))  # 10 tokens: blocks of 4, 4 and a partly filled one
    world.add("b", [7, 7, 7])
    world.fork("a", "a1")
    world.fork("a", "a2")
    world.check_attention(["a", "a1", "a2", "b"])
    assert world.manager.stats().blocks_saved_by_sharing == 6  # two children share a's three blocks

    cows = world.step({"a": 100, "a1": 101, "a2": 102, "b": 103})
    assert len(cows) == 2, "the shared last block is copied for two of the three writers"
    world.check_attention(["a", "a1", "a2", "b"])

    for step in range(6):
        world.step({"a": 200 + step, "a1": 300 + step, "a2": 400 + step, "b": 500 + step})
        world.check_attention(["a", "a1", "a2", "b"])

    world.swap_out(["a1", "a2"])  # a group: blocks shared between a1 and a2 (and a) move once
    world.step({"a": 600, "b": 601})
    world.check_attention(["a", "b"])
    world.swap_in(["a1", "a2"])
    world.check_attention(["a", "a1", "a2", "b"])
    world.step({"a1": 700, "a2": 701})
    world.check_attention(["a", "a1", "a2", "b"])

    for seq_id in ["a", "a1", "a2", "b"]:
        world.manager.free(seq_id)
    assert world.manager.num_free_blocks == 24


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_caching_reuses_kv(device):
    world = PagedWorld(device, enable_prefix_caching=True)
    system_prompt = list(range(50, 63))  # 13 tokens: three full blocks and one token more
    assert world.add("first", system_prompt + [1, 2]) == 0
    world.check_attention(["first"])
    # The second request shares the three full blocks; only its own tokens are written.
    cached = world.add("second", system_prompt + [9, 9, 9])
    assert cached == 12
    world.check_attention(["first", "second"])
    world.step({"first": 5, "second": 6})
    world.check_attention(["first", "second"])
    world.manager.free("first")
    world.manager.free("second")
    # Freed cached blocks stay reusable.
    assert world.add("third", system_prompt) == 12
    world.check_attention(["third"])
