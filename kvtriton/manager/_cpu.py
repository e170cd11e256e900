"""The host-memory offloading manager: slots, block states, eviction, events."""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from typing import NamedTuple, NoReturn, cast

from kvtriton._int_argument import check_int
from kvtriton._keys import OffloadKey
from kvtriton._offload_types import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from kvtriton.manager._base import OffloadingManager, override
from kvtriton.manager._request_access import RequestAccess, head_to_tail
from kvtriton.manager._slot_pool import SlotPool
from kvtriton.manager._stats import ManagerStats
from kvtriton.manager.policies import (
    PENDING,
    Block,
    CachePolicy,
    KeyRun,
    RequestAwarePolicy,
    canonical_policy_name,
    make_policy,
    run_keys,
)

_MEDIUM = CPULoadStoreSpec.MEDIUM
# Module-level names: lookup, the hottest call, returns these without an enum attribute lookup.
_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
_NO_POSITIONS: Mapping[OffloadKey, int | None] = {}


class _RequestHooks(NamedTuple):
    """The policy's request-scoped calls, or vLLM's defaults for a policy without them."""

    on_request_access: (
        Callable[[Sequence[OffloadKey], Sequence[Block | None], Sequence[int | None], ReqContext], None] | None
    )
    """None for a plain ``CachePolicy``: nothing ranks a running request's keys."""
    on_store_miss: Callable[[Sequence[OffloadKey]], None]
    on_request_finished: Callable[[Sequence[KeyRun], ReqContext], None]


def _request_hooks(policy: CachePolicy) -> _RequestHooks:
    """Bind ``policy``'s request hooks once; a plain ``CachePolicy`` gets ``touch`` (vLLM's defaults)."""
    if isinstance(policy, RequestAwarePolicy):
        return _RequestHooks(policy.on_request_access, policy.on_store_miss, policy.on_request_finished)
    touch = policy.touch

    def finished(runs: Sequence[KeyRun], req_context: ReqContext) -> None:
        del req_context
        touch(run_keys(runs))

    return _RequestHooks(None, touch, finished)


def _refuse_non_bytes(keys: Sequence[object]) -> NoReturn:
    bad = next(key for key in keys if not isinstance(key, bytes))
    raise TypeError(
        f"prepare_store: key {bad!r} is a {type(bad).__name__}; keys are bytes (OffloadKey: the block hash "
        "followed by the 4-byte group index, see kvtriton._keys.make_offload_key)"
    )


_join_bytes = b"".join

_CONTEXT_METHODS = ("get_state", "set_state", "get_offload_key_position")
"""What the manager reads a request context through (kvtriton's ``ReqContext`` and vLLM's both have them)."""


def _check_context(call: str, req_context: object) -> None:
    """Raise ``TypeError`` naming ``req_context`` when it is no request context (a request id passed instead).

    Called only once reading the context failed, so a real context costs nothing.
    """
    missing = [name for name in _CONTEXT_METHODS if not callable(getattr(req_context, name, None))]
    if missing:
        raise TypeError(
            f"{call}: req_context must be a request context (kvtriton._offload_types.ReqContext, or vLLM's ReqContext), "
            f"got {type(req_context).__name__} {req_context!r}, which has no {missing[0]}()"
        )


class CPUOffloadingManager(OffloadingManager):
    """Tracks which blocks sit in which slot of a host slab of ``num_blocks`` slots.

    A key is *pending* from ``prepare_store`` until ``complete_store``, then
    *ready*; ``prepare_load`` adds a reader and ``complete_load`` removes one.
    Only ready blocks without readers are evictable, chosen by the named
    ``cache_policy`` (see ``kvtriton.manager.policies``; any case). With
    ``enable_events`` every store completion and every eviction is queued as
    an ``OffloadingEvent`` for ``take_events`` (a store's names the request
    that completed it); with ``report_dropped_stores``
    too, a failed store queues a ``metadata_only`` removal of its keys (what
    vLLM emits, so its events tracker can drop what it recorded).

    Recency is vLLM's: every ``prepare_load`` and ``prepare_store``
    records the keys of its request in the request's context
    (``kvtriton.manager._request_access``), the policy ranks a running
    request's keys by their token positions, and ``on_request_finished``
    commits them head to tail; ``touch`` marks keys used at once. No call
    has to announce a request first (``on_new_request`` is optional).
    """

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        *,
        report_dropped_stores: bool = False,
    ) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        self._policy_name = canonical_policy_name(cache_policy)
        self._policy: CachePolicy = make_policy(self._policy_name, num_blocks)
        self._hooks = _request_hooks(self._policy)
        self._pool = SlotPool(num_blocks)
        # The authoritative index of cached keys. The policy keeps the same
        # Block objects in its own order; lookups and state changes go
        # through this plain dict and never call into the policy.
        self._blocks: dict[OffloadKey, Block] = {}
        # One Block per slot, made when the slot is first handed out and
        # reused for every key stored in it: a key leaves every structure
        # (this index, the policy) before its slot is handed out again, and
        # resetting a record is a third of the cost of making one.
        self._slot_blocks: list[Block] = []
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._num_pending = 0
        self._num_loading = 0
        # Slots of failed stores kept out of the pool until released (hold_failed_stores).
        self._held_slots: set[int] = set()
        # Lookups are counted by outcome only (lookups = misses + hits +
        # pending hits): one increment per lookup, the hottest call.
        self._misses = 0
        self._hits = 0
        self._pending_hits = 0
        self._evictions = 0
        self._stores = 0
        self._loads = 0
        self._failed_stores = 0
        self.report_dropped_stores = report_dropped_stores
        self.allocation_sizes: list[int] | None = None
        """``None``, or a list each ``prepare_store`` that needs new slots appends its count to.

        vLLM's ``kv_offload_cpu_allocation_size`` histogram: the count is
        appended before the allocation is tried, so a store refused for lack
        of room counts too. The vLLM adapter sets a list and drains it.
        """
        # Bumped by reset_cache: a request's record from before a reset is stale.
        self._generation = 0

    # --- introspection -------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the host slab (``num_blocks``)."""
        return self._pool.capacity

    @property
    def cache_policy(self) -> str:
        """The policy's registry name (lower case)."""
        return self._policy_name

    @property
    def policy(self) -> CachePolicy:
        """The policy object (read it, do not drive it: the manager owns its state)."""
        return self._policy

    def stats(self) -> ManagerStats:
        """A snapshot of occupancy and counters."""
        used = len(self._blocks)
        return ManagerStats(
            capacity=self._pool.capacity,
            used=used,
            pending=self._num_pending,
            loading=self._num_loading,
            evictable=used - self._num_pending - self._num_loading,
            held=len(self._held_slots),
            lookups=self._misses + self._hits + self._pending_hits,
            hits=self._hits,
            pending_hits=self._pending_hits,
            evictions=self._evictions,
            stores=self._stores,
            loads=self._loads,
            failed_stores=self._failed_stores,
        )

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached, pending or ready; unlike ``lookup`` it counts nothing."""
        return key in self._blocks

    def slot_map(self) -> dict[OffloadKey, int]:
        """A copy of the key -> slot assignment of every cached block (pending included)."""
        return {key: block.slot for key, block in self._blocks.items()}

    # --- request records -------------------------------------------------

    def _current_access(self, call: str, req_context: ReqContext) -> RequestAccess | None:
        """This manager's record of ``req_context``'s request, or None when it has none since the last reset."""
        try:
            access = req_context.get_state(RequestAccess)
        except AttributeError:
            _check_context(call, req_context)
            raise
        if access is None or access.owner is not self or access.generation != self._generation:
            return None
        return access

    def _access(self, call: str, req_context: ReqContext) -> RequestAccess:
        """This manager's record of ``req_context``'s request, made on first use (and renewed after a reset)."""
        access = self._current_access(call, req_context)
        if access is None:
            access = RequestAccess(self, self._generation)
            req_context.set_state(access)
        return access

    def _observe(
        self, access: RequestAccess, keys: list[OffloadKey], blocks: list[Block | None], req_context: ReqContext
    ) -> None:
        """Record the keys of ``keys`` the request sees for the first time and let the policy rank them.

        ``blocks[i]`` is ``keys[i]``'s block (None: not cached). Nothing is
        recorded once the request has finished: its access was committed then.
        """
        if access.finished:
            return
        new, positions = access.observe(keys, req_context.get_offload_key_position)
        on_access = self._hooks.on_request_access
        if new and on_access is not None:
            if new is not keys:
                blocks = list(map(self._blocks.get, new))
            on_access(new, blocks, positions, req_context)

    @override
    def on_new_request(self, req_context: ReqContext) -> None:
        self._access("on_new_request", req_context)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        access = self._current_access("on_request_finished", req_context)
        if access is None or access.finished:
            return
        access.finished = True
        if not access.positions:
            return
        recorded = access.positions
        keys = list(recorded)
        positions = list(recorded.values())
        if None in positions:
            # vLLM reads the positions at the end; a key without one when first seen may have one now.
            position_of = req_context.get_offload_key_position
            positions = [found if found is not None else position_of(key) for key, found in zip(keys, positions)]
        ordered = head_to_tail(keys, positions)
        self._hooks.on_request_finished(access.runs(ordered), req_context)

    # --- OffloadingManager ---------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        block = self._blocks.get(key)
        if block is None:
            self._misses += 1
            return _MISS
        if block.ref_cnt == PENDING:
            self._pending_hits += 1
            return _HIT_PENDING
        self._hits += 1
        return _HIT

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        loaded = keys if isinstance(keys, list) else list(keys)
        got = list(map(self._blocks.get, loaded))
        if None in got:  # C speed; nothing is pinned yet
            self._refuse_load(loaded, got, 0)
        access = self._access("prepare_load", req_context)  # before pinning: a bad context changes nothing
        newly_loading = 0
        # One pass that pins as it validates; on a pending key the pins taken
        # so far are undone before raising, so a failed call changes nothing.
        # Pins never make a block pending, so the first pending block met is
        # the first pending one in ``got``: everything before it was pinned.
        for block in cast("list[Block]", got):  # no None (checked above)
            count = block.ref_cnt
            if count <= 0:
                if count:  # PENDING, the only negative count
                    self._refuse_load(loaded, got, got.index(block))
                newly_loading += 1
            block.ref_cnt = count + 1
        self._num_loading += newly_loading
        self._loads += len(got)
        self._observe(access, loaded, got, req_context)
        access.reuse(loaded)
        return CPULoadStoreSpec.from_slots([block.slot for block in cast("list[Block]", got)])

    @staticmethod
    def _refuse_load(keys: Sequence[OffloadKey], got: list[Block | None], pinned: int) -> NoReturn:
        """Undo the pins ``prepare_load`` took on ``got[:pinned]`` and raise for the first uncached or pending key."""
        for taken in got[:pinned]:
            if taken is not None:
                taken.ref_cnt -= 1
        bad = next(i for i, block in enumerate(got) if block is None or block.ref_cnt == PENDING)
        block = got[bad]
        state = "not cached" if block is None else "still pending (its store has not completed)"
        raise ValueError(f"prepare_load: key {keys[bad]!r} is {state}")

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        got = list(map(self._blocks.get, keys))
        if None in got:  # C speed; nothing is released yet
            self._refuse_completion(keys, got, 0)
        now_idle = 0
        for index, block in enumerate(cast("list[Block]", got)):  # no None (checked above)
            count = block.ref_cnt - 1
            if count < 0:
                self._refuse_completion(keys, got, index)
            block.ref_cnt = count
            if not count:
                now_idle += 1
        self._num_loading -= now_idle

    @staticmethod
    def _refuse_completion(keys: Collection[OffloadKey], got: list[Block | None], released: int) -> NoReturn:
        """Undo the releases ``complete_load`` made on ``got[:released]`` and raise for the first key without a load."""
        for taken in got[:released]:
            if taken is not None:
                taken.ref_cnt += 1
        # The first key whose release would fail, counting the releases of
        # the same block earlier in the call (a key may be named twice).
        left: dict[int, int] = {}
        bad = 0
        for bad, block in enumerate(got):  # noqa: B007 -- read after the loop: the index where the walk stopped
            if block is None:
                break
            count = left.get(id(block), block.ref_cnt) - 1
            if count < 0:
                break
            left[id(block)] = count
        key = list(keys)[bad]
        raise ValueError(f"complete_load: key {key!r} has no load in flight (no matching prepare_load)")

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        offered = keys if isinstance(keys, list) else list(keys)
        # C speed: refuses anything but bytes (str keys above all), before anything is recorded.
        try:
            _join_bytes(offered)
        except TypeError:
            _refuse_non_bytes(offered)
        access = self._access("prepare_store", req_context)
        # One pass sorts the offer: keys to store (named once), keys the
        # request records (not a key another request is still storing: that
        # one is not this request's yet), ready keys (reused) and cached keys
        # (the only ones an eviction could take, so protecting them protects
        # the whole offer: the caller was just told they are cached).
        to_store: dict[OffloadKey, None] = {}
        recorded: list[OffloadKey] = []
        recorded_blocks: list[Block | None] = []
        ready: list[OffloadKey] = []
        cached: set[OffloadKey] = set()
        for key, block in zip(offered, map(self._blocks.get, offered)):
            if block is None:
                to_store[key] = None
            else:
                cached.add(key)
                if block.ref_cnt == PENDING:
                    continue
                ready.append(key)
            recorded.append(key)
            recorded_blocks.append(block)
        self._observe(access, recorded, recorded_blocks, req_context)
        access.reuse(ready)
        if not to_store:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec.from_slots([]), evicted_keys=[])
        new_keys = list(to_store)
        misses = access.store_misses(new_keys)
        if misses:
            # ARC learns from B1/B2 before insert removes the ghost entries; once per key and request.
            self._hooks.on_store_miss(misses)
        sizes = self.allocation_sizes
        if sizes is not None:
            sizes.append(len(new_keys))
        # Positions the record read (none after the request finished: the policy asks the context).
        positions: Mapping[OffloadKey, int | None] = access.positions if not access.finished else _NO_POSITIONS
        output = self._store(new_keys, positions, cached, req_context)
        if output is not None:
            access.inserted.update(new_keys)
        return output

    def _store(
        self,
        new_keys: list[OffloadKey],
        positions: Mapping[OffloadKey, int | None],
        cached: Container[OffloadKey],
        req_context: ReqContext,
    ) -> PrepareStoreOutput | None:
        """Allocate slots for ``new_keys`` (distinct, none cached), evicting if needed, but none of ``cached``.

        ``cached`` are the offer's keys that are cached: the only ones an
        eviction could take, so protecting them protects the whole offer
        (the caller was just told they are cached, so they must stay).
        """
        blocks = self._blocks
        pool = self._pool
        shortfall = len(new_keys) - pool.num_free
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            evictable = len(blocks) - self._num_pending - self._num_loading
            if shortfall > evictable:
                return None
            victims = self._policy.evict(shortfall, cached)
            if victims is None:
                return None
            evicted = victims
            pop = blocks.pop
            pool.release_many([pop(key).slot for key in evicted])
            self._evictions += len(evicted)
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=list(evicted), medium=_MEDIUM, removed=True))

        slots = pool.allocate(len(new_keys))
        slot_blocks = self._slot_blocks
        if max(slots) >= len(slot_blocks):  # slots handed out for the first time (in increasing order)
            slot_blocks.extend(map(Block, range(len(slot_blocks), max(slots) + 1)))
        made = list(map(slot_blocks.__getitem__, slots))
        for block in made:
            block.ref_cnt = PENDING
        blocks.update(zip(new_keys, made))
        self._policy.insert(new_keys, made, positions, req_context)
        self._num_pending += len(new_keys)
        self._stores += len(new_keys)
        return PrepareStoreOutput(
            keys_to_store=new_keys, store_spec=CPULoadStoreSpec.from_slots(slots), evicted_keys=evicted
        )

    @override
    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
        *,
        skip_without_store: bool = False,
    ) -> None:
        """Make stored ``keys`` readable (``success=True``) or free their slots (``success=False``).

        Every key must have a store in flight (``prepare_store`` returned it
        and it was not completed since): otherwise ``ValueError`` names the
        first key without one and nothing changes, as in ``complete_load``.
        With ``skip_without_store`` such keys are skipped instead, vLLM's
        rule (vLLM's own tests complete a batch that names keys stored
        earlier); the vLLM adapter completes that way.
        """
        blocks = self._blocks
        if not skip_without_store:
            self._check_stores_in_flight(keys, "complete_store")
        if success:
            stored: list[OffloadKey] = []
            for key in keys:
                block = blocks.get(key)
                if block is not None and block.ref_cnt == PENDING:
                    block.ref_cnt = 0
                    stored.append(key)
            self._num_pending -= len(stored)
            if stored and self._events is not None:
                self._events.append(
                    OffloadingEvent(keys=stored, medium=_MEDIUM, removed=False, req_context=req_context)
                )
            return
        # A failed store frees its slots at once: a pending key left behind
        # would hold its slot forever (pending blocks are never evicted).
        dropped: list[OffloadKey] = []
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.ref_cnt == PENDING:
                del blocks[key]
                self._policy.remove(key)
                self._pool.release(block.slot)
                dropped.append(key)
        self._num_pending -= len(dropped)
        self._failed_stores += len(dropped)
        if dropped and self.report_dropped_stores and self._events is not None:
            self._events.append(OffloadingEvent(keys=dropped, medium=_MEDIUM, removed=True, metadata_only=True))

    def hold_failed_stores(self, keys: Collection[OffloadKey]) -> list[int]:
        """Fail the stores in flight of ``keys`` as ``complete_store(success=False)`` does, but hold their slots.

        The keys leave the cache at once (a lookup misses, a later store of
        the same key takes another slot), while their slots stay out of the
        free pool until :meth:`release_held_slots`: a writer that outlived its
        failed job (a secondary tier's I/O) may still be filling them, and a
        chunk stored there meanwhile would be overwritten. Returns the held
        slots, co-indexed with ``keys``. Every key must have a store in
        flight: otherwise ``ValueError`` names the first without one and
        nothing changes. Failures are reported as ``complete_store``'s are.
        """
        self._check_stores_in_flight(keys, "hold_failed_stores")
        blocks = self._blocks
        held: list[int] = []
        for key in keys:
            block = blocks.pop(key)
            self._policy.remove(key)
            held.append(block.slot)
        self._held_slots.update(held)
        self._num_pending -= len(held)
        self._failed_stores += len(held)
        if held and self.report_dropped_stores and self._events is not None:
            self._events.append(OffloadingEvent(keys=list(keys), medium=_MEDIUM, removed=True, metadata_only=True))
        return held

    def release_held_slots(self, slots: Collection[int]) -> None:
        """Return slots :meth:`hold_failed_stores` held to the free pool (their writer can no longer touch them).

        Every slot must be held: otherwise ``ValueError`` names the first
        that is not (or is named twice) and nothing changes.
        """
        held = self._held_slots
        seen: set[int] = set()
        for slot in slots:
            if slot not in held or slot in seen:
                why = "is named twice" if slot in seen else "is not held (never held, or released already)"
                raise ValueError(f"release_held_slots: slot {slot!r} {why}")
            seen.add(slot)
        held.difference_update(seen)
        self._pool.release_many(slots)

    @property
    def num_held_slots(self) -> int:
        """Slots :meth:`hold_failed_stores` holds until :meth:`release_held_slots` (neither free nor holding a block)."""
        return len(self._held_slots)

    def _check_stores_in_flight(self, keys: Collection[OffloadKey], call: str) -> None:
        """Raise ``ValueError`` for the first of ``keys`` without a store in flight (or named twice), changing nothing."""
        seen: set[OffloadKey] = set()
        for key in keys:
            block = self._blocks.get(key)
            if block is None or block.ref_cnt != PENDING or key in seen:
                if block is None:
                    why = "is not cached (never prepared, already failed, or evicted after a reset)"
                elif block.ref_cnt == PENDING:
                    why = "is named twice in one call"
                else:
                    why = "is already stored (its store was completed before)"
                raise ValueError(f"{call}: key {key!r} {why}: no store in flight (no matching prepare_store)")
            seen.add(key)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._events
        if not events:
            return ()
        self._events = []
        if not self.report_dropped_stores:
            return events
        # A key whose failed store is reported may have been stored again
        # since: it is cached now, so its metadata must stay.
        blocks = self._blocks
        drained: list[OffloadingEvent] = []
        for event in events:
            if event.metadata_only:
                kept = [key for key in event.keys if key not in blocks]
                if not kept:
                    continue
                if len(kept) != len(event.keys):
                    event = OffloadingEvent(keys=kept, medium=event.medium, removed=True, metadata_only=True)
            drained.append(event)
        return drained

    @override
    def reset_cache(self) -> None:
        """Forget every block; refused (``RuntimeError``) while :meth:`hold_failed_stores` holds slots."""
        if self._held_slots:
            # A reset hands every slot out again, a held one too, while its writer may still fill it.
            raise RuntimeError(
                f"reset_cache: {len(self._held_slots)} slot(s) of failed stores are still held, and their writer "
                "may still fill them; release them (release_held_slots) once it cannot, then reset"
            )
        self._generation += 1
        self._blocks.clear()
        self._policy.clear()
        self._pool.reset()
        self._num_pending = 0
        self._num_loading = 0

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"CPUOffloadingManager(capacity={s.capacity}, cache_policy={self._policy_name!r}, "
            f"used={s.used}, pending={s.pending}, loading={s.loading})"
        )
