from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import format_table, write_json


def test_write_json_records_the_machine_beside_the_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    path = write_json("example", {"rows": [1, 2]})
    record = json.loads(path.read_text())
    assert path.parent == tmp_path
    assert record["rows"] == [1, 2]
    assert record["machine"]["device_name"] == "cpu-interpreter"
    assert "torch" in record["machine"] and "date" in record["machine"]


def test_format_table_aligns_columns() -> None:
    table = format_table(["name", "GB/s"], [["gather", 1.23456], ["scatter", 12.5]])
    assert table.splitlines() == [
        "   name    GB/s",
        "-------  ------",
        " gather   1.235",
        "scatter  12.500",
    ]
