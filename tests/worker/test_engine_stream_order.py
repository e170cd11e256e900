"""The engine's CUDA stream order, checked on a CPU through a recording stand-in for ``torch.cuda``.

A store must read pages only after the forward pass queued before it has
written them, and a load must overwrite blocks only after the work queued
before it has stopped reading them: every job's copy is ordered after the
work on the compute stream at its submission. Its completion must be seen
only through its own event, recorded after its copy on its own lane. Both are
properties of the host code that queues the work, so the stand-in
(tests/worker/cuda_stand_in.py) checks them for every lane and every backend
without a GPU, the copy itself running on the CPU as the engine's CPU path
runs it, on both CUDA paths: a pinned slab's (the copies queued by the
submitting thread) and a pageable slab's (queued by each lane's worker
thread, behind an event the submitting thread records on the compute
stream). tests/worker/test_engine_cuda.py checks the same on a real GPU, with
a long kernel on the compute stream.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import kvtriton.worker._backends as backends_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.worker._backends import DeviceIndices, TransferBackend
from kvtriton.worker._engine import TransferEngine, TransferLane
from kvtriton.worker._plan import TransferPlan
from kvtriton.worker._slab import HostSlab
from tests.worker.conftest import make_kv
from tests.worker.cuda_stand_in import RecordingCuda, StandInStream

BACKENDS = [
    pytest.param(TransferBackend.TRITON, marks=pytest.mark.requires_interpreter, id="triton"),
    pytest.param(TransferBackend.DMA, id="dma"),
    pytest.param(TransferBackend.TORCH, id="torch"),
]
COPY_CLASSES = (backends_module.TritonCopy, backends_module.DmaCopy, backends_module.TorchCopy)
JOB_LANES = [TransferLane.STORE, TransferLane.LOAD, TransferLane.EXPEDITED_LOAD] * 2


def record_copies(cuda: RecordingCuda, monkeypatch: pytest.MonkeyPatch) -> dict[int, tuple[StandInStream, int]]:
    """Where each backend copy was queued, by the job's first GPU block: its stream (the current one) and position."""
    queued: dict[int, tuple[StandInStream, int]] = {}
    for cls in COPY_CLASSES:
        real = cls.copy

        def copy(self: object, plan: TransferPlan, device: DeviceIndices | None, real: object = real) -> None:
            stream = cuda.current_stream()
            queued[int(plan.gpu_blocks[0])] = (stream, stream.enqueue(f"copy of block {int(plan.gpu_blocks[0])}"))
            real(self, plan, device)  # pyright: ignore[reportCallIssue] -- the unbound method saved above

        monkeypatch.setattr(cls, "copy", copy)
    return queued


PATHS = [
    *(pytest.param(backend.values[0], False, marks=backend.marks, id=f"{backend.id}-pinned") for backend in BACKENDS),
    # Triton refuses a pageable slab on CUDA (the engine picks dma there), so the threaded path never runs it.
    *(pytest.param(backend.values[0], True, id=f"{backend.id}-pageable") for backend in BACKENDS[1:]),
]
"""Each backend on the engine's two CUDA paths: copies queued by the submitting thread (a pinned slab), or by each
lane's worker thread (a pageable slab, whose copies block the thread that issues them)."""


def on_the_cuda_path(
    engine: TransferEngine, cuda: RecordingCuda, monkeypatch: pytest.MonkeyPatch, threaded: bool
) -> list[ThreadPoolExecutor]:
    """Send a CPU engine's jobs down its CUDA path, onto stand-in lane streams (its copies still run on the CPU).

    ``threaded``: the pageable slab's path, through one worker thread per lane (returned; the engine's shutdown
    joins them).
    """
    monkeypatch.setattr(engine, "_cuda", True)
    monkeypatch.setattr(engine, "_streams", {lane: cuda.Stream() for lane in TransferLane})
    if not threaded:
        return []
    workers = {
        lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stand-in-{lane.name}") for lane in TransferLane
    }
    monkeypatch.setattr(engine, "_threaded", True)
    monkeypatch.setattr(engine, "_workers", workers)
    return list(workers.values())


def issued(workers: list[ThreadPoolExecutor]) -> None:
    """Wait until each lane's worker thread has queued the copies handed to it so far (one thread per lane)."""
    for worker in workers:
        worker.submit(lambda: None).result()


@pytest.mark.parametrize(("backend", "threaded"), PATHS)
def test_every_job_copies_after_the_compute_work_queued_before_it_and_is_seen_done_only_through_its_own_event(
    backend: TransferBackend, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(12)
    cuda = RecordingCuda()  # the device runs the compute stream last: whatever is not ordered after it runs first
    with HostSlab(12, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, backend) as engine:
        cuda.install(monkeypatch)
        queued = record_copies(cuda, monkeypatch)
        workers = on_the_cuda_path(engine, cuda, monkeypatch, threaded)
        compute_before: dict[int, int] = {}
        for job_id, lane in enumerate(JOB_LANES):
            cuda.compute.enqueue(f"forward pass before job {job_id}")
            compute_before[job_id] = len(cuda.compute.operations)
            blocks, slots = GPULoadStoreSpec([job_id]), CPULoadStoreSpec([job_id])
            if lane is TransferLane.STORE:
                assert engine.submit_store(job_id, blocks, slots)
            else:
                assert engine.submit_load(job_id, slots, blocks, expedited=lane is TransferLane.EXPEDITED_LOAD)
            cuda.compute.enqueue(f"forward pass after job {job_id}")
        issued(workers)  # the pageable path queues its copies on its worker threads, after submit_* returned

        for job_id, lane in enumerate(JOB_LANES):
            stream, position = queued[job_id]
            assert stream is engine.stream(lane), f"job {job_id} was copied on {stream}, not its {lane.value} lane"
            ordered = cuda.ordered_after(stream, position).get(cuda.compute, 0)
            assert ordered >= compute_before[job_id], (
                f"{lane.value} job {job_id} may copy after only {ordered} of the {compute_before[job_id]} operations "
                "queued on the compute stream before it was submitted"
            )

        reported: list[int] = []
        while True:
            for result in engine.get_finished():
                stream, position = queued[result.job_id]
                assert stream.executed > position, f"job {result.job_id} was reported before its copy ran"
                assert result.success
                reported.append(result.job_id)
            if not cuda.step():
                break
        reported += [result.job_id for result in engine.get_finished()]
        assert sorted(reported) == list(range(len(JOB_LANES)))


def test_the_stand_in_orders_only_what_a_wait_orders() -> None:
    # The check above is only as good as the model: a wait on the lane itself (what wait_stream on the current
    # stream does inside the lane's context) orders nothing; a wait on an event recorded on compute does.
    cuda = RecordingCuda()
    lane = cuda.Stream()
    cuda.compute.enqueue("forward pass")
    with cuda.stream(lane):
        lane.wait_stream(cuda.current_stream())
    unordered = lane.enqueue("copy")
    mark = cuda.Event()
    mark.record(cuda.compute)
    lane.wait_event(mark)
    ordered = lane.enqueue("copy")
    assert cuda.ordered_after(lane, unordered).get(cuda.compute, 0) == 0
    assert cuda.ordered_after(lane, ordered)[cuda.compute] == 1
    assert cuda.step() and lane.executed == 1  # the compute stream goes last: the unordered copy's wait runs first
    assert (lane.executed, cuda.compute.executed) == (1, 0)
    cuda.synchronize()
    assert lane.executed == len(lane.operations) and cuda.compute.executed == 1
