"""Recency from the request's own calls (vLLM's signal): no touch, token positions and on_request_finished.

The LRU ranking rule by rule is in tests/manager/test_manager_lru.py; here: the
request record (what counts as reused, inserted, learnt from), ARC's request
scenarios as vLLM's tests state them, and policies without the hooks.
"""

from __future__ import annotations

from collections.abc import Collection

import pytest

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import OffloadingEvent, ReqContext
from kvtriton.manager import CPUOffloadingManager, FilterReusedOffloadingManager
from kvtriton.manager._request_access import head_to_tail
from kvtriton.manager.policies import ARCCachePolicy, LRUCachePolicy
from tests.manager.conftest import NewestFirst, k, ks, request


def lru_order(manager: CPUOffloadingManager) -> list[OffloadKey]:
    policy = manager.policy
    assert isinstance(policy, LRUCachePolicy)
    return policy.ordered_keys()


def store_for(manager: CPUOffloadingManager, context: ReqContext, *ids: int) -> None:
    out = manager.prepare_store(ks(*ids), context)
    assert out is not None
    manager.complete_store(out.keys_to_store, context)


def stored_request(manager: CPUOffloadingManager, name: str, *ids: int) -> None:
    """A whole request: announced, stores the keys ``ids`` (token positions in order), finished."""
    context = request(name, *ids)
    manager.on_new_request(context)
    store_for(manager, context, *ids)
    manager.on_request_finished(context)


def test_a_loading_request_ranks_its_shared_head_above_its_new_tail_whatever_came_between() -> None:
    manager = CPUOffloadingManager(16)
    stored_request(manager, "first", 0, 1)

    second = request("second", 0, 1, 2, 3)
    manager.on_new_request(second)
    manager.prepare_load(ks(0, 1), second)
    # Another request stores in between (vLLM interleaves requests within a step).
    other = request("other", 7)
    manager.on_new_request(other)
    store_for(manager, other, 7)
    manager.complete_load(ks(0, 1), second)
    store_for(manager, second, 2, 3)
    # Least recent first: the tail of `second` goes before its head.
    order = lru_order(manager)
    assert order.index(k(3)) < order.index(k(2)) < order.index(k(1)) < order.index(k(0))
    manager.on_request_finished(second)
    assert lru_order(manager)[-4:] == ks(3, 2, 1, 0)


def test_finish_orders_keys_by_token_position_when_they_were_seen_out_of_order() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1, 2)
    manager.on_new_request(context)
    store_for(manager, context, 2)  # the tail first (a late store)
    store_for(manager, context, 0, 1)
    manager.on_request_finished(context)
    assert lru_order(manager) == ks(2, 1, 0)


def test_head_to_tail_keeps_the_seen_order_without_every_position() -> None:
    assert head_to_tail(ks(0, 1), [32, 16]) == ks(1, 0)
    assert head_to_tail(ks(0, 1, 2), [32, 16, None]) == ks(0, 1, 2)
    # Two groups: group by group, each by position when all of it has one; then all by position if all have one.
    two = [k(0), make_offload_key(b"block-0", 1), k(1), make_offload_key(b"block-1", 1)]
    assert head_to_tail(two, [32, 32, 16, 16]) == [two[2], two[3], two[0], two[1]]
    assert head_to_tail(two, [32, None, 16, 16]) == [two[2], two[0], two[1], two[3]]


def test_arc_counts_a_reuse_at_finish_and_never_a_store() -> None:
    manager = CPUOffloadingManager(8, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    stored_request(manager, "first", 0, 1)
    assert policy.state().t2 == ()  # stored, not reused

    second = request("second", 0, 1, 2)
    manager.on_new_request(second)
    manager.prepare_load(ks(0, 1), second)
    manager.complete_load(ks(0, 1), second)
    store_for(manager, second, 2)
    assert policy.state().t2 == ()  # the reuse counts when the request ends
    manager.on_request_finished(second)
    state = policy.state()
    assert state.t2 == tuple(ks(1, 0))  # one promotion each, head most recent
    assert state.t1 == tuple(ks(2))


def test_arc_learns_from_a_stored_ghost_once_per_request() -> None:
    manager = CPUOffloadingManager(2, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    filler = request("filler", 0, 1, 2)
    manager.on_new_request(filler)
    store_for(manager, filler, 0, 1)
    store_for(manager, filler, 2)  # evicts block 0 (T1 in offer order, as vLLM's ARC) into B1
    assert policy.state().b1 == (k(0),)
    again = request("again", 0)
    out = manager.prepare_store(ks(0), again)
    assert out is not None and out.keys_to_store == ks(0)
    assert policy.target_t1 == 1.0  # a ghost hit: T1 deserved more room
    manager.complete_store(ks(0), again, success=False)
    manager.prepare_store(ks(0), again)  # the same request retries the store: learnt once only
    assert policy.target_t1 == 1.0


def test_a_reset_makes_a_request_record_stale() -> None:
    manager = CPUOffloadingManager(8, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    context = request("r", 0)
    manager.on_new_request(context)
    store_for(manager, context, 0)
    manager.prepare_load(ks(0), context)
    manager.reset_cache()
    store_for(manager, context, 0)
    manager.on_request_finished(context)
    assert policy.state().t2 == ()  # the pre-reset load is forgotten


def test_the_reuse_filter_forwards_the_request_hooks() -> None:
    cpu = CPUOffloadingManager(8)
    manager = FilterReusedOffloadingManager(cpu)
    first = request("first", 0, 1)
    cpu.prepare_store(ks(0, 1), first)
    cpu.complete_store(ks(0, 1), first)
    context = request("r", 0)
    manager.on_new_request(context)
    manager.prepare_load(ks(0), context)
    manager.complete_load(ks(0), context)
    manager.on_request_finished(context)
    policy = cpu.policy
    assert isinstance(policy, LRUCachePolicy)
    assert policy.ordered_keys() == ks(1, 0)


@pytest.mark.parametrize("report", [False, True])
def test_a_failed_store_is_reported_metadata_only_when_asked(report: bool) -> None:
    manager = CPUOffloadingManager(4, enable_events=True, report_dropped_stores=report)
    context = ReqContext(req_id="r")
    manager.prepare_store(ks(0, 1), context)
    manager.complete_store(ks(0, 1), context, success=False)
    expected = [OffloadingEvent(keys=ks(0, 1), medium="CPU", removed=True, metadata_only=True)] if report else []
    assert list(manager.take_events()) == expected


def test_a_dropped_key_stored_again_before_the_drain_is_left_out() -> None:
    manager = CPUOffloadingManager(4, enable_events=True, report_dropped_stores=True)
    context = ReqContext(req_id="r")
    manager.prepare_store(ks(0, 1), context)
    manager.complete_store(ks(0, 1), context, success=False)
    manager.prepare_store(ks(1), context)  # a retry owns block 1 again
    assert list(manager.take_events()) == [OffloadingEvent(keys=ks(0), medium="CPU", removed=True, metadata_only=True)]


def test_a_policy_without_request_hooks_gets_touch_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtriton.manager.policies import POLICIES

    touched: list[list[OffloadKey]] = []

    class TouchOnly(NewestFirst):
        """Only the CachePolicy methods, recording each touch."""

        def touch(self, keys: Collection[OffloadKey]) -> None:
            touched.append(list(keys))

    monkeypatch.setitem(POLICIES, "touch-only", TouchOnly)
    manager = CPUOffloadingManager(8, "touch-only")
    stored_request(manager, "first", 0, 1)
    second = request("second", 0, 1, 2)
    manager.on_new_request(second)
    manager.prepare_load(ks(0, 1), second)
    manager.complete_load(ks(0, 1), second)
    store_for(manager, second, 2)
    manager.on_request_finished(second)
    # vLLM's defaults: each store miss and the end of each request become touches; loads change nothing.
    assert touched == [ks(0, 1), ks(0, 1), ks(2), ks(0, 1, 2)]


def test_a_loading_requests_new_blocks_rank_where_it_first_used_the_cache() -> None:
    manager = CPUOffloadingManager(16)
    stored_request(manager, "first", 0, 1)

    loader = request("loader", 0, 1, 2)
    manager.on_new_request(loader)
    manager.prepare_load(ks(0, 1), loader)
    # Another request stores and finishes after the loader's first load.
    stored_request(manager, "other", 7)
    manager.complete_load(ks(0, 1), loader)
    store_for(manager, loader, 2)
    # vLLM ranks an active request's new block at the moment of its first
    # use: below what others used since, and below its own head.
    assert lru_order(manager) == ks(2, 1, 0, 7)
    manager.on_request_finished(loader)
    assert lru_order(manager) == ks(7, 2, 1, 0)
    policy = manager.policy
    assert isinstance(policy, LRUCachePolicy)
    assert len(policy.ordered_keys()) == len(manager.slot_map())  # the request's mark is gone
