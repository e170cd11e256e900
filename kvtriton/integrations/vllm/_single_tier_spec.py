"""The single-tier spec: kvtriton's manager and worker behind vLLM's OffloadingConnector, one host slab per rank.

``kvtriton.integrations.vllm`` exports :class:`KVTritonOffloadingSpec` (the
``spec_name`` of the documented ``kv_transfer_config``); the tiered spec
(:mod:`kvtriton.integrations.vllm._tiered_spec`) stands beside it on the same
spec core (:mod:`kvtriton.integrations.vllm._spec_core`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from kvtriton._xxh3 import require_xxhash
from kvtriton.integrations.vllm._config import KVTritonOffloadConfig, check_budget, is_vllm_policy, parse_policy
from kvtriton.integrations.vllm._manager import VLLMOffloadingManager, metric_definitions, reuse_filter
from kvtriton.integrations.vllm._spec_core import (
    log_vllm_policy,
    open_host_slab,
    open_transfer_engines,
    spec_basis,
)
from kvtriton.integrations.vllm._surface import (
    CPUOffloadingInfo,
    CPUOffloadingSpec,
    OffloadingConfig,
    vllm_base,
)
from kvtriton.integrations.vllm._surface import (
    CPUOffloadingManager as VLLMCPUOffloadingManager,
)
from kvtriton.integrations.vllm._worker import GroupPages, VLLMOffloadingWorker
from kvtriton.manager import CPUOffloadingManager, OffloadingManager
from kvtriton.worker import HostSlab

logger = logging.getLogger(__name__)


def _compression_note(raw_row_bytes: int, row_bytes: int) -> str:
    """The start-up line's note on what compression buys: rows compressed to this fraction (empty when off)."""
    if row_bytes == raw_row_bytes:
        return ""
    return f" (rows of {raw_row_bytes} bytes stored in {row_bytes}: {raw_row_bytes / row_bytes:.2f}x the slots)"


def _names_vllm_policy(extra_config: dict[str, Any]) -> bool:
    """Whether ``extra_config`` leaves the eviction policy to vLLM's manager; False for a bad value (the spec names it)."""
    try:
        return is_vllm_policy(*parse_policy(extra_config))
    except ValueError:
        return False


def _verifies_host_loads(extra_config: dict[str, Any]) -> bool:
    """Whether ``extra_config`` turns ``kvtriton_verify_host_loads`` on; False for a bad config (the spec names it)."""
    try:
        return KVTritonOffloadConfig.from_extra_config(extra_config).verify_host_loads
    except ValueError:
        return False


VERIFY_HOST_LOADS_NOTE = (
    "; kvtriton_verify_host_loads=true: every load is checked against its store's digest (a debug mode: one hash "
    "pass per stored and loaded slot on the worker; a mismatch refuses the load)"
)
"""The start-up line's last words when the debug mode is on."""


@dataclass(frozen=True)
class VerifiedLoadsInfo(CPUOffloadingInfo):
    """vLLM's CPU tier labels plus ``kvtriton_verify_host_loads``, declared only when the debug mode is on.

    So the ``vllm:kv_offload_config_info`` series of an engine that verifies
    its loads says so, and every other engine's labels stay vLLM's own.
    """

    kvtriton_verify_host_loads: bool = True


class KVTritonOffloadingSpec(vllm_base.OffloadingSpec):
    """vLLM ``OffloadingSpec`` whose manager and worker are kvtriton's.

    One slot of the host slab holds one offloaded chunk (``blocks_per_chunk``
    GPU blocks) of one KV cache group's bytes on this rank: the pages the
    group references, without padding (see
    :mod:`kvtriton.integrations.vllm._worker`). The slot count is derived from
    ``cpu_bytes_to_use`` (the total over all ranks) and the KV bytes per block
    by the same formula in the scheduler (which sees rank 0's bytes) and in
    every worker (its own), so the slot ids the manager hands out are valid in
    every rank's slab when all ranks hold the same bytes per block (tensor
    parallelism, evenly split pipeline stages); vLLM's own CPU spec has the
    same limit. A worker refuses a slot beyond its slab, naming the cause.
    Unlike vLLM's own CPU spec, the worker runs on CPU tensors too (the torch
    backend; no pinned memory).

    An ``eviction_policy`` kvtriton does not implement, or a
    ``cache_policy_module_path``, runs vLLM's own ``CPUOffloadingManager``
    with that policy (resolved by vLLM's ``CachePolicyFactory``, reuse filter
    included) while kvtriton's worker moves the bytes: the worker needs only
    the slot ids a manager hands out.
    """

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, vllm_base.OffloadingMetricMetadata]:
        if _names_vllm_policy(extra_config):
            return CPUOffloadingSpec.build_metric_definitions(extra_config)
        return metric_definitions(extra_config)

    @classmethod
    @override
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return (VerifiedLoadsInfo if _verifies_host_loads(extra_config) else CPUOffloadingInfo).config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        basis = spec_basis(config, tiered=False, host_memory="the host slab")
        settings = basis.settings
        if settings.verify_host_loads:
            require_xxhash()  # the debug mode digests every slot it stores: refuse now, not at the first store
        world_size = config.parallel.world_size
        self.kv_dtype: torch.dtype | None = basis.kv_dtype
        """The KV cache's element dtype, which compression reads the byte pages as; None without compression."""
        self.row_bytes: int = basis.row_bytes
        """Bytes of one slot row: vLLM's bytes per block, or (compressed) their bound as fp8 rows."""
        slot_bytes = self.row_bytes * self.blocks_per_chunk
        check_budget(settings.cpu_bytes_to_use, slot_bytes=slot_bytes, world_size=world_size)
        self.settings: KVTritonOffloadConfig = settings
        """The parsed ``kv_connector_extra_config``."""
        self.num_slots: int = HostSlab.slots_for_budget(
            settings.cpu_bytes_to_use, self.blocks_per_chunk, self.row_bytes, world_size=world_size
        )
        """Slots in every rank's slab (and in the manager): one offloaded chunk each."""
        cpu_info = CPUOffloadingInfo.from_config(config, self.num_slots, slot_bytes * world_size)
        self.cpu_info: CPUOffloadingInfo = (
            VerifiedLoadsInfo(**dataclasses.asdict(cpu_info)) if settings.verify_host_loads else cpu_info
        )
        logger.info(
            "kvtriton offloading (rank %d of %d): cpu_bytes_to_use=%d in total, %d bytes for this rank -> "
            "%d slots x %d blocks x %d bytes; eviction_policy=%s store_threshold=%d backend=%s kv_compression=%s%s%s",
            config.parallel.rank,
            world_size,
            settings.cpu_bytes_to_use,
            settings.per_rank_bytes(world_size),
            self.num_slots,
            self.blocks_per_chunk,
            self.row_bytes,
            settings.eviction_policy,
            settings.store_threshold,
            settings.backend.value,
            settings.kv_compression.value,
            _compression_note(config.worker_kv_bytes_per_block, self.row_bytes),
            VERIFY_HOST_LOADS_NOTE if settings.verify_host_loads else "",
        )
        log_vllm_policy(logger, settings, vllm_manager="CPUOffloadingManager", scope="")
        self._manager: vllm_base.OffloadingManager | None = None
        self._worker: VLLMOffloadingWorker | None = None

    @override
    def get_manager(self) -> vllm_base.OffloadingManager:
        if self._manager is None and self.settings.uses_vllm_policy:
            settings = self.settings
            self._manager = VLLMCPUOffloadingManager(
                num_chunks=self.num_slots,
                cache_policy=settings.eviction_policy,
                cache_policy_module_path=settings.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=settings.store_threshold,
                max_tracker_size=settings.max_tracker_size,
                info=self.cpu_info,
            )
        if self._manager is None:
            settings = self.settings
            cpu = CPUOffloadingManager(
                self.num_slots,
                cache_policy=settings.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
            backing: OffloadingManager = cpu
            if settings.filters_reuse:
                # vLLM counts store offers, not lookups (its connector looks up only
                # until the first miss, so lookup counting would admit a repeated
                # prompt one chunk per repeat); 0.34 counts a key once per request.
                backing = reuse_filter(cpu, settings.store_threshold, settings.max_tracker_size)
            self._manager = VLLMOffloadingManager(
                backing, cpu, self.cpu_info, summary_interval_s=settings.summary_interval_s
            )
        return self._manager

    @override
    def get_worker(self, kv_caches: vllm_base.CanonicalKVCaches) -> vllm_base.OffloadingWorker:
        if self._worker is None:
            groups = GroupPages.from_canonical(
                kv_caches, kv_compression=self.settings.kv_compression, dtype=self.kv_dtype
            )
            # A slot holds one group's chunk, so a row is one block of the largest group.
            row_bytes = groups.row_bytes
            expected = self.row_bytes
            if row_bytes > expected:
                logger.warning(
                    "the largest KV cache group holds %d bytes per block but vLLM sized the budget for %d: the "
                    "host slab uses %.2fx this rank's share of cpu_bytes_to_use",
                    row_bytes,
                    expected,
                    row_bytes / expected,
                )
            logger.info(
                "kvtriton worker: %d KV cache group(s) moving %s bytes per block over %d page set(s); "
                "slab rows of %d bytes",
                len(groups.kv_of_group),
                list(groups.group_row_bytes),
                len(groups.kvs),
                row_bytes,
            )
            slab = open_host_slab(
                self.num_slots,
                self.blocks_per_chunk,
                row_bytes,
                device=groups.device,
                pageable_allowed=self.settings.pageable_slab,
            )
            try:
                engines = open_transfer_engines(groups, slab, self.settings)
            except BaseException:
                slab.close()
                raise
            self._worker = VLLMOffloadingWorker(
                engines,
                slab,
                groups.kv_of_group,
                verify_loads=self.settings.verify_host_loads,
                pointer_bases=groups.pointer_bases,
            )
        return self._worker
