"""``vllm serve`` with kvtriton over loopback HTTP: the same completion around a prefix-cache reset, served from kvtriton."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.tiny_models import prompt_text
from e2e.engine import spec_config
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A
from e2e.serve import Server, vllm_serve

FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE


def metric(metrics: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    values = pattern.findall(metrics)
    assert values, f"{name} is not in /metrics"
    return sum(float(value) for value in values)


@pytest.fixture(scope="module")
def served(llama: Path, e2e_dir: Path) -> Iterator[tuple[Server, list[str], str, str]]:
    """One server: A completed, the prefix cache reset, A completed again; the two texts, /metrics and the log."""
    # A tiered-only key in the single-tier spec: kvtriton warns about it at start-up (the log must show the warning).
    config = spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20, tier_poll_interval_s=0.01)
    with vllm_serve(llama, config, e2e_dir / "serve") as server:
        texts = [server.complete(prompt_text(PROMPT_A), MAX_TOKENS)]
        server.post("/reset_prefix_cache")
        texts.append(server.complete(prompt_text(PROMPT_A), MAX_TOKENS))
        metrics = server.get("/metrics")
        yield server, texts, metrics, server.log()


def test_completion_is_identical_around_a_prefix_cache_reset(served: tuple[Server, list[str], str, str]) -> None:
    _, texts, _, _ = served
    first, second = texts
    assert len(first.split()) == MAX_TOKENS
    assert second == first


def test_metrics_show_kvtriton_transfers_and_the_external_hits(served: tuple[Server, list[str], str, str]) -> None:
    _, _, metrics, _ = served
    stored = metric(metrics, "vllm:kv_offload_store_bytes_total")
    assert stored > 0
    assert metric(metrics, "vllm:kv_offload_load_bytes_total") == stored
    assert metric(metrics, "vllm:external_prefix_cache_hits_total") == FULL_TOKENS
    assert metric(metrics, "vllm:prefix_cache_hits_total") == 0, "the reset emptied the engine's own prefix cache"
    # kvtriton's own gauges (host-slab usage) are exported under vLLM's CPU-tier names.
    assert "vllm:kv_offload_cpu_cache_usage_perc" in metrics


def test_kvtriton_log_lines_appear_in_the_default_vllm_log(served: tuple[Server, list[str], str, str]) -> None:
    _, _, _, log = served
    startup = [line for line in log.splitlines() if "kvtriton offloading" in line and "slots" in line]
    assert startup, "kvtriton's start-up line is missing from vllm serve's log"
    assert all(" INFO " in line for line in startup), startup
    assert any("kvtriton worker:" in line for line in log.splitlines())
    warnings = [
        line for line in log.splitlines() if "ignoring kv_connector_extra_config['tier_poll_interval_s']" in line
    ]
    assert warnings and all(" WARNING " in line for line in warnings), "kvtriton's warning is missing from the log"
