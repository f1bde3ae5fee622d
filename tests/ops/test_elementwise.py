"""rms_norm, add_rms_norm and silu_and_mul (the engine's elementwise layer work, csrc/cpu/elementwise.cpp): against
the eager formulas computed in float64 with the eager code's roundings to the dtype, on random data, over widths that
cut the 16-element vectors (tails), rows as strided slices whose other columns are NaN, non-finite inputs as torch's
eager ops treat them; the portable path again in a child process (PAGED_ATTN_NO_AVX512=1); errors, fakes and
torch.compile."""

import pytest
import torch
from conftest import DEVICES, run_on_portable_path

from paged_attn import ops
from paged_attn.engine.layers import rms_norm as eager_rms_norm
from paged_attn.engine.layers import silu_mul as eager_silu_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 15), (5, 16), (7, 37), (64, 576), (300, 960)]  # (rows, width); 300 x 960: several tasks
EPS = 1e-5
NAN = float("nan")


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of t's dtype at each element of t (float64)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[t.dtype]
    tiny = torch.finfo(t.dtype).tiny
    return torch.exp2(torch.floor(torch.log2(t.double().abs().clamp_min(tiny)))) * 2.0 ** -mantissa


def strided_rows(rows: int, width: int, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Random rows as a slice of a wider NaN-filled tensor (row stride width + 3)."""
    alloc = torch.full((rows, width + 3), NAN, dtype=dtype, device=device)
    alloc[:, :width] = (torch.randn(rows, width, dtype=torch.float64) * scale).to(dtype)
    return alloc[:, :width]


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64, rounded to x's dtype where the eager code rounds (the normalized value, then the product)."""
    x64 = x.double()
    y = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return weight.double() * y.double()


def check_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    # r = 1 / sqrt(mean + eps) in float32 is off by float32 roundings of the row's sum (relative (width + 8) 2^-24 at
    # most); the normalized value y then rounds to a neighbour of the float64 one at most one ulp away, the weight
    # multiplies it, and the product rounds once more
    ref = reference_rms_norm(x, weight)
    y64 = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    y_bound = ulp(y64.to(x.dtype)) + y64.abs() * (x.shape[-1] + 8) * 2.0 ** -24
    bound = weight.double().abs() * y_bound * 1.01 + ulp(ref.to(x.dtype)) + 1e-300
    assert out.dtype == x.dtype and out.shape == x.shape
    assert ((out.double() - ref).abs() <= bound).all(), (out.double() - ref).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_rms_norm_equals_the_float64_formula(device, dtype, rows, width):
    torch.manual_seed(rows * 1000 + width)
    x = strided_rows(rows, width, dtype, device, scale=3.0)
    weight = torch.randn(width, dtype=torch.float64).to(dtype).to(device)
    out = torch.ops.paged_attn.rms_norm(x, weight, EPS)
    check_norm(out.cpu(), x.cpu(), weight.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_add_rms_norm_adds_then_normalizes(device, dtype, rows, width):
    torch.manual_seed(rows * 1000 + width + 1)
    x, residual = strided_rows(rows, width, dtype, device), strided_rows(rows, width, dtype, device, scale=4.0)
    weight = torch.randn(width, dtype=torch.float64).to(dtype).to(device)
    hidden, out = torch.ops.paged_attn.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(hidden, x + residual)  # one rounding of the exact sum, as torch's add
    assert torch.equal(out, torch.ops.paged_attn.rms_norm(hidden, weight, EPS))
    check_norm(out.cpu(), hidden.cpu(), weight.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_and_mul_equals_the_float64_formula(device, dtype, rows, width):
    torch.manual_seed(rows * 1000 + width + 2)
    gate_up = strided_rows(rows, 2 * width, dtype, device, scale=6.0)  # gates from about -20 to 20
    out = torch.ops.paged_attn.silu_and_mul(gate_up).cpu()
    gate, up = gate_up.cpu().double().chunk(2, dim=-1)
    s64 = gate / (1 + torch.exp(-gate))
    s = s64.to(dtype)
    ref = s.double() * up
    # s within one ulp of silu rounded (exp_nonpositive: 4e-6 relative), then the product's rounding
    s_bound = ulp(s) + s64.abs() * 4e-6
    bound = s_bound * up.abs() * 1.01 + ulp(ref.to(dtype)) + 1e-300
    assert out.dtype == dtype and out.shape == (rows, width)
    assert ((out.double() - ref).abs() <= bound).all(), (out.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bfloat16_and_float16_round_as_the_eager_code(dtype):
    # against transformers-style eager code on the same device: the same bits but for rare one-ulp ties of a sum
    torch.manual_seed(3)
    x, residual = torch.randn(64, 576, dtype=dtype), torch.randn(64, 576, dtype=dtype)
    weight, gate_up = torch.randn(576, dtype=dtype), torch.randn(64, 3072, dtype=dtype) * 4
    hidden, out = ops.add_rms_norm(x, residual, weight, EPS)
    eager = eager_rms_norm(x + residual, weight, EPS)
    differ = (out != eager).float().mean().item()
    assert differ <= 0.01
    assert ((out.double() - eager.double()).abs() <= 2 * ulp(eager) * weight.double().abs().clamp_min(1)).all()
    silu = ops.silu_and_mul(gate_up)
    assert ((silu.double() - eager_silu_mul(gate_up).double()).abs() <= 2 * ulp(eager_silu_mul(gate_up)) + 1e-30).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs_as_torch_treats_them(device, dtype):
    special = torch.tensor([float("inf"), -float("inf"), NAN, 0.0, -0.0, 30.0, -30.0, 1e-3] * 2, dtype=dtype,
                           device=device)
    gate_up = torch.cat([special, torch.full_like(special, 2.0)])[None]
    out = torch.ops.paged_attn.silu_and_mul(gate_up)
    eager = eager_silu_mul(gate_up)
    assert torch.equal(out.isnan(), eager.isnan())
    finite = ~eager.isnan()
    assert torch.allclose(out[finite].double(), eager[finite].double(), rtol=1e-2, atol=0)
    assert torch.equal(out[finite].isinf(), eager[finite].isinf())
    x = torch.randn(3, 40, dtype=dtype, device=device)
    x[1, 7] = NAN
    out = torch.ops.paged_attn.rms_norm(x, torch.ones(40, dtype=dtype, device=device), EPS)
    assert out[1].isnan().all() and torch.isfinite(out[[0, 2]]).all()  # a NaN spoils its own row only


def test_leading_dimensions_and_wrappers():
    x = torch.randn(2, 3, 40)
    weight = torch.randn(40)
    assert ops.rms_norm(x, weight, EPS).shape == (2, 3, 40)
    assert torch.equal(ops.rms_norm(x, weight, EPS), ops.rms_norm(x.reshape(6, 40), weight, EPS).view(2, 3, 40))
    hidden, out = ops.add_rms_norm(x, x, weight, EPS)
    assert hidden.shape == out.shape == (2, 3, 40)
    assert ops.silu_and_mul(torch.randn(2, 3, 80)).shape == (2, 3, 40)
    assert ops.silu_and_mul(torch.randn(0, 80)).shape == (0, 40)
    assert ops.rms_norm(torch.randn(0, 40), weight, EPS).shape == (0, 40)
    transposed = torch.randn(40, 6).T  # last dimension not contiguous: the wrapper copies
    assert torch.equal(ops.rms_norm(transposed, weight, EPS), ops.rms_norm(transposed.contiguous(), weight, EPS))
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, x[0], weight, EPS)


def test_rows_are_independent_of_the_batch():
    x, weight = torch.randn(300, 960, dtype=torch.bfloat16), torch.randn(960, dtype=torch.bfloat16)
    whole = ops.rms_norm(x, weight, EPS)
    silu = ops.silu_and_mul(x)
    for r in (0, 150, 299):
        assert torch.equal(ops.rms_norm(x[r:r + 1], weight, EPS), whole[r:r + 1])
        assert torch.equal(ops.silu_and_mul(x[r:r + 1]), silu[r:r + 1])


def test_portable_path_when_avx512_is_switched_off():
    run_on_portable_path(
        "import torch, test_elementwise as t\n"
        "for dtype in t.DTYPES:\n"
        "    for shape in t.SHAPES:\n"
        "        t.test_rms_norm_equals_the_float64_formula('cpu', dtype, *shape)\n"
        "        t.test_add_rms_norm_adds_then_normalizes('cpu', dtype, *shape)\n"
        "        t.test_silu_and_mul_equals_the_float64_formula('cpu', dtype, *shape)\n"
        "    t.test_non_finite_inputs_as_torch_treats_them('cpu', dtype)\n")


@pytest.mark.parametrize("case", ["weight_shape", "weight_dtype", "x_dim", "int", "odd", "residual", "empty_rows"])
def test_bad_arguments_are_refused(case):
    x, weight = torch.randn(4, 40), torch.randn(40)
    call = {
        "weight_shape": lambda d: torch.ops.paged_attn.rms_norm(x.to(d), weight[:39].to(d), EPS),
        "weight_dtype": lambda d: torch.ops.paged_attn.rms_norm(x.to(d), weight.double().to(d), EPS),
        "x_dim": lambda d: torch.ops.paged_attn.rms_norm(x[0].to(d), weight.to(d), EPS),
        "int": lambda d: torch.ops.paged_attn.silu_and_mul(torch.ones(4, 40, dtype=torch.int32).to(d)),
        "odd": lambda d: torch.ops.paged_attn.silu_and_mul(torch.randn(4, 41).to(d)),
        "residual": lambda d: torch.ops.paged_attn.add_rms_norm(x.to(d), x[:3].to(d), weight.to(d), EPS),
        "empty_rows": lambda d: torch.ops.paged_attn.rms_norm(torch.randn(4, 0).to(d), weight[:0].to(d), EPS),
    }[case]
    messages = []
    for device in ("cpu", "meta"):  # the fakes say the same
        with pytest.raises(RuntimeError, match="rms_norm|silu_and_mul") as error:
            call(device)
        messages.append(str(error.value).split("\n")[0].replace(device, "DEVICE"))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fakes_and_torch_compile(dtype):
    x, residual, weight = torch.randn(7, 40, dtype=dtype), torch.randn(7, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    gate_up = torch.randn(7, 80, dtype=dtype)

    def layer(x, residual, gate_up):
        hidden, normed = ops.add_rms_norm(x, residual, weight, EPS)
        return ops.rms_norm(hidden, weight, EPS), normed, ops.silu_and_mul(gate_up)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(x, residual, gate_up), layer(x, residual, gate_up)):
        assert torch.equal(got, expected)
    for op, args in ((torch.ops.paged_attn.rms_norm.default, (x, weight, EPS)),
                     (torch.ops.paged_attn.add_rms_norm.default, (x, residual, weight, EPS)),
                     (torch.ops.paged_attn.silu_and_mul.default, (gate_up,))):
        torch.library.opcheck(op, args)
