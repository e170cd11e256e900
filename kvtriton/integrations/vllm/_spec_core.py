"""What kvtriton's two vLLM specs share: the parsed settings, the start-up checks, the worker's slab and engines.

:class:`~kvtriton.integrations.vllm.KVTritonOffloadingSpec` (one host slab
per rank) and :class:`~kvtriton.integrations.vllm._tiered_spec.KVTritonTieringOffloadingSpec`
(one shared region in front of vLLM's secondary tiers) differ in where the
host memory lives and which manager the scheduler runs. Everything else is
here, once: reading ``kv_connector_extra_config`` and vLLM's geometry
(:func:`spec_basis`), the line naming a policy left to vLLM
(:func:`log_vllm_policy`), the pinned slab a CUDA worker needs
(:func:`open_pinned_slab`) and the transfer engines over it
(:func:`open_transfer_engines`).

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtriton.integrations.vllm._config import (
    KVTRITON_PAGEABLE_SLAB,
    KVTritonOffloadConfig,
    check_keys,
    check_kv_geometry_known,
    check_vllm_policy,
    host_row_bytes,
    kv_dtype,
)
from kvtriton.integrations.vllm._surface import OffloadingConfig, check_vllm_release
from kvtriton.integrations.vllm._worker import GroupPages
from kvtriton.worker import HostSlab, SlabPinningError, TransferEngine


@dataclass(frozen=True, slots=True)
class SpecBasis:
    """What both specs derive from vLLM's ``OffloadingConfig`` before sizing their host memory."""

    settings: KVTritonOffloadConfig
    """The parsed ``kv_connector_extra_config``."""
    kv_dtype: torch.dtype | None
    """The KV cache's element dtype, which compression reads the byte pages as; None without compression."""
    row_bytes: int
    """Bytes of one host row: vLLM's bytes per block, or (compressed) their bound as fp8 rows."""


def spec_basis(config: OffloadingConfig, *, tiered: bool, host_memory: str) -> SpecBasis:
    """Parse and check what both specs read, before anything is allocated; errors name the key and the value.

    ``tiered`` says which spec asks (vLLM's tiered-only keys are warned about
    in the single-tier one); ``host_memory`` names what is sized ("the host
    slab", "the shared host region") in the error for an unknown geometry.
    The first check is the vLLM release (:func:`check_vllm_release`): the
    start-up line naming kvtriton's and vLLM's versions, or the refusal of an
    untested vLLM.
    """
    check_vllm_release()
    check_keys(config.extra_config, tiered=tiered)
    settings = KVTritonOffloadConfig.from_extra_config(config.extra_config)
    check_kv_geometry_known(
        canonical_layout=config.canonical_layout,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        host_memory=host_memory,
    )
    dtype = kv_dtype(config.model.dtype, settings.kv_compression)
    row_bytes = host_row_bytes(config.worker_kv_bytes_per_block, dtype, [group.layer_names for group in config.groups])
    return SpecBasis(settings, dtype, row_bytes)


def log_vllm_policy(
    spec_logger: logging.Logger, settings: KVTritonOffloadConfig, *, vllm_manager: str, scope: str
) -> None:
    """The start-up line saying that vLLM's ``vllm_manager`` runs the eviction policy (nothing for kvtriton's own).

    ``scope`` says what it evicts from ("the primary tier", or "" for the slab); the line goes to
    ``spec_logger``, the logger of the spec's public module, with the spec's other start-up lines.
    """
    if not settings.uses_vllm_policy:
        return
    spec_logger.info(
        "eviction_policy %r is not kvtriton's: vLLM's own %s ranks and evicts%s with %s, kvtriton's worker moves "
        "the bytes",
        settings.eviction_policy,
        vllm_manager,
        f" {scope}" if scope else "",
        check_vllm_policy(settings.eviction_policy, settings.cache_policy_module_path),
    )


class SlabOpener(Protocol):
    """Opens a host slab: ``HostSlab(...)`` with its sizes bound, or a shared region's ``rank_slab``."""

    def __call__(self, *, pin: bool | None = None, allow_pageable: bool = False) -> HostSlab: ...


def open_pinned_slab(open_slab: SlabOpener, *, device: torch.device, pageable_allowed: bool) -> HostSlab:
    """A worker's host slab: pinned when the KV cache is on CUDA, or a one-line error saying how to fix it.

    A pageable slab still works but copies through the CPU, several times
    slower, so a CUDA server refuses to start with one (the slab's
    :class:`~kvtriton.worker._slab.SlabPinningError`, naming the bytes asked
    for and why pinning failed) unless ``kvtriton_pageable_slab`` allows it
    (then it warns and runs). Off CUDA (tests, CPU runs) there is no copy
    engine to pin for: the slab is pageable.
    """
    if device.type != "cuda":
        return open_slab(pin=False)
    try:
        return open_slab(allow_pageable=pageable_allowed)
    except SlabPinningError as error:
        raise SlabPinningError(
            f"{error}; in vLLM that is kv_connector_extra_config[{KVTRITON_PAGEABLE_SLAB!r}]=true"
        ) from error


def open_host_slab(
    num_slots: int, block_size_factor: int, row_bytes: int, *, device: torch.device, pageable_allowed: bool
) -> HostSlab:
    """The single-tier spec's own host slab, opened as :func:`open_pinned_slab` says."""

    def open_slab(*, pin: bool | None = None, allow_pageable: bool = False) -> HostSlab:
        return HostSlab(num_slots, block_size_factor, row_bytes, pin, allow_pageable=allow_pageable)

    return open_pinned_slab(open_slab, device=device, pageable_allowed=pageable_allowed)


def open_transfer_engines(groups: GroupPages, slab: HostSlab, settings: KVTritonOffloadConfig) -> list[TransferEngine]:
    """One transfer engine per page set of ``groups``, all over ``slab``; on failure the ones built are shut down.

    The slab stays the caller's to close.
    """
    engines: list[TransferEngine] = []
    try:
        for kv in groups.kvs:
            engines.append(
                TransferEngine(
                    kv,
                    slab,
                    settings.backend,
                    num_programs=settings.num_programs,
                    kv_compression=settings.kv_compression,
                )
            )
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines
