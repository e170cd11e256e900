"""The kvtriton settings read from vLLM's ``kv_connector_extra_config``.

vLLM hands the OffloadingConnector's ``kv_connector_extra_config`` to the spec
as an untyped mapping (it comes from JSON on the command line). It is parsed
once, here, into a frozen :class:`KVTritonOffloadConfig`; a missing or invalid
value raises ``ValueError`` naming the key and the value before anything is
allocated. This module does not import vLLM, so it is testable without it.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtriton._choices import ChoiceT, parse_choice
from kvtriton._int_argument import check_int
from kvtriton._private_files import PRIVATE, FileSharing
from kvtriton.integrations.vllm._identity import IDENTITY_KEY
from kvtriton.kernels import (
    ALIGNMENT,
    COMPRESSIBLE_DTYPES,
    DEFAULT_GROUP_SIZE,
    DEFAULT_NUM_PROGRAMS,
    KVCompression,
    compression_layout,
)
from kvtriton.manager.policies import policy_names
from kvtriton.worker import TransferBackend

logger = logging.getLogger(__name__)

CPU_BYTES_TO_USE = "cpu_bytes_to_use"
EVICTION_POLICY = "eviction_policy"
CACHE_POLICY_MODULE_PATH = "cache_policy_module_path"
STORE_THRESHOLD = "store_threshold"
MAX_TRACKER_SIZE = "max_tracker_size"
KVTRITON_BACKEND = "kvtriton_backend"
KVTRITON_NUM_PROGRAMS = "kvtriton_num_programs"
KVTRITON_PAGEABLE_SLAB = "kvtriton_pageable_slab"
KVTRITON_KV_COMPRESSION = "kvtriton_kv_compression"
KVTRITON_SUMMARY_INTERVAL_S = "kvtriton_summary_interval_s"
KVTRITON_VERIFY_HOST_LOADS = "kvtriton_verify_host_loads"
KVTRITON_SHARED_GROUP = "kvtriton_shared_group"
KVTRITON_ENCRYPTION = "kvtriton_encryption"
DEFAULT_SUMMARY_INTERVAL_S = 60
"""Seconds of activity between two ``kvtriton summary:`` log lines (the adapter's own default too)."""

_KVTRITON_KEYS = frozenset(
    {
        KVTRITON_BACKEND,
        KVTRITON_NUM_PROGRAMS,
        KVTRITON_PAGEABLE_SLAB,
        KVTRITON_KV_COMPRESSION,
        KVTRITON_SUMMARY_INTERVAL_S,
        KVTRITON_VERIFY_HOST_LOADS,
        KVTRITON_SHARED_GROUP,
        KVTRITON_ENCRYPTION,
        IDENTITY_KEY,
    }
)

_KVTRITON_TIERED_ONLY_KEYS = frozenset({IDENTITY_KEY, KVTRITON_SHARED_GROUP, KVTRITON_ENCRYPTION})
"""kvtriton's keys that only the tiered spec reads: the single-tier spec hands no chunk to any tier."""

_KVTRITON_SINGLE_TIER_ONLY_KEYS = frozenset({KVTRITON_VERIFY_HOST_LOADS})
"""kvtriton's keys that only the single-tier spec reads: in the tiered spec the tiers write host chunks from the
scheduler, unseen by the worker that would check them (their chunks are verified as they come back instead)."""

COMPRESSION_GROUP_SIZE = DEFAULT_GROUP_SIZE
"""Elements per fp8 scale in vLLM's rows: vLLM hands the worker flat byte pages, so the head dimension is unknown."""

TIERED_ONLY_KEYS = frozenset({"secondary_tiers", "tier_poll_interval_s", "backpressure", "enable_telemetry"})
"""vLLM's keys that only the tiered spec reads (``KVTritonTieringOffloadingSpec``, vLLM's ``TieringOffloadingSpec``;
``enable_telemetry`` is the kvcr tier's switch, read from the top level)."""

VLLM_KEYS = frozenset(
    {
        # the connector and its spec factory
        "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
        "sync_load_budget_bytes", "offload_prompt_only", "self_describing_kv_events",
        # vLLM's CPU spec, which kvtriton's specs take over
        CPU_BYTES_TO_USE, EVICTION_POLICY, CACHE_POLICY_MODULE_PATH, STORE_THRESHOLD, MAX_TRACKER_SIZE,
    }
) | TIERED_ONLY_KEYS  # fmt: skip  # a table: the keys grouped by what reads them
"""Every ``kv_connector_extra_config`` key vLLM 0.33's OffloadingConnector, spec factory and specs read.

Read from vLLM 0.33's ``offloading_connector.py``, ``offloading/`` (its config
builder, scheduler and events) and ``v1/kv_offload/`` (the spec factory, the
CPU and tiering specs and kvcr's telemetry switch); ``cpu_bytes_to_use`` is
also the key vLLM itself writes for ``--kv-offloading-size``. MultiConnector's
``connectors`` is not among them: it sits in MultiConnector's own extra config,
and each child connector (this one) gets only its own ``kv_connector_extra_config``.
"""

VLLM_INT_KEYS: dict[str, tuple[int, str]] = {
    "blocks_per_chunk": (1, ""),
    "block_size": (1, "tokens"),
    "sync_load_budget_bytes": (0, "bytes"),
}
"""vLLM's integer keys with their minimum and unit, checked by kvtriton's rule (:func:`_parse_int`) when the spec is
built: vLLM reads them with ``int()``, which truncates ``2.5`` to 2 and takes ``true`` for 1 without a word (and a
word such as ``"x"`` in ``blocks_per_chunk`` or ``block_size`` fails in vLLM's own ``int()``, before any spec is
loaded). ``null`` in ``blocks_per_chunk`` or ``block_size`` means "not given" to vLLM, and so here."""

VLLM_BOOL_KEYS = frozenset({"canonical_layout", "offload_prompt_only", "self_describing_kv_events", "enable_telemetry"})
"""vLLM's switches: read with ``bool()``, so any non-empty string, ``"false"`` included, turns one on; only JSON
``true`` and ``false`` mean what they say."""

_MISTAKEN_KEYS = {
    "cache_policy": (
        EVICTION_POLICY,
        "'cache_policy' is the manager's argument; the configuration key is 'eviction_policy'",
    ),
}
"""Keys written for another one (with why), answered before the closest spelling: ``cache_policy`` looks most like
``cache_policy_module_path``, which would take the policy's name as a module path."""

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _integral(raw: object, *, round_down: bool) -> int | None:
    """``raw`` as an int if it is one as typed: an int, an integral float or string; None for anything else.

    JSON gives ints, but a shell user may write ``"68719476736"`` or
    ``6.8719476736e10``. Bools and words are never counts, and a fraction
    is refused unless ``round_down`` (a size in bytes, which vLLM itself
    rounds down: its ``--kv-offloading-size 2.3`` arrives as ``2.3 * 2**30``).
    """
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and math.isfinite(raw) and (raw.is_integer() or round_down):
        return math.floor(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            return None
    return None


def _parse_int(
    extra_config: Mapping[str, object], key: str, default: int | None, minimum: int, *, unit: str = ""
) -> int:
    """Read ``key`` as an integer >= ``minimum`` (:func:`_integral`; a size in ``unit`` "bytes" rounds down).

    The bound is checked by the project's one int check (:func:`~kvtriton._int_argument.check_int`); the
    message names the key, the value as written and the type expected.
    """
    suffix = f" {unit}" if unit else ""
    if key not in extra_config:
        if default is None:
            raise ValueError(f"{_where(key)} is required (an integer >= {minimum}{suffix}) but is missing")
        return default
    raw = extra_config[key]
    value = _integral(raw, round_down=unit == "bytes")
    if value is None:
        raise ValueError(f"{_where(key)} must be an integer >= {minimum}{suffix}, got {type(raw).__name__} {raw!r}")
    return check_int(_where(key), value, minimum, unit=unit)


def _parse_bool(extra_config: Mapping[str, object], key: str, default: bool) -> bool:
    """Read ``key`` as a boolean: JSON ``true``/``false``, or a word a shell user may write ("yes", "0", ...)."""
    if key not in extra_config:
        return default
    raw = extra_config[key]
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise ValueError(f"{_where(key)} must be true or false, got {type(raw).__name__} {raw!r}")


def check_vllm_values(extra_config: Mapping[str, object]) -> None:
    """Refuse a value of one of vLLM's typed keys that vLLM would misread (:data:`VLLM_INT_KEYS`,
    :data:`VLLM_BOOL_KEYS`), naming the key, the value and the type expected."""
    for key, (minimum, unit) in VLLM_INT_KEYS.items():
        if extra_config.get(key) is not None or key == "sync_load_budget_bytes":
            _parse_int(extra_config, key, minimum, minimum, unit=unit)
    for key in sorted(VLLM_BOOL_KEYS):
        raw = extra_config.get(key, False)
        if not isinstance(raw, bool):
            raise ValueError(
                f"{_where(key)} must be true or false (a JSON boolean: vLLM reads it with bool(), so any non-empty "
                f"string, 'false' included, is true), got {type(raw).__name__} {raw!r}"
            )


def _parse_str(extra_config: Mapping[str, object], key: str, default: str) -> str:
    raw = extra_config.get(key, default)
    if not isinstance(raw, str):
        raise ValueError(f"{_where(key)} must be a string, got {type(raw).__name__} {raw!r}")
    return raw.strip().lower()


def _parse_choice(extra_config: Mapping[str, object], key: str, default: ChoiceT) -> ChoiceT:
    """Read ``key`` as a member of ``default``'s enum, by its value in any case; the error lists the valid ones."""
    choices = type(default)
    name = _parse_str(extra_config, key, default.value)
    try:
        return parse_choice(choices, name, _where(key))
    except ValueError:
        valid = [member.value for member in choices]
        raise ValueError(f"{_where(key)} must be one of {valid}, got {extra_config[key]!r}") from None


@dataclass(frozen=True, slots=True)
class KVTritonOffloadConfig:
    """kvtriton's settings for one vLLM engine, parsed from ``kv_connector_extra_config``.

    ``cpu_bytes_to_use`` is the host-memory budget summed over all ranks of the
    engine, as vLLM defines it; each rank gets ``1/world_size`` of it.
    ``store_threshold < 2`` stores every block; ``>= 2`` stores a block only
    once it was offered for storing that many times (vLLM 0.33's reuse filter).
    ``pageable_slab`` lets a CUDA worker run with a pageable host slab when
    it cannot be pinned; by default it refuses to start instead (a pageable
    slab copies through the CPU, several times slower).
    ``summary_interval_s`` is how many seconds of activity pass between two
    ``kvtriton summary:`` log lines (hits, blocks and bytes in and out,
    evictions); 0 turns them off.
    ``verify_host_loads`` (a debug mode, single-tier spec only) has the
    worker refuse a load whose host slots changed since their store finished,
    which stops the engine (:mod:`kvtriton.worker._slot_digests`).
    ``file_sharing`` (``kvtriton_shared_group``, tiered spec only) says who
    besides the server's user may read the files the tiers write
    (:mod:`kvtriton._private_files`).
    """

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    backend: TransferBackend = TransferBackend.AUTO
    num_programs: int = DEFAULT_NUM_PROGRAMS
    pageable_slab: bool = False
    kv_compression: KVCompression = KVCompression.NONE
    summary_interval_s: int = DEFAULT_SUMMARY_INTERVAL_S
    verify_host_loads: bool = False
    file_sharing: FileSharing = PRIVATE

    @property
    def filters_reuse(self) -> bool:
        """Whether the reuse filter wraps the manager (``store_threshold >= 2``)."""
        return self.store_threshold >= 2

    @property
    def uses_vllm_policy(self) -> bool:
        """Whether vLLM's own manager runs the eviction policy (see :func:`is_vllm_policy`)."""
        return is_vllm_policy(self.eviction_policy, self.cache_policy_module_path)

    def per_rank_bytes(self, world_size: int) -> int:
        """This rank's share of ``cpu_bytes_to_use``."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return self.cpu_bytes_to_use // world_size

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, object]) -> KVTritonOffloadConfig:
        """Parse vLLM's ``kv_connector_extra_config``; raises ``ValueError`` naming the bad key and value.

        Keys are only parsed here; an unknown key is :func:`check_keys`'s to
        refuse, the policy is :func:`parse_policy`'s. vLLM's own typed keys
        are checked here too (:func:`check_vllm_values`), though only vLLM reads them.
        """
        check_vllm_values(extra_config)
        policy, module_path = parse_policy(extra_config)
        if is_vllm_policy(policy, module_path):
            check_vllm_policy(policy, module_path)
        backend = _parse_choice(extra_config, KVTRITON_BACKEND, TransferBackend.AUTO)
        kv_compression = _parse_choice(extra_config, KVTRITON_KV_COMPRESSION, KVCompression.NONE)
        if kv_compression is not KVCompression.NONE and backend is TransferBackend.DMA:
            raise ValueError(
                f"{_where(KVTRITON_KV_COMPRESSION)}={kv_compression.value!r} needs a kernel that compresses, but "
                f"{_where(KVTRITON_BACKEND)}='dma' copies bytes unchanged; use 'auto', 'triton' or 'torch'"
            )
        return cls(
            cpu_bytes_to_use=_parse_int(extra_config, CPU_BYTES_TO_USE, None, 1, unit="bytes"),
            eviction_policy=policy,
            cache_policy_module_path=module_path,
            # vLLM's default is 0 ("store everything"); 1 means the same.
            store_threshold=_parse_int(extra_config, STORE_THRESHOLD, 0, 0),
            max_tracker_size=_parse_int(extra_config, MAX_TRACKER_SIZE, 64_000, 1),
            backend=backend,
            num_programs=_parse_int(extra_config, KVTRITON_NUM_PROGRAMS, DEFAULT_NUM_PROGRAMS, 1),
            pageable_slab=_parse_bool(extra_config, KVTRITON_PAGEABLE_SLAB, False),
            kv_compression=kv_compression,
            summary_interval_s=_parse_int(
                extra_config, KVTRITON_SUMMARY_INTERVAL_S, DEFAULT_SUMMARY_INTERVAL_S, 0, unit="seconds"
            ),
            verify_host_loads=_parse_bool(extra_config, KVTRITON_VERIFY_HOST_LOADS, False),
            file_sharing=FileSharing.from_setting(
                extra_config.get(KVTRITON_SHARED_GROUP), where=_where(KVTRITON_SHARED_GROUP)
            ),
        )


def declares_reuse_filter(extra_config: Mapping[str, object]) -> bool:
    """Whether ``extra_config`` sets ``store_threshold >= 2`` (the reuse filter runs); False for an unreadable value.

    For the metric declarations, which vLLM asks for before any spec is
    built: the spec's own parse (:meth:`KVTritonOffloadConfig.from_extra_config`)
    refuses the unreadable value, naming it.
    """
    try:
        return _parse_int(extra_config, STORE_THRESHOLD, 0, 0) >= 2
    except ValueError:
        return False


def is_vllm_policy(eviction_policy: str, cache_policy_module_path: str | None) -> bool:
    """Whether vLLM's own manager runs this policy: one kvtriton does not implement, or one loaded by
    ``cache_policy_module_path`` (vLLM's ``CachePolicyFactory`` resolves both; kvtriton's worker moves the bytes)."""
    return cache_policy_module_path is not None or eviction_policy not in policy_names()


def check_vllm_policy(eviction_policy: str, cache_policy_module_path: str | None) -> str | None:
    """Refuse a policy kvtriton leaves to vLLM that vLLM would not load as configured; the class it loads.

    Returns the dotted name of the class vLLM's ``CachePolicyFactory``
    resolves (what the start-up log names), or None when vLLM is not
    installed (then no spec is built anyway; vLLM is imported here, lazily,
    so the module stays importable without it). Without
    ``cache_policy_module_path`` the name must be one vLLM registered. With it,
    the module must import and define ``eviction_policy`` as a vLLM
    ``CachePolicy`` class, and the name must not be a registered one: vLLM
    resolves a registered name first and never imports the module, so a
    mistyped or misplaced module path would silently run a built-in policy.
    The class must implement every abstract method of the installed vLLM's
    ``CachePolicy``: ``touch`` on vLLM 0.33, ``on_request_finished`` on 0.34
    (:data:`~kvtriton.integrations.vllm._surface.POLICY_MUST_FINISH_REQUESTS`),
    so a policy written for the other release is refused here, not when
    vLLM first builds it.
    """
    try:
        from kvtriton.integrations.vllm._surface import (
            POLICY_MUST_FINISH_REQUESTS,
            VLLM_VERSION,
            CachePolicy,
            CachePolicyFactory,
            registered_cache_policies,
        )
    except ImportError:
        return None
    registered = registered_cache_policies()
    if cache_policy_module_path is None:
        if eviction_policy not in registered:
            raise ValueError(
                f"{_where(EVICTION_POLICY)} must be one of {policy_names()}, got {eviction_policy!r}: "
                f"neither kvtriton's policies nor vLLM's CachePolicyFactory (registered: {registered}) resolve it; "
                f"for a policy class of your own, name its module in {_where(CACHE_POLICY_MODULE_PATH)}"
            )
        return _class_name(CachePolicyFactory.get_cache_policy_cls(eviction_policy))
    module_key = f"{_where(CACHE_POLICY_MODULE_PATH)}={cache_policy_module_path!r}"
    try:
        module = importlib.import_module(cache_policy_module_path)
    except Exception as error:
        raise ValueError(
            f"{module_key} cannot be imported ({type(error).__name__}: {error}); it names the Python module that "
            f"defines the policy class {_where(EVICTION_POLICY)} names. kvtriton's own policies {policy_names()} "
            f"need no module path: remove the key"
        ) from error
    if eviction_policy in registered:
        raise ValueError(
            f"{_where(EVICTION_POLICY)}={eviction_policy!r} is a policy vLLM's CachePolicyFactory has registered, "
            f"which vLLM loads without ever reading {module_key}: remove {_where(CACHE_POLICY_MODULE_PATH)}, or set "
            f"{_where(EVICTION_POLICY)} to the name of the policy class that module defines"
        )
    found: object = getattr(module, eviction_policy, None)
    if not (isinstance(found, type) and issubclass(found, CachePolicy)):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, CachePolicy) and value is not CachePolicy
        )
        raise ValueError(
            f"{_where(EVICTION_POLICY)}={eviction_policy!r} is not a vLLM CachePolicy class of module "
            f"{cache_policy_module_path!r} ({module_key}); the CachePolicy classes it defines: {defined}"
        )
    abstract: frozenset[str] = getattr(found, "__abstractmethods__", frozenset())
    unimplemented = sorted(abstract)
    if unimplemented:
        # Else Python refuses it only when the scheduler builds its manager, naming no key and no release.
        why = (
            "; vLLM 0.34 calls on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context) "
            "when a request finishes (its keys' recency) and no longer calls touch"
            if POLICY_MUST_FINISH_REQUESTS and "on_request_finished" in unimplemented
            else ""
        )
        raise ValueError(
            f"{_where(EVICTION_POLICY)}={eviction_policy!r}: {_class_name(found)} ({module_key}) does not implement "
            f"{', '.join(unimplemented)}, which vLLM {VLLM_VERSION}'s CachePolicy requires{why}: implement "
            f"{'it' if len(unimplemented) == 1 else 'them'}, or use one of kvtriton's policies {policy_names()}"
        )
    return _class_name(found)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def parse_policy(extra_config: Mapping[str, object]) -> tuple[str, str | None]:
    """``eviction_policy`` and ``cache_policy_module_path``, checked for type.

    kvtriton's own names (``lru``, ``arc``) in any case come back lower-cased;
    any other name is kept as written, for vLLM's ``CachePolicyFactory`` (the
    spec checks that it resolves), and so is every name that comes with a
    ``cache_policy_module_path``: it names a class in that module.
    """
    module_path = extra_config.get(CACHE_POLICY_MODULE_PATH)
    if module_path is not None and (not isinstance(module_path, str) or not module_path.strip()):
        raise ValueError(
            f"{_where(CACHE_POLICY_MODULE_PATH)} must be a Python module path, got "
            f"{type(module_path).__name__} {module_path!r}"
        )
    module_path = module_path.strip() if module_path is not None else None
    policy = _parse_str(extra_config, EVICTION_POLICY, "lru")
    if module_path is not None or policy not in policy_names():
        policy = str(extra_config.get(EVICTION_POLICY, "lru")).strip()
        if not policy:
            raise ValueError(f"{_where(EVICTION_POLICY)} must name a policy, got {extra_config[EVICTION_POLICY]!r}")
    return policy, module_path


def check_keys(extra_config: Mapping[str, object], *, tiered: bool) -> list[str]:
    """Refuse every ``kv_connector_extra_config`` key neither vLLM nor kvtriton reads; warn about the ones left unread.

    An unknown key is almost certainly a mistake (``eviction_polcy``, or
    ``cache_policy`` for ``eviction_policy``) that would leave a default in
    force, so the spec stops with one ``ValueError`` naming each such key
    and the closest valid one. Every key vLLM reads or passes through
    (:data:`VLLM_KEYS`) is accepted; vLLM's tiered-only keys
    (``secondary_tiers``, ...) in the single-tier spec are only warned
    about: they are vLLM's, and do nothing there; so is ``kvtriton_identity_key``,
    which names the chunks handed to a tier, and the single-tier spec has none;
    and so is ``kvtriton_verify_host_loads`` in the tiered spec.
    Returns the keys warned about.
    """
    known = VLLM_KEYS | _KVTRITON_KEYS
    unknown = [key for key in extra_config if key not in known]
    if unknown:
        named = "; ".join(f"{key!r} ({_closest_key(key, known)})" for key in unknown)
        # The valid keys are in the message itself: a wheel install has no docs/ to look them up in.
        raise ValueError(
            f"kv_connector_extra_config has {'a key' if len(unknown) == 1 else 'keys'} neither kvtriton nor vLLM "
            f"reads: {named}; kvtriton reads {sorted(_KVTRITON_KEYS)}, vLLM reads {sorted(VLLM_KEYS)}"
        )
    unread = _KVTRITON_SINGLE_TIER_ONLY_KEYS if tiered else TIERED_ONLY_KEYS | _KVTRITON_TIERED_ONLY_KEYS
    reader = "KVTritonOffloadingSpec" if tiered else "KVTritonTieringOffloadingSpec"
    ignored = [key for key in extra_config if key in unread]
    for key in ignored:
        logger.warning(
            "ignoring %s: only the %s spec (spec_name %s) reads it",
            _where(key),
            "single-tier" if tiered else "tiered",
            reader,
        )
    return ignored


def _closest_key(key: str, known: frozenset[str]) -> str:
    """The hint for an unknown key: a known confusion, kvtriton's prefix forgotten, or the closest spelling."""
    if key in _MISTAKEN_KEYS:
        meant, why = _MISTAKEN_KEYS[key]
        return f"did you mean {meant!r}? {why}"
    if f"kvtriton_{key}" in known:
        return f"did you mean 'kvtriton_{key}'?"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "no known key is close"


def host_ram_bytes() -> int | None:
    """This host's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_budget(cpu_bytes_to_use: int, *, slot_bytes: int, world_size: int, slot: str = "slot") -> None:
    """Refuse, when the spec is built, a ``cpu_bytes_to_use`` that holds no slot or exceeds this host's RAM.

    The value is in bytes (on kvtriton's command line a bare number is GiB,
    in every JSON key it is bytes), so the message says so: ``64`` reads as
    "64 bytes", not as 64 GiB. ``slot`` names the unit of storage ("slot",
    "chunk"). A rank's share larger than the host's physical memory can never
    be allocated and is refused here rather than later in the worker; a total
    larger than the host's RAM only warns (the ranks may sit on several hosts).
    """
    where = _where(CPU_BYTES_TO_USE)
    per_rank = cpu_bytes_to_use // world_size
    if per_rank < slot_bytes:
        over = f" ({per_rank} bytes per rank over world_size={world_size})" if world_size > 1 else ""
        raise ValueError(
            f"{where}={cpu_bytes_to_use}: {cpu_bytes_to_use} bytes{over} is less than one {slot} of {slot_bytes} "
            f"bytes; the value is in bytes (vLLM's --kv-offloading-size is in GiB: 8 GiB is {8 << 30})"
        )
    ram = host_ram_bytes()
    if ram is None:
        return
    if per_rank > ram:
        raise ValueError(
            f"{where}={cpu_bytes_to_use}: {per_rank} bytes per rank exceed this host's {ram} bytes of RAM "
            f"({ram / 2**30:.1f} GiB); the value is the host memory of all ranks together, in bytes"
        )
    if cpu_bytes_to_use > ram:
        logger.warning(
            "%s=%d exceeds this host's %d bytes of RAM: it only fits if the %d ranks are spread over several hosts",
            where,
            cpu_bytes_to_use,
            ram,
            world_size,
        )


def check_kv_geometry_known(*, canonical_layout: bool, worker_kv_bytes_per_block: int, host_memory: str) -> None:
    """Refuse, before anything is allocated, what vLLM's ``OffloadingConfig`` asks that kvtriton cannot size.

    Both kvtriton specs store each rank's own KV bytes per block, so they need
    vLLM's per-rank bytes per block and cannot serve the canonical
    (parallelism-free) host layout. ``host_memory`` names what would have been
    sized ("the host slab", "the shared host region").
    """
    if canonical_layout:
        raise ValueError(
            "kvtriton stores each rank's own KV bytes; the canonical (parallelism-free) host layout requested "
            "in kv_connector_extra_config is not supported, remove that setting"
        )
    if worker_kv_bytes_per_block < 1:
        raise ValueError(
            f"vLLM reported worker_kv_bytes_per_block={worker_kv_bytes_per_block}: "
            f"the KV cache is not known yet, so {host_memory} cannot be sized"
        )


def compression_tag(kv_compression: KVCompression) -> str | None:
    """The compression and its scale group size as a namespace tag (``fp8-e4m3-g128``); None without compression.

    Compressed rows are other bytes than uncompressed ones (and rows with
    another group size other bytes again), so the secondary tiers file them
    under a namespace of their own.
    """
    if kv_compression is KVCompression.NONE:
        return None
    return f"{kv_compression.value}-g{COMPRESSION_GROUP_SIZE}"


def kv_dtype(dtype_name: str, kv_compression: KVCompression) -> torch.dtype | None:
    """The KV cache's element dtype from vLLM's ``OffloadingModelConfig.dtype``; None without compression.

    Compression needs it: vLLM hands the worker its pages as bytes. A KV
    cache that is not bf16, fp16 or fp32 (an fp8 cache: already one byte per
    element) is refused, naming the key: compression would only add scales.
    """
    if kv_compression is KVCompression.NONE:
        return None
    found = getattr(torch, dtype_name.strip().removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or found not in COMPRESSIBLE_DTYPES:
        valid = [str(dtype).removeprefix("torch.") for dtype in COMPRESSIBLE_DTYPES]
        raise ValueError(
            f"{_where(KVTRITON_KV_COMPRESSION)}={kv_compression.value!r} compresses a KV cache of {valid}, but this "
            f"engine's KV cache dtype is {dtype_name!r}; remove the key (or set it to 'none')"
        )
    return found


def compressed_row_bytes(raw_row_bytes: int, dtype: torch.dtype, num_layers: int) -> int:
    """An upper bound, computed without the KV tensors, on a compressed row of ``raw_row_bytes`` of ``dtype``.

    The scheduler knows only the bytes per block and the layer names; the
    worker compresses each page tensor on its own (a layer has one or two),
    padding its codes and its scales to 16 bytes each, its last scale group
    possibly short. The bound is the row of one page tensor holding every
    element plus, for each of up to ``2 * num_layers`` page tensors, at most
    two paddings and one scale (under ``2 * ALIGNMENT`` bytes), so every
    rank's real row fits in it (a few dozen bytes per layer to spare).
    """
    elements = max(1, raw_row_bytes // dtype.itemsize)
    page = torch.empty((1, elements), dtype=dtype, device="meta")
    one_page = compression_layout([page], COMPRESSION_GROUP_SIZE).row_bytes
    page_tensors = 2 * max(1, num_layers)
    return one_page + page_tensors * 2 * ALIGNMENT


def host_row_bytes(
    worker_kv_bytes_per_block: int, dtype: torch.dtype | None, layer_names: Sequence[Sequence[str]]
) -> int:
    """Bytes of one host row for vLLM's ``worker_kv_bytes_per_block``: unchanged, or compressed when ``dtype`` is set.

    ``dtype`` is :func:`kv_dtype`'s answer (None: no compression);
    ``layer_names`` are those of every KV cache group (vLLM's
    ``OffloadingConfig.groups``), which bound the number of page tensors.
    Scheduler and workers compute it alike, so they agree on the slot count.
    """
    if dtype is None:
        return worker_kv_bytes_per_block
    return compressed_row_bytes(worker_kv_bytes_per_block, dtype, sum(len(names) for names in layer_names))
