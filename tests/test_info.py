"""kvtriton info: the plain memlock verdict and the warm-up line."""

from __future__ import annotations

import json

import pytest

import kvtriton.tools.info as info_module
from kvtriton.tools.cli import main
from kvtriton.tools.info import measure_warmup, memlock_verdict


def test_a_limit_below_the_slab_is_called_too_low_with_both_sizes_and_the_fix() -> None:
    verdict = memlock_verdict(64 * 2**10, 96 * 2**30)
    assert verdict.startswith("TOO LOW to pin a 96.00 GiB slab: the limit is 64.00 KiB")
    assert "ulimit -l unlimited" in verdict


def test_a_limit_above_the_slab_and_an_unlimited_one_are_enough() -> None:
    assert memlock_verdict(2**30, 2**20).startswith("enough: a 1.00 MiB slab fits under the 1.00 GiB limit")
    assert memlock_verdict(None, 2**40) == "unlimited: a slab of any size can be pinned"
    assert memlock_verdict(2**30, None).startswith("slabs up to 1.00 GiB can be pinned")


def test_info_takes_a_slab_size_and_reports_the_verdict(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    import kvtriton.worker.slab as slab_module

    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 8 * 2**20)
    assert main(["info", "--json", "--slab-size", "1GiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memlock_verdict"].startswith("TOO LOW to pin a 1.00 GiB slab: the limit is 8.00 MiB")
    assert report["engine_warmup"] == "not measured: test"


def test_without_cuda_the_warm_up_line_says_why_it_was_not_measured() -> None:
    import torch

    if torch.cuda.is_available():
        assert measure_warmup().endswith("later starts faster)")
    else:
        assert measure_warmup() == "not measured: no CUDA device (the kernels compile only for a GPU)"
