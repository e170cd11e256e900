"""The `kvtriton` command line: one subcommand per module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) ->
int``. Command modules keep torch and triton imports inside ``run`` so that
building the parser stays fast and the scheduler-only commands never import
torch. Every size flag follows one unit rule (``geometry.SIZE_RULE``), and
every choice flag takes its names in any case (:func:`choice_argument`). An
option no command knows is named, with the closest known one when there is
one, and a missing command lists the commands.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from kvtriton import __version__
from kvtriton._byte_units import SIZE_RULE


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
        "kvtriton.cli._info",
        "versions, CUDA, pinned memory; with --slab-size, whether RAM and /dev/shm hold a host slab (memlock: information only)",
    ),
    _Command("demo", "kvtriton.cli._demo", "offload a model-shaped KV cache through manager and engine"),
    _Command(
        "simulate", "kvtriton.cli._simulate", "capacity planning: cache hit rate per GiB of host memory for a trace"
    ),
    _Command(
        "bench",
        "kvtriton.cli._bench",
        "run the benchmarks of a source checkout (manager, kernels, host_cost, tiers, tiers_mooncake, compression, fleet_scale, serving): smoke runs by"
        " default, --full for figures",
    ),
)


def choice_argument(names: Sequence[str]) -> Callable[[str], str]:
    """An argparse ``type`` for a choice flag: its value in any case, as the lower-case name in ``names``.

    Set ``choices=names`` next to it so that ``--help`` lists them; a value
    that is no name fails here first, with the valid names and the text as typed.
    """

    def convert(text: str) -> str:
        name = text.strip().lower()
        if name not in names:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
        return name

    return convert


def add_choice_argument(
    parser: argparse._ActionsContainer,  # pyright: ignore[reportPrivateUsage] -- argparse names the type of parsers and groups only privately
    flag: str,
    names: Sequence[str],
    *,
    default: str,
    help: str,
) -> None:
    """Add the choice flag ``flag``: one of ``names`` in any case (:func:`choice_argument`), listed by ``--help``."""
    parser.add_argument(flag, type=choice_argument(names), choices=names, default=default, help=help)


def command_error(command: str, error: object) -> int:
    """``error`` on stderr as the error of ``kvtriton COMMAND``; the exit status of a command that cannot run."""
    print(f"kvtriton {command}: error: {error}", file=sys.stderr)
    return 2


def _load(command: _Command) -> _CommandModule:
    return cast(_CommandModule, importlib.import_module(command.module))


def build_parser(load: Callable[[_Command], _CommandModule] = _load) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtriton",
        description="kvtriton: offload the paged KV cache of an LLM server to host memory.",
        epilog=f"sizes (--capacity, --capacities, --slab-size): {SIZE_RULE}. `kvtriton COMMAND --help` lists each command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvtriton {__version__}")
    # Not required=True: main() names a missing command itself, with the list of commands, and an unknown
    # option before it (`kvtriton --bogus`) as what it is rather than as a missing command.
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        load(command).add_arguments(sub)
        sub.set_defaults(_command=command, _parser=sub)
    return parser


def _unknown_options_message(unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """``unrecognized arguments: ...``, with the closest option ``parser`` knows for the first unknown option."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    option = next((item.partition("=")[0] for item in unknown if item.startswith("-")), None)
    if option is None:
        return message
    # argparse lists a parser's options nowhere public: its _actions are what it matches against.
    known = [flag for action in parser._actions for flag in action.option_strings]
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
    return message + (f" (did you mean {close[0]}?)" if close else "")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line; an unknown option or a missing command exits with status 2 and a message naming it."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    commands = ", ".join(command.name for command in _COMMANDS)
    if getattr(args, "_command", None) is None:
        if unknown:
            parser.error(
                f"unknown option {unknown[0]}: give a command first, one of {commands}"
                " (`kvtriton COMMAND --help` lists its options)"
            )
        parser.error(f"a command is required, one of {commands} (`kvtriton COMMAND --help` lists its options)")
    if unknown:
        sub = cast(argparse.ArgumentParser, args._parser)
        sub.error(_unknown_options_message(unknown, sub))
    # What the command's JSON records as its command line: the arguments given to main(), not the test's sys.argv.
    args.command_line = list(sys.argv[1:] if argv is None else argv)
    return args


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """One line per warning on the command line, without the source line Python adds."""
    del filename, lineno, line
    return f"kvtriton: {category.__name__}: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
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
