"""How a tier reports a chunk that failed its seal check: one metric, one rate-limited WARNING.

Every tier that verifies what comes back (kvtriton's Mooncake tier in its own
``get``, kvtriton's tiered primary for vLLM's fs/obj/p2p tiers) owns one
:class:`IntegrityReport` and calls :meth:`IntegrityReport.record` for each
faulty chunk (which is then a miss). The report counts the faults in
``vllm:kv_offload_integrity_failures{tier, reason}`` (:data:`INTEGRITY_FAILURES`;
``reason`` is :class:`~kvtriton._integrity.IntegrityFault`'s value, or for a
sealed box that did not open ``decrypt_`` and
:class:`~kvtriton.encryption.OpenFailure`'s value: :func:`reason_label`) and logs a
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
from kvtriton.encryption import OpenFailure
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
    OpenFailure.TAG_MISMATCH: "its authentication tag fails: a byte changed, or it was sealed as another object, "
    "model, layout, tier or tenant",
    OpenFailure.RETIRED_KEY: "it was sealed under a master key that was retired",
    OpenFailure.OTHER_KEY: "it was sealed under another master key (another deployment's, or the wrong key file)",
    OpenFailure.TRUNCATED: "the sealed box is cut short",
    OpenFailure.WRONG_LENGTH: "the sealed box is longer than a sealed chunk",
    OpenFailure.UNKNOWN_FORMAT: "it is no sealed box of this kvtriton (unencrypted, or another format)",
}

Fault = IntegrityFault | OpenFailure
"""Why a chunk that came back from a tier is a miss: a failed seal check, or a sealed box that did not open."""


def reason_label(fault: Fault) -> str:
    """The metric's ``reason`` label of ``fault``: the seal check's own names, ``decrypt_`` before a box's (their
    values overlap: ``other_key`` is another object's chunk for one, another master key for the other)."""
    return f"decrypt_{fault.value}" if isinstance(fault, OpenFailure) else fault.value


REASON_LABELS = tuple(reason_label(fault) for fault in (*IntegrityFault, *OpenFailure))
"""Every ``reason`` the metric may carry."""


def integrity_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metric a tier adds to its ``build_metric_definitions``."""
    return {
        INTEGRITY_FAILURES: OffloadingCounterMetadata(
            "Chunks loaded from a tier that failed kvtriton's integrity check (or, encrypted, did not open) and were "
            f"treated as misses, by reason ({', '.join(REASON_LABELS)}).",
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
        # Keyed by the reason label: the two enums' members are strings, and equal values would share a key.
        self._counts: dict[str, int] = dict.fromkeys(REASON_LABELS, 0)
        self._reported: dict[str, int] = dict.fromkeys(REASON_LABELS, 0)
        self._last_warning: dict[str, float] = {}
        self._unwarned: dict[str, int] = dict.fromkeys(REASON_LABELS, 0)

    def record(self, fault: Fault, chunk: str) -> None:
        """Count one faulty chunk (named by ``chunk``: its key or object name) and warn unless warned lately."""
        reason = reason_label(fault)
        now = self._clock()
        with self._lock:
            self._counts[reason] += 1
            last = self._last_warning.get(reason)
            if last is not None and now - last < self._interval:
                self._unwarned[reason] += 1
                return
            self._last_warning[reason] = now
            unwarned, self._unwarned[reason] = self._unwarned[reason], 0
        since = f"; {unwarned} more {reason} fault(s) since the last warning" if unwarned else ""
        logger.warning(
            "kvtriton integrity: tier %s: chunk %s failed its check (reason %s: %s); it is a miss and will be "
            "recomputed%s",
            self.tier_label,
            chunk,
            reason,
            _WHAT[fault],
            since,
        )

    def counts(self) -> dict[str, int]:
        """Faults recorded since the tier started, by reason label (:func:`reason_label`)."""
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
        for reason, delta in deltas.items():
            if delta:
                stats.increase_counter(INTEGRITY_FAILURES, delta, (self.tier_label, reason))
