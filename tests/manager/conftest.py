"""Helpers the manager tests share: keys named by number, a request context that knows their positions, a toy policy.

Test modules import them as ``from tests.manager.conftest import ...`` (by
that full name: ``from conftest import`` would find whichever folder's
conftest pytest loaded last).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping, Sequence

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import ReqContext
from kvtriton.manager.policies import Block


def k(i: int, group: int = 0) -> OffloadKey:
    """The key of block ``i`` (hash ``block-i``) in KV cache group ``group``."""
    return make_offload_key(f"block-{i}".encode(), group)


def ks(*ids: int) -> list[OffloadKey]:
    """The keys of blocks ``ids``, in order (group 0)."""
    return [k(i) for i in ids]


def request(req_id: str, *ids: int, groups: int = 1) -> ReqContext:
    """A context where block ``ids[i]`` (every group of it) ends at token 16 * (i + 1)."""
    context = ReqContext(req_id=req_id)
    for index, i in enumerate(ids):
        for group in range(groups):
            context.set_offload_key_position(k(i, group), 16 * (index + 1))
    return context


class NewestFirst:
    """A toy policy with only the CachePolicy methods (no request hooks): evicts the most recently inserted idle block."""

    def __init__(self, capacity: int) -> None:
        self.blocks: dict[OffloadKey, Block] = {}

    def get(self, key: OffloadKey) -> Block | None:
        return self.blocks.get(key)

    def insert(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[Block],
        positions: Mapping[OffloadKey, int | None],
        req_context: ReqContext,
    ) -> None:
        del positions, req_context
        self.blocks.update(zip(keys, blocks))

    def remove(self, key: OffloadKey) -> None:
        self.blocks.pop(key, None)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        pass

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        idle = [key for key, block in reversed(self.blocks.items()) if block.ref_cnt == 0 and key not in protected]
        if len(idle) < n:
            return None
        for key in idle[:n]:
            del self.blocks[key]
        return idle[:n]

    def clear(self) -> None:
        self.blocks.clear()
