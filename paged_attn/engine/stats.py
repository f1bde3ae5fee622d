"""The engine's statistics: ``EngineStats`` (what ``LLM.stats()`` returns) and the ``StatsCollector`` that the
``LLM`` feeds with each scheduled step and each sampled token, from the start of every ``generate`` call."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._deprecation import renamed_attributes
from ..block_manager import BlockManager
from ..block_stats import BlockManagerStats


@renamed_attributes(num_gpu_blocks="num_kv_blocks", num_cpu_blocks="num_swap_blocks", gpu_blocks_used="kv_blocks_used",
                    peak_gpu_blocks_used="peak_kv_blocks_used")
@dataclass(frozen=True)
class EngineStats:
    """KV-cache and scheduling figures since the last ``generate`` began (peaks over its steps) and now."""

    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    bytes_per_block: int  # key and value, every layer of a KV-cache group
    kv_blocks_used: int  # now
    peak_kv_blocks_used: int
    peak_tokens: int  # tokens stored (counted per sequence) at the peak
    utilization_at_peak: float  # slots holding a token / slots in used blocks, at the peak
    peak_blocks_saved_by_sharing: int  # block-table entries minus physical blocks (fork, prefix hits)
    num_preemptions: int
    num_swapped_out: int
    num_recomputed: int
    prefix_cache_hit_tokens: int
    num_prefill_tokens: int  # tokens computed in prefill (prompts, and recomputation after preemption)
    num_generated_tokens: int
    num_steps: int  # forward passes
    num_decode_steps: int  # steps that decoded at least one token
    num_mixed_steps: int  # steps that decoded and computed prefill tokens together
    peak_running_seqs: int  # sequences in one step, at most
    kv_cache_dtype: str = ""  # the cache tensors' dtype, e.g. "bfloat16" or "float8_e4m3fn"
    num_kv_cache_groups: int = 1  # block tables per sequence (model_runner.kv_cache_groups); a block: a group's layers
    # KV bytes held per attention type ("global", "sliding_window"), now and at the peak of kv_blocks_used
    kv_bytes_by_attention_type: dict = field(default_factory=dict)
    peak_kv_bytes_by_attention_type: dict = field(default_factory=dict)
    # what one token's keys and values would take in every layer as plain multi-head attention (per head, a key and
    # a value): for a latent-attention (MLA) model, against bytes_per_token; for others, bytes_per_token itself
    mha_bytes_per_token: int = 0

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in every layer."""
        return self.bytes_per_block * self.num_kv_cache_groups // self.block_size



class StatsCollector:
    """Counters and peaks of one ``generate`` call: ``reset`` at its start, ``record_step`` after each step is
    scheduled (with the block manager then), ``record_generated`` for the tokens sampled."""

    def __init__(self, now: BlockManagerStats):
        self.reset(now)

    def reset(self, now: BlockManagerStats) -> None:
        self.peak = now
        self.peak_saved = now.blocks_saved_by_sharing
        self.num_swapped_out = self.num_recomputed = 0
        self.prefix_cache_hit_tokens = self.num_prefill_tokens = self.num_generated_tokens = 0
        self.num_steps = self.num_decode_steps = self.num_mixed_steps = self.peak_running_seqs = 0

    def record_step(self, step, block_manager: BlockManager) -> None:
        """A ``ScheduledStep`` as the scheduler returned it, and the block manager after scheduling it. The
        manager's counters give the blocks used and saved; its full stats are taken only at a new peak."""
        self.num_steps += 1
        self.num_prefill_tokens += step.num_prefill_tokens
        self.num_decode_steps += step.num_decode_tokens > 0
        self.num_mixed_steps += step.num_decode_tokens > 0 and step.num_prefill_tokens > 0
        self.num_swapped_out += step.num_swapped_out
        self.num_recomputed += step.num_recomputed
        self.prefix_cache_hit_tokens += step.prefix_cache_hit_tokens
        self.peak_running_seqs = max(self.peak_running_seqs, step.num_running_seqs)
        pool = block_manager.kv_pool
        if pool.num_used > self.peak.kv_blocks_used:
            self.peak = block_manager.stats()
        self.peak_saved = max(self.peak_saved, pool.num_saved_by_sharing)

    def record_generated(self, num_tokens: int) -> None:
        self.num_generated_tokens += num_tokens

    def snapshot(self, block_manager: BlockManager, bytes_per_block: int, kv_cache_dtype: str,
                 mha_bytes_per_token: int = 0) -> EngineStats:
        now = block_manager.stats()
        return EngineStats(
            block_size=block_manager.block_size, num_kv_blocks=now.num_kv_blocks,
            num_swap_blocks=block_manager.num_swap_blocks, bytes_per_block=bytes_per_block,
            kv_blocks_used=now.kv_blocks_used, peak_kv_blocks_used=self.peak.kv_blocks_used,
            peak_tokens=self.peak.num_tokens, utilization_at_peak=self.peak.utilization,
            peak_blocks_saved_by_sharing=self.peak_saved,
            num_preemptions=self.num_swapped_out + self.num_recomputed,
            num_swapped_out=self.num_swapped_out, num_recomputed=self.num_recomputed,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens, num_prefill_tokens=self.num_prefill_tokens,
            num_generated_tokens=self.num_generated_tokens, num_steps=self.num_steps,
            num_decode_steps=self.num_decode_steps, num_mixed_steps=self.num_mixed_steps,
            peak_running_seqs=self.peak_running_seqs, kv_cache_dtype=kv_cache_dtype,
            num_kv_cache_groups=block_manager.num_groups,
            kv_bytes_by_attention_type={kind: blocks * bytes_per_block
                                        for kind, blocks in now.kv_blocks_by_attention_type.items()},
            peak_kv_bytes_by_attention_type={kind: blocks * bytes_per_block
                                             for kind, blocks in self.peak.kv_blocks_by_attention_type.items()},
            mha_bytes_per_token=mha_bytes_per_token,
        )
