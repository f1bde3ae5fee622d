"""The model registry: which model class serves a checkpoint (by its GGUF architecture or transformers model_type),
and ``load_model``, the model of a GGUF file or a transformers checkpoint folder, of that class. It sits above the
model files, which import only downward (the layers, the batch, the loaders, and for Gemma 3 and DeepSeek-V3 the
Llama model they build on)."""

from __future__ import annotations

import os
from typing import Optional

from .checkpoint import load_checkpoint
from .deepseek_v3 import DeepseekV3Model
from .gemma3 import Gemma3Model
from .loader import MODELS, default_model_path, load_gguf, model_path
from .model import LlamaModel

__all__ = ["MODEL_CLASSES", "load_model", "model_class"]

MODEL_CLASSES = (LlamaModel, Gemma3Model, DeepseekV3Model)


def model_class(name: str) -> type[LlamaModel]:
    """The model class of a GGUF architecture or a transformers model_type."""
    for cls in MODEL_CLASSES:
        if name in (cls.ARCHITECTURE, cls.MODEL_TYPE):
            return cls
    raise ValueError(f"expected a Llama, Gemma 3 or DeepSeek-V3 model, got {name!r}")


def load_model(path: Optional[str] = None, device="cpu", dtype=None, use_onednn=True,
               packed_linear=True, fused_elementwise=True) -> LlamaModel:
    """The model of a GGUF (default: SmolLM2-135M-Instruct) or of a transformers checkpoint folder (config.json and
    safetensors: the DeepSeek-V3 architecture, ``checkpoint.load_checkpoint``), of the class its architecture
    needs; a name of ``loader.MODELS`` (``"gemma3-270m"``, ``"smollm2-135m"``) where no such file exists stands for
    its package's GGUF, as ``python -m paged_attn --model`` takes it."""
    if path is not None and not os.path.exists(path):
        if path not in MODELS:
            raise FileNotFoundError(f"no GGUF file or checkpoint folder at {path!r}, and it is not a model's name: "
                                    f"{', '.join(f'{name!r} ({what})' for name, what in MODELS.items())}")
        path = model_path(path)
    if path is not None and os.path.isdir(path):
        config, weights, tokenizer = load_checkpoint(path)
    else:
        config, weights, tokenizer = load_gguf(path or default_model_path())
    model = model_class(config.architecture)(config, weights, tokenizer, device, dtype, use_onednn, packed_linear)
    model.fused_elementwise = fused_elementwise  # see LlamaModel.fused_elementwise
    return model
