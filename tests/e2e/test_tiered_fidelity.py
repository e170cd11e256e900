"""`kvtriton simulate --tier fs` predicts what real vLLM engines report for each tier, within one point, across a restart.

A seeded workload of 160 short requests (:mod:`e2e.tiered_fidelity`) runs on
two engines in turn (one process: the first is shut down, with vLLM's process
state, before the second starts), each with ``KVTritonTieringOffloadingSpec``, a
host tier of 48 chunks (a fifth of the trace's 241 distinct blocks) and vLLM's
``fs`` tier on one root: the second engine starts with an empty host tier and
the first one's disk. Each run's prediction replays its half of the trace with
the fs tier carried over. The test asserts each tier's reported chunk hit rate
(``vllm:kv_offload_tiering_chunk_hits / _chunk_queries`` for ``0:primary``
and ``1:fs``) and the combined offload hit rate vLLM reports are within 1
point of the prediction, naming every gap that is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.tiered_fidelity import COMBINED, FS_TIER, HOST_TIER, RunComparison, TieredSetup, compare

SETUP = TieredSetup()
TOLERANCE_POINTS = 1.0


@pytest.fixture(scope="module")
def runs(llama: Path, e2e_dir: Path) -> list[RunComparison]:
    """Both engine runs, one after the other on one fs root, in one process (about 40 s here)."""
    return compare(SETUP, llama, e2e_dir / "tiered-fidelity")


def test_each_run_is_a_real_comparison(runs: list[RunComparison]) -> None:
    """Both runs ran; in each, the host tier and the disk both served chunks, and the disk served the restart."""
    assert [run.run for run in runs] == [1, 2]
    for run in runs:
        for tier in (HOST_TIER, FS_TIER, COMBINED):
            assert 0 < run.measured[tier].hits < run.measured[tier].queries, run.describe()
    assert runs[1].measured[FS_TIER].rate > runs[0].measured[FS_TIER].rate, runs[1].describe()


def test_vllm_reports_each_tiers_predicted_hits_within_one_point(runs: list[RunComparison]) -> None:
    far = [
        f"run {run.run}, {tier}: measured minus predicted {run.gap_points(tier):+.2f} points ({run.describe()})"
        for run in runs
        for tier in (HOST_TIER, FS_TIER, COMBINED)
        if abs(run.gap_points(tier)) > TOLERANCE_POINTS
    ]
    assert not far, f"beyond {TOLERANCE_POINTS} point:\n" + "\n".join(far)
