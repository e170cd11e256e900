"""The cache-policy protocol and the per-block record it orders.

A policy decides *which* ready, idle block to evict; the manager owns
everything else (slots, reader counts, events, what each request accessed).
The hooks and their order are vLLM's (``vllm/v1/kv_offload/cpu/policies``),
so a policy ranks blocks exactly as vLLM's does when given the same calls.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping, Sequence
from enum import Enum
from typing import Protocol, runtime_checkable

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext

PENDING = -1
"""``Block.ref_cnt`` of a block whose store has not completed yet."""


class Block:
    """One cached block: its slot in the host slab and its reference count.

    ``ref_cnt`` is ``PENDING`` (-1) while the store is in flight, 0 when the
    block is ready and idle (the only evictable state), and ``n > 0`` while
    ``n`` loads read it. Only the manager changes it; a policy reads it to
    skip blocks it must not evict and keeps its own ordering data beside the
    block (LRU's ranks live in ``kvtriton.manager.policies._lru``). A plain
    slotted class rather than a dataclass: the manager reads ``ref_cnt`` in
    every hot loop, so it stays as cheap as Python allows.
    """

    __slots__ = ("slot", "ref_cnt")

    def __init__(self, slot: int, ref_cnt: int = PENDING) -> None:
        self.slot = slot
        self.ref_cnt = ref_cnt

    def __repr__(self) -> str:
        return f"Block(slot={self.slot}, ref_cnt={self.ref_cnt})"


class Use(Enum):
    """How a finished request used a run of its keys (what ``on_request_finished`` hands a policy)."""

    REUSED = "reused"
    """Ready before the request used them: one use each (a frequency policy counts it)."""
    INSERTED = "inserted"
    """Stored by the request and not reused: not a use, recency only (vLLM's insertion-only keys)."""
    SEEN = "seen"
    """Neither: offered for a store that was refused."""


KeyRun = tuple[Sequence[OffloadKey], Use]
"""Consecutive keys of a finished request, head to tail, with the one way the request used all of them."""


def run_keys(runs: Sequence[KeyRun]) -> Sequence[OffloadKey]:
    """The keys of ``runs``, in order (a policy that ranks every use alike needs no more)."""
    if len(runs) == 1:
        return runs[0][0]
    return [key for keys, _ in runs for key in keys]


class CachePolicy(Protocol):
    """Orders the cached blocks and picks eviction victims.

    The manager calls ``insert`` when ``prepare_store`` allocates blocks,
    ``remove`` when a store fails, ``touch`` on every ``touch`` call,
    ``evict`` when it needs room and ``clear`` on ``reset_cache``. A policy
    must never evict a block whose ``ref_cnt`` is not 0 or whose key is in
    ``protected``. A policy that also implements :class:`RequestAwarePolicy`
    gets the request-scoped signal; one that does not gets ``touch`` in its
    place (vLLM's defaults).
    """

    def get(self, key: OffloadKey) -> Block | None:
        """The block cached under ``key`` (pending or ready), else ``None``."""
        ...

    def insert(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block],
        positions: Mapping[OffloadKey, int | None],
        req_context: ReqContext,
    ) -> None:
        """Start tracking newly allocated (pending) blocks, ``keys[i]`` -> ``blocks[i]``, stored for ``req_context``.

        One call per ``prepare_store``, keys in offer order. ``positions``
        holds the token positions the request's record read for its keys
        (a key missing or None there: ask ``req_context``). Without positions
        the first key is the least recent, as in vLLM.
        """
        ...

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` without remembering it anywhere (a failed store)."""
        ...

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Mark ``keys`` recently used; the first key ends up most recent. Unknown keys are ignored."""
        ...

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """Remove and return ``n`` ready, idle, unprotected keys in eviction order.

        Atomic: when fewer than ``n`` such keys exist, return ``None`` and
        change nothing.
        """
        ...

    def clear(self) -> None:
        """Forget every key and reset any adaptive state."""
        ...


@runtime_checkable
class RequestAwarePolicy(CachePolicy, Protocol):
    """A policy that takes the request-scoped signal, vLLM's hooks (LRU and ARC implement it).

    For every request the manager calls ``on_store_miss`` before a store
    allocates, ``on_request_access`` with the keys the request sees for the
    first time (loads and store offers), and ``on_request_finished`` once
    when the request ends. A policy without these methods still works: the
    manager calls its ``touch`` instead with the store misses and with the
    finished request's keys (vLLM's defaults), and nothing on access.
    """

    def on_request_access(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block | None],
        positions: Sequence[int | None],
        req_context: ReqContext,
    ) -> None:
        """``req_context``'s request sees ``keys`` for the first time; ``blocks[i]`` is ``keys[i]``'s block, or None.

        ``None`` marks a key not cached yet (a store offer about to insert
        it); ``positions`` are the keys' token positions (None when unknown).
        LRU ranks the cached ones at the request's rank by position; ARC
        waits for the request's end.
        """
        ...

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """Learn from ``keys`` about to be stored because no request found them cached (once per key and request).

        Called before the eviction that makes room for them. ARC adapts its
        T1 target to keys still in a ghost list.
        """
        ...

    def on_request_finished(self, runs: Sequence[KeyRun], req_context: ReqContext) -> None:
        """Commit one finished request's access: its keys head to tail (the head ends most recent), in runs of one use.

        ``Use.REUSED`` keys count one use each, for a frequency policy;
        ``Use.INSERTED`` keys were stored by the request, which is not a use;
        ``Use.SEEN`` keys (refused stores) only move within their list, if at
        all. A key appears once.
        """
        ...
