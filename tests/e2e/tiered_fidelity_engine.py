"""The body of one tiered fidelity engine process: :mod:`e2e.fidelity_engine`'s engine, with vLLM's tiering metrics by tier.

Run by :func:`e2e.tiered_fidelity.measure_run` as ``python -m e2e.tiered_fidelity_engine JOB_JSON RESULT_JSON``.
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
    return run_fidelity_engine(job, after_requests=after_requests)


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
