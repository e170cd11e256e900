"""Which vLLM release's tests the compatibility suite runs, and that each release's lists fit its selection.

Fast checks of :mod:`tests.vllm_compat.vllm_release` and
:mod:`tests.vllm_compat.allow_list` that need neither vLLM's tests nor a
download; test_vllm_compat.py runs the tests themselves.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from tests.vllm_compat.allow_list import ALLOWED_FAILURES
from tests.vllm_compat.vllm_release import RELEASES, Release, UnsupportedVLLMError, installed_release, release_for


def _in_selection(release: Release, nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return any(
        path == selected or (selected.endswith("/") and path.startswith(selected)) for selected in release.selected
    )


@pytest.mark.parametrize(
    ("installed", "tests_of"),
    [("0.33.0", "0.33.0"), ("0.33.2", "0.33.0"), ("0.34.0", "0.34.0"), ("0.34.1", "0.34.0"), ("0.34.0+cpu", "0.34.0")],
)
def test_each_installed_vllm_runs_its_series_release(installed: str, tests_of: str) -> None:
    assert release_for(installed).version == tests_of


@pytest.mark.parametrize("installed", ["0.35.0", "0.32.1", "1.0.0", "not-a-version"])
def test_a_vllm_outside_the_supported_series_is_refused_in_one_line(installed: str) -> None:
    with pytest.raises(UnsupportedVLLMError) as refusal:
        release_for(installed)
    message = str(refusal.value)
    assert "\n" not in message
    assert f"vLLM {installed} is installed" in message
    assert "0.33.x, 0.34.x" in message


def test_the_installed_vllm_picks_its_release() -> None:
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed here")
    assert installed_release().series == ".".join(installed.split(".")[:2])


def test_each_release_has_one_sha256_pin_and_one_allow_list() -> None:
    assert len({release.series for release in RELEASES}) == len(RELEASES)
    assert all(re.fullmatch("[0-9a-f]{64}", release.sdist_sha256) for release in RELEASES)
    assert set(ALLOWED_FAILURES) == {release.series for release in RELEASES}


@pytest.mark.parametrize("release", RELEASES, ids=lambda release: release.series)
def test_allow_list_and_not_run_entries_lie_in_the_selection_and_apart(release: Release) -> None:
    allowed = ALLOWED_FAILURES[release.series]
    assert [key for key in allowed if not _in_selection(release, key)] == []
    assert [entry for entry in release.not_run if not _in_selection(release, entry)] == []
    # A test vLLM cannot run here is never also excused for kvtriton.
    assert [key for key in allowed if key in release.not_run or key.split("::", 1)[0] in release.not_run] == []
    assert all(reason.strip() for reason in (*allowed.values(), *release.not_run.values()))
