"""bench/integrity.py measures every checksum candidate and kvtriton's seal and verify, and writes them as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import integrity


def test_a_quick_run_prints_both_tables_and_writes_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert integrity.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "checksum GB/s" in out and "kvtriton's seal (xxh3_128)" in out
    record = json.loads((tmp_path / "integrity-quick.json").read_text())
    assert record["quick"] is True and record["chosen"] == "xxh3_128" and "machine" in record
    measured = {(row["candidate"], row["chunk_bytes"]) for row in record["checksum"]}
    assert measured == {(name, size) for name in integrity.CANDIDATES for size in integrity.QUICK_CHUNK_SIZES}
    assert all(row["bandwidth_GBps"] > 0 for row in record["checksum"])
    assert [row["chunk_bytes"] for row in record["seal"]] == list(integrity.QUICK_CHUNK_SIZES)
    assert all(row["seal_GBps"] > 0 and row["verify_GBps"] > 0 for row in record["seal"])
    assert not (tmp_path / "integrity.json").exists()  # a smoke run never passes for a real one


def test_bad_timings_are_refused_naming_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert integrity.main(["--seconds", "0"]) == 2
    assert "--seconds must be > 0 and --repeats >= 1, got 0.0 and 5" in capsys.readouterr().err
