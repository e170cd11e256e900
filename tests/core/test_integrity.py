from __future__ import annotations

import os
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtriton._integrity import (
    FINGERPRINT_BYTES,
    ROW_FORMAT_VERSION,
    SEAL_BYTES,
    IntegrityFault,
    key_digest,
    payload_of,
    seal,
    seal_bytes,
    seal_in_place,
    sealed_length,
    verify,
    verify_seal,
)

FINGERPRINT = bytes(range(FINGERPRINT_BYTES))
OTHER_FINGERPRINT = bytes(reversed(range(FINGERPRINT_BYTES)))
KEY = b"block-hash-0001\x00\x00\x00\x00"
PAYLOAD = os.urandom(4096 + 17)


def _sealed(payload: bytes = PAYLOAD, key: bytes = KEY, fingerprint: bytes = FINGERPRINT) -> bytearray:
    return bytearray(seal(payload, key=key, fingerprint=fingerprint))


def test_a_sealed_chunk_verifies_and_keeps_its_payload_in_front() -> None:
    chunk = _sealed()
    assert len(chunk) == sealed_length(len(PAYLOAD)) == len(PAYLOAD) + SEAL_BYTES
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is None
    assert bytes(payload_of(chunk)) == PAYLOAD
    assert chunk[: len(PAYLOAD)] == PAYLOAD


@given(payload=st.binary(max_size=2048), key=st.binary(min_size=1, max_size=64))
def test_any_payload_and_key_round_trip(payload: bytes, key: bytes) -> None:
    chunk = seal(payload, key=key, fingerprint=FINGERPRINT)
    assert verify(chunk, key=key, fingerprint=FINGERPRINT, expected_length=sealed_length(len(payload))) is None
    assert bytes(payload_of(chunk)) == payload


def test_an_empty_payload_seals_and_verifies() -> None:
    chunk = seal(b"", key=KEY, fingerprint=FINGERPRINT)
    assert len(chunk) == SEAL_BYTES
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=SEAL_BYTES) is None
    assert bytes(payload_of(chunk)) == b""


def test_seal_in_place_writes_the_same_trailer_into_the_reserved_tail() -> None:
    chunk = bytearray(PAYLOAD) + bytearray(b"\xee" * SEAL_BYTES)
    seal_in_place(chunk, key=KEY, fingerprint=FINGERPRINT)
    assert bytes(chunk) == seal(PAYLOAD, key=KEY, fingerprint=FINGERPRINT)
    assert chunk[-SEAL_BYTES:] == seal_bytes(PAYLOAD, key=KEY, fingerprint=FINGERPRINT)


def test_numpy_and_tensor_buffers_seal_and_verify_through_memoryview() -> None:
    """The host slab is a uint8 tensor: its chunks are sealed through NumPy's buffer (``ndarray.data``)."""
    rows = torch.arange(0, 64 * 33, dtype=torch.int32).reshape(64, 33).to(torch.bfloat16)
    row_bytes = rows.view(-1).view(torch.uint8)
    chunk = torch.zeros(row_bytes.numel() + SEAL_BYTES, dtype=torch.uint8)
    chunk[:-SEAL_BYTES] = row_bytes
    seal_in_place(chunk.numpy().data, key=KEY, fingerprint=FINGERPRINT)
    two_dimensional = chunk.view(-1, 1).numpy()
    assert verify(two_dimensional.data, key=KEY, fingerprint=FINGERPRINT) is None
    assert bytes(payload_of(chunk.numpy().data)) == row_bytes.numpy().tobytes()


@pytest.mark.parametrize(
    "position", [0, 1, len(PAYLOAD) // 2, len(PAYLOAD) - 1] + list(range(len(PAYLOAD), len(PAYLOAD) + 48))
)
def test_a_flipped_byte_outside_the_length_version_and_magic_is_a_checksum_fault(position: int) -> None:
    chunk = _sealed()
    chunk[position] ^= 0x40
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.CHECKSUM


@pytest.mark.parametrize("position", range(len(PAYLOAD) + 48, len(PAYLOAD) + SEAL_BYTES))
def test_a_flipped_byte_in_the_length_version_or_magic_is_still_a_fault(position: int) -> None:
    """These fields are read before the checksum (an older format may hash otherwise), so they name the fault."""
    chunk = _sealed()
    chunk[position] ^= 0x01
    fault = verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk))
    offset = position - len(PAYLOAD)
    if offset < 56:
        assert fault in (IntegrityFault.TORN, IntegrityFault.WRONG_SIZE)
    elif offset < 60:
        assert fault is IntegrityFault.STALE_FORMAT
    else:
        assert fault is IntegrityFault.TORN


def test_a_right_sized_chunk_of_other_bytes_is_a_fault() -> None:
    chunk = os.urandom(sealed_length(len(PAYLOAD)))
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.TORN
    zeros = bytes(sealed_length(len(PAYLOAD)))
    assert verify(zeros, key=KEY, fingerprint=FINGERPRINT, expected_length=len(zeros)) is IntegrityFault.TORN


def test_other_payload_bytes_under_a_copied_seal_are_a_checksum_fault() -> None:
    chunk = bytearray(os.urandom(len(PAYLOAD))) + _sealed()[-SEAL_BYTES:]
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.CHECKSUM


@pytest.mark.parametrize("kept", [0, 1, SEAL_BYTES - 1, SEAL_BYTES, len(PAYLOAD) // 2, len(PAYLOAD) + SEAL_BYTES - 1])
def test_a_truncated_chunk_is_torn(kept: int) -> None:
    chunk = _sealed()
    assert verify(chunk[:kept], key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.TORN
    # without the expected length the lost end of the seal still tells
    if kept < len(chunk):
        assert verify(chunk[:kept], key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.TORN


def test_an_over_long_chunk_is_the_wrong_size() -> None:
    chunk = _sealed()
    longer = chunk + b"\x00" * 7
    assert verify(longer, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.WRONG_SIZE


def test_an_intact_chunk_of_another_geometry_is_the_wrong_size() -> None:
    smaller = _sealed(PAYLOAD[:1000])
    assert verify(smaller, key=KEY, fingerprint=FINGERPRINT, expected_length=len(_sealed())) is IntegrityFault.TORN
    # a seal whose payload length disagrees with the bytes around it
    chunk = _sealed()
    grown = bytearray(PAYLOAD + b"\x00" * 8) + chunk[-SEAL_BYTES:]
    assert verify(grown, key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.WRONG_SIZE
    shrunk = bytearray(PAYLOAD[:-8]) + chunk[-SEAL_BYTES:]
    assert verify(shrunk, key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.TORN


def test_another_keys_intact_chunk_is_other_key() -> None:
    chunk = _sealed(key=b"another-block\x00\x00\x00\x01")
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.OTHER_KEY


def test_another_fingerprints_intact_chunk_is_other_fingerprint() -> None:
    chunk = _sealed(fingerprint=OTHER_FINGERPRINT)
    fault = verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk))
    assert fault is IntegrityFault.OTHER_FINGERPRINT


def test_a_chunk_sealed_by_an_older_row_format_is_stale() -> None:
    """An older release's seal: the same layout with another version number (and its own valid checksum)."""
    checked = struct.pack("<16s16sQI4s", FINGERPRINT, key_digest(KEY), len(PAYLOAD), ROW_FORMAT_VERSION - 1, b"KVTs")
    import xxhash

    state = xxhash.xxh3_128(PAYLOAD)
    state.update(checked)
    chunk = PAYLOAD + state.digest() + checked
    assert verify(chunk, key=KEY, fingerprint=FINGERPRINT, expected_length=len(chunk)) is IntegrityFault.STALE_FORMAT


def test_fault_values_are_the_metric_reasons() -> None:
    assert sorted(fault.value for fault in IntegrityFault) == [
        "checksum", "other_fingerprint", "other_key", "stale_format", "torn", "wrong_size",
    ]  # fmt: skip


@pytest.mark.parametrize("fingerprint", [b"", b"short", bytes(FINGERPRINT_BYTES + 1)])
def test_a_fingerprint_of_the_wrong_length_is_refused_naming_it(fingerprint: bytes) -> None:
    with pytest.raises(ValueError, match=rf"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"):
        seal(PAYLOAD, key=KEY, fingerprint=fingerprint)
    with pytest.raises(ValueError, match="fingerprint must be"):
        verify(_sealed(), key=KEY, fingerprint=fingerprint)


def test_sealing_in_place_refuses_a_chunk_without_room_or_read_only() -> None:
    with pytest.raises(ValueError, match=rf"at least SEAL_BYTES={SEAL_BYTES} bytes .*got 10"):
        seal_in_place(bytearray(10), key=KEY, fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="writable"):
        seal_in_place(bytes(100), key=KEY, fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="sealed_length|payload_length must be >= 0, got -1"):
        sealed_length(-1)


def test_a_payload_and_its_seal_held_apart_verify_alike() -> None:
    trailer = seal_bytes(PAYLOAD, key=KEY, fingerprint=FINGERPRINT)
    assert verify_seal(PAYLOAD, trailer, key=KEY, fingerprint=FINGERPRINT) is None
    damaged = bytearray(PAYLOAD)
    damaged[100] ^= 1
    assert verify_seal(damaged, trailer, key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.CHECKSUM
    assert verify_seal(PAYLOAD, trailer[:-1], key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.TORN
    assert verify_seal(PAYLOAD, trailer, key=b"other", fingerprint=FINGERPRINT) is IntegrityFault.OTHER_KEY
    assert verify_seal(PAYLOAD, trailer, key=KEY, fingerprint=OTHER_FINGERPRINT) is IntegrityFault.OTHER_FINGERPRINT
    assert verify_seal(PAYLOAD[:-1], trailer, key=KEY, fingerprint=FINGERPRINT) is IntegrityFault.TORN
