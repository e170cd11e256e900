"""kvtriton from its wheel, installed non-editable into a new environment beside vLLM, does what the docs say.

Nothing under the checkout can stand in for a file the wheel lacks: the
environment sees vLLM's packages but not the editable kvtriton, and its
engine process runs with only tests/ importable (:mod:`packaging_fixtures`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from packaging_fixtures import InstalledWheel, build_wheel, install_beside_test_venv, package_folders

from e2e.engine import HITS, LOADED, RESET_PREFIX_CACHE, EngineJob, EngineResult, generate, run_engine, spec_config
from e2e.prompts import MAX_TOKENS, PROMPT_A

DOCUMENTED_MODULES = {
    "kvtriton.integrations.vllm": ("KVTritonOffloadingSpec", "KVTritonTieringOffloadingSpec"),
    "kvtriton.integrations.mooncake": ("MooncakeStoreTier",),
}
"""The ``spec_module_path`` and Mooncake tier ``module_path`` the docs give, with the names vLLM looks up in each."""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    workdir = tmp_path_factory.mktemp("installed-wheel")
    return install_beside_test_venv(build_wheel(workdir), workdir / "env")


def run_installed(installed: InstalledWheel, *command: str) -> str:
    """``command`` run in a folder outside the checkout; its output, or an AssertionError with it."""
    # No PYTHONPATH: one naming a checkout (as a worktree's test run sets it) would stand in for the wheel.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run(
        command, cwd=installed.prefix, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def every_package() -> list[str]:
    """Every package of the checkout's kvtriton, as a dotted name."""
    return [".".join(folder.parts) for folder in package_folders()]


def test_every_package_and_documented_name_imports_from_the_wheel(installed: InstalledWheel) -> None:
    checks = "\n".join(
        [
            "import importlib, pathlib",
            f"site = pathlib.Path({str(installed.site_packages)!r}).resolve()",
            f"for name in {every_package()!r}:",
            "    origin = pathlib.Path(importlib.import_module(name).__file__).resolve()",
            "    assert site in origin.parents, (name, origin)",
            f"for name, attributes in {DOCUMENTED_MODULES!r}.items():",
            "    module = importlib.import_module(name)",
            "    for attribute in attributes:",
            "        getattr(module, attribute)",
            "print('ok')",
        ]
    )
    assert run_installed(installed, str(installed.python), "-c", checks).strip() == "ok"


def test_the_command_runs_from_the_wheel(installed: InstalledWheel) -> None:
    import kvtriton

    assert run_installed(installed, str(installed.kvtriton), "--version").strip().endswith(kvtriton.__version__)
    from kvtriton.integrations import installed_vllm_version

    info = dict(
        line.split(maxsplit=1) for line in run_installed(installed, str(installed.kvtriton), "info").splitlines()
    )
    assert info["kvtriton"] == kvtriton.__version__
    assert info["vllm"].startswith(f"{installed_vllm_version()} (tested)")


@pytest.fixture(scope="module")
def served(installed: InstalledWheel, llama: Path, e2e_dir: Path) -> EngineResult:
    steps = [generate(PROMPT_A, MAX_TOKENS, "cold"), RESET_PREFIX_CACHE, generate(PROMPT_A, MAX_TOKENS, "warm")]
    job = EngineJob(
        model=str(llama),
        steps=steps,
        kv_transfer_config=spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=8 << 20),
    )
    return run_engine(job, e2e_dir / "installed-wheel", interpreter=installed.python)


def test_an_engine_serves_through_the_installed_wheel(
    served: EngineResult, installed: InstalledWheel, reference: EngineResult
) -> None:
    assert Path(served.kvtriton_origin).resolve() == (installed.site_packages / "kvtriton").resolve()
    assert served.step("cold").token_ids == reference.step("A").token_ids
    assert served.step("warm").token_ids == reference.step("A").token_ids
    assert served.delta("warm", HITS) > 0
    assert served.delta("warm", LOADED) > 0
