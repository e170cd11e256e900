"""`kvtriton simulate --engines N`: the fleet's record and lines, every engine's `vllm serve` line as vLLM parses
it, the knee, the progress bar, and the mistakes refused naming the flag and the value."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvtriton.cli._main import main
from tests.cli.conftest import SMALL, simulate_json
from tests.cli.test_simulate_serve_line import parse_with_vllm, serve_argv

FLEET = [*SMALL, "--gpu-blocks", "120", "--max-num-seqs", "4", "--arrivals", "concurrency:2", "--capacities", "1"]
"""The shared small run (80 requests, 32-token blocks) on engines of 120 GPU blocks and 1 GiB of host memory each."""
POOLS = ["--tier-sizes", "1GiB,8GiB", "--policies", "lru"]


def test_the_record_holds_each_engines_counts_which_add_up_to_the_fleets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(tmp_path, capsys, *FLEET, *POOLS, "--engines", "3", "--target-hit-rate", "0.01")
    assert (record["engines"], record["router"], record["affinity_blocks"], record["tier"]) == (
        3,
        "round-robin",
        None,
        "mooncake",  # --engines shares a Mooncake pool when --tier is not given
    )
    assert record["requests_per_engine"] == [27, 27, 26]  # round robin over 80 requests
    assert [point["tier"]["capacity_bytes"] for point in record["points"]] == [1 << 30, 8 << 30]
    for point in record["points"]:
        engines = point["engines"]
        assert [engine["requests"] for engine in engines] == record["requests_per_engine"]
        for name in ("prompt_tokens", "gpu_hit_tokens", "host_hit_tokens", "pool_hit_tokens", "computed_tokens"):
            assert sum(engine[name] for engine in engines) == point[name], name
        assert point["host_hit_tokens"] == point["counts"]["host_loaded_chunks"] * 32
        assert point["pool_hit_tokens"] == point["counts"]["tier_loaded_chunks"] * 32
        assert point["hit_share"] == pytest.approx(1 - point["computed_tokens"] / point["prompt_tokens"])
        assert point["servers"] == 3
    knees = record["pool_knee"]
    assert knees["within_points"] == 1.0 and "within_points percentage points of the largest" in knees["rule"]
    (knee,) = knees["knees"]
    shares = {point["tier"]["capacity_bytes"]: point["hit_share"] for point in record["points"]}
    assert knee["largest_pool_bytes"] == 8 << 30 and knee["largest_hit_share"] == shares[8 << 30]
    smallest_within = min(size for size, share in shares.items() if 100 * (shares[8 << 30] - share) <= 1.0)
    assert knee["pool_bytes"] == smallest_within
    assert record["recommendation"]["reached"] and record["recommendation"]["pool_bytes"] in shares


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test installs it)")
def test_every_engine_gets_a_vllm_serve_line_that_vllms_parser_reads_as_the_modelled_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*FLEET, *POOLS, "--engines", "3", "--router", "prefix-affinity", "--affinity-blocks", "2"]
    assert main(["simulate", *flags, "--target-hit-rate", "0.01", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "simulate-system-prompts-fleet.json").read_text())
    assert (record["router"], record["affinity_blocks"]) == ("prefix-affinity", 2)
    headers = re.findall(r"^# engine (\d+) of 3 \((\d+) requests routed to it\)$", printed, re.MULTILINE)
    routed: list[int] = record["requests_per_engine"]
    assert [(int(engine), int(requests)) for engine, requests in headers] == list(enumerate(routed))
    # Each engine's line, as a shell reads it from its comment on.
    sections = printed.split("\n# engine ")[1:]
    lines = [serve_argv(section) for section in sections]
    assert len(lines) == 3
    extra = record["recommendation"]["kv_connector_extra_config"]
    assert extra["secondary_tiers"][0]["type"] == "MooncakeStoreTier"
    for engine in parse_with_vllm(lines):
        assert engine["kv_connector_extra_config"] == extra
        for name, value in record["engine_args"].items():
            if value is not None:
                assert engine[name] == value, name
        assert (engine["num_gpu_blocks_override"], engine["max_num_seqs"]) == (120, 4)
    pool = record["recommendation"]["pool_bytes"]
    size = f"{pool / 2**30:.2f} GiB"
    assert f"a Mooncake pool of {size}" in printed and f"adding up to {size}" in printed


def test_the_lines_name_the_routing_each_engine_and_the_knee(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*FLEET, *POOLS, "--engines", "2", "--router", "prefix-affinity"]
    assert main(["simulate", *flags, "--target-hit-rate", "0.01", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "fleet     2 engines behind prefix-affinity (a hash of the prompt's first 4 blocks picks the engine)" in printed
    )
    assert "shared by 2 engines" in printed
    assert "pool size that stops paying: the smallest pool whose hit share is within 1 point of the largest" in printed
    assert re.search(r"^  LRU, host 1\.00 GiB per engine: \d", printed, re.MULTILINE)
    table = printed.split("per engine at LRU")[1]
    assert re.search(r"^\s+0\s+\d+", table, re.MULTILINE) and re.search(r"^\s+1\s+\d+", table, re.MULTILINE)
    assert re.search(r"^\s+fleet\s+80\s", table, re.MULTILINE)


def test_a_fleet_of_one_engine_prints_the_single_engine_tiered_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiered = simulate_json(tmp_path, capsys, *FLEET, "--tier", "mooncake", *POOLS, "--target-hit-rate", "0.01")
    fleet = simulate_json(tmp_path, capsys, *FLEET, "--engines", "1", *POOLS, "--target-hit-rate", "0.01")
    for single, one in zip(tiered["points"], fleet["points"], strict=True):
        assert {name: one[name] for name in single} == single


def test_a_long_fleet_run_prints_progress_counted_in_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*FLEET, "--tier-sizes", "8GiB", "--policies", "lru", "--engines", "2"]
    flags.remove("--no-progress")
    assert main(["simulate", *flags, "--json", "--out", str(tmp_path)]) == 0
    bars = [line for line in capsys.readouterr().err.splitlines() if line.startswith("simulate (requests) [")]
    assert len(bars) >= 10 and bars[-1].split("] ")[1].startswith("80/80")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engines", "0"], "argument --engines: expected a positive integer, got '0'"),
        (["--engines", "2", "--router", "random"], "argument --router: expected one of round-robin, prefix-affinity, got 'random'"),
        (["--engines", "2", "--router", "prefix-affinity", "--affinity-blocks", "0"], "argument --affinity-blocks: expected a positive integer, got '0'"),
        (["--router", "prefix-affinity"], "--router routes a fleet's requests: it applies with --engines N"),
        (["--affinity-blocks", "8"], "--affinity-blocks routes a fleet's requests: it applies with --engines N"),
        (["--engines", "2", "--affinity-blocks", "8"], "--affinity-blocks 8 is the prefix the prefix-affinity router hashes; it does not apply to --router round-robin"),
        (["--engines", "2", "--tier", "fs"], "--engines shares one pool with a capacity; --tier fs has none: give --tier mooncake[:SIZE]"),
        (["--engines", "2", "--servers", "2"], "--servers 2 gives each server a request stream of its own; --engines 2 routes one trace to N engines: give one of them"),
        (["--engines", "2", "--call-order", "kvtriton"], "--engines models the vLLM server: it applies to --call-order vllm, not kvtriton"),
        (["--engines", "2", "--tier", "mooncake:1MiB"], "a Mooncake pool of 1.00 MiB holds no chunk of"),
    ],
)  # fmt: skip
def test_a_fleet_mistake_is_refused_naming_the_flag_and_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    base: list[str] = [*SMALL, "--capacities", "1", "--policies", "lru", "--tier-sizes", "8GiB"]
    if "--call-order" in flags or "mooncake:1MiB" in flags:
        base = base[:-2]  # neither gets as far as the pool sizes
    try:
        status: Any = main(["simulate", *base, *flags, "--out", str(tmp_path)])
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2
    assert message in capsys.readouterr().err
