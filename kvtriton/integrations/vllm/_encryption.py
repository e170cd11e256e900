"""``kvtriton_encryption``: every chunk a tier stores is sealed with its tenant's key first (docs/security.md).

The setting (tiered spec only; the single-tier spec hands no chunk to any
tier) names the master key and, after a rotation, the key ids of the master
keys retired::

    "kvtriton_encryption": {"master_key_file": "/etc/kvtriton/master.key", "retired_key_ids": ["0f1e..."]}
    "kvtriton_encryption": {"master_key_env": "KVTRITON_MASTER_KEY"}

:class:`EncryptionSetting` parses it (a bad key or value is one line naming
it); :class:`TierEncryption`, built once per spec in the engine core, loads
the key (a file anyone but the server's user may read is refused, naming its
mode) and gives a tier the :class:`~kvtriton.encryption.SealedBox` of a job's
tenant, the request's ``cache_salt``. vLLM's ``ReqContext`` does not carry
the salt: the spec installs :func:`~kvtriton.integrations.vllm._surface.install_tenant_hook`,
which records it on every context vLLM's connector builds
(:class:`~kvtriton.integrations.vllm._surface.RequestTenant`), and each job a
tier gets names its request's context.

Which tiers store ciphertext: those that move a chunk through memory of their
own (kvtriton's remote-tier base: Mooncake, the in-memory store, a backend of
your own), which set :data:`ENCRYPTING_TIER_ATTRIBUTE` and seal each value
themselves; and vLLM's ``fs`` tier, which kvtriton builds over an egress area
instead of the primary's memory and hands only sealed chunks
(:mod:`kvtriton.integrations.vllm._egress`, :func:`is_egress_tier`). vLLM's
``obj`` and ``p2p`` tiers, and any other, are refused at start-up
(:func:`refuse_plaintext_tiers`): ``p2p`` serves a peer's read straight from
the primary's memory, and ``obj`` moves it through NIXL registrations that
kvtriton has not tested over an egress area.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from kvtriton.encryption import (
    MAKE_KEY_COMMAND,
    MasterKey,
    SealedBox,
    TenantKeys,
    check_key_id,
    is_shared_tenant,
    require_cryptography,
)
from kvtriton.integrations.vllm._config import KVTRITON_ENCRYPTION
from kvtriton.integrations.vllm._surface import FileSystemTierManager, OffloadingSpec, RequestTenant

logger = logging.getLogger(__name__)

ENCRYPTING_TIER_ATTRIBUTE = "kvtriton_seals_per_tenant"
"""A secondary tier class that sets this class attribute true seals every chunk it stores with the job's tenant's
key (:class:`TierEncryption`) and opens every chunk it loads: the only tiers an encrypting spec accepts."""

_SETTING_KEYS = ("master_key_file", "master_key_env", "retired_key_ids")

CACHED_BOXES = 1024
"""Sealed boxes kept per spec (least recently used dropped first), one per tenant and model identity."""


def _where(key: str | None = None) -> str:
    setting = f"kv_connector_extra_config[{KVTRITON_ENCRYPTION!r}]"
    return setting if key is None else f"{setting}[{key!r}]"


@dataclass(frozen=True, slots=True)
class EncryptionSetting:
    """``kvtriton_encryption`` parsed: where the master key is, and the key ids retired."""

    master_key_file: str | None = None
    master_key_env: str | None = None
    retired_key_ids: tuple[str, ...] = ()

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, object]) -> EncryptionSetting | None:
        """The setting in ``extra_config``, or None when encryption is off (the key absent or null); ``ValueError``
        naming the bad key and value otherwise."""
        raw = extra_config.get(KVTRITON_ENCRYPTION)
        if raw is None:
            return None
        example = '{"master_key_file": "/path/to/master.key"} or {"master_key_env": "VARIABLE"}'
        if not isinstance(raw, Mapping):
            raise ValueError(f"{_where()} must be an object such as {example}, got {type(raw).__name__} {raw!r}")
        setting = cast("Mapping[str, object]", raw)
        unknown = sorted(str(key) for key in setting if key not in _SETTING_KEYS)
        if unknown:
            raise ValueError(f"{_where()} has unknown key(s) {unknown}; it takes {list(_SETTING_KEYS)}")
        sources = [key for key in ("master_key_file", "master_key_env") if setting.get(key) is not None]
        if len(sources) != 1:
            raise ValueError(
                f"{_where()} must name the master key in exactly one of 'master_key_file' and 'master_key_env', "
                f"got {sources or 'neither'}; for example {example}"
            )
        source = sources[0]
        value = setting[source]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{_where(source)} must be a non-empty string, got {type(value).__name__} {value!r}")
        retired_raw = setting.get("retired_key_ids", [])
        if not isinstance(retired_raw, list):
            raise ValueError(
                f"{_where('retired_key_ids')} must be a list of key ids (16 hex digits each), got "
                f"{type(retired_raw).__name__} {retired_raw!r}"
            )
        retired = tuple(
            check_key_id(key_id, where=f"{_where('retired_key_ids')}[{index}]")
            for index, key_id in enumerate(cast("list[object]", retired_raw))
        )
        if source == "master_key_file":
            return cls(master_key_file=value, retired_key_ids=retired)
        return cls(master_key_env=value.strip(), retired_key_ids=retired)

    def load_master_key(self) -> MasterKey:
        """The master key, from its file (refused unless the server's user's alone) or its environment variable."""
        if self.master_key_file is not None:
            return MasterKey.from_file(self.master_key_file)
        if self.master_key_env is None:  # from_extra_config sets exactly one
            raise ValueError(f"{_where()} names no master key; make one with: {MAKE_KEY_COMMAND}")
        return MasterKey.from_environment(self.master_key_env, where=_where("master_key_env"))


class TierEncryption:
    """The keys of one encrypting spec: each job's :class:`~kvtriton.encryption.SealedBox`, by tenant; thread-safe.

    Built in the engine core from :class:`EncryptionSetting`; needs
    ``cryptography`` (refused here, at start-up, when it is missing). A tier
    finds it on the spec it is built with (:func:`spec_encryption`).
    """

    def __init__(self, master_key: MasterKey, retired_key_ids: Sequence[str] = ()) -> None:
        require_cryptography()
        self.key_id: str = master_key.key_id
        """The current master key's id: every chunk sealed now carries it."""
        self.key_source: str = master_key.source
        """Where the master key came from, for the start-up line (never the key)."""
        self.retired_key_ids: tuple[str, ...] = tuple(retired_key_ids)
        if self.key_id in self.retired_key_ids:
            raise ValueError(
                f"{_where('retired_key_ids')} lists {self.key_id}, the id of the current master key "
                f"({self.key_source}): a key cannot be current and retired at once; list only the ids of keys "
                "rotated out"
            )
        self._tenant_keys = TenantKeys(master_key)
        self._boxes: OrderedDict[tuple[str | None, bytes], SealedBox] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_setting(cls, setting: EncryptionSetting) -> TierEncryption:
        return cls(setting.load_master_key(), setting.retired_key_ids)

    def box(self, tenant: RequestTenant, model_identity: bytes) -> SealedBox:
        """The box that seals and opens ``tenant``'s chunks of ``model_identity`` (a tier's identity fingerprint)."""
        salt = None if is_shared_tenant(tenant.cache_salt) else tenant.cache_salt
        cache_key = (salt, model_identity)
        with self._lock:
            found = self._boxes.get(cache_key)
            if found is not None:
                self._boxes.move_to_end(cache_key)
                return found
        made = SealedBox(self._tenant_keys.key_for(salt, model_identity), retired_key_ids=self.retired_key_ids)
        with self._lock:
            self._boxes[cache_key] = made
            while len(self._boxes) > CACHED_BOXES:
                self._boxes.popitem(last=False)
        return made

    def describe(self) -> str:
        """The start-up line's words: on, which key id is current, where it came from, which ids are retired."""
        retired = ", ".join(self.retired_key_ids) if self.retired_key_ids else "none"
        return (
            f"encryption on (AES-256-GCM per tenant): current master key id {self.key_id} ({self.key_source}); "
            f"retired key ids: {retired}"
        )

    def __repr__(self) -> str:
        return f"TierEncryption(key_id={self.key_id!r}, retired_key_ids={list(self.retired_key_ids)!r})"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("TierEncryption is never pickled: each process loads the master key itself")


def spec_encryption(spec: OffloadingSpec) -> TierEncryption | None:
    """The encryption of the spec a tier is built with (kvtriton's tiered spec, when ``kvtriton_encryption`` is set),
    or None: the tier stores plaintext, as behind vLLM's own spec."""
    found: object = getattr(spec, "encryption", None)
    return found if isinstance(found, TierEncryption) else None


def is_egress_tier(tier_class: type) -> bool:
    """Whether an encrypting spec builds ``tier_class`` over its egress area and hands it only sealed chunks: vLLM's
    fs tier (exactly: a subclass may move the bytes otherwise)."""
    return tier_class is FileSystemTierManager


def refuse_plaintext_tiers(tier_classes: Sequence[tuple[str, type]]) -> None:
    """Refuse, at start-up, every secondary tier that would store chunks unsealed under ``kvtriton_encryption``.

    ``tier_classes``: each tier's label (``secondary_tiers[0] (type 'obj')``) and class. A tier is accepted
    when its class sets :data:`ENCRYPTING_TIER_ATTRIBUTE` or :func:`is_egress_tier` holds.
    """
    for label, tier_class in tier_classes:
        if getattr(tier_class, ENCRYPTING_TIER_ATTRIBUTE, False) is True or is_egress_tier(tier_class):
            continue
        raise ValueError(
            f"{_where()} is set, but {label} ({tier_class.__qualname__}) reads each chunk straight "
            "from host memory and stores it as it is, in the clear; kvtriton hands ciphertext only to vLLM's fs "
            "tier (type 'fs', through its egress area) and to the tiers built on its remote-tier base "
            "(MooncakeStoreTier in kvtriton.integrations.mooncake, or a backend of "
            "kvtriton.integrations.remote.RemoteTier): use one of them, or remove kvtriton_encryption"
        )
