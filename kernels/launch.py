"""Typed Triton launcher: turns validated arguments into one launch of the copy kernel.

The host side does what the kernel must not: it picks the word width (the
widest of 16/8/4/2/1 bytes dividing every page size, page base, block stride,
row offset, slab base and slab row stride -- the kernel's alignment hints rely
on it), builds the int64 page table and sizes the persistent grid.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validation import PageGeometry

__all__ = ["MAX_NUM_WARPS", "MAX_PAIRS", "LaunchConfig", "launch_copy", "make_config", "plan_launch", "word_width"]

# Warps per program, at most: 4 warps x 32 threads x 16 B = 2 KiB per access
# wave, so a 16 KiB tile keeps eight 16-byte loads per thread in flight.
# Smaller tiles get fewer warps so that each thread still moves whole words.
MAX_NUM_WARPS = 4

# Index pairs per tile, at most: each pair costs a thread registers for its
# block and row ids, so pages under 128 B (no KV layout has them) get smaller
# tiles rather than hundreds of pairs per program.
MAX_PAIRS = 128

_ELEMENT_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def word_width(*values: int) -> int:
    """The widest of 16/8/4/2/1 bytes that divides every value."""
    for width in (16, 8, 4, 2):
        if all(value % width == 0 for value in values):
            return width
    return 1


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Compile-time shape of one launch: what the kernel is specialised on.

    Sizes are in slab elements (``element_bytes`` each, at most 8; a 16-byte
    word is two int64 elements that the compiler fuses into one access). One
    work unit is a ``pairs x chunk`` tile: one chunk of one page tensor for
    ``pairs`` consecutive index pairs (``pairs`` > 1 only when a whole page
    fits in one chunk).
    """

    word: int
    element_bytes: int
    page_elems: int
    chunk: int
    pairs: int
    uniform: bool
    num_pages: int

    @property
    def even(self) -> bool:
        """Every chunk of every page is full: the kernel needs no mask."""
        return self.uniform and self.page_elems % self.chunk == 0

    @property
    def tile_bytes(self) -> int:
        """Bytes one program moves per loop iteration (masked columns and pairs included)."""
        return self.pairs * self.chunk * self.element_bytes

    @property
    def num_warps(self) -> int:
        """Enough warps that every thread holds at least one 16-byte word of a tile."""
        return max(1, min(MAX_NUM_WARPS, self.tile_bytes // (32 * 16)))

    @property
    def chunks_per_page(self) -> int:
        return -(-self.page_elems // self.chunk)

    def units(self, num_pairs: int) -> int:
        """Work units (tiles) of a launch over ``num_pairs`` index pairs: what the grid walks."""
        return -(-num_pairs // self.pairs) * self.num_pages * self.chunks_per_page


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def plan_launch(pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry, bytes_per_iter: int) -> LaunchConfig:
    """Word width, element size and chunking for these pages and this slab."""
    slab_stride = slab.stride(0) if slab.shape[0] > 1 else 0
    values = [slab.data_ptr(), slab_stride, *geometry.page_bytes, *geometry.row_offsets]
    for t, page in enumerate(pages):
        values.append(page.data_ptr())
        if page.shape[0] > 1:
            values.append(geometry.block_strides[t])
    return make_config(word_width(*values), geometry.page_bytes, bytes_per_iter)


def make_config(word: int, page_bytes: Sequence[int], bytes_per_iter: int) -> LaunchConfig:
    """Element size and tiling for pages of these sizes, all aligned to ``word`` bytes.

    A page larger than ``bytes_per_iter`` is cut into chunks of
    ``bytes_per_iter``; a smaller one is one chunk (its size rounded up to a
    power of two) and a tile stacks ``bytes_per_iter // chunk bytes`` pairs
    (at most ``MAX_PAIRS``), so every iteration moves about ``bytes_per_iter``
    whatever the page size.
    """
    element = min(word, 8)
    page_elems = max(page_bytes) // element
    chunk = min(max(bytes_per_iter // element, 1), _next_power_of_two(page_elems))
    return LaunchConfig(
        word=word,
        element_bytes=element,
        page_elems=page_elems,
        chunk=chunk,
        pairs=max(1, min(MAX_PAIRS, bytes_per_iter // (chunk * element))),
        uniform=len(set(page_bytes)) == 1,
        num_pages=len(page_bytes),
    )


@functools.lru_cache(maxsize=64)
def _page_table(entries: tuple[tuple[int, int, int, int], ...], device: torch.device) -> torch.Tensor:
    # Cached by value: a deployment reuses the same page tensors for every job,
    # so the table is built (and copied to the GPU) once.
    return torch.tensor(entries, dtype=torch.int64, device=device)


def page_table(pages: Sequence[torch.Tensor], geometry: PageGeometry, element_bytes: int) -> torch.Tensor:
    """``(T, 4)`` int64: base address (B), block stride (B), row offset (elements), page size (elements)."""
    entries = tuple(
        (page.data_ptr(), geometry.block_strides[t], geometry.row_offsets[t] // element_bytes, geometry.page_bytes[t] // element_bytes)
        for t, page in enumerate(pages)
    )
    return _page_table(entries, geometry.device)


def slab_elements(slab: torch.Tensor, element_bytes: int) -> torch.Tensor:
    """A view of the slab's storage typed with the copy element, starting at ``slab[0, 0]`` (no copy)."""
    view = torch.empty(0, dtype=_ELEMENT_DTYPES[element_bytes], device=slab.device)
    start = int(slab.storage_offset()) // element_bytes
    length = max(0, (slab.untyped_storage().nbytes() // element_bytes) - start)
    return view.set_(slab.untyped_storage(), start, (length,), (1,))


def launch_copy(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    *,
    interpret: bool,
    num_programs: int,
    bytes_per_iter: int,
) -> None:
    """One launch moving every validated (block, row) pair of every page tensor."""
    from .jit.copy_pages import launch_copy_pages  # imports triton

    config = plan_launch(pages, slab, geometry, bytes_per_iter)
    units = config.units(blocks.shape[0])
    slab_stride = slab.stride(0) if slab.shape[0] > 1 else 0
    launch_copy_pages(
        interpret=interpret,
        grid=min(num_programs, units),
        num_warps=config.num_warps,
        table=page_table(pages, geometry, config.element_bytes),
        slab=slab_elements(slab, config.element_bytes),
        blocks=blocks,
        rows=rows,
        row_stride=slab_stride // config.element_bytes,
        to_slab=to_slab,
        num_pages=config.num_pages,
        page_elems=config.page_elems,
        chunk=config.chunk,
        pairs=config.pairs,
        uniform=config.uniform,
        even=config.even,
        word=config.word,
    )
