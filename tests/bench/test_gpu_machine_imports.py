"""bench/gpu_machine_imports.py: the GPU machine's package set, emulated on the machine that rehearses the check.

Each case runs in a fresh interpreter with bench/gpu_machine on PYTHONPATH, as
``bench/gpu_check.sh --dry-run`` runs every step: what the GPU machine lacks
(vLLM, xxhash, pytest plugins) is as absent as it is there, and what it has
imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_machine_imports import GPU_MACHINE_PACKAGES, allowed_top_level_names, dependency_closure

ROOT = Path(__file__).resolve().parents[2]


def run_emulated(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'bench' / 'gpu_machine'}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def test_what_the_gpu_machine_lacks_cannot_be_found_or_imported_and_what_it_has_imports() -> None:
    code = (
        "import importlib.metadata, importlib.util\n"
        "from bench.gpu_machine_imports import installed\n"
        "assert installed()\n"
        "assert importlib.util.find_spec('vllm') is None and importlib.util.find_spec('xxhash') is None\n"
        "try:\n"
        "    import vllm\n"
        "except ModuleNotFoundError as error:\n"
        "    print('import:', error)\n"
        "try:\n"
        "    importlib.metadata.version('vllm')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    print('metadata: none')\n"
        "import torch, triton, numpy, pytest, hypothesis, pluggy\n"
        "print('pluggy', importlib.metadata.version('pluggy') == pluggy.__version__)\n"
        "import kvtriton.worker, bench.common, bench.kernels, sysconfig\n"
        "print('paths', bool(sysconfig.get_config_vars()))\n"
    )
    run = run_emulated(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["import: No module named 'vllm'", "metadata: none", "pluggy True", "paths True"]


def test_the_allowed_set_is_the_standard_library_and_the_closure_of_the_gpu_machines_packages() -> None:
    closure = dependency_closure(GPU_MACHINE_PACKAGES)
    assert {"torch", "triton", "numpy", "pytest", "hypothesis", "pluggy", "iniconfig"} <= closure
    assert not {"vllm", "xxhash", "pytest-xdist", "matplotlib"} & closure  # this machine has them, that one does not
    allowed = allowed_top_level_names()
    assert {"json", "ctypes", "torch", "_pytest", "_hypothesis_pytestplugin"} <= allowed
    assert not {"vllm", "xxhash", "xdist", "matplotlib"} & allowed
