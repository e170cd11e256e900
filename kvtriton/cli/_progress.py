"""A dependency-free progress bar for long runs (demo, simulate, benchmarks).

Writes to stderr so that tables and JSON on stdout stay machine-readable; on a
non-terminal stream it prints a line every ~10% instead of redrawing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

_BAR_WIDTH = 30


def progress(
    items: Iterable[T],
    total: int,
    label: str,
    *,
    stream: TextIO | None = None,
    enabled: bool = True,
) -> Iterator[T]:
    """Yield ``items`` while drawing ``label [#####     ] done/total`` on ``stream``."""
    bar = ProgressBar(total, label, stream=stream, enabled=enabled)
    for item in items:
        yield item
        bar.advance()
    bar.finish()


class ProgressBar:
    """The bar :func:`progress` draws, advanced by hand: for work counted in units other than items of a loop."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.out = sys.stderr if stream is None else stream
        self.total = total
        self.label = label
        self.enabled = enabled
        self.interactive = self.out.isatty()
        self.started = time.perf_counter()
        self.done = 0
        self.last_decile = -1

    def advance(self, count: int = 1) -> None:
        """``count`` more units are done."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.done += count
        if self.enabled:
            self._draw(final=False)

    def finish(self) -> None:
        if self.enabled and (self.interactive or self.last_decile != 10):
            self._draw(final=True)

    def _draw(self, final: bool) -> None:
        fraction = 1.0 if self.total == 0 else min(self.done / self.total, 1.0)
        if not self.interactive:
            decile = int(fraction * 10)
            if decile == self.last_decile and not final:
                return
            self.last_decile = decile
        filled = int(fraction * _BAR_WIDTH)
        elapsed = time.perf_counter() - self.started
        line = f"{self.label} [{'#' * filled}{' ' * (_BAR_WIDTH - filled)}] {self.done}/{self.total} {elapsed:.1f}s"
        self.out.write(("\r" + line) if self.interactive else (line + "\n"))
        if final and self.interactive:
            self.out.write("\n")
        self.out.flush()
