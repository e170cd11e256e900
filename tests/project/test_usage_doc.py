"""The Python example in docs/usage.md runs, so the doc cannot drift from the API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.filterwarnings("ignore::kvtriton.worker._slab.PageableSlabWarning")
def test_usage_example_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_blocks(USAGE.read_text(encoding="utf-8"))
    assert len(blocks) == 1, "docs/usage.md should hold exactly one python example"
    exec(compile(blocks[0], str(USAGE), "exec"), {"__name__": "usage_example"})  # noqa: S102 -- the repository's own docs
    out = capsys.readouterr().out
    assert "8 page tensors" in out
    assert "job 0 ('GPU', 'CPU')" in out
    assert out.rstrip().endswith("round trip OK")
