"""What a manager remembers about one request between its request hooks.

vLLM 0.33's connector never calls ``touch``: the recency signal it gives is a
request's key positions and its hooks, ``on_new_request`` and
``on_request_finished``. A manager that is told about a request records here
every key the request loaded or offered for storing, in the order it first saw
them, and which of them were reused (ready before the request came) or only
inserted by it. When the request finishes, the keys are ranked head first and
handed to the policy with that split, so a frequency policy (ARC) counts one
reuse per request and never counts a store as one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kvtriton.keys import OffloadKey

__all__ = ["RequestAccess", "head_first"]


class RequestAccess:
    """The keys one request touched, for one manager (kept in ``ReqContext.accesses``).

    ``keys`` lists every key the request loaded or offered, in first-seen
    order (``seen`` is the same keys as a set); ``inserted`` the keys its
    stores allocated; ``reused`` the ready keys it loaded or offered again;
    ``store_missed`` the keys whose store miss the policy already learnt from
    (once per request); ``anchor`` what the policy returned from the
    request's first load (``RequestAwarePolicy.on_request_load``). ``generation`` is the manager's reset count when the
    request started: after ``reset_cache`` the record is stale and ignored.
    """

    __slots__ = ("generation", "keys", "seen", "inserted", "reused", "store_missed", "finished", "anchor")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.keys: list[OffloadKey] = []
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_missed: set[OffloadKey] = set()
        self.finished = False
        # The policy's mark of the moment the request first loaded (LRU ranks its stores there).
        self.anchor: object | None = None

    def observe(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Add the keys not seen before to ``keys`` (first-seen order) and return them."""
        seen = self.seen
        if not seen or seen.isdisjoint(keys):  # a request's first keys skip the scan
            new = keys
        else:
            new = [key for key in keys if key not in seen]
        if new:
            seen.update(new)
            self.keys.extend(new)
        return new


def head_first(keys: list[OffloadKey], position_of: Callable[[OffloadKey], int | None]) -> list[OffloadKey]:
    """``keys`` ordered by token position, head first, when every key has a position.

    The connector sees a request's keys head to tail, so the first-seen order
    is almost always already right; positions fix the rare out-of-order store
    (vLLM stores sliding-window groups' blocks late). Keys of several KV cache
    groups at one position keep their first-seen order (the sort is stable).
    Without a position for every key the first-seen order stands, as in vLLM.
    """
    # A dict's ``get`` (what kvtriton's and vLLM's contexts hand out) is read
    # through the dict's ``__getitem__`` instead: a missing key raises at once,
    # and no scan for ``None`` is needed (about a third cheaper per key).
    table: object = getattr(position_of, "__self__", None)
    if type(table) is dict:
        try:
            positions = list(map(cast("dict[OffloadKey, int]", table).__getitem__, keys))
        except KeyError:
            return keys
    else:
        found = list(map(position_of, keys))
        if None in found:
            return keys
        positions = cast("list[int]", found)  # no None left
    if positions == sorted(positions):  # C speed; linear on sorted input
        return keys  # already head to tail
    order = sorted(range(len(keys)), key=positions.__getitem__)
    return [keys[index] for index in order]
