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

from kvtriton.specs import CPULoadStoreSpec, GPULoadStoreSpec

__all__ = ["TransferDirection", "TransferPlan", "plan_transfer", "slots_needed"]


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
    """Co-indexed launch indices: row ``slab_rows[i]`` pairs with GPU block ``gpu_blocks[i]``.

    Both are 1-D int64 CPU tensors; the engine stages them for the device.
    """

    direction: TransferDirection
    gpu_blocks: torch.Tensor
    slab_rows: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.gpu_blocks.shape[0])


def _check_factor(block_size_factor: int) -> None:
    if isinstance(block_size_factor, bool) or not isinstance(block_size_factor, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        raise TypeError(f"block_size_factor must be an int, got {block_size_factor!r}")
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")


def slots_needed(gpu: GPULoadStoreSpec, block_size_factor: int) -> int:
    """How many slots ``gpu`` spans: the length the matching CPU spec must have."""
    _check_factor(block_size_factor)
    total = 0
    for size, index in zip(gpu.group_sizes, gpu.block_indices):
        if size:
            total += -(-(size + index % block_size_factor) // block_size_factor)
    return total


def _check_range(name: str, ids: NDArray[np.int64], limit: int | None) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"{name} holds {low}; ids must not be negative")
    if limit is not None and high >= limit:
        raise ValueError(f"{name} holds {high}, out of range for {limit} entries (0..{limit - 1})")


def _check_unique(name: str, ids: NDArray[np.int64]) -> None:
    values, counts = np.unique(ids, return_counts=True)
    repeated = values[counts > 1]
    if repeated.size:
        raise ValueError(
            f"{name} written more than once in one job: {repeated[:8].tolist()} (the copies would race)"
        )


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
    expected = slots_needed(gpu, f)
    slots = cpu.block_ids
    if len(slots) != expected:
        raise ValueError(
            f"the CPU spec holds {len(slots)} slots but the GPU spec spans {expected} "
            f"({len(gpu.block_ids)} GPU blocks, group_sizes={list(gpu.group_sizes)}, "
            f"block_indices={list(gpu.block_indices)}, block_size_factor={f})"
        )
    _check_range("GPU block_ids", gpu.block_ids, num_gpu_blocks)
    _check_range("CPU block_ids (slots)", slots, num_slots)

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
    rows = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    if direction is TransferDirection.STORE:
        _check_unique("slab row", rows)
    else:
        _check_unique("GPU block", gpu.block_ids)
    return TransferPlan(
        direction=direction,
        gpu_blocks=torch.as_tensor(gpu.block_ids, dtype=torch.int64).clone(),
        slab_rows=torch.as_tensor(rows, dtype=torch.int64),
    )
