"""A cascade's seals are written off vLLM's scheduler thread, and a tier never sees a chunk before its seal.

vLLM's real TieringOffloadingManager and fs tier run on a tmp dir, behind
kvtriton's tiered spec. The seal is replaced by :class:`HeldSeal`, which
refuses to run on the test's thread (the scheduler's, here) and otherwise
waits for the test's word before sealing: a scheduler call that returns while
a seal is held proves the seal runs elsewhere. The fs tier's ``submit_store``
is wrapped (on the class, before the manager is built) to check, when the tier
is handed a job, that every one of its slots already holds its seal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import drain, key, tiering_config
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

import kvtriton.integrations.vllm._sealed_tiering as sealed_tiering
from kvtriton._integrity import SEAL_BYTES, IntegrityFault, seal, seal_in_place, verify
from kvtriton.integrations.vllm._sealed_tiering import SEAL_THREAD_NAME, SealedTieringManager

CHUNK = 4096  # 2048-byte blocks, one rank and the seal, padded to a page
PAYLOAD = CHUNK - SEAL_BYTES
FILLS = {1: 0x11, 2: 0x22}
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
WAIT_S = 30.0
"""Bound on every wait for another thread: only a broken build waits this long."""


class Held:
    """Stands in for a call of the seal thread's: refuses the scheduler's thread, waits for :attr:`release`."""

    what = "a seal"
    """The call held, as the failures name it."""

    def __init__(self) -> None:
        self.scheduler_thread = threading.current_thread()
        self.release = threading.Event()
        """Set by the test: the calls held so far (and all later ones) go ahead."""
        self.started = threading.Event()
        """Set when the first call has begun (on the seal thread)."""
        self.threads: list[str] = []
        """The name of the thread of each call, in order."""

    def hold(self) -> None:
        """Record this thread, refuse the scheduler's, and wait (bounded) for the test's release."""
        thread = threading.current_thread()
        self.threads.append(thread.name)
        if thread is self.scheduler_thread:
            raise AssertionError(f"{self.what} ran on the scheduler's thread, under the manager lock")
        self.started.set()
        if not self.release.wait(WAIT_S):
            raise AssertionError(f"the test never released {self.what} within {WAIT_S} s")


class HeldSeal(Held):
    """Stands in for ``seal_in_place``: held (:class:`Held`), then seals (or fails)."""

    what = "a cascade's seal"

    def __init__(self, failure: Exception | None = None) -> None:
        super().__init__()
        self.failure = failure
        """Raised instead of sealing, once released."""

    def __call__(self, chunk: memoryview, *, key: bytes, fingerprint: bytes) -> None:
        self.hold()
        if self.failure is not None:
            raise self.failure
        seal_in_place(chunk, key=key, fingerprint=fingerprint)


HandedOver = list[list[tuple[OffloadKey, bytes]]]
"""Per job the fs tier is handed, in order: each slot's key and bytes at that moment."""


@pytest.fixture
def handed_over(monkeypatch: pytest.MonkeyPatch) -> HandedOver:
    """What the fs tier finds in its job's slots when it is handed the job (wraps its class before a build)."""
    jobs: HandedOver = []
    original = FileSystemTierManager.submit_store

    def recording_submit_store(tier: FileSystemTierManager, job_metadata: TransferJob) -> None:
        region = tier._primary_kv_view.cast("B")  # pyright: ignore[reportPrivateUsage] -- the bytes the tier reads
        jobs.append(
            [
                (offload_key, bytes(region[chunk * CHUNK : (chunk + 1) * CHUNK]))
                for offload_key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids.tolist())
            ]
        )
        original(tier, job_metadata)

    monkeypatch.setattr(FileSystemTierManager, "submit_store", recording_submit_store)
    return jobs


def seal_checks(manager: SealedTieringManager, jobs: HandedOver) -> list[list[IntegrityFault | None]]:
    """Each handed-over slot's seal check (None: sealed for its key under the manager's identity)."""
    fingerprint = manager.identity.fingerprint
    return [[verify(chunk, key=offload_key, fingerprint=fingerprint) for offload_key, chunk in job] for job in jobs]


def build(root: Path, managers: list[OffloadingManager] | None, chunks: int = 8) -> SealedTieringManager:
    """kvtriton's tiered manager with one fs tier under ``root``; shut down after the test when ``managers`` is given."""
    extra: dict[str, object] = {
        "cpu_bytes_to_use": chunks * CHUNK,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}],
    }
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra, worker_kv_bytes_per_block=2048))
    manager = spec.get_manager()
    assert isinstance(manager, SealedTieringManager)
    if managers is not None:
        managers.append(manager)
    return manager


def chunk_file(manager: SealedTieringManager, index: int) -> Path:
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, FileSystemTierManager)
    return Path(tier.file_mapper.get_file_name(key(index)))


def stored(manager: SealedTieringManager, request: str, indices: tuple[int, ...] = tuple(FILLS)) -> ReqContext:
    """Chunks ``key(indices)`` written into the primary as a worker would (their ``FILLS`` byte), not yet complete."""
    context = ReqContext(req_id=request)
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store([key(index) for index in indices], context)
    assert output is not None and isinstance(output.store_spec, CPULoadStoreSpec)
    region = manager.primary_tier.get_kv_memoryview().cast("B")
    for offload_key, slot in zip(output.keys_to_store, output.store_spec.chunk_ids.tolist()):
        fill = next(FILLS.get(index, index) for index in indices if key(index) == offload_key)
        region[slot * CHUNK : (slot + 1) * CHUNK] = bytes([fill]) * CHUNK  # the seal's room too: unsealed until sealed
    return context


def complete(manager: SealedTieringManager, context: ReqContext, indices: tuple[int, ...] = tuple(FILLS)) -> None:
    """The scheduler's ``complete_store``: the primary holds the chunks, and they cascade to the fs tier."""
    with manager.lock:
        manager.complete_store([key(index) for index in indices], context)


def sealed_file(manager: SealedTieringManager, index: int) -> bytes:
    return seal(bytes([FILLS[index]]) * PAYLOAD, key=key(index), fingerprint=manager.identity.fingerprint)


def hold_seals(monkeypatch: pytest.MonkeyPatch, failure: Exception | None = None) -> HeldSeal:
    held = HeldSeal(failure)
    monkeypatch.setattr(sealed_tiering, "seal_in_place", held)
    return held


def seal_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(SEAL_THREAD_NAME)]


def test_a_cascade_returns_while_its_seal_is_held_and_the_tier_gets_the_chunk_only_once_sealed(
    managers: list[OffloadingManager],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    handed_over: HandedOver,
) -> None:
    held = hold_seals(monkeypatch)
    manager = build(tmp_path, managers)
    context = stored(manager, "store")
    complete(manager, context)  # returns with the seal held: it is not computed on this thread
    assert held.started.wait(WAIT_S)
    for _ in range(3):  # steps go on; the tier is not handed a chunk whose seal is not written
        with manager.lock:
            manager.on_schedule_end(END_OF_STEP)
            assert manager.has_pending_work()
    assert handed_over == []
    assert not any(chunk_file(manager, index).exists() for index in FILLS)

    held.release.set()
    drain(manager)
    assert seal_checks(manager, handed_over) == [
        [None, None]
    ]  # one job, every slot sealed for its key when the tier got it
    assert all(chunk_file(manager, index).read_bytes() == sealed_file(manager, index) for index in FILLS)
    assert held.threads and all(name.startswith(SEAL_THREAD_NAME) for name in held.threads)
    manager.on_request_finished(context)


def test_a_seal_that_fails_fails_the_store_job_and_the_scheduler_carries_on(
    managers: list[OffloadingManager],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    handed_over: HandedOver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = hold_seals(monkeypatch, failure=ValueError("no room for the seal"))
    held.release.set()
    manager = build(tmp_path, managers, chunks=2)
    context = stored(manager, "store")
    complete(manager, context)  # no exception reaches the scheduler
    drain(manager)
    assert handed_over == [] and not any(chunk_file(manager, index).exists() for index in FILLS)
    stats = manager.get_stats()
    assert stats is not None
    failures = stats.reduce()
    cascade_failures = [
        float(value)
        for name, value in failures.items()
        if name.startswith(TieringOffloadingMetrics.CASCADE_JOB_FAILURES)
    ]
    assert sum(cascade_failures) == 1
    assert "could not seal store job" in caplog.text and "no room for the seal" in caplog.text
    with manager.lock:  # the chunks stay in the primary, readable
        assert all(manager.lookup(key(index), context) is LookupResult.HIT for index in FILLS)
    manager.on_request_finished(context)
    # ...and unpinned: two new chunks evict both from the two-chunk primary.
    later = ReqContext(req_id="later")
    manager.on_new_request(later)
    with manager.lock:
        output = manager.prepare_store([key(3), key(4)], later)
    assert output is not None and sorted(output.evicted_keys) == [key(index) for index in FILLS]


def test_shutdown_cancels_the_seals_not_begun_and_leaves_no_seal_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed_over: HandedOver
) -> None:
    held = hold_seals(monkeypatch)
    manager = build(tmp_path, None)  # shut down here, once
    first = stored(manager, "first", (1, 2))
    complete(manager, first, (1, 2))
    second = stored(manager, "second", (3, 4))
    complete(manager, second, (3, 4))  # queued behind the first job's held seal
    assert held.started.wait(WAIT_S)
    shutting_down = threading.Thread(target=manager.shutdown, name="test-shutdown")
    shutting_down.start()
    assert manager._sealing_stopped.wait(WAIT_S)  # pyright: ignore[reportPrivateUsage] -- shutdown has begun
    held.release.set()  # the seal in progress finishes its chunk; the rest of its job and the second are dropped
    shutting_down.join(WAIT_S)
    assert not shutting_down.is_alive()
    assert len(held.threads) == 1  # one chunk sealed; never a chunk after shutdown began, nor the queued job
    assert handed_over == []
    assert seal_threads() == []


def test_reset_cache_waits_for_the_seals_and_hands_their_jobs_over_first(
    managers: list[OffloadingManager],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    handed_over: HandedOver,
) -> None:
    held = hold_seals(monkeypatch)
    manager = build(tmp_path, managers)
    context = stored(manager, "store")
    complete(manager, context)
    assert held.started.wait(WAIT_S)
    releaser = threading.Timer(0.05, held.release.set)  # while the reset below waits (or before: it must not matter)
    releaser.start()
    with manager.lock:
        manager.reset_cache()  # vLLM drains the tiers and asserts no job is left: the held one went first
        manager.on_reset_flushed()
    releaser.join(WAIT_S)
    assert seal_checks(manager, handed_over) == [[None, None]]
    assert all(chunk_file(manager, index).read_bytes() == sealed_file(manager, index) for index in FILLS)
    manager.on_request_finished(context)


def test_a_peers_read_through_the_parent_manager_is_sealed_before_create_store_job_returns(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    """The p2p tier reads the slots as soon as ``create_store_job`` returns, with no ``submit_store`` to hold."""
    manager = build(tmp_path, managers)
    context = stored(manager, "store")
    complete(manager, context)
    drain(manager)
    peer = ReqContext(req_id="peer")
    manager.on_new_request(peer)
    region = manager.primary_tier.get_kv_memoryview().cast("B")
    fingerprint = manager.identity.fingerprint
    with manager.lock:
        output = manager.prepare_load([key(1)], peer)  # where key 1 is (its slot), pinned meanwhile
        assert isinstance(output, CPULoadStoreSpec)
        (chunk,) = output.chunk_ids.tolist()
        region[(chunk + 1) * CHUNK - SEAL_BYTES : (chunk + 1) * CHUNK] = bytes(SEAL_BYTES)  # the cascade's seal, gone
        job = manager.create_store_job([key(1)], peer, 0)  # what vLLM's _SecondaryTierFacingParent calls
        assert job.chunk_ids.tolist() == [chunk]
        assert verify(region[chunk * CHUNK : (chunk + 1) * CHUNK], key=key(1), fingerprint=fingerprint) is None


@pytest.mark.parametrize("off_thread", [True, False])
def test_every_seal_thread_is_gone_after_shutdown(tmp_path: Path, off_thread: bool, handed_over: HandedOver) -> None:
    manager = build(tmp_path, None)
    manager.seal_off_thread = off_thread
    context = stored(manager, "store")
    complete(manager, context)
    if not off_thread:  # sealed on this thread: the tier gets the job within complete_store, as vLLM hands it
        assert seal_checks(manager, handed_over) == [[None, None]]
    drain(manager)
    assert seal_checks(manager, handed_over) == [[None, None]]
    manager.on_request_finished(context)
    manager.shutdown()
    assert seal_threads() == []


# -- a promoted chunk's seal is checked off the manager lock ----------------------------------------------------------


class HeldCheck(Held):
    """Stands in for ``verify``: held (:class:`Held`), then checks (or fails)."""

    what = "a promoted chunk's check"

    def __init__(self, fault: IntegrityFault | None = None) -> None:
        super().__init__()
        self.fault = fault
        """Returned instead of the real check's verdict, once released."""

    def __call__(self, chunk: memoryview, *, key: bytes, fingerprint: bytes) -> IntegrityFault | None:
        self.hold()
        return self.fault if self.fault is not None else verify(chunk, key=key, fingerprint=fingerprint)


def hold_checks(monkeypatch: pytest.MonkeyPatch, fault: IntegrityFault | None = None) -> HeldCheck:
    held = HeldCheck(fault)
    monkeypatch.setattr(sealed_tiering, "verify", held)
    return held


def cascaded_and_forgotten(manager: SealedTieringManager) -> ReqContext:
    """Chunks ``key(1)`` and ``key(2)`` stored, sealed and written to fs, then forgotten by the primary; the request
    that is to read them back, begun."""
    context = stored(manager, "store")
    complete(manager, context)
    drain(manager)
    manager.on_request_finished(context)
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()
    reader = ReqContext(req_id="read")
    manager.on_new_request(reader)
    return reader


def step(manager: SealedTieringManager, context: ReqContext) -> LookupResult:
    """One scheduler step looking up ``key(1)``: the lookup, then the end of the step."""
    with manager.lock:
        answer = manager.lookup(key(1), context)
        manager.on_schedule_end(END_OF_STEP)
    return answer


def step_until(
    manager: SealedTieringManager, context: ReqContext, done: Callable[[LookupResult], bool]
) -> LookupResult:
    deadline = time.monotonic() + WAIT_S
    while not done(answer := step(manager, context)):
        assert time.monotonic() < deadline, f"the lookup still answers {answer.name} after {WAIT_S} s"
        time.sleep(0.005)
    return answer


def promoted_payload(manager: SealedTieringManager, context: ReqContext) -> bytes:
    with manager.lock:
        spec = manager.prepare_load([key(1)], context)
        manager.complete_load([key(1)], context)
    assert isinstance(spec, CPULoadStoreSpec)
    (slot,) = spec.chunk_ids.tolist()
    return bytes(manager.primary_tier.get_kv_memoryview().cast("B")[slot * CHUNK : slot * CHUNK + PAYLOAD])


def test_a_promotion_is_checked_off_the_lock_and_its_chunk_is_no_hit_until_the_check_passes(
    managers: list[OffloadingManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = build(tmp_path, managers)
    reader = cascaded_and_forgotten(manager)
    held = hold_checks(monkeypatch)
    step_until(manager, reader, lambda _: held.started.is_set())  # the fs tier has read it; the check is held
    for _ in range(3):  # the scheduler's calls return meanwhile, and the chunk is not served unchecked
        assert step(manager, reader) is LookupResult.HIT_PENDING
        with manager.lock:
            assert manager.has_pending_work()
    held.release.set()
    step_until(manager, reader, lambda answer: answer is LookupResult.HIT)
    assert promoted_payload(manager, reader) == bytes([FILLS[1]]) * PAYLOAD
    assert held.threads and all(name.startswith(SEAL_THREAD_NAME) for name in held.threads)
    assert manager.integrity[0].total() == 0
    manager.on_request_finished(reader)


@pytest.mark.parametrize("wait_s", [30.0, 0.0], ids=["waits", "never-waits"])
def test_a_check_done_within_the_wait_hands_its_promotion_over_in_the_poll_that_found_the_read_done(
    managers: list[OffloadingManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_s: float
) -> None:
    """vLLM's own tiering makes a promoted chunk a hit at the poll that finds the tier's read done; the check must not
    cost the request a scheduler step more when it is quick (a bound no check reaches here, so the outcome does not
    hang on this machine's speed; without the wait, the check is handed over a poll later)."""
    monkeypatch.setattr(sealed_tiering, "CHECK_WAIT_S", wait_s)
    checks: list[float] = []

    def slow_check(chunk: memoryview, *, key: bytes, fingerprint: bytes) -> IntegrityFault | None:
        time.sleep(0.05)  # longer than the moment between starting the check and looking at it, never waited for
        checks.append(time.monotonic())
        return verify(chunk, key=key, fingerprint=fingerprint)

    monkeypatch.setattr(sealed_tiering, "verify", slow_check)
    manager = build(tmp_path, managers)
    reader = cascaded_and_forgotten(manager)
    step_until(manager, reader, lambda answer: answer is LookupResult.HIT_PENDING)  # the fs tier reads the chunk
    time.sleep(1.0)  # ... and has read it long before this
    answer = step(manager, reader)
    if wait_s:
        assert checks and answer is LookupResult.HIT  # found read, checked and handed over in one poll
    else:
        assert answer is LookupResult.HIT_PENDING  # the check still runs: handed over at a later poll
        step_until(manager, reader, lambda answer: answer is LookupResult.HIT)
    manager.on_request_finished(reader)


def test_a_promotion_whose_check_fails_off_the_lock_is_a_counted_miss(
    managers: list[OffloadingManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = build(tmp_path, managers)
    reader = cascaded_and_forgotten(manager)
    held = hold_checks(monkeypatch, IntegrityFault.CHECKSUM)
    held.release.set()
    assert step_until(manager, reader, lambda answer: answer is LookupResult.MISS) is LookupResult.MISS
    assert manager.integrity[0].counts()[IntegrityFault.CHECKSUM.value] == 1
    assert not chunk_file(manager, 1).exists()  # dropped, as a faulty fs file is
    assert step(manager, reader) is LookupResult.MISS and manager.integrity[0].total() == 1  # not promoted again
    manager.on_request_finished(reader)


def test_a_check_that_raises_fails_its_promotion_and_the_scheduler_carries_on(
    managers: list[OffloadingManager],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = build(tmp_path, managers)
    reader = cascaded_and_forgotten(manager)

    def broken(chunk: memoryview, *, key: bytes, fingerprint: bytes) -> IntegrityFault | None:
        raise OSError("the region is gone")

    monkeypatch.setattr(sealed_tiering, "verify", broken)
    assert step_until(manager, reader, lambda answer: answer is LookupResult.MISS) is LookupResult.MISS
    assert "could not check the chunks of promotion job" in caplog.text and "the region is gone" in caplog.text
    assert step(manager, reader) is LookupResult.MISS  # not promoted again (that would loop), and uncounted
    assert manager.integrity[0].total() == 0
    manager.on_request_finished(reader)


def test_reset_cache_waits_for_a_held_check_and_hands_the_promotion_to_vllm(
    managers: list[OffloadingManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = build(tmp_path, managers)
    reader = cascaded_and_forgotten(manager)
    held = hold_checks(monkeypatch)
    step_until(manager, reader, lambda _: held.started.is_set())
    releaser = threading.Timer(0.05, held.release.set)
    releaser.start()
    with manager.lock:
        manager.reset_cache()  # vLLM asserts no job is left after draining: the held promotion went first
        manager.on_reset_flushed()
        assert not manager.has_pending_work()
    releaser.join(WAIT_S)
    manager.on_request_finished(reader)


def test_shutdown_stops_a_held_check_and_leaves_no_seal_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = build(tmp_path, None)  # shut down here, once
    reader = cascaded_and_forgotten(manager)
    held = hold_checks(monkeypatch)
    step_until(manager, reader, lambda _: held.started.is_set())
    shutting_down = threading.Thread(target=manager.shutdown, name="test-shutdown")
    shutting_down.start()
    assert manager._sealing_stopped.wait(WAIT_S)  # pyright: ignore[reportPrivateUsage] -- shutdown has begun
    held.release.set()
    shutting_down.join(WAIT_S)
    assert not shutting_down.is_alive()
    assert seal_threads() == []
