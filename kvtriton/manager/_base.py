"""The scheduler-side interface every offloading manager implements.

Mirrors vLLM's ``vllm/v1/kv_offload`` ``OffloadingManager`` so code written
against vLLM reads the same. Every ``keys`` parameter is a
``Collection[OffloadKey]``: callers pass lists, tuples, sets or dict views, and
a manager may iterate it more than once but never index it.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext

if sys.version_info >= (3, 12):
    from typing import override
else:
    _F = TypeVar("_F", bound=Callable[..., object])

    def override(method: _F, /) -> _F:
        """Stand-in for ``typing.override`` (3.12+): documents an override, checks nothing at run time."""
        return method


class OffloadingManager(ABC):
    """Decides which blocks live in the offload medium, and where.

    The engine calls ``lookup`` key by key, then ``prepare_load`` /
    ``complete_load`` around a load job and ``prepare_store`` /
    ``complete_store`` around a store job; ``take_events`` drains the
    stored / evicted notifications. An engine may bracket a request's calls
    with ``on_new_request`` / ``on_request_finished`` (vLLM's connector does,
    and never calls ``touch``).
    """

    def on_new_request(self, req_context: ReqContext) -> None:
        """Start tracking the request of ``req_context``: its loads and stores rank its keys from now on.

        Optional: a manager called without the request hooks keeps its
        ``touch``-driven behaviour. vLLM's connector calls this once per
        request before any other call for it.
        """
        del req_context

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request of ``req_context`` will make no more ``prepare_*`` calls: commit its access.

        ``complete_load`` / ``complete_store`` for its jobs may still follow.
        """
        del req_context

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether ``key`` is readable (``HIT``), being stored (``HIT_PENDING``) or absent (``MISS``)."""

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` against eviction for a load and say where they are, co-indexed with ``keys``."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used; the first key ends up most recent."""
        del keys, req_context

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the pin that ``prepare_load`` took on ``keys``."""
        del keys, req_context

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Allocate room for the ``keys`` not yet stored, evicting if needed; ``None`` if no room can be made."""

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Make stored ``keys`` readable (``success=True``) or drop them (``success=False``)."""
        del keys, req_context, success

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Return the queued stored / evicted events in creation order and empty the queue."""
        return ()

    def reset_cache(self) -> None:  # noqa: B027 -- an optional hook: a no-op unless a manager overrides it
        """Forget every block (the engine reset its prefix cache)."""

    def shutdown(self) -> None:  # noqa: B027 -- an optional hook: a no-op unless a manager overrides it
        """Release resources; the manager is not used afterwards."""
