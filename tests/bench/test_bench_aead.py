"""bench/aead.py measures every AEAD candidate (seal and open, per chunk size), 1 vs 2 threads and the GIL probe."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from bench import aead


def test_a_quick_run_prints_the_three_tables_and_writes_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert aead.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "GB/s per core (median, range)" in out and "seal, 1 vs 2 threads" in out and "GIL probe: call" in out
    record = json.loads((tmp_path / "aead-quick.json").read_text())
    assert record["quick"] is True and record["chosen"] == "aes-256-gcm" and "machine" in record
    assert record["command"] == "python -m bench.aead --quick" and record["rounds"] == 2
    names = [candidate["name"] for candidate in record["candidates"]]
    assert names[:3] == ["aes-256-gcm", "kvtriton-box", "chacha20-poly1305"]
    assert set(names[3:]) | set(record["not_measured"]) == {"aegis-128x2", "aegis-256x2"}
    measured = {(row["candidate"], row["operation"], row["chunk_bytes"]) for row in record["throughput"]}
    assert measured == {(name, op, size) for name in names for op in aead.OPERATIONS for size in aead.QUICK_CHUNK_SIZES}
    for row in record["throughput"]:
        spread = row["bandwidth_GBps"]
        assert len(spread["rounds"]) == 2 and 0 < spread["low"] <= spread["median"] <= spread["high"]
    assert [row["candidate"] for row in record["threads"]] == names
    assert all(
        row["one_thread_GBps"]["median"] > 0 and row["two_threads_GBps"]["median"] > 0 for row in record["threads"]
    )
    calls = {row["call"]: row for row in record["gil_probe"]["calls"]}
    assert set(calls) == {aead.HOLDS_GIL, aead.RELEASES_GIL, *names}
    assert all(row["releases_gil"] is None for row in calls.values())  # a smoke run gives no verdict
    assert calls[aead.RELEASES_GIL]["share"] is not None  # a 50 ms sleep is always long enough to probe
    assert not (tmp_path / "aead.json").exists()  # a smoke run never passes for a real one


def test_the_probe_sees_a_call_that_releases_the_gil_and_one_that_holds_it() -> None:
    def hold_the_gil() -> None:
        sum(range(2_000_000))  # one C call over a C iterator: no bytecode, so no GIL switch, for tens of ms

    previous = sys.getswitchinterval()
    sys.setswitchinterval(aead.PROBE_SWITCH_INTERVAL_S)
    try:
        released = aead.other_thread_share(lambda: time.sleep(0.05), 0.001)
        held = aead.other_thread_share(hold_the_gil, 0.001)
        too_short = aead.other_thread_share(lambda: None, 0.001)
    finally:
        sys.setswitchinterval(previous)
    assert released is not None and held is not None
    assert held <= 0.2 and released > held
    assert too_short is None  # too short to probe: no figure, not a zero


def test_bad_timings_are_refused_naming_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert aead.main(["--rounds", "0"]) == 2
    assert "--seconds must be > 0 and --rounds >= 1, got 0.1 and 0" in capsys.readouterr().err
