"""xxh3-128 from the ``xxhash`` package, imported at the first hash instead of when kvtriton is imported.

Only the chunk seals (:mod:`kvtriton._integrity`) and the opt-in slot digests
(:mod:`kvtriton.worker._slot_digests`) hash. Every constant and every other
path (the engine, the shared region's layout, the CLI, the simulator, the
benchmarks) imports without ``xxhash``, so kvtriton installed with ``pip
install --no-deps`` into an environment that lacks it (a vLLM server's:
vLLM does not bring it; or the GPU check's machine) still imports and
offloads; the first hash then fails saying which package to install.

Why not the standard library: measured for this choice on the project's
2-core CI machine (64 MiB buffers, one-shot, one core), xxh3-128 hashes
6.6 GB/s, ``zlib.crc32`` 1.2, ``hashlib.sha256`` 0.7 and ``hashlib.blake2b``
0.3; and the seal's bytes are fixed by ``ROW_FORMAT_VERSION``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

Buffer = bytes | bytearray | memoryview
"""What the hashes read: any contiguous buffer."""


class Xxh3State(Protocol):
    """A running xxh3-128 hash (``xxhash.xxh3_128``)."""

    def update(self, data: Buffer, /) -> None: ...

    def digest(self) -> bytes: ...


MISSING_XXHASH = (
    "kvtriton seals chunks and digests slots with xxh3-128 from the 'xxhash' package, which this environment lacks "
    "(vLLM does not bring it, and `pip install --no-deps` skips it); install it: pip install 'xxhash>=2.0'"
)
"""What a seal, a slot digest, and a spec that will need them at start, say when ``xxhash`` is not installed."""


def require_xxhash() -> None:
    """``ModuleNotFoundError`` (:data:`MISSING_XXHASH`) unless ``xxhash`` imports: for a spec to refuse at start-up
    rather than at its first seal, mid-serve."""
    _xxhash()


def _xxhash() -> ModuleType:
    try:
        import xxhash
    except ImportError as error:
        raise ModuleNotFoundError(MISSING_XXHASH, name="xxhash") from error
    return xxhash


def xxh3_128(data: Buffer = b"") -> Xxh3State:
    """A running xxh3-128 hash of ``data`` (``ModuleNotFoundError`` naming ``xxhash`` when it is not installed)."""
    state: Xxh3State = _xxhash().xxh3_128(data)
    return state


def xxh3_128_digest(data: Buffer, *, seed: int = 0) -> bytes:
    """The 16-byte xxh3-128 digest of ``data`` under ``seed`` (``ModuleNotFoundError`` as :func:`xxh3_128`)."""
    digest: bytes = _xxhash().xxh3_128_digest(data, seed=seed)
    return digest
