"""What a remote tier's keys and seals name: the identity of the chunks a vLLM offloading spec hands it.

:func:`kv_identity` is the fingerprint every seal names and the keys are filed
under (docs/tiers.md, "Integrity"); :func:`chunk_identity` is everything that
shapes a chunk's bytes, from which :class:`~kvtriton.integrations.remote.TierKeyspace`
derives the object keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtriton.integrations.remote._keyspace import ChunkIdentity
from kvtriton.integrations.vllm import KVIdentity, compression_tag, compute_identity, vllm_identity
from kvtriton.kernels import KVCompression

if TYPE_CHECKING:
    from kvtriton.integrations.vllm import OffloadingSpec

DEFAULT_LAYOUT_TAG = "vllm-cpu"
"""The layout tag of a primary that does not name its own: vLLM's CPU primary."""


def _layout_tag(spec: OffloadingSpec) -> str:
    """The layout tag ``spec``'s primary names, or vLLM's CPU primary's when it names none."""
    layout_tag = getattr(spec, "layout_tag", None)
    return layout_tag if isinstance(layout_tag, str) and layout_tag else DEFAULT_LAYOUT_TAG


def kv_identity(spec: OffloadingSpec, namespace: str) -> KVIdentity:
    """The identity fingerprint of the chunks ``spec``'s primary hands this tier (each holds every rank's bytes).

    Behind kvtriton's tiered spec, the spec's own identity (its ``identity``),
    salted with ``namespace``: the spec computed it from the real model folder,
    whereas the model name this tier sees is the spec's tier namespace. Behind
    vLLM's own primary, computed here: the layout is ``vllm-cpu``.
    """
    spec_identity: object = getattr(spec, "identity", None)
    if isinstance(spec_identity, KVIdentity):
        return compute_identity(spec_identity.parts, namespace=namespace, identity_key=spec_identity.identity_key)
    settings: object = getattr(spec, "settings", None)
    compression = getattr(settings, "kv_compression", None)
    return vllm_identity(
        spec.config,
        layout=_layout_tag(spec),
        compression=compression_tag(compression) if isinstance(compression, KVCompression) else None,
        rank=None,
        namespace=namespace,
    )


def chunk_identity(spec: OffloadingSpec, chunk_bytes: int, namespace: str, fingerprint: str = "") -> ChunkIdentity:
    """Everything in ``spec`` that shapes a chunk's bytes, plus the user namespace and the identity fingerprint."""
    config = spec.config
    parallel = config.parallel
    canonical = ""
    if config.canonical_layout and config.kv_cache_layout is not None:
        canonical = str(config.kv_cache_layout)
    return ChunkIdentity(
        model=config.model.name,
        dtype=str(config.model.dtype),
        tokens_per_block=tuple(group.tokens_per_block for group in config.groups),
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=spec.blocks_per_chunk,
        chunk_bytes=chunk_bytes,
        world_size=parallel.world_size,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        kv_groups=tuple(tuple(group.layer_names) for group in config.groups),
        layout_tag=_layout_tag(spec),
        canonical_format=canonical,
        namespace=namespace,
        fingerprint=fingerprint,
    )
