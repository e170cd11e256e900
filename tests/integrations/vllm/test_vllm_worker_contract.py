"""kvtriton's worker driven exactly as the installed vLLM's OffloadingConnector drives it, over every KV layout.

vLLM 0.34 resolves a job's block ids into device pointers before it calls
the worker (``resolve_device_pointers`` on the registered KV caches);
vLLM 0.33 passes the block ids. These tests build the canonical KV caches of
each layout kvtriton supports as vLLM's ``register_kv_caches`` does, make the
worker's calls through :mod:`vllm_fixtures.connector` (the installed
release's contract), and check every byte that moved and every byte that
must not have: they are the tests that catch a worker written against the
other release's contract. ``make test`` runs them on one vLLM and CI's second
environment on the other.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm_fixtures.builders import canonical_kv_caches, offloading_config
from vllm_fixtures.connector import device_side, submit_load, submit_store

from kvtriton.integrations.vllm import KVTritonOffloadingSpec
from kvtriton.integrations.vllm._surface import FAILED_TRANSFERS_ARE_REPORTED, WORKER_GETS_DEVICE_POINTERS
from kvtriton.integrations.vllm._worker import (
    PointerLayout,
    VLLMOffloadingWorker,
    _int64_view,  # pyright: ignore[reportPrivateUsage] -- the test checks that pointers are viewed, not copied
    block_ids_from_pointers,
)
from kvtriton.worker._slab import PageableSlabWarning

NUM_BLOCKS = 24
NUM_SLOTS = 12
MARKER = 0x5A
"""What every byte a load must not touch is set to before the load."""


@dataclass
class Layout:
    """One KV layout: the memory vLLM's attention backend allocates and the canonical views vLLM registers."""

    views: list[torch.Tensor]
    """The canonical int8 ``(num_blocks, page bytes)`` views, as vLLM's register_kv_caches cuts them."""
    group_refs: list[list[tuple[int, int]]]
    """Per KV cache group, its ``(view index, unpadded page bytes)`` references in vLLM's order (repeats kept)."""

    def canonical(self) -> CanonicalKVCaches:
        return canonical_kv_caches(self.views, group_refs=self.group_refs)


def _bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _layout(name: str) -> Layout:
    """The canonical views of each layout over freshly randomised memory (2 layers where layers apply)."""
    if name == "flash_attn":  # per layer (2, num_blocks, page): K and V are two tensors, each block-major
        layers = [_bytes((2, NUM_BLOCKS, 96), seed) for seed in (1, 2)]
        views = [layer[half] for layer in layers for half in (0, 1)]
        return Layout(views, [[(index, 96) for index in range(4)]])
    if name == "flashinfer":  # per layer (num_blocks, 2, page): one tensor per layer
        views = [_bytes((NUM_BLOCKS, 2, 48), seed).view(NUM_BLOCKS, 96) for seed in (3, 4)]
        return Layout(views, [[(0, 96), (1, 96)]])
    if name == "mla":  # one latent page per block and layer, an odd size
        views = [_bytes((NUM_BLOCKS, 7, 10), seed).view(NUM_BLOCKS, 70) for seed in (5, 6)]
        return Layout(views, [[(0, 70), (1, 70)]])
    if name == "cross_layer":  # every layer of a block in one page: one tensor, one reference
        return Layout([_bytes((NUM_BLOCKS, 2 * 2 * 48), 7)], [[(0, 192)]])
    if name == "hybrid":  # two groups over different tensors; tensor 2's pages padded to 160, 128 of them real
        views = [_bytes((NUM_BLOCKS, 64), 8), _bytes((NUM_BLOCKS, 84), 9), _bytes((NUM_BLOCKS, 160), 10)]
        return Layout(views, [[(0, 64), (2, 128)], [(1, 84)]])
    if name == "aliased":  # two layers of a group aliasing one tensor: referenced twice, moved once
        views = [_bytes((NUM_BLOCKS, 64), 11), _bytes((NUM_BLOCKS, 32), 12)]
        return Layout(views, [[(0, 64), (0, 64), (1, 32)]])
    raise AssertionError(name)


LAYOUTS = ["flash_attn", "flashinfer", "mla", "cross_layer", "hybrid", "aliased"]


def _worker(layout: Layout, blocks_per_chunk: int) -> VLLMOffloadingWorker:
    padded = sum(view.shape[1] for view in layout.views)
    spec = KVTritonOffloadingSpec(
        offloading_config(
            {"cpu_bytes_to_use": NUM_SLOTS * blocks_per_chunk * padded, "kvtriton_num_programs": 2},
            worker_kv_bytes_per_block=padded,
            blocks_per_chunk=blocks_per_chunk,
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableSlabWarning)  # no CUDA here: the slab cannot be pinned
        worker = spec.get_worker(layout.canonical())
    assert isinstance(worker, VLLMOffloadingWorker)
    return worker


def _job(blocks: list[list[int]]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec([b for group in blocks for b in group], [len(group) for group in blocks], [0] * len(blocks))


def _slots(blocks: list[list[int]], blocks_per_chunk: int) -> CPULoadStoreSpec:
    counts = [-(-len(group) // blocks_per_chunk) for group in blocks]
    return CPULoadStoreSpec(list(range(2, 2 + sum(counts))))  # every group's chunks on slots of their own


def _finished(worker: VLLMOffloadingWorker) -> dict[int, TransferResult]:
    return {result.job_id: result for result in worker.get_finished()}


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_store_then_a_load_made_as_the_connector_makes_them_round_trips_every_byte(
    name: str, blocks_per_chunk: int
) -> None:
    layout = _layout(name)
    canonical = layout.canonical()
    worker = _worker(layout, blocks_per_chunk)
    original = [view.clone() for view in layout.views]
    groups = len(layout.group_refs)
    stored = [[3, 5, 7, 9], [11, 4]][:groups]
    loaded = [[13, 14, 15, 16], [17, 18]][:groups]
    slots = _slots(stored, blocks_per_chunk)

    assert submit_store(worker, canonical, 0, _job(stored), slots)
    store = _finished(worker)[0]
    assert store.success
    for view in layout.views:
        view.fill_(MARKER)
    assert submit_load(worker, canonical, 1, slots, _job(loaded), expedited=True)
    load = _finished(worker)[1]
    assert load.success and load.transfer_size == store.transfer_size

    expected = [view.clone().fill_(MARKER) for view in layout.views]
    for refs, sources, destinations in zip(layout.group_refs, stored, loaded):
        for index, size in refs:
            for source, destination in zip(sources, destinations):
                expected[index][destination, :size] = original[index][source, :size]
    for index, (view, want) in enumerate(zip(layout.views, expected)):
        assert torch.equal(view, want), f"{name}: canonical tensor {index} differs from what the load should leave"
    worker.shutdown()


def test_a_store_chunk_holding_the_null_block_as_a_placeholder_keeps_the_chunks_later_blocks_in_place() -> None:
    """vLLM 0.34 stores a sliding-window chunk with block 0 (its zeroed null block) standing in for a dropped one."""
    layout = _layout("flashinfer")
    canonical = layout.canonical()
    worker = _worker(layout, blocks_per_chunk=2)
    original = [view.clone() for view in layout.views]
    assert submit_store(worker, canonical, 0, _job([[0, 6, 0, 8]]), CPULoadStoreSpec([1, 2]))
    assert _finished(worker)[0].success
    assert submit_load(worker, canonical, 1, CPULoadStoreSpec([1, 2]), _job([[20, 21, 22, 23]]))
    assert _finished(worker)[1].success
    for view, before in zip(layout.views, original):
        assert torch.equal(view[20:24], before[[0, 6, 0, 8]])
    worker.shutdown()


def test_a_job_that_cannot_run_is_reported_as_the_installed_vllm_expects() -> None:
    """vLLM 0.34 takes a failed job from get_finished (a store dropped, a load recomputed); vLLM 0.33 stops."""
    layout = _layout("mla")
    canonical = layout.canonical()
    worker = _worker(layout, blocks_per_chunk=1)
    beyond_the_slab = CPULoadStoreSpec([NUM_SLOTS + 3])
    accepted = submit_store(worker, canonical, 0, _job([[1]]), beyond_the_slab)
    assert accepted is FAILED_TRANSFERS_ARE_REPORTED
    reported = _finished(worker)
    if FAILED_TRANSFERS_ARE_REPORTED:
        assert not reported[0].success and reported[0].transfer_size == 0
    else:
        assert reported == {}
    # A refused job's id is free again once reported; the worker goes on serving.
    assert submit_store(worker, canonical, 0, _job([[1]]), CPULoadStoreSpec([0]))
    assert _finished(worker)[0].success
    worker.shutdown()


@pytest.mark.skipif(not WORKER_GETS_DEVICE_POINTERS, reason="vLLM 0.33 passes block ids, not device pointers")
def test_device_pointers_that_name_no_block_of_the_kv_cache_fail_the_job_instead_of_copying() -> None:
    layout = _layout("flash_attn")
    canonical = layout.canonical()
    worker = _worker(layout, blocks_per_chunk=1)
    pointers = device_side(_job([[2, 3]]), canonical)
    ptrs = np.asarray(getattr(pointers, "ptrs"))  # by name: vLLM 0.33's types have no DevicePointers
    ptrs[0] += 1  # one byte into block 2: no block's address
    store = worker.submit_store(0, pointers, CPULoadStoreSpec([0, 1]))
    assert store and not _finished(worker)[0].success
    worker.shutdown()


@dataclass
class Pointers:
    """vLLM 0.34's ``DevicePointers``, by its fields (vLLM 0.33 has no such class)."""

    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


TWO_GROUPS = PointerLayout([[(1000, 10), (5000, 20)], [(9000, 4)]])
"""Group 0: two references of different strides; group 1: one."""


def _pointers(ptrs: list[int]) -> Pointers:
    return Pointers(np.array(ptrs, dtype=np.uint64), np.zeros(len(ptrs), np.uint64), (2, 1), (2, 1), (0, 1))


def test_block_ids_are_read_back_from_every_reference_of_each_group_and_checked() -> None:
    """The decoding on its own: ids from the first reference, the other references' addresses checked."""
    spec = block_ids_from_pointers(_pointers([1030, 1070, 5060, 5140, 9008]), TWO_GROUPS)
    assert spec.block_ids.tolist() == [3, 7, 2] and list(spec.group_sizes) == [2, 1]
    assert list(spec.block_indices) == [0, 1]
    with pytest.raises(ValueError, match=r"group 0's data reference 1 name other blocks: block 1's address is 0x1428"):
        block_ids_from_pointers(_pointers([1030, 1070, 5060, 5160, 9008]), TWO_GROUPS)
    with pytest.raises(ValueError, match=r"device pointer 0 of group 0 \(address 0x407\) is not a block"):
        block_ids_from_pointers(_pointers([1031, 1070, 5060, 5140, 9008]), TWO_GROUPS)
    with pytest.raises(ValueError, match="not a block"):  # below the tensor: a negative block id
        block_ids_from_pointers(_pointers([990, 1070, 5060, 5140, 9008]), TWO_GROUPS)
    with pytest.raises(ValueError, match="group 1 .* is not a block"):
        block_ids_from_pointers(_pointers([1030, 1070, 5060, 5140, 9009]), TWO_GROUPS)
    with pytest.raises(ValueError, match="account for"):
        block_ids_from_pointers(_pointers([1030, 1070, 5060, 5140, 9008, 9012]), TWO_GROUPS)
    with pytest.raises(ValueError, match="account for"):
        block_ids_from_pointers(_pointers([1030, 1070, 5060, 5140]), TWO_GROUPS)


def test_an_address_above_2_to_the_63_names_no_block() -> None:
    """vLLM's pointers are uint64; read as int64 (a view, not a copy) such an address is negative."""
    layout = PointerLayout([[(1000, 10)]])
    pointers = Pointers(np.array([2**63 + 1000], dtype=np.uint64), np.zeros(1, np.uint64), (1,), (1,), (0,))
    with pytest.raises(ValueError, match="not a block"):
        block_ids_from_pointers(pointers, layout)


@pytest.mark.parametrize("uniform", [True, False], ids=["one stride", "per-reference strides"])
def test_a_wrong_pointer_in_any_reference_row_of_a_wide_group_is_caught(uniform: bool) -> None:
    """160 references of 256 blocks: the rows are compared in slices, and every slice's rows are checked."""
    refs, blocks = 160, 256
    bases = [(2**40 + ref * 2**30, 4096 if uniform else 4096 + 64 * ref) for ref in range(refs)]
    layout = PointerLayout([bases])
    ids = np.random.default_rng(0).permutation(1024)[:blocks]
    grid = np.array([[base + int(block) * stride for block in ids] for base, stride in bases], dtype=np.uint64)

    def decode(values: np.ndarray) -> np.ndarray:
        pointers = Pointers(values.reshape(-1), np.zeros(values.size, np.uint64), (blocks,), (refs,), (0,))
        return block_ids_from_pointers(pointers, layout).block_ids

    assert decode(grid).tolist() == ids.tolist()
    for ref, position in [(1, 0), (31, 255), (32, 7), (100, 100), (159, 255)]:
        wrong = grid.copy()
        wrong[ref, position] += bases[ref][1]  # the next block: a real block, but not the one row 0 names
        with pytest.raises(ValueError, match=f"data reference {ref} name other blocks: block {position}'s"):
            decode(wrong)


@pytest.mark.parametrize("ref", [1, 63, 64])
def test_a_reference_whose_every_pointer_is_shifted_by_whole_blocks_is_caught(ref: int) -> None:
    """Each reference's pointers consistent among themselves but one block off: only its base says so."""
    refs, blocks = 65, 16
    bases = [(2**40 + index * 2**30, 4096) for index in range(refs)]
    layout = PointerLayout([bases])
    grid = np.array([[base + block * stride for block in range(blocks)] for base, stride in bases], dtype=np.uint64)
    grid[ref] += np.uint64(4096)  # every block of this reference names the next block
    pointers = Pointers(grid.reshape(-1), np.zeros(grid.size, np.uint64), (blocks,), (refs,), (0,))
    with pytest.raises(ValueError, match=f"data reference {ref} name other blocks: block 0's address"):
        block_ids_from_pointers(pointers, layout)


def test_pointers_are_viewed_not_copied() -> None:
    """The hot path reads vLLM's uint64 array in place (no astype copy of every pointer)."""
    layout = PointerLayout([[(1000, 10), (5000, 10)]])
    pointers = Pointers(np.array([1030, 1070, 5030, 5070], dtype=np.uint64), np.zeros(4, np.uint64), (2,), (2,), (0,))
    assert np.shares_memory(_int64_view(pointers.ptrs), pointers.ptrs)
    assert block_ids_from_pointers(pointers, layout).block_ids.tolist() == [3, 7]


def test_a_block_stride_below_one_is_refused_when_the_layout_is_built() -> None:
    with pytest.raises(ValueError, match=r"pointer_bases\[0\]\[1\] has block stride 0"):
        PointerLayout([[(1000, 10), (2000, 0)]])
