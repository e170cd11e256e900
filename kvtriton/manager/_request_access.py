"""What a manager remembers about one request: the keys it accessed, as vLLM's manager records them.

vLLM's connector never calls ``touch``: the recency signal it gives is
each key's token position in the request's context and the end of the
request (``on_request_finished``). A manager records here, for every request
that loads or offers keys, the keys in the order it first saw them, which of
them the request's stores inserted and which were reused (ready before the
request used them). The record lives in the request's own context
(``ReqContext.set_state``), so nothing has to announce the request and
nothing outlives it; when the request finishes, its keys are ordered head to
tail (:func:`head_to_tail`) and handed to the policy in runs of one use
(reused, inserted, neither), so a frequency policy (ARC) counts one reuse per
request and never a store.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, count, islice
from operator import is_not, itemgetter, lt
from typing import cast

from kvtriton._keys import OffloadKey
from kvtriton.manager.policies import KeyRun, Use

_REUSED, _INSERTED, _SEEN = Use.REUSED, Use.INSERTED, Use.SEEN


class RequestAccess:
    """The keys one request accessed through one manager, kept in the request's context.

    ``positions`` maps every key the request loaded or offered (its offered
    keys that were not pending) to its token position in the request (None
    when the context has none), in first-seen order: each position is read
    from the context once, when the key is first seen. ``inserted`` holds the
    keys its stores allocated, ``reused`` the ready keys it loaded or offered
    that it had not inserted itself, ``store_missed`` the keys whose store
    miss the policy already learnt from (once per request). ``owner`` and
    ``generation`` say which manager made the record and at which reset
    count: any other manager's record, or one from before ``reset_cache``, is
    replaced by a fresh one.
    """

    __slots__ = ("owner", "generation", "positions", "inserted", "reused", "store_missed", "finished")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.positions: dict[OffloadKey, int | None] = {}
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_missed: set[OffloadKey] = set()
        self.finished = False

    def observe(
        self, keys: list[OffloadKey], position_of: Callable[[OffloadKey], int | None]
    ) -> tuple[list[OffloadKey], list[int | None]]:
        """Record the keys of ``keys`` not seen before (once each, in order) with their positions; return both."""
        positions = self.positions
        before = len(positions)
        if not before or positions.keys().isdisjoint(keys):  # a request's first keys skip the scan
            new = keys
        else:
            new = [key for key in keys if key not in positions]
        if not new:
            return new, []
        found = list(map(position_of, new))
        positions.update(zip(new, found))
        if len(positions) - before != len(new):  # the offer named a key twice
            new = list(dict.fromkeys(new))
            found = [positions[key] for key in new]
        return new, found

    def reuse(self, keys: list[OffloadKey]) -> None:
        """``keys`` were ready when the request loaded or offered them."""
        inserted = self.inserted
        # A key this request inserted is read back by the tiers (a cascade), not reused.
        self.reused.update([key for key in keys if key not in inserted] if inserted else keys)

    def store_misses(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Of the uncached keys an offer is about to store, the ones the policy has not learnt from in this request."""
        missed = self.store_missed
        misses = keys if not missed or missed.isdisjoint(keys) else [key for key in keys if key not in missed]
        missed.update(misses)
        return misses

    def runs(self, ordered: list[OffloadKey]) -> list[KeyRun]:
        """The finished request's ``ordered`` keys (:func:`head_to_tail`) in runs of one use, head to tail."""
        inserted, reused = self.inserted, self.reused
        uses = [_REUSED if key in reused else _INSERTED if key in inserted else _SEEN for key in ordered]
        # A run ends where the next key's use differs (found at C speed) and at the last key.
        ends = [*compress(count(1), map(is_not, uses, islice(uses, 1, None))), len(uses)]
        return [(ordered[start:end], uses[start]) for start, end in zip([0, *ends], ends) if start < end]


def _group(key: OffloadKey) -> bytes:
    # The group index's 4 big-endian bytes order the groups as their indices do.
    return key[-4:]


_suffix = itemgetter(slice(-4, None))


def head_to_tail(keys: list[OffloadKey], positions: list[int | None]) -> list[OffloadKey]:
    """A finished request's ``keys`` (first-seen order, ``positions`` co-indexed) ordered as vLLM orders them.

    KV cache group by group (group 0 first), each group by token position
    when every key of the group has one; then, when every key has a
    position, all of them by position (a stable sort: keys of several groups
    at one position stay group by group). Without positions the first-seen
    order stands.
    """
    if len(keys) < 2:
        return keys
    if None not in positions:
        known = cast("list[int]", positions)  # no None (checked above)
        if all(map(lt, known, islice(known, 1, None))):  # each position below the next; C speed, one pass
            # Strictly head to tail already (the usual case): every rule below keeps this order.
            return keys
    groups = set(map(_suffix, keys))  # C speed
    if len(groups) == 1:
        if None in positions:
            return keys
        known = cast("list[int]", positions)  # no None (checked above)
        if known == sorted(known):  # C speed; the usual case, head to tail already
            return keys
        order = sorted(range(len(keys)), key=known.__getitem__)
        return [keys[index] for index in order]
    # Several groups (a hybrid model): group by group, then by position.
    ordered: list[OffloadKey] = []
    position_by_key = dict(zip(keys, positions))
    for group in sorted(groups):
        members = [key for key in keys if _group(key) == group]
        if all(position_by_key[key] is not None for key in members):
            members.sort(key=lambda key: position_by_key[key] or 0)
        ordered.extend(members)
    if None not in positions:
        ordered.sort(key=lambda key: position_by_key[key] or 0)
    return ordered
