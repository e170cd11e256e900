"""Makes vLLM 0.34's CPU platform run on this x86 test machine, in every process of the engine venv, lazily.

``python -m e2e.vllm_cpu --install`` (run by ``make venv``) copies this module
and :mod:`vllm_cpu_ops` into site-packages as the package :data:`PACKAGE` and
writes ``PACKAGE.pth``, whose line runs :func:`install_import_hook` at every
interpreter start. That costs the import of this module alone (about 4 ms: the
standard library's ``sys``, ``types`` and ``typing`` are all it imports, no torch,
no vLLM): it puts a finder at the front of ``sys.meta_path`` that does nothing until ``vllm.platforms.cpu`` is imported, and when that module has run,
:func:`patch_cpu_platform` adjusts its ``CpuPlatform``:

* ``import_kernels`` (which loads the compiled ``vllm/_C*.abi3.so``) then also
  registers the pure-torch stand-ins of :mod:`vllm_cpu_ops` for the ops the
  running vLLM calls and the loaded kernels lack (none on vLLM 0.33);
* from vLLM 0.34 on (:data:`STANDALONE_RUNNER_SINCE`), an x86 CPU without a
  Triton CPU backend takes the standalone CPU model runner, which needs no
  Triton. vLLM 0.34 gives x86 only the Triton runner (``triton-cpu``, which no
  package index serves) and refuses to start an x86 engine without it
  ("vLLM on x86 CPUs requires Triton"); the standalone runner is the one vLLM
  runs on every other CPU, and calls the ops above.

So ``python -c "import vllm; vllm.LLM(...)"`` and ``vllm serve`` in that venv
work with no test fixture imported, as the unpacked kernels do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

PACKAGE = "kvtriton_e2e_vllm_cpu"
"""The site-packages package the installer copies this module and :mod:`vllm_cpu_ops` into."""
PLATFORM_MODULE = "vllm.platforms.cpu"
STANDALONE_RUNNER_SINCE = (0, 34)
"""The first vLLM release whose x86 CPU platform needs the Triton CPU backend unless switched to the standalone runner."""
PATCHED = "_kvtriton_e2e_patched"
"""Set on ``CpuPlatform`` once patched, so that a module reloaded or a hook installed twice patches once."""


def patch_cpu_platform(cpu_platform: Any) -> None:
    """Make ``cpu_platform`` (vLLM's ``CpuPlatform`` class) register the missing ops and, from 0.34, run without Triton.

    Any: vLLM's classes are not importable where this module is type-checked (the test venv's vLLM
    is 0.33, which lacks the 0.34 methods patched here).
    """
    if getattr(cpu_platform, PATCHED, False):
        return
    import warnings

    import vllm.version  # vllm's __init__ imports it first: this is vllm.__version__, in the making

    vllm_version: str = getattr(vllm.version, "__version__")  # re-exported from vllm._version, which pyright flags

    from . import vllm_cpu_ops

    try:
        release = vllm_cpu_ops.release_of(vllm_version)
    except ValueError as error:
        warnings.warn(f"{PACKAGE}: vLLM's CPU platform left as it is: {error}", RuntimeWarning, stacklevel=2)
        return
    load_kernels = cpu_platform.import_kernels

    def import_kernels(cls: Any) -> None:
        del cls  # the original is bound to the class already
        load_kernels()
        vllm_cpu_ops.register_missing_ops(vllm_version)

    cpu_platform.import_kernels = classmethod(import_kernels)
    if release >= STANDALONE_RUNNER_SINCE:
        _run_standalone_runner_without_triton(cpu_platform)
    setattr(cpu_platform, PATCHED, True)


def _run_standalone_runner_without_triton(cpu_platform: Any) -> None:
    """Let ``cpu_platform`` take vLLM's standalone (no-Triton) CPU model runner on x86 when vLLM has no Triton.

    vLLM 0.34 decides in two places: ``uses_standalone_cpu_model_runner`` (true only off x86) and the
    first check of ``check_and_update_config``, which raises on x86 when ``vllm.triton_utils.HAS_TRITON``
    is false. The first is replaced by "vLLM has no usable Triton"; around the second, ``HAS_TRITON``
    reads true for the duration of the call (the function reads it once, at that check, and imports
    nothing that could keep the value), so its remaining configuration runs unchanged.
    """
    import vllm.triton_utils as triton_utils

    def uses_standalone_cpu_model_runner(cls: Any) -> bool:
        del cls
        return not triton_utils.HAS_TRITON

    check_and_update_config = cpu_platform.check_and_update_config

    def check_and_update_config_without_triton(cls: Any, vllm_config: Any) -> None:
        del cls
        if triton_utils.HAS_TRITON:
            check_and_update_config(vllm_config)
            return
        triton_utils.HAS_TRITON = True
        try:
            check_and_update_config(vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    cpu_platform.uses_standalone_cpu_model_runner = classmethod(uses_standalone_cpu_model_runner)
    cpu_platform.check_and_update_config = classmethod(check_and_update_config_without_triton)


class _PatchAfterExec:
    """A loader that runs the real loader's module, then :func:`patch_cpu_platform` on its ``CpuPlatform``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch_cpu_platform(module.CpuPlatform)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ...: what tracebacks and inspect ask a module's loader.
        return getattr(self._loader, name)


class CpuPlatformFinder:
    """A ``sys.meta_path`` finder that hands :data:`PLATFORM_MODULE` to the other finders and patches what they load."""

    is_cpu_platform_finder = True
    """Marks every copy of this class (the installed one's and tests/e2e's): one never asks another, or they recurse."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != PLATFORM_MODULE:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if getattr(finder, "is_cpu_platform_finder", False) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


def install_import_hook() -> None:
    """Put a :class:`CpuPlatformFinder` first on ``sys.meta_path`` unless one (of any copy) is there; patch the platform now if it is loaded."""
    if any(getattr(finder, "is_cpu_platform_finder", False) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, CpuPlatformFinder())
    loaded = sys.modules.get(PLATFORM_MODULE)
    if loaded is not None:
        patch_cpu_platform(loaded.CpuPlatform)
