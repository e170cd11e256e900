"""The Mooncake Store tier's settings and the keys it files chunks under.

:class:`MooncakeTierConfig` holds every configuration key of
``{"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake", ...}``
with its default and validation; :class:`MooncakeKeyspace` turns an
``OffloadKey`` into a Mooncake object key that two instances share only when
their chunks hold the same bytes (docs/mooncake.md describes both).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

KEY_PREFIX = "kvt"
"""Every object this tier writes starts with it: ``kvt/<digest>/...``."""

NAMESPACE_DIGEST_CHARS = 32
"""Hex characters of the namespace digest in each key (128 bits of SHA-256: collisions are out of reach)."""

_PROTOCOLS = ("tcp", "rdma")


def _default_local_hostname() -> str:
    """The address this process is reached at: MC_TCP_BIND_ADDRESS when set (as Mooncake itself does), else the host's."""
    bound = os.environ.get("MC_TCP_BIND_ADDRESS", "").strip()
    if bound:
        return bound
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class MooncakeTierConfig:
    """Every key of the tier's configuration, validated; see docs/mooncake.md for each one."""

    master_server_address: str
    """``host:port`` of ``mooncake_master`` (required)."""
    local_hostname: str = ""
    """Address the store's transfer engine advertises for this process; empty: MC_TCP_BIND_ADDRESS, else the host's address."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata service: ``P2PHANDSHAKE`` (peers exchange it directly), or an etcd / http URL."""
    protocol: str = "tcp"
    """``tcp`` or ``rdma``."""
    rdma_devices: str = ""
    """Comma-separated RDMA devices (e.g. ``mlx5_0,mlx5_1``); required with ``protocol="rdma"``."""
    local_buffer_size: int = 16 * 1024 * 1024
    """Bytes of the store client's own staging buffer (only the small manifest goes through it; chunks move zero-copy)."""
    global_segment_size: int = 0
    """Bytes this process contributes to the pool; 0: a serving process stores nothing itself, storage holders do."""
    namespace: str = ""
    """User namespace mixed into the key digest: instances share chunks only with the same namespace."""
    timeout_s: float = 5.0
    """Upper bound of every store operation (lookup, store, load, setup, drain, shutdown), in seconds."""
    io_threads: int = 4
    """Threads that run store and load jobs."""
    reconnect_interval_s: float = 1.0
    """Seconds between attempts to reach the master after it was lost (or before it was first reached)."""

    def __post_init__(self) -> None:
        if not isinstance(self.master_server_address, str) or not _is_host_port(self.master_server_address):  # pyright: ignore[reportUnnecessaryIsInstance] -- vLLM passes JSON values unchecked
            raise ValueError(f"master_server_address must be 'host:port', got {self.master_server_address!r}")
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {self.protocol!r}")
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ValueError("rdma_devices must name the RDMA devices (e.g. 'mlx5_0') when protocol='rdma', got ''")
        for name in ("local_buffer_size", "global_segment_size"):
            value: object = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a byte count >= 0, got {value!r}")
        for name in ("timeout_s", "reconnect_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.io_threads, int) or isinstance(self.io_threads, bool) or self.io_threads < 1:  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
            raise ValueError(f"io_threads must be an integer >= 1, got {self.io_threads!r}")
        if not isinstance(self.namespace, str):  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
            raise ValueError(f"namespace must be a string, got {self.namespace!r}")
        if not self.local_hostname:
            object.__setattr__(self, "local_hostname", _default_local_hostname())

    @property
    def timeout_ms(self) -> int:
        return max(1, int(self.timeout_s * 1000))

    def mooncake_environment(self) -> dict[str, str]:
        """The Mooncake client settings derived from this configuration (read by the library at setup).

        MC_RPC_TIMEOUT_MS bounds every master RPC (a hung master answers within
        the timeout); one setup attempt keeps setup within the timeout too
        (Mooncake's default retries a dead master for ~90 s); the TCP bind
        address keeps the transfer engine on the advertised address instead of
        the machine's first external one.
        """
        return {
            "MC_RPC_TIMEOUT_MS": str(self.timeout_ms),
            "MC_STORE_CLIENT_SETUP_RETRIES": "1",
            "MC_TCP_BIND_ADDRESS": os.environ.get("MC_TCP_BIND_ADDRESS") or self.local_hostname,
        }


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


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


class MooncakeKeyspace:
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
