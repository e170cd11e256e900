"""Where a remote tier files chunks: the identity of a chunk's bytes and the object keys derived from it.

:class:`ChunkIdentity` holds everything that shapes a chunk's bytes;
:class:`TierKeyspace` turns an ``OffloadKey`` into an object key that two
instances share only when their chunks hold the same bytes (docs/mooncake.md,
"Keys that cannot collide"). Every remote tier built on
:class:`~kvtriton.integrations.remote.RemoteTier` files its chunks this way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

KEY_PREFIX = "kvt"
"""Every object a remote tier writes starts with it: ``kvt/<digest>/...``."""

NAMESPACE_DIGEST_CHARS = 32
"""Hex characters of the namespace digest in each key (128 bits of SHA-256: collisions are out of reach)."""


@dataclass(frozen=True)
class ChunkIdentity:
    """Everything that shapes a chunk's bytes: two instances share chunks only when all of it matches."""

    model: str
    dtype: str
    tokens_per_block: tuple[int, ...]
    """Tokens per block of each KV cache group."""
    tokens_per_hash: int
    blocks_per_chunk: int
    chunk_bytes: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    kv_groups: tuple[tuple[str, ...], ...]
    """Layer names of each KV cache group."""
    layout_tag: str
    """The primary tier's byte layout (``vllm-cpu`` or kvtriton's tag): a chunk of one is no chunk of the other.

    kvtriton's tag names the row compression and its scale group size too
    (``kvtriton-block-rows-v1+fp8-e4m3-g128``), so compressed and uncompressed
    chunks live under different digests."""
    canonical_format: str
    namespace: str
    fingerprint: str = ""
    """The identity fingerprint (hex; kvtriton.integrations.vllm._identity): model, weights, dtypes, row format."""

    def fields(self) -> dict[str, object]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "tokens_per_block": list(self.tokens_per_block),
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_chunk": self.blocks_per_chunk,
            "chunk_bytes": self.chunk_bytes,
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "pcp_size": self.pcp_size,
            "dcp_size": self.dcp_size,
            "kv_groups": [list(group) for group in self.kv_groups],
            "layout_tag": self.layout_tag,
            "canonical_format": self.canonical_format,
            "namespace": self.namespace,
            "fingerprint": self.fingerprint,
        }

    def manifest(self) -> bytes:
        """The readable record stored under the manifest key: canonical JSON of every field."""
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.manifest()).hexdigest()[:NAMESPACE_DIGEST_CHARS]


class TierKeyspace:
    """Object keys of one :class:`ChunkIdentity`: ``kvt/<digest>/<block hash hex>/g<group>`` and ``kvt/<digest>/manifest``."""

    def __init__(self, identity: ChunkIdentity) -> None:
        self.identity = identity
        self.digest = identity.digest()
        self._prefix = f"{KEY_PREFIX}/{self.digest}/"
        self.manifest_key = f"{self._prefix}manifest"

    def object_key(self, block_hash: bytes, group: int) -> str:
        return f"{self._prefix}{block_hash.hex()}/g{group}"

    def describe(self) -> Mapping[str, object]:
        return {"digest": self.digest, **self.identity.fields()}
