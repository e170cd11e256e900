"""Least-recently-used eviction over a single ordered dict."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Sequence

from kvtriton.keys import OffloadKey
from kvtriton.manager.policies.base import Block

__all__ = ["LRUCachePolicy"]


class LRUCachePolicy:
    """Evicts the least recently used ready, idle block.

    One ``OrderedDict`` from key to block, least recent first. ``touch``
    moves keys to the recent end, the first key last (most recent), and
    remembers them as the *touched run*. A block inserted afterwards ranks
    just below that run **(kvtriton)**: an engine touches a request's cached
    prefix and then stores the blocks that extend it, which are deeper in the
    prefix tree and shared by fewer requests, so they should go first; vLLM
    0.33 reaches the same order by ranking a request's blocks by position.
    Without touches this is plain LRU. Eviction scans from the old end and
    skips pending, loading and protected keys.

    Through the request hooks (what vLLM's connector gives: no ``touch``),
    ``refresh`` ranks a request's keys head first when it stores and when it
    finishes, so its shared head outlives its unique tail whatever other
    requests did in between.
    """

    __slots__ = ("_blocks", "_run", "_unsettled")

    def __init__(self, capacity: int) -> None:
        # capacity is unused: LRU keeps no ghost state; the uniform
        # constructor lets the registry build every policy the same way.
        del capacity
        self._blocks: OrderedDict[OffloadKey, Block] = OrderedDict()
        # The touched run, least recent first, with the block each key had
        # when touched (a key evicted and stored again is a new block).
        self._run: list[tuple[OffloadKey, Block]] = []
        # Inserts since the run was last moved back on top. Settling is lazy:
        # done once before the order is next read, not once per insert.
        self._unsettled = False

    def _settle(self) -> None:
        self._unsettled = False
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        for key, block in self._run:
            if blocks.get(key) is block:
                move_to_end(key)

    def get(self, key: OffloadKey) -> Block | None:
        return self._blocks.get(key)

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[Block]) -> None:
        self._blocks.update(zip(reversed(keys), reversed(blocks)))
        if self._run:
            self._unsettled = True

    def remove(self, key: OffloadKey) -> None:
        self._blocks.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        if self._unsettled:
            self._settle()
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        run: list[tuple[OffloadKey, Block]] = []
        # Visit in reverse so the first key (the earliest prefix block, shared
        # by the most requests) ends up most recent and is evicted last.
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            block = blocks.get(key)
            if block is not None:
                move_to_end(key)
                run.append((key, block))
        self._run = run

    def refresh(self, keys: Sequence[OffloadKey]) -> None:
        if self._unsettled:
            self._settle()
        # The request-scoped order replaces any touched run.
        self._run = []
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        for key in reversed(keys):
            if key in blocks:
                move_to_end(key)

    def on_request_load(self, keys: Sequence[OffloadKey]) -> None:
        self.refresh(keys)

    def on_store_miss(self, keys: Sequence[OffloadKey], learnt: set[OffloadKey]) -> None:
        del keys, learnt  # LRU keeps no history of evicted keys

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted: Container[OffloadKey], reused: Container[OffloadKey]
    ) -> None:
        del inserted, reused  # every access counts the same in LRU
        self.refresh(keys)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if self._unsettled:
            self._settle()
        victims: list[OffloadKey] = []
        for key, block in self._blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        blocks = self._blocks
        for key in victims:
            del blocks[key]
        return victims

    def clear(self) -> None:
        self._blocks.clear()
        self._run = []
        self._unsettled = False

    def ordered_keys(self) -> list[OffloadKey]:
        """Every tracked key, least recent first (for tests and debugging)."""
        if self._unsettled:
            self._settle()
        return list(self._blocks)
