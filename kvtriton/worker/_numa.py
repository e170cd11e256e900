"""Host memory placement: put a GPU's host buffers on the NUMA node the GPU is attached to.

On a two-socket host every GPU hangs off one socket; host memory on the other
socket is reached across the inter-socket link, at a fraction of the
bandwidth and more latency. Linux places a page on the node of the CPU that
first touches it, and the slab's pages are first touched by whoever pins or
populates them (``cudaHostRegister`` faults every page in). So the pinning
and the populating run under :func:`on_node`: the calling thread is moved to
the node's CPUs for the duration, then moved back.

Where the GPU's node comes from: sysfs, ``/sys/bus/pci/devices/<bus id>/numa_node``
(``-1`` where the platform does not say). Hosts with one node, GPUs of unknown
node and systems without sysfs change nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Generator
from pathlib import Path
from typing import cast

import torch

logger = logging.getLogger(__name__)

SYSFS_ROOT = "/sys"
"""Where sysfs is mounted (tests point it at a fake tree)."""


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (sysfs's cpulist format) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def node_count(sysfs_root: str | None = None) -> int:
    """NUMA nodes with memory or CPUs listed under ``<sysfs>/devices/system/node`` (1 where sysfs says nothing)."""
    nodes = Path(sysfs_root or SYSFS_ROOT, "devices", "system", "node")
    try:
        found = [entry for entry in nodes.iterdir() if entry.name.startswith("node") and entry.name[4:].isdigit()]
    except OSError:
        return 1
    return max(1, len(found))


def node_cpus(node: int, sysfs_root: str | None = None) -> set[int]:
    """The CPUs of NUMA node ``node`` (empty when sysfs does not list them)."""
    try:
        return parse_cpu_list(
            Path(sysfs_root or SYSFS_ROOT, "devices", "system", "node", f"node{node}", "cpulist").read_text()
        )
    except (OSError, ValueError):
        return set()


def gpu_numa_node(pci_bus_id: str, sysfs_root: str | None = None) -> int | None:
    """The NUMA node of the PCI device ``pci_bus_id`` (``0000:3b:00.0``), or None when unknown."""
    path = Path(sysfs_root or SYSFS_ROOT, "bus", "pci", "devices", pci_bus_id.lower(), "numa_node")
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def cuda_pci_bus_id(device_index: int) -> str | None:
    """``domain:bus:device.function`` of CUDA device ``device_index``, from torch's device properties."""

    properties = cast(object, torch.cuda.get_device_properties(device_index))  # pyright: ignore[reportUnknownMemberType] -- torch types the properties as Unknown
    domain: object = getattr(properties, "pci_domain_id", None)
    bus: object = getattr(properties, "pci_bus_id", None)
    device: object = getattr(properties, "pci_device_id", None)
    if not isinstance(domain, int) or not isinstance(bus, int) or not isinstance(device, int):
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


@contextlib.contextmanager
def on_node(node: int | None, sysfs_root: str | None = None) -> Generator[int | None]:
    """Run the block on the CPUs of NUMA node ``node`` (first touches land there); yields the node used or None.

    Does nothing (yields None) for ``node=None``, a host with one node, a node
    without listed CPUs, or where the thread may not be moved.
    """
    if node is None or node_count(sysfs_root) < 2:
        yield None
        return
    cpus = node_cpus(node, sysfs_root)
    try:
        previous = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        yield None
        return
    allowed = cpus & previous
    if not allowed:
        yield None
        return
    try:
        os.sched_setaffinity(0, allowed)
    except OSError as error:
        logger.warning("could not move to NUMA node %d's CPUs (%s); host memory stays where it lands", node, error)
        yield None
        return
    try:
        yield node
    finally:
        os.sched_setaffinity(0, previous)


def placement_gpu(gpu: int | None) -> int | None:
    """The GPU whose NUMA node host memory is placed on: ``gpu`` if given, else the current CUDA device (None without)."""
    if gpu is not None:
        return gpu
    return torch.cuda.current_device() if torch.cuda.is_available() else None


@contextlib.contextmanager
def on_gpu_node(device_index: int | None, sysfs_root: str | None = None) -> Generator[int | None]:
    """:func:`on_node` for the NUMA node of CUDA device ``device_index`` (None: nothing moves)."""
    node = None
    if device_index is not None:
        bus_id = cuda_pci_bus_id(device_index)
        node = gpu_numa_node(bus_id, sysfs_root) if bus_id is not None else None
    with on_node(node, sysfs_root) as used:
        yield used
