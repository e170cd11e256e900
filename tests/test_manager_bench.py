"""bench/manager.py: the trace generator is pure and shaped as documented; the replay counts right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.manager import TraceConfig, kvtriton_calls, main, prefix_sharing_trace, replay
from kvtriton.manager import CPUOffloadingManager
from kvtriton.specs import ReqContext

SMALL = TraceConfig(requests=50, blocks_per_request=8, prefixes=5, prefix_blocks=6, zipf_s=1.0, seed=3)


def test_trace_is_deterministic_for_a_seed_and_changes_with_it() -> None:
    assert prefix_sharing_trace(SMALL) == prefix_sharing_trace(SMALL)
    other = TraceConfig(requests=50, blocks_per_request=8, prefixes=5, prefix_blocks=6, zipf_s=1.0, seed=4)
    assert prefix_sharing_trace(other) != prefix_sharing_trace(SMALL)


def test_trace_requests_are_a_shared_prefix_then_unique_blocks() -> None:
    requests = prefix_sharing_trace(SMALL)
    assert len(requests) == 50
    assert all(len(keys) == 8 and len(set(keys)) == 8 for keys in requests)
    first_blocks = {keys[0] for keys in requests}
    assert 1 < len(first_blocks) <= 5  # every request starts with one of the 5 prefixes
    owners: dict[bytes, int] = {}
    for i, keys in enumerate(requests):
        for key in keys[3:]:  # past the shortest shared part (ceil(6 / 2) = 3)
            owners.setdefault(key, i)
        for key in keys[6:]:  # past the longest shared part: unique to this request
            assert owners[key] == i


def test_trace_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="prefix_blocks must be in 0..8, got 9"):
        prefix_sharing_trace(TraceConfig(requests=1, blocks_per_request=8, prefix_blocks=9))


def test_replay_counts_blocks_hits_and_stores() -> None:
    requests = prefix_sharing_trace(SMALL)
    manager = CPUOffloadingManager(1_000)  # never full: everything stored once
    result = replay(kvtriton_calls(manager), requests, [ReqContext()] * len(requests), inflight=0)
    distinct = len({key for keys in requests for key in keys})
    assert result.blocks == 400
    assert result.stored == distinct
    assert result.failed_stores == 0
    assert result.loaded == manager.stats().hits
    assert 0 < result.hit_rate < 1


def test_bench_main_writes_json_and_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    args = ["--requests", "40", "--blocks-per-request", "8", "--prefixes", "4", "--prefix-blocks", "4"]
    assert main([*args, "--capacity", "32", "--repeats", "1", "--no-vllm", "--name", "t"]) == 0
    out = capsys.readouterr().out
    assert "kvtriton blocks/s" in out
    record = json.loads((tmp_path / "t.json").read_text())
    assert [row["policy"] for row in record["results"]] == ["arc", "lru"]
    assert record["vllm"] == "skipped (--no-vllm)"
    assert record["results"][0]["kvtriton"]["blocks"] == 320
