"""PagedKV: an engine's paged KV cache described as a list of page tensors.

Every supported cache layout reduces to *page tensors*: tensors whose dim 0
indexes GPU blocks and whose per-block bytes are contiguous (the block stride
may exceed the page, as in views of a larger tensor). One slab row holds the
bytes of one block across all page tensors, page after page, so the layout
fixes the row size and the offset of each page inside a row.

Layouts (``N`` = number of blocks, ``bs`` = tokens per block):

==============  ======================  =====================================
name            tensor shape            page tensors
==============  ======================  =====================================
``flash_attn``  ``(2, N, bs, h, d)``    ``t[0]`` (K) and ``t[1]`` (V)
``flashinfer``  ``(N, 2, bs, h, d)``    ``t`` (K and V of a block together)
``mla``         ``(N, bs, d)``          ``t``
``cross_layer`` ``(N, L, ...)``         ``t``: a block's bytes for all ``L``
                                        layers are contiguous, so the whole
                                        tensor is one page tensor (same row
                                        bytes as ``L`` strided layer views,
                                        one copy instead of ``L``)
``pages``       ``(N, ...)``            ``t`` as given, e.g. vLLM's int8
                                        ``(num_blocks, page_size_bytes)`` views
==============  ======================  =====================================

Compression (``kv_compression="fp8-e4m3"``, off by default): the slab rows
hold fp8 e4m3 codes plus one fp32 scale per group of ``group_size`` elements
for every bf16/fp16/fp32 page tensor (docs/kernels.md, "Compressed rows").
The group defaults to the head dimension (the page's last dim) for every
layout but ``pages``, which does not know it (128 there). ``row_bytes`` is
then the compressed row's size, so a slab sized with it holds about 1.9x the
blocks per byte for bf16.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtriton._choices import parse_choice
from kvtriton.kernels import (
    DEFAULT_GROUP_SIZE,
    CompressionLayout,
    KVCompression,
    PageGeometry,
    compression_layout,
    describe_pages,
)


class KVLayout(enum.Enum):
    """How one engine tensor maps to page tensors (see the module docstring)."""

    AUTO = "auto"
    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    MLA = "mla"
    CROSS_LAYER = "cross_layer"
    PAGES = "pages"

    @classmethod
    def parse(cls, value: str | KVLayout, argument: str = "layout") -> KVLayout:
        """The member called ``value``; anything else raises ``ValueError`` naming ``argument`` and the valid values."""
        return parse_choice(cls, value, argument)


def _detect(name: str, tensor: torch.Tensor) -> KVLayout:
    """Guess one tensor's layout from its shape, refusing to guess when two layouts fit."""
    shape = tuple(tensor.shape)
    if tensor.ndim == 2:
        return KVLayout.PAGES
    if tensor.ndim == 3:
        return KVLayout.MLA
    if tensor.ndim == 5:
        leading_kv, second_kv = shape[0] == 2, shape[1] == 2
        if leading_kv and not second_kv:
            return KVLayout.FLASH_ATTN
        if second_kv and not leading_kv:
            return KVLayout.FLASHINFER
        if leading_kv and second_kv:
            raise ValueError(
                f"cannot tell the layout of {name} with shape {shape}: it reads as flash_attn (2, N, ...) "
                "and as flashinfer (N, 2, ...); pass layout='flash_attn' or layout='flashinfer'"
            )
    raise ValueError(
        f"cannot tell the layout of {name} with shape {shape}; pass layout= one of "
        "'flash_attn' (2, N, ...), 'flashinfer' (N, 2, ...), 'mla' (N, bs, d), "
        "'cross_layer' (N, L, ...) or 'pages' (N, ...)"
    )


def _split(name: str, tensor: torch.Tensor, layout: KVLayout) -> list[tuple[str, torch.Tensor]]:
    """Return the named page tensors of one engine tensor in ``layout``."""
    shape = tuple(tensor.shape)
    if layout is KVLayout.FLASH_ATTN:
        if tensor.ndim < 3 or shape[0] != 2:
            raise ValueError(f"{name} with shape {shape} is not flash_attn: expected (2, num_blocks, ...)")
        return [(f"{name}.k", tensor[0]), (f"{name}.v", tensor[1])]
    if layout is KVLayout.FLASHINFER:
        if tensor.ndim < 3 or shape[1] != 2:
            raise ValueError(f"{name} with shape {shape} is not flashinfer: expected (num_blocks, 2, ...)")
    elif layout is KVLayout.MLA:
        if tensor.ndim != 3:
            raise ValueError(f"{name} with shape {shape} is not mla: expected (num_blocks, block_size, dim)")
    elif layout is KVLayout.CROSS_LAYER:
        if tensor.ndim < 3:
            raise ValueError(f"{name} with shape {shape} is not cross_layer: expected (num_blocks, num_layers, ...)")
    elif tensor.ndim < 1:
        raise ValueError(f"{name} is a scalar; a page tensor needs dim 0 to index blocks")
    return [(name, tensor)]


def byte_view(page: torch.Tensor) -> torch.Tensor:
    """Return ``page`` as a ``(num_blocks, page_bytes)`` uint8 view sharing its memory.

    Works for any dtype and for strided block dims; ``page`` must already have
    contiguous blocks (PagedKV checks this).
    """
    element = page.element_size()
    page_bytes = math.prod(page.shape[1:]) * element
    storage = torch.empty(0, dtype=torch.uint8, device=page.device).set_(page.untyped_storage())
    return storage.as_strided(
        (page.shape[0], page_bytes), (page.stride(0) * element, 1), page.storage_offset() * element
    )


def default_group_sizes(pages: Sequence[torch.Tensor], layout: KVLayout) -> tuple[int, ...]:
    """Elements per fp8 scale of each page tensor: its head dimension (last dim), or 128 for the ``pages`` layout."""
    if layout in (KVLayout.PAGES, KVLayout.AUTO):
        return tuple(DEFAULT_GROUP_SIZE for _ in pages)
    return tuple(int(page.shape[-1]) for page in pages)


@dataclass(frozen=True, slots=True)
class PagedKV:
    """The page tensors of one KV cache and the slab row layout they imply.

    Build it with :meth:`from_tensors`. ``page_offsets[t]`` is where page
    tensor ``t``'s bytes start inside an uncompressed slab row;
    ``raw_row_bytes`` is their sum; ``row_bytes`` is what one slab row holds:
    ``raw_row_bytes`` without compression, the compressed row
    (``compression_layout.row_bytes``) with it. ``geometry`` is the kernels'
    view of the pages, computed once. ``group_sizes`` (None: the default,
    see :func:`default_group_sizes`) applies only with compression.
    """

    pages: list[torch.Tensor]
    names: list[str]
    layout: KVLayout = KVLayout.PAGES
    compression: KVCompression = KVCompression.NONE
    group_sizes: tuple[int, ...] | None = None
    geometry: PageGeometry = field(init=False)
    page_bytes: list[int] = field(init=False)
    page_offsets: list[int] = field(init=False)
    raw_row_bytes: int = field(init=False)
    row_bytes: int = field(init=False)
    compression_layout: CompressionLayout | None = field(init=False)
    num_blocks: int = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        if not self.pages:
            raise ValueError("pages must hold at least one page tensor, got none")
        if len(self.names) != len(self.pages):
            raise ValueError(f"names has {len(self.names)} entries for {len(self.pages)} pages")
        first_name, first = self.names[0], self.pages[0]
        if first.ndim < 1 or first.shape[0] < 1:
            raise ValueError(f"{first_name} with shape {tuple(first.shape)} has no blocks along dim 0")
        # Device, contiguity, empty and overlapping pages: the kernels' own checks, in one place.
        geometry = describe_pages(self.pages, "pages", labels=self.names)
        seen_pointers: dict[int, str] = {}
        for name, page in zip(self.names, self.pages):
            if page.shape[0] != first.shape[0]:
                raise ValueError(f"{name} has {page.shape[0]} blocks but {first_name} has {first.shape[0]}")
            other = seen_pointers.setdefault(page.data_ptr(), name)
            if other != name:
                raise ValueError(f"{name} and {other} start at the same address; pass each tensor once")
        compression = KVCompression.parse(self.compression)
        compressed: CompressionLayout | None = None
        if compression is KVCompression.FP8_E4M3:
            sizes = self.group_sizes if self.group_sizes is not None else default_group_sizes(self.pages, self.layout)
            compressed = compression_layout(self.pages, sizes, name="pages")
        elif self.group_sizes is not None:
            raise ValueError("group_sizes applies only with kv_compression='fp8-e4m3'; kv_compression is 'none'")
        object.__setattr__(self, "compression", compression)
        object.__setattr__(self, "compression_layout", compressed)
        object.__setattr__(self, "geometry", geometry)
        object.__setattr__(self, "page_bytes", list(geometry.page_bytes))
        object.__setattr__(self, "page_offsets", list(geometry.row_offsets))
        object.__setattr__(self, "raw_row_bytes", geometry.row_bytes)
        object.__setattr__(self, "row_bytes", geometry.row_bytes if compressed is None else compressed.row_bytes)
        object.__setattr__(self, "num_blocks", geometry.num_blocks)
        object.__setattr__(self, "device", geometry.device)

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        layout: str | KVLayout = "auto",
        *,
        kv_compression: str | KVCompression = KVCompression.NONE,
        group_size: int | None = None,
    ) -> PagedKV:
        """Describe an engine's KV tensors (a list, or a name -> tensor mapping) as page tensors.

        ``layout="auto"`` reads it from the shapes and raises ``ValueError``
        when a shape fits no layout or more than one; every tensor must then
        resolve to the same layout. ``kv_compression="fp8-e4m3"`` (lossy,
        off by default) stores rows compressed; ``group_size`` overrides the
        elements per scale (default: the head dimension, 128 for ``pages``).
        """
        parsed = KVLayout.parse(layout)
        compression = KVCompression.parse(kv_compression, "kv_compression")
        named: list[tuple[str, torch.Tensor]]
        if isinstance(tensors, Mapping):
            named = [(str(name), tensor) for name, tensor in tensors.items()]
        else:
            named = [(f"tensors[{index}]", tensor) for index, tensor in enumerate(tensors)]
        if not named:
            raise ValueError("tensors must hold at least one tensor, got none")
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers pass numpy arrays
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if parsed is KVLayout.AUTO:
            detected = [(name, _detect(name, tensor)) for name, tensor in named]
            first_name, parsed = detected[0]
            for name, found in detected[1:]:
                if found is not parsed:
                    raise ValueError(
                        f"{name} looks like {found.value} but {first_name} looks like {parsed.value}; "
                        "pass layout= explicitly"
                    )
        pages: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named:
            pages.extend(_split(name, tensor, parsed))
        page_tensors = [page for _, page in pages]
        sizes = None if group_size is None else tuple(group_size for _ in page_tensors)
        return cls(
            pages=page_tensors,
            names=[name for name, _ in pages],
            layout=parsed,
            compression=compression,
            group_sizes=sizes,
        )

    def with_compression(self, kv_compression: str | KVCompression, group_size: int | None = None) -> PagedKV:
        """The same pages described with ``kv_compression`` (and ``group_size``, default as in :meth:`from_tensors`)."""
        compression = KVCompression.parse(kv_compression, "kv_compression")
        sizes = (
            None if group_size is None or compression is KVCompression.NONE else tuple(group_size for _ in self.pages)
        )
        if compression is self.compression and sizes is None:
            return self
        return PagedKV(
            pages=self.pages, names=self.names, layout=self.layout, compression=compression, group_sizes=sizes
        )

    def byte_pages(self) -> list[torch.Tensor]:
        """Every page tensor as a ``(num_blocks, page_bytes)`` uint8 view (see :func:`byte_view`)."""
        return [byte_view(page) for page in self.pages]
