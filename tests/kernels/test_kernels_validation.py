"""Bad calls raise before anything is written, naming the argument and the value."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from kvtriton.kernels import gather_pages, scatter_pages
from kvtriton.kernels._reference import gather_pages_reference, scatter_pages_reference
from tests.kernels.kernel_cases import PageCase, build_pages, build_slab, i64


def make_case() -> tuple[PageCase, torch.Tensor]:
    case = build_pages("flash_attn", torch.bfloat16, "cpu")
    return case, build_slab(case, 4, "cpu")


def assert_nothing_written(
    case: PageCase, slab: torch.Tensor, call: Callable[[], None], error: type[Exception], match: str
) -> None:
    pages_before, slab_before = case.memory(), slab.clone()
    with pytest.raises(error, match=match):
        call()
    assert torch.equal(slab, slab_before)
    for got, want in zip(case.memory(), pages_before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("gather", [gather_pages, gather_pages_reference], ids=["kernel", "reference"])
def test_gather_rejects_a_row_out_of_range_before_writing(gather: Callable[..., None]) -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather(case.pages, slab, i64(0, 1, 2), i64(0, 3, 4))
    assert_nothing_written(
        case, slab, call, ValueError, re.escape("dst_rows[2] = 4 is out of range: there are 4 slab rows")
    )


@pytest.mark.parametrize("scatter", [scatter_pages, scatter_pages_reference], ids=["kernel", "reference"])
def test_scatter_rejects_a_block_out_of_range_before_writing(scatter: Callable[..., None]) -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: scatter(slab, case.pages, i64(0, 1), i64(2, 6))
    assert_nothing_written(
        case, slab, call, ValueError, re.escape("dst_blocks[1] = 6 is out of range: there are 6 blocks")
    )


def test_negative_indices_are_out_of_range() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages, slab, i64(-1), i64(0))
    assert_nothing_written(case, slab, call, ValueError, re.escape("src_blocks[0] = -1 is out of range"))


def test_mismatched_index_lengths_are_rejected() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages, slab, i64(0, 1), i64(0))
    assert_nothing_written(case, slab, call, ValueError, "src_blocks and dst_rows must have equal lengths, got 2 and 1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_non_integer_or_narrow_indices_are_rejected_not_converted(dtype: torch.dtype) -> None:
    case, slab = make_case()
    rows = torch.zeros(1, dtype=dtype)
    call: Callable[[], None] = lambda: scatter_pages(slab, case.pages, rows, i64(0))
    assert_nothing_written(case, slab, call, TypeError, f"src_rows must be int32 or int64, got {dtype}")


def test_two_dimensional_indices_are_rejected() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages, slab, i64(0, 1).reshape(1, 2), i64(0, 1))
    assert_nothing_written(case, slab, call, ValueError, re.escape("src_blocks must be 1-D, got shape (1, 2)"))


def test_a_page_with_non_contiguous_blocks_is_rejected() -> None:
    case, slab = make_case()
    transposed = case.pages[1].transpose(1, 2)  # (N, h, bs, d): a block is no longer one run of bytes
    pages = [case.pages[0], transposed]
    call: Callable[[], None] = lambda: gather_pages(pages, slab, i64(0), i64(0))
    assert_nothing_written(case, slab, call, ValueError, re.escape("src[1] has non-contiguous blocks"))


def test_overlapping_blocks_are_rejected() -> None:
    case, slab = make_case()
    overlapping = torch.zeros(16, dtype=torch.uint8).as_strided((4, 8), (2, 1))
    call: Callable[[], None] = lambda: scatter_pages(slab, [overlapping], i64(0), i64(0))
    assert_nothing_written(case, slab, call, ValueError, re.escape("dst[0] has overlapping blocks: block stride 2 B"))


def test_a_slab_row_too_narrow_for_the_pages_is_rejected() -> None:
    case, _ = make_case()
    narrow = torch.zeros(4, case.row_bytes - 1, dtype=torch.uint8)
    call: Callable[[], None] = lambda: gather_pages(case.pages, narrow, i64(0), i64(0))
    assert_nothing_written(
        case,
        narrow,
        call,
        ValueError,
        f"dst row too narrow: {case.row_bytes - 1} bytes per row, the pages need {case.row_bytes}",
    )


@pytest.mark.parametrize(
    ("slab", "error", "match"),
    [
        (torch.zeros(4, 2048, dtype=torch.int8), TypeError, "dst must have dtype torch.uint8, got torch.int8"),
        (
            torch.zeros(4, 2, 1024, dtype=torch.uint8),
            ValueError,
            re.escape("dst must be 2-D (rows, row_bytes), got shape (4, 2, 1024)"),
        ),
        (torch.zeros(2048, 4, dtype=torch.uint8).t(), ValueError, "dst rows must be contiguous"),
    ],
    ids=["dtype", "ndim", "column-major"],
)
def test_a_malformed_slab_is_rejected(slab: torch.Tensor, error: type[Exception], match: str) -> None:
    case, _ = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages, slab, i64(0), i64(0))
    assert_nothing_written(case, slab, call, error, match)


def test_page_tensors_on_different_devices_are_rejected() -> None:
    case, slab = make_case()
    meta = torch.empty(6, 64, dtype=torch.uint8, device="meta")
    call: Callable[[], None] = lambda: gather_pages([case.pages[0], meta], slab, i64(0), i64(0))
    assert_nothing_written(case, slab, call, ValueError, "src\\[1\\] is on meta but src\\[0\\] is on cpu")


def test_a_single_tensor_instead_of_a_sequence_is_rejected() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages[0], slab, i64(0), i64(0))  # pyright: ignore[reportArgumentType] -- the mistake under test
    assert_nothing_written(case, slab, call, TypeError, "src must be a sequence of page tensors")


def test_an_empty_page_list_is_rejected() -> None:
    _, slab = make_case()
    with pytest.raises(ValueError, match="src must hold at least one page tensor"):
        gather_pages([], slab, i64(0), i64(0))


@pytest.mark.parametrize(("knob", "value"), [("num_programs", 0), ("bytes_per_iter", 1000), ("bytes_per_iter", 8)])
def test_bad_knobs_are_rejected(knob: str, value: int) -> None:
    case, slab = make_case()
    knobs = {"num_programs": 16, "bytes_per_iter": 16384, knob: value}
    call: Callable[[], None] = lambda: gather_pages(
        case.pages, slab, i64(0), i64(0), num_programs=knobs["num_programs"], bytes_per_iter=knobs["bytes_per_iter"]
    )
    assert_nothing_written(case, slab, call, ValueError, f"{knob} must be")


def test_gather_rejects_a_destination_row_named_twice() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: gather_pages(case.pages, slab, i64(0, 1, 2), i64(3, 1, 3))
    assert_nothing_written(case, slab, call, ValueError, "dst_rows names destination 3 more than once")


def test_scatter_rejects_a_destination_block_named_twice() -> None:
    case, slab = make_case()
    call: Callable[[], None] = lambda: scatter_pages(slab, case.pages, i64(0, 1), i64(5, 5))
    assert_nothing_written(case, slab, call, ValueError, "dst_blocks names destination 5 more than once")


def test_the_reference_keeps_the_last_pair_for_a_repeated_destination() -> None:
    # Sequential semantics: for i in order, slab[rows[i]] = pages[blocks[i]].
    case, slab = make_case()
    gather_pages_reference(case.pages, slab, i64(0, 1, 2), i64(3, 1, 3))
    expected = torch.cat([page[2].reshape(-1).view(torch.uint8) for page in case.pages])
    assert torch.equal(slab[3, : case.row_bytes], expected)


def test_the_reference_scatter_keeps_the_last_row_for_a_repeated_block() -> None:
    case, slab = make_case()
    scatter_pages_reference(slab, case.pages, i64(0, 2, 1), i64(4, 4, 4))
    offset = 0
    for page, size in zip(case.pages, case.page_bytes):
        assert torch.equal(page[4].reshape(-1).view(torch.uint8), slab[1, offset : offset + size])
        offset += size


def test_check_indices_false_skips_reading_the_indices() -> None:
    # The caller vouches for the indices (e.g. the engine that built them): no range check, no sync.
    case, slab = make_case()
    gather_pages(case.pages, slab, i64(1), i64(2), check_indices=False)
    expected = torch.cat([page[1].reshape(-1).view(torch.uint8) for page in case.pages])
    assert torch.equal(slab[2, : case.row_bytes], expected)
