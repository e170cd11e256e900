"""The Mooncake Store tier's settings.

:class:`MooncakeTierConfig` holds every configuration key of
``{"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake", ...}``
with its default and validation (docs/mooncake.md describes each); the keys
every remote tier shares (namespace, timeout, threads, reconnection) are
checked by :class:`~kvtriton.integrations.remote.RemoteTierSettings`. Object
keys come from the remote tiers' keyspace (:class:`MooncakeKeyspace` is
:class:`~kvtriton.integrations.remote.TierKeyspace`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvtriton._int_argument import check_int
from kvtriton.integrations.remote import ChunkIdentity, RemoteTierSettings, TierKeyspace

MooncakeKeyspace = TierKeyspace
"""The Mooncake tier's object keys: the remote tiers' keyspace, ``kvt/<digest>/<block hash hex>/g<group>``."""

__all__ = ["ChunkIdentity", "MooncakeKeyspace", "MooncakeTierConfig"]

_PROTOCOLS = ("tcp", "rdma")


def _default_local_hostname() -> str:
    """The address this process is reached at: MC_TCP_BIND_ADDRESS when set (as Mooncake itself does), else the host's."""
    bound = os.environ.get("MC_TCP_BIND_ADDRESS", "").strip()
    if bound:
        return bound
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True, kw_only=True)
class MooncakeTierConfig(RemoteTierSettings):
    """Every key of the tier's configuration, validated; see docs/mooncake.md for each one.

    The keys every remote tier shares (``namespace``, ``timeout_s``,
    ``io_threads``, ``reconnect_interval_s``, ``retry_backoff_s``,
    ``retry_backoff_max_s``) are :class:`RemoteTierSettings`' fields, checked there.
    """

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

    def __post_init__(self) -> None:
        if not isinstance(self.master_server_address, str) or not _is_host_port(self.master_server_address):  # pyright: ignore[reportUnnecessaryIsInstance] -- vLLM passes JSON values unchecked
            raise ValueError(f"master_server_address must be 'host:port', got {self.master_server_address!r}")
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {self.protocol!r}")
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ValueError("rdma_devices must name the RDMA devices (e.g. 'mlx5_0') when protocol='rdma', got ''")
        for name in ("local_buffer_size", "global_segment_size"):
            check_int(name, getattr(self, name), minimum=0)  # a byte count
        super().__post_init__()  # the keys every remote tier shares
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
