"""Each tenant's key: derived per (master key, cache_salt, model), the same in every process, cached, never shown."""

from __future__ import annotations

import pickle
import threading

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtriton.encryption import MasterKey, TenantKeys, is_shared_tenant
from kvtriton.encryption._tenant_keys import CACHED_TENANT_KEYS, derivation_info

MASTER = MasterKey(bytes(range(32)), source="test")
OTHER_MASTER = MasterKey(bytes(range(1, 33)), source="test")
MODEL = bytes(range(16))


def test_the_key_is_hkdf_sha256_of_the_master_key_with_tenant_and_model_in_info() -> None:
    info = b"kvtriton tenant key v1" + b"\x01" + (5).to_bytes(4, "big") + b"alice" + (16).to_bytes(4, "big") + MODEL
    assert derivation_info("alice", MODEL) == info
    independent = HKDF(hashes.SHA256(), 32, b"kvtriton encryption: tenant keys", info).derive(MASTER.secret)
    assert TenantKeys(MASTER).key_for("alice", MODEL).secret == independent


def test_another_tenant_model_or_master_key_gives_another_key_and_the_same_ones_the_same_key() -> None:
    keys = TenantKeys(MASTER)
    alice = keys.key_for("alice", MODEL).secret
    assert TenantKeys(MASTER).key_for("alice", MODEL).secret == alice  # another process derives the same key
    assert keys.key_for("alice", MODEL.hex()).secret == TenantKeys(MASTER).key_for("alice", MODEL.hex()).secret
    others = {
        keys.key_for("bob", MODEL).secret,
        keys.key_for("alicf", MODEL).secret,
        keys.key_for(None, MODEL).secret,
        keys.key_for("alice", bytes(16)).secret,
        keys.key_for("alice", MODEL + b"\x00").secret,
        TenantKeys(OTHER_MASTER).key_for("alice", MODEL).secret,
        MASTER.secret,
    }
    assert alice not in others and len(others) == 7


def test_no_salt_and_the_empty_salt_are_the_one_shared_tenant_as_in_vllm_s_block_hash() -> None:
    keys = TenantKeys(MASTER)
    assert is_shared_tenant(None) and is_shared_tenant("") and not is_shared_tenant("a")
    assert keys.key_for(None, MODEL).secret == keys.key_for("", MODEL).secret
    assert keys.key_for(None, MODEL).shared_tenant and not keys.key_for("a", MODEL).shared_tenant


def test_the_encoding_keeps_tenant_and_model_apart() -> None:
    """Length prefixes: moving bytes between the salt and the model never gives the same info."""
    assert derivation_info("ab", b"c") != derivation_info("a", b"bc")
    assert derivation_info(None, b"\x01\x00\x00\x00\x00") != derivation_info("", b"\x01\x00\x00\x00\x00" + b"x")


def test_derived_keys_are_cached_least_recently_used_out() -> None:
    keys = TenantKeys(MASTER)
    first = keys.key_for("tenant-0", MODEL)
    assert keys.key_for("tenant-0", MODEL) is first
    assert keys.key_for("", MODEL) is keys.key_for(None, MODEL)
    for tenant in range(1, CACHED_TENANT_KEYS + 1):
        keys.key_for(f"tenant-{tenant}", MODEL)
    assert repr(keys) == f"TenantKeys(key_id={MASTER.key_id!r}, cached={CACHED_TENANT_KEYS})"
    again = keys.key_for("tenant-0", MODEL)
    assert again is not first and again.secret == first.secret


def test_keys_derive_alike_from_many_threads() -> None:
    keys = TenantKeys(MASTER)
    found: list[bytes] = []

    def derive() -> None:
        found.extend(keys.key_for(f"t{i % 7}", MODEL).secret for i in range(200))

    threads = [threading.Thread(target=derive) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 800 and len(set(found)) == 7


@pytest.mark.parametrize(
    ("salt", "model", "error", "said"),
    [
        ("a", b"", ValueError, "model_identity must not be empty"),
        ("a", 3, TypeError, "model_identity must be bytes or str, got int"),
        (b"a", MODEL, TypeError, "cache_salt must be a str or None, got bytes"),
    ],
)
def test_a_bad_tenant_or_model_is_refused_naming_the_argument(
    salt: object, model: object, error: type[Exception], said: str
) -> None:
    with pytest.raises(error, match=said):
        TenantKeys(MASTER).key_for(salt, model)  # pyright: ignore[reportArgumentType] -- the wrong types under test


def test_no_key_and_no_salt_shows_in_repr_or_a_pickle() -> None:
    keys = TenantKeys(MASTER)
    key = keys.key_for("secret-salt-of-alice", MODEL)
    for shown in (repr(key), str(key), repr(keys), str(keys)):
        assert key.secret.hex() not in shown and MASTER.secret.hex() not in shown
        assert "secret-salt-of-alice" not in shown
    assert repr(key) == f"TenantKey(key_id={MASTER.key_id!r}, tenant='salted')"
    assert repr(keys.key_for(None, MODEL)) == f"TenantKey(key_id={MASTER.key_id!r}, tenant='shared')"
    for holder in (key, keys):
        with pytest.raises(TypeError, match="never pickled"):
            pickle.dumps(holder)
