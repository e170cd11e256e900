"""vLLM's scheduler-side ``OffloadingManager``, answered by kvtriton's managers.

vLLM's OffloadingConnector calls this object (under ``manager.lock``, from the
scheduler thread only); every call is forwarded to a kvtriton
``OffloadingManager`` -- a ``CPUOffloadingManager``, wrapped by
``FilterReusedOffloadingManager`` when a reuse threshold is set -- with the
values converted at the boundary:

* keys: both sides use the same bytes (block hash + 4-byte big-endian group
  index), so keys pass through unchanged;
* request contexts: one kvtriton ``ReqContext`` per vLLM request, kept in the
  vLLM context's per-request state;
* lookup results, specs and events: mapped to vLLM's classes on the way out
  (vLLM's worker side receives vLLM's ``CPULoadStoreSpec``);
* recency: vLLM 0.33's connector never calls ``touch``; it records each
  key's token position in its context and brackets a request's calls with
  ``on_new_request`` / ``on_request_finished``. Both hooks are forwarded, and
  the kvtriton context reads vLLM's positions, so the manager ranks a
  request's keys head first when it stores and when it finishes, and ARC
  counts one reuse per request (see ``kvtriton.manager.request_access``);
* failed stores: reported as a ``metadata_only`` removal event, as vLLM 0.33
  does, so its ``OffloadingEventsTracker`` drops the payload it recorded.

Lookups are the hottest call (one per chunk of every scheduled prompt), so
when no filter sits in between, the adapter's ``lookup`` is replaced, per
instance, by the ``CPUOffloadingManager``'s own lookup answering vLLM's
``LookupResult`` (``CPUOffloadingManager.lookup_with``): one call, no
translation. The other calls take the same shortcut there: the completions
are the CPU manager's own (they never read a context), and the prepares
build vLLM's spec and output straight from the slot lists the CPU manager
answers (``load_slots`` / ``store_slots``), with no kvtriton object between.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, cast

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtriton.keys import OffloadKey
from kvtriton.manager import CPUOffloadingManager, OffloadingManager
from kvtriton.specs import CPULoadStoreSpec, LoadStoreSpec, LookupResult, OffloadingEvent, ReqContext

__all__ = ["VLLMOffloadingManager", "gauge_definitions"]

_LOOKUP_RESULTS: dict[LookupResult, vllm_base.LookupResult] = {
    LookupResult.MISS: vllm_base.LookupResult.MISS,
    LookupResult.HIT: vllm_base.LookupResult.HIT,
    LookupResult.HIT_PENDING: vllm_base.LookupResult.HIT_PENDING,
}
_CHUNK_LEVEL = vllm_base.OffloadPolicy.CHUNK_LEVEL


def gauge_definitions() -> dict[str, vllm_base.OffloadingMetricMetadata]:
    """The Prometheus gauges :meth:`VLLMOffloadingManager.get_stats` sets (vLLM's CPU tier names)."""
    return {
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation=(
                "Fraction of kvtriton host-slab slots pinned by transfers in flight "
                "(0.0 = idle, 1.0 = saturated: new stores are dropped)."
            ),
        ),
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation="Fraction of kvtriton host-slab slots held by stores that have not completed.",
        ),
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation="Fraction of kvtriton host-slab slots held by loads that have not completed.",
        ),
    }


class _StoreAnswer(Protocol):
    """kvtriton's ``PrepareStoreOutput`` with its keys typed as vLLM's (the same bytes)."""

    @property
    def keys_to_store(self) -> list[vllm_base.OffloadKey]: ...
    @property
    def store_spec(self) -> LoadStoreSpec: ...
    @property
    def evicted_keys(self) -> list[vllm_base.OffloadKey]: ...


class _VLLMStoredSlots(Protocol):
    """kvtriton's ``StoredSlots`` with its keys typed as vLLM's (the same bytes)."""

    @property
    def keys(self) -> list[vllm_base.OffloadKey]: ...
    @property
    def slots(self) -> list[int]: ...
    @property
    def evicted(self) -> list[vllm_base.OffloadKey]: ...


class _VLLMKeyedManager(Protocol):
    """A kvtriton manager seen with vLLM's key type: one cast at construction instead of one per call."""

    def lookup(self, key: vllm_base.OffloadKey, req_context: ReqContext, /) -> LookupResult: ...
    def prepare_load(self, keys: Collection[vllm_base.OffloadKey], req_context: ReqContext, /) -> LoadStoreSpec: ...
    def touch(self, keys: Collection[vllm_base.OffloadKey], req_context: ReqContext, /) -> None: ...
    def complete_load(self, keys: Collection[vllm_base.OffloadKey], req_context: ReqContext, /) -> None: ...
    def prepare_store(self, keys: Collection[vllm_base.OffloadKey], req_context: ReqContext, /) -> _StoreAnswer | None: ...
    def complete_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: ReqContext, success: bool = True, /
    ) -> None: ...


def _vllm_keys(keys: list[OffloadKey]) -> list[vllm_base.OffloadKey]:
    return cast("list[vllm_base.OffloadKey]", keys)


def _slot_spec(spec: LoadStoreSpec) -> VLLMCPULoadStoreSpec:
    """kvtriton's slot spec as vLLM's ``CPULoadStoreSpec`` (what vLLM's worker side receives)."""
    if type(spec) is not CPULoadStoreSpec and not isinstance(spec, CPULoadStoreSpec):
        raise TypeError(f"the kvtriton manager returned a {type(spec).__name__}, expected a CPULoadStoreSpec")
    return VLLMCPULoadStoreSpec(spec.slot_list())


class VLLMOffloadingManager(vllm_base.OffloadingManager):
    """vLLM's manager interface over a kvtriton manager (see the module docstring).

    ``backing`` answers every call; ``cpu`` is the ``CPUOffloadingManager`` at
    the bottom of it (``backing`` itself when no filter wraps it), read for
    occupancy gauges. ``info`` fills vLLM's ``kv_offload_config_info`` metric.
    """

    def __init__(
        self,
        backing: OffloadingManager,
        cpu: CPUOffloadingManager,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        self._backing = backing
        self._cpu = cpu
        self._info: vllm_base.ConfigInfoMapping = info.as_config_info() if info is not None else {}
        # vLLM's events tracker expects a metadata-only removal for every failed store.
        cpu.report_dropped_stores = True
        # Both key types are NewTypes of the same bytes with the same encoding:
        # the casts rename types once here, nothing is converted per call.
        self._calls = cast(_VLLMKeyedManager, backing)
        if backing is cpu:
            # The hottest call (one per chunk of every scheduled prompt): the
            # instance's lookup becomes the CPU manager's own, answering
            # vLLM's LookupResult, so vLLM's call costs one Python frame.
            direct = cpu.lookup_with(
                vllm_base.LookupResult.MISS, vllm_base.LookupResult.HIT, vllm_base.LookupResult.HIT_PENDING
            )
            setattr(self, "lookup", direct)  # noqa: B010 -- an instance attribute shadowing the method is the point
            # The CPU manager's completions never read the context: vLLM's calls go straight to them.
            setattr(self, "complete_load", cpu.complete_load)  # noqa: B010 -- as above
            setattr(self, "complete_store", cpu.complete_store)  # noqa: B010 -- as above
            load_slots = cast("Callable[[Collection[vllm_base.OffloadKey], ReqContext], list[int]]", cpu.load_slots)
            store_slots = cast("Callable[[Collection[vllm_base.OffloadKey], ReqContext], _VLLMStoredSlots | None]", cpu.store_slots)
            context_of = self._context
            output = vllm_base.PrepareStoreOutput

            def prepare_load(keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> VLLMCPULoadStoreSpec:
                context = req_context.get_state(ReqContext)
                return VLLMCPULoadStoreSpec(load_slots(keys, context if context is not None else context_of(req_context)))

            def prepare_store(
                keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
            ) -> vllm_base.PrepareStoreOutput | None:
                context = req_context.get_state(ReqContext)
                stored = store_slots(keys, context if context is not None else context_of(req_context))
                if stored is None:
                    return None
                return output(stored.keys, VLLMCPULoadStoreSpec(stored.slots), stored.evicted)

            cpu_new, cpu_finished = cpu.on_new_request, cpu.on_request_finished
            request_offloading_context = vllm_base.RequestOffloadingContext

            def on_new_request(req_context: vllm_base.ReqContext) -> vllm_base.RequestOffloadingContext:
                context = req_context.get_state(ReqContext)
                cpu_new(context if context is not None else context_of(req_context))
                return request_offloading_context(policy=_CHUNK_LEVEL)

            def on_request_finished(req_context: vllm_base.ReqContext) -> None:
                # A request never announced has no kvtriton context and nothing to rank.
                context = req_context.get_state(ReqContext)
                if context is not None:
                    cpu_finished(context)

            setattr(self, "prepare_load", prepare_load)  # noqa: B010 -- as above
            setattr(self, "prepare_store", prepare_store)  # noqa: B010 -- as above
            setattr(self, "on_new_request", on_new_request)  # noqa: B010 -- as above
            setattr(self, "on_request_finished", on_request_finished)  # noqa: B010 -- as above

    @property
    def backing(self) -> OffloadingManager:
        """The kvtriton manager every call goes to."""
        return self._backing

    @property
    def cpu(self) -> CPUOffloadingManager:
        """The ``CPUOffloadingManager`` that owns the slots (below the reuse filter, if any)."""
        return self._cpu

    @staticmethod
    def _context(req_context: vllm_base.ReqContext) -> ReqContext:
        """The kvtriton context of ``req_context``'s request, built on first use and kept in its state."""
        context = req_context.get_state(ReqContext)
        if context is None:
            context = ReqContext(
                req_id=req_context.req_id,
                kv_transfer_params=req_context.kv_transfer_params,
                position_of=_position_reader(req_context),
            )
            req_context.set_state(context)
        return context

    @override
    def on_new_request(self, req_context: vllm_base.ReqContext) -> vllm_base.RequestOffloadingContext:
        self._backing.on_new_request(self._context(req_context))
        # Chunk level: store newly computed chunks only (what vLLM's CPU tier does).
        return vllm_base.RequestOffloadingContext(policy=_CHUNK_LEVEL)

    @override
    def on_request_finished(self, req_context: vllm_base.ReqContext) -> None:
        self._backing.on_request_finished(self._context(req_context))

    @override
    def lookup(self, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext) -> vllm_base.LookupResult:
        # Shadowed per instance when no filter wraps the CPU manager (see __init__).
        return _LOOKUP_RESULTS[self._calls.lookup(key, self._context(req_context))]

    @override
    def get_load_source(self, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    @override
    def prepare_load(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.LoadStoreSpec:
        return _slot_spec(self._calls.prepare_load(keys, self._context(req_context)))

    @override
    def touch(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> None:
        self._calls.touch(keys, self._context(req_context))

    @override
    def complete_load(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> None:
        self._calls.complete_load(keys, self._context(req_context))

    @override
    def prepare_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.PrepareStoreOutput | None:
        output = self._calls.prepare_store(keys, self._context(req_context))
        if output is None:
            return None
        return vllm_base.PrepareStoreOutput(
            keys_to_store=output.keys_to_store,
            store_spec=_slot_spec(output.store_spec),
            evicted_keys=output.evicted_keys,
        )

    @override
    def complete_store(
        self,
        keys: Collection[vllm_base.OffloadKey],
        req_context: vllm_base.ReqContext,
        success: bool = True,
    ) -> None:
        self._calls.complete_store(keys, self._context(req_context), success)

    @override
    def take_events(self) -> Iterable[vllm_base.OffloadingEvent]:
        return [_vllm_event(event) for event in self._backing.take_events()]

    @override
    def reset_cache(self) -> None:
        self._backing.reset_cache()

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """Occupancy gauges of the host slab, under vLLM's CPU tier metric names."""
        snapshot = self._cpu.stats()
        capacity = snapshot.capacity
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (snapshot.pending + snapshot.loading) / capacity)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, snapshot.pending / capacity)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, snapshot.loading / capacity)
        return stats

    @override
    def config_info(self) -> Sequence[vllm_base.ConfigInfoMapping]:
        return [self._info]

    @override
    def shutdown(self) -> None:
        self._backing.shutdown()


def _position_reader(req_context: vllm_base.ReqContext) -> Callable[[OffloadKey], int | None]:
    """Read the token positions vLLM's scheduler records in ``req_context`` (its keys are ours).

    vLLM 0.33 keeps them in a dict behind ``get_offload_key_position``;
    reading the dict's ``get`` directly spares a Python call per key when a
    finished request's keys are ordered. Any other layout goes through the
    public getter.
    """
    positions: object = getattr(req_context, "_offload_key_positions", None)
    if type(positions) is dict:
        return cast("dict[OffloadKey, int]", positions).get
    return cast("Callable[[OffloadKey], int | None]", req_context.get_offload_key_position)


def _vllm_event(event: OffloadingEvent) -> vllm_base.OffloadingEvent:
    return vllm_base.OffloadingEvent(
        keys=_vllm_keys(event.keys),
        medium=vllm_base.Medium(event.medium),
        removed=event.removed,
        metadata_only=event.metadata_only,
    )
