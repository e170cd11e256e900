"""The docs name every Prometheus counter as ``/metrics`` exposes it: with its ``_total`` suffix.

prometheus_client appends ``_total`` to a counter's name; an operator who
greps ``/metrics`` or writes a query for ``vllm:kv_offload_integrity_failures``
finds nothing. The counters are read from the definitions the specs hand
vLLM (kvtriton's, vLLM's tiering and transfer ones, the Mooncake tier's) and
from vLLM's own stat logger.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import get_connector_metric_definitions
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata
from vllm.v1.metrics import loggers

from kvtriton.integrations.mooncake import MooncakeStoreTier
from kvtriton.integrations.vllm import KVTritonOffloadingSpec, KVTritonTieringOffloadingSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"
TIERS = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kvtriton-unused"}]}


def _counters(definitions: dict[str, OffloadingMetricMetadata]) -> set[str]:
    return {name for name, metadata in definitions.items() if isinstance(metadata, OffloadingCounterMetadata)}


def counter_names() -> set[str]:
    """Every counter kvtriton's specs declare or vLLM exports beside them, by its declared name (no ``_total``)."""
    declared = (
        KVTritonOffloadingSpec.build_metric_definitions({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2}),
        KVTritonTieringOffloadingSpec.build_metric_definitions(dict(TIERS)),
        MooncakeStoreTier.build_metric_definitions({}),
        get_connector_metric_definitions(),
    )
    names = set[str]().union(*(_counters(definitions) for definitions in declared))
    # vLLM's engine counters (prefix cache hits and the like) are made in its stat logger, not declared in a table.
    names |= set(re.findall(r'_counter_cls\(\s*name="(vllm:[a-z0-9_]+)"', inspect.getsource(loggers)))
    return names


def test_the_counters_are_found() -> None:
    names = counter_names()
    assert {
        "vllm:kv_offload_integrity_failures",
        "vllm:kv_offload_stores_skipped",
        "vllm:kv_offload_tiering_chunk_hits",
        "vllm:kv_offload_mooncake_failed_ops",
        "vllm:kv_offload_store_bytes",
        "vllm:external_prefix_cache_hits",
    } <= names


def test_every_counter_the_docs_name_carries_its_total_suffix() -> None:
    names = counter_names()
    bare = [
        f"{path.name}:{number}: {name}"
        for path in sorted(DOCS.glob("*.md"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for name in re.findall(r"vllm:[a-z0-9_]+", line)
        if name in names
    ]
    assert bare == [], "name these counters with _total, as /metrics shows them"
