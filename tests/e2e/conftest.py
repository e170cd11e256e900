"""Shared engines and models of the end-to-end tests (one engine start is 10-40 s here: each is shared by its assertions)."""

from __future__ import annotations

import fcntl
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import pytest

from bench.real_model import MODEL_NAME, ModelUnavailable, PreparedModel, prepared_model
from bench.tiny_models import TinyLlama
from e2e.engine import TESTS, EngineJob, EngineResult, engine_env, generate, run_engine
from e2e.prompts import MAX_TOKENS, PROMPT_A
from e2e.real_text import RealTextRuns, run_real_text_engines

_Result = TypeVar("_Result")


def _once_per_run(factory: pytest.TempPathFactory, name: str, run: Callable[[Path], _Result]) -> _Result:
    """``run(folder)`` once per test run, also when ``pytest -n`` splits the files between processes.

    The first process to need it runs it under a file lock in the folder every process's temporary
    directory sits in; the others wait for the lock and read its pickled result, so an engine that
    several files share starts once, not once per process.
    """
    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = shared / f"{name}.pickle"
        if saved.exists():
            return cast(_Result, pickle.loads(saved.read_bytes()))  # written by this run's own process
        result = run(shared / name)
        saved.write_bytes(pickle.dumps(result))
        return result


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
def reference(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineResult:
    """Prompt A's tokens from an engine without a connector (step "A"), once per run."""
    steps = [generate(PROMPT_A, MAX_TOKENS, "A")]
    return _once_per_run(
        tmp_path_factory, "reference", lambda folder: run_engine(EngineJob(model=str(llama), steps=steps), folder)
    )


@pytest.fixture(scope="session")
def smollm2() -> PreparedModel:
    """SmolLM2-135M-Instruct, prepared once per machine (:mod:`bench.real_model`); skips, saying why, when unavailable."""
    try:
        return prepared_model()
    except ModelUnavailable as error:
        pytest.skip(f"{MODEL_NAME} is unavailable: {error}")


@pytest.fixture(scope="session")
def real_text(smollm2: PreparedModel, tmp_path_factory: pytest.TempPathFactory) -> RealTextRuns:
    """The real model's engines, all at once (one start-up's wait for all), once per run; each test file asserts on
    its own."""
    return _once_per_run(tmp_path_factory, "real-text", lambda folder: run_real_text_engines(smollm2, folder))
