"""CPUOffloadingManager, rule by rule of docs/manager.md, for every policy.

Scenarios use named keys ``k(0)``, ``k(1)``, ... and assert exact slot ids and
exact event lists. Rules whose outcome depends on the eviction choice live in
test_manager_lru.py / test_manager_arc.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Collection

import numpy as np
import pytest

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import CPULoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext
from kvtriton.manager import CPUOffloadingManager, ManagerStats, policy_names
from kvtriton.manager.policies import POLICIES as POLICY_REGISTRY
from tests.manager.conftest import k, ks

CTX = ReqContext(req_id="test")
POLICIES = policy_names()  # every registered policy meets the contract
RECENCY_POLICIES = ["lru", "arc"]  # the policies that order by recency (touch moves a key), where a FIFO would not


def make_manager(policy: str, num_blocks: int = 4, events: bool = True) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_blocks, cache_policy=policy, enable_events=events)


def full_manager(policy: str, num_blocks: int) -> CPUOffloadingManager:
    """A manager whose every block holds a stored key: k0 in slot 0, k1 in slot 1, ... (stored in that order)."""
    manager = make_manager(policy, num_blocks)
    for i in range(num_blocks):
        store(manager, ks(i))
    return manager


def slots(spec: object) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    assert spec.block_ids.dtype == np.int64
    return spec.block_ids.tolist()


def store(manager: CPUOffloadingManager, keys: Collection[OffloadKey], success: bool = True) -> PrepareStoreOutput:
    """prepare_store then complete_store; the output must not be None."""
    out = manager.prepare_store(keys, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX, success=success)
    return out


def removed(*ids: int) -> OffloadingEvent:
    return OffloadingEvent(keys=ks(*ids), medium="CPU", removed=True)


def stored(*ids: int) -> OffloadingEvent:
    return OffloadingEvent(keys=ks(*ids), medium="CPU", removed=False)


def lookups(manager: CPUOffloadingManager, *ids: int) -> list[LookupResult]:
    return [manager.lookup(k(i), CTX) for i in ids]


def refused(manager: CPUOffloadingManager, message: str, call: Callable[[], object]) -> None:
    """``call()`` raises ``ValueError`` with ``message`` (literal text) and leaves the manager's counts as they were."""
    before = manager.stats()
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
    assert manager.stats() == before


MISS, HIT, HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


# --- construction ------------------------------------------------------------------


@pytest.mark.parametrize("call", ["prepare_store", "prepare_load", "on_new_request", "on_request_finished"])
def test_a_request_id_for_req_context_is_refused_naming_the_argument_and_nothing_changes(call: str) -> None:
    manager = make_manager("lru")
    store(manager, ks(0))
    before = (manager.stats(), manager.slot_map())
    message = rf"^{call}: req_context must be a request context .*got str 'r1', which has no get_state\(\)$"
    with pytest.raises(TypeError, match=message):
        if call == "prepare_store":
            manager.prepare_store(ks(1), "r1")  # pyright: ignore[reportArgumentType] -- the wrong type is the point
        elif call == "prepare_load":
            manager.prepare_load(ks(0), "r1")  # pyright: ignore[reportArgumentType] -- as above
        else:
            getattr(manager, call)("r1")
    assert (manager.stats(), manager.slot_map()) == before  # nothing pinned, stored or counted


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_num_blocks_below_one_is_rejected(num_blocks: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be >= 1, got {num_blocks}"):
        CPUOffloadingManager(num_blocks)


@pytest.mark.parametrize("num_blocks", [2.0, True, "4"])
def test_num_blocks_that_is_not_an_int_is_rejected(num_blocks: object) -> None:
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        CPUOffloadingManager(num_blocks)  # pyright: ignore[reportArgumentType] -- the runtime check is under test


def test_unknown_policy_is_rejected_listing_the_valid_names() -> None:
    with pytest.raises(
        ValueError, match=rf"cache_policy must be one of {re.escape(str(policy_names()))}, got 'nosuch'"
    ):
        CPUOffloadingManager(4, cache_policy="nosuch")


def test_policy_names_are_the_registry_sorted_lru_and_arc_among_them() -> None:
    assert policy_names() == sorted(POLICY_REGISTRY)
    assert {"lru", "arc"} <= set(policy_names())


def test_manager_package_imports_without_torch_or_triton() -> None:
    code = "import sys, kvtriton.manager;print(','.join(m for m in ('torch', 'triton') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# --- block states ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_state_unknown_key_looks_up_as_miss(policy: str) -> None:
    assert lookups(make_manager(policy), 0) == [MISS]


@pytest.mark.parametrize("policy", POLICIES)
def test_state_pending_key_looks_up_as_hit_pending(policy: str) -> None:
    manager = make_manager(policy)
    manager.prepare_store(ks(0), CTX)
    assert lookups(manager, 0) == [HIT_PENDING]


@pytest.mark.parametrize("policy", POLICIES)
def test_state_completed_key_looks_up_as_hit(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))
    assert lookups(manager, 0) == [HIT]


@pytest.mark.parametrize("policy", POLICIES)
def test_state_loading_key_looks_up_as_hit(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))
    manager.prepare_load(ks(0), CTX)
    assert lookups(manager, 0) == [HIT]


@pytest.mark.parametrize("policy", POLICIES)
def test_state_lookup_never_changes_recency(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0))
    store(manager, ks(1))
    for _ in range(3):
        lookups(manager, 0)
    out = manager.prepare_store(ks(2), CTX)
    assert out is not None
    # k0 is the oldest whatever lookup said about it (and ARC did not promote it).
    assert out.evicted_keys == ks(0)


# --- prepare_store ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule1_present_keys_are_never_stored_again(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))  # ready
    manager.prepare_store(ks(1), CTX)  # pending
    out = manager.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None
    assert out.keys_to_store == ks(2)
    assert slots(out.store_spec) == [2]


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule1_keys_repeated_in_one_call_are_stored_once(policy: str) -> None:
    manager = make_manager(policy)
    out = manager.prepare_store(ks(0, 1, 0, 2, 1), CTX)
    assert out is not None
    assert out.keys_to_store == ks(0, 1, 2)
    assert slots(out.store_spec) == [0, 1, 2]
    assert manager.stats().pending == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule1_repeats_do_not_inflate_the_eviction(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0))
    out = manager.prepare_store(ks(1, 1, 1), CTX)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == (ks(1), [])


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule2_nothing_new_gives_an_empty_output_not_none(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))
    for keys in (ks(0), []):
        out = manager.prepare_store(keys, CTX)
        assert out is not None
        assert out.keys_to_store == []
        assert out.evicted_keys == []
        assert slots(out.store_spec) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule3_evicts_exactly_the_shortfall(policy: str) -> None:
    manager = full_manager(policy, 4)
    out = manager.prepare_store(ks(10, 11), CTX)
    assert out is not None
    assert out.evicted_keys == ks(0, 1)
    assert manager.stats() == ManagerStats(
        capacity=4, used=4, pending=2, loading=0, evictable=2, lookups=0, hits=0, evictions=2, stores=6
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule3_every_key_named_in_the_call_is_protected(policy: str) -> None:
    manager = full_manager(policy, 3)
    # k0 is the eviction candidate, but it is named in the call.
    out = manager.prepare_store(ks(0, 5), CTX)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == (ks(5), ks(1))
    assert lookups(manager, 0, 1, 2, 5) == [HIT, MISS, HIT, HIT_PENDING]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("blocker", ["pending", "loading", "protected"])
def test_prepare_store_rule3_none_when_room_cannot_be_made_changes_nothing(policy: str, blocker: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0))
    store(manager, ks(1))
    manager.touch(ks(1), CTX)
    named = ks(5, 6)
    if blocker == "pending":
        manager.reset_cache()
        manager.prepare_store(ks(0, 1), CTX)
    elif blocker == "loading":
        manager.prepare_load(ks(0, 1), CTX)
    else:
        named = ks(0, 1, 5)  # one slot needed, both candidates protected
    manager.take_events()
    before = (manager.stats(), manager.slot_map(), _policy_state(manager))

    assert manager.prepare_store(named, CTX) is None

    assert (manager.stats(), manager.slot_map(), _policy_state(manager)) == before
    assert list(manager.take_events()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule3_none_when_the_call_needs_more_than_capacity(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    assert manager.prepare_store(ks(0, 1, 2), CTX) is None
    assert manager.stats().used == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule4_evictions_in_order_with_one_removed_event(policy: str) -> None:
    manager = full_manager(policy, 3)
    assert list(manager.take_events()) == [stored(0), stored(1), stored(2)]
    out = manager.prepare_store(ks(7, 8, 9), CTX)
    assert out is not None
    assert out.evicted_keys == ks(0, 1, 2)
    assert list(manager.take_events()) == [removed(0, 1, 2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule4_new_keys_pending_in_input_order_with_co_indexed_slots(policy: str) -> None:
    manager = make_manager(policy, num_blocks=6)
    store(manager, ks(0, 1))
    out = manager.prepare_store(ks(9, 0, 4, 7), CTX)
    assert out is not None
    assert out.keys_to_store == ks(9, 4, 7)
    assert slots(out.store_spec) == [2, 3, 4]
    assert manager.slot_map() == {k(0): 0, k(1): 1, k(9): 2, k(4): 3, k(7): 4}
    assert lookups(manager, 9, 4, 7) == [HIT_PENDING] * 3


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule5_fresh_slots_first_then_last_freed_first(policy: str) -> None:
    manager = make_manager(policy, num_blocks=4)
    assert slots(store(manager, ks(0, 1)).store_spec) == [0, 1]
    out = manager.prepare_store(ks(2, 3), CTX)
    assert out is not None and slots(out.store_spec) == [2, 3]
    manager.complete_store(ks(3, 2), CTX, success=False)  # frees 3, then 2
    out = manager.prepare_store(ks(4, 5), CTX)
    assert out is not None and slots(out.store_spec) == [2, 3]


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule5_never_used_slots_go_before_freed_ones(policy: str) -> None:
    manager = make_manager(policy, num_blocks=5)
    assert slots(store(manager, ks(0, 1, 2)).store_spec) == [0, 1, 2]
    manager.prepare_store(ks(3), CTX)
    manager.complete_store(ks(3), CTX, success=False)  # slot 3 freed, slot 4 never used
    assert slots(store(manager, ks(4, 5)).store_spec) == [4, 3]
    # Full now. Without token positions a call's keys rank in offer order, the
    # first least recent (vLLM's rule): k0, k1, k2, k4, k5, so k0 goes
    # and slot 0 is reused.
    out = store(manager, ks(6))
    assert (out.evicted_keys, slots(out.store_spec)) == (ks(0), [0])


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_rule5_evicted_slots_are_reused_last_freed_first(policy: str) -> None:
    manager = full_manager(policy, 3)
    out = manager.prepare_store(ks(7, 8), CTX)
    assert out is not None
    assert out.evicted_keys == ks(0, 1)  # slots 0 then 1 freed
    assert slots(out.store_spec) == [1, 0]


# --- complete_store --------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_store_success_makes_pending_keys_ready_with_one_event(policy: str) -> None:
    manager = make_manager(policy)
    manager.prepare_store(ks(0, 1, 2), CTX)
    manager.complete_store({k(2), k(0)}, CTX)
    assert lookups(manager, 0, 1, 2) == [HIT, HIT_PENDING, HIT]
    events = list(manager.take_events())
    assert len(events) == 1
    assert sorted(events[0].keys) == sorted(ks(0, 2))
    assert (events[0].medium, events[0].removed) == ("CPU", False)


def test_a_stored_event_names_the_context_that_completed_the_store_and_no_other_event_names_one() -> None:
    manager = make_manager("lru", num_blocks=1)
    writer, other = ReqContext(req_id="writer"), ReqContext(req_id="other")
    manager.prepare_store(ks(0), writer)
    manager.complete_store(ks(0), writer)
    manager.prepare_store(ks(1), other)  # evicts k0
    manager.complete_store(ks(1), other, success=False)
    (stored_event, removed_event) = manager.take_events()
    assert stored_event.req_context is writer
    assert removed_event.removed and removed_event.req_context is None


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("success", [True, False])
@pytest.mark.parametrize(
    ("named", "bad", "why"),
    [
        ((1, 9), 9, "is not cached"),  # never prepared
        ((1, 0), 0, "is already stored"),  # completed before
        ((1, 1), 1, "is named twice in one call"),
    ],
)
def test_complete_store_of_a_key_without_a_store_in_flight_raises_naming_it_and_changes_nothing(
    policy: str, success: bool, named: tuple[int, ...], bad: int, why: str
) -> None:
    # One rule with complete_load: the first bad key is named, nothing is completed.
    manager = make_manager(policy)
    store(manager, ks(0))
    manager.prepare_store(ks(1), CTX)
    manager.take_events()
    refused(manager, f"complete_store: key {k(bad)!r} {why}", lambda: manager.complete_store(ks(*named), CTX, success))
    assert lookups(manager, 0, 1) == [HIT, HIT_PENDING]
    assert list(manager.take_events()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_store_skip_without_store_skips_keys_without_a_store_in_flight_as_vllm_does(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))
    manager.prepare_store(ks(1), CTX)
    manager.take_events()
    manager.complete_store([*ks(0, 1, 9), k(1)], CTX, skip_without_store=True)  # k(1) named twice, too
    assert list(manager.take_events()) == [stored(1)]
    assert manager.stats().pending == 0
    manager.complete_store(ks(0, 1, 9), CTX, skip_without_store=True)
    assert list(manager.take_events()) == []
    assert lookups(manager, 0, 1, 9) == [HIT, HIT, MISS]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_store_under_vllms_rule_drops_each_pending_key_once_and_skips_the_rest(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0))
    manager.prepare_store(ks(1), CTX)
    manager.complete_store([*ks(0, 1, 9), k(1)], CTX, success=False, skip_without_store=True)
    after = manager.stats()
    assert (after.used, after.pending, after.failed_stores) == (1, 0, 1)
    assert lookups(manager, 0, 1) == [HIT, MISS]
    out = manager.prepare_store(ks(2), CTX)  # the dropped key's slot is free again: no eviction
    assert out is not None and out.evicted_keys == [] and slots(out.store_spec) == [1]


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_store_failure_drops_pending_keys_and_frees_their_slots(policy: str) -> None:
    manager = make_manager(policy, num_blocks=3)
    store(manager, ks(0))
    manager.prepare_store(ks(1, 2), CTX)
    manager.take_events()
    manager.complete_store(ks(1, 2), CTX, success=False)
    assert lookups(manager, 0, 1, 2) == [HIT, MISS, MISS]
    assert list(manager.take_events()) == []
    assert manager.stats().used == 1
    # Both slots are free again (no pending key left blocking them).
    out = manager.prepare_store(ks(5, 6), CTX)
    assert out is not None
    assert (slots(out.store_spec), out.evicted_keys) == ([2, 1], [])


# --- prepare_load / complete_load ------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_load_spec_follows_the_iteration_order_of_keys(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0, 1, 2))
    assert slots(manager.prepare_load(ks(2, 0, 1), CTX)) == [2, 0, 1]
    as_dict = dict.fromkeys(ks(1, 2))
    assert slots(manager.prepare_load(as_dict.keys(), CTX)) == [1, 2]
    assert slots(manager.prepare_load((k(0),), CTX)) == [0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bad", ["missing", "pending"])
def test_prepare_load_of_a_key_not_ready_raises_naming_it_and_pins_nothing(policy: str, bad: str) -> None:
    manager = make_manager(policy, num_blocks=3)
    store(manager, ks(0, 1))
    if bad == "pending":
        manager.prepare_store(ks(2), CTX)
    refused(manager, f"prepare_load: key {k(2)!r} is", lambda: manager.prepare_load(ks(0, 1, 2), CTX))
    assert manager.stats().loading == 0
    # Nothing was pinned: both ready blocks can still be evicted.
    if bad == "pending":
        manager.complete_store(ks(2), CTX, success=False)
    out = manager.prepare_store(ks(7, 8, 9), CTX)
    assert out is not None
    assert len(out.evicted_keys) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_loading_keys_are_not_evictable_and_readers_stack(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0, 1))
    manager.prepare_load(ks(0), CTX)
    manager.prepare_load(ks(0, 1), CTX)
    assert manager.stats().loading == 2
    assert manager.prepare_store(ks(5), CTX) is None
    manager.complete_load(ks(0, 1), CTX)
    assert manager.stats().loading == 1
    out = manager.prepare_store(ks(5), CTX)
    assert out is not None and out.evicted_keys == ks(1)
    assert manager.prepare_store(ks(6), CTX) is None  # k0 still has one reader
    manager.complete_load(ks(0), CTX)
    out = manager.prepare_store(ks(6), CTX)
    assert out is not None and out.evicted_keys == ks(0)


@pytest.mark.parametrize("policy", POLICIES)
def test_complete_load_without_a_matching_load_raises_and_changes_nothing(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0, 1))
    manager.prepare_load(ks(0), CTX)
    refused(manager, f"complete_load: key {k(1)!r} has no load in flight", lambda: manager.complete_load(ks(0, 1), CTX))
    refused(manager, f"complete_load: key {k(9)!r}", lambda: manager.complete_load(ks(9), CTX))
    # The same key twice needs two readers.
    refused(manager, f"key {k(0)!r}", lambda: manager.complete_load([k(0), k(0)], CTX))
    manager.complete_load(ks(0), CTX)
    assert manager.stats().loading == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_load_call_names_its_first_bad_key_whatever_follows(policy: str) -> None:
    # The unknown-key check runs before any pin or release, yet the error
    # names the first key that fails in call order, and nothing changes.
    manager = make_manager(policy)
    store(manager, ks(0, 1))
    manager.prepare_store(ks(2), CTX)  # k2 stays pending
    refused(
        manager, f"prepare_load: key {k(2)!r} is still pending", lambda: manager.prepare_load([k(0), k(2), k(9)], CTX)
    )
    refused(manager, f"prepare_load: key {k(9)!r} is not cached", lambda: manager.prepare_load([k(0), k(9), k(2)], CTX))
    manager.prepare_load(ks(0), CTX)
    refused(
        manager,
        f"complete_load: key {k(1)!r} has no load in flight",
        lambda: manager.complete_load([k(0), k(1), k(9)], CTX),
    )
    refused(
        manager,
        f"complete_load: key {k(0)!r} has no load in flight",
        lambda: manager.complete_load([k(0), k(0), k(9)], CTX),
    )
    manager.complete_load(ks(0), CTX)
    assert manager.stats().loading == 0


# --- touch -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_ignores_unknown_keys(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0))
    store(manager, ks(1))
    manager.touch(ks(8, 9), CTX)
    out = manager.prepare_store(ks(2), CTX)
    assert out is not None and out.evicted_keys == ks(0)


@pytest.mark.parametrize("policy", RECENCY_POLICIES)
def test_touch_makes_the_first_key_most_recent(policy: str) -> None:
    manager = full_manager(policy, 3)
    manager.touch(ks(0, 1, 2), CTX)  # visited 2, 1, 0: k0 most recent
    out = manager.prepare_store(ks(7, 8), CTX)
    assert out is not None and out.evicted_keys == ks(2, 1)


# --- events ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_events_come_out_in_creation_order_and_the_queue_empties(policy: str) -> None:
    manager = make_manager(policy, num_blocks=2)
    store(manager, ks(0, 1))
    store(manager, ks(2))
    assert list(manager.take_events()) == [stored(0, 1), removed(0), stored(2)]
    assert list(manager.take_events()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_events_disabled_yield_nothing_and_store_nothing(policy: str) -> None:
    manager = make_manager(policy, num_blocks=1, events=False)
    store(manager, ks(0))
    store(manager, ks(1))
    assert list(manager.take_events()) == []


# --- reset_cache -----------------------------------------------------------------------


def busy_manager(policy: str) -> CPUOffloadingManager:
    """4 slots: blocks 0 and 1 stored, 1 loading, 2 pending; looked up 0 to 3 (hit, hit, pending hit, miss)."""
    manager = make_manager(policy, num_blocks=4)
    store(manager, ks(0, 1))
    manager.prepare_store(ks(2), CTX)
    manager.prepare_load(ks(1), CTX)
    lookups(manager, 0, 1, 2, 3)
    return manager


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_cache_drops_every_key_and_slot_without_events(policy: str) -> None:
    manager = busy_manager(policy)
    manager.take_events()
    manager.reset_cache()
    assert lookups(manager, 0, 1, 2) == [MISS, MISS, MISS]
    assert list(manager.take_events()) == []
    assert manager.slot_map() == {}
    stats = manager.stats()
    assert (stats.used, stats.pending, stats.loading, stats.evictable) == (0, 0, 0, 0)
    assert (stats.lookups, stats.hits) == (7, 2)  # traffic counters survive
    out = manager.prepare_store(ks(5), CTX)
    assert out is not None and slots(out.store_spec) == [0]  # slots start fresh


# --- stats and collections -------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_stats_snapshot_counts_occupancy_and_traffic(policy: str) -> None:
    stats = busy_manager(policy).stats()
    assert stats == ManagerStats(
        capacity=4,
        used=3,
        pending=1,
        loading=1,
        evictable=1,
        lookups=4,
        hits=2,
        pending_hits=1,
        evictions=0,
        stores=3,
        loads=1,
    )
    assert stats.occupancy == 0.75
    assert stats.free == 1
    assert stats.hit_rate == 0.5
    with pytest.raises(AttributeError):
        stats.used = 0  # pyright: ignore[reportAttributeAccessIssue] -- frozen: the assignment must fail


@pytest.mark.parametrize("policy", POLICIES)
def test_contains_reports_cached_keys_without_counting_a_lookup(policy: str) -> None:
    manager = make_manager(policy)
    store(manager, ks(0))
    manager.prepare_store(ks(1), CTX)
    assert [k(i) in manager for i in (0, 1, 2)] == [True, True, False]
    assert manager.stats().lookups == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_keys_may_be_any_collection(policy: str) -> None:
    manager = make_manager(policy, num_blocks=8)
    out = manager.prepare_store({k(0), k(1)}, CTX)
    assert out is not None and sorted(out.keys_to_store) == sorted(ks(0, 1))
    manager.complete_store(frozenset(out.keys_to_store), CTX)
    out = manager.prepare_store(dict.fromkeys(ks(2, 3, 2)).keys(), CTX)
    assert out is not None and out.keys_to_store == ks(2, 3)
    manager.complete_store(tuple(out.keys_to_store), CTX)
    manager.touch({k(0): None, k(3): None}.keys(), CTX)
    assert slots(manager.prepare_load({k(3)}, CTX)) == [manager.slot_map()[k(3)]]
    manager.complete_load(frozenset({k(3)}), CTX)
    assert manager.stats().loading == 0


def _policy_state(manager: CPUOffloadingManager) -> object:
    from kvtriton.manager.policies import ARCCachePolicy, LRUCachePolicy

    policy = manager.policy
    if isinstance(policy, LRUCachePolicy):
        return policy.ordered_keys()
    if isinstance(policy, ARCCachePolicy):
        return policy.state()
    return None  # a policy with no inspectable order: the slot map and the stats still show any change


# --- failed stores whose slots are held -----------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_held_failed_store_misses_at_once_but_its_slot_stays_out_of_the_pool_until_released(policy: str) -> None:
    manager = CPUOffloadingManager(3, cache_policy=policy, enable_events=True, report_dropped_stores=True)
    first = manager.prepare_store(ks(0, 1), CTX)
    assert first is not None and slots(first.store_spec) == [0, 1]
    manager.take_events()
    assert manager.hold_failed_stores(ks(1, 0)) == [1, 0]
    assert lookups(manager, 0, 1) == [MISS, MISS]
    stats = manager.stats()
    assert (stats.used, stats.pending, stats.held, stats.free, stats.failed_stores) == (0, 0, 2, 1, 2)
    # The held keys are announced as dropped (never readable), as a failed store's are.
    assert list(manager.take_events()) == [
        OffloadingEvent(keys=ks(1, 0), medium="CPU", removed=True, metadata_only=True)
    ]
    # Storing the key again takes a slot the late writer cannot touch; nothing more fits meanwhile.
    again = manager.prepare_store(ks(0), CTX)
    assert again is not None and slots(again.store_spec) == [2]
    assert manager.prepare_store(ks(5), CTX) is None
    manager.release_held_slots([1, 0])
    assert (manager.num_held_slots, manager.stats().free) == (0, 2)
    after = manager.prepare_store(ks(5, 6), CTX)
    assert after is not None and sorted(slots(after.store_spec)) == [0, 1]


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        (ks(0, 9), r"key .* is not cached .*"),
        (ks(1), r"key .* is already stored .*"),
        (ks(0, 0), r"key .* is named twice in one call"),
    ],
)
def test_holding_a_key_without_a_store_in_flight_is_refused_and_changes_nothing(
    keys: list[OffloadKey], why: str
) -> None:
    manager = make_manager("lru")
    store(manager, ks(1))
    manager.prepare_store(ks(0), CTX)
    before = manager.stats()
    with pytest.raises(ValueError, match=f"hold_failed_stores: {why}: no store in flight"):
        manager.hold_failed_stores(keys)
    assert manager.stats() == before and lookups(manager, 0, 1) == [HIT_PENDING, HIT]


def test_releasing_a_slot_that_is_not_held_is_refused_and_changes_nothing() -> None:
    manager = make_manager("lru")
    manager.prepare_store(ks(0, 1), CTX)
    manager.hold_failed_stores(ks(0))
    with pytest.raises(ValueError, match="release_held_slots: slot 1 is not held"):
        manager.release_held_slots([0, 1])
    with pytest.raises(ValueError, match="release_held_slots: slot 0 is named twice"):
        manager.release_held_slots([0, 0])
    assert manager.num_held_slots == 1


def test_reset_cache_is_refused_while_slots_are_held_and_works_once_they_are_released() -> None:
    manager = make_manager("lru")
    manager.prepare_store(ks(0, 1), CTX)
    manager.hold_failed_stores(ks(0))
    with pytest.raises(RuntimeError, match=r"reset_cache: 1 slot\(s\) of failed stores are still held"):
        manager.reset_cache()
    assert lookups(manager, 1) == [HIT_PENDING]  # refused: nothing forgotten
    manager.release_held_slots([0])
    manager.reset_cache()
    assert manager.stats().free == 4
