"""What the chunk seal costs on this CPU: GB/s of checksum per candidate, and of kvtriton's seal and verify.

Run ``python -m bench.integrity`` (``--quick`` for a smoke run). For chunk
sizes vLLM moves (64 KiB: one layer's 16-token block of a Llama-3-8B-like
model in bf16; 2 MiB: that block across 32 layers, one chunk per block; 8 and
32 MiB: 4 and 16 blocks per chunk) it hashes a chunk of random bytes held in a
NumPy array (as a host slab row is) with each candidate:

* ``zlib.crc32`` and ``zlib.adler32`` (the standard library),
* ``hashlib.blake2b`` (the standard library, 128-bit digest),
* ``xxhash.xxh3_64`` and ``xxhash.xxh3_128`` (the ``xxhash`` library),

and runs kvtriton's own ``seal_bytes`` (the 64-byte trailer, xxh3-128) and
``verify`` (the checks a promotion makes) on it. Each figure is the median of
``--repeats`` timings of enough calls to last ``--seconds``; GB/s are 10^9
bytes of chunk per second, one thread.

Writes ``bench/results/integrity.json`` (``integrity-quick.json`` for
``--quick``) in ``$KVTRITON_BENCH_OUT`` when set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from bench.common import bench_parser, format_table, readable_bytes, result_name, write_json
from kvtriton._integrity import FINGERPRINT_BYTES, SEAL_BYTES, seal_bytes, verify

CHUNK_SIZES = (64 << 10, 2 << 20, 8 << 20, 32 << 20)
QUICK_CHUNK_SIZES = (64 << 10, 1 << 20)
KEY = b"\x5a" * 32 + b"\x00\x00\x00\x00"
FINGERPRINT = bytes(range(FINGERPRINT_BYTES))

Checksum = Callable[[memoryview], object]

CANDIDATES: dict[str, tuple[str, Checksum]] = {
    "crc32": ("zlib (standard library)", zlib.crc32),
    "adler32": ("zlib (standard library)", zlib.adler32),
    "blake2b-128": ("hashlib (standard library)", lambda data: hashlib.blake2b(data, digest_size=16).digest()),
    "xxh3_64": ("xxhash", xxhash.xxh3_64_intdigest),
    "xxh3_128": ("xxhash", xxhash.xxh3_128_digest),
}
"""Name -> (library, one call over a chunk)."""

CHOSEN = "xxh3_128"
"""What kvtriton._integrity uses."""


def bandwidth_GBps(call: Callable[[], object], chunk_bytes: int, *, seconds: float, repeats: int) -> float:  # noqa: N802 -- the unit's spelling, as in every bench JSON key
    """Median GB/s of ``call`` over ``repeats`` timings, each of enough calls to last about ``seconds``."""
    call()
    started = time.perf_counter()
    call()
    once = max(time.perf_counter() - started, 1e-7)
    calls = max(1, int(seconds / once))
    rates: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = time.perf_counter() - started
        rates.append(calls * chunk_bytes / elapsed / 1e9)
    return statistics.median(rates)


@dataclass(frozen=True)
class ChecksumFigure:
    candidate: str
    library: str
    chunk_bytes: int
    bandwidth_GBps: float


@dataclass(frozen=True)
class SealFigure:
    chunk_bytes: int
    seal_GBps: float
    verify_GBps: float


def measure(
    chunk_sizes: Sequence[int], *, seconds: float, repeats: int
) -> tuple[list[ChecksumFigure], list[SealFigure]]:
    generator = np.random.default_rng(0)
    checksums: list[ChecksumFigure] = []
    seals: list[SealFigure] = []
    for chunk_bytes in chunk_sizes:
        payload = generator.integers(0, 256, chunk_bytes, dtype=np.uint8)
        view = payload.data
        for name, (library, checksum) in CANDIDATES.items():
            rate = bandwidth_GBps(functools.partial(checksum, view), chunk_bytes, seconds=seconds, repeats=repeats)
            checksums.append(ChecksumFigure(name, library, chunk_bytes, rate))
        sealed = np.empty(chunk_bytes + SEAL_BYTES, dtype=np.uint8)
        sealed[:chunk_bytes] = payload
        sealed[chunk_bytes:] = np.frombuffer(seal_bytes(view, key=KEY, fingerprint=FINGERPRINT), dtype=np.uint8)
        check = functools.partial(verify, sealed.data, key=KEY, fingerprint=FINGERPRINT, expected_length=sealed.size)
        assert check() is None
        seal = functools.partial(seal_bytes, view, key=KEY, fingerprint=FINGERPRINT)
        seals.append(
            SealFigure(
                chunk_bytes,
                bandwidth_GBps(seal, chunk_bytes, seconds=seconds, repeats=repeats),
                bandwidth_GBps(check, chunk_bytes, seconds=seconds, repeats=repeats),
            )
        )
    return checksums, seals


def tables(checksums: Sequence[ChecksumFigure], seals: Sequence[SealFigure]) -> str:
    sizes = sorted({figure.chunk_bytes for figure in checksums})
    by_candidate: dict[str, dict[int, float]] = {}
    for figure in checksums:
        by_candidate.setdefault(figure.candidate, {})[figure.chunk_bytes] = figure.bandwidth_GBps
    first = format_table(
        ["checksum GB/s", *(readable_bytes(size) for size in sizes)],
        [[name, *(rates[size] for size in sizes)] for name, rates in by_candidate.items()],
    )
    second = format_table(
        ["chunk", "seal GB/s", "verify GB/s"],
        [[readable_bytes(figure.chunk_bytes), figure.seal_GBps, figure.verify_GBps] for figure in seals],
    )
    return f"{first}\n\nkvtriton's seal ({CHOSEN}):\n{second}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("integrity", __doc__, quick="two small chunk sizes, short timings")
    parser.add_argument("--seconds", type=float, default=0.2, help="length of one timing (default: 0.2)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure, the median is kept (default: 5)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1:
        print(f"--seconds must be > 0 and --repeats >= 1, got {args.seconds} and {args.repeats}", file=sys.stderr)
        return 2
    sizes = QUICK_CHUNK_SIZES if args.quick else CHUNK_SIZES
    seconds, repeats = (min(args.seconds, 0.02), min(args.repeats, 2)) if args.quick else (args.seconds, args.repeats)
    checksums, seals = measure(sizes, seconds=seconds, repeats=repeats)
    print(tables(checksums, seals))
    payload: dict[str, object] = {
        "quick": bool(args.quick),
        "chosen": CHOSEN,
        "checksum": [dataclasses.asdict(figure) for figure in checksums],
        "seal": [dataclasses.asdict(figure) for figure in seals],
    }
    path = write_json(result_name(args), payload)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
