"""vLLM's worker-side ``OffloadingWorker``, carried out by kvtriton's ``TransferEngine``.

vLLM hands the worker its KV cache as ``CanonicalKVCaches``: one int8
``(num_blocks, page_size_bytes)`` view per distinct cache tensor, plus, per KV
cache group, which tensors the group's layers use. Those views are exactly
kvtriton's page tensors, so the engine copies them directly: one slab row per
GPU block holds the block's bytes of every tensor, ``blocks_per_chunk`` rows
per slot. Every offloaded group references every tensor (vLLM shares each
tensor between one layer of every group), so whole rows are always the right
unit.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import logging

import torch
from typing_extensions import override
from vllm.v1.kv_offload import base as vllm_base

from kvtriton.worker.engine import TransferEngine, TransferResult
from kvtriton.worker.layout import KVLayout, PagedKV
from kvtriton.worker.slab import HostSlab
from kvtriton.specs import CPULoadStoreSpec, GPULoadStoreSpec

__all__ = ["VLLMOffloadingWorker", "paged_kv_from_canonical"]

logger = logging.getLogger(__name__)


def paged_kv_from_canonical(kv_caches: vllm_base.CanonicalKVCaches) -> PagedKV:
    """Describe vLLM's canonical KV tensors as kvtriton page tensors.

    Raises ``ValueError`` when a group references a tensor that is not in
    ``kv_caches.tensors`` or a tensor's view does not match its declared page
    size (the engine would copy the wrong bytes).
    """
    if not kv_caches.tensors:
        raise ValueError("kv_caches.tensors is empty: vLLM registered no KV cache tensors")
    named: dict[str, torch.Tensor] = {}
    for index, canonical in enumerate(kv_caches.tensors):
        tensor = canonical.tensor
        name = f"kv_caches.tensors[{index}]"
        if tensor.ndim != 2 or tensor.shape[1] * tensor.element_size() != canonical.page_size_bytes:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, which does not match its "
                f"page_size_bytes={canonical.page_size_bytes}"
            )
        named[name] = tensor
    for group, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(kv_caches.tensors):
                raise ValueError(
                    f"kv_caches.group_data_refs[{group}] references tensor {ref.tensor_idx}, "
                    f"but there are {len(kv_caches.tensors)} tensors"
                )
    return PagedKV.from_tensors(named, layout=KVLayout.PAGES)


def _vllm_result(result: TransferResult) -> vllm_base.TransferResult:
    return vllm_base.TransferResult(
        job_id=result.job_id,
        success=result.success,
        transfer_size=result.transfer_size,
        transfer_time=result.transfer_time,
    )


def _slot_spec(spec: vllm_base.LoadStoreSpec) -> CPULoadStoreSpec | None:
    """vLLM's slot spec (its ``CPULoadStoreSpec``: block ids are slots) as kvtriton's; None if not one."""
    if not isinstance(spec, vllm_base.BlockIDsLoadStoreSpec) or isinstance(spec, vllm_base.GPULoadStoreSpec):
        return None
    return CPULoadStoreSpec(spec.block_ids)


def _gpu_spec(spec: vllm_base.GPULoadStoreSpec) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)


class VLLMOffloadingWorker(vllm_base.OffloadingWorker):
    """vLLM's worker interface over a kvtriton ``TransferEngine`` and the ``HostSlab`` it fills.

    The worker owns both: :meth:`shutdown` waits for the jobs in flight and
    releases (unpins) the slab. A job the engine refuses (bad ids, wrong spec
    type) makes ``submit_*`` return False, which vLLM treats as fatal.
    """

    def __init__(self, engine: TransferEngine, slab: HostSlab) -> None:
        self._engine = engine
        self._slab = slab

    @property
    def engine(self) -> TransferEngine:
        """The engine that runs the jobs."""
        return self._engine

    def _slots_fit(self, job_id: int, slots: CPULoadStoreSpec) -> bool:
        """Whether every slot id exists in this rank's slab; logs the likely cause when not."""
        num_slots = self._slab.num_slots
        if slots.block_ids.size == 0 or int(slots.block_ids.max()) < num_slots:
            return True
        logger.error(
            "job %d refused: it names slot %d but this rank's slab holds %d slots. The scheduler sized the "
            "cache from rank 0's KV bytes per block; a rank with more KV bytes per block (a pipeline-parallel "
            "stage holding more layers than the first) fits fewer slots. Split the layers evenly over the "
            "pipeline stages (VLLM_PP_LAYER_PARTITION).",
            job_id, int(slots.block_ids.max()), num_slots,
        )  # fmt: skip
        return False

    @override
    def submit_store(
        self, job_id: int, src_spec: vllm_base.GPULoadStoreSpec, dst_spec: vllm_base.LoadStoreSpec
    ) -> bool:
        slots = _slot_spec(dst_spec)
        if slots is None:
            logger.error("store job %d refused: destination is a %s, not a CPU slot spec", job_id, type(dst_spec).__name__)
            return False
        if not self._slots_fit(job_id, slots):
            return False
        return self._engine.submit_store(job_id, _gpu_spec(src_spec), slots)

    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: vllm_base.LoadStoreSpec,
        dst_spec: vllm_base.GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # Expedited loads (vLLM waits for them within the step) need no special
        # queue: the engine runs loads on their own stream, never behind stores.
        slots = _slot_spec(src_spec)
        if slots is None:
            logger.error("load job %d refused: source is a %s, not a CPU slot spec", job_id, type(src_spec).__name__)
            return False
        if not self._slots_fit(job_id, slots):
            return False
        return self._engine.submit_load(job_id, slots, _gpu_spec(dst_spec))

    @override
    def get_finished(self) -> list[vllm_base.TransferResult]:
        return [_vllm_result(result) for result in self._engine.get_finished()]

    @override
    def wait(self, job_ids: set[int]) -> None:
        self._engine.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self._engine.shutdown()
        self._slab.close()
