"""Random request call sequences (vLLM's signal) rank exactly as vLLM's own manager, for both policies.

Hypothesis opens requests (announced with ``on_new_request`` or not, with
token positions for one or two KV cache groups, or none) and drives lookup,
prepare_load of ready keys, prepare_store, touch (where vLLM has it), complete_load /
complete_store (success and failure), on_request_finished and reset_cache for
them on a small cache. The reference model is the installed vLLM's
``CPUOffloadingManager`` given the same calls with its own contexts: every
store must answer the same keys, slots and evictions, every lookup the same
result, every event batch the same events (where vLLM's events carry the request,
EVENTS_CARRY_REQ_CONTEXT, a stored one names the same request). Besides, after every step no slot
is held by two keys, the policy tracks exactly the cached keys, the counts add
up, and an eviction only ever takes a ready, idle key that the store did not
name. The ranking rule by rule is in tests/manager/test_manager_lru.py.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("vllm", reason="vLLM is the reference model (make test installs it from requirements-vllm.txt)")

from vllm.v1.kv_offload.base import ReqContext as VLLMReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMCPUOffloadingManager

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import CPULoadStoreSpec, LookupResult, ReqContext
from kvtriton.integrations.vllm._surface import EVENTS_CARRY_REQ_CONTEXT, MANAGER_HAS_TOUCH
from kvtriton.manager import ARCCachePolicy, CPUOffloadingManager, LRUCachePolicy

BLOCKS = [f"key-{i}".encode() for i in range(5)]
UNIVERSE = [make_offload_key(block, group) for block in BLOCKS for group in (0, 1)]
PENDING = -1


def slot_ids(spec: object) -> list[int]:
    """The slots of a kvtriton or a vLLM CPU spec."""
    assert isinstance(spec, (CPULoadStoreSpec, VLLMCPULoadStoreSpec))
    return [int(slot) for slot in spec.block_ids]


prompts = st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=5, unique=True)
key_lists = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4)


class RequestMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(capacity=st.integers(min_value=1, max_value=5))
    def start(self, capacity: int) -> None:
        self.manager = CPUOffloadingManager(
            capacity, cache_policy=self.policy, enable_events=True, report_dropped_stores=True
        )
        self.vllm = VLLMCPUOffloadingManager(capacity, cache_policy=self.policy, enable_events=True)
        self.capacity = capacity
        self.requests: list[tuple[ReqContext, VLLMReqContext]] = []
        self.loads: list[tuple[ReqContext, VLLMReqContext, list[OffloadKey]]] = []
        self.stores: list[tuple[ReqContext, VLLMReqContext, list[OffloadKey]]] = []
        self.opened = 0

    def state_of(self) -> dict[OffloadKey, int]:
        """Each cached key's reader count (PENDING while its store runs), from the pending loads and stores."""
        state = dict.fromkeys(self.manager.slot_map(), 0)
        for _, _, keys in self.stores:
            for key in keys:
                if key in state:
                    state[key] = PENDING
        for _, _, keys in self.loads:
            for key in keys:
                if state.get(key, PENDING) != PENDING:
                    state[key] += 1
        return state

    @rule(prompt=prompts, groups=st.sampled_from([1, 1, 2, 0]), announce=st.booleans())
    def open_request(self, prompt: list[bytes], groups: int, announce: bool) -> None:
        """A request whose prompt's blocks end at 16, 32, ... tokens, in ``groups`` groups (0: no positions)."""
        context = ReqContext(req_id=f"r{self.opened}")
        reference = VLLMReqContext(req_id=f"r{self.opened}")
        self.opened += 1
        for index, block in enumerate(prompt):
            for group in range(groups):
                key = make_offload_key(block, group)
                context.set_offload_key_position(key, 16 * (index + 1))
                reference.set_offload_key_position(key, 16 * (index + 1))  # pyright: ignore[reportArgumentType] -- the same bytes under vLLM's NewType
        if announce:
            self.manager.on_new_request(context)
            self.vllm.on_new_request(reference)
        self.requests.append((context, reference))

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0), keys=key_lists)
    def load_the_ready_keys(self, index: int, keys: list[OffloadKey]) -> None:
        context, reference = self.requests[index % len(self.requests)]
        answers = [self.manager.lookup(key, context) for key in keys]
        assert [answer.name for answer in answers] == [self.vllm.lookup(key, reference).name for key in keys]  # pyright: ignore[reportArgumentType] -- as above
        ready = list(dict.fromkeys(key for key, answer in zip(keys, answers) if answer is LookupResult.HIT))
        if ready:
            spec = self.manager.prepare_load(ready, context)
            assert slot_ids(spec) == slot_ids(self.vllm.prepare_load(ready, reference))  # pyright: ignore[reportArgumentType] -- as above
            self.loads.append((context, reference, ready))

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0), keys=key_lists)
    def store(self, index: int, keys: list[OffloadKey]) -> None:
        context, reference = self.requests[index % len(self.requests)]
        keys = list(dict.fromkeys(keys))
        before = self.state_of()
        out = self.manager.prepare_store(keys, context)
        expected = self.vllm.prepare_store(keys, reference)  # pyright: ignore[reportArgumentType] -- as above
        assert (out is None) == (expected is None)
        if out is None or expected is None:
            assert self.manager.slot_map().keys() == before.keys()
            return
        assert (out.keys_to_store, out.evicted_keys) == (expected.keys_to_store, expected.evicted_keys)
        assert slot_ids(out.store_spec) == slot_ids(expected.store_spec)
        for key in out.evicted_keys:
            assert before.get(key) == 0, f"evicted {key!r} in state {before.get(key)}"
            assert key not in keys
        if out.keys_to_store:
            self.stores.append((context, reference, list(out.keys_to_store)))

    @precondition(lambda self: MANAGER_HAS_TOUCH and bool(self.requests))
    @rule(index=st.integers(min_value=0), keys=key_lists)
    def touch(self, index: int, keys: list[OffloadKey]) -> None:
        """Only where the installed vLLM's manager has ``touch`` (MANAGER_HAS_TOUCH)."""
        context, reference = self.requests[index % len(self.requests)]
        self.manager.touch(keys, context)
        getattr(self.vllm, "touch")(keys, reference)  # by name: the manager type of a vLLM without touch has none

    @precondition(lambda self: bool(self.loads))
    @rule(index=st.integers(min_value=0))
    def complete_a_load(self, index: int) -> None:
        context, reference, keys = self.loads.pop(index % len(self.loads))
        self.manager.complete_load(keys, context)
        self.vllm.complete_load(keys, reference)  # pyright: ignore[reportArgumentType] -- as above

    @precondition(lambda self: bool(self.stores))
    @rule(index=st.integers(min_value=0), success=st.sampled_from([True, True, True, False]))
    def complete_a_store(self, index: int, success: bool) -> None:
        context, reference, keys = self.stores.pop(index % len(self.stores))
        self.manager.complete_store(keys, context, success=success)
        self.vllm.complete_store(keys, reference, success=success)  # pyright: ignore[reportArgumentType] -- as above

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(min_value=0))
    def finish_a_request(self, index: int) -> None:
        context, reference = self.requests.pop(index % len(self.requests))
        self.manager.on_request_finished(context)
        self.manager.on_request_finished(context)  # a second call is a no-op
        self.vllm.on_request_finished(reference)

    @rule()
    def reset(self) -> None:
        self.manager.reset_cache()
        self.vllm.reset_cache()
        self.loads.clear()
        self.stores.clear()

    @invariant()
    def events_match_vllms(self) -> None:
        if not hasattr(self, "manager"):
            return
        ours = [(event.keys, event.removed, event.metadata_only, event) for event in self.manager.take_events()]
        theirs = [(list(event.keys), event.removed, event.metadata_only, event) for event in self.vllm.take_events()]
        assert [entry[:3] for entry in ours] == [entry[:3] for entry in theirs]
        if EVENTS_CARRY_REQ_CONTEXT:
            # A stored event names the request whose store completed: the same request on both sides.
            for (_, removed, _, event), (_, _, _, reference) in zip(ours, theirs):
                expected: VLLMReqContext | None = getattr(reference, "req_context")  # by name: only such events have it
                assert (event.req_context and event.req_context.req_id) == (expected and expected.req_id)
                assert removed or event.req_context is not None

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
