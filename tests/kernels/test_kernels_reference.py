"""The torch reference (oracle and CPU fallback) against the plain per-block loop of its definition.

The other kernel tests compare the Triton kernel with the reference; these pin
the reference itself: every copy strategy it may pick (one op per run on
either side, two bulk passes), page groups (one strided view over several page
tensors) and the 16-byte word view, on every engine layout, with repeated
destinations resolved as the sequential loop does (the last pair wins).
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvtriton.kernels._reference as reference
from kvtriton.kernels import describe_pages
from kvtriton.kernels._reference import gather_pages_reference, scatter_pages_reference
from tests.kernels.kernel_cases import (
    LAYOUTS,
    NUM_BLOCKS,
    ODD_BYTE_LAYOUTS,
    build_pages,
    build_slab,
    i64,
    random_tensor,
)

ROWS = 9
ALL_LAYOUTS = [*LAYOUTS, *ODD_BYTE_LAYOUTS]
# Forces the copy strategy: 0 -> one op per run (whichever side has fewer
# runs), a huge value -> two bulk passes whenever there is more than one run.
STRATEGIES = {"per-run": 0, "two-pass": 1 << 40}


def page_bytes_of(page: torch.Tensor, block: int) -> torch.Tensor:
    """The raw bytes of ``page[block]`` as a 1-D uint8 view (writable)."""
    return page[block].reshape(-1).view(torch.uint8)


def loop_gather(pages: list[torch.Tensor], slab: torch.Tensor, blocks: list[int], rows: list[int]) -> None:
    """The definition, one pair and one page tensor at a time."""
    for block, row in zip(blocks, rows):
        column = 0
        for page in pages:
            data = page_bytes_of(page, block)
            slab[row, column : column + data.numel()] = data
            column += data.numel()


def loop_scatter(slab: torch.Tensor, pages: list[torch.Tensor], rows: list[int], blocks: list[int]) -> None:
    for row, block in zip(rows, blocks):
        column = 0
        for page in pages:
            data = page_bytes_of(page, block)
            data.copy_(slab[row, column : column + data.numel()])
            column += data.numel()


pairs = st.integers(1, 8).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n),
        st.lists(st.integers(0, ROWS - 1), min_size=n, max_size=n),
    )
)


@pytest.mark.parametrize(("direction", "dtype"), [("gather", torch.bfloat16), ("scatter", torch.float16)])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@given(layout=st.sampled_from(ALL_LAYOUTS), index=pairs)
def test_the_reference_equals_the_per_block_loop(
    direction: str, dtype: torch.dtype, strategy: str, layout: str, index: tuple[list[int], list[int]]
) -> None:
    blocks, rows = index
    # Bit-identical twins: the reference copies within one, the loop of the definition within the other.
    case, oracle = build_pages(layout, dtype, "cpu"), build_pages(layout, dtype, "cpu")
    slab, expected = build_slab(case, ROWS, "cpu"), build_slab(oracle, ROWS, "cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "_MIN_BYTES_PER_RUN", STRATEGIES[strategy])
        if direction == "gather":
            gather_pages_reference(case.pages, slab, i64(*blocks), i64(*rows))
        else:
            scatter_pages_reference(slab, case.pages, i64(*rows), i64(*blocks))
    if direction == "gather":
        loop_gather(oracle.pages, expected, blocks, rows)
    else:
        loop_scatter(expected, oracle.pages, rows, blocks)
    assert torch.equal(slab, expected)
    for got, want in zip(case.memory(), oracle.memory()):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("layout", "sizes"),
    [("flash_attn", [2, 2]), ("flashinfer", [1, 1]), ("mla", [1, 1]), ("cross_layer", [2]), ("odd_656", [1, 1])],
)
def test_page_tensors_sharing_one_strided_view_move_as_one_group(layout: str, sizes: list[int]) -> None:
    case = build_pages(layout, torch.bfloat16, "cpu")
    slab = build_slab(case, ROWS, "cpu")
    groups = reference.page_groups(case.pages, slab, describe_pages(case.pages, "src"))
    assert [blocks.shape[1] for blocks, _ in groups] == sizes
    assert [rows.shape[1] for _, rows in groups] == sizes


def test_aligned_pages_move_as_16_byte_words_and_odd_ones_as_bytes() -> None:
    aligned = build_pages("flash_attn", torch.bfloat16, "cpu")
    odd = build_pages("odd_4097", torch.uint8, "cpu")
    for case, dtype in ((aligned, torch.complex128), (odd, torch.uint8)):
        slab = build_slab(case, ROWS, "cpu", extra_bytes=16)
        for blocks, rows in reference.page_groups(case.pages, slab, describe_pages(case.pages, "src")):
            assert (blocks.dtype, rows.dtype) == (dtype, dtype)


def test_a_slab_at_an_odd_byte_offset_narrows_the_words_and_stays_exact() -> None:
    case = build_pages("flash_attn", torch.bfloat16, "cpu")
    wide = build_slab(case, ROWS, "cpu", extra_bytes=16)
    slab, expected = wide[:, 1:], wide.clone()[:, 1:]
    groups = reference.page_groups(case.pages, slab, describe_pages(case.pages, "src"))
    assert {rows.dtype for _, rows in groups} == {torch.uint8}
    gather_pages_reference(case.pages, slab, i64(5, 0, 3), i64(1, 2, 8))
    loop_gather(case.pages, expected, [5, 0, 3], [1, 2, 8])
    assert torch.equal(slab, expected)


# float64 patterns an arithmetic path would change: signalling and payload NaNs, subnormals, -0.
SPECIAL_FLOAT64 = [
    0x7FF0000000000001,
    0x7FF4000000000000,
    0xFFF8DEADBEEF0001,
    0x0000000000000001,
    0x800FFFFFFFFFFFFF,
    1 << 63,
]


def test_16_byte_words_keep_every_float_bit_pattern_even_with_denormals_flushed() -> None:
    words = torch.tensor(
        [struct.unpack("<q", struct.pack("<Q", bits))[0] for bits in SPECIAL_FLOAT64], dtype=torch.int64
    )
    layer = words.repeat(2 * NUM_BLOCKS * 16).view(torch.float64).reshape(2, NUM_BLOCKS, 96)
    pages = [layer[0], layer[1]]
    original = layer.clone()
    slab = torch.zeros(ROWS, 2 * 96 * 8, dtype=torch.uint8)
    torch.set_flush_denormal(True)  # where supported: an arithmetic copy would now zero the subnormals
    try:
        gather_pages_reference(pages, slab, i64(4, 1, 0), i64(0, 5, 2))
        layer.zero_()
        scatter_pages_reference(slab, pages, i64(0, 5, 2), i64(4, 1, 0))
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(layer[:, [4, 1, 0]].view(torch.int64), original[:, [4, 1, 0]].view(torch.int64))


def test_the_same_page_tensor_twice_scatters_as_the_sequential_loop() -> None:
    # Aliased page tensors never share a group: the later tensor's bytes win, as in the loop.
    layer = random_tensor((NUM_BLOCKS, 64), torch.uint8, torch.Generator().manual_seed(3), "cpu")
    oracle = layer.clone()
    slab = build_slab(build_pages("odd_656", torch.uint8, "cpu"), ROWS, "cpu")
    scatter_pages_reference(slab, [layer, layer], i64(1, 4), i64(2, 0))
    loop_scatter(slab, [oracle, oracle], [1, 4], [2, 0])
    assert torch.equal(layer, oracle)


@pytest.mark.parametrize("order", ["overlapping", "reversed"])
def test_page_tensors_that_no_view_covers_in_order_scatter_as_the_sequential_loop(order: str) -> None:
    owner = random_tensor((NUM_BLOCKS, 96), torch.uint8, torch.Generator().manual_seed(4), "cpu")
    # overlapping: two page tensors sharing bytes (pitch 32 B < page 64 B); reversed: V before K (negative pitch).
    pages = [owner[:, 0:64], owner[:, 32:96]] if order == "overlapping" else [owner[:, 48:96], owner[:, 0:48]]
    oracle_owner = owner.clone()
    oracle_pages = [oracle_owner[:, page.storage_offset() : page.storage_offset() + page.shape[1]] for page in pages]
    slab = torch.randint(0, 256, (ROWS, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert len(reference.page_groups(pages, slab, describe_pages(pages, "dst"))) == 2
    scatter_pages_reference(slab, pages, i64(3, 0, 6), i64(5, 2, 1))
    loop_scatter(slab, oracle_pages, [3, 0, 6], [5, 2, 1])
    assert torch.equal(owner, oracle_owner)
