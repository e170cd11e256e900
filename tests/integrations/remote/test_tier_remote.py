"""The remote-tier base over the in-memory store (no server): round trips, and every operation bounded by a deadline.

A stalled store call (:meth:`InMemoryStore.stall`) does not hold the job: it
fails at its deadline while the call is still inside the store, counted by
reason, the tier degrades and is retried after a back-off. The slots the
stalled call writes are kept aside until it returns: vLLM 0.34 gets a
``deferred_release`` event set only then; without it (vLLM 0.33) the call
writes the job's own landing memory, never the primary's slot. No test
asserts a duration: "within the deadline" is shown by the job's failure
arriving while the stalled call is still inside the store.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from mooncake_fixtures.tiers import Primary, chunk_keys, make_memory_tier, poll, resolve_lookups, run_job, submit
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.base import JobResult

from kvtriton.integrations.remote import (
    InMemoryStoreTier,
    InMemoryTierConfig,
    RemoteTierSettings,
    TierState,
    in_memory_store,
)
from kvtriton.integrations.remote._metrics import ABANDONED_CALLS, DEGRADED, FAILURES
from kvtriton.integrations.vllm._surface import JOB_RESULTS_DEFER_RELEASE

CHUNK = 16 * 1024
HIT, MISS = LookupResult.HIT, LookupResult.MISS
STALL_S = 120.0
"""Longer than any test: a stalled call returns when the test resumes it."""
DEADLINE_S = 2.0
"""The tiers' timeout_s: long enough that an I/O thread has surely entered its call by then on a loaded machine
(a job still queued at its deadline fails without running, which is another path)."""


@pytest.fixture
def tiers() -> Iterator[list[InMemoryStoreTier]]:
    made: list[InMemoryStoreTier] = []
    yield made
    for tier in made:
        tier.store.resume()
        tier.shutdown()


def fresh_store() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def finished(tier: InMemoryStoreTier, job_id: int) -> JobResult | None:
    return next((result for result in tier.get_finished_jobs() if result.job_id == job_id), None)


def metrics(tier: InMemoryStoreTier) -> dict[str, float]:
    """What vLLM's metrics get from the tier now (counters: the growth since the last call), keyed ``name:labels``."""
    return {key: float(value) for key, value in tier.get_stats().reduce().items()}


def key(tier: InMemoryStoreTier, name: str, *labels: str) -> str:
    return f"{name}:{(tier.tier_label, *labels)}"


def test_chunks_round_trip_bit_exact_through_the_in_memory_store(tiers: list[InMemoryStoreTier]) -> None:
    name = fresh_store()
    writer_memory, reader_memory = Primary(4, CHUNK), Primary(4, CHUNK)
    writer, reader = make_memory_tier(name, writer_memory), make_memory_tier(name, reader_memory)
    tiers += [writer, reader]
    keys = chunk_keys(2, salt=1)
    written = writer_memory.fill([0, 2], seed=1)
    assert run_job(writer, keys, [0, 2], load=False).success
    assert resolve_lookups(reader, [*keys, *chunk_keys(1, salt=9)]) == [HIT, HIT, MISS]
    assert run_job(reader, keys, [3, 1], load=True).success
    assert [reader_memory.chunk(3), reader_memory.chunk(1)] == written
    assert reader.stats().loaded_keys == 2 and reader.stats().failures["deadline"] == 0


@pytest.mark.parametrize("into_primary", [True, False], ids=["deferred-release", "landing-memory"])
def test_a_load_stalled_past_its_deadline_fails_at_once_and_its_slot_stays_aside_until_the_call_returns(
    tiers: list[InMemoryStoreTier], into_primary: bool
) -> None:
    if into_primary and not JOB_RESULTS_DEFER_RELEASE:
        pytest.skip("vLLM 0.33 has no JobResult.deferred_release: loads go through the tier's landing memory")
    name = fresh_store()
    memory = Primary(4, CHUNK)
    tier = make_memory_tier(name, memory, timeout_s=DEADLINE_S, retry_backoff_s=0.2, io_threads=1)
    tiers.append(tier)
    tier._jobs.loads_into_primary = into_primary  # pyright: ignore[reportPrivateUsage] -- both quarantine paths, on any vLLM
    keys = chunk_keys(1, salt=2)
    written = memory.fill([0], seed=2)
    assert run_job(tier, keys, [0], load=False).success
    store = in_memory_store(name)

    store.stall("get", STALL_S)
    job = submit(tier, keys, [1], load=True)
    result = poll(lambda: finished(tier, job.job_id), 30.0, "the load's failure")
    # Reported failed while the call is still inside the store: the request does not wait for the stall.
    assert store.in_flight("get") == 1
    assert (result.success, result.successful_keys) == (False, None)
    reported = metrics(tier)
    assert tier.stats().abandoned_calls == 1 and reported[key(tier, ABANDONED_CALLS)] == 1
    released = getattr(result, "deferred_release", None)
    if into_primary:
        assert isinstance(released, threading.Event) and not released.is_set()  # vLLM keeps the slot out of its pool
    else:
        assert released is None  # the slot is vLLM's again at once: the call writes the tier's own memory
    assert not memory.rows[1].any()

    # Degraded: lookups miss and jobs fail without touching the store, counted by reason.
    assert tier.state is TierState.DEGRADED
    assert reported[key(tier, FAILURES, "deadline")] == 1
    assert reported[key(tier, DEGRADED)] == 1
    calls = dict(store.calls)
    assert resolve_lookups(tier, keys) == [MISS]
    assert not run_job(tier, keys, [2], load=True).success
    assert store.calls == calls
    assert tier.stats().failures["refused"] == 1

    # The stalled call returns: its write lands (in the slot vLLM kept aside, or in the landing memory), and only
    # now is the slot released; an abandoned call keeps the tier degraded until then.
    store.resume()
    poll(lambda: True if tier.stats().abandoned_calls == 0 else None, 30.0, "the stalled call to return")
    if into_primary:
        assert released is not None and released.is_set()
        assert memory.chunk(1) == written[0]  # the late write reached only the slot vLLM held back
    else:
        assert not memory.rows[1].any()  # the late write never reached the primary
    poll(lambda: True if tier.state is TierState.UP else None, 30.0, "recovery after the back-off")
    assert metrics(tier)[key(tier, DEGRADED)] == 0
    assert run_job(tier, keys, [3], load=True).success and memory.chunk(3) == written[0]


def test_jobs_queued_behind_a_stalled_call_fail_at_their_deadline_without_reaching_the_store(
    tiers: list[InMemoryStoreTier],
) -> None:
    name = fresh_store()
    memory = Primary(6, CHUNK)
    tier = make_memory_tier(name, memory, timeout_s=DEADLINE_S, io_threads=1)
    tiers.append(tier)
    keys = chunk_keys(3, salt=3)
    memory.fill([0, 1, 2], seed=3)
    assert run_job(tier, keys, [0, 1, 2], load=False).success
    store = in_memory_store(name)
    store.stall("get", STALL_S)
    jobs = [submit(tier, [key], [3 + index], load=True) for index, key in enumerate(keys)]
    results: dict[int, JobResult] = {}

    def all_failed() -> bool | None:
        results.update({result.job_id: result for result in tier.get_finished_jobs()})
        return True if len(results) == len(jobs) else None

    poll(all_failed, 30.0, "every job's failure")
    assert not any(result.success for result in results.values())
    assert store.calls["get"] == 1 and store.in_flight("get") == 1  # the other two never reached the store
    assert tier.stats().failures["deadline"] == 3
    assert not tier.has_pending_work()
    store.resume()


def test_a_stalled_store_job_is_counted_at_its_deadline_and_reported_failed_when_the_call_returns(
    tiers: list[InMemoryStoreTier],
) -> None:
    name = fresh_store()
    memory = Primary(2, CHUNK)
    tier = make_memory_tier(name, memory, timeout_s=DEADLINE_S)
    tiers.append(tier)
    store = in_memory_store(name)
    store.stall("put", STALL_S)
    memory.fill([0], seed=4)
    job = submit(tier, chunk_keys(1, salt=4), [0], load=False)
    poll(lambda: store.in_flight("put") == 1 or None, 30.0, "the put inside the store")
    # vLLM's scheduler polls every step; the deadline is checked there.
    poll(lambda: finished(tier, job.job_id) or (True if tier.state is TierState.DEGRADED else None), 30.0, "deadline")
    # Not reported: vLLM would release the slot's read pin, and a chunk written there meanwhile would be read
    # by the stalled put. No request waits on a cascade.
    assert finished(tier, job.job_id) is None and tier.has_pending_work()
    assert tier.stats().failures["deadline"] == 1 and tier.stats().abandoned_calls == 1
    store.resume()
    result = poll(lambda: finished(tier, job.job_id), 30.0, "the store's late report")
    assert not result.success
    assert tier.stats().store_failed_keys == 1 and tier.stats().failures["deadline"] == 1


def test_drain_waits_for_an_abandoned_call_and_shutdown_is_bounded(
    tiers: list[InMemoryStoreTier], caplog: pytest.LogCaptureFixture
) -> None:
    name = fresh_store()
    memory = Primary(2, CHUNK)
    tier = make_memory_tier(name, memory, timeout_s=DEADLINE_S)
    keys = chunk_keys(1, salt=5)
    memory.fill([0], seed=5)
    assert run_job(tier, keys, [0], load=False).success
    store = in_memory_store(name)
    store.stall("get", STALL_S)
    job = submit(tier, keys, [1], load=True)
    poll(lambda: finished(tier, job.job_id), 30.0, "the load's failure")
    drained = threading.Event()
    drainer = threading.Thread(target=lambda: (tier.drain_jobs(), drained.set()))
    drainer.start()
    # vLLM drains before reusing every slot: not while the store may still write one.
    assert not drained.wait(1.5) and store.in_flight("get") == 1
    store.resume()
    drainer.join(30.0)
    assert drained.is_set()
    poll(lambda: True if tier.state is TierState.UP else None, 30.0, "recovery")
    store.stall("get", STALL_S)
    submit(tier, keys, [1], load=True)
    poll(lambda: True if store.in_flight("get") else None, 30.0, "the second call to enter the store")
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.remote._tier"):
        tier.shutdown()  # bounded by the timeout: returns with the call still inside the store
    assert store.in_flight("get") == 1
    # Never closed under the call (Mooncake's client crashed the process when such a call returned).
    assert f"1 call(s) still inside the store {DEADLINE_S:.1f} s into shutdown: its client is left open" in caplog.text
    store.resume()


def test_an_unreachable_store_makes_misses_the_tier_goes_down_and_comes_back(tiers: list[InMemoryStoreTier]) -> None:
    name = fresh_store()
    memory = Primary(2, CHUNK)
    tier = make_memory_tier(name, memory, reconnect_interval_s=0.1)
    tiers.append(tier)
    keys = chunk_keys(1, salt=6)
    memory.fill([0], seed=6)
    store = in_memory_store(name)
    store.unreachable = True
    assert not run_job(tier, keys, [0], load=False).success
    assert (
        tier.state is TierState.DOWN and metrics(tier)[key(tier, FAILURES, "unreachable")] >= 1
    )  # the put, then failed probes
    store.unreachable = False
    poll(lambda: True if tier.state is TierState.UP else None, 30.0, "reconnect")
    assert run_job(tier, keys, [0], load=False).success


def test_the_back_off_doubles_when_the_tier_degrades_again_soon_after_recovering(
    tiers: list[InMemoryStoreTier],
) -> None:
    name = fresh_store()
    memory = Primary(4, CHUNK)
    tier = make_memory_tier(name, memory, timeout_s=0.3, retry_backoff_s=0.2, retry_backoff_max_s=0.8)
    tiers.append(tier)
    keys = chunk_keys(1, salt=7)
    memory.fill([0], seed=7)
    assert run_job(tier, keys, [0], load=False).success
    store = in_memory_store(name)
    waits: list[float] = []
    for _ in range(4):
        store.stall("get", STALL_S)
        assert not run_job(tier, keys, [1], load=True).success
        waits.append(tier._supervisor.backoff_s)  # pyright: ignore[reportPrivateUsage] -- the wait before the next try
        store.resume()
        poll(lambda: True if tier.state is TierState.UP else None, 30.0, "recovery")
    assert waits == [0.2, 0.4, 0.8, 0.8]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"retry_backoff_s": 0}, "retry_backoff_s must be a number of seconds > 0, got 0"),
        ({"retry_backoff_max_s": "30"}, "retry_backoff_max_s must be a number of seconds > 0, got '30'"),
        (
            {"retry_backoff_s": 5.0, "retry_backoff_max_s": 1.0},
            "retry_backoff_max_s must be >= retry_backoff_s (5.0), got 1.0",
        ),
        ({"timeout_s": float("inf")}, "timeout_s must be a number of seconds > 0, got inf"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_value(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RemoteTierSettings(**arguments)  # pyright: ignore[reportArgumentType] -- deliberately bad values
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        InMemoryTierConfig(**arguments)  # pyright: ignore[reportArgumentType] -- every backend's config checks them


def test_shutdown_leaves_the_client_open_under_an_existence_check_still_inside_the_store(
    tiers: list[InMemoryStoreTier], caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup's ``exist`` given up on at its deadline is still inside the store: closing the client under it is
    what crashed Mooncake's engine processes as they exited (a stopped holder, seen on vLLM 0.34)."""
    name = fresh_store()
    tier = make_memory_tier(name, Primary(2, CHUNK), timeout_s=DEADLINE_S)
    store = in_memory_store(name)
    store.stall("exist", STALL_S)
    assert tier.exists(chunk_keys(1, salt=9)) == [False]  # at the deadline, not after the stall
    assert store.in_flight("exist") == 1 and tier.state is TierState.DOWN
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.remote._tier"):
        tier.shutdown()
    assert store.in_flight("exist") == 1
    assert f"1 call(s) still inside the store {DEADLINE_S:.1f} s into shutdown: its client is left open" in caplog.text
    store.resume()
