"""scatter_pages: slab rows -> GPU blocks of every page tensor, bit for bit as the torch reference.

The layout x dtype x padding matrix of both directions is in test_kernels_gather.py."""

from __future__ import annotations

import pytest
import torch

from kvtriton.kernels import gather_pages, scatter_pages
from tests.kernels.kernel_cases import (
    BLOCKS,
    ROWS,
    block_bytes,
    build_pages,
    build_slab,
    devices,
    indices,
    run_both,
)


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
    run_both("scatter", "flashinfer", torch.int8, device, [0, 3, 5], [6, 6, 6], torch.int64)
