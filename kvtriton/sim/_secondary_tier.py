"""A second tier behind the host tier, as vLLM's tiered offloading runs it (``vllm/v1/kv_offload/tiering``).

:class:`TieredManager` is the model of vLLM's ``TieringOffloadingManager``
over kvtriton's host tier (``KVTritonTieringOffloadingSpec``) and one
secondary tier; the server replay (:mod:`kvtriton.sim._vllm_server`) drives
it through :func:`tiered_calls` in the same loop as a host tier alone. What
it models, call by call:

* **Cascade.** A store the host tier completes (``complete_store``) is
  cascaded to the tier: the host chunks are pinned, the tier writes them while
  the model computes the next step (its threads run then), and the next
  step's first manager call unpins them.
* **Lookup and promotion.** A key the host tier misses is asked of the tier.
  Its existence check is asynchronous (vLLM's ``AsyncLookupManager``): the
  first lookup answers RETRY and queues the key, the step's end sends the
  batch, the check runs while the model computes, and the next step's lookup
  sees the verdict. A verdict stays cached while a request that asked for it
  is alive. A tier hit takes a host slot at once (``prepare_store`` of the
  request: it can evict) and answers HIT_PENDING; the step's end submits the
  read, which lands while the model computes, and the next step's lookup
  finds the chunk in the host tier. A request meeting RETRY or HIT_PENDING is
  deferred a step, so a promoted prefix costs it two steps.
* **Rates as vLLM reports them.** ``vllm:kv_offload_tiering_chunk_queries``
  and ``_chunk_hits`` by tier count each (request, key, tier) once, at the
  first HIT or MISS the tier gives it, and stop once the request is
  allocated; a promoted chunk is thus a host miss and a tier hit. Those
  counters say what each tier answered a request's *first* lookup, not what
  it served: in a burst every request looks its prefix up in step 1, before
  anything is stored, so both read (close to) 0% while the host tier serves
  loads later. What each tier served is ``vllm:prompt_tokens_cached_by_source``
  (``host``, and the tier's source): a loaded chunk promoted for the loading
  request is the tier's, any other the host tier's
  (``host_loaded_chunks``, ``tier_loaded_chunks``; they add up to the
  external hits).
  ``_read_bytes`` counts promoted chunks, ``_write_bytes`` cascaded ones,
  each at the host row's bytes (compressed rows with compression).

Two tiers, each as its code behaves (``--tier`` finds them by name in
:mod:`kvtriton.sim._tier_models`, the registry a new backend's model joins):

* :class:`FsTier`, vLLM's ``fs``: a file per chunk, no capacity, never
  evicts; every cascade rewrites its file. It keeps what it holds across
  engine restarts (pass the same tier to the next replay).
* :class:`MooncakePool`, Mooncake Store behind kvtriton's ``MooncakeStoreTier``:
  a pool of ``capacity_bytes`` holding objects of a chunk plus its 64-byte
  seal. Mooncake's master evicts :data:`MOONCAKE_EVICTION_RATIO` of the
  objects, least recently used first (it orders them by lease time; a put, an
  existence check and a read renew it), when the pool passes
  :data:`MOONCAKE_HIGH_WATERMARK` full, and a put into a full pool fails.

Not modelled: the lease's 10 s protection from eviction and the master's
10 ms eviction period (the simulator has no clock: eviction runs at the put
that crosses the watermark), back-pressure, request-level tiers, partial
promotions, tier failures, a thread that loses the race with the step (every
tier job and check is done by the next step).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtriton._int_argument import check_int
from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LookupResult, PrepareStoreOutput, ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._replay import ManagerCalls, hooked_calls

MOONCAKE_HIGH_WATERMARK = 0.9
"""``mooncake_master --eviction_high_watermark_ratio`` default: eviction starts past 90% full."""
MOONCAKE_EVICTION_RATIO = 0.05
"""``mooncake_master --eviction_ratio`` default: each eviction removes 5% of the objects (more when far past)."""


class _Retry:
    """vLLM's ``LookupResult.RETRY``: kvtriton's own ``LookupResult`` has none (its host tier always knows)."""

    def __repr__(self) -> str:
        return "RETRY"


RETRY = _Retry()
"""The answer of a lookup whose tier existence check has not run yet: the request tries again next step."""

_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING  # read once: lookup is the replay's hottest call


class SecondaryTier(Protocol):
    """What the orchestrator model asks of a secondary tier's store."""

    @property
    def kind(self) -> str:
        """``fs`` or ``mooncake``: the tier's label in vLLM's metrics (``1:fs``)."""
        ...

    def contains(self, key: OffloadKey) -> bool:
        """The existence check (``batch_lookup`` / ``batch_is_exist``)."""
        ...

    def put(self, key: OffloadKey) -> bool:
        """One chunk of a cascade; False when the tier refused it."""
        ...

    def get(self, key: OffloadKey) -> bool:
        """One chunk of a promotion; False when the tier no longer holds it."""
        ...

    @property
    def chunks(self) -> int:
        """Chunks held now."""
        ...

    @property
    def evictions(self) -> int: ...

    @property
    def refused_puts(self) -> int: ...


class FsTier:
    """vLLM's ``fs`` tier: one file per chunk under ``root_dir``, no capacity, never evicts."""

    kind = "fs"
    evictions = 0  # it has no capacity: nothing is ever evicted or refused
    refused_puts = 0

    def __init__(self) -> None:
        self._files: set[OffloadKey] = set()

    def contains(self, key: OffloadKey) -> bool:
        return key in self._files

    def put(self, key: OffloadKey) -> bool:
        self._files.add(key)  # written again when present (vLLM does not check)
        return True

    def get(self, key: OffloadKey) -> bool:
        return key in self._files

    @property
    def chunks(self) -> int:
        return len(self._files)


class MooncakePool:
    """Mooncake Store's pool as its master manages it: ``capacity_objects`` objects, LRU eviction past the watermark."""

    kind = "mooncake"

    def __init__(
        self,
        capacity_objects: int,
        *,
        high_watermark: float = MOONCAKE_HIGH_WATERMARK,
        eviction_ratio: float = MOONCAKE_EVICTION_RATIO,
    ) -> None:
        self.capacity_objects = check_int("capacity_objects", capacity_objects, 1)
        self.high_watermark = high_watermark
        self.eviction_ratio = eviction_ratio
        self._objects: OrderedDict[OffloadKey, None] = OrderedDict()  # least recently leased first
        self.evictions = 0
        self.refused_puts = 0

    def _lease(self, key: OffloadKey) -> bool:
        if key not in self._objects:
            return False
        self._objects.move_to_end(key)
        return True

    def contains(self, key: OffloadKey) -> bool:
        return self._lease(key)  # the master grants a lease to an object a client asks about

    def get(self, key: OffloadKey) -> bool:
        return self._lease(key)

    def put(self, key: OffloadKey) -> bool:
        if key in self._objects:
            return True  # the object exists: Mooncake keeps it and leaves its lease as it was
        if len(self._objects) >= self.capacity_objects:
            self.refused_puts += 1  # no space to allocate: the put fails until the master evicts
            return False
        self._objects[key] = None
        used = len(self._objects) / self.capacity_objects
        if used > self.high_watermark:
            # The master's eviction target: the ratio, plus how far past the watermark the pool is.
            target = max(self.eviction_ratio, used - self.high_watermark + self.eviction_ratio)
            for _ in range(min(math.ceil(len(self._objects) * target), len(self._objects))):
                self._objects.popitem(last=False)
                self.evictions += 1
        return True

    @property
    def chunks(self) -> int:
        return len(self._objects)


@dataclass(frozen=True, slots=True)
class TierCounts:
    """What the two tiers did over a replay, counted as vLLM's metrics count them (chunks)."""

    kind: str
    host_chunk_queries: int
    """``vllm:kv_offload_tiering_chunk_queries{tier="0:primary"}``."""
    host_chunk_hits: int
    """``vllm:kv_offload_tiering_chunk_hits{tier="0:primary"}``."""
    tier_chunk_queries: int
    """``..._chunk_queries{tier="1:<kind>"}``."""
    tier_chunk_hits: int
    """``..._chunk_hits{tier="1:<kind>"}``: chunks found in the tier, each then promoted."""
    host_loaded_chunks: int
    """Chunks requests loaded into the GPU that the host tier held: vLLM's ``prompt_tokens_cached_by_source``
    ``host`` (in chunks)."""
    tier_loaded_chunks: int
    """Chunks requests loaded into the GPU that were promoted from the tier for them: that counter's tier source
    (``disk`` for fs)."""
    promotions: int
    """Chunks promoted (the tier read them into the host tier)."""
    promotion_jobs: int
    promotion_failures: int
    """Tier hits the host tier had no room for (vLLM's ``promotion_allocation_failures``), or the tier lost."""
    promotion_evictions: int
    """Host chunks evicted to make room for promoted ones."""
    cascaded_chunks: int
    """Chunks written to the tier (every completed host store, again when a chunk returns)."""
    tier_chunks: int
    """Chunks the tier holds at the end (fs: what it filled)."""
    tier_peak_chunks: int
    tier_evictions: int
    tier_refused_puts: int


@dataclass(slots=True)
class _Lookup:
    """One key's existence check (vLLM's ``LookupState``): queued, in flight, then resolved."""

    phase: str = "queued"  # queued -> in flight -> resolved
    found: bool | None = None
    answer: bool | None = None
    """The tier's verdict, computed while the model ran, applied at the next drain."""
    requests: set[str] = field(default_factory=set[str])


@dataclass(slots=True)
class _Job:
    keys: list[OffloadKey]
    context: ReqContext
    is_promotion: bool
    done: bool = False
    succeeded: list[OffloadKey] = field(default_factory=list[OffloadKey])


@dataclass(slots=True)
class _RequestState:
    context: ReqContext
    pending_stores: int = 0
    finished: bool = False
    allocated: bool = False
    host_counted: set[OffloadKey] = field(default_factory=set[OffloadKey])
    """Keys whose host tier answer is already counted in the chunk metrics."""
    tier_counted: set[OffloadKey] = field(default_factory=set[OffloadKey])
    """Keys whose secondary tier answer is already counted in the chunk metrics."""
    own_evictions: int = 0
    """Chunks this request had looked up that its own promotions evicted from the host tier."""
    asked: list[OffloadKey] = field(default_factory=list[OffloadKey])
    """The keys whose existence verdict this request holds (it is in their lookup's ``requests``): the only
    lookups its end can let go, so finalizing it never walks the other requests' lookups."""


class TieredManager:
    """vLLM's ``TieringOffloadingManager`` over kvtriton's host tier ``primary`` and one secondary ``tier``.

    Its methods are the calls the connector makes (see the module docstring);
    :func:`tiered_calls` hands them to the server replay. ``tier`` may outlive
    the manager: an engine restart is a new manager (empty host tier) over the
    same tier.
    """

    def __init__(self, primary: CPUOffloadingManager, tier: SecondaryTier, *, stores_mark_present: bool) -> None:
        self.primary = primary
        self.tier = tier
        self.stores_mark_present = stores_mark_present
        """A finished store turns the verdicts cached for its keys into hits (``ServerModel.stores_mark_present``)."""
        self._lookups: dict[OffloadKey, _Lookup] = {}
        self._queued: list[OffloadKey] = []
        # The lookups of _lookups in phase "in flight" (the same objects): the next drain resolves exactly these,
        # so a step costs what it checked, not every verdict still held.
        self._in_flight: dict[OffloadKey, _Lookup] = {}
        self._need_drain = False
        self._jobs: list[_Job] = []
        self._promotions: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
        # vLLM's _request_load_sources: the chunks promoted for a request, which its load counts as the tier's.
        self._promoted_for: dict[str, set[OffloadKey]] = {}
        self._requests: dict[str, _RequestState] = {}
        self._polled = False
        self._peak = tier.chunks
        self.host_chunk_queries = self.host_chunk_hits = 0
        self.tier_chunk_queries = self.tier_chunk_hits = 0
        self.promotions = self.promotion_jobs = self.promotion_failures = self.cascaded_chunks = 0
        self.promotion_evictions = 0
        self.host_loaded_chunks = self.tier_loaded_chunks = 0

    # -- the connector's calls --------------------------------------------------------------

    def on_new_request(self, context: ReqContext) -> None:
        self.primary.on_new_request(context)
        self._requests[context.req_id] = _RequestState(context)

    def lookup(self, key: OffloadKey, context: ReqContext) -> object:
        if not self._polled:  # _maybe_poll, inline: the replay's most frequent call
            self._poll()
        state = self._requests[context.req_id]
        primary = self.primary.lookup(key, context)
        if primary is _HIT_PENDING:
            return primary
        hit = primary is _HIT
        self._count(state, key, tier=False, hit=hit)
        if hit:
            return primary
        found = self._existence(key, state)
        if found is None:
            return RETRY
        self._count(state, key, tier=True, hit=found)
        if not found:
            return LookupResult.MISS
        # A promotion: the host slot is taken now (the request's store), the read submitted at the step's end.
        output = self.primary.prepare_store([key], context)
        if output is None:
            self.promotion_failures += 1
            return LookupResult.MISS
        self.promotion_evictions += len(output.evicted_keys)
        state.own_evictions += sum(evicted in state.host_counted for evicted in output.evicted_keys)
        self._promotions.setdefault(context.req_id, (context, []))[1].extend(output.keys_to_store)
        self._promoted_for.setdefault(context.req_id, set()).update(output.keys_to_store)
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey], context: ReqContext) -> object:
        self._requests[context.req_id].allocated = True
        promoted = self._promoted_for.get(context.req_id, set())
        from_tier = sum(key in promoted for key in keys)
        self.tier_loaded_chunks += from_tier
        self.host_loaded_chunks += len(keys) - from_tier
        return self.primary.prepare_load(keys, context)

    def complete_load(self, keys: Sequence[OffloadKey], context: ReqContext) -> None:
        self.primary.complete_load(keys, context)

    def prepare_store(self, keys: Sequence[OffloadKey], context: ReqContext) -> PrepareStoreOutput | None:
        self._poll()  # always: eviction must see the freshest completions (vLLM's comment)
        state = self._requests[context.req_id]
        state.allocated = True
        output = self.primary.prepare_store(keys, context)
        if output is not None and output.keys_to_store:
            state.pending_stores += 1
        return output

    def complete_store(self, keys: Sequence[OffloadKey], context: ReqContext) -> None:
        self.primary.complete_store(keys, context)
        if keys:
            # The cascade pins the host chunks for the tier's read, counting no access of the request.
            self.primary.prepare_load(keys, ReqContext(req_id=context.req_id))
            self._jobs.append(_Job(list(keys), context, is_promotion=False))
        state = self._requests[context.req_id]
        state.pending_stores -= 1
        self._maybe_finalize(state)

    def on_request_finished(self, context: ReqContext) -> None:
        self.primary.on_request_finished(context)
        state = self._requests[context.req_id]
        state.finished = True
        self._maybe_finalize(state)

    def on_schedule_end(self) -> None:
        """The last manager call of a step; then the model computes, and the tier's threads run meanwhile."""
        self._maybe_poll()
        self._polled = False
        for context, keys in self._promotions.values():
            self._jobs.append(_Job(keys, context, is_promotion=True))
            self.promotion_jobs += 1
        self._promotions.clear()
        self._drain()
        self._need_drain = True
        batch, self._queued = self._queued, []
        # While the model computes: cascades land, then promotions read, then the step's existence checks run.
        for job in self._jobs:
            if not job.done:
                job.done = True
                job.succeeded = [
                    key for key in job.keys if (self.tier.get(key) if job.is_promotion else self.tier.put(key))
                ]
        self._peak = max(self._peak, self.tier.chunks)
        for key in batch:
            lookup = self._lookups.get(key)
            if lookup is not None and lookup.phase == "queued":
                lookup.phase = "in flight"
                lookup.answer = self.tier.contains(key)
                self._in_flight[key] = lookup

    def own_evictions(self, req_id: str) -> int:
        """Chunks request ``req_id`` had looked up that its own promotions evicted (0 for a request it forgot)."""
        state = self._requests.get(req_id)
        return 0 if state is None else state.own_evictions

    def has_pending_work(self) -> bool:
        """Tier jobs, promotions or existence checks not yet seen by the scheduler."""
        return bool(self._jobs or self._promotions or self._queued or self._in_flight)

    # -- internals ----------------------------------------------------------------------------

    def _count(self, state: _RequestState, key: OffloadKey, *, tier: bool, hit: bool) -> None:
        counted = state.tier_counted if tier else state.host_counted
        if state.allocated or key in counted:
            return
        counted.add(key)
        if tier:
            self.tier_chunk_queries += 1
            self.tier_chunk_hits += hit
        else:
            self.host_chunk_queries += 1
            self.host_chunk_hits += hit

    def _existence(self, key: OffloadKey, state: _RequestState) -> bool | None:
        """vLLM's ``AsyncLookupManager.lookup``: the cached verdict, or None (queued for this step's check)."""
        if self._need_drain:
            self._drain()
            self._need_drain = False
        lookup = self._lookups.get(key)
        if lookup is None:
            lookup = self._lookups[key] = _Lookup()
            self._queued.append(key)
        req_id = state.context.req_id
        if req_id not in lookup.requests:
            lookup.requests.add(req_id)
            state.asked.append(key)
        return lookup.found

    def _drain(self) -> None:
        """The checks in flight come back: each verdict a request holds is resolved, the others dropped."""
        lookups = self._lookups
        for key, lookup in self._in_flight.items():
            if not lookup.requests:
                del lookups[key]
                continue
            lookup.phase, lookup.found = "resolved", lookup.answer
        self._in_flight.clear()

    def _maybe_poll(self) -> None:
        if not self._polled:
            self._polled = True
            self._poll()

    def _poll(self) -> None:
        """Finish the tier jobs done since the last poll: promotions become loadable, cascades unpin."""
        self._polled = True
        done = [job for job in self._jobs if job.done]
        if not done:
            return
        self._jobs = [job for job in self._jobs if not job.done]
        for job in done:
            if job.is_promotion:
                self.promotions += len(job.succeeded)
                succeeded = set(job.succeeded)
                lost = [key for key in job.keys if key not in succeeded]
                if job.succeeded:
                    self.primary.complete_store(job.succeeded, job.context)
                if lost:
                    self.promotion_failures += len(lost)
                    self.primary.complete_store(lost, job.context, success=False)
                    for key in lost:
                        lookup = self._lookups.get(key)
                        if lookup is not None and lookup.phase == "resolved":
                            lookup.found = False
            else:
                self.cascaded_chunks += len(job.succeeded)
                self.primary.complete_load(job.keys, ReqContext(req_id=job.context.req_id))
                if self.stores_mark_present:
                    self._mark_present(job.succeeded)

    def _mark_present(self, keys: Sequence[OffloadKey]) -> None:
        """vLLM's ``AsyncLookupManager.mark_present``: a store newer than any verdict or check of its keys wins.

        A cached MISS, and a check queued or in flight (whose answer is then
        ignored), become a resolved HIT; a verdict no request holds is
        dropped; a key never looked up gets no verdict.
        """
        for key in keys:
            lookup = self._lookups.get(key)
            if lookup is None or lookup.found is True:
                continue
            if lookup.phase == "in flight":
                del self._in_flight[key]  # its answer is ignored: it leaves the checks the next drain resolves
            if not lookup.requests:
                del self._lookups[key]
                continue
            lookup.phase, lookup.found = "resolved", True

    def _maybe_finalize(self, state: _RequestState) -> None:
        """The tier forgets the request's lookups once it finished and its last host store completed."""
        if not state.finished or state.pending_stores:
            return
        req_id = state.context.req_id
        lookups = self._lookups
        # A key asked twice (its lookup dropped and made again meanwhile) is met twice: the second finds no req_id.
        for key in state.asked:
            lookup = lookups.get(key)
            if lookup is not None and req_id in lookup.requests:
                lookup.requests.discard(req_id)
                if not lookup.requests and lookup.phase != "in flight":
                    del lookups[key]
        del self._requests[req_id]
        self._promoted_for.pop(req_id, None)

    def counts(self) -> TierCounts:
        return TierCounts(
            kind=self.tier.kind,
            host_chunk_queries=self.host_chunk_queries,
            host_chunk_hits=self.host_chunk_hits,
            tier_chunk_queries=self.tier_chunk_queries,
            tier_chunk_hits=self.tier_chunk_hits,
            host_loaded_chunks=self.host_loaded_chunks,
            tier_loaded_chunks=self.tier_loaded_chunks,
            promotions=self.promotions,
            promotion_jobs=self.promotion_jobs,
            promotion_failures=self.promotion_failures,
            promotion_evictions=self.promotion_evictions,
            cascaded_chunks=self.cascaded_chunks,
            tier_chunks=self.tier.chunks,
            tier_peak_chunks=self._peak,
            tier_evictions=self.tier.evictions,
            tier_refused_puts=self.tier.refused_puts,
        )


def tiered_calls(manager: TieredManager) -> ManagerCalls[ReqContext]:
    """The replay calls of a :class:`TieredManager` in vLLM's connector order: request hooks, RETRY, step hooks."""
    return dataclasses.replace(
        hooked_calls(manager, hit=LookupResult.HIT, pending=LookupResult.HIT_PENDING),
        retry=RETRY,
        on_schedule_end=manager.on_schedule_end,
        has_pending_work=manager.has_pending_work,
    )
