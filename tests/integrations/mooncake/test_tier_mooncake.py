"""MooncakeStoreTier against a real mooncake_master and storage holder on 127.0.0.1.

Round trips are bit-exact through the tier's own calls (submit_store /
submit_load / lookup / get_finished_jobs); the keyspace separates layouts; a
value of the wrong size is a miss. Breaking the store is in
tests/integrations/mooncake/test_tier_mooncake_failures.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import numpy as np
from mooncake_fixtures.tiers import END_OF_STEP, Primary, chunk_keys, make_tier, resolve_lookups, run_job
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from kvtriton._integrity import SEAL_BYTES
from kvtriton.integrations import _mooncake_local as mooncake_local
from kvtriton.integrations.mooncake import MooncakeClient, MooncakeStoreTier, StoreClient, TierState
from kvtriton.integrations.mooncake._config import MooncakeTierConfig
from kvtriton.integrations.vllm._surface import JOB_RESULTS_DEFER_RELEASE, LOOKUPS_MARK_PRESENT

if TYPE_CHECKING:
    from tests.integrations.mooncake.conftest import NewTier

CHUNK = 64 * 1024
Transfer = Callable[[list[str], list[list[int]], list[list[int]]], list[int]]
"""A Mooncake binding's batch transfer: ``(keys, pointers, sizes)`` to a code per key."""
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def test_chunks_stored_by_one_tier_load_bit_exact_into_another_primary(new_tier: NewTier) -> None:
    writer_memory, reader_memory = Primary(8, CHUNK), Primary(8, CHUNK)
    writer = new_tier(writer_memory, "roundtrip")
    reader = new_tier(reader_memory, "roundtrip")
    keys = chunk_keys(4, salt=1)
    written = writer_memory.fill([1, 3, 5, 7], seed=1)

    stored = run_job(writer, keys, [1, 3, 5, 7], load=False)
    assert (stored.success, stored.transfer_bytes) == (True, 4 * CHUNK)

    assert resolve_lookups(reader, [*keys, *chunk_keys(2, salt=99)]) == [HIT] * 4 + [MISS] * 2
    loaded = run_job(reader, keys, [6, 4, 2, 0], load=True)
    assert (loaded.success, loaded.successful_keys, loaded.transfer_bytes) == (True, None, 4 * CHUNK)
    assert [reader_memory.chunk(chunk) for chunk in (6, 4, 2, 0)] == written
    assert not reader_memory.rows[[1, 3, 5, 7]].any()  # nothing landed outside the job's slots

    stats = reader.stats()
    assert (stats.state, stats.loaded_keys, stats.load_failed_keys, stats.failed_ops) == (TierState.UP, 4, 0, 0)
    assert (stats.lookups, stats.lookup_hits, stats.bytes_loaded) == (6, 4, 4 * CHUNK)
    assert writer.stats().stored_keys == 4


def test_a_lookup_answers_retry_until_a_step_has_sent_it_then_hit(new_tier: NewTier) -> None:
    memory = Primary(2, CHUNK)
    tier = new_tier(memory, "retry")
    key = chunk_keys(1, salt=2)[0]
    memory.fill([0], seed=2)
    assert run_job(tier, [key], [0], load=False).success
    context = ReqContext(req_id="r")
    assert tier.lookup(key, context) is LookupResult.RETRY  # never blocks the scheduler on the network
    assert tier.lookup(key, context) is LookupResult.RETRY  # same step: the batch is sent when the step ends
    steps = 0
    while (answer := tier.lookup(key, context)) is LookupResult.RETRY:
        tier.on_schedule_end(END_OF_STEP)
        steps += 1
        assert steps < 1000, "the lookup never resolved"
        time.sleep(0.002)
    assert answer is HIT and steps >= 1
    tier.on_request_finished(context)


@pytest.mark.parametrize(
    ("what", "reader_namespace", "reader_dtype", "reader_chunk"),
    [
        ("another namespace", "other", None, CHUNK),
        ("another dtype", "layout", "bfloat16", CHUNK),
        ("another chunk size", "layout", None, CHUNK // 2),
    ],
)
def test_another_layout_or_namespace_sees_only_misses(
    new_tier: NewTier,
    what: str,
    reader_namespace: str,
    reader_dtype: str | None,
    reader_chunk: int,
) -> None:
    writer_memory = Primary(4, CHUNK)
    writer = new_tier(writer_memory, "layout")
    reader = new_tier(Primary(4, reader_chunk), reader_namespace, dtype_override=reader_dtype)
    keys = chunk_keys(3, salt=3)
    writer_memory.fill([0, 1, 2], seed=3)
    assert run_job(writer, keys, [0, 1, 2], load=False).success
    assert writer.keyspace.digest != reader.keyspace.digest, what
    assert resolve_lookups(reader, keys) == [MISS] * 3, what
    assert resolve_lookups(writer, keys) == [HIT] * 3


def test_the_manifest_key_holds_the_configuration_behind_the_digest(new_tier: NewTier, store: StoreClient) -> None:
    tier = new_tier(Primary(2, CHUNK), "manifest")
    manifest = json.loads(store.get(tier.keyspace.manifest_key))
    assert manifest == tier.keyspace.identity.fields()
    assert (manifest["namespace"], manifest["chunk_bytes"], manifest["layout_tag"]) == ("manifest", CHUNK, "vllm-cpu")
    assert tier.keyspace.manifest_key == f"kvt/{tier.keyspace.digest}/manifest"


def test_a_value_of_the_wrong_size_is_a_miss_for_that_key_only(new_tier: NewTier, store: StoreClient) -> None:
    memory = Primary(8, CHUNK)
    tier = new_tier(memory, "wrong-size")
    keys = chunk_keys(3, salt=4)
    written = memory.fill([0, 1, 2], seed=4)
    assert run_job(tier, [keys[0], keys[2]], [0, 2], load=False).success
    # Another writer filed a shorter value under the middle key.
    assert store.put(tier.keyspace.object_key(bytes([4, 1]) * 16, 0), b"short value") == 0
    assert resolve_lookups(tier, keys) == [HIT] * 3  # it exists, so the lookup says so ...
    result = run_job(tier, keys, [5, 6, 7], load=True)
    assert not result.success
    assert result.successful_keys is not None and set(result.successful_keys) == {
        keys[0],
        keys[2],
    }  # ... the load does not
    assert (memory.chunk(5), memory.chunk(7)) == (written[0], written[2])
    stats = tier.stats()
    assert (stats.loaded_keys, stats.load_failed_keys, stats.wrong_size_keys) == (2, 1, 1)


def test_a_larger_value_is_a_miss_and_writes_nothing(new_tier: NewTier, store: StoreClient) -> None:
    memory = Primary(2, CHUNK)
    tier = new_tier(memory, "too-large")
    key = chunk_keys(1, salt=5)
    assert store.put(tier.keyspace.object_key(bytes([5, 0]) * 16, 0), b"x" * (2 * CHUNK)) == 0
    result = run_job(tier, key, [1], load=True)
    assert (result.success, result.successful_keys) == (False, None)
    assert not memory.rows.any()


def test_a_store_of_keys_already_present_succeeds_and_keeps_the_bytes(new_tier: NewTier) -> None:
    memory = Primary(4, CHUNK)
    tier = new_tier(memory, "again")
    keys = chunk_keys(2, salt=6)
    written = memory.fill([0, 1], seed=6)
    assert run_job(tier, keys, [0, 1], load=False).success
    assert run_job(tier, keys, [0, 1], load=False).success
    assert run_job(tier, keys, [2, 3], load=True).success
    assert [memory.chunk(2), memory.chunk(3)] == written


def test_groups_of_one_block_hash_are_separate_objects(new_tier: NewTier) -> None:
    memory = Primary(4, CHUNK)
    tier = new_tier(memory, "groups")
    group0, group1 = chunk_keys(1, salt=7, group=0), chunk_keys(1, salt=7, group=1)
    written = memory.fill([0, 1], seed=7)
    assert run_job(tier, group0 + group1, [0, 1], load=False).success
    assert run_job(tier, group1 + group0, [2, 3], load=True).success
    assert [memory.chunk(2), memory.chunk(3)] == [written[1], written[0]]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"master_server_address": "no-port"}, "master_server_address must be 'host:port', got 'no-port'"),
        ({"protocol": "udp"}, "protocol must be one of ('tcp', 'rdma'), got 'udp'"),
        ({"protocol": "rdma"}, "rdma_devices must name the RDMA devices"),
        ({"timeout_s": 0}, "timeout_s must be a number of seconds > 0, got 0"),
        ({"io_threads": 0}, "io_threads must be >= 1, got 0"),
        ({"global_segment_size": -1}, "global_segment_size must be >= 0, got -1"),
    ],
)
def test_bad_configuration_names_the_key_and_value(config: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"master_server_address": "127.0.0.1:1", **config}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MooncakeTierConfig(**arguments)  # pyright: ignore[reportArgumentType] -- deliberately bad values


def test_stores_and_loads_move_through_registered_memory_not_python_bytes(new_tier: NewTier) -> None:
    # Zero copy: the tier hands Mooncake addresses inside the primary (registered once) and in its registered
    # seal slots (one per chunk, beside the chunk's bytes in the same value), never a bytes object.
    memory = Primary(4, CHUNK)
    tier = new_tier(memory, "zero-copy")
    base = memory.rows.ctypes.data
    seals = tier._slots.seals_base  # pyright: ignore[reportPrivateUsage] -- the registered seal slots
    assert tier._slots.primary_base == base  # pyright: ignore[reportPrivateUsage] -- the registered address is the primary's own
    calls: list[tuple[str, list[list[int]], list[list[int]]]] = []
    client = tier._supervisor.store  # pyright: ignore[reportPrivateUsage]
    assert isinstance(client, MooncakeClient)
    store = client.store

    def recorded(kind: str, transfer: Transfer) -> Transfer:
        def record_then_transfer(keys: list[str], pointers: list[list[int]], sizes: list[list[int]]) -> list[int]:
            calls.append((kind, pointers, sizes))
            return transfer(keys, pointers, sizes)

        return record_then_transfer

    # A spy around the real binding: each batch transfer's pointers and sizes recorded, then made.
    client.store = SimpleNamespace(  # pyright: ignore[reportAttributeAccessIssue] -- duck-typed as the binding
        register_buffer=store.register_buffer,
        unregister_buffer=store.unregister_buffer,
        batch_put_from_multi_buffers=recorded("put", store.batch_put_from_multi_buffers),
        batch_get_into_multi_buffers=recorded("get", store.batch_get_into_multi_buffers),
    )
    keys = chunk_keys(2, salt=8)
    memory.fill([0, 3], seed=8)
    try:
        assert run_job(tier, keys, [0, 3], load=False).success
        assert run_job(tier, keys, [1, 2], load=True).success
    finally:
        client.store = store
    sizes = [[CHUNK, SEAL_BYTES]] * 2
    put, get = calls
    assert put == ("put", [[base, seals], [base + 3 * CHUNK, seals + 3 * SEAL_BYTES]], sizes)
    if JOB_RESULTS_DEFER_RELEASE:  # vLLM 0.34 keeps a late load's slots aside: loads land in the primary directly
        assert get == ("get", [[base + CHUNK, seals + SEAL_BYTES], [base + 2 * CHUNK, seals + 2 * SEAL_BYTES]], sizes)
    else:  # vLLM 0.33 would reuse them: loads land in the tier's own registered memory, copied in once in time
        landing = get[1][0][0]
        assert get[2] == sizes and not base <= landing < base + memory.rows.nbytes
        assert get[1] == [[landing, landing + CHUNK], [landing + CHUNK + SEAL_BYTES, landing + 2 * CHUNK + SEAL_BYTES]]
    assert np.array_equal(memory.rows[1], memory.rows[0]) and np.array_equal(memory.rows[2], memory.rows[3])


def test_log_files_of_the_cluster_exist(cluster: MooncakeCluster) -> None:
    assert Path(cluster.log_dir / "master-1.log").stat().st_size > 0
    assert Path(cluster.log_dir / "holder.log").stat().st_size > 0


def test_the_tier_master_and_holder_talk_only_to_the_loopback(new_tier: NewTier, cluster: MooncakeCluster) -> None:
    psutil = pytest.importorskip("psutil")
    memory = Primary(4, CHUNK)
    tier = new_tier(memory, "loopback")
    keys = chunk_keys(2, salt=9)
    memory.fill([0, 1], seed=9)
    assert run_job(tier, keys, [0, 1], load=False).success and run_job(tier, keys, [2, 3], load=True).success
    assert cluster.master is not None and cluster.holder is not None
    peers: set[str] = set()
    for pid in (os.getpid(), cluster.master.pid, cluster.holder.pid):
        for connection in psutil.Process(pid).net_connections(kind="inet"):
            if connection.raddr:
                peers.add(connection.raddr.ip)
    assert peers and peers <= {"127.0.0.1", "::ffff:127.0.0.1"}


def stale_miss_then_store(tier: MooncakeStoreTier, memory: Primary, key: OffloadKey) -> LookupResult:
    """A running request probes ``key`` before it is stored (MISS, cached while the request runs); the tier then
    stores it: what a new request's lookup answers in the same step."""
    asking = ReqContext(req_id="asking")
    assert resolve_lookups(tier, [key], request="asking", finish=False) == [MISS]
    memory.fill([0], seed=3)
    assert run_job(tier, [key], [0], load=False).success
    answer = tier.lookup(key, ReqContext(req_id="next"))
    tier.on_request_finished(asking)
    return answer


@pytest.mark.skipif(
    not LOOKUPS_MARK_PRESENT, reason="LOOKUPS_MARK_PRESENT: vLLM 0.34's AsyncLookupManager.mark_present"
)
def test_on_vllm_0_34_a_key_just_stored_is_a_hit_for_the_next_request_despite_a_miss_cached_before(
    new_tier: NewTier,
) -> None:
    memory = Primary(2, CHUNK)
    tier = new_tier(memory, "mark-present")
    assert stale_miss_then_store(tier, memory, chunk_keys(1, salt=3)[0]) is HIT


@pytest.mark.skipif(LOOKUPS_MARK_PRESENT, reason="not LOOKUPS_MARK_PRESENT: vLLM 0.33's lookup cache keeps its verdict")
def test_on_vllm_0_33_a_miss_cached_before_a_store_stands_while_its_request_runs(new_tier: NewTier) -> None:
    memory = Primary(2, CHUNK)
    tier = new_tier(memory, "stale-miss")
    assert stale_miss_then_store(tier, memory, chunk_keys(1, salt=4)[0]) is MISS


def test_an_outdated_mooncake_is_refused_before_the_tier_opens_a_port(
    cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake_local, "installed_mooncake_version", lambda: ("0.3.12", "mooncake-transfer-engine"))
    with pytest.raises(
        ImportError, match=r"^mooncake-transfer-engine 0\.3\.12 is installed, but the Mooncake tier needs 0\.3\.13"
    ):
        make_tier(cluster.master_address, Primary(4, CHUNK), namespace="outdated")


def test_the_serving_process_listens_on_every_interface_whatever_local_hostname_says(
    cluster: MooncakeCluster, tiers: list[MooncakeStoreTier]
) -> None:
    """Mooncake's transfer engine binds its handshake and TCP data ports to all interfaces (docs/security.md says
    so, and why the ports must be firewalled); the test fails, and the page is to be corrected, when it stops."""
    psutil = pytest.importorskip("psutil")

    def listening() -> set[tuple[str, int]]:
        process = psutil.Process(os.getpid())
        return {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet") if c.status == "LISTEN"}

    before = listening()
    tiers.append(make_tier(cluster.master_address, Primary(4, CHUNK), namespace="ports", local_hostname="127.0.0.1"))
    opened = listening() - before
    assert len(opened) == 2, opened  # the handshake (RPC) port and the TCP transport's data port
    assert {ip for ip, _ in opened} <= {"0.0.0.0", "::"}, opened
