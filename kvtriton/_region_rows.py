"""How the tiered spec's shared region sizes a chunk's block rows, without torch (the simulator sizes with it too).

Every block row holds all ranks' bytes of one GPU block and keeps room for a
chunk's seal (:data:`kvtriton._integrity.SEAL_BYTES`), padded so that a chunk
is a multiple of :data:`ROW_ALIGNMENT`. Every row has the same stride (the slab
is one strided view), so every row keeps the seal's room, although only the
last row of a chunk holds it.
"""

from __future__ import annotations

import math
import mmap

from kvtriton._integrity import SEAL_BYTES

ROW_ALIGNMENT = max(4096, mmap.PAGESIZE)
"""Chunks are padded to this: O_DIRECT needs 4096-byte buffers and lengths; vLLM pads to the page."""


def block_row_stride(block_size_factor: int, world_size: int, rank_row_bytes: int) -> int:
    """Bytes from one block row to the next: all ranks' bytes and room for a seal, so padded that a chunk of
    ``block_size_factor`` rows is a multiple of :data:`ROW_ALIGNMENT`.

    A chunk wastes less than one page plus ``SEAL_BYTES`` per block row when
    ``block_size_factor`` divides the page (any power of two up to 4096), and up
    to a page per block row otherwise.
    """
    step = ROW_ALIGNMENT // math.gcd(block_size_factor, ROW_ALIGNMENT)
    return -(-(world_size * rank_row_bytes + SEAL_BYTES) // step) * step
