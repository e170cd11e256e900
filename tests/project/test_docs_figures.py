"""Every benchmark figure in README.md and docs/ is what bench/results/*.json says (bench/render_docs.py); every
statement of the supported vLLM releases, in the docs, pyproject.toml's ``vllm`` extra and the Makefile, is what
``TESTED_VLLM_RELEASES`` (kvtriton/integrations/_vllm_release.py) says."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from bench import render_docs
from bench.render_docs import (
    MARKER,
    RENDERERS,
    RenderError,
    Results,
    gb_per_s,
    makefile_vllm_versions,
    render_text,
    stale_regions,
)
from kvtriton.integrations._vllm_release import TESTED_VLLM_RANGE, TESTED_VLLM_RELEASES, vllm_release

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


# -- the supported vLLM releases: one source, TESTED_VLLM_RELEASES ------------------------------------------------


def _regions(name: str) -> set[str]:
    return {match.group("name") for match in MARKER.finditer((REPO / name).read_text(encoding="utf-8"))}


def test_the_supported_releases_are_generated_wherever_the_docs_state_them() -> None:
    assert {"vllm-releases", "vllm-make-test", "vllm-make-compat-other", "vllm-requirement"} <= _regions("README.md")
    assert {"vllm-releases", "vllm-releases-table", "vllm-requirement"} <= _regions("docs/vllm.md")
    assert "vllm-releases" in _regions("docs/operations.md")
    vllm_page = (REPO / "docs" / "vllm.md").read_text(encoding="utf-8")
    assert vllm_page.count("## Supported vLLM versions") == 1, "one section says which releases are supported"


def test_the_tested_releases_are_consecutive_and_the_range_holds_exactly_them() -> None:
    assert list(TESTED_VLLM_RELEASES) == sorted(set(TESTED_VLLM_RELEASES)), "oldest first, each once"
    for (major, minor), (next_major, next_minor) in zip(TESTED_VLLM_RELEASES, TESTED_VLLM_RELEASES[1:]):
        assert (next_major, next_minor) == (major, minor + 1), "one range cannot skip a release"
    accepted = SpecifierSet(TESTED_VLLM_RANGE)
    for major, minor in TESTED_VLLM_RELEASES:
        assert f"{major}.{minor}.0" in accepted and f"{major}.{minor}.7" in accepted, "every patch release"
    (oldest_major, oldest_minor), (newest_major, newest_minor) = TESTED_VLLM_RELEASES[0], TESTED_VLLM_RELEASES[-1]
    assert f"{oldest_major}.{oldest_minor - 1}.9" not in accepted
    assert f"{newest_major}.{newest_minor + 1}.0" not in accepted


def test_pyprojects_vllm_extra_asks_for_the_tested_range() -> None:
    # A regex, not tomllib: the package supports Python 3.10, which lacks it; a TOML list of strings reads as JSON.
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(
        r"^\[project\.optional-dependencies\]$.*?^vllm = (\[[^\]]*\])$", pyproject, re.MULTILINE | re.DOTALL
    )
    assert found is not None, "pyproject.toml has no vllm extra"
    assert json.loads(found.group(1)) == [f"vllm{TESTED_VLLM_RANGE}"], (
        f"pyproject.toml's vllm extra must be ['vllm{TESTED_VLLM_RANGE}'], the range of TESTED_VLLM_RELEASES "
        "(kvtriton/integrations/_vllm_release.py)"
    )


def test_the_makefile_tests_every_tested_release_and_no_other() -> None:
    installed = {target: vllm_release(version) for target, version in makefile_vllm_versions().items()}
    assert set(installed) == {"make test", "make compat-other"}
    assert sorted(release for release in installed.values() if release is not None) == sorted(TESTED_VLLM_RELEASES), (
        f"the Makefile's VLLM_VERSION and OTHER_VLLM_VERSION install {installed}, TESTED_VLLM_RELEASES is "
        f"{TESTED_VLLM_RELEASES}"
    )


def test_the_release_figures_follow_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_docs, "TESTED_VLLM_RELEASES", ((0, 33), (0, 34), (0, 35)))
    assert RENDERERS["vllm-releases"](Results()) == "vLLM 0.33.x, 0.34.x and 0.35.x"
    page = (
        "kvtriton supports <!-- generated:vllm-releases -->vLLM 0.33.x and 0.34.x<!-- /generated:vllm-releases -->.\n"
    )
    (tmp_path / "page.md").write_text(page)
    assert stale_regions(tmp_path / "page.md", Results()) == ["vllm-releases"], (
        "a page naming the old releases is stale"
    )
    with pytest.raises(RenderError, match="no make target installs vLLM 0.35.x"):
        RENDERERS["vllm-releases-table"](Results())
    makefile = tmp_path / "Makefile"
    makefile.write_text("VLLM_VERSION ?= 0.32.1\nOTHER_VLLM_VERSION ?= 0.34.0\n")
    monkeypatch.setattr(render_docs, "makefile_vllm_versions", lambda: makefile_vllm_versions(makefile))
    with pytest.raises(
        RenderError, match=r"`make test` installs vLLM 0\.32\.1, which is not one of the tested releases"
    ):
        RENDERERS["vllm-releases-table"](Results())
    makefile.write_text("OTHER_VLLM_VERSION ?= 0.34.0\n")
    with pytest.raises(RenderError, match=r"Makefile sets no `VLLM_VERSION \?= <version>`"):
        makefile_vllm_versions(makefile)
