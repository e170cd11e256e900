"""Third-party log noise in the benchmarks' output: silenced, or summarised in one line.

A benchmark's stdout is its table. Two libraries write there (or to stderr)
on their own:

* vLLM, built python-only as the benchmarks use it, warns that its C
  kernels are missing ("Failed to import from vllm._C"; the scheduler-side
  code the benchmarks run never needs them) and that an out-of-tree spec
  (kvtriton's) is loaded: :func:`quiet_vllm` drops these two warnings and
  nothing else.
* Mooncake's client library logs through glog straight to file descriptor 2,
  about a hundred lines per run, including an ``E`` line ("Local segment
  descriptor not found") that is part of a normal start-up on TCP.
  :func:`native_log_captured` points descriptor 2 at a file while the client
  runs and prints one line instead: how many lines, how many of them errors,
  and where the file is (``--mooncake-log`` in ``bench.tiers_mooncake`` shows
  them as they come).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXPECTED_NATIVE_ERRORS", "VLLM_EXPECTED_WARNINGS", "NativeLog", "native_log_captured", "quiet_vllm"]

VLLM_EXPECTED_WARNINGS = (
    "Failed to import from vllm._C",
    "Loading out-of-tree offloading spec",
)
"""The starts of the vLLM warnings every benchmark run triggers by design: a python-only vLLM has no C
kernels (the scheduler side never needs them), and kvtriton's specs are out-of-tree specs."""


class _DropExpectedWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(VLLM_EXPECTED_WARNINGS)


def quiet_vllm() -> None:
    """Drop vLLM's expected warnings (:data:`VLLM_EXPECTED_WARNINGS`); every other record passes.

    The warnings come from child loggers (``vllm.platforms...``,
    ``vllm.v1.kv_offload...``) and reach the ``vllm`` logger's handlers by
    propagation, where a handler filter sees them (a logger filter would
    not). When vLLM configured no handler of its own, one is added that
    prints as Python's last-resort handler would, filtered.
    """
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("vllm: %(levelname)s: %(message)s"))
        vllm_logger.addHandler(handler)
    for handler in vllm_logger.handlers:
        if not any(isinstance(existing, _DropExpectedWarnings) for existing in handler.filters):
            handler.addFilter(_DropExpectedWarnings())


_GLOG_LINE = re.compile(r"^([IWEF])\d{4} ")
"""glog's line prefix: severity letter, then MMDD."""

EXPECTED_NATIVE_ERRORS = ("Local segment descriptor not found",)
"""``E`` lines Mooncake's client logs on every normal TCP start-up (it looks its own segment up before
publishing it); counted apart from real errors."""


@dataclass(slots=True)
class NativeLog:
    """What a native library wrote to descriptor 2 while captured."""

    path: Path
    lines: int = 0
    errors: int = 0
    """``E`` and ``F`` lines, the expected ones (:data:`EXPECTED_NATIVE_ERRORS`) left out."""
    expected_errors: int = 0
    first_error: str = ""

    def summary(self, library: str) -> str:
        if self.lines == 0:
            return f"{library}'s own log: empty"
        errors = f"{self.errors} errors (first: {self.first_error!r})" if self.errors else "no errors"
        expected = f", {self.expected_errors} expected start-up E lines" if self.expected_errors else ""
        return f"{library}'s own log: {self.lines} lines, {errors}{expected}, in {self.path}"


@contextmanager
def native_log_captured(folder: Path | None = None, *, enabled: bool = True) -> Generator[NativeLog]:
    """Send descriptor 2 (where C++ libraries log) to a file for the duration; count its lines afterwards.

    Python's ``sys.stderr`` writes to the same descriptor, so anything the
    benchmark itself prints to stderr meanwhile lands in the file too:
    benchmarks print their progress to stdout while this is active. With
    ``enabled=False`` nothing is redirected and the log is not counted.
    """
    handle, name = tempfile.mkstemp(prefix="native-", suffix=".log", dir=folder)
    log = NativeLog(Path(name))
    if not enabled:
        os.close(handle)
        os.unlink(name)
        yield log
        return
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(handle, 2)
    os.close(handle)
    try:
        yield log
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        for line in log.path.read_text(encoding="utf-8", errors="replace").splitlines():
            log.lines += 1
            match = _GLOG_LINE.match(line)
            if match is None or match.group(1) not in "EF":
                continue
            message = line.split("] ", 1)[-1].strip()
            if message.startswith(EXPECTED_NATIVE_ERRORS):
                log.expected_errors += 1
                continue
            log.errors += 1
            if not log.first_error:
                log.first_error = message
