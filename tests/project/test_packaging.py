"""The wheel ships every package of kvtriton (found, never listed), kernels/ as kvtriton.kernels and never as a top-level
package; the kernels' development tools stay out. tests/e2e/test_installed_wheel.py installs the same wheel and runs it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from packaging_fixtures import ROOT, build_wheel, package_folders

import kvtriton


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("wheel")))


@pytest.fixture(scope="module")
def wheel_names(wheel: zipfile.ZipFile) -> list[str]:
    return wheel.namelist()


def test_wheel_holds_every_package_of_the_tree(wheel_names: list[str]) -> None:
    packages = {str(folder) for folder in package_folders()}
    shipped = {str(Path(name).parent) for name in wheel_names if name.endswith("/__init__.py")}
    assert {"kvtriton/integrations/vllm", "kvtriton/integrations/mooncake", "kvtriton/kernels/_jit"} <= packages
    assert packages == shipped
    sources = {str(path.relative_to(ROOT)) for package in packages for path in (ROOT / package).glob("*.py")}
    assert sources <= set(wheel_names)


def test_wheel_holds_kvtriton_kernels_and_no_top_level_kernels(wheel_names: list[str]) -> None:
    kernel_sources = {Path(source).name for source in (ROOT / "kernels").rglob("*.py")}
    shipped = {Path(name).name for name in wheel_names if name.startswith("kvtriton/kernels/")}
    assert kernel_sources <= shipped
    assert not [name for name in wheel_names if name.startswith("kernels/")]
    assert not [
        name for name in wheel_names if name.startswith("kernels_dev/") or "codegen" in name or "compile_asm" in name
    ]
    assert "kvtriton/py.typed" in wheel_names


def test_wheel_carries_the_version_kvtriton_reports(wheel: zipfile.ZipFile) -> None:
    (metadata,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    assert f"Version: {kvtriton.__version__}" in wheel.read(metadata).decode().splitlines()


def test_wheel_declares_what_the_seal_needs(wheel: zipfile.ZipFile) -> None:
    """xxhash (the chunk seal's checksum) comes with ``pip install kvtriton``: neither vLLM release brings it."""
    (metadata,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    requires = [
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert any(requirement.startswith("xxhash") for requirement in requires), requires
