"""Opt-in fp8 e4m3 compression of slab rows: the choice (``KVCompression``) and the arithmetic.

The row format (``CompressedPage``, ``CompressionLayout``) is in ``_compressed_format.py``, the torch
reference in ``_reference.py``, the public ``gather_pages`` / ``scatter_pages`` (``compression=``) in
``_pages.py``. The format's names are also importable from here, for the callers that read them with
``KVCompression``.

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

import enum

import torch

from kvtriton._choices import parse_choice

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


def non_finite_error(name: str) -> NonFiniteKVError:
    """The error a compressed gather raises when the page tensors ``name`` held NaN or infinity."""
    return NonFiniteKVError(
        f"{name} holds NaN or infinity: fp8-e4m3 compression refuses non-finite KV values (the destination rows "
        "hold NaN codes and must not be used); store this cache with kv_compression='none'"
    )


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
