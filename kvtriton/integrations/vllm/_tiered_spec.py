"""kvtriton as the primary tier of vLLM's tiered offloading (``vllm.v1.kv_offload.tiering``, 0.33 and 0.34).

vLLM's ``TieringOffloadingManager`` puts one *primary* tier (host memory, the
only tier the GPU reaches) in front of any number of *secondary* tiers
(``fs``, ``obj``, ``p2p``, out-of-tree tiers by ``module_path``): every chunk
stored to the primary is cascaded to every secondary tier, and a chunk found
only in a secondary tier is promoted into the primary before the GPU loads it.
:class:`KVTritonTieringOffloadingSpec` keeps vLLM's orchestrator and its
secondary tiers unchanged and replaces the primary: kvtriton's manager decides
which slot holds which chunk and evicts, kvtriton's Triton kernels move the
bytes between the GPU and host memory.

Configuration: ``TieringOffloadingSpec``'s keys unchanged (``cpu_bytes_to_use``,
``block_size`` / ``blocks_per_chunk``, ``eviction_policy``, ``secondary_tiers``,
``tier_poll_interval_s``, ``backpressure``) plus kvtriton's ``kvtriton_backend``,
``kvtriton_num_programs`` and ``kvtriton_kv_compression``; docs/tiers.md has a
complete example.

The pieces:

* :class:`KVTritonPrimaryTier`: the primary-tier contract the orchestrator
  calls (``prepare_write`` / ``complete_write`` for promotions,
  ``prepare_read`` / ``complete_read`` for cascades, ``get_kv_memoryview``,
  ``_num_chunks``) over kvtriton's ``CPUOffloadingManager``;
* the host memory is one :class:`~kvtriton.worker._shared_region.SharedRegion`
  in /dev/shm: the scheduler maps it for the secondary tiers, every worker rank
  writes its bytes of every block row through a strided ``HostSlab``
  (:meth:`~kvtriton.worker._shared_region.SharedRegion.rank_slab`);
* a namespace: kvtriton's chunk bytes are not vLLM's (every chunk ends in
  its seal, and a multi-block chunk is ordered block by block), so the
  secondary tiers see the model name suffixed with :func:`layout_tag` and the
  identity fingerprint (:meth:`KVTritonTieringOffloadingSpec.tier_facing_spec`)
  and file their chunks under a namespace of their own: a vLLM primary, an
  engine of another model, weights, dtype, geometry or compression sharing the
  root only misses, never loads them. With ``kvtriton_kv_compression`` the
  tag names the compression and its scale group size too (``+fp8-e4m3-g128``);
* fail closed (:class:`~kvtriton.integrations.vllm._sealed_tiering.SealedTieringManager`):
  every chunk a secondary tier reads is sealed first, every chunk it returns
  is verified before it becomes a hit (docs/tiers.md, "Integrity");
* encrypted (``kvtriton_encryption``): kvtriton's remote tiers seal each value
  with its tenant's key themselves; vLLM's fs tier is built over an egress
  area (:mod:`kvtriton.integrations.vllm._egress`) and handed only sealed
  chunks; any other tier is refused at start-up (docs/security.md).

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import threading
from collections.abc import Collection, Iterable
from typing import Any, Protocol, cast

import torch
from typing_extensions import override

from kvtriton._private_files import prepare_tier_root
from kvtriton._xxh3 import require_xxhash
from kvtriton.integrations.vllm._config import (
    CACHE_POLICY_MODULE_PATH,
    EVICTION_POLICY,
    KVTritonOffloadConfig,
    check_budget,
    check_vllm_policy,
    compression_tag,
    is_vllm_policy,
    parse_policy,
)
from kvtriton.integrations.vllm._egress import EgressArea, EgressCipher, egress_rows
from kvtriton.integrations.vllm._encryption import (
    EncryptionSetting,
    TierEncryption,
    is_egress_tier,
    refuse_plaintext_tiers,
)
from kvtriton.integrations.vllm._identity import KVIdentity, vllm_identity
from kvtriton.integrations.vllm._integrity_report import integrity_metric_definitions
from kvtriton.integrations.vllm._manager import VLLMOffloadingManager
from kvtriton.integrations.vllm._sealed_tiering import (
    IDENTITY_INFO_KEYS,
    SealedTieringManager,
    host_memory_path_definition,
)
from kvtriton.integrations.vllm._spec_core import log_vllm_policy, open_pinned_slab, open_transfer_engines, spec_basis
from kvtriton.integrations.vllm._surface import (
    VLLM_VERSION,
    CPUOffloadingInfo,
    CPUPrimaryTierOffloadingManager,
    OffloadingConfig,
    SecondaryTierFactory,
    SecondaryTierManager,
    TieringOffloadingSpec,
    install_tenant_hook,
    refuse_secondary_tiers_across_nodes,
    vllm_base,
    with_model_name,
)
from kvtriton.integrations.vllm._surface import (
    CPULoadStoreSpec as VLLMCPULoadStoreSpec,
)
from kvtriton.integrations.vllm._tier_configs import (
    check_backpressure,
    check_poll_interval,
    release_half_built,
    resolve_tier,
    tier_failure,
    tier_label,
)
from kvtriton.integrations.vllm._worker import GroupPages, VLLMOffloadingWorker
from kvtriton.manager import CPUOffloadingManager
from kvtriton.worker import HostSlab, RegionLayout, SharedRegion, TransferEngine

logger = logging.getLogger(__name__)

LAYOUT_TAG = "kvtriton-block-rows-v1"
"""Appended to the model name the secondary tiers see: kvtriton's chunks are not vLLM's bytes.

vLLM's secondary tiers name their storage after the model, dtype, parallelism
and chunk size (``vllm.v1.kv_offload.file_mapper.FileMapper``), not after the
bytes inside a chunk. kvtriton's chunk ends in its seal and orders a
multi-block chunk block by block (each block row holds every rank's bytes of
one block); vLLM's has no seal and orders it rank by rank. The tag keeps the
two apart; bump its version if the order ever changes. With compression
:func:`layout_tag` appends the compression's tag.
"""


def layout_tag(*, compression: str | None) -> str:
    """The namespace tag of the chunks the secondary tiers store.

    ``compression``: :func:`~kvtriton.integrations.vllm._config.compression_tag` (None: off).
    """
    return LAYOUT_TAG if compression is None else f"{LAYOUT_TAG}+{compression}"


def _tier_context(req_context: vllm_base.ReqContext) -> vllm_base.ReqContext:
    """A context for a copy between tiers: the request's id, but none of its access record.

    kvtriton's manager ranks a request's keys from what the request itself
    loads and stores (``kvtriton.manager._request_access``); a cascade or a
    promotion is the tiers' traffic, not the request's, so it must not count.
    """
    return vllm_base.ReqContext(req_id=req_context.req_id, kv_transfer_params=req_context.kv_transfer_params)


def region_name(engine_id: str) -> str:
    """The shared region's name for an engine (one per engine and data-parallel replica); safe as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id) or "engine"


class ChunkRegion(Protocol):
    """The host memory a primary tier hands the secondary tiers: kvtriton's ``SharedRegion``, or any region alike."""

    def chunk_memoryview(self) -> memoryview:
        """The chunks as a ``(num_chunks, chunk_bytes)`` memoryview."""
        ...

    def close(self) -> None:
        """Unmap (the last process to close removes it)."""
        ...


class _VLLMRegionView:
    """A :class:`ChunkRegion` as vLLM's ``CPUPrimaryTierOffloadingManager`` reads its ``mmap_region``."""

    def __init__(self, region: ChunkRegion) -> None:
        self._region = region

    def create_kv_memoryview(self) -> memoryview:
        return self._region.chunk_memoryview()

    def cleanup(self) -> None:
        self._region.close()


class KVTritonPrimaryTier(VLLMOffloadingManager):
    """The primary tier ``TieringOffloadingManager`` drives, answered by kvtriton's ``CPUOffloadingManager``.

    Besides vLLM's manager interface (inherited) it offers what the
    orchestrator calls on its primary:

    * ``prepare_write`` / ``complete_write``: a promotion takes slots that stay
      pending (``lookup`` answers ``HIT_PENDING``, never evicted) until the
      secondary tier has written them; a failed write frees them at once;
    * ``defer_write_release`` / ``release_deferred_write`` /
      ``num_deferred_release_chunks`` (vLLM 0.34): a failed promotion whose
      tier may still write fails its keys at once but holds its chunks until
      the tier is done; ``reset_cache`` is refused while chunks are held;
    * ``prepare_read`` / ``complete_read``: a cascade pins chunks without
      counting an access (the request's own loads do that); pins stack, so two
      tiers reading one chunk and a GPU load keep it until the last one ends;
    * ``lookup`` answers HIT, HIT_PENDING or MISS, never RETRY: the
      orchestrator asks the secondary tiers only on MISS;
    * ``get_kv_memoryview``: the region's chunks, ``(num_chunks, chunk_bytes)``;
    * ``_num_chunks``: read by the orchestrator for its occupancy metrics.
    """

    reports_occupancy = False  # vLLM's tiering spec does not declare kvtriton's occupancy gauge

    def __init__(self, cpu: CPUOffloadingManager, info: CPUOffloadingInfo, region: ChunkRegion) -> None:
        super().__init__(cpu, cpu, info)
        self._region = region
        self._num_chunks: int = cpu.capacity
        self._kv_memoryview = region.chunk_memoryview()

    @property
    def region(self) -> ChunkRegion:
        """The shared host region the tiers copy from and to."""
        return self._region

    def get_kv_memoryview(self) -> memoryview:
        """The region's chunks as a ``(num_chunks, chunk_bytes)`` memoryview; chunk ``c`` starts at ``c * chunk_bytes``."""
        return self._kv_memoryview

    def prepare_read(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> VLLMCPULoadStoreSpec:
        """Pin ready chunks for a copy to a secondary tier; no access is recorded (recency stays the request's)."""
        return cast("VLLMCPULoadStoreSpec", self.prepare_load(keys, _tier_context(req_context)))

    def complete_read(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> None:
        """Drop the pins of one ``prepare_read``."""
        self.complete_load(keys, _tier_context(req_context))

    def prepare_write(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.PrepareStoreOutput | None:
        """Take slots for chunks promoted from a secondary tier (pending until ``complete_write``); None when full.

        The promotion is the request's store, as in vLLM (its ``prepare_write`` is ``prepare_store``).
        """
        return self.prepare_store(keys, req_context)

    def complete_write(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, success: bool = True
    ) -> None:
        """Make promoted chunks loadable, or (``success=False``) free their slots."""
        self.complete_store(keys, req_context, success)

    def defer_write_release(self, keys: Collection[vllm_base.OffloadKey]) -> list[int]:
        """Fail pending promotion writes as ``complete_write(success=False)`` does, but hold their chunks.

        vLLM 0.34's orchestrator calls it when a secondary tier reports a
        failed promotion whose I/O may still write into the chunks
        (``JobResult.deferred_release``): the keys leave the cache at once
        (lookups miss, a later store takes another chunk) and a
        ``metadata_only`` removal is announced, while the chunks stay out of
        the free pool until :meth:`release_deferred_write`. Returns the held
        chunk ids. A key that is no pending write raises ``AssertionError``,
        as vLLM's primary does (the orchestrator's contract).
        """
        try:
            return self._cpu_calls.hold_failed_stores(keys)
        except ValueError as error:
            raise AssertionError(f"defer_write_release: a key is not a pending write ({error})") from error

    def release_deferred_write(self, chunk_ids: Iterable[int]) -> None:
        """Return the chunks :meth:`defer_write_release` held to the free pool (the tier's I/O is done with them)."""
        self.cpu.release_held_slots(list(chunk_ids))

    @property
    def num_deferred_release_chunks(self) -> int:
        """Chunks :meth:`defer_write_release` holds until released (vLLM 0.34's orchestrator reads it)."""
        return self.cpu.num_held_slots

    @override
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._kv_memoryview = memoryview(b"")
            self._region.close()


def build_primary_tier(
    num_chunks: int,
    region: ChunkRegion,
    *,
    eviction_policy: str,
    cache_policy_module_path: str | None,
    enable_events: bool,
    info: CPUOffloadingInfo,
) -> vllm_base.OffloadingManager:
    """The primary tier over ``region``'s ``num_chunks`` chunks, as :class:`KVTritonTieringOffloadingSpec` builds it.

    kvtriton's :class:`KVTritonPrimaryTier` for kvtriton's policies; for any
    other ``eviction_policy``, or one loaded by ``cache_policy_module_path``,
    vLLM's own ``CPUPrimaryTierOffloadingManager`` with that policy over the
    same region (kvtriton's workers then only write the chunks it assigns).
    On failure ``region`` is left open (the caller owns it).
    """
    policy, module_path = parse_policy(
        {EVICTION_POLICY: eviction_policy, CACHE_POLICY_MODULE_PATH: cache_policy_module_path}
    )
    if is_vllm_policy(policy, module_path):
        check_vllm_policy(policy, module_path)
        return CPUPrimaryTierOffloadingManager(
            num_chunks=num_chunks,
            mmap_region=_VLLMRegionView(region),  # pyright: ignore[reportArgumentType] -- vLLM reads only create_kv_memoryview and cleanup
            cache_policy=policy,
            cache_policy_module_path=module_path,
            enable_events=enable_events,
            info=info,
        )
    cpu = CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=enable_events)
    return KVTritonPrimaryTier(cpu, info, region)


class KVTritonTieringWorker(VLLMOffloadingWorker):
    """vLLM's worker interface over kvtriton's engines, writing this rank's part of the shared region."""

    def __init__(self, engines: list[TransferEngine], slab: HostSlab, groups: GroupPages, region: SharedRegion) -> None:
        super().__init__(engines, slab, groups.kv_of_group, pointer_bases=groups.pointer_bases)
        self._region = region

    @override
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._region.close()


def _compressed(settings: KVTritonOffloadConfig) -> str:
    compression = settings.kv_compression.value
    return "" if compression == "none" else f" compressed ({compression})"


class KVTritonTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with kvtriton as the primary tier (see the module docstring).

    vLLM builds it once in the scheduler process (:meth:`get_manager`: the
    orchestrator, kvtriton's primary tier, the secondary tiers) and once per
    worker rank (:meth:`get_worker`: kvtriton's engine writing this rank's
    part of the shared region). Every error a configuration can cause is
    raised here, before anything is allocated, naming the key and the value.
    """

    @classmethod
    @override
    def _get_secondary_tiers(
        cls, extra_config: dict[str, Any]
    ) -> list[tuple[dict[str, Any], type[SecondaryTierManager]]]:
        tier_configs = extra_config.get("secondary_tiers", [])
        if not isinstance(tier_configs, list):
            raise ValueError(f"secondary_tiers must be a list of tier configurations, got {tier_configs!r}")
        configs = cast("list[object]", tier_configs)
        return [(cast("dict[str, Any]", config), resolve_tier(index, config)) for index, config in enumerate(configs)]

    def __init__(self, config: OffloadingConfig) -> None:
        extra = config.extra_config
        # Every chunk a secondary tier gets is sealed: without xxhash the spec would start, then fail at its first seal.
        require_xxhash()
        # Parsed first: a bad or missing key is reported as kvtriton reports it,
        # before vLLM's parent classes read the same keys.
        basis = spec_basis(config, tiered=True, host_memory="the shared host region")
        settings = basis.settings
        check_poll_interval(extra)
        check_backpressure("kv_connector_extra_config['backpressure']", extra.get("backpressure"))
        if settings.filters_reuse:
            raise ValueError(
                f"kv_connector_extra_config['store_threshold']={settings.store_threshold}: the tiered spec stores "
                "every chunk (vLLM's TieringOffloadingSpec does not support store_threshold either); remove it"
            )
        blocks_per_chunk = config.cache.blocks_per_chunk
        dtype = basis.kv_dtype
        row_bytes = basis.row_bytes
        row_stride = RegionLayout.block_row_stride_for(blocks_per_chunk, config.parallel.world_size, row_bytes)
        # One region on this host holds every rank's bytes: the whole budget must fit its RAM.
        check_budget(settings.cpu_bytes_to_use, slot_bytes=blocks_per_chunk * row_stride, world_size=1, slot="chunk")
        tier_classes = self._get_secondary_tiers(dict(extra))
        encryption_setting = EncryptionSetting.from_extra_config(extra)
        if encryption_setting is not None:
            refuse_plaintext_tiers(
                [(tier_label(index, config), tier_class) for index, (config, tier_class) in enumerate(tier_classes)]
            )
        super().__init__(config)
        self.encryption: TierEncryption | None = (
            None if encryption_setting is None else TierEncryption.from_setting(encryption_setting)
        )
        """With ``kvtriton_encryption``: the tenants' keys the secondary tiers seal and open chunks with."""
        # Every rank keeps its own copy of replicated (MLA) KV: the region has
        # a place for each rank, and each rank's worker stores its own bytes.
        self.replicated_layout = False
        self._kvtriton_worker: KVTritonTieringWorker | None = None
        self.settings: KVTritonOffloadConfig = settings
        """The parsed ``kv_connector_extra_config`` (kvtriton's keys)."""
        self.kv_dtype: torch.dtype | None = dtype
        """The KV cache's element dtype, which compression reads the byte pages as; None without compression."""
        self.region_layout: RegionLayout = RegionLayout.for_budget(
            settings.cpu_bytes_to_use, self.blocks_per_chunk, config.parallel.world_size, row_bytes
        )
        """Where every rank's bytes of every chunk sit in the shared region."""
        layout = self.region_layout
        # The attributes vLLM's parent classes derived from their own layout (_surface lists them),
        # restated for kvtriton's.
        self.num_chunks = layout.num_chunks
        self.kv_bytes_per_chunk = layout.chunk_bytes
        self.cpu_page_size_per_worker = layout.rank_row_bytes * layout.block_size_factor
        self.cpu_info = CPUOffloadingInfo.from_config(config, layout.num_chunks, layout.chunk_bytes)
        self.layout_tag: str = layout_tag(compression=compression_tag(settings.kv_compression))
        """Appended to the model name in the secondary tiers' namespace, with the identity."""
        self.identity: KVIdentity = vllm_identity(
            config,
            layout=self.layout_tag,
            compression=compression_tag(settings.kv_compression),
            rank=None,  # a chunk holds every rank's bytes
        )
        """The identity fingerprint of the chunks the secondary tiers store (docs/tiers.md, "Integrity")."""
        logger.info(
            "kvtriton tiered offloading (rank %d of %d): %s; %d secondary tier(s); eviction_policy=%s backend=%s "
            "kv_compression=%s%s; files %s",
            config.parallel.rank,
            config.parallel.world_size,
            layout.describe(),
            len(self.secondary_tier_configs),
            settings.eviction_policy,
            settings.backend.value,
            settings.kv_compression.value,
            f"; secondary tiers namespaced with {self.layout_tag!r}",
            settings.file_sharing.describe(),
        )
        log_vllm_policy(logger, settings, vllm_manager="CPUPrimaryTierOffloadingManager", scope="the primary tier")

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, vllm_base.OffloadingMetricMetadata]:
        return {
            **super().build_metric_definitions(extra_config),
            **integrity_metric_definitions(),
            **host_memory_path_definition(),
        }

    @classmethod
    @override
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return (*super().config_info_keys(extra_config), *IDENTITY_INFO_KEYS)

    @property
    def expected_mappers(self) -> int:
        """Processes that map the region: the scheduler and every worker rank."""
        return self.config.parallel.world_size + 1

    def _refuse_secondary_tiers_across_nodes(self) -> None:
        """vLLM's refusal of secondary tiers on workers that span nodes, where vLLM's own ``create_worker`` runs it
        (vLLM 0.34), restated for this spec: every rank takes part (a collective), before anything is mapped."""
        try:
            refuse_secondary_tiers_across_nodes()
        except NotImplementedError as error:
            raise NotImplementedError(
                f"KVTritonTieringOffloadingSpec: secondary_tiers ({len(self.secondary_tier_configs)} configured) "
                f"are not supported when the engine's workers span several nodes (vLLM {VLLM_VERSION} refuses them: "
                "the tiers run in the engine core and read only its node's host region); run the engine on one "
                "node, or remove secondary_tiers"
            ) from error

    def _open_region(self) -> SharedRegion:
        return SharedRegion(region_name(self.config.engine_id), self.region_layout, self.expected_mappers)

    def tier_namespace(self) -> str:
        """The model name the secondary tiers see: ``<model>@<layout tag>@id-<identity fingerprint>``.

        The tiers file their chunks under it (vLLM's fs tier: a directory of
        its own), so an engine of another identity (other weights at the same
        path, another dtype or geometry) finds none of this one's chunks: a
        plain miss, never a read of bytes that are not its own.
        """
        return f"{self.config.model.name}@{self.layout_tag}@id-{self.identity.hex}"

    def tier_facing_spec(self) -> TieringOffloadingSpec:
        """The spec the secondary tiers are built with: this one, under :meth:`tier_namespace`'s model name."""
        tagged = copy.copy(self)
        tagged.config = with_model_name(self.config, self.tier_namespace())
        return tagged

    def _egress_cipher(self) -> EgressCipher | None:
        """The egress area vLLM's fs tier is built over when encrypting (:mod:`kvtriton.integrations.vllm._egress`),
        or None: not encrypting, or no such tier."""
        if self.encryption is None or not any(
            is_egress_tier(resolve_tier(index, config)) for index, config in enumerate(self.secondary_tier_configs)
        ):
            return None
        layout = self.region_layout
        rows = egress_rows(layout.num_chunks, layout.chunk_bytes)
        logger.info(
            "kvtriton encryption: vLLM's fs tier gets only sealed chunks, through an egress area of %d rows of %d "
            "bytes (%.1f MiB at most, resident only as rows are used)",
            rows,
            layout.chunk_bytes,
            rows * layout.chunk_bytes / (1 << 20),
        )
        return EgressCipher(
            EgressArea(rows, layout.chunk_bytes),
            self.encryption,
            fingerprint=self.identity.fingerprint,
            layout=self.layout_tag,
        )

    @override
    def get_manager(self) -> vllm_base.OffloadingManager:
        if self._manager is not None:
            return self._manager
        if self.encryption is not None:
            install_tenant_hook()  # before the connector builds any request's context: each names its tenant
        region = self._open_region()
        primary: vllm_base.OffloadingManager | None = None
        tiers: list[SecondaryTierManager] = []
        try:
            primary = build_primary_tier(
                self.num_chunks,
                region,
                eviction_policy=self.settings.eviction_policy,
                cache_policy_module_path=self.settings.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=self.cpu_info,
            )
            view = cast("KVTritonPrimaryTier | CPUPrimaryTierOffloadingManager", primary).get_kv_memoryview()
            tier_spec = self.tier_facing_spec()
            egress = self._egress_cipher()
            egress_tiers: list[int] = []
            for index, tier_config in enumerate(self.secondary_tier_configs):
                threads_before = threading.enumerate()
                tier_view = view
                if egress is not None and is_egress_tier(resolve_tier(index, tier_config)):
                    tier_view = egress.area.view()  # the tier's only view of the KV: sealed chunks
                    egress_tiers.append(index)
                try:
                    prepare_tier_root(tier_label(index, tier_config), tier_config, self.settings.file_sharing)
                    tier = SecondaryTierFactory.create_secondary_tier(tier_config, tier_view, tier_spec)  # pyright: ignore[reportUnknownMemberType] -- vLLM annotates tier configs as a bare dict
                except Exception as error:
                    # Before anything else: a half-built tier's threads would outlive this spec (and the next ones).
                    left = release_half_built(error, threads_before)
                    if not isinstance(error, (OSError, ImportError, TypeError, ValueError, RuntimeError)):
                        raise
                    label = tier_label(index, tier_config)
                    config = cast("dict[str, Any]", tier_config)
                    raise tier_failure(label, config, error, threads_left=left) from error
                tiers.append(tier)
                logger.info("created secondary tier #%d (%s)", index, tier.tier_type)
            manager = SealedTieringManager(
                # The orchestrator is typed for vLLM's CPU primary; KVTritonPrimaryTier
                # offers every method and attribute it uses (see the class docstring).
                primary_tier=primary,  # pyright: ignore[reportArgumentType] -- duck-typed primary, checked by tests/integrations/vllm/test_tiering_contract.py
                secondary_tiers=tiers,
                identity=self.identity,
                tier_poll_interval_s=self.tier_poll_interval_s,
                host_memory_path=lambda: region.memory_path,
                # Encrypting, every tier is one handed ciphertext or one that seals its values itself (the others
                # were refused).
                self_sealing_tiers=[index for index in range(len(tiers)) if index not in egress_tiers]
                if self.encryption is not None
                else (),
                egress=egress,
                egress_tiers=egress_tiers,
            )
        except BaseException:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:
                    logger.exception("failed to shut down a secondary tier while cleaning up")
            if primary is not None:
                primary.shutdown()
            else:
                region.close()
            raise
        # Logged here, where the identity is used (the seals, the tiers' namespace, the metrics): once per
        # engine, by its engine core; the workers compute the same identity and use none of it.
        logger.info("kvtriton tiered offloading %s", self.identity.describe())
        if self.encryption is not None:
            logger.info("kvtriton tiered offloading: %s", self.encryption.describe())
        self._manager = manager
        return manager

    @override
    def get_worker(self, kv_caches: vllm_base.CanonicalKVCaches) -> vllm_base.OffloadingWorker:
        if self._kvtriton_worker is not None:
            return self._kvtriton_worker
        if self.secondary_tier_configs and self.config.parallel.world_size > 1:
            self._refuse_secondary_tiers_across_nodes()
        groups = GroupPages.from_canonical(kv_caches, kv_compression=self.settings.kv_compression, dtype=self.kv_dtype)
        layout = self.region_layout
        rank = self.config.parallel.rank
        if groups.row_bytes > layout.rank_row_bytes:
            raise ValueError(
                f"rank {rank}'s KV tensors hold {groups.row_bytes} bytes per block{_compressed(self.settings)}, but "
                f"the shared region gives each rank {layout.rank_row_bytes} (from vLLM's worker_kv_bytes_per_block): "
                "pipeline stages must hold the same "
                "layers per rank (split them evenly: VLLM_PP_LAYER_PARTITION)"
            )
        region = self._open_region()
        slab: HostSlab | None = None
        try:
            slab = open_pinned_slab(
                functools.partial(region.rank_slab, rank),
                device=groups.device,
                pageable_allowed=self.settings.pageable_slab,
            )
            engines = open_transfer_engines(groups, slab, self.settings)
        except BaseException:
            if slab is not None:
                slab.close()
            region.close()
            raise
        made = KVTritonTieringWorker(engines, slab, groups, region)
        self._kvtriton_worker = made
        return made
