"""What a manager remembers about one request: the keys it accessed, as vLLM 0.33's manager records them.

vLLM 0.33's connector never calls ``touch``: the recency signal it gives is
each key's token position in the request's context and the end of the
request (``on_request_finished``). A manager records here, for every request
that loads or offers keys, the keys in the order it first saw them, which of
them the request's stores inserted and which were reused (ready before the
request used them). The record lives in the request's own context
(``ReqContext.set_state``), so nothing has to announce the request and
nothing outlives it; when the request finishes, its keys are ordered head to
tail (:func:`head_to_tail`) and handed to the policy with that split, so a
frequency policy (ARC) counts one reuse per request and never a store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import cast

from kvtriton.keys import OffloadKey
from kvtriton.manager.policies.base import Block, KeyRun, Use

__all__ = ["RequestAccess", "head_to_tail"]

_REUSED, _INSERTED, _SEEN = Use.REUSED, Use.INSERTED, Use.SEEN


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
    store of its tail: the usual request), ``runs`` lists the accesses in
    order, each with its one use, and nothing is hashed a second time; their
    keys together are exactly ``positions``' keys, in order. The first
    access that names a key again turns ``runs`` into the sets and ``runs``
    to None: ``inserted`` are the keys its stores allocated, ``reused`` the
    ready keys it loaded or offered that it had not inserted itself,
    ``store_missed`` the keys whose store miss the policy already learnt from
    (once per request).
    """

    __slots__ = ("owner", "generation", "positions", "runs", "inserted", "reused", "store_missed", "finished")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.positions: dict[OffloadKey, int | None] = {}
        self.runs: list[KeyRun] | None = []
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_missed: set[OffloadKey] = set()
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

    def to_sets(self) -> None:
        """Keep the uses in the sets from now on (an access is about to name a key again)."""
        runs = self.runs
        if runs is None:
            return
        self.runs = None
        for keys, use in runs:
            if use is _REUSED:
                self.reused.update(keys)
            else:  # a store's keys: all were store misses
                self.store_missed.update(keys)
                if use is _INSERTED:
                    self.inserted.update(keys)

    def reuse(self, keys: list[OffloadKey], fresh: bool) -> None:
        """``keys`` were ready when the request loaded or offered them; ``fresh``: all first seen in this access."""
        runs = self.runs
        if fresh and runs is not None:
            runs.append((keys, _REUSED))
            return
        self.to_sets()
        inserted = self.inserted
        # A key this request inserted is read back by the tiers (a cascade), not reused.
        self.reused.update([key for key in keys if key not in inserted] if inserted else keys)

    def store_misses(self, keys: list[OffloadKey], fresh: bool) -> list[OffloadKey]:
        """Of the uncached keys an offer is about to store, the ones the policy has not learnt from in this request.

        ``fresh``: the offer's recorded keys were all first seen in it.
        """
        if fresh and self.runs is not None:
            return keys  # first seen in this offer: none learnt from yet (offer records them)
        self.to_sets()
        missed = self.store_missed
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
        runs = self.runs
        if fresh and runs is not None:
            if blocks.count(None) == len(blocks):  # the usual offer: new keys only
                runs.append((keys, new_use))
                return
            run: list[OffloadKey] = []
            last: Use | None = None
            for key, block in zip(keys, blocks):
                use = new_use if block is None else _REUSED
                if use is not last:
                    run = []
                    runs.append((run, use))
                    last = use
                run.append(key)
            return
        self.reuse([key for key, block in zip(keys, blocks) if block is not None], False)
        if stored:
            self.inserted.update([key for key, block in zip(keys, blocks) if block is None])

    def head_to_tail_runs(self, ordered: list[OffloadKey], first_seen: bool) -> list[KeyRun]:
        """The finished request's ``ordered`` keys (:func:`head_to_tail`) in runs of one use.

        ``first_seen``: ``ordered`` is the first-seen order, so the record's
        own runs already are the answer.
        """
        runs = self.runs
        if first_seen and runs is not None:
            return runs
        self.to_sets()
        inserted, reused = self.inserted, self.reused
        classified: list[KeyRun] = []
        run: list[OffloadKey] = []
        last: Use | None = None
        for key in ordered:
            use = _REUSED if key in reused else _INSERTED if key in inserted else _SEEN
            if use is not last:
                run = []
                classified.append((run, use))
                last = use
            run.append(key)
        return classified


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
        if known == sorted(known) and len(set(known)) == len(known):
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
