"""kvtriton as the primary tier of vLLM's tiered offloading, through vLLM's real request flow on CPU.

vLLM's Scheduler, OffloadingConnector, TieringOffloadingManager and ``fs``
secondary tier run unchanged; kvtriton's manager is the primary tier and
kvtriton's worker ranks move the bytes into one shared host region. A prompt
is stored and cascaded to the fs tier; the connector's cache is reset and the
GPU scrubbed; the same prompt must be promoted from the fs tier and loaded back
bit-exact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from fs_round_trip import loaded_blocks
from tiering_fixtures.tiered_vllm import (
    BLOCK_SIZE,
    LAYERS,
    TieredVLLM,
    fs_tier,
    kv_spec,
    start_tiered_vllm,
)
from vllm.config import ModelConfig
from vllm_fixtures.requests import make_request

from kvtriton._keys import OffloadKey
from kvtriton.integrations.vllm._tiered_spec import KVTritonTieringWorker
from kvtriton.worker._shared_region import SharedRegion


@pytest.fixture
def engines() -> Iterator[list[TieredVLLM]]:
    made: list[TieredVLLM] = []
    yield made
    for engine in made:
        engine.shutdown()


def budget(chunks: int, blocks_per_chunk: int, world_size: int) -> int:
    """cpu_bytes_to_use for ``chunks`` chunks (each padded to 4096 bytes)."""
    chunk = blocks_per_chunk * world_size * kv_spec(world_size).page_size_bytes * len(LAYERS)
    return chunks * -(-chunk // 4096) * 4096


def fs_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


PROMPT = list(range(100, 100 + 4 * BLOCK_SIZE + 5))  # 4 full blocks and a partial one


@pytest.mark.parametrize(
    ("blocks_per_chunk", "world_size"),
    [(1, 1), (2, 1), (1, 2), (2, 2)],
    ids=["1block", "2blocks", "2ranks", "2ranks-2blocks"],
)
def test_a_prompt_cascaded_to_fs_is_promoted_and_loaded_back_bit_exact(
    model_config: ModelConfig, engines: list[TieredVLLM], tmp_path: Path, blocks_per_chunk: int, world_size: int
) -> None:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": budget(8, blocks_per_chunk, world_size),
        "blocks_per_chunk": blocks_per_chunk,
        "secondary_tiers": [fs_tier(tmp_path)],
    }
    engine = start_tiered_vllm(model_config, extra, world_size=world_size)
    engines.append(engine)
    assert all(
        isinstance(worker.connector_worker.worker, KVTritonTieringWorker)
        for worker in engine.workers
        if worker.connector_worker
    )
    region = engine.primary.region
    assert isinstance(region, SharedRegion)
    assert not os.path.exists(region.path)  # scheduler + every rank mapped it: no name left in /dev/shm
    assert region.mapped_count == world_size + 1

    chunks = 4 // blocks_per_chunk
    engine.serve("first", PROMPT)
    assert engine.cpu.stats().stores == chunks
    assert len(fs_files(tmp_path)) == chunks  # every chunk cascaded to the fs tier

    # The connector forgets everything it holds in host memory; the GPU blocks are overwritten.
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.step()
    assert engine.cpu.stats().used == 0
    engine.scrub()

    engine.computed.clear()
    engine.scheduler.add_request(make_request("second", PROMPT))
    # The fs tier checks for files on its own thread: its first answer is RETRY, so the request waits.
    assert engine.step().num_scheduled_tokens.get("second", 0) == 0
    assert engine.cpu.stats().used == 0  # nothing promoted yet
    loaded = loaded_blocks(engine, "second", 4)
    assert engine.load_jobs, "the prompt was never loaded from the tiers"
    assert [index for request, index in engine.computed if request == "second"] == []  # nothing recomputed
    for rank in range(world_size):
        assert [engine.block_bytes(rank, block) for block in loaded] == [
            engine.expected_bytes(rank, index) for index in range(4)
        ], f"rank {rank}'s blocks differ after the promotion"
    stats = engine.cpu.stats()
    assert (stats.stores, stats.pending, stats.loading) == (2 * chunks, 0, 0)  # promoted into fresh slots, all done


def test_a_promotion_that_fails_halfway_keeps_the_chunks_that_arrived_and_recomputes_the_rest(
    model_config: ModelConfig, engines: list[TieredVLLM], tmp_path: Path
) -> None:
    engine = start_tiered_vllm(
        model_config, {"cpu_bytes_to_use": budget(8, 1, 1), "secondary_tiers": [fs_tier(tmp_path)]}
    )
    engines.append(engine)
    engine.serve("first", PROMPT)
    keys = [OffloadKey(key) for key in engine.cpu.slot_map()]
    assert len(keys) == 4
    # Chunk 2's file is cut short: the batched read stops there.
    paths = [Path(engine.fs.file_mapper.get_file_name(cast("Any", key))) for key in keys]
    assert all(path.exists() for path in paths)
    slot_of = engine.cpu.slot_map()
    by_block = sorted(keys, key=lambda key: slot_of[key])  # slots were handed out in prompt order
    broken = Path(engine.fs.file_mapper.get_file_name(cast("Any", by_block[2])))
    broken.write_bytes(broken.read_bytes()[:100])

    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.step()
    engine.scrub()
    engine.computed.clear()
    engine.scheduler.add_request(make_request("second", PROMPT))
    engine.step_until(lambda: "second" not in engine.scheduler.requests, "the second request finished")

    recomputed = [index for request, index in engine.computed if request == "second"]
    assert recomputed == [2, 3]  # blocks 0 and 1 came from the fs tier, the rest was computed again
    blocks = engine.gpu_blocks_seen["second"]
    assert [engine.block_bytes(0, block) for block in blocks[:4]] == [
        engine.expected_bytes(0, index) for index in range(4)
    ]
    # The recomputed chunks are stored (and cascaded) again; the failed promotion left no slot behind.
    engine.step_until(lambda: engine.cpu.stats().pending == 0 and not engine.tiering.has_pending_work(), "drained")
    stats = engine.cpu.stats()
    assert (stats.used, stats.loading) == (4, 0)
    assert broken.stat().st_size == 4096  # the damaged file was replaced by the new cascade


def test_a_connector_cache_reset_drains_the_tiers_cascades_first(
    model_config: ModelConfig, engines: list[TieredVLLM], tmp_path: Path
) -> None:
    engine = start_tiered_vllm(
        model_config, {"cpu_bytes_to_use": budget(8, 1, 1), "secondary_tiers": [fs_tier(tmp_path)]}
    )
    engines.append(engine)
    engine.scheduler.add_request(make_request("first", PROMPT))
    # Step only until the GPU -> host stores completed: their cascades to fs are then in flight or queued.
    engine.step_until(lambda: engine.cpu.stats().stores == 4 and engine.cpu.stats().pending == 0, "stores completed")
    assert engine.tiering.has_pending_work()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    # reset_cache waited for every tier job: every chunk is on disk, none is pinned or in flight.
    assert not engine.tiering.has_pending_work()
    assert len(fs_files(tmp_path)) == 4
    assert engine.cpu.stats().used == 0
