"""The calls a remote tier makes on its store: the seam between :class:`RemoteTier` and a backend.

A backend (Mooncake, the in-memory store, the next one) is a class with
these methods; :class:`~kvtriton.integrations.remote.RemoteTier` runs them on
its own threads, bounds them by the tier's timeout, and turns every answer
into hits, misses and counted failures. A client never blocks the scheduler
itself and never needs a lock of its own for the base's sake: the base calls
``exist`` and ``put_value`` from one thread and ``put``/``get`` from its I/O
threads.

Memory moves by address: the base registers the primary tier's host memory
(and its seal slots) once, then hands ``put``/``get`` a list of
``(address, bytes)`` segments per key; a value is the concatenation of its
segments (the chunk, then its 64-byte seal).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

Segment = tuple[int, int]
"""``(address, bytes)`` of one piece of a value, in registered memory."""


class Outcome(enum.Enum):
    """What a store call did with one key (a ``get`` that moved a value answers its size instead)."""

    OK = "ok"
    """Stored (a ``put``)."""
    ABSENT = "absent"
    """The store holds no value under the key (a ``get``): a plain miss."""
    FAILED = "failed"
    """The store answered but did not move the value (full, refused, or a value of another size)."""
    UNREACHABLE = "unreachable"
    """The store could not be reached: the tier goes down until it answers again."""


class Unreachable(Exception):
    """Raised by :meth:`RemoteClient.exist` when the store could not be reached."""


class RemoteClient(Protocol):
    """One connection to a remote store, set up and ready (see the module docstring)."""

    def register_memory(self, address: int, nbytes: int) -> bool:
        """Make ``nbytes`` at ``address`` readable and writable by the store's transfers; False when refused."""
        ...

    def unregister_memory(self, address: int) -> None:
        """Forget memory :meth:`register_memory` made available (only after every call using it returned)."""
        ...

    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` the store holds, in one call; raises :class:`Unreachable`."""
        ...

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Outcome]:
        """Store each key's value, read from its segments (OK, FAILED or UNREACHABLE per key)."""
        ...

    def get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[int | Outcome]:
        """Read each key's value into its segments: the bytes moved, or why none were (ABSENT, FAILED, UNREACHABLE).

        A value whose size is not the segments' total moves nothing: the
        answer is FAILED (or its size, where the store says so), never part
        of a value."""
        ...

    def size_of(self, key: str) -> int | None:
        """The size of the value under ``key``, or None when there is none (asked only on the rare failure path)."""
        ...

    def put_value(self, key: str, value: bytes) -> Outcome:
        """Store a small value from Python bytes (the keyspace's manifest): OK, FAILED or UNREACHABLE."""
        ...

    def close(self) -> None:
        """Release the connection; may block while a call is still inside the store (the base bounds it)."""
        ...
