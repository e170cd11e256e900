"""@triton.jit body of the fused fp8 e4m3 gather (quantize while copying) and scatter (dequantize while writing).

The arithmetic is ``kernels/_compression.py``'s, line for line, on int32 bit
patterns: the interpreter has no fp8 casts and truncates fp32 -> bf16, and
a GPU may flush subnormals; integer encoding and the subnormal rules of the
format make every path compute the same bits. Divisions are
``tl.math.div_rn`` (IEEE), because Triton's ``/`` on fp32 is approximate on
a GPU.

One launch per page kind (dtype, elements, group size) moves a whole job.
Page tensors are reached through the same int64 table as the copy kernel::

    [base address (bytes), block stride (bytes), row offset (bytes), page size (bytes; unused here)]

A work unit is ``TILE_GROUPS`` groups of one page tensor for ``PAIRS``
consecutive index pairs: a ``PAIRS x TILE_GROUPS x GROUP_COLUMNS`` tile of
elements (``GROUP_COLUMNS`` = ``GROUP`` rounded up to a power of two, the
excess masked; ``PAIRS`` > 1 only when a whole page fits in one tile, so that
a small page still moves about ``bytes_per_iter`` per iteration, as in the
copy kernel). ``PAGE_WORD`` and
``SLAB_WORD`` are the byte alignments the host checked (page bases and block
strides; slab base and row stride; every region of a compressed row is
16-byte aligned), so with a power-of-two group the page side moves 16-byte
words.
"""

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from .variants import KernelVariants

if TYPE_CHECKING:
    from .._launch_arguments import CompressArguments

_DO_NOT_SPECIALIZE = ("num_pairs",)

TINY_GROUP = tl.constexpr(2.0**-100)  # kernels/_compression.py's TINY_GROUP
E4M3_MAX = tl.constexpr(448.0)


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def compress_pages_kernel(
    table_ptr,
    slab_ptr,
    blocks_ptr,
    rows_ptr,
    status_ptr,
    num_pairs,
    row_stride,
    TO_SLAB: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    ELEMENTS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_COLUMNS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    PAIRS: tl.constexpr,
    KIND: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    PAGE_WORD: tl.constexpr,
    SLAB_WORD: tl.constexpr,
):
    """Gather (``TO_SLAB``: quantize) or scatter (dequantize) every (block, row) pair for every page tensor.

    ``KIND``: 0 bf16, 1 fp16, 2 fp32 pages. Gather writes 1 to ``status_ptr``
    when a value is NaN or infinite (stored as the NaN code; the caller counts or refuses it).
    """
    CHUNKS: tl.constexpr = (NUM_GROUPS + TILE_GROUPS - 1) // TILE_GROUPS
    total = tl.cast(num_pairs, tl.int64)
    units = ((total + (PAIRS - 1)) // PAIRS) * (NUM_PAGES * CHUNKS)
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    # Non-finite groups seen so far: reduced and reported once, after the loop, not once per tile.
    flagged = tl.zeros((PAIRS, TILE_GROUPS), tl.int32)
    for unit in range(first, units, step):
        chunk = unit % CHUNKS  # pyright: ignore[reportOperatorIssue] -- unit is a Triton tensor
        rest = unit // CHUNKS
        page = rest % NUM_PAGES
        pair_group = rest // NUM_PAGES
        entry = table_ptr + page * 4
        base = tl.load(entry)
        block_stride = tl.load(entry + 1)
        row_offset = tl.load(entry + 2)
        # The tile is (PAIRS, TILE_GROUPS, GROUP_COLUMNS): dim 0 the index pairs (block and row ids
        # loaded as vectors), dim 1 the groups, dim 2 the elements of a group.
        pair = pair_group * PAIRS + tl.arange(0, PAIRS)
        live_pair = pair < total
        # Widen before multiplying: i32 products wrap past 2 GiB.
        block = tl.load(blocks_ptr + pair, mask=live_pair, other=0).to(tl.int64)
        row = tl.load(rows_ptr + pair, mask=live_pair, other=0).to(tl.int64)
        group = chunk * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
        column = tl.arange(0, GROUP_COLUMNS)
        element = (group[:, None] * GROUP + column[None, :])[None, :, :]
        live_group = live_pair[:, None] & (group < NUM_GROUPS)[None, :]
        live = live_group[:, :, None] & (column[None, None, :] < GROUP) & (element < ELEMENTS)
        page_address = base + block * block_stride
        if KIND == 2:
            page_start = tl.multiple_of(page_address.to(tl.pointer_type(tl.int32)), PAGE_WORD)[:, None, None]
        else:
            page_start = tl.multiple_of(page_address.to(tl.pointer_type(tl.int16)), PAGE_WORD)[:, None, None]
        codes_row = tl.multiple_of(slab_ptr + (row * row_stride + row_offset), SLAB_WORD)
        codes_start = codes_row[:, None, None]
        scales_start = tl.multiple_of((codes_row + SCALES_OFFSET).to(tl.pointer_type(tl.float32)), SLAB_WORD)[:, None]
        if TO_SLAB:
            raw = tl.load(page_start + element, mask=live, other=0)
            if KIND == 0:
                bits = (raw.to(tl.int32) & 0xFFFF) << 16
            elif KIND == 1:
                bits = raw.to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
            else:
                bits = raw
            exponent_field = (bits >> 23) & 0xFF
            finite = exponent_field != 0xFF
            magnitude = tl.where(finite & (exponent_field >= 1), bits & 0x7FFFFFFF, 0)
            absmax = tl.max(magnitude, axis=2).to(tl.float32, bitcast=True)
            tiny = absmax < TINY_GROUP
            scale = tl.where(tiny, 0.0, tl.math.div_rn(absmax, tl.full(absmax.shape, E4M3_MAX, tl.float32)))
            # One IEEE reciprocal per group, then a multiply per element: a division per element would
            # cost more than the copy.
            inverse = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(tiny, 1.0, scale))
            scaled = tl.minimum(magnitude.to(tl.float32, bitcast=True) * inverse[:, :, None], E4M3_MAX)
            # e4m3 encoding, round to nearest even (compression.encode_e4m3; inlined: helper @jit
            # functions would not compile for the codegen checks while TRITON_INTERPRET is set).
            v = scaled.to(tl.int32, bitcast=True)
            normal = ((v + 0x7FFFF + ((v >> 20) & 1)) >> 20) - (120 << 3)
            # Below 2^-6 the code is |v| * 2^9 rounded to an integer: adding 2^23 does it, to nearest even.
            subnormal = (scaled * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
            codes = tl.where(v >= 0x3C800000, normal, subnormal)
            codes = tl.where(tiny[:, :, None], 0, codes)
            codes = tl.where(finite, codes, 0x7F) | ((bits >> 24) & 0x80)
            tl.store(codes_start + element, codes.to(tl.uint8), mask=live)
            tl.store(scales_start + group[None, :], scale, mask=live_group)
            flagged = flagged | tl.max(tl.where(live & (exponent_field == 0xFF), 1, 0), axis=2)
        else:
            codes = tl.load(codes_start + element, mask=live, other=0).to(tl.int32)
            scale = tl.load(scales_start + group[None, :], mask=live_group, other=0.0)
            # e4m3 decoding (compression.decode_e4m3), inlined as above.
            sign = (codes & 0x80) << 24
            c_exponent = (codes >> 3) & 15
            mantissa = codes & 7
            normal = ((c_exponent + 120) << 23) | (mantissa << 20)
            subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
            value_bits = tl.where(c_exponent == 0, subnormal, normal)
            value_bits = tl.where((codes & 0x7F) == 0x7F, 0x7FC00000, value_bits)
            x = (value_bits | sign).to(tl.float32, bitcast=True) * scale[:, :, None]
            nan = (codes & 0x7F) == 0x7F
            if KIND == 0:
                xbits = x.to(tl.int32, bitcast=True)
                rounded = (xbits + 0x7FFF + ((xbits >> 16) & 1)) >> 16
                out = tl.where(nan, 0x7FC0, rounded).to(tl.int16)
            elif KIND == 1:
                out = tl.where(nan, 0x7E00, x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)).to(tl.int16)
            else:
                out = tl.where(nan, 0x7FC00000, x.to(tl.int32, bitcast=True))
            tl.store(page_start + element, out, mask=live)
    if TO_SLAB:
        tl.store(status_ptr, 1, mask=tl.max(tl.max(flagged, axis=1), axis=0) > 0)  # pyright: ignore[reportOperatorIssue] -- tl.max is typed as maybe returning a tuple; here it is a scalar tensor


VARIANTS = KernelVariants(compress_pages_kernel, _DO_NOT_SPECIALIZE)


def launch_compress_pages(arguments: "CompressArguments", *, interpret: bool, grid: int) -> None:
    """One launch of :func:`compress_pages_kernel` on ``grid`` programs (``arguments``: a ``CompressArguments``)."""
    kernel = VARIANTS.kernel(interpret)
    kernel[(grid,)](
        arguments.table,
        arguments.slab,
        arguments.blocks,
        arguments.rows,
        arguments.status,
        arguments.num_pairs,
        arguments.row_stride,
        **arguments.constexprs,
        num_warps=arguments.num_warps,
    )
