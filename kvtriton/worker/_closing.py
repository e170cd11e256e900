"""The ``with`` support every closable worker object shares (the slab, the engine, the shared region)."""

from __future__ import annotations

from typing_extensions import Self


class ClosesOnExit:
    """A context manager that returns itself and calls :meth:`close` when the block ends, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
