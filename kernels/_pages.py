"""Public gather/scatter entry points, plain or compressed: validate, then pick the path that runs the copy.

Dispatch is decided per call from the tensors' device and the environment at
call time (never at import). This is the dispatch of the public functions
only; a transfer engine decides its backend once, at construction
(``kvtriton.worker._backends``), and launches through a prepared
:class:`~kvtriton.kernels._launch.CopyLauncher`:

* CUDA tensors -> the compiled Triton kernels;
* CPU tensors with ``TRITON_INTERPRET=1`` -> the same Triton kernels through
  Triton's interpreter (how the tests exercise the real kernel code);
* CPU tensors otherwise -> the torch reference (``kernels/_reference.py``).

``compression`` (an fp8 row layout, ``compression_layout(pages, group_size)``)
picks the fused quantizing kernel or the compressed reference on the same
path; None copies bytes.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import torch

from ._compressed_format import CompressionLayout, check_call
from ._compression import non_finite_error
from ._reference import gather_unchecked, scatter_unchecked
from ._validation import PageGeometry

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


def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run the kernels on CPU tensors, or None (imports triton, once)."""
    from ._jit import interpreter_probe

    return interpreter_probe.interpreter_problem()


def interpreter_ready() -> None:
    """Raise ``RuntimeError`` in words when ``TRITON_INTERPRET`` is set but this Triton's interpreter cannot run the kernels."""
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
    compression: CompressionLayout | None = None,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    bytes_per_iter: int = DEFAULT_BYTES_PER_ITER,
    check_indices: bool = True,
) -> None:
    """Copy block ``src_blocks[i]`` of every page tensor in ``src`` into slab row ``dst_rows[i]``.

    Runs on the device of the page tensors whichever GPU is current; tensors
    on two devices are refused before anything is written. A slab row holds tensor 0's page bytes, then tensor 1's, ... Each
    destination row may be named once (``ValueError`` otherwise).
    ``compression``: None copies bytes; ``compression_layout(src, group_size)``
    quantizes to fp8 e4m3 rows of its ``row_bytes`` and raises
    :class:`~kvtriton.kernels.NonFiniteKVError` when a value is NaN or
    infinite (after the launch: on CUDA this reads a flag back, a device sync).
    Knobs: ``num_programs`` caps the persistent grid (SMs used),
    ``bytes_per_iter`` is what one program moves per iteration;
    ``check_indices=False`` skips the range and uniqueness checks, which read
    the indices (a device sync on CUDA).
    """
    check_knobs(num_programs, bytes_per_iter)
    geometry = check_call(
        src,
        dst,
        src_blocks,
        dst_rows,
        to_slab=True,
        compression=compression,
        check_values=check_indices,
        allow_duplicate_destinations=False,
    )
    if not _run(True, list(src), dst, src_blocks, dst_rows, geometry, compression, num_programs, bytes_per_iter):
        raise non_finite_error("src")


def scatter_pages(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    compression: CompressionLayout | None = None,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    bytes_per_iter: int = DEFAULT_BYTES_PER_ITER,
    check_indices: bool = True,
) -> None:
    """Copy slab row ``src_rows[i]`` into block ``dst_blocks[i]`` of every page tensor in ``dst``.

    The inverse of :func:`gather_pages`; each destination block may be named
    once. ``compression`` (``compression_layout(dst, group_size)``)
    dequantizes fp8 rows. Knobs as for :func:`gather_pages`.
    """
    check_knobs(num_programs, bytes_per_iter)
    geometry = check_call(
        dst,
        src,
        src_rows,
        dst_blocks,
        to_slab=False,
        compression=compression,
        check_values=check_indices,
        allow_duplicate_destinations=False,
    )
    _run(False, list(dst), src, dst_blocks, src_rows, geometry, compression, num_programs, bytes_per_iter)


def _run(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    compression: CompressionLayout | None,
    num_programs: int,
    bytes_per_iter: int,
) -> bool:
    """One validated copy on the path :func:`select_path` picks; whether every value was finite.

    Only a compressed gather can meet a non-finite value: plain rows are bytes, and a scatter decodes codes,
    which are finite by construction.
    """
    if blocks.numel() == 0:
        return True
    path = select_path(geometry.device)
    if path is KernelPath.TORCH:
        if to_slab:
            return gather_unchecked(pages, slab, blocks, rows, geometry, compression)
        scatter_unchecked(slab, pages, rows, blocks, geometry, compression)
        return True
    from ._launch import CopyLauncher  # triton is imported only when a Triton path runs

    if path is KernelPath.INTERPRETER:
        interpreter_ready()
    launcher = CopyLauncher(
        pages,
        slab,
        geometry,
        compression=compression,
        interpret=path is KernelPath.INTERPRETER,
        num_programs=num_programs,
        bytes_per_iter=bytes_per_iter,
    )
    status = None
    if to_slab and compression is not None:
        status = torch.zeros(1, dtype=torch.int32, device=geometry.device)
    launcher.launch(to_slab, blocks, rows, status)
    return status is None or int(status.item()) == 0
