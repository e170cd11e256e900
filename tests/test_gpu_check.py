"""bench/gpu_check.sh --dry-run: every step of the first GPU run rehearsed on CPU, so no typo can waste it.

The GPU machine brings back at most 8 files from $OUT, no deeper than two
folders, and runs about six minutes: the dry run writes exactly the files the
real run writes, every step's own code runs (CUDA skipped, tiny sizes), and
summary.json holds one entry per step with its status, seconds and budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ["preflight", "cuda_tests", "crossover", "kernels", "host_cost"]
FILES = {"summary.json", "preflight.txt", "tests.log", "steps.log", "crossover.json", "kernels.json", "engine.json"}
GPU_RUN_LIMIT_S = 360  # six minutes on an H200, so that a second run fits in a 15-minute lease


def test_the_dry_run_runs_every_step_and_writes_the_files_the_gpu_run_brings_back(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    written = [path.relative_to(out) for path in out.rglob("*") if path.is_file()]
    assert {str(path) for path in written} == FILES
    assert len(written) <= 8 and all(len(path.parts) <= 3 for path in written)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert [step["name"] for step in summary["steps"]] == STEPS
    for step in summary["steps"]:
        assert set(step) >= {"name", "status", "seconds", "budget"}
        assert step["status"] == "ok", step
        assert 0 <= step["seconds"] <= step["budget"]
    assert sum(step["budget"] for step in summary["steps"]) < GPU_RUN_LIMIT_S
    # Each benchmark wrote a complete result with the unambiguous bandwidth field.
    for name in ("crossover", "kernels"):
        record = json.loads((out / f"{name}.json").read_text())
        assert record["complete"] is True and all("bandwidth_GBps" in row for row in record["results"])
    assert json.loads((out / "engine.json").read_text())["real_launch"] is True
    # The one-screen summary is printed last.
    tail = run.stdout.strip().splitlines()[-40:]
    assert any(line.startswith("gpu_check summary (DRY RUN") for line in tail)
    assert tail[-2].strip().startswith("verdict: every step that ran passed")
    assert len(tail[tail.index(next(line for line in tail if line.startswith("gpu_check summary"))) - 1 :]) <= 40


def test_an_unknown_argument_is_refused_naming_it() -> None:
    run = subprocess.run(["bash", str(SCRIPT), "--dryrun"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 2 and "unknown argument --dryrun" in run.stderr


def test_a_step_past_its_budget_a_failing_one_and_a_skipped_one_are_each_recorded_and_the_next_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = (
        f"GPU_CHECK_FUNCTIONS_ONLY=1 source {SCRIPT} --dry-run\n"
        'run_step slow 1 "$OUT/steps.log" sleep 30\n'
        'run_step broken 5 "$OUT/steps.log" false\n'
        'skip absent 7 "no CUDA device"\n'
        'run_step fine 5 "$OUT/steps.log" echo still running\n'
    )
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [(step["name"], step["status"], step["budget"]) for step in steps] == [
        ("slow", "timeout", 1), ("broken", "failed", 5), ("absent", "skipped", 7), ("fine", "ok", 5),
    ]  # fmt: skip
    assert steps[0]["seconds"] < 15  # killed at its budget, not after the 30 s it asked for
    assert steps[1]["detail"] == "exit 1" and steps[2]["detail"] == "no CUDA device"
    assert "still running" in (out / "steps.log").read_text()


def test_without_a_gpu_the_real_run_skips_every_gpu_step_naming_why_and_fails(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stdout[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [(step["name"], step["status"]) for step in steps] == [("preflight", "ok")] + [(name, "skipped") for name in STEPS[1:]]
    assert all("no CUDA device" in step["detail"] for step in steps[1:])
    assert "verdict: INCOMPLETE; skipped: cuda_tests, crossover, kernels, host_cost" in run.stdout
