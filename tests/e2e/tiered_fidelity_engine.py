"""The body of one tiered fidelity engine process: :mod:`e2e.fidelity_engine`'s engine, with vLLM's tiering metrics by tier.

Run by :func:`e2e.tiered_fidelity.measure_runs` as ``python -m e2e.tiered_fidelity_engine JOB_JSON RESULT_JSON``.
It runs :func:`e2e.fidelity_engine.run` (one request at a time, a small GPU
cache with its prefix cache on, here with ``KVTritonTieringOffloadingSpec``
and an fs tier), then steps the engine until every cascade to the disk has
landed (:func:`e2e.engine_process.settle`, a filler prompt shorter than a
block, which stores and looks up nothing) so that the next engine on the
same root finds every chunk this one wrote, and adds the tiering counters
label by label (``tier="0:primary"``, ``tier="1:fs"``), which
:func:`e2e.engine_process.vllm_counters` sums away.
"""

from __future__ import annotations

import sys
from typing import Any

from e2e.engine_process import job_main, settle_offloading
from e2e.fidelity_engine import run as run_fidelity_engine

TIERING_PREFIX = "vllm:kv_offload_tiering_"


def counters_by_tier(llm: Any) -> dict[str, dict[str, float]]:
    """``{counter: {tier label: value}}`` for vLLM's tiering counters."""
    from vllm.v1.metrics.reader import Counter

    by_tier: dict[str, dict[str, float]] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name.startswith(TIERING_PREFIX) and "tier" in metric.labels:
            tiers = by_tier.setdefault(metric.name, {})
            tier = metric.labels["tier"]
            tiers[tier] = tiers.get(tier, 0.0) + float(metric.value)
    return by_tier


def after_requests(llm: Any) -> dict[str, Any]:
    settle_offloading(llm)
    return {"tier_counters": counters_by_tier(llm)}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Each of ``job["runs"]`` (a list of prompt lists) on an engine of its own, one after the other.

    An engine restart without a new interpreter: the first engine shuts down
    (its connector, host region and tiers with it) and vLLM's process-wide
    state is torn down before the next one starts, which saves re-importing
    torch and vLLM (most of a process's start-up here).
    """
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    results: list[dict[str, Any]] = []
    for prompts in job["runs"]:
        results.append(run_fidelity_engine({**job, "prompts": prompts}, after_requests=after_requests))
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    return {"runs": results}


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
