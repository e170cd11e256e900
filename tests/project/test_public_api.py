from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

import kvtriton


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert kvtriton.__all__ == sorted(kvtriton.__all__)
    for name in kvtriton.__all__:
        assert getattr(kvtriton, name) is not None, name


def test_scheduler_side_imports_without_torch_or_triton() -> None:
    code = "import sys, kvtriton, kvtriton._keys, kvtriton._offload_types; print(sorted({'torch', 'triton'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


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
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvtriton.no_such_name


def test_the_kernel_package_exports_its_torch_references_and_no_development_tool() -> None:
    import kvtriton.kernels

    # The torch references are public (a user checks the kernels on their own GPU against them, the demo shows
    # what they make of a block); the codegen and compile helpers are development tools outside the wheel.
    exported = set(kvtriton.kernels.__all__)
    assert {"gather_pages_reference", "scatter_pages_reference"} <= exported
    assert not exported & {"compile_asm", "compile_copy_pages", "compiled_variants", "production_config"}
    assert not hasattr(kvtriton.kernels, "Path")  # was an enum shadowing pathlib.Path; now KernelPath
    assert kvtriton.kernels.KernelPath.TRITON.value == "triton"


# --- one public list per package, and nothing else public ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvtriton"
# The packages vLLM loads by their path: the documented spec_module_path and the remote tiers' module_path (Mooncake, in-memory).
ENTRY_PACKAGES = {"kvtriton.integrations.vllm", "kvtriton.integrations.mooncake", "kvtriton.integrations.remote"}


def _module_name(source: Path) -> str:
    parts = source.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    """Every Python file of the package; kvtriton/kernels is a symlink to kernels/, walked as kvtriton.kernels."""
    return sorted(source for source in PACKAGE.rglob("*.py") if "__pycache__" not in source.parts) + sorted(
        PACKAGE / "kernels" / source.relative_to(ROOT / "kernels") for source in (ROOT / "kernels").rglob("*.py")
    )


def _packages() -> list[str]:
    return sorted({_module_name(source) for source in _sources() if source.name == "__init__.py"})


def test_the_walk_sees_every_room() -> None:
    packages = _packages()
    for room in ("kvtriton", "kvtriton.kernels", "kvtriton.kernels._jit", "kvtriton.manager", "kvtriton.worker"):
        assert room in packages


def test_every_module_is_private_but_the_package_inits() -> None:
    public: set[str] = set()
    for source in _sources():
        name = _module_name(source)
        if source.name == "__init__.py":
            continue
        if not any(part.startswith("_") for part in name.split(".")[1:]):
            public.add(name)
    assert public == set(), "make these private (an underscore name) or export their names from the package"


def test_the_entry_packages_exist_where_the_docs_say() -> None:
    for name in ENTRY_PACKAGES:
        assert (ROOT / name.replace(".", "/") / "__init__.py").is_file(), name


@pytest.mark.parametrize("package", _packages())
def test_every_package_has_a_public_list_whose_names_exist(package: str) -> None:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert isinstance(names, list), f"{package} has no __all__"
    listed = cast("list[str]", names)
    assert len(set(listed)) == len(listed), package
    missing = [name for name in listed if getattr(module, name, None) is None]
    assert missing == [], f"{package}.__all__ names what it does not define"


def test_the_top_level_list_is_the_one_docs_usage_md_documents() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = usage.split("## Public names", 1)[1].split("\n## ", 1)[0]
    documented = sorted(set(re.findall(r"^\* `([A-Za-z_]+)`", section, flags=re.MULTILINE)))
    assert documented == sorted(kvtriton.__all__)
