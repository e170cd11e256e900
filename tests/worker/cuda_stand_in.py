"""A recording stand-in for the parts of ``torch.cuda`` that the engine and the benchmarks use, for CPU tests.

Streams, events, ``wait_stream``/``wait_event``, the per-thread current stream
(``torch.cuda.stream``/``current_stream``), ``torch.cuda.Stream``/``Event``
and ``synchronize``. Nothing runs on a device: every piece of work a test
enqueues (:meth:`StandInStream.enqueue`) and every wait is recorded in the
queue of its stand-in stream, and a device model executes those queues in
the order CUDA allows and nothing more: a stream runs its operations in
order, a wait blocks its stream until the stream it waits on has executed
up to the recorded point, and the streams run in an order the test picks
(:meth:`RecordingCuda.step`), as adversarial as it likes.
:meth:`RecordingCuda.ordered_after` answers what an operation is guaranteed to
follow, whatever the order the streams really run in.

:meth:`RecordingCuda.install` puts the stand-in in place of those
``torch.cuda`` attributes for one test (through ``monkeypatch``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True, slots=True)
class Work:
    """A piece of work queued on a stream (a kernel, a copy): ``label`` says which."""

    label: str


@dataclass(frozen=True, slots=True)
class Wait:
    """The stream waits here until ``stream`` has executed its first ``position`` operations."""

    stream: StandInStream
    position: int


class StandInStream:
    """One stand-in CUDA stream: the operations queued on it and how many of them the device has executed."""

    def __init__(self, cuda: RecordingCuda, name: str, handle: int) -> None:
        self._cuda = cuda
        self.name = name
        self.cuda_stream = handle
        """The raw handle torch exposes (0 for the legacy default stream)."""
        self.operations: list[Work | Wait] = []
        self.executed = 0

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"

    def enqueue(self, label: str) -> int:
        """Queue a piece of work; its position in this stream."""
        with self._cuda.lock:
            self.operations.append(Work(label))
            return len(self.operations) - 1

    def wait_event(self, event: StandInEvent) -> None:
        with self._cuda.lock:
            if event.recorded_at is not None:  # CUDA: waiting on an event never recorded waits for nothing
                stream, position = event.recorded_at
                self.operations.append(Wait(stream, position))

    def wait_stream(self, stream: StandInStream) -> None:
        self.wait_event(stream.record_event())  # as torch does: an event recorded on ``stream``, waited for here

    def record_event(self, event: StandInEvent | None = None) -> StandInEvent:
        recorded = event if event is not None else StandInEvent(self._cuda)
        recorded.record(self)
        return recorded

    def synchronize(self) -> None:
        self._cuda.run_until(self, len(self.operations))


class StandInEvent:
    """One stand-in CUDA event: where it was last recorded (a stream and a position in it)."""

    def __init__(self, cuda: RecordingCuda, enable_timing: bool = False) -> None:
        self._cuda = cuda
        self.enable_timing = enable_timing
        self.recorded_at: tuple[StandInStream, int] | None = None

    def record(self, stream: StandInStream | None = None) -> None:
        target = stream if stream is not None else self._cuda.current_stream()
        with self._cuda.lock:
            self.recorded_at = (target, len(target.operations))

    def query(self) -> bool:
        with self._cuda.lock:
            if self.recorded_at is None:
                return True
            stream, position = self.recorded_at
            return stream.executed >= position

    def synchronize(self) -> None:
        if self.recorded_at is not None:
            self._cuda.run_until(*self.recorded_at)

    def elapsed_time(self, end: StandInEvent) -> float:
        del end
        return 1.0  # milliseconds: the stand-in keeps no clock


class RecordingCuda:
    """The stand-in ``torch.cuda``: a compute stream (the default), streams made on request, and the device model.

    ``pick`` chooses which runnable stream executes next (:meth:`step`); by
    default the compute stream goes last, so that anything not ordered after
    the compute stream's work runs before it.
    """

    def __init__(self, pick: Callable[[list[StandInStream]], StandInStream] | None = None) -> None:
        self.lock = threading.RLock()
        self._handles = itertools.count(1)
        self.compute = StandInStream(self, "compute", 0)
        """The legacy default stream (handle 0): the model's work goes here."""
        self.streams: list[StandInStream] = [self.compute]
        self._current = threading.local()
        self._pick = pick if pick is not None else self._compute_last

    def _compute_last(self, runnable: list[StandInStream]) -> StandInStream:
        others = [stream for stream in runnable if stream is not self.compute]
        return others[0] if others else runnable[0]

    # --- the torch.cuda surface ------------------------------------------------------------

    def Stream(self, device: object = None, priority: int = 0) -> StandInStream:  # noqa: N802 -- torch's name
        del device, priority
        with self.lock:
            handle = next(self._handles)
            stream = StandInStream(self, f"stream{handle}", handle)
            self.streams.append(stream)
            return stream

    def Event(self, enable_timing: bool = False) -> StandInEvent:  # noqa: N802 -- torch's name
        return StandInEvent(self, enable_timing)

    def current_stream(self, device: object = None) -> StandInStream:
        del device
        current: StandInStream | None = getattr(self._current, "stream", None)
        return current if current is not None else self.compute

    @contextlib.contextmanager
    def stream(self, stream: StandInStream) -> Generator[StandInStream]:
        previous: StandInStream | None = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = previous

    def device(self, device: object) -> contextlib.AbstractContextManager[object]:
        del device
        return contextlib.nullcontext()

    def synchronize(self, device: object = None) -> None:
        del device
        for stream in list(self.streams):
            stream.synchronize()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Stand in for ``torch.cuda``'s streams, events and synchronisation until the test ends."""
        for name in ("Stream", "Event", "current_stream", "stream", "device", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    # --- the device model ------------------------------------------------------------------

    def _runnable(self) -> list[StandInStream]:
        runnable: list[StandInStream] = []
        for stream in self.streams:
            if stream.executed == len(stream.operations):
                continue
            head = stream.operations[stream.executed]
            if isinstance(head, Work) or head.stream.executed >= head.position:
                runnable.append(stream)
        return runnable

    def step(self) -> bool:
        """Execute one operation of a runnable stream (``pick`` chooses which); False when none can run."""
        with self.lock:
            runnable = self._runnable()
            if not runnable:
                return False
            self._pick(runnable).executed += 1
            return True

    def run_until(self, stream: StandInStream, position: int) -> None:
        """Step the device until ``stream`` has executed ``position`` operations (AssertionError: it never can)."""
        while stream.executed < position:
            if not self.step():
                raise AssertionError(f"deadlock: {stream} can never execute its operation {position - 1}")

    def ordered_after(self, stream: StandInStream, position: int) -> dict[StandInStream, int]:
        """For each stream, how many of its operations are certain to have executed before ``stream``'s ``position``-th.

        Stream order and every wait queued before it, followed transitively.
        """
        with self.lock:
            reached: dict[StandInStream, int] = {}
            pending = [(stream, position)]
            while pending:
                current, upto = pending.pop()
                if reached.get(current, 0) >= upto:
                    continue
                start = reached.get(current, 0)
                reached[current] = upto
                for operation in current.operations[start:upto]:
                    if isinstance(operation, Wait):
                        pending.append((operation.stream, operation.position))
            return reached
