"""`kvtriton info`: what this machine offers an offload backend, and whether a host slab of a given size can start.

With ``--slab-size`` it checks what can stop a server at start: the RAM
available (pinning the slab on CUDA needs it free) and /dev/shm (only the
tiering spec keeps its slab there); it exits 1 when the RAM says TOO LOW, so
a start-up script can run it as a check. RLIMIT_MEMLOCK is reported for
information only: ``cudaHostRegister``, which pins the slab, is not charged
to it (the NVIDIA driver pins with ``pin_user_pages`` and never accounts the
pages as locked memory), so it neither allows nor stops a slab.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
from dataclasses import asdict, dataclass

from kvtriton._byte_units import SIZE_RULE, format_bytes, size_argument

TOO_LOW = "TOO LOW"
"""How every verdict that stops a slab of ``--slab-size`` from starting begins; ``info`` then exits 1."""

MAX_SLAB_BYTES = 2**57
"""The largest ``--slab-size`` taken: 128 PiB, the 57-bit virtual address space of x86-64 and arm64 Linux.

No process can map more, so a larger size is a typo (an exponent, say), refused rather than printed.
"""


@dataclass(frozen=True, slots=True)
class MachineInfo:
    """A snapshot of the software and hardware an offload run depends on."""

    kvtriton: str
    python: str
    torch: str
    triton: str
    vllm: str
    mooncake: str
    cuda_available: bool
    device_name: str
    pinned_memory: str
    memlock_limit: str
    triton_interpret: bool

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def vllm_verdict(version: str) -> str:
    """The installed vLLM's version, and whether kvtriton is tested on its release (the spec refuses it otherwise)."""
    from kvtriton.integrations import ALLOW_UNTESTED_VLLM, TESTED_VLLM_RELEASES, tested_releases, vllm_release

    if version == "not installed":
        return f"not installed (kvtriton's vLLM specs need vLLM {tested_releases()})"
    if vllm_release(version) in TESTED_VLLM_RELEASES:
        return f"{version} (tested)"
    return f"{version} (untested: kvtriton is tested on {tested_releases()}; its specs refuse it unless {ALLOW_UNTESTED_VLLM}=1)"


def _mooncake_version() -> str:
    """The Mooncake Store client's version under either of its distribution names, and whether the tier takes it."""
    from kvtriton.integrations import installed_mooncake_version, mooncake_version_problem

    installed = installed_mooncake_version()
    if installed is None:
        return "not installed (only the Mooncake Store tier needs it)"
    version, name = installed
    refused = (
        " (refused by the Mooncake tier: too old, its transfer engine lets anyone who reaches it read this process's memory)"
        if mooncake_version_problem(installed)
        else ""
    )
    return f"{version} ({name}){refused}"


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
    from kvtriton import __version__
    from kvtriton.integrations import installed_vllm_version

    return MachineInfo(
        kvtriton=__version__,
        python=platform.python_version(),
        torch=str(torch.__version__),
        triton=_package_version("triton"),
        vllm=vllm_verdict(installed_vllm_version()),
        mooncake=_mooncake_version(),
        cuda_available=cuda,
        device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        pinned_memory=_probe_pinned_memory(),
        memlock_limit=_format_limit(soft_limit),
        triton_interpret=os.environ.get("TRITON_INTERPRET", "") not in ("", "0"),
    )


def memlock_verdict(limit_bytes: int | None, slab_bytes: int | None) -> str:
    """RLIMIT_MEMLOCK (``None`` = unlimited), for information: it never decides whether a slab can be pinned.

    Never starts with :data:`TOO_LOW`: ``cudaHostRegister`` is not charged to
    the limit, so a slab larger than it pins all the same.
    """
    from kvtriton.worker import MEMLOCK_NOTE

    limit = "unlimited" if limit_bytes is None else format_bytes(limit_bytes)
    if slab_bytes is None or limit_bytes is None or slab_bytes <= limit_bytes:
        return f"{limit} ({MEMLOCK_NOTE})"
    return f"{limit}, below the {format_bytes(slab_bytes)} slab ({MEMLOCK_NOTE})"


def memory_verdict(available_bytes: int | None, slab_bytes: int | None) -> str:
    """Whether ``MemAvailable`` (``None`` = unknown) holds a slab of ``slab_bytes`` besides what already runs."""
    if available_bytes is None:
        return "unknown (no MemAvailable in /proc/meminfo)"
    available = format_bytes(available_bytes)
    if slab_bytes is None:
        return f"{available} available (pass --slab-size to check a size)"
    size = format_bytes(slab_bytes)
    if slab_bytes <= available_bytes:
        return f"enough: a {size} slab fits in the {available} available"
    return f"{TOO_LOW} for a {size} slab: only {available} is available (MemAvailable); lower cpu_bytes_to_use"


def shm_verdict(free_bytes: int | None, slab_bytes: int | None) -> str:
    """Whether /dev/shm (``None`` = absent) holds the tiering primary's region for a slab of ``slab_bytes``.

    Only ``KVTritonTieringOffloadingSpec`` puts its slab in /dev/shm (plus a
    4 KiB header page); the single-tier spec's slab is an anonymous mapping, so
    a small /dev/shm is named here but never makes ``info`` fail.
    """
    if free_bytes is None:
        return "absent (only the tiering spec needs it)"
    free = format_bytes(free_bytes)
    if slab_bytes is None:
        return f"{free} free (the tiering spec's region lives here; pass --slab-size to check a size)"
    needed = slab_bytes + 4096
    if needed <= free_bytes:
        return f"enough for the tiering spec: a {format_bytes(slab_bytes)} region fits in {free} free"
    return (
        f"too small for the tiering spec: a {format_bytes(slab_bytes)} region (plus its 4 KiB header) does not"
        f" fit in {free} free (docker: --shm-size or --ipc=host); the single-tier spec does not use /dev/shm"
    )


def _shm_free_bytes() -> int | None:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def measure_warmup() -> str:
    """Build a small Triton engine on the first GPU and report how long its warm-up (kernel compiles) took."""
    import torch

    if not torch.cuda.is_available():
        return "not measured: no CUDA device (the kernels compile only for a GPU)"
    from kvtriton.worker import HostSlab, PagedKV, TransferEngine

    kv = PagedKV.from_tensors([torch.zeros((2, 4, 16, 8, 128), dtype=torch.bfloat16, device="cuda")])
    try:
        with HostSlab(4, 1, kv.row_bytes, pin=True) as slab, TransferEngine(kv, slab, "triton") as engine:
            seconds = engine.warmup_seconds
    except (RuntimeError, ValueError) as error:
        return f"not measured: {error}"
    return f"{seconds:.2f} s (gather and scatter compiled when an engine is built; Triton's disk cache makes later starts faster)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "exit status: 0, or 1 when a --slab-size slab cannot start here (the memory verdict reads TOO LOW: the"
        " RAM available); the memlock line is information only (cudaHostRegister is not charged to RLIMIT_MEMLOCK)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    def slab_size(text: str) -> int:
        size = size_argument(text)
        if size > MAX_SLAB_BYTES:
            raise argparse.ArgumentTypeError(
                f"{text!r} is {float(size):.3g} bytes, more than any process can map (128 PiB, the 57-bit address space of "
                "x86-64 and arm64 Linux); pass the per-rank slab size, e.g. 96GiB"
            )
        return size

    parser.add_argument(
        "--slab-size",
        type=slab_size,
        default=None,
        metavar="SIZE",
        help="say whether this machine can pin and hold a host slab of this size (vLLM's cpu_bytes_to_use"
        f" per rank), e.g. 96GiB ({SIZE_RULE}; at most 128 PiB)",
    )


def run(args: argparse.Namespace) -> int:
    import json

    from kvtriton.worker import mem_available_bytes, memlock_limit_bytes

    slab_bytes: int | None = args.slab_size
    info = collect_machine_info()
    rows = info.as_dict()
    rows["memlock_verdict"] = memlock_verdict(memlock_limit_bytes(), slab_bytes)
    rows["memory_verdict"] = memory_verdict(mem_available_bytes(), slab_bytes)
    rows["shm_verdict"] = shm_verdict(_shm_free_bytes(), slab_bytes)
    rows["engine_warmup"] = measure_warmup()
    # Only the RAM stops a slab: the memlock line informs, and /dev/shm matters to the tiering spec alone.
    blocking = str(rows["memory_verdict"]).startswith(TOO_LOW)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(name) for name in rows)
        for name, value in rows.items():
            print(f"{name.replace('_', ' '):<{width}}  {value}")
    return 1 if blocking else 0
