"""kv_compression='fp8-e4m3' through the transfer engine: slab sizing, both CPU backends bit for bit, byte counts,
block_size_factor > 1, NaN stores (stored, reported successful, counted) and the argument errors."""

from __future__ import annotations

import logging

import pytest
import torch

import kvtriton.worker._backends as backends_module
import kvtriton.worker._engine as engine_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.kernels import KVCompression, compression_layout
from kvtriton.kernels._launch_arguments import CompressConfig
from kvtriton.kernels._reference import gather_pages_reference, scatter_pages_reference
from kvtriton.worker._backends import AutoRule, TransferBackend, choose_backend
from kvtriton.worker._engine import NON_FINITE_WARNING_INTERVAL_S, EngineStats, TransferEngine
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection
from kvtriton.worker._slab import HostSlab
from tests.kernels.kernel_cases import kv_tensor

BLOCKS, SLOTS, FACTOR = 8, 6, 2
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.requires_interpreter),
]


def kv_tensors(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [kv_tensor((2, BLOCKS, 4, 2, 16), dtype, generator, "cpu") for _ in range(2)]


def test_the_engine_sizes_its_rows_compressed_and_counts_the_compressed_bytes() -> None:
    kv = PagedKV.from_tensors(kv_tensors(), kv_compression="fp8-e4m3")
    assert kv.row_bytes < kv.raw_row_bytes
    with HostSlab(SLOTS, FACTOR, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab) as engine:
        assert engine.submit_store(1, GPULoadStoreSpec([3, 4, 5]), CPULoadStoreSpec([0, 2]))
        (result,) = engine.get_finished()
        assert result.success and result.transfer_size == 3 * kv.row_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_writes_the_reference_rows_and_a_load_decodes_them(backend: str) -> None:
    source = kv_tensors()
    kv = PagedKV.from_tensors(source)
    compressed = kv.with_compression("fp8-e4m3")
    assert compressed.compression_layout is not None
    with HostSlab(SLOTS, FACTOR, compressed.row_bytes, pin=False) as slab:
        with TransferEngine(kv, slab, backend, kv_compression="fp8-e4m3") as engine:
            assert engine.kv.compression is KVCompression.FP8_E4M3
            # Three blocks from block index 1 of their request: the first slot is entered part-way.
            spec = GPULoadStoreSpec([6, 2, 7], group_sizes=[3], block_indices=[1])
            assert engine.submit_store(1, spec, CPULoadStoreSpec([4, 1]))
            assert [result.success for result in engine.get_finished()] == [True]
        expected = torch.zeros_like(slab.rows)
        gather_pages_reference(
            kv.pages, expected, torch.tensor([6, 2, 7]), torch.tensor([9, 2, 3]),
            compression=compressed.compression_layout,
        )  # fmt: skip
        assert torch.equal(slab.rows[[9, 2, 3]], expected[[9, 2, 3]])
        target = [torch.zeros_like(tensor) for tensor in source]
        with TransferEngine(PagedKV.from_tensors(target, kv_compression="fp8-e4m3"), slab, backend) as engine:
            assert engine.submit_load(
                2, CPULoadStoreSpec([4, 1]), GPULoadStoreSpec([0, 1, 5], group_sizes=[3], block_indices=[1])
            )
            assert [result.success for result in engine.get_finished()] == [True]
        decoded = [torch.zeros_like(tensor) for tensor in source]
        scatter_pages_reference(
            expected, PagedKV.from_tensors(decoded).pages, torch.tensor([9, 2, 3]), torch.tensor([0, 1, 5]),
            compression=compressed.compression_layout,
        )  # fmt: skip
        for got, want, original in zip(target, decoded, source):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            assert not torch.equal(got[:, [0, 1, 5]], original[:, [6, 2, 7]])  # lossy: not the original bits
            assert not bool(got[:, [2, 3, 4, 6, 7]].any())  # blocks not named stay untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_write_the_same_bits(backend: str) -> None:
    kv = PagedKV.from_tensors(kv_tensors(dtype=torch.float16), kv_compression="fp8-e4m3")
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, backend) as engine:
        assert engine.submit_store(1, GPULoadStoreSpec([5, 0, 3]), CPULoadStoreSpec([1, 4, 0]))
        assert engine.get_finished()[0].success
        with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as other, TransferEngine(kv, other, "torch") as reference:
            assert reference.submit_store(1, GPULoadStoreSpec([5, 0, 3]), CPULoadStoreSpec([1, 4, 0]))
            assert reference.get_finished()[0].success
            assert torch.equal(slab.rows, other.rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_of_pages_holding_nan_succeeds_stores_the_nan_code_and_is_counted_with_one_warning(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM asserts that every store succeeds: a refused store would stop the server, so the job succeeds, the
    # NaN code is stored (it loads back as NaN, never as a finite number) and the event is counted and logged.
    tensors = kv_tensors()
    tensors[1][1, 4, 0, 0, 0] = float("nan")
    tensors[0][0, 6, 1, 1, 3] = float("-inf")
    kv = PagedKV.from_tensors(tensors, kv_compression="fp8-e4m3")
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, backend) as engine:
        assert engine.stats == EngineStats(non_finite_stores=0)
        with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
            assert engine.submit_store(1, GPULoadStoreSpec([4]), CPULoadStoreSpec([0]))
            assert engine.submit_store(2, GPULoadStoreSpec([6]), CPULoadStoreSpec([2]))
            results = engine.get_finished()
        assert [(result.job_id, result.success, result.transfer_size) for result in results] == [
            (1, True, kv.row_bytes), (2, True, kv.row_bytes),
        ]  # fmt: skip
        assert engine.stats.non_finite_stores == 2
        warnings = [record for record in caplog.records if "NaN or infinity" in record.getMessage()]
        assert len(warnings) == 1  # rate-limited: the second event within the interval is counted, not logged
        assert "job 1" in warnings[0].getMessage() and "NaN code" in warnings[0].getMessage()
        # The next job on the same (pooled) staging is judged on its own values.
        assert engine.submit_store(3, GPULoadStoreSpec([5]), CPULoadStoreSpec([1]))
        assert engine.get_finished()[0].success
        assert engine.stats.non_finite_stores == 2
        target = [torch.zeros_like(tensor) for tensor in tensors]
        with TransferEngine(PagedKV.from_tensors(target, kv_compression="fp8-e4m3"), slab, backend) as loader:
            assert loader.submit_load(4, CPULoadStoreSpec([0, 2]), GPULoadStoreSpec([0, 1]))
            assert [result.success for result in loader.get_finished()] == [True]
        assert bool(target[1][1, 0, 0, 0, 0].isnan()) and bool(target[0][0, 1, 1, 1, 3].isnan())
        assert int(target[1][:, 0].isnan().sum()) == 1  # only the element that was NaN reads back as NaN


def test_nan_warnings_are_rate_limited_but_every_store_is_counted(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = kv_tensors()
    tensors[0][0, 3, 0, 0, 0] = float("nan")
    kv = PagedKV.from_tensors(tensors, kv_compression="fp8-e4m3")
    clock = [1000.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: clock[0])
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, "torch") as engine:
        with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
            for job, advance in enumerate((0.0, 1.0, 1.0, NON_FINITE_WARNING_INTERVAL_S, 1.0)):
                clock[0] += advance
                assert engine.submit_store(job, GPULoadStoreSpec([3]), CPULoadStoreSpec([job]))
                assert engine.get_finished()[0].success
        messages = [record.getMessage() for record in caplog.records if "NaN or infinity" in record.getMessage()]
        assert engine.stats.non_finite_stores == 5
        # One warning at once, then the next once the interval has passed, naming the events it summarises.
        assert [message.split(" store job(s)")[0] for message in messages] == ["1", "3"]
        assert "(5 such stores" not in messages[-1] and "(4 such stores" in messages[-1]


def test_a_slab_sized_for_uncompressed_rows_still_works_but_one_too_narrow_names_the_compression() -> None:
    kv = PagedKV.from_tensors(kv_tensors())
    with (
        HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as roomy,
        TransferEngine(kv, roomy, kv_compression="fp8-e4m3") as engine,
    ):
        assert engine.kv.row_bytes < roomy.row_bytes
    narrow_bytes = kv.with_compression("fp8-e4m3").row_bytes - 16
    with HostSlab(SLOTS, 1, narrow_bytes, pin=False) as narrow:
        with pytest.raises(ValueError, match="compressed with fp8-e4m3"):
            TransferEngine(kv, narrow, kv_compression="fp8-e4m3")


@pytest.mark.requires_interpreter
@pytest.mark.parametrize(("row_stride", "row_offset"), [(None, 1), (2, 0)], ids=["row_offset", "row_stride"])
def test_a_triton_engine_refuses_a_slab_whose_scale_rows_are_off_a_4_byte_boundary(
    row_stride: int | None, row_offset: int
) -> None:
    # On a GPU the compressed kernel's fp32 scale accesses would fault there, killing the CUDA context: the
    # engine's launcher refuses such a slab at build, as the public calls refuse it at each call.
    kv = PagedKV.from_tensors(kv_tensors(), kv_compression="fp8-e4m3")
    stride = kv.row_bytes + (row_stride if row_stride is not None else 4)
    buffer = torch.zeros(SLOTS * stride, dtype=torch.uint8)
    with HostSlab.from_buffer(
        buffer, SLOTS, 1, kv.row_bytes, row_stride=stride, row_offset=row_offset, pin=False
    ) as slab:  # fmt: skip
        with pytest.raises(
            ValueError, match="slab must start on a 4-byte boundary and have a row stride that is a mul"
        ):
            TransferEngine(kv, slab, "triton")
        with TransferEngine(kv, slab, "torch") as engine:  # the reference reads no scales at a device address
            assert engine.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]))
            assert [result.success for result in engine.get_finished()] == [True]


@pytest.mark.requires_interpreter
def test_a_compressed_launch_builds_no_constexpr_dict_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = PagedKV.from_tensors(kv_tensors(), kv_compression="fp8-e4m3")
    built: list[bool] = []
    real = CompressConfig.kernel_constexprs

    def counting(self: CompressConfig, to_slab: bool) -> dict[str, int | bool]:
        built.append(to_slab)
        return real(self, to_slab)

    monkeypatch.setattr(CompressConfig, "kernel_constexprs", counting)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, "triton") as engine:
        assert sorted(built) == [False, True]  # once per direction, when the launcher is prepared
        for job in range(3):
            assert engine.submit_store(2 * job, GPULoadStoreSpec([job]), CPULoadStoreSpec([job]))
            assert engine.submit_load(2 * job + 1, CPULoadStoreSpec([job]), GPULoadStoreSpec([job + 3]))
        assert all(result.success for result in engine.get_finished())
        assert sorted(built) == [False, True]


def test_a_bad_kv_compression_names_the_argument_and_dma_is_refused() -> None:
    kv = PagedKV.from_tensors(kv_tensors())
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab:
        with pytest.raises(ValueError, match="kv_compression must be one of 'none', 'fp8-e4m3', got 'int4'"):
            TransferEngine(kv, slab, kv_compression="int4")
        with pytest.raises(ValueError, match="backend='dma' cannot compress"):
            TransferEngine(kv, slab, "dma", kv_compression="fp8-e4m3")


def test_auto_takes_torch_where_it_would_take_dma_when_rows_are_compressed() -> None:
    cuda = torch.device("cuda", 0)
    for direction in TransferDirection:
        chosen = choose_backend(
            TransferBackend.AUTO, direction, device=cuda, slab_pinned=False, page_bytes=4096, compressed=True
        )
        assert chosen is TransferBackend.TORCH
        pinned = choose_backend(
            TransferBackend.AUTO, direction, device=cuda, slab_pinned=True, page_bytes=4096, compressed=True
        )
        assert pinned is TransferBackend.TRITON


def test_a_pinned_dma_row_of_auto_table_takes_triton_when_compressed_and_torch_only_when_the_kernel_cannot_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As bench/crossover.py may add it: dma wins for pinned slabs from 4 KiB pages. The torch reference would
    # read the device back twice per job on vLLM's scheduler thread, so compressed pinned jobs take the kernels.
    monkeypatch.setattr(
        backends_module, "AUTO_TABLE",
        (*backends_module.AUTO_TABLE, AutoRule("cuda", True, None, 4096, TransferBackend.DMA)),
    )  # fmt: skip
    cuda = torch.device("cuda", 0)

    def choose(direction: TransferDirection, *, compressed: bool, aliased: bool = True) -> TransferBackend:
        return choose_backend(
            TransferBackend.AUTO, direction, device=cuda, slab_pinned=True, page_bytes=8192,
            slab_device_aliased=aliased, compressed=compressed,
        )  # fmt: skip

    for direction in TransferDirection:
        assert choose(direction, compressed=False) is TransferBackend.DMA
        assert choose(direction, compressed=True) is TransferBackend.TRITON
        assert choose(direction, compressed=True, aliased=False) is TransferBackend.TORCH


def test_the_same_budget_buys_about_1_9x_the_slots_for_bf16_with_groups_of_128() -> None:
    tensors = [torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    plain = PagedKV.from_tensors(tensors)
    compressed = plain.with_compression("fp8-e4m3")
    budget = 1 << 30
    ratio = HostSlab.slots_for_budget(budget, 2, compressed.row_bytes) / HostSlab.slots_for_budget(
        budget, 2, plain.row_bytes
    )
    assert 1.9 < ratio < 1.95
    assert compressed.row_bytes == compression_layout(plain.pages, 128).row_bytes
