"""Launch planning (kernels/_launch.py): small pages are stacked into tiles of index pairs, and a tiled launch copies exactly what the reference does."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from kvtriton.kernels import DEFAULT_BYTES_PER_ITER, gather_pages, scatter_pages
from kvtriton.kernels._launch import make_config
from kvtriton.kernels._launch_arguments import MAX_NUM_WARPS, MAX_PAIRS, word_width
from tests.kernels.kernel_cases import build_sized_pages, build_slab, copy_with_both, indices

# 11 pairs: several tiles with a partial last one (4 + 4 + 3, 2 x 5 + 1, ...).
NUM_BLOCKS = 16
GATHER_BLOCKS = [3, 15, 0, 3, 7, 9, 12, 1, 1, 14, 5]
GATHER_ROWS = [12, 0, 5, 3, 9, 1, 11, 7, 2, 10, 6]
SCATTER_ROWS = [4, 4, 0, 12, 7, 2, 9, 9, 1, 3, 11]
SCATTER_BLOCKS = [15, 2, 8, 0, 11, 6, 3, 13, 9, 4, 10]
SLAB_ROWS = 13

# (page sizes, bytes_per_iter, pairs per tile): uniform, masked columns (656 B
# in a 1 KiB chunk), mixed sizes (per-page mask from the table), odd sizes
# (byte words).
TILES: dict[str, tuple[tuple[int, ...], int, int]] = {
    "1k-tile-of-4": ((1024, 1024), 4096, 4),
    "1k-tile-of-16": ((1024, 1024), DEFAULT_BYTES_PER_ITER, 16),
    "656-masked-columns": ((656, 656), 4096, 4),
    "mixed-656-1024-48": ((656, 1024, 48), 4096, 4),
    "mixed-656-1024-48-tile-of-16": ((656, 1024, 48), DEFAULT_BYTES_PER_ITER, 16),
    "odd-bytes-4097-33-8": ((4097, 33, 8), DEFAULT_BYTES_PER_ITER, 2),
    "odd-bytes-4097-33-8-tile-of-8": ((4097, 33, 8), 65536, 8),
}


@pytest.mark.parametrize(
    ("page_bytes", "chunk_bytes", "pairs"),
    [(1024, 1024, 16), (4096, 4096, 4), (656, 1024, 16), (16384, 16384, 1), (32768, 16384, 1), (262144, 16384, 1)],
)
def test_pages_smaller_than_bytes_per_iter_stack_pairs_into_one_tile(
    page_bytes: int, chunk_bytes: int, pairs: int
) -> None:
    config = make_config(word_width(page_bytes), [page_bytes] * 64, DEFAULT_BYTES_PER_ITER)
    assert config.chunk * config.element_bytes == chunk_bytes
    assert config.pairs == pairs
    assert config.tile_bytes == DEFAULT_BYTES_PER_ITER
    assert config.num_warps == MAX_NUM_WARPS


@pytest.mark.parametrize("bytes_per_iter", [16, 64, 1024, 16384, 65536])
@pytest.mark.parametrize("page_bytes", [1, 8, 33, 48, 104, 656, 1000, 1024, 4097, 65536])
def test_pairs_per_tile_is_a_power_of_two_and_the_tile_fills_bytes_per_iter(
    page_bytes: int, bytes_per_iter: int
) -> None:
    config = make_config(word_width(page_bytes), [page_bytes], bytes_per_iter)
    assert 1 <= config.pairs <= MAX_PAIRS and config.pairs & (config.pairs - 1) == 0
    # Pairs stack only when a whole page is one chunk.
    assert config.pairs == 1 or config.chunks_per_page == 1
    # Every iteration moves bytes_per_iter, unless the pair cap (pages < 128 B) binds.
    assert config.tile_bytes == bytes_per_iter or config.pairs == MAX_PAIRS


def test_units_count_tiles_of_pairs_with_a_partial_last_tile() -> None:
    small = make_config(16, [1024] * 3, 4096)  # 4 pairs per tile, 3 page tensors
    assert small.pairs == 4
    assert [small.units(n) for n in (0, 1, 4, 5, 11)] == [0, 3, 3, 6, 9]
    large = make_config(16, [32768] * 2, 16384)  # 2 chunks per page, one pair per unit
    assert large.pairs == 1 and large.units(3) == 12


def _pairs(sizes: tuple[int, ...], bytes_per_iter: int) -> int:
    return make_config(word_width(*sizes), list(sizes), bytes_per_iter).pairs


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("tile", list(TILES.values()), ids=list(TILES))
@pytest.mark.parametrize(
    ("direction", "blocks", "rows"),
    [("gather", GATHER_BLOCKS, GATHER_ROWS), ("scatter", SCATTER_BLOCKS, SCATTER_ROWS)],
    ids=["gather", "scatter"],
)
def test_a_tiled_copy_matches_the_reference_with_a_partial_last_tile(
    direction: Literal["gather", "scatter"],
    blocks: list[int],
    rows: list[int],
    tile: tuple[tuple[int, ...], int, int],
    strided: bool,
) -> None:
    sizes, bytes_per_iter, pairs = tile
    assert _pairs(sizes, bytes_per_iter) == pairs and len(blocks) % pairs != 0
    case = build_sized_pages(sizes, NUM_BLOCKS, "cpu", strided=strided)
    oracle = build_sized_pages(sizes, NUM_BLOCKS, "cpu", strided=strided)
    slab, expected = build_slab(case, SLAB_ROWS, "cpu"), build_slab(oracle, SLAB_ROWS, "cpu")
    # 2 programs walk every tile; the last tile of 4 holds 3 live pairs. Blocks not named (and bytes between
    # strided pages) keep their bytes.
    copy_with_both(
        direction,
        case,
        oracle,
        slab,
        expected,
        blocks,
        rows,
        torch.int32,
        torch.int64,
        num_programs=2,
        bytes_per_iter=bytes_per_iter,
    )


@pytest.mark.parametrize("bytes_per_iter", [1024, DEFAULT_BYTES_PER_ITER], ids=["one-pair-per-unit", "tile-of-16"])
def test_a_one_pair_job_copies_one_block_both_ways(bytes_per_iter: int) -> None:
    case = build_sized_pages((1024, 1024), NUM_BLOCKS, "cpu")
    assert _pairs((1024, 1024), bytes_per_iter) == bytes_per_iter // 1024
    slab = build_slab(case, 3, "cpu")
    before = slab.clone()
    gather_pages(
        case.pages,
        slab,
        indices([9], torch.int64, "cpu"),
        indices([1], torch.int64, "cpu"),
        bytes_per_iter=bytes_per_iter,
    )
    assert torch.equal(slab[1, :2048], torch.cat([page[9] for page in case.pages]))
    assert torch.equal(slab[[0, 2]], before[[0, 2]]) and torch.equal(slab[1, 2048:], before[1, 2048:])
    targets = build_sized_pages((1024, 1024), NUM_BLOCKS, "cpu", seed=7)
    untouched = build_sized_pages((1024, 1024), NUM_BLOCKS, "cpu", seed=7)
    scatter_pages(
        slab,
        targets.pages,
        indices([1], torch.int32, "cpu"),
        indices([4], torch.int32, "cpu"),
        bytes_per_iter=bytes_per_iter,
    )
    for target, kept, source in zip(targets.pages, untouched.pages, case.pages):
        assert torch.equal(target[4], source[9])
        others = [b for b in range(NUM_BLOCKS) if b != 4]
        assert torch.equal(target[others], kept[others])
