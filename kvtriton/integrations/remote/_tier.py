"""RemoteTier: what every remote secondary tier does, once, over a :class:`RemoteClient`.

A backend subclasses :class:`RemoteTier`, names its configuration and itself
(:attr:`RemoteTier.config_type`, :attr:`RemoteTier.backend`, :attr:`RemoteTier.metrics`)
and opens its client (:meth:`RemoteTier.open_client`); everything else is here, in parts each named for its job: the supervisor
(:mod:`._supervisor`: up, degraded, down, back-off, probes), the jobs
(:mod:`._jobs`: submit, run, deadline, quarantine, drain), the seals
(:mod:`._seals`), the lookups (:mod:`._lookups`) and the counters and metrics
(:mod:`._metrics`).
:class:`RemoteTier` composes them into vLLM's ``SecondaryTierManager``:

How it moves data
    The primary tier's host memory and one 64-byte seal slot per primary
    chunk are registered with the store once; a cascade is one ``put`` of
    every key's chunk and seal, a promotion one ``get`` into the allocated
    slots. No chunk passes through Python ``bytes``.

How it fails closed
    Object keys are filed under the engine's identity fingerprint
    (:mod:`kvtriton.integrations.vllm._identity`) in the keyspace of
    :mod:`._keyspace`. Every value is the chunk followed by its seal
    (:mod:`kvtriton._integrity`), verified before the chunk becomes a hit; a
    value that fails is a miss for that key only, counted in
    ``vllm:kv_offload_integrity_failures{tier,reason}``.

How it stays out of the scheduler's way
    Lookups go through vLLM's ``AsyncLookupManager``: the scheduler gets RETRY
    until one batched ``exist`` per step has answered. Store and load jobs run
    on ``io_threads`` threads and complete through ``get_finished_jobs``; a
    promotion that loaded only some keys reports them.

How it fails
    Every failure is a miss, never a hang or wrong data. A lookup that does not
    answer within ``timeout_s`` is a miss; every lookup, load and store has a
    deadline ``timeout_s`` after it was asked for, past which it is a miss or a
    failed store, counted by reason, and the tier is *degraded* (retried after
    ``retry_backoff_s``, doubling up to ``retry_backoff_max_s``). A load still
    inside the store at its deadline is abandoned: vLLM gets the failure then,
    and the slots the call may still write are kept aside until it returns
    (docs/tiers.md, "Deadlines, degraded tiers and abandoned calls"). Once an operation finds
    the store unreachable the tier is *down*: lookups miss and jobs fail at
    once, without touching the network, while one background thread probes
    the store every ``reconnect_interval_s`` and brings the tier back when it
    answers. :meth:`RemoteTier.stats` counts the failures and the time they took.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, cast

from typing_extensions import TypeVar, override

from kvtriton._integrity import SEAL_BYTES
from kvtriton.integrations.remote._client import RemoteClient
from kvtriton.integrations.remote._identity import chunk_identity, kv_identity
from kvtriton.integrations.remote._jobs import JobRunner
from kvtriton.integrations.remote._keyspace import TierKeyspace
from kvtriton.integrations.remote._lookups import RemoteLookups
from kvtriton.integrations.remote._metrics import (
    Counters,
    RemoteTierMetrics,
    RemoteTierStats,
    connector_stats,
    metric_definitions,
    vllm_tier_label,
)
from kvtriton.integrations.remote._seals import EncryptedSlots, SealedSlots
from kvtriton.integrations.remote._settings import RemoteTierSettings, tier_constructor_signature
from kvtriton.integrations.remote._supervisor import Supervisor, TierState
from kvtriton.integrations.vllm import (
    BackpressureDetector,
    CacheHitSource,
    IntegrityReport,
    JobResult,
    Locality,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
    get_offload_block_hash,
    get_offload_group_idx,
    spec_encryption,
)

if TYPE_CHECKING:
    from kvtriton.integrations.vllm import OffloadingSpec

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT", bound=RemoteTierSettings, default=RemoteTierSettings, covariant=True)
"""A backend's configuration type (:attr:`RemoteTier.config_type`)."""

_LEFT_OPEN: list[RemoteClient] = []
"""Clients a shutdown left open because a call was still inside them (:meth:`RemoteTier.shutdown`): held until the
interpreter ends, after it has joined the I/O threads those calls run on."""


class RemoteTier(SecondaryTierManager, Generic[ConfigT]):
    """A vLLM secondary tier over a remote store reached through a :class:`RemoteClient` (see the module docstring).

    A backend names its configuration (:attr:`config_type`), sets :attr:`backend`
    and :attr:`metrics`, and implements :meth:`open_client` and
    :meth:`describe_store`; it writes no constructor: vLLM passes every key of the
    tier's configuration by name, the base builds :attr:`config` from them, and
    each backend's constructor signature is its configuration's fields
    (:func:`~kvtriton.integrations.remote._settings.tier_constructor_signature`).
    docs/tiers.md, "Adding a tier backend", walks through one.
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    backend: ClassVar[str] = "remote"
    """The backend's name in log lines (``Mooncake tier '...': ...``)."""
    metrics: ClassVar[RemoteTierMetrics] = RemoteTierMetrics.with_prefix("remote")
    """The names of the backend's metrics."""
    kvtriton_seals_per_tenant: ClassVar[bool] = True
    """Every remote tier can encrypt: behind a spec with ``kvtriton_encryption`` each value is a sealed box of its
    tenant (:class:`~kvtriton.integrations.remote._seals.EncryptedSlots`), so the spec accepts it
    (:data:`~kvtriton.integrations.vllm.ENCRYPTING_TIER_ATTRIBUTE`)."""
    config_type: ClassVar[type[RemoteTierSettings]] = RemoteTierSettings
    """The backend's configuration: a frozen dataclass of every key the tier takes (a subclass of
    :class:`RemoteTierSettings`, which holds the keys every remote tier shares), validated when it is built."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each backend a constructor whose signature lists its configuration's keys, as vLLM's config check
        (and anyone calling ``inspect.signature``) reads them; the keys are written once, in :attr:`config_type`."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            return  # a backend that writes its own constructor states its own signature

        def __init__(self: RemoteTier[Any], *args: Any, **keys: Any) -> None:
            super(cls, self).__init__(*args, **keys)

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = f"Every key of :class:`{cls.config_type.__name__}` by name, as vLLM passes them."
        vars(__init__)["__signature__"] = tier_constructor_signature(RemoteTier.__init__, cls.config_type)
        type.__setattr__(cls, "__init__", __init__)

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **keys: Any,
    ) -> None:
        """``keys``: every key of the tier's configuration (:attr:`config_type`), by name; starts connecting."""
        problem = self.installation_problem()
        if problem is not None:
            raise ImportError(problem)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._config = cast("ConfigT", self.config_type(**keys))  # config_type is the class ConfigT names
        settings: RemoteTierSettings = self._config
        self.endpoint = self.describe_store()
        """Where the store is, for log lines."""
        self.locality = Locality(locality) if locality is not None else None
        self.tier_label: str = vllm_tier_label(offloading_spec, tier_type, {**keys, "locality": locality})
        """The ``tier`` label of this tier's metrics: vLLM's own for it (``"1:MooncakeStoreTier"``)."""
        self.who = f"{self.backend} tier {tier_type!r}"
        """The tier in log lines (``Mooncake tier 'MooncakeStoreTier'``)."""
        who = self.who
        self.integrity = IntegrityReport(self.tier_label)
        """Values that failed their seal check: counted by reason, warned about at a bounded rate."""
        self.identity = kv_identity(offloading_spec, settings.namespace)
        """What every value's seal names and the keys are filed under (docs/tiers.md, "Integrity")."""
        self.keyspace = TierKeyspace(
            chunk_identity(offloading_spec, self.block_size_bytes, settings.namespace, self.identity.hex)
        )
        encryption = spec_encryption(offloading_spec)
        self._slots = (
            SealedSlots(
                primary_kv_view,
                self.block_size_bytes,
                fingerprint=self.identity.fingerprint,
                integrity=self.integrity,
                who=who,
            )
            if encryption is None
            else EncryptedSlots(
                primary_kv_view,
                self.block_size_bytes,
                fingerprint=self.identity.fingerprint,
                integrity=self.integrity,
                who=who,
                encryption=encryption,
                layout=self.keyspace.digest,
                tier=tier_type,
            )
        )
        self._lock = threading.Lock()
        """Guards the counters, the state, the client handle and the jobs' phases (taken by every thread)."""
        self._counters = Counters(self._lock)
        prefix = f"kvtriton_{self.backend.lower()}"
        self._supervisor = Supervisor(
            who=who,
            endpoint=self.endpoint,
            thread_prefix=prefix,
            tier_type=tier_type,
            settings=settings,
            counters=self._counters,
            keyspace=self.keyspace,
            open_client=self.open_client,
            regions=self._slots.regions(),
        )
        self._reported = self.stats()
        """The counters as of the last get_stats (vLLM's metrics take increments)."""
        self._lookups = RemoteLookups(tier_type, self._supervisor, self.object_key)
        self._jobs = JobRunner(
            supervisor=self._supervisor,
            slots=self._slots,
            lookups=self._lookups,
            object_key=self.object_key,
            io_threads=settings.io_threads,
            thread_name=f"{prefix}_{tier_type}",
        )
        self._start()

    @property
    def config(self) -> ConfigT:
        """The tier's configuration, validated (a bad key or value raised naming it)."""
        return self._config

    @classmethod
    def installation_problem(cls) -> str | None:
        """Why the backend's client library cannot serve (raised as an ImportError before anything starts), or
        None; a backend whose library may be missing or outdated overrides it."""
        return None

    def _start(self) -> None:
        """Start connecting in the background (last in the constructor: the backend is complete by then)."""
        self._supervisor.thread.start()
        sealing = (
            f"{SEAL_BYTES}-byte seals"
            if not isinstance(self._slots, EncryptedSlots)
            else f"{self._slots.sealed_bytes - self.block_size_bytes}-byte sealed boxes per tenant (encrypted)"
        )
        logger.info(
            "%s tier %r: %s, namespace digest %s (%s), %d-byte chunks + %s, timeout %.1f s; %s",
            self.backend,
            self.tier_type,
            self.endpoint,
            self.keyspace.digest,
            self.keyspace.identity.model,
            self.block_size_bytes,
            sealing,
            self.config.timeout_s,
            self.identity.describe(),
        )

    @abstractmethod
    def open_client(self) -> RemoteClient | None:
        """A client set up against the store, or None when setup failed (bounded by the timeout); on the
        supervisor thread. A backend implements it."""

    @abstractmethod
    def describe_store(self) -> str:
        """Where the store is, for log lines (``master 10.0.0.5:50051``), from :attr:`config`. A backend implements
        it."""

    @property
    def state(self) -> TierState:
        return self._supervisor.state

    def wait_until_up(self, timeout_s: float) -> bool:
        """Block until the tier reaches the store (True) or ``timeout_s`` passes (False); for tests and tools."""
        return self._supervisor.up.wait(timeout_s)

    # ------------------------------------------------------------------
    # Lookups
    # ------------------------------------------------------------------

    def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which ``keys`` the store holds, in one ``exist``; all False when down or past the timeout."""
        return self._lookups.exists(keys)

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._supervisor.state is not TierState.UP:
            return LookupResult.MISS  # no probe while down: the scheduler never waits on a lost store
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # ------------------------------------------------------------------
    # Store (cascade) and load (promotion) jobs
    # ------------------------------------------------------------------

    def object_key(self, key: OffloadKey) -> str:
        """The store object ``key`` is filed under."""
        return self.keyspace.object_key(get_offload_block_hash(key), get_offload_group_idx(key))

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs.submit(job_metadata, is_load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs.submit(job_metadata, is_load=True)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self._jobs.finished()

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs.jobs)

    @override
    def drain_jobs(self) -> None:
        """Cancel queued jobs (they fail) and wait until no call is inside the store, abandoned ones included.

        vLLM drains before it reuses every primary slot (a cache reset), so this
        waits as long as the store holds a call, however long past the deadline
        (a WARNING every ``timeout_s`` names the jobs): a slot reused under a
        late write would hold another chunk's bytes."""
        self._jobs.cancel_queued()
        self._jobs.wait_for_calls(None)

    @override
    def shutdown(self) -> None:
        """Stop the threads and close the client, within about twice the timeout even with a hung store.

        A client with a call still inside the store after ``timeout_s`` is left
        open, never closed under the call (:data:`_LEFT_OPEN`): Mooncake's client
        frees its transfer engine on close, and the call, returning later (a
        stalled holder's connection gives up after about a minute), then
        crashed the process as it exited. The process instead waits for the
        call as it exits (Python joins the I/O threads), and the client is
        closed by its destructor after that."""
        timeout_s = self.config.timeout_s
        self._supervisor.stop()
        self._lookups.shutdown()
        self._jobs.cancel_queued()
        calls_done = self._jobs.wait_for_calls(timeout_s)
        self._jobs.shutdown()
        self._supervisor.join()
        # A lookup's existence check given up on at its deadline is inside the store as much as a job's call.
        late_checks = self._supervisor.late_calls()
        with self._lock:
            store, self._supervisor.store = self._supervisor.store, None
            stuck = len(self._jobs.in_flight) + late_checks
        if store is not None and (not calls_done or late_checks):
            _LEFT_OPEN.append(store)
            logger.warning(
                "%s tier %r: %d call(s) still inside the store %.1f s into shutdown: its client is left "
                "open, not closed under them; the process waits for them as it exits",
                self.backend,
                self.tier_type,
                stuck,
                timeout_s,
            )
            return  # the primary's memory stays exported too: a late transfer may still write it
        if store is not None:
            prefix = f"kvtriton_{self.backend.lower()}"
            closer = threading.Thread(target=store.close, name=f"{prefix}_close", daemon=True)
            closer.start()
            closer.join(timeout_s)
            if closer.is_alive():
                # The store still has the primary's memory registered: keep our export of it, so the primary's
                # region stays mapped instead of being reused under a late transfer.
                logger.warning(
                    "%s tier %r: the store did not close within %.1f s", self.backend, self.tier_type, timeout_s
                )
                return
        self._slots.release()

    # ------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------

    def stats(self) -> RemoteTierStats:
        with self._lock:
            return self._counters.snapshot(self._supervisor.state)

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, object]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions(cls.backend, cls.metrics)

    @override
    def get_stats(self) -> OffloadingConnectorStats:
        """The counters' growth since the last call, and whether the store answers now."""
        now = self.stats()
        last = self._reported
        self._reported = now
        return connector_stats(
            now,
            last,
            names=self.metrics,
            tier_label=self.tier_label,
            up=now.state is TierState.UP,
            degraded=now.state is TierState.DEGRADED,
            integrity=self.integrity,
        )
