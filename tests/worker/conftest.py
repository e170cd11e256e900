"""Helpers the worker tests share: a small seeded paged KV cache on CPU and the bytes of one of its blocks.

Test modules import them as ``from tests.worker.conftest import ...`` (by
that full name: ``from conftest import`` would find whichever folder's
conftest pytest loaded last).
"""

from __future__ import annotations

import torch

from kvtriton.worker import PagedKV


def make_kv(blocks: int) -> PagedKV:
    """Two int8 layers of ``blocks`` blocks (K and V, 4 tokens x 2 heads x 8 dims), the same values every call."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 127, (2, blocks, 4, 2, 8), dtype=torch.int8, generator=generator) for _ in range(2)]
    return PagedKV.from_tensors(tensors)


def block_bytes(kv: PagedKV, block: int) -> bytes:
    """Block ``block`` of every layer of ``kv``, as bytes, in layer order."""
    return b"".join(bytes(page[block].numpy().tobytes()) for page in kv.byte_pages())
