from __future__ import annotations

import pytest
import torch

from kvtriton.kernels import KVCompression
from kvtriton.worker._layout import KVLayout, PagedKV, byte_view

BLOCKS, BS, HEADS, DIM = 6, 4, 2, 8
PAGE_BF16 = BS * HEADS * DIM * 2  # bytes of one K (or V) page in bf16


def flash_attn(layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, BLOCKS, BS, HEADS, DIM).to(torch.bfloat16) for _ in range(layers)]


def test_flash_attn_splits_each_layer_into_k_and_v_pages() -> None:
    tensors = flash_attn()
    kv = PagedKV.from_tensors(tensors, layout="flash_attn")
    assert kv.layout is KVLayout.FLASH_ATTN
    assert len(kv.pages) == 4
    assert kv.names == ["tensors[0].k", "tensors[0].v", "tensors[1].k", "tensors[1].v"]
    assert kv.num_blocks == BLOCKS
    assert kv.page_bytes == [PAGE_BF16] * 4
    assert kv.page_offsets == [0, PAGE_BF16, 2 * PAGE_BF16, 3 * PAGE_BF16]
    assert kv.row_bytes == 4 * PAGE_BF16
    assert kv.pages[1].data_ptr() == tensors[0][1].data_ptr()


def test_auto_detects_flash_attn_and_flashinfer_from_the_position_of_the_2() -> None:
    assert PagedKV.from_tensors(flash_attn()).layout is KVLayout.FLASH_ATTN
    flashinfer = [torch.zeros(BLOCKS, 2, BS, HEADS, DIM, dtype=torch.float16)]
    kv = PagedKV.from_tensors(flashinfer)
    assert kv.layout is KVLayout.FLASHINFER
    assert kv.row_bytes == 2 * BS * HEADS * DIM * 2
    assert kv.pages[0] is flashinfer[0]


def test_auto_refuses_a_shape_that_reads_as_both_flash_attn_and_flashinfer() -> None:
    with pytest.raises(ValueError, match="tensors\\[0\\].*flash_attn.*flashinfer"):
        PagedKV.from_tensors([torch.zeros(2, 2, BS, HEADS, DIM)])
    kv = PagedKV.from_tensors([torch.zeros(2, 2, BS, HEADS, DIM)], layout="flashinfer")
    assert kv.num_blocks == 2


def test_auto_detects_mla_and_plain_byte_pages() -> None:
    mla = PagedKV.from_tensors({"layer0": torch.zeros(BLOCKS, BS, 576, dtype=torch.bfloat16)})
    assert mla.layout is KVLayout.MLA
    assert mla.names == ["layer0"]
    assert mla.row_bytes == BS * 576 * 2
    vllm_views = [torch.zeros(BLOCKS, 656, dtype=torch.int8) for _ in range(3)]
    pages = PagedKV.from_tensors(vllm_views)
    assert pages.layout is KVLayout.PAGES
    assert pages.page_offsets == [0, 656, 1312]
    assert pages.row_bytes == 3 * 656


def test_cross_layer_keeps_the_whole_tensor_as_one_page_of_all_layers() -> None:
    layers = 3
    tensor = torch.zeros(BLOCKS, layers, 2, BS, HEADS, DIM, dtype=torch.bfloat16)
    kv = PagedKV.from_tensors([tensor], layout="cross_layer")
    assert len(kv.pages) == 1
    assert kv.row_bytes == layers * 2 * PAGE_BF16


def test_strided_layer_views_are_accepted_as_pages() -> None:
    tensor = torch.zeros(BLOCKS, 3, BS, DIM, dtype=torch.float16)
    views = [tensor[:, layer] for layer in range(3)]
    kv = PagedKV.from_tensors(views, layout="pages")
    assert kv.page_bytes == [BS * DIM * 2] * 3
    assert kv.pages[1].stride(0) == 3 * BS * DIM


def test_auto_refuses_shapes_it_cannot_name() -> None:
    with pytest.raises(ValueError, match="cannot tell the layout of tensors\\[0\\] with shape \\(6, 4, 2, 8\\)"):
        PagedKV.from_tensors([torch.zeros(BLOCKS, BS, HEADS, DIM)])


def test_auto_refuses_tensors_that_resolve_to_different_layouts() -> None:
    with pytest.raises(ValueError, match="tensors\\[1\\] looks like mla but tensors\\[0\\] looks like flash_attn"):
        PagedKV.from_tensors([flash_attn(1)[0], torch.zeros(BLOCKS, BS, DIM)])


def test_unknown_layout_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="layout must be one of .*'flashinfer'.*got 'paged'"):
        PagedKV.from_tensors(flash_attn(), layout="paged")


def test_explicit_layout_that_does_not_fit_says_which_tensor() -> None:
    with pytest.raises(ValueError, match="layer1 with shape \\(6, 4, 8\\) is not flash_attn"):
        PagedKV.from_tensors({"layer0": flash_attn(1)[0], "layer1": torch.zeros(BLOCKS, BS, DIM)}, "flash_attn")


def test_disagreeing_block_counts_name_the_tensor() -> None:
    with pytest.raises(ValueError, match="tensors\\[1\\] has 5 blocks but tensors\\[0\\] has 6"):
        PagedKV.from_tensors([torch.zeros(6, 16), torch.zeros(5, 16)])


def test_disagreeing_devices_name_the_tensor() -> None:
    with pytest.raises(ValueError, match="tensors\\[1\\] is on meta but tensors\\[0\\] is on cpu"):
        PagedKV.from_tensors([torch.zeros(6, 16), torch.zeros(6, 16, device="meta")])


def test_pages_without_contiguous_blocks_are_refused() -> None:
    transposed = torch.zeros(BLOCKS, 8, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="has non-contiguous blocks"):
        PagedKV.from_tensors([transposed], layout="pages")


def test_the_same_tensor_twice_is_refused() -> None:
    tensor = torch.zeros(BLOCKS, 16)
    with pytest.raises(ValueError, match="start at the same address"):
        PagedKV.from_tensors([tensor, tensor])


def test_empty_inputs_and_non_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        PagedKV.from_tensors([])
    with pytest.raises(ValueError, match="has no blocks"):
        PagedKV.from_tensors([torch.zeros(0, 16)])
    with pytest.raises(TypeError, match="tensors\\[0\\] must be a torch.Tensor"):
        PagedKV.from_tensors([[1, 2]])  # pyright: ignore[reportArgumentType] -- the wrong type is the point


def test_byte_view_shares_memory_and_covers_each_block_exactly() -> None:
    tensor = torch.arange(BLOCKS * 3 * 5, dtype=torch.int32).reshape(BLOCKS, 3, 5)
    view = byte_view(tensor[:, 1])
    assert view.shape == (BLOCKS, 5 * 4)
    assert torch.equal(view[2], tensor[2, 1].view(torch.uint8).reshape(-1))
    view[4].zero_()
    assert int(tensor[4, 1].abs().sum()) == 0
    assert int(tensor[4, 0].abs().sum()) != 0


def test_with_compression_redescribes_the_same_pages_and_none_keeps_them_as_they_are() -> None:
    tensors = [torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)]
    plain = PagedKV.from_tensors(tensors)
    assert plain.with_compression("none") is plain
    compressed = plain.with_compression(KVCompression.FP8_E4M3, group_size=32)
    assert compressed.pages is plain.pages and compressed.page_bytes == plain.page_bytes
    assert compressed.compression_layout is not None
    assert {page.group_size for page in compressed.compression_layout.pages} == {32}
    assert compressed.with_compression("none").row_bytes == plain.row_bytes


def test_group_sizes_without_compression_are_refused() -> None:
    with pytest.raises(ValueError, match="group_sizes applies only with kv_compression='fp8-e4m3'"):
        PagedKV(pages=[torch.zeros(4, 8)], names=["t"], group_sizes=(8,))
