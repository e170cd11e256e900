"""RemoteTier: what every remote secondary tier does, once, over a :class:`RemoteClient`.

A backend subclasses :class:`RemoteTier`, names itself (:attr:`RemoteTier.backend`,
:attr:`RemoteTier.metrics`) and opens its client (:meth:`RemoteTier.open_client`);
everything else is here:

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

import dataclasses
import enum
import logging
import math
import queue
import threading
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar, cast

import numpy as np
from typing_extensions import override

from kvtriton._integrity import SEAL_BYTES, IntegrityFault, seal_bytes, verify_seal
from kvtriton.integrations.remote._client import Outcome, RemoteClient, Segment, Unreachable
from kvtriton.integrations.remote._keyspace import ChunkIdentity, TierKeyspace
from kvtriton.integrations.remote._settings import RemoteTierSettings
from kvtriton.integrations.vllm._config import compression_tag
from kvtriton.integrations.vllm._identity import KVIdentity, compute_identity, vllm_identity
from kvtriton.integrations.vllm._integrity_report import IntegrityReport, integrity_metric_definitions
from kvtriton.integrations.vllm._surface import (
    JOB_RESULTS_DEFER_RELEASE,
    TIER_LABEL,
    AsyncLookupManager,
    BackpressureDetector,
    CacheHitSource,
    JobId,
    JobResult,
    Locality,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
    failed_load_result,
    get_offload_block_hash,
    get_offload_group_idx,
    mark_stored,
)
from kvtriton.kernels import KVCompression

if TYPE_CHECKING:
    from kvtriton.integrations.vllm._surface import OffloadingSpec

logger = logging.getLogger(__name__)

DEFAULT_LAYOUT_TAG = "vllm-cpu"
"""The layout tag of a primary that does not name its own: vLLM's CPU primary."""

_T = TypeVar("_T")


def _layout_tag(spec: OffloadingSpec) -> str:
    """The layout tag ``spec``'s primary names, or vLLM's CPU primary's when it names none."""
    layout_tag = getattr(spec, "layout_tag", None)
    return layout_tag if isinstance(layout_tag, str) and layout_tag else DEFAULT_LAYOUT_TAG


def kv_identity(spec: OffloadingSpec, namespace: str) -> KVIdentity:
    """The identity fingerprint of the chunks ``spec``'s primary hands this tier (each holds every rank's bytes).

    Behind kvtriton's tiered spec, the spec's own identity (its ``identity``),
    salted with ``namespace``: the spec computed it from the real model folder,
    whereas the model name this tier sees is the spec's tier namespace. Behind
    vLLM's own primary, computed here: the layout is ``vllm-cpu``.
    """
    spec_identity: object = getattr(spec, "identity", None)
    if isinstance(spec_identity, KVIdentity):
        return compute_identity(spec_identity.parts, namespace=namespace, identity_key=spec_identity.identity_key)
    settings: object = getattr(spec, "settings", None)
    compression = getattr(settings, "kv_compression", None)
    return vllm_identity(
        spec.config,
        layout=_layout_tag(spec),
        compression=compression_tag(compression) if isinstance(compression, KVCompression) else None,
        rank=None,
        namespace=namespace,
    )


def chunk_identity(spec: OffloadingSpec, chunk_bytes: int, namespace: str, fingerprint: str = "") -> ChunkIdentity:
    """Everything in ``spec`` that shapes a chunk's bytes, plus the user namespace and the identity fingerprint."""
    config = spec.config
    parallel = config.parallel
    canonical = ""
    if config.canonical_layout and config.kv_cache_layout is not None:
        canonical = str(config.kv_cache_layout)
    return ChunkIdentity(
        model=config.model.name,
        dtype=str(config.model.dtype),
        tokens_per_block=tuple(group.tokens_per_block for group in config.groups),
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=spec.blocks_per_chunk,
        chunk_bytes=chunk_bytes,
        world_size=parallel.world_size,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        kv_groups=tuple(tuple(group.layer_names) for group in config.groups),
        layout_tag=_layout_tag(spec),
        canonical_format=canonical,
        namespace=namespace,
        fingerprint=fingerprint,
    )


@dataclass(frozen=True)
class RemoteTierMetrics:
    """The names of the Prometheus metrics a backend adds to vLLM's offloading metrics (one set per backend).

    They are in vLLM's ``vllm:kv_offload_`` namespace, so vLLM's Prometheus
    logger exports them beside its own tier series and ``LLM.get_metrics()``
    (which keeps only ``vllm:`` names) returns them; each carries vLLM's own
    ``tier`` label for the tier (``"1:MooncakeStoreTier"``: position in
    ``secondary_tiers`` plus one, and the type).
    """

    FAILED_OPS: str
    FAILED_OP_SECONDS: str
    WRONG_SIZE_VALUES: str
    """Values whose size is not a sealed chunk's (each also an integrity failure, reason ``torn`` or ``wrong_size``)."""
    RECONNECTS: str
    UP: str

    @classmethod
    def with_prefix(cls, prefix: str) -> RemoteTierMetrics:
        """The backend's names: ``vllm:kv_offload_<prefix>_failed_ops`` and so on."""
        base = f"vllm:kv_offload_{prefix}"
        return cls(
            FAILED_OPS=f"{base}_failed_ops",
            FAILED_OP_SECONDS=f"{base}_failed_op_seconds",
            WRONG_SIZE_VALUES=f"{base}_wrong_size_values",
            RECONNECTS=f"{base}_reconnects",
            UP=f"{base}_up",
        )


_LEFT_OPEN: list[RemoteClient] = []
"""Clients a shutdown left open because a call was still inside them (:meth:`RemoteTier.shutdown`): held until the
interpreter ends, after it has joined the I/O threads those calls run on."""

_claimed_positions: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()
"""The ``secondary_tiers`` positions already taken by a remote tier of each spec (two equal configs get two)."""

_FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys of a tier's configuration vLLM's SecondaryTierFactory consumes instead of passing them to the tier."""


def vllm_tier_label(offloading_spec: object, tier_type: str, arguments: Mapping[str, object]) -> str:
    """The ``tier`` label vLLM's orchestrator gives this tier: ``f"{position + 1}:{tier_type}"``.

    The tier is not told its position, so it finds itself in the spec's
    ``secondary_tiers`` (vLLM builds the tiers in that order): the first
    configuration of its type whose keys match its ``arguments`` and that no
    earlier tier of the same spec took. Without a tiered spec (a tier built
    directly), the label is the type alone.
    """
    configs = getattr(offloading_spec, "secondary_tier_configs", None)
    if not isinstance(configs, list):
        return tier_type
    claimed = _claimed_positions.setdefault(offloading_spec, set())
    for position, config in enumerate(cast("list[object]", configs)):
        if not isinstance(config, dict) or position in claimed:
            continue
        entry = cast("dict[str, object]", config)
        if entry.get("type") != tier_type:
            continue
        if all(arguments.get(key) == value for key, value in entry.items() if key not in _FACTORY_KEYS):
            claimed.add(position)
            return f"{position + 1}:{tier_type}"
    return tier_type


class TierState(enum.Enum):
    CONNECTING = "connecting"
    """Never reached the store yet: everything misses while the background thread sets up."""
    UP = "up"
    DOWN = "down"
    """The store was lost: everything misses until a probe answers."""
    DEGRADED = "degraded"
    """An operation ran past its deadline: everything misses until the back-off has passed, no abandoned call is
    still inside the store, and a probe answers."""
    CLOSED = "closed"


class FailureReason(enum.Enum):
    """Why an operation failed: the ``reason`` label of ``vllm:kv_offload_remote_tier_failures``."""

    DEADLINE = "deadline"
    """It did not answer within ``timeout_s`` (a lookup, a queued or running job): a miss, or a failed store."""
    UNREACHABLE = "unreachable"
    """The store said it could not be reached (or could not be set up)."""
    REFUSED = "refused"
    """The tier was not up (connecting, down, degraded): failed at once, without touching the network."""
    ERROR = "error"
    """The store answered, but some keys failed (full, refused, a value of another size), or a call raised."""


FAILURES = "vllm:kv_offload_remote_tier_failures"
"""Counter, every remote tier: failed operations by tier and :class:`FailureReason`."""
DEGRADED = "vllm:kv_offload_remote_tier_degraded"
"""Gauge, every remote tier: 1 while the tier is degraded (an operation ran past its deadline), else 0."""
ABANDONED_CALLS = "vllm:kv_offload_remote_tier_abandoned_calls"
"""Gauge, every remote tier: calls still inside the store after their job failed at its deadline."""
REASON_LABEL = "reason"


@dataclass(frozen=True)
class RemoteTierStats:
    """Counters since the tier started (all time in seconds)."""

    state: TierState
    lookups: int
    lookup_hits: int
    stored_keys: int
    store_failed_keys: int
    loaded_keys: int
    load_failed_keys: int
    wrong_size_keys: int
    """Keys whose value did not have a sealed chunk's exact size (each also counted in ``load_failed_keys``)."""
    integrity_failures: int
    """Keys whose value failed its seal check, any reason, wrong sizes included (each also in ``load_failed_keys``)."""
    failed_ops: int
    """Store calls (lookup, put, get) that failed, timed out, or were refused while the tier was down."""
    failed_op_seconds: float
    """Time those failed calls took."""
    slowest_op_seconds: float
    reconnects: int
    bytes_stored: int
    bytes_loaded: int
    failures: Mapping[str, int]
    """Failed operations by :class:`FailureReason` value (``"deadline"``, ...; a job or lookup counts once)."""
    abandoned_calls: int
    """Calls still inside the store whose job already failed at its deadline (their slots are kept aside)."""


@dataclass
class _Counters:
    """The mutable counters behind :class:`RemoteTierStats` (the same fields, less ``state``)."""

    lookups: int = 0
    lookup_hits: int = 0
    stored_keys: int = 0
    store_failed_keys: int = 0
    loaded_keys: int = 0
    load_failed_keys: int = 0
    wrong_size_keys: int = 0
    integrity_failures: int = 0
    failed_ops: int = 0
    failed_op_seconds: float = 0.0
    slowest_op_seconds: float = 0.0
    reconnects: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    failures: dict[FailureReason, int] = field(default_factory=lambda: dict.fromkeys(FailureReason, 0))
    abandoned_calls: int = 0


class _Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    """An I/O thread is inside the store call."""
    LANDING = "landing"
    """The call returned in time: the I/O thread checks and delivers the result (no deadline applies any more)."""
    DONE = "done"
    ABANDONED = "abandoned"
    """Failed at its deadline and reported; a call it had started may still be inside the store."""


@dataclass
class _Job:
    job_id: JobId
    keys: list[OffloadKey]
    object_keys: list[str]
    pointers: list[int]
    seal_pointers: list[int]
    chunk_ids: list[int]
    is_load: bool
    deadline: float
    submitted: float = 0.0
    future: Future[None] | None = None
    succeeded: list[OffloadKey] = field(default_factory=lambda: [])
    failed: list[OffloadKey] = field(default_factory=lambda: [])
    seconds: float = 0.0
    phase: _Phase = _Phase.QUEUED
    overdue: bool = False
    """The deadline passed while the call ran (counted once; a store then reports failed when the call returns)."""
    call_returned: threading.Event = field(default_factory=threading.Event)
    """Set once no store call of this job can touch memory any more (vLLM 0.34's ``deferred_release``)."""


class _RemoteLookups(AsyncLookupManager):
    """vLLM's async lookup bookkeeping; each step's keys are checked in one bounded ``exist``."""

    def __init__(self, tier: RemoteTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.exists(keys)


class RemoteTier(SecondaryTierManager):
    """A vLLM secondary tier over a remote store reached through a :class:`RemoteClient` (see the module docstring).

    A backend sets :attr:`backend` and :attr:`metrics`, implements
    :meth:`open_client`, and passes its configuration's shared keys as
    ``settings``; docs/tiers.md, "Adding a tier backend", walks through one.
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    backend: ClassVar[str] = "remote"
    """The backend's name in log lines (``Mooncake tier '...': ...``)."""
    metrics: ClassVar[RemoteTierMetrics] = RemoteTierMetrics.with_prefix("remote")
    """The names of the backend's metrics."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        settings: RemoteTierSettings,
        *,
        endpoint: str,
        label_arguments: Mapping[str, object],
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        """``settings``: the configuration's shared keys; ``endpoint``: where the store is, for log lines;
        ``label_arguments``: every configuration key as given, to find this tier's position for its ``tier`` label."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = settings
        self.endpoint = endpoint
        self.locality = Locality(locality) if locality is not None else None
        self.tier_label: str = vllm_tier_label(offloading_spec, tier_type, label_arguments)
        """The ``tier`` label of this tier's metrics: vLLM's own for it (``"1:MooncakeStoreTier"``)."""
        if primary_kv_view.ndim != 2 or not primary_kv_view.c_contiguous:
            raise ValueError(
                f"primary_kv_view must be a C-contiguous (num_chunks, chunk_bytes) view, got shape {primary_kv_view.shape}"
            )
        namespace = settings.namespace
        # The registered region: one numpy view over the primary's memory, kept alive with its address.
        self._primary_array = np.frombuffer(primary_kv_view, dtype=np.uint8)
        self._primary_base: int = self._primary_array.ctypes.data
        self._chunk_bytes = self.block_size_bytes
        self.identity = kv_identity(offloading_spec, namespace)
        """What every value's seal names and the keys are filed under (docs/tiers.md, "Integrity")."""
        self.keyspace = TierKeyspace(chunk_identity(offloading_spec, self._chunk_bytes, namespace, self.identity.hex))
        # One seal slot per primary chunk, registered with the store beside the primary: a job on a chunk
        # owns that chunk's seal slot as it owns the chunk.
        self._seals = np.zeros((len(primary_kv_view), SEAL_BYTES), dtype=np.uint8)
        self._seals_base: int = self._seals.ctypes.data
        self.integrity = IntegrityReport(self.tier_label)
        """Values that failed their seal check: counted by reason, warned about at a bounded rate."""

        self._lock = threading.Lock()
        """Guards the counters, the state and the client handle (taken by I/O, lookup and supervisor threads)."""
        self._counters = _Counters()
        self._state = TierState.CONNECTING
        self._store: RemoteClient | None = None
        self._reported = self.stats()
        """The counters as of the last get_stats (vLLM's metrics take increments)."""
        self._up = threading.Event()
        self._stopping = threading.Event()
        self._wake_supervisor = threading.Event()

        self._jobs: dict[JobId, _Job] = {}
        """Submitted jobs not yet returned by get_finished_jobs (scheduler thread only)."""
        self._in_flight: dict[JobId, _Job] = {}
        """Every job whose call has not returned, reported or not (under ``_lock``): drain and shutdown wait on them."""
        self._loads_into_primary = JOB_RESULTS_DEFER_RELEASE
        """Loads write the primary's slots directly, and a load abandoned at its deadline hands vLLM a
        ``deferred_release`` event (vLLM 0.34). Without it (0.33) a load lands in memory of its own first and is
        copied into the primary only if it returned in time, so a late write never reaches a slot vLLM reused."""
        self._backoff_s = settings.retry_backoff_s
        self._recovered_at = -math.inf
        self._finished: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        prefix = f"kvtriton_{self.backend.lower()}"
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix=f"{prefix}_{tier_type}")
        # One thread for existence checks, so a caller can stop waiting on a hung store after the timeout.
        self._exist_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}_lookup_{tier_type}")
        self._lookups = _RemoteLookups(self)
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"{prefix}_supervisor_{tier_type}", daemon=True
        )

    def start(self) -> None:
        """Start connecting in the background; a subclass calls it last in its constructor."""
        self._supervisor.start()
        logger.info(
            "%s tier %r: %s, namespace digest %s (%s), %d-byte chunks + %d-byte seals, timeout %.1f s; %s",
            self.backend,
            self.tier_type,
            self.endpoint,
            self.keyspace.digest,
            self.keyspace.identity.model,
            self._chunk_bytes,
            SEAL_BYTES,
            self.settings.timeout_s,
            self.identity.describe(),
        )

    @abstractmethod
    def open_client(self) -> RemoteClient | None:
        """A client set up against the store, or None when setup failed (bounded by the timeout); on the
        supervisor thread. A backend implements it."""

    # ------------------------------------------------------------------
    # Connection: setup, loss and reconnection
    # ------------------------------------------------------------------

    @property
    def state(self) -> TierState:
        return self._state

    def wait_until_up(self, timeout_s: float) -> bool:
        """Block until the tier reaches the store (True) or ``timeout_s`` passes (False); for tests and tools."""
        return self._up.wait(timeout_s)

    def _supervise(self) -> None:
        """Set the client up, then bring it back whenever an operation found the store gone or too slow."""
        while not self._stopping.is_set():
            state = self._state
            if state is TierState.CONNECTING:
                self._connect()
            elif state is TierState.DOWN:
                self._probe()
            elif state is TierState.DEGRADED:
                self._stopping.wait(self._backoff_s)
                if self._state is TierState.DEGRADED and not self._stopping.is_set():
                    self._retry_degraded()
                continue
            if self._state is TierState.UP:
                self._wake_supervisor.wait()  # until an operation reports the store lost or slow, or shutdown
                self._wake_supervisor.clear()
            else:
                self._stopping.wait(self.settings.reconnect_interval_s)

    def _retry_degraded(self) -> None:
        """After the back-off: up again if no abandoned call is still inside the store and a probe answers in time;
        otherwise the next wait is twice as long (up to ``retry_backoff_max_s``)."""
        with self._lock:
            stuck = self._counters.abandoned_calls
        if stuck:
            logger.info(
                "%s tier %r: %d call(s) still inside the store past their deadline; staying degraded",
                self.backend,
                self.tier_type,
                stuck,
            )
            self._longer_backoff()
            return
        store = self._store
        started = time.monotonic()
        found: list[bool] | FailureReason = FailureReason.REFUSED
        if store is not None:
            probed = store
            found = self._bounded(lambda: probed.exist([self.keyspace.manifest_key]))
        if not isinstance(found, list):
            self._count_failure(time.monotonic() - started, _reason(found))
            self._longer_backoff()
            return
        with self._lock:
            if self._state is not TierState.DEGRADED:
                return
            self._state = TierState.UP
            self._recovered_at = time.monotonic()
        self._up.set()
        logger.info("%s tier %r: %s answers in time again; serving", self.backend, self.tier_type, self.endpoint)

    def _longer_backoff(self) -> None:
        self._backoff_s = min(self._backoff_s * 2, self.settings.retry_backoff_max_s)

    def _degrade(self, what: str) -> None:
        """An operation ran past its deadline: stop using the store until it answers in time again (with back-off)."""
        with self._lock:
            if self._state is not TierState.UP:
                return
            self._state = TierState.DEGRADED
            recently = time.monotonic() - self._recovered_at < self.settings.retry_backoff_max_s
            self._backoff_s = (
                min(self._backoff_s * 2, self.settings.retry_backoff_max_s)
                if recently
                else self.settings.retry_backoff_s
            )
            backoff = self._backoff_s
        self._up.clear()
        logger.warning(
            "%s tier %r: %s did not answer within %.1f s (%s); degraded: every lookup misses and every job fails at "
            "once for the next %.1f s, then it is tried again",
            self.backend,
            self.tier_type,
            self.endpoint,
            self.settings.timeout_s,
            what,
            backoff,
        )
        self._wake_supervisor.set()

    def _connect(self) -> None:
        started = time.monotonic()
        try:
            store = self.open_client()
        except Exception:  # a broken installation or bad address: keep missing, keep trying
            logger.exception("%s tier %r: store setup raised", self.backend, self.tier_type)
            store = None
        if store is None:
            self._count_failure(time.monotonic() - started, FailureReason.UNREACHABLE)
            return
        for base, nbytes, what in (
            (self._primary_base, self._primary_array.nbytes, f"the primary's {self._primary_array.nbytes} bytes"),
            (self._seals_base, self._seals.nbytes, f"the {self._seals.nbytes} bytes of seals"),
        ):
            if not store.register_memory(base, nbytes):
                logger.error("%s tier %r: registering %s failed", self.backend, self.tier_type, what)
                store.close()
                self._count_failure(time.monotonic() - started, FailureReason.ERROR)
                return
        with self._lock:
            if self._stopping.is_set():
                store.close()
                return
            self._store = store
        if self._write_manifest(store):
            self._set_up()
            return
        with self._lock:  # set up but the store stopped answering: probe it like a lost one
            if self._state is TierState.CONNECTING:
                self._state = TierState.DOWN

    def _probe(self) -> None:
        store = self._store
        if store is None:
            self._state = TierState.CONNECTING
            return
        started = time.monotonic()
        found = self._bounded(lambda: store.exist([self.keyspace.manifest_key]))
        if not isinstance(found, list) or len(found) != 1:
            self._count_failure(time.monotonic() - started, _reason(found))
            return
        # A restarted store has forgotten every object, the manifest included.
        if not found[0] and not self._write_manifest(store):
            return
        with self._lock:
            self._counters.reconnects += 1
        logger.info("%s tier %r: %s is back", self.backend, self.tier_type, self.endpoint)
        self._set_up()

    def _write_manifest(self, store: RemoteClient) -> bool:
        """Store the readable configuration behind the digest, once per digest; False when the store did not answer.

        A manifest the pool refuses (full, say) is logged and skipped: it documents
        the digest, serving does not depend on it.
        """
        key = self.keyspace.manifest_key
        exists = self._bounded(lambda: store.exist([key]))
        if not isinstance(exists, list) or len(exists) != 1:
            return False
        if exists[0]:
            return True
        status = self._bounded(lambda: store.put_value(key, self.keyspace.identity.manifest()))
        if not isinstance(status, Outcome) or status is Outcome.UNREACHABLE:
            return False
        if status is not Outcome.OK:
            logger.warning("%s tier %r: storing the manifest %s failed", self.backend, self.tier_type, key)
        return True

    def _set_up(self) -> None:
        with self._lock:
            if self._state is TierState.CLOSED:
                return
            self._state = TierState.UP
        self._up.set()

    def _set_down(self) -> None:
        with self._lock:
            if self._state is not TierState.UP:
                return
            self._state = TierState.DOWN
        self._up.clear()
        logger.warning(
            "%s tier %r: %s unreachable; every lookup misses until it answers again",
            self.backend,
            self.tier_type,
            self.endpoint,
        )
        self._wake_supervisor.set()

    def _bounded(self, call: Callable[[], _T]) -> _T | FailureReason:
        """``call()`` on the existence-check thread, or why it gave no answer: past the deadline (the store is then
        taken for lost), unreachable, or raised."""
        try:
            future = self._exist_pool.submit(call)
        except RuntimeError:  # the pool is shut down
            return FailureReason.REFUSED
        try:
            return future.result(timeout=self.settings.timeout_s)
        except FutureTimeoutError:
            self._set_down()
            return FailureReason.DEADLINE
        except Unreachable:
            self._set_down()
            return FailureReason.UNREACHABLE
        except Exception:  # the binding raised: treat it as no answer, and keep the calling thread alive
            logger.exception("%s tier %r: a store call raised", self.backend, self.tier_type)
            return FailureReason.ERROR

    def _count_failure(self, seconds: float, reason: FailureReason) -> None:
        with self._lock:
            self._counters.failed_ops += 1
            self._counters.failed_op_seconds += seconds
            self._counters.slowest_op_seconds = max(self._counters.slowest_op_seconds, seconds)
            self._counters.failures[reason] += 1

    def _count_op(self, seconds: float) -> None:
        with self._lock:
            self._counters.slowest_op_seconds = max(self._counters.slowest_op_seconds, seconds)

    # ------------------------------------------------------------------
    # Lookups
    # ------------------------------------------------------------------

    def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which ``keys`` the store holds, in one ``exist``; all False when down or past the timeout."""
        store = self._store
        with self._lock:
            self._counters.lookups += len(keys)
        if self._state is not TierState.UP or store is None:
            self._count_failure(0.0, FailureReason.REFUSED)
            return [False] * len(keys)
        object_keys = [self.object_key(key) for key in keys]
        started = time.monotonic()
        found = self._bounded(lambda: store.exist(object_keys))
        seconds = time.monotonic() - started
        if not isinstance(found, list) or len(found) != len(keys):
            self._count_failure(seconds, _reason(found))
            return [False] * len(keys)
        self._count_op(seconds)
        with self._lock:
            self._counters.lookup_hits += sum(found)
        return found

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._state is not TierState.UP:
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

    def _submit(self, job_metadata: TransferJob, is_load: bool) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(chunk) for chunk in job_metadata.chunk_ids]
        if len(chunk_ids) != len(keys):
            raise ValueError(f"job {job_metadata.job_id}: {len(keys)} keys but {len(chunk_ids)} chunk_ids")
        now = time.monotonic()
        job = _Job(
            job_id=job_metadata.job_id,
            keys=keys,
            object_keys=[self.object_key(key) for key in keys],
            pointers=[self._primary_base + chunk * self._chunk_bytes for chunk in chunk_ids],
            seal_pointers=[self._seals_base + chunk * SEAL_BYTES for chunk in chunk_ids],
            chunk_ids=chunk_ids,
            is_load=is_load,
            deadline=now + self.settings.timeout_s,
            submitted=now,
        )
        self._jobs[job.job_id] = job
        if self._state is not TierState.UP:  # fail at once: no I/O thread needed (they may all be in stalled calls)
            self._count_failure(0.0, FailureReason.REFUSED)
            self._fail_unrun(job)
            return
        try:
            job.future = self._io.submit(self._run, job)
        except RuntimeError:  # shut down: the job fails like any other
            self._fail_unrun(job)

    def _fail_unrun(self, job: _Job) -> None:
        """Report ``job`` failed; it never reached the store."""
        job.failed = list(job.keys)
        job.phase = _Phase.DONE
        job.call_returned.set()
        self._finished.put(job)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _run(self, job: _Job) -> None:
        """One job on an I/O thread: a single batch call, every key's result checked.

        Reaches ``_finished`` unless the job was abandoned at its deadline (then
        it was reported already; a store is never abandoned while its call runs,
        see :meth:`_expire`)."""
        with self._lock:
            if job.phase is _Phase.ABANDONED:  # failed at its deadline while queued: never touched memory
                job.call_returned.set()
                return
            job.phase = _Phase.RUNNING
            self._in_flight[job.job_id] = job
        started = time.monotonic()
        try:
            self._transfer(job)
        except Exception:
            logger.exception("%s tier %r: job %d raised", self.backend, self.tier_type, job.job_id)
            job.failed = [key for key in job.keys if key not in set(job.succeeded)]
        finally:
            job.seconds = time.monotonic() - started
            with self._lock:
                abandoned = _abandoned(job)  # set by the scheduler thread meanwhile
                if not abandoned:
                    job.phase = _Phase.DONE
                self._in_flight.pop(job.job_id, None)
                late = abandoned or job.overdue
                if late:
                    self._counters.abandoned_calls -= 1
                job.call_returned.set()
            if late:
                logger.warning(
                    "%s tier %r: %s job %d returned from the store after %.1f s, %.1f s past its deadline; "
                    "its slots are free again",
                    self.backend,
                    self.tier_type,
                    "load" if job.is_load else "store",
                    job.job_id,
                    time.monotonic() - job.submitted,
                    time.monotonic() - job.deadline,
                )
            if not abandoned:
                self._finished.put(job)

    def _transfer(self, job: _Job) -> None:
        store = self._store
        if self._state is not TierState.UP or store is None or time.monotonic() > job.deadline:
            job.failed = list(job.keys)  # not up, or queued past the deadline: fail without touching the network
            self._count_failure(
                0.0, FailureReason.REFUSED if self._state is not TierState.UP else FailureReason.DEADLINE
            )
            return
        sealed_bytes = self._chunk_bytes + SEAL_BYTES
        staging: np.ndarray | None = None
        if job.is_load and not self._loads_into_primary:
            staging = np.empty((len(job.keys), sealed_bytes), dtype=np.uint8)
            if not store.register_memory(staging.ctypes.data, staging.nbytes):
                job.failed = list(job.keys)
                self._count_failure(0.0, FailureReason.ERROR)
                return
            base = staging.ctypes.data
            segments: list[list[Segment]] = [
                [
                    (base + index * sealed_bytes, self._chunk_bytes),
                    (base + index * sealed_bytes + self._chunk_bytes, SEAL_BYTES),
                ]
                for index in range(len(job.keys))
            ]
        else:
            segments = [
                [(chunk, self._chunk_bytes), (seal, SEAL_BYTES)] for chunk, seal in zip(job.pointers, job.seal_pointers)
            ]
        started = time.monotonic()
        try:
            if job.is_load:
                results = store.get(job.object_keys, segments)
            else:
                for key, chunk in zip(job.keys, job.chunk_ids):
                    self._seals[chunk] = np.frombuffer(self._seal_of(key, chunk), dtype=np.uint8)
                results = store.put(job.object_keys, segments)
        finally:
            if staging is not None:
                store.unregister_memory(staging.ctypes.data)
        seconds = time.monotonic() - started
        with self._lock:
            if job.phase is _Phase.ABANDONED:
                return  # reported failed at its deadline: what the call wrote stays in memory vLLM keeps aside
            job.phase = _Phase.LANDING
            overdue = job.overdue
        if len(results) != len(job.keys):
            results = [Outcome.FAILED] * len(job.keys)
        wrong_size = 0
        faults = 0
        for index, (key, object_key, chunk, result) in enumerate(
            zip(job.keys, job.object_keys, job.chunk_ids, results)
        ):
            if not job.is_load:
                (job.succeeded if result is Outcome.OK and not overdue else job.failed).append(key)
                continue
            fault: IntegrityFault | None = None
            if result == sealed_bytes:
                fault = self._verify(key, chunk, None if staging is None else staging[index])
            elif isinstance(result, int) or result is Outcome.FAILED:
                fault = self._size_fault(store, object_key, result)
                if fault is not None:
                    wrong_size += 1
            if result == sealed_bytes and fault is None:
                if staging is not None:
                    start = chunk * self._chunk_bytes
                    self._primary_array[start : start + self._chunk_bytes] = staging[index, : self._chunk_bytes]
                job.succeeded.append(key)
                continue
            job.failed.append(key)
            if fault is not None:
                faults += 1
                self.integrity.record(fault, object_key)
        lost_store = any(result is Outcome.UNREACHABLE for result in results)
        with self._lock:
            counters = self._counters
            counters.slowest_op_seconds = max(counters.slowest_op_seconds, seconds)
            if job.failed and not overdue:  # an overdue store was counted at its deadline
                counters.failed_ops += 1
                counters.failed_op_seconds += seconds
                counters.failures[FailureReason.UNREACHABLE if lost_store else FailureReason.ERROR] += 1
            if job.is_load:
                counters.loaded_keys += len(job.succeeded)
                counters.load_failed_keys += len(job.failed)
                counters.wrong_size_keys += wrong_size
                counters.integrity_failures += faults
                counters.bytes_loaded += len(job.succeeded) * self._chunk_bytes
            else:
                counters.stored_keys += len(job.succeeded)
                counters.store_failed_keys += len(job.failed)
                counters.bytes_stored += len(job.succeeded) * self._chunk_bytes
        if job.failed and not overdue:
            failed_results = sorted(
                {_describe(result) for result, key in zip(results, job.keys) if key in set(job.failed)}
            )
            logger.info(
                "%s tier %r: %s job %d: %d of %d keys failed (%s)",
                self.backend,
                self.tier_type,
                "load" if job.is_load else "store",
                job.job_id,
                len(job.failed),
                len(job.keys),
                ", ".join(failed_results),
            )
        if lost_store:
            self._set_down()

    def _chunk_view(self, chunk: int) -> memoryview:
        start = chunk * self._chunk_bytes
        return self._primary_array[start : start + self._chunk_bytes].data

    def _seal_of(self, key: OffloadKey, chunk: int) -> bytes:
        """The seal of primary chunk ``chunk`` as the value of ``key``."""
        return seal_bytes(self._chunk_view(chunk), key=key, fingerprint=self.identity.fingerprint)

    def _verify(self, key: OffloadKey, chunk: int, landed: np.ndarray | None) -> IntegrityFault | None:
        """Whether the value just read (into ``chunk`` and its seal slot, or into ``landed``: the chunk, then its seal)
        is ``key``'s sealed chunk."""
        if landed is not None:
            payload, seal = landed[: self._chunk_bytes].data, landed[self._chunk_bytes :].data
        else:
            payload, seal = self._chunk_view(chunk), self._seals[chunk].data
        return verify_seal(payload, seal, key=key, fingerprint=self.identity.fingerprint)

    def _size_fault(self, store: RemoteClient, object_key: str, result: int | Outcome) -> IntegrityFault | None:
        """Why a get that moved no sealed chunk failed: the value's size (torn or too long), or None (no value).

        A store may refuse a get into buffers that do not match the value's size
        exactly without saying so; one ``size_of`` (only on this rare path) tells.
        """
        size = result if isinstance(result, int) else store.size_of(object_key)
        if size is None:
            return None
        sealed_bytes = self._chunk_bytes + SEAL_BYTES
        logger.warning(
            "%s tier %r: %s holds %d bytes, not a %d-byte sealed chunk: a miss",
            self.backend,
            self.tier_type,
            object_key,
            size,
            sealed_bytes,
        )
        return IntegrityFault.TORN if size < sealed_bytes else IntegrityFault.WRONG_SIZE

    def _expire(self, job: _Job, now: float) -> JobResult | None:
        """The deadline of ``job`` has passed: its failure, when it can be reported now (scheduler thread).

        A queued job fails at once (it never touched memory). A running load is
        abandoned: reported failed now, its slots kept aside until the call
        returns (vLLM 0.34's ``deferred_release``; on 0.33 the call writes only
        the job's own landing memory). A running store stays unreported until
        its call returns, then fails: its slots stay pinned by vLLM's read count
        meanwhile, as vLLM has no way to keep a store's slots aside, and no
        request waits on a cascade. Either way the failure is counted now and
        the tier degrades.
        """
        with self._lock:
            if job.overdue or job.phase not in (_Phase.QUEUED, _Phase.RUNNING):
                return None
            started = job.phase is _Phase.RUNNING
            if started:
                job.overdue = True
                self._counters.abandoned_calls += 1
            if not started or job.is_load:
                job.phase = _Phase.ABANDONED
            counters = self._counters
            counters.failed_ops += 1
            counters.failed_op_seconds += now - job.submitted
            counters.failures[FailureReason.DEADLINE] += 1
            if job.is_load:
                counters.load_failed_keys += len(job.keys)
        self._degrade(f"{'load' if job.is_load else 'store'} job {job.job_id} {'running' if started else 'queued'}")
        if job.phase is not _Phase.ABANDONED:
            return None  # a running store: reported when its call returns
        self._jobs.pop(job.job_id, None)
        if job.is_load:
            self._lookups.mark_miss(job.keys)
        if started and self._loads_into_primary:
            return failed_load_result(job.job_id, None, now - job.submitted, 0, job.call_returned)
        return JobResult(job.job_id, False, None, now - job.submitted, 0)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                job = self._finished.get_nowait()
            except queue.Empty:
                break
            if self._jobs.pop(job.job_id, None) is None:
                continue
            moved = len(job.succeeded) * self._chunk_bytes
            loaded_some: tuple[OffloadKey, ...] | None = None  # a partly failed load reports the keys it loaded
            if job.failed and job.is_load:
                self._lookups.mark_miss(job.failed)
                loaded_some = tuple(job.succeeded) or None
            elif job.succeeded and not job.is_load:
                mark_stored(self._lookups, job.succeeded)  # a MISS cached before the put gives way (vLLM 0.34)
            results.append(JobResult(job.job_id, not job.failed, loaded_some, job.seconds, moved))
        now = time.monotonic()
        for job in [job for job in self._jobs.values() if now > job.deadline and not job.overdue]:
            expired = self._expire(job, now)
            if expired is not None:
                results.append(expired)
        return results

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def _wait_for_calls(self, bound_s: float | None) -> bool:
        """Wait until no store call of any job (abandoned ones included) can touch memory; False when ``bound_s``
        passed first. Unbounded, it logs a WARNING every ``timeout_s`` it keeps waiting."""
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while True:
            with self._lock:
                running = list(self._in_flight.values())
            if not running:
                return True
            wait_s = self.settings.timeout_s
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
            if not running[0].call_returned.wait(wait_s) and bound_s is None:
                logger.warning(
                    "%s tier %r: waiting for %d call(s) still inside the store (job %s) before the "
                    "primary's slots can be reused",
                    self.backend,
                    self.tier_type,
                    len(running),
                    ", ".join(str(job.job_id) for job in running),
                )

    def _cancel_queued(self) -> None:
        for job in list(self._jobs.values()):
            future = job.future
            if future is not None and future.cancel():
                self._fail_unrun(job)

    @override
    def drain_jobs(self) -> None:
        """Cancel queued jobs (they fail) and wait until no call is inside the store, abandoned ones included.

        vLLM drains before it reuses every primary slot (a cache reset), so this
        waits as long as the store holds a call, however long past the deadline
        (a WARNING every ``timeout_s`` names the jobs): a slot reused under a
        late write would hold another chunk's bytes."""
        self._cancel_queued()
        self._wait_for_calls(None)

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
        self._stopping.set()
        self._wake_supervisor.set()
        with self._lock:
            self._state = TierState.CLOSED
        self._up.clear()
        self._lookups.shutdown()
        self._cancel_queued()
        calls_done = self._wait_for_calls(self.settings.timeout_s)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._exist_pool.shutdown(wait=False, cancel_futures=True)
        self._supervisor.join(self.settings.timeout_s)
        with self._lock:
            store, self._store = self._store, None
            stuck = len(self._in_flight)
        if store is not None and not calls_done:
            _LEFT_OPEN.append(store)
            logger.warning(
                "%s tier %r: %d call(s) still inside the store %.1f s into shutdown: its client is left "
                "open, not closed under them; the process waits for them as it exits",
                self.backend,
                self.tier_type,
                stuck,
                self.settings.timeout_s,
            )
            return  # the primary's memory stays exported too: a late transfer may still write it
        if store is not None:
            prefix = f"kvtriton_{self.backend.lower()}"
            closer = threading.Thread(target=store.close, name=f"{prefix}_close", daemon=True)
            closer.start()
            closer.join(self.settings.timeout_s)
            if closer.is_alive():
                # The store still has the primary's memory registered: keep our export of it, so the primary's
                # region stays mapped instead of being reused under a late transfer.
                logger.warning(
                    "%s tier %r: the store did not close within %.1f s",
                    self.backend,
                    self.tier_type,
                    self.settings.timeout_s,
                )
                return
        # Drop our export of the primary's memory so the primary can unmap its region.
        self._primary_array = np.empty(0, dtype=np.uint8)
        self._seals = np.empty((0, SEAL_BYTES), dtype=np.uint8)

    # ------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------

    def stats(self) -> RemoteTierStats:
        with self._lock:
            fields = dataclasses.asdict(self._counters)
            fields["failures"] = {reason.value: count for reason, count in self._counters.failures.items()}
            return RemoteTierStats(state=self._state, **fields)

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, object]) -> dict[str, OffloadingMetricMetadata]:
        labels = (TIER_LABEL,)
        names = cls.metrics
        backend = cls.backend
        return {
            names.FAILED_OPS: OffloadingCounterMetadata(
                f"{backend} store calls (lookup, put, get) that failed, timed out or were refused while the "
                "store was unreachable.",
                labels,
            ),
            names.FAILED_OP_SECONDS: OffloadingCounterMetadata(
                f"Seconds spent in {backend} store calls that failed.", labels
            ),
            names.WRONG_SIZE_VALUES: OffloadingCounterMetadata(
                f"{backend} values loaded whose size was not the chunk's (each a miss).", labels
            ),
            names.RECONNECTS: OffloadingCounterMetadata(
                f"Times the tier reached the {backend} store again after losing it.", labels
            ),
            names.UP: OffloadingGaugeMetadata(f"1 while the {backend} store answers, else 0.", labels),
            **remote_metric_definitions(),
            **integrity_metric_definitions(),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats:
        """The counters' growth since the last call, and whether the store answers now."""
        now = self.stats()
        last = self._reported
        self._reported = now
        stats = OffloadingConnectorStats()
        labels = (self.tier_label,)
        names = self.metrics
        for name, delta in (
            (names.FAILED_OPS, now.failed_ops - last.failed_ops),
            (names.FAILED_OP_SECONDS, now.failed_op_seconds - last.failed_op_seconds),
            (names.WRONG_SIZE_VALUES, now.wrong_size_keys - last.wrong_size_keys),
            (names.RECONNECTS, now.reconnects - last.reconnects),
        ):
            if delta:
                stats.increase_counter(name, delta, labels)
        stats.set_gauge(names.UP, 1 if now.state is TierState.UP else 0, labels)
        for reason, count in now.failures.items():
            if count - last.failures[reason]:
                stats.increase_counter(FAILURES, count - last.failures[reason], (self.tier_label, reason))
        stats.set_gauge(DEGRADED, 1 if now.state is TierState.DEGRADED else 0, labels)
        stats.set_gauge(ABANDONED_CALLS, now.abandoned_calls, labels)
        self.integrity.add_to(stats)
        return stats


def remote_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics every remote tier adds, whatever its backend (one name each; the ``tier`` label tells them apart)."""
    return {
        FAILURES: OffloadingCounterMetadata(
            "Remote-tier operations that failed, by reason: deadline (no answer within timeout_s: a miss or a failed "
            "store), unreachable, refused (the tier was not up), error (the store answered with a failure).",
            (TIER_LABEL, REASON_LABEL),
        ),
        DEGRADED: OffloadingGaugeMetadata(
            "1 while the tier is degraded (an operation ran past its deadline; retried after a back-off), else 0.",
            (TIER_LABEL,),
        ),
        ABANDONED_CALLS: OffloadingGaugeMetadata(
            "Store calls still running after their job failed at its deadline (their primary slots kept aside).",
            (TIER_LABEL,),
        ),
    }


def _abandoned(job: _Job) -> bool:
    return job.phase is _Phase.ABANDONED


def _reason(answer: object) -> FailureReason:
    """Why a bounded call gave no usable answer (a malformed one is the store's error)."""
    return answer if isinstance(answer, FailureReason) else FailureReason.ERROR


def _describe(result: int | Outcome) -> str:
    """One key's result in a log line: the size a get moved, or the outcome."""
    return f"{result} bytes" if isinstance(result, int) else result.value
