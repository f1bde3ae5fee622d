"""Typed wrappers of the engine's projection ops: ``y = x W^T`` on a weight packed once for the device's matmul
(``csrc/cpu/linear.cpp``, ``csrc/cuda/linear.cpp``). Their fakes are in ``paged_attn/fakes.py``; ``paged_attn.ops``
re-exports them.

On the CPU, W ``[out_features, in_features]`` (float32 or bfloat16) is packed as column blocks of 64 outputs, and
within a block as steps of ``kps`` input features (2 for bfloat16, the pairs that ``vdpbf16ps`` multiplies; 1 for
float32), each step the 64 outputs' weights: ``[ceil(out_features / 64), ceil(in_features / kps), 64, kps]``, zero
padded. A decode step multiplies a few rows by every weight, so its time is the weights' read: one sequential
stream per thread, summed in float32 and rounded once. On CUDA the packed weight is W itself (cuBLAS reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _C


@dataclass(frozen=True)
class PackedLinearWeight:
    """A weight as :func:`linear` takes it: ``packed`` (:func:`pack_linear_weight`'s layout for its device) and the
    weight's shape."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    def dense(self) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` as it was packed."""
        if self.packed.dim() == 2:  # CUDA: the weight itself
            return self.packed
        blocks, steps, width, kps = self.packed.shape
        weight = self.packed.permute(0, 2, 1, 3).reshape(blocks * width, steps * kps)
        return weight[: self.out_features, : self.in_features]


def pack_linear_weight(weight: torch.Tensor) -> PackedLinearWeight:
    """Pack ``weight`` ``[out_features, in_features]`` once for :func:`linear` on its device (CPU: float32 or
    bfloat16; CUDA: also float16)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"pack_linear_weight expects a 2-D weight [out_features, in_features], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    packed = torch.ops.paged_attn.pack_linear_weight(weight)
    return PackedLinearWeight(packed, weight.shape[0], weight.shape[1])


def linear(x: torch.Tensor, weight: PackedLinearWeight) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[..., in_features]`` of the weight's dtype and device: ``[..., out_features]``, summed in
    float32 and rounded once to x's dtype."""
    if not isinstance(weight, PackedLinearWeight):
        raise TypeError(f"linear expects a PackedLinearWeight (pack_linear_weight's), got {type(weight).__name__}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, the weight {weight.in_features}")
    rows = x.reshape(x.shape[:-1].numel(), weight.in_features)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.ops.paged_attn.linear(rows, weight.packed, weight.out_features)
    return y.view(*x.shape[:-1], weight.out_features)


def linear_uses_avx512() -> bool:
    """Whether the CPU :func:`linear` runs its AVX-512 micro-kernels on this machine (AVX512_BF16, and
    ``PAGED_ATTN_NO_AVX512`` unset); elsewhere it runs a portable loop that oneDNN outruns."""
    return _C._linear_uses_avx512()
