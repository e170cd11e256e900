"""IntegrityReport: every fault counted by tier and reason, WARNINGs at a bounded rate, vLLM's counters fed increments."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata

from kvtriton._integrity import IntegrityFault
from kvtriton.integrations.vllm._integrity_report import (
    INTEGRITY_FAILURES,
    IntegrityReport,
    integrity_metric_definitions,
)

TIER = "1:MooncakeStoreTier"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counters(stats: OffloadingConnectorStats) -> dict[str, float]:
    """The integrity counter's increments in ``stats``, by reason (vLLM's reduced form names the label values)."""
    found: dict[str, float] = {}
    for name, value in stats.reduce().items():
        for fault in IntegrityFault:
            if name == f"{INTEGRITY_FAILURES}:{(TIER, fault.value)}":
                found[fault.value] = value
    return found


def test_the_metric_is_a_counter_in_vllms_namespace_by_tier_and_reason() -> None:
    definitions = integrity_metric_definitions()
    metadata = definitions[INTEGRITY_FAILURES]
    assert INTEGRITY_FAILURES.startswith("vllm:kv_offload_")
    assert isinstance(metadata, OffloadingCounterMetadata)
    assert metadata.labelnames == ("tier", "reason")


def test_faults_are_counted_and_reported_as_increments() -> None:
    report = IntegrityReport(TIER, clock=_Clock())
    report.record(IntegrityFault.CHECKSUM, "kvt/abc/01/g0")
    report.record(IntegrityFault.CHECKSUM, "kvt/abc/02/g0")
    report.record(IntegrityFault.OTHER_FINGERPRINT, "kvt/abc/03/g0")
    assert report.total() == 3
    assert report.counts()[IntegrityFault.CHECKSUM.value] == 2
    first = OffloadingConnectorStats()
    report.add_to(first)
    assert _counters(first) == {"checksum": 2, "other_fingerprint": 1}
    second = OffloadingConnectorStats()
    report.add_to(second)
    assert _counters(second) == {}
    report.record(IntegrityFault.TORN, "kvt/abc/04/g0")
    third = OffloadingConnectorStats()
    report.add_to(third)
    assert _counters(third) == {"torn": 1}


def test_warnings_name_the_tier_and_reason_and_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    report = IntegrityReport(TIER, warning_interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvtriton.integrations.vllm._integrity_report"):
        for index in range(5):
            report.record(IntegrityFault.CHECKSUM, f"chunk-{index}")
        report.record(IntegrityFault.OTHER_KEY, "chunk-x")  # another reason warns on its own
        clock.now += 61.0
        report.record(IntegrityFault.CHECKSUM, "chunk-late")
    messages = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(messages) == 3
    assert TIER in messages[0] and "reason checksum" in messages[0] and "chunk-0" in messages[0]
    assert "reason other_key" in messages[1]
    assert "chunk-late" in messages[2] and "4 more checksum fault(s)" in messages[2]
    assert report.counts()[IntegrityFault.CHECKSUM.value] == 6
