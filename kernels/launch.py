"""Triton launcher (interim: runs the torch reference until the Triton kernel lands)."""

from __future__ import annotations

import torch

from .reference import gather_unchecked, scatter_unchecked
from .validation import PageGeometry

__all__ = ["launch_copy"]


def launch_copy(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    *,
    interpret: bool,
    num_programs: int,
    bytes_per_iter: int,
) -> None:
    """Move the validated pairs between ``pages`` and ``slab`` (interim torch path)."""
    del interpret, num_programs, bytes_per_iter
    if to_slab:
        gather_unchecked(pages, slab, blocks, rows, geometry)
    else:
        scatter_unchecked(slab, pages, rows, blocks, geometry)
