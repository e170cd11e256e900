"""Triton gather/scatter kernels between paged KV blocks and packed slab rows.

Shipped as ``kvtriton.kernels`` (``kvtriton/kernels`` is a symlink to this
folder). Files holding ``@triton.jit`` bodies live in ``_jit/``; everything
exported from here is fully annotated. Importing this package does not import
triton; the first Triton launch does. The torch references, the tests'
oracles, are not exported: they live in ``kvtriton.kernels._reference``.
"""

from ._compressed_format import COMPRESSIBLE_DTYPES, DEFAULT_GROUP_SIZE, CompressionLayout, compression_layout
from ._compression import KVCompression, NonFiniteKVError
from ._pages import (
    DEFAULT_BYTES_PER_ITER,
    DEFAULT_NUM_PROGRAMS,
    KernelPath,
    gather_pages,
    scatter_pages,
    select_path,
)
from ._validation import PageGeometry, describe_pages

__all__ = [
    "COMPRESSIBLE_DTYPES",
    "DEFAULT_BYTES_PER_ITER",
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_NUM_PROGRAMS",
    "CompressionLayout",
    "KVCompression",
    "KernelPath",
    "NonFiniteKVError",
    "PageGeometry",
    "compression_layout",
    "describe_pages",
    "gather_pages",
    "scatter_pages",
    "select_path",
]
