"""The one check for an int argument that may arrive untyped (a config value, a keyword from user code).

``bool`` is an ``int`` to Python but never a count or an index to kvtriton,
and a float such as ``2.0`` is refused rather than truncated. A value of the
wrong type raises ``TypeError``, one out of range ``ValueError``; both name the
argument and the bad value.
"""

from __future__ import annotations


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None, *, unit: str = ""
) -> int:
    """Return ``value`` if it is an int within ``minimum..maximum`` (either bound optional), else raise naming ``name``.

    ``unit`` ("bytes", "seconds") follows the bound in the message, so that ``must be >= 1 bytes`` says what the
    number counts.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    suffix = f" {unit}" if unit else ""
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in {minimum}..{maximum}{suffix}, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{suffix}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}{suffix}, got {value}")
    return value
