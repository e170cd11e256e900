"""Typed Triton launcher: turns validated arguments into one launch of the copy kernel.

The host side does what the kernel must not: it picks the word width (the
widest of 16/8/4/2/1 bytes dividing every page size, page base, block stride,
row offset, slab base and slab row stride -- the kernel's alignment hints rely
on it), builds the int64 page table and sizes the persistent grid.
:class:`CopyLauncher` does all of that once for a fixed set of pages and a
slab (the engine's case); :func:`launch_copy` once per call (the public
``gather_pages`` / ``scatter_pages``).

Pages of different sizes (an MLA or hybrid model, say) get one launch per
distinct page size: within a launch every page then has the size the kernel
is specialised on (``UNIFORM``), so the column mask is a compile-time bound
and the compiler keeps 16-byte accesses; one launch over mixed sizes would
read each page's bound from the table at run time, which Triton cannot prove
aligned, and every access would fall to 8 bytes or less.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from ._launch_arguments import MAX_NUM_WARPS, MAX_PAIRS, CopyArguments, next_power_of_two
from ._validation import PageGeometry, slab_row_stride

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


def launch_config(
    pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry, bytes_per_iter: int
) -> LaunchConfig:
    """Word width, element size and chunking for these pages and this slab."""
    values = [slab.data_ptr(), slab_row_stride(slab), *geometry.page_bytes, *geometry.row_offsets]
    return make_config(word_width(*values, *page_addresses(pages, geometry)), geometry.page_bytes, bytes_per_iter)


def page_addresses(pages: Sequence[torch.Tensor], geometry: PageGeometry) -> list[int]:
    """The page side's addresses a word must divide: each page tensor's base and (past one block) its block stride."""
    values: list[int] = []
    for t, page in enumerate(pages):
        values.append(page.data_ptr())
        if page.shape[0] > 1:
            values.append(geometry.block_strides[t])
    return values


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
    chunk = min(max(bytes_per_iter // element, 1), next_power_of_two(page_elems))
    return LaunchConfig(
        word=word,
        element_bytes=element,
        page_elems=page_elems,
        chunk=chunk,
        pairs=max(1, min(MAX_PAIRS, bytes_per_iter // (chunk * element))),
        uniform=len(set(page_bytes)) == 1,
        num_pages=len(page_bytes),
    )


def page_table(pages: Sequence[torch.Tensor], geometry: PageGeometry, element_bytes: int) -> torch.Tensor:
    """``(T, 4)`` int64 on the pages' device: base address (B), block stride (B), row offset and page size (elements).

    Both kernels read it (the compressed one with ``element_bytes=1`` and its row offsets, ignoring the
    page size). Built on the current stream. Never cached across callers: a cached table
    freed (evicted) while another stream's kernel still reads it would be
    reused under that kernel. :class:`CopyLauncher` holds its own for its lifetime.
    """
    entries = [
        (
            page.data_ptr(),
            geometry.block_strides[t],
            geometry.row_offsets[t] // element_bytes,
            geometry.page_bytes[t] // element_bytes,
        )
        for t, page in enumerate(pages)
    ]
    return torch.tensor(entries, dtype=torch.int64, device=geometry.device)


def slab_elements(slab: torch.Tensor, element_bytes: int) -> torch.Tensor:
    """A view of the slab's storage typed with the copy element, starting at ``slab[0, 0]`` (no copy)."""
    view = torch.empty(0, dtype=_ELEMENT_DTYPES[element_bytes], device=slab.device)
    start = int(slab.storage_offset()) // element_bytes
    length = max(0, (slab.untyped_storage().nbytes() // element_bytes) - start)
    return view.set_(slab.untyped_storage(), start, (length,), (1,))


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A device guard when ``device`` is a GPU that is not the current one (Triton launches on the current device)."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


_variant_log: set[tuple[object, ...]] | None = None


@contextlib.contextmanager
def record_variants() -> Generator[set[tuple[object, ...]]]:
    """Collect the specialisation key of every copy launch made inside the block.

    The key is what Triton's launcher would compile a variant for (the
    constexprs, ``num_warps``, and each runtime argument's type and
    specialisation as Triton's own binder computes it), so a launch whose key
    is new would compile on a GPU. Works on the interpreter path too, which
    is how the CPU tests prove that warm-up left nothing to compile.
    """
    global _variant_log
    recorded: set[tuple[object, ...]] = set()
    previous, _variant_log = _variant_log, recorded
    try:
        yield recorded
    finally:
        _variant_log = previous


def page_size_groups(page_bytes: Sequence[int]) -> list[list[int]]:
    """Page tensor indices grouped by page size, in order of first appearance: one launch per group."""
    groups: dict[int, list[int]] = {}
    for t, size in enumerate(page_bytes):
        groups.setdefault(size, []).append(t)
    return list(groups.values())


class _SizedLaunch:
    """The prepared launch of the page tensors of one page size (a subset of the launcher's pages)."""

    def __init__(
        self, pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry, bytes_per_iter: int
    ) -> None:
        self.config = launch_config(pages, slab, geometry, bytes_per_iter)
        self.table = page_table(pages, geometry, self.config.element_bytes)
        self.slab = slab_elements(slab, self.config.element_bytes)
        self.row_stride = slab_row_stride(slab) // self.config.element_bytes
        config, empty = self.config, self.table[:0]
        self.templates = {
            to_slab: CopyArguments(
                self.table,
                self.slab,
                empty,
                empty,
                0,
                self.row_stride,
                to_slab,
                config.num_pages,
                config.page_elems,
                config.chunk,
                config.pairs,
                config.uniform,
                config.even,
                config.word,
                config.num_warps,
            )
            for to_slab in (True, False)
        }


class CopyLauncher:
    """The launches of one set of page tensors against one slab, prepared once.

    Holds what does not change from job to job: per distinct page size (see
    the module docstring) the launch configuration and the page table on the
    pages' device (built once, held for the launcher's lifetime, so no stream
    can read a freed table), the slab's element view, the grid cap and the
    device. :meth:`launch` then only sizes the grids and launches;
    :meth:`warm_up` compiles both directions up front.
    """

    def __init__(
        self,
        pages: Sequence[torch.Tensor],
        slab: torch.Tensor,
        geometry: PageGeometry,
        *,
        interpret: bool,
        num_programs: int,
        bytes_per_iter: int,
    ) -> None:
        self.device = geometry.device
        self.interpret = interpret
        self.num_programs = num_programs
        with on_device(self.device):
            self._launches = [
                _SizedLaunch([pages[t] for t in members], slab, geometry.subset(members), bytes_per_iter)
                for members in page_size_groups(geometry.page_bytes)
            ]

    @property
    def configs(self) -> list[LaunchConfig]:
        """One launch configuration per distinct page size, in the order the launches run."""
        return [launch.config for launch in self._launches]

    def launch(self, to_slab: bool, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy every (``blocks[i]``, ``rows[i]``) pair; the indices are checked and on the pages' device."""
        count = int(blocks.shape[0])
        if count == 0:
            return
        with on_device(self.device):
            for sized in self._launches:
                self._launch(sized, to_slab, blocks, rows, count, min(self.num_programs, sized.config.units(count)))

    def warm_up(self, index_dtype: torch.dtype = torch.int64) -> None:
        """Compile (or, interpreted, trace) the gather and the scatter variants a job can request.

        Launches each with zero pairs on 16-byte aligned ``index_dtype``
        indices, the alignment the engine's staging guarantees: nothing is read
        or written, and the variant is cached before the first real job.
        """
        with on_device(self.device):
            indices = torch.zeros(64, dtype=index_dtype, device=self.device)
            for sized in self._launches:
                for to_slab in (True, False):
                    self._launch(sized, to_slab, indices[:32], indices[32:], 0, 1)

    def _launch(
        self, sized: _SizedLaunch, to_slab: bool, blocks: torch.Tensor, rows: torch.Tensor, count: int, grid: int
    ) -> None:
        from ._jit import copy_pages  # imports triton; a dictionary lookup after the first call

        arguments = sized.templates[to_slab]._replace(blocks=blocks, rows=rows, num_pairs=count)
        if _variant_log is not None:
            _variant_log.add(copy_pages.specialization_key(arguments))
        copy_pages.launch_copy_pages(arguments, interpret=self.interpret, grid=grid)


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
    """One launch moving every validated (block, row) pair of every page tensor (prepared for this call only)."""
    launcher = CopyLauncher(
        pages, slab, geometry, interpret=interpret, num_programs=num_programs, bytes_per_iter=bytes_per_iter
    )
    launcher.launch(to_slab, blocks, rows)
