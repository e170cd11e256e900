"""LRUCachePolicy, rule by rule of docs/manager.md ("Recency"): vLLM's ranking.

Each test states one rule and checks it through the policy's order
(``ordered_keys``, least recent first) or the manager's exact evictions.
"""

from __future__ import annotations

import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.manager.policies import Block, LRUCachePolicy
from tests.manager.conftest import k, ks, request

CTX = ReqContext(req_id="test")
NONE: frozenset[OffloadKey] = frozenset()


def lru_with(*ids: int) -> LRUCachePolicy:
    """An LRU holding ready blocks ``ids`` stored one by one without positions (the first least recent)."""
    policy = LRUCachePolicy(8)
    for slot, i in enumerate(ids):
        policy.insert(ks(i), [Block(slot, 0)], {}, CTX)
    return policy


def order(manager: CPUOffloadingManager) -> list[OffloadKey]:
    policy = manager.policy
    assert isinstance(policy, LRUCachePolicy)
    return policy.ordered_keys()


def store(manager: CPUOffloadingManager, context: ReqContext, keys: list[OffloadKey]) -> list[OffloadKey]:
    """prepare_store then complete_store; returns the evicted keys."""
    out = manager.prepare_store(keys, context)
    assert out is not None
    manager.complete_store(out.keys_to_store, context)
    return out.evicted_keys


def load(manager: CPUOffloadingManager, context: ReqContext, keys: list[OffloadKey]) -> None:
    manager.prepare_load(keys, context)
    manager.complete_load(keys, context)


# --- without token positions (kvtriton's direct API, vLLM's tests' empty context) -------


def test_rule1_without_positions_a_batch_ranks_in_offer_order_the_first_least_recent() -> None:
    policy = lru_with(0)
    policy.insert(ks(1, 2), [Block(1), Block(2)], {}, CTX)
    assert policy.ordered_keys() == ks(0, 1, 2)


def test_rule2_touch_visits_keys_in_reverse_so_the_first_ends_most_recent() -> None:
    policy = lru_with(0, 1, 2, 3)
    policy.touch(ks(1, 0, 9))  # unknown keys are ignored
    assert policy.ordered_keys() == ks(2, 3, 0, 1)


def test_rule3_eviction_takes_the_least_recent_skipping_busy_and_protected_keys() -> None:
    policy = lru_with(0, 1, 2, 3)
    busy = policy.get(k(0))
    assert busy is not None
    busy.ref_cnt = 1  # loading
    assert policy.evict(2, protected={k(1)}) == ks(2, 3)
    assert policy.ordered_keys() == ks(0, 1)


def test_rule3_eviction_is_atomic_all_or_nothing() -> None:
    policy = lru_with(0, 1)
    assert policy.evict(3, protected=NONE) is None
    assert policy.ordered_keys() == ks(0, 1)
    assert policy.evict(0, protected=NONE) == []


def test_remove_and_clear_forget_keys() -> None:
    policy = lru_with(0, 1, 2)
    policy.remove(k(1))
    policy.remove(k(9))  # unknown: nothing happens
    assert policy.ordered_keys() == ks(0, 2)
    policy.clear()
    assert policy.ordered_keys() == []


def test_vllms_cpu_manager_scenario_with_exact_evictions() -> None:
    # vLLM's test_cpu_manager sequence, one shared context without positions.
    manager = CPUOffloadingManager(4, enable_events=True)
    assert store(manager, CTX, ks(1, 2)) == []
    assert store(manager, CTX, ks(2, 3, 4, 5)) == ks(1)
    manager.prepare_load(ks(2, 3), CTX)
    assert manager.prepare_store(ks(6, 7, 8), CTX) is None  # k2, k3 are being loaded
    manager.complete_load(ks(2, 3), CTX)
    out = manager.prepare_store(ks(6, 7, 8), CTX)
    assert out is not None and out.evicted_keys == ks(2, 3, 4)  # the oldest, in order
    manager.complete_store(out.keys_to_store, CTX)
    manager.touch(ks(5, 6, 7), CTX)
    assert store(manager, CTX, ks(9)) == ks(8)


# --- a running request ranks its keys by token position --------------------------------


def test_rule4_a_running_requests_keys_rank_by_position_tails_first_whatever_the_batch_order() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1, 2, 3)
    store(manager, context, ks(2, 3))  # a late batch first (the tail)
    store(manager, context, ks(1, 0))  # then the head, in reverse
    assert order(manager) == ks(3, 2, 1, 0)


def test_rule4_hybrid_groups_in_one_batch_rank_by_position_not_group_by_group() -> None:
    # A hybrid model's groups come out group 0 first; positions decide.
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1, groups=2)
    store(manager, context, [k(0, 0), k(1, 0), k(0, 1), k(1, 1)])
    # Both groups' tails (position 32) go first; at one position the keys' bytes break the tie.
    assert order(manager) == [k(1, 0), k(1, 1), k(0, 0), k(0, 1)]


def test_rule4_a_running_requests_new_blocks_rank_below_what_others_used_since_it_started() -> None:
    manager = CPUOffloadingManager(16)
    first = request("first", 0, 1)
    store(manager, first, ks(0, 1))
    manager.on_request_finished(first)
    loader = request("loader", 0, 1, 2)
    manager.prepare_load(ks(0, 1), loader)  # the loader's tick is taken here
    other = request("other", 7)
    store(manager, other, ks(7))
    manager.on_request_finished(other)
    manager.complete_load(ks(0, 1), loader)
    store(manager, loader, ks(2))
    # The loader's keys rank at its start, tail first, below k7.
    assert order(manager) == ks(2, 1, 0, 7)
    manager.on_request_finished(loader)
    assert order(manager) == ks(7, 2, 1, 0)


def test_rule5_an_access_only_raises_a_rank() -> None:
    manager = CPUOffloadingManager(8)
    early = request("early", 0, 5)
    store(manager, early, ks(5))  # early's tick is taken here
    store(manager, CTX, ks(0, 1))  # used after early started
    load(manager, early, ks(0))  # (early's tick, -16) is below k0's rank: it stays
    assert order(manager) == ks(5, 0, 1)
    load(manager, request("late", 0), ks(0))  # a request started since raises it
    assert order(manager) == ks(5, 1, 0)


def test_rule6_the_end_of_a_request_ranks_its_keys_most_recent_head_last() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1, 2)
    store(manager, context, ks(2))  # seen out of order
    store(manager, context, ks(0, 1))
    store(manager, CTX, ks(7))
    manager.on_request_finished(context)
    assert order(manager) == ks(7, 2, 1, 0)
    manager.on_request_finished(context)  # a second end changes nothing
    assert order(manager) == ks(7, 2, 1, 0)


def test_rule6_at_the_end_keys_at_one_position_stay_group_by_group() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1, groups=2)
    store(manager, context, [k(1, 1), k(0, 1), k(1, 0), k(0, 0)])
    manager.on_request_finished(context)
    # Head to tail by position, group 0 before group 1 at one position: the head's group 0 ends most recent.
    assert order(manager) == [k(1, 1), k(1, 0), k(0, 1), k(0, 0)]


def test_rule6_without_every_position_the_first_seen_order_stands_at_the_end() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0)  # k1 has no position
    store(manager, context, ks(1, 0))
    manager.on_request_finished(context)
    assert order(manager) == ks(0, 1)  # seen k1, k0: k1 ends most recent


def test_rule7_no_request_has_to_be_announced() -> None:
    # vLLM's tiering orchestrator never passes on_new_request to its primary tier.
    announced, silent = CPUOffloadingManager(4), CPUOffloadingManager(4)
    for manager, announce in ((announced, True), (silent, False)):
        contexts = [request("r1", 0, 1), request("r2", 2, 3), request("r3", 0, 1), request("r4", 4, 5)]
        if announce:
            for context in contexts:
                manager.on_new_request(context)
        store(manager, contexts[0], ks(0, 1))
        manager.on_request_finished(contexts[0])
        store(manager, contexts[1], ks(2, 3))
        manager.on_request_finished(contexts[1])
        load(manager, contexts[2], ks(0, 1))
        manager.on_request_finished(contexts[2])
        assert store(manager, contexts[3], ks(4, 5)) == ks(3, 2)


def test_rule8_after_a_reset_a_running_request_gets_a_new_rank() -> None:
    manager = CPUOffloadingManager(8)
    context = request("r", 0, 1)
    store(manager, context, ks(0))
    manager.reset_cache()
    store(manager, CTX, ks(7))
    store(manager, context, ks(1))  # ranked at its new tick, after k7
    assert order(manager) == ks(7, 1)


@pytest.mark.parametrize("finished", [False, True])
def test_a_running_request_evicts_its_own_tail_first_and_leaves_nothing_behind(finished: bool) -> None:
    manager = CPUOffloadingManager(2)
    context = request("r", 0, 1, 2, 3)
    store(manager, context, ks(0, 1))
    assert store(manager, context, ks(2, 3)) == ks(1, 0)
    if finished:
        manager.on_request_finished(context)
    assert order(manager) == ks(3, 2)
    assert manager.prepare_store(ks(4, 5), CTX) is not None
    assert order(manager) == ks(4, 5)
