"""Turn a GPU spec and a CPU spec into the index tensors of one kernel launch.

The only place where specs become launch indices. One slot holds
``f = block_size_factor`` GPU blocks as ``f`` consecutive slab rows (slot
``s`` = rows ``s*f .. s*f+f-1``). GPU block ids arrive group by group
(``group_sizes``); group ``g``'s first block has index ``block_indices[g]``
within its request, so when that index is not a multiple of ``f`` the group
enters its first slot part-way and ``block_indices[g] % f`` rows of it are
skipped. Each group starts on a fresh slot and uses
``ceil((group_size + skip) / f)`` slots; its last slot may be used only
in part. This matches vLLM's CPU<->GPU offloading handler, for loads and
stores alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from kvtriton._int_argument import check_int
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.kernels import check_host_indices, check_unique


class TransferDirection(enum.Enum):
    """Which way a job copies: STORE = GPU pages -> slab, LOAD = slab -> GPU pages."""

    STORE = ("GPU", "CPU")
    LOAD = ("CPU", "GPU")

    @property
    def transfer_type(self) -> tuple[str, str]:
        """``(source medium, destination medium)``, as vLLM's TransferResult reports it."""
        return self.value


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Co-indexed indices of one job: slab row ``slab_rows[i]`` pairs with GPU block ``gpu_blocks[i]``.

    Both are 1-D int64 numpy arrays on the host, already checked (range, and
    no destination named twice); the engine stages them for the device.
    """

    direction: TransferDirection
    gpu_blocks: NDArray[np.int64]
    slab_rows: NDArray[np.int64]

    @property
    def num_rows(self) -> int:
        return int(self.gpu_blocks.shape[0])


def host_tensor(array: NDArray[np.int64]) -> torch.Tensor:
    """A CPU tensor sharing ``array``'s memory (no copy)."""
    return torch.from_numpy(array)  # pyright: ignore[reportUnknownMemberType] -- torch types from_numpy's argument as Unknown


def _check_factor(block_size_factor: int) -> None:
    check_int("block_size_factor", block_size_factor, minimum=1)


def slots_needed(gpu: GPULoadStoreSpec, block_size_factor: int) -> int:
    """How many slots ``gpu`` spans: the length the matching CPU spec must have."""
    _check_factor(block_size_factor)
    return _slots_spanned(gpu, block_size_factor)


def _slots_spanned(gpu: GPULoadStoreSpec, block_size_factor: int) -> int:
    """:func:`slots_needed` for a factor already checked (the planner checks it once per job)."""
    if block_size_factor == 1:
        return len(gpu.block_ids)
    total = 0
    for size, index in zip(gpu.group_sizes, gpu.block_indices):
        if size:
            total += -(-(size + index % block_size_factor) // block_size_factor)
    return total


def plan_transfer(
    direction: TransferDirection,
    gpu: GPULoadStoreSpec,
    cpu: CPULoadStoreSpec,
    block_size_factor: int,
    *,
    num_gpu_blocks: int | None = None,
    num_slots: int | None = None,
) -> TransferPlan:
    """Expand ``gpu`` and ``cpu`` into co-indexed (GPU block, slab row) launch indices.

    Raises ``ValueError`` (before anything runs) when the CPU spec's slot
    count does not match what ``gpu`` spans, when an id is out of range
    (``num_gpu_blocks`` / ``num_slots``, when given), or when the job would
    write one destination row or block twice.
    """
    _check_factor(block_size_factor)
    if not isinstance(gpu, GPULoadStoreSpec):  # pyright: ignore[reportUnnecessaryIsInstance] -- specs arrive from untyped connectors
        raise TypeError(f"gpu must be a GPULoadStoreSpec, got {type(gpu).__name__}")
    if not isinstance(cpu, CPULoadStoreSpec):  # pyright: ignore[reportUnnecessaryIsInstance] -- same
        raise TypeError(f"cpu must be a CPULoadStoreSpec, got {type(cpu).__name__}")
    f = block_size_factor
    expected = _slots_spanned(gpu, f)
    slots = cpu.block_ids
    if len(slots) != expected:
        raise ValueError(
            f"the CPU spec holds {len(slots)} slots but the GPU spec spans {expected} "
            f"({len(gpu.block_ids)} GPU blocks, group_sizes={list(gpu.group_sizes)}, "
            f"block_indices={list(gpu.block_indices)}, block_size_factor={f})"
        )
    rows = slots if f == 1 else _rows(gpu, slots, f)  # one block per slot: row = slot
    # Each side's range, and that the destination (GPU blocks, or slab rows: slots when one block fills one) is
    # written once; one sort checks both of the destination's.
    store = direction is TransferDirection.STORE
    check_host_indices(
        gpu.block_ids, "GPU block_ids", num_gpu_blocks, "GPU blocks", unique_as=None if store else "GPU block_ids"
    )
    check_host_indices(slots, "CPU block_ids", num_slots, "slots", unique_as="slab rows" if store and f == 1 else None)
    if store and f > 1:
        check_unique(rows, "slab rows")
    return TransferPlan(direction=direction, gpu_blocks=gpu.block_ids, slab_rows=rows)


def _rows(gpu: GPULoadStoreSpec, slots: NDArray[np.int64], f: int) -> NDArray[np.int64]:
    """The slab row of each GPU block, group by group (a loop over groups, vectorised within each)."""
    within_slot = np.arange(f, dtype=np.int64)
    parts: list[NDArray[np.int64]] = []
    slot_cursor = 0
    for size, index in zip(gpu.group_sizes, gpu.block_indices):
        if size == 0:
            continue
        skip = index % f
        count = -(-(size + skip) // f)
        group_slots = slots[slot_cursor : slot_cursor + count]
        slot_cursor += count
        rows = np.repeat(group_slots * f, f) + np.tile(within_slot, count)
        parts.append(rows[skip : skip + size])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
