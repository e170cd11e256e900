"""vLLM's worker-side ``OffloadingWorker``, carried out by kvtriton's ``TransferEngine``.

vLLM hands the worker its KV cache as ``CanonicalKVCaches``: one int8
``(num_blocks, page_size_bytes)`` view per distinct cache tensor, plus, per KV
cache group, which tensors the group's layers use and how many bytes of each
page are real (``CanonicalKVCacheRef.page_size_bytes``: a page may be padded
so that groups of different kinds share one block size in bytes).

A group's blocks move only what the group owns, as vLLM's own CPU worker
does: the pages of the tensors the group references, each cut to its
unpadded size. :class:`GroupPages` turns the references into one
:class:`~kvtriton.worker._layout.PagedKV` per distinct reference set, and the
worker runs one ``TransferEngine`` per ``PagedKV``, all over one host slab.
A slot holds one group's chunk (vLLM keys offloaded blocks by group), so a
slab row is sized for the largest group and a smaller group leaves the end of
its rows unused. A vLLM job whose groups map to several engines is split into
one part per engine and reported once, when every part has finished. In the
common case (every group references every tensor in full, as in vLLM's
hybrid allocator with shared tensors) there is one engine and a job is passed
through unsplit.

With ``kvtriton_kv_compression`` (lossy, off by default) every group's pages
are read as the KV cache's dtype (vLLM's views are bytes) and each tensor is
compressed at its unpadded size: a row holds that group's codes and scales,
and a job's ``transfer_size`` counts the compressed bytes it moved.

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.integrations.vllm._surface import (
    FAILED_TRANSFERS_ARE_REPORTED,
    DevicePointers,
    DeviceSide,
    load_arguments,
    store_arguments,
    vllm_base,
)
from kvtriton.kernels import KVCompression
from kvtriton.worker import HostSlab, KVLayout, PagedKV, SlotDigests, TransferEngine

logger = logging.getLogger(__name__)


def _tensor_name(index: int) -> str:
    return f"kv_caches.tensors[{index}]"


def _checked_tensors(kv_caches: vllm_base.CanonicalKVCaches) -> list[torch.Tensor]:
    """``kv_caches.tensors`` as tensors, each checked against its declared (padded) page size."""
    if not kv_caches.tensors:
        raise ValueError("kv_caches.tensors is empty: vLLM registered no KV cache tensors")
    tensors: list[torch.Tensor] = []
    for index, canonical in enumerate(kv_caches.tensors):
        tensor = canonical.tensor
        if tensor.ndim != 2 or tensor.shape[1] * tensor.element_size() != canonical.page_size_bytes:
            raise ValueError(
                f"{_tensor_name(index)} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, which does not "
                f"match its page_size_bytes={canonical.page_size_bytes}"
            )
        tensors.append(tensor)
    return tensors


def _group_refs(
    kv_caches: vllm_base.CanonicalKVCaches, group: int, tensors: Sequence[torch.Tensor]
) -> tuple[tuple[int, int], ...]:
    """Group ``group``'s ``(tensor index, unpadded page bytes)`` references, checked, in vLLM's order.

    A tensor referenced twice by one group (two of its layers aliasing the
    same bytes) is copied once, at the larger of the two sizes: copying it
    twice would move the same bytes twice.
    """
    sizes: dict[int, int] = {}
    for ref in kv_caches.group_data_refs[group]:
        where = f"kv_caches.group_data_refs[{group}]"
        if not 0 <= ref.tensor_idx < len(tensors):
            raise ValueError(f"{where} references tensor {ref.tensor_idx}, but there are {len(tensors)} tensors")
        padded = kv_caches.tensors[ref.tensor_idx].page_size_bytes
        element = tensors[ref.tensor_idx].element_size()
        if not 1 <= ref.page_size_bytes <= padded or ref.page_size_bytes % element:
            raise ValueError(
                f"{where} uses {ref.page_size_bytes} bytes of each page of {_tensor_name(ref.tensor_idx)}, "
                f"whose pages hold {padded} bytes of {element}-byte elements (expected a multiple of {element} "
                f"in 1..{padded})"
            )
        sizes[ref.tensor_idx] = max(sizes.get(ref.tensor_idx, 0), ref.page_size_bytes)
    return tuple(sizes.items())


def _as_dtype(index: int, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte page tensor viewed as the KV cache's ``dtype`` (compression reads values, not bytes)."""
    if tensor.dtype == dtype:
        return tensor
    problem = ValueError(
        f"{_tensor_name(index)} ({tuple(tensor.shape)} {tensor.dtype}, strides {tensor.stride()}) cannot be read "
        f"as {dtype} pages for kv_compression: expected byte pages of whole {dtype.itemsize}-byte elements"
    )
    if tensor.element_size() != 1 or tensor.shape[1] % dtype.itemsize:
        raise problem
    try:
        return tensor.view(dtype)
    except RuntimeError as error:  # a block stride or offset that is not a whole number of elements
        raise problem from error


@dataclass(frozen=True, slots=True)
class GroupPages:
    """What every KV cache group moves: the page tensors it references, cut to their unpadded size.

    ``kvs`` holds one :class:`PagedKV` per distinct set of references;
    ``kv_of_group[g]`` is the index in ``kvs`` of group ``g``'s pages, or None
    when the group references no tensor (its blocks move nothing).
    ``group_row_bytes[g]`` is what one block of group ``g`` moves (its
    compressed row with compression).
    """

    kvs: tuple[PagedKV, ...]
    kv_of_group: tuple[int | None, ...]
    group_row_bytes: tuple[int, ...]
    pointer_bases: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per group, per data reference in vLLM's order (repeats included): ``(base address, block stride)`` of the
    referenced tensor, as vLLM 0.34 resolves a block's address (``base + block_id * stride``); the worker keeps them
    as a :class:`PointerLayout` (see :func:`block_ids_from_pointers`)."""

    @property
    def row_bytes(self) -> int:
        """The bytes of one slab row: one block of the largest group."""
        return max(kv.row_bytes for kv in self.kvs)

    @property
    def device(self) -> torch.device:
        return self.kvs[0].device

    @classmethod
    def from_canonical(
        cls,
        kv_caches: vllm_base.CanonicalKVCaches,
        *,
        kv_compression: KVCompression = KVCompression.NONE,
        dtype: torch.dtype | None = None,
    ) -> GroupPages:
        """Read vLLM's canonical KV caches; raises ``ValueError`` naming the tensor or group that is inconsistent.

        Refused: no tensors or no groups, a tensor view that contradicts its
        declared page size, a reference to a tensor that does not exist or to
        more bytes than its pages hold, and no group referencing any tensor.
        With ``kv_compression`` the byte pages are read as ``dtype`` (the KV
        cache's, required then) and every group's pages compress at their
        unpadded size.
        """
        tensors = _checked_tensors(kv_caches)
        if kv_compression is not KVCompression.NONE:
            if dtype is None:
                raise ValueError(f"kv_compression={kv_compression.value!r} needs the KV cache dtype, got dtype=None")
            tensors = [_as_dtype(index, tensor, dtype) for index, tensor in enumerate(tensors)]
        if not kv_caches.group_data_refs:
            raise ValueError("kv_caches.group_data_refs is empty: vLLM offloads no KV cache group")
        kv_index_of_refs: dict[tuple[tuple[int, int], ...], int] = {}
        kvs: list[PagedKV] = []
        kv_of_group: list[int | None] = []
        group_row_bytes: list[int] = []
        for group in range(len(kv_caches.group_data_refs)):
            refs = _group_refs(kv_caches, group, tensors)
            if not refs:
                kv_of_group.append(None)
                group_row_bytes.append(0)
                continue
            if refs not in kv_index_of_refs:
                pages = {
                    _tensor_name(index): tensors[index][:, : size // tensors[index].element_size()]
                    for index, size in refs
                }
                kv_index_of_refs[refs] = len(kvs)
                kvs.append(PagedKV.from_tensors(pages, layout=KVLayout.PAGES, kv_compression=kv_compression))
            kv_of_group.append(kv_index_of_refs[refs])
            group_row_bytes.append(kvs[kv_index_of_refs[refs]].row_bytes)
        if not kvs:
            raise ValueError("no group in kv_caches.group_data_refs references a tensor: there is nothing to offload")
        # vLLM's own formula (vllm.v1.kv_offload.pointer_utils): the canonical tensor's address plus the block id
        # times its stride(0), in elements; vLLM's canonical tensors are bytes, so elements are bytes.
        pointer_bases = tuple(
            tuple(
                (
                    kv_caches.tensors[ref.tensor_idx].tensor.data_ptr(),
                    kv_caches.tensors[ref.tensor_idx].tensor.stride(0),
                )
                for ref in refs
            )
            for refs in kv_caches.group_data_refs
        )
        return cls(
            kvs=tuple(kvs),
            kv_of_group=tuple(kv_of_group),
            group_row_bytes=tuple(group_row_bytes),
            pointer_bases=pointer_bases,
        )


@dataclass(frozen=True, slots=True, eq=False)
class _GroupAddresses:
    """One group's data references as arrays: the base address and block stride of each, as a column."""

    bases: npt.NDArray[np.int64]
    """``(references, 1)``: each reference's tensor address."""
    strides: npt.NDArray[np.int64]
    """``(references, 1)``: each reference's block stride in bytes."""
    base_steps: npt.NDArray[np.int64]
    """``(references - 1,)``: how far each reference's base lies past the previous reference's."""
    first_base: int
    first_stride: int
    uniform_stride: bool
    """Every reference has the first one's stride (the usual case): a block sits at the same offset in each."""

    @classmethod
    def of(cls, group: int, bases: Sequence[tuple[int, int]]) -> _GroupAddresses:
        """Group ``group``'s ``(base address, block stride)`` per reference; ``ValueError`` for a stride below 1."""
        for ref, (_, stride) in enumerate(bases):
            if stride < 1:
                raise ValueError(f"pointer_bases[{group}][{ref}] has block stride {stride}: expected at least 1")
        first_base, first_stride = bases[0] if bases else (0, 1)
        base_column = np.array([base for base, _ in bases], dtype=np.int64).reshape(-1, 1)
        return cls(
            bases=base_column,
            strides=np.array([stride for _, stride in bases], dtype=np.int64).reshape(-1, 1),
            base_steps=np.diff(base_column[:, 0]),
            first_base=first_base,
            first_stride=first_stride,
            uniform_stride=all(stride == first_stride for _, stride in bases),
        )

    @property
    def references(self) -> int:
        return len(self.bases)

    def addresses(self, block_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``(references, blocks)``: where vLLM puts each block of each reference (``base + block_id * stride``)."""
        return self.bases + block_ids * self.strides

    def name_blocks(self, ptrs: npt.NDArray[np.int64], block_ids: npt.NDArray[np.int64]) -> bool:
        """Whether ``ptrs`` (reference-major, one per reference and block) are the addresses of ``block_ids``.

        Every pointer is compared. With one block stride for every reference
        (the usual case) a block's address in reference ``r + 1`` lies
        ``base_steps[r]`` past its address in reference ``r``, whatever the
        block; so the differences between neighbouring references are
        compared, block with next block, over the flat array. Flat operations
        run numpy's contiguous loops, which are several times faster than
        broadcasting a column over 160 references of 256 blocks (the cost
        ``bench/host_cost.py`` measures). That, with ``block_ids`` read
        from reference 0, makes every reference's addresses exactly
        :meth:`addresses`.
        """
        count = len(block_ids)
        if not self.uniform_stride:
            return bool(np.array_equal(ptrs.reshape(-1, count), self.addresses(block_ids)))
        steps = ptrs[count:] - ptrs[:-count]  # per reference r and block: reference r + 1's address minus r's
        step_changes = steps[1:] != steps[:-1]  # a block's step against the next block's ...
        step_changes[count - 1 :: count] = False  # ... within one reference (one's last block, the next's first differ)
        # count_nonzero: numpy's cheapest test of a bool array (``any`` costs four times as much on a short one).
        return not np.count_nonzero(step_changes) and not np.count_nonzero(steps[::count] != self.base_steps)


class PointerLayout:
    """Where vLLM 0.34 puts each block of each group: what :func:`block_ids_from_pointers` reads pointers against.

    ``pointer_bases[g][r]`` is the ``(base address, block stride)`` of group
    ``g``'s data reference ``r`` (:attr:`GroupPages.pointer_bases`). They are
    kept as arrays, built once, so that a job's pointers are checked with one
    comparison per group instead of a loop over its references.
    """

    __slots__ = ("_groups",)

    def __init__(self, pointer_bases: Sequence[Sequence[tuple[int, int]]]) -> None:
        self._groups = tuple(_GroupAddresses.of(group, bases) for group, bases in enumerate(pointer_bases))

    def __len__(self) -> int:
        return len(self._groups)

    def group(self, index: int) -> _GroupAddresses:
        return self._groups[index]


def _int64_view(ptrs: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """vLLM's ``uint64`` pointers viewed as ``int64``, not copied (addresses fit 63 bits, so differences are signed).

    An address of 2**63 or more reads negative here and so names no block.
    """
    array = np.asarray(ptrs)
    if array.dtype.kind not in "iu" or array.dtype.itemsize != 8:
        array = array.astype(np.uint64)  # not vLLM's own type: one copy, for a caller that passed a list
    if array.ndim != 1:  # vLLM's is flat already: no reshape call on the hot path
        array = array.reshape(-1)
    return array.view(np.int64)


def block_ids_from_pointers(pointers: DevicePointers, layout: PointerLayout) -> GPULoadStoreSpec:
    """The block ids behind vLLM 0.34's resolved ``DevicePointers``; ``ValueError`` naming what does not fit.

    vLLM resolves each block id to one address per data reference of its
    group (``base + block_id * stride``, flat, group by group, reference by
    reference). kvtriton's kernels index pages by block id, so the ids are
    read back from the group's first reference and every reference's
    addresses are checked against them, all of a group's at once: a vLLM
    whose pointers mean something else is refused, never copied from.
    """
    ptrs = _int64_view(pointers.ptrs)
    # map, min and sum over the counts rather than generator expressions: a few microseconds of every job.
    counts = tuple(map(int, pointers.group_block_counts))
    ref_counts = tuple(pointers.group_data_ref_counts)
    indices = tuple(map(int, pointers.block_indices))
    if len(counts) != len(layout) or len(ref_counts) != len(counts) or len(indices) != len(counts):
        raise ValueError(
            f"device pointers for {len(counts)} groups (group_data_ref_counts={list(ref_counts)}, "
            f"block_indices={list(indices)}), but the KV cache has {len(layout)} groups"
        )
    if min(counts, default=0) < 0 or min(indices, default=0) < 0:
        raise ValueError(f"device pointers with negative group counts {list(counts)} or block indices {list(indices)}")
    expected = sum(map(operator.mul, counts, ref_counts))
    if expected != ptrs.size:
        raise ValueError(f"{ptrs.size} device pointers, but the group counts account for {expected}")
    if len(counts) == 1:  # the usual case: the group's ids are the job's, no copy into a joint array
        block_ids = _group_block_ids(0, ptrs, counts[0], ref_counts[0], layout.group(0))
        return GPULoadStoreSpec.from_checked(block_ids, counts, indices)
    parts: list[npt.NDArray[np.int64]] = []
    ptr_start = 0
    for group, (count, ref_count) in enumerate(zip(counts, ref_counts)):
        size = count * ref_count
        parts.append(_group_block_ids(group, ptrs[ptr_start : ptr_start + size], count, ref_count, layout.group(group)))
        ptr_start += size
    return GPULoadStoreSpec.from_checked(np.concatenate(parts), counts, indices)


def _group_block_ids(
    group: int, ptrs: npt.NDArray[np.int64], count: int, ref_count: int, addresses: _GroupAddresses
) -> npt.NDArray[np.int64]:
    """Group ``group``'s block ids from its ``ref_count * count`` pointers, every one of them checked."""
    if not count:
        return np.zeros(0, dtype=np.int64)
    if ref_count != addresses.references:
        raise ValueError(
            f"device pointers give group {group} {ref_count} data references, the KV cache {addresses.references}"
        )
    if not ref_count:
        return np.zeros(count, dtype=np.int64)
    # The ids, read from reference 0: whole blocks from its base (an address inside a block, or below it, is refused).
    block_ids, inside_block = np.divmod(ptrs[:count] - addresses.first_base, addresses.first_stride)
    if np.count_nonzero(inside_block) or int(block_ids.min()) < 0 or not addresses.name_blocks(ptrs, block_ids):
        raise _mismatch(group, ptrs.reshape(ref_count, count), block_ids, addresses)
    return block_ids


def _mismatch(
    group: int, grid: npt.NDArray[np.int64], block_ids: npt.NDArray[np.int64], addresses: _GroupAddresses
) -> ValueError:
    """The error for a group whose pointers do not all name its blocks: the first pointer that does not fit."""
    first_offsets = grid[0] - addresses.first_base
    for position, offset in enumerate(first_offsets.tolist()):
        if offset < 0 or offset % addresses.first_stride:
            return ValueError(
                f"device pointer {position} of group {group} (address {int(grid[0, position]):#x}) is not a block "
                f"of its KV cache tensor (base {addresses.first_base:#x}, block stride {addresses.first_stride})"
            )
    wanted = addresses.addresses(block_ids)
    ref, position = (int(index) for index in np.argwhere(grid != wanted)[0])
    return ValueError(
        f"the device pointers of group {group}'s data reference {ref} name other blocks: block {position}'s address "
        f"is {int(grid[ref, position]):#x}, but block {int(block_ids[position])} of that reference is at "
        f"{int(wanted[ref, position]):#x}"
    )


def _slot_spec(spec: vllm_base.LoadStoreSpec) -> CPULoadStoreSpec | None:
    """vLLM's slot spec (its ``CPULoadStoreSpec``: block ids are slots) as kvtriton's; None if not one."""
    if not isinstance(spec, vllm_base.BlockIDsLoadStoreSpec) or isinstance(spec, vllm_base.GPULoadStoreSpec):
        return None
    return CPULoadStoreSpec(spec.block_ids)


def _vllm_result(job_id: int, success: bool, size: int, seconds: float) -> vllm_base.TransferResult:
    return vllm_base.TransferResult(
        job_id=job_id, success=success, transfer_size=size if success else 0, transfer_time=seconds
    )


@dataclass(frozen=True, slots=True)
class _Part:
    """The share of one vLLM job that one engine runs: the job's groups whose pages that engine moves."""

    engine: int
    gpu: GPULoadStoreSpec
    slots: CPULoadStoreSpec


@dataclass(slots=True)
class _Pending:
    """A vLLM job whose parts are in flight; reported once the last one finishes."""

    parts_left: int
    success: bool = True
    size: int = 0
    seconds: float = 0.0
    abandoned: bool = False
    """A later part was refused: the submitted parts are drained, then the job is reported failed (vLLM 0.34) or
    not at all (vLLM 0.33, whose engine stops at the refusal)."""


class VLLMOffloadingWorker(vllm_base.OffloadingWorker):
    """vLLM's worker interface over kvtriton ``TransferEngine``s (one per group page set) and their ``HostSlab``.

    ``engine_of_group[g]`` is the index in ``engines`` of the engine that
    moves group ``g``'s pages (None: the group moves nothing). The worker owns
    the engines and the slab: :meth:`shutdown` waits for the jobs in flight and
    releases (unpins) the slab. A job that cannot run (bad ids, wrong spec
    type) makes ``submit_*`` return False, which vLLM treats as fatal; nothing
    of it is reported. ``verify_loads`` (``kvtriton_verify_host_loads``, a
    debug mode) also refuses a load that reads a slot whose bytes changed since
    its store finished (:class:`~kvtriton.worker._slot_digests.SlotDigests`).
    """

    def __init__(
        self,
        engines: Sequence[TransferEngine],
        slab: HostSlab,
        engine_of_group: Sequence[int | None] | None = None,
        *,
        verify_loads: bool = False,
        pointer_bases: Sequence[Sequence[tuple[int, int]]] = (),
    ) -> None:
        if not engines:
            raise ValueError("engines must hold at least one TransferEngine, got none")
        groups = list(engine_of_group) if engine_of_group is not None else [0]
        for group, engine in enumerate(groups):
            if engine is not None and not 0 <= engine < len(engines):
                raise ValueError(f"engine_of_group[{group}] is {engine}, but there are {len(engines)} engines")
        self._engines = list(engines)
        self._engine_of_group = groups
        self._slab = slab
        self._block_size_factor = slab.block_size_factor
        self._num_gpu_blocks = min(engine.kv.num_blocks for engine in engines)
        # One engine moving every group: jobs pass through unsplit (the hot path).
        self._single_engine = len(engines) == 1 and all(engine == 0 for engine in groups)
        self._pending: dict[int, _Pending] = {}
        """Jobs split into several parts, until their last part is reported."""
        self._finished_now: list[vllm_base.TransferResult] = []
        """Jobs done at submission: empty ones (succeeded) and, on vLLM 0.34, refused ones (failed)."""
        self._pointer_layout = PointerLayout(pointer_bases)
        self._unreported: set[int] = set()
        """Every job id accepted and not yet reported (an abandoned job's stays until its parts drain)."""
        self._digests = SlotDigests(slab) if verify_loads else None
        self._stores_in_flight: dict[int, list[int]] = {}
        """With ``verify_loads``: the slots of each store accepted and not yet reported."""

    @property
    def engines(self) -> list[TransferEngine]:
        """The engines that run the jobs, one per distinct set of group pages."""
        return list(self._engines)

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
            job_id,
            int(slots.block_ids.max()),
            num_slots,
        )
        return False

    def _parts(self, name: str, job_id: int, gpu: GPULoadStoreSpec, slots: CPULoadStoreSpec) -> list[_Part] | None:
        """Split a job by engine; None (after logging why) when the specs do not fit together."""
        if self._single_engine:
            # Only an empty job gets here (see _submit): the engine checks the others itself.
            return self._no_parts(name, job_id, slots)
        if len(gpu.group_sizes) != len(self._engine_of_group):
            logger.error(
                "%s job %d refused: its GPU spec has %d groups but the KV cache has %d",
                name,
                job_id,
                len(gpu.group_sizes),
                len(self._engine_of_group),
            )
            return None
        factor = self._block_size_factor
        slot_counts = [
            -(-(size + index % factor) // factor) if size else 0
            for size, index in zip(gpu.group_sizes, gpu.block_indices)
        ]
        if sum(slot_counts) != slots.block_ids.size:
            logger.error(
                "%s job %d refused: the CPU spec holds %d slots but the GPU spec spans %d (group_sizes=%s, "
                "block_indices=%s, block_size_factor=%d)",
                name,
                job_id,
                slots.block_ids.size,
                sum(slot_counts),
                list(gpu.group_sizes),
                list(gpu.block_indices),
                factor,
            )
            return None
        # Every id is checked before the first part is submitted, so a job is refused whole, never half run.
        if gpu.block_ids.size and not 0 <= int(gpu.block_ids.min()) <= int(gpu.block_ids.max()) < self._num_gpu_blocks:
            logger.error(
                "%s job %d refused: GPU block ids span %d..%d, out of range for %d blocks",
                name,
                job_id,
                int(gpu.block_ids.min()),
                int(gpu.block_ids.max()),
                self._num_gpu_blocks,
            )
            return None
        if slots.block_ids.size and int(slots.block_ids.min()) < 0:
            logger.error(
                "%s job %d refused: slot ids must not be negative, got %d", name, job_id, int(slots.block_ids.min())
            )
            return None
        # Each engine checks that its part writes no row or block twice; two parts
        # writing the same slot would mix two groups' bytes in one row.
        written = slots.block_ids if name == "store" else gpu.block_ids
        if np.unique(written).size != written.size:
            what = "slot" if name == "store" else "GPU block"
            logger.error("%s job %d refused: it writes a %s twice (the copies would race)", name, job_id, what)
            return None
        # Per engine: the block and slot ranges of each of its groups, in group order.
        shares: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        block_start = slot_start = 0
        for group, (size, index, count) in enumerate(zip(gpu.group_sizes, gpu.block_indices, slot_counts)):
            engine = self._engine_of_group[group]
            if size and engine is not None:
                shares.setdefault(engine, []).append((block_start, size, index, slot_start, count, group))
            block_start += size
            slot_start += count
        if not shares:
            return self._no_parts(name, job_id, slots)
        parts: list[_Part] = []
        for engine, ranges in shares.items():
            blocks = np.concatenate([gpu.block_ids[start : start + size] for start, size, _, _, _, _ in ranges])
            slot_ids = np.concatenate([slots.block_ids[start : start + count] for _, _, _, start, count, _ in ranges])
            sizes = [size for _, size, _, _, _, _ in ranges]
            indices = [index for _, _, index, _, _, _ in ranges]
            parts.append(_Part(engine, GPULoadStoreSpec(blocks, sizes, indices), CPULoadStoreSpec(slot_ids)))
        return parts

    def _no_parts(self, name: str, job_id: int, slots: CPULoadStoreSpec) -> list[_Part] | None:
        """A job with no block to move: empty when its CPU spec is empty too, else a mismatch."""
        if slots.block_ids.size:
            logger.error(
                "%s job %d refused: it moves no GPU block but names %d slots", name, job_id, slots.block_ids.size
            )
            return None
        return []

    def _submit(
        self,
        name: str,
        job_id: int,
        device: DeviceSide,
        slot_spec: vllm_base.LoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Accept a job, or refuse it as the installed vLLM expects (see :meth:`_refuse`)."""
        if job_id in self._unreported:
            # Never reported as failed: that would report the job in flight under this id.
            logger.error("%s job %d refused: job id %d is still in flight or unreported", name, job_id, job_id)
            return False
        slots = _slot_spec(slot_spec)
        if slots is None:
            side = "destination" if name == "store" else "source"
            logger.error(
                "%s job %d refused: %s is a %s, not a CPU slot spec", name, job_id, side, type(slot_spec).__name__
            )
            return self._refuse(job_id)
        try:
            gpu = self.device_blocks(device)
        except ValueError as error:
            logger.error("%s job %d refused: %s", name, job_id, error)
            return self._refuse(job_id)
        if name == "load" and not self._slots_unchanged(job_id, slots):
            return self._refuse(job_id)
        if self._single_engine and gpu.block_ids.size:
            # The hot path: the engine checks the rest itself (slot ids in range among them) and reports the job
            # as it is. Only a refused job pays for the slot check that names the likely cause.
            accepted = self._submit_part(name, _Part(0, gpu, slots), job_id, expedited)
            if not accepted:
                self._slots_fit(job_id, slots)
        elif not self._slots_fit(job_id, slots):  # before any part runs: a job is refused whole, never half run
            return self._refuse(job_id)
        else:
            accepted = self._submit_parts(name, job_id, gpu, slots, expedited)
        if not accepted:
            if job_id in self._unreported:  # abandoned after a first part: reported failed once its parts drain
                return FAILED_TRANSFERS_ARE_REPORTED
            return self._refuse(job_id)
        self._unreported.add(job_id)
        if name == "store" and self._digests is not None:
            self._stores_in_flight[job_id] = slots.slot_list()
        return True

    def _refuse(self, job_id: int) -> bool:
        """A job that cannot run (its cause already logged): what ``submit_*`` returns for it.

        vLLM 0.34 takes failures from ``get_finished`` (a failed store is
        dropped, a failed load recomputed as ``kv_load_failure_policy`` says),
        so the job is accepted and reported failed. vLLM 0.33 asserts that every
        job succeeds, so there it is refused (False), which stops the engine.
        """
        if not FAILED_TRANSFERS_ARE_REPORTED:
            return False
        self._finished_now.append(_vllm_result(job_id, False, 0, 0.0))
        self._unreported.add(job_id)
        return True

    def device_blocks(self, device: DeviceSide) -> GPULoadStoreSpec:
        """A job's device blocks: vLLM 0.33's block ids as they are, 0.34's pointers read back into block ids.

        Raises ``ValueError`` for pointers that name no block of this worker's KV caches.
        """
        if isinstance(device, vllm_base.GPULoadStoreSpec):
            return GPULoadStoreSpec(device.block_ids, device.group_sizes, device.block_indices)
        return block_ids_from_pointers(device, self._pointer_layout)

    def _slots_unchanged(self, job_id: int, slots: CPULoadStoreSpec) -> bool:
        """With ``verify_loads``: whether every slot the load reads holds what its store left; logs the slots when
        not (vLLM then stops the engine: it cannot fall back on recomputing)."""
        if self._digests is None:
            return True
        if not self._slots_fit(job_id, slots):  # a slot beyond the slab has no bytes to compare
            return False
        changed = self._digests.changed(slots.slot_list())
        if not changed:
            return True
        logger.error(
            "load job %d refused by kvtriton_verify_host_loads: host slab slot(s) %s no longer hold the bytes their "
            "store left (or no store filled them). Something other than kvtriton's stores wrote into the slab, or "
            "its memory is faulty; the engine stops rather than load them",
            job_id,
            changed[:16],
        )
        return False

    def _submit_part(self, name: str, part: _Part, job_id: int, expedited: bool) -> bool:
        engine = self._engines[part.engine]
        if name == "store":
            return engine.submit_store(job_id, part.gpu, part.slots)
        return engine.submit_load(job_id, part.slots, part.gpu, expedited=expedited)

    def _submit_parts(
        self, name: str, job_id: int, gpu: GPULoadStoreSpec, slots: CPULoadStoreSpec, expedited: bool
    ) -> bool:
        parts = self._parts(name, job_id, gpu, slots)
        if parts is None:
            return False
        if not parts:
            # Nothing to copy: done at once, without touching an engine (vLLM treats failure as fatal).
            self._finished_now.append(_vllm_result(job_id, True, 0, 0.0))
            return True
        pending = _Pending(parts_left=0)
        for part in parts:
            if not self._submit_part(name, part, job_id, expedited):
                if pending.parts_left:
                    # Earlier parts are already queued: let them finish (their rows and blocks belong to this
                    # job). On vLLM 0.34 the job is then reported failed; on 0.33 it reports nothing.
                    pending.abandoned = True
                    pending.success = False
                    self._pending[job_id] = pending
                    self._unreported.add(job_id)
                return False
            pending.parts_left += 1
        if len(parts) > 1:
            self._pending[job_id] = pending  # a job of one part is reported as its engine reports it
        return True

    @override
    def submit_store(self, *args: Any, **kwargs: Any) -> bool:
        """``submit_store(job_id, device side, slot spec)`` as the installed vLLM calls it.

        vLLM 0.33 passes the device side as a ``GPULoadStoreSpec`` of block ids
        (``src_spec``), vLLM 0.34 as resolved ``DevicePointers``
        (``device_ptrs``); the parameter's name differs, so the override takes
        the call as it comes and binds it to the installed vLLM's signature.
        """
        if len(args) == 3 and not kwargs:
            # As vLLM's connector calls it, on either release: positional, nothing to bind (binding costs ~5 us).
            job_id, device, slots = args
        else:
            job_id, device, slots = store_arguments(args, kwargs)
        return self._submit("store", job_id, device, slots)

    @override
    def submit_load(self, *args: Any, **kwargs: Any) -> bool:
        """``submit_load(job_id, slot spec, device side, expedited=False)``, taken as :meth:`submit_store` says."""
        if len(args) == 3 and kwargs.keys() <= {"expedited"}:
            # As vLLM's connector calls it, on either release (see submit_store).
            job_id, slots, device = args
            expedited = bool(kwargs.get("expedited", False))
        else:
            job_id, slots, device, expedited = load_arguments(args, kwargs)
        # vLLM's sync loads: it waits for them within the step, so each engine
        # runs them on its own expedited stream, never behind earlier loads.
        return self._submit("load", job_id, device, slots, expedited)

    @override
    def get_finished(self) -> list[vllm_base.TransferResult]:
        results, self._finished_now = self._finished_now, []
        for engine in self._engines:
            for part in engine.get_finished():
                pending = self._pending.get(part.job_id)
                if pending is None:
                    results.append(_vllm_result(part.job_id, part.success, part.transfer_size, part.transfer_time))
                    continue
                pending.parts_left -= 1
                pending.success = pending.success and part.success
                pending.size += part.transfer_size
                pending.seconds += part.transfer_time
                if pending.parts_left:
                    continue
                del self._pending[part.job_id]
                if pending.abandoned and not FAILED_TRANSFERS_ARE_REPORTED:
                    self._unreported.discard(part.job_id)
                else:
                    results.append(_vllm_result(part.job_id, pending.success, pending.size, pending.seconds))
        for result in results:
            self._unreported.discard(result.job_id)
            stored = self._stores_in_flight.pop(result.job_id, None)
            if stored is not None and self._digests is not None:
                if result.success:
                    self._digests.record(stored)
                else:
                    self._digests.forget(stored)
        return results

    @override
    def wait(self, job_ids: set[int]) -> None:
        for engine in self._engines:
            engine.wait(job_ids)

    @override
    def shutdown(self) -> None:
        for engine in self._engines:
            engine.shutdown()
        self._slab.close()
