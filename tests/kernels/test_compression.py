"""fp8 e4m3 compression: the row format, the arithmetic's defined edge cases, the accuracy bound, and the fused
Triton gather/scatter bit for bit against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvtriton.kernels import (
    DEFAULT_BYTES_PER_ITER,
    KVCompression,
    NonFiniteKVError,
    compression_layout,
    gather_pages,
    scatter_pages,
)
from kvtriton.kernels._compression import TINY_GROUP, decode_e4m3, dequantize_groups, encode_e4m3, quantize_groups
from kvtriton.kernels._reference import gather_pages_reference, int_list
from kvtriton.worker._layout import PagedKV
from tests.kernels.kernel_cases import (
    BLOCKS,
    COMPRESSIBLE_DTYPES,
    ROWS,
    build_pages,
    build_slab,
    copy_with_both,
    devices,
    indices,
    kv_tensor,
)

GROUP = 8  # the test layouts' head dimension


def roundtrip(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (n, E) quantized and decoded by the reference: (decoded values, per-element scale)."""
    codes, scales, bad = quantize_groups(values, group)
    assert not bool(bad.any())
    decoded = dequantize_groups(codes, scales, group, values.dtype)
    return decoded, scales.repeat_interleave(group, dim=1)[:, : values.shape[1]]


def assert_within_bound(values: torch.Tensor, group: int) -> None:
    decoded, scale = roundtrip(values, group)
    x, y = values.double(), decoded.double()
    bound = 2.0**-4 * x.abs() + scale.double() * 2.0**-9
    excess = (x - y).abs() - bound
    assert bool((excess <= 0).all()), f"worst excess {excess.max().item()} at {int(excess.argmax())}"


# --- the format ----------------------------------------------------------------------------------------------


def test_a_bf16_row_with_groups_of_128_is_about_half_the_bytes_and_every_region_is_16_byte_aligned() -> None:
    pages = [torch.zeros(3, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    layout = compression_layout(pages, 128)
    assert [page.row_offset for page in layout.pages] == [0, 16896, 33792, 50688]
    # 16384 codes + 128 fp32 scales = 16896 bytes for a 32768-byte page.
    assert layout.pages[0].scales_offset == 16384 and layout.row_bytes == 4 * 16896
    assert layout.ratio == pytest.approx(0.5156, abs=1e-4)
    assert all(page.row_offset % 16 == 0 and page.region_bytes % 16 == 0 for page in layout.pages)


def test_a_page_that_groups_do_not_divide_gets_a_shorter_last_group_and_padding() -> None:
    (page,) = compression_layout([torch.zeros(2, 5, 67, dtype=torch.float16)], 128).pages
    assert (page.elements, page.group_size, page.num_groups) == (335, 128, 3)
    assert page.scales_offset == 336 and page.region_bytes == 336 + 16


def test_fp8_and_int8_pages_pass_through_in_a_padded_region() -> None:
    layout = compression_layout([torch.zeros(2, 33, dtype=torch.int8), torch.zeros(2, 64, dtype=torch.bfloat16)], 32)
    passthrough, compressed = layout.pages
    assert not passthrough.compressed and passthrough.region_bytes == 48
    assert compressed.compressed and compressed.row_offset == 48 and compressed.num_groups == 2


def test_paged_kv_groups_by_the_head_dimension_unless_the_layout_does_not_know_it() -> None:
    flash = PagedKV.from_tensors([torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)], kv_compression="fp8-e4m3")
    assert flash.compression_layout is not None
    assert {page.group_size for page in flash.compression_layout.pages} == {64}
    pages = PagedKV.from_tensors(
        [torch.zeros(4, 4096, dtype=torch.bfloat16)], layout="pages", kv_compression="fp8-e4m3"
    )
    assert pages.compression_layout is not None and pages.compression_layout.pages[0].group_size == 128
    assert pages.row_bytes == pages.compression_layout.row_bytes and pages.raw_row_bytes == 8192


def test_compression_is_off_by_default_and_a_bad_value_names_the_argument() -> None:
    kv = PagedKV.from_tensors([torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)])
    assert kv.compression is KVCompression.NONE and kv.compression_layout is None and kv.row_bytes == kv.raw_row_bytes
    with pytest.raises(ValueError, match="kv_compression must be one of 'none', 'fp8-e4m3', got 'fp8'"):
        PagedKV.from_tensors([torch.zeros(2, 4, 16, 2, 64)], kv_compression="fp8")
    with pytest.raises(ValueError, match="group_size for pages\\[0\\] must be >= 1, got 0"):
        kv.with_compression("fp8-e4m3", group_size=0)


# --- the arithmetic --------------------------------------------------------------------------------------------


def test_integer_e4m3_encoding_rounds_exactly_as_torchs_float8_cast() -> None:
    generator = torch.Generator().manual_seed(3)
    grid = decode_e4m3(torch.arange(0, 127, dtype=torch.int32))
    midpoints = (grid[1:].double() + grid[:-1].double()) / 2  # ties: round to even
    values = torch.cat([
        torch.rand(20000, generator=generator) * 448,
        torch.exp2(torch.rand(20000, generator=generator) * -24),
        grid, midpoints.float(), torch.nextafter(midpoints.float(), torch.tensor(0.0)), torch.tensor([0.0, 448.0, 2.0**-10, 2.0**-11, 1e-40, 2.0**-149]),
    ])  # fmt: skip
    assert torch.equal(encode_e4m3(values).to(torch.uint8), values.to(torch.float8_e4m3fn).view(torch.uint8))


def test_every_code_decodes_as_torch_reads_it_and_encodes_back_to_itself() -> None:
    codes = torch.arange(256, dtype=torch.int32)
    decoded = decode_e4m3(codes)
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(decoded.isnan(), expected.isnan())
    finite = ~decoded.isnan()
    assert torch.equal(decoded[finite], expected[finite])
    magnitudes = (codes & 0x7F) != 0x7F
    assert torch.equal(encode_e4m3(decoded[magnitudes].abs()), codes[magnitudes] & 0x7F)


@pytest.mark.parametrize("dtype", list(COMPRESSIBLE_DTYPES.values()), ids=list(COMPRESSIBLE_DTYPES))
def test_every_element_is_within_e4m3_rounding_of_its_scaled_value(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    values = kv_tensor((64, 4 * 128 + 37), dtype, generator, "cpu")
    values[3] *= 1000  # a block with large magnitudes
    values[4, :130] = torch.tensor([1e-4, -3e-5] * 65)  # small values: fp16 subnormals, bf16 normals
    assert_within_bound(values, 128)
    assert_within_bound(values, 37)


def test_fp16_subnormal_and_extreme_values_stay_within_the_bound() -> None:
    values = torch.tensor([[6e-8, -1.2e-7, 3e-6, 6.1e-5, 65504.0, -65504.0, 1.0, 0.0]], dtype=torch.float16)
    assert_within_bound(values, 8)
    assert_within_bound(values[:, :4], 4)  # a group made of subnormals only


def test_a_zero_group_stores_scale_0_and_keeps_the_signs_of_its_zeros() -> None:
    values = torch.tensor([[0.0, -0.0, 0.0, -0.0, 1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    codes, scales, _ = quantize_groups(values, 4)
    assert scales[0, 0].item() == 0.0 and int_list(codes[0, :4]) == [0, 0x80, 0, 0x80]
    decoded = dequantize_groups(codes, scales, 4, torch.bfloat16)
    assert torch.equal(decoded[:, :4].view(torch.int16), values[:, :4].view(torch.int16))


def test_a_group_below_the_tiny_threshold_and_fp32_subnormals_decode_to_signed_zero() -> None:
    tiny = TINY_GROUP / 2
    values = torch.tensor([[tiny, -tiny, 1e-40, -1e-40], [1e-40, -1e-40, 1.0, -1.0]], dtype=torch.float32)
    codes, scales, _ = quantize_groups(values, 4)
    assert scales[0, 0].item() == 0.0
    decoded = dequantize_groups(codes, scales, 4, torch.float32)
    assert [str(value.item()) for value in decoded[0]] == ["0.0", "-0.0", "0.0", "-0.0"]
    # Below 2^-126 a value counts as zero whatever its group: a flush-to-zero GPU reads it so.
    assert [str(value.item()) for value in decoded[1]] == ["0.0", "-0.0", "1.0", "-1.0"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_and_infinity_are_refused_by_the_reference(bad: float) -> None:
    case = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    case.pages[1][4, 0, 0, 3] = bad
    layout = compression_layout(case.pages, GROUP)
    slab = build_slab(case, 9, "cpu", row_bytes=layout.row_bytes)
    with pytest.raises(NonFiniteKVError, match="NaN or infinity"):
        gather_pages_reference(
            case.pages, slab, indices(BLOCKS, torch.int64, "cpu"), indices(ROWS, torch.int64, "cpu"), compression=layout
        )
    # The offending element is written as the NaN code (with its sign), so a row used by mistake reads as NaN.
    code = int(slab[2, layout.pages[1].row_offset + 3])
    assert code & 0x7F == 0x7F


@pytest.mark.requires_interpreter
@pytest.mark.parametrize("bytes_per_iter", [DEFAULT_BYTES_PER_ITER, 16], ids=["one-tile", "first-of-many-tiles"])
def test_nan_is_refused_by_the_triton_gather_too(bytes_per_iter: int) -> None:
    # The kernel reports non-finite values once per program, after its loop: with 16-byte tiles on one
    # program, the NaN's tile (block 4 comes first) is followed by dozens of clean ones.
    case = build_pages("mla", torch.float16, "cpu", kv_values=True)
    case.pages[0][4, 0, 0] = float("nan")
    layout = compression_layout(case.pages, GROUP)
    slab = build_slab(case, 9, "cpu", row_bytes=layout.row_bytes)
    with pytest.raises(NonFiniteKVError):
        gather_pages(
            case.pages, slab, indices(BLOCKS, torch.int64, "cpu"), indices(ROWS, torch.int64, "cpu"), compression=layout,
            bytes_per_iter=bytes_per_iter, num_programs=1,
        )  # fmt: skip
    assert int(slab[2, layout.pages[0].row_offset]) & 0x7F == 0x7F


@pytest.mark.parametrize("misalignment", ["base", "row_stride"])
def test_a_compressed_slab_off_a_4_byte_boundary_is_refused_naming_it(misalignment: str) -> None:
    # fp32 scales at a misaligned address would fault on a GPU and kill its CUDA context.
    case = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    owner = build_slab(
        case, 9, "cpu", row_bytes=layout.row_bytes, extra_bytes=5 if misalignment == "row_stride" else 17
    )
    slab = owner if misalignment == "row_stride" else owner[:, 1:]
    before = owner.clone()
    blocks, rows = indices(BLOCKS, torch.int64, "cpu"), indices(ROWS, torch.int64, "cpu")
    with pytest.raises(
        ValueError, match="dst must start on a 4-byte boundary and have a row stride that is a multiple of 4"
    ):
        gather_pages(case.pages, slab, blocks, rows, compression=layout)
    with pytest.raises(ValueError, match="dst must start on a 4-byte boundary"):
        gather_pages_reference(case.pages, slab, blocks, rows, compression=layout)
    with pytest.raises(ValueError, match="src must start on a 4-byte boundary"):
        scatter_pages(slab, case.pages, rows, blocks, compression=layout)
    assert torch.equal(owner, before)


def test_a_compression_argument_that_is_not_the_layout_of_the_pages_is_refused_naming_it() -> None:
    case = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    slab = build_slab(case, 9, "cpu", row_bytes=layout.row_bytes)
    before = slab.clone()
    blocks, rows = indices(BLOCKS, torch.int64, "cpu"), indices(ROWS, torch.int64, "cpu")
    fewer = compression_layout(case.pages[:1], GROUP)
    with pytest.raises(ValueError, match=f"compression is the layout of 1 page tensors, src has {len(case.pages)}"):
        gather_pages(case.pages, slab, blocks, rows, compression=fewer)
    as_fp16 = compression_layout([page.view(torch.float16) for page in case.pages], GROUP)
    with pytest.raises(ValueError, match=r"compression does not describe dst\[0\]: it has .*float16.*bfloat16"):
        scatter_pages(slab, case.pages, rows, blocks, compression=as_fp16)
    with pytest.raises(TypeError, match="compression must be None or a CompressionLayout .*, got 'fp8-e4m3'"):
        gather_pages_reference(case.pages, slab, blocks, rows, compression="fp8-e4m3")  # pyright: ignore[reportArgumentType] -- what an untyped caller may pass
    assert torch.equal(slab, before)


# --- the fused kernels against the reference ---------------------------------------------------------------


def run_both(layout: str, dtype: torch.dtype, device: str, group: int, blocks: list[int], rows: list[int]) -> None:
    """Gather then scatter with the kernels on ``device`` and with the reference on CPU; every byte must agree."""
    case = build_pages(layout, dtype, device, kv_values=True)
    oracle = build_pages(layout, dtype, "cpu", kv_values=True)
    compression = compression_layout(oracle.pages, group)
    slab = build_slab(case, 9, device, row_bytes=compression.row_bytes)
    expected = build_slab(oracle, 9, "cpu", row_bytes=compression.row_bytes)
    copy_with_both(
        "gather", case, oracle, slab, expected, blocks, rows, torch.int64, torch.int32, compression=compression
    )
    for owner in [*case.owners, *oracle.owners]:
        owner.view(torch.uint8).fill_(0xA5)
    targets = [1, 3, 5][: len(blocks)]  # other blocks than the gathered ones, each once
    copy_with_both("scatter", case, oracle, slab, expected, targets, rows, compression=compression)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8", "int8"])
def test_every_dtype_matches_the_reference_bit_for_bit(dtype: str, device: str) -> None:
    from tests.kernels.kernel_cases import DTYPES

    run_both("flash_attn", {**DTYPES, **COMPRESSIBLE_DTYPES}[dtype], device, GROUP, BLOCKS, ROWS)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    ("layout", "group"),
    [("flashinfer", GROUP), ("mla", 20), ("mla", 32), ("cross_layer", GROUP), ("odd_656", 128), ("mixed_sizes", 128)],
)
def test_every_layout_and_odd_group_matches_the_reference_bit_for_bit(layout: str, group: int, device: str) -> None:
    run_both(layout, torch.bfloat16, device, group, BLOCKS, ROWS)


@pytest.mark.parametrize("device", devices())
def test_one_block_gathered_into_several_rows_matches_the_reference(device: str) -> None:
    run_both("cross_layer", torch.float16, device, GROUP, [3, 3, 3], [0, 4, 8])


@pytest.mark.parametrize("device", devices())
def test_a_small_tile_budget_walks_several_chunks_per_page_and_still_matches(device: str) -> None:
    case = build_pages("flash_attn", torch.bfloat16, device, kv_values=True)
    oracle = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(oracle.pages, 4)
    slab = build_slab(case, 9, device, row_bytes=layout.row_bytes)
    expected = build_slab(oracle, 9, "cpu", row_bytes=layout.row_bytes)
    copy_with_both(
        "gather", case, oracle, slab, expected, BLOCKS, ROWS, compression=layout, bytes_per_iter=16, num_programs=3
    )


def test_empty_indices_write_nothing() -> None:
    case = build_pages("mla", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    slab = build_slab(case, 4, "cpu", row_bytes=layout.row_bytes)
    before, pages_before = slab.clone(), case.memory()
    empty = indices([], torch.int64, "cpu")
    gather_pages(case.pages, slab, empty, empty, compression=layout)
    scatter_pages(slab, case.pages, empty, empty, compression=layout)
    assert torch.equal(slab, before)
    assert all(torch.equal(got, want) for got, want in zip(case.memory(), pages_before))


def test_a_destination_named_twice_is_refused_but_the_reference_keeps_the_last() -> None:
    case = build_pages("mla", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    slab = build_slab(case, 9, "cpu", row_bytes=layout.row_bytes)
    with pytest.raises(ValueError, match="dst_rows names destination 2 more than once"):
        gather_pages(
            case.pages,
            slab,
            indices([1, 4], torch.int64, "cpu"),
            indices([2, 2], torch.int64, "cpu"),
            compression=layout,
        )
    twice, once = slab.clone(), slab.clone()
    gather_pages_reference(
        case.pages, twice, indices([1, 4], torch.int64, "cpu"), indices([2, 2], torch.int64, "cpu"), compression=layout
    )
    gather_pages_reference(
        case.pages, once, indices([4], torch.int64, "cpu"), indices([2], torch.int64, "cpu"), compression=layout
    )
    assert torch.equal(twice, once)


def test_a_slab_sized_for_uncompressed_rows_is_accepted_but_one_too_narrow_is_refused_naming_it() -> None:
    case = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    narrow = torch.zeros(4, layout.row_bytes - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dst row too narrow"):
        gather_pages(
            case.pages, narrow, indices([0], torch.int64, "cpu"), indices([0], torch.int64, "cpu"), compression=layout
        )
    assert not narrow.any()


def test_tiles_of_several_pairs_with_a_partial_last_tile_match_the_reference() -> None:
    # flash_attn bf16 pages of 64 elements in groups of 8: a 128-byte tile per pair, so a 512-byte budget
    # stacks 4 pairs per tile; 6 pairs make one full tile and one half-masked one.
    from kvtriton.kernels._launch import compress_config

    case = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    oracle = build_pages("flash_attn", torch.bfloat16, "cpu", kv_values=True)
    layout = compression_layout(case.pages, GROUP)
    assert compress_config(layout.pages[0], len(case.pages), 512).pairs == 4
    blocks, rows = [5, 4, 3, 2, 1, 0], [0, 2, 4, 6, 8, 1]
    slab = build_slab(case, 9, "cpu", row_bytes=layout.row_bytes)
    expected = build_slab(oracle, 9, "cpu", row_bytes=layout.row_bytes)
    copy_with_both(
        "gather", case, oracle, slab, expected, blocks, rows, compression=layout, bytes_per_iter=512, num_programs=2
    )
    for owner in [*case.owners, *oracle.owners]:
        owner.zero_()
    copy_with_both("scatter", case, oracle, slab, expected, blocks, rows, compression=layout, bytes_per_iter=512)
