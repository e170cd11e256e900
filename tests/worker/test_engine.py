from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

import pytest
import torch

import kvtriton.kernels._launch as launch_module
import kvtriton.worker._backends as backends_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.worker._backends import TransferBackend, choose_backend
from kvtriton.worker._engine import TransferEngine, TransferLane, TransferResult
from kvtriton.worker._plan import TransferDirection, plan_transfer
from kvtriton.worker._slab import HostSlab
from tests.worker.conftest import block_bytes, make_kv

BLOCKS, SLOTS = 8, 6
STORE_TYPE, LOAD_TYPE = ("GPU", "CPU"), ("CPU", "GPU")
STORE, LOAD = TransferDirection.STORE, TransferDirection.LOAD


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    kv = make_kv(BLOCKS)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab) as transfer:
        yield transfer


def store(engine: TransferEngine, job_id: int, blocks: Sequence[int], slots: Sequence[int]) -> bool:
    return engine.submit_store(job_id, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))


def load(engine: TransferEngine, job_id: int, slots: Sequence[int], blocks: Sequence[int]) -> bool:
    return engine.submit_load(job_id, CPULoadStoreSpec(slots), GPULoadStoreSpec(blocks))


def test_auto_runs_the_torch_backend_on_cpu(engine: TransferEngine) -> None:
    assert engine.backend is TransferBackend.TORCH


def choose(
    requested: TransferBackend, device: str, pinned: bool, direction: TransferDirection = STORE
) -> TransferBackend:
    return choose_backend(requested, direction, device=torch.device(device), slab_pinned=pinned, page_bytes=4096)


def test_auto_follows_the_table_triton_on_cuda_dma_when_the_slab_is_not_pinned_torch_on_cpu() -> None:
    for direction in TransferDirection:
        assert choose(TransferBackend.AUTO, "cuda", True, direction) is TransferBackend.TRITON
        assert choose(TransferBackend.AUTO, "cuda", False, direction) is TransferBackend.DMA
        assert choose(TransferBackend.AUTO, "cpu", False, direction) is TransferBackend.TORCH
    assert choose(TransferBackend.DMA, "cuda", True) is TransferBackend.DMA


def test_a_table_row_with_a_page_size_threshold_switches_one_direction(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = backends_module.AutoRule("cuda", True, LOAD, 8192, TransferBackend.DMA)
    monkeypatch.setattr(backends_module, "AUTO_TABLE", (*backends_module.AUTO_TABLE, rule))
    cuda = torch.device("cuda", 0)
    assert (
        choose_backend(TransferBackend.AUTO, LOAD, device=cuda, slab_pinned=True, page_bytes=8192)
        is TransferBackend.DMA
    )
    assert (
        choose_backend(TransferBackend.AUTO, LOAD, device=cuda, slab_pinned=True, page_bytes=4096)
        is TransferBackend.TRITON
    )
    assert (
        choose_backend(TransferBackend.AUTO, STORE, device=cuda, slab_pinned=True, page_bytes=8192)
        is TransferBackend.TRITON
    )


def test_triton_refuses_a_pageable_slab_on_cuda() -> None:
    with pytest.raises(ValueError, match="backend='triton' needs a pinned slab on CUDA"):
        choose(TransferBackend.TRITON, "cuda", False)


def test_triton_on_cpu_without_a_working_interpreter_is_an_error_not_a_silent_torch_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends_module, "interpreter_problem", lambda: "the interpreter is broken here")
    kv = make_kv(BLOCKS)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab:
        with pytest.raises(
            ValueError, match="backend='triton' on CPU runs Triton's interpreter, but the interpreter is broken"
        ):
            TransferEngine(kv, slab, "triton")


@pytest.mark.requires_interpreter
def test_triton_on_cpu_really_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(BLOCKS)
    launches: list[bool] = []
    real = launch_module.CopyLauncher.launch

    def counting(
        self: launch_module.CopyLauncher,
        to_slab: bool,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        status: torch.Tensor | None = None,
    ) -> None:
        launches.append(to_slab)
        real(self, to_slab, blocks, rows, status)

    monkeypatch.setattr(launch_module.CopyLauncher, "launch", counting)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, "triton") as engine:
        assert engine.backend is TransferBackend.TRITON
        assert store(engine, 0, [4], [1]) and load(engine, 1, [1], [6])
        assert launches == [True, False]
        assert block_bytes(kv, 6) == block_bytes(kv, 4)


def test_each_direction_reports_the_backend_that_really_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    table = (
        backends_module.AutoRule("cpu", None, STORE, 0, TransferBackend.TORCH),
        backends_module.AutoRule("cpu", None, LOAD, 0, TransferBackend.DMA),
    )
    monkeypatch.setattr(backends_module, "AUTO_TABLE", table)
    kv = make_kv(BLOCKS)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab) as engine:
        assert engine.backends == {STORE: TransferBackend.TORCH, LOAD: TransferBackend.DMA}
        with pytest.raises(ValueError, match="stores run torch and loads run dma; read engine.backends"):
            _ = engine.backend
        assert engine.backend_name == "torch (store) / dma (load)"
        assert store(engine, 0, [2, 3], [0, 1]) and load(engine, 1, [0, 1], [6, 7])
        assert [block_bytes(kv, 6), block_bytes(kv, 7)] == [block_bytes(kv, 2), block_bytes(kv, 3)]


def test_the_dma_backend_copies_whole_runs_never_one_row_at_a_time() -> None:
    plan = plan_transfer(STORE, GPULoadStoreSpec([4, 5, 6, 7, 0, 2]), CPULoadStoreSpec([10, 11, 12, 13, 0, 1]), 1)
    blocks, rows, lengths = backends_module.dma_runs(plan)
    assert (blocks.tolist(), rows.tolist(), lengths.tolist()) == ([4, 0, 2], [10, 0, 1], [4, 1, 1])


def test_warm_up_is_timed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    kv = make_kv(BLOCKS)
    with caplog.at_level(logging.INFO, logger="kvtriton.worker._engine"):
        with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab) as engine:
            assert engine.warmup_seconds >= 0.0
    assert any("warm-up" in record.getMessage() for record in caplog.records)


def test_a_store_copies_block_bytes_into_slot_rows_and_is_reported_once(engine: TransferEngine) -> None:
    assert store(engine, 0, [5, 2], [1, 4])
    results = engine.get_finished()
    assert len(results) == 1
    result = results[0]
    assert (result.job_id, result.success, result.transfer_type) == (0, True, STORE_TYPE)
    assert result.transfer_size == 2 * engine.kv.row_bytes
    assert result.transfer_time >= 0.0
    assert bytes(engine.slab.rows[1].numpy().tobytes()) == block_bytes(engine.kv, 5)
    assert bytes(engine.slab.rows[4].numpy().tobytes()) == block_bytes(engine.kv, 2)
    assert engine.get_finished() == []


def test_a_load_brings_slot_bytes_back_into_other_blocks(engine: TransferEngine) -> None:
    expected = block_bytes(engine.kv, 3)
    store(engine, 0, [3], [0])
    assert load(engine, 1, [0], [7])
    assert [(r.job_id, r.transfer_type) for r in engine.get_finished()] == [(0, STORE_TYPE), (1, LOAD_TYPE)]
    assert block_bytes(engine.kv, 7) == expected


def test_results_come_in_submission_order_per_direction(engine: TransferEngine) -> None:
    store(engine, 4, [0], [0])
    load(engine, 2, [0], [6])
    store(engine, 1, [1], [1])
    load(engine, 3, [1], [7])
    results = engine.get_finished()
    stores = [r.job_id for r in results if r.transfer_type == STORE_TYPE]
    loads = [r.job_id for r in results if r.transfer_type == LOAD_TYPE]
    assert (stores, loads) == ([4, 1], [2, 3])


def test_an_invalid_submit_returns_false_reports_nothing_and_logs_why(
    engine: TransferEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtriton.worker._engine"):
        assert not store(engine, 0, [0, 1], [0])
        assert not store(engine, 1, [BLOCKS], [0])
        assert not load(engine, 2, [SLOTS], [0])
        assert not engine.submit_store(3, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]))  # pyright: ignore[reportArgumentType] -- wrong spec type on purpose
        assert not engine.submit_load(4, GPULoadStoreSpec([0]), GPULoadStoreSpec([1]))
    assert engine.get_finished() == []
    assert "holds 1 slots but the GPU spec spans 2" in caplog.text
    assert "out of range" in caplog.text
    assert "gpu must be a GPULoadStoreSpec" in caplog.text
    assert "the slot spec is a GPULoadStoreSpec, not a CPULoadStoreSpec" in caplog.text
    assert int(engine.slab.rows.sum()) == 0


def test_a_job_id_still_unreported_is_refused_then_free_again(engine: TransferEngine) -> None:
    assert store(engine, 7, [0], [0])
    assert not load(engine, 7, [0], [1])
    assert [r.job_id for r in engine.get_finished()] == [7]
    assert load(engine, 7, [0], [1])
    assert [r.transfer_type for r in engine.get_finished()] == [LOAD_TYPE]


def test_a_non_integer_job_id_is_refused(engine: TransferEngine) -> None:
    assert not store(engine, "job", [0], [0])  # pyright: ignore[reportArgumentType] -- wrong type on purpose
    assert not store(engine, True, [0], [0])


def test_a_copy_that_raises_fails_only_its_job(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_gather = backends_module.gather_unchecked
    calls: list[int] = []

    def gather_failing_second_call(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated copy failure")
        real_gather(*args, **kwargs)  # pyright: ignore[reportArgumentType] -- forwarded unchanged

    monkeypatch.setattr(backends_module, "gather_unchecked", gather_failing_second_call)
    assert store(engine, 0, [0], [0])
    assert store(engine, 1, [1], [1])
    assert store(engine, 2, [2], [2])
    results = engine.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(0, True), (1, False), (2, True)]
    assert results[1].transfer_size == 0
    assert bytes(engine.slab.rows[2].numpy().tobytes()) == block_bytes(engine.kv, 2)


def test_wait_accepts_unknown_ids_and_leaves_results_reportable(engine: TransferEngine) -> None:
    store(engine, 0, [0], [0])
    engine.wait({0, 99})
    assert [r.job_id for r in engine.get_finished()] == [0]


def test_shutdown_keeps_results_and_refuses_new_jobs(engine: TransferEngine) -> None:
    store(engine, 0, [0], [0])
    engine.shutdown()
    assert not store(engine, 1, [1], [1])
    assert [r.job_id for r in engine.get_finished()] == [0]
    engine.shutdown()


@pytest.mark.parametrize(
    "backend", [TransferBackend.TORCH, TransferBackend.DMA, TransferBackend.TRITON], ids=lambda b: b.value
)
def test_an_empty_job_succeeds_at_once_without_touching_the_backend(
    backend: TransferBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(BLOCKS)
    with HostSlab(SLOTS, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, backend) as engine:

        def refuse(*args: object) -> None:
            raise AssertionError("an empty job reached the backend")

        monkeypatch.setattr(engine, "_copy", refuse)
        assert store(engine, 0, [], [])
        assert engine.submit_load(1, CPULoadStoreSpec([]), GPULoadStoreSpec([]), expedited=True)
        results = engine.get_finished()
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(0, True, 0), (1, True, 0)]


def test_an_expedited_load_copies_like_a_load_and_is_reported_as_one(engine: TransferEngine) -> None:
    assert store(engine, 0, [3], [2])
    engine.get_finished()
    assert engine.submit_load(1, CPULoadStoreSpec([2]), GPULoadStoreSpec([6]), expedited=True)
    (result,) = engine.get_finished()
    assert (result.job_id, result.success, result.transfer_type) == (1, True, LOAD_TYPE)
    assert block_bytes(engine.kv, 6) == block_bytes(engine.kv, 3)


def test_an_expedited_job_id_shares_the_in_flight_check_with_other_lanes(engine: TransferEngine) -> None:
    assert store(engine, 7, [0], [0])
    assert not engine.submit_load(7, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]), expedited=True)


def test_the_engine_is_a_user_of_its_slab_and_closing_the_slab_drains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(BLOCKS)
    slab = HostSlab(SLOTS, 1, kv.row_bytes, pin=False)
    engine = TransferEngine(kv, slab)
    drained: list[bool] = []
    monkeypatch.setattr(engine, "drain", lambda: drained.append(True))
    slab.close()
    slab.close()
    assert drained == [True]


def test_close_is_shutdown_and_a_second_close_is_a_no_op(engine: TransferEngine) -> None:
    assert store(engine, 0, [1], [1])
    engine.close()
    engine.close()
    assert engine.closed
    assert [r.job_id for r in engine.get_finished()] == [0]
    with pytest.raises(ValueError, match="no load stream"):
        engine.stream(TransferLane.LOAD)


def test_transfer_result_is_a_frozen_value() -> None:
    result = TransferResult(1, True, 10, 0.5, STORE_TYPE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.success = False  # pyright: ignore[reportAttributeAccessIssue] -- mutation is the point


def test_block_size_factor_comes_from_the_slab() -> None:
    kv = make_kv(BLOCKS)
    with HostSlab(2, 3, kv.row_bytes, pin=False) as slab:
        engine = TransferEngine(kv, slab)
        assert engine.block_size_factor == 3
        assert engine.submit_store(0, GPULoadStoreSpec([0, 1, 2, 3, 4, 5]), CPULoadStoreSpec([1, 0]))
        assert engine.get_finished()[0].transfer_size == 6 * kv.row_bytes
        assert bytes(slab.rows[3].numpy().tobytes()) == block_bytes(kv, 0)


def test_construction_rejects_narrow_slabs_bad_backends_and_program_counts() -> None:
    kv = make_kv(BLOCKS)
    with HostSlab(2, 1, kv.row_bytes - 1, pin=False) as narrow:
        with pytest.raises(ValueError, match=f"slab rows hold {kv.row_bytes - 1} bytes but one block of kv needs"):
            TransferEngine(kv, narrow)
    with HostSlab(2, 1, kv.row_bytes, pin=False) as slab:
        with pytest.raises(ValueError, match="backend must be one of .*'dma'.*got 'cuda'"):
            TransferEngine(kv, slab, backend="cuda")
        with pytest.raises(ValueError, match="num_programs must be >= 1, got 0"):
            TransferEngine(kv, slab, num_programs=0)
    closed = HostSlab(2, 1, kv.row_bytes, pin=False)
    closed.close()
    with pytest.raises(ValueError, match="slab is closed"):
        TransferEngine(kv, closed)
