"""Argument checks shared by every gather/scatter path, and the byte geometry they yield.

Every check runs before a single byte is written, so a bad call leaves the
page tensors and the slab exactly as they were. Each error names the argument
and the offending value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from numpy.typing import NDArray

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """Where each page tensor's block bytes live and where they land in a slab row.

    All values are in bytes. ``row_offsets[t]`` is the column at which page
    tensor ``t`` starts inside a slab row (page-first layout: tensor 0's page,
    then tensor 1's, ...).
    """

    page_bytes: tuple[int, ...]
    block_strides: tuple[int, ...]
    storage_offsets: tuple[int, ...]
    row_offsets: tuple[int, ...]
    num_blocks: int
    device: torch.device

    @property
    def row_bytes(self) -> int:
        """Bytes one slab row must hold: the sum of every page."""
        return sum(self.page_bytes)

    @property
    def num_pages(self) -> int:
        return len(self.page_bytes)

    def subset(self, members: Sequence[int], row_offsets: Sequence[int] | None = None) -> PageGeometry:
        """The geometry of page tensors ``members`` only; their row offsets stay where they are unless given."""
        return dataclasses.replace(
            self,
            page_bytes=tuple(self.page_bytes[t] for t in members),
            block_strides=tuple(self.block_strides[t] for t in members),
            storage_offsets=tuple(self.storage_offsets[t] for t in members),
            row_offsets=tuple(self.row_offsets[t] for t in members) if row_offsets is None else tuple(row_offsets),
        )


def slab_row_stride(slab: torch.Tensor) -> int:
    """The slab's row stride in bytes, 0 for a one-row slab (its stride means nothing: alignment ignores it)."""
    return slab.stride(0) if slab.shape[0] > 1 else 0


def argument_names(to_slab: bool) -> tuple[str, str, str, str]:
    """What a public call's errors name its (page tensors, slab, source index, destination index).

    Every gather is ``(src, dst, src_blocks, dst_rows)`` and every scatter ``(dst, src, src_rows, dst_blocks)``:
    the page tensors of a scatter are its destination, the slab its source.
    """
    return ("src", "dst", "src_blocks", "dst_rows") if to_slab else ("dst", "src", "src_rows", "dst_blocks")


def require_tensor(value: object, name: str) -> None:
    """Refuse anything but a tensor, naming it (callers outside pyright pass anything)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def block_is_contiguous(page: torch.Tensor) -> bool:
    """True when the bytes of ``page[i]`` are contiguous for every block ``i``."""
    expected = 1
    for size, stride in zip(reversed(page.shape[1:]), reversed(page.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def describe_pages(pages: Sequence[torch.Tensor], name: str, labels: Sequence[str] | None = None) -> PageGeometry:
    """Check a list of page tensors and return their byte geometry.

    A page tensor's dim 0 indexes blocks; the rest of each block must be
    contiguous (the block stride itself may exceed the page, as for per-layer
    views of a cross-layer cache). Blocks must not overlap. The one home of
    the page-tensor checks: the public kernels and ``PagedKV`` both call it.
    Errors name ``labels[t]`` (default ``name[t]``).
    """
    if isinstance(pages, torch.Tensor):
        raise TypeError(f"{name} must be a sequence of page tensors, got a single tensor of shape {tuple(pages.shape)}")
    if len(pages) == 0:
        raise ValueError(f"{name} must hold at least one page tensor, got an empty sequence")
    page_bytes: list[int] = []
    block_strides: list[int] = []
    storage_offsets: list[int] = []
    row_offsets: list[int] = []
    offset = 0
    device: torch.device | None = None
    num_blocks: int | None = None
    for t, page in enumerate(pages):
        label = labels[t] if labels is not None else f"{name}[{t}]"
        first_label = labels[0] if labels is not None else f"{name}[0]"
        require_tensor(page, label)
        if page.dim() < 1:
            raise ValueError(f"{label} must have a block dimension (dim 0), got a 0-d tensor")
        device = page.device if device is None else device
        if page.device != device:
            raise ValueError(
                f"{label} is on {page.device} but {first_label} is on {device}; all page tensors must share one device"
            )
        if not block_is_contiguous(page):
            raise ValueError(
                f"{label} has non-contiguous blocks: shape {tuple(page.shape)}, stride {page.stride()}; "
                "each block's bytes (dims 1..) must be contiguous"
            )
        size = math.prod(page.shape[1:]) * page.element_size()
        if size == 0:
            raise ValueError(f"{label} has empty pages (shape {tuple(page.shape)}); a page must hold at least one byte")
        stride = page.stride(0) * page.element_size()
        if page.shape[0] > 1 and stride < size:
            raise ValueError(
                f"{label} has overlapping blocks: block stride {stride} B is smaller than the page ({size} B)"
            )
        page_bytes.append(size)
        block_strides.append(stride)
        storage_offsets.append(int(page.storage_offset()) * page.element_size())
        row_offsets.append(offset)
        offset += size
        num_blocks = page.shape[0] if num_blocks is None else min(num_blocks, page.shape[0])
    return PageGeometry(
        page_bytes=tuple(page_bytes),
        block_strides=tuple(block_strides),
        storage_offsets=tuple(storage_offsets),
        row_offsets=tuple(row_offsets),
        num_blocks=num_blocks or 0,
        device=device or torch.device("cpu"),
    )


def check_slab(slab: torch.Tensor, name: str, geometry: PageGeometry) -> None:
    """Check that ``slab`` is a 2-D uint8 tensor with contiguous rows wide enough for every page.

    The slab lives with the pages, or in pinned host memory when the pages are on a GPU.
    """
    require_tensor(slab, name)
    if slab.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {slab.dtype}")
    if slab.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, row_bytes), got shape {tuple(slab.shape)}")
    if slab.shape[1] > 1 and slab.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous, got stride {slab.stride()}")
    if slab.shape[0] > 1 and slab.stride(0) < slab.shape[1]:
        raise ValueError(f"{name} rows overlap: row stride {slab.stride(0)} < row bytes {slab.shape[1]}")
    if slab.shape[1] < geometry.row_bytes:
        raise ValueError(
            f"{name} row too narrow: {slab.shape[1]} bytes per row, the pages need {geometry.row_bytes} "
            f"(page bytes {list(geometry.page_bytes)})"
        )
    if slab.device == geometry.device:
        return
    if geometry.device.type == "cuda" and slab.device.type == "cpu":
        # The GPU reaches host memory only when it is pinned (or registered).
        if not slab.is_pinned():
            raise ValueError(f"{name} is pageable host memory; a slab used with {geometry.device} pages must be pinned")
        return
    raise ValueError(f"{name} is on {slab.device} but the page tensors are on {geometry.device}")


def _check_index(index: torch.Tensor, name: str) -> None:
    require_tensor(index, name)
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(index.shape)}")


def _host_values(index: torch.Tensor | NDArray[np.int64]) -> NDArray[np.int64] | None:
    """The values as a numpy array when they are on the host (numpy is faster on small host arrays), else None."""
    if isinstance(index, np.ndarray):
        return index
    if index.device.type == "cpu":
        return cast("NDArray[np.int64]", index.numpy())
    return None


def check_index_range(index: torch.Tensor | NDArray[np.int64], name: str, bound: int, what: str) -> None:
    """Every value of ``index`` must lie in ``0..bound-1``; the error names the first bad position and value.

    The one range check of the package: the public kernels run it on their
    index tensors, the engine's planner on each job's host indices (numpy).
    """
    host = _host_values(index)
    if host is not None:
        if host.size == 0 or (int(host.min()) >= 0 and int(host.max()) < bound):
            return
        position = int(np.flatnonzero((host < 0) | (host >= bound))[0])
        value = int(host[position])
    else:
        assert isinstance(index, torch.Tensor)
        if index.numel() == 0:
            return
        low, high = torch.aminmax(index)
        if int(low) >= 0 and int(high) < bound:
            return
        position = int(torch.nonzero((index < 0) | (index >= bound))[0, 0])
        value = int(index[position])
    raise ValueError(f"{name}[{position}] = {value} is out of range: there are {bound} {what} (valid 0..{bound - 1})")


def check_unique(index: torch.Tensor | NDArray[np.int64], name: str) -> None:
    """No value may appear twice in ``index`` (a destination written twice in one parallel copy races)."""
    host = _host_values(index)
    if host is not None:
        if host.size < 2:
            return
        ordered_host = np.sort(host)
        repeated_host = ordered_host[1:] == ordered_host[:-1]
        if not np.count_nonzero(repeated_host):  # numpy's cheapest test of a bool array
            return
        value = int(ordered_host[1:][repeated_host][0])
    else:
        assert isinstance(index, torch.Tensor)
        if index.numel() < 2:
            return
        ordered = torch.sort(index).values
        repeated = ordered[1:] == ordered[:-1]
        if not bool(repeated.any()):
            return
        value = int(ordered[1:][repeated][0])
    raise ValueError(
        f"{name} names destination {value} more than once; a destination may be written only once per call "
        "(the parallel kernel has no 'last one wins' order)"
    )


def check_host_indices(
    index: NDArray[np.int64], name: str, bound: int | None, what: str, *, unique_as: str | None = None
) -> None:
    """A host index array's range (when ``bound`` is given), and that no value repeats (when ``unique_as`` is).

    :func:`check_index_range` and :func:`check_unique`, with their errors
    (``unique_as`` names the array in the second: slot ids written as slab
    rows, say), in one sort when both apply, whose ends are the range: the
    planner's check of every job's destination costs one sort instead of a
    sort, a minimum and a maximum.
    """
    if bound is None or unique_as is None:
        if bound is not None:
            check_index_range(index, name, bound, what)
        if unique_as is not None:
            check_unique(index, unique_as)
        return
    if index.size == 0:
        return
    ordered = np.sort(index)
    if int(ordered[0]) < 0 or int(ordered[-1]) >= bound:
        check_index_range(index, name, bound, what)
    if np.count_nonzero(ordered[1:] == ordered[:-1]):
        check_unique(index, unique_as)


def check_index_pair(
    source: torch.Tensor,
    destination: torch.Tensor,
    *,
    geometry: PageGeometry,
    slab: torch.Tensor,
    to_slab: bool,
    check_values: bool,
    allow_duplicate_destinations: bool,
) -> None:
    """Check dtypes, shapes, devices, ranges and destination uniqueness of one call's index pair.

    ``source`` / ``destination`` are the index tensors in copy direction:
    blocks of the pages then rows of the slab for a gather (``to_slab``),
    rows then blocks for a scatter. Index tensors live on the device of the
    data (the kernel reads them there). Checking values reads them, which
    costs a device sync on CUDA; callers that built the indices themselves may
    skip that with ``check_values=False``. Errors name the indices as the public calls do (:func:`argument_names`).
    """
    _, _, source_name, destination_name = argument_names(to_slab)
    _check_index(source, source_name)
    _check_index(destination, destination_name)
    if source.shape[0] != destination.shape[0]:
        raise ValueError(
            f"{source_name} and {destination_name} must have equal lengths, got {source.shape[0]} and {destination.shape[0]}"
        )
    for index, name in ((source, source_name), (destination, destination_name)):
        if index.device != geometry.device:
            raise ValueError(
                f"{name} is on {index.device} but the data is on {geometry.device}; index tensors must be on the same device"
            )
    if not check_values:
        return
    blocks, rows = (geometry.num_blocks, "blocks"), (int(slab.shape[0]), "slab rows")
    (source_bound, source_what), (destination_bound, destination_what) = (blocks, rows) if to_slab else (rows, blocks)
    check_index_range(source, source_name, source_bound, source_what)
    check_index_range(destination, destination_name, destination_bound, destination_what)
    if not allow_duplicate_destinations:
        check_unique(destination, destination_name)
