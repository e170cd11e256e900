"""Chunks through vLLM's fs tier behind kvtriton's tiered manager, moved by hand as vLLM's scheduler and a worker would.

vLLM's real TieringOffloadingManager and fs tier run on a tmp dir: a chunk is
stored (its bytes written into the slot vLLM chose, as a worker's copy would),
cascaded to the fs tier, forgotten by the primary, and looked up again step
after step until the promotions settle. The fail-closed tests
(test_tiering_integrity.py) and the encryption tests
(test_tiering_fs_encryption.py) share these steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvtriton._integrity import SEAL_BYTES
from kvtriton.integrations.vllm._sealed_tiering import SealedTieringManager
from tiering_fixtures.configs import drain, key

CHUNK = 4096  # 2048-byte blocks, one rank and the seal, padded to a page
PAYLOAD = CHUNK - SEAL_BYTES
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
FS_TIER: dict[str, object] = {"type": "fs", "n_read_threads": 1, "n_write_threads": 1}
"""The fs tier's entry in ``secondary_tiers``, but its ``root_dir``."""


def fs_of(manager: SealedTieringManager) -> FileSystemTierManager:
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, FileSystemTierManager)
    return tier


def chunk_file(manager: SealedTieringManager, index: int) -> Path:
    return Path(fs_of(manager).file_mapper.get_file_name(key(index)))


def flat(manager: SealedTieringManager) -> memoryview:
    return manager.primary_tier.get_kv_memoryview().cast("B")


def store(manager: SealedTieringManager, contents: Mapping[int, bytes], context: ReqContext) -> None:
    """Store ``key(i)`` for each ``i`` of ``contents`` holding its bytes (from its slot's start), cascade them to fs,
    and make the primary forget them, so that the next lookups go to the fs tier."""
    keys = [key(index) for index in contents]
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store(keys, context)
    assert output is not None and isinstance(output.store_spec, VLLMCPULoadStoreSpec)
    region = flat(manager)
    by_key = {key(index): data for index, data in contents.items()}
    for stored, slot in zip(output.keys_to_store, output.store_spec.chunk_ids.tolist()):
        data = by_key[stored]
        region[slot * CHUNK : slot * CHUNK + len(data)] = data
    with manager.lock:
        manager.complete_store(keys, context)
    drain(manager)
    manager.on_request_finished(context)
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()


def look_up(manager: SealedTieringManager, indices: tuple[int, ...], context: ReqContext) -> dict[int, bytes | None]:
    """Each key's promoted payload, or None for a miss, as vLLM's scheduler asks step after step."""
    manager.on_new_request(context)
    deadline = time.monotonic() + 15.0
    while True:
        with manager.lock:
            answers = {index: manager.lookup(key(index), context) for index in indices}
            manager.on_schedule_end(END_OF_STEP)
        if all(answer in (LookupResult.HIT, LookupResult.MISS) for answer in answers.values()):
            break
        assert time.monotonic() < deadline, f"lookups never settled: {answers}"
        time.sleep(0.005)
    found: dict[int, bytes | None] = {}
    region = flat(manager)
    for index, answer in answers.items():
        found[index] = None
        if answer is LookupResult.HIT:
            with manager.lock:
                spec = manager.prepare_load([key(index)], context)
                manager.complete_load([key(index)], context)
            assert isinstance(spec, VLLMCPULoadStoreSpec)
            (slot,) = spec.chunk_ids.tolist()
            found[index] = bytes(region[slot * CHUNK : slot * CHUNK + PAYLOAD])
    manager.on_request_finished(context)
    return found
