from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pytest

from kvtriton._offload_types import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)

COLLECTIONS: list[Collection[int]] = [[3, 1, 2], (3, 1, 2), range(3, 0, -1), np.array([3, 1, 2], dtype=np.int32)]


@pytest.mark.parametrize("block_ids", COLLECTIONS, ids=["list", "tuple", "range", "numpy"])
def test_cpu_spec_accepts_any_collection_as_int64_array(block_ids: Collection[int]) -> None:
    spec = CPULoadStoreSpec(block_ids)
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == list(block_ids)
    assert spec.medium() == "CPU"


@pytest.mark.parametrize("block_ids", COLLECTIONS, ids=["list", "tuple", "range", "numpy"])
def test_gpu_spec_accepts_any_collection_as_int64_array(block_ids: Collection[int]) -> None:
    spec = GPULoadStoreSpec(block_ids, group_sizes=[3], block_indices=[0])
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == list(block_ids)
    assert spec.medium() == "GPU"


def test_spec_copies_its_input_so_later_mutation_does_not_leak() -> None:
    source = np.array([1, 2], dtype=np.int64)
    spec = CPULoadStoreSpec(source)
    source[0] = 99
    assert spec.block_ids.tolist() == [1, 2]


def test_empty_specs_hold_empty_int64_arrays() -> None:
    assert CPULoadStoreSpec([]).block_ids.dtype == np.int64
    gpu = GPULoadStoreSpec([], group_sizes=[0], block_indices=[0])
    assert gpu.block_ids.shape == (0,)


def test_gpu_spec_defaults_to_one_group_starting_at_zero() -> None:
    spec = GPULoadStoreSpec([4, 5])
    assert spec.group_sizes == (2,)
    assert spec.block_indices == (0,)


def test_gpu_spec_group_sizes_must_sum_to_block_count() -> None:
    with pytest.raises(ValueError, match=r"sum\(group_sizes\) = 3 .* len\(block_ids\) = 2"):
        GPULoadStoreSpec([1, 2], group_sizes=[1, 2], block_indices=[0, 0])


def test_gpu_spec_needs_one_block_index_per_group() -> None:
    with pytest.raises(ValueError, match=r"len\(block_indices\) = 1 .* len\(group_sizes\) = 2"):
        GPULoadStoreSpec([1, 2], group_sizes=[1, 1], block_indices=[0])


def test_non_integer_block_ids_are_rejected() -> None:
    with pytest.raises(TypeError, match="block_ids must hold integers"):
        CPULoadStoreSpec(np.array([1.5, 2.0]))


def test_value_types_compare_by_value() -> None:
    assert ReqContext("r1") == ReqContext("r1")
    assert OffloadingEvent([], "CPU", removed=False) == OffloadingEvent([], "CPU", removed=False)
    output = PrepareStoreOutput([], CPULoadStoreSpec([]), [])
    assert output.keys_to_store == [] and output.evicted_keys == []
    assert {result.name for result in LookupResult} == {"MISS", "HIT", "HIT_PENDING"}
