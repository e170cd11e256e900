"""Byte counts: one rule for every size kvtriton prints or logs, and one for every size a user types.

Printing: the largest of TiB, GiB, MiB and KiB that keeps the number at least
1, with two decimals, or whole bytes below 1 KiB. Parsing (:data:`SIZE_RULE`):
a bare number is GiB, binary and decimal units as written. Both live in the
core so that the serving side (the vLLM summary line) and the command line
(``kvtriton simulate``, ``kvtriton info``) share them without one importing
the other.
"""

from __future__ import annotations

import argparse
import math
import re

_PRINTED_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: float) -> str:
    """``size`` bytes in the largest binary unit that keeps it >= 1, e.g. ``288.00 KiB``; ``512 B`` below 1 KiB."""
    for unit, scale in _PRINTED_UNITS:
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


BARE_NUMBER_UNIT = "GiB"
"""The unit of a size given as a bare number, in every command: vLLM's ``--kv-offloading-size`` is in GiB too."""

SIZE_RULE = (
    f"a bare number is {BARE_NUMBER_UNIT}; units B, KiB or K, MiB or M, GiB or G, TiB or T are powers of 1024,"
    " KB, MB, GB, TB powers of 1000"
)
"""The one unit rule of the command line, quoted in the --help of every size flag."""

_UNITS: dict[str, int] = {
    "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip  # a table: one line per scale, binary and decimal units side by side
_CAPACITY = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
"""A number (a sign is read, so that ``-1`` is refused as not positive rather than as not a number) and a unit."""


def parse_capacity(text: str) -> int:
    """Parse a host memory size such as ``4``, ``1.5GiB``, ``512MiB`` or ``8G`` into bytes.

    One rule for every command (:data:`SIZE_RULE`): a bare number is
    :data:`BARE_NUMBER_UNIT`. Binary units (KiB, MiB, GiB, TiB and the single
    letters K, M, G, T) are powers of 1024; KB, MB, GB, TB are powers of
    1000, as written on memory data sheets.
    """
    match = _CAPACITY.match(text)
    if match is None:
        raise ValueError(f"capacity must be a number with an optional unit (e.g. 4GiB, 512MiB), got {text!r}")
    number, unit = float(match.group(1)), (match.group(2) or BARE_NUMBER_UNIT).lower()
    if unit not in _UNITS:
        raise ValueError(f"capacity unit must be one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, got {text!r}")
    if not math.isfinite(number):
        raise ValueError(f"capacity must be finite, got {text!r}")
    if number <= 0:
        raise ValueError(f"capacity must be positive, got {text!r}")
    size = int(number * _UNITS[unit])
    if size < 1:
        raise ValueError(f"capacity less than one byte, got {text!r}")
    return size


def parse_capacity_list(text: str) -> list[int]:
    """Parse a comma-separated list of sizes (``4,8,16GiB``) into bytes, in the order given.

    Every item must be a size (an empty item, as in ``1,,2``, is refused, not
    skipped) and no two may be the same number of bytes (``16,16GiB`` is
    refused, naming both), so that nothing the user wrote is silently dropped.
    """
    items = text.split(",")
    sizes: list[int] = []
    written: dict[int, str] = {}
    for position, item in enumerate(items, start=1):
        if not item.strip():
            raise ValueError(f"size {position} of {text!r} is empty (sizes are separated by single commas)")
        size = parse_capacity(item)
        if size in written:
            raise ValueError(
                f"{written[size].strip()!r} and {item.strip()!r} in {text!r} are the same size; give it once"
            )
        written[size] = item
        sizes.append(size)
    return sizes


def size_argument(text: str) -> int:
    """An argparse ``type`` for one size flag: :func:`parse_capacity`, its message shown as the error."""
    try:
        return parse_capacity(text)
    except ValueError as error:
        # A plain ValueError would print as "invalid size_argument value", naming nothing the user typed.
        raise argparse.ArgumentTypeError(str(error)) from None


def size_list_argument(text: str) -> list[int]:
    """An argparse ``type`` for a comma-separated list of sizes: :func:`parse_capacity_list`."""
    try:
        return parse_capacity_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def is_bare_number(text: str) -> bool:
    """Whether ``text`` is a size without a unit (so it was read as :data:`BARE_NUMBER_UNIT`)."""
    match = _CAPACITY.match(text)
    return match is not None and not match.group(2)
