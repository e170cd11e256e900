"""A CPU copy path for LMCache under ``vllm serve`` on vLLM's CPU platform: the serving benchmark's, not LMCache's.

LMCache 0.5.6 runs its cache engine, token database and local CPU backend on
a CPU torch, but has no connector between vLLM's paged CPU KV cache and its
memory objects: ``lmcache.v1.gpu_connector.CreateGPUConnector`` raises "No
supported cpu connector found" (its CUDA connector builds CUDA streams; its
torch fallback refuses vLLM's CPU layout). This module supplies one, so that
:mod:`bench.serving` can run LMCache beside kvtriton:

* :class:`PagedCPUCopier` copies tokens between vLLM's CPU cache (per layer
  ``[blocks, kv heads, block size, 2 * head size]``, which vLLM's CPU
  attention views as ``[blocks, kv heads, 2 * block size, head size]``: a
  block's K rows, then its V rows) and LMCache's ``KV_2LTD`` memory objects
  (``[2, layers, tokens, kv heads * head size]``), by slot;
* :class:`LMCacheCPUConnectorV1` is vLLM's own ``LMCacheConnectorV1`` with
  LMCache's connector factory wrapped so that, on a CPU torch, a vLLM engine
  gets a :class:`PagedCPUCopier` (every other case goes to LMCache's own
  factory). vLLM loads it through ``kv_connector_module_path``. On vLLM 0.34
  it also answers a question LMCache 0.5.6's adapter asks of vLLM's scheduler
  output in a field 0.34 dropped (:func:`with_resumed_req_ids`).

Everything else (lookup, chunking, hashing, storage, eviction, the vLLM
adapter) is LMCache's own. LMCache is not a dependency of kvtriton: it lives
in the benchmark's own environment (``bench/serving.py`` says how to make it),
so this module imports it only when vLLM builds the connector.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["LMCacheCPUConnectorV1", "PagedCPUCopier", "install_cpu_copy_path"]

_FACTORY_MODULE = "lmcache.v1.gpu_connector"
_FACTORY = "CreateGPUConnector"
_WRAPPED_MARK = "_kvtriton_bench_cpu_copy_path"


class _MemoryObj(Protocol):
    """What the copier uses of an LMCache ``MemoryObj``: its tensor, ``[2, layers, tokens, kv heads * head size]``."""

    @property
    def tensor(self) -> torch.Tensor | None: ...


class _Metadata(Protocol):
    """What the copier uses of LMCache's ``LMCacheMetadata``."""

    kv_shape: tuple[int, ...]
    """``(layers, 2, chunk size, kv heads, head size)``."""
    use_mla: bool


class _Config(Protocol):
    """The LMCache settings whose paths need more than a synchronous copy (refused here)."""

    use_layerwise: bool
    enable_blending: bool


class PagedCPUCopier:
    """Copies tokens, by slot, between vLLM's paged CPU KV cache and LMCache's ``KV_2LTD`` memory objects.

    LMCache calls it as it calls its own connectors (``from_gpu`` on store,
    ``to_gpu`` on retrieve, each with ``kvcaches`` and the request's whole
    ``slot_mapping``); "gpu" in their names is LMCache's.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        if min(num_layers, num_kv_heads, head_size) < 1:
            raise ValueError(
                f"num_layers, num_kv_heads and head_size must be >= 1, got {num_layers}, {num_kv_heads}, {head_size}"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def for_lmcache(cls, config: _Config, metadata: _Metadata) -> PagedCPUCopier:
        """The copier for LMCache's engine ``metadata``; only LMCache's plain (not layerwise, not blending) path."""
        if config.use_layerwise or config.enable_blending:
            raise ValueError(
                "the benchmark's LMCache CPU copy path does synchronous whole-request copies only: set "
                f"lmcache.use_layerwise and lmcache.enable_blending false (got {config.use_layerwise}, "
                f"{config.enable_blending})"
            )
        if metadata.use_mla:
            raise ValueError("the benchmark's LMCache CPU copy path does not handle MLA caches (use_mla is true)")
        layers, _, _, heads, head_size = metadata.kv_shape
        return cls(layers, heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        """A memory object's shape for ``num_tokens`` tokens (LMCache's ``KV_2LTD``)."""
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def initialize_kvcaches_ptr(self, **kwargs: object) -> None:
        caches = kwargs.get("kvcaches")
        if caches is not None:
            self.kvcaches = self._layers(caches)

    def from_gpu(self, memory_obj: _MemoryObj, start: int, end: int, **kwargs: object) -> None:
        """Tokens ``start:end`` of the request, from vLLM's cache into ``memory_obj``."""
        target = self._tensor(memory_obj)
        slots = self._slots(kwargs, start, end)
        caches = self._caches(kwargs)
        blocks, offsets = self._addresses(slots, caches[0])
        for layer, cache in enumerate(caches):
            tokens = self._token_major(cache)[blocks, offsets]  # [tokens, 2, heads, head size]
            target[:, layer, : len(slots)].copy_(tokens.transpose(0, 1).reshape(2, len(slots), -1))

    def to_gpu(self, memory_obj: _MemoryObj, start: int, end: int, **kwargs: object) -> None:
        """Tokens ``start:end`` of the request, from ``memory_obj`` into vLLM's cache.

        The first ``vllm_cached_tokens`` of the request are already in vLLM's
        cache (its own prefix cache): those slots are left alone, as LMCache's
        own connectors leave them.
        """
        source = self._tensor(memory_obj)
        cached = kwargs.get("vllm_cached_tokens", 0)
        skip = min(end - start, max(0, (cached if isinstance(cached, int) else 0) - start))
        slots = self._slots(kwargs, start + skip, end)
        if len(slots) == 0:
            return
        caches = self._caches(kwargs)
        blocks, offsets = self._addresses(slots, caches[0])
        for layer, cache in enumerate(caches):
            tokens = source[:, layer, skip : end - start].reshape(2, len(slots), self.num_kv_heads, self.head_size)
            self._token_major(cache)[blocks, offsets] = tokens.transpose(0, 1)

    def batched_from_gpu(
        self, memory_objs: Sequence[_MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: object
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Sequence[_MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: object
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    # -- helpers --------------------------------------------------------------------------------------------

    def _token_major(self, cache: torch.Tensor) -> torch.Tensor:
        """One layer's cache as ``[blocks, block size, 2 (K, V), kv heads, head size]``, a view of it."""
        if cache.dim() != 4 or cache.shape[1] != self.num_kv_heads or cache.shape[3] != 2 * self.head_size:
            raise ValueError(
                "expected vLLM's CPU cache layout [blocks, kv heads, block size, 2 * head size] = "
                f"[*, {self.num_kv_heads}, *, {2 * self.head_size}], got {list(cache.shape)}: another vLLM layout "
                "needs another copy path"
            )
        blocks, heads, block_size, _ = cache.shape
        # vLLM's CPU attention: view(blocks, heads, 2 * block size, head size).chunk(2, dim=2) -> K rows, V rows.
        return cache.view(blocks, heads, 2, block_size, self.head_size).permute(0, 3, 2, 1, 4)

    def _caches(self, kwargs: dict[str, object]) -> list[torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise ValueError("LMCache passed no kvcaches (vLLM's per-layer KV cache tensors) to the copier")
        if len(self.kvcaches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers' caches, got {len(self.kvcaches)}")
        return self.kvcaches

    @staticmethod
    def _layers(caches: object) -> list[torch.Tensor]:
        items: list[object] | None = list(cast(Sequence[object], caches)) if type(caches) in (list, tuple) else None
        layers = [c for c in items or [] if isinstance(c, torch.Tensor)]
        if items is None or len(layers) != len(items):
            raise ValueError(f"kvcaches must be a list of tensors, got {type(caches).__name__}")
        return layers

    @staticmethod
    def _slots(kwargs: dict[str, object], start: int, end: int) -> torch.Tensor:
        mapping = kwargs.get("slot_mapping")
        if not isinstance(mapping, torch.Tensor):
            raise ValueError(f"slot_mapping must be a tensor of the request's slots, got {type(mapping).__name__}")
        slots = mapping[start:end]
        if len(slots) != end - start or bool((slots < 0).any()):
            raise ValueError(
                f"slot_mapping[{start}:{end}] must name a slot for every token (got {len(slots)} slots, "
                f"{int((slots < 0).sum())} negative)"
            )
        return slots

    @staticmethod
    def _addresses(slots: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's block and its offset in the block (``cache``: a layer's, ``[blocks, heads, block size, *]``)."""
        block_size = cache.shape[2]
        return slots.div(block_size, rounding_mode="floor"), slots.remainder(block_size)

    def _tensor(self, memory_obj: _MemoryObj) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise ValueError("LMCache passed a memory object without a tensor")
        return tensor


CreateConnector = Callable[..., object]


def install_cpu_copy_path() -> None:
    """Wrap LMCache's connector factory: a vLLM engine on a CPU torch gets a :class:`PagedCPUCopier`.

    Idempotent; every other device and engine goes to LMCache's own factory.
    LMCache's vLLM adapter imports the factory from its module when it builds
    the engine, so wrapping the module's attribute is enough.
    """
    factory_module = importlib.import_module(_FACTORY_MODULE)
    original: CreateConnector = getattr(factory_module, _FACTORY)
    if getattr(original, _WRAPPED_MARK, False):
        return
    device_type = str(getattr(importlib.import_module("lmcache"), "torch_device_type", ""))

    def create_connector(config: _Config, metadata: _Metadata, engine: object, layout_hints: object = None) -> object:
        if device_type == "cpu" and getattr(engine, "name", None) == "VLLM":
            return PagedCPUCopier.for_lmcache(config, metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    setattr(create_connector, _WRAPPED_MARK, True)
    setattr(factory_module, _FACTORY, create_connector)


def with_resumed_req_ids(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """``scheduler_output`` as LMCache 0.5.6's adapter reads it: its cached requests carry ``resumed_req_ids``.

    LMCache asks each scheduled cached request whether it resumes from
    preemption (``resumed_req_ids``, vLLM 0.33) and refuses to go on without
    the answer. vLLM 0.34 dropped the field: it sends a resumed request again
    in full, as a new one, so no cached request is a resumed one and the
    answer is an empty set. A shallow copy carries it; vLLM's own objects are
    left as they are (the scheduler output also goes to the workers).
    """
    cached = scheduler_output.scheduled_cached_reqs
    if hasattr(cached, "resumed_req_ids"):
        return scheduler_output
    answered = copy.copy(cached)
    setattr(answered, "resumed_req_ids", set())  # vLLM 0.34 has no such field: the type checker would refuse it
    return dataclasses.replace(scheduler_output, scheduled_cached_reqs=answered)


class LMCacheCPUConnectorV1(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` (LMCache's own adapter behind it) with the CPU copy path installed first, and
    the scheduler output as LMCache 0.5.6 reads it (:func:`with_resumed_req_ids`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        install_cpu_copy_path()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return super().build_connector_meta(with_resumed_req_ids(scheduler_output))
