"""MooncakeStoreTier when the store breaks: every failure is a miss, bounded by the timeout, never wrong data.

Each test gets its own master and holder (tests/mooncake_fixtures) and breaks
them: kill or hang (SIGSTOP) the master, kill the holder, overfill the pool.
Times are bounds on the failure path with generous slack for a loaded 2-core
machine, not performance goals.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np
from mooncake_fixtures.tiers import Primary, chunk_keys, make_tier, poll, resolve_lookups, run_job
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvtriton.integrations._mooncake_local import LOOPBACK, free_port
from kvtriton.integrations.mooncake import MooncakeStoreTier, MooncakeTierConfig, MooncakeTierMetrics, TierState
from kvtriton.integrations.mooncake._setup_failure import setup_failure_line

CHUNK = 64 * 1024
SLACK_S = 2.0
"""Scheduling slack on top of the tier's timeout on this shared 2-core machine."""
MISS = LookupResult.MISS


def timed(call: object) -> float:
    assert callable(call)
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_a_killed_master_makes_misses_within_the_timeout_and_the_tier_reconnects_when_it_returns(
    own_cluster: MooncakeCluster, own_tiers: list[MooncakeStoreTier]
) -> None:
    memory = Primary(8, CHUNK)
    tier = make_tier(own_cluster.master_address, memory, namespace="killed", timeout_s=5.0, reconnect_interval_s=0.2)
    own_tiers.append(tier)
    keys = chunk_keys(2, salt=10)
    memory.fill([0, 1], seed=10)
    assert run_job(tier, keys, [0, 1], load=False).success

    own_cluster.kill_master()
    started = time.monotonic()
    loaded = run_job(tier, keys, [2, 3], load=True)
    assert time.monotonic() - started < 5.0 + SLACK_S
    assert (loaded.success, loaded.successful_keys) == (False, None)
    assert not memory.rows[2:4].any()
    assert poll(lambda: tier.state if tier.state is TierState.DOWN else None, 5.0 + SLACK_S, "down") is TierState.DOWN

    # vLLM's metrics see the failures as counter increments and the master as down.
    metrics = tier.get_stats().reduce()
    label = "('MooncakeStoreTier',)"
    assert metrics[f"{MooncakeTierMetrics.UP}:{label}"] == 0
    assert metrics[f"{MooncakeTierMetrics.FAILED_OPS}:{label}"] >= 1
    assert f"{MooncakeTierMetrics.FAILED_OPS}:{label}" not in tier.get_stats().reduce()  # reported once

    # While down nothing touches the network: lookups miss and jobs fail at once.
    started = time.monotonic()
    assert resolve_lookups(tier, keys) == [MISS, MISS]
    assert not run_job(tier, keys, [0, 1], load=False).success
    assert time.monotonic() - started < 1.0

    own_cluster.start_master()  # same port: the tier's probe finds it
    poll(lambda: True if tier.state is TierState.UP else None, 10.0 + SLACK_S, "reconnect")
    own_cluster.start_holder()  # the restarted master lost the old holder's segment with its metadata
    fresh = chunk_keys(2, salt=11)
    written = memory.fill([4, 5], seed=11)
    assert poll(lambda: True if run_job(tier, fresh, [4, 5], load=False).success else None, 10.0, "store after return")
    assert run_job(tier, fresh, [6, 7], load=True).success
    assert [memory.chunk(6), memory.chunk(7)] == written
    stats = tier.stats()
    assert stats.reconnects >= 1 and stats.failed_ops >= 2 and stats.failed_op_seconds > 0
    assert stats.load_failed_keys >= 2
    metrics = tier.get_stats().reduce()
    assert (
        metrics[f"{MooncakeTierMetrics.UP}:{label}"] == 1 and metrics[f"{MooncakeTierMetrics.RECONNECTS}:{label}"] >= 1
    )


def test_a_hung_master_bounds_lookups_jobs_drain_and_shutdown_by_the_timeout(own_cluster: MooncakeCluster) -> None:
    timeout_s = 2.0
    memory = Primary(8, CHUNK)
    tier = make_tier(own_cluster.master_address, memory, namespace="hung", timeout_s=timeout_s, io_threads=1)
    keys = chunk_keys(3, salt=12)
    written = memory.fill([0, 1, 2], seed=12)
    assert run_job(tier, keys, [0, 1, 2], load=False).success

    own_cluster.hang_master()
    try:
        started = time.monotonic()
        assert resolve_lookups(tier, keys) == [MISS] * 3
        assert time.monotonic() - started < timeout_s + SLACK_S

        # Three loads on one I/O thread: the first waits out the RPC timeout, the rest fail without waiting again.
        jobs = [
            TransferJob(100 + index, [key], np.array([4 + index]), True, ReqContext(req_id="h"))
            for index, key in enumerate(keys)
        ]
        started = time.monotonic()
        for job in jobs:
            tier.submit_load(job)
        tier.drain_jobs()
        assert time.monotonic() - started < timeout_s + SLACK_S
        results = {result.job_id: result for result in tier.get_finished_jobs()}
        assert sorted(results) == [100, 101, 102] and not any(result.success for result in results.values())
        assert not memory.rows[4:7].any()
        assert tier.state is TierState.DOWN

        assert timed(tier.shutdown) < 2 * timeout_s + SLACK_S
    finally:
        own_cluster.resume_master()
    assert [memory.chunk(chunk) for chunk in (0, 1, 2)] == written  # the primary's own chunks untouched


def test_a_vanished_holder_turns_its_chunks_into_misses_never_wrong_bytes(
    own_cluster: MooncakeCluster, own_tiers: list[MooncakeStoreTier]
) -> None:
    memory = Primary(8, CHUNK)
    tier = make_tier(own_cluster.master_address, memory, namespace="holder", timeout_s=5.0)
    own_tiers.append(tier)
    keys = chunk_keys(3, salt=13)
    memory.fill([0, 1, 2], seed=13)
    assert run_job(tier, keys, [0, 1, 2], load=False).success

    own_cluster.kill_holder()
    started = time.monotonic()
    loaded = run_job(tier, keys, [3, 4, 5], load=True)
    assert time.monotonic() - started < 5.0 + SLACK_S
    assert not loaded.success and not loaded.successful_keys
    assert not memory.rows[3:6].any()
    # Once the master drops the holder (client_ttl), the keys are gone: plain misses, and stores fail per job.
    poll(lambda: True if resolve_lookups(tier, keys) == [MISS] * 3 else None, 10.0, "keys dropped with the holder")
    assert not run_job(tier, keys, [0, 1, 2], load=False).success
    assert tier.stats().store_failed_keys == 3


def test_a_full_store_evicts_or_refuses_and_every_load_is_exact_or_a_miss(
    tmp_path_factory: pytest.TempPathFactory, own_tiers: list[MooncakeStoreTier]
) -> None:
    chunk = 1024 * 1024
    cluster = MooncakeCluster(tmp_path_factory.mktemp("mooncake-full"), holder_bytes=16 * chunk).start()
    try:
        memory = Primary(48, chunk)
        tier = make_tier(cluster.master_address, memory, namespace="full")
        own_tiers.append(tier)
        keys = chunk_keys(24, salt=14)
        written = memory.fill(range(24), seed=14)
        outcomes = [
            run_job(tier, keys[first : first + 4], range(first, first + 4), load=False) for first in range(0, 24, 4)
        ]
        stats = tier.stats()
        assert stats.stored_keys + stats.store_failed_keys == 24
        assert all(result.success for result in outcomes[:3])  # the first 12 MiB fit

        loaded = run_job(tier, keys, range(24, 48), load=True)
        arrived = set(loaded.successful_keys or (keys if loaded.success else ()))
        assert len(arrived) < 24  # 24 MiB never fit in 16
        for index, key in enumerate(keys):
            if key in arrived:
                assert memory.chunk(24 + index) == written[index], f"chunk {index} loaded wrong bytes"
        assert tier.stats().load_failed_keys == 24 - len(arrived)
    finally:
        for tier in own_tiers:
            tier.shutdown()
        own_tiers.clear()
        cluster.stop()


def test_a_tier_started_before_its_master_misses_until_the_master_appears(
    tmp_path_factory: pytest.TempPathFactory, own_tiers: list[MooncakeStoreTier], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = MooncakeCluster(tmp_path_factory.mktemp("mooncake-late"))
    try:
        memory = Primary(4, CHUNK)
        tier = make_tier(
            cluster.master_address, memory, namespace="late", wait_up=False, timeout_s=5.0, reconnect_interval_s=0.2
        )
        own_tiers.append(tier)
        assert tier.state is TierState.CONNECTING
        keys = chunk_keys(1, salt=15)
        assert resolve_lookups(tier, keys) == [MISS]
        assert not run_job(tier, keys, [0], load=False).success
        with caplog.at_level(logging.INFO, logger="kvtriton.integrations.mooncake"):
            cluster.start()
            assert tier.wait_until_up(15.0)
        assert re.search(
            rf"Mooncake tier 'MooncakeStoreTier': set up against master {cluster.master_address} after \d+ failed "
            r"attempt\(s\)",
            caplog.text,
        )
        written = memory.fill([1], seed=15)
        assert run_job(tier, keys, [1], load=False).success
        assert run_job(tier, keys, [2], load=True).success and memory.chunk(2) == written[0]
    finally:
        for tier in own_tiers:
            tier.shutdown()
        own_tiers.clear()
        cluster.stop()


STARTS_DOWN = "The tier starts down: every lookup is a miss and every job fails until the setup succeeds; it is retried"


def setup_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "Mooncake store setup failed" in record.getMessage()
    ]


@pytest.mark.parametrize("bad_key", ["master_server_address", "metadata_server"])
def test_a_failed_setup_says_once_which_key_and_address_failed_and_that_the_tier_is_down_until_it_answers(
    cluster: MooncakeCluster, own_tiers: list[MooncakeStoreTier], caplog: pytest.LogCaptureFixture, bad_key: str
) -> None:
    closed = f"{LOOPBACK}:{free_port()}"  # nothing listens there
    bad = {"master_server_address": closed, "metadata_server": f"http://{closed}/metadata"}[bad_key]
    config: dict[str, Any] = {"master_server_address": cluster.master_address, bad_key: bad}  # tier keys by name
    memory = Primary(4, CHUNK)
    with caplog.at_level(logging.DEBUG, logger="kvtriton.integrations.mooncake"):
        tier = make_tier(
            config.pop("master_server_address"),
            memory,
            namespace="setup",
            wait_up=False,
            timeout_s=2.0,
            reconnect_interval_s=0.2,
            **config,
        )
        own_tiers.append(tier)
        poll(lambda: True if tier.stats().failures["unreachable"] >= 2 else None, 30.0, "two failed setups")
        assert tier.state is TierState.CONNECTING
        assert resolve_lookups(tier, chunk_keys(1, salt=16)) == [MISS]
    (line,) = setup_warnings(caplog)  # once, however often it is retried
    assert line.startswith("Mooncake tier 'MooncakeStoreTier': Mooncake store setup failed with status -")
    assert f"{bad_key} {bad!r} refused the connection (nothing listens there)" in line
    assert f"{STARTS_DOWN} every 0.2 s" in line
    other = ({"master_server_address", "metadata_server"} - {bad_key}).pop()
    assert other not in line and "local_hostname" not in line  # only the key that failed


def test_a_setup_failure_names_a_local_hostname_this_machine_cannot_listen_at(cluster: MooncakeCluster) -> None:
    # Mooncake's own setup takes such a local_hostname and falls back to a port of its own; the line still names it
    # when the setup fails for any reason.
    config = MooncakeTierConfig(master_server_address=cluster.master_address, local_hostname=f"{LOOPBACK}:99999")
    line = setup_failure_line(config, -1, who="Mooncake tier 'MooncakeStoreTier'")
    assert f"local_hostname '{LOOPBACK}:99999' has port 99999, outside 1-65535" in line
    assert "master_server_address" not in line and "metadata_server" not in line
    assert f"{STARTS_DOWN} every 1 s" in line


def test_a_setup_failure_with_every_address_answering_names_each_key_it_was_given(cluster: MooncakeCluster) -> None:
    config = MooncakeTierConfig(master_server_address=cluster.master_address, local_hostname=LOOPBACK)
    line = setup_failure_line(config, -1, who="Mooncake")
    assert (
        f"each of master_server_address {cluster.master_address!r}, local_hostname '{LOOPBACK}' answers from here, "
        "so see Mooncake's own lines above" in line
    )
