"""ARCCachePolicy: T1/T2, ghost lists, the adaptive target, eviction with fallback."""

from __future__ import annotations

import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.manager.policies import PENDING, ARCCachePolicy, ARCState, Block
from tests.manager.conftest import k, ks, request

CTX = ReqContext(req_id="test")
NONE: frozenset[OffloadKey] = frozenset()


def arc_with(capacity: int, *ids: int, ref_cnt: int = 0) -> ARCCachePolicy:
    """An ARC whose T1 holds ``ids`` inserted one by one (the first least recent)."""
    policy = ARCCachePolicy(capacity)
    for slot, i in enumerate(ids):
        policy.insert(ks(i), [Block(slot, ref_cnt)], {}, CTX)
    return policy


def state(
    t1: tuple[int, ...] = (),
    t2: tuple[int, ...] = (),
    b1: tuple[int, ...] = (),
    b2: tuple[int, ...] = (),
    target: float = 0.0,
) -> ARCState:
    return ARCState(tuple(ks(*t1)), tuple(ks(*t2)), tuple(ks(*b1)), tuple(ks(*b2)), target)


def test_arc_insert_goes_to_the_recent_end_of_t1_in_offer_order() -> None:
    # vLLM's ARC inserts a batch key by key: the first key is the least recent.
    policy = arc_with(8, 0)
    policy.insert(ks(1, 2), [Block(1), Block(2)], {}, CTX)
    assert policy.state() == state(t1=(0, 1, 2))


def test_arc_insert_removes_the_key_from_the_ghost_lists() -> None:
    policy = arc_with(4, 0, 1)
    policy.touch(ks(1))  # k1 -> T2
    assert policy.evict(2, protected=NONE) == ks(0, 1)
    assert policy.state() == state(b1=(0,), b2=(1,))
    policy.insert(ks(0, 1), [Block(0), Block(1)], {}, CTX)
    assert policy.state() == state(t1=(0, 1))


def test_arc_touch_promotes_ready_t1_keys_and_refreshes_t2_keys() -> None:
    policy = arc_with(8, 0, 1, 2)
    policy.touch(ks(0, 1))  # visited k1, k0
    assert policy.state() == state(t1=(2,), t2=(1, 0))
    policy.touch(ks(1))
    assert policy.state() == state(t1=(2,), t2=(0, 1))


def test_arc_touch_of_a_pending_t1_key_keeps_it_in_t1_at_the_recent_end() -> None:
    policy = arc_with(8, 0, 1, ref_cnt=PENDING)
    policy.touch(ks(0))
    assert policy.state() == state(t1=(1, 0))


def test_arc_touch_of_a_loading_t1_key_promotes_it() -> None:
    policy = arc_with(8, 0, 1, ref_cnt=3)
    policy.touch(ks(0))
    assert policy.state() == state(t1=(1,), t2=(0,))


def test_arc_ghost_hit_in_b1_raises_the_target_and_never_reinserts() -> None:
    policy = arc_with(4, 0, 1, 2)
    assert policy.evict(2, protected=NONE) == ks(0, 1)  # B1 = k0, k1
    policy.touch(ks(0))  # delta = max(1, 0 / 2) = 1; k0 to B1's recent end
    assert policy.state() == state(t1=(2,), b1=(1, 0), target=1.0)
    assert policy.get(k(0)) is None


def test_arc_target_grows_by_b2_over_b1_capped_at_capacity() -> None:
    policy = arc_with(3, 0, 1, 2, 3)
    policy.touch(ks(1, 2, 3))  # T2 = k3, k2, k1
    policy.evict(4, protected=NONE)  # T1 first (target 0): k0 -> B1; then T2 -> B2
    assert policy.state() == state(b1=(0,), b2=(3, 2, 1))
    policy.touch(ks(0))  # delta = max(1, 3 / 1) = 3
    assert policy.target_t1 == 3.0
    policy.touch(ks(0))  # capped at capacity 3
    assert policy.target_t1 == 3.0


def test_arc_ghost_hit_in_b2_lowers_the_target_floored_at_zero() -> None:
    policy = arc_with(4, 0, 1, 2)
    policy.touch(ks(0, 1, 2))  # all in T2
    policy.evict(1, protected=NONE)  # T1 empty -> T2's oldest k2 -> B2
    policy.insert(ks(7), [Block(7, 0)], {}, CTX)
    policy.evict(1, protected=NONE)  # k7 from T1 -> B1
    assert policy.state() == state(t2=(1, 0), b1=(7,), b2=(2,))
    policy.touch(ks(7))  # target 1
    policy.touch(ks(7))  # target 2
    policy.touch(ks(2))  # delta = max(1, 1 / 1) = 1
    assert policy.target_t1 == 1.0
    policy.touch(ks(2))
    policy.touch(ks(2))
    assert policy.target_t1 == 0.0


def test_arc_evicts_from_t1_while_t1_is_at_least_the_target() -> None:
    policy = arc_with(8, 0, 1, 2, 3)
    policy.touch(ks(2, 3))  # T1 = k0, k1; T2 = k3, k2
    policy._target = 1.0  # pyright: ignore[reportPrivateUsage] -- set the adaptive state directly
    # |T1| = 2 >= 1: k0; then virtual |T1| = 1 >= 1: k1; then T2.
    assert policy.evict(3, protected=NONE) == ks(0, 1, 3)
    assert policy.state() == state(t2=(2,), b1=(0, 1), b2=(3,), target=1.0)


def test_arc_evicts_from_t2_when_t1_is_below_the_target() -> None:
    policy = arc_with(8, 0, 1, 2)
    policy.touch(ks(1, 2))  # T1 = k0; T2 = k2, k1
    policy._target = 2.0  # pyright: ignore[reportPrivateUsage] -- set the adaptive state directly
    assert policy.evict(2, protected=NONE) == ks(2, 1)
    assert policy.state() == state(t1=(0,), b2=(2, 1), target=2.0)


@pytest.mark.parametrize("preferred", ["t1", "t2"])
def test_arc_falls_back_to_the_other_list_when_the_preferred_one_has_nothing_evictable(preferred: str) -> None:
    policy = arc_with(8, 0, 1, 2)
    policy.touch(ks(2))  # T1 = k0, k1; T2 = k2
    if preferred == "t1":
        assert policy.evict(2, protected={k(0), k(1)}) is None
        assert policy.evict(1, protected={k(0), k(1)}) == ks(2)
    else:
        policy._target = 5.0  # pyright: ignore[reportPrivateUsage] -- T1 below target: T2 preferred
        assert policy.evict(2, protected={k(2)}) == ks(0, 1)
        assert policy.state() == state(t2=(2,), b1=(0, 1), target=5.0)


def test_arc_evict_is_atomic_and_skips_busy_keys() -> None:
    policy = arc_with(8, 0, 1, 2)
    busy = policy.get(k(1))
    assert busy is not None
    busy.ref_cnt = 1
    before = policy.state()
    assert policy.evict(3, protected=NONE) is None
    assert policy.state() == before
    assert policy.evict(2, protected=NONE) == ks(0, 2)


def test_arc_ghost_lists_are_trimmed_to_capacity() -> None:
    policy = arc_with(2, 0, 1)
    policy.evict(2, protected=NONE)
    policy.insert(ks(2, 3), [Block(2, 0), Block(3, 0)], {}, CTX)  # T1 = k2, k3
    policy.evict(1, protected=NONE)
    assert policy.state() == state(t1=(3,), b1=(1, 2))


def test_arc_failed_store_is_removed_without_a_ghost() -> None:
    manager = CPUOffloadingManager(4, cache_policy="arc")
    manager.prepare_store(ks(0, 1), CTX)
    manager.complete_store(ks(0), CTX, success=False)
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    assert policy.state() == state(t1=(1,))


def test_arc_clear_resets_lists_and_target() -> None:
    policy = arc_with(4, 0, 1)
    policy.evict(1, protected=NONE)
    policy.touch(ks(0))
    assert policy.target_t1 == 1.0
    policy.clear()
    assert policy.state() == state()


def test_arc_manager_scenario_reuse_survives_a_scan() -> None:
    # Blocks used twice (T2) outlive a stream of blocks used once, which LRU
    # would let flush them.
    manager = CPUOffloadingManager(4, cache_policy="arc", enable_events=True)
    for i in (0, 1):
        out = manager.prepare_store([k(i)], CTX)
        assert out is not None
        manager.complete_store(out.keys_to_store, CTX)
    manager.touch(ks(0, 1), CTX)
    for i in range(10, 16):
        out = manager.prepare_store([k(i)], CTX)
        assert out is not None
        manager.complete_store(out.keys_to_store, CTX)
    assert [manager.lookup(key, CTX).name for key in ks(0, 1, 14, 15)] == ["HIT"] * 4
    evicted = [event.keys for event in manager.take_events() if event.removed]
    assert evicted == [[key] for key in ks(10, 11, 12, 13)]


def test_arc_a_block_reused_by_a_finished_request_outlives_a_scan_as_vllms_t2() -> None:
    # vLLM's T1 -> T2 scenario through its connector's calls (no touch), checked by evictions.
    manager = CPUOffloadingManager(4, cache_policy="arc", enable_events=True)
    writer = request("writer", 0, 1)
    out = manager.prepare_store(ks(0, 1), writer)
    assert out is not None
    manager.complete_store(out.keys_to_store, writer)
    manager.on_request_finished(writer)
    reader = request("reader", 0)
    manager.prepare_load([k(0)], reader)
    manager.complete_load([k(0)], reader)
    manager.on_request_finished(reader)  # k0's reuse counts here: T1 -> T2
    for i in range(10, 15):
        scan = request(f"scan{i}", i)
        out = manager.prepare_store([k(i)], scan)
        assert out is not None
        manager.complete_store(out.keys_to_store, scan)
        manager.on_request_finished(scan)
    evicted = [key for event in manager.take_events() if event.removed for key in event.keys]
    assert k(0) not in evicted and k(1) in evicted  # the block seen once went with the scan
    assert manager.lookup(k(0), ReqContext()).name == "HIT"


def test_arc_a_stored_block_is_not_a_reuse_and_a_retried_store_learns_from_its_ghost_once() -> None:
    manager = CPUOffloadingManager(2, cache_policy="arc", enable_events=True)
    first = request("first", 0, 1, 2)
    for keys in ([k(0), k(1)], [k(2)]):
        out = manager.prepare_store(keys, first)
        assert out is not None
        manager.complete_store(out.keys_to_store, first)
    manager.on_request_finished(first)  # stores only: nothing moves to T2
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    assert policy.state().t2 == () and policy.state().b1 == tuple(ks(0))
    again = request("again", 0)
    out = manager.prepare_store([k(0)], again)  # a B1 ghost stored again: T1's target grows once
    # The end of "first" ranked its keys head to tail in T1 (k1, its head, most recent): k2 goes.
    assert out is not None and out.evicted_keys == [k(2)]
    assert policy.target_t1 == 1.0
