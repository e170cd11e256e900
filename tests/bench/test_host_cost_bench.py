"""bench/host_cost.py: the host-cost benchmark runs the current tree and the baseline commit, and records both."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.host_cost import BASELINE_COMMIT, ROOT, main, measure
from kvtriton.worker._backends import DmaCopy
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, TransferPlan


def _baseline_in_history() -> bool:
    """False in a shallow clone or an unpacked archive: the baseline commit cannot be read there."""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{BASELINE_COMMIT}^{{commit}}"],
            capture_output=True,
            check=False,
        )
    except OSError:
        return False
    return found.returncode == 0


@pytest.mark.requires_interpreter
def test_measure_times_submits_of_every_block_count_without_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtriton.kernels._jit.copy_pages as jit_module

    monkeypatch.setattr(jit_module, "launch_copy_pages", jit_module.launch_copy_pages)  # restored after the test
    rows = measure(2, [1, 4], jobs=3, repeats=2, device="cpu")
    assert [row["blocks"] for row in rows] == [1, 4]
    assert all(0 < row["us_per_job"] <= row["median_us_per_job"] for row in rows)


@pytest.mark.requires_interpreter
@pytest.mark.skipif(
    not _baseline_in_history(), reason=f"commit {BASELINE_COMMIT[:12]} is not in this checkout's history"
)
def test_one_run_measures_current_and_baseline_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert (
        main(
            ["--page-tensors", "2", "--blocks", "1", "--jobs", "2", "--repeats", "1", "--device", "cpu", "--name", "t"]
        )
        == 0
    )
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["baseline_commit"] == BASELINE_COMMIT
    (row,) = record["results"]
    assert row["page_tensors"] == 2 and row["blocks"] == 1
    assert row["current_us"] > 0 and row["baseline_us"] > 0 and row["speedup"] == row["baseline_us"] / row["current_us"]


def test_bad_arguments_are_refused_naming_the_value() -> None:
    with pytest.raises(SystemExit, match="--blocks must lie in 1..512, got \\[0\\]"):
        main(["--blocks", "0"])
    with pytest.raises(SystemExit, match="--page-tensors must be even numbers >= 2"):
        main(["--page-tensors", "3"])


def test_the_json_is_rewritten_after_every_case_so_a_cut_off_run_keeps_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.host_cost as module

    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))

    def child(tree: Path, page_tensors: int, block_counts: list[int], *rest: object) -> list[dict[str, float]]:
        del tree, rest
        if page_tensors == 160:
            raise SystemExit("bench/host_cost.py: measuring ... failed")  # the second case cut off
        return [{"us_per_job": 30.0 + blocks, "median_us_per_job": 31.0 + blocks} for blocks in block_counts]

    monkeypatch.setattr(module, "_run_child", child)
    with pytest.raises(SystemExit, match="measuring"):
        main(["--page-tensors", "64", "160", "--blocks", "1", "16", "--real-launch", "--name", "cut"])
    record = json.loads((tmp_path / "cut.json").read_text())
    assert record["complete"] is False and record["real_launch"] is True
    assert [(row["page_tensors"], row["blocks"], row["current_us"], row["goal_us"]) for row in record["results"]] == [
        (64, 1, 31.0, 40.0), (64, 16, 46.0, 40.0),
    ]  # fmt: skip
    # The batch call's arrays beside it, for the page-tensor count measured: one copy per page tensor and pair.
    assert [(row["page_tensors"], row["blocks"], row["copies"]) for row in record["batch_arrays"]] == [
        (64, 1, 64),
        (64, 16, 1024),
    ]
    assert all(0 < row["arrays_us"] <= row["median_arrays_us"] for row in record["batch_arrays"])


def test_the_batch_arrays_timed_are_the_ones_the_dma_backend_hands_its_batch_call() -> None:
    kv = PagedKV.from_tensors([torch.zeros((2, 8, 4, 2, 16), dtype=torch.bfloat16) for _ in range(2)])
    slab = torch.zeros((8, kv.row_bytes), dtype=torch.uint8)
    backend = DmaCopy(kv, slab)
    plan = TransferPlan(TransferDirection.STORE, np.array([5, 2], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    destinations, sources, sizes = backend.batch_arrays(plan)
    pages = kv.byte_pages()
    assert sources.tolist() == [page[block].data_ptr() for page in pages for block in (5, 2)]
    assert destinations.tolist() == [slab[row, offset:].data_ptr() for offset in kv.page_offsets for row in (0, 1)]
    assert sizes.tolist() == [size for size in kv.page_bytes for _ in range(2)]
