"""The cache-policy protocol and the per-block record it orders.

A policy decides *which* ready, idle block to evict; the manager owns
everything else (slots, reader counts, events). Keeping the protocol this
small means a new policy is one file plus one line in the registry.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence
from typing import Protocol, runtime_checkable

from kvtriton.keys import OffloadKey

__all__ = ["PENDING", "Block", "CachePolicy", "RequestAwarePolicy"]

PENDING = -1
"""``Block.ref_cnt`` of a block whose store has not completed yet."""


class Block:
    """One cached block: its slot in the host slab and its reference count.

    ``ref_cnt`` is ``PENDING`` (-1) while the store is in flight, 0 when the
    block is ready and idle (the only evictable state), and ``n > 0`` while
    ``n`` loads read it. A plain slotted class rather than a dataclass: the
    manager creates one per stored block and reads ``ref_cnt`` in every hot
    loop, so it stays as cheap as Python allows.
    """

    __slots__ = ("slot", "ref_cnt")

    def __init__(self, slot: int, ref_cnt: int = PENDING) -> None:
        self.slot = slot
        self.ref_cnt = ref_cnt

    def __repr__(self) -> str:
        return f"Block(slot={self.slot}, ref_cnt={self.ref_cnt})"


class CachePolicy(Protocol):
    """Orders the cached blocks and picks eviction victims.

    The manager calls ``insert`` when ``prepare_store`` allocates blocks,
    ``remove`` when a store fails, ``touch`` on every ``touch`` call,
    ``evict`` when it needs room and ``clear`` on ``reset_cache``. For a
    request it tracks (``on_new_request``) it also calls ``on_store_miss``
    ``on_request_load`` on its loads, ``on_store_miss`` before a store,
    ``refresh`` after it and ``on_request_finished`` at the
    end (``kvtriton.manager.request_access``). A policy
    must never evict a block whose ``ref_cnt`` is not 0 or whose key is in
    ``protected``.
    """

    def get(self, key: OffloadKey) -> Block | None:
        """The block cached under ``key`` (pending or ready), else ``None``."""
        ...

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[Block]) -> None:
        """Start tracking newly allocated (pending) blocks, ``keys[i]`` -> ``blocks[i]``.

        One call per ``prepare_store``, so a policy can place the batch at
        C speed. Like ``touch``, the first key ends up most recent.
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
    """A policy that also takes the request-scoped signal (optional; LRU and ARC implement it).

    For a request it tracks (``on_new_request``) the manager calls
    ``on_request_load`` on its loads, ``on_store_miss`` before a store,
    ``refresh`` after it and ``on_request_finished`` at the end
    (``kvtriton.manager.request_access``). A policy without these methods
    still works: the manager then calls its ``touch`` for ``refresh`` and
    ``on_request_finished`` and skips the other two (vLLM's defaults).
    """

    def refresh(self, keys: Sequence[OffloadKey]) -> None:
        """Rank ``keys`` most recent, the first key most recent, without counting a use.

        The request-scoped recency signal (a request's keys when it stores and
        when it finishes): ARC moves each key within its own list and never
        promotes. Unknown keys are ignored.
        """
        ...

    def on_request_load(self, keys: Sequence[OffloadKey]) -> None:
        """A tracked request loads ``keys`` (head first); its reuse counts only when it finishes.

        LRU ranks them most recent: the load completes before the request
        stores the rest of its prompt, and its prefix must not age out in
        between. ARC leaves its lists alone (vLLM 0.33's ARC does too).
        """
        ...

    def on_store_miss(self, keys: Sequence[OffloadKey], learnt: set[OffloadKey]) -> None:
        """Learn from ``keys`` about to be stored because no request found them cached.

        Called before the eviction that makes room for them. ``learnt`` is the
        storing request's record of keys already learnt from: a policy learns
        from a key once per request (a refused store may be offered again) and
        adds the keys it learnt from. ARC adapts its T1 target to keys still
        in a ghost list.
        """
        ...

    def on_request_finished(
        self, keys: Sequence[OffloadKey], inserted: Container[OffloadKey], reused: Container[OffloadKey]
    ) -> None:
        """Apply one finished request's access: ``keys`` head first (head most recent afterwards).

        ``reused`` keys were ready before the request used them (one use each,
        for a frequency policy); ``inserted`` keys were stored by it (not a
        use); keys in neither (a refused store) are left where they are.
        """
        ...
