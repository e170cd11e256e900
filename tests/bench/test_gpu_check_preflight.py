"""bench/gpu_preflight.py: a real pin decides, memlock only informs, each finding is on disk as soon as it is known."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_preflight import (
    PIN_PROBE_BYTES,
    REGION_RANK_ROW_BYTES,
    Preflight,
    launch_tiny_copy,
    main,
    memlock_text,
    probe_pin,
    probe_region_pin,
)
from kvtriton._region_rows import block_row_stride
from kvtriton.worker._slab import PIN_CHUNK_BYTES, SlabPinningError


class _Slab:
    closed = 0

    def close(self) -> None:
        _Slab.closed += 1


def test_a_pin_that_works_reports_its_rate_and_frees_the_slab() -> None:
    asked: list[tuple[int, int, int, bool]] = []

    def make_slab(num_slots: int, block_size_factor: int, row_bytes: int, pin: bool) -> _Slab:
        asked.append((num_slots, block_size_factor, row_bytes, pin))
        return _Slab()

    before = _Slab.closed
    probe = probe_pin(64 << 20, True, make_slab)
    assert probe.error is None and probe.nbytes == 64 << 20 and probe.seconds > 0
    assert probe.bandwidth_GBps == pytest.approx((64 << 20) / probe.seconds / 1e9)
    assert asked == [(64, 1, 1 << 20, True)] and _Slab.closed == before + 1


def test_a_refused_pin_is_reported_in_words_not_raised() -> None:
    def refuse(num_slots: int, block_size_factor: int, row_bytes: int, pin: bool) -> _Slab:
        del num_slots, block_size_factor, row_bytes, pin
        raise SlabPinningError("cannot pin the 1073741824-byte host slab (cudaErrorMemoryAllocation)")

    probe = probe_pin(1 << 30, True, refuse)
    assert probe.error == "SlabPinningError: cannot pin the 1073741824-byte host slab (cudaErrorMemoryAllocation)"


def test_a_real_host_slab_left_pageable_is_probed_the_same_way() -> None:
    probe = probe_pin(PIN_PROBE_BYTES["PIN_SMALL"], False)
    assert probe.error is None and probe.nbytes == 64 << 20


def test_a_pin_whose_import_fails_reports_the_missing_module_instead_of_stopping_the_pre_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The GPU machine lacks packages the CPU machine has: an import that fails there is a finding, by name.
    monkeypatch.setitem(sys.modules, "kvtriton.worker", None)
    for probe in (probe_pin(64 << 20, False), probe_region_pin(1 << 30, False)):
        assert probe.error is not None and probe.error.startswith("ModuleNotFoundError: import of kvtriton.worker")


def test_the_region_view_is_pinned_as_whole_rows_in_pieces_of_at_most_a_gib() -> None:
    probe = probe_region_pin(1 << 30, False)  # pageable: the registrations are the ones a pin would make
    rows = (1 << 30) // REGION_RANK_ROW_BYTES // 16 * 16
    assert probe.error is None and probe.nbytes == rows * REGION_RANK_ROW_BYTES
    # A rank registers whole rows (the other seven ranks' bytes of them too), a whole number of 16-row chunks per
    # registration of at most 1 GiB: 102 chunks of 83.9 MB, 12 to a piece, in 9 pieces (one per row before).
    chunk_bytes = 16 * block_row_stride(16, 8, REGION_RANK_ROW_BYTES)
    assert probe.registrations == -(-(rows // 16) // (PIN_CHUNK_BYTES // chunk_bytes)) == 9


@pytest.mark.parametrize("nbytes", [0, (1 << 20) + 1])
def test_a_size_that_is_not_whole_rows_is_refused_naming_it(nbytes: int) -> None:
    with pytest.raises(ValueError, match=f"nbytes must be a positive multiple of 1048576, got {nbytes}"):
        probe_pin(nbytes, False)


def test_memlock_is_information_only_whatever_its_value() -> None:
    assert memlock_text(resource.RLIM_INFINITY).startswith("unlimited (information only")
    assert memlock_text(8 << 20) == (
        "8388608 bytes (information only: cudaHostRegister is not charged to it; the pins below decide)"
    )


def test_each_finding_is_appended_to_the_env_file_the_moment_it_is_known(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tmp_path / "preflight.env"
    preflight = Preflight(env, dry_run=True)
    assert preflight.check("TORCH", "torch", lambda: "2.11.0")
    assert env.read_text() == "PF_TORCH=1\n"

    def missing() -> str:
        raise ModuleNotFoundError("No module named 'hypothesis'")

    assert not preflight.check("HYPOTHESIS", "hypothesis", missing)
    assert env.read_text() == "PF_TORCH=1\nPF_HYPOTHESIS=0\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["torch", "2.11.0"]
    assert lines[1].startswith("hypothesis")
    assert lines[1].endswith("MISSING: ModuleNotFoundError: No module named 'hypothesis'")


@pytest.mark.requires_interpreter
def test_the_tiny_launch_copies_two_pages_exactly_through_the_interpreter_on_cpu() -> None:
    assert launch_tiny_copy(torch.device("cpu")).endswith("2 pages x 4 blocks copied exactly")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tiny_launch_compiles_on_a_gpu() -> None:
    assert launch_tiny_copy(torch.device("cuda", 0)).startswith("compiled and launched in")


@pytest.mark.requires_interpreter
def test_a_dry_run_finds_everything_but_cuda_and_pins_pageably(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tmp_path / "preflight.env"
    assert main([str(env), "--dry-run"]) == 0
    found = dict(line.split("=") for line in env.read_text().splitlines())
    assert found["PF_TORCH"] == found["PF_PYTEST"] == found["PF_KERNELS"] == "1"
    assert found["PF_PIN_SMALL"] == found["PF_PIN_LARGE"] == found["PF_PIN_REGION"] == found["PF_TRITON_LAUNCH"] == "1"
    out = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert found["PF_CUDA"] == "0" and "(dry run: pageable, not pinned)" in out
        assert "interpreted (dry run: nothing compiled)" in out
