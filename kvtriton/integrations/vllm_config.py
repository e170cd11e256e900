"""The kvtriton settings read from vLLM's ``kv_connector_extra_config``.

vLLM hands the OffloadingConnector's ``kv_connector_extra_config`` to the spec
as an untyped mapping (it comes from JSON on the command line). It is parsed
once, here, into a frozen :class:`KVTritonOffloadConfig`; a missing or invalid
value raises ``ValueError`` naming the key and the value before anything is
allocated. This module does not import vLLM, so it is testable without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvtriton.worker.backends import TransferBackend
from kvtriton.kernels import DEFAULT_NUM_PROGRAMS
from kvtriton.manager.policies import policy_names

__all__ = [
    "CPU_BYTES_TO_USE",
    "EVICTION_POLICY",
    "KVTRITON_BACKEND",
    "KVTRITON_NUM_PROGRAMS",
    "KVTRITON_PAGEABLE_SLAB",
    "KVTritonOffloadConfig",
    "MAX_TRACKER_SIZE",
    "STORE_THRESHOLD",
    "check_kv_geometry_known",
]

logger = logging.getLogger(__name__)

CPU_BYTES_TO_USE = "cpu_bytes_to_use"
EVICTION_POLICY = "eviction_policy"
STORE_THRESHOLD = "store_threshold"
MAX_TRACKER_SIZE = "max_tracker_size"
KVTRITON_BACKEND = "kvtriton_backend"
KVTRITON_NUM_PROGRAMS = "kvtriton_num_programs"
KVTRITON_PAGEABLE_SLAB = "kvtriton_pageable_slab"

_KVTRITON_KEYS = frozenset({KVTRITON_BACKEND, KVTRITON_NUM_PROGRAMS, KVTRITON_PAGEABLE_SLAB})

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _parse_int(extra_config: Mapping[str, object], key: str, default: int | None, minimum: int) -> int:
    """Read ``key`` as an integer >= ``minimum``.

    JSON gives ints, but a shell user may write ``"68719476736"`` or
    ``6.8719476736e10``: integral strings and floats are accepted, anything
    else (bools, fractions, words) is rejected.
    """
    if key not in extra_config:
        if default is None:
            raise ValueError(f"{_where(key)} is required (an integer >= {minimum}) but is missing")
        return default
    raw = extra_config[key]
    value: int | None = None
    if isinstance(raw, bool):
        value = None
    elif isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str):
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
    if value is None:
        raise ValueError(f"{_where(key)} must be an integer >= {minimum}, got {type(raw).__name__} {raw!r}")
    if value < minimum:
        raise ValueError(f"{_where(key)} must be >= {minimum}, got {raw!r}")
    return value


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


def _parse_str(extra_config: Mapping[str, object], key: str, default: str) -> str:
    raw = extra_config.get(key, default)
    if not isinstance(raw, str):
        raise ValueError(f"{_where(key)} must be a string, got {type(raw).__name__} {raw!r}")
    return raw.strip().lower()


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
    """

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    backend: TransferBackend = TransferBackend.AUTO
    num_programs: int = DEFAULT_NUM_PROGRAMS
    pageable_slab: bool = False

    @property
    def filters_reuse(self) -> bool:
        """Whether the reuse filter wraps the manager (``store_threshold >= 2``)."""
        return self.store_threshold >= 2

    def per_rank_bytes(self, world_size: int) -> int:
        """This rank's share of ``cpu_bytes_to_use``."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return self.cpu_bytes_to_use // world_size

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, object]) -> KVTritonOffloadConfig:
        """Parse vLLM's ``kv_connector_extra_config``; raises ``ValueError`` naming the bad key and value.

        Keys this class does not know are left alone (the connector itself
        reads ``spec_name``, ``block_size``, ...), except unknown ``kvtriton_*``
        keys, which are almost certainly typos and get a warning.
        """
        policy = _parse_str(extra_config, EVICTION_POLICY, "lru")
        valid_policies = policy_names()
        if policy not in valid_policies:
            raise ValueError(f"{_where(EVICTION_POLICY)} must be one of {valid_policies}, got {extra_config[EVICTION_POLICY]!r}")
        backend_name = _parse_str(extra_config, KVTRITON_BACKEND, TransferBackend.AUTO.value)
        try:
            backend = TransferBackend.parse(backend_name)
        except ValueError:
            valid = [backend.value for backend in TransferBackend]
            raise ValueError(f"{_where(KVTRITON_BACKEND)} must be one of {valid}, got {extra_config[KVTRITON_BACKEND]!r}") from None
        for key in extra_config:
            if key.startswith("kvtriton_") and key not in _KVTRITON_KEYS:
                logger.warning("ignoring unknown key %s; kvtriton reads %s", _where(key), sorted(_KVTRITON_KEYS))
        return cls(
            cpu_bytes_to_use=_parse_int(extra_config, CPU_BYTES_TO_USE, None, 1),
            eviction_policy=policy,
            # vLLM's default is 0 ("store everything"); 1 means the same.
            store_threshold=_parse_int(extra_config, STORE_THRESHOLD, 0, 0),
            max_tracker_size=_parse_int(extra_config, MAX_TRACKER_SIZE, 64_000, 1),
            backend=backend,
            num_programs=_parse_int(extra_config, KVTRITON_NUM_PROGRAMS, DEFAULT_NUM_PROGRAMS, 1),
            pageable_slab=_parse_bool(extra_config, KVTRITON_PAGEABLE_SLAB, False),
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
