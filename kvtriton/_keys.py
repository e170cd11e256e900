"""OffloadKey: the name of one offloaded block on the scheduler side.

A key is the block hash followed by the KV group index as 4 big-endian bytes,
exactly as vLLM's ``vllm/v1/kv_offload`` builds it, so keys cross the adapter
boundary without conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NewType, cast

from kvtriton._int_argument import check_int

OffloadKey = NewType("OffloadKey", bytes)

GROUP_INDEX_BYTES = 4
_MAX_GROUP_INDEX = 2 ** (8 * GROUP_INDEX_BYTES) - 1


# The 4-byte suffixes of the first KV cache groups, built once: almost every
# key is made for one of them, and the common case then costs a type check,
# a list index and one concatenation.
_CACHED_GROUPS = 64
_SUFFIXES = tuple(group.to_bytes(GROUP_INDEX_BYTES, "big", signed=False) for group in range(_CACHED_GROUPS))
_concat = cast("Callable[[bytes, bytes], OffloadKey]", bytes.__add__)


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Return the key of block ``block_hash`` in KV cache group ``group_idx``.

    An empty ``block_hash`` is refused: its key would be the bare group index,
    which names no block (vLLM's block hashes are never empty).
    """
    if type(block_hash) is bytes and block_hash and type(group_idx) is int and 0 <= group_idx < _CACHED_GROUPS:
        return _concat(block_hash, _SUFFIXES[group_idx])
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):  # pyright: ignore[reportUnnecessaryIsInstance] -- callers outside the typed world pass str or int
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}: {block_hash!r}")
    if not len(block_hash):
        raise ValueError(f"block_hash must not be empty (it names the block), got {bytes(block_hash)!r}")
    check_int("group_idx", group_idx, minimum=0, maximum=_MAX_GROUP_INDEX)
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_INDEX_BYTES, "big", signed=False))


def _check_key(key: OffloadKey) -> None:
    if len(key) < GROUP_INDEX_BYTES:
        raise ValueError(f"key must hold at least {GROUP_INDEX_BYTES} bytes (the group index), got {len(key)}: {key!r}")


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block hash part of ``key``."""
    _check_key(key)
    return bytes(key[:-GROUP_INDEX_BYTES])


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV cache group index stored in the last 4 bytes of ``key``."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big", signed=False)
