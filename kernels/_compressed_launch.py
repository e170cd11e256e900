"""Typed launcher of the fused fp8 gather/scatter: one launch per page kind, prepared once.

Page tensors that compress are grouped by kind (dtype, elements per page,
group size); each kind gets its own table, tiling and variant of
``jit/compress_pages.py``. Page tensors that pass through unchanged (fp8,
int8, ...) go through a :class:`~kvtriton.kernels._launch.CopyLauncher` whose
row offsets are the compressed row's. A job is then one launch per kind,
still over every layer at once (every layer of a model is one kind).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._compressed_format import CompressedPage, CompressionLayout, check_scales_alignment
from ._launch import CopyLauncher, on_device, page_addresses, page_table, word_width
from ._launch_arguments import MAX_PAIRS, CompressArguments, CompressConfig, next_power_of_two
from ._validation import PageGeometry, slab_row_stride

_KINDS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def compress_config(
    page: CompressedPage, num_pages: int, bytes_per_iter: int, *, page_word: int = 16, slab_word: int = 16
) -> CompressConfig:
    """Tiling for ``num_pages`` page tensors like ``page``: about ``bytes_per_iter`` source bytes per tile."""
    element_bytes = page.page_bytes // page.elements
    columns = next_power_of_two(page.group_size)
    groups_wanted = max(1, bytes_per_iter // (columns * element_bytes))
    tile_groups = min(next_power_of_two(page.num_groups), 1 << (groups_wanted.bit_length() - 1))
    # A page smaller than the budget: stack pairs (a power of two, at most MAX_PAIRS) to fill it.
    pairs_wanted = max(1, bytes_per_iter // (tile_groups * columns * element_bytes))
    pairs = min(MAX_PAIRS, 1 << (pairs_wanted.bit_length() - 1))
    return CompressConfig(
        num_pages=num_pages, elements=page.elements, group=page.group_size, group_columns=columns,
        num_groups=page.num_groups, tile_groups=tile_groups, pairs=pairs, kind=_KINDS[page.dtype],
        scales_offset=page.scales_offset,
        page_word=page_word, slab_word=slab_word, element_bytes=element_bytes,
    )  # fmt: skip


class _KindLaunch:
    """The prepared launch of the compressible page tensors of one kind."""

    def __init__(
        self, members: Sequence[int], pages: Sequence[torch.Tensor], slab: torch.Tensor, geometry: PageGeometry,
        layout: CompressionLayout, bytes_per_iter: int,
    ) -> None:  # fmt: skip
        first = layout.pages[members[0]]
        kind_pages = [pages[t] for t in members]
        kind_geometry = layout.geometry_of(geometry, members)
        page_word = word_width(first.page_bytes, *page_addresses(kind_pages, kind_geometry))
        self.row_stride = slab_row_stride(slab)
        slab_word = min(16, word_width(slab.data_ptr(), self.row_stride))  # >= 4: check_scales_alignment
        self.config = compress_config(first, len(members), bytes_per_iter, page_word=page_word, slab_word=slab_word)
        # Built once per direction, as CopyLauncher's templates are: a launch only looks them up.
        self.constexprs = {to_slab: self.config.kernel_constexprs(to_slab) for to_slab in (True, False)}
        self.table = page_table(kind_pages, kind_geometry, 1)
        self.slab = slab


class CompressedLauncher:
    """The launches of one set of page tensors against one compressed slab, prepared once (as ``CopyLauncher``).

    Takes validated arguments, as ``CopyLauncher`` does, but refuses a slab
    whose base or row stride is not a multiple of 4 bytes
    (``check_scales_alignment``, as the public calls do): its rows' fp32 scales
    would fault on a GPU, and that fault kills the CUDA context. An engine's
    slab can be such a one (``HostSlab.from_buffer`` with an odd
    ``row_stride`` or ``row_offset``), so the engine refuses it at build.
    """

    def __init__(
        self,
        pages: Sequence[torch.Tensor],
        slab: torch.Tensor,
        geometry: PageGeometry,
        layout: CompressionLayout,
        *,
        interpret: bool,
        num_programs: int,
        bytes_per_iter: int,
    ) -> None:
        check_scales_alignment(slab, "slab")
        self.device = geometry.device
        self.interpret = interpret
        self.num_programs = num_programs
        kinds: dict[tuple[torch.dtype, int, int], list[int]] = {}
        for t, page in enumerate(layout.pages):
            if page.compressed:
                kinds.setdefault((page.dtype, page.elements, page.group_size), []).append(t)
        with on_device(self.device):
            self._launches = [
                _KindLaunch(members, pages, slab, geometry, layout, bytes_per_iter) for members in kinds.values()
            ]
            passthrough = layout.passthrough_geometry(geometry)
            self._copy: CopyLauncher | None = None
            if passthrough is not None:
                members, copy_geometry = passthrough
                self._copy = CopyLauncher(
                    [pages[t] for t in members], slab, copy_geometry,
                    interpret=interpret, num_programs=num_programs, bytes_per_iter=bytes_per_iter,
                )  # fmt: skip
            # Scatter launches get a status pointer they never write; one small tensor serves them all.
            self._unused_status = torch.zeros(4, dtype=torch.int32, device=geometry.device)

    @property
    def configs(self) -> list[CompressConfig]:
        """One configuration per page kind, in launch order."""
        return [launch.config for launch in self._launches]

    def launch(self, to_slab: bool, blocks: torch.Tensor, rows: torch.Tensor, status: torch.Tensor | None) -> None:
        """Quantize (``to_slab``) or dequantize every (``blocks[i]``, ``rows[i]``) pair (indices checked, on the pages' device).

        A gather sets ``status[0]`` to 1 (int32; on the pages' device or
        pinned host memory) when it met NaN or infinity; it never clears it.
        """
        count = int(blocks.shape[0])
        if count == 0:
            return
        if to_slab and status is None:
            raise ValueError("a compressed gather needs a status tensor to report non-finite values")
        with on_device(self.device):
            for kind in self._launches:
                self._launch(
                    kind, to_slab, blocks, rows, count, min(self.num_programs, kind.config.units(count)), status
                )
            if self._copy is not None:
                self._copy.launch(to_slab, blocks, rows)

    def warm_up(self, index_dtype: torch.dtype = torch.int64) -> None:
        """Compile (or trace) both directions of every kind with zero pairs: nothing is read or written."""
        with on_device(self.device):
            indices = torch.zeros(64, dtype=index_dtype, device=self.device)
            for kind in self._launches:
                for to_slab in (True, False):
                    self._launch(kind, to_slab, indices[:32], indices[32:], 0, 1, self._unused_status)
            if self._copy is not None:
                self._copy.warm_up(index_dtype)

    def _launch(
        self, kind: _KindLaunch, to_slab: bool, blocks: torch.Tensor, rows: torch.Tensor, count: int, grid: int,
        status: torch.Tensor | None,
    ) -> None:  # fmt: skip
        from ._jit import compress_pages  # imports triton

        arguments = CompressArguments(
            kind.table, kind.slab, blocks, rows, self._unused_status if status is None else status, count, kind.row_stride,
            kind.constexprs[to_slab], kind.config.num_warps,
        )  # fmt: skip
        compress_pages.launch_compress_pages(arguments, interpret=self.interpret, grid=grid)
