"""A descriptor-per-copy kernel in the style of vLLM's ``swap_blocks_triton.py``: the comparison baseline.

The host builds one descriptor ``(src address, dst address, bytes)`` per block
per page tensor; each program walks descriptors and copies int64 words through
pointers cast from the loaded addresses. With no alignment information the
compiler emits 8-byte scalar accesses. Used by ``bench/kernels.py`` (``--ptx``
and, on CUDA, timings); never by the package itself.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def descriptor_copy_kernel(
    descriptors_ptr,
    num_descriptors,
    BLOCK: tl.constexpr,
):
    """For each descriptor d: copy d.bytes bytes (a multiple of 8) from d.src to d.dst."""
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    for index in range(first, num_descriptors, step):
        src = tl.load(descriptors_ptr + index * 3).to(tl.pointer_type(tl.int64))
        dst = tl.load(descriptors_ptr + index * 3 + 1).to(tl.pointer_type(tl.int64))
        words = tl.load(descriptors_ptr + index * 3 + 2) // 8
        for start in range(0, words, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < words
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


_COMPILED = []


def launch_descriptor_copy(descriptors: torch.Tensor, *, grid: int, block: int = 1024, num_warps: int = 4) -> None:
    """Copy every ``(src, dst, bytes)`` row of the int64 ``descriptors`` tensor (on the GPU).

    Always the compiled kernel, even if ``TRITON_INTERPRET`` was set when this module was imported.
    """
    if not _COMPILED:
        from triton.runtime.jit import JITFunction

        _COMPILED.append(JITFunction(descriptor_copy_kernel.fn))
    kernel = _COMPILED[0][(grid,)]
    kernel(descriptors, descriptors.shape[0], BLOCK=block, num_warps=num_warps)
