"""What the launcher hands a ``@triton.jit`` wrapper: the argument records of both kernels, the limits they obey, and the word width.

The launcher (``_launch.py``) builds these; the kernel wrappers in ``_jit/``
read them. Keeping them here, below both, means no wrapper imports the
launcher back. :func:`word_width`, the alignment rule every launch argument
obeys, lives here too: the torch reference (``_reference.py``) moves its bytes
in the same words without importing the launcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Warps per program, at most: 4 warps x 32 threads x 16 B = 2 KiB per access
# wave, so a 16 KiB tile keeps eight 16-byte loads per thread in flight.
# Smaller tiles get fewer warps so that each thread still moves whole words.
MAX_NUM_WARPS = 4

# Index pairs per tile, at most: each pair costs a thread registers for its
# block and row ids, so pages under 128 B (no KV layout has them) get smaller
# tiles rather than hundreds of pairs per program.
MAX_PAIRS = 128


def word_width(*values: int) -> int:
    """The widest of 16/8/4/2/1 bytes that divides every value."""
    for width in (16, 8, 4, 2):
        if all(value % width == 0 for value in values):
            return width
    return 1


def next_power_of_two(value: int) -> int:
    """The smallest power of two >= ``value`` (1 for 0 and 1)."""
    return 1 << max(0, (value - 1).bit_length())


class CopyArguments(NamedTuple):
    """The arguments of one copy-kernel launch, by kernel parameter (a tuple: cheap to build per job)."""

    table: torch.Tensor
    slab: torch.Tensor
    blocks: torch.Tensor
    rows: torch.Tensor
    num_pairs: int
    row_stride: int
    to_slab: bool
    num_pages: int
    page_elems: int
    chunk: int
    pairs: int
    uniform: bool
    even: bool
    word: int
    num_warps: int


@dataclass(frozen=True, slots=True)
class CompressConfig:
    """Compile-time shape of one compressed launch (the kernel's constexprs, but the direction)."""

    num_pages: int
    elements: int
    group: int
    group_columns: int
    num_groups: int
    tile_groups: int
    pairs: int
    kind: int
    scales_offset: int
    page_word: int
    slab_word: int
    element_bytes: int

    @property
    def num_warps(self) -> int:
        """Enough warps that every thread holds at least one 16-byte word of the tile's page side."""
        tile_bytes = self.pairs * self.tile_groups * self.group_columns * self.element_bytes
        return max(1, min(MAX_NUM_WARPS, tile_bytes // (32 * 16)))

    def units(self, num_pairs: int) -> int:
        return -(-num_pairs // self.pairs) * self.num_pages * -(-self.num_groups // self.tile_groups)

    def kernel_constexprs(self, to_slab: bool) -> dict[str, int | bool]:
        """The kernel's constexprs, by parameter name: the direction, then each field the kernel takes, upper-cased."""
        return {"TO_SLAB": to_slab} | {name.upper(): getattr(self, name) for name in _KERNEL_FIELDS}


# The CompressConfig fields the kernel takes as constexprs, in parameter order (element_bytes only sizes tiles).
_KERNEL_FIELDS = (
    "num_pages",
    "elements",
    "group",
    "group_columns",
    "num_groups",
    "tile_groups",
    "pairs",
    "kind",
    "scales_offset",
    "page_word",
    "slab_word",
)


class CompressArguments(NamedTuple):
    """The arguments of one compressed launch: the run-time ones by kernel parameter, then the compile-time ones.

    ``constexprs`` is :meth:`CompressConfig.kernel_constexprs` for the launch's
    direction, built once per launcher and direction (never per launch).
    """

    table: torch.Tensor
    slab: torch.Tensor
    blocks: torch.Tensor
    rows: torch.Tensor
    status: torch.Tensor
    num_pairs: int
    row_stride: int
    constexprs: Mapping[str, int | bool]
    num_warps: int
