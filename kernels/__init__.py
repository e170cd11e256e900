"""Triton gather/scatter kernels between paged KV blocks and packed slab rows.

Shipped as ``kvtriton.kernels`` (``kvtriton/kernels`` is a symlink to this
folder). Files holding ``@triton.jit`` bodies live in ``_jit/``; everything
exported from here is fully annotated. Importing this package does not import
triton; the first Triton launch does.

Two groups of names leave the room: the copy calls a user makes
(``gather_pages``, ``scatter_pages``, their torch references, the compression
layout), and the launch layer ``kvtriton.worker`` drives a transfer job
through (``CopyLauncher``, the references' unchecked copies for its torch
backend, the index checks it runs once per job, the interpreter probe).
"""

from ._compressed_format import (
    ALIGNMENT,
    COMPRESSIBLE_DTYPES,
    DEFAULT_GROUP_SIZE,
    CompressionLayout,
    compression_layout,
)
from ._compression import KVCompression, NonFiniteKVError
from ._launch import CopyLauncher
from ._pages import (
    DEFAULT_BYTES_PER_ITER,
    DEFAULT_NUM_PROGRAMS,
    KernelPath,
    gather_pages,
    interpreter_problem,
    scatter_pages,
    select_path,
)
from ._reference import gather_pages_reference, gather_unchecked, scatter_pages_reference, scatter_unchecked
from ._validation import PageGeometry, check_host_indices, check_index_range, check_unique, describe_pages

__all__ = [
    # the copy calls and what describes them
    "ALIGNMENT",
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
    "gather_pages_reference",
    "scatter_pages_reference",
    # the launch layer kvtriton.worker drives
    "CopyLauncher",
    "check_host_indices",
    "check_index_range",
    "check_unique",
    "gather_unchecked",
    "interpreter_problem",
    "scatter_unchecked",
]
