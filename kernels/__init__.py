"""Triton gather/scatter kernels between paged KV blocks and packed slab rows.

Shipped as ``kvtriton.kernels`` (``kvtriton/kernels`` is a symlink to this
folder). Files holding ``@triton.jit`` bodies live in ``jit/``; everything
exported from here is fully annotated. Importing this package does not import
triton; the first Triton launch does.
"""

from ._compression import (
    KVCompression,
    NonFiniteKVError,
    compression_layout,
    gather_pages_compressed,
    gather_pages_compressed_reference,
    scatter_pages_compressed,
    scatter_pages_compressed_reference,
)
from ._pages import DEFAULT_BYTES_PER_ITER, DEFAULT_NUM_PROGRAMS, KernelPath, gather_pages, scatter_pages, select_path
from ._reference import gather_pages_reference, scatter_pages_reference
from ._validation import PageGeometry, describe_pages

__all__ = [
    "DEFAULT_BYTES_PER_ITER",
    "DEFAULT_NUM_PROGRAMS",
    "KVCompression",
    "KernelPath",
    "NonFiniteKVError",
    "PageGeometry",
    "compression_layout",
    "describe_pages",
    "gather_pages",
    "gather_pages_compressed",
    "gather_pages_compressed_reference",
    "gather_pages_reference",
    "scatter_pages",
    "scatter_pages_compressed",
    "scatter_pages_compressed_reference",
    "scatter_pages_reference",
    "select_path",
]
