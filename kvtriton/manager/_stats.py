"""A point-in-time snapshot of a manager's occupancy and traffic."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Occupancy (in blocks) and cumulative counters of a ``CPUOffloadingManager``.

    ``used = pending + loading + evictable``; ``used + held + free = capacity``.
    Counters (``lookups`` onwards) count since construction and survive
    ``reset_cache``: they describe traffic, not contents.
    """

    capacity: int
    """Slots in the host slab."""
    used: int
    """Slots holding a block (pending or ready)."""
    pending: int
    """Blocks whose store has not completed."""
    loading: int
    """Ready blocks with at least one load in flight."""
    evictable: int
    """Ready blocks with no load in flight."""
    lookups: int
    """``lookup`` calls."""
    hits: int
    """``lookup`` calls answered ``HIT``."""
    pending_hits: int = 0
    """``lookup`` calls answered ``HIT_PENDING``."""
    evictions: int = 0
    """Blocks evicted to make room."""
    stores: int = 0
    """Blocks that ``prepare_store`` allocated."""
    loads: int = 0
    """Blocks that ``prepare_load`` pinned for a load (each key of each call)."""
    failed_stores: int = 0
    """Blocks whose store failed (``complete_store(..., success=False)`` or ``hold_failed_stores``)."""
    held: int = 0
    """Slots of failed stores held out of the pool until released (``hold_failed_stores``): no block, not free."""

    @property
    def free(self) -> int:
        """Slots holding nothing, and not held."""
        return self.capacity - self.used - self.held

    @property
    def occupancy(self) -> float:
        """``used / capacity``: the fraction of slots holding a block (stored or being stored)."""
        return self.used / self.capacity if self.capacity else 0.0

    @property
    def hit_rate(self) -> float:
        """``hits / lookups``, 0.0 before the first lookup."""
        return self.hits / self.lookups if self.lookups else 0.0
