"""What a manager remembers about one request: the keys it accessed, as vLLM 0.33's manager records them.

vLLM 0.33's connector never calls ``touch``: the recency signal it gives is
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

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from operator import itemgetter, lt
from typing import cast

from kvtriton._keys import OffloadKey
from kvtriton.manager.policies._base import Block, KeyRun, Use

__all__ = ["KeyUses", "RequestAccess", "head_to_tail"]

_REUSED, _INSERTED, _SEEN = Use.REUSED, Use.INSERTED, Use.SEEN


class KeyUses:
    """A request's keys by use, once its record keeps them as sets (see :class:`RequestAccess`)."""

    __slots__ = ("inserted", "reused", "store_missed")

    def __init__(self) -> None:
        self.inserted: set[OffloadKey] = set()
        """The keys its stores allocated."""
        self.reused: set[OffloadKey] = set()
        """The ready keys it loaded or offered that it had not inserted itself."""
        self.store_missed: set[OffloadKey] = set()
        """The keys whose store miss the policy already learnt from (once per request)."""


class RequestAccess:
    """The keys one request accessed through one manager, kept in the request's context.

    ``positions`` maps every key the request loaded or offered (its offered
    keys that were not pending) to its token position in the request (None
    when the context has none), in first-seen order: each position is read
    from the context once, when the key is first seen. ``owner`` and
    ``generation`` say which manager made the record and at which reset
    count: any other manager's record, or one from before ``reset_cache``, is
    replaced by a fresh one.

    How the request used its keys is kept in one of two forms. While every
    access names only keys the request has not seen (a load of its prefix, a
    store of its tail: the usual request), the keys of ``positions`` are cut
    into runs of one use: run ``i`` ends at index ``run_ends[i]`` and its keys
    were used as ``run_uses[i]``. Nothing is hashed a second time and the
    record holds four objects for the garbage collector (vLLM's holds about
    ten). The first access that names a key again moves the uses
    into :class:`KeyUses` sets (``uses``) and sets ``run_ends`` to None.
    """

    __slots__ = ("owner", "generation", "positions", "run_ends", "run_uses", "uses", "finished")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.positions: dict[OffloadKey, int | None] = {}
        self.run_ends: list[int] | None = []
        self.run_uses: list[Use] = []
        self.uses: KeyUses | None = None
        self.finished = False

    def observe(
        self, keys: list[OffloadKey], position_of: Callable[[OffloadKey], int | None]
    ) -> tuple[list[OffloadKey], list[int | None]]:
        """Record the keys of ``keys`` not seen before (once each, in order) with their positions; return both.

        The first list is ``keys`` itself exactly when every key was new (and named once).
        """
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

    def _runs(self, keys: list[OffloadKey]) -> list[KeyRun]:
        """The record's runs, cut from its first-seen ``keys`` (``list(self.positions)``).

        Keys past the last run end, seen by an access still in progress, belong to no run yet.
        """
        ends, uses = self.run_ends, self.run_uses
        assert ends is not None  # the callers check the form
        if len(uses) == 1:  # a request that only loaded or only stored: no slicing unless an access is in progress
            return [(keys if ends[0] == len(keys) else keys[: ends[0]], uses[0])]
        return _cut(keys, zip(ends, uses))

    def to_sets(self) -> KeyUses:
        """The uses as sets, kept in that form from now on (an access is about to name a key again)."""
        uses = self.uses
        if uses is not None:
            return uses
        uses = self.uses = KeyUses()
        if self.run_ends:
            for keys, use in self._runs(list(self.positions)):
                if use is _REUSED:
                    uses.reused.update(keys)
                else:  # a store's keys: all were store misses
                    uses.store_missed.update(keys)
                    if use is _INSERTED:
                        uses.inserted.update(keys)
        self.run_ends = None
        return uses

    def reuse(self, keys: list[OffloadKey], fresh: bool) -> None:
        """``keys`` were ready when the request loaded or offered them; ``fresh``: all first seen in this access."""
        ends = self.run_ends
        if fresh and ends is not None:
            if keys:
                ends.append(len(self.positions))
                self.run_uses.append(_REUSED)
            return
        uses = self.to_sets()
        inserted = uses.inserted
        # A key this request inserted is read back by the tiers (a cascade), not reused.
        uses.reused.update([key for key in keys if key not in inserted] if inserted else keys)

    def store_misses(self, keys: list[OffloadKey], fresh: bool) -> list[OffloadKey]:
        """Of the uncached keys an offer is about to store, the ones the policy has not learnt from in this request.

        ``fresh``: the offer's recorded keys were all first seen in it.
        """
        if fresh and self.run_ends is not None:
            return keys  # first seen in this offer: none learnt from yet (offer records them)
        missed = self.to_sets().store_missed
        misses = keys if not missed or missed.isdisjoint(keys) else [key for key in keys if key not in missed]
        missed.update(misses)
        return misses

    def offer(self, keys: list[OffloadKey], blocks: Sequence[Block | None], fresh: bool, *, stored: bool) -> None:
        """A store offer's recorded ``keys``, after the store: ``blocks[i]`` is None for a key the offer stores, else its ready block.

        ``stored``: the store allocated the offer's new keys (else it was
        refused); the ready keys were reused. ``fresh`` as :meth:`store_misses` had it.
        """
        if not keys:
            return
        new_use = _INSERTED if stored else _SEEN
        ends = self.run_ends
        if fresh and ends is not None:
            run_uses = self.run_uses
            if blocks.count(None) == len(blocks):  # the usual offer: new keys only
                ends.append(len(self.positions))
                run_uses.append(new_use)
                return
            # New and ready keys mixed: one run per stretch of one use.
            start = len(self.positions) - len(keys)
            for end, use in _stretches([new_use if block is None else _REUSED for block in blocks]):
                ends.append(start + end)
                run_uses.append(use)
            return
        self.reuse([key for key, block in zip(keys, blocks) if block is not None], False)
        if stored:
            self.to_sets().inserted.update([key for key, block in zip(keys, blocks) if block is None])

    def head_to_tail_runs(self, ordered: list[OffloadKey], first_seen: bool) -> list[KeyRun]:
        """The finished request's ``ordered`` keys (:func:`head_to_tail`) in runs of one use.

        ``first_seen``: ``ordered`` is the first-seen order (``list(self.positions)``),
        so the record's own runs cut it.
        """
        if first_seen and self.run_ends is not None:
            return self._runs(ordered) if self.run_ends else []
        uses = self.to_sets()
        inserted, reused = uses.inserted, uses.reused
        kinds = [_REUSED if key in reused else _INSERTED if key in inserted else _SEEN for key in ordered]
        return _cut(ordered, _stretches(kinds))


def _stretches(uses: list[Use]) -> list[tuple[int, Use]]:
    """Each stretch of one use in ``uses``: the index just past its end, and the use."""
    last = len(uses) - 1
    return [(index + 1, use) for index, use in enumerate(uses) if index == last or uses[index + 1] is not use]


def _cut(keys: list[OffloadKey], stretches: Iterable[tuple[int, Use]]) -> list[KeyRun]:
    """``keys`` cut into runs at the ends of ``stretches`` (consecutive, the first starting at index 0)."""
    runs: list[KeyRun] = []
    start = 0
    for end, use in stretches:
        runs.append((keys[start:end], use))
        start = end
    return runs


def _group(key: OffloadKey) -> bytes:
    # The group index's 4 big-endian bytes order the groups as their indices do.
    return key[-4:]


_suffix = itemgetter(slice(-4, None))


def head_to_tail(keys: list[OffloadKey], positions: list[int | None]) -> list[OffloadKey]:
    """A finished request's ``keys`` (first-seen order, ``positions`` co-indexed) ordered as vLLM 0.33 orders them.

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
