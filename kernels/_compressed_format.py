"""The compressed slab row, and what one call must satisfy, plain or compressed.

Where each page tensor's codes, scales or raw bytes sit in a compressed row
(``compression_layout``), and :func:`check_call`, every check of one call
(it sits here, above ``_validation.py``, because a compressed call is also
checked against its layout). ``_compression.py`` has the e4m3 arithmetic,
``_reference.py`` the torch reference, ``_pages.py`` the public entry points;
docs/kernels.md, "Compressed rows", draws the row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtriton._int_argument import check_int

from ._validation import PageGeometry, argument_names, check_index_pair, check_slab, describe_pages, slab_row_stride

DEFAULT_GROUP_SIZE = 128
"""Elements per scale when the layout does not know the head dimension."""

ALIGNMENT = 16
"""Every region of a compressed row starts and ends on this many bytes."""

COMPRESSIBLE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Page dtypes that compress; every other dtype passes through unchanged."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class CompressedPage:
    """Where one page tensor's block lives in a compressed slab row.

    ``compressed`` False: the page's ``page_bytes`` raw bytes at ``row_offset``.
    True: ``elements`` e4m3 codes at ``row_offset``, then ``num_groups`` fp32
    scales at ``row_offset + scales_offset``.
    """

    dtype: torch.dtype
    elements: int
    page_bytes: int
    compressed: bool
    group_size: int
    row_offset: int

    @property
    def num_groups(self) -> int:
        return -(-self.elements // self.group_size) if self.compressed else 0

    @property
    def scales_offset(self) -> int:
        """Offset of the scales from the region's start (the codes, padded to 16 bytes)."""
        return _round_up(self.elements, ALIGNMENT)

    @property
    def region_bytes(self) -> int:
        """Bytes this page tensor takes in a row, padding included (a multiple of 16)."""
        if not self.compressed:
            return _round_up(self.page_bytes, ALIGNMENT)
        return self.scales_offset + _round_up(4 * self.num_groups, ALIGNMENT)


@dataclass(frozen=True, slots=True)
class CompressionLayout:
    """The compressed row of one set of page tensors: one :class:`CompressedPage` each, back to back."""

    pages: tuple[CompressedPage, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes a compressed slab row needs (a multiple of 16)."""
        last = self.pages[-1]
        return last.row_offset + last.region_bytes

    @property
    def raw_row_bytes(self) -> int:
        """Bytes the same block takes uncompressed (``PagedKV.row_bytes``)."""
        return sum(page.page_bytes for page in self.pages)

    @property
    def ratio(self) -> float:
        """Compressed over uncompressed bytes per block (about 0.52 for bf16 with G = 128)."""
        return self.row_bytes / self.raw_row_bytes

    def geometry_of(self, geometry: PageGeometry, members: Sequence[int]) -> PageGeometry:
        """``geometry`` of page tensors ``members`` only, their row offsets those of the compressed row."""
        return geometry.subset(members, [self.pages[t].row_offset for t in members])

    def passthrough_geometry(self, geometry: PageGeometry) -> tuple[list[int], PageGeometry] | None:
        """The page tensors copied unchanged and their geometry with compressed row offsets (None: there are none)."""
        members = [t for t, page in enumerate(self.pages) if not page.compressed]
        if not members:
            return None
        return members, self.geometry_of(geometry, members)


def _check_group_size(group_size: int, label: str) -> None:
    check_int(f"group_size for {label}", group_size, minimum=1)


def compression_layout(
    pages: Sequence[torch.Tensor], group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE, *, name: str = "pages"
) -> CompressionLayout:
    """The compressed row layout of ``pages`` (already valid page tensors) with ``group_size`` elements per scale.

    ``group_size`` is one value for every page tensor or one per page tensor
    (``PagedKV`` passes the head dimension of each).
    """
    sizes = [group_size] * len(pages) if isinstance(group_size, int) else list(group_size)
    if len(sizes) != len(pages):
        raise ValueError(f"group_size has {len(sizes)} entries for {len(pages)} page tensors")
    entries: list[CompressedPage] = []
    offset = 0
    for t, (page, size) in enumerate(zip(pages, sizes)):
        _check_group_size(size, f"{name}[{t}]")
        elements = math.prod(page.shape[1:])
        compressed = page.dtype in COMPRESSIBLE_DTYPES
        entry = CompressedPage(
            dtype=page.dtype,
            elements=elements,
            page_bytes=elements * page.element_size(),
            compressed=compressed,
            group_size=min(size, elements) if compressed else 1,
            row_offset=offset,
        )
        entries.append(entry)
        offset += entry.region_bytes
    return CompressionLayout(tuple(entries))


def check_scales_alignment(slab: torch.Tensor, name: str) -> None:
    """Refuse a compressed slab whose base address or row stride is not a multiple of 4 bytes.

    Rows hold fp32 scales 16-byte aligned within the row; a misaligned row
    would make a GPU's 4-byte accesses fault (``cudaErrorMisalignedAddress``,
    which kills the CUDA context for the rest of the process).
    """
    stride = slab_row_stride(slab)
    if slab.data_ptr() % 4 or stride % 4:
        raise ValueError(
            f"{name} must start on a 4-byte boundary and have a row stride that is a multiple of 4 for fp8-e4m3 rows "
            f"(their fp32 scales), got address {slab.data_ptr():#x} mod 4 = {slab.data_ptr() % 4} and row stride {stride}"
        )


def check_layout_of(layout: CompressionLayout, pages: Sequence[torch.Tensor], name: str) -> None:
    """Refuse a ``compression`` argument that is not the layout of ``pages`` (named ``name``), naming what differs."""
    if not isinstance(layout, CompressionLayout):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        raise TypeError(
            f"compression must be None or a CompressionLayout (compression_layout({name}, group_size)), got {layout!r}"
        )
    if len(layout.pages) != len(pages):
        raise ValueError(f"compression is the layout of {len(layout.pages)} page tensors, {name} has {len(pages)}")
    expected = compression_layout(pages, [entry.group_size for entry in layout.pages], name=name)
    for t, (given, wanted) in enumerate(zip(layout.pages, expected.pages)):
        if given != wanted:
            raise ValueError(
                f"compression does not describe {name}[{t}]: it has {given}, {name}[{t}] needs {wanted}; "
                f"build it with compression_layout({name}, group_size)"
            )


def check_call(
    pages: Sequence[torch.Tensor],
    slab: torch.Tensor,
    source: torch.Tensor,
    destination: torch.Tensor,
    *,
    to_slab: bool,
    compression: CompressionLayout | None,
    check_values: bool,
    allow_duplicate_destinations: bool,
) -> PageGeometry:
    """Every check of one gather (``to_slab``: blocks -> rows) or scatter (rows -> blocks) call; the page geometry.

    ``source`` / ``destination`` are the index tensors in copy direction (see
    ``check_index_pair``); errors name the arguments as the public calls do
    (``argument_names``). With ``compression`` (the fp8 row layout of
    ``pages``) the slab must hold compressed rows and start on a 4-byte
    boundary (``check_scales_alignment``): the one place a call checks that,
    as the launcher takes validated arguments (and checks it once more for an
    engine's slab).
    """
    pages_name, slab_name, _, _ = argument_names(to_slab)
    geometry = describe_pages(pages, pages_name)
    if compression is None:
        check_slab(slab, slab_name, geometry)
    else:
        check_layout_of(compression, pages, pages_name)
        # The slab must hold compressed rows: check it against a geometry whose pages are the regions.
        regions = tuple(page.region_bytes for page in compression.pages)
        check_slab(slab, slab_name, dataclasses.replace(geometry, page_bytes=regions))
        check_scales_alignment(slab, slab_name)
    check_index_pair(
        source,
        destination,
        geometry=geometry,
        slab=slab,
        to_slab=to_slab,
        check_values=check_values,
        allow_duplicate_destinations=allow_duplicate_destinations,
    )
    return geometry
