"""bench/third_party_logs.py: vLLM's expected warnings dropped, a native library's log summarised in one line."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from bench.third_party_logs import native_log_captured, quiet_vllm


def test_what_a_native_library_writes_to_fd_2_is_counted_not_shown(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with native_log_captured(tmp_path) as log:
        os.write(2, b"I1201 11:16:42.98 6339 client.cpp:1] starting\n")
        os.write(2, b"E1201 11:16:42.98 6339 meta.cpp:2] Local segment descriptor not found\n")
        os.write(2, b"E1201 11:16:42.99 6339 meta.cpp:3] connection refused\n")
        os.write(2, b"W1201 11:16:43.00 6339 client.cpp:4] slow\n")
    assert capfd.readouterr().err == ""
    assert (log.lines, log.errors, log.expected_errors) == (4, 1, 1)
    assert log.summary("Mooncake") == (
        f"Mooncake's own log: 4 lines, 1 errors (first: 'connection refused'), 1 expected start-up E lines, in {log.path}"
    )
    assert "connection refused" in log.path.read_text()
    os.write(2, b"after\n")  # descriptor 2 is the terminal's again
    assert capfd.readouterr().err == "after\n"


def test_disabled_capture_lets_the_log_through(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with native_log_captured(tmp_path, enabled=False) as log:
        os.write(2, b"I1201 shown\n")
    assert capfd.readouterr().err == "I1201 shown\n" and log.lines == 0
    assert list(tmp_path.iterdir()) == []


def test_quiet_vllm_drops_only_the_expected_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])  # as a benchmark process starts: vLLM configured nothing
    quiet_vllm()
    quiet_vllm()  # idempotent: one handler, one filter
    (handler,) = vllm_logger.handlers
    assert len(handler.filters) == 1

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.platforms.interface", logging.WARNING, __file__, 1, message, None, None)

    assert not handler.filter(record("Failed to import from vllm._C: %s"))
    assert not handler.filter(record("Loading out-of-tree offloading spec. This API is experimental"))
    assert handler.filter(record("something else went wrong"))
