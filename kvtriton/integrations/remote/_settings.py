"""The settings every remote tier shares, and the constructor signature a backend's configuration gives it.

A backend's configuration (``MooncakeTierConfig``, ``InMemoryTierConfig``) is
a frozen dataclass subclassing :class:`RemoteTierSettings`: it adds its own
keys to the shared ones (namespace, timeout, I/O threads, reconnection,
back-off), each checked once, a bad value an error naming the key and the
value. It is the only place a backend states its keys:
:func:`tier_constructor_signature` turns its fields into the signature of the
backend's constructor, which vLLM's tier config check reads.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def tier_constructor_signature(
    base_init: Callable[..., None], config_type: type[RemoteTierSettings]
) -> inspect.Signature:
    """``base_init``'s signature with its ``**keys`` replaced by a keyword parameter per field of ``config_type``.

    vLLM's ``SecondaryTierFactory`` calls a tier as ``tier_cls(offloading_spec=...,
    primary_kv_view=..., tier_type=..., backpressure_detector=..., **config)``,
    and kvtriton's start-up check (``_check_tier_keys`` in
    kvtriton/integrations/vllm/_tier_configs.py) reads ``inspect.signature(tier_cls.__init__)``:
    a field without a default is a required key, every other key is unknown,
    and a value must match the field's ``int``/``float``/``bool``/``str`` type.
    """
    base = inspect.signature(base_init)
    fields = [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=_default_of(field),
            annotation=field.type,
        )
        for field in dataclasses.fields(config_type)
    ]
    given = [parameter for parameter in base.parameters.values() if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
    return base.replace(parameters=[*given, *fields])


def _default_of(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty
