"""bench/fleet_scale.py: its quick mode times a fleet at each request count, fits the growth, writes a smoke file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.fleet_scale as fleet_scale
from bench.fleet_scale import Progress, fitted_exponent, main, per_request_growth, trace


def test_the_fitted_exponent_is_that_of_a_power_law() -> None:
    assert fitted_exponent([10, 100, 1000], [0.5, 5.0, 50.0]) == pytest.approx(1.0)
    assert fitted_exponent([10, 100], [1.0, 100.0]) == pytest.approx(2.0)
    assert fitted_exponent([10], [1.0]) is None


def test_the_growth_is_the_time_per_request_of_the_largest_count_over_the_smallest() -> None:
    assert per_request_growth([10_000, 100_000, 1_000_000], [5.0, 50.0, 500.0]) == pytest.approx(1.0)
    assert per_request_growth([100_000, 10_000], [80.0, 5.0]) == pytest.approx(1.6)  # in any order
    assert per_request_growth([10], [1.0]) is None


def test_progress_prints_a_line_per_period_with_the_rate_and_the_time_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = iter([100.0, 110.0, 130.0, 135.0, 170.0])  # started, then one reading per call
    monkeypatch.setattr(fleet_scale.time, "perf_counter", lambda: next(clock))
    progress = Progress(1000, every=30.0)
    progress(100)  # 10 s in: before the first period ends, nothing
    progress(200)  # 30 s in: 300 done, 10 a second, 70 s left
    progress(100)  # 35 s in: the next line is due at 60 s
    progress(600)  # all done: the point's own line says so
    assert capsys.readouterr().out == "  300 of 1,000 requests (30%) in 30 s: 10 requests/s, about 70 s left\n"
    assert progress.done == 1000


def test_the_trace_is_drawn_stream_by_stream_with_ids_that_never_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_scale, "STREAM_REQUESTS", 30)
    requests = trace(75)
    assert len(requests) == 75
    assert len({each.req_id for each in requests}) == 75
    assert [each.req_id.split("-")[0] for each in requests[::30]] == ["s0", "s1", "s2"]
    # The streams share the popular system prompts: a first block recurs across streams.
    first_blocks = [{each.prompt_keys[0] for each in requests[start : start + 30]} for start in (0, 30, 60)]
    assert first_blocks[0] & first_blocks[1] & first_blocks[2]


def test_quick_mode_times_each_request_count_and_writes_a_smoke_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert main(["--quick", "--requests", "60,30", "--engines", "3"]) == 0
    printed = capsys.readouterr().out
    assert "SMOKE RUN (--quick)" in printed and "fitted seconds ~ requests^" in printed
    assert "x the time per request from 30 to 60 requests (1.00: linear)" in printed
    record = json.loads((tmp_path / "fleet_scale-quick.json").read_text())
    assert record["quick"] is True and record["machine"]
    assert [(row["requests"], row["engines"]) for row in record["rows"]] == [(30, 3), (60, 3)]
    for row in record["rows"]:
        assert row["seconds"] > 0 and row["us_per_request"] == pytest.approx(1e6 * row["seconds"] / row["requests"])
        assert row["requests_per_second"] == pytest.approx(row["requests"] / row["seconds"])
        assert 0 < row["cpu_seconds"] and len(row["load_average"]) == 2
        assert not row["stalled"] and 0 < row["hit_share"] <= 1
    seconds = [row["seconds"] for row in record["rows"]]
    assert record["fitted_exponent"] == pytest.approx(fitted_exponent([30, 60], seconds))
    assert record["per_request_growth"] == pytest.approx(per_request_growth([30, 60], seconds))
    assert record["pool_bytes"] == 1024 * 2**30 and record["server"]["concurrency"] == 8
