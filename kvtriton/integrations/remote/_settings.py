"""The settings every remote tier shares: namespace, timeout, I/O threads, reconnection, back-off.

A backend's own configuration (``MooncakeTierConfig``, ``InMemoryTierConfig``)
holds these keys beside its own and hands them to the base as one
:class:`RemoteTierSettings`; each is checked here, once, and a bad value is
an error naming the key and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtriton._int_argument import check_int


def _check_seconds(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


@dataclass(frozen=True)
class RemoteTierSettings:
    """The keys of a remote tier's configuration that the base reads (docs/tiers.md, "Adding a tier backend")."""

    namespace: str = ""
    """User namespace mixed into the key digest: instances share chunks only with the same namespace."""
    timeout_s: float = 5.0
    """Deadline of every store operation (lookup, store, load, setup, drain, shutdown), in seconds."""
    io_threads: int = 4
    """Threads that run store and load jobs."""
    reconnect_interval_s: float = 1.0
    """Seconds between attempts to reach the store after it was lost (or before it was first reached)."""
    retry_backoff_s: float = 1.0
    """Seconds a *degraded* tier (an operation ran past its deadline) waits before it tries the store again."""
    retry_backoff_max_s: float = 30.0
    """The longest such wait: each time the tier degrades again soon after it recovered, the wait doubles up to it."""

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)
        _check_seconds("reconnect_interval_s", self.reconnect_interval_s)
        _check_seconds("retry_backoff_s", self.retry_backoff_s)
        _check_seconds("retry_backoff_max_s", self.retry_backoff_max_s)
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(
                f"retry_backoff_max_s must be >= retry_backoff_s ({self.retry_backoff_s!r}), got {self.retry_backoff_max_s!r}"
            )
        check_int("io_threads", self.io_threads, minimum=1)
        if not isinstance(self.namespace, str):  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
            raise ValueError(f"namespace must be a string, got {self.namespace!r}")
