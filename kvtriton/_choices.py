"""Parsing the user-facing name of a choice (a layout, a backend) into its Enum member.

Strings live only at the edges (CLI flags, vLLM config dicts, keyword
arguments such as ``TransferEngine(backend=...)``); each is parsed once, here,
by one rule at every entry point: names are case-insensitive and surrounding
blanks are ignored (``"TORCH"``, ``" fp8-E4M3 "``), and anything else is an
error that names the argument and lists the valid names.
"""

from __future__ import annotations

import enum
from typing import TypeVar

ChoiceT = TypeVar("ChoiceT", bound=enum.Enum)


def parse_choice(choices: type[ChoiceT], value: str | ChoiceT, argument: str) -> ChoiceT:
    """Return the member of ``choices`` whose value is ``value`` in any case (members pass through).

    Every member's value is a lower-case string. Raises ``ValueError`` naming
    ``argument``, the valid values and the bad one (a value that is not a
    string included: it came from an untyped config).
    """
    if isinstance(value, choices):
        return value
    if isinstance(value, str):
        wanted = value.strip().lower()
        for member in choices:
            if member.value == wanted:
                return member
    valid = ", ".join(repr(member.value) for member in choices)
    raise ValueError(f"{argument} must be one of {valid}, got {value!r}")
