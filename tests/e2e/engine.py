"""Start one vLLM engine process with a given KV-transfer config, run steps in it, return the results.

The launcher the end-to-end tests share (and any later test that needs a real
engine): :func:`run_engine` runs an :class:`EngineJob` in a fresh process
(:mod:`e2e.engine_process`), bounded by ``timeout_s``, and returns an
:class:`EngineResult` with each step's tokens and vLLM's counters after it.
The process gets a session (process group) of its own; when it ends, or
times out and is killed, the launcher checks that nothing of that group is
left running, so a test never leaves an orphan behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtriton.integrations._mooncake_local import MooncakeCluster
from kvtriton.worker._shared_region import RegionLayout

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ENGINE_TIMEOUT_S = 240.0
"""One engine process, start-up included (20-40 s on a loaded 2-core machine)."""
HITS = "vllm:external_prefix_cache_hits"
"""vLLM's counter of prompt tokens the connector loaded (its external prefix cache hits)."""
LOADED = "vllm:kv_offload_load_bytes"
"""vLLM's counter of bytes the offloading connector loaded into the GPU."""
STORED = "vllm:kv_offload_store_bytes"
"""vLLM's counter of bytes the offloading connector stored from the GPU."""


def spec_config(spec_name: str, **extra: object) -> dict[str, object]:
    """An OffloadingConnector ``kv_transfer_config`` for one of kvtriton's specs."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": spec_name,
            "spec_module_path": "kvtriton.integrations.vllm",
            **extra,
        },
    }


def mooncake_tier(master_address: str, namespace: str, *, timeout_s: float = 5.0, **keys: object) -> dict[str, object]:
    """A ``secondary_tiers`` entry: kvtriton's Mooncake Store tier on ``master_address`` under ``namespace``, two I/O
    threads, and ``keys``."""
    return {
        "type": "MooncakeStoreTier",
        "module_path": "kvtriton.integrations.mooncake",
        "master_server_address": master_address,
        "namespace": namespace,
        "timeout_s": timeout_s,
        "io_threads": 2,
        **keys,
    }


def mooncake_job(
    model: Path,
    master_address: str,
    namespace: str,
    steps: Sequence[dict[str, object]],
    *,
    timeout_s: float = 5.0,
    **tier_keys: object,
) -> EngineJob:
    """An engine on the tiered spec, 8 MiB of host memory in front of :func:`mooncake_tier`, running ``steps`` once
    its tier is up."""
    tier = mooncake_tier(master_address, namespace, timeout_s=timeout_s, **tier_keys)
    config = spec_config("KVTritonTieringOffloadingSpec", cpu_bytes_to_use=8 << 20, secondary_tiers=[tier])
    return EngineJob(model=str(model), steps=[WAIT_TIERS_UP, *steps], kv_transfer_config=config)


def mooncake_cluster(folder: Path) -> Generator[MooncakeCluster]:
    """A module's own Mooncake master and holder in ``folder``, for tests that stop or kill them: the master keeps
    a silent client listed for a minute (``--client_ttl=60``, not the fixtures' 2 s), so that a holder stays listed
    while it or the master is stopped. Stopped when the generator closes (a fixture's ``yield from``)."""
    started = MooncakeCluster(folder, master_extra_args=("--client_ttl=60",))
    started.start()
    try:
        yield started
    finally:
        started.stop()


def generate(
    prompt: Sequence[int],
    max_tokens: int,
    name: str,
    *,
    compare_to: str | None = None,
    logprobs: int = 0,
    cache_salt: str | None = None,
    settle: bool = True,
) -> dict[str, object]:
    """A step: greedy generation of ``max_tokens`` tokens after ``prompt`` (token ids).

    With ``settle`` (the default) the step ends once every offloading transfer
    in flight has finished; without it, as soon as the request has (the next
    step or the shutdown then meets the transfers still running).

    With ``cache_salt``, the request carries vLLM's ``cache_salt`` (a tenant's
    salt: its blocks' hashes, so every tier's keys, differ from other salts'
    while its tokens do not).

    With ``compare_to`` (an earlier generate step's name), the step also
    records, for each full prompt block, whether its bytes in the KV cache
    (every layer, first KV cache group) equal that step's
    (:attr:`StepResult.blocks_equal`). With ``logprobs`` > 0, it records the
    log-probabilities of the ``logprobs`` most likely tokens at every
    generated position (:attr:`StepResult.logprobs`).
    """
    return {
        "op": "generate", "prompt": list(prompt), "max_tokens": max_tokens, "name": name, "compare_to": compare_to,
        "logprobs": logprobs, "cache_salt": cache_salt, "settle": settle,
    }  # fmt: skip


def generate_batch(
    prompts: Sequence[Sequence[int]], max_tokens: int, name: str, *, logprobs: int = 0
) -> dict[str, object]:
    """A step: greedy generation of ``max_tokens`` tokens after each of ``prompts``, all in one generate call.

    vLLM schedules the prompts together, as a server batches concurrent
    requests; each one's result is a :class:`Completion` of
    :attr:`StepResult.completions`, in the order of ``prompts``.
    """
    return {"op": "generate_batch", "prompts": [list(prompt) for prompt in prompts], "max_tokens": max_tokens, "name": name,
            "logprobs": logprobs}  # fmt: skip


def generate_with_aborts(
    prompts: Sequence[Sequence[int]], max_tokens: int, name: str, *, abort: Sequence[int], abort_after_steps: int
) -> dict[str, object]:
    """A step: ``prompts`` submitted together and stepped one engine step at a time; after ``abort_after_steps``
    steps the prompts at the indices ``abort`` are aborted, the others run to their end.

    Each prompt's result is a :class:`Completion` of :attr:`StepResult.completions`, in the order of ``prompts``;
    an aborted prompt's is empty (or what it had generated, when it finished before the abort).
    """
    return {
        "op": "generate_with_aborts",
        "prompts": [list(prompt) for prompt in prompts],
        "max_tokens": max_tokens,
        "name": name,
        "abort": list(abort),
        "abort_after_steps": abort_after_steps,
    }


def barrier(name: str) -> dict[str, object]:
    """A step: the engine writes ``<name>.reached`` in its working directory and waits (bounded by
    :data:`e2e.engine_process.BARRIER_TIMEOUT_S`) until ``<name>.go`` exists there: a test injects a fault at a
    known point of the engine's steps (:func:`faults_at`)."""
    return {"op": "barrier", "name": name}


@contextlib.contextmanager
def faults_at(workdir: Path, faults: Sequence[tuple[str, Callable[[], object]]]) -> Generator[None]:
    """While the block runs the engine in ``workdir``: as it reaches each :func:`barrier` of ``faults`` (in order), run
    that fault's action, then let the engine go on.

    Raises what an action raised (the engine's barrier then timed out); once the block ends, nothing more is run.
    """
    for name, _ in faults:  # an earlier run's marks in the same folder would release this engine too early
        (workdir / f"{name}.reached").unlink(missing_ok=True)
        (workdir / f"{name}.go").unlink(missing_ok=True)
    ended = threading.Event()
    errors: list[Exception] = []

    def inject() -> None:
        try:
            for name, action in faults:
                while not (workdir / f"{name}.reached").exists():
                    if ended.wait(0.05):
                        return
                action()
                (workdir / f"{name}.go").touch()
        except Exception as error:  # noqa: BLE001 -- raised again in the test's own thread, below
            errors.append(error)

    injector = threading.Thread(target=inject, name="faults_at", daemon=True)
    injector.start()
    try:
        yield
    finally:
        ended.set()
        injector.join(30.0)
        if errors:
            raise errors[0]


RESET_PREFIX_CACHE: dict[str, object] = {"op": "reset_prefix_cache"}
"""A step: drop the engine's own prefix cache (the connector's cache stays)."""
WAIT_TIERS_UP: dict[str, object] = {"op": "wait_tiers_up"}
"""A step: wait until every secondary tier that connects in the background (Mooncake) is up."""
ZERO_KV_CACHE: dict[str, object] = {"op": "zero_kv_cache"}
"""A step: zero every KV cache tensor (after a reset: what a later load writes is all that is there)."""
OVERWRITE_HOST_SLAB: dict[str, object] = {"op": "overwrite_host_slab"}
"""A step: overwrite every byte of kvtriton's host slab with random bytes (single-tier spec)."""
CHECK_MOONCAKE_VALUES_SEALED: dict[str, object] = {"op": "check_mooncake_values_sealed"}
"""A step: read back, through a Mooncake client of its own, the value of every chunk kvtriton's primary holds and
count (:attr:`StepResult.measured`) the values (``values``) and those holding any 64-byte run of the chunk's
plaintext in the primary (``with_plaintext``)."""
DAMAGE_MOONCAKE_VALUES: dict[str, object] = {"op": "damage_mooncake_values"}
"""A step: through a Mooncake client of its own (a broken writer), replace the value of every chunk kvtriton's
primary holds, in every Mooncake tier, by one of the same size with 64 bytes flipped in its middle."""


@dataclass(frozen=True)
class EngineJob:
    """One engine: its model, block size, KV-transfer config (None: no connector) and the steps to run."""

    model: str
    steps: list[dict[str, object]]
    kv_transfer_config: dict[str, object] | None = None
    block_size: int = 32
    max_model_len: int = 512
    kv_cache_bytes: int = 16 << 20
    attention_backend: str | None = None
    """vLLM's attention backend by name (None: the platform's choice)."""
    dtype: str = "float32"
    """The model's and KV cache's dtype, as vLLM's ``dtype`` argument takes it."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``kv_cache_dtype``: ``auto`` (the model's dtype) or one of its quantized caches (``fp8``)."""
    stop_before_scheduler_joins: bool = False
    """Stop the process (SIGSTOP) once the worker made the tiered spec's shared region, before the scheduler maps it
    (:func:`e2e.engine_process.stop_before_scheduler_joins`); for a test that then kills it."""


@dataclass(frozen=True)
class Completion:
    """One prompt's result in a :func:`generate_batch` step."""

    token_ids: list[int]
    num_cached_tokens: int
    """The prompt tokens vLLM did not compute (its own prefix cache's hits and the connector's)."""
    logprobs: list[dict[int, float]] = field(default_factory=list[dict[int, float]])
    """Per generated position: token id -> log-probability of the most likely tokens (empty without ``logprobs``)."""


@dataclass(frozen=True)
class StepResult:
    op: str
    name: str
    counters: dict[str, float]
    token_ids: list[int] = field(default_factory=list[int])
    num_cached_tokens: int = 0
    blocks_equal: list[bool] | None = None
    """Per full prompt block: equal to the ``compare_to`` step's bytes (None without ``compare_to``)."""
    blocks_relative_error: list[float] | None = None
    """Per full prompt block: ``||x - x_ref|| / ||x_ref||`` against the ``compare_to`` step's values (every layer)."""
    logprobs: list[dict[int, float]] = field(default_factory=list[dict[int, float]])
    """Per generated position: token id -> log-probability of the most likely tokens (empty without ``logprobs``)."""
    completions: list[Completion] = field(default_factory=list[Completion])
    """A :func:`generate_batch` step's results, one per prompt (empty for other steps)."""
    seconds: float = 0.0
    """A generate step's request, from submission to its last token (the settling steps after it excluded)."""
    measured: dict[str, int] = field(default_factory=dict[str, int])
    """What a check step counted (:data:`CHECK_MOONCAKE_VALUES_SEALED`); empty for other steps."""
    gauges: dict[str, dict[str, float]] = field(default_factory=dict[str, dict[str, float]])
    """vLLM's gauges after this step whose names start with ``vllm:kv_offload``: name -> labels -> value (the labels
    as ``k=v`` pairs joined by commas)."""

    def counter(self, name: str) -> float:
        """vLLM's counter ``name`` (e.g. ``vllm:external_prefix_cache_hits``) after this step, 0 when never set."""
        return self.counters.get(name, 0.0)


@dataclass(frozen=True)
class EngineResult:
    steps: list[StepResult]
    log: str
    """The engine process's stdout and stderr."""
    startup_s: float
    kv_bytes_per_block: int = 0
    blocks_per_chunk: int = 0
    kvtriton_origin: str = ""
    """The folder the engine imported kvtriton from (empty when the engine ran without a connector)."""

    def step(self, name: str) -> StepResult:
        (found,) = [step for step in self.steps if step.name == name]
        return found

    @property
    def tier_chunk_bytes(self) -> int:
        """Bytes of one chunk as the tiered spec hands it to a secondary tier (one rank): its KV bytes and its seal,
        padded to whole pages; what ``vllm:kv_offload_tiering_write_bytes`` counts per chunk."""
        return self.blocks_per_chunk * RegionLayout.block_row_stride_for(
            self.blocks_per_chunk, 1, self.kv_bytes_per_block
        )

    def delta(self, name: str, counter: str) -> float:
        """How much ``counter`` grew during step ``name``."""
        index = next(index for index, step in enumerate(self.steps) if step.name == name)
        before = self.steps[index - 1].counter(counter) if index else 0.0
        return self.steps[index].counter(counter) - before


def engine_env(*, checkout_importable: bool = True) -> dict[str, str]:
    """The environment of a test's engine process: this one's, with the repository and tests/ importable; with
    ``checkout_importable`` False, tests/ alone (not even this process's ``PYTHONPATH``, which may name a checkout):
    an installed kvtriton must then be the only one the process can import."""
    env = dict(os.environ)
    inherited = [env.get("PYTHONPATH", "")] if checkout_importable else []
    paths = [str(REPO)] if checkout_importable else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(TESTS), *filter(None, inherited)])
    return env


def group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of group ``pgid``, as ``"pid command"``; Linux's /proc, else a signal probe."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [f"group {pgid}"]
    members: list[str] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (command) state ppid pgrp ...": the command may hold spaces and parentheses.
        command, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(f"{entry.name} {command}")
    return members


def end_process_group(process: subprocess.Popen[bytes], *, grace_s: float = 10.0) -> list[str]:
    """Stop ``process`` and everything in its group (SIGTERM, then SIGKILL); returns what had to be killed."""
    killed: list[str] = []
    pgid = process.pid
    if process.poll() is None:
        os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            killed.append(f"process {process.pid} ignored SIGTERM")
    deadline = time.monotonic() + grace_s
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        killed.append(f"processes of group {pgid} outlived the engine: {left}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    if process.poll() is None:
        process.kill()
    process.wait()
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is asynchronous
    return killed


def _step_result(raw: dict[str, Any]) -> StepResult:
    """One step of the engine process's JSON (logprobs travel as [token, logprob] pairs: JSON keys are strings)."""
    pairs: list[list[list[float]]] = raw.pop("logprobs", [])
    completions: list[dict[str, Any]] = raw.pop("completions", [])
    return StepResult(
        **raw,
        logprobs=_logprobs(pairs),
        completions=[
            Completion(
                token_ids=c["token_ids"], num_cached_tokens=c["num_cached_tokens"], logprobs=_logprobs(c["logprobs"])
            )
            for c in completions
        ],
    )


def _logprobs(pairs: list[list[list[float]]]) -> list[dict[int, float]]:
    return [{int(token): logprob for token, logprob in position} for position in pairs]


def run_process(
    module: str,
    job: dict[str, Any],
    workdir: Path,
    *,
    label: str,
    timeout_s: float = ENGINE_TIMEOUT_S,
    interpreter: Path | None = None,
) -> tuple[dict[str, Any], str]:
    """Run ``python -m module JOB_JSON RESULT_JSON`` in a session of its own under ``workdir``; its result and log.

    Raises, naming ``label`` and with the end of the process's log, when it
    runs past ``timeout_s`` (then it is killed), fails, writes no result, or
    leaves a process of its group behind. With ``interpreter`` (another
    environment's python, e.g. one kvtriton's wheel is installed into), the
    process runs under it and cannot import the checkout's kvtriton.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = workdir / "job.json", workdir / "result.json", workdir / "engine.log"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(interpreter or sys.executable), "-m", module, str(job_path), str(result_path)],
            cwd=workdir, env=engine_env(checkout_importable=interpreter is None), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        leftovers = end_process_group(process)
    output = log_path.read_text(errors="replace")
    if returncode is None:
        raise AssertionError(f"{label} ran past {timeout_s}s and was killed; its log ends:\n{output[-6000:]}")
    if returncode != 0 or not result_path.exists():
        raise AssertionError(f"{label} exited with {returncode}; its log ends:\n{output[-6000:]}")
    if leftovers:
        raise AssertionError(f"{label} left processes behind: {leftovers}")
    raw: dict[str, Any] = json.loads(result_path.read_text())
    return raw, output


def run_engine(
    job: EngineJob, workdir: Path, *, timeout_s: float = ENGINE_TIMEOUT_S, interpreter: Path | None = None
) -> EngineResult:
    """Run ``job`` in a new engine process (files under ``workdir``; under ``interpreter`` when given, as
    :func:`run_process` says); raises with the process's log on any failure."""
    raw, output = run_process(
        "e2e.engine_process",
        asdict(job),
        workdir,
        label="the engine process",
        timeout_s=timeout_s,
        interpreter=interpreter,
    )
    return EngineResult(
        steps=[_step_result(step) for step in raw["steps"]],
        log=output,
        startup_s=raw["startup_s"],
        kv_bytes_per_block=raw.get("kv_bytes_per_block", 0),
        blocks_per_chunk=raw.get("blocks_per_chunk", 0),
        kvtriton_origin=raw.get("kvtriton_origin", ""),
    )
