"""The model: Llama weights as plain tensors on one device and dtype, and a compact forward pass that keeps its
keys and values in the paged KV cache (loading the checkpoint and the tokenizer: ``loader.py``).

The forward pass mirrors transformers' ``LlamaForCausalLM`` operation by operation (RMSNorm in float32, RoPE
from the same float32 tables, SwiGLU), with the query/key/value and gate/up projections fused. One step may mix
decodes, prompts and chunks of prompts: each layer writes the new tokens' keys and values with
``reshape_and_cache``, then ``paged_attention`` attends each new token causally over its sequence's cached tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .. import ops
from .loader import ModelConfig, Tokenizer, config_from_transformers, default_model_path, load_gguf

__all__ = ["Batch", "CompiledElementwise", "KVCacheGroups", "LlamaModel", "kv_cache_groups", "SERIAL_ELEMENTWISE_TOKENS", "compile_elementwise",
           "load_model", "model_class",
           # loaded by loader.py, named here too for LlamaModel's users
           "ModelConfig", "Tokenizer", "config_from_transformers", "default_model_path", "load_gguf"]


@dataclass(frozen=True)
class KVCacheGroups:
    """How the layers share the paged KV cache (window-aware memory; design: ``WINDOW_MEMORY.md``): the layers are
    split into groups of ``layers_per_group`` layers of one attention type, and every group keeps its own block
    tables and slot mapping over one pool of pages; a page holds ``block_size`` tokens of a group's layers, so a
    windowed group can release the pages that have fallen out of its window while a global one keeps them."""

    windows: tuple[Optional[int], ...]  # per group: None (global) or its sliding window; global groups first
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: which of the layers_per_group (key, value) cache tensors it uses
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_cache_groups(config: ModelConfig, window_aware: bool = True,
                    enable_prefix_caching: bool = False) -> KVCacheGroups:
    """The KV-cache groups of a model: one global group of every layer when all layers are global (Llama), when
    ``window_aware`` is off, or when prefix caching needs a global group and there is none; else, per attention
    type (global, then each window), the type's layers in order, cut into groups of the greatest common divisor of
    the types' layer counts (Gemma 3 270M: 3 global and 15 windowed layers make 6 groups of 3)."""
    num_layers = config.num_layers
    windows = config.sliding_windows or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda window: (window is not None, window or 0))
    if not window_aware or kinds == [None] or (enable_prefix_caching and None not in kinds):
        return KVCacheGroups((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    layers = {kind: [i for i, window in enumerate(windows) if window == kind] for kind in kinds}
    size = math.gcd(*(len(indices) for indices in layers.values()))
    group_windows, layer_group, layer_slot = [], [0] * num_layers, [0] * num_layers
    for kind in kinds:
        for start in range(0, len(layers[kind]), size):
            for slot, layer in enumerate(layers[kind][start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


@dataclass
class Batch:
    """Paged metadata of one step, built by the model runner: sequence ``s`` feeds its last ``q_s`` tokens (rows
    ``query_start_loc[s]:query_start_loc[s + 1]``, ``q_s`` >= 1) and attends over its first ``seq_lens[s]``.
    Layer ``i`` writes and reads the cache through its KV-cache group's ``slot_mapping`` and ``block_tables``
    (``layer_groups[i]``; see ``KVCacheGroups``)."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_groups, num_tokens]
    block_tables: torch.Tensor  # int32 [num_groups, num_seqs, max_blocks]; -1 (PAD_BLOCK_ID): none or released
    layer_groups: tuple[int, ...]  # per layer: its KV-cache group
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache once this step's are written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int  # the largest q_s
    logits_indices: torch.Tensor  # int64 [num_sampling_seqs]: rows whose next-token logits are wanted
    shared_plans: Optional[tuple[torch.Tensor, ...]] = None  # CUDA decode steps: per group, plan_shared_blocks


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # where the device's matmul has them


class LlamaModel:
    """Llama weights on one device and dtype, and the forward pass over the paged KV cache."""

    ARCHITECTURE, MODEL_TYPE = "llama", "llama"  # GGUF general.architecture, transformers model_type
    NORMS = ("input_layernorm", "post_attention_layernorm")  # each layer's norm weights (transformers' names)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Optional[Tokenizer] = None,
                 device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None, use_onednn: bool = True):
        self.config, self.tokenizer = config, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.use_onednn = use_onednn and self.device.type == "cpu" and torch.backends.mkldnn.is_available()
        self.check_dtype(self.device, self.dtype, use_onednn)

        def get(name):
            return weights[name].to(device=self.device, dtype=self.dtype)

        self.embed_tokens = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.tie_word_embeddings = "lm_head.weight" not in weights
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else get("lm_head.weight")
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            layer = {name: get(prefix + name + ".weight") for name in self.NORMS}
            layer.update({
                "qkv_proj": torch.cat([get(prefix + f"self_attn.{p}_proj.weight") for p in "qkv"]),
                "o_proj": get(prefix + "self_attn.o_proj.weight"),
                "gate_up_proj": torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]),
                "down_proj": get(prefix + "mlp.down_proj.weight"),
            })
            self.layers.append(layer)
        self.rope_cos, self.rope_signed_sin = self._rope_tables(config.rope_theta)
        # NOTE: on the CPU, oneDNN's matmul on weights packed once in its blocked layout runs these small-batch
        # projections several times faster than the default F.linear (MKL sgemm): figures in bench/RESULTS.md,
        # "Serving engine". The embedding stays dense for lookups.
        if self.use_onednn:
            self.lm_head = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, None)
            for layer in self.layers:
                for name in _PROJECTIONS:
                    layer[name] = torch.ops.mkldnn._reorder_linear_weight(layer[name], None)

    def _rope_tables(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and signed sin tables ``[max_model_len, head_dim]`` for base ``theta``, computed as
        transformers does (float32), then cast to the model's dtype."""
        head_dim = self.config.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(self.config.max_model_len).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin with its first half negated: rotate_half(x) * sin == x.roll(head_dim / 2) * signed_sin, exactly
        sin = emb.sin()
        signed_sin = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1)
        return (emb.cos().to(device=self.device, dtype=self.dtype),
                signed_sin.to(device=self.device, dtype=self.dtype))

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return F.linear(x, weight)

    @classmethod
    def check_dtype(cls, device: torch.device, dtype, use_onednn: bool = True) -> None:
        """Raise ValueError unless the forward pass can run in ``dtype`` on ``device``: one of SUPPORTED_DTYPES,
        and a small projection through the same matmul path as the model's must run."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {_names(SUPPORTED_DTYPES)}, got {dtype}")
        error = cls._matmul_error(device, dtype, use_onednn)
        if error is not None:
            supported = [d for d in SUPPORTED_DTYPES if cls._matmul_error(device, d, use_onednn) is None]
            raise ValueError(f"dtype {_names([dtype])} is not supported on {device} by this machine ({error}); "
                             f"supported here: {_names(supported)}")

    @classmethod
    def _matmul_error(cls, device: torch.device, dtype: torch.dtype, use_onednn: bool) -> Optional[str]:
        try:
            weight = torch.ones(16, 16, dtype=dtype, device=device)
            if use_onednn and device.type == "cpu" and torch.backends.mkldnn.is_available():
                weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            cls._linear(torch.ones(2, 16, dtype=dtype, device=device), weight)
        except RuntimeError as error:
            return str(error).splitlines()[0]
        return None

    @classmethod
    def from_gguf(cls, path: Optional[str] = None, device="cpu", dtype=None, use_onednn=True) -> "LlamaModel":
        """This class's model from a GGUF (``load_model`` picks the class from the file)."""
        path = path or default_model_path()
        config, weights, tokenizer = load_gguf(path)
        if config.architecture != cls.ARCHITECTURE:
            raise ValueError(f"{path}: a {config.architecture!r} GGUF, not {cls.ARCHITECTURE!r} (load_model picks the "
                             f"model class from the file)")
        return cls(config, weights, tokenizer, device, dtype, use_onednn)

    @classmethod
    def from_transformers(cls, hf_model, tokenizer=None, device="cpu", dtype=None, use_onednn=True) -> "LlamaModel":
        if getattr(hf_model.config, "model_type", None) != cls.MODEL_TYPE:
            raise ValueError(f"expected a transformers model of model_type {cls.MODEL_TYPE!r}, got "
                             f"{getattr(hf_model.config, 'model_type', None)!r}")
        weights = dict(hf_model.state_dict())
        if getattr(hf_model.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        return cls(config_from_transformers(hf_model.config), weights, tokenizer, device, dtype, use_onednn)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names (projections unpacked and unfused)."""
        def dense(w):
            return w.to_dense() if w.is_mkldnn else w

        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        weights = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.tie_word_embeddings:
            weights["lm_head.weight"] = dense(self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            q, k, v = dense(layer["qkv_proj"]).split([q_size, kv_size, kv_size])
            gate, up = dense(layer["gate_up_proj"]).chunk(2)
            weights.update({prefix + name + ".weight": layer[name] for name in self.NORMS})
            weights.update({
                prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": dense(layer["o_proj"]),
                prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": dense(layer["down_proj"]),
            })
        return weights

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                kv_scales: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                kv_amax: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
                elementwise: Optional["CompiledElementwise"] = None) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(logits_indices), vocab_size]`` of the rows named there.
        ``kv_scales``: per layer (k_scale, v_scale) of fp8 caches (float32 ``[1]``). ``kv_amax``: a list to which
        each layer appends (amax(|k|), amax(|v|)) of this step's keys and values (float32 0-d tensors; the fp8
        calibration pass, see ``model_runner``). ``elementwise``: compiled elementwise kernels (see
        ``compile_elementwise``), used for steps of at least their ``min_tokens``; the model itself stays eager."""
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        signed_sin = self.rope_signed_sin[batch.positions].unsqueeze(1)
        if elementwise is not None and num_tokens >= elementwise.min_tokens:
            rms_norm, rope_qkv, silu_mul = elementwise.rms_norm, elementwise.rope_qkv, elementwise.silu_mul
        else:
            rms_norm, rope_qkv, silu_mul = _rms_norm, _rope_qkv, _silu_mul
        eps, heads = cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        serial = _Serial(self.device.type == "cpu" and num_tokens < SERIAL_ELEMENTWISE_TOKENS)
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            with serial:
                x = rms_norm(hidden, layer["input_layernorm"], eps)
            qkv = self._linear(x, layer["qkv_proj"])
            with serial:
                q, k, v = rope_qkv(qkv, cos, signed_sin, *heads)
            attn = self._attend(batch, batch.layer_groups[i], q, k, v, kv_caches[i],
                                kv_scales[i] if kv_scales is not None else None, kv_amax)
            o = self._linear(attn, layer["o_proj"])
            with serial:
                hidden = hidden + o
                x = rms_norm(hidden, layer["post_attention_layernorm"], eps)
            gate_up = self._linear(x, layer["gate_up_proj"])
            with serial:
                x = silu_mul(gate_up)
            down = self._linear(x, layer["down_proj"])
            with serial:
                hidden = hidden + down
        with serial:
            hidden = _rms_norm(hidden[batch.logits_indices], self.norm, eps)
        return self._linear(hidden, self.lm_head).float()


    @staticmethod
    def _attend(batch: Batch, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], kv_scale: Optional[tuple[torch.Tensor, torch.Tensor]],
                kv_amax: Optional[list], **options) -> torch.Tensor:
        """One layer's attention: write the step's keys and values into the layer's cache (through its KV-cache
        ``group``'s slots), then attend each query over its sequence (``options``: ``paged_attention``'s scale, sliding_window). ``[num_tokens, num_heads *
        head_dim]``."""
        key_cache, value_cache = kv_cache
        k_scale, v_scale = kv_scale if kv_scale is not None else (None, None)
        if kv_amax is not None:
            kv_amax.append((k.abs().amax().float(), v.abs().amax().float()))
        ops.reshape_and_cache(k, v, key_cache, value_cache, batch.slot_mapping[group], k_scale=k_scale, v_scale=v_scale)
        # decode form when every sequence feeds one token (the same attention, without query_start_loc)
        chunks = batch.max_query_len > 1
        attn = ops.paged_attention(q, key_cache, value_cache, batch.block_tables[group], batch.seq_lens,
                                   query_start_loc=batch.query_start_loc if chunks else None,
                                   max_query_len=batch.max_query_len if chunks else None,
                                   k_scale=k_scale, v_scale=v_scale,
                                   shared_plan=batch.shared_plans[group] if batch.shared_plans and not chunks else None,
                                   **options)
        return attn.flatten(1)


# NOTE: a CPU step of fewer tokens than this runs its elementwise work (norms, RoPE, SiLU, residual adds) on the
# calling thread alone, and only the projections and the cache ops on all of torch's threads. ATen splits an
# elementwise op over its threads from 32768 elements on (e.g. 57 tokens x 576), and with passive waiting
# (GOMP_SPINCOUNT=0) waking OpenMP's sleeping workers costs more than such an op does; above this size two threads
# win again. Figures: bench/RESULTS.md, "Waking OpenMP's threads: a quarter of a large decode step".
SERIAL_ELEMENTWISE_TOKENS = 256


class _Serial:
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
    return CompiledElementwise(torch.compile(_rms_norm, dynamic=True), torch.compile(_rope_qkv, dynamic=True),
                               torch.compile(_silu_mul, dynamic=True), min_tokens)


# The elementwise work of a layer, as plain functions of tensors (so that torch.compile can take them whole).

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalized(x, eps).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [num_tokens, (num_heads + 2 num_kv_heads) head_dim] as q, k (rotated: views of
    one tensor) and v (a view of qkv). Queries and keys are rotated together: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin computed as x.roll(head_dim / 2) * signed_sin (the same products, bit for bit)."""
    num_tokens, qk_heads = qkv.shape[0], num_heads + num_kv_heads
    qk = _rotate(qkv[:, : qk_heads * head_dim].view(num_tokens, qk_heads, head_dim), cos, signed_sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, qkv[:, qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[num_tokens, heads, head_dim]``: x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def model_class(name: str) -> type[LlamaModel]:
    """The model class of a GGUF architecture or a transformers model_type: LlamaModel or Gemma3Model."""
    from .gemma3 import Gemma3Model  # (which builds on this module)

    for cls in (LlamaModel, Gemma3Model):
        if name in (cls.ARCHITECTURE, cls.MODEL_TYPE):
            return cls
    raise ValueError(f"expected a Llama or Gemma 3 model, got {name!r}")


def load_model(path: Optional[str] = None, device="cpu", dtype=None, use_onednn=True) -> LlamaModel:
    """The model of a GGUF (default: SmolLM2-135M-Instruct), of the class its architecture needs."""
    config, weights, tokenizer = load_gguf(path or default_model_path())
    return model_class(config.architecture)(config, weights, tokenizer, device, dtype, use_onednn)


def _names(dtypes) -> str:
    return ", ".join(str(dtype).replace("torch.", "") for dtype in dtypes)
