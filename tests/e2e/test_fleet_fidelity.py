"""`kvtriton simulate`'s fleet model predicts what three real vLLM engines sharing one Mooncake pool report.

A seeded workload of 120 short requests (:mod:`e2e.fleet_fidelity`) is routed
by the fleet model's router, round-robin and prefix-affinity (on the first
block), to three engines with ``KVTritonTieringOffloadingSpec``, each its own
host tier of 60 chunks, all on one Mooncake pool (one namespace per router).
The engines run in turn, one request at a time, in one process (an engine's
shutdown and restart is the next engine: empty GPU cache and host tier, the
pool as the others left it); the prediction replays each engine's stream in
the same order over one pool model. The test asserts, per engine, the shares
of its prompt tokens served by its GPU prefix cache, its host tier and the
pool, and the share it computed, and the fleet's pool hits, are within 1
point of the prediction (the engines in turn are repeatable: docs/simulate.md
gives the measured figures).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.fleet_fidelity import SHARES, FleetComparison, FleetSetup, compare, engine_shares, pool_traffic

SETUP = FleetSetup()
TOLERANCE_POINTS = 1.0


@pytest.fixture(scope="module")
def fleets(llama: Path, e2e_dir: Path) -> list[FleetComparison]:
    """Every router's three engines in turn on one Mooncake pool, in one process."""
    from mooncake_fixtures import MOONCAKE_MISSING

    if MOONCAKE_MISSING is not None:
        pytest.skip(MOONCAKE_MISSING)
    from kvtriton.integrations._mooncake_local import MooncakeCluster

    cluster = MooncakeCluster(e2e_dir / "fleet-fidelity-mooncake-cluster").start()
    try:
        return compare(
            SETUP, llama, e2e_dir / "fleet-fidelity", mooncake_master=cluster.master_address,
            pool_bytes=cluster.holder_bytes,
        )  # fmt: skip
    finally:
        cluster.stop()


def test_each_fleet_is_a_real_comparison(fleets: list[FleetComparison]) -> None:
    """Every router's engines served requests and their figures add up; round-robin's engines hit each other's
    chunks in the pool, and a host tier served some."""
    assert [fleet.router for fleet in fleets] == list(SETUP.routers)
    for fleet in fleets:
        assert len(fleet.measured) == len(fleet.predicted) == SETUP.engines, fleet.describe()
        for side in (fleet.measured, fleet.predicted):
            for report in side:
                assert report.requests > 0, fleet.describe()
                assert sum(engine_shares(report).values()) == pytest.approx(1.0), fleet.describe()
    round_robin = fleets[SETUP.routers.index("round-robin")]
    assert all(report.pool_hit_tokens > 0 for report in round_robin.measured[1:]), round_robin.describe()
    assert any(report.host_hit_tokens > 0 for report in round_robin.measured), round_robin.describe()


def test_each_engine_and_the_pool_are_within_the_bound_of_the_fleet_model(fleets: list[FleetComparison]) -> None:
    far = [
        f"{fleet.router}, engine {engine}, {share}: measured minus predicted {fleet.gap_points(engine, share):+.2f}"
        f" points, beyond {TOLERANCE_POINTS}\n{fleet.describe()}"
        for fleet in fleets
        for engine in range(SETUP.engines)
        for share in SHARES
        if abs(fleet.gap_points(engine, share)) > TOLERANCE_POINTS
    ]
    far += [
        f"{fleet.router}, the fleet's pool hits: measured minus predicted {fleet.pool_hit_gap_points():+.2f} points,"
        f" beyond {TOLERANCE_POINTS}\n{fleet.describe()}"
        for fleet in fleets
        if abs(fleet.pool_hit_gap_points()) > TOLERANCE_POINTS
    ]
    assert not far, "\n".join(far)


def test_the_pool_carries_what_the_model_says(fleets: list[FleetComparison]) -> None:
    """The chunks the engines wrote to the pool and read from it, within 1% of the model's count."""
    far: list[str] = []
    for fleet in fleets:
        measured, predicted = pool_traffic(fleet.measured), pool_traffic(fleet.predicted)
        far += [
            f"{fleet.router}, pool chunks {name}: {measured[name]} measured, {predicted[name]} predicted\n"
            + fleet.describe()
            for name in predicted
            if abs(measured[name] - predicted[name]) > TOLERANCE_POINTS / 100 * predicted[name]
        ]
    assert not far, "\n".join(far)
