"""vLLM's scheduler-side ``OffloadingManager``, answered by kvtriton's managers.

vLLM's OffloadingConnector calls this object (under ``manager.lock``, from the
scheduler thread only); every call is forwarded to a kvtriton
``OffloadingManager`` -- a ``CPUOffloadingManager``, wrapped by
``FilterReusedOffloadingManager`` when a reuse threshold is set -- with the
values converted at the boundary:

* keys: both sides use the same bytes (block hash + 4-byte big-endian group
  index), so keys pass through unchanged;
* request contexts: vLLM's ``ReqContext`` itself. kvtriton's manager reads a
  context only through ``get_offload_key_position`` (the token positions
  vLLM's scheduler records), ``get_state`` and ``set_state`` (where it keeps
  its record of the request), which vLLM's context has, so nothing is
  copied or wrapped;
* recency: vLLM's connector never calls ``touch`` (0.34 removed it from the
  interface, and so does this adapter there: :data:`MANAGER_HAS_TOUCH`); the
  manager ranks a request's keys by their token positions from its first
  load or store and commits them at ``on_request_finished``, exactly as
  vLLM's CPU manager does, whether or not ``on_new_request`` came first
  (vLLM's tiering orchestrator never passes it on to its primary tier);
* ``store_threshold``: the reuse filter (:func:`reuse_filter`) counts store
  offers as the installed vLLM does (:data:`STORE_OFFER_SIGNAL`);
* lookup results, specs and events: mapped to vLLM's classes on the way out
  (vLLM's worker side receives vLLM's ``CPULoadStoreSpec``);
* completions: ``complete_store`` follows vLLM's rule (keys without a store
  in flight are skipped: ``CPUOffloadingManager.complete_store`` with
  ``skip_without_store=True``);
  a failed store is reported as a ``metadata_only`` removal event, as vLLM
  does, so its ``OffloadingEventsTracker`` drops the payload it recorded; on
  vLLM 0.34 a stored event names the request whose store completed and
  expects the keys' removal (``req_context``, ``removal_expected``:
  :func:`~kvtriton.integrations.vllm._surface.stored_event`);
* metrics: vLLM's CPU tier metrics under vLLM's names (:func:`metric_definitions`
  declares them for the spec, :meth:`VLLMOffloadingManager.get_stats`
  reports them), a true occupancy gauge beside them, and every
  ``summary_interval_s`` of activity one ``kvtriton summary:`` log line.

Each method is one forward and one conversion: the code below is the code
that runs.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol, cast

from typing_extensions import override

from kvtriton._byte_units import format_bytes
from kvtriton._keys import OffloadKey
from kvtriton._offload_types import CPULoadStoreSpec, LoadStoreSpec, LookupResult, OffloadingEvent
from kvtriton.integrations.vllm._config import DEFAULT_SUMMARY_INTERVAL_S, declares_reuse_filter
from kvtriton.integrations.vllm._surface import (
    MANAGER_HAS_TOUCH,
    STORE_OFFERS_COUNT_ONCE_PER_REQUEST,
    CacheHitSource,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
    OffloadingConnectorStats,
    stored_event,
    vllm_base,
)
from kvtriton.integrations.vllm._surface import (
    CPULoadStoreSpec as VLLMCPULoadStoreSpec,
)
from kvtriton.manager import (
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    ManagerStats,
    OffloadingManager,
    ReuseSignal,
)

logger = logging.getLogger(__name__)

CPU_CACHE_OCCUPANCY_PERC = "vllm:kv_offload_cpu_cache_occupancy_perc"
"""kvtriton's gauge of the slots holding a block; under ``vllm:`` so ``LLM.get_metrics()`` returns it too."""

# kvtriton's lookup answers and vLLM's, as module names: the adapter's lookup compares and returns them
# without an enum attribute lookup or an enum hash (a Python-level __hash__).
_MISS, _HIT = LookupResult.MISS, LookupResult.HIT
_VLLM_MISS, _VLLM_HIT, _VLLM_HIT_PENDING = (
    vllm_base.LookupResult.MISS,
    vllm_base.LookupResult.HIT,
    vllm_base.LookupResult.HIT_PENDING,
)
_CHUNK_LEVEL = vllm_base.OffloadPolicy.CHUNK_LEVEL

_ALLOCATION_SIZE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""vLLM 0.33's buckets for ``kv_offload_cpu_allocation_size`` (its ``CPUOffloadingSpec``)."""


def metric_definitions(
    extra_config: Mapping[str, object] | None = None,
) -> dict[str, vllm_base.OffloadingMetricMetadata]:
    """The metrics :meth:`VLLMOffloadingManager.get_stats` reports, for the spec's ``build_metric_definitions``.

    vLLM 0.33's CPU tier metrics with its names, types, buckets and meaning,
    the ``stores_skipped`` counter only when ``extra_config`` sets
    ``store_threshold >= 2`` (as vLLM's ``CPUOffloadingSpec`` declares it),
    plus kvtriton's occupancy gauge. vLLM's Prometheus logger refuses a
    metric nobody declared, so the spec must declare exactly these.
    """
    definitions: dict[str, vllm_base.OffloadingMetricMetadata] = {
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation=(
                "Fraction of kvtriton host-slab slots pinned by transfers in flight, stores and loads "
                "(0.0 = idle, 1.0 = saturated: new stores are dropped). Counts slots held by transfers, as "
                "vLLM's CPU tier does, not slots holding data: see "
                f"{CPU_CACHE_OCCUPANCY_PERC} for that."
            ),
        ),
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation="Fraction of kvtriton host-slab slots held by stores that have not completed.",
        ),
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation="Fraction of kvtriton host-slab slots held by loads that have not completed.",
        ),
        CPU_CACHE_OCCUPANCY_PERC: vllm_base.OffloadingGaugeMetadata(
            documentation=(
                "Fraction of kvtriton host-slab slots holding a chunk (stored, or being stored): 1.0 once the "
                "cache has filled up, after which every new store evicts."
            ),
        ),
        CPUOffloadingMetrics.CPU_ALLOCATION_SIZE: vllm_base.OffloadingHistogramMetadata(
            documentation="Histogram of the number of CPU chunks requested by each KV offload prepare_store call.",
            buckets=_ALLOCATION_SIZE_BUCKETS,
        ),
    }
    if extra_config is not None and declares_reuse_filter(extra_config):
        definitions[CPUOffloadingMetrics.STORES_SKIPPED] = vllm_base.OffloadingCounterMetadata(
            documentation="Number of KV offload stores skipped because the reuse threshold was not reached.",
        )
    return definitions


STORE_OFFER_SIGNAL: ReuseSignal = (
    ReuseSignal.STORE_OFFER_PER_REQUEST if STORE_OFFERS_COUNT_ONCE_PER_REQUEST else ReuseSignal.STORE_OFFER
)
"""What counts as one use toward ``store_threshold`` on the installed vLLM: a store offer, as vLLM's CPU manager
counts it (each offer on 0.33; each request's first offer of a key on 0.34). Never a lookup: vLLM's connector looks
keys up only until the first miss, so lookup counting would admit a repeated prompt one chunk per repeat."""


def reuse_filter(
    cpu: CPUOffloadingManager, store_threshold: int, max_tracker_size: int
) -> FilterReusedOffloadingManager:
    """The reuse filter over ``cpu`` for ``store_threshold >= 2``, counting as the installed vLLM counts (:data:`STORE_OFFER_SIGNAL`)."""
    return FilterReusedOffloadingManager(cpu, store_threshold, max_tracker_size, count_on=STORE_OFFER_SIGNAL)


class _StoreAnswer(Protocol):
    """kvtriton's ``PrepareStoreOutput`` with its keys typed as vLLM's (the same bytes)."""

    @property
    def keys_to_store(self) -> list[vllm_base.OffloadKey]: ...
    @property
    def store_spec(self) -> LoadStoreSpec: ...
    @property
    def evicted_keys(self) -> list[vllm_base.OffloadKey]: ...


class _VLLMKeyedManager(Protocol):
    """A kvtriton manager seen with vLLM's key and context types: one cast at construction instead of one per call.

    Keys are the same bytes under two NewTypes; a kvtriton manager reads a
    context only through the methods vLLM's ``ReqContext`` has (see the module
    docstring).
    """

    def on_new_request(self, req_context: vllm_base.ReqContext, /) -> None: ...
    def on_request_finished(self, req_context: vllm_base.ReqContext, /) -> None: ...
    def lookup(self, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext, /) -> LookupResult: ...
    def prepare_load(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, /
    ) -> LoadStoreSpec: ...
    def touch(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, /) -> None: ...
    def complete_load(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, /) -> None: ...
    def prepare_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, /
    ) -> _StoreAnswer | None: ...


class _VLLMKeyedCPU(_VLLMKeyedManager, Protocol):
    """``CPUOffloadingManager`` seen the same way, with the completion the adapter calls."""

    def complete_store(
        self,
        keys: Collection[vllm_base.OffloadKey],
        req_context: vllm_base.ReqContext,
        success: bool = True,
        /,
        *,
        skip_without_store: bool = False,
    ) -> None: ...
    def hold_failed_stores(self, keys: Collection[vllm_base.OffloadKey], /) -> list[int]: ...


def _vllm_keys(keys: list[OffloadKey]) -> list[vllm_base.OffloadKey]:
    return cast("list[vllm_base.OffloadKey]", keys)


def _slot_spec(spec: LoadStoreSpec) -> VLLMCPULoadStoreSpec:
    """kvtriton's slot spec as vLLM's ``CPULoadStoreSpec`` (what vLLM's worker side receives)."""
    if not isinstance(spec, CPULoadStoreSpec):
        raise TypeError(f"the kvtriton manager returned a {type(spec).__name__}, expected a CPULoadStoreSpec")
    return VLLMCPULoadStoreSpec(spec.slot_list())


class VLLMOffloadingManager(vllm_base.OffloadingManager):
    """vLLM's manager interface over a kvtriton manager (see the module docstring).

    ``backing`` answers every call; ``cpu`` is the ``CPUOffloadingManager`` at
    the bottom of it (``backing`` itself when no filter wraps it), read for
    occupancy gauges. ``info`` fills vLLM's ``kv_offload_config_info`` metric
    and sizes the summary's bytes. Every ``summary_interval_s`` seconds of
    activity (checked when a request finishes; 0 turns it off) one
    ``kvtriton summary:`` line is logged at INFO: lookups and hits, chunks and
    bytes loaded and stored, evictions and occupancy since the last line.
    """

    reports_occupancy = True
    """Whether :meth:`get_stats` sets the occupancy gauge (only a spec that declares it may: see :func:`metric_definitions`)."""

    def __init__(
        self,
        backing: OffloadingManager,
        cpu: CPUOffloadingManager,
        info: CPUOffloadingInfo | None = None,
        *,
        summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
    ) -> None:
        if isinstance(summary_interval_s, bool) or not isinstance(summary_interval_s, (int, float)):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(f"summary_interval_s must be a number of seconds, got {summary_interval_s!r}")
        if summary_interval_s < 0:
            raise ValueError(f"summary_interval_s must be >= 0 (0 turns the summary off), got {summary_interval_s}")
        self._backing = backing
        self._cpu = cpu
        self._info: vllm_base.ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._bytes_per_chunk = (
            info.cpu_kv_cache_size_bytes / info.cpu_num_chunks if info is not None and info.cpu_num_chunks else 0.0
        )
        self._filter = backing if isinstance(backing, FilterReusedOffloadingManager) else None
        self._stores_skipped_reported = 0
        self._summary_interval_s = float(summary_interval_s)
        self._summary_since = time.monotonic()
        self._summary_stats = cpu.stats()
        # vLLM's events tracker expects a metadata-only removal for every failed store.
        cpu.report_dropped_stores = True
        # vLLM's kv_offload_cpu_allocation_size histogram, drained by get_stats.
        cpu.allocation_sizes = []
        # Both key types are NewTypes of the same bytes with the same encoding,
        # and vLLM's context has every method a kvtriton manager reads: the
        # casts rename types once here, nothing is converted per call.
        self._calls = cast(_VLLMKeyedManager, backing)
        self._cpu_calls = cast(_VLLMKeyedCPU, cpu)

    @property
    def backing(self) -> OffloadingManager:
        """The kvtriton manager every call goes to."""
        return self._backing

    @property
    def summary_interval_s(self) -> float:
        """Seconds of activity between two ``kvtriton summary:`` log lines (0: none)."""
        return self._summary_interval_s

    @property
    def cpu(self) -> CPUOffloadingManager:
        """The ``CPUOffloadingManager`` that owns the slots (below the reuse filter, if any)."""
        return self._cpu

    @override
    def on_new_request(self, req_context: vllm_base.ReqContext) -> vllm_base.RequestOffloadingContext:
        self._calls.on_new_request(req_context)
        # Chunk level: store newly computed chunks only (what vLLM's CPU tier does).
        return vllm_base.RequestOffloadingContext(policy=_CHUNK_LEVEL)

    @override
    def on_request_finished(self, req_context: vllm_base.ReqContext) -> None:
        self._calls.on_request_finished(req_context)
        if self._summary_interval_s and time.monotonic() - self._summary_since >= self._summary_interval_s:
            self.log_summary()

    def log_summary(self) -> None:
        """Log one ``kvtriton summary:`` line for the traffic since the last one (what the interval does)."""
        now = time.monotonic()
        current = self._cpu.stats()
        last = self._summary_stats
        logger.info("%s", summary_line(last, current, now - self._summary_since, self._bytes_per_chunk))
        self._summary_since, self._summary_stats = now, current

    @override
    def lookup(self, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext) -> vllm_base.LookupResult:
        result = self._calls.lookup(key, req_context)
        if result is _MISS:
            return _VLLM_MISS
        return _VLLM_HIT if result is _HIT else _VLLM_HIT_PENDING

    @override
    def get_load_source(self, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    @override
    def prepare_load(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.LoadStoreSpec:
        return _slot_spec(self._calls.prepare_load(keys, req_context))

    if MANAGER_HAS_TOUCH:
        # vLLM 0.33's interface only: 0.34 removed touch (no @override, which 0.34's base would refuse).
        def touch(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> None:
            self._calls.touch(keys, req_context)

    @override
    def complete_load(self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext) -> None:
        self._calls.complete_load(keys, req_context)

    @override
    def prepare_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.PrepareStoreOutput | None:
        output = self._calls.prepare_store(keys, req_context)
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
        # Every completion goes to the CPU manager (the filter only forwards it), under vLLM's rule.
        self._cpu_calls.complete_store(keys, req_context, success, skip_without_store=True)

    @override
    def take_events(self) -> Iterable[vllm_base.OffloadingEvent]:
        return [_vllm_event(event) for event in self._backing.take_events()]

    @override
    def reset_cache(self) -> None:
        self._backing.reset_cache()

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's CPU tier metrics since the last call, under vLLM's names (see :func:`metric_definitions`)."""
        snapshot = self._cpu.stats()
        capacity = snapshot.capacity
        stats = OffloadingConnectorStats()
        # A held slot's failed write may still be running (vLLM 0.34 counts it as write-pending too).
        writing = snapshot.pending + snapshot.held
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (writing + snapshot.loading) / capacity)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing / capacity)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, snapshot.loading / capacity)
        if self.reports_occupancy:
            stats.set_gauge(CPU_CACHE_OCCUPANCY_PERC, snapshot.occupancy)
        sizes = self._cpu.allocation_sizes
        if sizes:
            for size in sizes:
                stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
            sizes.clear()
        if self._filter is not None:
            skipped = self._filter.stores_skipped
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped - self._stores_skipped_reported)
            self._stores_skipped_reported = skipped
        return stats

    @override
    def config_info(self) -> Sequence[vllm_base.ConfigInfoMapping]:
        return [self._info]

    @override
    def shutdown(self) -> None:
        self._backing.shutdown()


def summary_line(last: ManagerStats, current: ManagerStats, seconds: float, bytes_per_chunk: float) -> str:
    """The ``kvtriton summary:`` log line for the traffic between two snapshots ``seconds`` apart.

    Bytes are given in the binary unit that fits them (``288.00 KiB``, ``1.50 GiB``,
    :func:`~kvtriton._byte_units.format_bytes`).
    """
    lookups = current.lookups - last.lookups
    hits = current.hits - last.hits
    loaded = current.loads - last.loads
    stored = (current.stores - last.stores) - (current.failed_stores - last.failed_stores)
    hit_rate = f"{100 * hits / lookups:.1f}%" if lookups else "-"
    return (
        f"kvtriton summary: last {seconds:.0f} s: {lookups} lookups, {hits} hits ({hit_rate}); "
        f"loaded {loaded} chunks ({format_bytes(loaded * bytes_per_chunk)}), stored {stored} chunks "
        f"({format_bytes(stored * bytes_per_chunk)}), evicted {current.evictions - last.evictions}; "
        f"occupancy {100 * current.occupancy:.1f}% of {current.capacity} slots"
    )


def _vllm_event(event: OffloadingEvent) -> vllm_base.OffloadingEvent:
    """kvtriton's event as vLLM's: a stored one as the installed vLLM's CPU manager makes it (:func:`stored_event`)."""
    if not event.removed:
        # The context is the one vLLM passed to complete_store (the manager keeps it, never wraps it).
        return stored_event(
            _vllm_keys(event.keys),
            vllm_base.Medium(event.medium),
            cast("vllm_base.ReqContext | None", event.req_context),
        )
    return vllm_base.OffloadingEvent(
        keys=_vllm_keys(event.keys),
        medium=vllm_base.Medium(event.medium),
        removed=True,
        metadata_only=event.metadata_only,
    )
