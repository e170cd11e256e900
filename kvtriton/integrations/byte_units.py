"""Byte counts in the binary unit that fits them, for the lines the serving side logs.

The serving side (``kvtriton.integrations``) never imports the operator tools,
so the rule lives here: the largest of TiB, GiB, MiB and KiB that keeps the
number at least 1, with two decimals, or whole bytes below 1 KiB. It is the
rule ``kvtriton simulate`` prints sizes by (``kvtriton.tools.geometry``).
"""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: float) -> str:
    """``size`` bytes in the largest binary unit that keeps it >= 1, e.g. ``288.00 KiB``; ``512 B`` below 1 KiB."""
    for unit, scale in _UNITS:
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"
