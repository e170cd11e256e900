"""The seal that travels with every chunk that leaves the host slab, and its check when the chunk comes back.

A sealed chunk is the payload (the chunk's host rows, exactly as the slab holds
them) followed by a fixed :data:`SEAL_BYTES`-byte trailer. A trailer, not a
header: the payload keeps its offsets (row ``i`` still starts at
``i * row_bytes``), and a chunk cut short loses the end of its seal first, so a
truncated chunk never passes as whole.

The trailer, little-endian, 64 bytes:

====== ====== ===============================================================
offset bytes  field
====== ====== ===============================================================
0      16     checksum: xxh3-128 of the payload, then of trailer bytes 16..63
16     16     identity fingerprint (what made the bytes; :data:`FINGERPRINT_BYTES`)
32     16     the chunk's key digest (xxh3-128 of the key, seeded apart)
48     8      payload length in bytes
56     4      row format version (:data:`ROW_FORMAT_VERSION`)
60     4      magic ``b"KVTs"``
====== ====== ===============================================================

The checksum covers the other trailer fields too, so a flipped byte anywhere
in a chunk (payload or seal) reads as :attr:`IntegrityFault.CHECKSUM`, and
:attr:`~IntegrityFault.OTHER_FINGERPRINT` / :attr:`~IntegrityFault.OTHER_KEY`
name only intact chunks written by another deployment or for another key.

Why xxh3-128 (the ``xxhash`` library) and not the standard library: on this
project's reference CPU (bench/integrity.py, docs/tiers.md "Integrity") it
hashes 27-47 GB/s against zlib.crc32's 3.6 GB/s and blake2b's 0.8 GB/s, so
verifying a promoted chunk costs a small fraction of the disk or network read
it follows; 128 bits leave no practical chance that a damaged chunk keeps its
checksum. It is a checksum against accidents (bit rot, torn writes, a pool
shared by mistake), not a MAC: whoever can write to a tier can forge a seal.
``xxhash`` is imported at the first seal or check (:mod:`kvtriton._xxh3`), so
the constants here import without it.
"""

from __future__ import annotations

import enum
import struct

from kvtriton._xxh3 import xxh3_128, xxh3_128_digest

ROW_FORMAT_VERSION = 1
"""The version of the bytes of a host row and of this seal; bumped whenever either changes meaning.

A chunk sealed under another version is :attr:`IntegrityFault.STALE_FORMAT`;
the version also goes into the identity fingerprint."""

FINGERPRINT_BYTES = 16
"""Length of an identity fingerprint (kvtriton.integrations.vllm._identity builds it for vLLM)."""

SEAL_BYTES = 64
"""Length of the trailer :func:`seal_bytes` returns and :func:`seal` appends."""

_MAGIC = b"KVTs"
_TRAILER = struct.Struct("<16s16s16sQI4s")
_CHECKED_FROM = 16
"""Trailer bytes from here on are hashed after the payload (everything but the checksum itself)."""
_KEY_SEED = 0x6B767472_6B657973  # "kvtrkeys": key digests never equal a checksum of the same bytes

assert _TRAILER.size == SEAL_BYTES

Buffer = bytes | bytearray | memoryview
"""What the seal reads and writes: any contiguous buffer (a NumPy array or a CPU tensor through ``memoryview``)."""


class IntegrityFault(str, enum.Enum):
    """Why a chunk that came back from a tier is not the chunk that was sealed; each one is a miss.

    The value is the metric's ``reason`` label and what the WARNING names.
    """

    CHECKSUM = "checksum"
    """The bytes differ from the sealed ones (flipped, overwritten, or never sealed at the right size)."""
    TORN = "torn"
    """Shorter than expected, or no intact seal at its end: cut short, or a partial write."""
    WRONG_SIZE = "wrong_size"
    """Longer than expected, or sealed with another payload length (another chunk geometry)."""
    OTHER_KEY = "other_key"
    """An intact chunk sealed for another key: one key's bytes stored under another's name."""
    STALE_FORMAT = "stale_format"
    """Sealed under another :data:`ROW_FORMAT_VERSION`: written by another kvtriton release."""
    OTHER_FINGERPRINT = "other_fingerprint"
    """An intact chunk of another identity: another model, weights, dtype, layout, rank or compression."""


def _bytes_view(buffer: Buffer, argument: str) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError(f"{argument} must be a contiguous buffer, got a {view.format!r} view of shape {view.shape}")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_fingerprint(fingerprint: bytes) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}: {fingerprint!r}")


def key_digest(key: bytes) -> bytes:
    """The 16 bytes that name ``key`` in a seal."""
    return xxh3_128_digest(key, seed=_KEY_SEED)


def sealed_length(payload_length: int) -> int:
    """Bytes of a sealed chunk whose payload is ``payload_length`` bytes."""
    if payload_length < 0:
        raise ValueError(f"payload_length must be >= 0, got {payload_length}")
    return payload_length + SEAL_BYTES


def _checksum(payload: memoryview, checked_fields: bytes | memoryview) -> bytes:
    state = xxh3_128(payload)
    state.update(checked_fields)
    return state.digest()


def seal_bytes(payload: Buffer, *, key: bytes, fingerprint: bytes) -> bytes:
    """The :data:`SEAL_BYTES`-byte trailer that seals ``payload`` as the chunk of ``key`` under ``fingerprint``."""
    _check_fingerprint(fingerprint)
    view = _bytes_view(payload, "payload")
    fields = _TRAILER.pack(bytes(16), fingerprint, key_digest(key), len(view), ROW_FORMAT_VERSION, _MAGIC)[
        _CHECKED_FROM:
    ]
    return _checksum(view, fields) + fields


def seal(payload: Buffer, *, key: bytes, fingerprint: bytes) -> bytes:
    """``payload`` followed by its seal: what a tier stores for ``key``."""
    return bytes(payload) + seal_bytes(payload, key=key, fingerprint=fingerprint)


def seal_in_place(chunk: Buffer, *, key: bytes, fingerprint: bytes) -> None:
    """Seal a writable ``chunk`` whose last :data:`SEAL_BYTES` bytes are reserved for the seal.

    The payload is ``chunk[:-SEAL_BYTES]``; the trailer overwrites the rest.
    """
    view = _bytes_view(chunk, "chunk")
    if view.readonly:
        raise ValueError("chunk must be writable to be sealed in place, got a read-only buffer")
    if len(view) < SEAL_BYTES:
        raise ValueError(f"chunk must hold at least SEAL_BYTES={SEAL_BYTES} bytes for its seal, got {len(view)}")
    view[-SEAL_BYTES:] = seal_bytes(view[:-SEAL_BYTES], key=key, fingerprint=fingerprint)


def payload_of(chunk: Buffer) -> memoryview:
    """The payload of a sealed ``chunk`` (a view, no copy); check it with :func:`verify` first."""
    view = _bytes_view(chunk, "chunk")
    if len(view) < SEAL_BYTES:
        raise ValueError(f"chunk must hold at least SEAL_BYTES={SEAL_BYTES} bytes, got {len(view)}")
    return view[:-SEAL_BYTES]


def verify(
    chunk: Buffer, *, key: bytes, fingerprint: bytes, expected_length: int | None = None
) -> IntegrityFault | None:
    """None when ``chunk`` is the intact sealed chunk of ``key`` under ``fingerprint``; else why not.

    ``expected_length`` is the sealed length the caller knows (its slot size):
    a shorter chunk is :attr:`~IntegrityFault.TORN`, a longer one
    :attr:`~IntegrityFault.WRONG_SIZE`. The checks run in this order, the first
    that fails answers: length, magic (torn), format version, payload length,
    checksum, fingerprint, key. Never raises for any bytes a tier returns.
    """
    _check_fingerprint(fingerprint)
    view = _bytes_view(chunk, "chunk")
    if expected_length is not None:
        if len(view) < expected_length:
            return IntegrityFault.TORN
        if len(view) > expected_length:
            return IntegrityFault.WRONG_SIZE
    if len(view) < SEAL_BYTES:
        return IntegrityFault.TORN
    return verify_seal(view[:-SEAL_BYTES], view[-SEAL_BYTES:], key=key, fingerprint=fingerprint)


def verify_seal(payload: Buffer, seal: Buffer, *, key: bytes, fingerprint: bytes) -> IntegrityFault | None:
    """:func:`verify` for a payload and its seal held in two buffers (a tier that reads the seal apart).

    ``seal`` must be the :data:`SEAL_BYTES` that followed ``payload``; any other
    length is :attr:`~IntegrityFault.TORN`.
    """
    _check_fingerprint(fingerprint)
    payload_view = _bytes_view(payload, "payload")
    trailer = _bytes_view(seal, "seal")
    if len(trailer) != SEAL_BYTES:
        return IntegrityFault.TORN
    checksum, sealed_fingerprint, sealed_key, payload_length, version, magic = _TRAILER.unpack(trailer)
    if magic != _MAGIC:
        return IntegrityFault.TORN
    if version != ROW_FORMAT_VERSION:
        return IntegrityFault.STALE_FORMAT
    if payload_length != len(payload_view):
        return IntegrityFault.TORN if payload_length > len(payload_view) else IntegrityFault.WRONG_SIZE
    if _checksum(payload_view, trailer[_CHECKED_FROM:]) != checksum:
        return IntegrityFault.CHECKSUM
    if sealed_fingerprint != fingerprint:
        return IntegrityFault.OTHER_FINGERPRINT
    if sealed_key != key_digest(key):
        return IntegrityFault.OTHER_KEY
    return None
