"""kvtriton as a drop-in by vLLM's own measure: the installed vLLM's offloading tests, unchanged, with kvtriton swapped in.

The installed vLLM picks the release (:func:`~tests.vllm_compat.vllm_release.installed_release`:
vLLM 0.33.x runs 0.33.0's tests, 0.34.x runs 0.34.0's; any other version fails
this suite with one line saying so). That release's selected files of vLLM's
test suite (from its source release, see :mod:`tests.vllm_compat.vllm_release`)
run twice in a pytest process of their own: once as vLLM ships them (every
test must pass: the baseline proves the environment), once with kvtriton's
classes constructed wherever a test constructs vLLM's
(:mod:`tests.vllm_compat.kvtriton_swap`). The tests the release lists as not
runnable on this machine are deselected in both. A kvtriton failure fails this
suite unless the series' list in :data:`~tests.vllm_compat.allow_list.ALLOWED_FAILURES`
names the test with its reason, and an allow-list entry that no longer fails
fails it too (the list stays short and true). ``make compat`` runs this file alone.

Set ``KVTRITON_SKIP_VLLM_COMPAT=1`` to skip it (an offline machine without the
cached release); the reason is printed in pytest's summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_compat.allow_list import ALLOWED_FAILURES, allow_list_key
from tests.vllm_compat.vllm_release import Release, UnsupportedVLLMError, ensure_tests, installed_release, run_env

pytest.importorskip("vllm", reason="the vLLM compatibility suite needs vLLM 0.33.x or 0.34.x (make venv installs it)")

RUN_TIMEOUT_S = 900
PLUGIN_DIR = Path(__file__).resolve().parent
REPOSITORY = PLUGIN_DIR.parent.parent


@dataclass(frozen=True)
class PassResult:
    """One pytest run over a release's :attr:`~tests.vllm_compat.vllm_release.Release.selected` tests."""

    outcomes: dict[str, str]
    messages: dict[str, str]
    not_run: dict[str, list[str]]
    """Each of the release's not-run entries and the node ids it deselected."""
    constructed: dict[str, int]
    """kvtriton objects built per swapped vLLM manager class (empty without the swap)."""
    specs: dict[str, str]
    """The class vLLM's spec factory loads for each of its two spec names."""
    retried: list[str]
    """Tests that failed once and passed when run again on their own (timing-sensitive)."""
    output_tail: str

    def failed(self) -> list[str]:
        return sorted(nodeid for nodeid, outcome in self.outcomes.items() if outcome == "failed")

    def count(self, outcome: str) -> int:
        return sum(1 for nodeid, value in self.outcomes.items() if value == outcome and "::" in nodeid)

    def deselected(self) -> int:
        return sum(len(nodeids) for nodeids in self.not_run.values())


def _run_pytest(release: Release, root: Path, tests: list[str], *, swap: bool) -> tuple[dict[str, Any], str]:
    env = run_env(root)
    # vLLM's tests/ first: its `tests` package, not kvtriton's; then kvtriton and the plugin.
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPOSITORY), str(PLUGIN_DIR)])
    env["KVTRITON_SWAP"] = "1" if swap else "0"
    with tempfile.TemporaryDirectory(prefix="vllm-compat-") as scratch:
        report = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvtriton_swap",
            f"--kvtriton-report={report}", "--rootdir", str(root),
            *(f"--kvtriton-not-run={entry}" for entry in release.not_run), *tests,
        ]  # fmt: skip
        completed = subprocess.run(
            command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
        tail = (completed.stdout + completed.stderr)[-4000:]
        if not report.exists():
            raise AssertionError(f"vLLM's tests did not run (exit {completed.returncode}):\n{tail}")
        return json.loads(report.read_text()), tail


def run_pass(release: Release, root: Path, *, swap: bool) -> PassResult:
    """Run ``release``'s selection in ``root`` (its extracted tests), with or without kvtriton swapped in.

    A few of vLLM's tests time real intervals (the back-pressure EMA) and can
    fail on a loaded machine: every failed test is run once more on its own,
    and that second outcome counts (the tests that needed it are listed in
    ``retried``).
    """
    data, tail = _run_pytest(release, root, list(release.selected), swap=swap)
    outcomes: dict[str, str] = data["outcomes"]
    messages: dict[str, str] = data["messages"]
    failed = sorted(nodeid for nodeid, outcome in outcomes.items() if outcome == "failed" and "::" in nodeid)
    retried: list[str] = []
    if failed:
        again, _ = _run_pytest(release, root, failed, swap=swap)
        for nodeid in failed:
            if again["outcomes"].get(nodeid) == "passed":
                outcomes[nodeid] = "passed"
                retried.append(nodeid)
                messages.pop(nodeid, None)
    return PassResult(outcomes, messages, data["not_run"], data["constructed"], data["specs"], retried, tail)


@pytest.fixture(scope="module")
def release() -> Release:
    """The release of the installed vLLM's series; an unsupported vLLM fails the suite with one line saying so."""
    if os.environ.get("KVTRITON_SKIP_VLLM_COMPAT") == "1":
        pytest.skip("KVTRITON_SKIP_VLLM_COMPAT=1")
    try:
        return installed_release()
    except UnsupportedVLLMError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="module")
def allowed(release: Release) -> dict[str, str]:
    """The allow-list of ``release``'s series."""
    assert release.series in ALLOWED_FAILURES, f"tests/vllm_compat/allow_list.py has no list for {release.series}"
    return ALLOWED_FAILURES[release.series]


@pytest.fixture(scope="module")
def vllm_tests(release: Release) -> Path:
    return ensure_tests(release)


@pytest.fixture(scope="module")
def passes(release: Release, vllm_tests: Path) -> dict[bool, PassResult]:
    """Both passes (by ``swap``) side by side, each pytest in a process of its own: half the wait on two cores."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {swap: pool.submit(run_pass, release, vllm_tests, swap=swap) for swap in (False, True)}
        return {swap: run.result() for swap, run in runs.items()}


@pytest.fixture(scope="module")
def baseline(passes: dict[bool, PassResult]) -> PassResult:
    return passes[False]


@pytest.fixture(scope="module")
def swapped(passes: dict[bool, PassResult]) -> PassResult:
    return passes[True]


def _describe(result: PassResult, nodeids: list[str]) -> str:
    return "\n".join(f"  {nodeid}: {result.messages.get(nodeid, '?')}" for nodeid in nodeids)


def summary(release: Release, allowed: dict[str, str], baseline: PassResult, swapped: PassResult) -> str:
    """Both passes' counts in one paragraph: what ran, what passed, what failed and whether it is allow-listed."""
    failed = swapped.failed()
    allow_listed = sum(1 for nodeid in failed if allow_list_key(nodeid) in allowed)
    built = ", ".join(f"{count} for {name}" for name, count in sorted(swapped.constructed.items()))
    return (
        f"vLLM {release.version}'s tests for the installed vLLM {release.series}.x "
        f"({baseline.deselected()} not run here, tests/vllm_compat/vllm_release.py):\n"
        f"  as vLLM ships them: {baseline.count('passed')} passed, {baseline.count('failed')} failed, "
        f"{baseline.count('skipped')} skipped\n"
        f"  kvtriton swapped in: {swapped.count('passed')} passed, {len(failed)} failed "
        f"({allow_listed} allow-listed, {len(failed) - allow_listed} not), {swapped.count('skipped')} skipped; "
        f"kvtriton objects built: {built}"
    )


def test_baseline_passes_as_vllm_ships_it(release: Release, baseline: PassResult) -> None:
    """Every selected path collects tests, every not-run entry names tests, and every test passes without kvtriton."""
    for path in release.selected:
        assert any(nodeid.startswith(path.rstrip("/") + ("/" if path.endswith("/") else "::"))
                   for nodeid in baseline.outcomes), f"no test of {path} ran:\n{baseline.output_tail}"  # fmt: skip
    unmatched = sorted(entry for entry, nodeids in baseline.not_run.items() if not nodeids)
    assert not unmatched, f"not-run entries that name no test of vLLM {release.version}: {unmatched}"
    failed = baseline.failed()
    assert not failed, (
        f"vLLM {release.version}'s own tests fail here without kvtriton (twice):\n{_describe(baseline, failed)}"
    )
    if baseline.retried:
        print(f"passed when run again (timing-sensitive): {baseline.retried}")


def test_the_swap_builds_kvtritons_classes_and_the_baseline_vllms(baseline: PassResult, swapped: PassResult) -> None:
    assert (baseline.constructed, baseline.specs) == (
        {}, {"CPUOffloadingSpec": "CPUOffloadingSpec", "TieringOffloadingSpec": "TieringOffloadingSpec"},
    )  # fmt: skip
    assert swapped.specs == {
        "CPUOffloadingSpec": "KVTritonOffloadingSpec",
        "TieringOffloadingSpec": "KVTritonTieringOffloadingSpec",
    }
    # Every selected file builds managers; far more than a handful go through kvtriton.
    assert swapped.constructed.get("CPUOffloadingManager", 0) >= 100, swapped.constructed
    assert swapped.constructed.get("CPUPrimaryTierOffloadingManager", 0) >= 50, swapped.constructed


def test_kvtriton_fails_only_allow_listed_tests(
    release: Release, allowed: dict[str, str], baseline: PassResult, swapped: PassResult
) -> None:
    """With kvtriton constructed wherever vLLM's classes are, only allow-listed tests fail."""
    print(summary(release, allowed, baseline, swapped))
    assert set(swapped.outcomes) >= {n for n, outcome in baseline.outcomes.items() if outcome == "passed"}, (
        "the swapped run collected fewer tests than the baseline"
    )
    if swapped.retried:
        print(f"passed when run again (timing-sensitive): {swapped.retried}")
    unexpected = [nodeid for nodeid in swapped.failed() if allow_list_key(nodeid) not in allowed]
    assert not unexpected, (
        f"{len(unexpected)} of vLLM {release.version}'s tests fail with kvtriton swapped in and are not "
        f"allow-listed for {release.series} (tests/vllm_compat/allow_list.py): differences a vLLM user would see, "
        f"unless the test reads vLLM's private state\n{summary(release, allowed, baseline, swapped)}\n"
        f"{_describe(swapped, unexpected)}"
    )


def test_allow_list_entries_still_fail(release: Release, allowed: dict[str, str], swapped: PassResult) -> None:
    """Each allow-list entry names a test that exists and still fails: a fixed one leaves the list."""
    failing = {allow_list_key(nodeid) for nodeid in swapped.failed()}
    collected = {allow_list_key(nodeid) for nodeid in swapped.outcomes}
    missing = sorted(key for key in allowed if key not in collected)
    assert not missing, f"allow-listed tests that vLLM {release.version}'s selection does not have: {missing}"
    passing = sorted(key for key in allowed if key not in failing)
    assert not passing, (
        f"allow-listed tests that pass now on vLLM {release.version} (remove them from its list in "
        f"tests/vllm_compat/allow_list.py): {passing}"
    )


ORPHANING_TEST = """
import multiprocessing


def _wait_for_release(queue):
    queue.get()  # blocks until the test releases it, which the failing test never does


def test_fails_before_releasing_its_child():
    queue = multiprocessing.get_context("spawn").Queue()
    multiprocessing.get_context("spawn").Process(target=_wait_for_release, args=(queue,)).start()
    assert False, "fails before it releases its child"
"""


def test_a_run_whose_failed_test_left_a_child_waiting_still_ends(tmp_path: Path) -> None:
    # As vLLM's test_multiprocess_race_construct_and_write does when its wait for its children times out: without
    # the plugin's clean-up, multiprocessing joins the waiting child at exit and the run hangs (until RUN_TIMEOUT_S).
    (tmp_path / "test_orphan.py").write_text(ORPHANING_TEST)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(PLUGIN_DIR), "KVTRITON_SWAP": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvtriton_swap",
         f"--kvtriton-report={report}", "--rootdir", str(tmp_path), "test_orphan.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "stopped 1 child process(es) a test left running" in done.stdout, done.stdout[-2000:]
    assert json.loads(report.read_text())["outcomes"] == {
        "test_orphan.py::test_fails_before_releasing_its_child": "failed"
    }
