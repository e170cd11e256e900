"""Random request-tracked call sequences (vLLM's signal) keep the manager consistent, for both policies.

Hypothesis opens and finishes requests (``on_new_request`` /
``on_request_finished``, with token positions) and drives lookup,
prepare_load of ready keys, prepare_store, complete_load / complete_store
(success and failure) and reset_cache for them on a small cache. The recency
the request hooks produce is checked rule by rule in
tests/test_manager_requests.py; here the checks are the ones no ranking may
break: after every step no slot is held by two keys, the policy tracks exactly
the cached keys, the counts add up, and an eviction only ever takes a ready,
idle key that the store did not name.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtriton.keys import OffloadKey, make_offload_key
from kvtriton.manager import ARCCachePolicy, CPUOffloadingManager, LRUCachePolicy
from kvtriton.specs import LookupResult, ReqContext

UNIVERSE = [make_offload_key(f"key-{i}".encode()) for i in range(5)]
PENDING = -1

prompts = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True)


class RequestMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(capacity=st.integers(min_value=1, max_value=4))
    def start(self, capacity: int) -> None:
        self.manager = CPUOffloadingManager(capacity, cache_policy=self.policy, enable_events=True, report_dropped_stores=True)
        self.capacity = capacity
        self.requests: list[ReqContext] = []
        self.loads: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.stores: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.opened = 0

    def state_of(self) -> dict[OffloadKey, int]:
        """Each cached key's reader count (PENDING while its store runs), from the pending loads and stores."""
        state = dict.fromkeys(self.manager.slot_map(), 0)
        for _, keys in self.stores:
            for key in keys:
                if key in state:
                    state[key] = PENDING
        for _, keys in self.loads:
            for key in keys:
                if state.get(key, PENDING) != PENDING:
                    state[key] += 1
        return state

    @rule(prompt=prompts)
    def open_request(self, prompt: list[OffloadKey]) -> None:
        context = ReqContext(req_id=f"r{self.opened}")
        self.opened += 1
        for index, key in enumerate(prompt):
            context.set_offload_key_position(key, 16 * (index + 1))
        self.manager.on_new_request(context)
        self.requests.append(context)

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0), keys=prompts)
    def load_the_ready_keys(self, index: int, keys: list[OffloadKey]) -> None:
        context = self.requests[index % len(self.requests)]
        ready = [key for key in keys if self.manager.lookup(key, context) is LookupResult.HIT]
        if ready:
            self.manager.prepare_load(ready, context)
            self.loads.append((context, ready))

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0), keys=prompts)
    def store(self, index: int, keys: list[OffloadKey]) -> None:
        context = self.requests[index % len(self.requests)]
        before = self.state_of()
        out = self.manager.prepare_store(keys, context)
        if out is None:
            assert self.manager.slot_map().keys() == before.keys()
            return
        for key in out.evicted_keys:
            assert before.get(key) == 0, f"evicted {key!r} in state {before.get(key)}"
            assert key not in keys
        assert set(out.keys_to_store) == {key for key in keys if key not in before}
        if out.keys_to_store:
            self.stores.append((context, list(out.keys_to_store)))

    @precondition(lambda self: bool(self.loads))
    @rule(index=st.integers(min_value=0))
    def complete_a_load(self, index: int) -> None:
        context, keys = self.loads.pop(index % len(self.loads))
        self.manager.complete_load(keys, context)

    @precondition(lambda self: bool(self.stores))
    @rule(index=st.integers(min_value=0), success=st.sampled_from([True, True, True, False]))
    def complete_a_store(self, index: int, success: bool) -> None:
        context, keys = self.stores.pop(index % len(self.stores))
        self.manager.complete_store(keys, context, success=success)

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0))
    def finish_a_request(self, index: int) -> None:
        context = self.requests.pop(index % len(self.requests))
        self.manager.on_request_finished(context)
        self.manager.on_request_finished(context)  # a second call is a no-op

    @rule()
    def reset(self) -> None:
        self.manager.reset_cache()
        self.loads.clear()
        self.stores.clear()

    @invariant()
    def slots_are_distinct(self) -> None:
        slot_map = self.manager.slot_map()
        assert len(set(slot_map.values())) == len(slot_map)
        assert all(0 <= slot < self.capacity for slot in slot_map.values())

    @invariant()
    def the_policy_tracks_exactly_the_cached_keys(self) -> None:
        cached = set(self.manager.slot_map())
        policy = self.manager.policy
        if isinstance(policy, LRUCachePolicy):
            order = policy.ordered_keys()
            assert len(order) == len(cached) and set(order) == cached
        elif isinstance(policy, ARCCachePolicy):
            state = policy.state()
            assert set(state.t1).isdisjoint(state.t2)
            assert set(state.t1) | set(state.t2) == cached
            assert len(state.b1) <= self.capacity and len(state.b2) <= self.capacity

    @invariant()
    def counts_add_up(self) -> None:
        stats = self.manager.stats()
        states = list(self.state_of().values())
        assert stats.used + stats.free == stats.capacity
        assert stats.pending == states.count(PENDING)
        assert stats.loading == sum(1 for readers in states if readers > 0)
        assert stats.evictable == states.count(0)


class LRURequestMachine(RequestMachine):
    policy = "lru"


class ARCRequestMachine(RequestMachine):
    policy = "arc"


TestLRURequestMachine = LRURequestMachine.TestCase
TestLRURequestMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestARCRequestMachine = ARCRequestMachine.TestCase
TestARCRequestMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
