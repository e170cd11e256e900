"""Store only blocks that have been asked for more than once."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Protocol, runtime_checkable

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext
from kvtriton.manager._base import OffloadingManager, override, require_int


class ReuseSignal(enum.Enum):
    """Which call counts as one use of a key."""

    LOOKUP = "lookup"
    """Each ``lookup`` counts (docs/manager.md, "The reuse filter"; vLLM's filter before 0.33)."""
    STORE_OFFER = "store_offer"
    """Each ``prepare_store`` that offers the key counts, once per call (vLLM 0.33's admission).

    vLLM's connector looks keys up only from the first chunk the GPU lacks and
    stops at the first miss, so counting lookups admits a repeated prompt one
    chunk per repeat; counting offers admits the whole prompt on its second
    computation.
    """


@runtime_checkable
class _HoldsKeys(Protocol):
    """A backing manager that can say whether it caches a key without counting a lookup."""

    def __contains__(self, key: object, /) -> bool: ...


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps a manager and forwards to ``prepare_store`` only keys used ``store_threshold`` times.

    Most blocks of a serving workload are never requested again; storing them
    costs PCIe bandwidth and evicts blocks that would have been reused. Each
    use of a key -- a ``lookup`` by default, or an offer to ``prepare_store``
    with ``count_on=ReuseSignal.STORE_OFFER`` -- counts once in a table bounded
    to ``max_tracker_size`` keys (the least recently counted key is forgotten
    first). Keys the backing manager already caches are forwarded whatever
    their count when it can tell (``key in backing``, as
    ``CPUOffloadingManager`` answers): it never stores them again, but being
    named protects them from the call's eviction (prepare_store rule 3 in docs/manager.md). Every
    other call is forwarded unchanged.
    """

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
        *,
        count_on: ReuseSignal = ReuseSignal.LOOKUP,
    ) -> None:
        require_int(store_threshold, "store_threshold")
        require_int(max_tracker_size, "max_tracker_size")
        if store_threshold < 2:
            raise ValueError(f"store_threshold must be >= 2 (1 would filter nothing), got {store_threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        if not isinstance(count_on, ReuseSignal):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(f"count_on must be a ReuseSignal, got {type(count_on).__name__}: {count_on!r}")
        self._backing = backing
        self._count_on = count_on
        self._threshold = store_threshold
        self._max_tracked = max_tracker_size
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._stores_skipped = 0
        self._holds: Callable[[OffloadKey], bool] | None = (
            backing.__contains__ if isinstance(backing, _HoldsKeys) else None
        )

    @property
    def backing(self) -> OffloadingManager:
        """The wrapped manager."""
        return self._backing

    @property
    def count_on(self) -> ReuseSignal:
        """Which call counts as a use."""
        return self._count_on

    @property
    def store_threshold(self) -> int:
        """Uses a key needs before it is stored."""
        return self._threshold

    @property
    def max_tracker_size(self) -> int:
        """Most keys the use counter remembers."""
        return self._max_tracked

    @property
    def stores_skipped(self) -> int:
        """Keys withheld from ``prepare_store`` so far because their count was below the threshold.

        vLLM 0.33's ``kv_offload_stores_skipped``: a key the backing manager
        already caches is never counted (it would not be stored anyway).
        """
        return self._stores_skipped

    def use_count(self, key: OffloadKey) -> int:
        """How many uses of ``key`` the tracker remembers (0 if forgotten or never seen)."""
        return self._counts.get(key, 0)

    def _count(self, key: OffloadKey) -> None:
        counts = self._counts
        count = counts.get(key)
        if count is None:
            if len(counts) >= self._max_tracked:
                counts.popitem(last=False)
            counts[key] = 1
        else:
            counts[key] = count + 1
            counts.move_to_end(key)

    def _count_offer(self, keys: Collection[OffloadKey]) -> None:
        """Count each distinct key of one store offer once, never forgetting a key of the offer.

        Counting key by key would let the offer's new keys push out the keys
        it has just counted whenever it names more keys than the tracker
        holds, and such an offer would never be admitted. So the tracked keys
        count first (moving to the recent end), and a new key takes only room
        that a key outside the offer gives up; the rest wait for a later offer
        (vLLM 0.33 records offers the same way).
        """
        counts = self._counts
        offer = dict.fromkeys(keys)  # a key repeated in one offer counts once
        new = [key for key in offer if key not in counts]
        for key in offer:
            count = counts.get(key)
            if count is not None:
                counts[key] = count + 1
                counts.move_to_end(key)
        # Keys outside the offer, all now at the old end of the table.
        forgettable = len(counts) - (len(offer) - len(new))
        for key in new:
            if len(counts) >= self._max_tracked:
                if forgettable == 0:
                    break
                counts.popitem(last=False)
                forgettable -= 1
            counts[key] = 1

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._count_on is ReuseSignal.LOOKUP:
            self._count(key)
        return self._backing.lookup(key, req_context)

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self._count_on is ReuseSignal.STORE_OFFER:
            self._count_offer(keys)
        counts = self._counts
        threshold = self._threshold
        # Forward even when nothing qualifies: the backing manager answers an
        # empty call with an empty output, which the caller expects.
        holds = self._holds
        if holds is None:
            eligible = [key for key in keys if counts.get(key, 0) >= threshold]
        else:
            # A cached key below the threshold (its count aged out of the
            # tracker, or it was stored before this filter counted it) goes
            # through too: the backing never stores it again, and naming it
            # keeps this call from evicting it.
            eligible = [key for key in keys if counts.get(key, 0) >= threshold or holds(key)]
        self._stores_skipped += len(keys) - len(eligible)
        return self._backing.prepare_store(eligible, req_context)

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._backing.prepare_load(keys, req_context)

    @override
    def on_new_request(self, req_context: ReqContext) -> None:
        self._backing.on_new_request(req_context)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._backing.on_request_finished(req_context)

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
