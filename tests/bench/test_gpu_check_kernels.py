"""bench/kernels.py --gpu-check and kernels_dev/compiled_variants.py.

The headline size first, the fp8 gather by program count, and the registers and spills of each compiled variant.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import bench.kernels as kernels_module
from bench.kernels import Result, base_method, fp8_ratios, main, time_round_robin
from kernels_dev.compiled_variants import describe_variant, format_variant, variant_records
from tests.worker.cuda_stand_in import RecordingCuda

KiB = 1024


def _result(method: str, seconds: float, programs: int | None, kernel: str = "gather") -> Result:
    return Result(kernel, method, 32 * KiB, 256, 32, "consecutive", "random", "sweep", seconds, 1.0, 1.0, programs)


def test_every_fp8_method_is_compared_with_its_plain_counterpart_at_its_own_program_count() -> None:
    names = ("triton-fp8-p32", "triton-fp8", "torch-fp8", "dma", "triton-p32", "dma-2d")
    assert [base_method(name) for name in names] == ["triton", "triton", "torch", "dma", "triton", "dma-2d"]
    results = [
        _result("triton", 1.0, 16), _result("triton-fp8", 2.0, 16), _result("triton-fp8-p32", 1.25, 32),
        _result("triton-fp8-p64", 1.0, 64), _result("dma", 3.0, None), _result("triton", 1.0, 16, kernel="scatter"),
    ]  # fmt: skip
    ratios = fp8_ratios(results)
    assert [(r.kernel, r.method, r.fp8_method, r.programs, r.ratio) for r in ratios] == [
        ("gather", "triton", "triton-fp8", 16, 0.5), ("gather", "triton", "triton-fp8-p32", 32, 0.8),
        ("gather", "triton", "triton-fp8-p64", 64, 1.0),
    ]  # fmt: skip


def test_the_gpu_check_run_measures_the_headline_size_first_with_the_loop_there_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    args = ["--gpu-check", "--device", "cpu", "--page-kib", "4", "32", "--blocks", "8", "--layers", "1"]
    args += ["--repeats", "1", "--no-plot"]
    assert main([*args, "--compression", "fp8-e4m3", "--name", "k"]) == 0
    record = json.loads((tmp_path / "k.json").read_text())
    rows = record["results"]
    assert rows[0]["page_bytes"] == 32 * KiB and {row["page_bytes"] for row in rows} == {4 * KiB, 32 * KiB}
    assert {row["page_bytes"] for row in rows if row["method"] == "loop"} == {32 * KiB}
    # CPU: no Triton method, and the trimmed run times no torch reference.
    assert {row["method"] for row in rows} == {"dma", "dma-2d", "loop", "contiguous"}
    assert all(row["programs"] is None for row in rows) and "compiled_variants" not in record
    assert record["errors"] == []


def test_a_method_that_cannot_be_prepared_or_fails_when_timed_loses_its_own_row_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    real_dma = kernels_module._dma  # pyright: ignore[reportPrivateUsage] -- the preparation under test

    def dma(fixture: kernels_module.Fixture, to_slab: bool, batched: bool) -> Callable[[], object]:
        if batched:
            raise RuntimeError("CUDA error: operation not supported on the legacy stream\nsecond line")
        run = real_dma(fixture, to_slab, batched)
        if to_slab:
            return run

        def fail_when_timed() -> None:
            raise ValueError("scatter failed")

        return fail_when_timed

    monkeypatch.setattr(kernels_module, "_dma", dma)
    args = ["--gpu-check", "--device", "cpu", "--page-kib", "4", "--blocks", "8", "--layers", "1", "--repeats", "2"]
    assert main([*args, "--no-plot", "--name", "k"]) == 0
    record = json.loads((tmp_path / "k.json").read_text())
    assert record["complete"] is True
    assert {(row["kernel"], row["method"]) for row in record["results"]} == {
        ("gather", "dma-2d"), ("gather", "loop"), ("gather", "contiguous"), ("scatter", "loop"),
        ("scatter", "contiguous"),
    }  # fmt: skip
    assert [(error["kernel"], error["method"], error["error"]) for error in record["errors"]] == [
        ("gather", "dma", "RuntimeError: CUDA error: operation not supported on the legacy stream"),
        ("scatter", "dma", "RuntimeError: CUDA error: operation not supported on the legacy stream"),
        ("scatter", "dma-2d", "ValueError: scatter failed"),
    ]


def test_on_cuda_every_method_runs_and_is_timed_on_a_stream_of_its_own_never_the_legacy_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA refuses cudaMemcpyBatchAsync on the legacy default stream (handle 0): the dma method died there.
    cuda = RecordingCuda()
    cuda.install(monkeypatch)
    streams: dict[str, list[int]] = {"dma": [], "triton": []}

    def method(name: str) -> Callable[[], object]:
        def run() -> None:
            stream = cuda.current_stream()
            streams[name].append(stream.cuda_stream)
            stream.enqueue(name)

        return run

    timings, errors = time_round_robin({name: method(name) for name in streams}, 3, torch.device("cuda", 0))
    assert errors == {} and set(timings) == set(streams)
    assert all(len(handles) == 4 and 0 not in handles for handles in streams.values())  # warm-up and 3 repeats


def test_a_program_count_below_one_is_refused_naming_it() -> None:
    with pytest.raises(SystemExit, match=r"--fp8-programs must be >= 1, got \[16, 0\]"):
        main(["--gpu-check", "--device", "cpu", "--fp8-programs", "16", "0"])


class _Metadata:
    num_warps = 4
    shared = 0


class _Function:
    arg_names = ["table_ptr", "slab_ptr", "TO_SLAB", "CHUNK"]


class _Source:
    fn = _Function()
    constants = {(2,): True, (3,): 2048, "extra": 1}


class _Compiled:
    metadata = _Metadata()
    src = _Source()

    def __init__(self, regs: int | None) -> None:
        if regs is not None:  # Triton sets them when it loads the binary, at the first launch
            self.n_regs = regs
            self.n_spills = 0


class _JITFunction:
    device_caches = {0: ({"key-a": _Compiled(40), "key-b": _Compiled(None)}, object(), object())}


def test_each_compiled_variant_is_listed_with_its_registers_spills_and_constants() -> None:
    records = variant_records("copy_pages", _JITFunction())
    assert records == [
        {"kernel": "copy_pages", "num_warps": 4, "shared_bytes": 0, "n_regs": 40, "n_spills": 0,
         "constants": {"TO_SLAB": "True", "CHUNK": "2048", "extra": "1"}},
        {"kernel": "copy_pages", "num_warps": 4, "shared_bytes": 0, "n_regs": None, "n_spills": None,
         "constants": {"TO_SLAB": "True", "CHUNK": "2048", "extra": "1"}},
    ]  # fmt: skip
    shown = format_variant(records[0], ("TO_SLAB", "CHUNK"))
    assert shown == "copy_pages  regs 40  spills 0  warps 4  TO_SLAB=True CHUNK=2048"
    assert variant_records("copy_pages", object()) == [] and describe_variant("x", object())["n_regs"] is None
