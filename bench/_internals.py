"""The private kvtriton names a benchmark may import, each with why: the one exception to "through the public lists".

A benchmark reaches kvtriton through the packages' ``__all__`` (``kvtriton``,
``kvtriton.worker``, ``kvtriton.kernels``, ``kvtriton.integrations.vllm``,
...), except where it times a piece the public names hide or reads a fact
only a private module computes. Those names are listed here, and only here:
``tests/project/test_package_layout.py`` fails on a private import in bench/
that is not listed, and on an entry no benchmark imports any more.

The imports themselves stay in the benchmarks, where they are needed (often
inside the function or check that uses them: ``bench/gpu_preflight.py``
reports a failed import on that check's line, and a benchmark that never
times a piece never imports it), so this module imports nothing of kvtriton.
A name is its dotted path: ``from kvtriton.a._b import c`` is ``kvtriton.a._b.c``,
``importlib.import_module("kvtriton.a._b")`` is ``kvtriton.a._b``.
"""

from __future__ import annotations

__all__ = ["PRIVATE_NAMES"]

_DMA_BESIDE_TRITON = (
    "kernels.py and host_cost.py time the worker's DMA backend on the same plan as the Triton kernel, below the "
    "engine's choice between them, which the public TransferEngine makes on its own"
)
_SEAL = (
    "integrity.py times the chunk seal and its check alone, as a tier's store and promotion run them; no public "
    "call seals or verifies bytes by itself"
)
_QUANTIZATION = (
    "compression.py measures the fp8 codec's error by itself (a round trip without a copy kernel, against a "
    "per-tensor scale); the public names quantize only inside a copy"
)
_NUMA = "gpu_preflight.py reports the GPU's NUMA node as the worker finds it when it places the slab"

PRIVATE_NAMES: dict[str, str] = {
    "kvtriton.cli._info.collect_machine_info": (
        "common.py records the machine beside every result, the same probe `kvtriton info` prints"
    ),
    "kvtriton._integrity.FINGERPRINT_BYTES": _SEAL,
    "kvtriton._integrity.SEAL_BYTES": _SEAL,
    "kvtriton._integrity.seal_bytes": _SEAL,
    "kvtriton._integrity.verify": _SEAL,
    "kvtriton._region_rows.block_row_stride": (
        "gpu_preflight.py pins one rank's view of a shared region laid out exactly as the tiering spec's ranks lay "
        "it out"
    ),
    "kvtriton.kernels._compression.E4M3_MAX": _QUANTIZATION,
    "kvtriton.kernels._compression.dequantize_groups": _QUANTIZATION,
    "kvtriton.kernels._compression.quantize_groups": _QUANTIZATION,
    "kvtriton.kernels._jit.copy_pages": (
        "gpu_preflight.py reports the file the copy kernel loads from (the kvtriton/kernels link resolved); "
        "host_cost.py replaces its launch with a no-op to time the host's side alone"
    ),
    "kvtriton.kernels._jit.descriptor_copy.launch_descriptor_copy": (
        "kernels.py times vLLM's descriptor-per-copy style beside kvtriton's kernel: the comparison baseline, "
        "which the package never runs"
    ),
    "kvtriton.worker._backends.DmaCopy": _DMA_BESIDE_TRITON,
    "kvtriton.worker._plan.TransferPlan": _DMA_BESIDE_TRITON,
    "kvtriton.worker._numa.cuda_pci_bus_id": _NUMA,
    "kvtriton.worker._numa.gpu_numa_node": _NUMA,
    "kvtriton.worker._numa.node_count": _NUMA,
}
"""Each private kvtriton name a benchmark imports (its dotted path), and why the benchmark needs it."""
