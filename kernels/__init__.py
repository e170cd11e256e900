"""Triton gather/scatter kernels between paged KV blocks and packed slab rows.

Shipped as ``kvtriton.kernels`` (``kvtriton/kernels`` is a symlink to this
folder). Files holding ``@triton.jit`` bodies live in ``jit/``; everything
exported from here is fully annotated.
"""

__all__: list[str] = []
