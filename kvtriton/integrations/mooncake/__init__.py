"""MooncakeStoreTier: a secondary tier over Mooncake Store, shared by every instance of a deployment.

vLLM's tiered offloading (``vllm.v1.kv_offload.tiering``, 0.33 and 0.34) loads it by
module path::

    {"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake",
     "master_server_address": "10.0.0.5:50051", "namespace": "prod"}

behind vLLM's own ``TieringOffloadingSpec`` (vLLM's CPU primary) or kvtriton's
tiered spec. Every configuration key is in :class:`MooncakeTierConfig`
(kvtriton/integrations/mooncake/_config.py) and docs/mooncake.md.

How it moves data
    The primary tier's host memory is registered with the store once; a
    cascade is one ``batch_put_from`` reading the pinned primary slots, a
    promotion one ``batch_get_into`` writing into the allocated ones. No chunk
    passes through Python ``bytes``. A get that returns anything but the exact
    chunk size is a miss for that key (the slot is handed back, never used).

How it fails closed
    Object keys are filed under the engine's identity fingerprint
    (:mod:`kvtriton.integrations.vllm._identity`: model, weights, dtypes,
    layout, compression, row format, namespace). Every value is the chunk
    followed by its 64-byte seal (:mod:`kvtriton._integrity`), put from the
    primary's slot and a small registered seal buffer in one
    ``batch_put_from_multi_buffers``; a promotion reads both back in one
    ``batch_get_into_multi_buffers`` and verifies the seal before the chunk
    becomes a hit. A value that fails (other bytes, another key's or another
    identity's chunk, a torn or over-long one, an older format) is a miss for
    that key only, counted in ``vllm:kv_offload_integrity_failures{tier,reason}``
    with a rate-limited WARNING (:mod:`kvtriton.integrations.vllm._integrity_report`).

How it stays out of the scheduler's way
    Lookups go through vLLM's ``AsyncLookupManager``: the scheduler gets RETRY
    until one batched ``batch_is_exist`` per step has answered. On vLLM 0.34
    a key this tier has just stored is marked present there
    (``mark_present``), so a MISS cached from before the put, or a probe
    still in flight, no longer hides it from the next request. Store and load
    jobs run on ``io_threads`` threads and complete through
    ``get_finished_jobs``; a promotion that loaded only some keys reports them.

How it fails
    Every failure is a miss, never a hang or wrong data. The master's RPC
    timeout is the configured ``timeout_s``; a lookup that does not answer
    within it is a miss; a job that waited longer than ``timeout_s`` in the
    queue fails without running. Once an operation finds the master
    unreachable the tier is *down*: lookups miss and jobs fail at once, without
    touching the network, while one background thread probes the master every
    ``reconnect_interval_s`` and brings the tier back when it answers.
    :meth:`MooncakeStoreTier.stats` counts the failures and the time they took.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar, cast

import numpy as np
from typing_extensions import override

from kvtriton._integrity import SEAL_BYTES, IntegrityFault, seal_bytes, verify_seal
from kvtriton.integrations._mooncake_local import mooncake_version_problem
from kvtriton.integrations.mooncake._config import ChunkIdentity, MooncakeKeyspace, MooncakeTierConfig
from kvtriton.integrations.vllm._config import compression_tag
from kvtriton.integrations.vllm._identity import KVIdentity, compute_identity, vllm_identity
from kvtriton.integrations.vllm._integrity_report import IntegrityReport, integrity_metric_definitions
from kvtriton.integrations.vllm._surface import (
    TIER_LABEL,
    AsyncLookupManager,
    BackpressureDetector,
    CacheHitSource,
    ConfigInfoMapping,
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
    get_offload_block_hash,
    get_offload_group_idx,
    mark_stored,
)
from kvtriton.kernels import KVCompression

if TYPE_CHECKING:
    from kvtriton.integrations.vllm._surface import OffloadingSpec

__all__ = [
    "MooncakeStoreTier",
    "MooncakeTierConfig",
    "MooncakeTierMetrics",
    "MooncakeTierStats",
    "StoreClient",
    "TierState",
    "chunk_identity",
    "is_connection_error",
    "kv_identity",
    "open_store",
]

logger = logging.getLogger(__name__)

DEFAULT_LAYOUT_TAG = "vllm-cpu"
"""The layout tag of a primary that does not name its own: vLLM's CPU primary."""

_T = TypeVar("_T")


OBJECT_NOT_FOUND = -704
"""Mooncake's status for a key the store does not hold."""


def is_connection_error(code: int) -> bool:
    """Whether a Mooncake status code says the master could not be reached (RPC_FAIL -900, RPC_TIMEOUT -901, ...)."""
    return -999 <= code <= -900


class StoreClient(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` this tier uses (the package ships no type information)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def get_size(self, key: str) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...
    def put(self, key: str, value: bytes) -> int: ...
    def get(self, key: str) -> bytes: ...
    def close(self) -> int: ...


def open_store(config: MooncakeTierConfig) -> StoreClient | None:
    """A store client set up against ``config``'s master, or None when setup fails (bounded by the timeout's settings).

    Mooncake reads its RPC timeout and setup retries from the environment when
    a client is created, so :meth:`MooncakeTierConfig.mooncake_environment` is
    applied first (the same values for every tier of a process).
    """
    import os

    os.environ.update(config.mooncake_environment())
    module = importlib.import_module("mooncake.store")
    factory = cast("Callable[[], StoreClient]", module.MooncakeDistributedStore)
    store = factory()
    status = store.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.rdma_devices,
        config.master_server_address,
    )
    if status != 0:
        logger.warning("Mooncake store setup against %s failed with status %d", config.master_server_address, status)
        store.close()
        return None
    return store


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


class MooncakeTierMetrics:
    """The Prometheus metrics the tier adds to vLLM's offloading metrics, labelled by tier as vLLM labels it.

    They are in vLLM's ``vllm:kv_offload_`` namespace, so vLLM's Prometheus
    logger exports them beside its own tier series and ``LLM.get_metrics()``
    (which keeps only ``vllm:`` names) returns them; the ``tier`` label is
    vLLM's own for the same tier (``"1:MooncakeStoreTier"``: position in
    ``secondary_tiers`` plus one, and the type), as on vLLM's store, load and
    config-info series.
    """

    FAILED_OPS = "vllm:kv_offload_mooncake_failed_ops"
    FAILED_OP_SECONDS = "vllm:kv_offload_mooncake_failed_op_seconds"
    WRONG_SIZE_VALUES = "vllm:kv_offload_mooncake_wrong_size_values"
    """Values whose size is not a sealed chunk's (each also an integrity failure, reason ``torn`` or ``wrong_size``)."""
    RECONNECTS = "vllm:kv_offload_mooncake_reconnects"
    UP = "vllm:kv_offload_mooncake_up"


_FACTORY_KEYS = frozenset({"type", "module_path", "backpressure"})
"""Keys of a tier's configuration vLLM's SecondaryTierFactory consumes instead of passing them to the tier."""

_claimed_positions: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()
"""The ``secondary_tiers`` positions already taken by a Mooncake tier of each spec (two equal configs get two)."""


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
    """Never reached the master yet: everything misses while the background thread sets up."""
    UP = "up"
    DOWN = "down"
    """The master was lost: everything misses until a probe answers."""
    CLOSED = "closed"


@dataclass(frozen=True)
class MooncakeTierStats:
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


@dataclass
class _Counters:
    """The mutable counters behind :class:`MooncakeTierStats` (the same fields, less ``state``)."""

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
    future: Future[None] | None = None
    succeeded: list[OffloadKey] = field(default_factory=lambda: [])
    failed: list[OffloadKey] = field(default_factory=lambda: [])
    seconds: float = 0.0


class _MooncakeLookups(AsyncLookupManager):
    """vLLM's async lookup bookkeeping; each step's keys are checked in one bounded ``batch_is_exist``."""

    def __init__(self, tier: MooncakeStoreTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.exists(keys)


class MooncakeStoreTier(SecondaryTierManager):
    """A vLLM secondary tier over Mooncake Store (see the module docstring)."""

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        master_server_address: str,
        local_hostname: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        rdma_devices: str = "",
        local_buffer_size: int = 16 * 1024 * 1024,
        global_segment_size: int = 0,
        namespace: str = "",
        timeout_s: float = 5.0,
        io_threads: int = 4,
        reconnect_interval_s: float = 1.0,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        """The keyword arguments after ``tier_type`` are the tier's configuration (docs/mooncake.md)."""
        outdated = mooncake_version_problem()
        if outdated is not None:
            raise ImportError(outdated)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = MooncakeTierConfig(
            master_server_address=master_server_address,
            local_hostname=local_hostname,
            metadata_server=metadata_server,
            protocol=protocol,
            rdma_devices=rdma_devices,
            local_buffer_size=local_buffer_size,
            global_segment_size=global_segment_size,
            namespace=namespace,
            timeout_s=timeout_s,
            io_threads=io_threads,
            reconnect_interval_s=reconnect_interval_s,
        )
        self.locality = Locality(locality) if locality is not None else None
        self.tier_label: str = vllm_tier_label(
            offloading_spec,
            tier_type,
            {
                "master_server_address": master_server_address, "local_hostname": local_hostname,
                "metadata_server": metadata_server, "protocol": protocol, "rdma_devices": rdma_devices,
                "local_buffer_size": local_buffer_size, "global_segment_size": global_segment_size,
                "namespace": namespace, "timeout_s": timeout_s, "io_threads": io_threads,
                "reconnect_interval_s": reconnect_interval_s, "locality": locality,
            },
        )  # fmt: skip
        """The ``tier`` label of this tier's metrics: vLLM's own for it (``"1:MooncakeStoreTier"``)."""
        if primary_kv_view.ndim != 2 or not primary_kv_view.c_contiguous:
            raise ValueError(
                f"primary_kv_view must be a C-contiguous (num_chunks, chunk_bytes) view, got shape {primary_kv_view.shape}"
            )
        # The registered region: one numpy view over the primary's memory, kept alive with its address.
        self._primary_array = np.frombuffer(primary_kv_view, dtype=np.uint8)
        self._primary_base: int = self._primary_array.ctypes.data
        self._chunk_bytes = self.block_size_bytes
        self.identity = kv_identity(offloading_spec, namespace)
        """What every value's seal names and the keys are filed under (docs/tiers.md, "Integrity")."""
        self.keyspace = MooncakeKeyspace(
            chunk_identity(offloading_spec, self._chunk_bytes, namespace, self.identity.hex)
        )
        # One seal slot per primary chunk, registered with the store beside the primary: a job on a chunk
        # owns that chunk's seal slot as it owns the chunk.
        self._seals = np.zeros((len(primary_kv_view), SEAL_BYTES), dtype=np.uint8)
        self._seals_base: int = self._seals.ctypes.data
        self.integrity = IntegrityReport(self.tier_label)
        """Values that failed their seal check: counted by reason, warned about at a bounded rate."""

        self._lock = threading.Lock()
        """Guards the counters, the state and the store handle (taken by I/O, lookup and supervisor threads)."""
        self._counters = _Counters()
        self._state = TierState.CONNECTING
        self._store: StoreClient | None = None
        self._reported = self.stats()
        """The counters as of the last get_stats (vLLM's metrics take increments)."""
        self._up = threading.Event()
        self._stopping = threading.Event()
        self._wake_supervisor = threading.Event()

        self._jobs: dict[JobId, _Job] = {}
        """Submitted jobs not yet returned by get_finished_jobs (scheduler thread only)."""
        self._finished: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._io = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix=f"kvtriton_mooncake_{tier_type}")
        # One thread for existence checks, so a caller can stop waiting on a hung master after the timeout.
        self._exist_pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvtriton_mooncake_lookup_{tier_type}")
        self._lookups = _MooncakeLookups(self)
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"kvtriton_mooncake_supervisor_{tier_type}", daemon=True
        )
        self._supervisor.start()
        logger.info(
            "Mooncake tier %r: master %s, namespace digest %s (%s), %d-byte chunks + %d-byte seals, timeout %.1f s; %s",
            tier_type, self.config.master_server_address, self.keyspace.digest, self.keyspace.identity.model,
            self._chunk_bytes, SEAL_BYTES, self.config.timeout_s, self.identity.describe(),
        )  # fmt: skip

    # ------------------------------------------------------------------
    # Connection: setup, loss and reconnection
    # ------------------------------------------------------------------

    @property
    def state(self) -> TierState:
        return self._state

    def wait_until_up(self, timeout_s: float) -> bool:
        """Block until the tier reaches the master (True) or ``timeout_s`` passes (False); for tests and tools."""
        return self._up.wait(timeout_s)

    def _supervise(self) -> None:
        """Set the store up, then bring it back whenever an operation found the master gone."""
        while not self._stopping.is_set():
            state = self._state
            if state is TierState.CONNECTING:
                self._connect()
            elif state is TierState.DOWN:
                self._probe()
            if self._state is TierState.UP:
                self._wake_supervisor.wait()  # until an operation reports the master lost, or shutdown
                self._wake_supervisor.clear()
            else:
                self._stopping.wait(self.config.reconnect_interval_s)

    def _connect(self) -> None:
        started = time.monotonic()
        try:
            store = open_store(self.config)
        except Exception:  # a broken installation or bad address: keep missing, keep trying
            logger.exception("Mooncake tier %r: store setup raised", self.tier_type)
            store = None
        if store is None:
            self._count_failure(time.monotonic() - started)
            return
        for base, nbytes, what in (
            (self._primary_base, self._primary_array.nbytes, f"the primary's {self._primary_array.nbytes} bytes"),
            (self._seals_base, self._seals.nbytes, f"the {self._seals.nbytes} bytes of seals"),
        ):
            status = store.register_buffer(base, nbytes)
            if status != 0:
                logger.error("Mooncake tier %r: registering %s failed (%d)", self.tier_type, what, status)
                store.close()
                self._count_failure(time.monotonic() - started)
                return
        with self._lock:
            if self._stopping.is_set():
                store.close()
                return
            self._store = store
        if self._write_manifest(store):
            self._set_up()
            return
        with self._lock:  # set up but the master stopped answering: probe it like a lost one
            if self._state is TierState.CONNECTING:
                self._state = TierState.DOWN

    def _probe(self) -> None:
        store = self._store
        if store is None:
            self._state = TierState.CONNECTING
            return
        started = time.monotonic()
        found = self._bounded(lambda: store.batch_is_exist([self.keyspace.manifest_key]))
        if found is None or len(found) != 1 or found[0] < 0:
            self._count_failure(time.monotonic() - started)
            return
        # A restarted master has forgotten every object, the manifest included.
        if found[0] == 0 and not self._write_manifest(store):
            return
        with self._lock:
            self._counters.reconnects += 1
        logger.info("Mooncake tier %r: master %s is back", self.tier_type, self.config.master_server_address)
        self._set_up()

    def _write_manifest(self, store: StoreClient) -> bool:
        """Store the readable configuration behind the digest, once per digest; False when the master did not answer.

        A manifest the pool refuses (full, say) is logged and skipped: it documents
        the digest, serving does not depend on it.
        """
        key = self.keyspace.manifest_key
        exists = self._bounded(lambda: store.batch_is_exist([key]))
        if exists is None or len(exists) != 1 or is_connection_error(exists[0]):
            return False
        if exists[0] == 1:
            return True
        status = self._bounded(lambda: store.put(key, self.keyspace.identity.manifest()))
        if status is None or is_connection_error(status):
            return False
        if status != 0:
            logger.warning("Mooncake tier %r: storing the manifest %s failed (%d)", self.tier_type, key, status)
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
            "Mooncake tier %r: master %s unreachable; every lookup misses until it answers again",
            self.tier_type, self.config.master_server_address,
        )  # fmt: skip
        self._wake_supervisor.set()

    def _bounded(self, call: Callable[[], _T]) -> _T | None:
        """``call()`` on the existence-check thread; None when it does not return within the timeout."""
        try:
            future = self._exist_pool.submit(call)
        except RuntimeError:  # the pool is shut down
            return None
        try:
            return future.result(timeout=self.config.timeout_s)
        except FutureTimeoutError:
            self._set_down()
            return None
        except Exception:  # the binding raised: treat it as no answer, and keep the calling thread alive
            logger.exception("Mooncake tier %r: a store call raised", self.tier_type)
            return None

    def _count_failure(self, seconds: float, ops: int = 1) -> None:
        with self._lock:
            self._counters.failed_ops += ops
            self._counters.failed_op_seconds += seconds
            self._counters.slowest_op_seconds = max(self._counters.slowest_op_seconds, seconds)

    def _count_op(self, seconds: float) -> None:
        with self._lock:
            self._counters.slowest_op_seconds = max(self._counters.slowest_op_seconds, seconds)

    # ------------------------------------------------------------------
    # Lookups
    # ------------------------------------------------------------------

    def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which ``keys`` the store holds, in one ``batch_is_exist``; all False when down or past the timeout."""
        store = self._store
        with self._lock:
            self._counters.lookups += len(keys)
        if self._state is not TierState.UP or store is None:
            self._count_failure(0.0)
            return [False] * len(keys)
        object_keys = [self.object_key(key) for key in keys]
        started = time.monotonic()
        codes = self._bounded(lambda: store.batch_is_exist(object_keys))
        seconds = time.monotonic() - started
        if codes is None or len(codes) != len(keys):
            self._count_failure(seconds)
            return [False] * len(keys)
        if any(is_connection_error(code) for code in codes):
            self._count_failure(seconds)
            self._set_down()
        else:
            self._count_op(seconds)
        found = [code == 1 for code in codes]
        with self._lock:
            self._counters.lookup_hits += sum(found)
        return found

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._state is not TierState.UP:
            return LookupResult.MISS  # no probe while down: the scheduler never waits on a lost master
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
        """The Mooncake object ``key`` is stored under."""
        return self.keyspace.object_key(get_offload_block_hash(key), get_offload_group_idx(key))

    def _submit(self, job_metadata: TransferJob, is_load: bool) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(chunk) for chunk in job_metadata.chunk_ids]
        if len(chunk_ids) != len(keys):
            raise ValueError(f"job {job_metadata.job_id}: {len(keys)} keys but {len(chunk_ids)} chunk_ids")
        job = _Job(
            job_id=job_metadata.job_id,
            keys=keys,
            object_keys=[self.object_key(key) for key in keys],
            pointers=[self._primary_base + chunk * self._chunk_bytes for chunk in chunk_ids],
            seal_pointers=[self._seals_base + chunk * SEAL_BYTES for chunk in chunk_ids],
            chunk_ids=chunk_ids,
            is_load=is_load,
            deadline=time.monotonic() + self.config.timeout_s,
        )
        self._jobs[job.job_id] = job
        try:
            job.future = self._io.submit(self._run, job)
        except RuntimeError:  # shut down: the job fails like any other
            job.failed = list(keys)
            self._finished.put(job)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _run(self, job: _Job) -> None:
        """One job on an I/O thread: a single batch call, every key's result checked; always reaches ``_finished``."""
        started = time.monotonic()
        try:
            self._transfer(job)
        except Exception:
            logger.exception("Mooncake tier %r: job %d raised", self.tier_type, job.job_id)
            job.failed = [key for key in job.keys if key not in set(job.succeeded)]
        finally:
            job.seconds = time.monotonic() - started
            self._finished.put(job)

    def _transfer(self, job: _Job) -> None:
        store = self._store
        if self._state is not TierState.UP or store is None or time.monotonic() > job.deadline:
            job.failed = list(job.keys)  # down, or queued past the timeout: fail without touching the network
            self._count_failure(0.0)
            return
        buffers = [[chunk, seal] for chunk, seal in zip(job.pointers, job.seal_pointers)]
        sizes = [[self._chunk_bytes, SEAL_BYTES]] * len(job.keys)
        sealed_bytes = self._chunk_bytes + SEAL_BYTES
        started = time.monotonic()
        if job.is_load:
            codes = store.batch_get_into_multi_buffers(job.object_keys, buffers, sizes)
        else:
            for key, chunk in zip(job.keys, job.chunk_ids):
                self._seals[chunk] = np.frombuffer(self._seal_of(key, chunk), dtype=np.uint8)
            codes = store.batch_put_from_multi_buffers(job.object_keys, buffers, sizes)
        seconds = time.monotonic() - started
        if len(codes) != len(job.keys):
            codes = [-1] * len(job.keys)
        wrong_size = 0
        faults = 0
        for key, object_key, chunk, code in zip(job.keys, job.object_keys, job.chunk_ids, codes):
            if not job.is_load:
                (job.succeeded if code == 0 else job.failed).append(key)
                continue
            fault: IntegrityFault | None = None
            if code == sealed_bytes:
                fault = self._verify(key, chunk)
            elif code >= 0 or (code != OBJECT_NOT_FOUND and not is_connection_error(code)):
                fault = self._size_fault(store, object_key, code)
                if fault is not None:
                    wrong_size += 1
            if code == sealed_bytes and fault is None:
                job.succeeded.append(key)
                continue
            job.failed.append(key)
            if fault is not None:
                faults += 1
                self.integrity.record(fault, object_key)
        lost_master = any(is_connection_error(code) for code in codes)
        with self._lock:
            counters = self._counters
            counters.slowest_op_seconds = max(counters.slowest_op_seconds, seconds)
            if job.failed:
                counters.failed_ops += 1
                counters.failed_op_seconds += seconds
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
        if job.failed:
            failed_codes = sorted({code for code, key in zip(codes, job.keys) if key in set(job.failed)})
            logger.info("Mooncake tier %r: %s job %d: %d of %d keys failed (status %s)", self.tier_type,
                        "load" if job.is_load else "store", job.job_id, len(job.failed), len(job.keys),
                        failed_codes)  # fmt: skip
        if lost_master:
            self._set_down()

    def _chunk_view(self, chunk: int) -> memoryview:
        start = chunk * self._chunk_bytes
        return self._primary_array[start : start + self._chunk_bytes].data

    def _seal_of(self, key: OffloadKey, chunk: int) -> bytes:
        """The seal of primary chunk ``chunk`` as the value of ``key``."""
        return seal_bytes(self._chunk_view(chunk), key=key, fingerprint=self.identity.fingerprint)

    def _verify(self, key: OffloadKey, chunk: int) -> IntegrityFault | None:
        """Whether the value just read into ``chunk`` and its seal slot is ``key``'s sealed chunk."""
        return verify_seal(
            self._chunk_view(chunk), self._seals[chunk].data, key=key, fingerprint=self.identity.fingerprint
        )

    def _size_fault(self, store: StoreClient, object_key: str, code: int) -> IntegrityFault | None:
        """Why a get that moved no sealed chunk failed: the value's size (torn or too long), or None (no value).

        Mooncake refuses a get into buffers that do not match the value's size
        exactly without saying so; one ``get_size`` (only on this rare path) tells.
        """
        size = code if code >= 0 else store.get_size(object_key)
        if size < 0:
            return None
        sealed_bytes = self._chunk_bytes + SEAL_BYTES
        logger.warning("Mooncake tier %r: %s holds %d bytes, not a %d-byte sealed chunk: a miss",
                       self.tier_type, object_key, size, sealed_bytes)  # fmt: skip
        return IntegrityFault.TORN if size < sealed_bytes else IntegrityFault.WRONG_SIZE

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
        return results

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @override
    def drain_jobs(self) -> None:
        """Wait for every submitted job (queued ones are cancelled and fail), at most ``timeout_s`` past the last one's start."""
        deadline = time.monotonic() + self.config.timeout_s
        for job in list(self._jobs.values()):
            future = job.future
            if future is None:
                continue
            if future.cancel():
                job.failed = list(job.keys)
                self._finished.put(job)
                continue
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeoutError:
                # The call is still inside Mooncake (bounded by its own RPC timeout); aborting it could corrupt a slot.
                logger.error("Mooncake tier %r: job %d still running after %.1f s", self.tier_type, job.job_id,
                             self.config.timeout_s)  # fmt: skip
                deadline = time.monotonic()

    @override
    def shutdown(self) -> None:
        """Stop the threads and close the store, within about twice the timeout even with a hung master."""
        self._stopping.set()
        self._wake_supervisor.set()
        with self._lock:
            self._state = TierState.CLOSED
        self._up.clear()
        self._lookups.shutdown()
        self.drain_jobs()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._exist_pool.shutdown(wait=False, cancel_futures=True)
        self._supervisor.join(self.config.timeout_s)
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            closer = threading.Thread(target=store.close, name="kvtriton_mooncake_close", daemon=True)
            closer.start()
            closer.join(self.config.timeout_s)
            if closer.is_alive():
                # Mooncake still has the primary's memory registered: keep our export of it, so the
                # primary's region stays mapped instead of being reused under a late transfer.
                logger.warning("Mooncake tier %r: the store did not close within %.1f s", self.tier_type,
                               self.config.timeout_s)  # fmt: skip
                return
        # Drop our export of the primary's memory so the primary can unmap its region.
        self._primary_array = np.empty(0, dtype=np.uint8)
        self._seals = np.empty((0, SEAL_BYTES), dtype=np.uint8)

    # ------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------

    def stats(self) -> MooncakeTierStats:
        with self._lock:
            return MooncakeTierStats(state=self._state, **dataclasses.asdict(self._counters))

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, object]) -> dict[str, OffloadingMetricMetadata]:
        labels = (TIER_LABEL,)
        return {
            MooncakeTierMetrics.FAILED_OPS: OffloadingCounterMetadata(
                "Mooncake store calls (lookup, put, get) that failed, timed out or were refused while the master was unreachable.",
                labels,
            ),
            MooncakeTierMetrics.FAILED_OP_SECONDS: OffloadingCounterMetadata(
                "Seconds spent in Mooncake store calls that failed.", labels
            ),
            MooncakeTierMetrics.WRONG_SIZE_VALUES: OffloadingCounterMetadata(
                "Mooncake values loaded whose size was not the chunk's (each a miss).", labels
            ),
            MooncakeTierMetrics.RECONNECTS: OffloadingCounterMetadata(
                "Times the tier reached the Mooncake master again after losing it.", labels
            ),
            MooncakeTierMetrics.UP: OffloadingGaugeMetadata("1 while the Mooncake master answers, else 0.", labels),
            **integrity_metric_definitions(),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats:
        """The counters' growth since the last call, and whether the master answers now."""
        now = self.stats()
        last = self._reported
        self._reported = now
        stats = OffloadingConnectorStats()
        labels = (self.tier_label,)
        for name, delta in (
            (MooncakeTierMetrics.FAILED_OPS, now.failed_ops - last.failed_ops),
            (MooncakeTierMetrics.FAILED_OP_SECONDS, now.failed_op_seconds - last.failed_op_seconds),
            (MooncakeTierMetrics.WRONG_SIZE_VALUES, now.wrong_size_keys - last.wrong_size_keys),
            (MooncakeTierMetrics.RECONNECTS, now.reconnects - last.reconnects),
        ):
            if delta:
                stats.increase_counter(name, delta, labels)
        stats.set_gauge(MooncakeTierMetrics.UP, 1 if now.state is TierState.UP else 0, labels)
        self.integrity.add_to(stats)
        return stats

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, object]) -> tuple[str, ...]:
        return ("mooncake_master", "mooncake_namespace_digest", "mooncake_identity")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {
            "mooncake_master": self.config.master_server_address,
            "mooncake_namespace_digest": self.keyspace.digest,
            "mooncake_identity": self.identity.hex,
        }
