"""bench/gpu_check.sh --dry-run: every step of the first GPU run rehearsed on CPU, so no typo can waste it.

The GPU machine brings back at most 8 files from $OUT, no deeper than two
folders, and runs at most five minutes: the dry run writes exactly the files
the real run writes, every step's own code runs (CUDA skipped, tiny sizes)
under the GPU machine's package set (bench/gpu_machine_imports.py), and
summary.json holds one entry per step with its status, seconds and budget. The skip decisions are driven here from hand-written pre-flight
findings: only a piece found missing skips a step, never one not checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ["preflight", "cuda_tests", "fp8_tests", "crossover", "kernels", "host_cost"]
FILES = {"summary.json", "preflight.txt", "tests.log", "steps.log", "crossover.json", "kernels.json", "host_cost.json"}
FP8_COLD_ESTIMATE_S = 40
"""The fp8 step's worst estimate: 24 fp8 variants compiled from an empty Triton cache."""
PREFLIGHT_COLD_ESTIMATE_S = 25
"""The pre-flight's worst estimate on a cold disk (the 1 GiB pins and the shared region's view)."""
KERNELS_ESTIMATE_S = 45
"""The kernels step's worst estimate."""
GPU_RUN_LIMIT_S = 300  # start-up takes 2-4 minutes of a 15-minute lease: a run, a fix and a second run must fit


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
    assert sum(step["budget"] for step in summary["steps"]) <= GPU_RUN_LIMIT_S
    # Each benchmark wrote a complete result with the unambiguous bandwidth field.
    for name in ("crossover", "kernels"):
        record = json.loads((out / f"{name}.json").read_text())
        assert record["complete"] is True and all("bandwidth_GBps" in row for row in record["results"])
    engine = json.loads((out / "host_cost.json").read_text())
    assert engine["real_launch"] is True and engine["complete"] is True
    # The pre-flight pinned (pageably, in a dry run) and launched the copy kernel, and each pytest run is counted.
    preflight = (out / "preflight.txt").read_text()
    assert "pin 64 MiB" in preflight and "pin 1 GiB" in preflight and "information only" in preflight
    assert "pin region 1 GiB" in preflight and " in 9 registrations (rank 0 of 8" in preflight
    # Every step ran where only the GPU machine's packages import.
    assert "packages             the GPU machine's set only" in preflight
    assert "2 pages x 4 blocks copied exactly" in preflight or "triton launch        skipped (dry run" in preflight
    tests_log = (out / "tests.log").read_text()
    assert "== cuda_tests (budget" in tests_log and "== fp8_tests (budget" in tests_log
    assert "tests (cuda_tests): " in run.stdout and "tests (fp8_tests): " in run.stdout
    # The kernel bench measured the 32 KiB headline size first.
    assert json.loads((out / "kernels.json").read_text())["results"][0]["page_bytes"] == 32 * 1024
    # The one-screen summary is printed last.
    tail = run.stdout.strip().splitlines()[-40:]
    assert any(line.startswith("gpu_check summary (DRY RUN") for line in tail)
    assert tail[-2].strip().startswith("verdict: every step that ran passed")
    assert len(tail[tail.index(next(line for line in tail if line.startswith("gpu_check summary"))) - 1 :]) <= 40


def test_an_unknown_argument_is_refused_naming_it() -> None:
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dryrun"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
    )
    assert run.returncode == 2 and "unknown argument --dryrun" in run.stderr


def test_a_step_past_its_budget_a_failing_one_and_a_skipped_one_are_each_recorded_and_the_next_runs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    script = (
        f"GPU_CHECK_FUNCTIONS_ONLY=1 source {SCRIPT} --dry-run\n"
        'run_step slow 1 "$OUT/steps.log" sleep 30\n'
        'run_step broken 5 "$OUT/steps.log" false\n'
        'skip absent 7 "no CUDA device"\n'
        'run_step fine 5 "$OUT/steps.log" echo still running\n'
    )
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
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
    run = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 1, run.stdout[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [(step["name"], step["status"]) for step in steps] == [("preflight", "ok")] + [
        (name, "skipped") for name in STEPS[1:]
    ]
    assert all("no CUDA device" in step["detail"] for step in steps[1:])
    assert "verdict: INCOMPLETE; skipped: cuda_tests, fp8_tests, crossover, kernels, host_cost" in run.stdout


def _decide(tmp_path: Path, env_lines: str | None, dry_run: bool = False) -> dict[str, str]:
    """gpu_check.sh's skip decisions for these pre-flight findings (None: no env file, the pre-flight was cut off)."""
    env_file = tmp_path / "preflight.env"
    if env_lines is not None:
        env_file.write_text(env_lines)
    script = (
        f"GPU_CHECK_FUNCTIONS_ONLY=1 source {SCRIPT} {'--dry-run' if dry_run else ''}\n"
        f"read_preflight {env_file}\n"
        "decide_skips\n"
        'printf "gpu=%s\\nbench=%s\\ntests=%s\\n" "$gpu_missing" "$bench_missing" "$tests_missing"\n'
        "missing SHM_OK && echo shm=missing || echo shm=tried\n"
    )
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    return dict(line.split("=", 1) for line in run.stdout.splitlines())


def test_a_pre_flight_cut_off_before_it_wrote_anything_skips_nothing(tmp_path: Path) -> None:
    assert _decide(tmp_path, None) == {"gpu": "", "bench": "", "tests": "", "shm": "tried"}
    # Cut off after the imports: what it found is used, what it never reached is tried.
    assert _decide(tmp_path, "PF_TORCH=1\nPF_PYTEST=1\nPF_HYP") == {"gpu": "", "bench": "", "tests": "", "shm": "tried"}


def test_only_a_piece_found_missing_skips_the_steps_that_need_it(tmp_path: Path) -> None:
    keys = ("TORCH", "PYTEST", "HYPOTHESIS", "KERNELS", "CUDA", "SHM_OK", "PIN_SMALL", "PIN_LARGE")
    found = "".join(f"PF_{key}=1\n" for key in keys)
    assert _decide(tmp_path, found) == {"gpu": "", "bench": "", "tests": "", "shm": "tried"}
    no_cuda = _decide(tmp_path, found.replace("PF_CUDA=1", "PF_CUDA=0"))
    assert no_cuda["gpu"].startswith("no CUDA device") and no_cuda["bench"] == no_cuda["tests"] == no_cuda["gpu"]
    no_pin = _decide(tmp_path, found.replace("PF_PIN_SMALL=1", "PF_PIN_SMALL=0"))
    assert no_pin["gpu"].startswith("pinning a 64 MiB slab failed")
    assert no_pin["bench"] == no_pin["tests"] == no_pin["gpu"]
    # 1 GiB refused: the benchmarks that pin that much skip; the tests and the host cost (small slabs) still run.
    no_large_pin = _decide(tmp_path, found.replace("PF_PIN_LARGE=1", "PF_PIN_LARGE=0"))
    assert no_large_pin["gpu"] == no_large_pin["tests"] == ""
    assert no_large_pin["bench"].startswith("pinning a 1 GiB slab failed")
    no_pytest = _decide(tmp_path, found.replace("PF_PYTEST=1", "PF_PYTEST=0"))
    assert no_pytest["tests"] == "pytest or hypothesis does not import" and no_pytest["gpu"] == no_pytest["bench"] == ""
    assert _decide(tmp_path, found.replace("PF_SHM_OK=1", "PF_SHM_OK=0"))["shm"] == "missing"


def test_a_dry_run_is_not_gated_on_cuda_or_pinning_and_stray_lines_are_neither_run_nor_read(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    lines = "PF_TORCH=1\nPF_CUDA=0\nPF_PIN_SMALL=0\nPF_PIN_LARGE=0\nPF_KERNELS=0x\n"
    lines += f"touch {marker}\nPF_TORCH=0 touch {marker}\n"
    assert _decide(tmp_path, lines, dry_run=True) == {"gpu": "", "bench": "", "tests": "", "shm": "tried"}
    assert not marker.exists()


def test_every_step_budget_and_the_total_are_spelled_out_and_add_up() -> None:
    text = SCRIPT.read_text()
    budgets = {name: int(value) for name, value in re.findall(r"^BUDGET_([A-Z0-9_]+)=(\d+)$", text, re.M)}
    total = budgets.pop("TOTAL")
    assert set(budgets) == {name.upper() for name in STEPS}
    assert sum(budgets.values()) <= total <= GPU_RUN_LIMIT_S
    # Headroom over the estimates for an H100 host with an empty Triton cache (bench/gpu_check.sh's header): the
    # fp8 step compiles 24 variants in 28-40 s, the pre-flight pins up to 25 s on a cold disk, kernels <= 45 s.
    assert budgets["FP8_TESTS"] >= 1.25 * FP8_COLD_ESTIMATE_S
    assert budgets["PREFLIGHT"] >= 1.25 * PREFLIGHT_COLD_ESTIMATE_S
    assert budgets["KERNELS"] >= 1.25 * KERNELS_ESTIMATE_S
    assert "--continue-on-collection-errors" in text  # one file that fails to collect loses its own cases only
