"""Typed wrappers over ``torch.ops.paged_attn.*`` (their fake kernels are in ``paged_attn/fakes.py``).

Glossary: every file of this repository (C++, CUDA, Python, docs) uses these words in these senses only.

- block: ``block_size`` consecutive token slots of a cache, the unit the block manager hands out, shares
  (copy-on-write, prefix caching) and swaps. A CUDA *thread block* is always named so (launch-plan fields such as
  ``heads_per_block`` and ``blocks_per_group`` count thread blocks).
- block table: a sequence's physical block ids, in token order. slot: one token's place in a cache, ``block *
  block_size + offset`` (``slot_mapping``; negative: a padding token).
- KV pool / swap space: the engine's cache blocks on its device, CPU or GPU (``num_kv_blocks``), and the CPU
  blocks that preempted sequences are swapped to (``num_swap_blocks``).
- row: one query token (all its heads) and its output: one per sequence in decode, one per query token in a
  prefill. A K or V row is one token's ``head_dim`` elements of one kv head; prefill tiles stack (token, head) rows.
- head group: the ``group_size = num_heads // num_kv_heads`` query heads that read one kv head (1 for MHA).
- chunk: the part of a prompt that one engine step computes (chunked prefill, ``max_num_batched_tokens``).
- tile: the keys (key tile) or query rows (query tile) that one step of a kernel loads and works on together: CPU
  decode 16 keys at multiples of 16; CPU prefill 32 keys x 48 rows; CUDA-core decode 256 keys; tensor-core decode
  16 keys per warp; CUDA prefill 64 keys (16 at head dim 256) x 64 rows. (MMA operands and AMX tile registers keep
  their hardware names; the *tiled cache layout*, below, is named for the 16-token tiles of its key cache.)
- vector: what one SIMD register or memory access holds: ``kVecSize`` floats, or 32 bfloat16 (``kBf16Vec``) on
  the CPU's AVX-512 path; 16 bytes on CUDA.
- partition: a span of a row's keys attended from a fresh online-softmax state (max, sum, acc); a row's partitions'
  states are merged left to right. CPU decode: always, 512 keys at multiples of 512 (so batch-invariant). CUDA:
  ``partition_size`` keys from the launch plan (split-KV: 64 to 512 by default, merged by the reduce kernel; single
  pass: the whole row). A *partition slot* is a ``grid.z`` index, whose thread block runs partitions z, z +
  grid.z, ...
- item: one entry of a decode kernel's work list: on CUDA what ``grid.x`` counts (a sequence or a query row), on
  the CPU one partition of one row (each thread takes a run of items).
- task: what one worker takes at a time: a CUDA thread block's (item, kv head, part of the head group,
  partition); a CPU prefill (sequence, kv head, query tile); an entry of a shared-blocks plan (below).
- shared blocks: physical blocks that several rows' block tables hold at the same positions (samples or beams of
  a prompt, a cached prefix), read once for all those rows. A shared segment is what such rows read together: on
  the CPU the shared tokens of one partition, for up to 16 rows (the op finds them itself); on CUDA a task of
  :func:`plan_shared_blocks`, a block range for up to 8 rows, in whole partitions.
- head slot: one of the 8 query-head places of a CUDA tensor-core decode thread block (N of its m16n8k16).
- sink: a per-head logit with no value vector (gpt-oss), counted once per row, where the row's state is final.
- lse: per row and head, the natural-log log-sum-exp of the final logits (``return_lse``,
  :func:`merge_attention_states`).

The cache layout (the one full description; every other file points here):

- Shape: ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the "NHD" layout
  FlashAttention and FlashInfer also read), both of one shape, dtype and device; ``block_size``, ``num_kv_heads`` and
  ``head_dim`` are positive, ``num_blocks`` may be 0 (an empty pool).
- Strides: the last dimension (``head_dim``) is contiguous; the block, token and head dimensions may have any strides
  under which no two elements share memory (taken by increasing stride, each dimension steps past everything the
  smaller ones cover). So the caches can be the two halves of one ``[num_blocks, 2, block_size, num_kv_heads,
  head_dim]`` allocation, the K and V halves of vLLM's packed ``[num_blocks, block_size, num_kv_heads, 2 * head_dim]``
  cache (head stride ``2 * head_dim``), or have the token and head dimensions transposed.
- Slots: token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset ``t % block_size``; its
  *slot* is ``block * block_size + offset``, so a cache holds ``num_blocks * block_size`` slots. Kv head ``h``'s row
  of ``head_dim`` elements starts at ``block * block_stride + offset * token_stride + h * head_stride``. A negative
  slot (``slot_mapping``) marks a padding token.
- Dtypes: float32, float16 or bfloat16 (keys, values and queries then have the caches' dtype), or fp8
  (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, half the bytes of bfloat16; keys, values and queries stay
  float32, float16 or bfloat16). Each fp8 cache has a scale, ``k_scale`` / ``v_scale``: a float32 tensor of one
  element on the caches' device (default 1.0), finite and nonzero: 0, -0, NaN and +-inf are refused (on the CPU
  always; on CUDA with validation on, see :func:`set_validation`, since reading the value there synchronizes; a fake
  kernel knows the value only of a constant made while tracing). Scales are an error with any other dtype.
  :func:`reshape_and_cache` stores the fp8 value nearest to ``x / scale`` (round to nearest even, saturated to the
  largest finite value, 448 for e4m3fn and 57344 for e5m2; NaN stays NaN); :func:`paged_attention` reads
  ``float(stored) * scale``. :func:`copy_blocks` and :func:`swap_blocks` copy the bytes.
  ``paged_attn.reference.quantize_fp8`` / ``dequantize_fp8`` say the same in PyTorch.
- Block spans (:func:`swap_blocks`): ``src`` and ``dst`` are any ``[num_blocks, ...]`` tensors with the same
  per-block shape, strides and dtype. Each block is copied as the run of bytes it *spans*, from its first element to
  the end of its last, the bytes between its rows included (the V rows of a packed K|V block when its K half is
  swapped); the block stride must reach past a block's span.

The tiled layout (paged_attn/tiled_cache.py holds its one full description): a second layout for the CPU ops
(:func:`reshape_and_cache`, :func:`copy_blocks`, :func:`swap_blocks`, :func:`paged_attention`), bfloat16 or fp8,
laid out for the dot-product units: keys ``[num_blocks, num_kv_heads, block_size // 16, head_dim // 2, 16, 2]``,
values ``[num_blocks, num_kv_heads, block_size // 2, head_dim, 2]``, each block contiguous. Both caches of a call are
tiled or neither (the rank tells them apart: 6 and 5 dims); slots, block tables and scales are as above.
:func:`pack_cache` and :func:`unpack_cache` convert, :func:`tiled_cache_shapes` gives the shapes, :func:`is_tiled`
tells the layouts apart. CUDA ops and the MLA ops do not take tiled caches.

Memory: a tensor an op writes (the caches of :func:`reshape_and_cache` and :func:`copy_blocks`, ``dst`` of
:func:`swap_blocks`, ``out`` of :func:`paged_attention`, ``out`` and ``lse`` of :func:`merge_attention_states`) must
not share a byte with any other argument; the tensors an op only reads may share memory with each other (one scale
tensor as both ``k_scale`` and ``v_scale``, one tensor as ``key`` and ``value``, or as both caches of
:func:`paged_attention`). Memory is compared element by element, so
interleaved but disjoint layouts (the halves of a ``[num_blocks, 2, ...]`` allocation) are fine; :func:`swap_blocks`
compares the block spans of ``dst`` with those of ``src`` and with ``block_mapping`` (unless ``src`` and ``dst`` are
one cache: the same data pointer, shape and strides).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _C
from . import fakes  # noqa: F401  (registers the fake kernels)
from .fakes import _INT64_MAX, _check_max_query_len, _is_finite, _is_int
from .elementwise import add_rms_norm, rms_norm, silu_and_mul  # noqa: F401  (part of this module's API)
from .linear import PackedLinearWeight, linear, linear_uses_avx512, pack_linear_weight  # noqa: F401  (part of this module's API)
from .mla import concat_and_cache_mla, mla_attention  # noqa: F401  (part of this module's API)
from .shared_plan import plan_shared_blocks  # noqa: F401  (part of this module's API)
from .tiled_cache import is_tiled, logical_shape, pack_cache, tiled_cache_shapes, unpack_cache  # noqa: F401  (API)

BlockMapping = Union[torch.Tensor, Sequence[Sequence[int]]]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write new keys and values into their cache slots, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the caches (float32, float16 or
            bfloat16 for an fp8 cache); any strides as long as the last dimension is contiguous (e.g. slices of a
            fused QKV projection).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, modified in place; or, on the
            CPU, a tiled pair (:func:`pack_cache`), written in its layout.
        slot_mapping: int64 ``[num_tokens]`` on the caches' device; token ``i`` goes to slot ``slot_mapping[i]``;
            a negative slot marks a padding token, which is skipped.
        k_scale, v_scale: fp8 caches only: float32 ``[1]`` on the caches' device (default 1.0); the key cache stores
            the fp8 value nearest to ``key / k_scale`` (see the module docstring).

    Example::

        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim)
        value_cache = torch.empty_like(key_cache)
        paged_attn.reshape_and_cache(k, v, key_cache, value_cache, torch.tensor([0, 1, 17]))
    """
    torch.ops.paged_attn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                           v_scale=v_scale)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: BlockMapping,
) -> None:
    """Copy whole blocks within each layer's caches (copy-on-write), in place.

    Args:
        key_caches, value_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer, all of
            the same shape, dtype and device. Caches without a K/V pair (MLA's latent caches ``[num_blocks,
            block_size, kv_lora_rank + rope_dim]``, or any single cache per layer): ``key_caches`` only and
            ``value_caches=[]``. On the CPU a layer's pair may be tiled (:func:`pack_cache`: both of the layer's
            caches; the layers' logical shapes, dtypes and devices must agree).
        block_mapping: int64 ``[num_pairs, 2]`` of ``(src_block, dst_block)`` (or a list of pairs), on the CPU or
            the caches' device. Every pair is copied in every layer; destinations are distinct and never sources.
            On CUDA all layers and pairs take one kernel launch and the host never waits for the device.

    CUDA graphs: a call with ``block_mapping`` on the caches' device can be captured (validation off: see
    :func:`set_validation`); a replay copies the pairs the mapping holds at replay time, in the caches captured.
    A CPU mapping (tensor or list) cannot: it is copied into a private pinned buffer during the call and uploaded
    from there, so the caller may overwrite or free it as soon as the call returns.
    """
    torch.ops.paged_attn.copy_blocks(list(key_caches), list(value_caches), _as_block_mapping(block_mapping))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: BlockMapping) -> None:
    """Copy blocks from one cache to another, on any pair of devices (swap out GPU->CPU, swap in CPU->GPU).

    Args:
        src, dst: caches ``[num_blocks, ...]`` with the same per-block shape, strides and dtype (the block
            dimension may have any stride). ``dst`` is modified in place. Each block is copied as the run of bytes
            it spans: for a strided view that includes the bytes between its rows, e.g. the V rows of a packed K|V
            cache when its K half is swapped; swap both halves with the same mapping, or swap the packed tensor
            itself (one copy instead of two). So the runs dst's blocks span must not overlap src's (e.g. the K and
            V halves of one packed cache cannot be swapped into each other) nor ``block_mapping``, unless src and
            dst are the same memory (same data pointer, shape and strides: one cache, whose destinations are then
            never sources). Tiled caches (:func:`pack_cache`) are swapped as any others: a block is a contiguous run.
        block_mapping: int64 ``[num_pairs, 2]`` of ``(src_block, dst_block)`` on the CPU (or a list of pairs);
            destinations are distinct.

    On CUDA the copies run on the current stream, one copy per run of consecutive block ids, and are asynchronous
    with respect to the host when the CPU side is pinned memory.
    """
    torch.ops.paged_attn.swap_blocks(src, dst, _as_block_mapping(block_mapping))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: Optional[torch.Tensor] = None,
    max_query_len: Optional[int] = None,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
    shared_plan: Optional[torch.Tensor] = None,
):
    """Attention over a paged KV cache: decode (one query token per sequence), or any mix of prefills, prefill
    chunks and decodes with ``query_start_loc``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` (last dimension contiguous), same dtype as the caches
            (float32, float16 or bfloat16 for an fp8 cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, last dimension contiguous,
            any other strides (e.g. the K and V halves of vLLM's packed ``[..., 2 * head_dim]`` cache);
            ``num_heads`` must be a multiple of ``num_kv_heads`` (query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)``). The values may have a width of their own, ``head_dim_v``
            (``value_cache`` ``[..., head_dim_v]``, the output too): MLA's prefill with up-projected keys of 192 and
            values of 128, or a latent cache's first columns as values (CPU; on CUDA not yet). On the CPU such a
            call runs every row on the decode kernel (the rows of a prompt share its partitions there). On the CPU
            the caches may be a tiled pair (:func:`pack_cache`; then ``head_dim_v = head_dim``).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past ``ceil(seq_lens[s] / block_size)`` are
            never read and may hold anything (e.g. -1).
        seq_lens: int32 ``[num_seqs]``: tokens of each sequence in the cache, the query tokens' own included
            (write them with :func:`reshape_and_cache` first).
        query_start_loc: int32 ``[num_seqs + 1]``, from 0, non-decreasing, ending at ``num_tokens``: query rows
            ``qsl[s]:qsl[s + 1]`` are the last ``q_s = qsl[s + 1] - qsl[s]`` tokens of sequence ``s`` (``q_s <=
            seq_lens[s]``; 0 is allowed), at positions ``seq_lens[s] - q_s + i``; each attends causally to the
            sequence's tokens up to its own position. Without it, one token per sequence (``num_tokens =
            num_seqs``), the last one: a sequence of length 0 then gets a zero output row.
        max_query_len: optional upper bound of ``q_s`` (host int, like FlashAttention's ``max_seqlen_q``). The
            CUDA launch never reads ``query_start_loc`` on the host, with or without it (the call can be captured
            in a CUDA graph); ``max_query_len <= 1`` (every sequence a decode) skips the launch of the multi-row
            kernel. A bound smaller than some ``q_s`` is an error (checked on the CPU, and on CUDA with
            validation on).
        scale: logit scale, default ``head_dim ** -0.5``.
        alibi_slopes: float32 ``[num_heads]``: adds ``slope[h] * (t - p)`` to the logit of token ``t`` for the
            query at position ``p``.
        sliding_window: only the last ``sliding_window`` positions up to ``p`` take part (``t > p - window``).
        logits_soft_cap: ``c``: logits become ``c * tanh(logit / c)`` (before ALiBi).
        out: optional ``[num_tokens, num_heads, head_dim_v]`` contiguous output to write into.
        k_scale, v_scale: fp8 caches only: float32 ``[1]`` on the caches' device (default 1.0); keys are read as
            ``float(key_cache) * k_scale``, values as ``float(value_cache) * v_scale``.
        return_lse: also return each row's log-sum-exp.
        sinks: attention sinks (gpt-oss): ``[num_heads]`` float32 (or float16 / bfloat16, as gpt-oss stores them,
            converted exactly) on the query's device; head ``h``'s softmax also counts ``sinks[h]`` as a logit
            without a value vector: ``out = sum_t e^(x_t - M) v_t / (e^(sinks[h] - M) + sum_t e^(x_t - M))``, ``M``
            the max over the row's logits and the sink. The sink is not scaled, soft-capped, biased by ALiBi or
            masked by the window, and is counted once per row whatever the split (partitions, threads, shared
            blocks). As openai/gpt-oss's ``torch/model.py`` ``sdpa`` (the sink concatenated, unscaled, to the
            scaled and masked logits before the softmax, its weight dropped), vLLM's CPU ``s_aux`` and
            FlashAttention's ``learnable_sink``. ``-inf``: no sink for that head (the same bits as without);
            ``+inf``: the sink takes the whole softmax, the output is 0 (its limit), never NaN; NaN is an error
            (on CUDA with validation on; without it the head's output is NaN). A row that sees no key outputs
            zeros. With ``return_lse`` the lse counts the sink (``sinks[h]`` for a row that sees no key), so a
            cascade passes ``sinks`` to one of its parts only.
        shared_plan: a plan of :func:`plan_shared_blocks` (int32 ``[num_tasks, 11]``, on the query's device): on
            CUDA, decode (no ``query_start_loc``) on the tensor-core kernel (float16 / bfloat16 over a cache of the
            same dtype, compute capability 8.0+) reads the blocks it lists once per kv head for the rows that share
            them, and takes split-KV. Any contents are safe: each listing is checked in the kernel against the
            block tables, lengths and window it is used with, and one that does not hold is not used (the row reads
            those blocks itself), so a stale plan costs time, never a wrong result; with a plan that holds, every
            row's output has the same bits as with no plan under the same split-KV partitions. The other CUDA
            paths (float32 queries, fp8 caches, ``query_start_loc``, GPUs below 8.0) do not read it. On the CPU
            the plan is checked for its shape and otherwise not read: the CPU kernel finds the sharing itself.

    Returns:
        ``[num_tokens, num_heads, head_dim_v]`` in the query dtype (``out`` when given); with ``return_lse``,
        ``(out, lse)``: lse float32 ``[num_tokens, num_heads]``, per row and head the natural-log log-sum-exp of
        its final logits (scaled, soft-capped, with ALiBi) over the keys it sees, ``-inf`` for a row that sees no
        key; with :func:`merge_attention_states`, partial results over disjoint key ranges (a cascade over a shared
        prefix, split-KV) merge into the full one. Softmax and the weighted
        sum are accumulated in float32. On the CPU the result is batch-invariant: a decode row's keys are summed
        in partitions at fixed token positions (multiples of 512) merged left to right, so its output bits do not
        depend on the other sequences of the batch, their order, the thread count, or which physical blocks
        hold its keys (and a prefill row's do not depend on the other sequences either). Shared blocks: on the
        CPU the op finds, in the block tables, the tokens of a 512-token partition that several decode rows read
        in the same physical blocks (the same entries from the partition's start: a prompt shared by samples or
        beams, a cached prefix shared by requests, the rows of one sequence in a variable-length call; the whole
        partition, or its first tokens up to a multiple of 16 where the rows' blocks or lengths part) and reads
        them once for up to 16 of those rows, each row from its own state and then on alone through the rest of
        its partition, so the bits stay those of the row alone. Nothing to
        pass; ``PAGED_ATTN_NO_SHARED_BLOCKS=1`` switches the search off (for measuring). ``PAGED_ATTN_AMX=1`` (read
        once per process) runs bfloat16 decode rows on Intel AMX where the CPU has it: faster where rows share
        blocks, slower for a row alone, and other bits than without it (still the same bits shared or not).

    Example::

        out = paged_attn.paged_attention(q, key_cache, value_cache, block_tables, seq_lens)  # decode
        out = paged_attn.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32))
    """
    if query.dim() != 3 or query.shape[1] == 0 or query.shape[2] == 0:
        raise ValueError(f"query must have shape [num_tokens, num_heads, head_dim] with positive num_heads and "
                         f"head_dim, got {tuple(query.shape)}")
    if sliding_window is not None and not (_is_int(sliding_window) and 0 < sliding_window <= _INT64_MAX):
        raise ValueError(f"sliding_window must be a positive integer number of tokens (at most 2**63 - 1: the op "
                         f"takes an int64) or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not (_is_finite(logits_soft_cap) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be positive and finite, or None, got {logits_soft_cap}")
    if scale is not None and not _is_finite(scale):
        raise ValueError(f"scale must be finite or None, got {scale}")
    _check_max_query_len(max_query_len, query_start_loc)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if out is None:
        # head_dim_v: a row-major cache's last size; a tiled one's is not (its logical shape says it). The op checks
        # the caches; a malformed one only sizes out wrongly here before the op refuses it.
        value_shape = logical_shape(value_cache) if is_tiled(value_cache) else value_cache.shape
        out = torch.empty(tuple(query.shape[:2]) + tuple(value_shape[3:]), dtype=query.dtype, device=query.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if return_lse else None
    torch.ops.paged_attn.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), alibi_slopes,
        int(sliding_window or 0), float(logits_soft_cap or 0.0), query_start_loc,
        None if max_query_len is None else int(max_query_len), k_scale=k_scale, v_scale=v_scale, lse=lse,
        sinks=sinks, shared_plan=shared_plan,
    )
    return (out, lse) if return_lse else out


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key ranges A and B into the result over A and B, exactly
    (split-KV decode, cascade / shared-prefix attention, chunked prefill against a cached prefix).

    With ``m = max(lse_a, lse_b)``, ``w_a = exp(lse_a - m)``, ``w_b = exp(lse_b - m)``, per (token, head)::

        out = (w_a * out_a + w_b * out_b) / (w_a + w_b)    # float32, rounded once to out's dtype
        lse = m + log(w_a + w_b)

    Args:
        out_a, out_b: ``[num_tokens, num_heads, head_dim]``, float32, float16 or bfloat16, of one shape, dtype and
            device, last dimension contiguous (any other strides).
        lse_a, lse_b: float32 ``[num_tokens, num_heads]`` on that device, any strides: the natural-log log-sum-exp
            of each row's (scaled) logits over its key range; ``-inf`` for a part that saw no key. vLLM keeps lse as
            ``[num_heads, num_tokens]``: pass ``lse.t()``.
        out, lse: optional outputs to write into (``out`` like ``out_a``, ``lse`` float32 ``[num_tokens,
            num_heads]``, any strides without self-overlap); neither may share memory with another argument.

    Returns:
        ``(out, lse)``.

    Edges, one rule for every sink and mask (splitting a call's keys in two, the sinks in one part, and merging
    gives the whole call): an lse of ``+inf`` dominates (a part whose softmax mass is infinite, as a ``+inf`` sink
    makes it: :func:`paged_attention` then returns out 0 and lse ``+inf``): ``out`` is that part's output and ``lse``
    ``+inf`` (both ``+inf``: the mean of the two); ``-inf`` is a part that saw no key; both parts ``-inf``: ``out =
    0 * out_a + 0 * out_b`` (0 for finite values, never NaN from 0 / 0) and ``lse = -inf``; a NaN lse gives a NaN row and NaN lse; a NaN in ``out_a`` or
    ``out_b`` gives NaN in that element, even where its part has weight 0 (``0 * NaN``), as in vLLM.

    Checked against vLLM's ``merge_attn_states`` (``csrc/attention/merge_attn_states.cu`` and the Triton
    ``triton_merge_attn_states.py``): the same formula (scales ``w / (w_a + w_b)`` first, then a float32 sum,
    one rounding) and NaN propagation; there lse is ``[num_heads, num_tokens]``, an lse of ``+inf`` reads as ``-inf``
    (FlashAttention 2's marker of a part that saw no key: convert such an lse before merging it here) and two
    ``-inf`` parts give NaN (``-inf - -inf``), here 0 and -inf. FlashInfer's ``merge_state``
    (``include/flashinfer/attention/cascade.cuh``): the same formula and our ``[num_tokens, num_heads]`` lse
    layout, but its lse is base 2 (multiply ours by ``log2(e)``), it has no +inf rule, and two ``-inf`` parts give
    NaN too.

    Example::

        out_a, lse_a = ...  # attention over keys [0, k)
        out_b, lse_b = ...  # attention over keys [k, n)
        out, lse = paged_attn.merge_attention_states(out_a, lse_a, out_b, lse_b)  # attention over [0, n)
    """
    if out is None:
        out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    if lse is None:
        lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
    torch.ops.paged_attn.merge_attention_states(out, lse, out_a, lse_a, out_b, lse_b)
    return out, lse


def set_validation(enabled: bool) -> None:
    """Turn on (or off) index and scale validation for CUDA ops.

    Checking slot and block ids, and the values of fp8 scales, on CUDA copies them to the host, which synchronizes,
    so it is off by default; when on, an out-of-range index or a zero or non-finite scale raises the same clear error
    as on the CPU (where they are always checked) before anything is written. The environment variable
    ``PAGED_ATTN_VALIDATE=1`` turns it on at import.
    """
    _C.set_validation(bool(enabled))


def set_batch_invariant(enabled: bool) -> None:
    """Make (or stop making) every CUDA decode row's output bits independent of its batch.

    The CPU kernels always are (``tests/ops/test_batch_invariance.py``). On CUDA the decode plan otherwise picks the
    single pass or split-KV, and the partitions' size, from the batch, its block table's width and the GPU's SM count
    (``csrc/cuda/launch_plan.h``), and a row's bits follow. When on, every decode row's keys are cut into partitions
    of 512 tokens at fixed positions, each attended from a fresh state, always merged by split-KV's reduce in a fixed
    order: a row gets the same bits alone or in any batch, in any order, beside any table width (up to 33.5M
    tokens), on any number of SMs, with or without a shared-blocks plan, and as a decode row of a ``query_start_loc``
    call. Prefill rows (two or more query rows) are so in either mode: their tiles are their sequence's own. Not
    invariant: across dtypes, head dims or block sizes, between a GPU with tensor cores (compute capability 8.0+)
    and one without, or between the CPU and CUDA. The cost: split-KV for every call (two launches, the partition
    records), where short batches would run a single pass. ``PAGED_ATTN_BATCH_INVARIANT=1`` turns it on at import.
    """
    _C.set_batch_invariant(bool(enabled))


def batch_invariant() -> bool:
    """Whether the CUDA decode is batch-invariant (see :func:`set_batch_invariant`)."""
    return _C.batch_invariant_enabled()


def validation_enabled() -> bool:
    """Whether CUDA index and scale validation is on (see :func:`set_validation`)."""
    return _C.validation_enabled()


def has_cuda_kernels() -> bool:
    """Whether this build of the extension contains the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("paged_attn::reshape_and_cache", "CUDA")



def _as_block_mapping(block_mapping: BlockMapping) -> torch.Tensor:
    """A tensor as it is (the op checks it); a sequence must be of (src_block, dst_block) integer pairs."""
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping
    pairs = list(block_mapping)
    if not all(hasattr(pair, "__len__") and len(pair) == 2 and all(map(_is_int, pair)) for pair in pairs):
        raise ValueError(f"block_mapping must be a list of (src_block, dst_block) integer pairs, got {block_mapping!r}")
    return torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2)
