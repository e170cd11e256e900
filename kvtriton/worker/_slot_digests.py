"""SlotDigests: a debug check that a host slab slot still holds the bytes its last store left there.

kvtriton trusts its host slab: a chunk a tier hands back is verified once, when
it enters the slab, and from then on the slab's bytes (and those the GPU stored)
are loaded as they are. vLLM cannot take a refused load from the host back
(its offloading worker asserts that every transfer it submits is accepted), so
a check on every load would have nothing to fall back on but stopping the engine.

That is what this check is for, opt-in, while debugging (a kernel writing the
wrong slot, a process writing into pinned memory, faulty RAM): the worker takes
each slot's digest when its store finishes, and before a load it compares every
slot the load reads. A slot that changed, or was never stored, refuses the load,
which stops the engine with the slot named, instead of feeding the GPU bytes
that were not stored there. It costs one xxh3-128 pass over every stored and
every loaded slot on the worker's thread (about 50 us per 2 MiB on the
reference CPU, bench/integrity.py), so it stays off in production.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtriton._xxh3 import xxh3_128
from kvtriton.worker._slab import HostSlab


class SlotDigests:
    """The digest of every slot of ``slab`` as its last finished store left it."""

    def __init__(self, slab: HostSlab) -> None:
        self._slab = slab
        self._digests: dict[int, bytes] = {}

    def _digest(self, slot: int) -> bytes:
        state = xxh3_128()
        for row in self._slab.slot(slot):  # rows may be strided apart: each one is contiguous
            state.update(row.numpy().data)
        return state.digest()

    def record(self, slots: Iterable[int]) -> None:
        """Take the digests of ``slots``, whose store has just finished."""
        for slot in slots:
            self._digests[slot] = self._digest(slot)

    def forget(self, slots: Iterable[int]) -> None:
        """A store to ``slots`` failed: their bytes are no store's, and no load may read them."""
        for slot in slots:
            self._digests.pop(slot, None)

    def changed(self, slots: Iterable[int]) -> list[int]:
        """The slots of ``slots`` (each once, in order) whose bytes are not what their last store left, or that
        no store filled."""
        found: list[int] = []
        for slot in dict.fromkeys(slots):
            if self._digests.get(slot) != self._digest(slot):
                found.append(slot)
        return found
