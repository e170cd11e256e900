"""`kvtriton info`: what this machine offers an offload backend."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
from dataclasses import dataclass

__all__ = ["MachineInfo", "add_arguments", "collect_machine_info", "run"]


@dataclass(frozen=True, slots=True)
class MachineInfo:
    """A snapshot of the software and hardware an offload run depends on."""

    python: str
    torch: str
    triton: str
    cuda_available: bool
    device_name: str
    pinned_memory: str
    memlock_limit: str
    triton_interpret: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "python": self.python,
            "torch": self.torch,
            "triton": self.triton,
            "cuda_available": self.cuda_available,
            "device_name": self.device_name,
            "pinned_memory": self.pinned_memory,
            "memlock_limit": self.memlock_limit,
            "triton_interpret": self.triton_interpret,
        }


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _format_limit(limit: int) -> str:
    if limit == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{limit} bytes ({limit / 2**20:.1f} MiB)"


def _probe_pinned_memory() -> str:
    """Try one small pinned allocation; say why it is unavailable otherwise."""
    import torch

    if not torch.cuda.is_available():
        return "unavailable (no CUDA device; host slabs stay pageable)"
    try:
        torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:
        return f"failed: {error}"
    return "works"


def collect_machine_info() -> MachineInfo:
    """Probe the machine. Imports torch, so the scheduler side never calls this."""
    import torch

    cuda = torch.cuda.is_available()
    soft_limit, _hard_limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return MachineInfo(
        python=platform.python_version(),
        torch=str(torch.__version__),
        triton=_package_version("triton"),
        cuda_available=cuda,
        device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        pinned_memory=_probe_pinned_memory(),
        memlock_limit=_format_limit(soft_limit),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "") not in ("", "0"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    import json

    info = collect_machine_info()
    if args.json:
        print(json.dumps(info.as_dict(), indent=2))
        return 0
    rows = info.as_dict()
    width = max(len(name) for name in rows)
    for name, value in rows.items():
        print(f"{name.replace('_', ' '):<{width}}  {value}")
    return 0
