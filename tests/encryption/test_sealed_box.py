"""The sealed box: what opens, and every way a box from a tier fails to open (each a reason, never an exception)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtriton import make_offload_key
from kvtriton.encryption import (
    HEADER_BYTES,
    OVERHEAD_BYTES,
    MasterKey,
    OpenFailure,
    SealedBox,
    TenantKeys,
    associated_data,
    sealed_length,
)

MASTER = MasterKey(bytes(range(32)), source="test")
ROTATED = MasterKey(bytes(range(100, 132)), source="test")
STRANGER = MasterKey(bytes(range(200, 232)), source="test")
MODEL = bytes(range(16))
OBJECT = make_offload_key(bytes(range(32)), 0)
AD_FIELDS: dict[str, bytes | str] = {
    "object_key": OBJECT,
    "model_identity": MODEL,
    "layout": "block-rows-v1 bf16 16x8x128 32 layers",
    "tier": "fs",
}
AD = associated_data(**AD_FIELDS)  # pyright: ignore[reportArgumentType] -- the fields' types, checked by the function
BOX = SealedBox(TenantKeys(MASTER).key_for("alice", MODEL))


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 1, 1 << 20], ids=["empty", "1-byte", "1-MiB"])
def test_a_box_opens_to_its_plaintext_and_is_plaintext_plus_44_bytes(size: int) -> None:
    plaintext = payload(size)
    sealed = BOX.seal(plaintext, AD)
    assert len(sealed) == sealed_length(size) == size + OVERHEAD_BYTES
    assert BOX.open(sealed, AD) == plaintext
    assert BOX.open(sealed, AD, plaintext_length=size) == plaintext
    if size >= 64:
        assert plaintext[:64] not in sealed and plaintext[-64:] not in sealed


def test_every_seal_draws_a_new_nonce() -> None:
    first, second = BOX.seal(b"same bytes", AD), BOX.seal(b"same bytes", AD)
    assert first[16:HEADER_BYTES] != second[16:HEADER_BYTES] and first[HEADER_BYTES:] != second[HEADER_BYTES:]


def test_a_box_seals_from_and_opens_into_host_memory_without_copies() -> None:
    row = np.random.default_rng(1).integers(0, 256, (4, 4096), dtype=np.uint8)
    egress = np.zeros(sealed_length(row.nbytes), dtype=np.uint8)
    BOX.seal_into(row.data, AD, egress.data)
    back = np.zeros_like(row)
    assert BOX.open_into(egress.data, AD, back.data) is None
    assert np.array_equal(back, row)
    as_floats = np.frombuffer(row.tobytes(), dtype=np.float32)  # any element format: the bytes are sealed
    assert BOX.open(BOX.seal(as_floats.data, AD), AD) == row.tobytes()


@pytest.mark.parametrize("field", sorted(AD_FIELDS))
def test_a_box_read_for_another_object_model_layout_or_tier_fails_its_tag(field: str) -> None:
    sealed = BOX.seal(b"kv of one block", AD)
    changed = dict(AD_FIELDS)
    value = changed[field]
    changed[field] = value + b"\x01" if isinstance(value, bytes) else value + "x"
    assert BOX.open(sealed, associated_data(**changed)) is OpenFailure.TAG_MISMATCH  # pyright: ignore[reportArgumentType] -- as above


def test_a_box_moved_under_another_kv_group_fails_its_tag() -> None:
    sealed = BOX.seal(b"kv of one block", AD)
    other_group = associated_data(**{**AD_FIELDS, "object_key": make_offload_key(bytes(range(32)), 1)})  # pyright: ignore[reportArgumentType] -- as above
    assert BOX.open(sealed, other_group) is OpenFailure.TAG_MISMATCH


@pytest.mark.parametrize(
    ("salt", "model"),
    [("bob", MODEL), (None, MODEL), ("alice", bytes(16))],
    ids=["other-tenant", "shared-tenant", "other-model"],
)
def test_a_box_opened_with_another_tenant_s_or_model_s_key_fails_its_tag(salt: str | None, model: bytes) -> None:
    sealed = BOX.seal(b"alice's prompt", AD)
    assert SealedBox(TenantKeys(MASTER).key_for(salt, model)).open(sealed, AD) is OpenFailure.TAG_MISMATCH


@pytest.mark.parametrize(
    ("offset", "expected"),
    [
        (0, OpenFailure.UNKNOWN_FORMAT),  # magic
        (4, OpenFailure.UNKNOWN_FORMAT),  # format version
        (5, OpenFailure.UNKNOWN_FORMAT),  # algorithm
        (6, OpenFailure.UNKNOWN_FORMAT),  # reserved
        (8, OpenFailure.OTHER_KEY),  # key id
        (16, OpenFailure.TAG_MISMATCH),  # nonce
        (27, OpenFailure.TAG_MISMATCH),  # nonce, last byte
        (HEADER_BYTES, OpenFailure.TAG_MISMATCH),  # ciphertext
        (HEADER_BYTES + 500, OpenFailure.TAG_MISMATCH),  # ciphertext
        (-16, OpenFailure.TAG_MISMATCH),  # tag
        (-1, OpenFailure.TAG_MISMATCH),  # tag, last byte
    ],
)
def test_a_flipped_byte_anywhere_in_a_box_is_a_failure_never_plaintext(offset: int, expected: OpenFailure) -> None:
    sealed = bytearray(BOX.seal(payload(1000), AD))
    sealed[offset] ^= 0x01
    assert BOX.open(sealed, AD) is expected


def test_a_box_cut_short_is_truncated_and_one_too_long_the_wrong_length() -> None:
    sealed = BOX.seal(payload(100), AD)
    for length in (0, 3, HEADER_BYTES - 1, HEADER_BYTES, OVERHEAD_BYTES - 1):
        assert BOX.open(sealed[:length], AD) is OpenFailure.TRUNCATED
    assert BOX.open(sealed[:-1], AD, plaintext_length=100) is OpenFailure.TRUNCATED
    assert BOX.open(sealed[:-1], AD) is OpenFailure.TAG_MISMATCH  # no length expected: only the tag can tell
    assert BOX.open(sealed + b"\x00", AD, plaintext_length=100) is OpenFailure.WRONG_LENGTH


def test_a_box_of_a_rotated_out_key_is_a_retired_key_and_one_of_an_unknown_key_another_key() -> None:
    before = SealedBox(TenantKeys(ROTATED).key_for("alice", MODEL)).seal(b"sealed before the rotation", AD)
    stranger = SealedBox(TenantKeys(STRANGER).key_for("alice", MODEL)).seal(b"another deployment's", AD)
    after = SealedBox(TenantKeys(MASTER).key_for("alice", MODEL), retired_key_ids=[ROTATED.key_id])
    assert after.open(before, AD) is OpenFailure.RETIRED_KEY
    assert after.open(stranger, AD) is OpenFailure.OTHER_KEY
    assert BOX.open(before, AD) is OpenFailure.OTHER_KEY  # not listed as retired


def test_unencrypted_bytes_are_an_unknown_format() -> None:
    assert BOX.open(payload(4096), AD) is OpenFailure.UNKNOWN_FORMAT


def test_a_failed_open_into_leaves_no_unauthenticated_bytes_behind() -> None:
    sealed = bytearray(BOX.seal(payload(4096), AD))
    sealed[HEADER_BYTES] ^= 0xFF
    out = bytearray(b"\xaa" * 4096)
    assert BOX.open_into(sealed, AD, out) is OpenFailure.TAG_MISMATCH
    assert out == bytes(4096)


def test_a_caller_s_wrong_buffer_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"out must be sealed_length\(3\) = 47 bytes, got 46"):
        BOX.seal_into(b"abc", AD, bytearray(46))
    with pytest.raises(ValueError, match="out must be writable"):
        BOX.seal_into(b"abc", AD, bytes(47))
    with pytest.raises(ValueError, match="out must be writable"):
        BOX.open_into(BOX.seal(b"abc", AD), AD, bytes(3))
    with pytest.raises(ValueError, match="plaintext must be a contiguous buffer"):
        BOX.seal(np.zeros((4, 4), dtype=np.uint8)[:, 1].data, AD)
    with pytest.raises(ValueError, match="plaintext_length must be >= 0, got -1"):
        sealed_length(-1)


def test_retired_key_ids_are_checked_and_never_the_current_one() -> None:
    key = TenantKeys(MASTER).key_for("alice", MODEL)
    with pytest.raises(ValueError, match=r"retired_key_ids\[1\] must be a key id"):
        SealedBox(key, retired_key_ids=[ROTATED.key_id, "old"])
    with pytest.raises(ValueError, match=f"retired_key_ids lists {MASTER.key_id}, the id of the current master key"):
        SealedBox(key, retired_key_ids=[MASTER.key_id])


@pytest.mark.parametrize("field", ["object_key", "model_identity", "layout", "tier"])
def test_an_empty_associated_data_field_is_refused_naming_it(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must not be empty"):
        associated_data(**{**AD_FIELDS, field: b"" if field != "tier" else ""})  # pyright: ignore[reportArgumentType] -- as above


def test_associated_data_fields_cannot_borrow_bytes_from_each_other() -> None:
    assert associated_data(object_key=b"ab", model_identity=b"c", layout="l", tier="t") != associated_data(
        object_key=b"a", model_identity=b"bc", layout="l", tier="t"
    )


def test_no_key_shows_in_a_box_s_repr_or_a_pickle() -> None:
    key = TenantKeys(MASTER).key_for("alice", MODEL)
    box = SealedBox(key, retired_key_ids=[ROTATED.key_id])
    assert repr(box) == str(box) == f"SealedBox(key_id={MASTER.key_id!r}, retired_key_ids=[{ROTATED.key_id!r}])"
    for secret in (key.secret, MASTER.secret):
        assert secret.hex() not in repr(box) and repr(secret) not in repr(box)
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(box)


@given(plaintext=st.binary(max_size=4096), extra=st.binary(max_size=64), salt=st.one_of(st.none(), st.text()))
def test_any_plaintext_opens_back_under_its_own_associated_data_only(
    plaintext: bytes, extra: bytes, salt: str | None
) -> None:
    box = SealedBox(TenantKeys(MASTER).key_for(salt, MODEL))
    ad = AD + extra
    sealed = box.seal(plaintext, ad)
    assert box.open(sealed, ad) == plaintext
    assert box.open(sealed, ad + b"\x00") is OpenFailure.TAG_MISMATCH


@given(garbage=st.binary(max_size=256))
def test_any_bytes_from_a_tier_open_or_fail_with_a_reason_never_an_exception(garbage: bytes) -> None:
    forged = BOX.seal(b"", AD)[:HEADER_BYTES] + garbage  # a valid header, then anything
    for candidate in (garbage, forged):
        assert isinstance(BOX.open(candidate, AD), OpenFailure)


def test_a_box_is_sealed_and_opened_alike_from_many_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def seal(chunk: bytes) -> bytes:
        return BOX.seal(chunk, AD)

    def open_(box: bytes) -> bytes | OpenFailure:
        return BOX.open(box, AD)

    chunks = [os.urandom(65536) for _ in range(16)]
    with ThreadPoolExecutor(4) as pool:
        sealed = list(pool.map(seal, chunks))
        opened = list(pool.map(open_, sealed))
    assert opened == chunks
