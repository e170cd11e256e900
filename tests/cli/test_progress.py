from __future__ import annotations

import io

import pytest

from kvtriton.cli._progress import ProgressBar, progress


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


def test_a_bar_advanced_by_hand_prints_a_line_per_tenth_and_ends_at_the_total() -> None:
    stream = io.StringIO()
    bar = ProgressBar(200, "replay", stream=stream)
    for _ in range(40):
        bar.advance(5)
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # 0/10 .. 10/10 of the way, each tenth once (the stream is no terminal)
    assert lines[-1].startswith("replay [" + "#" * 30 + "] 200/200 ")
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        bar.advance(-1)
