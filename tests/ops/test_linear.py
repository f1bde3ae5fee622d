"""pack_linear_weight and linear (the engine's projections, csrc/cpu/linear.cpp): against x @ W^T in float64 on
random data, over shapes that cut the column blocks (64 outputs), the bfloat16 input pairs (odd in_features), the
micro-kernel's rows (6) and the cache chunks (96 rows); x as a strided slice whose other columns are NaN; the portable
path again in a child process (PAGED_ATTN_NO_AVX512=1); errors, fakes and torch.compile."""

import os

import pytest
import torch
from conftest import DEVICES, cpu_flags, run_on_portable_path

from paged_attn import ops

SHAPES = [  # (rows, out_features, in_features)
    (1, 576, 576), (1, 1, 1), (2, 65, 3), (5, 100, 33), (6, 64, 64), (7, 129, 130), (13, 960, 1), (97, 70, 577),
    (200, 192, 96),
]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T


def check(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """float32 sums: within float32 rounding of sum |x||w| per output; bfloat16 also one rounding of the output."""
    ref = reference(x, weight)
    scale = x.double().abs() @ weight.double().abs().T
    rounding = 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0
    bound = ref.abs() * rounding + scale * (x.shape[-1] + 2) * 2.0 ** -24
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_linear_equals_the_float64_product(device, dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype).to(device)
    # x: a slice of a wider tensor whose other columns are NaN (a kernel that reads past in_features gives NaN)
    wide = torch.full((rows, in_features + 5), float("nan"), dtype=dtype)
    wide[:, 2:2 + in_features] = torch.randn(rows, in_features, generator=gen).to(dtype)
    x = wide.to(device)[:, 2:2 + in_features]
    packed = ops.pack_linear_weight(weight)
    check(ops.linear(x, packed), x, weight)
    assert torch.equal(packed.dense(), weight)


def test_leading_dimensions_and_empty_inputs():
    weight = torch.randn(70, 40, dtype=torch.bfloat16)
    packed = ops.pack_linear_weight(weight)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    y = ops.linear(x, packed)
    assert y.shape == (2, 3, 70)
    assert torch.equal(y, ops.linear(x.reshape(6, 40), packed).view(2, 3, 70))
    assert ops.linear(x[:0], packed).shape == (0, 3, 70)
    empty = ops.pack_linear_weight(torch.randn(5, 0))
    assert torch.equal(ops.linear(torch.randn(3, 0), empty), torch.zeros(3, 5))


def test_rows_are_independent_of_the_batch():
    # a row's sums do not depend on which rows share its micro-kernel call or cache chunk (batch invariance)
    weight = torch.randn(130, 200, dtype=torch.bfloat16)
    packed = ops.pack_linear_weight(weight)
    x = torch.randn(101, 200, dtype=torch.bfloat16)
    whole = ops.linear(x, packed)
    for r in (0, 5, 6, 95, 96, 100):
        assert torch.equal(ops.linear(x[r:r + 1], packed), whole[r:r + 1])


def test_portable_path_when_avx512_is_switched_off():
    run_on_portable_path(
        "import torch, test_linear as t\n"
        "from paged_attn import ops\n"
        "assert not ops.linear_uses_avx512()\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for shape in t.SHAPES:\n"
        "        t.test_linear_equals_the_float64_product('cpu', dtype, *shape)\n")


def test_avx512_is_reported_where_the_cpu_has_it():
    assert ops.linear_uses_avx512() == ({"avx512_bf16", "avx512bw"} <= cpu_flags()
                                        and "PAGED_ATTN_NO_AVX512" not in os.environ)


@pytest.mark.parametrize("case", ["dtype", "mixed", "shape", "out_features", "x_dim", "weight_dim", "rows"])
def test_bad_arguments_are_refused(case):
    weight = torch.randn(100, 33)
    packed = ops.pack_linear_weight(weight).packed
    x = torch.randn(4, 33)
    call = {
        "dtype": lambda: torch.ops.paged_attn.pack_linear_weight(weight.half()),
        "mixed": lambda: torch.ops.paged_attn.linear(x.bfloat16(), packed, 100),
        "shape": lambda: torch.ops.paged_attn.linear(torch.randn(4, 34), packed, 100),
        "out_features": lambda: torch.ops.paged_attn.linear(x, packed, 140),
        "x_dim": lambda: torch.ops.paged_attn.linear(x[0], packed, 100),
        "weight_dim": lambda: torch.ops.paged_attn.pack_linear_weight(weight[0]),
        "rows": lambda: torch.ops.paged_attn.linear(x.T.contiguous().T, packed, 100),
    }[case]
    with pytest.raises(RuntimeError, match="linear"):
        call()
    for device in ("cpu", "meta"):  # the fakes say the same
        if case == "rows":
            continue  # a stride rule of the kernel
        args_device = {"cpu": lambda t: t, "meta": lambda t: t.to("meta")}[device]
        with pytest.raises(RuntimeError, match="linear"):
            {
                "dtype": lambda: torch.ops.paged_attn.pack_linear_weight(args_device(weight.half())),
                "mixed": lambda: torch.ops.paged_attn.linear(args_device(x.bfloat16()), args_device(packed), 100),
                "shape": lambda: torch.ops.paged_attn.linear(args_device(torch.randn(4, 34)), args_device(packed),
                                                             100),
                "out_features": lambda: torch.ops.paged_attn.linear(args_device(x), args_device(packed), 140),
                "x_dim": lambda: torch.ops.paged_attn.linear(args_device(x[0]), args_device(packed), 100),
                "weight_dim": lambda: torch.ops.paged_attn.pack_linear_weight(args_device(weight[0])),
            }[case]()


def test_python_wrappers_raise_for_caller_errors():
    packed = ops.pack_linear_weight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="2-D weight"):
        ops.pack_linear_weight(torch.randn(8))
    with pytest.raises(TypeError, match="PackedLinearWeight"):
        ops.linear(torch.randn(2, 4), torch.randn(8, 4))
    with pytest.raises(ValueError, match="input features"):
        ops.linear(torch.randn(2, 5), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fakes_and_torch_compile(dtype):
    weight = torch.randn(100, 33).to(dtype)
    packed = ops.pack_linear_weight(weight)
    meta = torch.ops.paged_attn.pack_linear_weight(weight.to("meta"))
    assert meta.shape == packed.packed.shape and meta.dtype == dtype
    y_meta = torch.ops.paged_attn.linear(torch.empty(7, 33, dtype=dtype, device="meta"), packed.packed.to("meta"), 100)
    assert y_meta.shape == (7, 100)
    x = torch.randn(7, 33).to(dtype)
    compiled = torch.compile(lambda x: ops.linear(x, packed), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ops.linear(x, packed))
