from __future__ import annotations

import enum

import pytest
import torch

from kvtriton._choices import parse_choice
from kvtriton.kernels._compression import KVCompression
from kvtriton.worker._backends import TransferBackend
from kvtriton.worker._engine import TransferEngine
from kvtriton.worker._layout import KVLayout, PagedKV
from kvtriton.worker._slab import HostSlab


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_a_name_parses_to_its_member_and_a_member_passes_through() -> None:
    assert parse_choice(Colour, "red", "colour") is Colour.RED
    assert parse_choice(Colour, Colour.BLUE, "colour") is Colour.BLUE


@pytest.mark.parametrize("name", ["RED", "Red", " red ", "rEd\n"])
def test_a_name_parses_in_any_case_and_with_blanks_around_it(name: str) -> None:
    assert parse_choice(Colour, name, "colour") is Colour.RED


def test_an_unknown_name_is_rejected_naming_the_argument_and_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"colour must be one of 'red', 'blue', got 'green'"):
        parse_choice(Colour, "green", "colour")


@pytest.mark.parametrize("value", [3, None, True, b"red"])
def test_a_value_that_is_not_a_string_is_rejected_naming_the_argument_and_the_valid_names(value: object) -> None:
    with pytest.raises(ValueError, match=rf"colour must be one of 'red', 'blue', got {value!r}"):
        parse_choice(Colour, value, "colour")  # pyright: ignore[reportArgumentType] -- untyped input is the point


def test_every_entry_point_reads_names_in_any_case() -> None:
    # The parsers TransferEngine, the layouts and the compression use: one rule for all of them.
    assert TransferBackend.parse("TORCH") is TransferBackend.TORCH
    assert KVLayout.parse("Flash_Attn") is KVLayout.FLASH_ATTN
    assert KVCompression.parse("FP8-E4M3") is KVCompression.FP8_E4M3
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'triton', 'dma', 'torch', got 'CUDA'"):
        TransferBackend.parse("CUDA")


def test_transfer_engine_takes_its_backend_name_in_any_case() -> None:
    kv = PagedKV.from_tensors([torch.zeros(4, 64, dtype=torch.int8)], layout="PAGES")
    with HostSlab(2, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, backend="TORCH") as engine:
        assert engine.backend_name == "torch"
