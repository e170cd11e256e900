"""The ``kvtriton`` command line: ``demo``, ``simulate``, ``bench`` and ``info``.

Built on the core and on the simulator (:mod:`kvtriton.sim`); nothing a server
runs imports from here.
"""

from kvtriton.cli._main import main
from kvtriton.cli._progress import progress

__all__ = ["main", "progress"]
