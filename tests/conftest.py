"""Test-wide setup.

TRITON_INTERPRET must be set before triton is first imported: kernel tests run
the real Triton kernels on CPU tensors through the interpreter. Where the
installed Triton's interpreter cannot run the kernels (Triton < 3.7 with
NumPy >= 2.4, as on some GPU machines), CPU cases take the torch path instead
and the tests that exist to exercise the interpreter are skipped, saying why;
CUDA cases are unaffected.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

from kvtriton.kernels._jit.interpreter_probe import interpreter_problem

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

INTERPRETER_PROBLEM = interpreter_problem() if os.environ["TRITON_INTERPRET"] not in ("", "0") else None
if INTERPRETER_PROBLEM is not None:
    os.environ["TRITON_INTERPRET"] = "0"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires_interpreter: the test exercises the Triton interpreter on CPU tensors")


def pytest_report_header(config: pytest.Config) -> str:
    del config
    if INTERPRETER_PROBLEM is None:
        return f"triton interpreter: {'on' if os.environ['TRITON_INTERPRET'] not in ('', '0') else 'off'}"
    return f"triton interpreter: unusable here ({INTERPRETER_PROBLEM}); CPU kernel cases take the torch path"


_SLOW_FOLDERS = ("vllm_compat", "e2e")
"""Test folders whose files start engines or pytest runs of their own (one to three minutes a file)."""


def _slow_first(item: pytest.Item) -> int:
    folder = item.path.parent.name
    return _SLOW_FOLDERS.index(folder) if folder in _SLOW_FOLDERS else len(_SLOW_FOLDERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    # The slow files first (a stable sort keeps each file's tests together and in order): under pytest -n
    # the fast files then fill the gaps, instead of a long file starting last and running alone.
    items.sort(key=_slow_first)
    if INTERPRETER_PROBLEM is None:
        return
    skip = pytest.mark.skip(reason=f"Triton interpreter unusable here: {INTERPRETER_PROBLEM}")
    for item in items:
        if "requires_interpreter" in item.keywords:
            item.add_marker(skip)


_FIGURES: list[str] = []
"""Measured, not asserted, figures of this process's tests, printed in the "end-to-end figures" section."""


@pytest.fixture(scope="session")
def report_figure() -> Callable[[str], None]:
    """Add a line to the "end-to-end figures" section printed at the end of the run (a measured, not asserted, figure)."""
    return _FIGURES.append


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under pytest -n each test process hands its figures to the one that prints the summary.
    worker_output: dict[str, object] | None = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["figures"] = list(_FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    del error
    worker_output: dict[str, object] = getattr(node, "workeroutput", {})
    figures = worker_output.get("figures", [])
    if isinstance(figures, list):
        _FIGURES.extend(str(line) for line in cast(list[object], figures))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("end-to-end figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
