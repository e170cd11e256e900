from __future__ import annotations

import io

import pytest

from kvtriton.cli._progress import progress


def test_progress_yields_every_item_and_reports_the_total() -> None:
    stream = io.StringIO()
    assert list(progress(range(25), 25, "copy", stream=stream)) == list(range(25))
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("copy [") and " 25/25 " in lines[-1]
    assert len(lines) <= 12  # a non-terminal stream gets a line per decile, not per item


def test_progress_can_be_silenced() -> None:
    stream = io.StringIO()
    assert list(progress([1, 2], 2, "quiet", stream=stream, enabled=False)) == [1, 2]
    assert stream.getvalue() == ""


def test_negative_total_is_rejected() -> None:
    with pytest.raises(ValueError, match="total must be >= 0, got -1"):
        list(progress(list[int](), -1, "bad"))
