"""Full round trips on CPU: manager + engine store blocks, the GPU pages are overwritten, loads bring them back.

Every layout, every backend (``triton`` runs the real kernel through the
Triton interpreter: conftest sets TRITON_INTERPRET=1), block size factors 1
and 3 with loads that start mid-slot, two KV groups, and a failed store whose
slots are reused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

import kvtriton.worker._backends as backends_module
from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec, LookupResult, ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.worker._engine import TransferEngine, TransferResult
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._slab import HostSlab

NUM_BLOCKS = 16
CTX = ReqContext(req_id="test")


def _random_bytes(shape: Sequence[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=generator)


def _cache(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# Small caches of every layout; odd page sizes included (mla: 4*13*2 = 104 B, pages: 656 B).
LAYOUTS: dict[str, Callable[[], list[torch.Tensor]]] = {
    "flash_attn": lambda: [_cache(torch.bfloat16, 2, NUM_BLOCKS, 4, 2, 8) for _ in range(2)],
    "flashinfer": lambda: [_cache(torch.float16, NUM_BLOCKS, 2, 4, 2, 8) for _ in range(2)],
    "mla": lambda: [_cache(torch.bfloat16, NUM_BLOCKS, 4, 13) for _ in range(3)],
    "cross_layer": lambda: [_cache(torch.bfloat16, NUM_BLOCKS, 3, 2, 4, 2, 8)],
    "pages": lambda: [_cache(torch.int8, NUM_BLOCKS, 656) for _ in range(2)],
}


@dataclass
class Harness:
    """A manager, a slab and an engine over one KV cache, with byte-level helpers."""

    kv: PagedKV
    slab: HostSlab
    manager: CPUOffloadingManager
    engine: TransferEngine
    next_job: int = 0

    def fill_pages(self, seed: int) -> None:
        for index, page in enumerate(self.kv.byte_pages()):
            page.copy_(_random_bytes(page.shape, seed * 100 + index))

    def block(self, block: int) -> bytes:
        return b"".join(page[block].numpy().tobytes() for page in self.kv.byte_pages())

    def job(self) -> int:
        self.next_job += 1
        return self.next_job

    def finish(self, job_id: int) -> TransferResult:
        self.engine.wait({job_id})
        results = {result.job_id: result for result in self.engine.get_finished()}
        return results[job_id]

    def store(self, keys: list[OffloadKey], gpu: GPULoadStoreSpec) -> TransferResult:
        output = self.manager.prepare_store(keys, CTX)
        assert output is not None and output.keys_to_store == keys
        assert isinstance(output.store_spec, CPULoadStoreSpec)
        job_id = self.job()
        assert self.engine.submit_store(job_id, gpu, output.store_spec)
        result = self.finish(job_id)
        self.manager.complete_store(keys, CTX, success=result.success)
        return result

    def load(self, keys: list[OffloadKey], gpu: GPULoadStoreSpec) -> TransferResult:
        assert all(self.manager.lookup(key, CTX) is LookupResult.HIT for key in keys)
        spec = self.manager.prepare_load(keys, CTX)
        job_id = self.job()
        assert self.engine.submit_load(job_id, spec, gpu)
        result = self.finish(job_id)
        self.manager.complete_load(keys, CTX)
        return result


@pytest.fixture
def harness_factory() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def build(layout: str = "flash_attn", backend: str = "torch", factor: int = 1, slots: int = 8) -> Harness:
        kv = PagedKV.from_tensors(LAYOUTS[layout](), layout=layout)
        slab = HostSlab(slots, factor, kv.row_bytes, pin=False)
        harness = Harness(kv, slab, CPUOffloadingManager(slots), TransferEngine(kv, slab, backend=backend))
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.engine.shutdown()
        harness.slab.close()


def keys(*hashes: int, group: int = 0) -> list[OffloadKey]:
    return [make_offload_key(value.to_bytes(8, "big"), group) for value in hashes]


@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("backend", ["torch", "dma", "triton"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stored_blocks_load_back_bit_exact_into_other_blocks(
    harness_factory: Callable[..., Harness], layout: str, backend: str, factor: int
) -> None:
    h = harness_factory(layout, backend, factor)
    h.fill_pages(seed=1)
    # One request of 3 offloaded blocks = 3*factor GPU blocks, scattered over the cache.
    request_blocks = [15, 2, 9, 4, 11, 0, 7, 13, 5][: 3 * factor]
    expected = [h.block(block) for block in request_blocks]
    request_keys = keys(10, 11, 12)
    stored = h.store(request_keys, GPULoadStoreSpec(request_blocks))
    assert stored.success and stored.transfer_size == 3 * factor * h.kv.row_bytes

    h.fill_pages(seed=2)  # the GPU cache is reused for something else
    # Load the request's blocks from logical index `start` on (mid-slot when factor > 1)
    # into different GPU blocks.
    start = 1 if factor == 1 else 4
    count = 3 * factor - start
    targets = [block for block in range(NUM_BLOCKS) if block not in request_blocks][:count]
    first_key = start // factor
    loaded = h.load(request_keys[first_key:], GPULoadStoreSpec(targets, group_sizes=[count], block_indices=[start]))
    assert loaded.success and loaded.transfer_type == ("CPU", "GPU")
    assert [h.block(block) for block in targets] == expected[start:]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_two_kv_groups_store_and_load_mid_slot(harness_factory: Callable[..., Harness], backend: str) -> None:
    h = harness_factory("flash_attn", backend, factor=2)
    h.fill_pages(seed=3)
    group0_blocks, group1_blocks = [0, 1, 2, 3], [8, 9]
    expected = {block: h.block(block) for block in group0_blocks + group1_blocks}
    both = keys(1, 2) + keys(1, group=1)
    gpu = GPULoadStoreSpec(group0_blocks + group1_blocks, group_sizes=[4, 2], block_indices=[0, 0])
    assert h.store(both, gpu).success

    h.fill_pages(seed=4)
    # Group 0 from logical block 1 (skip one row of its first slot), group 1 from block 1.
    load_keys = keys(1, 2) + keys(1, group=1)
    load_gpu = GPULoadStoreSpec([12, 13, 14, 15], group_sizes=[3, 1], block_indices=[1, 1])
    assert h.load(load_keys, load_gpu).success
    assert [h.block(block) for block in [12, 13, 14]] == [expected[1], expected[2], expected[3]]
    assert h.block(15) == expected[9]


def test_a_failed_store_frees_its_slots_and_the_next_store_leaves_no_stale_bytes(
    harness_factory: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness_factory("flash_attn", "torch", factor=1, slots=2)
    h.fill_pages(seed=5)
    real_gather = backends_module.gather_unchecked

    def gather_then_fail(*args: object, **kwargs: object) -> None:
        real_gather(*args, **kwargs)  # pyright: ignore[reportArgumentType] -- forwarded unchanged
        raise RuntimeError("simulated failure after the bytes were written")

    monkeypatch.setattr(backends_module, "gather_unchecked", gather_then_fail)
    failed_keys = keys(1, 2)
    failed = h.store(failed_keys, GPULoadStoreSpec([0, 1]))
    assert not failed.success
    assert [h.manager.lookup(key, CTX) for key in failed_keys] == [LookupResult.MISS, LookupResult.MISS]
    monkeypatch.setattr(backends_module, "gather_unchecked", real_gather)

    expected = [h.block(2), h.block(3)]
    new_keys = keys(3, 4)
    output = h.manager.prepare_store(new_keys, CTX)
    assert output is not None and output.evicted_keys == []  # the failed store's slots were free again
    assert isinstance(output.store_spec, CPULoadStoreSpec)
    assert sorted(output.store_spec.block_ids.tolist()) == [0, 1]
    h.manager.complete_store(new_keys, CTX, success=False)  # hand them back; store through the harness below
    assert h.store(new_keys, GPULoadStoreSpec([2, 3])).success

    h.fill_pages(seed=6)
    assert h.load(new_keys, GPULoadStoreSpec([10, 11])).success
    assert [h.block(10), h.block(11)] == expected


def test_evicted_slots_are_reused_and_surviving_blocks_still_load_correctly(
    harness_factory: Callable[..., Harness],
) -> None:
    h = harness_factory("mla", "torch", factor=1, slots=3)
    h.fill_pages(seed=7)
    snapshots = {block: h.block(block) for block in range(6)}
    assert h.store(keys(1, 2, 3), GPULoadStoreSpec([0, 1, 2])).success
    h.manager.touch(keys(3), CTX)  # key 3 most recent: keys 1 and 2 are evicted first
    output = h.manager.prepare_store(keys(4, 5), CTX)
    assert output is not None and sorted(output.evicted_keys) == keys(1, 2)
    h.manager.complete_store(keys(4, 5), CTX, success=False)
    assert h.store(keys(4, 5), GPULoadStoreSpec([3, 4])).success

    h.fill_pages(seed=8)
    assert h.load(keys(3, 4, 5), GPULoadStoreSpec([7, 8, 9])).success
    assert [h.block(7), h.block(8), h.block(9)] == [snapshots[2], snapshots[3], snapshots[4]]
