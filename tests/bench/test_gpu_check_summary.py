"""bench/gpu_summary.py: the last screen of bench/gpu_check.sh, from complete, cut-off and missing result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_summary import kernel_lines, main, pytest_runs, summary_lines

KiB = 1024
STEPS = ["preflight", "cuda_tests", "fp8_tests", "crossover", "kernels", "host_cost"]

COMPLETE_RUN = """== cuda_tests (budget 90 s)
tests/worker/test_engine_cuda.py::test_store[cuda] PASSED [ 50%]
tests/worker/test_engine_cuda.py::test_load[cuda] FAILED [100%]
=========================== short test summary info ============================
FAILED tests/worker/test_engine_cuda.py::test_load[cuda] - AssertionError
==================== 1 failed, 1 passed, 3 deselected in 4.20s =================
== cuda_tests: failed after 5.0 s (exit 1)
"""
CUT_OFF_RUN = """== fp8_tests (budget 45 s)
tests/kernels/test_compression.py::test_every_dtype[cuda-bf16] PASSED [ 10%]
tests/kernels/test_compression.py::test_every_dtype[cuda-fp16] FAILED [ 20%]
tests/kernels/test_compression.py::test_every_dtype[cuda-fp32] PASSED [ 30%]
== fp8_tests: timeout after 45.0 s (exit 124)
"""


def test_each_pytest_run_is_counted_and_one_cut_off_is_counted_from_its_verbose_lines() -> None:
    assert pytest_runs(COMPLETE_RUN + CUT_OFF_RUN) == [
        ("cuda_tests", "1 failed, 1 passed, 3 deselected", ["tests/worker/test_engine_cuda.py::test_load[cuda]"]),
        (
            "fp8_tests",
            "cut off after 2 passed, 1 failed",
            ["tests/kernels/test_compression.py::test_every_dtype[cuda-fp16]"],
        ),
    ]
    nothing = pytest_runs("== cuda_tests (budget 90 s)\ncollecting ...\n")
    assert nothing == [("cuda_tests", "no test finished (see tests.log)", [])]


def _row(
    kernel: str, method: str, page: int, ratio: float, gbps: float, programs: int | None = None
) -> dict[str, object]:
    return {"kernel": kernel, "method": method, "page_bytes": page, "blocks": 256, "vs_contiguous": ratio,
            "bandwidth_GBps": gbps, "programs": programs}  # fmt: skip


def _kernels(complete: bool) -> dict[str, object]:
    results: list[dict[str, object]] = []
    ratios: list[dict[str, object]] = []
    for page in (32 * KiB, 4 * KiB, 16 * KiB, 64 * KiB):
        for kernel in ("gather", "scatter"):
            results += [_row(kernel, "triton", page, 0.9, 45.0, 16), _row(kernel, "dma", page, 0.8, 40.0)]
            results += [_row(kernel, "triton-p32", page, 0.95, 47.0, 32), _row(kernel, "dma-2d", page, 0.7, 35.0)]
            results.append(_row(kernel, "contiguous", page, 1.0, 50.0))
            counts = (16, 32, 64) if kernel == "gather" else (16,)
            for count in counts:
                ratio = 0.8 + count / 1000
                ratios.append({"kernel": kernel, "method": "triton", "page_bytes": page, "programs": count,
                               "ratio": ratio})  # fmt: skip
    results.append(_row("gather", "loop", 32 * KiB, 0.05, 2.5))
    variants = [
        {"kernel": "copy_pages", "n_regs": 40, "n_spills": 0},
        {"kernel": "compress_pages", "n_regs": 128, "n_spills": 8},
    ]  # fmt: skip
    errors = [{"kernel": "scatter", "method": "dma", "page_bytes": 64 * KiB, "error": "CudaRuntimeError: boom"}]
    return {"complete": complete, "results": results, "fp8_vs_plain": ratios, "compiled_variants": variants,
            "errors": errors}  # fmt: skip


def test_kernel_lines_put_fp8_beside_plain_triton_at_each_program_count_and_flag_spills() -> None:
    lines = kernel_lines(_kernels(complete=False))
    assert lines[0].startswith("  kernels (INCOMPLETE: cut off): x contiguous copy (triton GB/s), 256 blocks;")
    assert lines[1:4] == [
        "    page     kernel          triton   t@32    dma dma-2d   loop  fp8@16  fp8@32  fp8@64",
        "    32 KiB   gather     0.90 (45.0)   0.95   0.80   0.70   0.05    0.82    0.83    0.86",
        "    32 KiB   scatter    0.90 (45.0)   0.95   0.80   0.70      -    0.82       -       -",
    ]  # the run's order (the headline size first), the loop where it was measured, fp8 scatter at 16 programs only
    assert [line.split()[0] for line in lines[2:10:2]] == ["32", "4", "16", "64"]
    assert lines[-2] == (
        "    1 method run(s) FAILED (errors in kernels.json), the first: dma scatter 64 KiB: CudaRuntimeError: boom"
    )
    assert lines[-1] == "    2 compiled variants: regs 40-128, SPILLS in 1 (compiled_variants in kernels.json)"


def _write(out: Path, name: str, record: object) -> None:
    (out / name).write_text(json.dumps(record))


def _full_run(out: Path, statuses: dict[str, str]) -> None:
    steps = [
        {"name": name, "status": statuses.get(name, "ok"), "seconds": 10.0, "budget": 60, "detail": "exit 0"}
        for name in STEPS
    ]
    _write(out, "summary.json", {"dry_run": False, "steps": steps})
    (out / "preflight.txt").write_text(
        "== preflight (budget 60 s)\npython               3.12.3\n"
        "torch                2.11.0\ntriton               3.6.0\n"
        "gpu                  NVIDIA H200 (CUDA 12.8, 1 device(s))\n"
        "memlock (ulimit -l)  8388608 bytes (information only)\n"
        "pin 64 MiB           12.0 GB/s\npin 1 GiB            11.0 GB/s\n"
        "pin region 1 GiB     8.0 GB/s (1632 registrations)\n"
        "triton launch        compiled and launched in 2.0 s\n"
    )
    failures = "".join(f"FAILED tests/kernels/test_kernels_gather.py::test_{n}[cuda] - boom\n" for n in range(5))
    (out / "tests.log").write_text(
        "== cuda_tests (budget 90 s)\n"
        + failures
        + "============ 5 failed, 90 passed in 80.00s ============\n"
        + CUT_OFF_RUN
    )
    _write(out, "crossover.json", {
        "complete": False, "crossover_page_bytes": {"store/random": 16 * KiB, "store/runs": None},
        "auto_table_rows": {
            "store": "no dma row for store (triton wins at some size with some pattern)", "load": "AutoRule(...)",
        },
        "verdict_page_bytes": [8 * KiB, 16 * KiB],
    })  # fmt: skip
    _write(out, "kernels.json", _kernels(complete=True))
    _write(out, "host_cost.json", {"complete": True, "results": [
        {"page_tensors": 64, "blocks": 1, "current_us": 30.0, "goal_us": 40.0},
        {"page_tensors": 64, "blocks": 256, "current_us": 41.0, "goal_us": 40.0},
        {"page_tensors": 160, "blocks": 1, "current_us": 50.0, "goal_us": 60.0},
    ], "batch_arrays": [
        {"page_tensors": 64, "blocks": 1, "arrays_us": 3.0}, {"page_tensors": 64, "blocks": 256, "arrays_us": 90.5},
    ]})  # fmt: skip


def test_a_full_gpu_run_with_failures_and_a_cut_off_crossover_fits_one_screen(tmp_path: Path) -> None:
    _full_run(tmp_path, {"fp8_tests": "timeout"})
    lines, status = summary_lines(tmp_path)
    assert status == 1 and len(lines) <= 40
    text = "\n".join(lines)
    assert "  gpu                  NVIDIA H200" in text and "  pin 1 GiB            11.0 GB/s" in text
    assert "  torch 2.11.0, triton 3.6.0\n" in text and "(total 60.0 s of 360)" in text
    assert "  python" not in text and "memlock" not in text  # the screen keeps what decides, preflight.txt has the rest
    assert "tests (cuda_tests): 5 failed, 90 passed" in text
    assert "tests (fp8_tests): cut off after 2 passed, 1 failed" in text
    assert sum(line.startswith("    FAILED ") for line in lines) == 3 and "(+3 more in tests.log)" in text
    assert (
        "crossover (INCOMPLETE: cut off; verdict from 8 KiB-16 KiB pages): dma faster from store/random 16 KiB, "
        "store/runs never"
    ) in text
    assert "    AUTO_TABLE store: no dma row for store" in text
    assert "    64 page tensors: 1 blk 30.0, 256 blk 41.0 (40.0)  MISSED; batch arrays 3.0/90.5" in text
    assert "  pin region 1 GiB     8.0 GB/s (1632 registrations)" in text
    assert "    160 page tensors: 1 blk 50.0 (60.0)  met" in text
    assert lines[-2] == "  verdict: FAILED: fp8_tests" and lines[-1].startswith("====")


def test_a_skipped_step_on_a_gpu_run_is_incomplete_and_a_missing_file_is_left_out(tmp_path: Path) -> None:
    _full_run(tmp_path, {"kernels": "skipped"})
    (tmp_path / "kernels.json").unlink()
    lines, status = summary_lines(tmp_path)
    assert status == 1 and not any(line.startswith("  kernels:") for line in lines)
    assert lines[-2] == "  verdict: INCOMPLETE; skipped: kernels (see each step's reason above)"


def test_nothing_written_yet_still_prints_a_verdict_and_a_bad_call_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == "  verdict: every step that ran passed"
    assert main([]) == 2
    assert capsys.readouterr().err == "usage: python -m bench.gpu_summary OUT\n"
