from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.worker._plan import TransferDirection, plan_transfer, slots_needed

STORE, LOAD = TransferDirection.STORE, TransferDirection.LOAD


def ids(array: NDArray[np.int64]) -> list[int]:
    return [int(value) for value in array]


def brute_force_rows(slots: list[int], group_sizes: list[int], block_indices: list[int], f: int) -> list[int]:
    """Walk every GPU block of every group and name the slab row it pairs with, one at a time."""
    rows: list[int] = []
    cursor = 0
    for size, index in zip(group_sizes, block_indices):
        if size == 0:
            continue
        position = index % f  # position inside the current slot
        for _ in range(size):
            rows.append(slots[cursor] * f + position)
            position += 1
            if position == f:
                position = 0
                cursor += 1
        if position != 0:
            cursor += 1  # the group ended part-way into a slot; the next group starts a fresh one
    return rows


def test_factor_one_pairs_blocks_and_slots_one_to_one() -> None:
    plan = plan_transfer(STORE, GPULoadStoreSpec([7, 2, 5]), CPULoadStoreSpec([0, 3, 1]), 1)
    assert ids(plan.gpu_blocks) == [7, 2, 5]
    assert ids(plan.slab_rows) == [0, 3, 1]
    assert plan.gpu_blocks.dtype == np.int64 and plan.slab_rows.dtype == np.int64
    assert plan.num_rows == 3


def test_each_slot_spans_factor_consecutive_rows() -> None:
    plan = plan_transfer(STORE, GPULoadStoreSpec(range(6)), CPULoadStoreSpec([4, 1]), 3)
    assert ids(plan.slab_rows) == [12, 13, 14, 3, 4, 5]


def test_a_load_starting_mid_slot_skips_the_first_rows_of_that_slot() -> None:
    # Blocks 4..7 of a request with f=3: block 4 sits at position 1 of the request's second slot.
    gpu = GPULoadStoreSpec([20, 21, 22, 23], group_sizes=[4], block_indices=[4])
    plan = plan_transfer(LOAD, gpu, CPULoadStoreSpec([9, 2]), 3)
    assert ids(plan.slab_rows) == [28, 29, 6, 7]
    assert ids(plan.gpu_blocks) == [20, 21, 22, 23]


def test_each_group_starts_its_own_slots() -> None:
    gpu = GPULoadStoreSpec([1, 2, 3, 10, 11], group_sizes=[3, 2], block_indices=[2, 0])
    # group 0: skip 2 of slot 5, then slot 6 (rows 18, 19); group 1: slot 0 rows 0, 1.
    plan = plan_transfer(LOAD, gpu, CPULoadStoreSpec([5, 6, 0]), 3)
    assert ids(plan.slab_rows) == [17, 18, 19, 0, 1]


def test_empty_groups_take_no_slots() -> None:
    gpu = GPULoadStoreSpec([4], group_sizes=[0, 1], block_indices=[5, 0])
    assert slots_needed(gpu, 2) == 1
    assert ids(plan_transfer(STORE, gpu, CPULoadStoreSpec([3]), 2).slab_rows) == [6]


def test_an_empty_job_plans_no_rows() -> None:
    plan = plan_transfer(STORE, GPULoadStoreSpec([]), CPULoadStoreSpec([]), 4)
    assert plan.num_rows == 0


def test_a_slot_count_mismatch_reports_both_numbers() -> None:
    with pytest.raises(ValueError, match="holds 1 slots but the GPU spec spans 2 .*block_size_factor=2"):
        plan_transfer(STORE, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0]), 2)


def test_out_of_range_ids_are_refused() -> None:
    with pytest.raises(
        ValueError, match=re.escape("GPU block_ids[0] = 8 is out of range: there are 8 GPU blocks (valid 0..7)")
    ):
        plan_transfer(STORE, GPULoadStoreSpec([8]), CPULoadStoreSpec([0]), 1, num_gpu_blocks=8, num_slots=4)
    with pytest.raises(ValueError, match=re.escape("CPU block_ids[0] = 4 is out of range: there are 4 slots")):
        plan_transfer(STORE, GPULoadStoreSpec([1]), CPULoadStoreSpec([4]), 1, num_gpu_blocks=8, num_slots=4)


@pytest.mark.parametrize("bounds", [{}, {"num_gpu_blocks": 8, "num_slots": 4}], ids=["unbounded", "bounded"])
def test_a_job_writing_one_destination_twice_is_refused(bounds: dict[str, int]) -> None:
    # Bounded, the destination's range and uniqueness are checked in one sort: the same refusals.
    with pytest.raises(ValueError, match="slab rows names destination 2 more than once"):
        plan_transfer(STORE, GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([2, 2]), 1, **bounds)
    with pytest.raises(ValueError, match="GPU block_ids names destination 3 more than once"):
        plan_transfer(LOAD, GPULoadStoreSpec([3, 3]), CPULoadStoreSpec([0, 1]), 1, **bounds)


def test_a_destination_out_of_range_is_refused_before_its_repeats() -> None:
    with pytest.raises(ValueError, match=re.escape("CPU block_ids[1] = 4 is out of range: there are 4 slots")):
        plan_transfer(STORE, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([2, 4, 2]), 1, num_gpu_blocks=8, num_slots=4)
    with pytest.raises(ValueError, match=re.escape("GPU block_ids[0] = -1 is out of range: there are 8 GPU blocks")):
        plan_transfer(LOAD, GPULoadStoreSpec([-1, 3, 3]), CPULoadStoreSpec([0, 1, 2]), 1, num_gpu_blocks=8, num_slots=4)


def test_reading_one_source_twice_is_allowed() -> None:
    plan = plan_transfer(LOAD, GPULoadStoreSpec([3, 4]), CPULoadStoreSpec([1, 1]), 1)
    assert ids(plan.slab_rows) == [1, 1]


def test_bad_factor_and_spec_types_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size_factor must be >= 1, got 0"):
        plan_transfer(STORE, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]), 0)
    with pytest.raises(TypeError, match="gpu must be a GPULoadStoreSpec, got CPULoadStoreSpec"):
        plan_transfer(STORE, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]), 1)  # pyright: ignore[reportArgumentType] -- the wrong type is the point


def test_direction_names_the_media_like_vllm() -> None:
    assert STORE.transfer_type == ("GPU", "CPU")
    assert LOAD.transfer_type == ("CPU", "GPU")


@st.composite
def job(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """A random job: factor, per-group sizes and start indices, unique GPU blocks and slots."""
    f = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(0, 7)) for _ in range(groups)]
    indices = [draw(st.integers(0, 12)) for _ in range(groups)]
    gpu = GPULoadStoreSpec(range(sum(sizes)), group_sizes=sizes, block_indices=indices)
    needed = slots_needed(gpu, f)
    slots = draw(st.lists(st.integers(0, 40), min_size=needed, max_size=needed, unique=True))
    blocks = draw(st.permutations(list(range(sum(sizes)))))
    return f, sizes, indices, list(blocks), slots


@given(job(), st.sampled_from([STORE, LOAD]))
def test_plan_matches_a_block_by_block_walk(
    case: tuple[int, list[int], list[int], list[int], list[int]], direction: TransferDirection
) -> None:
    f, sizes, indices, blocks, slots = case
    gpu = GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=indices)
    plan = plan_transfer(
        direction, gpu, CPULoadStoreSpec(slots), f, num_gpu_blocks=max(blocks, default=0) + 1, num_slots=41
    )
    assert ids(plan.gpu_blocks) == blocks
    assert ids(plan.slab_rows) == brute_force_rows(slots, sizes, indices, f)


@given(job(), st.integers(1, 3))
def test_any_other_slot_count_is_refused(
    case: tuple[int, list[int], list[int], list[int], list[int]], extra: int
) -> None:
    f, sizes, indices, blocks, slots = case
    gpu = GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=indices)
    wrong = slots + list(range(100, 100 + extra))
    with pytest.raises(ValueError, match=f"holds {len(wrong)} slots but the GPU spec spans {len(slots)}"):
        plan_transfer(LOAD, gpu, CPULoadStoreSpec(wrong), f)
