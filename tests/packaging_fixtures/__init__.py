"""kvtriton as users get it: a wheel built from a copy of the checkout, installed non-editable into a new environment,
and an interpreter that lacks one of its optional dependencies (:func:`run_python_without`).

The environment is a new venv that sees the test venv's packages (vLLM, torch,
triton, Mooncake, numpy, xxhash: a vLLM server's environment) through one
``.pth`` line, and runs their other ``.pth`` files too, all but the editable
install of kvtriton itself. So kvtriton can only come from the wheel: a module
the wheel lacks fails to import there, whatever the checkout holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EDITABLE_PTH_PREFIX = "__editable__.kvtriton"
"""setuptools' name for the ``.pth`` of an editable kvtriton (``pip install -e``): the one the new environment skips."""


def run_python_without(
    package: str, code: str, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the checkout's root where ``import package`` fails, as it fails in an
    environment that lacks an optional dependency (``sys.modules[package] = None`` is how Python spells it)."""
    blocked = f"import sys\nsys.modules[{package!r}] = None  # import {package} now raises ImportError\n"
    return subprocess.run(
        [sys.executable, "-c", blocked + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def missing_package_errors(
    package: str, setup: str, attempts: Sequence[str], *, env: dict[str, str] | None = None
) -> list[str]:
    """What each of ``attempts`` (calls, as source) raises in a fresh interpreter without ``package``, after ``setup``:
    one ``"<module name> | <message>"`` line per ``ModuleNotFoundError``, in order (an attempt that raises none
    adds no line). The interpreter must exit cleanly."""
    calls = ", ".join(f"lambda: {attempt}" for attempt in attempts)
    code = (
        f"{setup}\n"
        f"for attempt in ({calls},):\n"
        "    try:\n"
        "        attempt()\n"
        "    except ModuleNotFoundError as error:\n"
        "        print(error.name, '|', error)\n"
    )
    run = run_python_without(package, code, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def package_folders() -> list[Path]:
    """Every package folder of the checkout's kvtriton, relative to the checkout (``kvtriton/kernels``, a symlink
    that ``rglob`` does not enter, walked as the build walks it)."""
    inits = [*(ROOT / "kvtriton").rglob("__init__.py"), *(ROOT / "kvtriton" / "kernels").rglob("__init__.py")]
    return sorted({init.parent.relative_to(ROOT) for init in inits if "__pycache__" not in init.parts})


def source_copy(destination: Path) -> Path:
    """The checkout's files as git sees them (untracked, unignored ones included), without a build/ of old runs.

    setuptools reuses ``build/lib``: a file deleted since the last build would ship again from there.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    return destination


def build_wheel(workdir: Path) -> Path:
    """kvtriton's wheel, built (no build isolation: the index may be out of reach) from a copy of the checkout."""
    source = source_copy(workdir / "source")
    wheels = workdir / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
        ]
        + [str(source)],
        check=True,
        capture_output=True,
        cwd=workdir,
    )
    (wheel,) = wheels.glob("kvtriton-*.whl")
    return wheel


@dataclass(frozen=True)
class InstalledWheel:
    """A new environment with kvtriton's wheel installed, beside the test venv's packages."""

    prefix: Path
    site_packages: Path

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def kvtriton(self) -> Path:
        """The ``kvtriton`` command the wheel's entry point installed."""
        return self.prefix / "bin" / "kvtriton"


def install_beside_test_venv(wheel: Path, prefix: Path) -> InstalledWheel:
    """A new venv at ``prefix`` that sees this interpreter's site-packages but not its editable kvtriton, with
    ``wheel`` installed into it as ``pip install --no-deps`` installs it (the README's install into a vLLM server's
    environment)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(prefix)
    site_packages = Path(sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix)})["purelib"])
    beside = Path(sysconfig.get_paths()["purelib"])
    # site reads .pth files in name order: this one first, so the others' import lines find their packages.
    (site_packages / "00-beside-test-venv.pth").write_text(f"{beside}\n")
    for pth in beside.glob("*.pth"):
        if not pth.name.startswith(EDITABLE_PTH_PREFIX):
            shutil.copy2(pth, site_packages / pth.name)
    # --ignore-installed: the test venv's editable kvtriton is visible through the .pth line; pip must install beside
    # it, never uninstall it.
    subprocess.run(
        [str(prefix / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed"]
        + [str(wheel)],
        check=True,
        capture_output=True,
        cwd=prefix,
    )
    return InstalledWheel(prefix=prefix, site_packages=site_packages)
