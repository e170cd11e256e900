"""Helpers the manager tests share: keys named by number, and a request context that knows their positions.

Test modules import them as ``from tests.manager.conftest import ...`` (by
that full name: ``from conftest import`` would find whichever folder's
conftest pytest loaded last).
"""

from __future__ import annotations

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import ReqContext


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
