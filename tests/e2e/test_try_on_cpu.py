"""``make try`` (docs/try-on-cpu.md) does what the page says: SmolLM2-135M's prompt prefix comes back from kvtriton.

One engine start: the path of :mod:`e2e.try_on_cpu` itself, as ``make try``
runs it (model preparation shared with the other real-model tests).
"""

from __future__ import annotations

import io
import re
import time

import pytest

from bench.real_model import PreparedModel
from e2e import try_on_cpu
from e2e.engine import REPO
from e2e.real_text import BLOCK_SIZE
from e2e.try_on_cpu import ENGINE, FROM_CONNECTOR, PROMPT, TryRun, exposed, log_message, report, run_try


@pytest.fixture(scope="module")
def tried(smollm2: PreparedModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[TryRun, str]:
    """The try path's run and the progress it printed."""
    progress = io.StringIO()
    return run_try(smollm2, tmp_path_factory.mktemp("try") / "engine", progress), progress.getvalue()


def test_the_second_request_takes_its_prefix_from_kvtriton_and_answers_the_same(
    tried: tuple[TryRun, str], smollm2: PreparedModel
) -> None:
    run, _ = tried
    full_blocks = (len(smollm2.chat_prompts[PROMPT]) - 1) // BLOCK_SIZE
    assert full_blocks >= 4, "the prompt spans several blocks"
    assert run.first_text == run.second_text and run.first_text.strip(), "the same, non-empty answer both times"
    assert run.from_kvtriton == run.cached_tokens == full_blocks * BLOCK_SIZE, "every full block came from kvtriton"
    assert run.from_vllm_cache == 0, "vLLM's own prefix cache was reset"
    assert run.bytes_loaded == run.bytes_stored > 0
    assert run.blocks_equal == [True] * full_blocks, "the zeroed KV cache holds the computed blocks again"
    assert any(line.startswith("kvtriton 0.1.0 on vLLM ") for line in run.kvtriton_lines), run.kvtriton_lines
    assert run.problems == []


def test_the_report_says_what_the_page_says_it_says(tried: tuple[TryRun, str]) -> None:
    run, _ = tried
    text = report(run)
    assert (
        f"first answer:  {run.first_text!r}\nsecond answer: {run.second_text!r}\nthe two answers are identical" in text
    )
    assert f"{run.from_kvtriton} of its {run.prompt_tokens} prompt tokens came from kvtriton" in text
    assert f"{exposed(FROM_CONNECTOR)} +{run.from_kvtriton}," in text
    assert "kvtriton's host slab (KVTritonOffloadingSpec" in text
    assert text.endswith("kvtriton served the prefix.")
    page = (REPO / "docs" / "try-on-cpu.md").read_text(encoding="utf-8")
    for phrase in (
        "the two answers are identical",
        "came from kvtriton",
        FROM_CONNECTOR,
        "kvtriton served the prefix.",
    ):
        assert phrase in page, f"docs/try-on-cpu.md does not show {phrase!r}"


def test_the_engine_start_shows_progress(tried: tuple[TryRun, str]) -> None:
    run, progress = tried
    assert f"the engine's log: {run.log}" in progress
    assert re.search(rf"^{ENGINE}: done in \d+\.\d s$", progress, re.MULTILINE), progress
    assert re.search(rf"^  \.\.\. {ENGINE}: \d+ s \(.+\)$", progress, re.MULTILINE), "a line every few seconds"


def test_a_long_step_says_it_still_runs_and_what_it_is_at(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(try_on_cpu, "HEARTBEAT_S", 0.02)
    out = io.StringIO()
    result = try_on_cpu.with_heartbeat("step", lambda: time.sleep(0.3) or 7, out, note="why", detail=lambda: "at x")
    lines = out.getvalue().splitlines()
    assert result == 7
    assert lines[0] == "step (why) ..." and re.fullmatch(r"step: done in 0\.\d s", lines[-1]), lines
    assert lines[1:-1] and all(re.fullmatch(r"  \.\.\. step: \d+ s \(at x\)", line) for line in lines[1:-1]), lines


def test_a_log_line_reads_as_its_message() -> None:
    line = "(MainProcess pid=9741) INFO 12-07 15:42:16 [_surface.py:124] kvtriton 0.1.0 on vLLM 0.33.0 (tested)"
    assert log_message(line) == "kvtriton 0.1.0 on vLLM 0.33.0 (tested)"
    assert log_message("no prefix here") == "no prefix here"


def test_make_try_runs_this_module() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^try: \$\(STAMP\)\n\tPYTHONPATH=tests \$\(PY\) -m e2e\.try_on_cpu", makefile, re.MULTILINE)
