from __future__ import annotations

import re

import pytest

import torch

import kvtriton.worker.backends as backends_module
import kvtriton.tools.demo as demo_module
import kvtriton.worker.slab as slab_module
from kvtriton.tools.cli import main

SMALL = ["--model", "qwen2.5-7b", "--gpu-blocks", "16", "--capacity", "24MiB", "--requests", "8", "--no-progress"]


def _field(out: str, name: str) -> str:
    match = re.search(rf"^{name}\s+(.*)$", out, re.MULTILINE)
    assert match is not None, f"no {name!r} line in:\n{out}"
    return match.group(1)


@pytest.mark.filterwarnings("ignore::kvtriton.worker.slab.PageableSlabWarning")
def test_demo_replays_requests_with_hits_and_verifies_every_loaded_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-7b: 28 layers" in out
    hits = re.match(r"(\d+\.\d)% \((\d+) of (\d+) prompt chunks\)", _field(out, "hit rate"))
    assert hits is not None and int(hits.group(2)) > 0
    verified = re.match(r"(\d+) loaded blocks, (\d+) mismatched", _field(out, "verified"))
    assert verified is not None and int(verified.group(1)) == int(hits.group(2)) and verified.group(2) == "0"
    assert re.match(r"[1-9]\d* loads, [1-9]\d* stores, 0 failed", _field(out, "jobs"))
    assert "OK: every loaded block matched" in out


@pytest.mark.filterwarnings("ignore::kvtriton.worker.slab.PageableSlabWarning")
@pytest.mark.parametrize(
    "flags",
    [
        ["--layout", "cross_layer", "--policy", "arc", "--block-size-factor", "2"],
        ["--layout", "pages", "--backend", "dma"],
        ["--layout", "flashinfer", "--backend", "triton", "--requests", "3"],
        ["--model", "deepseek-v3", "--layout", "mla", "--capacity", "32MiB"],
    ],
    ids=["cross_layer-arc-f2", "pages-dma", "flashinfer-triton", "mla"],
)
def test_demo_runs_clean_for_other_layouts_policies_and_backends(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *SMALL, *flags]) == 0
    assert "0 mismatched" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::kvtriton.worker.slab.PageableSlabWarning")
def test_demo_exits_nonzero_when_a_loaded_block_differs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def copy_nothing(*args: object, **kwargs: object) -> None:
        """A load that silently moves no bytes."""

    monkeypatch.setattr(backends_module, "scatter_unchecked", copy_nothing)
    # Pinned to the patched torch backend: on a CUDA machine "auto" would pick triton and copy for real.
    assert main(["demo", *SMALL, "--device", "cpu", "--backend", "torch"]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out
    assert "MISMATCH" in captured.err


def test_demo_rejects_impossible_settings_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "deepseek-v3", "--layout", "flash_attn"]) == 2
    assert "caches one latent" in capsys.readouterr().err
    assert main(["demo", *SMALL, "--capacity", "1KiB"]) == 2
    assert "less than one slot" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--capacity", "abc"], "kvtriton demo: error: --capacity: capacity must be a number .*got 'abc'"),
        (["--capacity", "0"], "kvtriton demo: error: --capacity: capacity must be positive, got '0'"),
        (["--capacity", "1KiB"], "kvtriton demo: error: --capacity 1KiB: .*less than one slot"),
        (["--block-size-factor", "100"], "kvtriton demo: error: --capacity 24MiB: .*less than one slot"),
        (["--requests", "0"], "kvtriton demo: error: --requests must be >= 1, got 0"),
    ],
)
def test_demo_bad_values_name_the_flag_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *SMALL, *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_demo_refuses_more_memory_than_the_machine_has_before_allocating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    allocated: list[int] = []

    def build_cache(*args: object) -> list[torch.Tensor]:
        allocated.append(1)
        return []

    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(demo_module, "build_cache", build_cache)
    assert main(["demo", *SMALL, "--capacity", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"kvtriton demo: error: --gpu-blocks 16 and --capacity 1GiB need .* of RAM, .*64.00 MiB", err)
    assert "Traceback" not in err and allocated == []


def test_demo_reports_a_host_slab_refusal_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # RAM shrinks between the demo's check and the slab's own (another process allocated it).
    answers = iter([2**40, 2**20])
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: next(answers))
    assert main(["demo", *SMALL]) == 2
    assert re.search(r"kvtriton demo: error: a slab of .* bytes of RAM are available", capsys.readouterr().err)


def test_demo_reports_an_out_of_memory_gpu_cache_by_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*args: object) -> list[torch.Tensor]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(demo_module, "build_cache", out_of_memory)
    assert main(["demo", *SMALL]) == 2
    assert "kvtriton demo: error: --gpu-blocks 16: CUDA out of memory" in capsys.readouterr().err


def test_demo_help_documents_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ["(default: llama-3-8b)", "(default: flash_attn)", "(default: lru)", "(default: 96MiB)",
                    "(default: auto)", "(default: 40)", "(default: 0)"]:  # fmt: skip
        assert default in out
