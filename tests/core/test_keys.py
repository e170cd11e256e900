from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtriton._keys import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)


@given(block_hash=st.binary(min_size=1, max_size=40), group_idx=st.integers(min_value=0, max_value=2**32 - 1))
def test_key_round_trips_block_hash_and_group_index(block_hash: bytes, group_idx: int) -> None:
    key = make_offload_key(block_hash, group_idx)
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == group_idx


def test_key_is_block_hash_then_big_endian_group_index() -> None:
    assert make_offload_key(b"\xab\xcd", 258) == b"\xab\xcd\x00\x00\x01\x02"
    assert make_offload_key(b"h") == b"h\x00\x00\x00\x00"


@pytest.mark.parametrize("group_idx", [-1, 2**32, 2**40])
def test_group_index_outside_u32_is_rejected(group_idx: int) -> None:
    with pytest.raises(ValueError, match=rf"group_idx .*{group_idx}"):
        make_offload_key(b"hash", group_idx)


def test_non_bytes_block_hash_is_rejected_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="block_hash"):
        make_offload_key("text", 0)  # pyright: ignore[reportArgumentType] -- the runtime check is under test


@pytest.mark.parametrize("block_hash", [b"", bytearray(), memoryview(b"")])
def test_an_empty_block_hash_is_rejected_naming_the_argument(block_hash: bytes) -> None:
    with pytest.raises(ValueError, match=r"block_hash must not be empty .*got b''"):
        make_offload_key(block_hash, 0)
    with pytest.raises(ValueError, match="block_hash must not be empty"):
        make_offload_key(block_hash, 100)  # a group beyond the cached suffixes takes the checked path too


def test_key_too_short_for_a_group_index_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 4 bytes"):
        get_offload_group_idx(OffloadKey(b"abc"))
