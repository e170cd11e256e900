"""gather_pages: GPU blocks of every page tensor -> slab rows, bit for bit as the torch reference.

The layout x dtype x padding matrix runs here for both directions, scatter_pages included."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from kvtriton.kernels import KernelPath, gather_pages, select_path
from tests.kernels.kernel_cases import (
    BLOCKS,
    DTYPES,
    LAYOUTS,
    ODD_BYTE_LAYOUTS,
    ROWS,
    block_bytes,
    build_pages,
    build_slab,
    devices,
    indices,
    over_slab_paddings,
    run_both,
    synchronize,
)


@pytest.mark.parametrize("device", devices())
@over_slab_paddings
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_gather_and_scatter_match_reference_bit_for_bit(
    direction: Literal["gather", "scatter"], layout: str, dtype: str, padding: int, device: str
) -> None:
    # int32 indices on every other layout, scatter on the layouts where gather takes int64.
    narrow = (list(LAYOUTS).index(layout) + (direction == "scatter")) % 2
    run_both(direction, layout, DTYPES[dtype], device, BLOCKS, ROWS, torch.int32 if narrow else torch.int64, padding)


@pytest.mark.parametrize("device", devices())
@over_slab_paddings
@pytest.mark.parametrize("layout", list(ODD_BYTE_LAYOUTS))
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_gather_and_scatter_handle_odd_page_sizes_byte_by_byte(
    direction: Literal["gather", "scatter"], layout: str, padding: int, device: str
) -> None:
    index_dtype = torch.int64 if direction == "gather" else torch.int32
    run_both(direction, layout, torch.uint8, device, BLOCKS, ROWS, index_dtype, padding)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_gather_accepts_int32_and_int64_indices(index_dtype: torch.dtype, device: str) -> None:
    run_both("gather", "flash_attn", torch.bfloat16, device, [5, 1], [0, 8], index_dtype)


@pytest.mark.parametrize("device", devices())
def test_gather_places_each_block_in_its_row_and_leaves_other_rows_alone(device: str) -> None:
    case = build_pages("flash_attn", torch.float16, device)
    slab = build_slab(case, 9, device)
    before = slab.clone()
    gather_pages(case.pages, slab, indices(BLOCKS, torch.int64, device), indices(ROWS, torch.int64, device))
    synchronize(device)
    for block, row in zip(BLOCKS, ROWS):
        expected = torch.cat([block_bytes(page, [block])[0] for page in case.pages])
        assert torch.equal(slab[row, : case.row_bytes].cpu(), expected)
        # Bytes past the pages in a row are not part of the row layout.
        assert torch.equal(slab[row, case.row_bytes :], before[row, case.row_bytes :])
    untouched = [r for r in range(9) if r not in ROWS]
    assert torch.equal(slab[untouched], before[untouched])


@pytest.mark.parametrize("device", devices())
def test_gather_reads_the_same_block_into_several_rows(device: str) -> None:
    run_both("gather", "cross_layer", torch.bfloat16, device, [3, 3, 3], [0, 4, 8], torch.int64)


@pytest.mark.parametrize("device", devices())
def test_gather_with_empty_indices_writes_nothing(device: str) -> None:
    case = build_pages("mla", torch.bfloat16, device)
    slab = build_slab(case, 4, device)
    before = slab.clone()
    gather_pages(case.pages, slab, indices([], torch.int64, device), indices([], torch.int64, device))
    assert torch.equal(slab, before)


@pytest.mark.parametrize("device", devices())
def test_gather_with_more_pairs_than_programs_covers_every_pair(device: str) -> None:
    # 6 pairs x 4 pages = 24 work units on a grid of 3 programs: each program loops.
    run_both(
        "gather", "flash_attn", torch.int8, device, [5, 4, 3, 2, 1, 0], [0, 2, 4, 6, 8, 1], torch.int64, num_programs=3
    )


@pytest.mark.parametrize("bytes_per_iter", [16, 64, 4096])
def test_gather_result_does_not_depend_on_bytes_per_iter(bytes_per_iter: int) -> None:
    run_both("gather", "odd_656", torch.bfloat16, "cpu", BLOCKS, ROWS, torch.int64, bytes_per_iter=bytes_per_iter)


def test_cpu_tensors_take_the_interpreter_under_triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_path(torch.device("cpu")) is KernelPath.INTERPRETER
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_path(torch.device("cpu")) is KernelPath.TORCH
    monkeypatch.delenv("TRITON_INTERPRET")
    assert select_path(torch.device("cpu")) is KernelPath.TORCH
    assert select_path(torch.device("cuda", 0)) is KernelPath.TRITON


@pytest.mark.requires_interpreter
def test_the_interpreter_path_runs_the_triton_kernel_not_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtriton.kernels._pages as pages_module

    def refuse(*args: object) -> None:
        raise AssertionError("the torch reference ran instead of the Triton kernel")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pages_module, "gather_unchecked", refuse)
    run_both("gather", "mla", torch.float16, "cpu", BLOCKS, ROWS, torch.int64)


def test_without_triton_interpret_cpu_tensors_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtriton.kernels._launch as launch_module

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton launcher ran on the torch path")

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch_module, "CopyLauncher", refuse)
    run_both("gather", "mla", torch.float16, "cpu", BLOCKS, ROWS, torch.int64)


@pytest.mark.requires_interpreter
def test_the_interpreter_probe_finds_no_problem_where_the_interpreter_works() -> None:
    from kvtriton.kernels._jit.interpreter_probe import interpreter_problem

    assert interpreter_problem() is None


def test_an_unusable_interpreter_is_reported_in_words_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvtriton.kernels._jit.interpreter_probe as probe

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(probe, "interpreter_problem", lambda: "the Triton 3.6.0 interpreter cannot run a loop")
    case = build_pages("mla", torch.float16, "cpu")
    slab = torch.zeros(16, sum(case.page_bytes), dtype=torch.uint8)
    with pytest.raises(
        RuntimeError, match="TRITON_INTERPRET is set but the Triton 3.6.0 interpreter cannot run a loop"
    ):
        gather_pages(case.pages, slab, indices(BLOCKS, torch.int64, "cpu"), indices(ROWS, torch.int64, "cpu"))
    assert not slab.any()
