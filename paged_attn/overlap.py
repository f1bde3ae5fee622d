"""The memory-overlap geometry of csrc/overlap.cpp in Python, for the fake kernels (paged_attn/fakes.py): which bytes
a strided layout's elements cover, and whether two layouts share a byte. Plain integers in, nothing raised; the same
decisions as the C++, case for case, so the fakes refuse exactly what the kernels refuse (how it decides: see
csrc/overlap.h).

A layout here is a tensor's place in its storage, in bytes: the offset of its first element (storage_offset times
the element size, where the C++ has the data pointer), its sizes, its strides in bytes and its element size.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Footprint(NamedTuple):
    """The bytes a layout's elements cover, as a lattice of contiguous runs: a run of `run` bytes starts at
    begin + sum(i_d * stride_d) for every index i_d < size_d of the outer dims, given by increasing stride."""

    begin: int
    run: int
    outer: tuple[tuple[int, int], ...]  # (stride, size), strides in bytes


def footprint(begin: int, sizes: Sequence[int], strides: Sequence[int], elem: int) -> Footprint:
    """The footprint of a non-empty layout (strides in bytes, elem the element size); as footprint_of."""
    outer = sorted((stride, size) for size, stride in zip(sizes, strides) if size > 1 and stride != 0)
    run, inner = elem, 0  # dims that continue the run: their copies of it leave no gap
    while inner < len(outer) and outer[inner][0] <= run:
        run += (outer[inner][1] - 1) * outer[inner][0]
        inner += 1
    return Footprint(begin, run, tuple(outer[inner:]))


def span_bytes(sizes: Sequence[int], strides: Sequence[int], elem: int) -> int:
    """The bytes from a layout's first element to the end of its last (strides in bytes); 0 when it is empty.
    Of a cache's block (its sizes and strides after the first): block_span_bytes."""
    if any(size == 0 for size in sizes):
        return 0
    return sum((size - 1) * stride for size, stride in zip(sizes, strides)) + elem


def block_spans(begin: int, sizes: Sequence[int], strides: Sequence[int], elem: int) -> Footprint:
    """The bytes swap_blocks copies of a cache's blocks: one run of span_bytes(block) per block, a block stride apart
    (runs that touch or overlap merge into one); as block_spans_of."""
    run = span_bytes(sizes[1:], strides[1:], elem)
    if sizes[0] > 1 and strides[0] != 0:
        if strides[0] <= run:
            return Footprint(begin, run + (sizes[0] - 1) * strides[0], ())
        return Footprint(begin, run, ((strides[0], sizes[0]),))
    return Footprint(begin, run, ())


def byte_range(f: Footprint) -> tuple[int, int]:
    """[begin, end) of the bytes f covers."""
    return f.begin, f.begin + f.run + sum((size - 1) * stride for stride, size in f.outer)


def intersect(a: Footprint, b: Footprint) -> bool:
    """Whether a and b cover a common byte (of one storage); as footprints_intersect."""
    (a_begin, a_end), (b_begin, b_end) = byte_range(a), byte_range(b)
    if a_end <= b_begin or b_end <= a_begin:
        return False
    if len(a.outer) <= 1 and len(b.outer) <= 1:
        if not a.outer and not b.outer:
            return True  # two single runs whose ranges intersect
        stride = (a.outer or b.outer)[0][0]
        if not b.outer or b.outer[0][0] == stride:  # one common stride: closed form
            return _lattices_intersect(a.begin, a.run, a.outer[0][1] if a.outer else 1, b.begin, b.run,
                                       b.outer[0][1] if b.outer else 1, stride)
    # The same nested lattice at two offsets (the K and V halves of a packed cache): only equal indices can meet.
    if a.outer and a.outer == b.outer and _nested(a):
        delta, s0 = b.begin - a.begin, a.outer[0][0]
        if delta - a.run >= -s0 and delta + b.run <= s0:
            return -b.run < delta < a.run
    # Unusual layouts: sweep both sorted lists of runs.
    runs_a, runs_b = _runs(a), _runs(b)
    i = j = 0
    while i < len(runs_a) and j < len(runs_b):
        if runs_a[i][1] <= runs_b[j][0]:
            i += 1
        elif runs_b[j][1] <= runs_a[i][0]:
            j += 1
        else:
            return True
    return False


def _lattices_intersect(a: int, la: int, na: int, b: int, lb: int, nb: int, s: int) -> bool:
    """Runs of la bytes at a + i * s (i < na) and of lb bytes at b + j * s (j < nb) intersect iff some k = i - j in
    [-(nb - 1), na - 1] has b - a - la < k * s < b - a + lb: checks the smallest k with k * s > b - a - la."""
    k = max((b - a - la) // s + 1, -(nb - 1))  # // floors, as floor_div
    return k <= na - 1 and k * s < b - a + lb


def _nested(f: Footprint) -> bool:
    return all(f.outer[d + 1][0] >= f.outer[d][1] * f.outer[d][0] for d in range(len(f.outer) - 1))


def _runs(f: Footprint) -> list[tuple[int, int]]:
    starts = [f.begin]
    for stride, size in f.outer:
        starts = [start + i * stride for i in range(size) for start in starts]
    return sorted((start, start + f.run) for start in starts)
