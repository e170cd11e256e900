"""Encryption per tenant: the master key, each tenant's key, the associated data and the sealed box.

These are the primitives of issue 48; no tier uses them yet. docs/security.md
("Encryption per tenant: the primitives") describes the key format, how to
make a key, the derivation, the associated data and the measured choice of
cipher.

Importing this package imports no cipher library: the key derivation uses the
standard library (:mod:`hmac`, :mod:`hashlib`), and ``cryptography`` is
imported when the first :class:`SealedBox` is built, so a server that does not
encrypt never needs it (``MISSING_CRYPTOGRAPHY`` says how to install it).

A typical use::

    master = MasterKey.from_file("/etc/kvtriton/master.key")      # refused unless mode 600 and the server's
    keys = TenantKeys(master)                                      # derives and caches per (tenant, model)
    box = SealedBox(keys.key_for(cache_salt, fingerprint), retired_key_ids=())
    ad = associated_data(object_key=key, model_identity=fingerprint, layout=layout, tier="fs")
    sealed = box.seal(chunk, ad)
    opened = box.open(sealed, ad)                                  # bytes, or an OpenFailure (a counted miss)
"""

from __future__ import annotations

from kvtriton.encryption._associated_data import associated_data
from kvtriton.encryption._hkdf import hkdf, hkdf_expand, hkdf_extract
from kvtriton.encryption._master_key import (
    KEY_FORMAT,
    MAKE_KEY_COMMAND,
    MASTER_KEY_BYTES,
    MasterKey,
    MasterKeyError,
    check_key_id,
)
from kvtriton.encryption._sealed_box import (
    CRYPTOGRAPHY_REQUIREMENT,
    FORMAT_VERSION,
    HEADER_BYTES,
    MISSING_CRYPTOGRAPHY,
    OVERHEAD_BYTES,
    TAG_BYTES,
    OpenFailure,
    SealedBox,
    require_cryptography,
    sealed_length,
)
from kvtriton.encryption._tenant_keys import TenantKey, TenantKeys, is_shared_tenant

__all__ = [
    "CRYPTOGRAPHY_REQUIREMENT",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "KEY_FORMAT",
    "MAKE_KEY_COMMAND",
    "MASTER_KEY_BYTES",
    "MISSING_CRYPTOGRAPHY",
    "MasterKey",
    "MasterKeyError",
    "OVERHEAD_BYTES",
    "OpenFailure",
    "SealedBox",
    "TAG_BYTES",
    "TenantKey",
    "TenantKeys",
    "associated_data",
    "check_key_id",
    "hkdf",
    "hkdf_expand",
    "hkdf_extract",
    "is_shared_tenant",
    "require_cryptography",
    "sealed_length",
]
