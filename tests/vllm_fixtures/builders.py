"""One builder per vLLM object the adapter tests need, with small named defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.request import Request

from bench.common import offloading_config as bench_offloading_config
from kvtriton.integrations.vllm._surface import registered_cache_policies
from kvtriton.manager.policies import policy_names

SHARED_POLICIES = sorted(set(policy_names()) & set(registered_cache_policies()))
"""The eviction policies both kvtriton and vLLM's own manager implement: the ones a test can compare with vLLM's."""

TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny_llama"
"""A config.json-only Llama (2 layers, 2 KV heads of 8): enough for vLLM's ModelConfig on CPU."""

SPEC_EXTRA_CONFIG: dict[str, object] = {
    "spec_name": "KVTritonOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}
"""The two keys that point vLLM's OffloadingConnector at kvtriton."""


def offloading_config(
    extra_config: Mapping[str, object],
    *,
    worker_kv_bytes_per_block: int = 1024,
    blocks_per_chunk: int = 1,
    world_size: int = 1,
    rank: int = 0,
    enable_events: bool = True,
    canonical_layout: bool = False,
    tokens_per_block: int = 16,
) -> OffloadingConfig:
    """The OffloadingConfig vLLM's connector would build for one full-attention group."""
    return bench_offloading_config(
        {**SPEC_EXTRA_CONFIG, **extra_config},
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        engine_id="test-engine",
        model_name="tiny",
        blocks_per_chunk=blocks_per_chunk,
        world_size=world_size,
        rank=rank,
        enable_events=enable_events,
        canonical_layout=canonical_layout,
        tokens_per_block=tokens_per_block,
        max_model_len=1024,
    )


def canonical_kv_caches(
    layers: Sequence[torch.Tensor],
    num_groups: int = 1,
    *,
    group_refs: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> CanonicalKVCaches:
    """vLLM's canonical view of ``layers`` (each ``(num_blocks, ...)`` with contiguous blocks).

    Each layer becomes one int8 ``(num_blocks, page_size_bytes)`` view, as
    vLLM's OffloadingConnectorWorker.register_kv_caches builds them. By
    default every one of ``num_groups`` groups references every tensor in
    full (vLLM shares each tensor between one layer of every group);
    ``group_refs[g]`` instead lists group ``g``'s ``(tensor index, unpadded
    page bytes)`` references, for hybrid models whose groups own different
    tensors and for padded pages.
    """
    tensors: list[CanonicalKVCacheTensor] = []
    for layer in layers:
        page = layer[0].numel() * layer.element_size()
        view = torch.empty(0, dtype=torch.int8).set_(
            layer.untyped_storage(), layer.storage_offset() * layer.element_size(),
            (layer.shape[0], page), (layer.stride(0) * layer.element_size(), 1),
        )  # fmt: skip
        tensors.append(CanonicalKVCacheTensor(tensor=view, page_size_bytes=page))
    if group_refs is None:
        group_refs = [[(index, canonical.page_size_bytes) for index, canonical in enumerate(tensors)]] * num_groups
    refs = [
        [CanonicalKVCacheRef(tensor_idx=index, page_size_bytes=size) for index, size in group] for group in group_refs
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def salted_request(salt: str | None, *, prompt_tokens: int = 64, block_size: int = 16) -> Request:
    """A vLLM ``Request`` of ``prompt_tokens`` tokens carrying ``cache_salt=salt``, its block hashes computed as
    vLLM's scheduler computes them (sha256, blocks of ``block_size``)."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=f"salt-{salt!r}",
        prompt_token_ids=list(range(prompt_tokens)),
        sampling_params=params,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
