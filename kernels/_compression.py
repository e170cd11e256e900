"""Opt-in fp8 e4m3 compression of slab rows: the arithmetic, its torch reference, and the public entry points.

The row format (``CompressedPage``, ``CompressionLayout``) is in ``compressed_format.py``; its names are
re-exported here.

Lossy, off by default (``KVCompression.NONE``). With ``KVCompression.FP8_E4M3``
every bf16 / fp16 / fp32 page tensor is stored in a slab row as

* ``codes``: one e4m3 byte per element, in page order, padded to 16 bytes;
* ``scales``: one fp32 per group of ``G`` contiguous elements (the last group
  shorter where ``G`` does not divide the page), padded to 16 bytes;

and every other page tensor (fp8, int8, uint8, ...: already a byte per element
or opaque) is copied unchanged, its region padded to 16 bytes. Regions follow
each other page tensor by page tensor, so every region starts on a 16-byte
boundary of the row (docs/kernels.md, "Compressed rows").

Arithmetic, the same bits on every path (the torch reference here, the Triton
kernel compiled or interpreted; e4m3 is encoded and decoded with integer
arithmetic because Triton's interpreter has no fp8 casts and truncates
fp32 -> bf16). Per group, in fp32:

1. ``x`` in fp32 (exact). Values below the smallest normal fp32 (2^-126:
   bf16 and fp32 subnormals) count as signed zero, as a GPU's flush-to-zero
   arithmetic would read them.
2. ``absmax`` = the largest ``|x|``; ``scale = absmax / 448`` and
   ``inverse = 1 / scale`` (IEEE divisions, once per group).
   A group whose ``absmax`` is below ``2^-100`` (``TINY_GROUP``) is a zero
   group: scale 0, every element a signed zero. This keeps every later
   product out of the subnormal range, where flush-to-zero hardware and the
   CPU would disagree.
3. ``code = sign | e4m3_rne(min(|x| * inverse, 448))``: round to nearest even,
   e4m3 subnormals (multiples of 2^-9) included.
4. Decoding: ``x' = e4m3_value(code) * scale`` in fp32, then rounded to the
   page dtype (round to nearest even; bf16 by integer arithmetic).

NaN and infinity are never turned into finite garbage: a gather writes the NaN
code ``0x7F`` (with the element's sign) in its place and reports it. The
public gathers then raise :class:`NonFiniteKVError`; the engine stores the
block anyway (vLLM cannot survive a failed store), counts it and warns. A
code ``0x7F`` / ``0xFF`` read back decodes to NaN.

Slab rows hold fp32 scales, so a compressed slab's base address and row
stride must be multiples of 4 bytes (:func:`check_scales_alignment`; an
engine's slab always is).

Accuracy: every element of a non-zero group satisfies
``|x - x'| <= 2^-4 |x| + scale * 2^-9`` (tested in ``tests/kernels/test_compression.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

from kvtriton._choices import parse_choice

from ._compressed_format import (
    COMPRESSIBLE_DTYPES,
    DEFAULT_GROUP_SIZE,
    CompressedPage,
    CompressionLayout,
    check_scales_alignment,
    compression_layout,
)
from ._validation import PageGeometry, check_index_pair, check_slab, describe_pages

__all__ = [
    "COMPRESSIBLE_DTYPES",
    "DEFAULT_GROUP_SIZE",
    "E4M3_MAX",
    "TINY_GROUP",
    "CompressedPage",
    "CompressionLayout",
    "KVCompression",
    "NonFiniteKVError",
    "check_scales_alignment",
    "compression_layout",
    "decode_e4m3",
    "dequantize_groups",
    "encode_e4m3",
    "gather_pages_compressed",
    "gather_pages_compressed_reference",
    "quantize_groups",
    "scatter_pages_compressed",
    "scatter_pages_compressed_reference",
]

E4M3_MAX = 448.0
"""The largest finite e4m3 (``e4m3fn``) value: scale = group absmax / 448."""

TINY_GROUP = 2.0**-100
"""A group whose absmax is below this is stored as signed zeros with scale 0 (see the module docstring)."""

_MIN_NORMAL_EXPONENT_FIELD = 1
_NAN_CODE = 0x7F
_SMALLEST_NORMAL_E4M3_BITS = 0x3C800000  # 2^-6 as fp32 bits
_CANONICAL_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class KVCompression(enum.Enum):
    """How slab rows store the page bytes: ``none`` (bit-exact copy, the default) or ``fp8-e4m3`` (lossy)."""

    NONE = "none"
    FP8_E4M3 = "fp8-e4m3"

    @classmethod
    def parse(cls, value: str | KVCompression, argument: str = "kv_compression") -> KVCompression:
        """The member called ``value``; anything else raises ``ValueError`` naming ``argument`` and the valid values."""
        return parse_choice(cls, value, argument)


class NonFiniteKVError(ValueError):
    """A compressed gather met NaN or infinity in the pages: the rows it wrote hold NaN codes and must not be used."""


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic, on int32 bit patterns (the kernel's jit/compress_pages.py mirrors every line).


def encode_e4m3(magnitude: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (int32, 0..126) of fp32 magnitudes in ``[0, 448]``, rounded to nearest even.

    Normal results (>= 2^-6) round the fp32 bits at bit 20 and rebias the
    exponent. Below 2^-6 the code is ``|v| * 2^9`` rounded to an integer:
    adding 2^23 to a float in ``[0, 8]`` rounds it to an integer, to nearest
    even (exact: the product is a power-of-two scaling). Zero and fp32
    subnormals encode as 0.
    """
    bits = magnitude.view(torch.int32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (magnitude * 512.0 + 8388608.0).view(torch.int32) - 0x4B000000
    return torch.where(bits >= _SMALLEST_NORMAL_E4M3_BITS, normal, subnormal)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 codes (int32, 0..255), sign included; ``0x7F`` / ``0xFF`` decode to NaN."""
    sign = (codes & 0x80) << 24
    exponent = (codes >> 3) & 15
    mantissa = codes & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(torch.float32) * 2.0**-9).view(torch.int32)
    bits = torch.where(exponent == 0, subnormal, normal)
    bits = torch.where((codes & 0x7F) == _NAN_CODE, torch.full_like(bits, 0x7FC00000), bits)
    return (bits | sign).view(torch.float32)


def _grouped(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(n, E)`` as ``(n, groups, group_size)``, the last group padded with zeros."""
    count, elements = values.shape
    groups = -(-elements // group_size)
    return torch.nn.functional.pad(values, (0, groups * group_size - elements)).view(count, groups, group_size)


def quantize_groups(values: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``(n, E)`` bf16/fp16/fp32 values group by group: (codes ``(n, E)`` uint8, scales ``(n, groups)`` fp32, non-finite ``(n,)`` bool)."""
    count, elements = values.shape
    bits = _grouped(values.to(torch.float32).view(torch.int32), group_size)
    exponent_field = (bits >> 23) & 0xFF
    finite = exponent_field != 0xFF
    magnitude_bits = torch.where(finite & (exponent_field >= _MIN_NORMAL_EXPONENT_FIELD), bits & 0x7FFFFFFF, 0)
    absmax = magnitude_bits.amax(dim=2).view(torch.float32)
    tiny = absmax < TINY_GROUP
    # Divide by tensors, as the kernel does: CUDA turns a division by a Python scalar into a multiply by its
    # reciprocal, one ulp off. One reciprocal per group, then a multiply per element (the kernel's arithmetic).
    scales = torch.where(tiny, 0.0, absmax / torch.full_like(absmax, E4M3_MAX))
    inverse = torch.ones_like(scales) / torch.where(tiny, 1.0, scales)
    scaled = torch.clamp(magnitude_bits.view(torch.float32) * inverse[:, :, None], max=E4M3_MAX)
    # torch's fp8 cast rounds to nearest even, as encode_e4m3 does (the tests check them against each other);
    # one op instead of twenty on the host.
    magnitude_codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(tiny[:, :, None] | ~finite, torch.where(finite, 0, _NAN_CODE).to(torch.uint8), magnitude_codes)
    codes = codes | ((bits >> 24) & 0x80).to(torch.uint8)
    flat = codes.view(count, -1)[:, :elements]
    return flat, scales, ~finite.view(count, -1).all(dim=1)


def _round_to_dtype(x: torch.Tensor, nan: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Raw bits (int16 / int32) of fp32 ``x`` rounded to nearest even in ``dtype``; NaN as the canonical NaN."""
    if dtype in (torch.bfloat16, torch.float16):
        # torch's casts round to nearest even: for bf16 the same bits as the kernel's integer rounding
        # ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` of every finite value.
        rounded = x.to(dtype).view(torch.int16)
    else:
        rounded = x.view(torch.int32)
    canonical = torch.tensor(_CANONICAL_NAN_BITS[dtype], dtype=rounded.dtype, device=x.device)
    return torch.where(nan, canonical, rounded)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(n, E)`` values of ``dtype`` decoded from codes ``(n, E)`` uint8 and scales ``(n, groups)`` fp32."""
    count, elements = codes.shape
    grouped = _grouped(codes, group_size)
    # torch's fp8 -> fp32 conversion is exact and reads every code as decode_e4m3 does (tested), NaN included.
    x = grouped.view(torch.float8_e4m3fn).to(torch.float32) * scales[:, :, None]
    nan = (grouped & 0x7F) == _NAN_CODE
    return _round_to_dtype(x, nan, dtype).view(count, -1)[:, :elements].view(dtype)


# ---------------------------------------------------------------------------------------------------------------
# The reference gather / scatter (test oracle and CPU fallback).


def _elements(page: torch.Tensor, elements: int) -> torch.Tensor:
    """``page`` as an ``(N, E)`` view of its elements (blocks are contiguous; the block stride may be larger)."""
    return page.as_strided((page.shape[0], elements), (page.stride(0), 1))


def _raw_bytes(page: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``page`` as an ``(N, page_bytes)`` uint8 view (pass-through pages: any dtype, no arithmetic)."""
    element = page.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=page.device)
    return view.set_(
        page.untyped_storage(),
        page.storage_offset() * element,
        (page.shape[0], page_bytes),
        (page.stride(0) * element, 1),
    )


def _last_wins(source: torch.Tensor, destination: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs that survive a sequential loop: one per destination, the last that names it."""
    source, destination = source.to(torch.int64).cpu(), destination.to(torch.int64).cpu()
    order = torch.argsort(destination, stable=True)
    ordered = destination[order]
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[:-1] = ordered[1:] != ordered[:-1]
    return source[order[keep]], destination[order[keep]]


def _region(slab: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return slab[:, start : start + length]


def gather_compressed_unchecked(
    pages: Sequence[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    layout: CompressionLayout,
) -> bool:
    """Compress blocks ``blocks[i]`` into slab rows ``rows[i]`` (validated arguments); True when every value was finite."""
    if blocks.numel() == 0:
        return True
    blocks, rows = _last_wins(blocks, rows)
    finite = True
    for page, entry in zip(pages, layout.pages):
        target_rows = rows.to(slab.device)
        if not entry.compressed:
            raw = _raw_bytes(page, entry.page_bytes).index_select(0, blocks.to(page.device))
            _region(slab, entry.row_offset, entry.page_bytes).index_copy_(0, target_rows, raw.to(slab.device))
            continue
        picked = _elements(page, entry.elements).index_select(0, blocks.to(page.device))
        codes, scales, bad = quantize_groups(picked, entry.group_size)
        finite = finite and not bool(bad.any())
        _region(slab, entry.row_offset, entry.elements).index_copy_(0, target_rows, codes.to(slab.device))
        scale_bytes = scales.contiguous().view(torch.uint8)
        _region(slab, entry.row_offset + entry.scales_offset, scale_bytes.shape[1]).index_copy_(
            0, target_rows, scale_bytes.to(slab.device)
        )
    return finite


def scatter_compressed_unchecked(
    slab: torch.Tensor,
    pages: Sequence[torch.Tensor],
    rows: torch.Tensor,
    blocks: torch.Tensor,
    layout: CompressionLayout,
) -> None:
    """Decompress slab rows ``rows[i]`` into blocks ``blocks[i]`` (validated arguments)."""
    if rows.numel() == 0:
        return
    rows, blocks = _last_wins(rows, blocks)
    for page, entry in zip(pages, layout.pages):
        picked_rows = rows.to(slab.device)
        target = blocks.to(page.device)
        if not entry.compressed:
            raw = _region(slab, entry.row_offset, entry.page_bytes).index_select(0, picked_rows)
            _raw_bytes(page, entry.page_bytes).index_copy_(0, target, raw.to(page.device))
            continue
        codes = _region(slab, entry.row_offset, entry.elements).index_select(0, picked_rows).to(page.device)
        scale_bytes = _region(slab, entry.row_offset + entry.scales_offset, 4 * entry.num_groups).index_select(
            0, picked_rows
        )
        scales = scale_bytes.to(page.device).contiguous().view(torch.float32)
        values = dequantize_groups(codes, scales, entry.group_size, entry.dtype)
        _elements(page, entry.elements).index_copy_(0, target, values.to(page.device))


# ---------------------------------------------------------------------------------------------------------------
# Public entry points (validate, then the torch path or one Triton launch per page kind).


def _check_compressed_call(
    pages: Sequence[torch.Tensor],
    pages_name: str,
    slab: torch.Tensor,
    slab_name: str,
    source: torch.Tensor,
    source_name: str,
    destination: torch.Tensor,
    destination_name: str,
    *,
    to_slab: bool,
    group_size: int | Sequence[int],
    check_values: bool,
    allow_duplicate_destinations: bool,
) -> tuple[PageGeometry, CompressionLayout]:
    geometry = describe_pages(pages, pages_name)
    layout = compression_layout(pages, group_size, name=pages_name)
    # The slab must hold compressed rows: check it against a geometry whose pages are the regions.
    check_slab(
        slab, slab_name, dataclasses.replace(geometry, page_bytes=tuple(page.region_bytes for page in layout.pages))
    )
    check_scales_alignment(slab, slab_name)
    check_index_pair(
        source, source_name, destination, destination_name, geometry=geometry, slab=slab, to_slab=to_slab,
        check_values=check_values, allow_duplicate_destinations=allow_duplicate_destinations,
    )  # fmt: skip
    return geometry, layout


def _non_finite(name: str) -> NonFiniteKVError:
    return NonFiniteKVError(
        f"{name} holds NaN or infinity: fp8-e4m3 compression refuses non-finite KV values (the destination rows "
        "hold NaN codes and must not be used); store this cache with kv_compression='none'"
    )


def gather_pages_compressed_reference(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
) -> None:
    """The torch reference of :func:`gather_pages_compressed` (a destination named twice: the last pair wins)."""
    _, layout = _check_compressed_call(
        src, "src", dst, "dst", src_blocks, "src_blocks", dst_rows, "dst_rows", to_slab=True,
        group_size=group_size, check_values=True, allow_duplicate_destinations=True,
    )  # fmt: skip
    if not gather_compressed_unchecked(src, dst, src_blocks, dst_rows, layout):
        raise _non_finite("src")


def scatter_pages_compressed_reference(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
) -> None:
    """The torch reference of :func:`scatter_pages_compressed` (a destination named twice: the last pair wins)."""
    _, layout = _check_compressed_call(
        dst, "dst", src, "src", src_rows, "src_rows", dst_blocks, "dst_blocks", to_slab=False,
        group_size=group_size, check_values=True, allow_duplicate_destinations=True,
    )  # fmt: skip
    scatter_compressed_unchecked(src, dst, src_rows, dst_blocks, layout)


def gather_pages_compressed(
    src: Sequence[torch.Tensor],
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
    num_programs: int | None = None,
    bytes_per_iter: int | None = None,
    check_indices: bool = True,
) -> None:
    """Quantize block ``src_blocks[i]`` of every page tensor into compressed slab row ``dst_rows[i]``.

    The compressed counterpart of :func:`kvtriton.kernels.gather_pages`
    (same dispatch, one launch per page kind); ``dst`` rows must hold
    ``compression_layout(src, group_size).row_bytes``. Raises
    :class:`NonFiniteKVError` when a value is NaN or infinite (after the
    launch: on CUDA this reads a flag back, a device sync).
    """
    knobs = _checked_knobs(num_programs, bytes_per_iter)
    geometry, layout = _check_compressed_call(
        src, "src", dst, "dst", src_blocks, "src_blocks", dst_rows, "dst_rows", to_slab=True,
        group_size=group_size, check_values=check_indices, allow_duplicate_destinations=False,
    )  # fmt: skip
    if not _run_compressed(True, list(src), dst, src_blocks, dst_rows, geometry, layout, knobs):
        raise _non_finite("src")


def scatter_pages_compressed(
    src: torch.Tensor,
    dst: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    group_size: int | Sequence[int] = DEFAULT_GROUP_SIZE,
    num_programs: int | None = None,
    bytes_per_iter: int | None = None,
    check_indices: bool = True,
) -> None:
    """Dequantize compressed slab row ``src_rows[i]`` into block ``dst_blocks[i]`` of every page tensor in ``dst``."""
    knobs = _checked_knobs(num_programs, bytes_per_iter)
    geometry, layout = _check_compressed_call(
        dst, "dst", src, "src", src_rows, "src_rows", dst_blocks, "dst_blocks", to_slab=False,
        group_size=group_size, check_values=check_indices, allow_duplicate_destinations=False,
    )  # fmt: skip
    _run_compressed(False, list(dst), src, dst_blocks, src_rows, geometry, layout, knobs)


def _checked_knobs(num_programs: int | None, bytes_per_iter: int | None) -> tuple[int, int]:
    """The launch knobs with their defaults filled in, refused (naming the knob) when out of range."""
    from ._pages import DEFAULT_BYTES_PER_ITER, DEFAULT_NUM_PROGRAMS, check_knobs

    programs = DEFAULT_NUM_PROGRAMS if num_programs is None else num_programs
    per_iter = DEFAULT_BYTES_PER_ITER if bytes_per_iter is None else bytes_per_iter
    check_knobs(programs, per_iter)
    return programs, per_iter


def _run_compressed(
    to_slab: bool,
    pages: list[torch.Tensor],
    slab: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    geometry: PageGeometry,
    layout: CompressionLayout,
    knobs: tuple[int, int],
) -> bool:
    """One compressed copy on the path the device takes (``kernels._pages._run``'s dispatch); whether all was finite.

    ``knobs`` are ``(num_programs, bytes_per_iter)``. A scatter decodes codes, which are finite by
    construction: it always answers True.
    """
    from ._pages import KernelPath, interpreter_ready, select_path

    if blocks.numel() == 0:
        return True
    path = select_path(geometry.device)
    if path is KernelPath.TORCH:
        if to_slab:
            return gather_compressed_unchecked(pages, slab, blocks, rows, layout)
        scatter_compressed_unchecked(slab, pages, rows, blocks, layout)
        return True
    from ._compressed_launch import CompressedLauncher

    if path is KernelPath.INTERPRETER:
        interpreter_ready()
    launcher = CompressedLauncher(
        pages,
        slab,
        geometry,
        layout,
        interpret=path is KernelPath.INTERPRETER,
        num_programs=knobs[0],
        bytes_per_iter=knobs[1],
    )
    if not to_slab:
        launcher.launch(False, blocks, rows, None)
        return True
    status = torch.zeros(1, dtype=torch.int32, device=geometry.device)
    launcher.launch(True, blocks, rows, status)
    return int(status.item()) == 0
