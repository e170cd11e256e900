"""Store only blocks that have been asked for more than once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvtriton.keys import OffloadKey
from kvtriton.manager.base import OffloadingManager, override
from kvtriton.specs import LoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext

__all__ = ["FilterReusedOffloadingManager"]


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps a manager and forwards to ``prepare_store`` only keys looked up ``store_threshold`` times.

    Most blocks of a serving workload are never requested again; storing them
    costs PCIe bandwidth and evicts blocks that would have been reused. Each
    ``lookup`` counts one use of its key in a table bounded to
    ``max_tracker_size`` keys (the least recently counted key is forgotten
    first). Every other call is forwarded unchanged.
    """

    def __init__(self, backing: OffloadingManager, store_threshold: int = 2, max_tracker_size: int = 64_000) -> None:
        if isinstance(store_threshold, bool) or not isinstance(store_threshold, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(f"store_threshold must be an int, got {type(store_threshold).__name__}: {store_threshold!r}")
        if isinstance(max_tracker_size, bool) or not isinstance(max_tracker_size, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(
                f"max_tracker_size must be an int, got {type(max_tracker_size).__name__}: {max_tracker_size!r}"
            )
        if store_threshold < 2:
            raise ValueError(f"store_threshold must be >= 2 (1 would filter nothing), got {store_threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self._backing = backing
        self._threshold = store_threshold
        self._max_tracked = max_tracker_size
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    @property
    def backing(self) -> OffloadingManager:
        """The wrapped manager."""
        return self._backing

    @property
    def store_threshold(self) -> int:
        """Lookups a key needs before it is stored."""
        return self._threshold

    @property
    def max_tracker_size(self) -> int:
        """Most keys the use counter remembers."""
        return self._max_tracked

    def use_count(self, key: OffloadKey) -> int:
        """How many lookups of ``key`` the tracker remembers (0 if forgotten or never seen)."""
        return self._counts.get(key, 0)

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        counts = self._counts
        count = counts.get(key)
        if count is None:
            if len(counts) >= self._max_tracked:
                counts.popitem(last=False)
            counts[key] = 1
        else:
            counts[key] = count + 1
            counts.move_to_end(key)
        return self._backing.lookup(key, req_context)

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        counts = self._counts
        threshold = self._threshold
        # Forward even when nothing qualifies: the backing manager answers an
        # empty call with an empty output, which the caller expects.
        eligible = [key for key in keys if counts.get(key, 0) >= threshold]
        return self._backing.prepare_store(eligible, req_context)

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._backing.prepare_load(keys, req_context)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._backing.touch(keys, req_context)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._backing.complete_load(keys, req_context)

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._backing.complete_store(keys, req_context, success)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._backing.take_events()

    @override
    def reset_cache(self) -> None:
        self._backing.reset_cache()

    @override
    def shutdown(self) -> None:
        self._backing.shutdown()
