"""The wheel ships kernels/ as kvtriton.kernels and never as a top-level package; the kernels' development tools stay out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_copy(destination: Path) -> Path:
    """The checkout's files as git sees them (untracked, unignored ones included), without a build/ of old runs.

    setuptools reuses ``build/lib``: a file deleted since the last build would ship again from there.
    """
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    return destination


def test_wheel_holds_kvtriton_kernels_and_no_top_level_kernels(tmp_path: Path) -> None:
    source = _source_copy(tmp_path / "source")
    wheels = tmp_path / "wheels"
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
            str(source),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("kvtriton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernel_sources = {Path(source).name for source in (ROOT / "kernels").rglob("*.py")}
    shipped = {Path(name).name for name in names if name.startswith("kvtriton/kernels/")}
    assert kernel_sources <= shipped
    assert not [name for name in names if name.startswith("kernels/")]
    assert not [name for name in names if name.startswith("kernels_dev/") or "codegen" in name or "compile_asm" in name]
    assert "kvtriton/py.typed" in names
