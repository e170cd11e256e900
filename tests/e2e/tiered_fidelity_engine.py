"""The body of one tiered fidelity engine process: :mod:`e2e.fidelity_engine`'s engine, with vLLM's tiering metrics by tier.

Run by :func:`e2e.tiered_fidelity.measure_runs` as ``python -m e2e.tiered_fidelity_engine JOB_JSON RESULT_JSON``.
Each of the job's runs is :func:`e2e.fidelity_engine.run` (a small GPU cache
with its prefix cache on, here with ``KVTritonTieringOffloadingSpec`` and an
fs or Mooncake tier, the requests sent as the run's ``concurrency`` says) on
an engine of its own: it waits until a tier that connects in the background
(Mooncake) is up, sends the requests, then steps the engine until every
cascade has landed (:func:`e2e.engine_process.settle_offloading`, a filler
prompt shorter than a block, which stores and looks up nothing) so that the
next engine on the same tier finds every chunk this one wrote, and adds the
counters label by label (the tiering counters' ``tier="0:primary"``,
``tier="1:fs"``; ``vllm:prompt_tokens_cached_by_source``'s ``source``), which
:func:`e2e.engine_process.vllm_counters` sums away.
"""

from __future__ import annotations

import sys
from typing import Any

from e2e.engine_process import job_main, settle_offloading, wait_tiers_up
from e2e.fidelity_engine import run as run_fidelity_engine

TIERING_PREFIX = "vllm:kv_offload_tiering_"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
"""Prompt tokens served from each source (``device``, ``host``, ``disk``, ...): where the loaded chunks came from."""


def counters_by_label(llm: Any) -> dict[str, dict[str, float]]:
    """``{counter: {label value: value}}`` for vLLM's tiering counters (by ``tier``) and cached tokens (by ``source``)."""
    from vllm.v1.metrics.reader import Counter

    by_label: dict[str, dict[str, float]] = {}
    for metric in llm.get_metrics():
        if not isinstance(metric, Counter):
            continue
        if metric.name.startswith(TIERING_PREFIX) and "tier" in metric.labels:
            label = metric.labels["tier"]
        elif metric.name == CACHED_BY_SOURCE and "source" in metric.labels:
            label = metric.labels["source"]
        else:
            continue
        values = by_label.setdefault(metric.name, {})
        values[label] = values.get(label, 0.0) + float(metric.value)
    return by_label


def after_requests(llm: Any) -> dict[str, Any]:
    settle_offloading(llm)
    return {"tier_counters": counters_by_label(llm)}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Each of ``job["runs"]`` (the job's keys a run overrides: its ``prompts``, ``concurrency`` and
    ``kv_transfer_config``) on an engine of its own, one after the other.

    An engine restart without a new interpreter: the first engine shuts down
    (its connector, host region and tiers with it) and vLLM's process-wide
    state is torn down before the next one starts, which saves re-importing
    torch and vLLM (most of a process's start-up here).
    """
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    results: list[dict[str, Any]] = []
    for overrides in job["runs"]:
        results.append(
            run_fidelity_engine({**job, **overrides}, before_requests=wait_tiers_up, after_requests=after_requests)
        )
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    return {"runs": results}


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
