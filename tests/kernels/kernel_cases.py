"""One builder for the kernel tests: page tensors cut from real engine layouts, slabs and indices.

Every case is deterministic in its seed, so building it twice gives two
bit-identical copies: one for the kernel, one for the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypedDict, Unpack

import pytest
import torch

from kvtriton.kernels import CompressionLayout, gather_pages, scatter_pages
from kvtriton.kernels._reference import gather_pages_reference, scatter_pages_reference

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

# Small on purpose: the interpreter runs one work unit at a time.
NUM_BLOCKS = 6
LAYERS = 2
BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8


def devices() -> list[str]:
    """CPU always (through the interpreter), plus CUDA where a GPU is present."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@dataclass(frozen=True, slots=True)
class PageCase:
    """Page tensors (views) plus the tensors that own their memory."""

    name: str
    pages: list[torch.Tensor]
    owners: list[torch.Tensor]

    @property
    def page_bytes(self) -> list[int]:
        return [page[0].numel() * page.element_size() for page in self.pages]

    @property
    def row_bytes(self) -> int:
        return sum(self.page_bytes)

    @property
    def num_blocks(self) -> int:
        return min(page.shape[0] for page in self.pages)

    def memory(self) -> list[torch.Tensor]:
        """Every byte the case owns, as uint8 tensors (compare them to see what changed)."""
        return [as_bytes(owner) for owner in self.owners]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """All bytes of a contiguous tensor, as a flat uint8 copy on the CPU."""
    return tensor.detach().reshape(-1).view(torch.uint8).cpu().clone()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, device: str) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern, NaNs included, must survive a copy."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * item), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).to(device)


COMPRESSIBLE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Page dtypes that fp8 compression quantizes (every other dtype passes through)."""

OUTLIER_EVERY = 8
"""In :func:`kv_tensor`, every this-many-th channel of the last dim is an outlier channel (x16 magnitude)."""


def kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, device: str) -> torch.Tensor:
    """Finite, KV-like values for the compression tests: normal values, outlier channels, a few exact zeros.

    Integer and fp8 dtypes get random bytes (they pass through compression unchanged).
    """
    if dtype not in COMPRESSIBLE_DTYPES.values():
        return random_tensor(shape, dtype, generator, device)
    values = torch.randn(shape, generator=generator)
    channel_scale = torch.ones(shape[-1])
    channel_scale[::OUTLIER_EVERY] = 16.0
    values = values * channel_scale
    values[torch.rand(shape, generator=generator) < 0.02] = 0.0
    return values.to(dtype).to(device)


Maker = Callable[[tuple[int, ...], torch.dtype, torch.Generator, str], torch.Tensor]


def _flash_attn(
    dtype: torch.dtype, g: torch.Generator, device: str, make: Maker = random_tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = [make((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype, g, device) for _ in range(LAYERS)]
    return [layer[kv] for layer in layers for kv in range(2)], layers


def _flashinfer(
    dtype: torch.dtype, g: torch.Generator, device: str, make: Maker = random_tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = [make((NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM), dtype, g, device) for _ in range(LAYERS)]
    return list(layers), layers


def _mla(
    dtype: torch.dtype, g: torch.Generator, device: str, make: Maker = random_tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = [make((NUM_BLOCKS, BLOCK_SIZE, 2 * HEAD_DIM + 4), dtype, g, device) for _ in range(LAYERS)]
    return list(layers), layers


def _cross_layer(
    dtype: torch.dtype, g: torch.Generator, device: str, make: Maker = random_tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # (N, L, 2, bs, h, d): one strided view per layer, block stride = L pages.
    cache = make((NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM), dtype, g, device)
    return [cache[:, layer] for layer in range(LAYERS)], [cache]


def _odd_pages(sizes: tuple[int, ...]) -> Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]]:
    def build(
        dtype: torch.dtype, g: torch.Generator, device: str, make: Maker = random_tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        item = torch.empty((), dtype=dtype).element_size()
        owners = [make((NUM_BLOCKS, size // item), dtype, g, device) for size in sizes]
        return list(owners), owners

    return build


LAYOUTS: dict[str, Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]]] = {
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "mla": _mla,
    "cross_layer": _cross_layer,
    "odd_656": _odd_pages((656, 656)),
    "mixed_sizes": _odd_pages((656, 1024, 48)),
}
ODD_BYTE_LAYOUTS: dict[str, tuple[int, ...]] = {"odd_4097": (4097,), "odd_mixed_bytes": (4097, 33, 8)}


def build_pages(layout: str, dtype: torch.dtype, device: str, seed: int = 0, *, kv_values: bool = False) -> PageCase:
    """Page tensors of ``layout`` holding random bytes (same seed -> same bytes).

    ``kv_values``: finite KV-like values instead (:func:`kv_tensor`), what compression needs.
    """
    generator = torch.Generator().manual_seed(seed)
    make: Maker = kv_tensor if kv_values else random_tensor
    if layout in ODD_BYTE_LAYOUTS:
        pages, owners = _odd_pages(ODD_BYTE_LAYOUTS[layout])(torch.uint8, generator, device, make)
    else:
        pages, owners = LAYOUTS[layout](dtype, generator, device, make)
    return PageCase(name=f"{layout}-{dtype}", pages=pages, owners=owners)


SLAB_PADDINGS = (5, 16)
"""Bytes a test slab's rows exceed the pages by: 5 makes every row stride odd (the byte-wide kernel variants), 16
keeps the 16-byte alignment production slabs have (the 16-byte variants)."""
over_slab_paddings = pytest.mark.parametrize(
    "padding", SLAB_PADDINGS, ids=[f"pad{padding}" for padding in SLAB_PADDINGS]
)
"""Runs a kernel test once per :data:`SLAB_PADDINGS` (its ``padding`` argument: ``build_slab``'s ``extra_bytes``)."""


def build_slab(
    case: PageCase, rows: int, device: str, *, extra_bytes: int = 16, seed: int = 1, row_bytes: int | None = None
) -> torch.Tensor:
    """A slab with ``rows`` rows ``extra_bytes`` wider than needed (than ``row_bytes``, default the case's), filled with random bytes.

    On CUDA the slab is pinned host memory, as in production.
    """
    generator = torch.Generator().manual_seed(seed)
    width = case.row_bytes if row_bytes is None else row_bytes
    slab = torch.randint(0, 256, (rows, width + extra_bytes), dtype=torch.uint8, generator=generator)
    return slab.pin_memory() if device == "cuda" else slab


def synchronize(device: str) -> None:
    """Wait for the kernels queued on ``device``: a gather into a pinned host slab is asynchronous.

    Reading the slab on the host (it is already CPU memory, so ``.cpu()``
    copies nothing and waits for nothing) right after the launch would see
    whatever the kernel had written so far.
    """
    if device == "cuda":
        torch.cuda.synchronize()


def indices(values: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def i64(*values: int) -> torch.Tensor:
    """``values`` as the int64 CPU index tensor the references (and the validation cases) take."""
    return indices(list(values), torch.int64, "cpu")


def block_bytes(page: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """The raw bytes of ``page[blocks]`` as ``(len(blocks), page_bytes)`` uint8 on the CPU (NaN-safe to compare)."""
    picked = page[blocks].cpu().contiguous()
    return picked.reshape(len(blocks), -1).view(torch.uint8)


def build_sized_pages(
    sizes: tuple[int, ...], num_blocks: int, device: str, *, strided: bool = False, seed: int = 0
) -> PageCase:
    """uint8 page tensors of these page sizes in bytes, ``num_blocks`` blocks each, holding random bytes.

    ``strided``: every page tensor is a column slice of one ``(num_blocks, sum + 16)``
    tensor (block stride larger than the page, bases not 16-byte aligned past
    the first), as a cross-layer cache's per-layer views.
    """
    generator = torch.Generator().manual_seed(seed)
    if strided:
        owner = random_tensor((num_blocks, sum(sizes) + 16), torch.uint8, generator, device)
        starts = [sum(sizes[:t]) for t in range(len(sizes))]
        pages = [owner[:, start : start + size] for start, size in zip(starts, sizes)]
        return PageCase(name=f"strided{sizes}", pages=pages, owners=[owner])
    owners = [random_tensor((num_blocks, size), torch.uint8, generator, device) for size in sizes]
    return PageCase(name=f"sized{sizes}", pages=list(owners), owners=owners)


class LaunchKnobs(TypedDict, total=False):
    """The kernels' launch knobs a test may set (the reference takes none)."""

    num_programs: int
    bytes_per_iter: int


BLOCKS = [4, 0, 5]
ROWS = [2, 7, 3]
"""The GPU blocks and slab rows most kernel tests copy between: out of order, block 0 and row 7 of 9 included."""


def run_both(
    direction: Literal["gather", "scatter"],
    layout: str,
    dtype: torch.dtype,
    device: str,
    blocks: list[int],
    rows: list[int],
    index_dtype: torch.dtype,
    padding: int = 16,
    **knobs: Unpack[LaunchKnobs],
) -> None:
    """:func:`copy_with_both` on a ``layout`` case and a 9-row slab ``padding`` bytes wider than its rows."""
    case, oracle = build_pages(layout, dtype, device), build_pages(layout, dtype, "cpu")
    slab, expected = build_slab(case, 9, device, extra_bytes=padding), build_slab(oracle, 9, "cpu", extra_bytes=padding)
    copy_with_both(direction, case, oracle, slab, expected, blocks, rows, index_dtype, **knobs)


def copy_with_both(
    direction: Literal["gather", "scatter"],
    case: PageCase,
    oracle: PageCase,
    slab: torch.Tensor,
    expected: torch.Tensor,
    blocks: list[int],
    rows: list[int],
    block_dtype: torch.dtype = torch.int64,
    row_dtype: torch.dtype | None = None,
    *,
    compression: CompressionLayout | None = None,
    **knobs: Unpack[LaunchKnobs],
) -> None:
    """Copy GPU blocks ``blocks`` <-> slab rows ``rows`` with the kernel between ``case`` and ``slab``, and with the
    torch reference between their bit-identical CPU twins ``oracle`` and ``expected``: afterwards every byte of the
    slabs and of the cases' memory must agree, which also shows the side copied from was only read.

    ``row_dtype`` defaults to ``block_dtype``.
    """
    device = case.pages[0].device.type

    def index(where: str) -> tuple[torch.Tensor, torch.Tensor]:
        return indices(blocks, block_dtype, where), indices(rows, row_dtype or block_dtype, where)

    (blocks_there, rows_there), (blocks_cpu, rows_cpu) = index(device), index("cpu")
    if direction == "gather":
        gather_pages(case.pages, slab, blocks_there, rows_there, compression=compression, **knobs)
        gather_pages_reference(oracle.pages, expected, blocks_cpu, rows_cpu, compression=compression)
    else:
        scatter_pages(slab, case.pages, rows_there, blocks_there, compression=compression, **knobs)
        scatter_pages_reference(expected, oracle.pages, rows_cpu, blocks_cpu, compression=compression)
    synchronize(device)
    assert torch.equal(slab.cpu(), expected)
    for got, want in zip(case.memory(), oracle.memory()):
        assert torch.equal(got, want)
