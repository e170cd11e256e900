"""Shared engines and models of the end-to-end tests (one engine start is 10-40 s here: each is shared by its assertions)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.real_model import MODEL_NAME, ModelUnavailable, PreparedModel, prepared_model
from bench.tiny_models import TinyLlama
from e2e.engine import TESTS, EngineJob, EngineResult, engine_env, generate, run_engine
from e2e.prompts import MAX_TOKENS, PROMPT_A
from e2e.real_text import RealTextRuns, run_real_text_engines

_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def report_figure() -> Callable[[str], None]:
    """Add a line to the "end-to-end figures" section printed at the end of the run (a measured, not asserted, figure)."""
    return _FIGURES.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("end-to-end figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def vllm_cpu_kernels() -> None:
    """Fail (never skip) every e2e test when vLLM's CPU kernels are missing or do not pair with vLLM's Python."""
    check = subprocess.run(
        [sys.executable, "-m", "e2e.vllm_cpu"], cwd=TESTS, env=engine_env(), capture_output=True, text=True, timeout=120
    )
    if check.returncode != 0:
        pytest.fail(f"{check.stdout}{check.stderr}".strip()[-3000:], pytrace=False)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def llama(e2e_dir: Path) -> Path:
    """The dense tiny Llama (2 layers, 4 heads of 32, 2 KV heads)."""
    return TinyLlama().write(e2e_dir / "llama")


@pytest.fixture(scope="session")
def reference(llama: Path, e2e_dir: Path) -> EngineResult:
    """Prompt A's tokens from an engine without a connector (step "A")."""
    steps = [generate(PROMPT_A, MAX_TOKENS, "A")]
    return run_engine(EngineJob(model=str(llama), steps=steps), e2e_dir / "reference")


@pytest.fixture(scope="session")
def smollm2() -> PreparedModel:
    """SmolLM2-135M-Instruct, prepared once per machine (:mod:`bench.real_model`); skips, saying why, when unavailable."""
    try:
        return prepared_model()
    except ModelUnavailable as error:
        pytest.skip(f"{MODEL_NAME} is unavailable: {error}")


@pytest.fixture(scope="session")
def real_text(smollm2: PreparedModel, e2e_dir: Path) -> RealTextRuns:
    """The real model's engines, all at once (one start-up's wait for all); each test file asserts on its own."""
    return run_real_text_engines(smollm2, e2e_dir)
