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
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np
from mooncake_fixtures.managers import promote, serve_and_cascade, started
from mooncake_fixtures.tiers import chunk_keys
from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm_fixtures.builders import offloading_config

from kvtriton.integrations.mooncake import MooncakeStoreTier, MooncakeTierMetrics

BLOCK_BYTES = 64 * 1024


TierEntry = Callable[[str], dict[str, object]]
"""The type of the folder's ``tier_entry`` fixture (tests/integrations/mooncake/conftest.py)."""


def tiered_manager(
    tier_entry: TierEntry, engine_id: str, made: list[OffloadingManager], block_bytes: int = BLOCK_BYTES
) -> tuple[TieringOffloadingManager, MooncakeStoreTier, np.ndarray]:
    """vLLM's TieringOffloadingSpec with the Mooncake tier loaded by module path; returns the tier and the primary's rows."""
    config = offloading_config(
        {"cpu_bytes_to_use": 16 * block_bytes, "secondary_tiers": [tier_entry("vllm-manager")]},
        worker_kv_bytes_per_block=block_bytes,
    )
    spec = TieringOffloadingSpec(dataclasses.replace(config, engine_id=engine_id))
    return started(spec.get_manager(), made)


def test_chunks_cascaded_by_one_vllm_manager_are_promoted_bit_exact_by_another_and_missed_by_another_layout(
    tier_entry: TierEntry, managers: list[OffloadingManager]
) -> None:
    first, first_tier, first_rows = tiered_manager(tier_entry, "mooncake-first", managers)
    keys = chunk_keys(3, salt=30)
    written = serve_and_cascade(first, first_rows, keys, seed=30)
    assert first_tier.stats().stored_keys == 3

    second, second_tier, second_rows = tiered_manager(tier_entry, "mooncake-second", managers)
    assert not second_rows.any()  # an empty primary
    assert promote(second, second_rows, keys) == written
    stats = second_tier.stats()
    assert (stats.lookup_hits, stats.loaded_keys, stats.load_failed_keys) == (3, 3, 0)

    third, third_tier, third_rows = tiered_manager(tier_entry, "mooncake-third", managers, block_bytes=BLOCK_BYTES // 2)
    assert third_tier.keyspace.digest != second_tier.keyspace.digest
    assert promote(third, third_rows, keys) is None
    assert third_tier.stats().loaded_keys == 0


def test_vllm_builds_the_tier_from_its_documented_defaults(
    cluster: MooncakeCluster, tier_entry: TierEntry, managers: list[OffloadingManager]
) -> None:
    _, tier, _ = tiered_manager(tier_entry, "mooncake-defaults", managers)
    config = tier.config
    assert (config.metadata_server, config.protocol, config.global_segment_size, config.io_threads) == (
        "P2PHANDSHAKE",
        "tcp",
        0,
        4,
    )
    assert config.local_hostname == "127.0.0.1"  # MC_TCP_BIND_ADDRESS, set by the fixtures
    assert tier.config_info() == {
        "mooncake_master": cluster.master_address,
        "mooncake_namespace_digest": tier.keyspace.digest,
        "mooncake_identity": tier.identity.hex,
    }


def test_vllm_declares_the_tiers_metrics_and_info_labels() -> None:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": "127.0.0.1:1",
            }
        ],
    }
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)
    assert {MooncakeTierMetrics.FAILED_OPS, MooncakeTierMetrics.FAILED_OP_SECONDS, MooncakeTierMetrics.UP} <= set(
        metrics
    )
    assert {"mooncake_master", "mooncake_namespace_digest"} <= set(TieringOffloadingSpec.config_info_keys(extra))


def test_the_tiers_metrics_are_read_where_vllms_tier_metrics_are_with_vllms_tier_label(
    tier_entry: TierEntry, managers: list[OffloadingManager], tmp_path: Path
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
            tier_entry("vllm-metrics"),
        ],
    }
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
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
            )
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


def test_after_shutdown_the_primary_unmaps_its_region(tier_entry: TierEntry) -> None:
    # The tier holds the primary's memory registered with Mooncake; once the store is closed it lets go,
    # so vLLM's primary can unmap its region instead of keeping it mapped for a native user.
    made: list[OffloadingManager] = []
    manager, _, rows = tiered_manager(tier_entry, "mooncake-unmap", made)
    del rows  # the test's own view of the primary
    region = manager.primary_tier._mmap_region  # pyright: ignore[reportPrivateUsage] -- vLLM's CPU primary keeps its region private
    manager.shutdown()
    assert region.mmap_obj is None
