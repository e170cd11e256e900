"""kvtriton's version, in a module of its own.

A module inside kvtriton that needs the version (the vLLM surface's start-up
line) imports it from here rather than from the package's public list, whose
``__init__`` re-exports it as ``kvtriton.__version__``.
"""

from __future__ import annotations

__version__ = "0.1.0"
"""The release, written here alone: pyproject.toml reads it for the wheel (``[tool.setuptools.dynamic]``)."""
