from __future__ import annotations

import enum

import pytest

from kvtriton.choices import parse_choice


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_a_name_parses_to_its_member_and_a_member_passes_through() -> None:
    assert parse_choice(Colour, "red", "colour") is Colour.RED
    assert parse_choice(Colour, Colour.BLUE, "colour") is Colour.BLUE


def test_an_unknown_name_is_rejected_naming_the_argument_and_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"colour must be one of 'red', 'blue', got 'green'"):
        parse_choice(Colour, "green", "colour")
