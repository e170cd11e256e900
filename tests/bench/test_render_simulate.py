"""docs/simulate.md's figures are what bench/results/simulate-*.json says, and its plots were drawn from those records.

Until ``SIMULATE_RENDERERS`` is merged into ``render_docs.RENDERERS`` (then
``tests/project/test_docs_figures.py`` checks these regions with every other), the
regions are checked here with the simulate renderers alone.
"""

from __future__ import annotations

import json
import shlex
import struct
import zlib
from pathlib import Path
from typing import cast

import pytest

from bench.render_docs import MARKER, RenderError, Results
from bench.render_simulate import RUNS, SIMULATE_RENDERERS, SimulateRun, main, run_flags
from kvtriton.cli._simulate import plot_stamp

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "simulate.md"
RESULTS = REPO / "bench" / "results"


def _record(name: str, folder: Path = RESULTS) -> dict[str, object]:
    return json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))


def png_text(path: Path) -> dict[str, str]:
    """The tEXt, zTXt and iTXt entries of a PNG, by keyword."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    entries: dict[str, str] = {}
    offset = 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        offset += 12 + length
        if kind == b"tEXt":
            keyword, _, text = body.partition(b"\0")
            entries[keyword.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt":
            keyword, _, rest = body.partition(b"\0")
            entries[keyword.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            keyword, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _language, _, rest = rest.partition(b"\0")
            _translated, _, text = rest.partition(b"\0")
            entries[keyword.decode()] = (zlib.decompress(text) if compressed else text).decode()
    return entries


def test_every_simulate_region_of_the_doc_matches_its_result_file() -> None:
    text = DOC.read_text(encoding="utf-8")
    regions = [match for match in MARKER.finditer(text) if match.group("name") in SIMULATE_RENDERERS]
    assert {match.group("name") for match in regions} == set(SIMULATE_RENDERERS)  # every renderer is used
    for match in regions:
        body = match.group("body")
        rendered = SIMULATE_RENDERERS[match.group("name")](Results())
        expected = f"\n{rendered}\n" if body.startswith("\n") else rendered
        assert body == expected, f"docs/simulate.md: stale {match.group('name')}: run `python -m bench.render_docs`"


def test_no_figure_of_the_doc_is_written_by_hand_outside_a_region() -> None:
    """The stale figures of issue 26 (52.7%, 60.5%, 65%, 43.8%) must not come back as plain prose."""
    prose = MARKER.sub("", DOC.read_text(encoding="utf-8"))
    for stale in ("52.7%", "52.4%", "60.5%", "65% at 8 GiB", "43.8% (ARC)", "3.5 s"):
        assert stale not in prose


@pytest.mark.parametrize("run", [run for run in RUNS if run.plot], ids=lambda run: run.name)
def test_each_plot_was_drawn_from_its_result_file(run: SimulateRun) -> None:
    stamp = png_text(REPO / "docs" / "img" / f"{run.name}.png").get("Source")
    stale = f"docs/img/{run.name}.png is stale: run `python -m bench.render_simulate`"
    assert stamp == plot_stamp(_record(run.name)), stale


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_each_result_file_is_the_documented_command(run: SimulateRun) -> None:
    argv = ["simulate", *run_flags(run, Results()), "--no-progress", *([] if run.plot else ["--no-plot"])]
    assert _record(run.name)["argv"] == argv


def test_the_prefix_sharing_command_is_the_manager_benchmarks() -> None:
    block = SIMULATE_RENDERERS["simulate-prefix-sharing-command"](Results())
    command = block.removeprefix("```bash\n").removesuffix("\n```").split("#")[0].replace("\\\n", " ")
    assert shlex.split(command) == shlex.split(str(_record("manager")["simulate"]))


def test_a_rerun_gives_the_recorded_points_and_plot(tmp_path: Path) -> None:
    """The few-shot record is what the simulator gives today: a change in the replay shows up as stale figures."""
    assert main(["--only", "simulate-few-shot", "--results", str(tmp_path), "--images", str(tmp_path)]) == 0
    fresh, recorded = _record("simulate-few-shot", tmp_path), _record("simulate-few-shot")
    assert fresh["points"] == recorded["points"] and fresh["printed"] == recorded["printed"]
    assert png_text(tmp_path / "simulate-few-shot.png")["Source"] == plot_stamp(recorded)


def _copy_with(tmp_path: Path, name: str, policy: str, gib: float, rate: float) -> Results:
    """A results folder holding ``name`` with ``policy``'s rate at ``gib`` set to ``rate``."""
    record = _record(name)
    for point in cast(list[dict[str, object]], record["points"]):
        if point["policy"] == policy and point["capacity_gib"] == gib:
            point["token_hit_rate"] = point["external_hit_rate"] = rate
    (tmp_path / f"{name}.json").write_text(json.dumps(record))
    return Results(tmp_path)


@pytest.mark.parametrize(
    ("region", "name", "policy", "gib"),
    [
        ("simulate-few-shot-arc-ahead", "simulate-few-shot", "lru", 4.0),
        ("simulate-chat-lru-ahead", "simulate-chat", "arc", 8.0),
        ("simulate-vllm-ceiling", "simulate-system-prompts-vllm", "lru", 16.0),
    ],
)
def test_a_claim_of_the_prose_that_a_rerun_turns_around_fails_the_rendering(
    region: str, name: str, policy: str, gib: float, tmp_path: Path
) -> None:
    with pytest.raises(RenderError, match="rewrite the sentence"):
        SIMULATE_RENDERERS[region](_copy_with(tmp_path, name, policy, gib, 0.99))


def test_the_figures_follow_the_numbers_of_the_result_file(tmp_path: Path) -> None:
    results = _copy_with(tmp_path, "simulate-few-shot", "arc", 4.0, 0.5555)
    assert SIMULATE_RENDERERS["simulate-few-shot-arc-ahead"](results).startswith("ARC 55.5% against LRU")


def test_the_trimmed_output_keeps_the_chosen_rows_and_marks_each_gap() -> None:
    block = SIMULATE_RENDERERS["simulate-few-shot-output"](Results()).splitlines()
    rows = [line.split()[:2] for line in block if line.split()[:1] in (["lru"], ["arc"])]
    assert rows == [[policy, gib] for policy in ("lru", "arc") for gib in ("4", "8", "16")]
    assert block.count("   …") == 3  # the smaller sizes before each policy's rows, the larger after the last
    printed = cast(list[str], _record("simulate-few-shot")["printed"])
    assert block[1 : printed.index("") + 1] == printed[: printed.index("")]  # the lines above the table, as printed
