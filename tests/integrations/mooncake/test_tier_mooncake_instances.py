"""Two serving instances share a prefix through Mooncake; a third with another layout only misses.

Each instance is its own process (tests/mooncake_fixtures/instance.py): vLLM's
Scheduler and OffloadingConnector, kvtriton's tiered spec with a private host
primary, and the Mooncake tier, all with the same namespace. The first serves
a prompt and its chunks cascade to Mooncake; the second, with an empty primary,
serves the same prompt from Mooncake without computing it, bit-exact; a third
with two blocks per chunk (the same block hashes and chunk size, another byte
layout) computes everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from mooncake_fixtures.instance import FULL_BLOCKS
from tiering_fixtures.tiered_vllm import BLOCK_SIZE, HEAD_SIZE, LAYERS, TieredVLLM, kv_spec

TESTS_DIR = Path(__file__).resolve().parents[2]
INSTANCE_TIMEOUT_S = 120


def start_instance(
    cluster: MooncakeCluster, tmp_path: Path, name: str, blocks_per_chunk: int, go_file: Path | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / f"{name}.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 -- handed to the child, closed right after the spawn
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake_fixtures.instance",
                cluster.master_address,
                "shared",
                str(blocks_per_chunk),
                str(out),
                *([str(go_file)] if go_file else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    finally:
        log.close()
    return process, out


def finish(process: subprocess.Popen[bytes], out: Path, name: str) -> dict[str, Any]:
    try:
        code = process.wait(INSTANCE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    log = out.with_name(f"{name}.log").read_text(errors="replace")
    assert code == 0, f"instance {name} failed:\n{log[-4000:]}"
    return cast("dict[str, Any]", json.loads(out.read_text()))


def expected_hex(index: int) -> list[str]:
    """The bytes the simulated model writes into prompt block ``index`` of each layer (rank 0), as hex."""
    shape = torch.Size((2, BLOCK_SIZE, kv_spec(1).num_kv_heads, HEAD_SIZE))
    return [TieredVLLM.pattern(0, index, name, shape).numpy().tobytes().hex() for name in LAYERS]


def test_a_second_instance_serves_the_first_ones_prefix_from_mooncake_and_another_layout_only_misses(
    cluster: MooncakeCluster, tmp_path: Path
) -> None:
    # All three start at once (vLLM's start-up is the slow part); the second and third serve once the first is done.
    go = tmp_path / "first-is-done"
    first_process, first_out = start_instance(cluster, tmp_path, "first", 1)
    second_process, second_out = start_instance(cluster, tmp_path, "second", 1, go)
    third_process, third_out = start_instance(cluster, tmp_path, "third", 2, go)
    try:
        first = finish(first_process, first_out, "first")
    finally:
        go.touch()
    assert first["computed"] == list(range(FULL_BLOCKS)) and first["load_jobs"] == 0
    assert first["stats"]["stored_keys"] == FULL_BLOCKS and first["stats"]["store_failed_keys"] == 0

    second = finish(second_process, second_out, "second")
    third = finish(third_process, third_out, "third")

    assert second["digest"] == first["digest"]
    assert second["load_jobs"] >= 1 and second["computed"] == []  # the whole prefix came from Mooncake
    assert second["blocks"] == [expected_hex(index) for index in range(FULL_BLOCKS)]  # bit-exact
    assert second["stats"]["loaded_keys"] == FULL_BLOCKS and second["stats"]["load_failed_keys"] == 0

    assert third["digest"] != first["digest"]
    assert third["stats"]["lookup_hits"] == 0 and third["load_jobs"] == 0
    assert third["computed"] == list(range(FULL_BLOCKS))  # recomputed: nothing of the other layout was loaded
