"""LRUCachePolicy: one recency order, atomic eviction, the touched-run rule."""

from __future__ import annotations

from kvtriton.keys import OffloadKey, make_offload_key
from kvtriton.manager import CPUOffloadingManager
from kvtriton.manager.policies import PENDING, Block, LRUCachePolicy
from kvtriton.specs import ReqContext

CTX = ReqContext(req_id="test")
NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(f"block-{i}".encode())


def ks(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


def lru_with(*ids: int, ref_cnt: int = 0) -> LRUCachePolicy:
    """An LRU holding ``ids`` inserted one by one (the first least recent)."""
    policy = LRUCachePolicy(capacity=len(ids))
    for slot, i in enumerate(ids):
        policy.insert(ks(i), [Block(slot, ref_cnt)])
    return policy


def test_lru_insert_of_a_batch_puts_the_first_key_most_recent() -> None:
    policy = lru_with(0)
    policy.insert(ks(1, 2, 3), [Block(1), Block(2), Block(3)])
    assert policy.ordered_keys() == ks(0, 3, 2, 1)


def test_lru_touch_visits_keys_in_reverse_so_the_first_ends_most_recent() -> None:
    policy = lru_with(0, 1, 2, 3)
    policy.touch(ks(1, 9, 0))
    assert policy.ordered_keys() == ks(2, 3, 0, 1)


def test_lru_evicts_from_the_least_recent_end_skipping_busy_and_protected_keys() -> None:
    policy = lru_with(0, 1, 2, 3, 4)
    busy = policy.get(k(0))
    pending = policy.get(k(1))
    assert busy is not None and pending is not None
    busy.ref_cnt = 2  # loading
    pending.ref_cnt = PENDING
    assert policy.evict(2, protected={k(2)}) == ks(3, 4)
    assert policy.ordered_keys() == ks(0, 1, 2)


def test_lru_evict_is_atomic_all_or_nothing() -> None:
    policy = lru_with(0, 1, 2)
    assert policy.evict(3, protected={k(1)}) is None
    assert policy.ordered_keys() == ks(0, 1, 2)
    assert policy.evict(0, protected=NONE) == []


def test_lru_remove_and_clear_forget_keys() -> None:
    policy = lru_with(0, 1, 2)
    policy.remove(k(1))
    policy.remove(k(9))  # unknown: ignored
    assert policy.ordered_keys() == ks(0, 2)
    assert policy.get(k(1)) is None
    policy.clear()
    assert policy.ordered_keys() == []


def test_lru_blocks_stored_after_a_touch_rank_just_below_the_touched_run() -> None:
    # (kvtriton) the engine touches a request's cached prefix, then stores the
    # blocks extending it: those go before the prefix they extend.
    policy = lru_with(0, 1, 2)
    policy.touch(ks(0))
    policy.insert(ks(5, 6), [Block(5, 0), Block(6, 0)])
    assert policy.ordered_keys() == ks(1, 2, 6, 5, 0)
    policy.insert(ks(7), [Block(7, 0)])  # the run stays on top until the next touch
    assert policy.ordered_keys() == ks(1, 2, 6, 5, 7, 0)
    policy.touch(ks(1))
    policy.insert(ks(8), [Block(8, 0)])
    assert policy.ordered_keys() == ks(2, 6, 5, 7, 0, 8, 1)
    assert policy.evict(3, protected=NONE) == ks(2, 6, 5)


def test_lru_without_touches_is_plain_lru() -> None:
    policy = lru_with(0, 1)
    policy.insert(ks(2), [Block(2, 0)])
    assert policy.ordered_keys() == ks(0, 1, 2)


def test_lru_touched_run_ignores_a_key_stored_again_since_the_touch() -> None:
    policy = lru_with(0)
    policy.insert(ks(1), [Block(1)])  # pending
    policy.touch(ks(1))
    policy.remove(k(1))  # its store failed
    policy.insert(ks(1), [Block(1)])  # stored again: a new block, not the touched one
    policy.insert(ks(2), [Block(2)])
    assert policy.ordered_keys() == ks(0, 1, 2)


def test_lru_manager_scenario_with_exact_evictions() -> None:
    manager = CPUOffloadingManager(3, cache_policy="lru", enable_events=True)
    for i in range(3):
        out = manager.prepare_store(ks(i), CTX)
        assert out is not None
        manager.complete_store(out.keys_to_store, CTX)
    manager.touch(ks(0), CTX)  # order: k1, k2, k0
    out = manager.prepare_store(ks(3), CTX)  # evicts k1, k3 ranks below k0
    assert out is not None and out.evicted_keys == ks(1)
    manager.complete_store(ks(3), CTX)
    manager.prepare_load(ks(2), CTX)  # k2 pinned
    out = manager.prepare_store(ks(4), CTX)  # k2 busy: k3 goes
    assert out is not None and out.evicted_keys == ks(3)
    assert manager.slot_map() == {k(0): 0, k(2): 2, k(4): 1}
