"""The identity fingerprint: one digest of everything that changes the KV bytes of a block.

Every chunk kvtriton hands a tier is sealed with it (:mod:`kvtriton._integrity`),
and the tiers kvtriton writes to file their keys under it, so a tier that holds
another model's KV (a fine-tune copied over the old weights, another dtype,
block size, page layout, rank or compression) answers a miss, never another
model's bytes.

What goes in (:class:`IdentityParts`)
    The model (name, revision when vLLM knows one, and :func:`weights_fingerprint`
    of its local files), the model dtype, the KV cache dtype, tokens per block,
    the page layout and geometry (kvtriton's layout tag, vLLM's KV cache
    layout, bytes per block, blocks per chunk, tokens per hash, the layer names
    of each KV cache group), the rank (None for a chunk that holds every rank's
    bytes) and the parallel sizes, kvtriton's :data:`~kvtriton._integrity.ROW_FORMAT_VERSION`
    and the compression scheme. The user's ``namespace`` is an extra salt.

What stays out
    Everything that does not change the bytes of a block: ``max_num_seqs``,
    ``gpu_memory_utilization``, ``max_model_len``, the tokenizer and every other
    file in the model folder that is not a weight file or ``config.json``.

``kvtriton_identity_key`` (:data:`IDENTITY_KEY`)
    Set in ``kv_connector_extra_config``, it replaces the model part of the
    fingerprint (name, revision, weights, model dtype) with the operator's
    word that the deployments run the same model: deployments that set the
    same key (and the same namespace) share a pool even when their model
    paths differ. The layout, geometry, KV dtype, rank, row format and
    compression stay computed: a key shared by mistake across two page layouts
    still cannot serve bytes of the wrong shape.

This module imports vLLM only inside :func:`vllm_identity`, so the parts and
the weights fingerprint are testable without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtriton._int_argument import check_int
from kvtriton._integrity import FINGERPRINT_BYTES, ROW_FORMAT_VERSION

if TYPE_CHECKING:
    from kvtriton.integrations.vllm._surface import OffloadingConfig, VllmConfig

logger = logging.getLogger(__name__)

IDENTITY_KEY = "kvtriton_identity_key"
"""The ``kv_connector_extra_config`` key whose value replaces the model part of the fingerprint."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")
"""File endings :func:`weights_fingerprint` reads as weights; ``config.json`` is read too."""

_SAMPLES_PER_FILE = 8
_SAMPLE_BYTES = 4096
_MAX_SAFETENSORS_HEADER = 64 << 20
"""A larger declared header is no safetensors header: it is sampled like any other bytes."""


def weights_fingerprint(model_dir: Path) -> str:
    """A cheap hex digest of the model's weights that changes when the weights do; never a full read.

    For each weight file (:data:`WEIGHT_SUFFIXES`, anywhere under
    ``model_dir``, by relative path): its name and size, a safetensors file's
    header (tensor names, dtypes, shapes and offsets), and
    ``_SAMPLES_PER_FILE`` samples of ``_SAMPLE_BYTES`` spread evenly from its
    first byte to its last. ``config.json`` is hashed whole. Other files
    (README, tokenizer, a stray log) stay out. Costs a few small reads per
    file, whatever the file's size. A folder without weight files gives the
    digest of its config alone.
    """
    state = hashlib.blake2b(digest_size=16)
    config = model_dir / "config.json"
    if config.is_file():
        state.update(b"config.json\0" + config.read_bytes())
    weight_files = sorted(
        path for path in model_dir.rglob("*") if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)
    )
    for path in weight_files:
        size = path.stat().st_size
        state.update(f"{path.relative_to(model_dir).as_posix()}\0{size}\0".encode())
        with path.open("rb") as weights:
            if path.suffix == ".safetensors" and size >= 8:
                (header_length,) = struct.unpack("<Q", weights.read(8))
                if header_length <= min(size - 8, _MAX_SAFETENSORS_HEADER):
                    state.update(weights.read(header_length))
            span = max(0, size - _SAMPLE_BYTES)
            for sample in range(_SAMPLES_PER_FILE):
                weights.seek(span * sample // (_SAMPLES_PER_FILE - 1))
                state.update(weights.read(_SAMPLE_BYTES))
    return state.hexdigest()


def resolve_model_dir(model: str, revision: str | None) -> Path | None:
    """The local folder of ``model``: itself when it is one, else its Hugging Face cache snapshot; None if neither.

    Looks only at the local cache (no network): vLLM has downloaded the
    weights before the offloading spec is built. The snapshot is the folder
    that holds the cached ``config.json`` of ``revision`` (default: main).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 -- no hub library or no usable cache: the same answer, no local weights to read
        return None
    return Path(config).parent if isinstance(config, str) else None


@dataclass(frozen=True, slots=True)
class IdentityParts:
    """Everything that changes the KV bytes of a block, as plain values (see the module docstring)."""

    model: str
    revision: str | None
    weights: str
    """:func:`weights_fingerprint` of the model's folder; empty when no local folder was found."""
    model_dtype: str
    kv_cache_dtype: str
    tokens_per_block: tuple[int, ...]
    """Of each KV cache group."""
    layout: str
    """The page layout: kvtriton's layout tag and vLLM's KV cache layout name."""
    bytes_per_block: int
    blocks_per_chunk: int
    tokens_per_hash: int
    kv_groups: tuple[tuple[str, ...], ...]
    """Layer names of each KV cache group."""
    rank: int | None
    """This rank's index; None when a chunk holds every rank's bytes (kvtriton's shared region)."""
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    compression: str
    """``none`` or the compression with its scale group (``fp8-e4m3-g128``)."""
    row_format_version: int = ROW_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("bytes_per_block", "blocks_per_chunk", "tokens_per_hash", "world_size", "tp_size", "pp_size"):
            check_int(name, getattr(self, name), 1)
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be None or in 0..{self.world_size - 1} (world_size), got {self.rank!r}")

    def model_fields(self) -> dict[str, object]:
        """The part an identity key replaces: which model, in which dtype."""
        return {
            "model": self.model,
            "revision": self.revision,
            "weights": self.weights,
            "model_dtype": self.model_dtype,
        }

    def byte_fields(self) -> dict[str, object]:
        """The part always computed: how the model's KV is laid out in a chunk."""
        fields = asdict(self)
        for name in self.model_fields():
            del fields[name]
        return fields


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """The fingerprint of one engine's (or rank's) chunks, with what made it."""

    fingerprint: bytes
    """:data:`~kvtriton._integrity.FINGERPRINT_BYTES` bytes: what the seal carries and the tiers' keys are filed under."""
    parts: IdentityParts
    namespace: str
    identity_key: str | None
    """The operator's key when one replaced the model part, else None."""

    @property
    def hex(self) -> str:
        return self.fingerprint.hex()

    @property
    def source(self) -> str:
        """``identity_key`` or ``computed``: what the start-up log line and the config info say."""
        return "identity_key" if self.identity_key is not None else "computed"

    def describe(self) -> str:
        """One line for the start-up log: the fingerprint, its source and the model part it stands for."""
        parts = self.parts
        model = (
            f"identity_key={self.identity_key!r}"
            if self.identity_key is not None
            else f"model={parts.model!r} revision={parts.revision} weights={parts.weights[:12] or 'none'} "
            f"model_dtype={parts.model_dtype}"
        )
        return (
            f"identity {self.hex} ({self.source}): {model} kv_dtype={parts.kv_cache_dtype} "
            f"block_size={','.join(map(str, parts.tokens_per_block))} layout={parts.layout} rank={parts.rank} "
            f"tp={parts.tp_size} pp={parts.pp_size} compression={parts.compression} "
            f"row_format=v{parts.row_format_version} namespace={self.namespace!r}"
        )


def compute_identity(parts: IdentityParts, *, namespace: str = "", identity_key: str | None = None) -> KVIdentity:
    """The fingerprint of ``parts`` salted with ``namespace``; ``identity_key`` replaces the model part.

    blake2b over canonical JSON of the fields, cut to
    :data:`~kvtriton._integrity.FINGERPRINT_BYTES`: the input is tiny and a
    cryptographic digest keeps two different identities from ever sharing one.
    """
    if not isinstance(namespace, str):  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
        raise ValueError(f"namespace must be a string, got {type(namespace).__name__} {namespace!r}")
    if identity_key is not None and (not isinstance(identity_key, str) or not identity_key.strip()):  # pyright: ignore[reportUnnecessaryIsInstance] -- JSON input
        raise ValueError(f"{IDENTITY_KEY} must be a non-empty string, got {identity_key!r}")
    model: Mapping[str, object] = {"identity_key": identity_key} if identity_key is not None else parts.model_fields()
    record = {"model": model, "bytes": parts.byte_fields(), "namespace": namespace}
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    fingerprint = hashlib.blake2b(canonical, digest_size=FINGERPRINT_BYTES).digest()
    return KVIdentity(fingerprint=fingerprint, parts=parts, namespace=namespace, identity_key=identity_key)


def parse_identity_key(extra_config: Mapping[str, object]) -> str | None:
    """``kv_connector_extra_config[IDENTITY_KEY]``, stripped; None when absent. Refuses a non-string or empty one."""
    if IDENTITY_KEY not in extra_config:
        return None
    raw = extra_config[IDENTITY_KEY]
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(
            f"kv_connector_extra_config[{IDENTITY_KEY!r}] must be a non-empty string, got {type(raw).__name__} {raw!r}"
        )
    return raw.strip()


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def identity_parts(
    config: OffloadingConfig,
    *,
    layout: str,
    compression: str | None,
    rank: int | None,
    model_revision: str | None = None,
    model_dtype: str | None = None,
    model_dir: Path | None = None,
) -> IdentityParts:
    """The parts of vLLM's ``OffloadingConfig`` plus what it leaves out, given as plain values.

    ``config.model.dtype`` is vLLM's resolved KV cache dtype; ``model_dtype``
    and ``model_revision`` come from vLLM's ``ModelConfig`` (see
    :func:`vllm_identity`); ``model_dir`` defaults to :func:`resolve_model_dir`.
    """
    folder = model_dir if model_dir is not None else resolve_model_dir(config.model.name, model_revision)
    kv_layout = config.kv_cache_layout or ""
    return IdentityParts(
        model=config.model.name,
        revision=model_revision,
        weights=weights_fingerprint(folder) if folder is not None else "",
        model_dtype=model_dtype or "",
        kv_cache_dtype=config.model.dtype,
        tokens_per_block=tuple(group.tokens_per_block for group in config.groups),
        layout=f"{layout};kv_cache_layout={kv_layout};canonical={config.canonical_layout}",
        bytes_per_block=config.worker_kv_bytes_per_block,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        tokens_per_hash=config.cache.tokens_per_hash,
        kv_groups=tuple(tuple(group.layer_names) for group in config.groups),
        rank=rank,
        world_size=config.parallel.world_size,
        tp_size=config.parallel.tp_size,
        pp_size=config.parallel.pp_size,
        pcp_size=config.parallel.pcp_size,
        dcp_size=config.parallel.dcp_size,
        compression=compression or "none",
    )


def vllm_identity(
    config: OffloadingConfig,
    *,
    layout: str,
    compression: str | None,
    rank: int | None,
    namespace: str = "",
    vllm_config: VllmConfig | None = None,
) -> KVIdentity:
    """The identity of the chunks a kvtriton spec built from ``config`` hands its tiers.

    ``layout`` is the spec's layout tag (``vllm-cpu`` for vLLM's own rows);
    ``compression`` :func:`~kvtriton.integrations.vllm._config.compression_tag`'s
    answer; ``rank`` this rank's index, or None for chunks that hold every
    rank's bytes. The model's revision and dtype come from ``vllm_config``,
    by default the one vLLM's connector is being built from
    (:func:`~kvtriton.integrations.vllm._surface.connector_vllm_config`: the
    same in the engine core and in every worker); when there is none they
    stay empty and the rest still counts. The identity key is read from
    ``config.extra_config``.
    """
    if vllm_config is None:
        from kvtriton.integrations.vllm._surface import connector_vllm_config

        vllm_config = connector_vllm_config()
    revision: str | None = None
    model_dtype: str | None = None
    if vllm_config is not None:
        model_config = vllm_config.model_config
        revision = model_config.revision
        model_dtype = _dtype_name(model_config.dtype)
    parts = identity_parts(
        config, layout=layout, compression=compression, rank=rank, model_revision=revision, model_dtype=model_dtype
    )
    return compute_identity(parts, namespace=namespace, identity_key=parse_identity_key(config.extra_config))
