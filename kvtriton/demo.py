"""`kvtriton demo`: placeholder until the worker side lands (prints machine info)."""

from __future__ import annotations

import argparse

from kvtriton import info

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    info.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return info.run(args)
