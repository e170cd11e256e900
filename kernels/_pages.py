"""Public gather/scatter entry points, plain and compressed: validate, then pick the path that runs the copy.

Dispatch is decided per call from the tensors' device and the environment at
call time (never at import). This is the dispatch of the public functions
only; a transfer engine decides its backend once, at construction
(``kvtriton.worker._backends``), and launches through a prepared
:class:`~kvtriton.kernels._launch.CopyLauncher`:

* CUDA tensors -> the compiled Triton kernel;
* CPU tensors with ``TRITON_INTERPRET=1`` -> the same Triton kernel through
  Triton's interpreter (how the tests exercise the real kernel code);
* CPU tensors otherwise -> the torch reference (``kernels/_reference.py``).

The compressed calls (``gather_pages_compressed`` / ``scatter_pages_compressed``) take the same paths:
the fused kernel of ``_compressed_launch.py`` or the compressed torch reference.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import torch

from ._compressed_format import DEFAULT_GROUP_SIZE, CompressionLayout, check_compressed_call
from ._compression import non_finite_error
from ._reference import gather_compressed_unchecked, gather_unchecked, scatter_compressed_unchecked, scatter_unchecked
from ._validation import PageGeometry, check_call

# A persistent grid of at most this many programs: enough to saturate PCIe /
# C2C host traffic on H100/H200 class GPUs while leaving the other SMs to the
# model (docs/kernels.md, "Kernel design").
DEFAULT_NUM_PROGRAMS = 16
# Bytes one program moves per loop iteration: host reads are latency-bound,
# so each program keeps tens of KiB in flight.
DEFAULT_BYTES_PER_ITER = 16 * 1024


class KernelPath(enum.Enum):
    """Which implementation runs a public gather/scatter call."""

    TRITON = "triton"
    INTERPRETER = "triton-interpreter"
    TORCH = "torch"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_path(device: torch.device) -> KernelPath:
    """The path a call on ``device`` takes now (reads ``TRITON_INTERPRET`` at call time)."""
    if device.type == "cuda":
        return KernelPath.TRITON
    if device.type == "cpu" and _interpreting():
        return KernelPath.INTERPRETER
    if device.type == "cpu":
        return KernelPath.TORCH
    raise ValueError(f"unsupported device {device}: page tensors must be on CUDA or CPU")


def check_knobs(num_programs: int, bytes_per_iter: int) -> None:
    """Refuse launch knobs out of range, naming the knob and the value."""
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    if bytes_per_iter < 16 or bytes_per_iter & (bytes_per_iter - 1):
        raise ValueError(f"bytes_per_iter must be a power of two >= 16, got {bytes_per_iter}")


def interpreter_ready() -> None:
    """Raise ``RuntimeError`` in words when ``TRITON_INTERPRET`` is set but this Triton's interpreter cannot run the kernels."""
    from ._jit.interpreter_probe import interpreter_problem

    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(
            f"TRITON_INTERPRET is set but {problem}; unset TRITON_INTERPRET to copy CPU tensors "
            "with the torch path, or use a newer Triton (3.9 works)"
        )


def gather_pages(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    bytes_per_iter: int = DEFAULT_BYTES_PER_ITER,
    check_indices: bool = True,
) -> None:
    """Copy block ``src_blocks[i]`` of every page tensor in ``src`` into slab row ``dst_rows[i]``.

    Runs on the device of the page tensors whichever GPU is current; tensors
    on two devices are refused before anything is written. A slab row holds tensor 0's page bytes, then tensor 1's, ... Each
    destination row may be named once (``ValueError`` otherwise). Knobs:
    ``num_programs`` caps the persistent grid (SMs used), ``bytes_per_iter`` is
    what one program moves per iteration; ``check_indices=False`` skips the
    range and uniqueness checks, which read the indices (a device sync on CUDA).
    """
    check_knobs(num_programs, bytes_per_iter)
    geometry = check_call(
        src, dst, src_blocks, dst_rows, to_slab=True, check_values=check_indices, allow_duplicate_destinations=False
    )
    _run(True, list(src), dst, src_blocks, dst_rows, geometry, num_programs, bytes_per_iter)


def scatter_pages(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    bytes_per_iter: int = DEFAULT_BYTES_PER_ITER,
    check_indices: bool = True,
) -> None:
    """Copy slab row ``src_rows[i]`` into block ``dst_blocks[i]`` of every page tensor in ``dst``.

    The inverse of :func:`gather_pages`; each destination block may be named
    once. Knobs as for :func:`gather_pages`.
    """
    check_knobs(num_programs, bytes_per_iter)
    geometry = check_call(
        dst, src, src_rows, dst_blocks, to_slab=False, check_values=check_indices, allow_duplicate_destinations=False
    )
    _run(False, list(dst), src, dst_blocks, src_rows, geometry, num_programs, bytes_per_iter)


def _run(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    num_programs: int,
    bytes_per_iter: int,
) -> None:
    if blocks.numel() == 0:
        return
    path = select_path(geometry.device)
    if path is KernelPath.TORCH:
        if to_slab:
            gather_unchecked(pages, slab, blocks, rows, geometry)
        else:
            scatter_unchecked(slab, pages, rows, blocks, geometry)
        return
    from ._launch import launch_copy  # triton is imported only when a Triton path runs

    if path is KernelPath.INTERPRETER:
        interpreter_ready()
    launch_copy(
        to_slab, pages, slab, blocks, rows, geometry, interpret=path is KernelPath.INTERPRETER,
        num_programs=num_programs, bytes_per_iter=bytes_per_iter,
    )  # fmt: skip


def gather_pages_compressed(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
    num_programs: int | None = None,
    bytes_per_iter: int | None = None,
    check_indices: bool = True,
) -> None:
    """Quantize block ``src_blocks[i]`` of every page tensor into compressed slab row ``dst_rows[i]``.

    The compressed counterpart of :func:`gather_pages` (same dispatch, one
    launch per page kind); ``dst`` rows must hold
    ``compression_layout(src, group_size).row_bytes``. Raises
    :class:`~kvtriton.kernels.NonFiniteKVError` when a value is NaN or
    infinite (after the launch: on CUDA this reads a flag back, a device sync).
    A knob given as None takes its default.
    """
    num_programs, bytes_per_iter = _filled_knobs(num_programs, bytes_per_iter)
    geometry, layout = check_compressed_call(
        src, dst, src_blocks, dst_rows, to_slab=True,
        group_size=group_size, check_values=check_indices, allow_duplicate_destinations=False,
    )  # fmt: skip
    if not _run_compressed(True, list(src), dst, src_blocks, dst_rows, geometry, layout, num_programs, bytes_per_iter):
        raise non_finite_error("src")


def scatter_pages_compressed(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
    num_programs: int | None = None,
    bytes_per_iter: int | None = None,
    check_indices: bool = True,
) -> None:
    """Dequantize compressed slab row ``src_rows[i]`` into block ``dst_blocks[i]`` of every page tensor in ``dst``."""
    num_programs, bytes_per_iter = _filled_knobs(num_programs, bytes_per_iter)
    geometry, layout = check_compressed_call(
        dst, src, src_rows, dst_blocks, to_slab=False,
        group_size=group_size, check_values=check_indices, allow_duplicate_destinations=False,
    )  # fmt: skip
    _run_compressed(False, list(dst), src, dst_blocks, src_rows, geometry, layout, num_programs, bytes_per_iter)


def _filled_knobs(num_programs: int | None, bytes_per_iter: int | None) -> tuple[int, int]:
    """The launch knobs with their defaults filled in for None, refused (naming the knob) when out of range."""
    programs = DEFAULT_NUM_PROGRAMS if num_programs is None else num_programs
    per_iter = DEFAULT_BYTES_PER_ITER if bytes_per_iter is None else bytes_per_iter
    check_knobs(programs, per_iter)
    return programs, per_iter


def _run_compressed(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    layout: CompressionLayout,
    num_programs: int,
    bytes_per_iter: int,
) -> bool:
    """One compressed copy on the path :func:`_run` would take; whether every value was finite.

    A scatter decodes codes, which are finite by construction: it always answers True.
    """
    if blocks.numel() == 0:
        return True
    path = select_path(geometry.device)
    if path is KernelPath.TORCH:
        if to_slab:
            return gather_compressed_unchecked(pages, slab, blocks, rows, layout)
        scatter_compressed_unchecked(slab, pages, rows, blocks, layout)
        return True
    from ._compressed_launch import CompressedLauncher  # triton is imported only when a Triton path runs

    if path is KernelPath.INTERPRETER:
        interpreter_ready()
    launcher = CompressedLauncher(
        pages, slab, geometry, layout, interpret=path is KernelPath.INTERPRETER,
        num_programs=num_programs, bytes_per_iter=bytes_per_iter,
    )  # fmt: skip
    if not to_slab:
        launcher.launch(False, blocks, rows, None)
        return True
    status = torch.zeros(1, dtype=torch.int32, device=geometry.device)
    launcher.launch(True, blocks, rows, status)
    return int(status.item()) == 0
