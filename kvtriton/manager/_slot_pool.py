"""The free list of slots in the host slab."""

from __future__ import annotations

from collections.abc import Iterable


class SlotPool:
    """Hands out slot ids ``0 .. capacity-1``.

    Never-used slots go out first, in increasing order; after that, freed
    slots are reused last-freed-first. The order is part of the contract: it
    makes slot ids in tests predictable, and reusing the most recently freed
    slot keeps the touched part of the slab small while the cache warms up.
    """

    __slots__ = ("_capacity", "_next_fresh", "_free")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._next_fresh = 0
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        """How many slots exist."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """How many slots ``allocate`` can still hand out."""
        return self._capacity - self._next_fresh + len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` slots; ``ValueError`` (and nothing taken) if fewer are free."""
        if n < 0 or n > self.num_free:
            raise ValueError(f"n must be in 0..{self.num_free} (the free slots), got {n}")
        start = self._next_fresh
        fresh = min(n, self._capacity - start)
        slots = list(range(start, start + fresh))
        self._next_fresh = start + fresh
        reused = n - fresh
        if reused:
            free = self._free
            tail = free[-reused:]
            del free[-reused:]
            tail.reverse()
            slots += tail
        return slots

    def release(self, slot: int) -> None:
        """Return ``slot`` to the pool; it is the next one reused."""
        self._free.append(slot)

    def release_many(self, slots: Iterable[int]) -> None:
        """Return ``slots`` in order; the last one is the next one reused."""
        self._free.extend(slots)

    def reset(self) -> None:
        """Mark every slot never-used again."""
        self._next_fresh = 0
        self._free.clear()
