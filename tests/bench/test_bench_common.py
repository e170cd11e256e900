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


def test_smoke_runs_get_a_quick_file_stem_once() -> None:
    from bench.common import quick_name

    assert quick_name("kernels") == "kernels-quick"
    assert quick_name("kernels-quick") == "kernels-quick"


def test_sizes_read_as_bytes_kib_and_mib_not_powers_of_two() -> None:
    from bench.common import readable_bytes

    assert [readable_bytes(size) for size in (656, 4096, 28 * 1024, 1536, 1 << 20, 1 << 30)] == [
        "656 B", "4 KiB", "28 KiB", "1.5 KiB", "1 MiB", "1 GiB",
    ]  # fmt: skip
