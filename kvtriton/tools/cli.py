"""The `kvtriton` command line: one subcommand per module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) ->
int``. Command modules keep torch and triton imports inside ``run`` so that
building the parser stays fast and the scheduler-only commands never import
torch. Every size flag follows one unit rule (``geometry.SIZE_RULE``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from kvtriton import __version__
from kvtriton.tools.geometry import SIZE_RULE

__all__ = ["main"]


class _CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True, slots=True)
class _Command:
    name: str
    module: str
    help: str


_SIGPIPE_EXIT = 128 + 13
"""Exit status of a process killed by SIGPIPE, which is what a shell expects after ``| head``."""

_COMMANDS: tuple[_Command, ...] = (
    _Command(
        "info",
        "kvtriton.tools.info",
        "versions, CUDA, pinned memory; with --slab-size, whether a host slab fits the memlock limit, RAM and /dev/shm",
    ),
    _Command("demo", "kvtriton.tools.demo", "offload a model-shaped KV cache through manager and engine"),
    _Command("simulate", "kvtriton.tools.simulate", "capacity planning: cache hit rate per GiB of host memory for a trace"),
    _Command(
        "bench",
        "kvtriton.tools.bench_command",
        "run the benchmarks of a source checkout (manager, kernels, engine, tiers, tiers_mooncake, compression): smoke runs by"
        " default, --full for figures",
    ),
)


def _load(command: _Command) -> _CommandModule:
    return cast(_CommandModule, importlib.import_module(command.module))


def build_parser(load: Callable[[_Command], _CommandModule] = _load) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtriton",
        description="kvtriton: offload the paged KV cache of an LLM server to host memory.",
        epilog=f"sizes (--capacity, --capacities, --slab-size): {SIZE_RULE}. `kvtriton COMMAND --help` lists each command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvtriton {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        load(command).add_arguments(sub)
        sub.set_defaults(_command=command)
    return parser


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """One line per warning on the command line, without the source line Python adds."""
    del filename, lineno, line
    return f"kvtriton: {category.__name__}: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = cast(_Command, args._command)
    previous = warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        return _load(command).run(args)
    except BrokenPipeError:
        # `kvtriton simulate | head` closed stdout early: exit as a process
        # killed by SIGPIPE would, without a traceback. stdout is pointed at
        # /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _SIGPIPE_EXIT
    finally:
        warnings.formatwarning = previous


if __name__ == "__main__":
    sys.exit(main())
