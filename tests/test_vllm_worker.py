"""The worker adapter moves vLLM's canonical KV bytes to the host slab and back, bit for bit, on CPU."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm_fixtures.builders import canonical_kv_caches, offloading_config  # noqa: E402

from kvtriton.integrations.vllm import KVTritonOffloadingSpec, VLLMOffloadingWorker  # noqa: E402
from kvtriton.worker.slab import PageableSlabWarning  # noqa: E402

NUM_BLOCKS = 16
BLOCKS_PER_CHUNK = 2
NUM_SLOTS = 6
# Two layers with different page sizes: a fp16 flash-attn style page of 2 x 4
# tokens x 2 heads x 8 dims (256 bytes) and an odd 3 x 7 x 4-byte page (84 bytes).
LAYER_SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [((NUM_BLOCKS, 2, 4, 2, 8), torch.float16), ((NUM_BLOCKS, 3, 7), torch.float32)]
ROW_BYTES = 256 + 84


@dataclass
class Rig:
    """One worker over freshly randomised layers, plus a copy of their original bytes."""

    worker: OffloadingWorker
    layers: list[torch.Tensor]
    original: list[torch.Tensor]

    def block(self, layer: int, block: int) -> bytes:
        return self.layers[layer][block].numpy().tobytes()

    def original_block(self, layer: int, block: int) -> bytes:
        return self.original[layer][block].numpy().tobytes()

    def clear_gpu(self) -> None:
        for layer in self.layers:
            layer.zero_()


def make_rig(backend: str = "auto", num_groups: int = 1) -> Rig:
    generator = torch.Generator().manual_seed(0)
    layers = [
        torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32).to(torch.int16).view(dtype)
        if dtype == torch.float16
        else torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32).view(dtype)
        for shape, dtype in LAYER_SHAPES
    ]
    spec = KVTritonOffloadingSpec(
        offloading_config(
            {"cpu_bytes_to_use": NUM_SLOTS * BLOCKS_PER_CHUNK * ROW_BYTES, "kvtriton_backend": backend, "kvtriton_num_programs": 2},
            worker_kv_bytes_per_block=ROW_BYTES,
            blocks_per_chunk=BLOCKS_PER_CHUNK,
        )
    )
    assert spec.num_slots == NUM_SLOTS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableSlabWarning)  # no CUDA here: the slab cannot be pinned
        worker = spec.get_worker(canonical_kv_caches(layers, num_groups=num_groups))
    assert spec.get_worker(canonical_kv_caches(layers)) is worker  # one worker per spec
    return Rig(worker=worker, layers=layers, original=[layer.clone() for layer in layers])


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.worker.shutdown()


def gpu(block_ids: list[int], group_sizes: list[int] | None = None, block_indices: list[int] | None = None) -> GPULoadStoreSpec:
    sizes = [len(block_ids)] if group_sizes is None else group_sizes
    return GPULoadStoreSpec(block_ids, sizes, [0] * len(sizes) if block_indices is None else block_indices)


def finished(worker: OffloadingWorker) -> dict[int, TransferResult]:
    return {result.job_id: result for result in worker.get_finished()}


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
    assert not rig.worker.submit_store(0, gpu([0, 1]), CPULoadStoreSpec([NUM_SLOTS]))
    assert not rig.worker.submit_store(1, gpu([0, 1]), gpu([2, 3]))
    assert not rig.worker.submit_load(2, gpu([2, 3]), gpu([0, 1]))
    assert finished(rig.worker) == {}


def test_a_slot_beyond_this_ranks_slab_is_refused_with_the_likely_cause(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # The scheduler sizes the cache from rank 0's KV bytes per block; a
    # pipeline stage holding more layers than rank 0 fits fewer slots.
    with caplog.at_level(logging.ERROR, logger="kvtriton.integrations.vllm_worker"):
        assert not rig.worker.submit_load(3, CPULoadStoreSpec([1, NUM_SLOTS + 2]), gpu([0, 1, 2, 3]))
    assert f"slot {NUM_SLOTS + 2}" in caplog.text and f"holds {NUM_SLOTS} slots" in caplog.text
    assert "pipeline" in caplog.text
    assert finished(rig.worker) == {}


def test_after_shutdown_new_jobs_are_refused() -> None:
    rig = make_rig()
    assert isinstance(rig.worker, VLLMOffloadingWorker)
    rig.worker.shutdown()
    assert not rig.worker.submit_store(0, gpu([0, 1]), CPULoadStoreSpec([0]))


def test_kv_tensors_whose_view_contradicts_their_page_size_are_rejected() -> None:
    layers = [torch.zeros(NUM_BLOCKS, 64, dtype=torch.int8)]
    caches = canonical_kv_caches(layers)
    caches.tensors[0].page_size_bytes = 32
    spec = KVTritonOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 16}, worker_kv_bytes_per_block=64))
    with pytest.raises(ValueError, match=r"kv_caches.tensors\[0\] has shape \(16, 64\).*page_size_bytes=32"):
        spec.get_worker(caches)
