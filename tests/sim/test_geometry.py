from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvtriton.sim._geometry import (
    BARE_NUMBER_UNIT,
    PRESETS,
    SIZE_RULE,
    KVDtype,
    ModelGeometry,
    format_bytes,
    is_bare_number,
    parse_capacity,
    parse_capacity_list,
    parse_dtype,
    size_argument,
    size_list_argument,
)
from kvtriton.worker import RegionLayout


def test_llama_3_8b_block_of_16_bf16_tokens_is_two_mib() -> None:
    geometry = PRESETS["llama-3-8b"]
    # 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token
    assert geometry.bytes_per_token == 128 * 2**10
    assert geometry.bytes_per_block == 2 * 2**20


def test_mla_geometry_caches_one_latent_per_token_and_layer() -> None:
    geometry = PRESETS["deepseek-v3"]
    assert geometry.kv_factor == 1
    assert geometry.bytes_per_token == 61 * 576 * 2


def test_block_size_and_dtype_scale_the_block_bytes() -> None:
    base = ModelGeometry("m", num_layers=2, num_kv_heads=4, head_dim=8, dtype=KVDtype.FLOAT16, block_size=16)
    fp8 = ModelGeometry("m", num_layers=2, num_kv_heads=4, head_dim=8, dtype=KVDtype.FP8, block_size=32)
    assert base.bytes_per_block == 2 * 2 * 4 * 8 * 2 * 16
    assert fp8.bytes_per_block == base.bytes_per_block  # half the bytes per element, twice the tokens


def test_blocks_for_counts_only_whole_blocks() -> None:
    geometry = PRESETS["llama-3-8b"]
    assert geometry.blocks_for(2**30) == 512
    assert geometry.blocks_for(2 * 2**20 - 1) == 0
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -1"):
        geometry.blocks_for(-1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_non_positive_geometry_field_is_rejected_by_name(field: str) -> None:
    values: dict[str, int] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "block_size": 1, field: 0}
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        ModelGeometry(
            "bad",
            values["num_layers"],
            values["num_kv_heads"],
            values["head_dim"],
            KVDtype.BFLOAT16,
            values["block_size"],
        )


def test_kv_factor_other_than_one_or_two_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_factor must be 1 .* got 3"):
        ModelGeometry("bad", 1, 1, 1, KVDtype.BFLOAT16, kv_factor=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4", 4 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 2**29),
        ("512 mib", 2**29),
        ("8G", 8 * 2**30),
        ("2GB", 2 * 10**9),
        ("1TiB", 2**40),
        ("4096B", 4096),
    ],
)
def test_capacity_parses_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_capacity(text) == expected


def test_a_bare_number_is_gib_the_one_unit_rule_of_every_command() -> None:
    assert BARE_NUMBER_UNIT == "GiB"
    assert parse_capacity("3") == parse_capacity("3GiB") == 3 * 2**30
    assert parse_capacity("0.5") == 2**29
    assert SIZE_RULE.startswith("a bare number is GiB")


@pytest.mark.parametrize(
    ("text", "bare"), [("96", True), (" 1.5 ", True), ("96MiB", False), ("8G", False), ("x", False)]
)
def test_is_bare_number_tells_a_size_without_a_unit(text: str, bare: bool) -> None:
    assert is_bare_number(text) is bare


@pytest.mark.parametrize("text", ["", "GiB", "1x", "-1", "0", "1.2.3GiB", "nan"])
def test_bad_capacity_is_rejected_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="capacity") as raised:
        parse_capacity(text)
    assert repr(text) in str(raised.value)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1e400", "must be finite"),
        ("1e400GiB", "must be finite"),
        ("1e-20", "less than one byte"),
        ("0.5B", "less than one byte"),
    ],
)
def test_capacity_that_is_not_a_whole_positive_byte_count_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"capacity {why}, got '{text}'"):
        parse_capacity(text)


def test_dtype_names_follow_vllm_spellings() -> None:
    assert parse_dtype("bf16") is KVDtype.BFLOAT16
    assert parse_dtype("BFloat16") is KVDtype.BFLOAT16
    assert parse_dtype("fp8_e4m3") is KVDtype.FP8
    assert parse_dtype("half") is KVDtype.FLOAT16
    assert KVDtype.BFLOAT16 is not KVDtype.FLOAT16


def test_unknown_dtype_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="dtype must be one of .*bf16.*got 'int4'"):
        parse_dtype("int4")


def test_format_bytes_picks_the_largest_binary_unit() -> None:
    assert format_bytes(2 * 2**20) == "2.00 MiB"
    assert format_bytes(1536 * 2**30) == "1.50 TiB"
    assert format_bytes(512) == "512 B"


def test_a_negative_size_is_refused_as_not_positive_not_as_not_a_number() -> None:
    with pytest.raises(ValueError, match="capacity must be positive, got '-1'"):
        parse_capacity("-1")


def test_a_size_list_keeps_the_order_given() -> None:
    assert parse_capacity_list("16,4GiB, 512MiB") == [16 * 2**30, 4 * 2**30, 2**29]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1,,2", "size 2 of '1,,2' is empty"),
        ("1,2,", "size 3 of '1,2,' is empty"),
        ("", "size 1 of '' is empty"),
        ("16,16GiB", "'16' and '16GiB' in '16,16GiB' are the same size; give it once"),
        ("4,-1", "capacity must be positive, got '-1'"),
    ],
)
def test_a_size_list_refuses_what_it_would_otherwise_drop(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_capacity_list(text)


def test_the_argparse_types_show_the_parsers_message_as_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--size", type=size_argument)
    parser.add_argument("--sizes", type=size_list_argument)
    assert parser.parse_args(["--size", "2", "--sizes", "1,2"]).sizes == [2**30, 2**31]
    for argv in (["--size", "0"], ["--sizes", "1,,2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    err = capsys.readouterr().err
    assert "argument --size: capacity must be positive, got '0'" in err
    assert "argument --sizes: size 2 of '1,,2' is empty" in err
    assert "invalid" not in err


@pytest.mark.parametrize("stored", [1, 4032, 4033, 32768, 2 << 20])
def test_the_tiered_chunk_is_the_regions_sealed_chunk(stored: int) -> None:
    geometry = dataclasses.replace(PRESETS["llama-3-8b"], compression="fp8-e4m3", compressed_bytes_per_block=stored)
    assert geometry.tiered_chunk_bytes == RegionLayout.block_row_stride_for(1, 1, stored)
