"""Tier traffic through kvtriton's primary tier vs vLLM's CPU primary, behind vLLM's own ``fs`` tier.

vLLM's ``TieringOffloadingManager`` drives both primaries the same way: a
chunk stored to the primary is *cascaded* to every secondary tier (primary ->
fs), and a chunk found only in a secondary tier is *promoted* (fs -> primary).
The primary's part of that traffic is bookkeeping (pin the chunks, hand out
slots, a memoryview the tier copies through); this benchmark shows that
kvtriton's adds no measurable cost. Both primaries run in one process, against
the same fs root on local disk, alternating repeat by repeat, with distinct
keys (the fs tier skips a file that already exists):

* cascade: ``--total-mib`` of chunks are stored in batches of ``--batch`` (one
  ``prepare_store`` / ``complete_store`` pair each, as the connector stores one
  request's new chunks per step); the slots are taken and filled untimed (the
  workers' part), then the stores complete batch after batch, each cascading
  its chunks, timed until every fs write has completed;
* promotion: the primary is emptied (``reset_cache``), then every chunk is
  looked up, as the scheduler does step after step, until all of them are
  readable in the primary again (the fs tier's asynchronous existence checks,
  its reads into the primary's slots, and the completions).

Only the scheduler side runs: no GPU is needed, and the chunk bytes are
written into the primaries' host memory directly. Chunk sizes are set by the
KV bytes per GPU block with one block per chunk, so both primaries lay chunks
out identically (the layouts are byte-identical then). Prints chunks/s and
GB/s per chunk size, primary and direction (best of ``--repeats``, as
interference on a shared machine only slows a pass down) and the kvtriton/vLLM
ratio (goal >= 0.95; the ratio of the medians is printed beside it), next to
vLLM's primary measured against itself in the same rounds (an A/A run: how far
the disk's noise alone moves the ratio). A second
table times the primary-tier calls alone (promotion slot, cascade pin, lookup)
per chunk, without I/O: the primary's whole share of the tier traffic,
measured without the disk's noise. Writes ``bench/results/tiers.json``.

``--steps`` measures something else instead: the time vLLM's scheduler thread
spends in the tiered manager per step (``complete_store`` of the previous
step's chunks, which cascades them; ``prepare_store`` of this step's;
``on_schedule_end``), with kvtriton's primary, in seven variants built alike
and run in alternating order round after round: no secondary tier; the fs
tier with every cascaded chunk sealed on the scheduler thread (as kvtriton
did before); the fs tier with the seals on kvtriton's seal thread (what it
does now); two promoting variants (each step's lookups of chunks found
only in fs, then ``on_schedule_end``), each promoted chunk's seal checked
under vLLM's manager lock (before) or on the seal thread (now); and the
in-memory remote tier (the Mooncake tier's base, a store in this process)
storing chunks in the clear, and with ``kvtriton_encryption`` sealing each
chunk for its tenant on the tier's I/O threads (issue 48's goal: within 10 %
of the plaintext variant). Chunks of
``--step-chunk-mib`` (16 MiB: the seal's cost grows with the chunk),
``--step-batch`` of them per step, ``--step-count`` steps per
round with ``--step-pause-ms`` between steps standing in for the model's
forward pass (the fs tier's writes and the seals run meanwhile). Prints and
writes the median step time per variant (the median of each round's median)
and the range of the rounds' medians: ``bench/results/tiers_steps.json``.

    python -m bench.tiers                    # 0.5, 2 and 4 MiB chunks, 128 MiB per pass
    python -m bench.tiers --quick            # smoke run: one small pass per size, no verdict, tiers-quick.json
    python -m bench.tiers --root /mnt/nvme/kv --total-mib 1024
    python -m bench.tiers --steps            # scheduler step time, 7 rounds; --quick: one short round
"""

from __future__ import annotations

import argparse
import importlib
import os
import secrets
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import bench_parser, command_line, format_table, offloading_config, write_json
from bench.third_party_logs import quiet_vllm
from kvtriton.cli import progress

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

__all__ = [
    "STEP_VARIANTS",
    "Bookkeeping",
    "PassResult",
    "StepRound",
    "build_parser",
    "main",
    "measure_bookkeeping",
    "measure_steps",
    "run_pass",
]

GOAL_RATIO = 0.95
BOOKKEEPING_CHUNKS = 4096
BOOKKEEPING_FIELDS = ("write_us", "read_us", "lookup_us")
STEP_S = 0.002
"""Pause between two polling rounds, standing in for a scheduler step (the tiers' threads run meanwhile)."""
PRIMARIES = ("vllm", "kvtriton")
NOISE_PRIMARY = "vllm-again"
"""vLLM's primary measured a second time in the same rounds: vLLM against itself (an A/A run) shows how far
the disk's noise alone moves the ratio, so a kvtriton/vLLM ratio inside that band is no measurable cost."""
PASS_ORDER = (*PRIMARIES, NOISE_PRIMARY)
_SPEC_NAMES = {
    "vllm": ("TieringOffloadingSpec", None),
    NOISE_PRIMARY: ("TieringOffloadingSpec", None),
    "kvtriton": ("KVTritonTieringOffloadingSpec", "kvtriton.integrations.vllm"),
}


@dataclass(frozen=True, slots=True)
class PassResult:
    """One cascade pass and one promotion pass of ``chunks`` chunks of ``chunk_bytes`` through one primary."""

    primary: str
    chunk_bytes: int
    chunks: int
    cascade_s: float
    promotion_s: float

    def seconds(self, direction: str) -> float:
        """The time of the pass in ``direction``: ``cascade`` or ``promotion``."""
        return {"cascade": self.cascade_s, "promotion": self.promotion_s}[direction]

    def chunks_per_s(self, direction: str) -> float:
        return self.chunks / self.seconds(direction)

    def gb_per_s(self, direction: str) -> float:
        return self.chunks * self.chunk_bytes / self.seconds(direction) / 1e9


def _slot_bytes(primary: str, chunk_bytes: int) -> int:
    """What one chunk of ``chunk_bytes`` takes in ``primary``'s memory: kvtriton's region keeps room for its seal,
    padded to 4 KiB (docs/tiers.md, "Memory layout"), so the same chunks take a little more memory there."""
    from kvtriton.worker import RegionLayout

    return RegionLayout.block_row_stride_for(1, 1, chunk_bytes) if primary == "kvtriton" else chunk_bytes


ENCRYPTION_KEY_VARIABLE = "KVTRITON_BENCH_MASTER_KEY"
"""The variable the encrypting step variant's master key is in (a fresh random key for each run)."""


def _manager(
    primary: str, chunk_bytes: int, chunks: int, root: Path, threads: int, tier: str = "fs", *, encrypted: bool = False
) -> object:
    """A scheduler-side TieringOffloadingManager with ``primary`` and one tier: ``fs`` under ``root``, ``memory``
    (the in-memory remote tier, on a store of its own), or ``none``; ``encrypted``: with ``kvtriton_encryption``."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec_name, module = _SPEC_NAMES[primary]
    tiers: dict[str, list[dict[str, object]]] = {
        "fs": [{"type": "fs", "root_dir": str(root), "n_read_threads": threads, "n_write_threads": threads}],
        "memory": [
            {
                "type": "InMemoryStoreTier",
                "module_path": "kvtriton.integrations.remote",
                "store": f"bench-{uuid.uuid4().hex[:12]}",
                "io_threads": threads,
            }
        ],
        "none": [],
    }
    extra: dict[str, object] = {
        "spec_name": spec_name,
        "cpu_bytes_to_use": chunks * _slot_bytes(primary, chunk_bytes),
        "secondary_tiers": tiers[tier],
    }
    if encrypted:
        os.environ.setdefault(ENCRYPTION_KEY_VARIABLE, secrets.token_hex(32))
        extra["kvtriton_encryption"] = {"master_key_env": ENCRYPTION_KEY_VARIABLE}
    if module is not None:
        extra["spec_module_path"] = module
    config = offloading_config(
        extra,
        worker_kv_bytes_per_block=chunk_bytes,
        engine_id=f"bench-tiers-{uuid.uuid4().hex[:12]}",
        model_name="bench/tiers",
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()


def _keys(first: int, count: int) -> list[OffloadKey]:
    """``count`` distinct chunk keys from ``first`` on (the fs tier skips a file that already exists)."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key((first + index).to_bytes(32, "big"), 0) for index in range(count)]


def _batches(keys: list[OffloadKey], batch: int) -> list[list[OffloadKey]]:
    """``keys`` in batches of ``batch``, as one scheduler step stores a request's new chunks."""
    return [keys[start : start + batch] for start in range(0, len(keys), batch)]


def _settle(manager: TieringOffloadingManager, step_end: ScheduleEndContext) -> None:
    """End steps until no tier job is in flight."""
    while True:
        with manager.lock:
            manager.on_schedule_end(step_end)
            if not manager.has_pending_work():
                return
        time.sleep(STEP_S)


def run_pass(
    primary: str, chunk_bytes: int, chunks: int, batch: int, root: Path, threads: int, first_key: int
) -> PassResult:
    """Cascade ``chunks`` fresh chunks to fs through ``primary``, then promote them all back; time both."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    manager = _manager(primary, chunk_bytes, chunks, root, threads)
    assert isinstance(manager, TieringOffloadingManager)
    step_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    keys = _keys(first_key, chunks)
    slot_bytes = _slot_bytes(primary, chunk_bytes)
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    try:
        payload = bytes(range(256)) * (chunk_bytes // 256)
        context = ReqContext(req_id="cascade")
        manager.on_new_request(context)
        # Untimed: the GPU -> host stores (slots taken, bytes written, as the workers would).
        batches = _batches(keys, batch)
        for batch_keys in batches:
            with manager.lock:
                output = manager.prepare_store(batch_keys, context)
            if output is None:
                raise RuntimeError(f"the {primary} primary refused to store {len(batch_keys)} chunks")
            spec = output.store_spec
            assert isinstance(spec, CPULoadStoreSpec)
            for slot in spec.block_ids.tolist():
                view[slot * slot_bytes : slot * slot_bytes + chunk_bytes] = payload
        # Timed: the stores complete step by step, each cascading its chunks, until fs holds them all.
        started = time.perf_counter()
        for batch_keys in batches:
            with manager.lock:
                manager.complete_store(batch_keys, context)
                manager.on_schedule_end(step_end)
        _settle(manager, step_end)
        cascade_s = time.perf_counter() - started
        manager.on_request_finished(context)

        with manager.lock:
            manager.reset_cache()
            manager.on_reset_flushed()
        context = ReqContext(req_id="promotion")
        manager.on_new_request(context)
        pending = list(keys)
        started = time.perf_counter()
        while pending:
            with manager.lock:
                pending = [key for key in pending if manager.lookup(key, context) is not LookupResult.HIT]
                manager.on_schedule_end(step_end)
            if pending:
                time.sleep(STEP_S)
        promotion_s = time.perf_counter() - started
        manager.on_request_finished(context)
    finally:
        view.release()  # the primary's memory may only be unmapped once no view of it is left
        manager.shutdown()
    return PassResult(primary, chunk_bytes, chunks, cascade_s, promotion_s)


@dataclass(frozen=True, slots=True)
class Bookkeeping:
    """The primary's own cost per chunk, in microseconds, with no tier I/O: what it adds to every chunk moved."""

    primary: str
    write_us: float
    """``prepare_write`` + ``complete_write`` (a promotion's slot), per chunk, in batches of ``--batch``."""
    read_us: float
    """``prepare_read`` + ``complete_read`` (a cascade's pin), per chunk, in batches of ``--batch``."""
    lookup_us: float
    """``lookup`` of a chunk the primary holds."""


def measure_bookkeeping(primary: str, chunks: int, batch: int) -> Bookkeeping:
    """Time the primary-tier calls the orchestrator makes per chunk, directly on ``primary``."""
    from vllm.v1.kv_offload.base import ReqContext

    with tempfile.TemporaryDirectory(prefix="kvtriton-bench-tiers-") as root:
        manager = _manager(primary, 4096, chunks, Path(root), 1)
        tier = getattr(manager, "primary_tier")
        try:
            keys = _keys(0, chunks)
            batches = _batches(keys, batch)
            context = ReqContext(req_id="bookkeeping")
            started = time.perf_counter()
            for batch_keys in batches:
                tier.prepare_write(batch_keys, context)
                tier.complete_write(batch_keys, context, True)
            written = time.perf_counter()
            for batch_keys in batches:
                tier.prepare_read(batch_keys, context)
                tier.complete_read(batch_keys, context)
            read = time.perf_counter()
            for key in keys:
                tier.lookup(key, context)
            looked_up = time.perf_counter()
        finally:
            getattr(manager, "shutdown")()
    per_chunk = 1e6 / chunks
    return Bookkeeping(
        primary, (written - started) * per_chunk, (read - written) * per_chunk, (looked_up - read) * per_chunk
    )


STEP_VARIANTS = {
    "no-tier": "no secondary tier",
    "fs-sealed-on-scheduler": "fs tier, sealed on the scheduler thread (before)",
    "fs-sealed-off-thread": "fs tier, sealed on the seal thread (now)",
    "fs-promoted-checked-on-scheduler": "fs tier promoting, each chunk checked under the manager lock (before)",
    "fs-promoted-checked-off-thread": "fs tier promoting, each chunk checked on the seal thread (now)",
    "memory-plain": "in-memory remote tier (the Mooncake tier's base), chunks stored in the clear",
    "memory-encrypted": "in-memory remote tier with kvtriton_encryption: each chunk sealed for its tenant",
}
"""The step-time variants (``--steps``), by name: what each one is."""
STEP_CAPACITY_STEPS = 8
"""The primary holds this many steps' chunks: enough that the chunks still being written to fs never fill it."""


@dataclass(frozen=True, slots=True)
class StepRound:
    """One round of ``--steps`` for one variant: the scheduler thread's time in the manager, step by step."""

    variant: str
    step_ms: tuple[float, ...]
    """Each step's ``complete_store`` + ``prepare_store`` + ``on_schedule_end``, in milliseconds."""
    refused_steps: int
    """Steps whose ``prepare_store`` found no room (every slot still pinned by a cascade), or for a promotion variant
    the chunks that ended a miss: 0 in a fair run."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


def measure_steps(
    variant: str, chunk_bytes: int, batch: int, steps: int, pause_s: float, root: Path, threads: int, first_key: int
) -> StepRound:
    """Run ``steps`` scheduler steps through kvtriton's tiered manager set up as ``variant``; time each step."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from kvtriton.integrations.remote import InMemoryStoreTier
    from kvtriton.integrations.vllm import RequestTenant, SealedTieringManager

    if variant not in STEP_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(STEP_VARIANTS)}, got {variant!r}")
    if variant.startswith("fs-promoted-"):
        return measure_promotion_steps(variant, chunk_bytes, batch, steps, pause_s, root, threads, first_key)
    tier = "none" if variant == "no-tier" else "memory" if variant.startswith("memory-") else "fs"
    manager = _manager(
        "kvtriton",
        chunk_bytes,
        STEP_CAPACITY_STEPS * batch,
        root,
        threads,
        tier,
        encrypted=variant == "memory-encrypted",
    )
    assert isinstance(manager, TieringOffloadingManager)
    if isinstance(manager, SealedTieringManager):
        manager.seal_off_thread = variant == "fs-sealed-off-thread"
    step_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    slot_bytes = _slot_bytes("kvtriton", chunk_bytes)
    payload = bytes(range(256)) * (chunk_bytes // 256)
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    context = ReqContext(req_id="steps")
    context.set_state(RequestTenant("bench-tenant"))  # as vLLM's connector records it: an encrypting tier needs it
    timings: list[float] = []
    refused = 0
    try:
        manager.on_new_request(context)
        previous: list[OffloadKey] = []
        for step in range(steps):
            keys = _keys(first_key + step * batch, batch)
            started = time.perf_counter()
            with manager.lock:
                if previous:  # the workers stored the last step's chunks: they cascade to the tiers
                    manager.complete_store(previous, context)
                output = manager.prepare_store(keys, context)
                manager.on_schedule_end(step_end)
            timings.append((time.perf_counter() - started) * 1e3)
            previous = []
            if output is None or not output.keys_to_store:
                refused += 1
            else:  # untimed: the workers' copies into the slots
                spec = output.store_spec
                assert isinstance(spec, CPULoadStoreSpec)
                for slot in spec.block_ids.tolist():
                    view[slot * slot_bytes : slot * slot_bytes + chunk_bytes] = payload
                previous = list(output.keys_to_store)
            time.sleep(pause_s)  # the model's forward pass: the tier's writes and the seals run meanwhile
        with manager.lock:
            if previous:
                manager.complete_store(previous, context)
        _settle(manager, step_end)  # untimed: the last cascades land before the next round starts
        manager.on_request_finished(context)
        for secondary in manager.secondary_tiers:
            if isinstance(secondary, InMemoryStoreTier) and secondary.stats().store_failed_keys:
                # A figure for stores that never happened would flatter the variant: refuse it instead.
                raise RuntimeError(f"{variant}: {secondary.stats().store_failed_keys} chunk(s) failed to store")
    finally:
        view.release()
        for secondary in manager.secondary_tiers:
            if isinstance(secondary, InMemoryStoreTier):
                secondary.store.clear()  # the values of this round only: the next round starts with an empty store
        manager.shutdown()
    return StepRound(variant, tuple(timings), refused)


def measure_promotion_steps(
    variant: str, chunk_bytes: int, batch: int, steps: int, pause_s: float, root: Path, threads: int, first_key: int
) -> StepRound:
    """``steps`` scheduler steps that each look up ``batch`` more chunks found only in the fs tier; time each step.

    Untimed first: ``steps * batch`` chunks are stored, cascaded to fs and
    forgotten by the primary (``reset_cache``). Then each step looks up its
    new chunks and those still in flight (the fs tier answers asynchronously,
    then reads the chunk into a primary slot; the step that takes the read's
    completion checks the chunk's seal, on the scheduler thread before, on
    the seal thread now), and ends (``on_schedule_end`` submits the reads).
    A step's ``refused`` count is the chunks that ended a miss: 0 in a fair run.
    """
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvtriton.integrations.vllm import SealedTieringManager

    # Room for every chunk of the round: a promotion refused for want of a slot (every one write-pending on a busy
    # machine) would be a miss that says nothing about the checks.
    manager = _manager("kvtriton", chunk_bytes, steps * batch, root, threads)
    assert isinstance(manager, SealedTieringManager)
    step_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    slot_bytes = _slot_bytes("kvtriton", chunk_bytes)
    payload = bytes(range(256)) * (chunk_bytes // 256)
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    keys = _keys(first_key, steps * batch)
    timings: list[float] = []
    missed = 0

    try:
        storing = ReqContext(req_id="store")
        manager.on_new_request(storing)
        for start in range(0, len(keys), batch):  # untimed: the chunks reach fs, sealed, one batch at a time
            with manager.lock:
                output = manager.prepare_store(keys[start : start + batch], storing)
            assert output is not None and isinstance(output.store_spec, CPULoadStoreSpec)
            for slot in output.store_spec.block_ids.tolist():
                view[slot * slot_bytes : slot * slot_bytes + chunk_bytes] = payload
            with manager.lock:
                manager.complete_store(output.keys_to_store, storing)
            _settle(manager, step_end)  # untimed
        manager.on_request_finished(storing)
        with manager.lock:  # the primary forgets them: each lookup below finds its chunk in fs only
            manager.reset_cache()
            manager.on_reset_flushed()
        manager.seal_off_thread = variant == "fs-promoted-checked-off-thread"
        context = ReqContext(req_id="steps")
        manager.on_new_request(context)
        in_flight: list[OffloadKey] = []
        for step in range(steps):
            in_flight += keys[step * batch : (step + 1) * batch]
            started = time.perf_counter()
            with manager.lock:
                answers = [manager.lookup(key, context) for key in in_flight]
                manager.on_schedule_end(step_end)
            timings.append((time.perf_counter() - started) * 1e3)
            missed += answers.count(LookupResult.MISS)
            in_flight = [
                key for key, answer in zip(in_flight, answers) if answer not in (LookupResult.HIT, LookupResult.MISS)
            ]
            time.sleep(pause_s)  # the model's forward pass: the fs reads and the checks run meanwhile
        _settle(manager, step_end)  # untimed
        manager.on_request_finished(context)
    finally:
        view.release()
        manager.shutdown()
    return StepRound(variant, tuple(timings), missed)


def _step_summary(rounds: list[StepRound]) -> dict[str, object]:
    """One variant's record: the median of its rounds' median step times, and their range."""
    medians = [round_.median_ms for round_ in rounds]
    return {
        "median_ms": statistics.median(medians),
        "low_ms": min(medians),
        "high_ms": max(medians),
        "round_medians_ms": medians,
        "refused_steps": sum(round_.refused_steps for round_ in rounds),
    }


def _run_steps(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--steps``: the scheduler's step time per variant (see the module docstring)."""
    name: str = args.name if args.name is not None else "tiers_steps-quick" if args.quick else "tiers_steps"
    rounds: int = args.repeats if args.repeats is not None else 1 if args.quick else 7
    steps: int = 6 if args.quick else args.step_count
    chunk_bytes = int(args.step_chunk_mib * (1 << 20))
    pause_s: float = args.step_pause_ms / 1e3
    if rounds < 1 or args.step_batch < 1 or steps < 1 or args.threads < 1 or pause_s < 0:
        raise SystemExit(
            "need --repeats, --step-batch, --step-count and --threads >= 1 and --step-pause-ms >= 0; got "
            f"{rounds}, {args.step_batch}, {steps}, {args.threads}, {args.step_pause_ms}"
        )
    if chunk_bytes < 4096 or chunk_bytes % 4096:
        raise SystemExit(
            f"--step-chunk-mib must be a multiple of 4 KiB (the fs tier uses O_DIRECT), got {args.step_chunk_mib}"
        )
    base = Path(tempfile.mkdtemp(prefix="kvtriton-bench-steps-", dir=args.root))
    order = tuple(STEP_VARIANTS)
    plan = [variant for index in range(rounds) for variant in (order if index % 2 == 0 else order[::-1])]
    print(
        f"fs root: {base}; {rounds} rounds of {steps} steps, {args.step_batch} x {args.step_chunk_mib:g} MiB chunks"
        f" stored per step, {args.step_pause_ms:g} ms between steps; {args.threads}+{args.threads} fs threads"
    )
    results: dict[str, list[StepRound]] = {variant: [] for variant in order}
    first_key = 0
    try:
        for variant in progress(plan, total=len(plan), label="step rounds"):
            root = base / "fs"
            results[variant].append(
                measure_steps(variant, chunk_bytes, args.step_batch, steps, pause_s, root, args.threads, first_key)
            )
            first_key += steps * args.step_batch
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summaries = {variant: _step_summary(runs) for variant, runs in results.items()}
    rows: list[list[object]] = [
        [
            STEP_VARIANTS[variant],
            summary["median_ms"],
            f"{summary['low_ms']:.3f}-{summary['high_ms']:.3f}",
            summary["refused_steps"],
        ]
        for variant, summary in summaries.items()
    ]
    print(f"scheduler thread's time in the manager per step, ms (median of {rounds} rounds' medians, their range):")
    print(format_table(["variant", "median ms", "range ms", "refused steps"], rows))
    path = write_json(
        name,
        {
            "command": command_line("tiers", argv),
            "smoke_run": bool(args.quick),
            "chunk_bytes": chunk_bytes,
            "batch": args.step_batch,
            "steps": steps,
            "pause_ms": args.step_pause_ms,
            "rounds": rounds,
            "threads": args.threads,
            "variants": [
                {"variant": variant, "what": STEP_VARIANTS[variant], **summaries[variant]} for variant in order
            ],
            "step_ms": {variant: [list(round_.step_ms) for round_ in runs] for variant, runs in results.items()},
        },
    )
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("tiers", __doc__)
    parser.add_argument(
        "--chunk-mib", type=float, nargs="+", default=[0.5, 2.0, 4.0], help="chunk sizes in MiB (default: 0.5 2 4)"
    )
    parser.add_argument("--total-mib", type=int, default=128, help="MiB moved per pass and direction (default: 128)")
    parser.add_argument("--batch", type=int, default=8, help="chunks per store, as one step stores them (default: 8)")
    parser.add_argument(
        "--repeats", type=int, help="passes per size and primary, best kept (default: 7, 1 with --quick)"
    )
    parser.add_argument("--threads", type=int, default=4, help="fs tier read and write threads each (default: 4)")
    parser.add_argument("--root", type=Path, help="directory for the fs tier (default: a temporary one under /tmp)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 MiB per pass, one repeat, no goal verdict; writes tiers-quick.json",
    )
    parser.add_argument("--name", help="result file name without .json (default: tiers, tiers-quick with --quick)")
    parser.add_argument(
        "--steps",
        action="store_true",
        help="measure the scheduler's step time with and without the fs tier instead (tiers_steps.json)",
    )
    parser.add_argument("--step-chunk-mib", type=float, default=16.0, help="--steps: chunk size in MiB (default: 16)")
    parser.add_argument("--step-batch", type=int, default=2, help="--steps: chunks stored per step (default: 2)")
    parser.add_argument(
        "--step-count", type=int, default=24, help="--steps: steps per round (default: 24, 6 with --quick)"
    )
    parser.add_argument(
        "--step-pause-ms", type=float, default=40.0, help="--steps: pause between steps, the forward pass (default: 40)"
    )
    return parser


def _need_vllm() -> None:
    try:
        importlib.import_module("vllm.v1.kv_offload.tiering.manager")
    except ImportError as error:
        raise SystemExit(f"bench.tiers runs vLLM's tiered manager and needs vLLM 0.33: {error}") from None


def _median_costs(runs: list[Bookkeeping]) -> dict[str, float]:
    """The median of each of the primary's costs over its bookkeeping runs."""
    return {field: statistics.median(float(getattr(run, field)) for run in runs) for field in BOOKKEEPING_FIELDS}


def _figures(results: list[PassResult], direction: str) -> dict[str, float]:
    """One primary's record for a chunk size and direction: its best pass (on a shared machine, interference only
    ever slows a pass down), and its median chunks/s."""
    rates = [result.chunks_per_s(direction) for result in results]
    return {
        "chunks_per_s": max(rates),
        "gb_per_s": max(result.gb_per_s(direction) for result in results),
        "median_chunks_per_s": statistics.median(rates),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_vllm()
    if args.steps:
        _need_vllm()
        return _run_steps(args, argv)
    name: str = args.name if args.name is not None else "tiers-quick" if args.quick else "tiers"
    repeats: int = args.repeats if args.repeats is not None else 1 if args.quick else 7
    total_mib: int = 16 if args.quick else args.total_mib
    sizes = [int(mib * (1 << 20)) for mib in args.chunk_mib]
    if repeats < 1 or args.batch < 1 or args.threads < 1 or total_mib < 1:
        raise SystemExit(
            f"need --repeats, --batch, --threads and --total-mib >= 1; got {repeats}, {args.batch}, {args.threads}, {total_mib}"
        )
    bad = [mib for mib, size in zip(args.chunk_mib, sizes) if size < 4096 or size % 4096]
    if bad:
        raise SystemExit(f"--chunk-mib must be multiples of 4 KiB (the fs tier reads with O_DIRECT), got {bad}")
    _need_vllm()

    base = Path(tempfile.mkdtemp(prefix="kvtriton-bench-tiers-", dir=args.root))
    print(
        f"fs root: {base}; {total_mib} MiB per pass; batches of {args.batch}; {args.threads}+{args.threads} fs threads"
    )
    steps = [
        (size, repeat, primary)
        for size in sizes
        for repeat in range(repeats)
        for primary in (PASS_ORDER if repeat % 2 == 0 else PASS_ORDER[::-1])
    ]
    results: dict[tuple[int, str], list[PassResult]] = {}
    first_key = 0
    try:
        for size, _, primary in progress(steps, total=len(steps), label="tier passes"):
            chunks = max(1, (total_mib << 20) // size)
            root = base / "fs"  # one root for both primaries; distinct keys keep their files apart
            results.setdefault((size, primary), []).append(
                run_pass(primary, size, chunks, args.batch, root, args.threads, first_key)
            )
            first_key += chunks
            shutil.rmtree(root, ignore_errors=True)  # the next pass writes fresh files, not over old ones
    finally:
        shutil.rmtree(base, ignore_errors=True)

    headers = [
        "chunk MiB",
        "direction",
        "vLLM chunks/s",
        "vLLM GB/s",
        "kvtriton chunks/s",
        "kvtriton GB/s",
        "ratio",
        "median ratio",
        "vLLM/vLLM (A/A)",
    ]
    table: list[list[object]] = []
    records: list[dict[str, object]] = []
    worst = float("inf")
    worst_median = float("inf")
    noise = 0.0  # the largest distance of an A/A median ratio from 1
    for size in sizes:
        for direction in ("cascade", "promotion"):
            theirs, ours, again = (_figures(results[(size, primary)], direction) for primary in PASS_ORDER)
            ratio = ours["chunks_per_s"] / theirs["chunks_per_s"]
            median_ratio = ours["median_chunks_per_s"] / theirs["median_chunks_per_s"]
            same_ratio = again["median_chunks_per_s"] / theirs["median_chunks_per_s"]
            worst = min(worst, ratio)
            worst_median = min(worst_median, median_ratio)
            noise = max(noise, abs(1.0 - same_ratio))
            table.append(
                [
                    size / (1 << 20),
                    direction,
                    theirs["chunks_per_s"],
                    theirs["gb_per_s"],
                    ours["chunks_per_s"],
                    ours["gb_per_s"],
                    ratio,
                    median_ratio,
                    same_ratio,
                ]
            )
            records.append(
                {
                    "chunk_bytes": size,
                    "direction": direction,
                    "ratio": ratio,
                    "median_ratio": median_ratio,
                    "vllm_vs_vllm_median_ratio": same_ratio,
                    "vllm": theirs,
                    "kvtriton": ours,
                }
            )
    print(format_table(headers, table))

    # The primary's own share, without I/O: deterministic where the passes above are at the mercy of the disk.
    bookkeeping: dict[str, list[Bookkeeping]] = {primary: [] for primary in PRIMARIES}
    for repeat in range(repeats):
        for primary in PRIMARIES if repeat % 2 == 0 else PRIMARIES[::-1]:
            bookkeeping[primary].append(measure_bookkeeping(primary, BOOKKEEPING_CHUNKS, args.batch))
    costs = {primary: _median_costs(runs) for primary, runs in bookkeeping.items()}
    cost_rows: list[list[object]] = [[primary, *primary_costs.values()] for primary, primary_costs in costs.items()]
    print(
        f"primary-tier calls alone, microseconds per chunk (median of {repeats} x {BOOKKEEPING_CHUNKS} chunks, batches of {args.batch}):"
    )
    print(format_table(["primary", "promotion slot (write)", "cascade pin (read)", "lookup"], cost_rows))
    if args.quick:
        verdict = f"smoke run (--quick, {total_mib} MiB, {repeats} pass): no verdict on the goal >= {GOAL_RATIO}"
    else:
        verdict = f"goal >= {GOAL_RATIO} {'met' if worst >= GOAL_RATIO else 'NOT met'}"
    print(f"worst kvtriton/vLLM ratio {worst:.3f} (best passes), {worst_median:.3f} (medians): {verdict}")
    # Only the primary's calls differ between the two runs; if kvtriton's are cheaper than vLLM's, its primary
    # cannot slow the tier traffic down, whatever the disk's noise does to the end-to-end ratio.
    pin_and_slot_us = {primary: costs[primary]["write_us"] + costs[primary]["read_us"] for primary in PRIMARIES}
    extra_us = pin_and_slot_us["kvtriton"] - pin_and_slot_us["vllm"]
    print(
        f"noise floor: vLLM against itself moves the median ratio by up to {noise:.3f}; kvtriton's primary calls cost"
        f" {extra_us:+.2f} us per chunk against vLLM's (cascade pin + promotion slot)"
    )
    path = write_json(
        name,
        {
            "command": command_line("tiers", argv),
            "smoke_run": bool(args.quick),
            "goal_met": None if args.quick else worst >= GOAL_RATIO,
            "total_mib": total_mib,
            "batch": args.batch,
            "threads": args.threads,
            "repeats": repeats,
            "goal_ratio": GOAL_RATIO,
            "worst_ratio": worst,
            "worst_median_ratio": worst_median,
            "vllm_vs_vllm_noise": noise,
            "kvtriton_extra_us_per_chunk": extra_us,
            "results": records,
            "bookkeeping_us_per_chunk": costs,
            "passes": [asdict(result) for runs in results.values() for result in runs],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
