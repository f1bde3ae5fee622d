"""CUDA-only checks of paged_attention with query_start_loc and of strided caches (skipped without a GPU; the kernels
themselves also run on every machine under the emulator, tests/emulated/test_emulated_kernels.py):
  - which kernel serves which rows must not change the result: head dims with and without a tensor-core kernel,
    groups above 64 heads, max_query_len given or not;
  - no host synchronization: the call is captured in a CUDA graph and replayed;
  - cache rows that the 16-byte loads cannot read are refused with a clear error.
"""

import pytest
import torch
from conftest import requires_cuda
from test_attention import tolerance
from test_varlen_attention import MIXED, expected, make_varlen_case

import paged_attn

pytestmark = requires_cuda


def attend(case, **kwargs):
    query, key_cache, value_cache, block_tables, seq_lens, starts = case
    return paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=starts,
                                      **kwargs)


@pytest.mark.parametrize("head_dim", [32, 120, 256], ids=["32 (decode kernel per row)", "120 (idem)", "256"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dims_with_and_without_tensor_cores(head_dim, dtype):
    case = make_varlen_case(MIXED, 8, 2, head_dim, 16, dtype, "cuda", "packed")
    torch.testing.assert_close(attend(case), expected(case), **tolerance(dtype))


def test_group_of_80_heads_takes_two_thread_blocks():
    case = make_varlen_case([(60, 60), (9, 1), (100, 30)], 80, 1, 64, 16, torch.bfloat16, "cuda")
    torch.testing.assert_close(attend(case), expected(case), **tolerance(torch.bfloat16))


def test_max_query_len_does_not_change_the_result():
    case = make_varlen_case(MIXED, 8, 2, 128, 16, torch.bfloat16, "cuda")
    assert torch.equal(attend(case), attend(case, max_query_len=120))
    decodes = make_varlen_case([(n, 1) for n in (5, 40, 300)] + [(7, 0)], 8, 2, 128, 16, torch.bfloat16, "cuda")
    assert torch.equal(attend(decodes), attend(decodes, max_query_len=1))  # only the decode kernel launched


def test_captured_in_a_cuda_graph():
    """Neither kernel reads query_start_loc on the host: the call can be captured, and replays see new inputs."""
    case = make_varlen_case(MIXED, 8, 2, 64, 16, torch.bfloat16, "cuda", "halves")
    out = torch.empty_like(case[0])
    attend(case, max_query_len=120, out=out)  # warm-up (lazy initialization outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(case, max_query_len=120, out=out)
    case[0].copy_(torch.randn_like(case[0]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected(case), **tolerance(torch.bfloat16))


def test_misaligned_cache_rows_are_refused():
    """K|V packed with 4 elements of padding per row: the head stride (132 bf16 = 264 bytes) is no multiple of 16."""
    alloc = torch.zeros(4, 16, 2, 2 * 64 + 4, dtype=torch.bfloat16, device="cuda")
    key_cache, value_cache = alloc[..., :64], alloc[..., 64:128]
    query = torch.randn(3, 4, 64, dtype=torch.bfloat16, device="cuda")
    block_tables = torch.zeros(3, 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(3, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="cache rows must be 16-byte aligned"):
        paged_attn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
