"""Output conventions shared by every benchmark in bench/.

Each benchmark prints a table, and writes JSON (plus a PNG where a curve says
more than a table) under ``bench/results/`` -- or the folder named by
``$KVTRITON_BENCH_OUT`` -- with the machine it ran on recorded beside the
numbers, so figures from different machines are never mixed up.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtriton.tools.info import collect_machine_info

__all__ = ["format_table", "machine_record", "results_dir", "write_json"]

RESULTS_ENV = "KVTRITON_BENCH_OUT"


def results_dir() -> Path:
    """Where results go: ``$KVTRITON_BENCH_OUT`` if set, else ``bench/results/``."""
    chosen = os.environ.get(RESULTS_ENV)
    folder = Path(chosen) if chosen else Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def machine_record() -> dict[str, object]:
    """Machine info for a result file: GPU name, or ``cpu`` / ``cpu-interpreter``."""
    info = collect_machine_info().as_dict()
    if not info["cuda_available"]:
        info["device_name"] = "cpu-interpreter" if info["triton_interpret"] else "cpu"
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return info


def write_json(name: str, payload: Mapping[str, object]) -> Path:
    """Write ``{"machine": ..., **payload}`` to ``<results>/<name>.json``."""
    path = results_dir() / f"{name}.json"
    record: dict[str, object] = {"machine": machine_record(), **payload}
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table; floats get 3 significant decimals."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    text_rows = [[cell(value) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in text_rows)]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.rjust(width) for header, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(value.rjust(width) for value, width in zip(row, widths)) for row in text_rows]
    return "\n".join(lines)
