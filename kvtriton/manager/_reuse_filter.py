"""Store only blocks that have been asked for more than once."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterable
from typing import Protocol, runtime_checkable

from kvtriton._int_argument import check_int
from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LoadStoreSpec, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext
from kvtriton.manager._base import OffloadingManager, override


class ReuseSignal(enum.Enum):
    """Which call counts as one use of a key.

    The store-offer signals are the two rules vLLM's own filter has followed;
    which one the installed vLLM follows is the vLLM integration's to say
    (``STORE_OFFER_SIGNAL`` in ``kvtriton.integrations.vllm._manager``), the
    manager knows only the rules.
    """

    LOOKUP = "lookup"
    """Each ``lookup`` counts (docs/manager.md, "The reuse filter"; as vLLM's filter counted before it counted store offers)."""
    STORE_OFFER = "store_offer"
    """Each ``prepare_store`` that offers the key counts, once per call (a vLLM admission rule).

    vLLM's connector looks keys up only from the first chunk the GPU lacks and
    stops at the first miss, so counting lookups admits a repeated prompt one
    chunk per repeat; counting offers admits the whole prompt on its second
    computation.
    """
    STORE_OFFER_PER_REQUEST = "store_offer_per_request"
    """A request's first offer of the key counts, its later offers do not (vLLM's later admission rule).

    The connector offers a key again when ``prepare_store`` found no room (a
    retry) and when a preempted request is scheduled anew (a re-offer): the
    same request computing the same content is no second use of it. Such a
    later offer keeps the key tracked (it moves to the recent end) without
    counting, and a key it still withholds is not counted in
    ``stores_skipped`` again. The request's offered keys are kept in its
    context (``ReqContext.set_state``) until ``reset_cache``.
    """


@runtime_checkable
class _HoldsKeys(Protocol):
    """A backing manager that can say whether it caches a key without counting a lookup."""

    def __contains__(self, key: object, /) -> bool: ...


class _OfferedKeys:
    """The keys one request has offered to one filter: each counted once (``ReuseSignal.STORE_OFFER_PER_REQUEST``)."""

    __slots__ = ("owner", "generation", "keys")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.keys: set[OffloadKey] = set()


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps a manager and forwards to ``prepare_store`` only keys used ``store_threshold`` times.

    Most blocks of a serving workload are never requested again; storing them
    costs PCIe bandwidth and evicts blocks that would have been reused. Each
    use of a key -- a ``lookup`` by default, an offer to ``prepare_store``
    with ``count_on=ReuseSignal.STORE_OFFER``, or a request's first offer with
    ``ReuseSignal.STORE_OFFER_PER_REQUEST`` -- counts once in a table bounded
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
        check_int("store_threshold", store_threshold, minimum=2)  # 1 would filter nothing
        check_int("max_tracker_size", max_tracker_size, minimum=1)
        if not isinstance(count_on, ReuseSignal):  # pyright: ignore[reportUnnecessaryIsInstance] -- config values arrive untyped
            raise TypeError(f"count_on must be a ReuseSignal, got {type(count_on).__name__}: {count_on!r}")
        self._backing = backing
        self._count_on = count_on
        self._threshold = store_threshold
        self._max_tracked = max_tracker_size
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._stores_skipped = 0
        # Bumped by reset_cache: a request's offered keys from before a reset count again (vLLM's rule).
        self._generation = 0
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

        vLLM's ``kv_offload_stores_skipped``: a key the backing manager
        already caches is never counted (it would not be stored anyway), and
        with ``ReuseSignal.STORE_OFFER_PER_REQUEST`` a key counts once per
        request however often the request offers it (as vLLM counts it).
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

    def _count_offer(self, keys: Collection[OffloadKey], counted: Container[OffloadKey] = ()) -> None:
        """Count each distinct key of one store offer once, never forgetting a key of the offer.

        A tracked key in ``counted`` (the request counted it before) moves to
        the recent end without counting again.

        Counting key by key would let the offer's new keys push out the keys
        it has just counted whenever it names more keys than the tracker
        holds, and such an offer would never be admitted. So the tracked keys
        count first (moving to the recent end), and a new key takes only room
        that a key outside the offer gives up; the rest wait for a later offer
        (vLLM records offers the same way).
        """
        counts = self._counts
        offer = dict.fromkeys(keys)  # a key repeated in one offer counts once
        new = [key for key in offer if key not in counts]
        for key in offer:
            count = counts.get(key)
            if count is not None:
                if key not in counted:
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

    def _offered_keys(self, req_context: ReqContext) -> _OfferedKeys:
        """The keys ``req_context``'s request offered to this filter since the last reset, kept in its context."""
        offered = req_context.get_state(_OfferedKeys)
        if offered is None or offered.owner is not self or offered.generation != self._generation:
            offered = _OfferedKeys(self, self._generation)
            req_context.set_state(offered)
        return offered

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        earlier: set[OffloadKey] | None = None
        if self._count_on is ReuseSignal.STORE_OFFER:
            self._count_offer(keys)
        elif self._count_on is ReuseSignal.STORE_OFFER_PER_REQUEST:
            earlier = self._offered_keys(req_context).keys
            self._count_offer(keys, earlier)
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
        if earlier is None:
            self._stores_skipped += len(keys) - len(eligible)
        else:
            # A key this request's earlier offer withheld was counted as skipped then.
            withheld = set(keys).difference(eligible)
            self._stores_skipped += len(withheld.difference(earlier))
            earlier.update(keys)
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
        self._generation += 1
        self._backing.reset_cache()

    @override
    def shutdown(self) -> None:
        self._backing.shutdown()
