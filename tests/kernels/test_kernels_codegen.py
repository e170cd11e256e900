"""Compile-only quality gate: what the production kernels compile to for sm_90, checked on a CPU machine."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

from kernels_dev.codegen import CompiledKernel, compile_copy_pages, compile_descriptor_copy, production_config
from kvtriton.kernels import DEFAULT_BYTES_PER_ITER

REPO = Path(__file__).resolve().parents[2]

# A Llama-3-8B-shaped job: 32 layers x (K, V) page tensors.
NUM_PAGES = 64


@functools.cache
def compiled(page_bytes: int, to_slab: bool, index_type: str = "i64") -> CompiledKernel:
    from kernels_dev.compile_asm import UnsupportedTriton

    try:
        return compile_copy_pages(production_config(page_bytes, NUM_PAGES), to_slab=to_slab, index_type=index_type)
    except UnsupportedTriton as error:  # pragma: no cover - depends on the installed Triton
        pytest.skip(str(error))


KINDS = pytest.mark.parametrize("to_slab", [True, False], ids=["gather", "scatter"])


@KINDS
@pytest.mark.parametrize("page_bytes", [1024, 4096, 16384, 32768])
def test_aligned_pages_use_16_byte_global_loads_and_stores(page_bytes: int, to_slab: bool) -> None:
    accesses = compiled(page_bytes, to_slab).accesses()
    # Every data access is a 16-byte vector (ld/st.global.v2.b64 or v4.b32); the
    # only narrower loads are the scalar index and page-table reads (<= 8 B).
    assert accesses.widest_load == 16
    assert set(accesses.stores) == {16}, accesses.describe()
    ptx = compiled(page_bytes, to_slab).ptx
    assert "st.global.v2.b64" in ptx or "st.global.v4.b32" in ptx


@pytest.mark.parametrize("page_bytes", [1024, 4096, 32768])
def test_gather_stores_into_the_slab_pointer_are_16_bytes_wide(page_bytes: int) -> None:
    # In the gather kernel every store goes to the slab (a real pointer argument).
    kernel = compiled(page_bytes, True)
    assert kernel.accesses().stores == {16: kernel.accesses().stores[16]}
    assert "copy_pages_kernel_param_1" in kernel.ptx  # the slab parameter exists as a pointer


@KINDS
@pytest.mark.parametrize("index_type", ["i32", "i64"])
def test_block_and_row_offsets_are_multiplied_in_64_bits(to_slab: bool, index_type: str) -> None:
    kernel = compiled(32768, to_slab, index_type)
    multiplies = kernel.multiplies()
    assert any("%block" in m and "%block_stride" in m and m.endswith(": i64") for m in multiplies), multiplies
    assert any("%row" in m and "%row_stride" in m and m.endswith(": i64") for m in multiplies), multiplies
    assert kernel.narrow_multiplies() == []


@KINDS
@pytest.mark.parametrize("index_type", ["i32", "i64"])
def test_a_tile_of_pairs_multiplies_its_block_and_row_vectors_in_64_bits(to_slab: bool, index_type: str) -> None:
    # 1 KiB pages: 16 pairs per tile, block and row ids loaded as 16-element vectors.
    kernel = compiled(1024, to_slab, index_type)
    multiplies = kernel.multiplies()
    assert any(m.startswith("%block") and m.endswith(": i64") for m in multiplies), multiplies
    assert any(m.startswith("%row") and m.endswith(": i64") for m in multiplies), multiplies
    assert kernel.narrow_multiplies() == []


@KINDS
@pytest.mark.parametrize("page_bytes", [1024, 4096, 16384, 32768])
def test_one_loop_iteration_keeps_bytes_per_iter_of_16_byte_loads_in_flight(page_bytes: int, to_slab: bool) -> None:
    # Host reads are latency-bound: whatever the page size, one iteration of one
    # program issues at least bytes_per_iter / 16 sixteen-byte loads (and as
    # many stores), not one page's worth (1 KiB pages used to move 1 KiB).
    kernel = compiled(page_bytes, to_slab)
    loop = kernel.loop_accesses()
    wanted = DEFAULT_BYTES_PER_ITER // 16
    assert loop.loads.get(16, 0) * kernel.threads >= wanted, (kernel.threads, loop.describe())
    assert loop.stores.get(16, 0) * kernel.threads >= wanted, (kernel.threads, loop.describe())
    assert kernel.loop_bytes_loaded() >= DEFAULT_BYTES_PER_ITER


def test_the_loop_body_is_found_between_the_backward_branch_and_its_label() -> None:
    ptx = """
    ld.global.b64 {%rd1}, [%rd2 + 0];
$L__BB0_2:
    ld.global.v2.b64 {%rd3, %rd4}, [%rd5 + 0];
    st.global.v2.b64 [%rd6 + 0], {%rd3, %rd4};
    @%p2 bra $L__BB0_2;
$L__BB0_3:
    st.global.b32 [%rd7 + 0], %r1;
    .reqntid 64
"""
    kernel = CompiledKernel(name="toy", ptx=ptx, ttir="")
    assert kernel.loop_accesses().loads == {16: 1} and kernel.loop_accesses().stores == {16: 1}
    assert kernel.accesses().loads == {8: 1, 16: 1}
    assert kernel.threads == 64 and kernel.loop_bytes_loaded() == 16 * 64
    with pytest.raises(ValueError, match="no loop"):
        CompiledKernel(name="straight", ptx="ld.global.b64 {%rd1}, [%rd2];", ttir="").loop_accesses()


def test_the_loop_body_is_the_copy_loop_not_an_outer_latch_placed_above_it() -> None:
    # The compiler may put an outer loop's latch block before a backward branch
    # that is shorter than the copy loop (the descriptor kernel does).
    ptx = """
$L__BB0_5:
    @!%p12 bra $L__BB0_6;
$L__BB0_2:
    ld.global.b64 {%rd13}, [%rd14 + 0];
    @%p2 bra $L__BB0_5;
$L__BB0_4:
    @%p3 ld.global.b64 {%rd22}, [%rd23 + 0];
    @%p3 ld.global.b64 {%rd24}, [%rd25 + 0];
    @%p3 st.global.b64 [%rd38 + 0], {%rd22};
    @%p3 st.global.b64 [%rd39 + 0], {%rd24};
    @%p11 bra $L__BB0_4;
    bra.uni $L__BB0_5;
$L__BB0_6:
"""
    loop = CompiledKernel(name="nested", ptx=ptx, ttir="").loop_accesses()
    assert loop.loads == {8: 2} and loop.stores == {8: 2}


def test_tensor_multiplies_are_reported_with_their_element_type() -> None:
    ttir = """
    %a = arith.muli %block_15, %page_start : tensor<16xi64> loc(#loc70)
    %b = arith.muli %row, %stride : tensor<4x8xi32> loc(#loc71)
    %c = arith.muli %page, %c4_i64 : i64 loc(#loc72)
"""
    kernel = CompiledKernel(name="toy", ptx="", ttir=ttir)
    assert kernel.multiplies() == ["%block_15 * %page_start : i64", "%row * %stride : i32", "%page * %c4_i64 : i64"]
    assert kernel.narrow_multiplies() == ["%row * %stride : i32"]


@KINDS
def test_a_656_byte_page_still_moves_16_byte_words(to_slab: bool) -> None:
    assert set(compiled(656, to_slab).accesses().stores) == {16}


@KINDS
def test_a_4097_byte_page_falls_back_to_byte_accesses(to_slab: bool) -> None:
    # Block addresses base + b * 4097 are byte aligned only: no wider word is safe.
    assert set(compiled(4097, to_slab).accesses().stores) == {1}


def test_the_descriptor_per_copy_baseline_compiles_to_8_byte_scalar_accesses() -> None:
    from kernels_dev.compile_asm import UnsupportedTriton

    try:
        accesses = compile_descriptor_copy().accesses()
    except UnsupportedTriton as error:  # pragma: no cover - depends on the installed Triton
        pytest.skip(str(error))
    assert accesses.widest_load == 8 and accesses.widest_store == 8


@KINDS
@pytest.mark.parametrize("page_bytes", [8, 32768], ids=["tile-of-pairs", "one-pair-per-unit"])
@pytest.mark.parametrize("constant", ["num_pairs", "row_stride"])
def test_a_kernel_argument_that_triton_specialises_to_the_constant_1_still_compiles(
    to_slab: bool, constant: str, page_bytes: int
) -> None:
    # Triton's launcher turns an int argument equal to 1 into a compile-time
    # constant (a plain int in the body): a one-pair job, or a one-element row
    # stride, must compile as well as the general case, in both code paths.
    from kernels_dev.compile_asm import UnsupportedTriton, compile_asm

    config = production_config(page_bytes, 2)
    assert (config.pairs > 1) == (page_bytes < DEFAULT_BYTES_PER_ITER)
    signature = {"table_ptr": "*i64", "slab_ptr": "*i64", "blocks_ptr": "*i64", "rows_ptr": "*i64",
                 "num_pairs": "i32", "row_stride": "i64"}  # fmt: skip
    del signature[constant]
    constexprs: dict[str, int | bool] = {
        constant: 1, "TO_SLAB": to_slab, "NUM_PAGES": config.num_pages, "PAGE_ELEMS": config.page_elems,
        "CHUNK": config.chunk, "PAIRS": config.pairs, "UNIFORM": config.uniform, "EVEN": config.even, "WORD": config.word,
    }  # fmt: skip
    try:
        asm = compile_asm(
            "copy_pages", signature=signature, constexprs=constexprs, divisible_by_16=[], num_warps=config.num_warps
        )
    except UnsupportedTriton as error:  # pragma: no cover - depends on the installed Triton
        pytest.skip(str(error))
    assert "st.global" in asm["ptx"]


def test_the_compiled_kernel_never_specialises_the_pair_count() -> None:
    # One compiled variant serves every job size (no recompile for 1 pair or a multiple of 16 pairs).
    from kvtriton.kernels._jit.copy_pages import VARIANTS

    # A JITFunction; its parameter records (KernelParam) are Triton internals, read untyped.
    kernel = cast(object, VARIANTS.kernel(False))
    params = cast("list[object]", getattr(kernel, "params"))
    skipped = {cast(str, getattr(param, "name")) for param in params if getattr(param, "do_not_specialize")}
    assert skipped == {"num_pairs"}


@KINDS
def test_mixed_page_sizes_in_one_launch_fall_to_8_byte_accesses_so_the_launcher_splits_them(to_slab: bool) -> None:
    # The per-page mask bound read from the table cannot be proven aligned: one launch over 1 KiB and
    # 4 KiB pages moves 8 bytes per access. CopyLauncher launches each page size on its own (uniform).
    from kernels_dev.compile_asm import UnsupportedTriton
    from kvtriton.kernels._launch import make_config, page_size_groups

    sizes = [1024, 4096] * 8
    try:
        mixed = compile_copy_pages(make_config(16, sizes, DEFAULT_BYTES_PER_ITER), to_slab=to_slab)
    except UnsupportedTriton as error:  # pragma: no cover - depends on the installed Triton
        pytest.skip(str(error))
    assert max(mixed.accesses().stores) == 8, mixed.accesses().describe()
    for group in page_size_groups(sizes):
        config = make_config(16, [sizes[t] for t in group], DEFAULT_BYTES_PER_ITER)
        assert config.uniform
        assert set(compile_copy_pages(config, to_slab=to_slab).accesses().stores) == {16}


# Every fp8 variant the tests read, compiled once.
COMPRESSED_VARIANTS = [
    (1024, "bf16", True), (4096, "bf16", True), (32768, "bf16", True), (32768, "fp32", True),
    (1024, "bf16", False), (4096, "fp16", False), (32768, "bf16", False),
]  # fmt: skip


@functools.cache
def compressed_kernels() -> dict[tuple[int, str, bool], CompiledKernel]:
    import torch

    from kernels_dev.codegen import compile_compress_pages, compressed_production_config
    from kernels_dev.compile_asm import UnsupportedTriton

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    requests = [
        (compressed_production_config(size, NUM_PAGES, dtypes[name]), to_slab)
        for size, name, to_slab in COMPRESSED_VARIANTS
    ]
    try:
        kernels = compile_compress_pages(requests)
    except UnsupportedTriton as error:  # pragma: no cover - depends on the installed Triton
        pytest.skip(str(error))
    return dict(zip(COMPRESSED_VARIANTS, kernels))


def compiled_compressed(page_bytes: int, to_slab: bool, dtype_name: str = "bf16") -> CompiledKernel:
    return compressed_kernels()[(page_bytes, dtype_name, to_slab)]


@pytest.mark.parametrize(("page_bytes", "dtype_name"), [(4096, "bf16"), (32768, "bf16"), (32768, "fp32")])
def test_the_fp8_gather_reads_pages_and_writes_codes_in_16_byte_words(page_bytes: int, dtype_name: str) -> None:
    # Quantizing while copying keeps the page side at 16-byte loads; the codes go out as 16-byte
    # stores, only the fp32 scales (4 bytes per group) are narrower.
    loop = compiled_compressed(page_bytes, True, dtype_name).loop_accesses()
    assert loop.widest_load == 16 and loop.loads[16] >= 2, loop.describe()
    assert set(loop.stores) <= {16, 4} and 16 in loop.stores, loop.describe()


@pytest.mark.parametrize(("page_bytes", "dtype_name"), [(4096, "bf16"), (32768, "bf16"), (32768, "fp32")])
def test_the_fp8_gather_divides_once_per_group_not_once_per_element(page_bytes: int, dtype_name: str) -> None:
    # An IEEE division is a dozen instructions; per element it would make the gather compute-bound.
    # Per group there are two (the scale and its reciprocal), the elements multiply.
    kernel = compiled_compressed(page_bytes, True, dtype_name)
    elements = kernel.loop_accesses().loads[16] * 16 // (4 if dtype_name == "fp32" else 2)
    divisions = kernel.loop_instructions("div.rn.f32")
    assert 0 < divisions and 4 * divisions <= elements, (divisions, elements)


@pytest.mark.parametrize(("page_bytes", "dtype_name"), [(4096, "fp16"), (32768, "bf16")])
def test_the_fp8_scatter_writes_pages_in_16_byte_words(page_bytes: int, dtype_name: str) -> None:
    loop = compiled_compressed(page_bytes, False, dtype_name).loop_accesses()
    assert set(loop.stores) == {16}, loop.describe()


@KINDS
def test_the_fp8_kernels_multiply_block_and_row_offsets_in_64_bits(to_slab: bool) -> None:
    kernel = compiled_compressed(32768, to_slab, "bf16")
    assert kernel.narrow_multiplies() == []
    assert any("%block" in m and m.endswith(": i64") for m in kernel.multiplies()), kernel.multiplies()


@pytest.mark.parametrize(
    ("page_bytes", "to_slab"), [(1024, True), (4096, True), (32768, True), (1024, False), (32768, False)]
)
def test_one_fp8_loop_iteration_moves_bytes_per_iter_of_page_bytes_in_16_byte_words(
    page_bytes: int, to_slab: bool
) -> None:
    # As in the copy kernel, small pages stack several index pairs per tile: every iteration of a
    # program reads (gather) or writes (scatter) bytes_per_iter of page bytes, whatever the page size.
    kernel = compiled_compressed(page_bytes, to_slab, "bf16")
    loop = kernel.loop_accesses()
    page_side = loop.loads if to_slab else loop.stores
    assert page_side.get(16, 0) * 16 * kernel.threads >= DEFAULT_BYTES_PER_ITER, (kernel.threads, loop.describe())


_AFTER_AN_INTERPRETED_FP8_KERNEL = """
import torch
from kvtriton.kernels import compression_layout, gather_pages
from tests.kernels.kernel_cases import build_pages, build_slab, indices
from kernels_dev.codegen import compile_copy_pages, production_config

case = build_pages("mla", torch.bfloat16, "cpu", kv_values=True)
slab = build_slab(case, 4, "cpu", row_bytes=compression_layout(case.pages, 8).row_bytes)
rows = indices([0, 1], torch.int64, "cpu")
gather_pages(case.pages, slab, rows, rows, compression=compression_layout(case.pages, 8))  # tl.max / tl.sum, interpreted
print(len(compile_copy_pages(production_config(4096, 2), to_slab=True).ptx))
"""


def test_a_compile_after_an_interpreted_fp8_kernel_works_on_an_empty_triton_cache(tmp_path: Path) -> None:
    # A new machine: nothing in Triton's cache, and the interpreter has already run a kernel that calls a
    # @triton.jit helper (which leaves triton.language.core patched in that process).
    environment = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_AN_INTERPRETED_FP8_KERNEL],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 1000  # the PTX of the gather
