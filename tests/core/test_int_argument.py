"""The one int check: types first (a bool or a float is never a count), then the bounds, each naming the argument."""

from __future__ import annotations

import pytest

from kvtriton._int_argument import check_int


@pytest.mark.parametrize("value", [True, 2.0, "3", None])
def test_anything_but_an_int_is_a_type_error_naming_the_argument_and_the_value(value: object) -> None:
    with pytest.raises(TypeError, match=f"num_slots must be an int, got {type(value).__name__}: {value!r}"):
        check_int("num_slots", value, minimum=1)


@pytest.mark.parametrize(
    ("minimum", "maximum", "value", "message"),
    [
        (1, None, 0, "must be >= 1, got 0"),
        (None, 7, 8, "must be <= 7, got 8"),
        (0, 7, -1, "must be in 0..7, got -1"),
        (0, 7, 8, "must be in 0..7, got 8"),
    ],
)
def test_a_value_out_of_bounds_is_a_value_error_saying_the_bound(
    minimum: int | None, maximum: int | None, value: int, message: str
) -> None:
    with pytest.raises(ValueError, match=f"rank {message}"):
        check_int("rank", value, minimum, maximum)


@pytest.mark.parametrize(("minimum", "maximum", "value"), [(None, None, -5), (1, None, 1), (0, 7, 0), (0, 7, 7)])
def test_a_value_within_bounds_comes_back(minimum: int | None, maximum: int | None, value: int) -> None:
    assert check_int("rank", value, minimum, maximum) == value
