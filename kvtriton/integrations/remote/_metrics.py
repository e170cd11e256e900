"""What a remote tier counts and how vLLM sees it: counters, stats, the ``tier`` label and the Prometheus series.

:class:`Counters` are the tier's running totals, written by every part of
:class:`~kvtriton.integrations.remote.RemoteTier` under the tier's one lock;
:class:`RemoteTierStats` is a snapshot of them. vLLM's metrics take
increments, so :func:`connector_stats` turns two snapshots into the growth
between them, labelled as vLLM labels the tier (:func:`vllm_tier_label`).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvtriton.integrations.vllm import (
    TIER_LABEL,
    IntegrityReport,
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    integrity_metric_definitions,
)

if TYPE_CHECKING:
    from kvtriton.integrations.remote._supervisor import TierState


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
    NO_TENANT = "no_tenant"
    """An encrypting tier's job whose request named no tenant (no ``cache_salt`` record): failed, never sent."""


def failure_reason(answer: object) -> FailureReason:
    """Why a bounded call gave no usable answer (a malformed one is the store's error)."""
    return answer if isinstance(answer, FailureReason) else FailureReason.ERROR


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
class Counters:
    """The mutable counters behind :class:`RemoteTierStats` (the same fields, less ``state``), under the tier's lock."""

    lock: threading.Lock = field(repr=False, compare=False)
    """The tier's one lock: it also guards the state, the client handle and the jobs' phases."""
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

    def count_failure(self, seconds: float, reason: FailureReason) -> None:
        with self.lock:
            self.failed_ops += 1
            self.failed_op_seconds += seconds
            self.slowest_op_seconds = max(self.slowest_op_seconds, seconds)
            self.failures[reason] += 1

    def count_op(self, seconds: float) -> None:
        with self.lock:
            self.slowest_op_seconds = max(self.slowest_op_seconds, seconds)

    def snapshot(self, state: TierState) -> RemoteTierStats:
        """The counters now, as stats (the caller holds the lock, so that ``state`` is read with them)."""
        values = {name.name: getattr(self, name.name) for name in dataclasses.fields(self) if name.name != "lock"}
        values["failures"] = {reason.value: count for reason, count in self.failures.items()}
        return RemoteTierStats(state=state, **values)


def metric_definitions(backend: str, names: RemoteTierMetrics) -> dict[str, OffloadingMetricMetadata]:
    """Every metric a tier of ``backend`` adds: its own series, the ones every remote tier shares, integrity's."""
    labels = (TIER_LABEL,)
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


def connector_stats(
    now: RemoteTierStats,
    last: RemoteTierStats,
    *,
    names: RemoteTierMetrics,
    tier_label: str,
    up: bool,
    degraded: bool,
    integrity: IntegrityReport,
) -> OffloadingConnectorStats:
    """The counters' growth from ``last`` to ``now`` and the gauges now, as vLLM's metrics take them."""
    stats = OffloadingConnectorStats()
    labels = (tier_label,)
    for name, delta in (
        (names.FAILED_OPS, now.failed_ops - last.failed_ops),
        (names.FAILED_OP_SECONDS, now.failed_op_seconds - last.failed_op_seconds),
        (names.WRONG_SIZE_VALUES, now.wrong_size_keys - last.wrong_size_keys),
        (names.RECONNECTS, now.reconnects - last.reconnects),
    ):
        if delta:
            stats.increase_counter(name, delta, labels)
    stats.set_gauge(names.UP, 1 if up else 0, labels)
    for reason, count in now.failures.items():
        if count - last.failures[reason]:
            stats.increase_counter(FAILURES, count - last.failures[reason], (tier_label, reason))
    stats.set_gauge(DEGRADED, 1 if degraded else 0, labels)
    stats.set_gauge(ABANDONED_CALLS, now.abandoned_calls, labels)
    integrity.add_to(stats)
    return stats
