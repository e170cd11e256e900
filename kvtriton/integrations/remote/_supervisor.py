"""Whether a remote tier may use its store: set-up, loss, degradation, back-off and the probes that end them.

One background thread per tier sets the client up, and whenever an
operation finds the store unreachable (*down*) or too slow (*degraded*),
stops the tier from touching it until a probe answers: a down tier is probed
every ``reconnect_interval_s``, a degraded one after a back-off of
``retry_backoff_s`` that doubles, up to ``retry_backoff_max_s``, each time it
degrades again soon after it recovered. Every call the supervisor, the
lookups and the manifest make goes through :meth:`Supervisor.bounded`, one
thread that a caller stops waiting on after ``timeout_s``.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TypeVar

from kvtriton.integrations.remote._client import Outcome, RemoteClient, Unreachable
from kvtriton.integrations.remote._keyspace import TierKeyspace
from kvtriton.integrations.remote._metrics import Counters, FailureReason, failure_reason
from kvtriton.integrations.remote._settings import RemoteTierSettings

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MemoryRegion = tuple[int, int, str]
"""``(address, bytes, what)`` of memory the store's transfers read and write, ``what`` for log lines."""


class TierState(enum.Enum):
    CONNECTING = "connecting"
    """Never reached the store yet: everything misses while the background thread sets up."""
    UP = "up"
    DOWN = "down"
    """The store was lost: everything misses until a probe answers."""
    DEGRADED = "degraded"
    """An operation ran past its deadline: everything misses until the back-off has passed, no abandoned call is
    still inside the store, and a probe answers."""
    CLOSED = "closed"


class Supervisor:
    """The tier's state and its client handle, and the thread that sets the client up and brings it back."""

    def __init__(
        self,
        *,
        who: str,
        endpoint: str,
        thread_prefix: str,
        tier_type: str,
        settings: RemoteTierSettings,
        counters: Counters,
        keyspace: TierKeyspace,
        open_client: Callable[[], RemoteClient | None],
        regions: Sequence[MemoryRegion],
    ) -> None:
        """``who``: the tier in log lines (``Mooncake tier 'MooncakeStoreTier'``); ``regions``: memory to register
        with every client it opens; threads are named ``<thread_prefix>_<job>_<tier_type>``."""
        self.who = who
        self.endpoint = endpoint
        self.settings = settings
        self.counters = counters
        self.lock = counters.lock
        self.keyspace = keyspace
        self._open_client = open_client
        self._regions = regions
        self.state = TierState.CONNECTING
        """Read without the lock by the scheduler and I/O threads (a stale read is one more miss or refusal)."""
        self.store: RemoteClient | None = None
        self.up = threading.Event()
        self.stopping = threading.Event()
        self.wake = threading.Event()
        """Set when an operation reports the store lost or slow, or at shutdown."""
        self.backoff_s = settings.retry_backoff_s
        """The wait of a degraded tier before it tries the store again."""
        self._recovered_at = -math.inf
        # One thread for existence checks, so a caller can stop waiting on a hung store after the timeout.
        self._exist_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{thread_prefix}_lookup_{tier_type}")
        self._late: list[Future[object]] = []
        """Bounded calls given up on at their deadline: until they return they are inside the store, whose client
        must not be closed under them (:meth:`late_calls`)."""
        self.thread = threading.Thread(
            target=self._supervise, name=f"{thread_prefix}_supervisor_{tier_type}", daemon=True
        )

    def _supervise(self) -> None:
        """Set the client up, then bring it back whenever an operation found the store gone or too slow."""
        while not self.stopping.is_set():
            state = self.state
            if state is TierState.CONNECTING:
                self._connect()
            elif state is TierState.DOWN:
                self._probe()
            elif state is TierState.DEGRADED:
                self.stopping.wait(self.backoff_s)
                if self.state is TierState.DEGRADED and not self.stopping.is_set():
                    self._retry_degraded()
                continue
            if self.state is TierState.UP:
                self.wake.wait()  # until an operation reports the store lost or slow, or shutdown
                self.wake.clear()
            else:
                self.stopping.wait(self.settings.reconnect_interval_s)

    def _retry_degraded(self) -> None:
        """After the back-off: up again if no abandoned call is still inside the store and a probe answers in time;
        otherwise the next wait is twice as long (up to ``retry_backoff_max_s``)."""
        with self.lock:
            stuck = self.counters.abandoned_calls
        if stuck:
            logger.info("%s: %d call(s) still inside the store past their deadline; staying degraded", self.who, stuck)
            self._longer_backoff()
            return
        store = self.store
        started = time.monotonic()
        found: list[bool] | FailureReason = FailureReason.REFUSED
        if store is not None:
            probed = store
            found = self.bounded(lambda: probed.exist([self.keyspace.manifest_key]))
        if not isinstance(found, list):
            self.counters.count_failure(time.monotonic() - started, failure_reason(found))
            self._longer_backoff()
            return
        with self.lock:
            if self.state is not TierState.DEGRADED:
                return
            self.state = TierState.UP
            self._recovered_at = time.monotonic()
        self.up.set()
        logger.info("%s: %s answers in time again; serving", self.who, self.endpoint)

    def _longer_backoff(self) -> None:
        self.backoff_s = min(self.backoff_s * 2, self.settings.retry_backoff_max_s)

    def degrade(self, what: str) -> None:
        """An operation ran past its deadline: stop using the store until it answers in time again (with back-off)."""
        settings = self.settings
        with self.lock:
            if self.state is not TierState.UP:
                return
            self.state = TierState.DEGRADED
            recently = time.monotonic() - self._recovered_at < settings.retry_backoff_max_s
            self.backoff_s = (
                min(self.backoff_s * 2, settings.retry_backoff_max_s) if recently else settings.retry_backoff_s
            )
            backoff = self.backoff_s
        self.up.clear()
        logger.warning(
            "%s: %s did not answer within %.1f s (%s); degraded: every lookup misses and every job fails at "
            "once for the next %.1f s, then it is tried again",
            self.who,
            self.endpoint,
            settings.timeout_s,
            what,
            backoff,
        )
        self.wake.set()

    def _connect(self) -> None:
        started = time.monotonic()
        try:
            store = self._open_client()
        except Exception:  # a broken installation or bad address: keep missing, keep trying
            logger.exception("%s: store setup raised", self.who)
            store = None
        if store is None:
            self.counters.count_failure(time.monotonic() - started, FailureReason.UNREACHABLE)
            return
        for base, nbytes, what in self._regions:
            if not store.register_memory(base, nbytes):
                logger.error("%s: registering %s failed", self.who, what)
                store.close()
                self.counters.count_failure(time.monotonic() - started, FailureReason.ERROR)
                return
        with self.lock:
            if self.stopping.is_set():
                store.close()
                return
            self.store = store
        if self._write_manifest(store):
            self._set_up()
            return
        with self.lock:  # set up but the store stopped answering: probe it like a lost one
            if self.state is TierState.CONNECTING:
                self.state = TierState.DOWN

    def _probe(self) -> None:
        store = self.store
        if store is None:
            self.state = TierState.CONNECTING
            return
        started = time.monotonic()
        found = self.bounded(lambda: store.exist([self.keyspace.manifest_key]))
        if not isinstance(found, list) or len(found) != 1:
            self.counters.count_failure(time.monotonic() - started, failure_reason(found))
            return
        # A restarted store has forgotten every object, the manifest included.
        if not found[0] and not self._write_manifest(store):
            return
        with self.lock:
            self.counters.reconnects += 1
        logger.info("%s: %s is back", self.who, self.endpoint)
        self._set_up()

    def _write_manifest(self, store: RemoteClient) -> bool:
        """Store the readable configuration behind the digest, once per digest; False when the store did not answer.

        A manifest the pool refuses (full, say) is logged and skipped: it documents
        the digest, serving does not depend on it.
        """
        key = self.keyspace.manifest_key
        exists = self.bounded(lambda: store.exist([key]))
        if not isinstance(exists, list) or len(exists) != 1:
            return False
        if exists[0]:
            return True
        status = self.bounded(lambda: store.put_value(key, self.keyspace.identity.manifest()))
        if not isinstance(status, Outcome) or status is Outcome.UNREACHABLE:
            return False
        if status is not Outcome.OK:
            logger.warning("%s: storing the manifest %s failed", self.who, key)
        return True

    def _set_up(self) -> None:
        with self.lock:
            if self.state is TierState.CLOSED:
                return
            self.state = TierState.UP
        self.up.set()

    def set_down(self) -> None:
        """An operation found the store unreachable: miss until a probe answers."""
        with self.lock:
            if self.state is not TierState.UP:
                return
            self.state = TierState.DOWN
        self.up.clear()
        logger.warning("%s: %s unreachable; every lookup misses until it answers again", self.who, self.endpoint)
        self.wake.set()

    def bounded(self, call: Callable[[], _T]) -> _T | FailureReason:
        """``call()`` on the existence-check thread, or why it gave no answer: past the deadline (the store is then
        taken for lost), unreachable, or raised."""
        try:
            future = self._exist_pool.submit(call)
        except RuntimeError:  # the pool is shut down
            return FailureReason.REFUSED
        try:
            return future.result(timeout=self.settings.timeout_s)
        except FutureTimeoutError:
            with self.lock:
                self._late.append(future)  # pyright: ignore[reportArgumentType] -- kept only to ask done()
            self.set_down()
            return FailureReason.DEADLINE
        except Unreachable:
            self.set_down()
            return FailureReason.UNREACHABLE
        except Exception:  # the binding raised: treat it as no answer, and keep the calling thread alive
            logger.exception("%s: a store call raised", self.who)
            return FailureReason.ERROR

    def late_calls(self) -> int:
        """How many bounded calls given up on at their deadline are still inside the store."""
        with self.lock:
            self._late = [future for future in self._late if not future.done()]
            return len(self._late)

    def stop(self) -> None:
        """Closed: nothing touches the store from now on; the thread ends within ``timeout_s``."""
        self.stopping.set()
        self.wake.set()
        with self.lock:
            self.state = TierState.CLOSED
        self.up.clear()

    def join(self) -> None:
        """After :meth:`stop`: no more bounded calls, and the thread gone (or ``timeout_s`` waited for it)."""
        self._exist_pool.shutdown(wait=False, cancel_futures=True)
        self.thread.join(self.settings.timeout_s)
