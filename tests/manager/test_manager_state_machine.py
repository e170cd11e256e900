"""Random call sequences against a tiny reference model, for both policies.

Hypothesis drives lookup / prepare_store / complete_store (success and
failure) / prepare_load / complete_load / touch / reset_cache on a small cache
and a small key universe. After every step it checks that no slot is held by
two keys, used + free = capacity, every count matches the model, and every
lookup agrees with the model. Each prepare_store is checked against the
model: the exact new keys and slots, evictions only of ready idle keys not
named in the call, ``None`` exactly when no room can be made (and then
nothing changed at all). A completion of keys without a store or load in
flight must raise and change nothing. For LRU the model also tracks the exact
recency order (vLLM's rule without token positions: a store appends its
keys in offer order, a touch moves its keys up in reverse), so the evicted
keys themselves are checked; the ranking by positions is held to vLLM's own
manager in tests/manager/test_manager_requests_machine.py.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import CPULoadStoreSpec, LookupResult, OffloadingEvent, ReqContext
from kvtriton.manager import ARCCachePolicy, CPUOffloadingManager, LRUCachePolicy, policy_names

CTX = ReqContext(req_id="machine")
UNIVERSE = [make_offload_key(f"key-{i}".encode()) for i in range(6)]
PENDING = -1

key_lists = st.lists(st.sampled_from(UNIVERSE), min_size=0, max_size=6)
containers = st.sampled_from(["list", "tuple", "set", "keys"])


def as_container(keys: list[OffloadKey], kind: str) -> Collection[OffloadKey]:
    if kind == "tuple":
        return tuple(keys)
    if kind == "set":
        return set(keys)
    if kind == "keys":
        return dict.fromkeys(keys).keys()
    return keys


@dataclass
class Model:
    """What the manager must contain: states, slots, the free list and (LRU) the recency order."""

    capacity: int
    state: dict[OffloadKey, int] = field(default_factory=lambda: {})
    """PENDING, or the number of readers (0 = ready, idle)."""
    slot: dict[OffloadKey, int] = field(default_factory=lambda: {})
    next_fresh: int = 0
    free: list[int] = field(default_factory=lambda: [])
    order: list[OffloadKey] = field(default_factory=lambda: [])
    """LRU recency, least recent first."""

    def evictable(self, named: Collection[OffloadKey]) -> list[OffloadKey]:
        return [key for key in self.order if self.state[key] == 0 and key not in named]

    def num_free(self) -> int:
        return self.capacity - self.next_fresh + len(self.free)

    def allocate(self, n: int) -> list[int]:
        fresh = min(n, self.capacity - self.next_fresh)
        slots = list(range(self.next_fresh, self.next_fresh + fresh))
        self.next_fresh += fresh
        for _ in range(n - fresh):
            slots.append(self.free.pop())
        return slots

    def drop(self, key: OffloadKey) -> None:
        self.free.append(self.slot.pop(key))
        del self.state[key]
        self.order.remove(key)

    def move_to_end(self, key: OffloadKey) -> None:
        self.order.remove(key)
        self.order.append(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.state:
                self.move_to_end(key)

    def insert(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        for key, slot in zip(keys, slots):
            self.state[key] = PENDING
            self.slot[key] = slot
        self.order.extend(keys)

    def reset(self) -> None:
        self.state.clear()
        self.slot.clear()
        self.next_fresh = 0
        self.free.clear()
        self.order.clear()


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.manager = CPUOffloadingManager(1, cache_policy=self.policy, enable_events=True)
        self.model = Model(capacity=1)

    @initialize(capacity=st.integers(min_value=1, max_value=5))
    def start(self, capacity: int) -> None:
        self.manager = CPUOffloadingManager(capacity, cache_policy=self.policy, enable_events=True)
        self.model = Model(capacity=capacity)

    # --- helpers ---------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        policy = self.manager.policy
        order: object = None  # a policy with no inspectable order: the slot map and the stats still show a change
        if isinstance(policy, LRUCachePolicy):
            order = policy.ordered_keys()
        elif isinstance(policy, ARCCachePolicy):
            order = policy.state()
        return (self.manager.stats(), self.manager.slot_map(), order)

    def expect(self, key: OffloadKey) -> LookupResult:
        state = self.model.state.get(key)
        if state is None:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if state == PENDING else LookupResult.HIT

    # --- rules -----------------------------------------------------------------

    @rule(key=st.sampled_from(UNIVERSE))
    def lookup(self, key: OffloadKey) -> None:
        assert self.manager.lookup(key, CTX) is self.expect(key)

    @rule(keys=key_lists, kind=containers)
    def prepare_store(self, keys: list[OffloadKey], kind: str) -> None:
        container = as_container(keys, kind)
        seen = list(container)
        model = self.model
        new = list(dict.fromkeys(key for key in seen if key not in model.state))
        shortfall = len(new) - model.num_free()
        candidates = model.evictable(set(seen))
        self.manager.take_events()
        before = self.snapshot()

        out = self.manager.prepare_store(container, CTX)

        if shortfall > len(candidates):
            assert out is None
            assert self.snapshot() == before
            assert list(self.manager.take_events()) == []
            return
        assert out is not None
        assert out.keys_to_store == new
        evicted = out.evicted_keys
        assert len(evicted) == max(shortfall, 0)
        for key in evicted:
            assert model.state.get(key) == 0, "only ready, idle keys may be evicted"
            assert key not in seen, "keys named in the call are protected"
        if self.policy == "lru":
            assert evicted == candidates[: len(evicted)]
        for key in evicted:
            model.drop(key)
        expected_slots = model.allocate(len(new))
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        assert out.store_spec.block_ids.tolist() == expected_slots
        model.insert(new, expected_slots)
        expected_events = [OffloadingEvent(keys=evicted, medium="CPU", removed=True)] if evicted else []
        assert list(self.manager.take_events()) == expected_events

    @rule(data=st.data(), success=st.booleans(), kind=containers)
    def complete_store(self, data: st.DataObject, success: bool, kind: str) -> None:
        pending_now = [key for key, state in self.model.state.items() if state == PENDING]
        # Mostly valid calls (drawn from pending keys), sometimes anything.
        pool = pending_now if pending_now and data.draw(st.booleans()) else UNIVERSE
        keys = data.draw(st.lists(st.sampled_from(pool), max_size=4))
        container = as_container(keys, kind)
        model = self.model
        named = list(container)
        pending = [key for key in named if model.state.get(key) == PENDING]
        self.manager.take_events()
        if len(pending) != len(named) or len(set(named)) != len(named):
            # A key without a store in flight (or named twice): refused, nothing completed.
            before = self.snapshot()
            with pytest.raises(ValueError, match="complete_store: key"):
                self.manager.complete_store(container, CTX, success=success)
            assert self.snapshot() == before
            assert list(self.manager.take_events()) == []
            return
        self.manager.complete_store(container, CTX, success=success)
        for key in pending:
            if success:
                model.state[key] = 0
            else:
                model.drop(key)
        expected = [OffloadingEvent(keys=pending, medium="CPU", removed=False)] if success and pending else []
        assert list(self.manager.take_events()) == expected

    @rule(keys=key_lists, kind=containers)
    def prepare_load(self, keys: list[OffloadKey], kind: str) -> None:
        container = as_container(keys, kind)
        model = self.model
        seen = list(container)
        if all(model.state.get(key, PENDING) >= 0 for key in seen):
            spec = self.manager.prepare_load(container, CTX)
            assert isinstance(spec, CPULoadStoreSpec)
            assert spec.block_ids.tolist() == [model.slot[key] for key in seen]
            for key in seen:
                model.state[key] += 1
        else:
            before = self.snapshot()
            with pytest.raises(ValueError, match="prepare_load: key"):
                self.manager.prepare_load(container, CTX)
            assert self.snapshot() == before

    @rule(data=st.data(), kind=containers)
    def complete_load(self, data: st.DataObject, kind: str) -> None:
        model = self.model
        loading = [key for key, readers in model.state.items() if readers > 0]
        # Mostly valid calls (drawn from loading keys), sometimes anything.
        pool = loading if loading and data.draw(st.booleans()) else UNIVERSE
        keys = data.draw(st.lists(st.sampled_from(pool), max_size=4))
        container = as_container(keys, kind)
        seen = list(container)
        valid = all(seen.count(key) <= max(model.state.get(key, 0), 0) for key in seen)
        if valid:
            self.manager.complete_load(container, CTX)
            for key in seen:
                model.state[key] -= 1
        else:
            before = self.snapshot()
            with pytest.raises(ValueError, match="complete_load: key"):
                self.manager.complete_load(container, CTX)
            assert self.snapshot() == before

    @rule(keys=key_lists, kind=containers)
    def touch(self, keys: list[OffloadKey], kind: str) -> None:
        container = as_container(keys, kind)
        self.manager.touch(container, CTX)
        self.model.touch(list(container))

    @rule()
    def reset_cache(self) -> None:
        self.manager.take_events()
        self.manager.reset_cache()
        self.model.reset()
        assert list(self.manager.take_events()) == []

    # --- invariants ------------------------------------------------------------

    @invariant()
    def slots_are_distinct_and_match_the_model(self) -> None:
        slot_map = self.manager.slot_map()
        assert len(set(slot_map.values())) == len(slot_map), "a slot is held by two keys"
        assert slot_map == self.model.slot

    @invariant()
    def counts_match_the_model(self) -> None:
        stats = self.manager.stats()
        states = list(self.model.state.values())
        assert stats.used + stats.free == stats.capacity == self.model.capacity
        assert stats.used == len(states)
        assert stats.pending == states.count(PENDING)
        assert stats.loading == sum(1 for readers in states if readers > 0)
        assert stats.evictable == states.count(0)

    @invariant()
    def lookups_agree_with_the_model(self) -> None:
        for key in UNIVERSE:
            assert self.manager.lookup(key, CTX) is self.expect(key)

    @invariant()
    def lru_order_matches_the_model(self) -> None:
        policy = self.manager.policy
        if isinstance(policy, LRUCachePolicy):
            assert policy.ordered_keys() == self.model.order


@pytest.mark.parametrize("policy", policy_names())
def test_every_registered_policy_keeps_the_managers_rules_under_any_call_sequence(policy: str) -> None:
    machine = type(f"{policy.upper()}Machine", (ManagerMachine,), {"policy": policy})
    run_state_machine_as_test(machine)
