"""Byte counts in the binary unit that fits them: one rule for every size kvtriton prints or logs.

The largest of TiB, GiB, MiB and KiB that keeps the number at least 1, with
two decimals, or whole bytes below 1 KiB. It lives in the core so that the
serving side (the vLLM summary line) and the command line (``kvtriton
simulate``, ``kvtriton info``) share it without one importing the other.
"""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: float) -> str:
    """``size`` bytes in the largest binary unit that keeps it >= 1, e.g. ``288.00 KiB``; ``512 B`` below 1 KiB."""
    for unit, scale in _UNITS:
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"
