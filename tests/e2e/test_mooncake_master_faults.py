"""The Mooncake master stalled (SIGSTOP) and killed in the middle of a real engine's stream of requests (issue 41).

A writer engine stores prompt A in the pool under several tenants' salts
(vLLM's ``cache_salt``: the same tokens, other block hashes, so other keys).
A reader engine with an empty host slab then serves A under those salts, one
request after another, while the test breaks the master between its requests
(:func:`e2e.engine.barrier`): stopped, resumed, killed, restarted with a new
holder. Every request ends with the reference tokens within twice the tier's
timeout; the tier says it is down (its ``up`` gauge, a WARNING) and counts the
failures; once the master answers again the same engine hits the pool, and
after the restart a new engine hits what the reader stored in the new pool.
The same requests show ``cache_salt`` keeping tenants apart in Mooncake:
another salt misses, the same salt hits. This module breaks its own cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mooncake_fixtures import MOONCAKE_MISSING, MooncakeCluster

from e2e.engine import (
    HITS,
    WAIT_TIERS_UP,
    EngineJob,
    EngineResult,
    barrier,
    faults_at,
    generate,
    mooncake_cluster,
    mooncake_job,
    run_engine,
)
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

if MOONCAKE_MISSING is not None:
    pytest.skip(MOONCAKE_MISSING, allow_module_level=True)

TIMEOUT_S = 1.0
"""The tier's timeout_s: small, so a fault costs a request at most about two seconds."""
FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE
FAILURES = "vllm:kv_offload_remote_tier_failures"
UP = "vllm:kv_offload_mooncake_up"
RECONNECTS = "vllm:kv_offload_mooncake_reconnects"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
FAULTED = ("stalled-stored", "stalled-new", "killed-stored", "killed-new")
"""The reader's requests served while the master was stopped or dead."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    # The holder stays listed through the master's stall (its heartbeats are not answered meanwhile): with the
    # fixtures' 2 s TTL the resumed master would drop it, and with it the chunks the reader should hit afterwards.
    yield from mooncake_cluster(tmp_path_factory.mktemp("mooncake-master"))


def job(model: Path, cluster: MooncakeCluster, steps: list[dict[str, object]]) -> EngineJob:
    return mooncake_job(
        model, cluster.master_address, "master-faults", steps, timeout_s=TIMEOUT_S, reconnect_interval_s=0.5
    )


def request(name: str, salt: str) -> dict[str, object]:
    return generate(PROMPT_A, MAX_TOKENS, name, cache_salt=salt)


@pytest.fixture(scope="module")
def writer(llama: Path, cluster: MooncakeCluster, e2e_dir: Path) -> EngineResult:
    """Prompt A stored in the pool under the salts the reader later asks for."""
    steps = [request(f"tenant-{name}", f"tenant-{name}") for name in ("a", "stall", "resume", "kill")]
    return run_engine(job(llama, cluster, steps), e2e_dir / "mooncake-master-writer")


def restart(cluster: MooncakeCluster) -> None:
    """A new master on the same port, and a new holder: the restarted master lost the old one's segment."""
    cluster.start_master()
    cluster.start_holder()


@pytest.fixture(scope="module")
def reader(writer: EngineResult, llama: Path, cluster: MooncakeCluster, e2e_dir: Path) -> EngineResult:
    """The stream: each fault injected at a barrier between two requests, every resumption before the next."""
    del writer  # the pool holds A under the tenant salts
    steps = [
        request("other-tenant", "tenant-b"),
        request("same-tenant", "tenant-a"),
        barrier("stall"),
        request("stalled-stored", "tenant-stall"),
        request("stalled-new", "stalled"),
        barrier("resume"),
        WAIT_TIERS_UP,
        request("resumed", "tenant-resume"),
        barrier("kill"),
        request("killed-stored", "tenant-kill"),
        request("killed-new", "killed"),
        barrier("restart"),
        WAIT_TIERS_UP,
        request("restarted", "after-restart"),
    ]
    workdir = e2e_dir / "mooncake-master-reader"
    faults: list[tuple[str, Callable[[], object]]] = [
        ("stall", cluster.hang_master),
        ("resume", cluster.resume_master),
        ("kill", cluster.kill_master),
        ("restart", lambda: restart(cluster)),
    ]
    with faults_at(workdir, faults):
        try:
            return run_engine(job(llama, cluster, steps), workdir)
        finally:
            if cluster.master is not None and cluster.master.poll() is None:
                cluster.resume_master()  # never leave a stopped master behind, whatever failed


def test_the_writer_stores_a_under_each_salt(writer: EngineResult, reference: EngineResult) -> None:
    for name in ("tenant-a", "tenant-stall", "tenant-resume", "tenant-kill"):
        assert writer.step(name).token_ids == reference.step("A").token_ids
        assert writer.delta(name, HITS) == 0  # each salt is a prefix of its own
        assert writer.delta(name, WRITE_BYTES) > 0


def test_another_salt_misses_the_pool_and_the_same_salt_hits(reader: EngineResult, reference: EngineResult) -> None:
    assert reader.delta("other-tenant", HITS) == 0
    assert reader.delta("same-tenant", HITS) == FULL_TOKENS
    for name in ("other-tenant", "same-tenant"):
        assert reader.step(name).token_ids == reference.step("A").token_ids


def test_every_request_gives_the_reference_tokens_within_twice_the_timeout(
    reader: EngineResult, reference: EngineResult
) -> None:
    for name in FAULTED:
        step = reader.step(name)
        assert step.token_ids == reference.step("A").token_ids, name
        assert reader.delta(name, HITS) == 0, name  # recomputed: the pool is out of reach
        assert step.seconds < 2 * TIMEOUT_S + reference.step("A").seconds, (name, step.seconds)


def test_the_tier_reports_itself_down_and_counts_the_failures(reader: EngineResult) -> None:
    for name in ("stalled-stored", "killed-stored"):
        assert reader.delta(name, FAILURES) >= 1, name
        assert set(reader.step(name).gauges[UP].values()) == {0.0}, name
    assert set(reader.step("same-tenant").gauges[UP].values()) == {1.0}
    assert "unreachable; every lookup misses until it answers again" in reader.log


def test_after_the_stall_the_same_engine_hits_the_pool_again(reader: EngineResult, reference: EngineResult) -> None:
    assert reader.delta("resumed", HITS) == FULL_TOKENS
    assert reader.step("resumed").token_ids == reference.step("A").token_ids
    assert set(reader.step("resumed").gauges[UP].values()) == {1.0}
    assert "is back" in reader.log


def test_after_a_restart_the_engine_stores_again_and_a_new_engine_hits(
    reader: EngineResult, llama: Path, cluster: MooncakeCluster, e2e_dir: Path, reference: EngineResult
) -> None:
    assert reader.delta("restarted", WRITE_BYTES) > 0  # cascaded into the restarted master's pool
    assert reader.step("restarted").counter(RECONNECTS) >= 2  # after the stall and after the restart
    newcomer = run_engine(
        job(llama, cluster, [request("restarted", "after-restart")]), e2e_dir / "mooncake-master-newcomer"
    )
    assert newcomer.delta("restarted", HITS) == FULL_TOKENS
    assert newcomer.step("restarted").token_ids == reference.step("A").token_ids
