"""How a tier reports a chunk that failed its seal check: one metric, one rate-limited WARNING.

Every tier that verifies what comes back (kvtriton's Mooncake tier in its own
``get``, kvtriton's tiered primary for vLLM's fs/obj/p2p tiers) owns one
:class:`IntegrityReport` and calls :meth:`IntegrityReport.record` for each
faulty chunk (which is then a miss). The report counts the faults in
``vllm:kv_offload_integrity_failures{tier, reason}`` (:data:`INTEGRITY_FAILURES`;
``reason`` is :class:`~kvtriton._integrity.IntegrityFault`'s value) and logs a
WARNING naming the tier, the reason and the chunk; within
:data:`WARNING_INTERVAL_S` of one WARNING for a tier and reason, the next
faults of that tier and reason are only counted, and the next WARNING says how
many there were.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtriton._integrity import IntegrityFault
from kvtriton.integrations.vllm._surface import (
    TIER_LABEL,
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
)

logger = logging.getLogger(__name__)

INTEGRITY_FAILURES = "vllm:kv_offload_integrity_failures"
"""Counter: chunks that came back from a tier and failed their seal check (each a miss), by tier and reason."""

REASON_LABEL = "reason"

WARNING_INTERVAL_S = 60.0
"""Seconds between two WARNINGs of one tier and reason (the faults between them are counted, then summed up)."""

_WHAT = {
    IntegrityFault.CHECKSUM: "its bytes are not the ones sealed (damaged or overwritten)",
    IntegrityFault.TORN: "it is cut short or holds no intact seal",
    IntegrityFault.WRONG_SIZE: "it is longer than a chunk, or sealed for another chunk size",
    IntegrityFault.OTHER_KEY: "it is another key's chunk",
    IntegrityFault.STALE_FORMAT: "it was written by another kvtriton row format",
    IntegrityFault.OTHER_FINGERPRINT: "it belongs to another identity (model, weights, dtype, layout, rank or compression)",
}


def integrity_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metric a tier adds to its ``build_metric_definitions``."""
    return {
        INTEGRITY_FAILURES: OffloadingCounterMetadata(
            "Chunks loaded from a tier that failed kvtriton's integrity check and were treated as misses, by reason "
            "(checksum, torn, wrong_size, other_key, stale_format, other_fingerprint).",
            (TIER_LABEL, REASON_LABEL),
        )
    }


class IntegrityReport:
    """One tier's integrity faults: counted, warned about at a bounded rate, handed to vLLM's metrics.

    Thread-safe: I/O threads record, the scheduler thread reports.
    ``clock`` is for tests (default ``time.monotonic``).
    """

    def __init__(
        self,
        tier_label: str,
        *,
        warning_interval_s: float = WARNING_INTERVAL_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.tier_label = tier_label
        self._interval = warning_interval_s
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._counts: dict[IntegrityFault, int] = dict.fromkeys(IntegrityFault, 0)
        self._reported: dict[IntegrityFault, int] = dict.fromkeys(IntegrityFault, 0)
        self._last_warning: dict[IntegrityFault, float] = {}
        self._unwarned: dict[IntegrityFault, int] = dict.fromkeys(IntegrityFault, 0)

    def record(self, fault: IntegrityFault, chunk: str) -> None:
        """Count one faulty chunk (named by ``chunk``: its key or object name) and warn unless warned lately."""
        now = self._clock()
        with self._lock:
            self._counts[fault] += 1
            last = self._last_warning.get(fault)
            if last is not None and now - last < self._interval:
                self._unwarned[fault] += 1
                return
            self._last_warning[fault] = now
            unwarned, self._unwarned[fault] = self._unwarned[fault], 0
        since = f"; {unwarned} more {fault.value} fault(s) since the last warning" if unwarned else ""
        logger.warning(
            "kvtriton integrity: tier %s: chunk %s failed its check (reason %s: %s); it is a miss and will be "
            "recomputed%s",
            self.tier_label,
            chunk,
            fault.value,
            _WHAT[fault],
            since,
        )

    def counts(self) -> dict[IntegrityFault, int]:
        """Faults recorded since the tier started, by reason."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def add_to(self, stats: OffloadingConnectorStats) -> None:
        """Add the faults recorded since the last call to ``stats`` (vLLM's counters take increments)."""
        with self._lock:
            deltas = {fault: count - self._reported[fault] for fault, count in self._counts.items()}
            self._reported = dict(self._counts)
        for fault, delta in deltas.items():
            if delta:
                stats.increase_counter(INTEGRITY_FAILURES, delta, (self.tier_label, fault.value))
