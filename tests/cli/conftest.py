"""Helpers the command-line tests share: a small quick `kvtriton simulate` run and its JSON record, and a refused
command line's message.

Test modules import them as ``from tests.cli.conftest import ...`` (by that
full name: ``from conftest import`` would find whichever folder's conftest
pytest loaded last).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtriton.cli._main import main

QUICK = ["--no-progress", "--no-plot"]
"""No progress bar on stderr, no plot to draw."""
SMALL = ["--workload", "system-prompts", "--requests", "80", "--block-size", "32", *QUICK]
"""A workload of 80 requests in 32-token blocks: seconds per sweep."""


def simulate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    """``kvtriton simulate FLAGS --json`` into ``tmp_path``: its record, as printed on stdout."""
    assert main(["simulate", *flags, "--json", "--out", str(tmp_path)]) == 0
    return json.loads(capsys.readouterr().out)


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``kvtriton ARGV`` writes on stderr as it refuses the command line (argparse's exit status 2)."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err
