"""mla_attention's CUDA kernel (csrc/cuda/mla_kernels.cuh) and its split-KV reduce, executed by the SIMT emulator
against the float64 reference (paged_attn.reference.mla_attention), as test_emulated_kernels.py runs the other
kernels: under ASan+UBSan in three thread orders and TSan, the same bits in every run, caches of shuffled blocks
poisoned with NaN where unused, garbage past each block table's entries, NaN-filled split-KV scratch.

concat_and_cache_mla's kernels write the same bytes as the CPU op.

Covered: float16 and bfloat16; 512 + 64 (DeepSeek-V3) and 128 + 32; 1 to 40 heads (one, two and three thread
blocks of heads, and fewer heads than a block's 16); block sizes 8 to 128; sequences of 0 tokens, shorter than a
step, on both sides of step and partition boundaries; single pass and split-KV (thread blocks that run several
partitions, partitions shorter than a step); lse; query_start_loc (several query rows per sequence, and sequences
without one); the same bits for a row in any batch with batch invariance.
"""

import pytest
import torch
from test_attention import NAN, tolerance
import test_emulated_kernels as emulated
from test_batch_invariance import poisoned
from test_emulated_kernels import FP8_FORMATS, Case, assert_same_bits, run_everywhere
from test_mla import mla_case

import paged_attn
from paged_attn import reference

# test_emulated_kernels.py's fixtures: the driver programs (built once per session) and each test's runs
programs, driver = emulated.programs, emulated.driver

SCALE = 0.07


def mla_emulated_case(seq_lens, num_heads, rank, rope, block_size, dtype, *, query_tokens=None, split=False,
                      partition_tokens=32, num_sms=1000, blocks_per_sm=1, lse=False, seed=0, batch_invariant=False,
                      scale=SCALE):
    """A case of op mla_attention: the latent cache written by concat_and_cache_mla (test_mla.mla_case), out and lse
    NaN until the kernels write them. split: many SMs force split-KV at partition_tokens (num_sms few: thread blocks
    loop over partitions)."""
    query, kv_cache, block_tables, seq_lens_t, qsl = mla_case(seq_lens, num_heads, rank, rope, block_size, dtype,
                                                              query_tokens=query_tokens, seed=seed)
    tensors = dict(out=torch.full((query.shape[0], num_heads, rank), NAN, dtype=dtype), query=query,
                   kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens_t)
    if qsl is not None:
        tensors["query_start_loc"] = qsl
    if lse:
        tensors["lse"] = torch.full((query.shape[0], num_heads), NAN)
    scalars = dict(kv_lora_rank=rank, scale=scale, num_sms=num_sms if split else 1, blocks_per_sm=blocks_per_sm,
                   partition_tokens=partition_tokens if split else 1 << 30, batch_invariant=int(batch_invariant))
    return Case("mla_attention", tensors, scalars, ("out", "lse") if lse else ("out",), dtype)


def mla_plan(case: Case):
    """The plan the driver launches with (the same plan_mla_attention, through the test hook)."""
    t, scalars = case.tensors, case.scalars
    rank = scalars["kv_lora_rank"]
    num_items = t["query"].shape[0] if "query_start_loc" in t else t["block_tables"].shape[0]
    return paged_attn._C._launch_plan(
        "mla_attention", num_items, t["query"].shape[1], rank, t["query"].shape[2] - rank, t["block_tables"].shape[1],
        t["kv_cache"].shape[1], scalars["num_sms"], scalars["blocks_per_sm"], scalars["partition_tokens"],
        scalars["batch_invariant"])


def check_mla(driver, case: Case, tmp_path):
    """The emulated output (and lse) against the float64 reference; returns the outputs."""
    t = case.tensors
    names = list(case.outputs)
    got = run_everywhere(driver, case, tmp_path, names)
    want, want_lse = reference.mla_attention(
        t["query"], t["kv_cache"], t["block_tables"], t["seq_lens"], kv_lora_rank=case.scalars["kv_lora_rank"],
        scale=case.scalars["scale"], query_start_loc=t.get("query_start_loc"), compute_dtype=torch.float64, return_lse=True)
    assert not got["out"].isnan().any(), "NaN in the output: an unused (poisoned) slot or record leaked in"
    torch.testing.assert_close(got["out"].double(), want.double(), **tolerance(case.dtype))
    if "lse" in got:
        torch.testing.assert_close(got["lse"].double(), want_lse.double(), rtol=1e-4, atol=1e-4)
    return got


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "half"])
def test_mla_decode(driver, tmp_path, dtype, split):
    """Lengths around steps (32) and partitions (32 in split-KV), a row without tokens, 20 heads (two thread blocks
    of 10), blocks of 16, lse."""
    case = mla_emulated_case([1, 31, 33, 64, 97, 0], 20, 128, 32, 16, dtype, split=split, lse=True)
    check_mla(driver, case, tmp_path)


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
def test_mla_rising_logits_rescale_the_state(driver, tmp_path, split):
    """Logits that grow along the sequence (rows scaled by 1 + t / 16) at a large scale: the reference max moves by
    more than 2^8 at many steps, so the state is rescaled after its first step (lazy rescaling), and the early
    tokens' weights end far below the last ones'."""
    case = mla_emulated_case([200, 77], 16, 128, 32, 16, torch.bfloat16, split=split, partition_tokens=64,
                             lse=True, scale=0.3, seed=5)
    t = case.tensors
    cache, tables = t["kv_cache"], t["block_tables"]
    for s, length in enumerate(t["seq_lens"].tolist()):
        for position in range(length):
            block, offset = tables[s, position // 16], position % 16
            cache[block, offset] = (cache[block, offset].float() * (1 + position / 16)).to(cache.dtype)
    check_mla(driver, case, tmp_path)


@pytest.mark.parametrize("num_heads", [16, 40])
def test_mla_deepseek_v3_shape(driver, tmp_path, num_heads):
    """512 + 64 in blocks of 64 (FlashMLA's only page size), split-KV at 64-token partitions, 16 heads (one thread
    block) and 40 (three: 14, 13, 13)."""
    case = mla_emulated_case([70, 129], num_heads, 512, 64, 64, torch.bfloat16, split=True, partition_tokens=64,
                             lse=True, seed=3)
    check_mla(driver, case, tmp_path)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_mla_block_sizes(driver, tmp_path, block_size):
    """Blocks smaller than a step (four per step), as long as one, longer; 3 heads."""
    case = mla_emulated_case([9, 75, 140], 3, 128, 32, block_size, torch.bfloat16, seed=block_size)
    check_mla(driver, case, tmp_path)


@pytest.mark.parametrize("split", [False, True], ids=["single_pass", "split_kv"])
def test_mla_query_start_loc(driver, tmp_path, split):
    """Several query rows per sequence (speculative decoding, short chunks: each row sees the tokens up to its own
    position), a sequence of one row and one of none, lse."""
    case = mla_emulated_case([5, 40, 17, 66], 4, 128, 32, 8, torch.bfloat16, query_tokens=[1, 3, 0, 2], split=split,
                             lse=True, seed=7)
    check_mla(driver, case, tmp_path)


def test_mla_partitions_looped_inside_a_thread_block(driver, tmp_path):
    """Few SMs: the plan's slots (grid.z) are fewer than a row's partitions, so each thread block runs partitions z,
    z + grid.z, ... from fresh accumulators (partitions of 32 tokens, one step each, and of 16, half a step: steps
    that begin before their partition)."""
    for tokens, num_sms, partitions, slots in ((32, 4, 11, 4), (16, 6, 21, 2)):
        case = mla_emulated_case([300, 45, 130], 2, 128, 32, 16, torch.bfloat16, split=True,
                                 partition_tokens=tokens, num_sms=num_sms, seed=tokens)
        plan = mla_plan(case)
        assert (plan["num_partitions"], plan["partition_size"], plan["grid"]) == (partitions, tokens, (3, 1, slots))
        (tmp_path / str(tokens)).mkdir()
        check_mla(driver, case, tmp_path / str(tokens))


def test_mla_batch_invariant_rows_have_the_same_bits_in_any_batch(driver, tmp_path):
    """With batch invariance a row's output is the same bits alone and in a batch of other rows (whose sizes would
    otherwise change the plan)."""
    alone = mla_emulated_case([150], 16, 128, 32, 16, torch.bfloat16, split=True, partition_tokens=512,
                              num_sms=132, blocks_per_sm=2, batch_invariant=True, seed=11)
    batch = mla_emulated_case([150] + [700] * 7, 16, 128, 32, 16, torch.bfloat16, split=True, partition_tokens=512,
                              num_sms=132, blocks_per_sm=2, batch_invariant=True, seed=11)
    batch.tensors["query"][0] = alone.tensors["query"][0]  # (row 0's cache rows are the same: the same seed)
    assert mla_plan(alone)["grid"] == (1, 1, 2) and mla_plan(batch)["grid"] == (8, 1, 2)
    # (without batch invariance the batch's plan cuts row 0 at other partitions)
    batch.scalars["batch_invariant"] = 0
    assert mla_plan(batch)["partition_size"] != 512
    batch.scalars["batch_invariant"] = 1
    for name in ("alone", "batch"):
        (tmp_path / name).mkdir()
    got_alone = check_mla(driver, alone, tmp_path / "alone")["out"][0]
    got_batch = check_mla(driver, batch, tmp_path / "batch")["out"][0]
    assert torch.equal(got_alone.view(torch.int16), got_batch.view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# concat_and_cache_mla

@pytest.mark.parametrize("cache_dtype, dtype, rank, rope", [
    (torch.bfloat16, torch.bfloat16, 128, 32), (torch.float16, torch.float16, 512, 64),
    (torch.float32, torch.float32, 64, 16), (torch.bfloat16, torch.bfloat16, 64, 3),
    (torch.float8_e4m3fn, torch.bfloat16, 128, 32), (torch.float8_e5m2, torch.float16, 64, 16),
    (torch.float8_e4m3fn, torch.float32, 64, 8)],
    ids=["bf16", "half-512", "float", "bf16-rope3 (2-byte units)", "e4m3-bf16", "e5m2-half", "e4m3-float"])
def test_concat_and_cache_mla(driver, tmp_path, cache_dtype, dtype, rank, rope):
    """kv_c and k_pe slices of one projection's output (as DeepSeek's kv_a_proj_with_mqa gives them), values over
    many binades, slots scattered and some skipped (-1) in a NaN-poisoned cache: the cache's bytes equal the CPU
    op's (fp8: quantized with a scale), unwritten slots untouched."""
    num_tokens, num_blocks, block_size = 9, 5, 4
    generator = torch.Generator().manual_seed(rank + rope)
    projection = torch.randn(num_tokens, rank + 8 + rope, generator=generator)
    projection *= 10.0 ** (torch.rand(projection.shape, generator=generator) * 6 - 3)
    projection = projection.to(dtype)
    kv_c, k_pe = projection[:, :rank], projection[:, rank + 8:]
    kv_cache = poisoned((num_blocks, block_size, rank + rope), cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[1, 6]] = -1
    tensors = dict(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slots)
    scalars = dict(element_size=kv_c.element_size())
    scale = None
    if cache_dtype in FP8_FORMATS:
        scale = torch.tensor([0.37])
        tensors["scale"] = scale
        scalars["fp8_format"] = FP8_FORMATS[cache_dtype]
    case = Case("concat_and_cache_mla", tensors, scalars, ("kv_cache",), dtype)
    got = run_everywhere(driver, case, tmp_path, ["kv_cache"])["kv_cache"]
    expected = kv_cache.clone()
    paged_attn.concat_and_cache_mla(kv_c, k_pe, expected, slots, scale=scale)
    assert_same_bits(got, expected, "kv_cache: the emulated kernel's bytes vs the CPU op's")
