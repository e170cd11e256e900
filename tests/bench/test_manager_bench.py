"""bench/manager.py: it measures the prefix-sharing workload, the replay counts right, and simulate agrees."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.manager import QUICK_REQUESTS, main, replay, simulate_command, trace
from kvtriton._offload_types import ReqContext
from kvtriton.cli._main import main as kvtriton_main
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._replay import manager_calls, prepare
from kvtriton.sim._workloads import PrefixSharingParams, generate

SMALL = PrefixSharingParams(requests=50, blocks_per_request=8, prefixes=5, prefix_blocks=6, zipf_s=1.0)


def test_trace_is_the_prefix_sharing_workload_at_16_tokens_per_block() -> None:
    expected = prepare(generate("prefix-sharing", seed=3, block_size=16, overrides=asdict(SMALL)))
    assert trace(SMALL, 3) == expected
    assert trace(SMALL, 3) != trace(SMALL, 4)


def test_replay_counts_blocks_hits_and_stores() -> None:
    requests = trace(SMALL, 3)
    manager = CPUOffloadingManager(1_000)  # never full: everything stored once
    contexts = [ReqContext()] * len(requests)
    result = replay(manager_calls(manager), requests, contexts, inflight=0)
    distinct = len({key for request in requests for key in request.prompt_keys})
    assert result.blocks == 400
    assert result.stored == distinct
    assert result.failed_stores == 0
    assert result.loaded == manager.stats().hits
    assert 0 < result.hit_rate < 1


def test_replay_rejects_a_negative_window() -> None:
    with pytest.raises(ValueError, match="inflight must be >= 0, got -1"):
        replay(manager_calls(CPUOffloadingManager(1)), [], [], inflight=-1)


def test_bench_main_writes_json_and_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    args = ["--requests", "40", "--blocks-per-request", "8", "--prefixes", "4", "--prefix-blocks", "4"]
    assert main([*args, "--slots", "32", "--repeats", "1", "--no-vllm", "--name", "t"]) == 0
    out = capsys.readouterr().out
    assert "kvtriton blocks/s" in out
    record = json.loads((tmp_path / "t.json").read_text())
    assert [row["policy"] for row in record["results"]] == ["arc", "lru"]
    assert record["vllm"] == "skipped (--no-vllm)"
    assert record["results"][0]["kvtriton"]["blocks"] == 320
    assert record["trace"] == {
        "workload": "prefix-sharing", "seed": 0, "block_size": 16,
        "requests": 40, "blocks_per_request": 8, "prefixes": 4, "prefix_blocks": 4, "zipf_s": 1.1,
    }  # fmt: skip


def test_quick_shortens_the_trace_and_replays_once_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    small = ["--blocks-per-request", "4", "--prefix-blocks", "2", "--no-vllm", "--policies", "lru"]
    assert main([*small, "--quick", "--name", "q"]) == 0
    record = json.loads((tmp_path / "q-quick.json").read_text())
    assert (record["trace"]["requests"], record["repeats"], record["smoke_run"]) == (QUICK_REQUESTS, 1, True)
    assert main([*small, "--quick", "--requests", "30", "--repeats", "2", "--name", "r"]) == 0
    record = json.loads((tmp_path / "r-quick.json").read_text())
    assert (record["trace"]["requests"], record["repeats"]) == (30, 2)
    # A smoke run never writes the measured file.
    assert not (tmp_path / "q.json").exists() and not (tmp_path / "r.json").exists()


def test_a_quick_run_says_it_is_a_smoke_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    small = ["--blocks-per-request", "4", "--prefix-blocks", "2", "--no-vllm", "--policies", "lru", "--requests", "20"]
    assert main([*small, "--quick", "--name", "s"]) == 0
    assert "SMOKE RUN (--quick)" in capsys.readouterr().out
    assert main([*small, "--name", "m"]) == 0
    assert "SMOKE RUN" not in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text())["smoke_run"] is False


def test_bad_trace_shape_exits_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    with pytest.raises(SystemExit, match="prefix_blocks must be in 0..8, got 9"):
        main(["--requests", "1", "--blocks-per-request", "8", "--prefix-blocks", "9", "--no-vllm"])


@pytest.mark.parametrize("inflight", [0, 3])
def test_simulate_command_reproduces_the_benchmark_hit_counts(
    inflight: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    shape = [
        "--requests",
        "120",
        "--blocks-per-request",
        "10",
        "--prefixes",
        "6",
        "--prefix-blocks",
        "8",
        "--seed",
        "5",
    ]
    flags = ["--slots", "60", "--inflight", str(inflight), "--repeats", "1", "--no-vllm", "--name", "b"]
    assert main([*shape, *flags]) == 0
    bench = json.loads((tmp_path / "b.json").read_text())
    params = PrefixSharingParams(requests=120, blocks_per_request=10, prefixes=6, prefix_blocks=8)
    assert bench["simulate"] == simulate_command(params, 5, 60, inflight, ["arc", "lru"])
    capsys.readouterr()
    command = shlex.split(bench["simulate"])
    assert command[:2] == ["kvtriton", "simulate"]
    assert kvtriton_main([*command[1:], "--json", "--no-plot", "--no-progress", "--out", str(tmp_path)]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert [point["num_blocks"] for point in simulated["points"]] == [60, 60]
    for row, point in zip(bench["results"], simulated["points"]):
        assert point["policy"] == row["policy"]
        assert point["hit_blocks"] == row["kvtriton"]["loaded"] > 0
        assert point["blocks_stored"] == row["kvtriton"]["stored"]
        assert point["evictions"] == row["kvtriton"]["evictions"] > 0


def test_vllm_replays_the_same_trace_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.v1.kv_offload.cpu.manager", reason="vLLM is not installed")
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    shape = ["--requests", "60", "--blocks-per-request", "8", "--prefixes", "4", "--prefix-blocks", "6"]
    small_headline = [
        "--workloads",
        "scan",
        "--headline-requests",
        "40",
        "--rounds",
        "1",
    ]  # the second table is checked
    assert main([*shape, *small_headline, "--slots", "40", "--repeats", "1", "--policies", "lru", "--name", "v"]) == 0
    record = json.loads((tmp_path / "v.json").read_text())
    assert record["vllm"].startswith("vLLM ")
    (row,) = record["results"]
    assert row["vllm"]["blocks"] == row["kvtriton"]["blocks"] == 480
    assert row["vllm"]["loaded"] > 0 and row["vllm"]["stored"] > 0
    assert row["speedup"] > 0


def test_timing_reports_median_and_range_of_blocks_per_second() -> None:
    from bench.manager import Timing

    timing = Timing.of(100, [1.0, 0.5, 0.25], hit_rate=0.5)
    assert (timing.median, timing.low, timing.high, timing.hit_rate) == (200.0, 100.0, 400.0, 0.5)


def test_headline_times_both_managers_in_vllms_call_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm", reason="the headline compares against vLLM's manager")
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    tiny = ["--requests", "20", "--blocks-per-request", "4", "--prefix-blocks", "2", "--repeats", "1"]
    head = ["--workloads", "scan", "--headline-requests", "40", "--rounds", "2", "--policies", "lru"]
    assert main([*tiny, *head, "--name", "h"]) == 0
    assert "kvtriton via adapter blocks/s (range)" in capsys.readouterr().out
    record = json.loads((tmp_path / "h.json").read_text())
    (row,) = record["headline"]["rows"]
    assert (row["workload"], row["policy"], record["headline"]["rounds"]) == ("scan", "lru", 2)
    assert row["vllm"]["low"] <= row["vllm"]["median"] <= row["vllm"]["high"]
    assert row["speedup"] == pytest.approx(row["kvtriton_via_vllm_adapter"]["median"] / row["vllm"]["median"])
    # Same trace, same call order: both managers saw every prompt block.
    assert 0 < row["blocks"]


def test_hit_rate_table_needs_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    with pytest.raises(SystemExit, match="--hit-rates needs vLLM: skipped"):
        main(["--requests", "5", "--blocks-per-request", "4", "--prefix-blocks", "2", "--no-vllm", "--hit-rates"])
