"""Typed wrappers of the engine's elementwise layer ops (``csrc/cpu/elementwise.cpp``; on CUDA torch's own ops,
``csrc/cuda/elementwise.cpp``): RMSNorm, the residual add fused with it, and SiLU gating, each one pass over a row
on the CPU where torch's eager code makes several. The roundings are the eager code's (transformers' LlamaRMSNorm
and ``F.silu(gate) * up``): in bfloat16 the same bits but for a sum's order, in float32 within a few float32 ulps.
Their fakes are in ``paged_attn/fakes.py``; ``paged_attn.ops`` re-exports them.
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor, name: str, op: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: expected {name} of shape [..., width], got {getattr(x, 'shape', type(x).__name__)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.shape[1] == 0 or rows.stride(1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2, -1) + eps))`` for ``x`` ``[..., width]`` (float32, bfloat16 or float16) and
    ``weight`` ``[width]`` of its dtype: the mean and the division in float32, the normalized value rounded to x's
    dtype before the weight multiplies it (transformers' LlamaRMSNorm)."""
    return torch.ops.paged_attn.rms_norm(_rows(x, "x", "rms_norm"), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden = x + residual`` (rounded to their dtype) and :func:`rms_norm` of it, in one pass: ``(hidden,
    normalized)``, both of x's shape (a decoder layer's residual stream and the next norm's output)."""
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: expected residual of x's shape {tuple(x.shape)}, got "
                         f"{getattr(residual, 'shape', type(residual).__name__)}")
    hidden, out = torch.ops.paged_attn.add_rms_norm(_rows(x, "x", "add_rms_norm"),
                                                    _rows(residual, "residual", "add_rms_norm"), weight, eps)
    return hidden.view(x.shape), out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[..., 2 * width]`` = ``[gate | up]``: ``[..., width]``, silu rounded to
    the dtype before the product (as ``F.silu(gate) * up``)."""
    out = torch.ops.paged_attn.silu_and_mul(_rows(gate_up, "gate_up", "silu_and_mul"))
    return out.view(*gate_up.shape[:-1], out.shape[-1])
