"""The engine on a real GPU: pinned HostSlab, compiled kernel, streams and events (skipped without CUDA).

The CPU suite runs the same engine code through the interpreter and the torch
reference; what only a GPU can check lives here: the pinned slab reaching the
compiled kernel, every backend's copies on a side stream, ordering against
the compute stream, and that submitting never synchronises the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

import kvtriton.worker._backends as backends_module
import kvtriton.worker._engine as engine_module
import kvtriton.worker._slab as slab_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.kernels._reference import gather_pages_reference, scatter_pages_reference
from kvtriton.worker._backends import TransferBackend
from kvtriton.worker._engine import TransferEngine, TransferLane
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, TransferPlan
from kvtriton.worker._slab import HostSlab

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCKS, SLOTS, LAYERS = 32, 16, 3
# A long kernel queued on the compute stream before the write the engine must wait for.
SPIN_CYCLES = 200_000_000
BACKENDS = pytest.mark.parametrize(
    "backend", [TransferBackend.TRITON, TransferBackend.DMA, TransferBackend.TORCH], ids=lambda b: b.value
)


def make_tensors() -> list[torch.Tensor]:
    """FlashAttention-layout bf16 layers holding random bits: (2, N, block_size, heads, head_dim), 4 KiB pages."""
    generator = torch.Generator().manual_seed(0)
    shape = (2, BLOCKS, 16, 2, 64)
    raw = [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator) for _ in range(LAYERS)]
    return [layer.view(torch.bfloat16).cuda() for layer in raw]


@pytest.fixture
def tensors() -> list[torch.Tensor]:
    return make_tensors()


def make_engine(
    tensors: list[torch.Tensor], backend: TransferBackend, block_size_factor: int = 1
) -> tuple[HostSlab, TransferEngine]:
    kv = PagedKV.from_tensors(tensors)
    slab = HostSlab(SLOTS, block_size_factor, kv.row_bytes, pin=True)
    return slab, TransferEngine(kv, slab, backend)


@pytest.fixture(params=[TransferBackend.TRITON, TransferBackend.DMA, TransferBackend.TORCH], ids=lambda b: b.value)
def engine(request: pytest.FixtureRequest, tensors: list[torch.Tensor]) -> Iterator[TransferEngine]:
    backend: TransferBackend = request.param
    slab, transfer = make_engine(tensors, backend)
    with slab, transfer:
        yield transfer


def block_bytes(engine: TransferEngine, block: int) -> bytes:
    return b"".join(page[block].cpu().numpy().tobytes() for page in engine.kv.byte_pages())


def row_bytes(engine: TransferEngine, row: int) -> bytes:
    return engine.slab.rows[row, : engine.kv.row_bytes].numpy().tobytes()


def store(engine: TransferEngine, job_id: int, blocks: Sequence[int], slots: Sequence[int]) -> None:
    assert engine.submit_store(job_id, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))


def load(engine: TransferEngine, job_id: int, slots: Sequence[int], blocks: Sequence[int]) -> None:
    assert engine.submit_load(job_id, CPULoadStoreSpec(slots), GPULoadStoreSpec(blocks))


def finish(engine: TransferEngine, *job_ids: int) -> None:
    """Wait for the jobs and check each was reported once, successfully."""
    engine.wait(set(job_ids))
    results = {result.job_id: result for result in engine.get_finished()}
    assert set(results) == set(job_ids)
    assert all(result.success for result in results.values()), results


def spin_compute_stream() -> None:
    """Queue a long kernel on the current (compute) stream, so that work queued after it lands late."""
    torch.cuda._sleep(SPIN_CYCLES)  # pyright: ignore[reportPrivateUsage, reportUnknownMemberType] -- torch.s untyped GPU spin helper, used by its own tests


def test_a_pinned_host_slab_is_pinned_as_torch_and_triton_see_it() -> None:
    # is_pinned() inspects the storage's first byte; the kernels refuse a slab that reads as pageable.
    with HostSlab(4, 1, 8192, pin=True) as slab:
        assert slab.pinned
        assert slab.rows.is_pinned()
        assert slab.slot(3).is_pinned()


def test_auto_resolves_to_triton_with_a_pinned_slab(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.AUTO)
    with slab, transfer:
        assert transfer.backend is TransferBackend.TRITON


def test_store_then_load_round_trips_every_byte(engine: TransferEngine) -> None:
    blocks, slots = [5, 9, 3, 30], [7, 0, 15, 8]
    before = {block: block_bytes(engine, block) for block in blocks}
    store(engine, 0, blocks, slots)
    finish(engine, 0)
    assert [row_bytes(engine, slot) for slot in slots] == [before[block] for block in blocks]
    for layer in engine.kv.byte_pages():
        layer[blocks] = 0
    load(engine, 1, slots, blocks)
    finish(engine, 1)
    assert {block: block_bytes(engine, block) for block in blocks} == before


def test_a_one_block_job_runs(engine: TransferEngine) -> None:
    # Triton specialises an int argument equal to 1; a one-pair launch must still compile and copy.
    expected = block_bytes(engine, 11)
    store(engine, 0, [11], [2])
    finish(engine, 0)  # lanes are not ordered against each other: the load must not start before the store ends
    load(engine, 1, [2], [12])
    finish(engine, 1)
    assert block_bytes(engine, 12) == expected


@BACKENDS
def test_blocks_spanning_slots_round_trip_with_a_block_size_factor(
    tensors: list[torch.Tensor], backend: TransferBackend
) -> None:
    slab, transfer = make_engine(tensors, backend, block_size_factor=4)
    with slab, transfer:
        # Group starts at block index 2 of its request: it enters slot 3 two rows in.
        spec = GPULoadStoreSpec([20, 21, 22, 23, 24], group_sizes=[5], block_indices=[2])
        before = [block_bytes(transfer, block) for block in (20, 21, 22, 23, 24)]
        assert transfer.submit_store(0, spec, CPULoadStoreSpec([3, 9]))
        finish(transfer, 0)
        assert [row_bytes(transfer, row) for row in (14, 15, 36, 37, 38)] == before
        target = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[5], block_indices=[2])
        assert transfer.submit_load(1, CPULoadStoreSpec([3, 9]), target)
        finish(transfer, 1)
        assert [block_bytes(transfer, block) for block in (1, 2, 3, 4, 5)] == before


def test_a_store_reads_what_the_compute_stream_wrote_before_it(
    engine: TransferEngine, tensors: list[torch.Tensor]
) -> None:
    spin_compute_stream()
    for layer in tensors:
        layer[:, 6] = 1.5  # queued behind the spin
    store(engine, 0, [6], [1])
    finish(engine, 0)
    assert row_bytes(engine, 1) == block_bytes(engine, 6)
    assert torch.all(engine.slab.rows[1, : engine.kv.row_bytes].view(torch.bfloat16) == 1.5)


def test_a_load_lands_after_compute_stream_writes_to_its_blocks(
    engine: TransferEngine, tensors: list[torch.Tensor]
) -> None:
    expected = block_bytes(engine, 6)
    store(engine, 0, [6], [1])
    finish(engine, 0)
    spin_compute_stream()
    for layer in tensors:
        layer[:, 8].zero_()  # e.g. the scheduler zeroing a reallocated block, queued behind the spin
    load(engine, 1, [1], [8])
    finish(engine, 1)
    assert block_bytes(engine, 8) == expected


@pytest.mark.parametrize("backend", [TransferBackend.TRITON, TransferBackend.DMA], ids=lambda b: b.value)
def test_submitting_jobs_never_synchronises_the_device(tensors: list[torch.Tensor], backend: TransferBackend) -> None:
    # (The torch backend is the test oracle: its reference copy reads the device indices, a sync.)
    slab, transfer = make_engine(tensors, backend)
    with slab, transfer:
        store(transfer, 0, [1, 2], [1, 2])  # warm-up: compiles both kernels and caches the page table
        load(transfer, 1, [1], [20])
        finish(transfer, 0, 1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            store(transfer, 2, [3, 4, 5], [3, 4, 5])
            load(transfer, 3, [1, 2], [10, 11])
            transfer.get_finished()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        transfer.wait({2, 3})
        transfer.get_finished()


def test_shutdown_waits_for_jobs_in_flight_and_keeps_their_results(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab:
        spin_compute_stream()
        store(transfer, 0, list(range(16)), list(range(16)))
        load(transfer, 1, [0], [31])  # reads slot 0 whenever it runs (lanes are unordered); only completion is checked
        transfer.shutdown()
        results = transfer.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(0, True), (1, True)]
        assert all(r.transfer_time > 0 for r in results)
        assert not transfer.submit_store(2, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))


def test_an_expedited_load_overtakes_an_ordinary_load_submitted_before_it(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab, transfer:
        store(transfer, 1, [0, 1], [0, 1])
        finish(transfer, 1)
        with torch.cuda.stream(transfer.stream(TransferLane.LOAD)):
            spin_compute_stream()  # the ordinary load lane is busy for a long while
        load(transfer, 2, [0], [5])
        assert transfer.submit_load(3, CPULoadStoreSpec([1]), GPULoadStoreSpec([6]), expedited=True)
        transfer.wait({3})
        assert [result.job_id for result in transfer.get_finished()] == [3]
        assert block_bytes(transfer, 6) == block_bytes(transfer, 1)
        finish(transfer, 2)


def test_closing_the_slab_with_jobs_in_flight_drains_them_first_and_twice_is_a_no_op(
    tensors: list[torch.Tensor],
) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    expected = block_bytes(transfer, 3)
    spin_compute_stream()  # the store below is queued behind this
    store(transfer, 1, [3], [2])
    rows = slab.rows
    slab.close()  # must wait for the queued store before unpinning
    assert rows[2, : transfer.kv.row_bytes].numpy().tobytes() == expected
    slab.close()
    transfer.close()
    transfer.close()
    assert transfer.closed


@BACKENDS
def test_an_empty_job_succeeds_at_once_on_every_backend(tensors: list[torch.Tensor], backend: TransferBackend) -> None:
    slab, transfer = make_engine(tensors, backend)
    with slab, transfer:
        spin_compute_stream()
        assert transfer.submit_store(1, GPULoadStoreSpec([]), CPULoadStoreSpec([]))
        assert transfer.submit_load(2, CPULoadStoreSpec([]), GPULoadStoreSpec([]), expedited=True)
        results = transfer.get_finished()  # no wait: nothing was queued
        assert sorted((r.job_id, r.success, r.transfer_size) for r in results) == [(1, True, 0), (2, True, 0)]


def test_a_pageable_slab_job_returns_before_the_forward_pass_ends_and_stores_what_it_wrote(
    tensors: list[torch.Tensor],
) -> None:
    kv = PagedKV.from_tensors(tensors)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab) as transfer:
        assert transfer.backend is TransferBackend.DMA
        spin_compute_stream()  # the "forward pass"...
        for layer in tensors:
            layer[:, 4] = 1.5  # ...which writes the block, queued behind the spin
        store(transfer, 0, [4], [3])
        # submit_* returned while the compute stream is still busy: it did not wait for it.
        assert not torch.cuda.current_stream().query()
        expected = block_bytes(transfer, 4)  # synchronises: the block as the forward pass left it
        # Lanes are unordered, and a pageable host-to-device copy reads host memory when it is issued: the load
        # must not be submitted before the store it reads has finished.
        finish(transfer, 0)
        spin_compute_stream()
        load(transfer, 1, [3], [7])
        assert not torch.cuda.current_stream().query()
        finish(transfer, 1)
        # The worker thread's copy waited for the write queued before the store (not the bytes from before it).
        assert torch.all(slab.rows[3, : kv.row_bytes].view(torch.bfloat16) == 1.5)
        assert row_bytes(transfer, 3) == expected and block_bytes(transfer, 7) == expected


def _compiled_variants() -> int:
    """How many variants Triton's launcher holds for the copy kernel on the current device."""
    from kvtriton.kernels._jit.copy_pages import VARIANTS

    return VARIANTS.compiled_count(torch.cuda.current_device())


def test_jobs_after_warm_up_compile_nothing(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab, transfer:
        warmed = _compiled_variants()
        job = 0
        for size in (1, 2, 3, 7, 16):
            blocks = list(range(size))
            store(transfer, job, blocks, blocks)
            load(transfer, job + 1, blocks, [block + 16 for block in blocks])
            assert transfer.submit_load(job + 2, CPULoadStoreSpec(blocks), GPULoadStoreSpec(blocks), expedited=True)
            finish(transfer, job, job + 1, job + 2)
            job += 3
        assert _compiled_variants() == warmed


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_an_engine_on_the_second_gpu_copies_there_whichever_gpu_is_current() -> None:
    tensors = [layer.to("cuda:1") for layer in make_tensors()]
    kv = PagedKV.from_tensors(tensors)
    with (
        torch.cuda.device(0),
        HostSlab(SLOTS, 1, kv.row_bytes, pin=True) as slab,
        TransferEngine(kv, slab, "triton") as transfer,
    ):
        expected = block_bytes(transfer, 5)
        store(transfer, 0, [5], [2])
        load(transfer, 1, [2], [9])
        finish(transfer, 0, 1)
        assert block_bytes(transfer, 9) == expected


@two_gpus
def test_a_call_with_tensors_on_two_gpus_is_refused_before_anything_is_written() -> None:
    from kvtriton.kernels import gather_pages

    pages = [
        torch.ones(4, 64, dtype=torch.uint8, device="cuda:0"),
        torch.ones(4, 64, dtype=torch.uint8, device="cuda:1"),
    ]
    slab = torch.zeros(4, 128, dtype=torch.uint8, device="cuda:0")
    index = torch.arange(2, device="cuda:0")
    with pytest.raises(ValueError, match="is on cuda:1 but"):
        gather_pages(pages, slab, index, index)
    assert int(slab.sum()) == 0


@pytest.mark.parametrize(
    "backend", [TransferBackend.TRITON, TransferBackend.DMA, TransferBackend.TORCH], ids=lambda b: b.value
)
def test_a_slab_pinned_in_many_registrations_round_trips_runs_that_cross_them(
    tensors: list[torch.Tensor], backend: TransferBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Registrations of a few pages: every consecutive run of slots crosses registration boundaries, so the
    # dma and torch backends must cut their runs, and triton must reach every registration from the base.
    monkeypatch.setattr(slab_module, "PIN_CHUNK_BYTES", 4 * slab_module.HOST_PAGE_BYTES)
    kv = PagedKV.from_tensors(tensors)
    with HostSlab(SLOTS, 2, kv.row_bytes, pin=True) as slab:
        assert len(slab._registered) > 4  # pyright: ignore[reportPrivateUsage] -- the registrations under test
        assert slab.registration_rows is not None and slab.registration_rows < 2 * SLOTS
        assert slab.device_aliased  # cudaHostGetDevicePointer(chunk) == chunk for every chunk on x86 H100/H200
        with TransferEngine(kv, slab, backend) as transfer:
            blocks, slots = list(range(4, 4 + 2 * SLOTS - 4)), list(range(SLOTS - 2))  # 28 blocks into 14 slots
            before = [block_bytes(transfer, block) for block in blocks]
            assert transfer.submit_store(0, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))
            finish(transfer, 0)
            assert [row_bytes(transfer, row) for row in range(len(blocks))] == before
            for layer in transfer.kv.byte_pages():
                layer[blocks] = 0
            assert transfer.submit_load(1, CPULoadStoreSpec(slots), GPULoadStoreSpec(blocks))
            finish(transfer, 1)
            assert [block_bytes(transfer, block) for block in blocks] == before


def test_each_lane_runs_on_a_stream_of_its_own_never_one_of_torchs_pool_streams(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab, transfer:
        lanes = {transfer.stream(lane).cuda_stream for lane in TransferLane}
        assert len(lanes) == 3
        # torch's pool holds 32 streams per priority, handed out round-robin: 64 of each cover them all.
        pool = {torch.cuda.Stream(priority=priority).cuda_stream for priority in (0, -1) for _ in range(64)}
        assert not lanes & pool
        assert torch.cuda.current_stream().cuda_stream not in lanes
        store(transfer, 0, [1], [1])
        finish(transfer, 0)


def test_a_job_on_a_closed_slab_is_refused_on_cuda(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    slab.close()
    assert not transfer.submit_store(0, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert not transfer.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]))
    assert transfer.get_finished() == []
    transfer.close()


def test_a_job_submitted_while_a_cuda_graph_is_captured_is_refused(tensors: list[torch.Tensor]) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab, transfer:
        counter = torch.zeros(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            counter.add_(1)  # something to capture
            accepted = transfer.submit_store(0, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        assert not accepted
        store(transfer, 0, [1], [1])  # outside the capture: accepted, under the same id
        finish(transfer, 0)


def test_a_job_copies_only_the_used_part_of_its_staging_buffer() -> None:
    staging = engine_module._Staging(64, torch.device("cuda"))  # pyright: ignore[reportPrivateUsage] -- the copy under test
    staging.device.fill_(-1)
    plan = TransferPlan(
        TransferDirection.STORE, np.array([5, 6, 7], dtype=np.int64), np.array([1, 2, 3], dtype=np.int64)
    )
    device = staging.stage(plan)
    torch.cuda.synchronize()
    assert [int(block) for block in device.gpu_blocks] == [5, 6, 7] and [int(row) for row in device.slab_rows] == [
        1,
        2,
        3,
    ]
    used = engine_module.staged_rows_at(3) + 3
    assert bool(staging.device[used:].eq(-1).all())  # the rest of the buffer was not copied


def test_a_staging_failure_refuses_the_job_and_leaks_no_events(
    tensors: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    slab, transfer = make_engine(tensors, TransferBackend.TRITON)
    with slab, transfer:
        store(transfer, 0, [1], [1])
        finish(transfer, 0)
        pooled = len(transfer._free_events)  # pyright: ignore[reportPrivateUsage] -- the pool under test
        real = engine_module._Staging  # pyright: ignore[reportPrivateUsage] -- same

        def out_of_memory(capacity: int, device: torch.device) -> object:
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(engine_module, "_Staging", out_of_memory)
        # The load lane's pool is still empty: its first job allocates a staging buffer, which fails here.
        assert not transfer.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]))
        assert len(transfer._free_events) == pooled  # pyright: ignore[reportPrivateUsage] -- same
        monkeypatch.setattr(engine_module, "_Staging", real)
        store(transfer, 1, [2, 3], [2, 3])
        finish(transfer, 1)


# --- the copy engines' submission path ------------------------------------------------


@pytest.mark.parametrize("batched", [True, False], ids=["batch", "per-run"])
@pytest.mark.parametrize("backend", [TransferBackend.DMA, TransferBackend.TORCH], ids=lambda b: b.value)
def test_dma_and_torch_round_trip_with_cudaMemcpyBatchAsync_and_with_the_per_run_fallback(  # noqa: N802 -- the CUDA name
    tensors: list[torch.Tensor], backend: TransferBackend, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not batched:
        monkeypatch.setattr(backends_module, "memcpy_batch", lambda: None)  # a runtime before CUDA 12.8
    elif backends_module.memcpy_batch() is None:
        pytest.skip("this libcudart has no cudaMemcpyBatchAsync (CUDA before 12.8)")
    slab, transfer = make_engine(tensors, backend)
    with slab, transfer:
        path = "cudaMemcpyBatchAsync per job" if batched else "cudaMemcpy2DAsync per run"
        assert transfer.backend_name == f"{backend.value} [{path}]"
        blocks, slots = [9, 10, 11, 2, 30], [4, 5, 6, 0, 15]  # a run of three and two single pairs
        before = [block_bytes(transfer, block) for block in blocks]
        store(transfer, 0, blocks, slots)
        finish(transfer, 0)
        assert [row_bytes(transfer, slot) for slot in slots] == before
        for layer in transfer.kv.byte_pages():
            layer[blocks] = 0
        load(transfer, 1, slots, blocks)
        finish(transfer, 1)
        assert [block_bytes(transfer, block) for block in blocks] == before


# --- compression on the GPU -------------------------------------------------------------


def finite_tensors(seed: int = 1) -> list[torch.Tensor]:
    """bf16 layers of normal values (random bits would hold NaN, which the reference refuses)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((2, BLOCKS, 16, 2, 64), generator=generator).to(torch.bfloat16).cuda() for _ in range(LAYERS)]


def test_a_compressed_store_and_load_through_the_engine_are_bit_exact_to_the_torch_reference() -> None:
    source = finite_tensors()
    kv = PagedKV.from_tensors(source, kv_compression="fp8-e4m3")
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=True) as slab, TransferEngine(kv, slab) as transfer:
        assert transfer.backend is TransferBackend.TRITON  # auto on a pinned slab: the fused kernels
        blocks, slots = [5, 9, 3, 30, 31], [7, 0, 15, 8, 9]
        store(transfer, 0, blocks, slots)
        finish(transfer, 0)
        cpu_pages = [page.cpu() for page in kv.pages]
        expected = torch.zeros_like(slab.rows)
        gather_pages_reference(
            cpu_pages, expected, torch.tensor(blocks), torch.tensor(slots), compression=kv.compression_layout
        )
        assert torch.equal(slab.rows[slots], expected[slots])
        targets = [torch.zeros_like(layer) for layer in source]
        with TransferEngine(PagedKV.from_tensors(targets, kv_compression="fp8-e4m3"), slab) as loader:
            load(loader, 1, slots, [0, 1, 2, 3, 4])
            finish(loader, 1)
        decoded = [torch.zeros_like(layer).cpu() for layer in source]
        scatter_pages_reference(
            expected, PagedKV.from_tensors(decoded).pages, torch.tensor(slots), torch.tensor([0, 1, 2, 3, 4]),
            compression=kv.compression_layout,
        )  # fmt: skip
        for got, want in zip(targets, decoded):
            assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
        assert transfer.stats.non_finite_stores == 0


def test_a_compressed_store_of_nan_succeeds_and_is_counted_on_the_gpu() -> None:
    source = finite_tensors()
    source[1][0, 6, 3, 1, 7] = float("nan")
    kv = PagedKV.from_tensors(source, kv_compression="fp8-e4m3")
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=True) as slab, TransferEngine(kv, slab, "triton") as transfer:
        store(transfer, 0, [6, 7], [2, 3])  # finish() checks the job reported success
        finish(transfer, 0)
        assert transfer.stats.non_finite_stores == 1
        store(transfer, 1, [7], [4])  # the same pooled status word, judged on its own values
        finish(transfer, 1)
        assert transfer.stats.non_finite_stores == 1
        load(transfer, 2, [2], [20])
        finish(transfer, 2)
        assert bool(source[1][0, 20, 3, 1, 7].isnan()) and int(source[1][:, 20].isnan().sum()) == 1


def _compress_variants() -> int:
    """How many variants Triton's launcher holds for the fused compression kernel on the current device."""
    from kvtriton.kernels._jit import compress_pages

    return compress_pages.VARIANTS.compiled_count(torch.cuda.current_device())


def test_compressed_jobs_after_warm_up_compile_no_variant() -> None:
    kv = PagedKV.from_tensors(finite_tensors(), kv_compression="fp8-e4m3")
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=True) as slab, TransferEngine(kv, slab, "triton") as transfer:
        warmed = _compress_variants()
        assert warmed >= 2  # both directions compiled by the engine's warm-up
        job = 0
        for size in (1, 2, 3, 7, 16):
            blocks = list(range(size))
            store(transfer, job, blocks, blocks)
            finish(transfer, job)
            load(transfer, job + 1, blocks, [block + 16 for block in blocks])
            assert transfer.submit_load(job + 2, CPULoadStoreSpec(blocks), GPULoadStoreSpec(blocks), expedited=True)
            finish(transfer, job + 1, job + 2)
            job += 3
        assert _compress_variants() == warmed
