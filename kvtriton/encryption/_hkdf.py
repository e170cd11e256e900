"""HKDF-SHA256 (RFC 5869) with the standard library alone, so deriving a key needs no third-party package.

Only the AEAD itself needs the ``cryptography`` package
(:mod:`kvtriton.encryption._sealed_box`); a key id or a tenant key is derived
here with :mod:`hmac` and :mod:`hashlib`, so a start-up check that only loads
the master key and prints its id works without the extra installed.
``tests/encryption/test_hkdf.py`` checks both steps against RFC 5869's
SHA-256 test vectors (appendix A.1-A.3).
"""

from __future__ import annotations

import hashlib
import hmac

HASH_BYTES = hashlib.sha256().digest_size
"""32: the length of a pseudorandom key (PRK) and of one block of output."""

MAX_OUTPUT_BYTES = 255 * HASH_BYTES
"""The most HKDF-Expand may return (RFC 5869, section 2.3)."""


def hkdf_extract(salt: bytes, input_key_material: bytes) -> bytes:
    """HKDF-Extract: the 32-byte pseudorandom key of ``input_key_material`` under ``salt`` (empty: 32 zero bytes)."""
    return hmac.digest(salt or bytes(HASH_BYTES), input_key_material, hashlib.sha256)


def hkdf_expand(pseudorandom_key: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand: ``length`` bytes (1 to :data:`MAX_OUTPUT_BYTES`) of output keyed by ``pseudorandom_key``, bound
    to ``info``."""
    if not 0 < length <= MAX_OUTPUT_BYTES:
        raise ValueError(f"length must be 1 to {MAX_OUTPUT_BYTES} bytes (255 SHA-256 blocks), got {length}")
    if len(pseudorandom_key) < HASH_BYTES:
        raise ValueError(f"pseudorandom_key must be at least {HASH_BYTES} bytes, got {len(pseudorandom_key)}")
    output = b""
    block = b""
    counter = 1
    while len(output) < length:
        block = hmac.digest(pseudorandom_key, block + info + bytes((counter,)), hashlib.sha256)
        output += block
        counter += 1
    return output[:length]


def hkdf(input_key_material: bytes, *, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Extract then HKDF-Expand: ``length`` bytes derived from ``input_key_material``."""
    return hkdf_expand(hkdf_extract(salt, input_key_material), info, length)
