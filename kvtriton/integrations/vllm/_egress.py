"""The egress area: where vLLM's ``fs`` tier finds ciphertext, never the primary's plaintext (``kvtriton_encryption``).

vLLM's fs tier copies a chunk between a file and row ``chunk_id`` of the
memory it was built with, byte for byte. Under ``kvtriton_encryption`` the
tiered spec builds it over an :class:`EgressArea` instead of the primary's
region: rows of the engine core's own memory that no worker rank maps and the
tier's only view of the KV. :class:`~kvtriton.integrations.vllm._sealed_tiering.SealedTieringManager`
hands the tier a copy of each job whose ``chunk_ids`` name egress rows:

* a cascade: the seal thread seals each primary slot with its tenant's key
  into an egress row (:meth:`EgressCipher.seal`), then the tier writes the row;
* a promotion: the tier reads each file into an egress row, then the seal
  thread opens it into the primary slot (:meth:`EgressCipher.open`).

A sealed chunk is exactly one slot long: the box holds the slot's first
``chunk_bytes - 44`` bytes (the KV and 20 bytes of the 64 each slot keeps for
an xxh3 seal, which an encrypted chunk has no use for) and adds the box's 44
bytes of header and tag, so every byte of a chunk file is authenticated and a
chunk file keeps the size, alignment and O_DIRECT use of an unencrypted one.

The area is bounded (:func:`egress_rows`); its rows are taken per job and
given back when the tier reports the job done. A cascade that finds too few
free rows stores only the chunks that got one (the rest stay in the primary
only, as a skipped store does); a promotion that finds too few is a miss.
"""

from __future__ import annotations

import logging
import mmap
import threading

import numpy as np

from kvtriton._integrity import SEAL_BYTES
from kvtriton.encryption import OVERHEAD_BYTES, OpenFailure, SealedBox, associated_data
from kvtriton.integrations.vllm._encryption import TierEncryption
from kvtriton.integrations.vllm._surface import OffloadKey, RequestTenant

logger = logging.getLogger(__name__)

assert OVERHEAD_BYTES <= SEAL_BYTES, "a sealed box must fit the room each slot keeps for its seal"

EGRESS_BYTES = 1 << 30
"""The egress area's size in bytes, unless the region is smaller (then the region's size) or a chunk is so large
that :data:`EGRESS_MIN_ROWS` rows need more."""

EGRESS_MIN_ROWS = 64
"""The fewest rows an egress area has (unless the region has fewer chunks): room for a long prompt's chunks."""


def egress_rows(num_chunks: int, chunk_bytes: int) -> int:
    """Rows of the egress area of a region of ``num_chunks`` chunks of ``chunk_bytes`` each."""
    if num_chunks < 1 or chunk_bytes < 1:
        raise ValueError(f"num_chunks and chunk_bytes must be >= 1, got {num_chunks} and {chunk_bytes}")
    return min(num_chunks, max(EGRESS_MIN_ROWS, EGRESS_BYTES // chunk_bytes))


class EgressArea:
    """``rows`` rows of ``row_bytes`` in the engine core's anonymous memory, taken and given back per job.

    The rows are page-aligned (an anonymous mapping), as O_DIRECT needs. Taken
    last-given-back first, so the pages ever touched (the resident cost) are the
    most rows in use at once, not the whole area. Thread-safe.
    """

    def __init__(self, rows: int, row_bytes: int) -> None:
        if rows < 1 or row_bytes < 1:
            raise ValueError(f"rows and row_bytes must be >= 1, got {rows} and {row_bytes}")
        # Never closed explicitly: the tier keeps a view of it until it is collected, which unmaps it.
        self._memory = mmap.mmap(-1, rows * row_bytes)
        self.rows: np.ndarray = np.frombuffer(self._memory, dtype=np.uint8).reshape(rows, row_bytes)
        """The rows, ``(rows, row_bytes)``."""
        self._free = list(range(rows - 1, -1, -1))  # a stack: row 0 on top
        self._lock = threading.Lock()

    @property
    def row_bytes(self) -> int:
        return int(self.rows.shape[1])

    def view(self) -> memoryview:
        """The rows as a ``(rows, row_bytes)`` memoryview: what the tier is built with instead of the primary's."""
        return memoryview(self._memory).cast("B", (len(self.rows), self.row_bytes))

    def take(self, count: int) -> list[int]:
        """Up to ``count`` free rows (fewer when fewer are free), now the caller's until :meth:`give_back`."""
        with self._lock:
            taken = self._free[len(self._free) - min(count, len(self._free)) :]
            del self._free[len(self._free) - len(taken) :]
        taken.reverse()
        return taken

    def give_back(self, rows: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(rows))

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)


class EgressCipher:
    """Seals primary slots into egress rows and opens egress rows into primary slots, per tenant.

    ``fingerprint`` (the model identity) and ``layout`` (the chunks' layout
    tag) go into every box's associated data with the key and the tier's type.
    """

    def __init__(self, area: EgressArea, encryption: TierEncryption, *, fingerprint: bytes, layout: str) -> None:
        self.area = area
        self._encryption = encryption
        self._fingerprint = fingerprint
        self._layout = layout
        self.plaintext_bytes = area.row_bytes - OVERHEAD_BYTES
        """The bytes of a slot a box holds: all but the last 44 (room kept for the seal)."""

    def box(self, tenant: RequestTenant) -> SealedBox:
        return self._encryption.box(tenant, self._fingerprint)

    def _associated_data(self, key: OffloadKey, tier: str) -> bytes:
        return associated_data(object_key=bytes(key), model_identity=self._fingerprint, layout=self._layout, tier=tier)

    def seal(self, box: SealedBox, key: OffloadKey, tier: str, slot: np.ndarray, row: int) -> None:
        """Seal primary ``slot`` (one chunk) as ``key``'s chunk on ``tier`` into egress row ``row``."""
        box.seal_into(slot[: self.plaintext_bytes].data, self._associated_data(key, tier), self.area.rows[row].data)

    def open(self, box: SealedBox, key: OffloadKey, tier: str, row: int, slot: np.ndarray) -> OpenFailure | None:
        """Open egress row ``row`` as ``key``'s chunk from ``tier`` into primary ``slot``; why not, or None."""
        return box.open_into(
            self.area.rows[row].data, self._associated_data(key, tier), slot[: self.plaintext_bytes].data
        )
