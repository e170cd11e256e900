"""Model geometry: how many bytes one offloaded KV block holds, and host memory sizes in bytes.

Capacity planning speaks in bytes (vLLM's ``cpu_bytes_to_use``) while the
manager counts slots; the geometry of the model's KV cache (layers, KV heads,
head dim, dtype, tokens per block) converts one into the other. Sizes are
parsed and printed by the core's rule (``kvtriton._byte_units``). Pure arithmetic: no torch, so ``kvtriton simulate``
stays scheduler-side and fast -- except :meth:`ModelGeometry.with_compression`,
which asks the compression format itself (``compression_layout``) what a
compressed block takes, and imports torch only then.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvtriton._byte_units import (
    BARE_NUMBER_UNIT as BARE_NUMBER_UNIT,
)
from kvtriton._byte_units import (
    SIZE_RULE as SIZE_RULE,
)
from kvtriton._byte_units import (
    format_bytes as format_bytes,
)
from kvtriton._byte_units import (
    is_bare_number as is_bare_number,
)
from kvtriton._byte_units import (
    parse_capacity as parse_capacity,
)
from kvtriton._byte_units import (
    parse_capacity_list as parse_capacity_list,
)
from kvtriton._byte_units import (
    size_argument as size_argument,
)
from kvtriton._byte_units import (
    size_list_argument as size_list_argument,
)

# One size rule for the command line and the serving logs; the parsers are named here too until every caller
# imports them from the core.
from kvtriton._int_argument import check_int
from kvtriton._region_rows import block_row_stride

GIB = 2**30

MAX_HOST_BYTES = 2**47
"""The largest host memory size the planner takes: 128 TiB, the user address space of one x86-64 process (47
bits), into which a vLLM worker maps its slab, and more RAM than any one server holds."""
MAX_TIER_BYTES = 2**50
"""The largest second-tier size the planner takes: 1 PiB, a Mooncake pool of 128 holders of 8 TiB each, beyond
any deployment the tier models were written for."""


def _check_bound(size: int, text: str, maximum: int, what: str) -> None:
    if size > maximum:
        raise ValueError(
            f"{text.strip()!r} is {format_bytes(size)}, above the planner's bound of {format_bytes(maximum)} for {what}:"
            " give a smaller size (a bare number is GiB)"
        )


def check_host_bytes(size: int, text: str) -> None:
    """ValueError for a host memory size (typed as ``text``) above :data:`MAX_HOST_BYTES`, saying why that bound."""
    _check_bound(
        size,
        text,
        MAX_HOST_BYTES,
        "host memory (a vLLM worker maps its slab into one x86-64 process's 128 TiB of user address space, and"
        " no server holds that much RAM)",
    )


def check_tier_bytes(size: int, text: str) -> None:
    """ValueError for a second-tier size (typed as ``text``) above :data:`MAX_TIER_BYTES`, saying why that bound."""
    _check_bound(size, text, MAX_TIER_BYTES, "a second tier (a pool of 128 holders of 8 TiB each)")


class KVDtype(enum.Enum):
    """Element types a KV cache is stored in."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE: dict[KVDtype, int] = {KVDtype.FLOAT32: 4, KVDtype.FLOAT16: 2, KVDtype.BFLOAT16: 2, KVDtype.FP8: 1}


_DTYPE_NAMES: dict[str, KVDtype] = {
    "float32": KVDtype.FLOAT32,
    "fp32": KVDtype.FLOAT32,
    "float16": KVDtype.FLOAT16,
    "fp16": KVDtype.FLOAT16,
    "half": KVDtype.FLOAT16,
    "bfloat16": KVDtype.BFLOAT16,
    "bf16": KVDtype.BFLOAT16,
    "fp8": KVDtype.FP8,
    "fp8_e4m3": KVDtype.FP8,
    "fp8_e5m2": KVDtype.FP8,
}


def parse_dtype(name: str) -> KVDtype:
    """Parse a dtype name as vLLM's ``--kv-cache-dtype`` spells it (``bf16``, ``fp8``, ...)."""
    dtype = _DTYPE_NAMES.get(name.strip().lower())
    if dtype is None:
        raise ValueError(f"dtype must be one of {', '.join(sorted(_DTYPE_NAMES))}, got {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shape of a model's KV cache, summed over all layers (and all TP ranks).

    ``kv_factor`` is 2 for attention that caches K and V separately and 1 for
    MLA, whose latent vector (``head_dim`` wide, one "head") holds both.
    ``block_size`` is the number of tokens in one offloaded block.

    ``compression`` is how host memory stores a block (``"none"``, or the
    lossy ``"fp8-e4m3"`` with ``compressed_bytes_per_block`` its compressed
    row; build it with :meth:`with_compression`). ``bytes_per_block`` stays
    the KV cache's own bytes; :attr:`stored_bytes_per_block` is what a block
    takes in host memory and moves per copy, so :meth:`blocks_for` counts the
    slots a size buys in it.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype
    block_size: int = 16
    kv_factor: int = 2
    compression: str = "none"
    compressed_bytes_per_block: int | None = None
    compression_group_size: int | None = None
    """Elements per fp8 scale (None without compression)."""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            check_int(field_name, getattr(self, field_name), minimum=1)
        if self.kv_factor not in (1, 2):
            raise ValueError(f"kv_factor must be 1 (MLA) or 2 (K and V), got {self.kv_factor!r}")
        if (self.compression == "none") != (self.compressed_bytes_per_block is None):
            raise ValueError(
                f"compressed_bytes_per_block ({self.compressed_bytes_per_block!r}) is set exactly when compression is"
                f" not 'none', got compression {self.compression!r}; build it with with_compression()"
            )

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """The KV cache's own bytes of one block (uncompressed)."""
        return self.bytes_per_token * self.block_size

    @property
    def stored_bytes_per_block(self) -> int:
        """Bytes one block takes in host memory and moves per copy: the compressed row with compression."""
        return self.bytes_per_block if self.compressed_bytes_per_block is None else self.compressed_bytes_per_block

    @property
    def tiered_chunk_bytes(self) -> int:
        """One chunk of the tiered spec's shared region, as its tiers store it: a stored block plus room for its
        64-byte seal, padded to 4 KiB (the region's layout; tiny blocks grow most)."""
        return block_row_stride(1, 1, self.stored_bytes_per_block)

    @property
    def compression_ratio(self) -> float:
        """Stored over raw bytes per block: 1.0 uncompressed, about 0.52 for bf16 with fp8-e4m3."""
        return self.stored_bytes_per_block / self.bytes_per_block

    def blocks_for(self, capacity_bytes: int) -> int:
        """How many whole blocks fit in ``capacity_bytes`` of host memory (stored as :attr:`stored_bytes_per_block`)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        return capacity_bytes // self.stored_bytes_per_block

    def with_compression(self, compression: str, group_size: int | None = None) -> ModelGeometry:
        """This geometry with host memory storing blocks as ``compression`` (``"none"`` or ``"fp8-e4m3"``).

        The compressed row is the engine's own: ``compression_layout`` of one
        layer's page tensors as the flash_attn layout hands them to the engine
        (K and V pages of ``block_size x num_kv_heads x head_dim``; MLA's one
        latent page), times the layers. ``group_size`` is the elements per
        fp8 scale (default: the head dimension, as ``PagedKV`` uses). fp8
        caches pass through unchanged (ratio 1). Imports torch.
        """
        from kvtriton.kernels import KVCompression

        parsed = KVCompression.parse(compression, "compression")
        if parsed is KVCompression.NONE:
            if group_size is not None:
                raise ValueError(f"group_size applies only with compression 'fp8-e4m3', got group_size {group_size}")
            return dataclasses.replace(
                self, compression="none", compressed_bytes_per_block=None, compression_group_size=None
            )
        if group_size is not None:
            check_int("group_size", group_size, minimum=1)
        import torch

        from kvtriton.kernels import compression_layout

        dtype = {
            KVDtype.FLOAT32: torch.float32, KVDtype.FLOAT16: torch.float16,
            KVDtype.BFLOAT16: torch.bfloat16, KVDtype.FP8: torch.float8_e4m3fn,
        }[self.dtype]  # fmt: skip  # a table: one dtype per line
        shape = (1, self.block_size, self.num_kv_heads, self.head_dim)
        pages = [torch.empty(shape, dtype=dtype, device="meta") for _ in range(self.kv_factor)]
        size = self.head_dim if group_size is None else group_size
        layer = compression_layout(pages, size)
        return dataclasses.replace(
            self,
            compression=parsed.value,
            compressed_bytes_per_block=self.num_layers * layer.row_bytes,
            compression_group_size=size,
        )

    def describe(self) -> str:
        text = (
            f"{self.name}: {self.num_layers} layers x {self.kv_factor} x {self.num_kv_heads} KV heads"
            f" x {self.head_dim} head dim x {self.dtype.value}, {self.block_size} tokens/block"
            f" = {format_bytes(self.bytes_per_block)} per block"
        )
        if self.compression != "none":
            text += (
                f"; stored {self.compression} (G = {self.compression_group_size}) as"
                f" {format_bytes(self.stored_bytes_per_block)} per block ({self.compression_ratio:.3f}x)"
            )
        return text


def _preset(name: str, layers: int, kv_heads: int, head_dim: int, kv_factor: int = 2) -> ModelGeometry:
    return ModelGeometry(name, layers, kv_heads, head_dim, KVDtype.BFLOAT16, 16, kv_factor)


PRESETS: dict[str, ModelGeometry] = {
    geometry.name: geometry
    for geometry in (
        _preset("llama-3-8b", 32, 8, 128),
        _preset("llama-3-70b", 80, 8, 128),
        _preset("llama-3-405b", 126, 8, 128),
        _preset("mistral-7b", 32, 8, 128),
        _preset("qwen2.5-7b", 28, 4, 128),
        _preset("qwen3-8b", 36, 8, 128),
        _preset("qwen3-32b", 64, 8, 128),
        # MLA: one 512-wide latent plus a 64-wide rope key per token and layer.
        _preset("deepseek-v3", 61, 1, 576, kv_factor=1),
    )
}
"""Published KV shapes of common models, bf16, 16 tokens per block."""
