"""scatter_pages: slab rows -> GPU blocks of every page tensor, bit for bit as the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvtriton.kernels import gather_pages, scatter_pages
from kvtriton.kernels._reference import scatter_pages_reference
from tests.kernels.kernel_cases import (
    DTYPES,
    LAYOUTS,
    ODD_BYTE_LAYOUTS,
    block_bytes,
    build_pages,
    build_slab,
    devices,
    indices,
    over_slab_paddings,
)

ROWS = [2, 7, 3]
BLOCKS = [4, 0, 5]


def run_both(
    layout: str,
    dtype: torch.dtype,
    device: str,
    rows: list[int],
    blocks: list[int],
    index_dtype: torch.dtype,
    padding: int = 16,
) -> None:
    """Scatter with the kernel on ``device`` and with the reference on CPU; every byte must agree."""
    case = build_pages(layout, dtype, device)
    oracle = build_pages(layout, dtype, "cpu")
    slab = build_slab(case, 9, device, extra_bytes=padding)
    source = build_slab(oracle, 9, "cpu", extra_bytes=padding)
    slab_before = slab.clone()
    scatter_pages(slab, case.pages, indices(rows, index_dtype, device), indices(blocks, index_dtype, device))
    scatter_pages_reference(
        source, oracle.pages, indices(rows, index_dtype, "cpu"), indices(blocks, index_dtype, "cpu")
    )
    for got, want in zip(case.memory(), oracle.memory()):
        assert torch.equal(got, want)
    # The slab is only read.
    assert torch.equal(slab, slab_before)


@pytest.mark.parametrize("device", devices())
@over_slab_paddings
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scatter_matches_reference_bit_for_bit(layout: str, dtype: str, padding: int, device: str) -> None:
    index_dtype = torch.int64 if list(LAYOUTS).index(layout) % 2 else torch.int32
    run_both(layout, DTYPES[dtype], device, ROWS, BLOCKS, index_dtype, padding)


@pytest.mark.parametrize("device", devices())
@over_slab_paddings
@pytest.mark.parametrize("layout", list(ODD_BYTE_LAYOUTS))
def test_scatter_handles_odd_page_sizes_byte_by_byte(layout: str, padding: int, device: str) -> None:
    run_both(layout, torch.uint8, device, ROWS, BLOCKS, torch.int32, padding)


@pytest.mark.parametrize("device", devices())
def test_scatter_writes_only_the_named_blocks(device: str) -> None:
    case = build_pages("flash_attn", torch.bfloat16, device)
    slab = build_slab(case, 9, device)
    scatter_pages(slab, case.pages, indices(ROWS, torch.int64, device), indices(BLOCKS, torch.int64, device))
    for t, page in enumerate(case.pages):
        offset = sum(case.page_bytes[:t])
        got = block_bytes(page, BLOCKS)
        assert torch.equal(got, slab[ROWS, offset : offset + case.page_bytes[t]].cpu())
    # Blocks not named keep their bytes.
    untouched = build_pages("flash_attn", torch.bfloat16, "cpu")
    others = [b for b in range(case.num_blocks) if b not in BLOCKS]
    for page_now, page_then in zip(case.pages, untouched.pages):
        assert torch.equal(block_bytes(page_now, others), block_bytes(page_then, others))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "layout", ["flash_attn", "flashinfer", "mla", "cross_layer", "odd_656", "mixed_sizes", "odd_4097"]
)
def test_gather_then_scatter_restores_the_original(layout: str, device: str) -> None:
    case = build_pages(layout, torch.float8_e4m3fn, device)
    slab = build_slab(case, 9, device)
    blocks, rows = [1, 5, 2, 0], [8, 0, 4, 6]
    gather_pages(case.pages, slab, indices(blocks, torch.int64, device), indices(rows, torch.int32, device))
    for owner in case.owners:
        owner.view(torch.uint8).fill_(0xA5)
    scatter_pages(slab, case.pages, indices(rows, torch.int32, device), indices(blocks, torch.int64, device))
    for page, kept in zip(case.pages, build_pages(layout, torch.float8_e4m3fn, "cpu").pages):
        assert torch.equal(block_bytes(page, blocks), block_bytes(kept, blocks))


@pytest.mark.parametrize("device", devices())
def test_scatter_with_empty_indices_writes_nothing(device: str) -> None:
    case = build_pages("cross_layer", torch.float16, device)
    before = case.memory()
    slab = build_slab(case, 4, device)
    scatter_pages(slab, case.pages, indices([], torch.int32, device), indices([], torch.int32, device))
    for got, want in zip(case.memory(), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", devices())
def test_scatter_reads_one_row_into_several_blocks(device: str) -> None:
    run_both("flashinfer", torch.int8, device, [6, 6, 6], [0, 3, 5], torch.int64)
