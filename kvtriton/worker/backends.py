"""The three ways a transfer job's rows can be copied, behind one small interface.

* ``triton``: one Triton gather/scatter launch per job (``kvtriton.kernels``);
  compiled on CUDA, through the interpreter on CPU under ``TRITON_INTERPRET=1``.
* ``dma``: one ``copy_`` per (row, page tensor), coalesced into one copy per
  run when a run is contiguous on both sides; the copy-engine baseline, and
  what runs when the slab could not be pinned (the kernel cannot reach
  pageable host memory).
* ``torch``: the torch reference (``kvtriton.kernels.reference``), the oracle
  of the tests; on CUDA it goes through a device staging buffer and reads the
  device indices to plan its copies, a device sync per job (the other two
  never synchronise on submit).
* ``auto``: ``triton`` on CUDA with a pinned slab, ``dma`` on CUDA otherwise,
  ``torch`` on CPU.

A backend only copies: the engine plans, stages indices, orders and times jobs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtriton.choices import parse_choice
from kvtriton.kernels import (
    DEFAULT_NUM_PROGRAMS,
    gather_pages,
    gather_pages_reference,
    scatter_pages,
    scatter_pages_reference,
)
from kvtriton.kernels.reference import int_list
from kvtriton.worker.layout import PagedKV
from kvtriton.worker.plan import TransferDirection, TransferPlan

__all__ = ["CopyBackend", "TransferBackend", "make_backend"]


class TransferBackend(enum.Enum):
    """Which implementation copies a job's rows (see the module docstring)."""

    AUTO = "auto"
    TRITON = "triton"
    DMA = "dma"
    TORCH = "torch"

    @classmethod
    def parse(cls, name: str | TransferBackend) -> TransferBackend:
        """Return the backend called ``name``; unknown names raise ``ValueError`` listing the valid ones."""
        return parse_choice(cls, name, "backend")

    def resolve(self, device: torch.device, slab_pinned: bool) -> TransferBackend:
        """The concrete backend ``auto`` stands for on ``device``; others are returned unchanged."""
        if self is not TransferBackend.AUTO:
            return self
        if device.type == "cuda":
            return TransferBackend.TRITON if slab_pinned else TransferBackend.DMA
        return TransferBackend.TORCH


class CopyBackend(Protocol):
    """Copies the rows of one planned job; raises on failure, before or while copying."""

    @property
    def kind(self) -> TransferBackend: ...

    @property
    def wants_device_indices(self) -> bool:
        """True when :meth:`copy` reads ``device`` (index tensors on the pages' device)."""
        ...

    def copy(self, host: TransferPlan, device: TransferPlan) -> None:
        """Run ``host.direction`` for the pairs of the plan.

        ``host`` holds CPU index tensors; ``device`` the same indices on the
        pages' device (the same object on CPU).
        """
        ...


@dataclass(frozen=True, slots=True)
class _Run:
    """``length`` pairs from pair ``start`` on, consecutive in both GPU blocks and slab rows."""

    start: int
    block: int
    row: int
    length: int


def _runs(blocks: list[int], rows: list[int]) -> list[_Run]:
    runs: list[_Run] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1 or rows[i] != rows[i - 1] + 1:
            runs.append(_Run(start, blocks[start], rows[start], i - start))
            start = i
    return runs


@dataclass(frozen=True, slots=True)
class TritonCopy:
    """One gather or scatter launch per job."""

    kv: PagedKV
    slab: torch.Tensor
    num_programs: int

    @property
    def kind(self) -> TransferBackend:
        return TransferBackend.TRITON

    @property
    def wants_device_indices(self) -> bool:
        return True

    def copy(self, host: TransferPlan, device: TransferPlan) -> None:
        # The plan already checked ranges and uniqueness on the host; checking
        # again here would read the device indices (a sync on CUDA).
        if host.direction is TransferDirection.STORE:
            gather_pages(
                self.kv.pages, self.slab, device.gpu_blocks, device.slab_rows,
                num_programs=self.num_programs, check_indices=False,
            )  # fmt: skip
        else:
            scatter_pages(
                self.slab, self.kv.pages, device.slab_rows, device.gpu_blocks,
                num_programs=self.num_programs, check_indices=False,
            )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DmaCopy:
    """Plain ``copy_`` calls: whole runs where both sides are contiguous, else row by row."""

    kv: PagedKV
    slab: torch.Tensor

    @property
    def kind(self) -> TransferBackend:
        return TransferBackend.DMA

    @property
    def wants_device_indices(self) -> bool:
        return False

    def copy(self, host: TransferPlan, device: TransferPlan) -> None:
        del device
        store = host.direction is TransferDirection.STORE
        runs = _runs(int_list(host.gpu_blocks), int_list(host.slab_rows))
        for page, offset, size in zip(self.kv.byte_pages(), self.kv.page_offsets, self.kv.page_bytes):
            columns = self.slab[:, offset : offset + size]
            # A run is one contiguous range on both sides only when this page
            # fills whole slab rows and its blocks are packed back to back.
            whole = size == self.slab.shape[1] and page.stride(0) == size
            for run in runs:
                if whole:
                    pairs = [(columns[run.row : run.row + run.length], page[run.block : run.block + run.length])]
                else:
                    pairs = [(columns[run.row + i], page[run.block + i]) for i in range(run.length)]
                for slab_part, page_part in pairs:
                    if store:
                        slab_part.copy_(page_part, non_blocking=True)
                    else:
                        page_part.copy_(slab_part, non_blocking=True)


@dataclass(frozen=True, slots=True)
class TorchCopy:
    """The torch reference; on CUDA it stages rows in a device buffer, then copies runs to the slab."""

    kv: PagedKV
    slab: torch.Tensor

    @property
    def kind(self) -> TransferBackend:
        return TransferBackend.TORCH

    @property
    def wants_device_indices(self) -> bool:
        return self.kv.device.type != "cpu"

    def copy(self, host: TransferPlan, device: TransferPlan) -> None:
        store = host.direction is TransferDirection.STORE
        if self.kv.device == self.slab.device:
            if store:
                gather_pages_reference(self.kv.pages, self.slab, host.gpu_blocks, host.slab_rows)
            else:
                scatter_pages_reference(self.slab, self.kv.pages, host.slab_rows, host.gpu_blocks)
            return
        count, width = host.num_rows, self.kv.row_bytes
        staging = torch.empty((count, width), dtype=torch.uint8, device=self.kv.device)
        local = torch.arange(count, dtype=torch.int64, device=self.kv.device)
        rows = int_list(host.slab_rows)
        runs = _runs(list(range(count)), rows)
        if store:
            gather_pages_reference(self.kv.pages, staging, device.gpu_blocks, local)
        for run in runs:
            slab_part = self.slab[run.row : run.row + run.length, :width]
            staged = staging[run.start : run.start + run.length]
            if store:
                slab_part.copy_(staged, non_blocking=True)
            else:
                staged.copy_(slab_part, non_blocking=True)
        if not store:
            scatter_pages_reference(staging, self.kv.pages, local, device.gpu_blocks)


def make_backend(
    backend: TransferBackend, kv: PagedKV, slab: torch.Tensor, *, slab_pinned: bool, num_programs: int = DEFAULT_NUM_PROGRAMS
) -> CopyBackend:
    """Build the concrete backend for ``kv`` and ``slab`` (``auto`` resolved here)."""
    concrete = backend.resolve(kv.device, slab_pinned)
    if concrete is TransferBackend.TRITON:
        if kv.device.type == "cuda" and not slab_pinned:
            raise ValueError(
                "backend='triton' needs a pinned slab on CUDA (the kernel cannot reach pageable host memory); "
                "pin the slab or use backend='dma'"
            )
        return TritonCopy(kv, slab, num_programs)
    if concrete is TransferBackend.DMA:
        return DmaCopy(kv, slab)
    return TorchCopy(kv, slab)
