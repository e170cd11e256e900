"""Least-recently-used eviction, ranked as vLLM ranks it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager.policies._base import Block, KeyRun, run_keys


@dataclass(slots=True)
class _RequestTick:
    """The tick a request was first seen at, kept in its context (one per policy and reset)."""

    owner: object
    generation: int
    tick: int


class _Ranked:
    """LRU's record of one cached block: the block and its rank.

    ``rank`` is the tick of the block's last use or, while a running request
    ranks the block, that request's tick; ``position`` is then the block's
    token position in the request (None otherwise).
    """

    __slots__ = ("block", "rank", "position")

    def __init__(self, block: Block, rank: int, position: int | None) -> None:
        self.block = block
        self.rank = rank
        self.position = position


def _bucket_rank(item: tuple[OffloadKey, _Ranked]) -> tuple[int, OffloadKey]:
    # Tails first; keys at one position (the groups of a hybrid model) by
    # their bytes, as vLLM's heap breaks the tie.
    position = item[1].position
    return (-position if position is not None else 0, item[0])


class LRUCachePolicy:
    """Evicts the ready, idle block of lowest rank: vLLM's LRU rule.

    One counter hands out *ticks*. A block's rank is ``(tick, 0)`` after it
    was stored without a token position, touched, or named by a request that
    finished (head to tail, so the head ranks highest); while a running
    request ranks it, its rank is ``(request's tick, -position)``, where the
    request's tick is taken when the policy first sees the request. So a
    running request's blocks rank together at the moment it started, tails
    below heads, and its end raises them all to the top. A request's access
    only ever raises a rank.

    Stored as one ``OrderedDict`` of every block, in which the blocks ranked
    by a tick alone sit in tick order, and the running requests' blocks by
    request tick. Eviction walks the two in rank order and skips pending,
    loading and protected blocks.
    """

    __slots__ = ("_order", "_requests", "_tick", "_generation")

    def __init__(self, capacity: int) -> None:
        # capacity is unused: LRU keeps no ghost state; the uniform
        # constructor lets the registry build every policy the same way.
        del capacity
        self._order: OrderedDict[OffloadKey, _Ranked] = OrderedDict()
        """Every cached block; those with ``position is None`` in tick order, least recent first."""
        self._requests: dict[int, dict[OffloadKey, _Ranked]] = {}
        """The blocks a running request ranks (``position`` set), by the request's tick."""
        self._tick = 0
        self._generation = 0

    def _current_request_tick(self, req_context: ReqContext) -> int | None:
        """The tick this policy gave ``req_context``'s request since the last reset, or None when it gave none."""
        state = req_context.get_state(_RequestTick)
        if state is None or state.owner is not self or state.generation != self._generation:
            return None
        return state.tick

    def _request_tick(self, req_context: ReqContext) -> int:
        tick = self._current_request_tick(req_context)
        if tick is None:
            self._tick += 1
            tick = self._tick
            req_context.set_state(_RequestTick(self, self._generation, tick))
        return tick

    def _leave_request(self, key: OffloadKey, entry: _Ranked) -> None:
        """Take ``entry`` out of the running request that ranks it."""
        ranked = self._requests[entry.rank]
        del ranked[key]
        if not ranked:
            del self._requests[entry.rank]
        entry.position = None

    def _request_keys(self, tick: int) -> dict[OffloadKey, _Ranked]:
        """The blocks the running request of ``tick`` ranks (made empty on first use)."""
        return self._requests.setdefault(tick, {})

    def get(self, key: OffloadKey) -> Block | None:
        entry = self._order.get(key)
        return entry.block if entry is not None else None

    def insert(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block],
        positions: Mapping[OffloadKey, int | None],
        req_context: ReqContext,
    ) -> None:
        order = self._order
        ranked: dict[OffloadKey, _Ranked] | None = None
        request_tick = 0
        get = positions.get
        for key, block in zip(keys, blocks):
            position = get(key)
            if position is None:
                # vLLM reads a position when it inserts: one unknown when first seen may be known now.
                position = req_context.get_offload_key_position(key)
            if position is None:
                self._tick += 1
                order[key] = _Ranked(block, self._tick, None)
            else:
                if ranked is None:
                    request_tick = self._request_tick(req_context)
                    ranked = self._request_keys(request_tick)
                order[key] = ranked[key] = _Ranked(block, request_tick, position)

    def remove(self, key: OffloadKey) -> None:
        entry = self._order.pop(key, None)
        if entry is not None and entry.position is not None:
            self._leave_request(key, entry)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        # Reverse order: the first key (the earliest prefix block, shared by
        # the most requests) ends up most recent and is evicted last.
        self._refresh(reversed(keys if isinstance(keys, list) else list(keys)))

    def _refresh(self, keys: Iterator[OffloadKey], released: Container[OffloadKey] = ()) -> None:
        """Give each cached key of ``keys`` the next tick, in turn (the last one ends most recent).

        ``released`` are the keys of a finished request's ranking, which the caller drops in bulk: they only
        lose their position; any other key a running request ranks leaves that request.
        """
        order = self._order
        get, move_to_end = order.get, order.move_to_end
        tick = self._tick
        for key in keys:
            entry = get(key)
            if entry is not None:
                if entry.position is not None:
                    if key in released:
                        entry.position = None
                    else:
                        self._leave_request(key, entry)  # ranked by another running request
                tick += 1
                entry.rank = tick
                move_to_end(key)
        self._tick = tick

    def on_request_access(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block | None],
        positions: Sequence[int | None],
        req_context: ReqContext,
    ) -> None:
        tick = self._request_tick(req_context)  # the request's rank starts here, whatever it accessed
        if blocks.count(None) == len(blocks):
            return  # a store offer of new keys: insert ranks them
        order = self._order
        ranked: dict[OffloadKey, _Ranked] | None = None
        for key, block, position in zip(keys, blocks, positions):
            if block is None or position is None:
                continue
            # Raise only: (tick, -position) against the block's rank.
            entry = order[key]
            current = entry.position
            if entry.rank > tick or (entry.rank == tick and current is not None and current <= position):
                continue
            if current is not None:
                self._leave_request(key, entry)
            if ranked is None:
                ranked = self._request_keys(tick)
            ranked[key] = entry
            entry.rank = tick
            entry.position = position

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        del keys  # LRU keeps no history of evicted keys

    def on_request_finished(self, runs: Sequence[KeyRun], req_context: ReqContext) -> None:
        keys = run_keys(runs)  # every access counts the same in LRU
        request_tick = self._current_request_tick(req_context)
        ranked = self._requests.pop(request_tick, None) if request_tick is not None else None
        self._refresh(reversed(keys), released=ranked or ())
        if not ranked:
            return
        left = {key: entry for key, entry in ranked.items() if entry.position is not None}
        if left and request_tick is not None:  # stored after the request's record was replaced: still ranked by it
            self._requests[request_tick] = left

    def _in_rank_order(self) -> Iterator[tuple[OffloadKey, _Ranked]]:
        """Every cached key with its record, lowest rank (the next to evict) first."""
        requests = self._requests
        if not requests:
            yield from self._order.items()
            return
        ticks = sorted(requests)
        waiting = 0
        for key, entry in self._order.items():
            if entry.position is not None:
                continue  # ranked by its request, below
            while waiting < len(ticks) and ticks[waiting] < entry.rank:
                yield from sorted(requests[ticks[waiting]].items(), key=_bucket_rank)
                waiting += 1
            yield key, entry
        for tick in ticks[waiting:]:
            yield from sorted(requests[tick].items(), key=_bucket_rank)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        requests = self._requests
        # The blocks ranked by a tick alone, least recent first (a running request's blocks are skipped here).
        last_rank = 0
        for key, entry in self._order.items():
            if entry.block.ref_cnt == 0 and key not in protected and entry.position is None:
                victims.append(key)
                if len(victims) == n:
                    last_rank = entry.rank
                    break
        else:
            if not requests:
                return None
        if requests and (len(victims) < n or last_rank > min(requests)):
            # A running request ranks below some of them: walk both in rank order.
            victims = []
            for key, entry in self._in_rank_order():
                if entry.block.ref_cnt == 0 and key not in protected:
                    victims.append(key)
                    if len(victims) == n:
                        break
            else:
                return None
        pop = self._order.pop
        for key in victims:
            entry = pop(key)
            if entry.position is not None:
                self._leave_request(key, entry)
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._requests.clear()
        self._tick = 0
        self._generation += 1

    def ordered_keys(self) -> list[OffloadKey]:
        """Every tracked key, least recent (next to evict) first (for tests and debugging)."""
        return [key for key, _ in self._in_rank_order()]
