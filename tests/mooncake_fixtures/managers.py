"""vLLM tiering managers over one Mooncake cluster: the fixtures and the store / promotion steps they share.

A test module takes the fixtures by importing them under their own names
(``from mooncake_fixtures.managers import cluster as cluster``; the ``managers`` list is
``tiering_fixtures.configs``'s),
so each module still gets its own cluster; a test that breaks the store (kills,
hangs or restarts its master or holder) takes ``own_cluster``, one of its own. vLLM's CPU worker needs a GPU, so
the GPU<->primary copies are the test's own writes into and reads from the
primary's memory; every primary<->Mooncake move is the tiering manager's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from tiering_fixtures.configs import drain as settle  # one polling loop for both fixture packages
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton.integrations._mooncake_local import MooncakeCluster
from kvtriton.integrations.mooncake import MooncakeStoreTier
from kvtriton.integrations.vllm import RequestTenant
from mooncake_fixtures.tiers import END_OF_STEP

__all__ = ["cluster", "own_cluster", "promote", "serve_and_cascade", "settle", "started"]


def _running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    started = MooncakeCluster(tmp_path_factory.mktemp("mooncake")).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """One master and storage holder on the loopback for the whole test module."""
    yield from _running_cluster(tmp_path_factory)


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """A master and holder for one test alone, which it may kill, hang or restart."""
    yield from _running_cluster(tmp_path_factory)


def started(
    manager: object, made: list[OffloadingManager]
) -> tuple[TieringOffloadingManager, MooncakeStoreTier, np.ndarray]:
    """A spec's tiering manager (kept in ``made``), its one Mooncake tier once up, and its primary's rows."""
    assert isinstance(manager, TieringOffloadingManager)
    made.append(manager)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, MooncakeStoreTier)
    assert tier.wait_until_up(10.0)
    return manager, tier, np.asarray(manager.primary_tier.get_kv_memoryview())


def _context(req_id: str, tenant: RequestTenant | None) -> ReqContext:
    """A request's context as vLLM's connector builds it; ``tenant``: what kvtriton's hook records on it."""
    context = ReqContext(req_id=req_id)
    if tenant is not None:
        context.set_state(tenant)
    return context


def serve_and_cascade(
    manager: TieringOffloadingManager,
    rows: np.ndarray,
    keys: list[OffloadKey],
    seed: int,
    *,
    tenant: RequestTenant | None = None,
) -> list[bytes]:
    """The GPU->primary half of a prompt's store (done by vLLM's worker on a GPU), then the manager's cascade."""
    context = _context(f"store-{seed}", tenant)
    with manager.lock:
        manager.on_new_request(context)
        prepared = manager.prepare_store(keys, context)
    assert prepared is not None and isinstance(prepared.store_spec, CPULoadStoreSpec)
    generator = np.random.default_rng(seed)
    for chunk in prepared.store_spec.chunk_ids:
        rows[int(chunk)] = generator.integers(-128, 128, rows.shape[1], dtype=np.int8)
    with manager.lock:
        manager.complete_store(keys, context)
        manager.on_request_finished(context)
    # As the tiers got them: kvtriton's tiered spec seals each chunk's last bytes when it hands the slot over.
    written = [rows[int(chunk)].tobytes() for chunk in prepared.store_spec.chunk_ids]
    settle(manager)
    return written


def promote(
    manager: TieringOffloadingManager,
    rows: np.ndarray,
    keys: list[OffloadKey],
    *,
    tenant: RequestTenant | None = None,
) -> list[bytes] | None:
    """Look ``keys`` up step after step as vLLM's scheduler does; the promoted chunks' bytes, or None on a miss."""
    context = _context("promote", tenant)
    with manager.lock:
        manager.on_new_request(context)
    deadline = time.monotonic() + 15.0
    try:
        while True:
            with manager.lock:
                answers = [manager.lookup(key, context) for key in keys]
                manager.on_schedule_end(END_OF_STEP)
            if all(answer is LookupResult.HIT for answer in answers):
                break
            if LookupResult.MISS in answers:
                return None
            assert time.monotonic() < deadline, f"lookups never resolved: {answers}"
            time.sleep(0.005)
        with manager.lock:
            spec = manager.prepare_load(keys, context)
        assert isinstance(spec, CPULoadStoreSpec)
        loaded = [rows[int(chunk)].tobytes() for chunk in spec.chunk_ids]
        with manager.lock:
            manager.complete_load(keys, context)
        return loaded
    finally:
        with manager.lock:
            manager.on_request_finished(context)
