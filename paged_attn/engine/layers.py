"""The layers' elementwise work that the models share, as plain functions of tensors: RMSNorm, RoPE (its tables and
the rotation), SiLU gating, the ``torch.compile``'d versions of Llama's (``compile_elementwise``), and running such
work on one CPU thread in small steps (``serial_elementwise``). Nothing here knows a model or the paged KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# NOTE: a CPU step of fewer tokens than this runs its elementwise work (norms, RoPE, SiLU, residual adds) on the
# calling thread alone, and only the projections and the cache ops on all of torch's threads. ATen splits an
# elementwise op over its threads from 32768 elements on (e.g. 57 tokens x 576), and with passive waiting
# (GOMP_SPINCOUNT=0) waking OpenMP's sleeping workers costs more than such an op does; above this size two threads
# win again. Figures: bench/RESULTS.md, "Waking OpenMP's threads: a quarter of a large decode step".
SERIAL_ELEMENTWISE_TOKENS = 256


class Serial:
    """``with serial:`` runs torch's CPU ops on one intra-op thread, then restores the thread count; a no-op when
    built inactive."""

    def __init__(self, active: bool):
        self.threads = torch.get_num_threads()
        self.active = active and self.threads > 1

    def __enter__(self):
        if self.active:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.active:
            torch.set_num_threads(self.threads)


def serial_elementwise(device: torch.device, num_tokens: int) -> Serial:
    """The ``Serial`` of a step of ``num_tokens`` tokens on ``device``: active on the CPU below
    SERIAL_ELEMENTWISE_TOKENS."""
    return Serial(device.type == "cpu" and num_tokens < SERIAL_ELEMENTWISE_TOKENS)


def rope_tables(theta: float, head_dim: int, max_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and signed sin tables ``[max_len, head_dim]`` for base ``theta``, computed as transformers does
    (float32), then cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    # sin with its first half negated: rotate_half(x) * sin == x.roll(head_dim / 2) * signed_sin, exactly
    sin = emb.sin()
    signed_sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(theta: float, dim: int, yarn) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies ``[dim / 2]`` (float32) and its cos/sin factor, for a ``config.YarnConfig``:
    interpolated by ``factor`` below the correction range, extrapolated above it, ramped between (as transformers'
    ``_compute_yarn_parameters``, operation by operation)."""
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        attention_factor = yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(yarn.factor,
                                                                                      yarn.mscale_all_dim) \
            if yarn.mscale and yarn.mscale_all_dim else yarn_get_mscale(yarn.factor)

    def correction_dim(rotations):
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rotary_half_tables(inv_freq: torch.Tensor, attention_factor: float, max_len: int, device: torch.device,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_len, dim / 2]`` (one angle per pair of dims), times ``attention_factor``, computed in
    float32 as transformers does, then cast to ``dtype``."""
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
    return (freqs.cos() * attention_factor).to(device=device, dtype=dtype), \
        (freqs.sin() * attention_factor).to(device=device, dtype=dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE with one angle per pair of dims (``cos``, ``sin`` ``[num_tokens, 1, dim / 2]``): the pairs are
    (x[2i], x[2i+1]) when ``interleaved`` (DeepSeek's layout), else (x[i], x[i + dim/2]); the output puts the
    rotated first members, then the second ones (transformers' ``apply_rotary_pos_emb_interleave`` /
    ``apply_rotary_pos_emb``)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[num_tokens, heads, head_dim]``: x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


# Llama's layer, as plain functions of tensors (so that torch.compile can take them whole).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * normalized(x, eps).to(x.dtype)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [num_tokens, (num_heads + 2 num_kv_heads) head_dim] as q, k (rotated: views of
    one tensor) and v (a view of qkv). Queries and keys are rotated together: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin computed as x.roll(head_dim / 2) * signed_sin (the same products, bit for bit)."""
    num_tokens, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    qk = rotate(qkv[:, : qk_heads * head_dim].view(num_tokens, qk_heads, head_dim), cos, signed_sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, qkv[:, qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class CompiledElementwise:
    """``torch.compile``'d versions of a layer's elementwise work, for steps of at least ``min_tokens`` tokens."""

    rms_norm: Callable
    rope_qkv: Callable
    silu_mul: Callable
    min_tokens: int


def compile_elementwise(min_tokens: int = 128) -> CompiledElementwise:
    """The elementwise work around the projections (RMSNorm, RoPE, SiLU * up) as ``torch.compile``'d kernels
    (inductor fuses each into one loop), for ``LlamaModel.forward(elementwise=...)``: an engine's own, so that
    compiling for one engine changes no other engine on the same model. Smaller steps than ``min_tokens`` stay
    eager, where a compiled call's fixed cost outweighs the fusion (figures: bench/RESULTS.md, "After the engine
    moved onto the variable-length op"). The first large step compiles (seconds). Results may differ from the eager
    ones in the last bits (a fused reduction sums in another order)."""
    return CompiledElementwise(torch.compile(rms_norm, dynamic=True), torch.compile(rope_qkv, dynamic=True),
                               torch.compile(silu_mul, dynamic=True), min_tokens)
