from __future__ import annotations

import subprocess
import sys

import kvtriton


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert kvtriton.__all__ == sorted(kvtriton.__all__)
    for name in kvtriton.__all__:
        assert getattr(kvtriton, name) is not None, name


def test_scheduler_side_imports_without_torch_or_triton() -> None:
    code = (
        "import sys, kvtriton, kvtriton._keys, kvtriton._offload_types;"
        "bad = [m for m in ('torch', 'triton') if m in sys.modules];"
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_worker_names_resolve_on_first_use_to_their_defining_module() -> None:
    from kvtriton.worker._engine import TransferEngine
    from kvtriton.worker._layout import PagedKV

    assert kvtriton.TransferEngine is TransferEngine
    assert kvtriton.PagedKV is PagedKV


def test_the_worker_api_of_issue_10_is_public() -> None:
    from kvtriton.worker._engine import TransferLane
    from kvtriton.worker._slab import SlabPinningError

    assert kvtriton.TransferLane is TransferLane
    assert kvtriton.SlabPinningError is SlabPinningError
    assert issubclass(SlabPinningError, RuntimeError)


def test_unknown_attribute_raises_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvtriton.no_such_name


def test_the_kernel_package_ships_only_what_users_run() -> None:
    import importlib.util

    import kvtriton.kernels

    # PTX inspection and compile-only tools live in bench/, outside the wheel.
    assert importlib.util.find_spec("kvtriton.kernels.codegen") is None
    assert importlib.util.find_spec("kvtriton.kernels._jit.compile") is None
    assert not hasattr(kvtriton.kernels, "Path")  # was an enum shadowing pathlib.Path; now KernelPath
    assert kvtriton.kernels.KernelPath.TRITON.value == "triton"
