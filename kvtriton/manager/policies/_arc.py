"""Adaptive Replacement Cache (Megiddo & Modha) adapted to offloaded blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager.policies._base import PENDING, Block, KeyRun, Use

_REUSED, _INSERTED = Use.REUSED, Use.INSERTED


@dataclass(frozen=True, slots=True)
class ARCState:
    """A copy of ARC's lists (least recent first) and its adaptive T1 target."""

    t1: tuple[OffloadKey, ...]
    t2: tuple[OffloadKey, ...]
    b1: tuple[OffloadKey, ...]
    b2: tuple[OffloadKey, ...]
    target_t1: float


def _take(entries: Iterator[tuple[OffloadKey, Block]], n: int, protected: Container[OffloadKey]) -> list[OffloadKey]:
    """Advance ``entries`` to collect up to ``n`` ready, idle, unprotected keys."""
    taken: list[OffloadKey] = []
    if n <= 0:
        return taken
    append = taken.append
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            append(key)
            n -= 1
            if not n:
                break
    return taken


class ARCCachePolicy:
    """Balances recency (T1: seen once) against frequency (T2: seen again), as vLLM's ARC does.

    B1 and B2 remember keys recently evicted from T1 and T2 (keys only, no
    slots). A store of a key still in B1 means T1 was too small, so the T1
    target grows; a B2 hit shrinks it (``on_store_miss``, once per key and
    request). Eviction takes from T1 while T1 is at least its target, else
    from T2, and falls back to the other list when the preferred one holds
    nothing evictable, so a store fails only when no evictable block exists
    at all. New blocks enter T1's recent end in offer order.

    A request's reuse of a ready block counts once, when the request
    finishes (``on_request_finished``): T1 -> T2, or to T2's recent end; its
    stores only move within their list, head to tail (the head ends most
    recent). ``touch`` (kvtriton's and vLLM's direct API) counts a use at once.
    """

    __slots__ = ("_capacity", "_target", "_t1", "_t2", "_b1", "_b2", "_ghost_free")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._target = 0.0
        self._t1: OrderedDict[OffloadKey, Block] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, Block] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        # The keys on_store_miss last found in no ghost list: the insert that
        # follows it (same list; the eviction between them only adds cached
        # keys to the ghost lists) need not look again.
        self._ghost_free: Sequence[OffloadKey] | None = None

    def get(self, key: OffloadKey) -> Block | None:
        block = self._t1.get(key)
        return block if block is not None else self._t2.get(key)

    def insert(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block],
        positions: Mapping[OffloadKey, int | None],
        req_context: ReqContext,
    ) -> None:
        del positions, req_context  # ARC ranks by arrival alone
        t1 = self._t1
        # A loop of item assignments: OrderedDict.update goes through the
        # generic mapping update, which is slower for a batch this size.
        for key, block in zip(keys, blocks):
            t1[key] = block
        if keys is self._ghost_free:
            self._ghost_free = None
            return
        # A stored key is no longer a ghost. The view intersections run in C
        # and are almost always empty.
        for ghost in (self._b1, self._b2):
            if ghost:
                for key in ghost.keys() & keys:
                    del ghost[key]

    def remove(self, key: OffloadKey) -> None:
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        # Reverse order: the first key ends up most recent (see LRU).
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            block = t1.get(key)
            if block is not None:
                if block.ref_cnt == PENDING:
                    # Only just allocated by prepare_store: not a second use yet.
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = block
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1 or key in b2:
                # Evicted while still in demand: B1 gives T1 more room, B2 less.
                self._adapt_to_ghost(key)

    def _adapt_to_ghost(self, key: OffloadKey) -> None:
        """A key evicted earlier is wanted again: move the T1 target toward the list that lost it."""
        b1, b2 = self._b1, self._b2
        if key in b1:
            delta = max(1.0, len(b2) / len(b1))
            self._target = min(self._target + delta, float(self._capacity))
            b1.move_to_end(key)
        elif key in b2:
            delta = max(1.0, len(b1) / len(b2))
            self._target = max(self._target - delta, 0.0)
            b2.move_to_end(key)

    def on_request_access(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block | None],
        positions: Sequence[int | None],
        req_context: ReqContext,
    ) -> None:
        del keys, blocks, positions, req_context  # a reuse counts when the request finishes

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        b1, b2 = self._b1, self._b2
        # Most stored keys were never evicted: find the ghosts at C speed first.
        if (not b1 or b1.keys().isdisjoint(keys)) and (not b2 or b2.keys().isdisjoint(keys)):
            self._ghost_free = keys
            return
        self._ghost_free = None
        for key in reversed(keys):
            if key in b1 or key in b2:  # most keys of the offer are not ghosts: no call for them
                self._adapt_to_ghost(key)

    def on_request_finished(self, runs: Sequence[KeyRun], req_context: ReqContext) -> None:
        del req_context
        t1, t2 = self._t1, self._t2
        t1_pop, t1_move, t2_move = t1.pop, t1.move_to_end, t2.move_to_end
        for keys, use in reversed(runs):
            if use is _REUSED:
                # One reuse per request: refreshed in T2, or T1 -> T2. T2 is
                # asked first: most reused keys were reused before, and T1
                # and T2 never share a key.
                for key in reversed(keys):
                    if key in t2:
                        t2_move(key)
                    else:
                        block = t1_pop(key, None)
                        if block is not None:
                            t2[key] = block
            elif use is _INSERTED:
                # A store is not a use: recency only, in whichever list holds it
                # (T1, unless evicted or reused since: asked without a lookup first).
                for key in reversed(keys):
                    try:
                        t1_move(key)
                    except KeyError:
                        if key in t2:
                            t2_move(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        # Choose every victim first and commit only when all n are found, so
        # a failed eviction leaves the lists untouched. T1 is preferred while
        # its size minus the T1 victims so far is >= int(target), i.e. for
        # the first len(T1) - int(target) + 1 victims; then T2; then T1
        # again as the fallback. Each scan only moves forward.
        t1_entries = iter(t1.items())
        from_t1 = _take(t1_entries, min(n, max(0, len(t1) - int(self._target) + 1)), protected)
        from_t2 = _take(iter(t2.items()), n - len(from_t1), protected)
        short = n - len(from_t1) - len(from_t2)
        fallback = _take(t1_entries, short, protected) if short else []
        if len(fallback) < short:
            return None

        # One pass per list moves each victim into its ghost list.
        b1, b2 = self._b1, self._b2
        for victims, cached, ghost in ((from_t1, t1, b1), (from_t2, t2, b2), (fallback, t1, b1)):
            for key in victims:
                del cached[key]
                ghost[key] = None
        capacity = self._capacity
        for ghost in (b1, b2):
            excess = len(ghost) - capacity
            if excess > 0:
                for key in list(islice(ghost, excess)):  # the oldest ghosts (measured faster than popitem)
                    del ghost[key]
        return from_t1 + from_t2 + fallback

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target = 0.0
        self._ghost_free = None

    @property
    def target_t1(self) -> float:
        """The adaptive target size of T1, in blocks."""
        return self._target

    def state(self) -> ARCState:
        """A copy of the four lists and the target (for tests and debugging)."""
        return ARCState(tuple(self._t1), tuple(self._t2), tuple(self._b1), tuple(self._b2), self._target)
