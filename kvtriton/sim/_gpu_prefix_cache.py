"""The engine's own prefix cache: vLLM's GPU block pool with prefix caching, as bookkeeping.

A serving engine answers a prompt's leading blocks from its GPU KV cache
before it asks the offload tier, so the offload tier only sees what the GPU
cache no longer holds. :class:`GpuPrefixCache` reproduces the rules of
vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``) and its
``FreeKVCacheBlockQueue`` (``kv_cache_utils.py``) that decide which blocks the
GPU cache still holds:

* block 0 is vLLM's null block: ``num_blocks - 1`` blocks hold KV;
* a full block is cached (its hash registered) when the scheduler allocates
  the tokens that fill it, or, for a block filled by an asynchronous load,
  once the load is in;
* a request's blocks are freed in reverse order when it finishes, so its tail
  is evicted first; freed blocks that hold a hash join the end of the free
  queue (least recently used first), freed blocks without one its front;
* a new block is taken from the front of the free queue, and the hash it held
  (if any) is forgotten: that is the eviction;
* a prefix hit on a free block takes it out of the free queue (``touch``).

Blocks are identified by small integers and hashes by any hashable key (the
replay uses the offload keys: one key per distinct block hash).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtriton._int_argument import check_int


class GpuPrefixCache:
    """A GPU KV cache of ``num_blocks`` blocks with vLLM's prefix caching and eviction order."""

    __slots__ = ("_blocks_of", "_front", "_hash_of", "_queue", "_refs", "evictions")

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=2)  # block 0 is vLLM's null block
        # The free queue is _front (reversed: its last entry is the queue's head) then _queue.
        # Only blocks without a hash are ever put at the head, and those are never hit, so
        # _front needs no removal; a dict keeps _queue's order and removes in O(1).
        self._front: list[int] = []
        self._queue: dict[int, None] = dict.fromkeys(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, Hashable] = {}
        self._blocks_of: dict[Hashable, dict[int, None]] = {}
        self.evictions = 0
        """Cached blocks whose hash was dropped to reuse the block."""

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (free ones and cached ones no running request uses)."""
        return len(self._front) + len(self._queue)

    def cached_prefix(self, keys: Sequence[Hashable], max_blocks: int) -> list[int]:
        """The blocks holding the longest cached prefix of ``keys``, at most ``max_blocks`` of them."""
        blocks: list[int] = []
        for key in keys[: max(max_blocks, 0)]:
            holders = self._blocks_of.get(key)
            if not holders:
                break
            blocks.append(next(iter(holders)))  # vLLM answers with the first block cached for the hash
        return blocks

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them takes them out of it)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """A request now uses ``blocks`` (a prefix hit): take free ones out of the free queue."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._queue[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue, evicting the hashes they held."""
        if count > self.num_free:
            raise ValueError(f"cannot allocate {count} blocks: {self.num_free} free")
        taken: list[int] = []
        while self._front and len(taken) < count:
            taken.append(self._front.pop())
        for block in self._queue:
            if len(taken) == count:
                break
            taken.append(block)
        for block in taken:
            self._queue.pop(block, None)
            key = self._hash_of.pop(block, None)
            if key is not None:
                self.evictions += 1
                holders = self._blocks_of[key]
                del holders[block]
                if not holders:
                    del self._blocks_of[key]
            self._refs[block] = 1
        return taken

    def cache(self, block: int, key: Hashable) -> None:
        """Register ``block`` as holding the full block ``key`` (a block already cached keeps its hash)."""
        if block in self._hash_of:
            return
        self._hash_of[block] = key
        self._blocks_of.setdefault(key, {})[block] = None

    def free(self, blocks: Sequence[int]) -> None:
        """Release a finished request's ``blocks`` (in request order): its tail becomes the first to be evicted."""
        to_head: list[int] = []
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._queue[block] = None  # the tail: least recently used first
                else:
                    to_head.append(block)
        # vLLM prepends them in this order: to_head[0] becomes the head.
        self._front.extend(reversed(to_head))
