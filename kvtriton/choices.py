"""Parsing the user-facing name of a choice (a layout, a backend) into its Enum member.

Strings live only at the edges (CLI flags, vLLM config dicts); each is parsed
once, here, with an error that names the argument and lists the valid names.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["parse_choice"]

ChoiceT = TypeVar("ChoiceT", bound=enum.Enum)


def parse_choice(choices: type[ChoiceT], value: str | ChoiceT, argument: str) -> ChoiceT:
    """Return the member of ``choices`` whose value is ``value`` (members pass through).

    Raises ``ValueError`` naming ``argument``, the valid values and the bad one.
    """
    if isinstance(value, choices):
        return value
    try:
        return choices(value)
    except ValueError:
        valid = ", ".join(repr(member.value) for member in choices)
        raise ValueError(f"{argument} must be one of {valid}, got {value!r}") from None
