"""The wheel ships kernels/ as kvtriton.kernels and never as a top-level package; the kernels' development tools stay out."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_holds_kvtriton_kernels_and_no_top_level_kernels(tmp_path: Path) -> None:
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
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("kvtriton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernel_sources = {Path(source).name for source in (ROOT / "kernels").rglob("*.py")}
    shipped = {Path(name).name for name in names if name.startswith("kvtriton/kernels/")}
    assert kernel_sources <= shipped
    assert not [name for name in names if name.startswith("kernels/")]
    assert not [name for name in names if name.startswith("kernels_dev/") or "codegen" in name or "compile_asm" in name]
    assert "kvtriton/py.typed" in names
