"""FilterReusedOffloadingManager: counts lookups, forwards only reused keys to prepare_store."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from kvtriton.manager import CPUOffloadingManager, FilterReusedOffloadingManager, OffloadingManager, ReuseSignal
from tests.manager.conftest import k, ks

CTX = ReqContext(req_id="test")


class Recorder(OffloadingManager):
    """A backing manager that records every call and answers fixed values."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.calls.append(("lookup", key, req_context))
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self.calls.append(("prepare_load", keys, req_context))
        return CPULoadStoreSpec([7])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.calls.append(("touch", keys, req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.calls.append(("complete_load", keys, req_context))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self.calls.append(("prepare_store", list(keys), req_context))
        return None

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.calls.append(("complete_store", keys, req_context, success))

    def take_events(self) -> Iterable[OffloadingEvent]:
        self.calls.append(("take_events",))
        return [OffloadingEvent(ks(1), "CPU", False)]

    def reset_cache(self) -> None:
        self.calls.append(("reset_cache",))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


@pytest.mark.parametrize(("threshold", "size"), [(1, 10), (0, 10), (2, 0)])
def test_filter_rejects_threshold_below_two_or_tracker_below_one(threshold: int, size: int) -> None:
    name = "store_threshold" if threshold < 2 else "max_tracker_size"
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        FilterReusedOffloadingManager(Recorder(), store_threshold=threshold, max_tracker_size=size)


def test_filter_lookup_counts_every_use_and_returns_the_backing_answer_unchanged() -> None:
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing)
    assert manager.lookup(k(0), CTX) is LookupResult.HIT_PENDING
    manager.lookup(k(0), CTX)
    manager.lookup(k(1), CTX)
    assert [manager.use_count(key) for key in ks(0, 1, 2)] == [2, 1, 0]
    assert backing.calls == [("lookup", k(0), CTX), ("lookup", k(0), CTX), ("lookup", k(1), CTX)]


def test_filter_tracker_forgets_its_least_recently_counted_key_when_full() -> None:
    manager = FilterReusedOffloadingManager(Recorder(), max_tracker_size=2)
    for i in (0, 1, 0, 2):  # counting k0 again makes k1 the oldest
        manager.lookup(k(i), CTX)
    assert [manager.use_count(key) for key in ks(0, 1, 2)] == [2, 0, 1]


def test_filter_prepare_store_forwards_keys_counted_threshold_times_in_input_order() -> None:
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing, store_threshold=3)
    for i in (4, 4, 4, 2, 2, 2, 2, 3, 3):
        manager.lookup(k(i), CTX)
    backing.calls.clear()
    manager.prepare_store({k(2): None, k(3): None, k(4): None, k(5): None}.keys(), CTX)
    assert backing.calls == [("prepare_store", ks(2, 4), CTX)]


def test_filter_prepare_store_forwards_even_when_nothing_qualifies() -> None:
    manager = FilterReusedOffloadingManager(CPUOffloadingManager(4))
    manager.lookup(k(0), CTX)
    out = manager.prepare_store(ks(0, 1), CTX)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == ([], [])


def test_filter_forwards_everything_else_with_the_same_arguments() -> None:
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing)
    keys = frozenset(ks(1))
    spec = manager.prepare_load(keys, CTX)
    manager.touch(keys, CTX)
    manager.complete_load(keys, CTX)
    manager.complete_store(keys, CTX, success=False)
    events = list(manager.take_events())
    manager.reset_cache()
    manager.shutdown()
    assert isinstance(spec, CPULoadStoreSpec) and spec.block_ids.tolist() == [7]
    assert events == [OffloadingEvent(ks(1), "CPU", False)]
    assert backing.calls == [
        ("prepare_load", keys, CTX),
        ("touch", keys, CTX),
        ("complete_load", keys, CTX),
        ("complete_store", keys, CTX, False),
        ("take_events",),
        ("reset_cache",),
        ("shutdown",),
    ]
    assert manager.backing is backing


def test_filter_over_a_cpu_manager_stores_a_block_on_its_second_request() -> None:
    manager = FilterReusedOffloadingManager(CPUOffloadingManager(4))
    request = ks(0, 1)
    for expected in ([], ks(0, 1)):
        for key in request:
            assert manager.lookup(key, CTX) is LookupResult.MISS
        out = manager.prepare_store(request, CTX)
        assert out is not None and out.keys_to_store == expected
        manager.complete_store(out.keys_to_store, CTX)
    assert [manager.lookup(key, CTX) for key in request] == [LookupResult.HIT] * 2


def test_filter_counting_store_offers_ignores_lookups_and_counts_a_repeated_key_once_per_offer() -> None:
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing, count_on=ReuseSignal.STORE_OFFER)
    manager.lookup(k(0), CTX)
    assert manager.use_count(k(0)) == 0
    manager.prepare_store(ks(0, 1, 0), CTX)
    assert [manager.use_count(key) for key in ks(0, 1)] == [1, 1]
    manager.prepare_store(ks(1, 2), CTX)
    assert backing.calls[-2:] == [("prepare_store", [], CTX), ("prepare_store", ks(1), CTX)]


def test_filter_counting_store_offers_stores_a_whole_request_on_its_second_offer() -> None:
    # A connector that looks up only until the first miss still gets the whole
    # repeated request stored on its second computation.
    manager = FilterReusedOffloadingManager(CPUOffloadingManager(4), count_on=ReuseSignal.STORE_OFFER)
    request = ks(0, 1, 2)
    for expected in ([], ks(0, 1, 2)):
        assert manager.lookup(request[0], CTX) is LookupResult.MISS
        out = manager.prepare_store(request, CTX)
        assert out is not None and out.keys_to_store == expected
        manager.complete_store(out.keys_to_store, CTX)


def test_filter_counting_store_offers_never_forgets_a_key_of_the_same_offer() -> None:
    # An offer larger than the tracker must not push out the keys it has just
    # counted (else no such offer is ever admitted): the tracked keys count,
    # new keys take only room that other keys can give up, the rest wait.
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing, max_tracker_size=2, count_on=ReuseSignal.STORE_OFFER)
    manager.prepare_store(ks(0, 1, 2), CTX)
    assert [manager.use_count(key) for key in ks(0, 1, 2)] == [1, 1, 0]
    manager.prepare_store(ks(2, 0, 1), CTX)
    assert [manager.use_count(key) for key in ks(0, 1, 2)] == [2, 2, 0]
    assert backing.calls[-1] == ("prepare_store", ks(0, 1), CTX)
    # A key outside the offer still makes room, least recently counted first.
    manager.prepare_store(ks(1, 3), CTX)
    assert [manager.use_count(key) for key in ks(0, 1, 3)] == [0, 3, 1]


@pytest.mark.parametrize("count_on", list(ReuseSignal))
def test_filter_prepare_store_rule3_protects_cached_keys_below_the_threshold(count_on: ReuseSignal) -> None:
    # prepare_store rule 3 (docs/manager.md): every key named in prepare_store is protected. A cached
    # key whose count aged out of the tracker (or that was stored before the
    # filter saw it) is still named by the caller, so the backing manager must
    # see it: it never stores it again, but it must not evict it either.
    cpu = CPUOffloadingManager(2, cache_policy="lru")
    out = cpu.prepare_store(ks(1, 0), CTX)  # full; k0 is the least recent
    assert out is not None
    cpu.complete_store(out.keys_to_store, CTX)
    manager = FilterReusedOffloadingManager(cpu, count_on=count_on)
    if count_on is ReuseSignal.LOOKUP:
        manager.lookup(k(6), CTX)
        manager.lookup(k(6), CTX)
    else:
        manager.prepare_store(ks(6), ReqContext(req_id="first"))  # another request's offer: counted, not stored
    out = manager.prepare_store(ks(0, 6), CTX)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == (ks(6), ks(1))
    assert cpu.lookup(k(0), CTX) is LookupResult.HIT


def per_request_filter(backing: OffloadingManager, threshold: int = 2) -> FilterReusedOffloadingManager:
    return FilterReusedOffloadingManager(backing, threshold, count_on=ReuseSignal.STORE_OFFER_PER_REQUEST)


@pytest.mark.parametrize("threshold", [2, 3])
def test_filter_counting_offers_per_request_does_not_count_the_retries_of_an_offer_that_found_no_room(
    threshold: int,
) -> None:
    # prepare_store answered None (no room): the connector offers the same keys
    # again through the same context. The retries neither admit a key only this
    # request offered nor count its skip again (as vLLM's counted_keys does).
    cpu = CPUOffloadingManager(2)
    manager = per_request_filter(cpu, threshold)
    pinned, warm, cold = ks(100, 101), k(1), k(2)
    for index in range(threshold - 1):  # other requests offer pinned and warm: one more offer admits them
        manager.prepare_store([*pinned, warm], ReqContext(req_id=f"warm-up-{index}"))
    pin = ReqContext(req_id="pin")
    out = manager.prepare_store(pinned, pin)
    assert out is not None and out.keys_to_store == pinned  # both slots now pending
    skipped_before = manager.stores_skipped

    context = ReqContext(req_id="req")
    assert manager.prepare_store([warm, cold], context) is None
    assert manager.prepare_store([warm, cold], context) is None
    cpu.complete_store(pinned, pin)  # the slots become evictable
    out = manager.prepare_store([warm, cold], context)
    assert out is not None and out.keys_to_store == [warm]
    assert manager.use_count(cold) == 1
    assert manager.stores_skipped - skipped_before == 1


@pytest.mark.parametrize("threshold", [2, 3])
def test_filter_counting_offers_per_request_counts_a_key_once_per_request_and_again_for_another(
    threshold: int,
) -> None:
    # A preempted request offers its keys again from its first chunk through the
    # same context: each key counts once for it; another request's offer counts.
    manager = per_request_filter(CPUOffloadingManager(4), threshold)
    warm, cold = k(1), k(2)
    for index in range(threshold - 1):
        manager.prepare_store([warm], ReqContext(req_id=f"warm-up-{index}"))
    skipped_before = manager.stores_skipped
    context = ReqContext(req_id="req")
    out = manager.prepare_store([warm, cold], context)
    assert out is not None and out.keys_to_store == [warm]
    manager.complete_store([warm], context)
    for _ in range(threshold - 1):  # preempted and scheduled again, as often as the threshold would need
        out = manager.prepare_store([warm, cold], context)
        assert out is not None and out.keys_to_store == []
    assert manager.use_count(cold) == 1
    assert manager.stores_skipped - skipped_before == 1
    manager.prepare_store([cold], ReqContext(req_id="other"))
    assert manager.use_count(cold) == 2


def test_filter_counting_offers_per_request_keeps_a_re_offered_key_tracked_and_counts_anew_after_a_reset() -> None:
    backing = Recorder()
    manager = FilterReusedOffloadingManager(backing, 2, 2, count_on=ReuseSignal.STORE_OFFER_PER_REQUEST)
    context = ReqContext(req_id="req")
    manager.prepare_store(ks(0), context)
    manager.prepare_store(ks(1), ReqContext(req_id="other"))
    # Re-offered by the same request: not counted, but it becomes the most recent key, so k1 is forgotten.
    manager.prepare_store(ks(0), context)
    manager.prepare_store(ks(2), ReqContext(req_id="third"))
    assert [manager.use_count(key) for key in ks(0, 1, 2)] == [1, 0, 1]
    # After reset_cache the request's earlier offers are forgotten (as vLLM's request state is).
    manager.reset_cache()
    manager.prepare_store(ks(0), context)
    assert manager.use_count(k(0)) == 2
    assert backing.calls[-1] == ("prepare_store", ks(0), context)


def test_filter_rejects_a_count_on_that_is_not_a_reuse_signal() -> None:
    with pytest.raises(TypeError, match="count_on must be a ReuseSignal, got str: 'lookup'"):
        FilterReusedOffloadingManager(Recorder(), count_on="lookup")  # pyright: ignore[reportArgumentType] -- the runtime check is under test
