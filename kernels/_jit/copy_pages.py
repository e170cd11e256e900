"""@triton.jit bodies of the gather (pages -> slab rows) and scatter (slab rows -> pages) kernels.

One launch moves a whole job (its pages of one size: the launcher groups
pages by size, so a launch always has ``UNIFORM`` pages). The page tensors are reached through a small
int64 table, one row of ``TABLE_COLUMNS`` per page tensor::

    [base address (bytes), block stride (bytes), row offset (elements), page size (elements)]

while the slab is a real pointer argument (typed with the word element, so
that Triton can vectorise the slab side; pinned host memory is translated to
its device address by Triton's launcher). Work is split into units: one
``CHUNK`` of one page tensor for ``PAIRS`` consecutive index pairs, a
``PAIRS x CHUNK`` tile; a persistent grid of programs walks the units with a
stride of the program count. A page larger than the per-iteration budget is
cut into chunks (``PAIRS`` = 1: scalar block and row ids, the same code as a
one-row tile); a smaller page is one chunk and the tile stacks several pairs,
their block and row ids loaded as vectors, so that each iteration of a
program still keeps about ``bytes_per_iter`` of loads in flight (host reads
are latency-bound).

Element type = ``slab_ptr``'s element (int8/16/32/64). ``WORD`` is the
alignment in bytes that the host checked for every base, stride, row offset
and the slab (16 lets the compiler emit 16-byte accesses of two int64s);
every hint below relies on that check. All index arithmetic is int64: block,
row and page indices are widened before they are multiplied.

Raw addresses work under ``TRITON_INTERPRET=1`` as well: the interpreter
dereferences the same int64 addresses on CPU tensors, so the tests run this
exact code.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .variants import KernelVariants

if TYPE_CHECKING:
    from .._launch_arguments import CopyArguments

TABLE_COLUMNS = 4

# Triton turns an int argument equal to 1 into a compile-time constant (a plain
# int in the kernel body), so a one-pair job would compile a second variant
# and the body could not call tensor methods on it: ``num_pairs`` is never
# specialised, and the body widens it with ``tl.cast`` (which takes both forms).
_DO_NOT_SPECIALIZE = ("num_pairs",)


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def copy_pages_kernel(
    table_ptr,
    slab_ptr,
    blocks_ptr,
    rows_ptr,
    num_pairs,
    row_stride,
    TO_SLAB: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    PAGE_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    PAIRS: tl.constexpr,
    UNIFORM: tl.constexpr,
    EVEN: tl.constexpr,
    WORD: tl.constexpr,
):
    """Gather (``TO_SLAB``) or scatter every (block, row) pair for every page tensor.

    gather : slab[rows[i]][off_t : off_t + page_t] = bytes(page_t[blocks[i]])
    scatter: bytes(page_t[blocks[i]]) = slab[rows[i]][off_t : off_t + page_t]

    ``PAGE_ELEMS`` is the page size in slab elements (the largest one when the
    pages differ, ``UNIFORM`` False; the per-page size then comes from the
    table); ``EVEN`` says that every chunk is full, so no column mask is
    needed. A unit is a ``PAIRS x CHUNK`` tile: one chunk of one page for
    ``PAIRS`` consecutive index pairs (``PAIRS`` > 1 only when a whole page
    fits in one chunk, so that a small page still moves about
    ``bytes_per_iter`` per iteration); the last group of pairs is masked.
    """
    CHUNKS: tl.constexpr = (PAGE_ELEMS + CHUNK - 1) // CHUNK
    total = tl.cast(num_pairs, tl.int64)
    groups = (total + (PAIRS - 1)) // PAIRS
    units = groups * (NUM_PAGES * CHUNKS)
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    for unit in range(first, units, step):
        chunk = unit % CHUNKS  # pyright: ignore[reportOperatorIssue] -- unit is a Triton tensor, not the int pyright infers from range()
        rest = unit // CHUNKS
        page = rest % NUM_PAGES
        group = rest // NUM_PAGES
        entry = table_ptr + page * 4
        base = tl.load(entry)
        block_stride = tl.load(entry + 1)
        row_offset = tl.load(entry + 2)
        columns = chunk * CHUNK + tl.arange(0, CHUNK)
        if PAIRS == 1:
            # One pair per unit: scalar block and row.
            # Widen before multiplying: i32 products wrap past 2 GiB.
            block = tl.load(blocks_ptr + group).to(tl.int64)
            row = tl.load(rows_ptr + group).to(tl.int64)
            # The host checked that every base, stride and offset is a multiple of WORD.
            page_start = tl.multiple_of((base + block * block_stride).to(slab_ptr.dtype), WORD)
            slab_start = tl.multiple_of(slab_ptr + (row * row_stride + row_offset), WORD)
            offsets = columns
            if EVEN:
                mask = None
            elif UNIFORM:
                mask = columns < PAGE_ELEMS
            else:
                mask = columns < tl.load(entry + 3)
        else:
            # PAIRS pairs per unit: the block and row ids are loaded as vectors
            # (one per tile row), so the whole tile's accesses are in flight at once.
            pair = group * PAIRS + tl.arange(0, PAIRS)
            live = pair < total
            block = tl.load(blocks_ptr + pair, mask=live, other=0).to(tl.int64)
            row = tl.load(rows_ptr + pair, mask=live, other=0).to(tl.int64)
            page_start = tl.multiple_of((base + block * block_stride).to(slab_ptr.dtype), WORD)[:, None]
            slab_start = tl.multiple_of(slab_ptr + (row * row_stride + row_offset), WORD)[:, None]
            offsets = columns[None, :]
            if EVEN:
                mask = live[:, None]
            elif UNIFORM:
                mask = live[:, None] & (offsets < PAGE_ELEMS)
            else:
                mask = live[:, None] & (offsets < tl.load(entry + 3))
        if TO_SLAB:
            tl.store(slab_start + offsets, tl.load(page_start + offsets, mask=mask), mask=mask)
        else:
            tl.store(page_start + offsets, tl.load(slab_start + offsets, mask=mask), mask=mask)


VARIANTS = KernelVariants(copy_pages_kernel, _DO_NOT_SPECIALIZE)


# CopyArguments holds the kernel's parameters in kernel order: these runtime ones, then these
# constexprs, then num_warps. Naming them once here keeps the launch and its specialisation key in step.
_RUNTIME_PARAMETERS = ("table_ptr", "slab_ptr", "blocks_ptr", "rows_ptr", "num_pairs", "row_stride")
_CONSTEXPR_PARAMETERS = ("TO_SLAB", "NUM_PAGES", "PAGE_ELEMS", "CHUNK", "PAIRS", "UNIFORM", "EVEN", "WORD")


def _runtime_values(arguments: "CopyArguments") -> tuple[object, ...]:
    return tuple(arguments[: len(_RUNTIME_PARAMETERS)])


def _constexprs(arguments: "CopyArguments") -> tuple[object, ...]:
    return tuple(arguments[len(_RUNTIME_PARAMETERS) : len(_RUNTIME_PARAMETERS) + len(_CONSTEXPR_PARAMETERS)])


def _specialize(value, specialize: bool) -> tuple[object, ...]:
    """How Triton's launcher specialises one runtime argument: its type and (for pointers and ints) divisibility.

    Triton >= 3.4 exposes the C++ routine its binder calls; older releases
    get a mirror of the same rule (pointer: element type, 16-byte aligned or
    not; int: type, == 1, divisible by 16).
    """
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        if isinstance(value, torch.Tensor):
            return (f"*{value.dtype}", "D" if value.data_ptr() % 16 == 0 else "")
        if not specialize:
            return ("int", None)
        return ("int", "constexpr 1" if value == 1 else ("D" if value % 16 == 0 else ""))
    return tuple(native_specialize_impl(BaseBackend, value, False, specialize, True))


def specialization_key(arguments: "CopyArguments") -> tuple[object, ...]:
    """The key under which Triton's launcher caches the compiled variant this launch needs."""
    runtime = tuple(
        (name, _specialize(value, name not in _DO_NOT_SPECIALIZE))
        for name, value in zip(_RUNTIME_PARAMETERS, _runtime_values(arguments))
    )
    return runtime + _constexprs(arguments) + (("num_warps", arguments.num_warps),)


def launch_copy_pages(arguments: "CopyArguments", *, interpret: bool, grid: int) -> None:
    """One launch of :func:`copy_pages_kernel` on ``grid`` programs (arguments already checked)."""
    kernel = VARIANTS.kernel(interpret)
    kernel[(grid,)](
        *_runtime_values(arguments),
        **dict(zip(_CONSTEXPR_PARAMETERS, _constexprs(arguments))),
        num_warps=arguments.num_warps,
    )
