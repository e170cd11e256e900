"""`kvtriton simulate --tier fs|mooncake` predicts what real vLLM engines report for each tier, per arrival mode.

A seeded workload of 160 short requests (:mod:`e2e.tiered_fidelity`) is sent
one at a time, four in flight and all at once; in each mode it runs on two
engines in turn (one process per tier: the first is shut down, with vLLM's
process state, before the second starts), each with
``KVTritonTieringOffloadingSpec``, a host tier of 48 chunks (a fifth of the
trace's 241 distinct blocks) and a second tier of the mode's own: vLLM's
``fs`` tier on a root directory, or kvtriton's Mooncake Store tier in a
namespace of one pool. The second engine starts with an empty host tier and
the first one's tier. Each run's prediction replays its half of the trace
with the tier carried over and the mode's ``--arrivals``. The test asserts
what each tier served (``vllm:prompt_tokens_cached_by_source``), vLLM's
first-lookup chunk counters (``vllm:kv_offload_tiering_chunk_hits /
_chunk_queries``) and the combined offload hit rate are within the bound
of the mode, naming every gap that is not: 1 point one at a time, where the
engine is repeatable; under concurrency only a gross break, since the engine
itself is not (docs/simulate.md gives the measured gaps).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.tiered_fidelity import (
    COMBINED,
    FROM_HOST,
    FROM_TIER,
    MODES,
    RATES,
    RunComparison,
    TieredSetup,
    compare,
)

SETUP = TieredSetup()
TOLERANCE_POINTS = 1.0
"""The goal, asserted where the engine is repeatable: requests sent one at a time."""
CONCURRENT_SANITY_POINTS = 40.0
"""Under concurrency the engine is not repeatable (the same trace, mode and tier measured 1.5 and 23.8 points from
the prediction in two runs on vLLM 0.33; on vLLM 0.34, whose stores that land turn cached misses into hits, Mooncake
all at once measured within the bound alone and 38.1 points off combined in a CI run, where its puts and existence
checks took more steps than the model's one; docs/simulate.md gives the measured gaps): only a gross break, such as a
tier the model never hits, fails there. Issue 49 models the steps a Mooncake call takes."""


def bound(mode: str) -> float:
    return TOLERANCE_POINTS if mode == "one at a time" else CONCURRENT_SANITY_POINTS


@pytest.fixture(scope="module")
def fs_runs(llama: Path, e2e_dir: Path) -> list[RunComparison]:
    """Every mode's two engine runs on its own fs root, in one process."""
    return compare(SETUP, llama, e2e_dir / "tiered-fidelity-fs", "fs")


@pytest.fixture(scope="module")
def mooncake_runs(llama: Path, e2e_dir: Path) -> list[RunComparison]:
    """Every mode's two engine runs in its own namespace of one Mooncake pool, in one process."""
    from mooncake_fixtures import MOONCAKE_MISSING

    if MOONCAKE_MISSING is not None:
        pytest.skip(MOONCAKE_MISSING)
    from kvtriton.integrations._mooncake_local import MooncakeCluster

    cluster = MooncakeCluster(e2e_dir / "tiered-fidelity-mooncake-cluster").start()
    try:
        return compare(
            SETUP, llama, e2e_dir / "tiered-fidelity-mooncake", "mooncake",
            mooncake_master=cluster.master_address, pool_bytes=cluster.holder_bytes,
        )  # fmt: skip
    finally:
        cluster.stop()


@pytest.fixture(params=["fs", "mooncake"])
def runs(request: pytest.FixtureRequest) -> list[RunComparison]:
    return request.getfixturevalue(f"{request.param}_runs")


def test_each_run_is_a_real_comparison(runs: list[RunComparison]) -> None:
    """Every mode ran both engines; the host tier served chunks in each, and the tier served the restart."""
    assert [(run.mode, run.run) for run in runs] == [(mode, index) for mode in MODES for index in (1, 2)]
    for run in runs:
        if run.mode == "one at a time":  # under concurrency a burst may leave the host tier nothing to serve
            for rate in (FROM_HOST, COMBINED):
                assert 0 < run.measured[rate].hits < run.measured[rate].queries, run.describe()
        # What each tier served adds up to the combined hits, on both sides.
        for side in (run.measured, run.predicted):
            assert side[FROM_HOST].hits + side[FROM_TIER].hits == side[COMBINED].hits, run.describe()
    restarts = [run for run in runs if run.run == 2 and run.mode == "one at a time"]
    assert all(run.measured[FROM_TIER].hits > 0 for run in restarts), [run.describe() for run in restarts]


def test_vllm_reports_each_tiers_predicted_rates_within_the_bound_of_its_arrival_mode(
    runs: list[RunComparison],
) -> None:
    far = [
        f"{run.tier}, {run.mode}, run {run.run}, {rate}: measured minus predicted {run.gap_points(rate):+.2f} points,"
        f" beyond {bound(run.mode)} ({run.describe()})"
        for run in runs
        for rate in RATES
        if abs(run.gap_points(rate)) > bound(run.mode)
    ]
    assert not far, "\n".join(far)
