"""The small value types that cross between the scheduler and the worker side.

Names and shapes mirror vLLM's ``vllm/v1/kv_offload`` so that code written
against vLLM's offloading interface reads the same here. Slot ids and GPU block
ids travel as numpy int64 arrays: the scheduler side imports neither torch nor
triton.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvtriton._keys import OffloadKey

_T = TypeVar("_T")

BlockIds = Collection[int] | NDArray[np.integer]
"""Anything that holds block ids: a list, tuple, range, set view or numpy array."""


class LookupResult(enum.Enum):
    """What the manager knows about one key."""

    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    """Stored but not readable yet: its store job has not completed."""


@dataclass
class ReqContext:
    """The request a manager call is made for (vLLM passes its own ``ReqContext``, which has the same methods).

    Besides the request's id and transfer parameters it carries the token
    position of each of the request's keys, as vLLM 0.33's scheduler records
    them: the end token of the block (or chunk) a key names. A manager ranks
    the request's keys by these positions (``docs/manager.md``, "Recency").
    ``get_state`` / ``set_state`` keep one value per type for whoever
    handles the request (the manager keeps its record of the request there),
    as vLLM's context does. A manager reads a context only through
    ``get_offload_key_position``, ``get_state`` and ``set_state``, so vLLM's
    own context can be passed in its place.
    """

    req_id: str = ""
    kv_transfer_params: Mapping[str, object] | None = None
    key_positions: dict[OffloadKey, int] = field(default_factory=lambda: {}, repr=False, compare=False)
    """End-token position per key, filled by :meth:`set_offload_key_position`."""
    _state: dict[type, Any] = field(default_factory=lambda: {}, repr=False, compare=False, init=False)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        """Record that ``key`` names the block ending at token ``end_token`` of this request."""
        self.key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        """The end-token position of ``key`` in this request, or ``None`` when unknown."""
        return self.key_positions.get(key)

    def set_state(self, value: object) -> None:
        """Keep ``value`` for this request, replacing any earlier value of the same type."""
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        """The value of type ``cls`` kept by :meth:`set_state`, else ``None``."""
        return self._state.get(cls)


def _as_block_id_array(block_ids: BlockIds, name: str) -> NDArray[np.int64]:
    """Copy ``block_ids`` into a 1-D int64 array, rejecting non-integers."""
    array = np.asarray(list(block_ids) if not isinstance(block_ids, np.ndarray) else block_ids)
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.dtype.kind not in "iu":  # signed or unsigned integers (a bool array is kind "b")
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=True)


class LoadStoreSpec(ABC):
    """Where the blocks of one transfer live: a medium and block ids in it."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The storage medium's name, e.g. ``"CPU"`` or ``"GPU"``."""


class CPULoadStoreSpec(LoadStoreSpec):
    """Slot ids in the host slab, co-indexed with the keys of the call.

    Built from caller data, the ids are checked and copied at once. The
    manager builds its answers with :meth:`from_slots` from a list of slots
    it allocated itself: nothing to check, and the numpy array is made only
    when the worker side first reads ``block_ids`` (the vLLM adapter reads the
    list instead and never pays for it).
    """

    __slots__ = ("_array", "_slots")

    MEDIUM: ClassVar[str] = "CPU"

    def __init__(self, block_ids: BlockIds) -> None:
        self._array: NDArray[np.int64] | None = _as_block_id_array(block_ids, "block_ids")
        self._slots: list[int] | None = None

    @classmethod
    def from_slots(cls, slots: list[int]) -> CPULoadStoreSpec:
        """A spec over ``slots``, which the caller built and will not change (not checked, not copied)."""
        spec = cls.__new__(cls)
        spec._array = None
        spec._slots = slots
        return spec

    @property
    def block_ids(self) -> NDArray[np.int64]:
        """The slot ids as a 1-D int64 array."""
        array = self._array
        if array is None:
            slots = self._slots
            array = self._array = np.array(slots if slots is not None else (), dtype=np.int64)
        return array

    @block_ids.setter
    def block_ids(self, block_ids: BlockIds) -> None:
        self._array = _as_block_id_array(block_ids, "block_ids")
        self._slots = None

    def slot_list(self) -> list[int]:
        """The slot ids as a list of ints (the manager's own list when it built the spec)."""
        slots = self._slots
        if slots is None:
            slots = self._slots = self.block_ids.tolist()
        return slots

    @staticmethod
    def medium() -> str:
        return CPULoadStoreSpec.MEDIUM

    def __repr__(self) -> str:
        return f"CPULoadStoreSpec(block_ids={self.block_ids.tolist()})"


class GPULoadStoreSpec(LoadStoreSpec):
    """GPU block ids, group by group.

    ``block_ids`` holds the blocks of KV cache group 0, then group 1, ...;
    ``group_sizes[g]`` says how many belong to group ``g`` and
    ``block_indices[g]`` is the index, within the request, of group ``g``'s
    first block (so a transfer may start part-way into an offloaded block that
    spans several GPU blocks).
    """

    MEDIUM: ClassVar[str] = "GPU"

    def __init__(
        self,
        block_ids: BlockIds,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        ids = _as_block_id_array(block_ids, "block_ids")
        sizes = [len(ids)] if group_sizes is None else [int(size) for size in group_sizes]
        indices = [0] * len(sizes) if block_indices is None else [int(index) for index in block_indices]
        if any(size < 0 for size in sizes):
            raise ValueError(f"group_sizes must not be negative, got {sizes}")
        if any(index < 0 for index in indices):
            raise ValueError(f"block_indices must not be negative, got {indices}")
        if sum(sizes) != len(ids):
            raise ValueError(f"sum(group_sizes) = {sum(sizes)} does not match len(block_ids) = {len(ids)}")
        if len(indices) != len(sizes):
            raise ValueError(f"len(block_indices) = {len(indices)} does not match len(group_sizes) = {len(sizes)}")
        self.block_ids: NDArray[np.int64] = ids
        self.group_sizes: tuple[int, ...] = tuple(sizes)
        self.block_indices: tuple[int, ...] = tuple(indices)

    @classmethod
    def from_checked(
        cls, block_ids: NDArray[np.int64], group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
    ) -> GPULoadStoreSpec:
        """A spec over ids its caller computed and checked as :meth:`__init__` would (not checked, not copied).

        For the worker's hot path, which reads the ids back from vLLM's device
        pointers into a fresh ``int64`` array and has checked the group counts.
        """
        spec = cls.__new__(cls)
        spec.block_ids = block_ids
        spec.group_sizes = group_sizes
        spec.block_indices = block_indices
        return spec

    @staticmethod
    def medium() -> str:
        return GPULoadStoreSpec.MEDIUM

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={self.block_ids.tolist()}, "
            f"group_sizes={list(self.group_sizes)}, block_indices={list(self.block_indices)})"
        )


@dataclass
class PrepareStoreOutput:
    """The answer to ``prepare_store``: what to store, where, and what made room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey] = field(default_factory=lambda: [])


@dataclass
class OffloadingEvent:
    """Keys that became readable (``removed=False``) or were evicted (``removed=True``).

    ``metadata_only`` marks the removal of keys whose store failed: they were
    never readable, so no cache announced them, but a consumer that recorded
    something when the store was prepared (vLLM's events tracker) drops it.
    ``req_context`` is the context of the request whose ``complete_store``
    made the keys readable (None on other events): vLLM 0.34's events tracker
    builds a stored block's payload from it.
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool
    metadata_only: bool = False
    req_context: ReqContext | None = field(default=None, repr=False, compare=False)
