"""The pre-flight of ``bench/gpu_check.sh``: what its GPU steps need, each found or missing, written as it goes.

``python -m bench.gpu_preflight ENV_FILE [--dry-run]`` prints one line per
check (``gpu_check.sh`` keeps them in ``preflight.txt``) and appends
``PF_<KEY>=1`` (found, worked) or ``PF_<KEY>=0`` (missing, failed) to
``ENV_FILE`` the moment each check ends. A pre-flight cut off at its budget
therefore keeps what it learnt, and ``gpu_check.sh`` reads a key that was
never written as "not known to be missing": it tries the step.

In this order, cheapest first: the imports (``PF_TORCH``, ``PF_PYTEST``,
``PF_HYPOTHESIS``, ``PF_NUMPY``, ``PF_TRITON``, and ``PF_KERNELS`` for
``kvtriton.kernels._jit.copy_pages`` through the ``kvtriton/kernels`` link),
the GPU (``PF_CUDA``) and its NUMA node, the toolchain Triton's launcher
builds with (a C compiler, ``Python.h``, ``ptxas``: information), free
``/dev/shm`` (``PF_SHM_OK``: the shared-region test needs under 1 MiB),
``RLIMIT_MEMLOCK`` (information only: ``cudaHostRegister`` pins through the
driver, which does not charge the limit, so only a real pin can tell), then
two real pins of a :class:`~kvtriton.worker._slab.HostSlab`, 64 MiB
(``PF_PIN_SMALL``, what the tests need) and 1 GiB (``PF_PIN_LARGE``, the
benchmarks' slabs), with the rate each pinned at (the slab's first touch and
registration: what a server pays per GiB at start-up), then one rank's view
of a shared region holding 1 GiB of its own (``PF_PIN_REGION``, information:
no step needs it): rank 0 of 8, 640 KiB per block row (a 70B model's K and V
at tensor parallelism 8), 16 blocks per chunk, pinned as the tiering spec's
ranks pin (whole rows, every rank's bytes of them, in slot-aligned pieces of
at most 1 GiB: :func:`probe_region_pin`), with its registrations counted; and last one tiny launch of the copy kernel
(``PF_TRITON_LAUNCH``), whose compile proves the C compiler, ``Python.h`` and
``ptxas`` are really there. Every import of kvtriton happens inside the check
that needs it: one that fails (a package the machine lacks) is reported by
name on that check's line, and the pre-flight goes on.

``--dry-run`` (a CPU machine) runs the same code: the slabs are left
pageable and the launch goes through Triton's interpreter, both labelled so.
Exit status 1 when torch does not import or a pin or the launch that was
tried failed; a missing GPU alone is no failure (the steps say why they skip).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import mmap
import os
import resource
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bench import gpu_machine_imports

if TYPE_CHECKING:
    import torch

__all__ = [
    "PIN_PROBE_BYTES",
    "SHM_NEEDED_BYTES",
    "PinProbe",
    "Preflight",
    "launch_tiny_copy",
    "main",
    "memlock_text",
    "probe_pin",
    "probe_region_pin",
]

LABEL_WIDTH = 20
SHM_NEEDED_BYTES = 1 << 20
"""Free /dev/shm the shared-region CUDA test needs, rounded up (its region holds 128 KiB)."""
PIN_PROBE_BYTES = {"PIN_SMALL": 64 << 20, "PIN_LARGE": 1 << 30}
"""The two pins tried: 64 MiB gates every step that pins (the tests), 1 GiB the benchmarks' slabs."""
PIN_ROW_BYTES = 1 << 20
REGION_PROBE_BYTES = 1 << 30
"""This rank's own bytes in the region view the pre-flight pins (the rest of each block row is the other ranks')."""
REGION_WORLD_SIZE = 8
REGION_RANK_ROW_BYTES = 640 << 10
"""One rank's bytes of one GPU block: 80 layers x K,V x 16 tokens x 1 KV head x 128 x bf16 (a 70B model at TP 8)."""
REGION_BLOCKS_PER_CHUNK = 16


class _Closable(Protocol):
    def close(self) -> None: ...


SlabFactory = Callable[[int, int, int, bool], _Closable]
"""``(num_slots, block_size_factor, row_bytes, pin) -> slab``: :class:`~kvtriton.worker._slab.HostSlab`'s signature."""


@dataclass(frozen=True, slots=True)
class PinProbe:
    """One pin tried: its size, how long the slab took to allocate, place and pin, and the error if it failed."""

    nbytes: int
    seconds: float
    error: str | None
    registrations: int | None = None
    """The ``cudaHostRegister`` calls the slab's pin makes (or would make, left pageable); None: not counted."""

    @property
    def bandwidth_GBps(self) -> float:  # noqa: N802 -- GB/s in the name, as the report prints it
        """Bytes pinned per second, in GB/s (10^9 bytes): the start-up cost of a slab per byte."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def probe_pin(nbytes: int, pin: bool, make_slab: SlabFactory | None = None) -> PinProbe:
    """Allocate (and, with ``pin``, pin) a slab of ``nbytes`` in rows of 1 MiB, timed, then free it.

    ``make_slab`` defaults to :class:`~kvtriton.worker._slab.HostSlab`; any failure is returned, never raised.
    """
    if nbytes < PIN_ROW_BYTES or nbytes % PIN_ROW_BYTES:
        raise ValueError(f"nbytes must be a positive multiple of {PIN_ROW_BYTES}, got {nbytes}")
    started = time.perf_counter()
    try:
        if make_slab is None:
            from kvtriton.worker import HostSlab  # inside the try: a failed import is a finding too

            make_slab = HostSlab
        started = time.perf_counter()
        slab = make_slab(nbytes // PIN_ROW_BYTES, 1, PIN_ROW_BYTES, pin)
    except Exception as error:  # noqa: BLE001 -- a failed pin is the finding, reported in words
        return PinProbe(nbytes, time.perf_counter() - started, f"{type(error).__name__}: {error}")
    seconds = time.perf_counter() - started
    slab.close()
    return PinProbe(nbytes, seconds, None)


def probe_region_pin(own_bytes: int, pin: bool) -> PinProbe:
    """One rank's view of a shared region with ``own_bytes`` of its own, pinned as a tiering rank pins it, timed.

    The region is :data:`REGION_WORLD_SIZE` ranks of
    :data:`REGION_RANK_ROW_BYTES` per block row, :data:`REGION_BLOCKS_PER_CHUNK`
    rows per chunk, laid out as the tiering spec's shared region lays it out
    (``kvtriton._region_rows.block_row_stride``), in an anonymous mapping:
    only this rank's pages are touched; the whole rows are registered (every
    rank's bytes of them, as a rank of the region pins them), in slot-aligned
    pieces of at most ``PIN_CHUNK_BYTES`` (``HostSlab.registration_plan``, counted). ``own_bytes`` is
    rounded down to whole chunks. Any failure is returned, never raised.
    """
    started = time.perf_counter()
    rows = own_bytes // REGION_RANK_ROW_BYTES // REGION_BLOCKS_PER_CHUNK * REGION_BLOCKS_PER_CHUNK
    try:
        from kvtriton._region_rows import block_row_stride
        from kvtriton.worker import HostSlab

        if rows < REGION_BLOCKS_PER_CHUNK:
            raise ValueError(f"own_bytes {own_bytes} holds no chunk of {REGION_BLOCKS_PER_CHUNK} block rows")
        stride = block_row_stride(REGION_BLOCKS_PER_CHUNK, REGION_WORLD_SIZE, REGION_RANK_ROW_BYTES)
        buffer = mmap.mmap(-1, rows * stride, flags=mmap.MAP_PRIVATE)  # virtual: untouched pages cost nothing
        started = time.perf_counter()
        slab = HostSlab.from_buffer(
            buffer,
            rows // REGION_BLOCKS_PER_CHUNK,
            REGION_BLOCKS_PER_CHUNK,
            REGION_RANK_ROW_BYTES,
            row_stride=stride,
            row_offset=0,
            pin=pin,
        )
        seconds = time.perf_counter() - started
        registrations = len(slab.registration_plan()[0])
        slab.close()
    except Exception as error:  # noqa: BLE001 -- a failed pin is the finding, reported in words
        return PinProbe(rows * REGION_RANK_ROW_BYTES, time.perf_counter() - started, f"{type(error).__name__}: {error}")
    return PinProbe(rows * REGION_RANK_ROW_BYTES, seconds, None, registrations)


def memlock_text(soft_limit: int) -> str:
    """``RLIMIT_MEMLOCK`` in words, as information: the pins below decide, not the limit."""
    limit = "unlimited" if soft_limit == resource.RLIM_INFINITY else f"{soft_limit} bytes"
    return f"{limit} (information only: cudaHostRegister is not charged to it; the pins below decide)"


def launch_tiny_copy(device: torch.device) -> str:
    """One launch of the copy kernel over 2 page tensors x 4 blocks on ``device``; what it proved, or raise.

    On CUDA the kernel is compiled (Triton builds its launcher with the C
    compiler and ``Python.h``, and assembles with ``ptxas``); on CPU it runs
    through Triton's interpreter. The slab lives on ``device`` too, so the
    launch does not depend on pinning. Raises ``RuntimeError`` when the bytes
    copied are wrong.
    """
    import torch

    from kvtriton.kernels import DEFAULT_BYTES_PER_ITER, CopyLauncher
    from kvtriton.worker import PagedKV

    blocks, words = 4, 8  # 64-byte pages
    pages = [
        torch.arange(t * 100, t * 100 + blocks * words, dtype=torch.int64, device=device).view(blocks, words)
        for t in range(2)
    ]
    slab = torch.zeros((blocks, 2 * words * 8), dtype=torch.uint8, device=device)
    started = time.perf_counter()
    launcher = CopyLauncher(
        pages,
        slab,
        PagedKV(pages, ["k", "v"]).geometry,
        interpret=device.type == "cpu",
        num_programs=1,
        bytes_per_iter=DEFAULT_BYTES_PER_ITER,
    )
    order = torch.tensor([2, 0, 3, 1], dtype=torch.int64, device=device)
    launcher.launch(True, order, torch.arange(blocks, dtype=torch.int64, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    expected = torch.cat([page[order].view(torch.uint8) for page in pages], dim=1)
    if not torch.equal(slab, expected):
        raise RuntimeError("the copy kernel ran but wrote the wrong bytes")
    how = "compiled and launched" if device.type == "cuda" else "interpreted (dry run: nothing compiled)"
    return f"{how} in {seconds:.1f} s; 2 pages x 4 blocks copied exactly"


class Preflight:
    """Prints each check's line and appends its ``PF_<KEY>`` to the env file as soon as it is known."""

    def __init__(self, env_path: Path, dry_run: bool) -> None:
        self.env_path = env_path
        self.dry_run = dry_run
        self.found: dict[str, bool] = {}
        self.failed: list[str] = []
        env_path.write_text("", encoding="ascii")

    def line(self, label: str, text: str) -> None:
        print(f"{label:{LABEL_WIDTH}s} {text}", flush=True)

    def record(self, key: str, ok: bool) -> None:
        """Remember ``key`` and append ``PF_<KEY>=0|1`` to the env file now (a cut-off run keeps it)."""
        self.found[key] = ok
        with self.env_path.open("a", encoding="ascii") as env:
            env.write(f"PF_{key}={int(ok)}\n")

    def info(self, label: str, load: Callable[[], str]) -> None:
        """An information line: ``load``'s text, or FAILED and the error (a failed import named) without stopping."""
        try:
            detail = load()
        except Exception as error:  # noqa: BLE001 -- information only: reported, never raised
            detail = f"FAILED: {type(error).__name__}: {error}"
        self.line(label, detail)

    def check(self, key: str, label: str, load: Callable[[], str]) -> bool:
        """Run ``load``; its text on success, MISSING and the error otherwise."""
        try:
            detail = load()
        except Exception as error:  # noqa: BLE001 -- a missing piece is reported, not raised
            self.line(label, f"MISSING: {type(error).__name__}: {error}")
            self.record(key, False)
            return False
        self.line(label, detail)
        self.record(key, True)
        return True

    def run(self) -> int:
        self.line("python", sys.version.split()[0])
        if gpu_machine_imports.installed():
            self.line("packages", "the GPU machine's set only (bench/gpu_machine_imports.py hides the rest)")
        for module in ("torch", "pytest", "hypothesis", "numpy", "triton"):
            self.check(module.upper(), module, _version_of(module))
        self.check("KERNELS", "kernels (link)", _kernels_link)
        if not self.found["TORCH"]:
            return 1
        import torch

        cuda = torch.cuda.is_available()
        no_gpu = "none" + (" (dry run: CUDA steps run with CUDA skipped)" if self.dry_run else "")
        self.line("gpu", _gpu_text() if cuda else no_gpu)
        self.record("CUDA", cuda)
        if cuda:
            self.info("numa", _numa_text)
        self.info("toolchain", _toolchain_text)
        shm = _shm_free_bytes()
        shm_ok = shm >= SHM_NEEDED_BYTES
        too_small = f"  TOO SMALL (under {SHM_NEEDED_BYTES}): the shared-region test is left out"
        self.line("/dev/shm free", f"{shm} bytes" + ("" if shm_ok else too_small))
        self.record("SHM_OK", shm_ok)
        self.line("memlock (ulimit -l)", memlock_text(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]))
        if cuda or self.dry_run:
            self._pins(pin=cuda)
        if self.found["KERNELS"] and (cuda or self.dry_run):
            self._launch(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        return 1 if self.failed else 0

    def _pins(self, pin: bool) -> None:
        for key, nbytes in PIN_PROBE_BYTES.items():
            label = f"pin {nbytes >> 20} MiB" if nbytes < 1 << 30 else f"pin {nbytes >> 30} GiB"
            self._report_pin(key, label, probe_pin(nbytes, pin), pin)
        region = probe_region_pin(REGION_PROBE_BYTES, pin)
        self._report_pin("PIN_REGION", f"pin region {REGION_PROBE_BYTES >> 30} GiB", region, pin)

    def _report_pin(self, key: str, label: str, probe: PinProbe, pin: bool) -> None:
        if probe.error is not None:
            self.line(label, f"FAILED after {probe.seconds:.2f} s: {probe.error}")
            self.failed.append(label)
        else:
            note = "" if pin else "  (dry run: pageable, not pinned)"
            per_gib = (1 << 30) / probe.nbytes * probe.seconds
            rate = f"{probe.bandwidth_GBps:.1f} GB/s ({probe.seconds:.2f} s; start-up: {per_gib:.2f} s per GiB of slab)"
            if probe.registrations is not None:
                rate += (
                    f" in {probe.registrations} registrations (rank 0 of {REGION_WORLD_SIZE}, "
                    f"{REGION_RANK_ROW_BYTES >> 10} KiB per block row)"
                )
            self.line(label, rate + note)
        self.record(key, probe.error is None)

    def _launch(self, device: torch.device) -> None:
        label = "triton launch"
        try:
            if device.type == "cpu":
                from kvtriton.kernels import interpreter_problem

                problem = interpreter_problem()
                if problem is not None:  # the dry run cannot interpret here; that says nothing about a GPU
                    self.line(label, f"skipped (dry run: {problem})")
                    return
            detail = launch_tiny_copy(device)
        except Exception as error:  # noqa: BLE001 -- the toolchain's failure is the finding
            last = str(error).strip().splitlines()[-1:] or [""]
            why = f"{type(error).__name__}: {last[0][:300]}"
            self.line(label, f"FAILED: {why} (the Triton steps will fail the same way)")
            self.failed.append(label)
            self.record("TRITON_LAUNCH", False)
            return
        if device.type == "cuda":
            from kernels_dev.compiled_variants import compiled_variants  # the launch above imported copy_pages already

            regs = ", ".join(f"regs {v['n_regs']} spills {v['n_spills']}" for v in compiled_variants())
            detail += f"; {regs}" if regs else ""
        self.line(label, detail)
        self.record("TRITON_LAUNCH", True)


def _version_of(module: str) -> Callable[[], str]:
    def load() -> str:
        return str(getattr(importlib.import_module(module), "__version__", "present"))

    return load


def _kernels_link() -> str:
    return str(importlib.import_module("kvtriton.kernels._jit.copy_pages").__file__)


def _gpu_text() -> str:
    import torch

    index = torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(index)} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s))"


def _numa_text() -> str:
    import torch

    from kvtriton.worker._numa import cuda_pci_bus_id, gpu_numa_node, node_count

    bus = cuda_pci_bus_id(torch.cuda.current_device())
    node = gpu_numa_node(bus) if bus else None
    return f"{node_count()} node(s); GPU {bus} on node {node if node is not None else 'unknown'}"


def _toolchain_text() -> str:
    """What Triton's launcher build needs, as found on PATH and disk (the launch below is the proof)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    header = Path(sysconfig.get_paths()["include"], "Python.h")
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or _bundled_ptxas() or shutil.which("ptxas")
    return (
        f"cc {compiler or 'MISSING'}; Python.h {'found' if header.is_file() else 'MISSING (' + str(header) + ')'}; "
        f"ptxas {ptxas or 'MISSING'}"
    )


def _bundled_ptxas() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(path) if path.is_file() else None


def _shm_free_bytes() -> int:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0] if __doc__ else None
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_preflight", description=description)
    parser.add_argument("env_file", type=Path, help="where the PF_<KEY>=0|1 lines go (appended as each check ends)")
    parser.add_argument("--dry-run", action="store_true", help="a CPU rehearsal: pageable slabs, an interpreted launch")
    args = parser.parse_args(argv)
    return Preflight(args.env_file, args.dry_run).run()


if __name__ == "__main__":
    raise SystemExit(main())
