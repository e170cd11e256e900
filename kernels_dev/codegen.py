"""What the production kernel compiles to, without a GPU: access widths and index arithmetic.

Compiles :func:`copy_pages_kernel` for ``sm_90`` with the configuration that a
real launch would use for a page size (see :func:`kvtriton.kernels._launch.launch_config`), then reads the
PTX (global load/store widths) and the TTIR (integer multiplies). The kernel
tests use this as a quality gate; ``bench/kernels.py --ptx`` prints it next to
the descriptor-per-copy baseline. A development tool: it lives in
``kernels_dev/``, outside the wheel, where both the tests and bench import it.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtriton.kernels import DEFAULT_BYTES_PER_ITER, compression_layout
from kvtriton.kernels._launch import LaunchConfig, compress_config, make_config
from kvtriton.kernels._launch_arguments import MAX_NUM_WARPS, CompressConfig, word_width

_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[a-z0-9]+)*)\s")
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.MULTILINE)
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_THREADS = re.compile(r"\.reqntid\s+(\d+)")
_PTX_MUL32 = re.compile(r"\b(?:mul|mad)\.lo\.[su]32\b")
# Scalar (``: i64``) and tensor (``: tensor<16xi64>``) multiplies; the element type is what can wrap.
_TTIR_MULI = re.compile(r"arith\.muli\s+(%[\w.#]+),\s*(%[\w.#]+)\s*:\s*(?:tensor<(?:\d+x)*)?(i\d+)")

_BITS = {"b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "b32": 32, "u32": 32, "s32": 32, "f32": 32,
         "b64": 64, "u64": 64, "s64": 64, "f64": 64}  # fmt: skip  # a table: the widths in rows


@dataclass(frozen=True, slots=True)
class AccessSummary:
    """Global memory instructions of one kernel, counted by access width in bytes per thread."""

    loads: dict[int, int]
    stores: dict[int, int]

    @property
    def widest_load(self) -> int:
        return max(self.loads, default=0)

    @property
    def widest_store(self) -> int:
        return max(self.stores, default=0)

    def describe(self) -> str:
        def side(counts: dict[int, int]) -> str:
            return " ".join(f"{width}B x{count}" for width, count in sorted(counts.items(), reverse=True)) or "-"

        return f"loads {side(self.loads)} | stores {side(self.stores)}"


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    """Assembly of one kernel configuration, with the questions the quality gate asks."""

    name: str
    ptx: str
    ttir: str

    def accesses(self) -> AccessSummary:
        """Every global access instruction of the kernel, counted once each."""
        return _count_accesses(self.ptx)

    def loop_accesses(self) -> AccessSummary:
        """The global accesses inside the copy loop: what one thread issues per iteration."""
        return _count_accesses(self.loop_body())

    def loop_instructions(self, opcode: str) -> int:
        """How many ``opcode`` instructions (``div.rn.f32``, say) one thread runs per copy-loop iteration."""
        return len(re.findall(rf"^\s*{re.escape(opcode)}\s", self.loop_body(), re.MULTILINE))

    def loop_body(self) -> str:
        """The PTX of the copy loop.

        A candidate body is the PTX between the label that a backward branch
        jumps to and that branch; the copy loop is the shortest one that
        stores (the copy kernel has one loop, the persistent one; in the
        descriptor kernel it is the inner loop, not an outer-loop latch that
        the compiler placed above it).
        """
        labels = {match.group(1): match.start() for match in _LABEL.finditer(self.ptx)}
        bodies = [
            self.ptx[labels[branch.group(1)] : branch.start()]
            for branch in _BRANCH.finditer(self.ptx)
            if labels.get(branch.group(1), branch.start()) < branch.start()
        ]
        for body in sorted(bodies, key=len):
            if _count_accesses(body).stores:
                return body
        raise ValueError(f"{self.name}: no loop (backward branch) with a global store in the PTX")

    @property
    def threads(self) -> int:
        """Threads per program (``.reqntid`` in the PTX: 32 x num_warps)."""
        match = _THREADS.search(self.ptx)
        if match is None:
            raise ValueError(f"{self.name}: the PTX declares no .reqntid thread count")
        return int(match.group(1))

    def loop_bytes_loaded(self, width: int = 16) -> int:
        """Bytes one program loads per loop iteration with ``width``-byte accesses (all threads)."""
        return self.loop_accesses().loads.get(width, 0) * width * self.threads

    def multiplies(self) -> list[str]:
        """TTIR integer multiplies as ``"lhs * rhs : type"`` (the element type for tensors)."""
        return [f"{lhs} * {rhs} : {ty}" for lhs, rhs, ty in _TTIR_MULI.findall(self.ttir)]

    def narrow_multiplies(self) -> list[str]:
        """32-bit (or narrower) multiplies in the TTIR and the PTX; each could wrap an address."""
        narrow = [m for m in self.multiplies() if not m.endswith(": i64")]
        return narrow + _PTX_MUL32.findall(self.ptx)


def _count_accesses(ptx: str) -> AccessSummary:
    counts: dict[str, collections.Counter[int]] = {"ld": collections.Counter(), "st": collections.Counter()}
    for kind, suffix in _ACCESS.findall(ptx):
        parts = suffix.strip(".").split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((_BITS[p] for p in parts if p in _BITS), 0)
        counts[kind][vector * bits // 8] += 1
    return AccessSummary(loads=dict(counts["ld"]), stores=dict(counts["st"]))


def production_config(page_bytes: int, num_pages: int, bytes_per_iter: int = DEFAULT_BYTES_PER_ITER) -> LaunchConfig:
    """The launch configuration for uniform pages of ``page_bytes`` with 16-byte aligned bases and slab.

    What :func:`kvtriton.kernels._launch.launch_config` picks in the usual case, in which
    the word width is set by the page size alone.
    """
    return make_config(word_width(page_bytes), [page_bytes] * num_pages, bytes_per_iter)


_ELEMENT_TYPES = {8: "i64", 4: "i32", 2: "i16", 1: "i8"}


def compile_copy_pages(
    config: LaunchConfig, *, to_slab: bool, index_type: str = "i64", arch: int = 90
) -> CompiledKernel:
    """Compile the gather (``to_slab``) or scatter kernel for ``config`` on ``sm_<arch>``."""
    from .compile_asm import compile_asm

    element = _ELEMENT_TYPES[config.element_bytes]
    asm = compile_asm(
        "copy_pages",
        signature={
            "table_ptr": "*i64",
            "slab_ptr": f"*{element}",
            "blocks_ptr": f"*{index_type}",
            "rows_ptr": f"*{index_type}",
            "num_pairs": "i32",
            "row_stride": "i64",
        },
        constexprs={
            "TO_SLAB": to_slab,
            "NUM_PAGES": config.num_pages,
            "PAGE_ELEMS": config.page_elems,
            "CHUNK": config.chunk,
            "PAIRS": config.pairs,
            "UNIFORM": config.uniform,
            "EVEN": config.even,
            "WORD": config.word,
        },
        # What Triton's launcher specialises for 16-byte aligned tensors and a
        # slab row stride that is a multiple of 16 elements.
        divisible_by_16=["table_ptr", "slab_ptr", "blocks_ptr", "rows_ptr", "row_stride"],
        num_warps=config.num_warps,
        arch=arch,
    )
    kind = "gather" if to_slab else "scatter"
    return CompiledKernel(name=f"{kind} {config.page_elems * config.element_bytes} B", ptx=asm["ptx"], ttir=asm["ttir"])


def compile_descriptor_copy(*, block: int = 1024, arch: int = 90) -> CompiledKernel:
    """Compile the vLLM-style descriptor-per-copy baseline (``kernels/_jit/descriptor_copy.py``)."""
    from .compile_asm import compile_asm

    asm = compile_asm(
        "descriptor_copy",
        signature={"descriptors_ptr": "*i64", "num_descriptors": "i64"},
        constexprs={"BLOCK": block},
        divisible_by_16=["descriptors_ptr"],
        num_warps=MAX_NUM_WARPS,
        arch=arch,
    )
    return CompiledKernel(name="descriptor-per-copy", ptx=asm["ptx"], ttir=asm["ttir"])


def _compile_compress(config: CompressConfig, to_slab: bool, arch: int) -> dict[str, str]:
    from .compile_asm import compile_asm

    return compile_asm(
        "compress_pages",
        signature={
            "table_ptr": "*i64",
            "slab_ptr": "*u8",
            "blocks_ptr": "*i64",
            "rows_ptr": "*i64",
            "status_ptr": "*i32",
            "num_pairs": "i32",
            "row_stride": "i64",
        },
        constexprs=config.kernel_constexprs(to_slab),
        divisible_by_16=["table_ptr", "slab_ptr", "blocks_ptr", "rows_ptr", "status_ptr", "row_stride"],
        num_warps=config.num_warps,
        arch=arch,
    )


def compile_compress_pages(requests: Sequence[tuple[CompressConfig, bool]], *, arch: int = 90) -> list[CompiledKernel]:
    """Compile the fused fp8 gather (``to_slab`` True: quantize) or scatter kernel for each ``(config, to_slab)``."""
    return [
        CompiledKernel(
            name=f"{'fp8 gather' if to_slab else 'fp8 scatter'} {config.elements * config.element_bytes} B",
            ptx=asm["ptx"],
            ttir=asm["ttir"],
        )
        for config, to_slab in requests
        for asm in [_compile_compress(config, to_slab, arch)]
    ]


def compressed_production_config(
    page_bytes: int,
    num_pages: int,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = 128,
    bytes_per_iter: int = DEFAULT_BYTES_PER_ITER,
) -> CompressConfig:
    """The compressed launch configuration for ``num_pages`` 16-byte aligned pages of ``page_bytes`` of ``dtype``."""
    page = torch.empty((1, page_bytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype)
    (entry,) = compression_layout([page], group_size).pages
    return compress_config(entry, num_pages, bytes_per_iter, page_word=word_width(page_bytes), slab_word=16)
