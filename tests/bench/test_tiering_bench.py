"""bench/tiers.py runs both primaries through the same fs tier and records what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from bench import tiers


@pytest.mark.parametrize("primary", tiers.PRIMARIES)
def test_a_pass_cascades_every_chunk_and_promotes_every_chunk_back(primary: str, tmp_path: Path) -> None:
    result = tiers.run_pass(primary, 64 << 10, 6, 4, tmp_path / "fs", 1, first_key=100)
    assert (result.primary, result.chunks, result.chunk_bytes) == (primary, 6, 64 << 10)
    assert result.cascade_s > 0 and result.promotion_s > 0
    files = sorted((tmp_path / "fs").rglob("*.bin"))
    # kvtriton's files are its sealed chunks: the 64 KiB, then a page holding the seal (docs/tiers.md, Integrity).
    sealed = {"kvtriton": (64 << 10) + 4096}.get(primary, 64 << 10)
    assert len(files) == 6 and all(path.stat().st_size == sealed for path in files)


def test_main_prints_the_ratio_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert (
        tiers.main(
            ["--chunk-mib", "0.0625", "--total-mib", "1", "--repeats", "1", "--threads", "1", "--root", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "kvtriton/vLLM ratio" in out and "primary-tier calls alone" in out
    assert "goal >= 0.95 met" in out or "goal >= 0.95 NOT met" in out
    record = json.loads((tmp_path / "tiers.json").read_text())
    assert record["smoke_run"] is False and isinstance(record["goal_met"], bool)
    assert [(row["chunk_bytes"], row["direction"]) for row in record["results"]] == [
        (65536, "cascade"),
        (65536, "promotion"),
    ]
    assert record["machine"] and record["command"].startswith("python -m bench.tiers")
    assert set(record["bookkeeping_us_per_chunk"]) == {"vllm", "kvtriton"}
    assert [path.name for path in tmp_path.iterdir()] == ["tiers.json"]  # the fs root it made is gone


def test_a_quick_run_is_a_smoke_run_without_a_verdict_in_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    assert tiers.main(["--quick", "--chunk-mib", "0.25", "--threads", "1", "--root", str(tmp_path)]) == 0
    captured = capfd.readouterr()
    assert "smoke run (--quick, 16 MiB, 1 pass): no verdict" in captured.out
    assert "met" not in captured.out
    record = json.loads((tmp_path / "tiers-quick.json").read_text())
    assert record["smoke_run"] is True and record["goal_met"] is None
    assert not (tmp_path / "tiers.json").exists()  # the full-size result is never overwritten by a smoke run
    # vLLM's expected warnings (python-only build, out-of-tree spec) are not part of the output.
    output = captured.out + captured.err
    assert "vllm._C" not in output and "out-of-tree" not in output


def test_chunk_sizes_that_o_direct_cannot_use_are_refused() -> None:
    with pytest.raises(SystemExit, match="multiples of 4 KiB"):
        tiers.main(["--chunk-mib", "0.001"])


@pytest.mark.parametrize("primary", tiers.PRIMARIES)
def test_the_primarys_own_calls_are_timed_per_chunk(primary: str) -> None:
    cost = tiers.measure_bookkeeping(primary, 64, 8)
    assert cost.primary == primary
    assert cost.write_us > 0 and cost.read_us > 0 and cost.lookup_us > 0


@pytest.mark.parametrize("variant", tiers.STEP_VARIANTS)
def test_a_step_round_times_every_step_and_cascades_every_chunk_when_there_is_a_tier(
    variant: str, tmp_path: Path
) -> None:
    round_ = tiers.measure_steps(variant, 64 << 10, 2, 3, 0.0, tmp_path / "fs", 1, first_key=500)
    assert (round_.variant, len(round_.step_ms), round_.refused_steps) == (variant, 3, 0)
    assert all(ms > 0 for ms in round_.step_ms)
    files = sorted((tmp_path / "fs").rglob("*.bin"))
    # Three steps of two chunks, each cascaded (and sealed: 64 KiB and a page for the seal) where there is a tier.
    on_disk = variant.startswith("fs-")
    assert [path.stat().st_size for path in files] == ([(64 << 10) + 4096] * 6 if on_disk else [])


def test_an_unknown_step_variant_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'fs-sealed-twice'"):
        tiers.measure_steps("fs-sealed-twice", 64 << 10, 1, 1, 0.0, tmp_path, 1, first_key=0)


def test_the_steps_mode_writes_each_variants_median_and_range_to_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    argv = ["--steps", "--quick", "--step-chunk-mib", "0.0625", "--step-pause-ms", "0", "--threads", "1"]
    assert tiers.main([*argv, "--root", str(tmp_path)]) == 0
    assert "scheduler thread's time in the manager per step" in capsys.readouterr().out
    record = json.loads((tmp_path / "tiers_steps-quick.json").read_text())
    assert record["smoke_run"] is True and (record["steps"], record["rounds"], record["batch"]) == (6, 1, 2)
    assert [row["variant"] for row in record["variants"]] == list(tiers.STEP_VARIANTS)
    for row in record["variants"]:
        assert row["low_ms"] <= row["median_ms"] <= row["high_ms"] and row["refused_steps"] == 0
        assert len(record["step_ms"][row["variant"]]) == 1 and len(record["step_ms"][row["variant"]][0]) == 6
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiers_steps-quick.json"]  # no tiers.json, no fs root
