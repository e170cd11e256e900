"""kvtriton info: the plain memlock verdict and the warm-up line."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvtriton.tools.info as info_module
from kvtriton.tools.cli import main
from kvtriton.tools.info import measure_warmup, memlock_verdict, memory_verdict, shm_verdict


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
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 64 * 2**30)
    real = info_module.collect_machine_info()
    monkeypatch.setattr(info_module, "collect_machine_info", lambda: dataclasses.replace(real, cuda_available=True))
    assert main(["info", "--json", "--slab-size", "1GiB"]) == 1  # a slab that cannot be pinned fails the check
    report = json.loads(capsys.readouterr().out)
    assert report["memlock_verdict"].startswith("TOO LOW to pin a 1.00 GiB slab: the limit is 8.00 MiB")
    assert report["memory_verdict"] == "enough: a 1.00 GiB slab fits in the 64.00 GiB available"
    assert report["engine_warmup"] == "not measured: test"

    assert main(["info", "--json", "--slab-size", "4MiB"]) == 0
    assert json.loads(capsys.readouterr().out)["memlock_verdict"].startswith("enough: a 4.00 MiB slab")


def test_a_slab_larger_than_the_available_ram_fails_the_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    import kvtriton.worker.slab as slab_module

    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: None)
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 2**30)
    assert main(["info", "--slab-size", "2GiB"]) == 1
    assert "memory verdict    TOO LOW for a 2.00 GiB slab: only 1.00 GiB is available" in capsys.readouterr().out


def test_ram_and_shm_verdicts_name_both_sizes() -> None:
    assert memory_verdict(None, 2**30).startswith("unknown")
    assert memory_verdict(2**31, None) == "2.00 GiB available (pass --slab-size to check a size)"
    assert shm_verdict(None, 2**30).startswith("absent")
    assert shm_verdict(2**31, 2**30) == "enough for the tiering spec: a 1.00 GiB region fits in 2.00 GiB free"
    # The region is the slab plus its 4 KiB header page; a small /dev/shm only matters to the tiering spec.
    small = shm_verdict(2**30, 2**30)
    assert small.startswith(
        "too small for the tiering spec: a 1.00 GiB region (plus its 4 KiB header) does not fit in 1.00 GiB free"
    )
    assert "--shm-size" in small and not small.startswith("TOO LOW")


def test_a_bad_slab_size_names_the_flag_and_the_rule_not_an_internal_function(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["info", "--slab-size", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --slab-size: capacity must be positive, got '0'" in err
    assert "invalid" not in err and "_argument" not in err


def test_without_cuda_the_warm_up_line_says_why_it_was_not_measured() -> None:
    import torch

    if torch.cuda.is_available():
        assert measure_warmup().endswith("later starts faster)")
    else:
        assert measure_warmup() == "not measured: no CUDA device (the kernels compile only for a GPU)"


def test_without_cuda_a_low_memlock_limit_is_named_but_does_not_fail(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    import kvtriton.worker.slab as slab_module

    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 8 * 2**20)
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 64 * 2**30)
    real = info_module.collect_machine_info()
    monkeypatch.setattr(info_module, "collect_machine_info", lambda: dataclasses.replace(real, cuda_available=False))
    assert main(["info", "--json", "--slab-size", "1GiB"]) == 0
    verdict = json.loads(capsys.readouterr().out)["memlock_verdict"]
    assert verdict.startswith("TOO LOW to pin a 1.00 GiB slab")
    assert verdict.endswith("(no CUDA device here: slabs stay pageable, so this matters only on the GPU machine)")
