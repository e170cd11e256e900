"""The Mooncake tier behind vLLM's own TieringOffloadingSpec (vLLM's CPU primary), at the manager level.

vLLM builds the tier from its config by ``module_path``; one manager stores
chunks and cascades them to Mooncake, a second manager with an empty primary
(another engine, same namespace) promotes them bit-exact, and a third with
another block layout only misses. vLLM's CPU worker needs a GPU, so the
GPU<->primary copies are the test's own writes into and reads from the
primary's memory; every primary<->Mooncake move is the tiering manager's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np  # noqa: E402
from mooncake_fixtures.tiers import END_OF_STEP, chunk_keys  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_fixtures.builders import offloading_config  # noqa: E402

from kvtriton.tiers.mooncake import MooncakeStoreTier, MooncakeTierMetrics  # noqa: E402

BLOCK_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    started = MooncakeCluster(tmp_path_factory.mktemp("mooncake-vllm")).start()
    yield started
    started.stop()


@pytest.fixture
def managers() -> Iterator[list[TieringOffloadingManager]]:
    made: list[TieringOffloadingManager] = []
    yield made
    for manager in made:
        manager.shutdown()


def tiered_manager(
    cluster: MooncakeCluster, engine_id: str, made: list[TieringOffloadingManager], block_bytes: int = BLOCK_BYTES
) -> tuple[TieringOffloadingManager, MooncakeStoreTier, np.ndarray]:
    """vLLM's TieringOffloadingSpec with the Mooncake tier loaded by module path; returns the tier and the primary's rows."""
    tier_config = {
        "type": "MooncakeStoreTier",
        "module_path": "kvtriton.tiers.mooncake",
        "master_server_address": cluster.master_address,
        "namespace": "vllm-manager",
        "timeout_s": 5.0,
    }
    config = offloading_config(
        {"cpu_bytes_to_use": 16 * block_bytes, "secondary_tiers": [tier_config]}, worker_kv_bytes_per_block=block_bytes
    )
    spec = TieringOffloadingSpec(dataclasses.replace(config, engine_id=engine_id))
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    made.append(manager)
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, MooncakeStoreTier)
    assert tier.wait_until_up(10.0)
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    return manager, tier, rows


def settle(manager: TieringOffloadingManager) -> None:
    """Step the manager until no primary<->secondary transfer is in flight."""
    deadline = time.monotonic() + 15.0
    while True:
        with manager.lock:
            manager.on_schedule_end(END_OF_STEP)
            if not manager.has_pending_work():
                return
        assert time.monotonic() < deadline, "transfers still in flight"
        time.sleep(0.005)


def serve_and_cascade(manager: TieringOffloadingManager, rows: np.ndarray, keys: list[OffloadKey], seed: int) -> list[bytes]:
    """The GPU->primary half of a prompt's store (done by vLLM's worker on a GPU), then the manager's cascade."""
    context = ReqContext(req_id=f"store-{seed}")
    with manager.lock:
        manager.on_new_request(context)
        prepared = manager.prepare_store(keys, context)
    assert prepared is not None and isinstance(prepared.store_spec, CPULoadStoreSpec)
    generator = np.random.default_rng(seed)
    written: list[bytes] = []
    for chunk in prepared.store_spec.chunk_ids:
        rows[int(chunk)] = generator.integers(-128, 128, rows.shape[1], dtype=np.int8)
        written.append(rows[int(chunk)].tobytes())
    with manager.lock:
        manager.complete_store(keys, context)
        manager.on_request_finished(context)
    settle(manager)
    return written


def promote(manager: TieringOffloadingManager, rows: np.ndarray, keys: list[OffloadKey]) -> list[bytes] | None:
    """Look ``keys`` up step after step as vLLM's scheduler does; the promoted chunks' bytes, or None on a miss."""
    context = ReqContext(req_id="promote")
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


def test_chunks_cascaded_by_one_vllm_manager_are_promoted_bit_exact_by_another_and_missed_by_another_layout(
    cluster: MooncakeCluster, managers: list[TieringOffloadingManager]
) -> None:
    first, first_tier, first_rows = tiered_manager(cluster, "mooncake-first", managers)
    keys = chunk_keys(3, salt=30)
    written = serve_and_cascade(first, first_rows, keys, seed=30)
    assert first_tier.stats().stored_keys == 3

    second, second_tier, second_rows = tiered_manager(cluster, "mooncake-second", managers)
    assert not second_rows.any()  # an empty primary
    assert promote(second, second_rows, keys) == written
    stats = second_tier.stats()
    assert (stats.lookup_hits, stats.loaded_keys, stats.load_failed_keys) == (3, 3, 0)

    third, third_tier, third_rows = tiered_manager(cluster, "mooncake-third", managers, block_bytes=BLOCK_BYTES // 2)
    assert third_tier.keyspace.digest != second_tier.keyspace.digest
    assert promote(third, third_rows, keys) is None
    assert third_tier.stats().loaded_keys == 0


def test_vllm_builds_the_tier_from_its_documented_defaults(
    cluster: MooncakeCluster, managers: list[TieringOffloadingManager]
) -> None:
    _, tier, _ = tiered_manager(cluster, "mooncake-defaults", managers)
    config = tier.config
    assert (config.metadata_server, config.protocol, config.global_segment_size, config.io_threads) == ("P2PHANDSHAKE", "tcp", 0, 4)
    assert config.local_hostname == "127.0.0.1"  # MC_TCP_BIND_ADDRESS, set by the fixtures
    assert tier.config_info() == {"mooncake_master": cluster.master_address, "mooncake_namespace_digest": tier.keyspace.digest}


def test_vllm_declares_the_tiers_metrics_and_info_labels() -> None:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "MooncakeStoreTier", "module_path": "kvtriton.tiers.mooncake", "master_server_address": "127.0.0.1:1"}
        ],
    }
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)
    assert {MooncakeTierMetrics.FAILED_OPS, MooncakeTierMetrics.FAILED_OP_SECONDS, MooncakeTierMetrics.UP} <= set(metrics)
    assert {"mooncake_master", "mooncake_namespace_digest"} <= set(TieringOffloadingSpec.config_info_keys(extra))


def test_the_tiers_metrics_are_read_where_vllms_tier_metrics_are_with_vllms_tier_label(
    cluster: MooncakeCluster, managers: list[TieringOffloadingManager], tmp_path: Path
) -> None:
    """Through vLLM's Prometheus metrics (what PrometheusStatLogger exports) and vLLM's reader (LLM.get_metrics())."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.reader import Counter as ReadCounter
    from vllm.v1.metrics.reader import Gauge as ReadGauge
    from vllm.v1.metrics.reader import get_metrics_snapshot

    # The Mooncake tier second, so its label is not the first position by chance.
    extra: dict[str, object] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 16 * BLOCK_BYTES,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path / "fs")},
            {"type": "MooncakeStoreTier", "module_path": "kvtriton.tiers.mooncake",
             "master_server_address": cluster.master_address, "namespace": "vllm-metrics", "timeout_s": 5.0},
        ],
    }  # fmt: skip
    config = offloading_config(extra, worker_kv_bytes_per_block=BLOCK_BYTES)
    manager = TieringOffloadingSpec(dataclasses.replace(config, engine_id="mooncake-metrics")).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    managers.append(manager)
    tier = manager.secondary_tiers[1]
    assert isinstance(tier, MooncakeStoreTier) and tier.wait_until_up(10.0)
    # vLLM's own label for this tier, on its config-info series.
    (vllm_label,) = [str(info["tier"]) for info in manager.config_info() if "mooncake_master" in info]
    assert vllm_label == "2:MooncakeStoreTier" == tier.tier_label

    unregister_vllm_metrics()
    try:
        vllm_config = SimpleNamespace(
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
        )
        prometheus = OffloadPromMetrics(
            vllm_config,  # pyright: ignore[reportArgumentType] -- OffloadPromMetrics reads only kv_transfer_config
            {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
            ["model_name", "engine"],
            {0: ["tiny", "0"]},
        )
        stats = manager.get_stats()
        assert stats is not None
        prometheus.observe(stats.to_dict(), engine_idx=0)

        exported = generate_latest(REGISTRY).decode()
        assert f'{MooncakeTierMetrics.UP}{{engine="0",model_name="tiny",tier="{vllm_label}"}} 1.0' in exported
        read = [metric for metric in get_metrics_snapshot() if metric.name == MooncakeTierMetrics.UP]
        assert [(type(metric), metric.labels["tier"], getattr(metric, "value", None)) for metric in read] == [
            (ReadGauge, vllm_label, 1.0)
        ]
        # The counters join them, under the same label, once they grow (a failed op after the master goes away).
        with tier._lock:  # pyright: ignore[reportPrivateUsage] -- stands in for a failed store call
            tier._counters.failed_ops += 2  # pyright: ignore[reportPrivateUsage] -- as above
        stats = manager.get_stats()
        assert stats is not None
        prometheus.observe(stats.to_dict(), engine_idx=0)
        read = [metric for metric in get_metrics_snapshot() if metric.name == MooncakeTierMetrics.FAILED_OPS]
        assert [(type(metric), metric.labels["tier"], getattr(metric, "value", None)) for metric in read] == [
            (ReadCounter, vllm_label, 2)
        ]
    finally:
        unregister_vllm_metrics()


def test_after_shutdown_the_primary_unmaps_its_region(cluster: MooncakeCluster) -> None:
    # The tier holds the primary's memory registered with Mooncake; once the store is closed it lets go,
    # so vLLM's primary can unmap its region instead of keeping it mapped for a native user.
    made: list[TieringOffloadingManager] = []
    manager, _, rows = tiered_manager(cluster, "mooncake-unmap", made)
    del rows  # the test's own view of the primary
    region = manager.primary_tier._mmap_region  # pyright: ignore[reportPrivateUsage] -- vLLM's CPU primary keeps its region private
    manager.shutdown()
    assert region.mmap_obj is None
