"""Torch reference of the kernels, plain and compressed: the test oracle and the CPU fallback.

Semantics, bit for bit (``bytes(x)`` is the raw bytes of one block)::

    gather : for i: slab[rows[i]] = concat_t( bytes(page_t[blocks[i]]) )
    scatter: for i: for t: bytes(page_t[blocks[i]]) = slab[rows[i]][off_t : off_t + page_bytes_t]

Read as a sequential loop: a destination named twice keeps the value of the
*last* pair that names it (the public launchers reject such calls instead,
because the parallel kernel has no order). Bytes outside the named rows and
blocks -- and slab columns past the pages -- are never touched.

Why not a per-block loop: one ``copy_`` per block per page tensor pays Python
and dispatch overhead per 32 KiB page (about 0.2 - 0.4 of a contiguous copy on
a CPU). Instead the copy is a few bulk torch ops per call:

* Page tensors that one strided view covers (the K and V halves of a
  FlashAttention layer, every layer of a cross-layer cache) form a *group* and
  move together: one op per group instead of one per page tensor.
* The index pairs are sorted once per call and split into runs that are
  consecutive on one side; each run moves with one ``index_select(out=...)``
  straight into a destination slice (row ``memcpy``), or one ``index_copy_``
  from a source slice.
* Bytes move as the widest integer-like word the alignment allows, up to 16
  bytes (``complex128``: ``index_copy_`` copies element by element, so wider
  elements mean fewer of them; a copy never does arithmetic on them, so every
  bit pattern, NaNs included, survives).

With ``compression`` (an fp8 row layout) the reference runs the e4m3
arithmetic of ``_compression.py`` page tensor by page tensor instead, in the
row format of ``_compressed_format.py``; it keeps the same last-pair-wins
reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ._compressed_format import CompressionLayout, check_call
from ._compression import dequantize_groups, non_finite_error, quantize_groups
from ._launch_arguments import word_width
from ._validation import PageGeometry

# Torch dtypes used to move raw bytes: the widest that the alignment allows.
# complex128 is only ever copied (never computed on), which keeps it bit-exact.
_WORD_DTYPES: dict[int, torch.dtype] = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}

# A run-by-run copy pays one op per run and page group; below this many bytes
# per op on average, two bulk passes (index_select into a temporary, then
# index_copy_) are faster. Measured on a 2-core x86 box: ops cost ~5 us.
_MIN_BYTES_PER_RUN = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Strided:
    """Where one page group's bytes live: storage, byte offset and byte strides of a 3-D view.

    The view is ``(items, pages, page_bytes)``: blocks (or slab rows), the page
    tensors of the group, the bytes of one page.
    """

    storage: torch.UntypedStorage
    offset: int
    items: int
    item_stride: int
    pages: int
    page_stride: int
    page_bytes: int

    def alignment_values(self) -> tuple[int, ...]:
        strides = (self.item_stride,) if self.items > 1 else ()
        strides += (self.page_stride,) if self.pages > 1 else ()
        return (self.storage.data_ptr() + self.offset, self.page_bytes, *strides)

    def view(self, width: int, device: torch.device) -> torch.Tensor:
        """The ``(items, pages, page_bytes // width)`` word view (no copy)."""
        words = torch.empty(0, dtype=_WORD_DTYPES[width], device=device)
        shape = (self.items, self.pages, self.page_bytes // width)
        return words.set_(
            self.storage, self.offset // width, shape, (self.item_stride // width, self.page_stride // width, 1)
        )


def _injective(sizes_and_strides: Sequence[tuple[int, int]]) -> bool:
    """True when no two elements of a view with these (size, stride) pairs share a byte address."""
    span = 1  # bytes covered by the dims taken so far, from the smallest stride up
    for size, stride in sorted((pair for pair in sizes_and_strides if pair[0] > 1), key=lambda pair: pair[1]):
        if stride < span:
            return False
        span += (size - 1) * stride
    return True


def _page_strided(page: torch.Tensor, geometry: PageGeometry, t: int) -> _Strided:
    size = geometry.page_bytes[t]
    return _Strided(
        storage=page.untyped_storage(),
        offset=geometry.storage_offsets[t],
        items=geometry.num_blocks,
        item_stride=geometry.block_strides[t] if geometry.num_blocks > 1 else size,
        pages=1,
        page_stride=size,
        page_bytes=size,
    )


def _join(group: _Strided, page: _Strided) -> _Strided | None:
    """``group`` extended by the next page tensor, if one strided view still covers them all, else None."""
    same_shape = (group.storage.data_ptr(), group.storage.nbytes(), group.item_stride, group.page_bytes) == (
        page.storage.data_ptr(),
        page.storage.nbytes(),
        page.item_stride,
        page.page_bytes,
    )
    if not same_shape:
        return None
    pitch = page.offset - group.offset if group.pages == 1 else group.page_stride
    if pitch <= 0 or page.offset != group.offset + group.pages * pitch:
        return None
    if word_width(pitch) < word_width(*group.alignment_values()):
        return None  # joining would narrow the words: not worth it
    joined = _Strided(
        group.storage, group.offset, group.items, group.item_stride, group.pages + 1, pitch, group.page_bytes
    )
    # Written through, a view whose elements overlap would lose the "later page tensor wins" order.
    dims = ((joined.items, joined.item_stride), (joined.pages, pitch), (joined.page_bytes, 1))
    return joined if _injective(dims) else None


def page_groups(
    pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per group of page tensors: (its blocks as ``(N, G, words)``, the slab columns it maps to as ``(rows, G, words)``).

    Consecutive page tensors join a group when one strided view of their
    common storage covers them (same page size and block stride, evenly
    spaced bases, no overlap); their slab columns are adjacent by the
    page-first row layout.
    """
    slab_stride = slab.stride(0) if slab.shape[0] > 1 else slab.shape[1]
    slab_offset = int(slab.storage_offset())
    groups: list[tuple[_Strided, int]] = []  # (page-side view, first page tensor)
    for t, page in enumerate(pages):
        strided = _page_strided(page, geometry, t)
        joined = _join(groups[-1][0], strided) if groups else None
        if joined is not None:
            groups[-1] = (joined, groups[-1][1])
        else:
            groups.append((strided, t))
    views: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group, first in groups:
        rows = _Strided(
            storage=slab.untyped_storage(),
            offset=slab_offset + geometry.row_offsets[first],
            items=int(slab.shape[0]),
            item_stride=slab_stride,
            pages=group.pages,
            page_stride=group.page_bytes,
            page_bytes=group.page_bytes,
        )
        width = word_width(*group.alignment_values(), *rows.alignment_values())
        views.append((group.view(width, geometry.device), rows.view(width, slab.device)))
    return views


@dataclass(frozen=True, slots=True)
class _Run:
    """``length`` pairs starting at ``start`` whose indices on one side are consecutive from ``first``."""

    start: int
    length: int
    first: int


@dataclass(frozen=True, slots=True)
class PairRuns:
    """Index pairs of one call, de-duplicated (last wins) and split into consecutive runs.

    ``by_destination``: pairs sorted by destination; runs consecutive in the
    destination. ``by_source``: pairs sorted by source; runs consecutive in the
    source. The copy uses whichever side has fewer runs.
    """

    destination: torch.Tensor
    source: torch.Tensor
    destination_runs: tuple[_Run, ...]
    source_sorted_destination: torch.Tensor
    source_sorted_source: torch.Tensor
    source_runs: tuple[_Run, ...]

    @property
    def num_pairs(self) -> int:
        return int(self.destination.shape[0])


def int_list(values: torch.Tensor) -> list[int]:
    """The values of a 1-D integer tensor as Python ints."""
    return cast("list[int]", values.tolist())  # pyright: ignore[reportUnknownMemberType] -- torch types tolist() as list[Unknown]


def consecutive_runs(*indices: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of the maximal runs over which every index tensor steps by exactly one.

    The reference copy's run detector (runs in one sorted index). The DMA
    backend finds its runs with numpy (``kvtriton.worker._backends.dma_runs``),
    also cut where a pinned registration of the slab starts.
    """
    count = int(indices[0].shape[0])
    if count == 0:
        return []
    steps = torch.zeros(count - 1, dtype=torch.bool, device=indices[0].device)
    for index in indices:
        steps |= index[1:] != index[:-1] + 1
    starts = [0, *int_list(torch.nonzero(steps).flatten() + 1)]
    ends = [*starts[1:], count]
    return [(start, end - start) for start, end in zip(starts, ends)]


def _runs(ordered: torch.Tensor) -> tuple[_Run, ...]:
    """Maximal runs of ``ordered`` (sorted int64) where each value is the previous plus one."""
    runs = consecutive_runs(ordered)
    if not runs:
        return ()
    firsts = int_list(ordered[torch.tensor([start for start, _ in runs], dtype=torch.int64, device=ordered.device)])
    return tuple(_Run(start, length, first) for (start, length), first in zip(runs, firsts))


def last_per_destination(
    source: torch.Tensor, destination: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs that survive a sequential loop, as int64 on ``device``: one per destination, the last naming it.

    Sorted by destination.
    """
    source = source.to(device=device, dtype=torch.int64)
    destination = destination.to(device=device, dtype=torch.int64)
    order = torch.argsort(destination, stable=True)
    ordered = destination[order]
    # After a stable sort the last of equal destinations is the last pair in call order.
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[:-1] = ordered[1:] != ordered[:-1]
    order = order[keep]
    return source[order], destination[order]


def split_runs(source: torch.Tensor, destination: torch.Tensor, device: torch.device) -> PairRuns:
    """Sequential semantics in bulk form: keep the last pair per destination, then find runs.

    The index tensors live on ``device`` (where the copies index).
    """
    source, destination = last_per_destination(source, destination, device)
    by_source = torch.argsort(source, stable=True)
    return PairRuns(
        destination=destination,
        source=source,
        destination_runs=_runs(destination),
        source_sorted_destination=destination[by_source],
        source_sorted_source=source[by_source],
        source_runs=_runs(source[by_source]),
    )


def _row_copyable(source: torch.Tensor, destination: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs of ``(items, ...)`` views that ``index_select`` copies row by row.

    ``index_select`` copies whole rows with ``memcpy`` only from a contiguous
    source; a group whose pages are not adjacent in memory (the K and V halves
    of a layer) goes one page at a time instead, each page's blocks being
    contiguous.
    """
    if source.shape[1] == 1 or source.is_contiguous():
        return [(source, destination)]
    return list(zip(source.unbind(1), destination.unbind(1)))


def copy_runs(destination: torch.Tensor, source: torch.Tensor, pairs: PairRuns) -> None:
    """``destination[pairs.destination[i]] = source[pairs.source[i]]`` for every pair, along dim 0."""
    if pairs.num_pairs == 0:
        return
    if destination.device != source.device:
        # GPU pages and a host slab: pick on the source device, place on the destination's.
        picked = source.index_select(0, pairs.source.to(source.device)).to(destination.device)
        destination.index_copy_(0, pairs.destination.to(destination.device), picked)
        return
    runs = min(len(pairs.destination_runs), len(pairs.source_runs))
    item_bytes = destination[0].numel() * destination.element_size()
    if pairs.num_pairs * item_bytes // runs < _MIN_BYTES_PER_RUN and runs > 1:
        picked = torch.empty((pairs.num_pairs, *source.shape[1:]), dtype=source.dtype, device=source.device)
        for part, out in _row_copyable(source, picked):
            torch.index_select(part, 0, pairs.source, out=out)
        destination.index_copy_(0, pairs.destination, picked)
    elif len(pairs.destination_runs) <= len(pairs.source_runs):
        parts = _row_copyable(source, destination)
        for run in pairs.destination_runs:
            picked = pairs.source[run.start : run.start + run.length]
            for part, out in parts:
                torch.index_select(part, 0, picked, out=out[run.first : run.first + run.length])
    else:
        for run in pairs.source_runs:
            targets = pairs.source_sorted_destination[run.start : run.start + run.length]
            destination.index_copy_(0, targets, source[run.first : run.first + run.length])


def gather_pages_reference(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    compression: CompressionLayout | None = None,
) -> None:
    """Copy (``compression``: quantize) block ``src_blocks[i]`` of every page tensor in ``src`` into slab row ``dst_rows[i]``.

    The torch reference of ``gather_pages`` (a destination named twice: the
    last pair wins). Compressed, it raises
    :class:`~kvtriton.kernels.NonFiniteKVError` when a value is NaN or infinite.
    """
    geometry = check_call(
        src,
        dst,
        src_blocks,
        dst_rows,
        to_slab=True,
        compression=compression,
        check_values=True,
        allow_duplicate_destinations=True,
    )
    if not gather_unchecked(src, dst, src_blocks, dst_rows, geometry, compression):
        raise non_finite_error("src")


def scatter_pages_reference(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    compression: CompressionLayout | None = None,
) -> None:
    """Copy (``compression``: dequantize) slab row ``src_rows[i]`` back into block ``dst_blocks[i]`` of every page tensor in ``dst``."""
    geometry = check_call(
        dst,
        src,
        src_rows,
        dst_blocks,
        to_slab=False,
        compression=compression,
        check_values=True,
        allow_duplicate_destinations=True,
    )
    scatter_unchecked(src, dst, src_rows, dst_blocks, geometry, compression)


def gather_unchecked(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    geometry: PageGeometry,
    compression: CompressionLayout | None = None,
) -> bool:
    """The gather (``compression``: quantizing) copy on already validated arguments; False when a value was NaN or infinite.

    Plain rows are bytes: always True.
    """
    if src_blocks.numel() == 0:
        return True
    if compression is not None:
        return _gather_compressed(src, dst, src_blocks, dst_rows, compression)
    pairs = split_runs(src_blocks, dst_rows, geometry.device)
    for blocks, rows in page_groups(src, dst, geometry):
        copy_runs(rows, blocks, pairs)
    return True


def scatter_unchecked(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    geometry: PageGeometry,
    compression: CompressionLayout | None = None,
) -> None:
    """The scatter (``compression``: dequantizing) copy on already validated arguments."""
    if src_rows.numel() == 0:
        return
    if compression is not None:
        _scatter_compressed(src, dst, src_rows, dst_blocks, compression)
        return
    pairs = split_runs(src_rows, dst_blocks, geometry.device)
    for blocks, rows in page_groups(dst, src, geometry):
        copy_runs(blocks, rows, pairs)


# ---------------------------------------------------------------------------------------------------------------
# The compressed reference.


def _elements(page: torch.Tensor, elements: int) -> torch.Tensor:
    """``page`` as an ``(N, E)`` view of its elements (blocks are contiguous; the block stride may be larger)."""
    return page.as_strided((page.shape[0], elements), (page.stride(0), 1))


def _raw_bytes(page: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``page`` as an ``(N, page_bytes)`` uint8 view (pass-through pages: any dtype, no arithmetic)."""
    element = page.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=page.device)
    return view.set_(
        page.untyped_storage(),
        page.storage_offset() * element,
        (page.shape[0], page_bytes),
        (page.stride(0) * element, 1),
    )


def _region(slab: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return slab[:, start : start + length]


def _gather_compressed(
    pages: Sequence[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    layout: CompressionLayout,
) -> bool:
    """Compress blocks ``blocks[i]`` into slab rows ``rows[i]`` (validated, non-empty); True when every value was finite."""
    blocks, rows = last_per_destination(blocks, rows, torch.device("cpu"))
    finite = True
    for page, entry in zip(pages, layout.pages):
        target_rows = rows.to(slab.device)
        if not entry.compressed:
            raw = _raw_bytes(page, entry.page_bytes).index_select(0, blocks.to(page.device))
            _region(slab, entry.row_offset, entry.page_bytes).index_copy_(0, target_rows, raw.to(slab.device))
            continue
        picked = _elements(page, entry.elements).index_select(0, blocks.to(page.device))
        codes, scales, bad = quantize_groups(picked, entry.group_size)
        finite = finite and not bool(bad.any())
        _region(slab, entry.row_offset, entry.elements).index_copy_(0, target_rows, codes.to(slab.device))
        scale_bytes = scales.contiguous().view(torch.uint8)
        _region(slab, entry.row_offset + entry.scales_offset, scale_bytes.shape[1]).index_copy_(
            0, target_rows, scale_bytes.to(slab.device)
        )
    return finite


def _scatter_compressed(
    slab: torch.Tensor,
    pages: Sequence[torch.Tensor],
    rows: torch.Tensor,
    blocks: torch.Tensor,
    layout: CompressionLayout,
) -> None:
    """Decompress slab rows ``rows[i]`` into blocks ``blocks[i]`` (validated, non-empty)."""
    rows, blocks = last_per_destination(rows, blocks, torch.device("cpu"))
    for page, entry in zip(pages, layout.pages):
        picked_rows = rows.to(slab.device)
        target = blocks.to(page.device)
        if not entry.compressed:
            raw = _region(slab, entry.row_offset, entry.page_bytes).index_select(0, picked_rows)
            _raw_bytes(page, entry.page_bytes).index_copy_(0, target, raw.to(page.device))
            continue
        codes = _region(slab, entry.row_offset, entry.elements).index_select(0, picked_rows).to(page.device)
        scale_bytes = _region(slab, entry.row_offset + entry.scales_offset, 4 * entry.num_groups).index_select(
            0, picked_rows
        )
        scales = scale_bytes.to(page.device).contiguous().view(torch.float32)
        values = dequantize_groups(codes, scales, entry.group_size, entry.dtype)
        _elements(page, entry.elements).index_copy_(0, target, values.to(page.device))
