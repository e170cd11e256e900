"""The result files the docs renderers read (``bench/results/*.json``) and the error a region that cannot be rendered
raises: shared by ``render_docs`` (every generated region) and ``render_simulate`` (docs/simulate.md's)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

__all__ = ["JSONObject", "REPO", "RESULTS", "RenderError", "Results"]

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

JSONObject = dict[str, object]


class RenderError(ValueError):
    """A region that cannot be rendered: an unknown name, a missing result file, a field it lacks."""


@dataclass
class Results:
    """The result files of ``folder``, each read once, by name without ``.json``."""

    folder: Path = RESULTS
    _cache: dict[str, JSONObject] = field(default_factory=lambda: {})

    def __call__(self, name: str) -> JSONObject:
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            try:
                self._cache[name] = cast(JSONObject, json.loads(path.read_text(encoding="utf-8")))
            except FileNotFoundError:
                raise RenderError(f"{path} is missing (run the benchmark that writes it)") from None
        return self._cache[name]
