"""Every benchmark figure in README.md and docs/ is what bench/results/*.json says (bench/render_docs.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import render_docs
from bench.render_docs import MARKER, RENDERERS, RenderError, Results, gb_per_s, render_text, stale_regions

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", render_docs.documents(), ids=lambda path: str(path.relative_to(REPO)))
def test_every_generated_figure_matches_its_result_file(path: Path) -> None:
    stale = stale_regions(path, Results())
    assert stale == [], f"{path.relative_to(REPO)}: stale {stale}: run `python -m bench.render_docs` and commit"


def test_the_headline_figures_are_generated_in_the_readme_benchmarks_and_manager_docs() -> None:
    names = {
        path.name: {match.group("name") for match in MARKER.finditer(path.read_text(encoding="utf-8"))}
        for path in render_docs.documents()
    }
    assert "manager-headline-range" in names["README.md"]
    assert {"summary", "manager-headline-table", "kernels-headline-table", "tiers-table", "mooncake-table"} <= names[
        "benchmarks.md"
    ]
    assert {"compression-table", "compression-bytes", "run-compression"} <= names["benchmarks.md"]
    assert {"manager-headline-table", "manager-headline-range"} <= names["manager.md"]


def test_check_mode_names_a_figure_edited_by_hand_and_render_fixes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "docs").mkdir()
    good = "Speed: <!-- generated:manager-headline-range -->{}<!-- /generated:manager-headline-range -->.\n"
    fresh = good.format(RENDERERS["manager-headline-range"](Results()))
    (tmp_path / "README.md").write_text(fresh.replace("ARC", "ARC 9.99x, was"))
    (tmp_path / "docs" / "index.md").write_text("no figures\n")
    monkeypatch.setattr(render_docs, "REPO", tmp_path)
    monkeypatch.setattr(
        render_docs, "documents", lambda repo=tmp_path: [tmp_path / "README.md", tmp_path / "docs" / "index.md"]
    )
    assert render_docs.main(["--check"]) == 1
    assert "README.md: manager-headline-range" in capsys.readouterr().err
    assert render_docs.main([]) == 0
    assert (tmp_path / "README.md").read_text() == fresh
    assert render_docs.main(["--check"]) == 0


def test_a_block_region_stays_a_block_and_an_inline_one_inline() -> None:
    text = "<!-- generated:run-host_cost -->\nold\n<!-- /generated:run-host_cost --> and <!-- generated:run-host_cost -->old<!-- /generated:run-host_cost -->"
    rendered = render_text(text, Results())
    date = RENDERERS["run-host_cost"](Results())
    assert (
        rendered
        == f"<!-- generated:run-host_cost -->\n{date}\n<!-- /generated:run-host_cost --> and <!-- generated:run-host_cost -->{date}<!-- /generated:run-host_cost -->"
    )


def test_an_unknown_region_or_a_missing_result_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match="unknown generated region 'no-such-figure'"):
        render_text("<!-- generated:no-such-figure -->x<!-- /generated:no-such-figure -->", Results())
    with pytest.raises(RenderError, match="manager.json is missing"):
        render_text(
            "<!-- generated:manager-headline-range -->x<!-- /generated:manager-headline-range -->", Results(tmp_path)
        )


def test_bandwidth_is_read_under_its_old_or_an_unambiguous_gb_per_s_name(tmp_path: Path) -> None:
    assert gb_per_s({"gbps": 17.5}) == gb_per_s({"gb_per_s": 17.5}) == gb_per_s({"bandwidth_gb_per_s": 17.5}) == 17.5
    with pytest.raises(RenderError, match="no bandwidth field"):
        gb_per_s({"seconds": 1.0})
    # The kernels table renders from a kernels.json whose rows were renamed.
    for name in ("kernels", "kernels_ptx"):
        shutil.copy(REPO / "bench" / "results" / f"{name}.json", tmp_path / f"{name}.json")
    record = json.loads((tmp_path / "kernels.json").read_text())
    for row in record["results"]:
        row["gb_per_s"] = row.pop("gbps")
    (tmp_path / "kernels.json").write_text(json.dumps(record))
    assert RENDERERS["kernels-headline-table"](Results(tmp_path)) == RENDERERS["kernels-headline-table"](Results())


def test_the_compression_figures_come_from_its_result_file(tmp_path: Path) -> None:
    record = json.loads((REPO / "bench" / "results" / "compression.json").read_text())
    record["accuracy"]["per-tensor fp8"]["attention_relative_error"] = 0.5
    record["bytes"][0]["blocks_per_gib_gain"] = 1.5
    (tmp_path / "compression.json").write_text(json.dumps(record))
    assert "| `per-tensor fp8` |" in RENDERERS["compression-table"](Results(tmp_path))
    assert "| 50.00% |" in RENDERERS["compression-table"](Results(tmp_path))
    assert RENDERERS["compression-bytes"](Results(tmp_path)).startswith(
        "bfloat16 0.516x the bytes moved, 1.50x the blocks per GiB"
    )
