"""What encrypting a chunk costs on this CPU: GB/s per core of each AEAD candidate, seal and open, and whether its
calls release the GIL.

Run ``python -m bench.aead`` (``--quick`` for a smoke run). For chunk sizes
from 64 KiB (one layer's 16-token block of a Llama-3-8B-like model in bf16) to
16 MiB (eight 2 MiB blocks per chunk) it seals and opens a chunk of random
bytes held in a NumPy array (as a host slab row is) with each candidate:

* ``aes-256-gcm``: ``cryptography``'s AESGCM (OpenSSL; AES-NI and VAES where
  the CPU has them), ``encrypt_into``/``decrypt_into`` a buffer allocated once,
  as kvtriton uses it;
* ``kvtriton-box``: kvtriton's own :class:`~kvtriton.encryption.SealedBox`
  around it (header, random nonce, associated data): what kvtriton pays;
* ``chacha20-poly1305``: ``cryptography``'s ChaCha20Poly1305, the same way;
* ``aegis-128x2`` and ``aegis-256x2``: ``pyaegis`` (libaegis), when installed
  (``pip install pyaegis``; it is not a kvtriton dependency), in place
  (``encrypt_inplace``/``decrypt_inplace``), its fastest form: kvtriton, which
  keeps the slab's plaintext, would add a copy to it.

Rounds alternate: each round measures every candidate once per size and
operation, in an order rotated round by round, so a burst of load from
another process (the reference machine has 2 cores shared with others) falls
on all of them alike; a figure is the median of the rounds' GB/s, with their
range. A round's figure times each call alone (``perf_counter`` around it) until
the calls add up to ``--seconds``. GB/s are 10^9 bytes of plaintext per second,
one thread.

Then the GIL, two ways:

* **threads**: the aggregate GB/s of sealing with one thread and with two
  (each its own chunk), alternating; two threads on two cores reach about
  twice one thread's rate only if the call releases the GIL (and only if the
  cores are free: the machine's load average is recorded beside it);
* **probe**: while one call on a large buffer runs, another Python thread
  stamps the time in a loop; the share of the call's 2 ms slices (those of its
  first and last switch interval left out; the interval is set to 1 ms for the
  probe) in which it ran. A call that holds the GIL
  leaves that thread no slice; one that releases it leaves it as many as the
  cores' load allows. Two references calibrate it: ``bytes(bytearray)`` (a
  copy that holds the GIL) and ``time.sleep`` (which releases it). A full run
  calls a candidate GIL-releasing when its median share is at least 0.1 and 3
  times the holding reference's; a smoke run gives no verdict.

Writes ``bench/results/aead.json`` (``aead-quick.json`` for ``--quick``) in
``$KVTRITON_BENCH_OUT`` when set.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, cast

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from bench.common import bench_parser, command_line, format_table, readable_bytes, result_name, write_json
from kvtriton.cli import progress
from kvtriton.encryption import MasterKey, SealedBox, TenantKeys, associated_data, sealed_length

CHUNK_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
QUICK_CHUNK_SIZES = (64 << 10, 1 << 20)
THREADS_CHUNK = 4 << 20
QUICK_THREADS_CHUNK = 256 << 10
PROBE_BYTES = 256 << 20
QUICK_PROBE_BYTES = 32 << 20
PROBE_SLICE_S = 0.002
QUICK_PROBE_SLICE_S = 0.0005
CHOSEN = "aes-256-gcm"
"""What kvtriton.encryption uses."""

ASSOCIATED_DATA = associated_data(
    object_key=bytes(range(36)), model_identity=bytes(16), layout="block-rows-v1", tier="bench"
)
OPERATIONS = ("seal", "open")


class Candidate(Protocol):
    """One AEAD set up for one chunk: ``seal`` and ``open`` it once; ``before_open`` readies an open, untimed."""

    def seal(self) -> None: ...

    def before_open(self) -> None: ...

    def open(self) -> None: ...


class _AeadClass(Protocol):
    def __call__(self, key: bytes, /) -> _Aead: ...


class _Aead(Protocol):
    def encrypt_into(self, nonce: bytes, data: memoryview, associated_data: bytes, buf: memoryview, /) -> int: ...

    def decrypt_into(self, nonce: bytes, data: memoryview, associated_data: bytes, buf: memoryview, /) -> int: ...


class CryptographyAead:
    """``cryptography``'s one-shot ``encrypt_into``/``decrypt_into``, between buffers allocated once."""

    def __init__(self, cipher: _AeadClass, chunk: np.ndarray) -> None:
        self._cipher = cipher(bytes(range(32)))
        self._nonce = bytes(12)
        self._plaintext = chunk.data
        self._sealed = np.empty(chunk.nbytes + 16, dtype=np.uint8)
        self._opened = np.empty_like(chunk)
        self._cipher.encrypt_into(self._nonce, self._plaintext, ASSOCIATED_DATA, self._sealed.data)

    def seal(self) -> None:
        self._cipher.encrypt_into(self._nonce, self._plaintext, ASSOCIATED_DATA, self._sealed.data)

    def before_open(self) -> None:
        pass

    def open(self) -> None:
        self._cipher.decrypt_into(self._nonce, self._sealed.data, ASSOCIATED_DATA, self._opened.data)


class KvtritonBox:
    """kvtriton's :class:`SealedBox`: its header, a random nonce per seal, the tag over header and associated data."""

    def __init__(self, chunk: np.ndarray) -> None:
        self._box = SealedBox(TenantKeys(MasterKey(bytes(range(32)), source="bench")).key_for("bench", b"model"))
        self._plaintext = chunk.data
        self._sealed = np.empty(sealed_length(chunk.nbytes), dtype=np.uint8)
        self._opened = np.empty_like(chunk)
        self.seal()

    def seal(self) -> None:
        self._box.seal_into(self._plaintext, ASSOCIATED_DATA, self._sealed.data)

    def before_open(self) -> None:
        pass

    def open(self) -> None:
        if self._box.open_into(self._sealed.data, ASSOCIATED_DATA, self._opened.data) is not None:
            raise AssertionError("a box the benchmark sealed did not open")


class _Aegis(Protocol):
    KEY_SIZE: int
    NONCE_SIZE: int

    def encrypt_inplace(self, key: bytes, nonce: bytes, buffer: memoryview, associated_data: bytes, /) -> bytes: ...

    def decrypt_inplace(
        self, key: bytes, nonce: bytes, buffer: memoryview, tag: bytes, associated_data: bytes, /
    ) -> None: ...


class AegisInPlace:
    """``pyaegis`` in place: the chunk's own buffer becomes its ciphertext, and back (a copy restores it untimed)."""

    def __init__(self, cipher: _Aegis, chunk: np.ndarray) -> None:
        self._cipher = cipher
        self._key = bytes(range(cipher.KEY_SIZE))
        self._nonce = bytes(cipher.NONCE_SIZE)
        self._buffer = chunk.copy()
        self._tag = cipher.encrypt_inplace(self._key, self._nonce, self._buffer.data, ASSOCIATED_DATA)
        self._sealed = self._buffer.copy()

    def seal(self) -> None:
        # Re-encrypting the buffer in place is the same work whatever it holds; the tag is not kept.
        self._cipher.encrypt_inplace(self._key, self._nonce, self._buffer.data, ASSOCIATED_DATA)

    def before_open(self) -> None:
        np.copyto(self._buffer, self._sealed)

    def open(self) -> None:
        self._cipher.decrypt_inplace(self._key, self._nonce, self._buffer.data, self._tag, ASSOCIATED_DATA)


@dataclass(frozen=True)
class CandidateInfo:
    name: str
    library: str
    how: str
    make: Callable[[np.ndarray], Candidate]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def candidates() -> tuple[list[CandidateInfo], dict[str, str]]:
    """The candidates installed here, and why each missing one is missing."""
    crypto = f"cryptography {_version('cryptography')}"
    found = [
        CandidateInfo(
            "aes-256-gcm",
            crypto,
            "encrypt_into / decrypt_into",
            lambda chunk: CryptographyAead(cast(_AeadClass, AESGCM), chunk),
        ),
        CandidateInfo("kvtriton-box", crypto, "SealedBox.seal_into / open_into (AES-256-GCM)", KvtritonBox),
        CandidateInfo(
            "chacha20-poly1305",
            crypto,
            "encrypt_into / decrypt_into",
            lambda chunk: CryptographyAead(cast(_AeadClass, ChaCha20Poly1305), chunk),
        ),
    ]
    missing: dict[str, str] = {}
    try:
        pyaegis = importlib.import_module("pyaegis")
    except ImportError:
        for name in ("aegis-128x2", "aegis-256x2"):
            missing[name] = "pyaegis is not installed (pip install pyaegis; benchmark only)"
        return found, missing
    for name, class_name in (("aegis-128x2", "Aegis128X2"), ("aegis-256x2", "Aegis256X2")):
        cipher = cast(_Aegis, getattr(pyaegis, class_name)(16))
        found.append(
            CandidateInfo(
                name,
                f"pyaegis {_version('pyaegis')}",
                "encrypt_inplace / decrypt_inplace (in place; kvtriton would add a copy)",
                lambda chunk, cipher=cipher: AegisInPlace(cipher, chunk),
            )
        )
    return found, missing


def _random_chunk(size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)


def timed_rate(call: Callable[[], None], before: Callable[[], None], chunk_bytes: int, seconds: float) -> float:
    """GB/s of ``call``, each call timed alone (``before`` runs untimed ahead of each) until they add up to
    ``seconds``."""
    before()
    call()  # warm up: first-touch page faults and caches are not the cipher's cost
    spent = 0.0
    calls = 0
    while spent < seconds or calls < 2:
        before()
        started = time.perf_counter()
        call()
        spent += time.perf_counter() - started
        calls += 1
    return calls * chunk_bytes / spent / 1e9


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    rounds: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), list(values))


@dataclass(frozen=True)
class ThroughputFigure:
    candidate: str
    operation: str
    chunk_bytes: int
    bandwidth_GBps: Spread


def measure_throughput(
    found: Sequence[CandidateInfo], chunk_sizes: Sequence[int], *, rounds: int, seconds: float
) -> list[ThroughputFigure]:
    rates: dict[tuple[str, str, int], list[float]] = {}
    steps = [(round_, size) for round_ in range(rounds) for size in chunk_sizes]
    for round_, size in progress(steps, len(steps), "aead throughput", stream=sys.stderr):
        chunk = _random_chunk(size)
        made = {info.name: info.make(chunk) for info in found}
        order = [found[(index + round_) % len(found)] for index in range(len(found))]
        for info in order:
            candidate = made[info.name]
            for operation in OPERATIONS:
                call = candidate.seal if operation == "seal" else candidate.open
                before = (lambda: None) if operation == "seal" else candidate.before_open
                rate = timed_rate(call, before, size, seconds)
                rates.setdefault((info.name, operation, size), []).append(rate)
    return [
        ThroughputFigure(info.name, operation, size, Spread.of(rates[(info.name, operation, size)]))
        for info in found
        for size in chunk_sizes
        for operation in OPERATIONS
    ]


def aggregate_seal_rate(info: CandidateInfo, chunk: np.ndarray, threads: int, seconds: float) -> float:
    """GB/s of sealing summed over ``threads`` threads, each sealing its own copy of ``chunk`` for ``seconds``."""
    made = [info.make(chunk.copy()) for _ in range(threads)]
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def work(index: int) -> None:
        start.wait()
        while time.perf_counter() < deadline[0]:
            made[index].seal()
            counts[index] += 1

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    began = time.perf_counter()
    deadline[0] = began + seconds
    start.wait()
    for worker in workers:
        worker.join()
    return sum(counts) * chunk.nbytes / (time.perf_counter() - began) / 1e9


@dataclass(frozen=True)
class ThreadsFigure:
    candidate: str
    chunk_bytes: int
    one_thread_GBps: Spread
    two_threads_GBps: Spread
    speedup: float
    """The median two-thread rate over the median one-thread rate (2 at best on two free cores)."""


def measure_threads(
    found: Sequence[CandidateInfo], chunk_bytes: int, *, rounds: int, seconds: float
) -> list[ThreadsFigure]:
    chunk = _random_chunk(chunk_bytes)
    rates: dict[tuple[str, int], list[float]] = {}
    steps = [(round_, info) for round_ in range(rounds) for info in found]
    for round_, info in progress(steps, len(steps), "aead 1 vs 2 threads", stream=sys.stderr):
        for threads in (1, 2) if round_ % 2 == 0 else (2, 1):
            rates.setdefault((info.name, threads), []).append(aggregate_seal_rate(info, chunk, threads, seconds))
    figures: list[ThreadsFigure] = []
    for info in found:
        one, two = Spread.of(rates[(info.name, 1)]), Spread.of(rates[(info.name, 2)])
        figures.append(ThreadsFigure(info.name, chunk_bytes, one, two, two.median / one.median))
    return figures


PROBE_SWITCH_INTERVAL_S = 0.001
"""The GIL's switch interval while probing (5 ms by default): shorter, so fewer of a call's first and last slices
are left out."""


def other_thread_share(call: Callable[[], None], slice_s: float) -> float | None:
    """The share of ``call``'s ``slice_s`` slices (those of its first and last switch intervals left out) in which
    another Python thread ran; None when the call was too short to leave 3 slices."""
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        clock, record = time.perf_counter, stamps.append
        while not stop.is_set():
            record(clock())

    other = threading.Thread(target=stamp)
    other.start()
    time.sleep(0.01)
    started = time.perf_counter()
    call()
    ended = time.perf_counter()
    stop.set()
    other.join()
    margin = int(sys.getswitchinterval() / slice_s) + 1
    counted = range(margin, int((ended - started) / slice_s) - margin)
    if len(counted) < 3:
        return None
    ran = {int((stamp - started) / slice_s) for stamp in stamps if started <= stamp < ended}
    return len(ran.intersection(counted)) / len(counted)


@dataclass(frozen=True)
class ProbeFigure:
    call: str
    share: Spread | None
    """None when every probed call was too short (a smoke run's small buffer on a fast CPU)."""
    releases_gil: bool | None
    """None in a smoke run (no verdict) and for the two references."""


HOLDS_GIL = "reference: bytes(bytearray) holds the GIL"
RELEASES_GIL = "reference: time.sleep releases the GIL"


def measure_probe(
    found: Sequence[CandidateInfo], probe_bytes: int, *, rounds: int, slice_s: float, verdicts: bool
) -> list[ProbeFigure]:
    """Each candidate's seal of ``probe_bytes`` and the two references, probed ``rounds`` times in rotated order;
    one candidate's buffers at a time."""
    chunk = np.zeros(probe_bytes, dtype=np.uint8)  # the cipher's speed does not depend on the bytes
    held_copy = bytearray(probe_bytes)

    def copy_holding_the_gil() -> None:
        bytes(held_copy)

    references: dict[str, Callable[[], None]] = {
        HOLDS_GIL: copy_holding_the_gil,
        RELEASES_GIL: lambda: time.sleep(0.05),
    }
    names = [*references, *(info.name for info in found)]
    makers = {info.name: info.make for info in found}
    shares: dict[str, list[float]] = {name: [] for name in names}
    steps = [(round_, names[(index + round_) % len(names)]) for round_ in range(rounds) for index in range(len(names))]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(PROBE_SWITCH_INTERVAL_S)
    try:
        for _, name in progress(steps, len(steps), "aead GIL probe", stream=sys.stderr):
            call = references[name] if name in references else makers[name](chunk).seal
            share = other_thread_share(call, slice_s)
            if share is not None:
                shares[name].append(share)
    finally:
        sys.setswitchinterval(previous)
    held = statistics.median(shares[HOLDS_GIL]) if shares[HOLDS_GIL] else None
    figures: list[ProbeFigure] = []
    for name in names:
        values = shares[name]
        spread = Spread.of(values) if values else None
        verdict = None
        if verdicts and name not in references and spread is not None and held is not None:
            verdict = spread.median >= max(0.1, 3 * held)
        figures.append(ProbeFigure(name, spread, verdict))
    return figures


def tables(
    throughput: Sequence[ThroughputFigure], threads: Sequence[ThreadsFigure], probe: Sequence[ProbeFigure]
) -> str:
    sizes = sorted({figure.chunk_bytes for figure in throughput})
    rows: dict[tuple[str, str], dict[int, ThroughputFigure]] = {}
    for figure in throughput:
        rows.setdefault((figure.candidate, figure.operation), {})[figure.chunk_bytes] = figure
    first = format_table(
        ["GB/s per core (median, range)", *(readable_bytes(size) for size in sizes)],
        [
            [
                f"{name} {operation}",
                *(
                    f"{cells[size].bandwidth_GBps.median:.2f} "
                    f"({cells[size].bandwidth_GBps.low:.1f}-{cells[size].bandwidth_GBps.high:.1f})"
                    for size in sizes
                ),
            ]
            for (name, operation), cells in rows.items()
        ],
    )
    second = format_table(
        ["seal, 1 vs 2 threads", "chunk", "1 thread GB/s", "2 threads GB/s", "speedup"],
        [
            [
                figure.candidate,
                readable_bytes(figure.chunk_bytes),
                f"{figure.one_thread_GBps.median:.2f} ({figure.one_thread_GBps.low:.1f}-{figure.one_thread_GBps.high:.1f})",
                f"{figure.two_threads_GBps.median:.2f} ({figure.two_threads_GBps.low:.1f}-{figure.two_threads_GBps.high:.1f})",
                figure.speedup,
            ]
            for figure in threads
        ],
    )
    third = format_table(
        ["GIL probe: call", "other thread ran (median, range)", "releases the GIL"],
        [
            [
                figure.call,
                "call too short"
                if figure.share is None
                else f"{figure.share.median:.2f} ({figure.share.low:.2f}-{figure.share.high:.2f})",
                "-" if figure.releases_gil is None else ("yes" if figure.releases_gil else "NO"),
            ]
            for figure in probe
        ],
    )
    return f"{first}\n\n{second}\n\n{third}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("aead", __doc__, quick="two small chunk sizes, short timings")
    parser.add_argument("--seconds", type=float, default=0.1, help="time of one figure in one round (default: 0.1)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is kept (default: 7)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1:
        print(f"--seconds must be > 0 and --rounds >= 1, got {args.seconds} and {args.rounds}", file=sys.stderr)
        return 2
    if args.quick:
        sizes, threads_chunk, probe_bytes, slice_s = (
            QUICK_CHUNK_SIZES,
            QUICK_THREADS_CHUNK,
            QUICK_PROBE_BYTES,
            QUICK_PROBE_SLICE_S,
        )
        seconds, rounds = min(args.seconds, 0.005), min(args.rounds, 2)
    else:
        sizes, threads_chunk, probe_bytes, slice_s = CHUNK_SIZES, THREADS_CHUNK, PROBE_BYTES, PROBE_SLICE_S
        seconds, rounds = args.seconds, args.rounds
    found, missing = candidates()
    load_before = os.getloadavg()
    throughput = measure_throughput(found, sizes, rounds=rounds, seconds=seconds)
    threads = measure_threads(found, threads_chunk, rounds=rounds, seconds=max(seconds, 0.02))
    probe = measure_probe(found, probe_bytes, rounds=rounds, slice_s=slice_s, verdicts=not args.quick)
    load_after = os.getloadavg()
    print(tables(throughput, threads, probe))
    for name, why in missing.items():
        print(f"not measured: {name}: {why}")
    payload: dict[str, object] = {
        "quick": bool(args.quick),
        "command": command_line("aead", argv),
        "chosen": CHOSEN,
        "rounds": rounds,
        "seconds": seconds,
        "cores": os.cpu_count(),
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "candidates": [{"name": info.name, "library": info.library, "how": info.how} for info in found],
        "not_measured": missing,
        "throughput": [asdict(figure) for figure in throughput],
        "threads": [asdict(figure) for figure in threads],
        "gil_probe": {
            "buffer_bytes": probe_bytes,
            "slice_s": slice_s,
            "switch_interval_s": PROBE_SWITCH_INTERVAL_S,
            "calls": [asdict(figure) for figure in probe],
        },
    }
    path = write_json(result_name(args), payload)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
