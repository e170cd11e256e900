"""An in-memory remote tier: a dict-backed store in this process, with faults on demand.

It is the smallest complete backend of :class:`RemoteTier` in the package
(docs/tiers.md, "Adding a tier backend", builds one like it), and the store the tests use to
exercise the base without a server: :class:`InMemoryStore` holds the values,
:class:`InMemoryClient` is the :class:`RemoteClient` a tier drives, and the
store injects the faults a real one has (:meth:`InMemoryStore.stall`: calls
block for a while, then complete, late writes included; :meth:`InMemoryStore.fail`:
calls answer FAILED; :attr:`InMemoryStore.unreachable`: every call answers
UNREACHABLE). Loaded by vLLM as::

    {"type": "InMemoryStoreTier", "module_path": "kvtriton.integrations.remote", "store": "test"}

Every tier naming the same ``store`` in one process shares it; nothing leaves
the process, so it is for tests and trials, never a deployment.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from typing_extensions import override

from kvtriton.integrations.remote._client import Outcome, RemoteClient, Segment, Unreachable
from kvtriton.integrations.remote._metrics import RemoteTierMetrics
from kvtriton.integrations.remote._settings import RemoteTierSettings
from kvtriton.integrations.remote._tier import RemoteTier

_Moved = TypeVar("_Moved")
"""What one key's transfer gives: an outcome (put), or the bytes read or an outcome (get)."""

OPERATIONS = ("exist", "put", "get")
"""The calls a fault applies to."""


class InMemoryStore:
    """Values by key in this process's memory, shared by every client opened on it (thread-safe)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stalls: dict[str, threading.Event] = {}
        self._stall_until: dict[str, float] = {}
        self._failing: set[str] = set()
        self.unreachable = False
        """Every call answers UNREACHABLE (or raises :class:`Unreachable`) while set: a lost server."""
        self.calls: dict[str, int] = dict.fromkeys(OPERATIONS, 0)
        """Calls made per operation (the stalled ones included)."""
        self.returned: dict[str, int] = dict.fromkeys(OPERATIONS, 0)
        """Calls that have returned per operation: ``calls - returned`` are inside the store now."""

    def stall(self, operation: str, seconds: float) -> None:
        """Every ``operation`` call from now on blocks for ``seconds`` (or until :meth:`resume`), then completes.

        A stalled ``get`` writes its value into the caller's memory when it
        completes, as a stalled network transfer does."""
        _check_operation(operation)
        with self._lock:
            self._stall_until[operation] = time.monotonic() + seconds
            self._stalls[operation] = threading.Event()

    def resume(self, operation: str | None = None) -> None:
        """End the stall of ``operation`` (every operation's when None): blocked calls complete now."""
        with self._lock:
            for name in [operation] if operation is not None else list(self._stalls):
                event = self._stalls.pop(name, None)
                self._stall_until.pop(name, None)
                if event is not None:
                    event.set()

    def fail(self, operation: str, failing: bool = True) -> None:
        """``operation`` calls answer FAILED for every key (an exist: nothing found) until ``fail(op, False)``."""
        _check_operation(operation)
        with self._lock:
            (self._failing.add if failing else self._failing.discard)(operation)

    def in_flight(self, operation: str) -> int:
        """Calls of ``operation`` inside the store now."""
        with self._lock:
            return self.calls[operation] - self.returned[operation]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def value(self, key: str) -> bytes | None:
        with self._lock:
            return self._values.get(key)

    def set_value(self, key: str, value: bytes) -> None:
        """Put ``value`` under ``key`` directly (a writer other than a tier: a test planting a damaged value)."""
        with self._lock:
            self._values[key] = value

    def clear(self) -> None:
        """Forget every value (a restarted server)."""
        with self._lock:
            self._values.clear()

    def enter(self, operation: str) -> bool:
        """Count a call and wait out its stall; whether it fails (answers FAILED). Raises Unreachable when lost."""
        with self._lock:
            self.calls[operation] += 1
            stall = self._stalls.get(operation)
            until = self._stall_until.get(operation, 0.0)
        if stall is not None:
            stall.wait(max(0.0, until - time.monotonic()))
        with self._lock:
            failing = operation in self._failing
        if self.unreachable:
            self.leave(operation)
            raise Unreachable(f"in-memory store {self.name!r} is unreachable")
        return failing

    def leave(self, operation: str) -> None:
        with self._lock:
            self.returned[operation] += 1


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")


_stores: dict[str, InMemoryStore] = {}
_stores_lock = threading.Lock()


def in_memory_store(name: str) -> InMemoryStore:
    """The process's store called ``name``, made on first use."""
    with _stores_lock:
        store = _stores.get(name)
        if store is None:
            store = _stores[name] = InMemoryStore(name)
        return store


class InMemoryClient(RemoteClient):
    """A :class:`RemoteClient` over an :class:`InMemoryStore`: values move by ``ctypes.memmove`` from and to
    registered memory, as a network store's transfer engine moves them."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store = store
        self._registered: list[tuple[int, int]] = []

    def register_memory(self, address: int, nbytes: int) -> bool:
        self._registered.append((address, nbytes))
        return True

    def unregister_memory(self, address: int) -> None:
        self._registered = [(base, size) for base, size in self._registered if base != address]

    def _check_registered(self, segments: Sequence[Segment]) -> None:
        for address, nbytes in segments:
            if not any(base <= address and address + nbytes <= base + size for base, size in self._registered):
                raise ValueError(f"segment {address:#x}+{nbytes} is in no registered memory")

    def exist(self, keys: Sequence[str]) -> list[bool]:
        failing = self.store.enter("exist")
        try:
            return [False if failing else self.store.value(key) is not None for key in keys]
        finally:
            self.store.leave("exist")

    def _transfer(
        self,
        operation: str,
        keys: Sequence[str],
        segments: Sequence[Sequence[Segment]],
        move: Callable[[str, Sequence[Segment]], _Moved],
    ) -> list[_Moved | Outcome]:
        """``move(key, pieces)`` for every key inside the store's ``operation``: every key UNREACHABLE while the
        store is, FAILED while the operation fails."""
        for pieces in segments:
            self._check_registered(pieces)
        try:
            failing = self.store.enter(operation)
        except Unreachable:
            return [Outcome.UNREACHABLE] * len(keys)
        try:
            if failing:
                return [Outcome.FAILED] * len(keys)
            return [move(key, pieces) for key, pieces in zip(keys, segments, strict=True)]
        finally:
            self.store.leave(operation)

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Outcome]:
        def write(key: str, pieces: Sequence[Segment]) -> Outcome:
            self.store.set_value(key, b"".join(ctypes.string_at(address, nbytes) for address, nbytes in pieces))
            return Outcome.OK

        return self._transfer("put", keys, segments, write)

    def get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[int | Outcome]:
        def read(key: str, pieces: Sequence[Segment]) -> int | Outcome:
            value = self.store.value(key)
            if value is None:
                return Outcome.ABSENT
            if len(value) != sum(nbytes for _, nbytes in pieces):
                return Outcome.FAILED  # as Mooncake: a value of another size moves nothing
            offset = 0
            for address, nbytes in pieces:
                ctypes.memmove(address, value[offset : offset + nbytes], nbytes)
                offset += nbytes
            return len(value)

        return self._transfer("get", keys, segments, read)

    def size_of(self, key: str) -> int | None:
        value = self.store.value(key)
        return None if value is None else len(value)

    def put_value(self, key: str, value: bytes) -> Outcome:
        if self.store.unreachable:
            return Outcome.UNREACHABLE
        self.store.set_value(key, value)
        return Outcome.OK

    def close(self) -> None:
        self._registered.clear()


@dataclass(frozen=True, kw_only=True)
class InMemoryTierConfig(RemoteTierSettings):
    """Every key of the in-memory tier's configuration: its store's name, and the keys every remote tier shares."""

    store: str = "default"
    """The name of the process's :class:`InMemoryStore` the tier uses (tiers naming the same store share it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
            raise ValueError(f"store must be a non-empty string, got {self.store!r}")
        super().__post_init__()  # the keys every remote tier shares


class InMemoryStoreTier(RemoteTier[InMemoryTierConfig]):
    """A secondary tier over an :class:`InMemoryStore` of this process (see the module docstring); its keys are
    :class:`InMemoryTierConfig`'s."""

    backend = "InMemory"
    metrics = RemoteTierMetrics.with_prefix("in_memory")
    config_type = InMemoryTierConfig

    @property
    def store(self) -> InMemoryStore:
        """The process's store this tier uses (the one its ``store`` key names)."""
        return in_memory_store(self.config.store)

    @override
    def describe_store(self) -> str:
        return f"in-memory store {self.config.store!r}"

    @override
    def open_client(self) -> RemoteClient | None:
        if self.store.unreachable:
            return None
        return InMemoryClient(self.store)
