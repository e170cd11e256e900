"""Typed Triton launcher: turns validated arguments into the launches of one copy, plain or compressed.

The host side does what the kernels must not: it picks the word width (the
widest of 16/8/4/2/1 bytes dividing every page size, page base, block stride,
row offset, slab base and slab row stride -- the kernels' alignment hints rely
on it), builds the int64 page tables and sizes the persistent grids.
:class:`CopyLauncher` does all of that once for a fixed set of pages and a
slab: the engine holds one for its lifetime, the public ``gather_pages`` /
``scatter_pages`` build one per call.

Pages of different sizes (an MLA or hybrid model, say) get one launch of the
copy kernel per distinct page size: within a launch every page then has the
size the kernel is specialised on (``UNIFORM``), so the column mask is a
compile-time bound and the compiler keeps 16-byte accesses; one launch over
mixed sizes would read each page's bound from the table at run time, which
Triton cannot prove aligned, and every access would fall to 8 bytes or less.

With a compression layout (fp8 rows), the page tensors that compress are
grouped by kind (dtype, elements per page, group size) instead; each kind gets
its own table, tiling and variant of ``_jit/compress_pages.py``. Page tensors
that pass through unchanged (fp8, int8, ...) go through the copy kernel with
the compressed row's offsets. A job is then one launch per kind, still over
every layer at once (every layer of a model is one kind).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from ._compressed_format import CompressedPage, CompressionLayout, check_scales_alignment
from ._launch_arguments import (
    MAX_NUM_WARPS,
    MAX_PAIRS,
    CompressArguments,
    CompressConfig,
    CopyArguments,
    next_power_of_two,
    word_width,
)
from ._validation import PageGeometry, slab_row_stride

_ELEMENT_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_KINDS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


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


def compress_config(
    page: CompressedPage, num_pages: int, bytes_per_iter: int, *, page_word: int = 16, slab_word: int = 16
) -> CompressConfig:
    """Tiling of a compressed launch over ``num_pages`` page tensors like ``page``: about ``bytes_per_iter`` source bytes per tile."""
    element_bytes = page.page_bytes // page.elements
    columns = next_power_of_two(page.group_size)
    groups_wanted = max(1, bytes_per_iter // (columns * element_bytes))
    tile_groups = min(next_power_of_two(page.num_groups), 1 << (groups_wanted.bit_length() - 1))
    # A page smaller than the budget: stack pairs (a power of two, at most MAX_PAIRS) to fill it.
    pairs_wanted = max(1, bytes_per_iter // (tile_groups * columns * element_bytes))
    pairs = min(MAX_PAIRS, 1 << (pairs_wanted.bit_length() - 1))
    return CompressConfig(
        num_pages=num_pages,
        elements=page.elements,
        group=page.group_size,
        group_columns=columns,
        num_groups=page.num_groups,
        tile_groups=tile_groups,
        pairs=pairs,
        kind=_KINDS[page.dtype],
        scales_offset=page.scales_offset,
        page_word=page_word,
        slab_word=slab_word,
        element_bytes=element_bytes,
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
    """The prepared copy-kernel launch of the page tensors of one page size (a subset of the launcher's pages)."""

    def __init__(
        self, pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry, bytes_per_iter: int
    ) -> None:
        self.config = launch_config(pages, slab, geometry, bytes_per_iter)
        self.table = page_table(pages, geometry, self.config.element_bytes)
        self.slab = slab_elements(slab, self.config.element_bytes)
        self.row_stride = slab_row_stride(slab) // self.config.element_bytes
        config = self.config
        # Per direction, the arguments after a job's own three (``blocks``, ``rows``, ``num_pairs``): a launch
        # builds its tuple from them, at less than half the cost of a template's ``_replace``.
        self._fixed_tails = {
            to_slab: (
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

    def run(
        self,
        to_slab: bool,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        count: int,
        grid: int,
        *,
        interpret: bool,
        status: torch.Tensor | None,
    ) -> None:
        """One launch over ``count`` pairs on ``grid`` programs (``status`` is the fp8 kernel's: a copy has none)."""
        del status
        from ._jit import copy_pages  # imports triton; a dictionary lookup after the first call

        arguments = CopyArguments(self.table, self.slab, blocks, rows, count, *self._fixed_tails[to_slab])
        if _variant_log is not None:
            _variant_log.add(copy_pages.specialization_key(arguments))
        copy_pages.launch_copy_pages(arguments, interpret=interpret, grid=grid)


def _sized_launches(
    pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry, bytes_per_iter: int
) -> list[_SizedLaunch]:
    """The copy-kernel launches of ``pages``: one per distinct page size."""
    return [
        _SizedLaunch([pages[t] for t in members], slab, geometry.subset(members), bytes_per_iter)
        for members in page_size_groups(geometry.page_bytes)
    ]


class _KindLaunch:
    """The prepared fp8-kernel launch of the compressible page tensors of one kind."""

    def __init__(
        self,
        members: Sequence[int],
        pages: Sequence[torch.Tensor],
        slab: torch.Tensor,
        geometry: PageGeometry,
        layout: CompressionLayout,
        bytes_per_iter: int,
    ) -> None:
        first = layout.pages[members[0]]
        kind_pages = [pages[t] for t in members]
        kind_geometry = layout.geometry_of(geometry, members)
        page_word = word_width(first.page_bytes, *page_addresses(kind_pages, kind_geometry))
        self.row_stride = slab_row_stride(slab)
        slab_word = min(16, word_width(slab.data_ptr(), self.row_stride))  # >= 4: check_scales_alignment
        self.config = compress_config(first, len(members), bytes_per_iter, page_word=page_word, slab_word=slab_word)
        # Built once per direction, as the copy launches' fixed arguments are: a launch only looks them up.
        self.constexprs = {to_slab: self.config.kernel_constexprs(to_slab) for to_slab in (True, False)}
        self.table = page_table(kind_pages, kind_geometry, 1)
        self.slab = slab
        # Scatter launches get a status pointer they never write.
        self.unused_status = torch.zeros(4, dtype=torch.int32, device=geometry.device)

    def run(
        self,
        to_slab: bool,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        count: int,
        grid: int,
        *,
        interpret: bool,
        status: torch.Tensor | None,
    ) -> None:
        """One launch over ``count`` pairs on ``grid`` programs; a gather flags NaN or infinity in ``status[0]``."""
        from ._jit import compress_pages  # imports triton

        arguments = CompressArguments(
            self.table,
            self.slab,
            blocks,
            rows,
            self.unused_status if status is None else status,
            count,
            self.row_stride,
            self.constexprs[to_slab],
            self.config.num_warps,
        )
        compress_pages.launch_compress_pages(arguments, interpret=interpret, grid=grid)


def _kind_launches(
    pages: Sequence[torch.Tensor],
    slab: torch.Tensor,
    geometry: PageGeometry,
    layout: CompressionLayout,
    bytes_per_iter: int,
) -> list[_KindLaunch]:
    """The fp8-kernel launches of the compressible page tensors: one per kind (dtype, elements per page, group)."""
    kinds: dict[tuple[torch.dtype, int, int], list[int]] = {}
    for t, page in enumerate(layout.pages):
        if page.compressed:
            kinds.setdefault((page.dtype, page.elements, page.group_size), []).append(t)
    return [_KindLaunch(members, pages, slab, geometry, layout, bytes_per_iter) for members in kinds.values()]


class CopyLauncher:
    """The launches of one set of page tensors against one slab, plain or compressed, prepared once.

    Holds what does not change from job to job: per launch (see the module
    docstring) the configuration and the page table on the pages' device
    (built once, held for the launcher's lifetime, so no stream can read a
    freed table), the slab's view, the grid cap and the device.
    :meth:`launch` then only sizes the grids and launches; :meth:`warm_up`
    compiles both directions up front.

    ``compression`` (None: plain rows) is the fp8 row layout of ``pages``.
    The arguments are validated already, but a compressed slab whose base or
    row stride is not a multiple of 4 bytes is refused here
    (``check_scales_alignment``, as the public calls do): its rows' fp32
    scales would fault on a GPU, and that fault kills the CUDA context. An
    engine's slab can be such a one (``HostSlab.from_buffer`` with an odd
    ``row_stride`` or ``row_offset``), so the engine refuses it at build.
    """

    def __init__(
        self,
        pages: Sequence[torch.Tensor],
        slab: torch.Tensor,
        geometry: PageGeometry,
        *,
        compression: CompressionLayout | None = None,
        interpret: bool,
        num_programs: int,
        bytes_per_iter: int,
    ) -> None:
        if compression is not None:
            check_scales_alignment(slab, "slab")
        self.device = geometry.device
        self.compression = compression
        self.interpret = interpret
        self.num_programs = num_programs
        kinds: list[_KindLaunch] = []
        self._copies: list[_SizedLaunch] = []
        with on_device(self.device):
            if compression is None:
                self._copies = _sized_launches(pages, slab, geometry, bytes_per_iter)
            else:
                kinds = _kind_launches(pages, slab, geometry, compression, bytes_per_iter)
                passthrough = compression.passthrough_geometry(geometry)
                if passthrough is not None:
                    members, copy_geometry = passthrough
                    self._copies = _sized_launches([pages[t] for t in members], slab, copy_geometry, bytes_per_iter)
        self._launches: list[_KindLaunch | _SizedLaunch] = [*kinds, *self._copies]

    @property
    def copy_configs(self) -> list[LaunchConfig]:
        """One copy-kernel configuration per distinct page size, in launch order (compressed rows: the pass-through pages')."""
        return [launch.config for launch in self._copies]

    def launch(
        self, to_slab: bool, blocks: torch.Tensor, rows: torch.Tensor, status: torch.Tensor | None = None
    ) -> None:
        """Copy every (``blocks[i]``, ``rows[i]``) pair; the indices are checked and on the pages' device.

        Compressed rows: a gather quantizes and sets ``status[0]`` to 1 (int32;
        on the pages' device or pinned host memory) when it met NaN or
        infinity; it never clears it. A compressed gather without ``status``
        is refused; plain rows ignore it.
        """
        count = int(blocks.shape[0])
        if count == 0:
            return
        if to_slab and self.compression is not None and status is None:
            raise ValueError("a compressed gather needs a status tensor to report non-finite values")
        with on_device(self.device):
            for prepared in self._launches:
                grid = min(self.num_programs, prepared.config.units(count))
                prepared.run(to_slab, blocks, rows, count, grid, interpret=self.interpret, status=status)

    def warm_up(self, index_dtype: torch.dtype = torch.int64) -> None:
        """Compile (or, interpreted, trace) the gather and the scatter variants a job can request.

        Launches each with zero pairs on 16-byte aligned ``index_dtype``
        indices, the alignment the engine's staging guarantees: nothing is read
        or written, and the variant is cached before the first real job.
        """
        with on_device(self.device):
            indices = torch.zeros(64, dtype=index_dtype, device=self.device)
            for prepared in self._launches:
                for to_slab in (True, False):
                    prepared.run(to_slab, indices[:32], indices[32:], 0, 1, interpret=self.interpret, status=None)
