"""The encryption tests' one check that no stored byte string carries its plaintext: no run of :data:`RUN` bytes."""

from __future__ import annotations

RUN = 64
"""No stored value or chunk file may hold a run of this many bytes of the plaintext it was made from (issue 48)."""


def holds_plaintext_run(data: bytes, plain: bytes) -> bool:
    """Whether ``data`` holds any :data:`RUN`-byte run of ``plain``, at any offset of either.

    Any such run contains one of ``plain``'s ``RUN // 2``-byte pieces at a multiple of ``RUN // 2``, so ``data``
    is searched for those at every offset (a stricter test than the runs themselves).
    """
    half = RUN // 2
    pieces = {plain[start : start + half] for start in range(0, len(plain) - half + 1, half)}
    return any(data[offset : offset + half] in pieces for offset in range(len(data) - half + 1))
