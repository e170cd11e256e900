"""The fixtures the vLLM adapter's tests share, found by pytest by name (no test module imports them).

tests/integrations/ is split by the package each test covers (vllm/, remote/, mooncake/), with no __init__.py
anywhere and no conftest.py in tests/integrations/ itself: either would put that folder on sys.path, where the
folders vllm/ and mooncake/ would import as namespace packages wherever the real packages are not installed. So
test module names stay unique across the suite.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is not None:
    # These import vLLM; without it the folder's vLLM modules skip themselves (pytest.importorskip) and the
    # shared-region tests, which never import it, still run (bench/gpu_check.sh runs test_tiering_cuda.py on a GPU
    # machine that has no vLLM).
    from tiering_fixtures.configs import managers as managers
    from vllm.config import ModelConfig
    from vllm_fixtures.in_process import tiny_model_config

    @pytest.fixture(scope="module")
    def model_config() -> ModelConfig:
        """vLLM's ModelConfig of the config-only tiny Llama, built once a module (~10 s: vLLM inspects the model
        class)."""
        return tiny_model_config()
