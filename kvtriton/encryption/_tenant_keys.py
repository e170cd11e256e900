"""Each tenant's key, derived from the master key with HKDF-SHA256 and bound to the tenant and the model.

A tenant is a request's ``cache_salt``. ``None`` and ``""`` are the same
tenant, the shared one: vLLM mixes the salt into a block's hash only when it is
truthy (``vllm/v1/core/kv_cache_utils.py``: ``if ... request.cache_salt``), so
a request with ``""`` already shares blocks with one without a salt, and giving
the two different keys would only turn those shared blocks into misses.

The derivation (RFC 5869; :mod:`kvtriton.encryption._hkdf`)::

    prk        = HKDF-Extract(salt="kvtriton encryption: tenant keys", IKM=master key)
    tenant key = HKDF-Expand(prk, info, 32)
    info       = "kvtriton tenant key v1" || tenant || model
    tenant     = 0x00                                    the shared tenant
               | 0x01 || len32(salt) || UTF-8(salt)      a cache_salt
    model      = len32(identity) || identity             the model identity the caller fingerprints

``len32`` is a 4-byte big-endian length, so no two (tenant, model) pairs
encode to the same ``info``. Another salt, another model or another master key
gives an unrelated key; the same three give the same key in every process of
the fleet, which is what lets one server read what another sealed.

Derived keys are kept in a small LRU (:data:`CACHED_TENANT_KEYS`): a key costs
three HMAC-SHA256 calls, a chunk seal one AES-GCM pass, so the cache is for
the many small seals of one tenant, not a necessity.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvtriton.encryption._hkdf import hkdf_expand, hkdf_extract
from kvtriton.encryption._master_key import MasterKey

TENANT_KEY_BYTES = 32
"""AES-256."""

CACHED_TENANT_KEYS = 1024
"""Derived keys kept (least recently used dropped first): far more tenants than one server serves at once."""

_EXTRACT_SALT = b"kvtriton encryption: tenant keys"
_INFO_LABEL = b"kvtriton tenant key v1"
_SHARED_TENANT = b"\x00"
_SALTED_TENANT = b"\x01"


def _length_prefixed(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value


def is_shared_tenant(cache_salt: str | None) -> bool:
    """Whether ``cache_salt`` names the shared tenant: ``None`` or ``""`` (vLLM ignores both)."""
    return not cache_salt


def _identity_bytes(model_identity: bytes | str) -> bytes:
    if isinstance(model_identity, str):
        model_identity = model_identity.encode("utf-8")
    if not isinstance(model_identity, bytes):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        raise TypeError(f"model_identity must be bytes or str, got {type(model_identity).__name__}")
    if not model_identity:
        raise ValueError("model_identity must not be empty: it binds the key to one model (pass its fingerprint)")
    return model_identity


def derivation_info(cache_salt: str | None, model_identity: bytes | str) -> bytes:
    """HKDF's ``info`` for the key of tenant ``cache_salt`` and model ``model_identity`` (the layout in the module
    docstring)."""
    if cache_salt is not None and not isinstance(cache_salt, str):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    tenant = (
        _SHARED_TENANT
        if is_shared_tenant(cache_salt)
        else _SALTED_TENANT + _length_prefixed(str(cache_salt).encode("utf-8"))
    )
    return _INFO_LABEL + tenant + _length_prefixed(_identity_bytes(model_identity))


class TenantKey:
    """One tenant's AES-256 key for one model, and the :attr:`key_id` of the master key it came from.

    ``repr`` shows the key id and whether the tenant is the shared one, never the
    key or the salt (a ``cache_salt`` is a secret of its tenant too).
    """

    __slots__ = ("_secret", "key_id", "shared_tenant")

    def __init__(self, secret: bytes, *, key_id: str, shared_tenant: bool) -> None:
        if len(secret) != TENANT_KEY_BYTES:
            raise ValueError(f"a tenant key must be {TENANT_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self.key_id: str = key_id
        """The key id of the master key it is derived from: every box sealed with it carries this id."""
        self.shared_tenant: bool = shared_tenant
        """Whether it is the key of the shared tenant (no ``cache_salt``)."""

    @property
    def secret(self) -> bytes:
        """The key's bytes: only for the cipher (:class:`kvtriton.encryption.SealedBox`)."""
        return self._secret

    def __repr__(self) -> str:
        tenant = "shared" if self.shared_tenant else "salted"
        return f"TenantKey(key_id={self.key_id!r}, tenant={tenant!r})"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("a TenantKey is never pickled: derive it in the process that uses it (TenantKeys.key_for)")


class TenantKeys:
    """Derives (and caches) each tenant's key for a model from one master key; thread-safe."""

    __slots__ = ("_cache", "_lock", "_pseudorandom_key", "key_id")

    def __init__(self, master_key: MasterKey) -> None:
        self._pseudorandom_key = hkdf_extract(_EXTRACT_SALT, master_key.secret)
        self.key_id: str = master_key.key_id
        """The master key's id, carried by every key derived here."""
        self._cache: OrderedDict[tuple[str | None, bytes], TenantKey] = OrderedDict()
        self._lock = threading.Lock()

    def key_for(self, cache_salt: str | None, model_identity: bytes | str) -> TenantKey:
        """The key of tenant ``cache_salt`` (``None`` or ``""``: the shared tenant) for model ``model_identity``."""
        info = derivation_info(cache_salt, model_identity)
        cache_key = (None if is_shared_tenant(cache_salt) else cache_salt, _identity_bytes(model_identity))
        with self._lock:
            found = self._cache.get(cache_key)
            if found is not None:
                self._cache.move_to_end(cache_key)
                return found
        key = TenantKey(
            hkdf_expand(self._pseudorandom_key, info, TENANT_KEY_BYTES),
            key_id=self.key_id,
            shared_tenant=is_shared_tenant(cache_salt),
        )
        with self._lock:
            self._cache[cache_key] = key
            while len(self._cache) > CACHED_TENANT_KEYS:
                self._cache.popitem(last=False)
        return key

    def __repr__(self) -> str:
        return f"TenantKeys(key_id={self.key_id!r}, cached={len(self._cache)})"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("TenantKeys are never pickled: build them from the MasterKey in the process that uses them")
