"""merge_attention_states: merging attention over keys [0, k) with attention over [k, n) gives attention over [0, n);
the edges (-inf, +inf, NaN) behave as documented in paged_attn/ops.py; bad input raises a clear error."""

import math

import pytest
import torch
from conftest import DEVICES

import paged_attn
from paged_attn import reference

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Each part is rounded to the dtype before the merge and the result once after: about one ulp of the dtype.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def split_attention(num_tokens, num_heads, head_dim, num_keys, split, dtype, device):
    """The two parts (over keys [0, split) and [split, num_keys)), rounded to dtype (lse float32) as a kernel would
    write them, and the float64 attention over all keys."""
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.float64) * 2
    keys = torch.randn(num_keys, num_heads, head_dim, dtype=torch.float64)
    values = torch.randn(num_keys, num_heads, head_dim, dtype=torch.float64)
    out_a, lse_a = reference.attention_with_lse(query, keys[:split], values[:split])
    out_b, lse_b = reference.attention_with_lse(query, keys[split:], values[split:])
    full = reference.attention_with_lse(query, keys, values)
    parts = [out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float()]
    return [t.to(device) for t in parts], full


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_keys,split", [(37, 1), (37, 18), (37, 36), (200, 128), (5, 0), (5, 5)])
def test_merging_split_key_ranges_gives_attention_over_all_keys(device, dtype, num_keys, split):
    parts, (full_out, full_lse) = split_attention(7, 3, 64, num_keys, split, dtype, device)
    out, lse = paged_attn.merge_attention_states(*parts)
    assert out.dtype == dtype and out.shape == (7, 3, 64) and lse.dtype == torch.float32 and lse.shape == (7, 3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), full_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double(), full_lse, rtol=1e-6, atol=1e-5)
    # Against the float64 merge of the same rounded parts: within one rounding of the output dtype.
    want_out, want_lse = reference.merge_attention_states(*[t.cpu() for t in parts])
    torch.testing.assert_close(out.cpu(), want_out, rtol=tol / 2, atol=tol / 2)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_part_that_saw_no_key_leaves_the_other_exactly(device, dtype):
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 2, 32, 9, 0, dtype, device)  # part a: no keys
    assert (lse_a == -INF).all()
    for args, (want_out, want_lse) in (((out_a, lse_a, out_b, lse_b), (out_b, lse_b)),
                                       ((out_b, lse_b, out_a, lse_a), (out_b, lse_b))):
        out, lse = paged_attn.merge_attention_states(*args)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_empty_parts_give_zero_and_minus_inf_not_nan(device, dtype):
    out_a = torch.randn(3, 2, 16, dtype=dtype, device=device)  # whatever an empty part left there
    out_b = torch.randn_like(out_a)
    empty = torch.full((3, 2), -INF, device=device)
    out, lse = paged_attn.merge_attention_states(out_a, empty, out_b, empty.clone())
    assert (out == 0).all() and not out.isnan().any()
    assert (lse == -INF).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_plus_inf_lse_dominates(device):
    """lse +inf (a part whose softmax mass is infinite: a +inf sink's) gives that part's output and lse +inf, in
    either position, over a finite part and over an empty one; two +inf parts give their mean."""
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 2, 32, 9, 4, torch.float32, device)
    inf, empty = torch.full_like(lse_a, INF), torch.full_like(lse_b, -INF)
    for args, want in [((out_a, inf, out_b, lse_b), out_a), ((out_b, lse_b, out_a, inf), out_a),
                       ((out_a, inf, out_b, empty), out_a), ((out_a, inf, out_b, inf.clone()), (out_a + out_b) / 2)]:
        out, lse = paged_attn.merge_attention_states(*args)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-7)
        assert (lse == INF).all()
        want_out, want_lse = reference.merge_attention_states(*[t.cpu() for t in args])
        torch.testing.assert_close(want_out, want.cpu(), rtol=0, atol=1e-7)
        assert (want_lse == INF).all()
    lse_a = lse_a.clone()
    lse_a[0, 0] = NAN  # NaN still wins over +inf
    out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, inf)
    assert out[0, 0].isnan().all() and lse[0, 0].isnan() and (lse.flatten()[1:] == INF).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sink_part", ["first", "second"])
def test_split_and_merge_equals_the_whole_call_for_every_sink(device, sink_part):
    """paged_attention over keys [0, n) with sinks (finite, +inf, -inf, one per head) against the merge of its two
    parts [0, k) and [k, n), the sinks passed to one part, for every split k (0 and n included: an empty part)."""
    torch.manual_seed(0)
    num_keys, num_heads, num_kv_heads, head_dim = 9, 4, 2, 32
    query = torch.randn(2, num_heads, head_dim, device=device)
    key_cache = torch.randn(num_keys, 1, num_kv_heads, head_dim, device=device)  # block size 1: block t = key t
    value_cache = torch.randn_like(key_cache)
    sinks = torch.tensor([0.7, INF, -INF, -1.2], device=device)

    def attend(begin, end, with_sinks):
        tables = torch.zeros(2, max(1, num_keys), dtype=torch.int32, device=device)
        tables[:, :end - begin] = torch.arange(begin, end, dtype=torch.int32, device=device)
        seq_lens = torch.full((2,), end - begin, dtype=torch.int32, device=device)
        return paged_attn.paged_attention(query, key_cache, value_cache, tables, seq_lens, return_lse=True,
                                          sinks=sinks if with_sinks else None)

    whole_out, whole_lse = attend(0, num_keys, True)
    assert (whole_lse[:, 1] == INF).all() and (whole_out[:, 1] == 0).all()
    for k in range(num_keys + 1):
        a, b = attend(0, k, sink_part == "first"), attend(k, num_keys, sink_part == "second")
        out, lse = paged_attn.merge_attention_states(*a, *b)
        torch.testing.assert_close(out, whole_out, rtol=1e-5, atol=1e-5, msg=f"split at {k}")
        torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5, msg=f"split at {k}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other", [0.5, -INF, NAN])
def test_a_nan_lse_makes_its_row_nan(device, other):
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 2, 32, 9, 4, torch.float32, device)
    lse_a, lse_b = lse_a.clone(), lse_b.clone()
    lse_a[1, 0], lse_b[1, 0] = NAN, other
    out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out[1, 0].isnan().all() and lse[1, 0].isnan()
    nan_row = torch.zeros(4, 2, dtype=torch.bool, device=device)
    nan_row[1, 0] = True
    assert not out[~nan_row].isnan().any() and not lse[~nan_row].isnan().any()
    want_out, want_lse = reference.merge_attention_states(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu())
    torch.testing.assert_close(out.cpu(), want_out, equal_nan=True)
    torch.testing.assert_close(lse.cpu(), want_lse, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_a_value", [0.0, -INF], ids=["weighted", "weight 0"])
def test_a_nan_in_an_output_makes_that_element_nan(device, lse_a_value):
    """As in vLLM: the NaN reaches the result even when its part has weight 0 (0 * NaN)."""
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 2, 32, 9, 4, torch.float32, device)
    out_a = out_a.clone()
    out_a[2, 1, 5] = NAN
    lse_a = torch.full_like(lse_a, lse_a_value)
    out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.isnan().sum() == 1 and out[2, 1, 5].isnan() and not lse.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_shifting_both_lse_by_a_constant_shifts_only_the_lse(device):
    """The merge is computed relative to max(lse_a, lse_b): lse values of 1e4 (exp would overflow) merge fine."""
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 2, 32, 9, 4, torch.float32, device)
    out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    shifted_out, shifted_lse = paged_attn.merge_attention_states(out_a, lse_a + 1e4, out_b, lse_b + 1e4)
    torch.testing.assert_close(shifted_out, out, rtol=2e-3, atol=2e-3)  # lse + 1e4 keeps ~3 decimals in float32
    torch.testing.assert_close(shifted_lse, lse + 1e4)
    assert shifted_out.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_given_outputs(device):
    """vLLM's [num_heads, num_tokens] lse passed transposed, outputs sliced out of a wider tensor, out= and lse=."""
    (out_a, lse_a, out_b, lse_b), _ = split_attention(5, 3, 32, 20, 7, torch.float16, device)
    want_out, want_lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    wide_a = torch.randn(5, 3, 64, dtype=torch.float16, device=device)
    wide_a[..., 16:48] = out_a
    heads_first = lse_b.t().contiguous()  # vLLM's layout
    out_alloc = torch.full((5, 4, 32), NAN, dtype=torch.float16, device=device)
    lse_alloc = torch.full((3, 5), NAN, device=device)
    out, lse = paged_attn.merge_attention_states(wide_a[..., 16:48], lse_a, out_b, heads_first.t(),
                                                 out=out_alloc[:, 1:], lse=lse_alloc.t())
    assert out.data_ptr() == out_alloc[:, 1:].data_ptr() and lse.data_ptr() == lse_alloc.data_ptr()
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert out_alloc[:, 0].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_are_fine(device):
    for shape in ((0, 2, 32), (3, 0, 32), (3, 2, 0)):
        out_a = torch.randn(shape, device=device)
        lse_a = torch.randn(shape[:2], device=device)
        out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_a.clone(), lse_a.clone())
        assert out.shape == shape and lse.shape == shape[:2]
        torch.testing.assert_close(lse, lse_a + math.log(2))


# ----------------------------------------------------------------------------------------------------------------
# Errors: each case maps (out_a, lse_a, out_b, lse_b) to the wrapper's positional and keyword arguments.

def error_parts(device="cpu"):
    out_a = torch.randn(3, 2, 32, device=device)
    lse_a = torch.randn(3, 2, device=device)
    return out_a, lse_a, torch.randn_like(out_a), torch.randn_like(lse_a)


ERRORS = {
    "out_a rank": (lambda a, la, b, lb: ((a[0], la, b[0], lb), {}), r"out_a must have shape \[num_tokens, num_heads, "
                   r"head_dim\], got \[2, 32\]"),
    "out_a dtype": (lambda a, la, b, lb: ((a.double(), la, b.double(), lb), {}),
                    "out_a must be float32, float16 or bfloat16, got Double"),
    "out_b dtype": (lambda a, la, b, lb: ((a, la, b.half(), lb), {}),
                    "out_a and out_b must have the same dtype, got Float and Half"),
    "out_b shape": (lambda a, la, b, lb: ((a, la, b[:2], lb), {}),
                    r"out_a and out_b must have the same shape, got \[3, 2, 32\] and \[2, 2, 32\]"),
    "out shape": (lambda a, la, b, lb: ((a, la, b, lb), dict(out=torch.empty(3, 2, 16))),
                  r"out_a and out must have the same shape, got \[3, 2, 32\] and \[3, 2, 16\]"),
    "out dtype": (lambda a, la, b, lb: ((a, la, b, lb), dict(out=torch.empty(3, 2, 32, dtype=torch.bfloat16))),
                  "out_a and out must have the same dtype, got Float and BFloat16"),
    "lse_a dtype": (lambda a, la, b, lb: ((a, la.double(), b, lb), {}), "lse_a must be float32, got Double"),
    "lse_b shape": (lambda a, la, b, lb: ((a, la, b, lb.t()), {}),
                    r"lse_b must have shape \[num_tokens, num_heads\] = \[3, 2\], got \[2, 3\]"),
    "lse_a rank": (lambda a, la, b, lb: ((a, la[:, :, None], b, lb), {}),
                   r"lse_a must have shape \[num_tokens, num_heads\] = \[3, 2\], got \[3, 2, 1\]"),
    "lse shape": (lambda a, la, b, lb: ((a, la, b, lb), dict(lse=torch.empty(3))),
                  r"lse must have shape \[num_tokens, num_heads\] = \[3, 2\], got \[3\]"),
    "lse dtype": (lambda a, la, b, lb: ((a, la, b, lb), dict(lse=torch.empty(3, 2, dtype=torch.float16))),
                  "lse must be float32, got Half"),
    "out_a last dim": (lambda a, la, b, lb: ((torch.randn(3, 2, 64)[..., ::2], la, b, lb), {}),
                       "out_a must be contiguous in its last dimension"),
    "out last dim": (lambda a, la, b, lb: ((a, la, b, lb), dict(out=torch.empty(3, 2, 64)[..., ::2])),
                     "out must be contiguous in its last dimension"),
    "out overlaps itself": (lambda a, la, b, lb: ((a, la, b, lb), dict(out=torch.empty(1, 1, 32).expand(3, 2, 32))),
                            "out must not have overlapping elements"),
    "lse overlaps itself": (lambda a, la, b, lb: ((a, la, b, lb), dict(lse=torch.empty(1).expand(3, 2))),
                            "lse must not have overlapping elements"),
    "out is out_a": (lambda a, la, b, lb: ((a, la, b, lb), dict(out=a)), "out and out_a must not overlap"),
    "lse is lse_b": (lambda a, la, b, lb: ((a, la, b, lb), dict(lse=lb)), "lse and lse_b must not overlap"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors(case):
    make_args, message = ERRORS[case]
    args, kwargs = make_args(*error_parts())
    with pytest.raises(RuntimeError, match=message):
        paged_attn.merge_attention_states(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_device_mismatch(device):
    out_a, lse_a, out_b, lse_b = error_parts(device)
    with pytest.raises(RuntimeError, match="lse_b and out_a must be on the same device, got meta and"):
        paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b.to("meta"))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="out_a and out_b must be on the same device, got cuda:0 and cpu"):
            paged_attn.merge_attention_states(out_a, lse_a, out_b.cpu(), lse_b)
        with pytest.raises(RuntimeError, match="lse_a and out_a must be on the same device, got cpu and cuda:0"):
            paged_attn.merge_attention_states(out_a, lse_a.cpu(), out_b, lse_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 3, 32, 11, 5, dtype, device)
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    torch.library.opcheck(torch.ops.paged_attn.merge_attention_states.default, (out, lse, out_a, lse_a, out_b, lse_b))


def test_torch_compile_fullgraph():
    (out_a, lse_a, out_b, lse_b), _ = split_attention(4, 3, 32, 11, 5, torch.float32, "cpu")
    compiled = torch.compile(lambda *parts: paged_attn.merge_attention_states(*parts)[0].sum(), fullgraph=True)
    want, _ = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(compiled(out_a, lse_a, out_b, lse_b), want.sum())
