"""The vLLM surface: every vLLM name kvtriton uses, and each difference between the vLLM releases it supports.

kvtriton supports the vLLM releases in :data:`TESTED_VLLM_RELEASES` (0.33.x
and 0.34.x). Everything kvtriton takes from vLLM comes through this module:

* the vLLM names the adapters import, re-exported below, so a release that
  moves one is one edit here;
* each behaviour that differs between the supported releases, resolved once
  into a named fact (:data:`WORKER_GETS_DEVICE_POINTERS`,
  :data:`FAILED_TRANSFERS_ARE_REPORTED`, ...) that the adapters branch on,
  instead of version tests scattered through them;
* the version check at start-up (:func:`check_vllm_release`): the start-up
  line naming kvtriton's and vLLM's versions, and the refusal of a vLLM
  outside the tested range unless ``KVTRITON_ALLOW_UNTESTED_VLLM=1``;
* the inventory of vLLM's private names kvtriton relies on
  (:data:`VLLM_PRIVATE_NAMES`: what, where kvtriton uses it, why), which
  ``tests/integrations/vllm/test_vllm_surface.py`` checks against the installed
  vLLM, failing with the entry's name.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import numpy.typing as npt
from vllm import envs as vllm_envs
from vllm.config import VllmConfig as VllmConfig
from vllm.config import get_current_vllm_config_or_none as get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats as OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector as OffloadingConnector,
)
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.base import ConfigInfoMapping as ConfigInfoMapping
from vllm.v1.kv_offload.base import Locality as Locality
from vllm.v1.kv_offload.base import LookupResult as LookupResult
from vllm.v1.kv_offload.base import Medium as Medium
from vllm.v1.kv_offload.base import OffloadingCounterMetadata as OffloadingCounterMetadata
from vllm.v1.kv_offload.base import OffloadingGaugeMetadata as OffloadingGaugeMetadata
from vllm.v1.kv_offload.base import OffloadingMetricMetadata as OffloadingMetricMetadata
from vllm.v1.kv_offload.base import OffloadingSpec as OffloadingSpec
from vllm.v1.kv_offload.base import OffloadKey as OffloadKey
from vllm.v1.kv_offload.base import ReqContext as ReqContext
from vllm.v1.kv_offload.base import RequestOffloadingContext as RequestOffloadingContext
from vllm.v1.kv_offload.base import ScheduleEndContext as ScheduleEndContext
from vllm.v1.kv_offload.base import get_offload_block_hash as get_offload_block_hash
from vllm.v1.kv_offload.base import get_offload_group_idx as get_offload_group_idx
from vllm.v1.kv_offload.config import OffloadingConfig as OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo as CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory as CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as CPUOffloadingSpec
from vllm.v1.kv_offload.tiering import backpressure as vllm_backpressure
from vllm.v1.kv_offload.tiering import factory as vllm_tier_factory
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager as AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector as BackpressureDetector
from vllm.v1.kv_offload.tiering.backpressure import BackpressurePolicy as BackpressurePolicy
from vllm.v1.kv_offload.tiering.base import TIER_LABEL as TIER_LABEL
from vllm.v1.kv_offload.tiering.base import JobId as JobId
from vllm.v1.kv_offload.tiering.base import JobResult as JobResult
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as SecondaryTierManager
from vllm.v1.kv_offload.tiering.base import TransferJob as TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager as FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager as CPUPrimaryTierOffloadingManager
from vllm.v1.kv_offload.tiering.manager import JobMetadata as JobMetadata
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager as TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec as TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource as CacheHitSource

from kvtriton._version import __version__ as KVTRITON_VERSION
from kvtriton.integrations._vllm_release import (
    ALLOW_UNTESTED_VLLM,
    TESTED_VLLM_RANGE,
    TESTED_VLLM_RELEASES,
    installed_vllm_version,
    tested_releases,
    vllm_release,
)

logger = logging.getLogger(__name__)


def vllm_configures_logging() -> bool:
    """vLLM's ``VLLM_CONFIGURE_LOGGING`` (its environment settings are read when asked), with its logging set-up defined."""
    importlib.import_module("vllm.logger")  # defines vLLM's logging set-up (applied when an engine starts)
    return bool(vllm_envs.VLLM_CONFIGURE_LOGGING)


# --- the release -------------------------------------------------------------------------------------------------

VLLM_VERSION: str = installed_vllm_version()
"""The installed vLLM's version."""

VLLM_RELEASE: tuple[int, int] | None = vllm_release(VLLM_VERSION)
"""Its ``(major, minor)``, None when the version string cannot be read."""


def check_vllm_release(spec_logger: logging.Logger = logger, environ: Mapping[str, str] = os.environ) -> None:
    """At spec construction: log kvtriton's and vLLM's versions; refuse an untested vLLM unless the operator insists.

    A vLLM outside :data:`TESTED_VLLM_RELEASES` raises ``RuntimeError`` with
    one line naming the installed version, the tested range and what to do,
    unless ``KVTRITON_ALLOW_UNTESTED_VLLM=1``: then it logs a WARNING and
    goes on (kvtriton follows the newest tested release's contract).
    """
    if VLLM_RELEASE in TESTED_VLLM_RELEASES:
        spec_logger.info(
            "kvtriton %s on vLLM %s (tested on vLLM %s)", KVTRITON_VERSION, VLLM_VERSION, tested_releases()
        )
        return
    problem = (
        f"kvtriton {KVTRITON_VERSION} is tested on vLLM {tested_releases()}, but vLLM {VLLM_VERSION} is "
        f"installed: install a tested release (pip install 'vllm{TESTED_VLLM_RANGE}') or a kvtriton that supports "
        f"vLLM {VLLM_VERSION}"
    )
    if environ.get(ALLOW_UNTESTED_VLLM) != "1":
        raise RuntimeError(f"{problem}; {ALLOW_UNTESTED_VLLM}=1 tries it anyway")
    spec_logger.warning("%s; starting anyway because %s=1: KV transfers may fail", problem, ALLOW_UNTESTED_VLLM)


# --- what differs between the supported releases, resolved once ----------------------------------------------------

_AT_LEAST_0_34 = VLLM_RELEASE is None or VLLM_RELEASE >= (0, 34)
"""vLLM 0.34's contract (or a newer or unreadable release, run only with ``KVTRITON_ALLOW_UNTESTED_VLLM``)."""

WORKER_GETS_DEVICE_POINTERS: bool = hasattr(vllm_base, "DevicePointers")
"""vLLM 0.34 hands a worker's ``submit_store``/``submit_load`` pre-resolved ``DevicePointers`` (one device address
per block and data reference) instead of a ``GPULoadStoreSpec`` of block ids (0.33)."""

FAILED_TRANSFERS_ARE_REPORTED: bool = _AT_LEAST_0_34
"""vLLM 0.34's connector takes a failed job from ``get_finished``: a failed store is dropped (not published), a failed
load is recomputed or fails the request as ``kv_load_failure_policy`` says. vLLM 0.33 asserts that every job
succeeds (and that ``submit_*`` returns True), so there a refused job can only stop the engine."""

MANAGER_HAS_TOUCH: bool = "touch" in vars(vllm_base.OffloadingManager)
"""vLLM 0.33's managers, tiers and ``CachePolicy`` have ``touch``; 0.34 removed it (recency comes with
``on_request_finished``)."""

STORE_OFFERS_COUNT_ONCE_PER_REQUEST: bool = _AT_LEAST_0_34
"""``store_threshold``: vLLM 0.34 counts a key's store offer once per request (a retry, or a re-offer after
preemption, is no new use of the content); 0.33 counts every offer."""

EVENTS_CARRY_REQ_CONTEXT: bool = "req_context" in {
    field.name for field in dataclasses.fields(vllm_base.OffloadingEvent)
}
"""vLLM 0.34's stored ``OffloadingEvent`` names the request that stored it (``req_context``)."""


def stored_event(keys: list[OffloadKey], medium: Medium, req_context: ReqContext | None) -> vllm_base.OffloadingEvent:
    """A host tier's event announcing ``keys`` stored, as the installed vLLM's CPU manager makes it.

    vLLM 0.34 (:data:`EVENTS_CARRY_REQ_CONTEXT`) names the request whose
    store completed (``req_context``: its events tracker builds the stored
    blocks' payload from it) and sets ``removal_expected`` (the tier will
    announce the keys' removal, so the tracker keeps the payload until then);
    vLLM 0.33's event has neither.
    """
    if not EVENTS_CARRY_REQ_CONTEXT:
        return vllm_base.OffloadingEvent(keys=keys, medium=medium, removed=False)
    provenance: dict[str, Any] = {"removal_expected": True, "req_context": req_context}  # 0.34's fields
    return vllm_base.OffloadingEvent(keys=keys, medium=medium, removed=False, **provenance)


PRIMARY_DEFERS_WRITE_RELEASE: bool = hasattr(CPUPrimaryTierOffloadingManager, "defer_write_release")
"""vLLM 0.34's orchestrator asks the primary tier to keep a failed promotion's chunks out of the free pool until the
secondary tier says its I/O can no longer write them (``defer_write_release``/``release_deferred_write``)."""

POLICY_MUST_FINISH_REQUESTS: bool = "on_request_finished" in CachePolicy.__abstractmethods__
"""vLLM 0.34's ``CachePolicy.on_request_finished`` is abstract (0.33's forwarded to ``touch``)."""

SECONDARY_TIERS_REFUSE_MULTI_NODE: bool = _AT_LEAST_0_34
"""vLLM 0.34 refuses secondary tiers on an engine whose workers span nodes: the tiers run in the engine core and
read only its node's host region."""


JOB_RESULTS_DEFER_RELEASE: bool = "deferred_release" in {field.name for field in dataclasses.fields(JobResult)}
"""vLLM 0.34's ``JobResult.deferred_release``: a failed promotion's primary chunks stay out of the free pool until
the tier sets the event (its I/O can no longer write them); vLLM 0.33 frees them as the job is reported."""


def failed_load_result(
    job_id: JobId, successful_keys: Collection[OffloadKey] | None, seconds: float, moved: int, released: threading.Event
) -> JobResult:
    """A failed promotion whose transfer may still write its slots: vLLM keeps them aside until ``released`` is set.

    Only where vLLM has the field (:data:`JOB_RESULTS_DEFER_RELEASE`); a tier
    on vLLM 0.33 must never hand vLLM a slot its I/O may still write.
    """
    if not JOB_RESULTS_DEFER_RELEASE:
        raise RuntimeError("this vLLM has no JobResult.deferred_release: a late write cannot be kept aside")
    deferred: dict[str, Any] = {"deferred_release": released}  # 0.34's field
    return JobResult(job_id, False, successful_keys, seconds, moved, **deferred)


LOOKUPS_MARK_PRESENT: bool = hasattr(AsyncLookupManager, "mark_present")
"""vLLM 0.34's ``AsyncLookupManager.mark_present``: a tier records the keys it has just stored as present, a verdict
newer than any probe in flight (0.33 has none: a verdict cached before the store stands until its requests end)."""


def mark_stored(lookups: AsyncLookupManager, keys: Collection[OffloadKey]) -> None:
    """Record in a tier's lookup cache that ``keys`` were just stored to the tier (scheduler thread only).

    vLLM 0.34's ``mark_present`` (:data:`LOOKUPS_MARK_PRESENT`), as vLLM's
    own ``fs`` and ``obj`` tiers call it when a store job succeeds: a MISS
    cached for a key (probed before its store landed, kept while a request
    that asked for it runs) and a probe still in flight give way to HIT, so
    the next request asking for the key promotes it instead of recomputing
    it. Nothing on vLLM 0.33, whose lookup cache has no such entry point.
    """
    if LOOKUPS_MARK_PRESENT:
        mark_present: Any = getattr(lookups, "mark_present")
        mark_present(keys)


REQ_CONTEXT_FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
REQ_CONTEXT_FACTORY = "_create_req_context"
"""The function of vLLM's connector scheduler that builds each request's ``ReqContext`` from its ``Request``."""


@dataclass(frozen=True, slots=True)
class RequestTenant:
    """The tenant of a request: its ``cache_salt`` (None: the shared tenant), on the request's ``ReqContext``.

    vLLM's ``ReqContext`` does not carry the salt, yet every job a tier gets
    names the context of the request it serves; :func:`install_tenant_hook`
    has vLLM's connector put this record on each context it builds, and
    :func:`request_tenant` reads it back (``ReqContext.get_state``).
    """

    cache_salt: str | None


def request_tenant(req_context: ReqContext) -> RequestTenant | None:
    """The tenant :func:`install_tenant_hook` recorded on ``req_context``; None for a context built without it (a
    peer's, a test's)."""
    return req_context.get_state(RequestTenant)


def install_tenant_hook() -> None:
    """Have vLLM's connector scheduler record each request's tenant (:class:`RequestTenant`) on its ``ReqContext``.

    Wraps the scheduler module's ``_create_req_context`` (the inventory's
    ``request_context_factory``; it takes the ``Request`` first on both
    releases) in this process, once; calling it again changes nothing. An
    encrypting spec calls it when it is built, in the engine core, before the
    connector builds any context. Raises ``RuntimeError`` when the installed
    vLLM has no such function, so encryption never starts without tenants.
    """
    module = importlib.import_module(REQ_CONTEXT_FACTORY_MODULE)
    original: Any = getattr(module, REQ_CONTEXT_FACTORY, None)
    if not callable(original):
        raise RuntimeError(
            f"vLLM {VLLM_VERSION} has no {REQ_CONTEXT_FACTORY_MODULE}.{REQ_CONTEXT_FACTORY}: kvtriton cannot learn "
            "each request's cache_salt, so it cannot encrypt per tenant; remove kvtriton_encryption or use a vLLM "
            f"kvtriton is tested on ({tested_releases()})"
        )
    if getattr(original, "kvtriton_tenant_hook", False):
        return

    def create_req_context(req: Any, *args: Any, **kwargs: Any) -> ReqContext:
        context = cast("ReqContext", original(req, *args, **kwargs))
        salt: object = getattr(req, "cache_salt", None)
        context.set_state(RequestTenant(salt if isinstance(salt, str) and salt else None))
        return context

    vars(create_req_context)["kvtriton_tenant_hook"] = True
    create_req_context.__wrapped__ = original  # pyright: ignore[reportFunctionMemberAccess] -- functools' convention
    setattr(module, REQ_CONTEXT_FACTORY, create_req_context)


def refuse_secondary_tiers_across_nodes() -> None:
    """vLLM's refusal of secondary tiers on an engine whose workers span nodes; nothing where vLLM has none (0.33).

    vLLM 0.34's ``TieringOffloadingSpec.create_worker`` runs it for an engine
    of several workers with secondary tiers: a collective over the TP, PP and
    PCP groups (so every rank must call it) that raises
    ``NotImplementedError`` when any group spans nodes
    (:data:`SECONDARY_TIERS_REFUSE_MULTI_NODE`; the inventory's
    ``multi_node_refusal``).
    """
    if not SECONDARY_TIERS_REFUSE_MULTI_NODE:
        return
    tiering_spec = importlib.import_module("vllm.v1.kv_offload.tiering.spec")
    refuse: Any = getattr(tiering_spec, MULTI_NODE_REFUSAL)
    refuse()


@runtime_checkable
class DevicePointers(Protocol):
    """What vLLM 0.34's ``DevicePointers`` carries, typed the same on either release (0.33 has no such class).

    Flat arrays in vLLM's canonical order: for each group, for each of its
    data references, for each of the group's blocks, one address and size.
    """

    @property
    def ptrs(self) -> npt.NDArray[Any]: ...
    @property
    def sizes(self) -> npt.NDArray[Any]: ...
    @property
    def group_block_counts(self) -> tuple[int, ...]: ...
    @property
    def group_data_ref_counts(self) -> tuple[int, ...]: ...
    @property
    def block_indices(self) -> tuple[int, ...]: ...


DeviceSide = vllm_base.GPULoadStoreSpec | DevicePointers
"""The device side of a transfer job as the installed vLLM hands it: block ids (0.33) or resolved pointers (0.34)."""

_STORE_PARAMETERS = inspect.signature(vllm_base.OffloadingWorker.submit_store)
_LOAD_PARAMETERS = inspect.signature(vllm_base.OffloadingWorker.submit_load)


def _bound(signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:]


def store_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[int, DeviceSide, vllm_base.LoadStoreSpec]:
    """``submit_store``'s ``(job_id, device side, slot spec)``, bound to the installed vLLM's own signature.

    The worker's override takes ``*args, **kwargs`` because the releases name
    the device-side parameter differently (``src_spec`` in 0.33,
    ``device_ptrs`` in 0.34); a bad call raises vLLM's own ``TypeError``.
    """
    job_id, device, slots = _bound(_STORE_PARAMETERS, args, kwargs)
    return job_id, device, slots


def load_arguments(
    args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[int, vllm_base.LoadStoreSpec, DeviceSide, bool]:
    """``submit_load``'s ``(job_id, slot spec, device side, expedited)``, bound as :func:`store_arguments` says."""
    job_id, slots, device, expedited = _bound(_LOAD_PARAMETERS, args, kwargs)
    return job_id, slots, device, expedited


# --- vLLM's private names -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VLLMPrivateName:
    """One vLLM name kvtriton relies on outside vLLM's public interface."""

    key: str
    """A short name for the entry (the test checks each key once)."""
    name: str
    """The dotted vLLM name (``module.Class.attribute``), or what kvtriton relies on when it is no single name."""
    used_by: str
    """The kvtriton module that relies on it."""
    why: str
    """Why kvtriton needs it, and what it would break."""


RESTATED_TIERING_SPEC_ATTRIBUTES: tuple[str, ...] = (
    "num_chunks",
    "kv_bytes_per_chunk",
    "cpu_page_size_per_worker",
    "cpu_info",
    "replicated_layout",
    "secondary_tier_configs",
    "tier_poll_interval_s",
    "_manager",
)
"""Attributes vLLM's ``TieringOffloadingSpec`` (and its ``CPUOffloadingSpec`` parent) set, which kvtriton's tiered
spec restates or reads."""

TIER_CLASS_REFUSED: type[Exception] = AssertionError
"""What ``SecondaryTierFactory.get_tier_class`` raises for a ``module_path`` class that is no ``SecondaryTierManager``."""

FACTORY_ARGUMENTS = frozenset({"self", "offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"})
"""A tier constructor's parameters vLLM's ``SecondaryTierFactory`` fills itself (not keys of the tier's config)."""

MULTI_NODE_REFUSAL = "_reject_workers_across_nodes"
"""vLLM 0.34's function in ``vllm.v1.kv_offload.tiering.spec`` that refuses secondary tiers across nodes."""

FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys of a tier's config vLLM's ``SecondaryTierFactory`` consumes before calling the constructor."""


VLLM_PRIVATE_NAMES: tuple[VLLMPrivateName, ...] = (
    VLLMPrivateName(
        "policy_registry",
        "vllm.v1.kv_offload.cpu.policies.factory.CachePolicyFactory._registry",
        "kvtriton.integrations.vllm._config",
        "the names of vLLM's registered eviction policies (no public list): a policy name kvtriton leaves to vLLM "
        "is refused at start-up unless vLLM resolves it",
    ),
    VLLMPrivateName(
        "secondary_tiers_hook",
        "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec._get_secondary_tiers",
        "kvtriton.integrations.vllm._tiered_spec",
        "overridden, so that a bad secondary_tiers entry (missing package, unknown key, wrong class) is one line "
        "naming the tier instead of vLLM's bare error",
    ),
    VLLMPrivateName(
        "primary_num_chunks",
        "vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager reads primary_tier._num_chunks",
        "kvtriton.integrations.vllm._tiered_spec",
        "KVTritonPrimaryTier sets _num_chunks: the orchestrator sizes its occupancy metrics from it",
    ),
    VLLMPrivateName(
        "restated_spec_attributes",
        "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec attributes "
        + ", ".join(RESTATED_TIERING_SPEC_ATTRIBUTES),
        "kvtriton.integrations.vllm._tiered_spec",
        "set by vLLM's parents from vLLM's own region layout; kvtriton's spec restates them for its own layout "
        "(RESTATED_TIERING_SPEC_ATTRIBUTES), and vLLM's tiers and metrics read them",
    ),
    VLLMPrivateName(
        "tier_class_assertion",
        "vllm.v1.kv_offload.tiering.factory.SecondaryTierFactory.get_tier_class raises AssertionError",
        "kvtriton.integrations.vllm._tier_configs",
        "vLLM asserts that an out-of-tree tier class is a SecondaryTierManager: kvtriton catches it "
        "(TIER_CLASS_REFUSED) to name the tier",
    ),
    VLLMPrivateName(
        "tier_factory_arguments",
        "vllm.v1.kv_offload.tiering.factory.SecondaryTierFactory.create_secondary_tier arguments and keys",
        "kvtriton.integrations.vllm._tier_configs",
        "the constructor arguments the factory fills itself (FACTORY_ARGUMENTS) and the tier keys it consumes "
        "(FACTORY_KEYS): kvtriton checks the rest of a tier's keys against the tier's constructor",
    ),
    VLLMPrivateName(
        "model_name_namespace",
        "vllm.v1.kv_offload.file_mapper.FileMapper names storage after config.model.name",
        "kvtriton.integrations.vllm._tiered_spec",
        "kvtriton rewrites the model name the secondary tiers see (with_model_name) to give its own chunk bytes "
        "a namespace of their own",
    ),
    VLLMPrivateName(
        "primary_region_methods",
        "vllm.v1.kv_offload.tiering.manager.CPUPrimaryTierOffloadingManager reads mmap_region "
        "create_kv_memoryview and cleanup",
        "kvtriton.integrations.vllm._tiered_spec",
        "vLLM's own primary runs over kvtriton's shared region (a vLLM eviction policy), seen through an object "
        "with only these two methods",
    ),
    VLLMPrivateName(
        "promotion_hooks",
        "vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager._complete_promotion(job_metadata, "
        "completed_job) and _initiate_promotion(tier_idx, key, req_context) -> bool",
        "kvtriton.integrations.vllm._sealed_tiering",
        "overridden: a promoted chunk is verified before vLLM marks its slot ready (a faulty key leaves the job's "
        "successful_keys), and a key that failed is not promoted from that tier again (False: a miss)",
    ),
    VLLMPrivateName(
        "multi_node_refusal",
        f"vllm.v1.kv_offload.tiering.spec.{MULTI_NODE_REFUSAL} (vLLM 0.34; absent from 0.33), which "
        "TieringOffloadingSpec.create_worker calls",
        "kvtriton.integrations.vllm._tiered_spec",
        "kvtriton's tiered spec overrides get_worker, so it runs vLLM's own refusal of secondary tiers on workers "
        "that span nodes (refuse_secondary_tiers_across_nodes) where vLLM's create_worker would",
    ),
    VLLMPrivateName(
        "connector_vllm_config",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector.__init__(vllm_config, "
        "role, kv_cache_config) builds the spec",
        "kvtriton.integrations.vllm._surface",
        "the spec's OffloadingConfig lacks the model dtype and revision; connector_vllm_config reads them from the "
        "constructor's vllm_config argument, so that the engine core (which builds its connector outside "
        "set_current_vllm_config) and the workers compute one identity",
    ),
    VLLMPrivateName(
        "backpressure_class_import",
        "vllm.v1.kv_offload.tiering.factory._import_class and _DEFAULT_PACKAGE",
        "kvtriton.integrations.vllm._surface",
        "how vLLM's tier factory resolves backpressure_cls and policy_cls (a short name in its backpressure module, "
        "a dotted one as module.Class): backpressure_class_problem resolves them the same way at start-up, so a "
        "bad one is one line naming the key instead of a raw AttributeError from the scheduler",
    ),
    VLLMPrivateName(
        "request_context_factory",
        f"{REQ_CONTEXT_FACTORY_MODULE}.{REQ_CONTEXT_FACTORY}(req, ...) builds every request's ReqContext",
        "kvtriton.integrations.vllm._surface",
        "with kvtriton_encryption, install_tenant_hook wraps it to record the request's cache_salt on the context "
        "(RequestTenant), from which a tier picks the tenant's key for each job",
    ),
    VLLMPrivateName(
        "fs_file_mapper",
        "vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager.file_mapper",
        "kvtriton.integrations.vllm._sealed_tiering",
        "the file of a chunk that failed its seal check is removed (as vLLM's fs tier removes one cut short), so "
        "the next cascade writes it afresh instead of skipping a file that exists",
    ),
)
"""The inventory, one entry per name; the test checks each against the installed vLLM."""


def registered_cache_policies() -> list[str]:
    """The eviction policy names vLLM's ``CachePolicyFactory`` has registered, sorted (vLLM has no public list)."""
    return sorted(CachePolicyFactory._registry)  # pyright: ignore[reportPrivateUsage] -- the inventory's first entry


def connector_vllm_config() -> VllmConfig | None:
    """The ``VllmConfig`` the offloading connector now being built was given, else vLLM's current one; None if neither.

    vLLM builds the offloading spec inside ``OffloadingConnector.__init__``
    from an ``OffloadingConfig`` that lacks the model's dtype and revision.
    The workers build their connector under ``set_current_vllm_config``; the
    engine core builds its scheduler's connector without it. The constructor's
    own ``vllm_config`` argument, read from its frame on the call stack, is
    the same object in both roles, so both compute one identity from it. The
    current config is the answer for a spec built outside a connector.
    """
    constructor = OffloadingConnector.__init__.__code__
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_code is not constructor:
            frame = frame.f_back
        argument: object = frame.f_locals.get("vllm_config") if frame is not None else None
    finally:
        del frame  # a frame held in a local keeps the stack alive (the inspect module's advice)
    return argument if isinstance(argument, VllmConfig) else get_current_vllm_config_or_none()


def backpressure_class_problem(name: object, base: type[BackpressureDetector] | type[BackpressurePolicy]) -> str | None:
    """Why vLLM's tier factory could not build ``name`` (a ``backpressure_cls`` or ``policy_cls``) as a ``base``.

    None when it can. The name is resolved as the factory resolves it: a
    short name in vLLM's backpressure module, a dotted one as
    ``module.Class``. The answer lists the short names that would do.
    """
    default_module: str = vllm_tier_factory._DEFAULT_PACKAGE  # pyright: ignore[reportPrivateUsage] -- inventoried above
    choices = sorted(
        value.__name__
        for value in vars(vllm_backpressure).values()
        if isinstance(value, type) and issubclass(value, base) and not inspect.isabstract(value)
    )
    hint = f"a short name from {default_module} ({', '.join(choices)}) or a dotted module.Class"
    if not isinstance(name, str) or not name:
        return f"must be {hint}, got {type(name).__name__} {name!r}"
    try:
        found = vllm_tier_factory._import_class(name)  # pyright: ignore[reportPrivateUsage] -- inventoried above
    except (ImportError, AttributeError, ValueError) as error:
        return f"names no class vLLM can import ({type(error).__name__}: {error}); use {hint}"
    if not inspect.isclass(found) or not issubclass(found, base):
        return f"is {found!r}, not a {base.__name__}; use {hint}"
    return None


def with_model_name(config: OffloadingConfig, name: str) -> OffloadingConfig:
    """``config`` with another model name: the name vLLM's ``FileMapper`` (and the other tiers) file chunks under."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, name=name))
