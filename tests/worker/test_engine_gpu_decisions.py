"""The CUDA path's decisions, checked on CPU with the CUDA pieces faked.

What a GPU run would catch late (a copy straddling two pinned registrations,
a job accepted on a closed slab or during graph capture, a staging failure
escaping ``submit_*``, a one-block job copying a large staging buffer, mixed
page sizes in one launch) is decided by host code, and checked here.
tests/worker/test_engine_cuda.py checks the same on a real GPU (this file is kept out of
bench/gpu_check.sh's CUDA step: nothing here needs a GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

import kvtriton.worker._backends as backends_module
import kvtriton.worker._engine as engine_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.kernels._launch import CopyLauncher, page_size_groups
from kvtriton.worker._backends import TransferBackend, choose_backend, dma_runs, slab_row_runs
from kvtriton.worker._engine import TransferEngine, TransferLane
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, plan_transfer
from kvtriton.worker._slab import HostSlab
from tests.kernels.kernel_cases import build_sized_pages
from tests.worker.conftest import block_bytes, make_kv

STORE, LOAD = TransferDirection.STORE, TransferDirection.LOAD
BLOCKS, SLOTS = 12, 12
CUDA = torch.device("cuda", 0)
Indices = NDArray[np.int64]


@pytest.fixture
def kv() -> PagedKV:
    return make_kv(BLOCKS)


@pytest.fixture
def slab(kv: PagedKV) -> Iterator[HostSlab]:
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as made:
        yield made


# --- runs never cross a registration -------------------------------------------


def test_dma_runs_are_cut_where_a_slab_registration_starts() -> None:
    plan = plan_transfer(STORE, GPULoadStoreSpec(list(range(10))), CPULoadStoreSpec(list(range(2, 12))), 1)
    assert [run.tolist() for run in dma_runs(plan)] == [[0], [2], [10]]
    blocks, rows, lengths = dma_runs(plan, registration_rows=4)  # registrations at rows 0, 4, 8
    assert (blocks.tolist(), rows.tolist(), lengths.tolist()) == ([0, 2, 6], [2, 4, 8], [2, 4, 4])


def test_torch_backend_runs_of_slab_rows_are_cut_there_too() -> None:
    rows = np.array([3, 4, 5, 6, 8, 9], dtype=np.int64)
    starts, lengths = slab_row_runs(rows, registration_rows=5)
    assert (starts.tolist(), lengths.tolist()) == ([0, 2, 4], [2, 2, 2])
    starts, lengths = slab_row_runs(rows)
    assert (starts.tolist(), lengths.tolist()) == ([0, 4], [4, 2])


def test_an_engine_cuts_its_dma_runs_at_the_slabs_registrations(
    kv: PagedKV, slab: HostSlab, monkeypatch: pytest.MonkeyPatch
) -> None:
    slab.registration_rows = 4  # as a slab pinned in registrations of 4 rows reports it
    heights: list[list[int]] = []
    real = backends_module.DmaCopy._copy_on_host  # pyright: ignore[reportPrivateUsage] -- the call under test

    def recording(self: backends_module.DmaCopy, store: bool, blocks: Indices, rows: Indices, lengths: Indices) -> None:
        heights.append([int(length) for length in lengths])
        real(self, store, blocks, rows, lengths)

    monkeypatch.setattr(backends_module.DmaCopy, "_copy_on_host", recording)
    with TransferEngine(kv, slab, "dma") as engine:
        before = [block_bytes(kv, block) for block in range(1, 8)]
        assert engine.submit_store(1, GPULoadStoreSpec(list(range(1, 8))), CPULoadStoreSpec(list(range(2, 9))))
        assert engine.submit_load(2, CPULoadStoreSpec(list(range(2, 9))), GPULoadStoreSpec(list(range(5, 12))))
        assert all(result.success for result in engine.get_finished())
    assert heights == [[2, 4, 1], [2, 4, 1]]  # rows 2-3 | 4-7 | 8
    assert [block_bytes(kv, block) for block in range(5, 12)] == before


# --- triton needs device alias == host address ------------------------------------


def test_triton_is_refused_for_a_slab_the_device_reaches_at_other_addresses_and_auto_takes_dma() -> None:
    def choose(requested: TransferBackend, aliased: bool) -> TransferBackend:
        return choose_backend(
            requested, STORE, device=CUDA, slab_pinned=True, page_bytes=4096, slab_device_aliased=aliased
        )

    with pytest.raises(ValueError, match="backend='triton' needs every registration .* use backend='dma'"):
        choose(TransferBackend.TRITON, False)
    assert choose(TransferBackend.AUTO, False) is TransferBackend.DMA
    assert choose(TransferBackend.AUTO, True) is TransferBackend.TRITON


# --- refused at submit -------------------------------------------------------------


def test_a_job_on_a_closed_slab_is_refused_with_a_clear_warning(kv: PagedKV, caplog: pytest.LogCaptureFixture) -> None:
    slab = HostSlab(SLOTS, 1, kv.row_bytes, pin=False)
    engine = TransferEngine(kv, slab)
    slab.close()
    with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
        assert not engine.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
        assert not engine.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([0]))
    assert "store job 1 refused: the host slab is closed" in caplog.text
    assert "load job 2 refused: the host slab is closed" in caplog.text
    assert engine.get_finished() == []
    engine.shutdown()


def test_a_job_submitted_during_cuda_graph_capture_is_refused(
    kv: PagedKV, slab: HostSlab, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with TransferEngine(kv, slab) as engine:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
            assert not engine.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
        assert "capturing a graph" in caplog.text
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert engine.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))  # the id was never taken
        assert [result.job_id for result in engine.get_finished()] == [1]


@pytest.mark.requires_interpreter
def test_a_staging_failure_refuses_the_job_and_the_next_one_runs(
    kv: PagedKV, slab: HostSlab, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with TransferEngine(kv, slab, "triton") as engine:
        real = engine_module._Staging  # pyright: ignore[reportPrivateUsage] -- the allocation under test

        def out_of_memory(capacity: int, device: torch.device) -> object:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        monkeypatch.setattr(engine_module, "_Staging", out_of_memory)
        with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
            assert not engine.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
        assert "store job 1 refused: its indices could not be staged: CUDA out of memory" in caplog.text
        monkeypatch.setattr(engine_module, "_Staging", real)
        assert engine.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
        assert [(result.job_id, result.success) for result in engine.get_finished()] == [(1, True)]


# --- staging -------------------------------------------------------------------------


def test_staging_takes_the_smallest_free_buffer_that_fits(kv: PagedKV, slab: HostSlab) -> None:
    with TransferEngine(kv, slab) as engine:
        staging = engine_module._Staging  # pyright: ignore[reportPrivateUsage] -- the pool under test
        free = engine._free_staging[TransferLane.LOAD]  # pyright: ignore[reportPrivateUsage] -- same
        free.extend(staging(capacity, kv.device) for capacity in (512, 64, 128))
        take = engine._take_staging  # pyright: ignore[reportPrivateUsage] -- same
        assert take(TransferLane.LOAD, 1).capacity == 64
        assert take(TransferLane.LOAD, 100).capacity == 128
        assert take(TransferLane.LOAD, 600).capacity == 1024  # none fits: a new one, the next power of two
        assert [buffer.capacity for buffer in free] == [512]


@pytest.mark.parametrize("count", [1, 2, 3, 64])
def test_a_job_stages_blocks_then_rows_in_one_16_byte_aligned_prefix(count: int) -> None:
    staging = engine_module._Staging(64, torch.device("cpu"))  # pyright: ignore[reportPrivateUsage] -- the layout under test
    blocks = np.arange(100, 100 + count, dtype=np.int64)
    rows = np.arange(200, 200 + count, dtype=np.int64)
    device = staging.stage(engine_module.TransferPlan(STORE, blocks, rows))
    assert torch.equal(device.gpu_blocks, torch.from_numpy(blocks))  # pyright: ignore[reportUnknownMemberType] -- torch types from_numpy's argument as Unknown
    assert torch.equal(device.slab_rows, torch.from_numpy(rows))  # pyright: ignore[reportUnknownMemberType] -- as above
    rows_at = engine_module.staged_rows_at(count)
    assert device.slab_rows.data_ptr() - device.gpu_blocks.data_ptr() == 8 * rows_at
    assert device.gpu_blocks.data_ptr() % 16 == 0 and device.slab_rows.data_ptr() % 16 == 0
    assert rows_at + count <= 2 * count + 1  # the used prefix: what a CUDA job copies to the device


# --- one launch per page size ------------------------------------------------------------


def test_pages_of_several_sizes_get_one_uniform_launch_per_size() -> None:
    case = build_sized_pages((1024, 4096, 1024, 48), 4, "cpu")
    slab = torch.zeros((4, case.row_bytes), dtype=torch.uint8)
    from kvtriton.kernels._validation import describe_pages

    geometry = describe_pages(case.pages, "pages")
    assert page_size_groups(geometry.page_bytes) == [[0, 2], [1], [3]]
    launcher = CopyLauncher(case.pages, slab, geometry, interpret=True, num_programs=4, bytes_per_iter=16 * 1024)
    configs = launcher.copy_configs
    assert [config.uniform for config in configs] == [True, True, True]
    assert [config.page_elems * config.element_bytes for config in configs] == [1024, 4096, 48]
    # 1 KiB and 4 KiB pages at 16-byte aligned row offsets keep 16-byte words; one mixed launch would not be uniform.
    assert [config.word for config in configs[:2]] == [16, 16]
