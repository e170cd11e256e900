"""The associated data that binds a sealed box to the one object it was sealed as: built here, in one function.

AES-GCM authenticates the associated data without storing it: the opener
rebuilds it from what it asked for and the tag fails unless every field is
what the sealer used. So a ciphertext copied under another object key (another
block hash or KV group), read for another model, another layout or from
another tier fails its tag and is a miss, never another block's KV. The
tenant is bound by the key itself (:mod:`kvtriton.encryption._tenant_keys`),
so another tenant's box fails too.

The bytes, each field length-prefixed (4 bytes, big-endian) so that no two
different sets of fields encode alike::

    "kvtriton ad v1" || len32(object key) || object key
                     || len32(model identity) || model identity
                     || len32(layout) || layout
                     || len32(tier) || tier

The object key is kvtriton's ``OffloadKey`` (the block hash followed by its
4-byte KV group index, :func:`kvtriton.make_offload_key`); the model identity
the fingerprint the caller already computes (for vLLM: the identity
fingerprint of :mod:`kvtriton.integrations.vllm._identity`); the layout a
description of the bytes' arrangement (the row format, page geometry, dtype);
the tier the name the tier is configured under.
"""

from __future__ import annotations

_LABEL = b"kvtriton ad v1"


def _field(name: str, value: bytes | str) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8")
    elif not isinstance(value, bytes):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        raise TypeError(f"{name} must be bytes or str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty: it is what binds a sealed box to its object")
    return len(value).to_bytes(4, "big") + value


def associated_data(*, object_key: bytes, model_identity: bytes | str, layout: bytes | str, tier: str) -> bytes:
    """The associated data of the box that holds ``object_key``'s bytes for ``model_identity`` in ``layout`` on
    ``tier``; ``ValueError`` for an empty field, naming it."""
    return (
        _LABEL
        + _field("object_key", object_key)
        + _field("model_identity", model_identity)
        + _field("layout", layout)
        + _field("tier", tier)
    )
