"""The host-memory offloading manager: slots, block states, eviction, events."""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, KeysView, Sequence
from typing import NamedTuple, NoReturn, TypeVar, cast

from kvtriton.keys import OffloadKey
from kvtriton.manager.base import OffloadingManager, override
from kvtriton.manager.policies.base import PENDING, Block, CachePolicy, RequestAwarePolicy
from kvtriton.manager.policies.registry import make_policy
from kvtriton.manager.request_access import RequestAccess, head_first
from kvtriton.manager.slot_pool import SlotPool
from kvtriton.manager.stats import ManagerStats
from kvtriton.specs import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)

__all__ = ["CPUOffloadingManager", "StoredSlots"]

_MEDIUM = CPULoadStoreSpec.MEDIUM
# Module-level aliases: the hot paths return these without an enum attribute lookup.
_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
# Collections whose elements are distinct by construction (no de-duplication needed).
_DISTINCT = (set, frozenset, KeysView)
_R = TypeVar("_R")
_NOTHING: frozenset[OffloadKey] = frozenset()


class StoredSlots(NamedTuple):
    """What :meth:`CPUOffloadingManager.store_slots` allocated: ``prepare_store``'s answer as plain lists."""

    keys: list[OffloadKey]
    """The keys to store (``keys_to_store``), distinct, in offer order."""
    slots: list[int]
    """Their slots, co-indexed with ``keys`` (the store spec's block ids)."""
    evicted: list[OffloadKey]
    """The keys evicted to make room (``evicted_keys``)."""


class _RequestHooks(NamedTuple):
    """The policy's request-scoped calls, or stand-ins for a policy without them."""

    on_request_load: Callable[[Sequence[OffloadKey], object | None], object | None]
    on_request_store: Callable[[Sequence[OffloadKey], Sequence[OffloadKey], Sequence[OffloadKey], object | None], None]
    on_store_miss: Callable[[Sequence[OffloadKey], set[OffloadKey]], None]
    on_request_finished: Callable[
        [Sequence[OffloadKey], Container[OffloadKey], Container[OffloadKey], object | None], None
    ]


def _request_hooks(policy: CachePolicy) -> _RequestHooks:
    """Bind ``policy``'s request hooks once; a plain ``CachePolicy`` gets ``touch`` (vLLM's defaults)."""
    if isinstance(policy, RequestAwarePolicy):
        return _RequestHooks(
            policy.on_request_load, policy.on_request_store, policy.on_store_miss, policy.on_request_finished
        )
    touch = policy.touch

    def load(keys: Sequence[OffloadKey], anchor: object | None) -> object | None:
        del keys
        return anchor

    def store(
        head: Sequence[OffloadKey], stored: Sequence[OffloadKey], reoffered: Sequence[OffloadKey], anchor: object | None
    ) -> None:
        del stored, reoffered, anchor
        if head:
            touch(head)

    def miss(keys: Sequence[OffloadKey], learnt: set[OffloadKey]) -> None:
        del keys, learnt

    def finished(
        keys: Sequence[OffloadKey], inserted: Container[OffloadKey], reused: Container[OffloadKey], anchor: object | None
    ) -> None:
        del inserted, reused, anchor
        touch(keys)

    return _RequestHooks(load, store, miss, finished)


class CPUOffloadingManager(OffloadingManager):
    """Tracks which blocks sit in which slot of a host slab of ``num_blocks`` slots.

    A key is *pending* from ``prepare_store`` until ``complete_store``, then
    *ready*; ``prepare_load`` adds a reader and ``complete_load`` removes one.
    Only ready blocks without readers are evictable, chosen by the named
    ``cache_policy`` (see ``kvtriton.manager.policies``). With
    ``enable_events`` every store completion and every eviction is queued as
    an ``OffloadingEvent`` for ``take_events``; with ``report_dropped_stores``
    too, a failed store queues a ``metadata_only`` removal of its keys (what
    vLLM 0.33 emits, so its events tracker can drop what it recorded).

    Recency comes from ``touch`` (kvtriton's own API) or, for a request
    announced with ``on_new_request`` (vLLM's connector), from the request
    itself: its stores rank its keys head first, and ``on_request_finished``
    ranks them again and counts its reuses (``kvtriton.manager.request_access``).
    """

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        *,
        report_dropped_stores: bool = False,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}: {num_blocks!r}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._policy: CachePolicy = make_policy(cache_policy, num_blocks)
        self._hooks = _request_hooks(self._policy)
        self._policy_name = cache_policy
        self._pool = SlotPool(num_blocks)
        # The authoritative index of cached keys. The policy keeps the same
        # Block objects in its own order; lookups and state changes go
        # through this plain dict and never call into the policy.
        self._blocks: dict[OffloadKey, Block] = {}
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._num_pending = 0
        self._num_loading = 0
        # Lookups are counted by outcome only (lookups = misses + hits +
        # pending hits): one increment per lookup, the hottest call.
        self._misses = 0
        self._hits = 0
        self._pending_hits = 0
        self._evictions = 0
        self._stores = 0
        self.report_dropped_stores = report_dropped_stores
        # Bumped by reset_cache: a request's record from before a reset is stale.
        self._generation = 0

    # --- introspection -------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the host slab (``num_blocks``)."""
        return self._pool.capacity

    @property
    def cache_policy(self) -> str:
        """The name the policy was chosen by."""
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
            lookups=self._misses + self._hits + self._pending_hits,
            hits=self._hits,
            pending_hits=self._pending_hits,
            evictions=self._evictions,
            stores=self._stores,
        )

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached, pending or ready; unlike ``lookup`` it counts nothing."""
        return key in self._blocks

    def slot_map(self) -> dict[OffloadKey, int]:
        """A copy of the key -> slot assignment of every cached block (pending included)."""
        return {key: block.slot for key, block in self._blocks.items()}

    def lookup_with(self, miss: _R, hit: _R, pending: _R) -> Callable[[OffloadKey, object], _R]:
        """A ``lookup(key, req_context)`` that answers ``miss`` / ``hit`` / ``pending`` instead of ``LookupResult``.

        It counts like :meth:`lookup` and ignores the context (this manager's
        lookup never reads one), so an adapter can install it as its own
        ``lookup`` and answer in its own result type with one call and no
        translation table.
        """
        blocks_get = self._blocks.get

        def lookup(key: OffloadKey, _req_context: object = None) -> _R:
            # The context is never read (no ``del``: that would cost a bytecode per lookup).
            block = blocks_get(key)
            if block is None:
                self._misses += 1
                return miss
            if block.ref_cnt < 0:  # PENDING, the only negative count
                self._pending_hits += 1
                return pending
            self._hits += 1
            return hit

        return lookup

    # --- request hooks ---------------------------------------------------

    def _access(self, req_context: ReqContext) -> RequestAccess | None:
        """The record of a tracked request (renewed after a reset), else ``None``."""
        accesses = req_context.accesses
        if not accesses:
            return None
        access = accesses.get(self)
        if access is not None and access.generation != self._generation:
            access = accesses[self] = RequestAccess(self._generation)
        return access

    @override
    def on_new_request(self, req_context: ReqContext) -> None:
        req_context.accesses[self] = RequestAccess(self._generation)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        access = req_context.accesses.pop(self, None)
        if access is None or access.generation != self._generation or not access.keys:
            return
        keys = access.keys
        position_of = req_context.position_of
        if position_of is None and req_context.key_positions:
            position_of = req_context.key_positions.get
        if position_of is not None:
            keys = head_first(keys, position_of)
        self._hooks.on_request_finished(keys, access.inserted, access.reused, access.anchor)

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
        return CPULoadStoreSpec.from_slots(self.load_slots(keys, req_context))

    def load_slots(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        """:meth:`prepare_load`, answering the slots as a list (an adapter builds its own spec type from it)."""
        got = list(map(self._blocks.get, keys))
        if None in got:  # C speed; nothing is pinned yet
            self._refuse_load(keys, got, 0)
        newly_loading = 0
        # One pass that pins as it validates; on a pending key the pins taken
        # so far are undone before raising, so a failed call changes nothing.
        # Pins never make a block pending, so the first pending block met is
        # the first pending one in ``got``: everything before it was pinned.
        for block in cast("list[Block]", got):  # no None (checked above)
            count = block.ref_cnt
            if count <= 0:
                if count == PENDING:
                    self._refuse_load(keys, got, got.index(block))
                newly_loading += 1
            block.ref_cnt = count + 1
        self._num_loading += newly_loading
        slots = [block.slot for block in cast("list[Block]", got)]
        accesses = req_context.accesses
        if accesses:
            access = accesses.get(self)
            if access is not None:
                if access.generation != self._generation:
                    access = accesses[self] = RequestAccess(self._generation)
                loaded = keys if isinstance(keys, list) else list(keys)
                access.observe(loaded)
                inserted = access.inserted
                access.reused.update([key for key in loaded if key not in inserted] if inserted else loaded)
                access.anchor = self._hooks.on_request_load(loaded, access.anchor)
        return slots

    @staticmethod
    def _refuse_load(keys: Collection[OffloadKey], got: list[Block | None], pinned: int) -> NoReturn:
        """Undo the pins ``prepare_load`` took on ``got[:pinned]`` and raise for the first uncached or pending key."""
        for taken in got[:pinned]:
            if taken is not None:
                taken.ref_cnt -= 1
        bad = next(i for i, block in enumerate(got) if block is None or block.ref_cnt == PENDING)
        block = got[bad]
        key = list(keys)[bad]
        state = "not cached" if block is None else "still pending (its store has not completed)"
        raise ValueError(f"prepare_load: key {key!r} is {state}")

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
        for bad, block in enumerate(got):
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
        stored = self.store_slots(keys, req_context)
        if stored is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=stored.keys, store_spec=CPULoadStoreSpec.from_slots(stored.slots), evicted_keys=stored.evicted
        )

    def store_slots(self, keys: Collection[OffloadKey], req_context: ReqContext) -> StoredSlots | None:
        """:meth:`prepare_store`, answering plain lists (an adapter builds its own output types from them)."""
        accesses = req_context.accesses
        if accesses:
            # _access, inlined: one call per store of every tracked request.
            access = accesses.get(self)
            if access is not None:
                if access.generation != self._generation:
                    access = accesses[self] = RequestAccess(self._generation)
                return self._prepare_tracked_store(access, keys)
        blocks = self._blocks
        new_keys = [key for key in keys if key not in blocks]
        if not new_keys:
            return StoredSlots([], [], [])
        if len(new_keys) > 1 and not isinstance(keys, _DISTINCT):
            distinct = dict.fromkeys(new_keys)
            if len(distinct) != len(new_keys):
                new_keys = list(distinct)
        return self._store(new_keys, keys)

    def _prepare_tracked_store(self, access: RequestAccess, keys: Collection[OffloadKey]) -> StoredSlots | None:
        """``prepare_store`` for a tracked request: record its keys, learn from misses, rank its keys head first."""
        blocks = self._blocks
        offered = keys if isinstance(keys, list) else list(keys)
        got = list(map(blocks.get, offered))
        ready: list[OffloadKey] = []
        skipped_pending = False
        # The request's keys before this offer: its head, for on_request_store.
        earlier = len(access.keys)
        if got.count(None) == len(got):
            # The usual offer: chunks nobody stored yet. Record them (offer
            # order, head to tail); when they were all new to the request
            # too, its seen-set grew by the whole offer, which proves the offer
            # distinct without building a dict of it.
            seen = access.seen
            before = len(seen)
            access.observe(offered)
            new_keys = offered[:]
            if len(seen) - before != len(new_keys) and len(new_keys) > 1 and not isinstance(keys, _DISTINCT):
                distinct = dict.fromkeys(new_keys)
                if len(distinct) != len(new_keys):
                    new_keys = list(distinct)
            if new_keys:
                self._hooks.on_store_miss(new_keys, access.store_missed)
        else:
            new_keys = [key for key, block in zip(offered, got) if block is None]
            for key, block in zip(offered, got):
                if block is not None:
                    if block.ref_cnt != PENDING:
                        ready.append(key)
                    else:
                        skipped_pending = True
            if len(new_keys) > 1 and not isinstance(keys, _DISTINCT):
                distinct = dict.fromkeys(new_keys)
                if len(distinct) != len(new_keys):
                    new_keys = list(distinct)
            if new_keys:
                self._hooks.on_store_miss(new_keys, access.store_missed)
            # Record the new and ready keys, in the offer's (head-to-tail) order; a
            # key some other request is still storing is not this request's yet.
            if skipped_pending:
                wanted = set(new_keys)
                wanted.update(ready)
                access.observe([key for key in offered if key in wanted])
            else:
                access.observe(offered)
        if ready:
            inserted = access.inserted
            access.reused.update([key for key in ready if key not in inserted] if inserted else ready)
        if not new_keys:
            return StoredSlots([], [], [])
        # The offer's cached keys are its ready ones and the ones still pending
        # (another request's store); only they could be evicted.
        if skipped_pending:
            cached: Container[OffloadKey] = {key for key, block in zip(offered, got) if block is not None}
        else:
            cached = set(ready) if ready else _NOTHING
        output = self._store(new_keys, keys, cached)
        if output is None:
            return None
        access.inserted.update(new_keys)
        # The new keys entered head first at the recent end; the policy ranks
        # them against the request's earlier keys (its loaded prefix).
        head = access.keys[:earlier]
        if ready:
            stored = set(new_keys)
            head.extend(key for key in access.keys[earlier:] if key not in stored)
        if head or access.anchor is not None:
            self._hooks.on_request_store(head, new_keys, ready, access.anchor)
        return output

    def _store(
        self,
        new_keys: list[OffloadKey],
        keys: Collection[OffloadKey],
        cached: Container[OffloadKey] | None = None,
    ) -> StoredSlots | None:
        """Allocate slots for ``new_keys`` (distinct, none cached), evicting if needed; every key of ``keys`` is protected.

        ``cached``, when the caller knows them, are the keys of ``keys`` that are
        cached: the only ones an eviction could take, so protecting them alone
        protects the whole offer without building a set of it.
        """
        blocks = self._blocks

        pool = self._pool
        shortfall = len(new_keys) - pool.num_free
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            evictable = len(blocks) - self._num_pending - self._num_loading
            if shortfall > evictable:
                return None
            # Every key named in the call is protected: the caller was just
            # told the already-stored ones are cached, so they must stay.
            if cached is not None:
                protected = cached
            else:
                protected = keys if isinstance(keys, (set, frozenset)) else set(keys)
            victims = self._policy.evict(shortfall, protected)
            if victims is None:
                return None
            evicted = victims
            pop = blocks.pop
            pool.release_many([pop(key).slot for key in evicted])
            self._evictions += len(evicted)
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=list(evicted), medium=_MEDIUM, removed=True))

        slots = pool.allocate(len(new_keys))
        made = list(map(Block, slots))
        blocks.update(zip(new_keys, made))
        self._policy.insert(new_keys, made)
        self._num_pending += len(new_keys)
        self._stores += len(new_keys)
        return StoredSlots(new_keys, slots, evicted)

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        blocks = self._blocks
        if success:
            stored: list[OffloadKey] = []
            for key in keys:
                block = blocks.get(key)
                if block is not None and block.ref_cnt == PENDING:
                    block.ref_cnt = 0
                    stored.append(key)
            self._num_pending -= len(stored)
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(keys=stored, medium=_MEDIUM, removed=False))
            return
        # A failed store frees its slots at once: a pending key left behind
        # would hold its slot forever (pending blocks are never evicted).
        remove = self._policy.remove
        release = self._pool.release
        dropped: list[OffloadKey] = []
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.ref_cnt == PENDING:
                del blocks[key]
                remove(key)
                release(block.slot)
                self._num_pending -= 1
                dropped.append(key)
        if dropped and self.report_dropped_stores and self._events is not None:
            self._events.append(OffloadingEvent(keys=dropped, medium=_MEDIUM, removed=True, metadata_only=True))

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
