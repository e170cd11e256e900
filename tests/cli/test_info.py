"""kvtriton info: the verdicts (memlock for information only), the --slab-size bound and the warm-up line."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvtriton
import kvtriton.cli._info as info_module
from kvtriton.cli._info import (
    MAX_SLAB_BYTES,
    TOO_LOW,
    collect_machine_info,
    measure_warmup,
    memlock_verdict,
    memory_verdict,
    shm_verdict,
    vllm_verdict,
)
from kvtriton.cli._main import main
from kvtriton.integrations._vllm_release import TESTED_VLLM_RELEASES, vllm_release
from kvtriton.worker._slab import MEMLOCK_NOTE
from tests.cli.conftest import usage_error


def test_the_memlock_line_informs_and_never_reads_too_low() -> None:
    # cudaHostRegister is not charged to RLIMIT_MEMLOCK: a limit below the slab neither stops nor allows it.
    below = memlock_verdict(64 * 2**10, 96 * 2**30)
    assert below.startswith("64.00 KiB, below the 96.00 GiB slab (for information: the NVIDIA driver does not charge")
    assert TOO_LOW not in below and "ulimit" not in below
    assert memlock_verdict(2**30, 2**20) == f"1.00 GiB ({MEMLOCK_NOTE})"
    assert memlock_verdict(None, 2**40) == f"unlimited ({MEMLOCK_NOTE})"
    assert memlock_verdict(2**30, None) == f"1.00 GiB ({MEMLOCK_NOTE})"


def test_a_low_memlock_limit_on_a_cuda_machine_does_not_fail_the_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    import kvtriton.worker as worker

    monkeypatch.setattr(worker, "memlock_limit_bytes", lambda: 8 * 2**20)
    monkeypatch.setattr(worker, "mem_available_bytes", lambda: 64 * 2**30)
    real = info_module.collect_machine_info()
    monkeypatch.setattr(info_module, "collect_machine_info", lambda: dataclasses.replace(real, cuda_available=True))
    assert main(["info", "--json", "--slab-size", "1GiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memlock_verdict"].startswith("8.00 MiB, below the 1.00 GiB slab (for information")
    assert report["memory_verdict"] == "enough: a 1.00 GiB slab fits in the 64.00 GiB available"
    assert report["engine_warmup"] == "not measured: test"


def test_a_slab_larger_than_the_available_ram_fails_the_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    import kvtriton.worker as worker

    monkeypatch.setattr(worker, "memlock_limit_bytes", lambda: None)
    monkeypatch.setattr(worker, "mem_available_bytes", lambda: 2**30)
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


@pytest.mark.parametrize(
    ("size", "says", "leaves_out"),
    [
        # the rule, not an internal function
        ("0", "argument --slab-size: capacity must be positive, got '0'", ["invalid", "_argument"]),
        # not printed in 27 digits of TiB
        ("1e30", "argument --slab-size: '1e30' is 1.07e+39 bytes, more than any process can map (128 PiB", ["TiB"]),
    ],
    ids=["zero", "absurd"],
)
def test_a_bad_slab_size_is_refused_naming_the_flag(
    size: str, says: str, leaves_out: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(["info", "--slab-size", size], capsys)
    assert says in err
    assert not [text for text in leaves_out if text in err]


def test_without_cuda_the_warm_up_line_says_why_it_was_not_measured() -> None:
    import torch

    if torch.cuda.is_available():
        assert measure_warmup().endswith("later starts faster)")
    else:
        assert measure_warmup() == "not measured: no CUDA device (the kernels compile only for a GPU)"


def test_the_largest_mappable_slab_size_is_taken(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_module, "measure_warmup", lambda: "not measured: test")
    assert main(["info", "--json", "--slab-size", f"{MAX_SLAB_BYTES}B"]) == 1  # taken, then too large for the RAM
    assert json.loads(capsys.readouterr().out)["memory_verdict"].startswith(TOO_LOW)


def test_info_names_the_versions_of_kvtriton_vllm_torch_triton_and_mooncake() -> None:
    info = collect_machine_info()
    assert info.kvtriton == kvtriton.__version__
    assert info.torch and info.triton and info.mooncake
    release = vllm_release(info.vllm.split()[0])
    assert info.vllm.endswith("(tested)") == (release in TESTED_VLLM_RELEASES)


def test_a_vllm_outside_the_tested_releases_is_named_with_what_the_specs_do() -> None:
    assert vllm_verdict("0.34.0") == "0.34.0 (tested)"
    assert vllm_verdict("0.33.2+cpu") == "0.33.2+cpu (tested)"
    untested = vllm_verdict("0.35.0")
    assert untested.startswith("0.35.0 (untested: kvtriton is tested on 0.33.x, 0.34.x")
    assert "KVTRITON_ALLOW_UNTESTED_VLLM=1" in untested
    assert vllm_verdict("not installed").startswith("not installed")
