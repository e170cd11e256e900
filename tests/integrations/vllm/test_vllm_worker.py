"""The worker adapter moves vLLM's canonical KV bytes to the host slab and back, bit for bit, on CPU."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm_fixtures.builders import canonical_kv_caches, offloading_config
from vllm_fixtures.connector import submit_load, submit_store
from vllm_fixtures.vllm_cpu_worker import vllm_cpu_worker

from kvtriton.integrations.vllm import KVTritonOffloadingSpec, VLLMOffloadingWorker
from kvtriton.integrations.vllm._surface import FAILED_TRANSFERS_ARE_REPORTED
from kvtriton.integrations.vllm._worker import GroupPages
from kvtriton.kernels._compressed_format import compression_layout
from kvtriton.kernels._compression import KVCompression, dequantize_groups, quantize_groups
from kvtriton.worker._slab import PageableSlabWarning

NUM_BLOCKS = 16
BLOCKS_PER_CHUNK = 2
NUM_SLOTS = 6
# Two layers with different page sizes: a fp16 flash-attn style page of 2 x 4
# tokens x 2 heads x 8 dims (256 bytes) and an odd 3 x 7 x 4-byte page (84 bytes).
LAYER_SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((NUM_BLOCKS, 2, 4, 2, 8), torch.float16),
    ((NUM_BLOCKS, 3, 7), torch.float32),
]
ROW_BYTES = 256 + 84


@dataclass
class Rig:
    """One worker over freshly randomised layers, plus a copy of their original bytes."""

    worker: VLLMOffloadingWorker
    layers: list[torch.Tensor]
    original: list[torch.Tensor]

    def block(self, layer: int, block: int) -> bytes:
        return self.layers[layer][block].numpy().tobytes()

    def original_block(self, layer: int, block: int) -> bytes:
        return self.original[layer][block].numpy().tobytes()

    def clear_gpu(self) -> None:
        for layer in self.layers:
            layer.zero_()


def make_rig(backend: str = "auto", num_groups: int = 1, extra: dict[str, object] | None = None) -> Rig:
    generator = torch.Generator().manual_seed(0)
    layers = [
        torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32).to(torch.int16).view(dtype)
        if dtype == torch.float16
        else torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32).view(dtype)
        for shape, dtype in LAYER_SHAPES
    ]
    spec = KVTritonOffloadingSpec(
        offloading_config(
            {
                "cpu_bytes_to_use": NUM_SLOTS * BLOCKS_PER_CHUNK * ROW_BYTES,
                "kvtriton_backend": backend,
                "kvtriton_num_programs": 2,
                **(extra or {}),
            },
            worker_kv_bytes_per_block=ROW_BYTES,
            blocks_per_chunk=BLOCKS_PER_CHUNK,
        )
    )
    assert spec.num_slots == NUM_SLOTS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableSlabWarning)  # no CUDA here: the slab cannot be pinned
        worker = spec.get_worker(canonical_kv_caches(layers, num_groups=num_groups))
    assert spec.get_worker(canonical_kv_caches(layers)) is worker  # one worker per spec
    assert isinstance(worker, VLLMOffloadingWorker)
    return Rig(worker=worker, layers=layers, original=[layer.clone() for layer in layers])


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.worker.shutdown()


def gpu(
    block_ids: list[int], group_sizes: list[int] | None = None, block_indices: list[int] | None = None
) -> GPULoadStoreSpec:
    sizes = [len(block_ids)] if group_sizes is None else group_sizes
    return GPULoadStoreSpec(block_ids, sizes, [0] * len(sizes) if block_indices is None else block_indices)


def finished(worker: OffloadingWorker) -> dict[int, TransferResult]:
    return {result.job_id: result for result in worker.get_finished()}


def assert_refused(worker: OffloadingWorker, accepted: dict[int, bool]) -> None:
    """Each job (id: what its ``submit_*`` returned) was refused as the installed vLLM expects, and nothing ran.

    vLLM 0.34 takes failures from ``get_finished``: the job is accepted and
    reported failed with no bytes. vLLM 0.33 asserts success: the job is
    refused (False) and never reported.
    """
    reported = finished(worker)
    if FAILED_TRANSFERS_ARE_REPORTED:
        assert all(accepted.values()), accepted
        assert {job: (result.success, result.transfer_size) for job, result in reported.items()} == {
            job: (False, 0) for job in accepted
        }
    else:
        assert not any(accepted.values()), accepted
        assert reported == {}


@pytest.mark.parametrize("backend", ["auto", "torch", "dma", "triton"])
def test_a_store_then_a_load_round_trips_every_byte(backend: str) -> None:
    rig = make_rig(backend)
    # Blocks 3,5 -> slot 2 and 7,9 -> slot 4 (two GPU blocks per slot).
    assert rig.worker.submit_store(0, gpu([3, 5, 7, 9]), CPULoadStoreSpec([2, 4]))
    stores = finished(rig.worker)
    assert set(stores) == {0}
    assert stores[0].success and stores[0].transfer_size == 4 * ROW_BYTES
    assert stores[0].transfer_time is not None and stores[0].transfer_time >= 0

    rig.clear_gpu()
    assert rig.worker.submit_load(1, CPULoadStoreSpec([4, 2]), gpu([11, 12, 13, 14]))
    loads = finished(rig.worker)
    assert loads[1].success and loads[1].transfer_size == 4 * ROW_BYTES
    for layer in range(len(LAYER_SHAPES)):
        assert [rig.block(layer, b) for b in (11, 12, 13, 14)] == [rig.original_block(layer, b) for b in (7, 9, 3, 5)]
        untouched = [b for b in range(NUM_BLOCKS) if b not in (11, 12, 13, 14)]
        assert all(not any(rig.block(layer, b)) for b in untouched)
    rig.worker.shutdown()


def test_a_load_starting_mid_chunk_skips_the_chunks_leading_blocks(rig: Rig) -> None:
    # vLLM's block_indices: the request's first GPU block here is its block 1,
    # so the load starts at the second block of the first slot.
    assert rig.worker.submit_store(0, gpu([3, 5, 7, 9]), CPULoadStoreSpec([2, 4]))
    rig.clear_gpu()
    assert rig.worker.submit_load(1, CPULoadStoreSpec([2, 4]), gpu([10, 11, 12], block_indices=[1]))
    assert finished(rig.worker)[1].transfer_size == 3 * ROW_BYTES
    assert [rig.block(0, b) for b in (10, 11, 12)] == [rig.original_block(0, b) for b in (5, 7, 9)]
    assert [rig.block(1, b) for b in (10, 11, 12)] == [rig.original_block(1, b) for b in (5, 7, 9)]


def test_a_partial_last_chunk_is_stored_and_loaded() -> None:
    rig = make_rig()
    assert rig.worker.submit_store(0, gpu([1, 2, 3]), CPULoadStoreSpec([0, 5]))
    rig.clear_gpu()
    assert rig.worker.submit_load(1, CPULoadStoreSpec([0, 5]), gpu([4, 6, 8]))
    assert {job: result.success for job, result in finished(rig.worker).items()} == {0: True, 1: True}
    assert [rig.block(1, b) for b in (4, 6, 8)] == [rig.original_block(1, b) for b in (1, 2, 3)]
    rig.worker.shutdown()


def test_each_kv_group_starts_on_its_own_slot() -> None:
    rig = make_rig(num_groups=2)
    # Group 0: blocks 1,2 -> slot 0; group 1: block 3 -> slot 1 (a partial chunk).
    assert rig.worker.submit_store(0, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    rig.clear_gpu()
    assert rig.worker.submit_load(1, CPULoadStoreSpec([1, 0]), gpu([9, 10, 11], group_sizes=[1, 2]))
    assert all(result.success for result in finished(rig.worker).values())
    assert [rig.block(0, b) for b in (9, 10, 11)] == [rig.original_block(0, b) for b in (3, 1, 2)]
    rig.worker.shutdown()


def test_wait_and_get_finished_report_each_job_once(rig: Rig) -> None:
    assert rig.worker.submit_store(7, gpu([0, 1]), CPULoadStoreSpec([0]))
    assert rig.worker.submit_store(8, gpu([2, 3]), CPULoadStoreSpec([1]))
    rig.worker.wait({7, 8})
    assert sorted(finished(rig.worker)) == [7, 8]
    assert finished(rig.worker) == {}


def test_a_job_the_engine_cannot_run_is_refused_not_half_done(rig: Rig) -> None:
    # Slot 6 does not exist (6 slots); a GPU spec as destination is not a slot spec.
    accepted = {
        0: rig.worker.submit_store(0, gpu([0, 1]), CPULoadStoreSpec([NUM_SLOTS])),
        1: rig.worker.submit_store(1, gpu([0, 1]), gpu([2, 3])),
        2: rig.worker.submit_load(2, gpu([2, 3]), gpu([0, 1])),
    }
    assert_refused(rig.worker, accepted)


def test_a_slot_beyond_this_ranks_slab_is_refused_with_the_likely_cause(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    # The scheduler sizes the cache from rank 0's KV bytes per block; a
    # pipeline stage holding more layers than rank 0 fits fewer slots.
    with caplog.at_level(logging.ERROR, logger="kvtriton.integrations.vllm._worker"):
        accepted = rig.worker.submit_load(3, CPULoadStoreSpec([1, NUM_SLOTS + 2]), gpu([0, 1, 2, 3]))
    assert f"slot {NUM_SLOTS + 2}" in caplog.text and f"holds {NUM_SLOTS} slots" in caplog.text
    assert "pipeline" in caplog.text
    assert_refused(rig.worker, {3: accepted})


def flip_a_byte(rig: Rig, slot: int) -> None:
    """Change one byte of ``slot`` behind the worker's back, as a stray write or faulty memory would."""
    assert isinstance(rig.worker, VLLMOffloadingWorker)
    rows = rig.worker.engines[0].slab.slot(slot)
    rows[1, 0] = rows[1, 0] ^ 0xFF


def test_verify_host_loads_refuses_a_load_of_a_slot_changed_since_its_store(caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(extra={"kvtriton_verify_host_loads": True})
    assert rig.worker.submit_store(0, gpu([3, 5, 7, 9]), CPULoadStoreSpec([2, 4]))
    assert finished(rig.worker)[0].success
    rig.clear_gpu()
    assert rig.worker.submit_load(1, CPULoadStoreSpec([4, 2]), gpu([11, 12, 13, 14]))  # unchanged: loads
    assert finished(rig.worker)[1].success
    assert [rig.block(0, b) for b in (11, 12, 13, 14)] == [rig.original_block(0, b) for b in (7, 9, 3, 5)]

    flip_a_byte(rig, 4)
    with caplog.at_level(logging.ERROR, logger="kvtriton.integrations.vllm._worker"):
        changed = rig.worker.submit_load(2, CPULoadStoreSpec([2, 4, 4]), gpu([0, 1, 2, 3, 4, 5]))
        assert "load job 2 refused by kvtriton_verify_host_loads: host slab slot(s) [4] " in caplog.text
        never_stored = rig.worker.submit_load(3, CPULoadStoreSpec([5]), gpu([0, 1]))
        assert "load job 3 refused by kvtriton_verify_host_loads: host slab slot(s) [5] " in caplog.text
    assert_refused(rig.worker, {2: changed, 3: never_stored})  # 0.34 recomputes; 0.33 stops the engine

    # Stored again (from the original blocks), the slot holds what its store left, and loads.
    for layer, original in zip(rig.layers, rig.original, strict=True):
        layer.copy_(original)
    assert rig.worker.submit_store(4, gpu([7, 9]), CPULoadStoreSpec([4]))
    assert finished(rig.worker)[4].success
    rig.clear_gpu()
    assert rig.worker.submit_load(5, CPULoadStoreSpec([4]), gpu([0, 1]))
    assert finished(rig.worker)[5].success
    assert [rig.block(1, b) for b in (0, 1)] == [rig.original_block(1, b) for b in (7, 9)]

    # A slot beyond the slab has no digest to compare: refused with the likely cause, before any is computed.
    with caplog.at_level(logging.ERROR, logger="kvtriton.integrations.vllm._worker"):
        beyond = rig.worker.submit_load(6, CPULoadStoreSpec([NUM_SLOTS + 1]), gpu([0, 1]))
    assert f"slot {NUM_SLOTS + 1}" in caplog.text and f"holds {NUM_SLOTS} slots" in caplog.text
    assert_refused(rig.worker, {6: beyond})
    rig.worker.shutdown()


def test_by_default_the_worker_trusts_the_host_slab_and_loads_what_it_holds(rig: Rig) -> None:
    assert rig.worker.submit_store(0, gpu([7, 9]), CPULoadStoreSpec([4]))
    assert finished(rig.worker)[0].success
    flip_a_byte(rig, 4)
    assert rig.worker.submit_load(1, CPULoadStoreSpec([4]), gpu([0, 1]))
    assert finished(rig.worker)[1].success
    assert rig.block(0, 1) != rig.original_block(0, 9)  # the changed byte went to the GPU: hence the debug mode


def test_after_shutdown_new_jobs_are_refused() -> None:
    rig = make_rig()
    assert isinstance(rig.worker, VLLMOffloadingWorker)
    rig.worker.shutdown()
    assert_refused(rig.worker, {0: rig.worker.submit_store(0, gpu([0, 1]), CPULoadStoreSpec([0]))})


def test_kv_tensors_whose_view_contradicts_their_page_size_are_rejected() -> None:
    layers = [torch.zeros(NUM_BLOCKS, 64, dtype=torch.int8)]
    caches = canonical_kv_caches(layers)
    caches.tensors[0].page_size_bytes = 32
    spec = KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 16}, worker_kv_bytes_per_block=64))
    with pytest.raises(ValueError, match=r"kv_caches.tensors\[0\] has shape \(16, 64\).*page_size_bytes=32"):
        spec.get_worker(caches)


def test_an_empty_job_succeeds_at_once_with_zero_bytes(rig: Rig) -> None:
    # vLLM's connector asserts success on every result: an empty job must not fail.
    assert rig.worker.submit_store(20, gpu([]), CPULoadStoreSpec([]))
    assert rig.worker.submit_load(21, CPULoadStoreSpec([]), gpu([]), expedited=True)
    results = finished(rig.worker)
    assert {job: (result.success, result.transfer_size) for job, result in results.items()} == {
        20: (True, 0),
        21: (True, 0),
    }
    assert finished(rig.worker) == {}
    assert all(rig.block(layer, b) == rig.original_block(layer, b) for layer in range(2) for b in range(NUM_BLOCKS))


def test_an_empty_gpu_spec_with_slots_is_refused(rig: Rig) -> None:
    assert_refused(rig.worker, {22: rig.worker.submit_store(22, gpu([]), CPULoadStoreSpec([1]))})


# A hybrid model: tensor 0 (256-byte pages) and tensor 2 (160-byte pages, of
# which 128 are real, the rest padding) belong to group 0; tensor 1 (84-byte
# pages) to group 1. A group-0 block moves 256 + 128 bytes, a group-1 block 84.
HYBRID_SHAPES: list[tuple[int, ...]] = [(NUM_BLOCKS, 256), (NUM_BLOCKS, 84), (NUM_BLOCKS, 160)]
HYBRID_REFS: list[list[tuple[int, int]]] = [[(0, 256), (2, 128)], [(1, 84)]]
HYBRID_GROUP_BYTES = (256 + 128, 84)
HYBRID_PADDED_BYTES = 256 + 84 + 160
"""What vLLM reports as worker_kv_bytes_per_block: every tensor's whole (padded) page."""


def hybrid_layers(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8) for shape in HYBRID_SHAPES]


def spec_and_worker(
    layers: list[torch.Tensor],
    group_refs: list[list[tuple[int, int]]],
    extra: Mapping[str, object],
    bytes_per_block: int,
    blocks_per_chunk: int = 1,
) -> tuple[KVTritonOffloadingSpec, VLLMOffloadingWorker]:
    """kvtriton's spec for ``extra`` and the worker it builds over ``layers`` (a pageable slab's warning silenced)."""
    spec = KVTritonOffloadingSpec(
        offloading_config(extra, worker_kv_bytes_per_block=bytes_per_block, blocks_per_chunk=blocks_per_chunk)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableSlabWarning)
        worker = spec.get_worker(canonical_kv_caches(layers, group_refs=group_refs))
    assert isinstance(worker, VLLMOffloadingWorker)
    return spec, worker


def hybrid_worker(layers: list[torch.Tensor], blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> VLLMOffloadingWorker:
    budget = {"cpu_bytes_to_use": NUM_SLOTS * blocks_per_chunk * HYBRID_PADDED_BYTES}
    return spec_and_worker(layers, HYBRID_REFS, budget, HYBRID_PADDED_BYTES, blocks_per_chunk)[1]


def test_a_hybrid_models_group_moves_only_its_own_tensors_at_their_unpadded_size() -> None:
    layers = hybrid_layers()
    original = [layer.clone() for layer in layers]
    worker = hybrid_worker(layers)
    assert len(worker.engines) == 2
    assert [engine.kv.row_bytes for engine in worker.engines] == list(HYBRID_GROUP_BYTES)
    assert worker.engines[0].slab.row_bytes == max(HYBRID_GROUP_BYTES)  # a row holds one block of the largest group
    # Group 0: blocks 1, 2 -> slot 0; group 1: block 3 -> slot 1.
    assert worker.submit_store(0, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    assert finished(worker)[0].transfer_size == 2 * HYBRID_GROUP_BYTES[0] + HYBRID_GROUP_BYTES[1]

    for layer in layers:
        layer.fill_(0x5A)  # a marker that every byte the load must not touch keeps
    assert worker.submit_load(1, CPULoadStoreSpec([0, 1]), gpu([9, 10, 11], group_sizes=[2, 1]))
    result = finished(worker)[1]
    assert result.success and result.transfer_size == 2 * HYBRID_GROUP_BYTES[0] + HYBRID_GROUP_BYTES[1]

    marker = bytes([0x5A])
    expected = [layer.clone().fill_(0x5A) for layer in layers]
    for destination, source in ((9, 1), (10, 2)):  # group 0: all of tensor 0, the real bytes of tensor 2
        expected[0][destination] = original[0][source]
        expected[2][destination, :128] = original[2][source, :128]
    expected[1][11] = original[1][3]  # group 1: tensor 1
    for index, (layer, want) in enumerate(zip(layers, expected)):
        assert torch.equal(layer, want), f"tensor {index}"
    assert layers[2][9, 128:].numpy().tobytes() == marker * 32  # the padding stayed on the GPU
    worker.shutdown()


# (store slots, load slots) for a store of group 0's blocks 0..2 and group 1's
# blocks 0..1 of a request, then a load of group 0's blocks 1..2 and group 1's
# block 1 (entering the first chunk part-way when a chunk holds 2 blocks).
REFERENCE_JOBS: dict[int, tuple[list[int], list[int]]] = {1: ([0, 1, 2, 3, 4], [1, 2, 4]), 2: ([0, 1, 2], [0, 1, 2])}


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_every_job_moves_the_bytes_vllms_own_cpu_worker_moves(blocks_per_chunk: int) -> None:
    ours = hybrid_layers()
    theirs = [layer.clone() for layer in ours]
    worker = hybrid_worker(ours, blocks_per_chunk)
    store_slots, load_slots = REFERENCE_JOBS[blocks_per_chunk]
    reference_caches = canonical_kv_caches(theirs, group_refs=HYBRID_REFS)
    with vllm_cpu_worker(reference_caches, blocks_per_chunk, NUM_SLOTS) as reference:
        store = gpu([1, 2, 3, 4, 5], group_sizes=[3, 2])
        assert worker.submit_store(0, store, CPULoadStoreSpec(store_slots))
        assert submit_store(reference, reference_caches, 0, store, CPULoadStoreSpec(store_slots))
        sizes = (finished(worker)[0].transfer_size, finished(reference)[0].transfer_size)
        assert sizes[0] == sizes[1] == 3 * HYBRID_GROUP_BYTES[0] + 2 * HYBRID_GROUP_BYTES[1]

        for layer in ours + theirs:
            layer.fill_(0x5A)
        for job, expedited in ((1, False), (2, True)):
            load = gpu([8 + job, 10 + job, 13 + job], group_sizes=[2, 1], block_indices=[1, 1])
            assert worker.submit_load(job, CPULoadStoreSpec(load_slots), load, expedited=expedited)
            assert submit_load(
                reference, reference_caches, job, CPULoadStoreSpec(load_slots), load, expedited=expedited
            )
        ours_sizes = {job: result.transfer_size for job, result in finished(worker).items()}
        theirs_sizes = {job: result.transfer_size for job, result in finished(reference).items()}
        assert ours_sizes == theirs_sizes == {job: 2 * HYBRID_GROUP_BYTES[0] + HYBRID_GROUP_BYTES[1] for job in (1, 2)}
    for index, (mine, vllms) in enumerate(zip(ours, theirs)):
        assert torch.equal(mine, vllms), f"tensor {index} differs from what vLLM's CPU worker loaded"
    worker.shutdown()


def test_an_empty_job_of_a_hybrid_model_succeeds_without_reaching_an_engine() -> None:
    worker = hybrid_worker(hybrid_layers())
    assert worker.submit_load(30, CPULoadStoreSpec([]), gpu([], group_sizes=[0, 0]), expedited=True)
    assert worker.submit_store(31, gpu([], group_sizes=[0, 0]), CPULoadStoreSpec([]))
    assert {job: (result.success, result.transfer_size) for job, result in finished(worker).items()} == {
        30: (True, 0),
        31: (True, 0),
    }
    assert all(engine.get_finished() == [] for engine in worker.engines)
    worker.shutdown()


def test_a_hybrid_job_that_does_not_fit_is_refused_before_any_part_runs() -> None:
    layers = hybrid_layers()
    before = [layer.clone() for layer in layers]
    worker = hybrid_worker(layers)
    # Two groups storing into one slot (each engine alone would see no repeat), a slot count that does not
    # match, a GPU block out of range, a group count that does not match, a load writing a block twice.
    accepted = {
        41: worker.submit_store(41, gpu([1, 2, 3, 4], group_sizes=[2, 2]), CPULoadStoreSpec([0, 0])),
        42: worker.submit_store(42, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1, 2])),
        43: worker.submit_load(43, CPULoadStoreSpec([0, 1]), gpu([1, NUM_BLOCKS], group_sizes=[1, 1])),
        44: worker.submit_load(44, CPULoadStoreSpec([0]), gpu([1])),
        45: worker.submit_load(45, CPULoadStoreSpec([0, 1]), gpu([5, 5], group_sizes=[1, 1])),
    }
    assert_refused(worker, accepted)
    assert all(torch.equal(layer, original) for layer, original in zip(layers, before))
    # The worker goes on: the next job runs normally.
    assert worker.submit_store(46, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([2, 3]))
    assert finished(worker)[46].success
    worker.shutdown()


def test_a_hybrid_job_an_engine_refuses_after_another_took_its_part_is_reported_once_its_parts_drain() -> None:
    worker = hybrid_worker(hybrid_layers())
    with mock.patch.object(worker.engines[1], "submit_store", return_value=False):
        accepted = worker.submit_store(50, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    worker.wait({50})
    # Group 0's part ran; the job is reported failed (0.34) or never (0.33, whose engine stops at the refusal).
    assert_refused(worker, {50: accepted})
    assert worker.submit_store(51, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    assert finished(worker)[51].transfer_size == 2 * HYBRID_GROUP_BYTES[0] + HYBRID_GROUP_BYTES[1]
    worker.shutdown()


@pytest.mark.parametrize("expedited", [False, True])
def test_every_part_of_an_expedited_load_takes_its_engines_expedited_lane(expedited: bool) -> None:
    worker = hybrid_worker(hybrid_layers())
    assert worker.submit_store(60, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    with (
        mock.patch.object(worker.engines[0], "submit_load", wraps=worker.engines[0].submit_load) as first,
        mock.patch.object(worker.engines[1], "submit_load", wraps=worker.engines[1].submit_load) as second,
    ):
        assert worker.submit_load(61, CPULoadStoreSpec([0, 1]), gpu([4, 5, 6], group_sizes=[2, 1]), expedited=expedited)
    assert [call.kwargs["expedited"] for call in (*first.call_args_list, *second.call_args_list)] == [
        expedited,
        expedited,
    ]
    assert finished(worker)[61].success
    worker.shutdown()


def test_group_pages_cut_each_referenced_tensor_to_its_unpadded_size_and_share_equal_sets() -> None:
    layers = [torch.zeros(NUM_BLOCKS, 96, dtype=torch.int8), torch.zeros(NUM_BLOCKS, 40, dtype=torch.int8)]
    # Groups 0 and 2 reference the same pages; group 1 cuts tensor 0 shorter; group 3 references nothing.
    refs: list[list[tuple[int, int]]] = [[(0, 96), (1, 40)], [(0, 64)], [(0, 96), (1, 40)], []]
    pages = GroupPages.from_canonical(canonical_kv_caches(layers, group_refs=refs))
    assert pages.kv_of_group == (0, 1, 0, None)
    assert pages.group_row_bytes == (136, 64, 136, 0)
    assert [kv.page_bytes for kv in pages.kvs] == [[96, 40], [64]]
    assert pages.row_bytes == 136


NO_REFS: list[tuple[int, int]] = []
BAD_REFS: list[tuple[list[list[tuple[int, int]]], str]] = [
    ([[(2, 8)]], r"kv_caches.group_data_refs\[0\] references tensor 2, but there are 2 tensors"),
    (
        [[(0, 8)], [(1, 48)]],
        r"group_data_refs\[1\] uses 48 bytes of each page of kv_caches.tensors\[1\], whose pages hold 40",
    ),
    ([[(0, 0)]], r"uses 0 bytes"),
    ([NO_REFS], r"no group in kv_caches.group_data_refs references a tensor"),
    ([], r"kv_caches.group_data_refs is empty"),
]


@pytest.mark.parametrize(("refs", "message"), BAD_REFS)
def test_group_references_that_do_not_fit_the_tensors_are_refused_naming_the_group(
    refs: list[list[tuple[int, int]]], message: str
) -> None:
    layers = [torch.zeros(NUM_BLOCKS, 96, dtype=torch.int8), torch.zeros(NUM_BLOCKS, 40, dtype=torch.int8)]
    with pytest.raises(ValueError, match=message):
        GroupPages.from_canonical(canonical_kv_caches(layers, group_refs=refs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "dma"])
def test_on_cuda_a_hybrid_model_round_trips_through_a_pinned_slab_with_expedited_loads(backend: str) -> None:
    layers = [layer.cuda() for layer in hybrid_layers()]
    original = [layer.clone() for layer in layers]
    spec = KVTritonOffloadingSpec(
        offloading_config(
            {"cpu_bytes_to_use": NUM_SLOTS * BLOCKS_PER_CHUNK * HYBRID_PADDED_BYTES, "kvtriton_backend": backend},
            worker_kv_bytes_per_block=HYBRID_PADDED_BYTES,
            blocks_per_chunk=BLOCKS_PER_CHUNK,
        )
    )
    worker = spec.get_worker(canonical_kv_caches(layers, group_refs=HYBRID_REFS))
    assert isinstance(worker, VLLMOffloadingWorker)
    assert all(
        engine.slab.pinned and {kind.value for kind in engine.backends.values()} == {backend}
        for engine in worker.engines
    )
    assert worker.submit_store(0, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    worker.wait({0})
    assert finished(worker)[0].success
    for layer in layers:
        layer.fill_(0x5A)
    assert worker.submit_load(1, CPULoadStoreSpec([0]), gpu([9, 10], group_sizes=[2, 0]))
    assert worker.submit_load(2, CPULoadStoreSpec([1]), gpu([11], group_sizes=[0, 1]), expedited=True)
    worker.wait({1, 2})
    results = finished(worker)
    assert {job: result.transfer_size for job, result in results.items()} == {
        1: 2 * HYBRID_GROUP_BYTES[0],
        2: HYBRID_GROUP_BYTES[1],
    }
    assert torch.equal(layers[0][9:11], original[0][1:3])
    assert torch.equal(layers[2][9:11, :128], original[2][1:3, :128])
    assert bool((layers[2][9:11, 128:] == 0x5A).all())  # padding stays on the GPU
    assert torch.equal(layers[1][11], original[1][3])
    assert bool((layers[1][9:11] == 0x5A).all()) and bool((layers[0][11] == 0x5A).all())
    worker.shutdown()


def test_a_worker_needs_an_engine_for_every_group_it_names() -> None:
    worker = hybrid_worker(hybrid_layers())
    with pytest.raises(ValueError, match=r"engine_of_group\[1\] is 2, but there are 2 engines"):
        VLLMOffloadingWorker(worker.engines, worker.engines[0].slab, [0, 2])
    with pytest.raises(ValueError, match="engines must hold at least one TransferEngine"):
        VLLMOffloadingWorker([], worker.engines[0].slab)
    worker.shutdown()


# Compression: the same hybrid model with fp16 KV (vLLM still hands the worker
# byte views). Group 0 references all of tensor 0 (128 elements a page) and the
# first 64 of tensor 2's 80; group 1 all of tensor 1 (42 elements).
COMPRESSED_ELEMENTS = (128, 42, 80)
COMPRESSED_REFS: list[list[tuple[int, int]]] = [[(0, 256), (2, 128)], [(1, 84)]]
COMPRESSED_PADDED_BYTES = 2 * sum(COMPRESSED_ELEMENTS)


def compressed_layers(seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn((NUM_BLOCKS, size), generator=generator) * 4).to(torch.float16) for size in COMPRESSED_ELEMENTS
    ]


def compressed_rows(layers: list[torch.Tensor]) -> tuple[int, int]:
    """The compressed row of each group's unpadded pages, from the kernels' own layout."""
    group0 = compression_layout([layers[0], layers[2][:, :64]], 128).row_bytes
    group1 = compression_layout([layers[1]], 128).row_bytes
    return group0, group1


def fp8_round_trip(pages: torch.Tensor) -> torch.Tensor:
    """What a compressed store and load gives back: the torch reference's quantize, then dequantize."""
    group = min(128, pages.shape[1])
    codes, scales, bad = quantize_groups(pages, group)
    assert not bool(bad.any())
    return dequantize_groups(codes, scales, group, pages.dtype)


def test_with_compression_each_group_compresses_its_unpadded_pages_and_reports_the_compressed_bytes() -> None:
    layers = compressed_layers()
    original = [layer.clone() for layer in layers]
    rows = compressed_rows(layers)
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 1 << 20,
        "kvtriton_kv_compression": "fp8-e4m3",
        "kvtriton_backend": "torch",
    }
    spec, worker = spec_and_worker(layers, COMPRESSED_REFS, extra, COMPRESSED_PADDED_BYTES, BLOCKS_PER_CHUNK)
    assert [engine.kv.compression for engine in worker.engines] == [KVCompression.FP8_E4M3] * 2
    assert [engine.kv.row_bytes for engine in worker.engines] == list(rows)
    assert [engine.kv.raw_row_bytes for engine in worker.engines] == [2 * (128 + 64), 2 * 42]
    assert worker.engines[0].slab.row_bytes == max(rows) <= spec.row_bytes  # the scheduler's bound holds
    # Group 0: blocks 1, 2 -> slot 0; group 1: block 3 -> slot 1.
    assert worker.submit_store(0, gpu([1, 2, 3], group_sizes=[2, 1]), CPULoadStoreSpec([0, 1]))
    assert finished(worker)[0].transfer_size == 2 * rows[0] + rows[1]  # the bytes moved, compressed
    for layer in layers:
        layer.fill_(7.0)
    assert worker.submit_load(1, CPULoadStoreSpec([0, 1]), gpu([9, 10, 11], group_sizes=[2, 1]))
    result = finished(worker)[1]
    assert result.success and result.transfer_size == 2 * rows[0] + rows[1]
    for destination, source in ((9, 1), (10, 2)):
        assert torch.equal(layers[0][destination], fp8_round_trip(original[0][source : source + 1])[0])
        assert torch.equal(layers[2][destination, :64], fp8_round_trip(original[2][source : source + 1, :64])[0])
        assert torch.equal(
            layers[2][destination, 64:], torch.full((16,), 7.0, dtype=torch.float16)
        )  # padding untouched
    assert torch.equal(layers[1][11], fp8_round_trip(original[1][3:4])[0])
    assert not torch.equal(layers[0][9], original[0][1])  # lossy: these values do not survive exactly
    worker.shutdown()


def test_without_compression_the_same_pages_round_trip_bit_exact_in_raw_rows() -> None:
    layers = compressed_layers()
    original = [layer.clone() for layer in layers]
    _, worker = spec_and_worker(layers, COMPRESSED_REFS, {"cpu_bytes_to_use": 1 << 20}, COMPRESSED_PADDED_BYTES)
    assert [engine.kv.row_bytes for engine in worker.engines] == [2 * (128 + 64), 2 * 42]
    assert worker.submit_store(0, gpu([1, 3], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1]))
    assert finished(worker)[0].transfer_size == 2 * (128 + 64) + 2 * 42
    for layer in layers:
        layer.zero_()
    assert worker.submit_load(1, CPULoadStoreSpec([0, 1]), gpu([5, 6], group_sizes=[1, 1]))
    assert finished(worker)[1].success
    assert torch.equal(layers[0][5], original[0][1]) and torch.equal(layers[2][5, :64], original[2][1, :64])
    assert torch.equal(layers[1][6], original[1][3])
    worker.shutdown()


def test_compression_refuses_byte_pages_that_are_not_whole_elements() -> None:
    odd = torch.zeros((NUM_BLOCKS, 5), dtype=torch.int8)  # 5 bytes a page cannot hold fp16 elements
    with pytest.raises(ValueError, match=r"kv_caches.tensors\[0\].*cannot be read as torch.float16 pages"):
        GroupPages.from_canonical(
            canonical_kv_caches([odd]), kv_compression=KVCompression.FP8_E4M3, dtype=torch.float16
        )
