"""Torch reference of the two kernels: the test oracle and the CPU fallback.

Semantics, bit for bit (``bytes(x)`` is the raw bytes of one block)::

    gather : for i: slab[rows[i]] = concat_t( bytes(page_t[blocks[i]]) )
    scatter: for i: for t: bytes(page_t[blocks[i]]) = slab[rows[i]][off_t : off_t + page_bytes_t]

Read as a sequential loop: a destination named twice keeps the value of the
*last* pair that names it (the public launchers reject such calls instead,
because the parallel kernel has no order). Bytes outside the named rows and
blocks -- and slab columns past the pages -- are never touched.

Why not a per-block loop: one ``copy_`` per block per page tensor pays Python
and dispatch overhead per 32 KiB page (about 0.17 of a contiguous copy on a
CPU). Instead the index pairs are sorted once per call and split into runs
that are consecutive on one side; each run then moves with a single
``index_select(out=...)`` straight into the destination slice, or a single
``index_copy_`` from a source slice, on word-sized views of the raw bytes.
Slabs filled from fresh slots (consecutive rows) take one op per page tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .validation import IndexBounds, PageGeometry, check_index_pair, check_slab, describe_pages

__all__ = ["gather_pages_reference", "scatter_pages_reference"]

# Torch dtypes used to move raw bytes: the widest that the geometry allows.
_WORD_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# A run-by-run copy pays one op per run and page tensor; below this many bytes
# per op on average, two bulk passes (index_select into a temporary, then
# index_copy_) are faster. Measured on a 2-core x86 box: ops cost ~5 us.
_MIN_BYTES_PER_RUN = 64 * 1024


def _word_width(*values: int) -> int:
    for width in (8, 4, 2):
        if all(value % width == 0 for value in values):
            return width
    return 1


def _words(base: torch.Tensor, offset: int, shape: tuple[int, int], row_stride: int, width: int) -> torch.Tensor:
    """A ``(rows, bytes // width)`` integer view of raw bytes of ``base``'s storage (no copy)."""
    view = torch.empty(0, dtype=_WORD_DTYPES[width], device=base.device)
    return view.set_(base.untyped_storage(), offset // width, (shape[0], shape[1] // width), (row_stride // width, 1))


def page_views(pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each page tensor: (its blocks as ``(N, words)``, the slab columns it maps to as ``(rows, words)``)."""
    slab_offset = int(slab.storage_offset())
    slab_stride = slab.stride(0) if slab.shape[0] > 1 else slab.shape[1]
    views: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t, page in enumerate(pages):
        size = geometry.page_bytes[t]
        stride = geometry.block_strides[t] if page.shape[0] > 1 else size
        column = slab_offset + geometry.row_offsets[t]
        width = _word_width(size, stride, geometry.storage_offsets[t], column, slab_stride)
        blocks = _words(page, geometry.storage_offsets[t], (page.shape[0], size), stride, width)
        rows = _words(slab, column, (slab.shape[0], size), slab_stride, width)
        views.append((blocks, rows))
    return views


@dataclass(frozen=True, slots=True)
class _Run:
    """``length`` pairs starting at ``start`` whose indices on one side are consecutive from ``first``."""

    start: int
    length: int
    first: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
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


def _runs(ordered: torch.Tensor) -> tuple[_Run, ...]:
    """Maximal runs of ``ordered`` (sorted int64) where each value is the previous plus one."""
    if ordered.numel() == 0:
        return ()
    breaks = torch.nonzero(ordered[1:] != ordered[:-1] + 1).flatten() + 1
    starts = [0, *int_list(breaks)]
    ends = [*starts[1:], int(ordered.shape[0])]
    firsts = int_list(ordered[torch.tensor(starts, dtype=torch.int64, device=ordered.device)])
    return tuple(_Run(start, end - start, first) for start, end, first in zip(starts, ends, firsts))


def plan_copy(source: torch.Tensor, destination: torch.Tensor, device: torch.device) -> CopyPlan:
    """Sequential semantics in bulk form: keep the last pair per destination, then find runs.

    The plan's index tensors live on ``device`` (where the copies index).
    """
    source = source.to(device=device, dtype=torch.int64)
    destination = destination.to(device=device, dtype=torch.int64)
    order = torch.argsort(destination, stable=True)
    ordered = destination[order]
    # After a stable sort the last of equal destinations is the last pair in call order.
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[:-1] = ordered[1:] != ordered[:-1]
    order = order[keep]
    destination = destination[order]
    source = source[order]
    by_source = torch.argsort(source, stable=True)
    return CopyPlan(
        destination=destination,
        source=source,
        destination_runs=_runs(destination),
        source_sorted_destination=destination[by_source],
        source_sorted_source=source[by_source],
        source_runs=_runs(source[by_source]),
    )


def copy_planned(destination: torch.Tensor, source: torch.Tensor, plan: CopyPlan) -> None:
    """``destination[plan.destination[i]] = source[plan.source[i]]`` for every pair, row-wise."""
    if plan.num_pairs == 0:
        return
    if destination.device != source.device:
        # GPU pages and a host slab: pick on the source device, place on the destination's.
        picked = source.index_select(0, plan.source.to(source.device)).to(destination.device)
        destination.index_copy_(0, plan.destination.to(destination.device), picked)
        return
    runs = min(len(plan.destination_runs), len(plan.source_runs))
    run_bytes = plan.num_pairs * destination.shape[1] * destination.element_size() // runs
    if run_bytes < _MIN_BYTES_PER_RUN and runs > 1:
        destination.index_copy_(0, plan.destination, source.index_select(0, plan.source))
    elif len(plan.destination_runs) <= len(plan.source_runs):
        for run in plan.destination_runs:
            picked = plan.source[run.start : run.start + run.length]
            torch.index_select(source, 0, picked, out=destination[run.first : run.first + run.length])
    else:
        for run in plan.source_runs:
            targets = plan.source_sorted_destination[run.start : run.start + run.length]
            destination.index_copy_(0, targets, source[run.first : run.first + run.length])


def gather_pages_reference(
    src: Sequence[torch.Tensor], dst: torch.Tensor, src_blocks: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """Copy blocks ``src_blocks[i]`` of every page tensor in ``src`` into slab row ``dst_rows[i]``."""
    geometry = describe_pages(src, "src")
    check_slab(dst, "dst", geometry)
    bounds = IndexBounds(geometry.num_blocks, "blocks", int(dst.shape[0]), "slab rows")
    check_index_pair(
        src_blocks, "src_blocks", dst_rows, "dst_rows",
        bounds=bounds, device=geometry.device, check_values=True, allow_duplicate_destinations=True,
    )  # fmt: skip
    gather_unchecked(src, dst, src_blocks, dst_rows, geometry)


def scatter_pages_reference(
    src: torch.Tensor, dst: Sequence[torch.Tensor], src_rows: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Copy slab row ``src_rows[i]`` back into block ``dst_blocks[i]`` of every page tensor in ``dst``."""
    geometry = describe_pages(dst, "dst")
    check_slab(src, "src", geometry)
    bounds = IndexBounds(int(src.shape[0]), "slab rows", geometry.num_blocks, "blocks")
    check_index_pair(
        src_rows, "src_rows", dst_blocks, "dst_blocks",
        bounds=bounds, device=geometry.device, check_values=True, allow_duplicate_destinations=True,
    )  # fmt: skip
    scatter_unchecked(src, dst, src_rows, dst_blocks, geometry)


def gather_unchecked(
    src: Sequence[torch.Tensor], dst: torch.Tensor, src_blocks: torch.Tensor, dst_rows: torch.Tensor, geometry: PageGeometry
) -> None:
    """The gather copy on already validated arguments."""
    if src_blocks.numel() == 0:
        return
    plan = plan_copy(src_blocks, dst_rows, geometry.device)
    for blocks, rows in page_views(src, dst, geometry):
        copy_planned(rows, blocks, plan)


def scatter_unchecked(
    src: torch.Tensor, dst: Sequence[torch.Tensor], src_rows: torch.Tensor, dst_blocks: torch.Tensor, geometry: PageGeometry
) -> None:
    """The scatter copy on already validated arguments."""
    if src_rows.numel() == 0:
        return
    plan = plan_copy(src_rows, dst_blocks, geometry.device)
    for blocks, rows in page_views(dst, src, geometry):
        copy_planned(blocks, rows, plan)
