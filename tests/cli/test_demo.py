from __future__ import annotations

import re

import pytest
import torch

import kvtriton.cli._demo as demo_module
import kvtriton.worker
import kvtriton.worker._backends as backends_module
import kvtriton.worker._engine as engine_module
import kvtriton.worker._slab as slab_module
from kvtriton.cli._main import main
from kvtriton.manager import policy_names
from kvtriton.worker._layout import PagedKV
from tests.cli.conftest import usage_error

SMALL = ["--model", "qwen2.5-7b", "--gpu-blocks", "16", "--capacity", "24MiB", "--requests", "8", "--no-progress"]


def _field(out: str, name: str) -> str:
    match = re.search(rf"^{name}\s+(.*)$", out, re.MULTILINE)
    assert match is not None, f"no {name!r} line in:\n{out}"
    return match.group(1)


def _blocks_verified(out: str) -> int:
    """The loaded blocks the demo's ``verified`` line counts, after checking that none of them mismatched."""
    verified = re.fullmatch(r"(\d+) loaded blocks, 0 mismatched", _field(out, "verified"))
    assert verified is not None, _field(out, "verified")
    return int(verified.group(1))


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_demo_replays_requests_with_hits_and_verifies_every_loaded_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-7b: 28 layers" in out
    hits = re.match(r"(\d+\.\d)% \((\d+) of (\d+) prompt chunks\)", _field(out, "hit rate"))
    assert hits is not None and int(hits.group(2)) > 0
    assert _blocks_verified(out) == int(hits.group(2))
    assert re.match(r"[1-9]\d* loads, [1-9]\d* stores, 0 failed", _field(out, "jobs"))
    assert "OK: every loaded block matched" in out


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
@pytest.mark.parametrize(
    "flags",
    [
        ["--layout", "cross_layer", "--policy", "arc", "--block-size-factor", "2"],
        ["--layout", "pages", "--backend", "dma"],
        ["--layout", "flashinfer", "--backend", "triton", "--requests", "3"],
        ["--model", "deepseek-v3", "--layout", "mla", "--capacity", "32MiB"],
        ["--model", "deepseek-v3", "--capacity", "32MiB"],  # the default layout follows the model
    ],
    ids=["cross_layer-arc-f2", "pages-dma", "flashinfer-triton", "mla", "mla-by-default"],
)
def test_demo_runs_clean_for_other_layouts_policies_and_backends(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *SMALL, *flags]) == 0
    assert "0 mismatched" in capsys.readouterr().out


COMPRESSED_SMALL = [
    *SMALL[:-3],
    "--requests",
    "4",
    "--no-progress",
    "--device",
    "cpu",
    "--backend",
    "torch",
    "--compression",
    "fp8-e4m3",
]
"""Four requests (three system prompts: one repeats), on the CPU torch path: the compressed torch path is slow."""


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_compressed_demo_checks_loads_against_the_reference_and_reports_bytes_slots_and_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", *COMPRESSED_SMALL]) == 0
    out = capsys.readouterr().out
    assert "compression fp8-e4m3: 462.00 KiB per slab row (0.516x); LOSSY" in out
    assert _blocks_verified(out) > 0
    moved = re.match(r".* = (\d\.\d+)x the .* uncompressed rows", _field(out, "bytes moved"))
    assert moved is not None and moved.group(1) == "0.516"  # 462 KiB of 896 KiB per block, loads and stores alike
    slots = re.match(r"(\d+) for --capacity, (\d\.\d+)x the (\d+) uncompressed", _field(out, "slots"))
    assert slots is not None and (int(slots.group(1)), int(slots.group(3))) == (24 * 1024 // 462, 24 * 1024 // 896)
    error = re.match(r"max \|x - x'\| ([\d.e+-]+), mean ([\d.e+-]+) ", _field(out, "element error"))
    assert (
        error is not None and 0 < float(error.group(2)) < float(error.group(1)) < 1
    )  # N(0, 1) values, 3 mantissa bits
    assert "note: LOSSY" in out
    assert "OK: every loaded block matched the torch reference's dequantized bytes (fp8-e4m3, lossy)" in out


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
@pytest.mark.parametrize(
    "flags",
    # Pinned to the patched torch backend: on a CUDA machine "auto" would pick triton and copy for real.
    [[*SMALL, "--device", "cpu", "--backend", "torch"], COMPRESSED_SMALL],
    ids=["plain", "compressed"],
)
def test_demo_exits_nonzero_when_a_load_writes_other_bytes_than_the_reference(
    flags: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def copy_nothing(*args: object, **kwargs: object) -> None:
        """A load that silently moves (or decodes) nothing."""

    monkeypatch.setattr(backends_module, "scatter_unchecked", copy_nothing)
    assert main(["demo", *flags]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "MISMATCH" in captured.err


def test_compressed_content_differs_block_by_block_after_quantization() -> None:
    """Blocks whose pool slices coincide (serials 64 apart) still differ once dequantized: the stamp survives."""
    tensors = demo_module.build_cache(demo_module.PRESETS["qwen2.5-7b"], "flash_attn", 2, torch.device("cpu"))
    kv = PagedKV.from_tensors(tensors, layout="flash_attn", kv_compression="fp8-e4m3")
    content = demo_module.BlockContent(kv, seed=0)
    hashes = [bytes([index]) for index in range(65)]
    for block_hash in hashes:  # serials 0..64 in order
        content.row(block_hash)
    differ = (content.row(hashes[0]) != content.row(hashes[64])).nonzero().flatten()
    stamps = torch.tensor([byte for offset in kv.page_offsets for byte in range(offset, offset + 64)])
    assert differ.numel() > 0 and bool(
        torch.isin(differ, stamps).all()
    )  # same pool slice: only the stamps tell the originals apart
    first, later = content.expected(hashes[0]), content.expected(hashes[64])
    assert not torch.equal(first, later)
    assert not torch.equal(first, content.row(hashes[0]))  # lossy: the round trip changed values
    assert all(bool(torch.isfinite(page.float()).all()) for page in kv.pages)


def test_compression_refuses_the_byte_view_layout_by_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--layout", "pages", "--compression", "fp8-e4m3"]) == 2
    err = capsys.readouterr().err
    assert "kvtriton demo: error: --compression fp8-e4m3" in err and "--layout pages" in err


def test_demo_rejects_impossible_settings_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "deepseek-v3", "--layout", "flash_attn"]) == 2
    assert "caches one latent" in capsys.readouterr().err
    assert main(["demo", "--model", "llama-3-8b", "--layout", "mla"]) == 2
    assert capsys.readouterr().err == (
        "kvtriton demo: error: --layout mla caches one latent per token, but --model llama-3-8b caches K and V"
        " (use flash_attn, flashinfer, cross_layer or pages, or an MLA model: deepseek-v3)\n"
    )
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

    monkeypatch.setattr(kvtriton.worker, "mem_available_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(demo_module, "build_cache", build_cache)
    assert main(["demo", *SMALL, "--capacity", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"kvtriton demo: error: --gpu-blocks 16 and --capacity 1GiB need .* of RAM, .*64.00 MiB", err)
    assert "Traceback" not in err and allocated == []


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(None, 96 * 2**20), ("1.5", 3 * 2**29), ("24MiB", 24 * 2**20), ("2G", 2 * 2**30)],
    ids=["default-of-make-demo", "bare-number-is-gib", "mib", "g"],
)
def test_demo_capacity_follows_the_command_line_unit_rule(capacity: str | None, expected: int) -> None:
    from kvtriton.cli._main import build_parser

    argv = ["demo"] if capacity is None else ["demo", "--capacity", capacity]
    config = demo_module.DemoConfig.from_args(build_parser().parse_args(argv))
    assert config.capacity_bytes == expected


def test_a_bare_capacity_too_large_for_the_machine_reminds_that_bare_numbers_are_gib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtriton.worker, "mem_available_bytes", lambda: 256 * 2**20)
    assert main(["demo", *SMALL, "--capacity", "96"]) == 2
    err = capsys.readouterr().err
    assert "--capacity 96 need" in err and "(a bare --capacity is GiB: write e.g. 96MiB for MiB)" in err
    # With a unit there is nothing to remind.
    assert main(["demo", *SMALL, "--capacity", "96GiB"]) == 2
    assert "bare" not in capsys.readouterr().err


def test_demo_reports_a_host_slab_refusal_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # RAM shrinks between the demo's check and the slab's own (another process allocated it).
    monkeypatch.setattr(kvtriton.worker, "mem_available_bytes", lambda: 2**40)  # the demo's check
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 2**20)  # the slab's own
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
    for default in ["(default: llama-3-8b)", "(default: auto)", "(default: lru)", "(default: 96MiB)",
                    "(default: auto)", "(default: 40)", "(default: 0)"]:  # fmt: skip
        assert default in out


def _recording_slab_class() -> tuple[type[slab_module.HostSlab], list[slab_module.HostSlab], list[bool]]:
    """A HostSlab subclass that remembers every slab built and the ``allow_pageable`` it was given."""
    slabs: list[slab_module.HostSlab] = []
    allow_pageable_given: list[bool] = []

    class RecordingSlab(slab_module.HostSlab):
        def __init__(self, num_slots: int, block_size_factor: int, row_bytes: int, pin: bool | None = None,
                     *, allow_pageable: bool = False) -> None:  # fmt: skip
            allow_pageable_given.append(allow_pageable)
            super().__init__(num_slots, block_size_factor, row_bytes, pin, allow_pageable=allow_pageable)
            slabs.append(self)

    return RecordingSlab, slabs, allow_pageable_given


def test_a_slab_that_cannot_be_pinned_stops_the_demo_with_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class UnpinnableSlab(slab_module.HostSlab):
        def __init__(self, *args: int, allow_pageable: bool = False) -> None:
            raise slab_module.SlabPinningError(
                "cannot pin the 25165824-byte host slab; RLIMIT_MEMLOCK is 8388608 bytes"
            )

    monkeypatch.setattr(kvtriton.worker, "HostSlab", UnpinnableSlab)
    assert main(["demo", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtriton demo: error: --capacity 24MiB: cannot pin the 25165824-byte host slab")
    assert err.rstrip().endswith("(here: --allow-pageable)") and err.count("\n") == 1


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_allow_pageable_reaches_the_slab(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    recording_slab, _, allow_pageable_given = _recording_slab_class()
    monkeypatch.setattr(kvtriton.worker, "HostSlab", recording_slab)
    assert main(["demo", *SMALL, "--requests", "2"]) == 0
    assert main(["demo", *SMALL, "--requests", "2", "--allow-pageable"]) == 0
    assert allow_pageable_given == [False, True]
    assert "OK: every loaded block matched" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_an_engine_the_slab_cannot_serve_is_refused_by_flag_and_the_slab_is_closed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> engine_module.TransferEngine:
        raise ValueError("backend='triton' needs a pinned slab on CUDA; pin the slab or use backend='dma'")

    recording_slab, slabs, _ = _recording_slab_class()
    monkeypatch.setattr(kvtriton.worker, "HostSlab", recording_slab)
    monkeypatch.setattr(kvtriton.worker, "TransferEngine", refuse)
    assert main(["demo", *SMALL, "--backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtriton demo: error: --backend triton: backend='triton' needs a pinned slab")
    assert "Traceback" not in err
    assert len(slabs) == 1 and slabs[0].closed


def test_every_choice_flag_takes_its_names_in_any_case() -> None:
    from kvtriton.cli._main import build_parser

    args = build_parser().parse_args([
        "demo", "--model", "Qwen2.5-7B", "--layout", "FLASH_ATTN", "--compression", "NONE", "--policy", "ARC",
        "--backend", "Torch", "--device", "CPU",
    ])  # fmt: skip
    config = demo_module.DemoConfig.from_args(args)
    assert (config.geometry.name, config.layout, config.policy, config.backend, config.device) == (
        "qwen2.5-7b", "flash_attn", "arc", "torch", "cpu",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "NOSUCH"], f"argument --policy: expected one of {', '.join(policy_names())}, got 'NOSUCH'"),
        (["--layout", "paged"], "expected one of auto, flash_attn, flashinfer, mla, cross_layer, pages, got 'paged'"),
        (["--device", "gpu"], "argument --device: expected one of auto, cpu, cuda, got 'gpu'"),
    ],
)
def test_a_bad_choice_names_the_flag_and_lists_the_names(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in usage_error(["demo", *flags], capsys)


def test_the_default_layout_follows_the_model() -> None:
    assert demo_module.default_layout(demo_module.PRESETS["deepseek-v3"]) == "mla"
    assert demo_module.default_layout(demo_module.PRESETS["llama-3-8b"]) == "flash_attn"


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_rates_are_in_gb_per_second_as_in_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert re.match(r"\d+\.\d\d MiB at \d+\.\d\d GB/s$", _field(out, "loaded"))
    assert "MiB/s" not in out


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_a_run_that_loads_nothing_verified_nothing_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--requests", "1"]) == 1
    out = capsys.readouterr().out
    assert _blocks_verified(out) == 0
    assert "NOTHING VERIFIED: no request found a stored chunk" in out and "OK" not in out


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_triton_on_a_cpu_says_it_runs_the_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--device", "cpu", "--backend", "triton", "--requests", "3"]) == 0
    assert demo_module.INTERPRETER_NOTE in capsys.readouterr().err
    assert main(["demo", *SMALL, "--device", "cpu", "--backend", "torch", "--requests", "3"]) == 0
    assert "interpreter" not in capsys.readouterr().err
