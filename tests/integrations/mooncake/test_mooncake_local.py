"""The local Mooncake cluster that tests and benchmarks start: a start that fails leaves nothing running."""

from __future__ import annotations

from pathlib import Path

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)


def test_a_holder_that_fails_to_start_takes_the_master_it_started_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = MooncakeCluster(tmp_path / "mooncake")

    def holder_fails() -> None:
        raise RuntimeError("mooncake holder exited with -6")

    monkeypatch.setattr(cluster, "start_holder", holder_fails)
    with pytest.raises(RuntimeError, match="holder exited"):
        cluster.start()
    master = cluster.master
    assert master is not None and master.poll() is not None  # started, then stopped: no orphan left
