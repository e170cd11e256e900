"""The memory a remote tier moves and the seals that make a loaded chunk trustworthy.

:class:`SealedSlots` holds the primary tier's host memory (the chunks, as
vLLM hands them over) and one 64-byte seal slot per primary chunk, both
registered with the store once: a job on a chunk owns that chunk's seal slot
as it owns the chunk, and every value is the chunk followed by its seal
(:mod:`kvtriton._integrity`). A load is verified before the chunk becomes a
hit; a value that fails is a miss for that key only, counted by reason in
the tier's :class:`~kvtriton.integrations.vllm._integrity_report.IntegrityReport`.

:class:`EncryptedSlots` (``kvtriton_encryption``) registers nothing of the
primary's plaintext: a store seals each chunk with its tenant's key into
memory of the job's own (an *egress* buffer, a sealed box per key) and puts
that; a load lands in memory of its own and opens each box straight into its
primary chunk. The box's tag is the integrity check, in the same one pass
over the bytes as the cipher: no xxh3 seal besides.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from kvtriton._integrity import SEAL_BYTES, IntegrityFault, seal_bytes, verify_seal
from kvtriton.encryption import OpenFailure, SealedBox, associated_data, sealed_length
from kvtriton.integrations.remote._client import Outcome, RemoteClient, Segment
from kvtriton.integrations.remote._supervisor import MemoryRegion
from kvtriton.integrations.vllm import IntegrityReport, OffloadKey, RequestTenant, TierEncryption

logger = logging.getLogger(__name__)


class KeyLoaded(NamedTuple):
    """What one key of a load gave."""

    loaded: bool
    """The key's sealed chunk, verified, is in the primary now."""
    fault: IntegrityFault | OpenFailure | None
    """Why the value was not the key's sealed chunk (recorded), or None (loaded, or no value)."""
    wrong_size: bool
    """The value had not a sealed chunk's size."""


class SealedSlots:
    """The primary's chunks and their seal slots, as the store's transfers read and write them."""

    def __init__(
        self, primary_kv_view: memoryview, chunk_bytes: int, *, fingerprint: bytes, integrity: IntegrityReport, who: str
    ) -> None:
        """``fingerprint``: the identity every seal names; ``who``: the tier in log lines."""
        if primary_kv_view.ndim != 2 or not primary_kv_view.c_contiguous:
            raise ValueError(
                f"primary_kv_view must be a C-contiguous (num_chunks, chunk_bytes) view, got shape {primary_kv_view.shape}"
            )
        self.fingerprint = fingerprint
        self.integrity = integrity
        self.who = who
        # The registered region: one numpy view over the primary's memory, kept alive with its address.
        self.primary = np.frombuffer(primary_kv_view, dtype=np.uint8)
        self.primary_base: int = self.primary.ctypes.data
        self.chunk_bytes = chunk_bytes
        self.sealed_bytes = self.chunk_bytes + SEAL_BYTES
        """The size of every value: the chunk, then its seal."""
        self.seals = np.zeros((len(primary_kv_view), SEAL_BYTES), dtype=np.uint8)
        self.seals_base: int = self.seals.ctypes.data

    def regions(self) -> list[MemoryRegion]:
        """The memory to register with the store, and what it is for log lines."""
        return [
            (self.primary_base, self.primary.nbytes, f"the primary's {self.primary.nbytes} bytes"),
            (self.seals_base, self.seals.nbytes, f"the {self.seals.nbytes} bytes of seals"),
        ]

    def release(self) -> None:
        """Drop our export of the primary's memory so the primary can unmap its region (only once the store has
        closed: a late transfer may still write it otherwise)."""
        self.primary = np.empty(0, dtype=np.uint8)
        self.seals = np.empty((0, SEAL_BYTES), dtype=np.uint8)

    def chunk_pointer(self, chunk: int) -> int:
        return self.primary_base + chunk * self.chunk_bytes

    def seal_pointer(self, chunk: int) -> int:
        return self.seals_base + chunk * SEAL_BYTES

    def segments(self, chunk_pointers: list[int], seal_pointers: list[int]) -> list[list[Segment]]:
        """Each value's segments in the primary and the seal slots: the chunk, then its seal."""
        return [[(chunk, self.chunk_bytes), (seal, SEAL_BYTES)] for chunk, seal in zip(chunk_pointers, seal_pointers)]

    def landing_segments(self, landing: np.ndarray) -> list[list[Segment]]:
        """Each value's segments in ``landing``, one ``sealed_bytes`` row per key: the chunk, then its seal."""
        base = landing.ctypes.data
        return [
            [
                (base + index * self.sealed_bytes, self.chunk_bytes),
                (base + index * self.sealed_bytes + self.chunk_bytes, SEAL_BYTES),
            ]
            for index in range(len(landing))
        ]

    def _chunk_view(self, chunk: int) -> memoryview:
        start = chunk * self.chunk_bytes
        return self.primary[start : start + self.chunk_bytes].data

    def seal(self, key: OffloadKey, chunk: int) -> None:
        """Write the seal of primary chunk ``chunk`` as the value of ``key`` into the chunk's seal slot."""
        seal = seal_bytes(self._chunk_view(chunk), key=key, fingerprint=self.fingerprint)
        self.seals[chunk] = np.frombuffer(seal, dtype=np.uint8)

    def check_load(
        self,
        store: RemoteClient,
        key: OffloadKey,
        object_key: str,
        chunk: int,
        result: int | Outcome,
        landed: np.ndarray | None,
        box: SealedBox | None = None,
    ) -> KeyLoaded:
        """Whether one key of a load gave ``key``'s sealed chunk (taken into the primary from ``landed``, the key's
        landing row, when the load used one; opened with ``box`` when the tier encrypts), and if not, why."""
        fault: IntegrityFault | OpenFailure | None = None
        wrong_size = False
        if result == self.sealed_bytes:
            fault = self._accept(key, chunk, landed, box)
            if fault is None:
                return KeyLoaded(loaded=True, fault=None, wrong_size=False)
        elif isinstance(result, int) or result is Outcome.FAILED:
            fault = self._size_fault(store, object_key, result)
            wrong_size = fault is not None
        if fault is not None:
            self.integrity.record(fault, object_key)
        return KeyLoaded(loaded=False, fault=fault, wrong_size=wrong_size)

    def _accept(
        self, key: OffloadKey, chunk: int, landed: np.ndarray | None, box: SealedBox | None
    ) -> IntegrityFault | OpenFailure | None:
        """Verify the value just read (into ``chunk`` and its seal slot, or into ``landed``: the chunk, then its
        seal) as ``key``'s sealed chunk and, when it landed apart, copy it into the primary; why not, if it is not."""
        if landed is None:
            return verify_seal(self._chunk_view(chunk), self.seals[chunk].data, key=key, fingerprint=self.fingerprint)
        fault = verify_seal(
            landed[: self.chunk_bytes].data, landed[self.chunk_bytes :].data, key=key, fingerprint=self.fingerprint
        )
        if fault is None:
            start = chunk * self.chunk_bytes
            self.primary[start : start + self.chunk_bytes] = landed[: self.chunk_bytes]
        return fault

    def _size_fault(self, store: RemoteClient, object_key: str, result: int | Outcome) -> IntegrityFault | None:
        """Why a get that moved no sealed chunk failed: the value's size (torn or too long), or None (no value).

        A store may refuse a get into buffers that do not match the value's size
        exactly without saying so; one ``size_of`` (only on this rare path) tells.
        """
        size = result if isinstance(result, int) else store.size_of(object_key)
        if size is None:
            return None
        logger.warning(
            "%s: %s holds %d bytes, not a %d-byte sealed chunk: a miss", self.who, object_key, size, self.sealed_bytes
        )
        return IntegrityFault.TORN if size < self.sealed_bytes else IntegrityFault.WRONG_SIZE


class EncryptedSlots(SealedSlots):
    """The primary's chunks as an encrypting tier moves them: every value a sealed box of its tenant (see the module
    docstring); nothing of the primary is registered with the store."""

    def __init__(
        self,
        primary_kv_view: memoryview,
        chunk_bytes: int,
        *,
        fingerprint: bytes,
        integrity: IntegrityReport,
        who: str,
        encryption: TierEncryption,
        layout: str,
        tier: str,
    ) -> None:
        """``layout``: what shapes the chunk's bytes (the tier's namespace digest); ``tier``: the tier's type name.
        Both are in every box's associated data, with the key and ``fingerprint``."""
        super().__init__(primary_kv_view, chunk_bytes, fingerprint=fingerprint, integrity=integrity, who=who)
        self.sealed_bytes = sealed_length(chunk_bytes)
        self.seals = np.zeros((0, SEAL_BYTES), dtype=np.uint8)  # the box's tag is the seal
        self.seals_base = self.seals.ctypes.data
        self._encryption = encryption
        self._layout = layout
        self._tier = tier

    def regions(self) -> list[MemoryRegion]:
        """Nothing: the store never reads or writes the primary's plaintext, only each job's sealed boxes."""
        return []

    def release(self) -> None:
        self.primary = np.empty(0, dtype=np.uint8)

    def box(self, tenant: RequestTenant) -> SealedBox:
        """The box of ``tenant``'s chunks on this tier."""
        return self._encryption.box(tenant, self.fingerprint)

    def _associated_data(self, key: OffloadKey) -> bytes:
        return associated_data(
            object_key=bytes(key), model_identity=self.fingerprint, layout=self._layout, tier=self._tier
        )

    def seal_into(self, box: SealedBox, keys: list[OffloadKey], chunks: list[int], egress: np.ndarray) -> None:
        """Seal each primary chunk in ``chunks`` as its key's value into its row of ``egress``, on an I/O thread
        (the cipher releases the GIL)."""
        for row, (key, chunk) in zip(egress, zip(keys, chunks)):
            box.seal_into(self._chunk_view(chunk), self._associated_data(key), row.data)

    def row_segments(self, rows: np.ndarray) -> list[list[Segment]]:
        """Each value's one segment: its row of ``rows`` (an egress or a landing buffer, ``sealed_bytes`` a row)."""
        base = rows.ctypes.data
        return [[(base + index * self.sealed_bytes, self.sealed_bytes)] for index in range(len(rows))]

    def landing_segments(self, landing: np.ndarray) -> list[list[Segment]]:
        return self.row_segments(landing)

    def _accept(
        self, key: OffloadKey, chunk: int, landed: np.ndarray | None, box: SealedBox | None
    ) -> IntegrityFault | OpenFailure | None:
        """Open the box that landed straight into primary chunk ``chunk`` (the tag fails for anything but ``key``'s
        chunk of this tenant, model, layout and tier under the current key)."""
        if landed is None or box is None:
            raise ValueError(f"{self.who}: an encrypted load must land apart and name its tenant's box")
        return box.open_into(landed.data, self._associated_data(key), self._chunk_view(chunk))
