"""vLLM ``OffloadingConfig`` objects for the tiered spec, and helpers to drive a tiering manager by hand."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Mapping

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from bench.common import offloading_config
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._tiered_spec import KVTritonPrimaryTier

_STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

TIERING_EXTRA: dict[str, object] = {
    "spec_name": "KVTritonTieringOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}


@pytest.fixture
def managers() -> Iterator[list[OffloadingManager]]:
    """The managers a test builds (it appends them); each is shut down after the test."""
    made: list[OffloadingManager] = []
    yield made
    for manager in made:
        manager.shutdown()


def own_engine_id(purpose: str) -> str:
    """A fresh engine id that names this process: ``kvtriton-tests-<pid>-<purpose>-<random>``."""
    return f"{OWN_ENGINE_PREFIX}{purpose}-{uuid.uuid4().hex[:12]}"


OWN_ENGINE_PREFIX = f"kvtriton-tests-{os.getpid()}-"
"""What every engine id this process's tests make begins with (its regions' file names contain it)."""


def tiering_config(
    extra_config: Mapping[str, object],
    *,
    worker_kv_bytes_per_block: int = 2048,
    blocks_per_chunk: int = 1,
    world_size: int = 1,
    rank: int = 0,
    engine_id: str | None = None,
    model_name: str = "tiny-tiering",
    enable_events: bool = False,
) -> OffloadingConfig:
    """The OffloadingConfig vLLM's connector builds for one full-attention group, with a fresh engine id.

    The id names this process (:func:`own_engine_id`), so a test can tell its regions from those of tests
    running beside it in other processes.
    """
    return offloading_config(
        {**TIERING_EXTRA, **extra_config},
        enable_events=enable_events,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        engine_id=engine_id or own_engine_id("tiering"),
        model_name=model_name,
        blocks_per_chunk=blocks_per_chunk,
        world_size=world_size,
        rank=rank,
        max_model_len=1024,
    )


def key(index: int) -> OffloadKey:
    return make_offload_key(index.to_bytes(32, "big"), 0)


def settle_lookup(
    manager: OffloadingManager, offload_key: OffloadKey, context: ReqContext, timeout_s: float = 10.0
) -> LookupResult:
    """Look ``offload_key`` up until the answer is not RETRY, ending each round as a scheduler step does."""
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            result = manager.lookup(offload_key, context)
            manager.on_schedule_end(_STEP_END)
        if result is not LookupResult.RETRY:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"lookup still answers RETRY after {timeout_s} s")
        time.sleep(0.005)


def drain(manager: OffloadingManager, timeout_s: float = 15.0) -> None:
    """End scheduler steps until no tier job is in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            manager.on_schedule_end(_STEP_END)
            if not manager.has_pending_work():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"tier jobs still in flight after {timeout_s} s")
        time.sleep(0.005)


def wait_for_hit(
    manager: OffloadingManager, offload_key: OffloadKey, context: ReqContext, timeout_s: float = 10.0
) -> None:
    """Step until ``offload_key`` is readable in the primary tier (a promotion has landed)."""
    deadline = time.monotonic() + timeout_s
    while (result := settle_lookup(manager, offload_key, context, timeout_s)) is not LookupResult.HIT:
        if time.monotonic() > deadline:
            raise AssertionError(f"lookup still answers {result.name} after {timeout_s} s")
        time.sleep(0.005)


def tiering(managers: list[OffloadingManager], extra: dict[str, object], **config: object) -> TieringOffloadingManager:
    """kvtriton's tiered manager as vLLM's factory builds it from ``extra``; kept in ``managers`` to be shut down."""
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra, **config))  # pyright: ignore[reportArgumentType] -- keyword pass-through
    assert isinstance(spec, KVTritonTieringOffloadingSpec)
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    managers.append(manager)
    return manager


def primary_of(manager: TieringOffloadingManager) -> KVTritonPrimaryTier:
    """The tiered manager's primary tier, checked to be kvtriton's."""
    primary = manager.primary_tier
    assert isinstance(primary, KVTritonPrimaryTier)
    return primary
