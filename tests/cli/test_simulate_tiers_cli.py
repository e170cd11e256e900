"""`kvtriton simulate --tier`: the tiered table's figures as vLLM counts them, the answer's config, the mistakes refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtriton.cli._main import main
from kvtriton.cli._simulate._output import stall_lines
from kvtriton.sim import GIB, PRESETS, Stall, TieredReport, TierSpec
from kvtriton.sim._tier_models import TIER_MODELS, TierModel
from tests.cli.conftest import QUICK, SMALL, simulate_json, usage_error

TIERED = [*SMALL, "--gpu-blocks", "120"]
"""The shared small run, in vLLM's call order with a GPU prefix cache of 120 blocks."""
CHUNK = (4 << 20) + 4096
"""llama-3-8b's 32-token block (4 MiB) as the tiered spec's region holds it: its seal's room, padded to 4 KiB."""


def test_the_fs_tier_reports_each_tiers_counts_and_bytes_as_vllms_counters_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(tmp_path, capsys, *TIERED, "--tier", "fs", "--capacities", "1,4")
    assert (record["tier"], record["servers"]) == ("fs", 1)
    assert record["python"] and record["platform"]  # where it ran, as the host-only record says
    points = record["points"]
    assert [(point["policy"], point["host_bytes"]) for point in points] == [
        (policy, gib << 30) for policy in ("lru", "arc") for gib in (1, 4)
    ]
    for point in points:
        counts = point["counts"]
        assert point["host_blocks"] == point["host_bytes"] // CHUNK
        assert point["bytes_per_chunk"] == point["tier_object_bytes"] == CHUNK
        assert point["tier_write_bytes"] == counts["cascaded_chunks"] * CHUNK
        assert point["tier_read_bytes"] == counts["promotions"] * CHUNK
        assert point["tier_fill_bytes"] == counts["tier_chunks"] * CHUNK
        assert counts["tier_evictions"] == 0  # vLLM's fs tier never evicts
        assert point["external_hit_rate"] == point["external_hit_tokens"] / point["external_query_tokens"]
        assert point["tier_chunk_hit_rate"] == counts["tier_chunk_hits"] / counts["tier_chunk_queries"]
        assert counts["tier_chunk_hits"] > 0  # the small host tier misses what the disk still holds
        # fs is bought by what it fills: the cost in tier GiB is the host at 10x plus the disk filled.
        assert point["cost_tier_gib"] == pytest.approx(
            (point["host_bytes"] * 10 + point["tier_fill_bytes"]) / (1 << 30)
        )


def test_the_cheapest_point_of_a_shared_pool_comes_with_its_tiered_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(
        tmp_path,
        capsys,
        *TIERED,
        "--tier",
        "mooncake:8GiB",
        "--capacities",
        "1,4",
        "--servers",
        "2",
        "--target-hit-rate",
        "0.2",
    )
    answer = record["recommendation"]
    assert answer["reached"] is True
    point = answer["point"]
    reaching = [each for each in record["points"] if each["external_hit_rate"] >= 0.2]
    assert point["cost_tier_gib"] == min(each["cost_tier_gib"] for each in reaching)
    # Two servers' host memory at 10x a pool GiB, plus the 8 GiB pool they share.
    assert point["cost_tier_gib"] == pytest.approx(2 * point["host_bytes"] / (1 << 30) * 10 + 8)
    assert point["tier_object_bytes"] == CHUNK + 64  # Mooncake's value carries a seal of its own
    config = answer["kv_connector_extra_config"]
    assert config["spec_name"] == "KVTritonTieringOffloadingSpec"
    assert config["cpu_bytes_to_use"] == point["host_bytes"]
    assert config["eviction_policy"] == point["policy"]
    (tier,) = config["secondary_tiers"]
    assert (tier["type"], tier["module_path"]) == ("MooncakeStoreTier", "kvtriton.integrations.mooncake")


def test_a_tier_registered_in_the_simulator_is_a_tier_choice_from_its_help_to_its_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backend the command did not know, whose pool evicts as Mooncake's does (tests/sim/test_tier_models.py
    # gives one a store model of its own).
    ram = TierModel(
        name="ram",
        help="a shared DRAM pool of SIZE",
        heading="a shared DRAM pool",
        store=TIER_MODELS["mooncake"].store,
        vllm_config={"type": "RamTier", "module_path": "example.ram"},
        bought_as="a DRAM pool of {size}",
        deployment="pool:      {size} of DRAM",
        sized=True,
    )
    monkeypatch.setitem(TIER_MODELS, "ram", ram)
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal's width
    assert "--tier fs|mooncake[:SIZE]|ram[:SIZE]" in help_text
    assert "'ram:SIZE' (a shared DRAM pool of SIZE), or 'ram' to sweep its size" in help_text

    flags = ["--tier", "ram:8GiB", "--capacities", "1,4", "--target-hit-rate", "0.2"]
    record = simulate_json(tmp_path, capsys, *TIERED, *flags)
    assert record["tier"] == "ram 8.00 GiB"
    assert record["recommendation"]["kv_connector_extra_config"]["secondary_tiers"] == [dict(ram.vllm_config)]
    assert main(["simulate", *TIERED, *flags, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "then a shared DRAM pool" in printed and "pool:      8.00 GiB of DRAM" in printed


def test_the_tiered_answer_serves_with_the_scheduler_limits_it_was_simulated_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--tier", "fs", "--capacities", "1,4", "--target-hit-rate", "0.01"]
    limits = ["--max-num-seqs", "4", "--max-num-batched-tokens", "1024"]
    assert main(["simulate", *TIERED, *flags, *limits, "--out", str(tmp_path)]) == 0
    assert (
        "vllm serve <model> --block-size 32 --tensor-parallel-size 1 --max-num-batched-tokens 1024 --max-num-seqs 4"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tier", "nfs"], "tier must be fs, mooncake or mooncake:SIZE (e.g. mooncake:64GiB), got 'nfs'"),
        (["--tier", "fs", "--servers", "0"], "argument --servers: expected a positive integer, got '0'"),
        (["--tier-sizes", "1GiB"], "--tier-sizes applies with --tier (fs or mooncake)"),
        (["--tier", "fs", "--call-order", "kvtriton"], "--tier models vLLM's tiered offloading"),
    ],
)
def test_a_tiered_mistake_is_refused_naming_the_flag_and_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    # argparse exits on a value it cannot parse; the command returns 2 on flags that do not go together.
    try:
        status = main(["simulate", *TIERED, *flags, "--out", str(tmp_path)])
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_a_mooncake_run_of_one_long_point_prints_progress_lines_counted_in_requests_as_it_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One (policy, host, pool) point: progress counted in points would print one line, at the very end.
    flags = ["--workload", "system-prompts", "--requests", "80", "--block-size", "32", "--gpu-blocks", "120"]
    one_point = ["--tier", "mooncake:8GiB", "--capacities", "1", "--policies", "lru", "--servers", "2"]
    assert main(["simulate", *flags, *one_point, "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().err.splitlines()
    bars = [line for line in lines if line.startswith("simulate (requests) [")]
    done = [int(line.split("] ")[1].split("/")[0]) for line in bars]
    assert len(bars) >= 10, lines  # a line per tenth of the requests, as the host-only sweep's bar prints its points
    assert all(line.split("] ")[1].split()[0].endswith("/160") for line in bars)  # 2 servers x 80 requests
    assert done == sorted(done) and done[0] < 160 // 2 and done[-1] == 160


def test_no_progress_silences_the_tiered_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    simulate_json(tmp_path, capsys, *TIERED, "--tier", "mooncake:8GiB", "--capacities", "1", "--policies", "lru")
    assert "simulate (requests)" not in capsys.readouterr().err


@pytest.mark.parametrize("arrivals", ["burst", "concurrency:4", "rate:0.5", "4"])
def test_each_arrival_pattern_prints_tier_columns_that_add_up_to_the_rows_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arrivals: str
) -> None:
    """host hit + tier hit is vLLM hit, and the host tier's loads are every loaded chunk, whatever the arrivals."""
    record = simulate_json(
        tmp_path, capsys, *TIERED, "--tier", "fs", "--capacities", "1,4", "--max-num-seqs", "4", "--arrivals", arrivals
    )
    for point in record["points"]:
        counts = point["counts"]
        loaded = counts["host_loaded_chunks"] + counts["tier_loaded_chunks"]
        assert loaded * 32 == point["external_hit_tokens"] > 0
        assert point["host_load_bytes"] == loaded * (4 << 20)  # a 4 MiB row per loaded chunk
        assert point["host_served_rate"] + point["tier_served_rate"] == pytest.approx(point["external_hit_rate"])
        assert point["host_served_rate"] > 0  # the host tier served loads, and its column says so


@pytest.mark.parametrize(
    ("value", "message"),
    [("concurrency:0", "concurrency:N (N >= 1)"), ("rate:-1", "got 'rate:-1'"), ("poisson", "expected burst")],
)
def test_a_bad_arrival_pattern_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    assert message in usage_error(["simulate", *TIERED, "--arrivals", value, "--out", str(tmp_path)], capsys)


def test_a_stalled_point_says_which_request_never_ran_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--workload", "chat", "--requests", "100", "--tier", "mooncake:2GiB", "--capacities", "0.25,0.5"]
    assert main(["simulate", *flags, "--policies", "lru", *QUICK, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stalled: a request waited 1000 steps and never ran; vLLM 0.33's engine" in out
    assert (
        "  LRU, host 256.00 MiB, mooncake 2.00 GiB: request 'chat-38-turn-2' (90 chunks of prompt) fits the host"
        " tier's 127 chunks, but its own promotions evicted chunks it had already found, step after step" in out
    )
    assert "LRU ranks a waiting request's chunks by when it was first seen" in out
    assert "a neighbouring size may not stall" in out
    record = json.loads((tmp_path / "simulate-chat-tiered.json").read_text())
    stalled, ran = record["points"]
    assert stalled["stalled"] and stalled["stall"]["req_id"] == "chat-38-turn-2"
    assert not ran["stalled"] and ran["stall"] is None


def test_a_prompt_larger_than_the_host_tier_is_told_the_host_memory_it_needs() -> None:
    geometry = PRESETS["llama-3-8b"]
    report = TieredReport(
        policy="arc", servers=1, host_bytes=GIB // 4, host_blocks=127, tier=TierSpec("fs"), stalled=True,
        external_query_tokens=0, external_hit_tokens=0, counts=None, bytes_per_chunk=geometry.tiered_chunk_bytes,
        tier_object_bytes=geometry.tiered_chunk_bytes, host_evictions=0, host_load_bytes=0, host_store_bytes=0,
        stall=Stall("r7", prompt_chunks=145, host_chunks=127, own_evictions=12),
    )  # fmt: skip
    (_, line) = stall_lines([report], geometry)
    assert line == (
        "  ARC, host 256.00 MiB, fs: request 'r7' (145 chunks of prompt) does not fit the host tier's 127 chunks:"
        " promoting the rest of it evicts what was promoted before; give each server at least 290.57 MiB of host"
        " memory"
    )
