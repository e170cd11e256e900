"""Mooncake Store as a :class:`~kvtriton.integrations.remote.RemoteClient`: the ~100 lines that know Mooncake.

:class:`StoreClient` is the part of ``mooncake.store.MooncakeDistributedStore``
the tier uses (the package ships no type information); :func:`open_store` sets
one up against the configured master (and says which key failed when it cannot); :class:`MooncakeClient` turns its status
codes into the remote tiers' outcomes.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from kvtriton.integrations.mooncake._config import MooncakeTierConfig
from kvtriton.integrations.mooncake._setup_failure import setup_failure_line
from kvtriton.integrations.remote import Outcome, RemoteClient, Segment, Unreachable

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
"""Mooncake's status for a key the store does not hold."""


def is_connection_error(code: int) -> bool:
    """Whether a Mooncake status code says the master could not be reached (RPC_FAIL -900, RPC_TIMEOUT -901, ...)."""
    return -999 <= code <= -900


class StoreClient(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` this tier uses (the package ships no type information)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def get_size(self, key: str) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...
    def put(self, key: str, value: bytes) -> int: ...
    def get(self, key: str) -> bytes: ...
    def close(self) -> int: ...


def set_up_store(config: MooncakeTierConfig) -> StoreClient | int:
    """A store client set up against ``config``'s master, or Mooncake's status when setup failed (bounded by the
    timeout's settings).

    Mooncake reads its RPC timeout and setup retries from the environment when
    a client is created, so :meth:`MooncakeTierConfig.mooncake_environment` is
    applied first (the same values for every tier of a process).
    """
    os.environ.update(config.mooncake_environment())
    module = importlib.import_module("mooncake.store")
    factory = cast("Callable[[], StoreClient]", module.MooncakeDistributedStore)
    store = factory()
    status = store.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.rdma_devices,
        config.master_server_address,
    )
    if status != 0:
        store.close()
        return status
    return store


def open_store(config: MooncakeTierConfig) -> StoreClient | None:
    """A store client set up against ``config``'s master, or None when setup failed (logged as a WARNING naming the
    key and address that failed, :func:`~kvtriton.integrations.mooncake._setup_failure.setup_failure_line`)."""
    store = set_up_store(config)
    if isinstance(store, int):
        logger.warning("%s", setup_failure_line(config, store, who="Mooncake"))
        return None
    return store


def _split(segments: Sequence[Sequence[Segment]]) -> tuple[list[list[int]], list[list[int]]]:
    return [[address for address, _ in pieces] for pieces in segments], [
        [nbytes for _, nbytes in pieces] for pieces in segments
    ]


class MooncakeClient(RemoteClient):
    """The remote tiers' client calls over one set-up :class:`StoreClient`."""

    def __init__(self, store: StoreClient) -> None:
        self.store = store

    def register_memory(self, address: int, nbytes: int) -> bool:
        status = self.store.register_buffer(address, nbytes)
        if status != 0:
            logger.error("Mooncake refused to register %d bytes at %#x (status %d)", nbytes, address, status)
        return status == 0

    def unregister_memory(self, address: int) -> None:
        status = self.store.unregister_buffer(address)
        if status != 0:
            logger.warning("Mooncake did not unregister the memory at %#x (status %d)", address, status)

    def exist(self, keys: Sequence[str]) -> list[bool]:
        codes = self.store.batch_is_exist(list(keys))
        if any(is_connection_error(code) for code in codes):
            raise Unreachable(f"Mooncake master unreachable (status {sorted(set(codes))})")
        return [code == 1 for code in codes]

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Outcome]:
        pointers, sizes = _split(segments)
        codes = self.store.batch_put_from_multi_buffers(list(keys), pointers, sizes)
        return [
            Outcome.OK if code == 0 else Outcome.UNREACHABLE if is_connection_error(code) else Outcome.FAILED
            for code in codes
        ]

    def get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[int | Outcome]:
        pointers, sizes = _split(segments)
        codes = self.store.batch_get_into_multi_buffers(list(keys), pointers, sizes)
        return [_get_result(code) for code in codes]

    def size_of(self, key: str) -> int | None:
        size = self.store.get_size(key)
        return size if size >= 0 else None

    def put_value(self, key: str, value: bytes) -> Outcome:
        status = self.store.put(key, value)
        if is_connection_error(status):
            return Outcome.UNREACHABLE
        if status != 0:
            logger.warning("Mooncake refused the value under %s (status %d)", key, status)
        return Outcome.OK if status == 0 else Outcome.FAILED

    def close(self) -> None:
        self.store.close()


def _get_result(code: int) -> int | Outcome:
    """One key's status from a Mooncake get: the bytes moved, or why none were."""
    if code >= 0:
        return code
    if code == OBJECT_NOT_FOUND:
        return Outcome.ABSENT
    return Outcome.UNREACHABLE if is_connection_error(code) else Outcome.FAILED
