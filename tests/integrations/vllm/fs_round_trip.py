"""Round trips through an fs secondary tier: one chunk by hand through a tiering manager, or a prompt through an
in-process engine.

The tests of what keeps two engines' chunks apart on one fs root (the layout tag, the compression) store a chunk
from each engine by hand and read each back from its own engine; the engine tests serve a prompt, forget it in
host memory and serve it again from fs. Import only after ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

from tiering_fixtures.configs import drain, key, wait_for_hit
from tiering_fixtures.tiered_vllm import TieredVLLM
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager


def _chunk_bytes(manager: TieringOffloadingManager, slot: int) -> memoryview:
    """The primary tier's bytes of chunk ``slot`` (vLLM's primary or kvtriton's)."""
    flat = manager.primary_tier.get_kv_memoryview().cast("B")
    size = len(flat) // manager.primary_tier._num_chunks  # pyright: ignore[reportPrivateUsage] -- vLLM's primary has no public count
    return flat[slot * size : (slot + 1) * size]


def store(manager: TieringOffloadingManager, index: int, fill: int) -> None:
    """Store chunk ``key(index)`` holding ``fill`` bytes, and wait until it is cascaded to fs."""
    context = ReqContext(req_id=f"store-{index}")
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store([key(index)], context)
    assert output is not None and isinstance(output.store_spec, CPULoadStoreSpec)
    (slot,) = output.store_spec.chunk_ids.tolist()
    chunk = _chunk_bytes(manager, slot)
    chunk[:] = bytes([fill]) * len(chunk)
    with manager.lock:
        manager.complete_store([key(index)], context)
    drain(manager)
    manager.on_request_finished(context)


def read_back(manager: TieringOffloadingManager, index: int) -> bytes:
    """Chunk ``key(index)``'s bytes as a load from fs brings them into the primary tier."""
    context = ReqContext(req_id=f"load-{index}")
    manager.on_new_request(context)
    wait_for_hit(manager, key(index), context)
    with manager.lock:
        spec = manager.prepare_load([key(index)], context)
    assert isinstance(spec, CPULoadStoreSpec)
    (slot,) = spec.chunk_ids.tolist()
    return bytes(_chunk_bytes(manager, slot))


def loaded_blocks(engine: TieredVLLM, request_id: str, count: int) -> list[int]:
    """Step ``engine`` until request ``request_id`` has finished; the GPU blocks its first ``count`` blocks were
    loaded into (read when its first load job is seen, before the engine can reuse them)."""
    loaded: list[int] = []

    def finished() -> bool:
        if engine.load_jobs and not loaded:
            loaded.extend(engine.gpu_blocks(request_id)[:count])
        return request_id not in engine.scheduler.requests

    engine.step_until(finished, f"the {request_id} request finished")
    return loaded
