"""The body of one engine process: build a vLLM ``LLM`` on CPU, run a script of steps, write what happened as JSON.

Run by :func:`e2e.engine.run_engine` as ``python -m e2e.engine_process JOB_JSON RESULT_JSON``
(tests/ on ``PYTHONPATH``); the job is an :class:`e2e.engine.EngineJob` as JSON.
The engine core and its worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a step can reach the worker's
kvtriton host slab, and the process leaves no children behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.vllm_cpu import ENGINE_ENV, cpu_kernels_problem

os.environ.update(ENGINE_ENV)

import torch

SETTLE_TIMEOUT_S = 30.0
BARRIER_TIMEOUT_S = 60.0
"""How long a barrier step waits for its test to let it go on."""
FILLER_PROMPT = [3, 4, 5]
"""A prompt shorter than a block: generating it steps the engine (so finished transfers are reported) and stores nothing."""


def vllm_counters(llm: Any) -> dict[str, float]:
    """Every counter vLLM's Prometheus registry holds, summed over its label sets."""
    from vllm.v1.metrics.reader import Counter

    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals


def offloading_gauges(llm: Any) -> dict[str, dict[str, float]]:
    """vLLM's ``vllm:kv_offload*`` gauges: name -> ``k=v,...`` labels -> value (the tiers' up/degraded states)."""
    from vllm.v1.metrics.reader import Gauge

    gauges: dict[str, dict[str, float]] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge) and metric.name.startswith("vllm:kv_offload"):
            labels = ",".join(f"{key}={value}" for key, value in sorted(metric.labels.items()))
            gauges.setdefault(metric.name, {})[labels] = float(metric.value)
    return gauges


def barrier(name: str) -> None:
    """Say ``name`` was reached (a file in the working directory) and wait, bounded, for the test's go-ahead."""
    Path(f"{name}.reached").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not Path(f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: no go-ahead within {BARRIER_TIMEOUT_S}s")
        time.sleep(0.02)


def _offloading_worker() -> Any:
    """The worker side of the OffloadingConnector in this process (the spec's worker: kvtriton's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector: Any = get_kv_transfer_group()  # the OffloadingConnector; vLLM types it as the connector base
    return connector.connector_worker


def _offloading_manager(llm: Any) -> Any:
    """The scheduler side's offloading manager in this process (kvtriton's, or vLLM's tiering manager over kvtriton)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return scheduler.connector.connector_scheduler.manager


def wait_tiers_up(llm: Any) -> None:
    """Wait (bounded) until every secondary tier that connects in the background (Mooncake) is up: a lookup
    before it is up misses."""
    for tier in _offloading_manager(llm).secondary_tiers:
        wait_until_up = getattr(tier, "wait_until_up", None)
        if wait_until_up is not None and not wait_until_up(SETTLE_TIMEOUT_S):
            raise TimeoutError(f"secondary tier {tier.tier_type} not up after {SETTLE_TIMEOUT_S}s")


def _damage_mooncake_values(manager: Any) -> None:
    """What a broken writer to the pool would leave: each chunk's value, the same size, 64 bytes flipped mid-way."""
    from kvtriton.integrations.mooncake import MooncakeStoreTier, open_store

    keys = list(manager.primary_tier.cpu.slot_map())  # the chunks this engine stored (and cascaded)
    tiers = [tier for tier in manager.secondary_tiers if isinstance(tier, MooncakeStoreTier)]
    assert keys and tiers, (keys, tiers)
    for tier in tiers:
        client = open_store(tier.config)
        assert client is not None
        try:
            for key in keys:
                name = tier.object_key(key)
                value = bytearray(client.get(name))
                assert value, f"no value under {name}"
                middle = len(value) // 2
                value[middle : middle + 64] = bytes(byte ^ 0xFF for byte in value[middle : middle + 64])
                client.batch_remove([name], force=True)  # a put keeps an existing object
                assert client.put(name, bytes(value)) == 0
        finally:
            client.close()


PLAINTEXT_RUN = 64
"""The plaintext run no encrypted value may hold (issue 48's test)."""


def _check_mooncake_values_sealed(manager: Any) -> dict[str, int]:
    """Count the pool's values of the chunks kvtriton's primary holds, and those holding any ``PLAINTEXT_RUN``-byte
    run (at any offset) of the chunk's bytes in the primary."""
    import numpy as np

    from kvtriton.integrations.mooncake import MooncakeStoreTier, open_store

    primary = manager.primary_tier
    slots = primary.cpu.slot_map()
    view = primary.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(len(view), -1)
    tiers = [tier for tier in manager.secondary_tiers if isinstance(tier, MooncakeStoreTier)]
    assert slots and tiers, (slots, tiers)
    counted = {"values": 0, "with_plaintext": 0}
    for tier in tiers:
        client = open_store(tier.config)
        assert client is not None
        try:
            for key, slot in slots.items():
                value = bytes(client.get(tier.object_key(key)))
                assert value, f"no value under {tier.object_key(key)}"
                plaintext = rows[slot].tobytes()
                runs = {plaintext[start : start + PLAINTEXT_RUN] for start in range(len(plaintext) - PLAINTEXT_RUN + 1)}
                counted["values"] += 1
                counted["with_plaintext"] += any(
                    value[start : start + PLAINTEXT_RUN] in runs for start in range(len(value) - PLAINTEXT_RUN + 1)
                )
        finally:
            client.close()
    return counted


def _kv_caches(llm: Any) -> list[Any]:
    """The model runner's KV cache tensors, one per attention layer, each indexed by block id first."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return list(runner.kv_caches)


class BlockTables:
    """The block ids vLLM's scheduler allocated to each request (one list per KV cache group), recorded as it allocates."""

    def __init__(self, llm: Any) -> None:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        allocate_slots = manager.allocate_slots
        self.by_request: dict[str, list[list[int]]] = {}

        def recording_allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            allocated = allocate_slots(request, *args, **kwargs)
            if allocated is not None:
                self.by_request[request.request_id] = [
                    list(group) for group in manager.get_block_ids(request.request_id)
                ]
            return allocated

        manager.allocate_slots = recording_allocate_slots


def _prompt_block_bytes(llm: Any, block_ids: list[int], full_blocks: int) -> list[list[bytes]]:
    """The bytes of the prompt's first ``full_blocks`` blocks in every layer (a model with one KV cache group)."""
    return [
        [bytes(kv[block].contiguous().view(-1).view(torch.uint8).numpy()) for kv in _kv_caches(llm)]
        for block in block_ids[:full_blocks]
    ]


def _relative_error(block: list[bytes], reference: list[bytes], dtype: torch.dtype) -> float:
    """``||x - r|| / ||r||`` over one block's elements in every layer (``dtype``: the KV cache's)."""
    values = torch.cat([torch.frombuffer(bytearray(layer), dtype=dtype).double() for layer in block])
    exact = torch.cat([torch.frombuffer(bytearray(layer), dtype=dtype).double() for layer in reference])
    return float((values - exact).pow(2).sum().sqrt() / exact.pow(2).sum().sqrt())


def _logprob_pairs(positions: Any) -> list[list[list[float]]]:
    """vLLM's per-position logprobs (None without ``logprobs``) as [token, logprob] pairs (JSON keys are strings)."""
    listed: list[Any] = [] if positions is None else list(positions)
    return [[[token, entry.logprob] for token, entry in position.items()] for position in listed]


def _step_engine(llm: Any, sampling: Any) -> None:
    llm.generate([{"prompt_token_ids": FILLER_PROMPT}], sampling, use_tqdm=False)


def _settle(llm: Any, sampling: Any) -> None:
    """Step the engine until every transfer in flight has finished and been reported.

    That is: the offloading manager has no pending work (stores, and a tiered
    manager's cascades to its secondary tiers) and vLLM's offloading counters
    stopped moving.
    """
    manager = _offloading_manager(llm) if llm.llm_engine.vllm_config.kv_transfer_config is not None else None
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    before = vllm_counters(llm)
    while True:
        _step_engine(llm, sampling)
        after = vllm_counters(llm)
        moved = {name for name in after if name.startswith("vllm:kv_offload") and after[name] != before.get(name)}
        pending = manager is not None and manager.has_pending_work()
        if not moved and not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"offloading still busy after {SETTLE_TIMEOUT_S}s: counters moving {sorted(moved)}, manager pending {pending}"
            )
        before = after
        if pending:
            time.sleep(0.05)


def settle_offloading(llm: Any) -> None:
    """Step the engine with a filler prompt until no offloading transfer is in flight (:func:`_settle`)."""
    from vllm import SamplingParams

    _settle(llm, SamplingParams(temperature=0.0, max_tokens=1))


def stop_before_scheduler_joins() -> None:
    """Make this process stop itself (SIGSTOP) as the scheduler starts to build the tiered spec's manager.

    By then the worker has created and populated the shared host region and
    the scheduler has not mapped it: the start-up window a crash leaks the
    region in. The test that asks for it SIGKILLs the stopped process.
    """
    from kvtriton.integrations.vllm._tiered_spec import KVTritonTieringOffloadingSpec

    build_manager = KVTritonTieringOffloadingSpec.get_manager

    def stopping_get_manager(self: KVTritonTieringOffloadingSpec) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)
        return build_manager(self)

    KVTritonTieringOffloadingSpec.get_manager = stopping_get_manager


def run(job: dict[str, Any]) -> dict[str, Any]:
    problem = cpu_kernels_problem()
    if problem is not None:
        raise RuntimeError(f"vLLM CPU kernels: {problem}")
    if job.get("stop_before_scheduler_joins"):
        stop_before_scheduler_joins()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_config = job["kv_transfer_config"]
    started = time.monotonic()
    llm: Any = LLM(  # Any: the steps reach into engine internals vLLM does not type
        model=job["model"],
        dtype=job["dtype"],
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=4,
        max_num_batched_tokens=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        kv_cache_dtype=job["kv_cache_dtype"],
        kv_transfer_config=None if kv_config is None else KVTransferConfig(**kv_config),
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **({} if job["attention_backend"] is None else {"attention_backend": job["attention_backend"]}),
    )
    try:
        return _run_steps(llm, job, startup_s=time.monotonic() - started)
    finally:
        # The engine core's shutdown runs the connector's: kvtriton's spec closes its slab and secondary tiers.
        llm.llm_engine.engine_core.shutdown()


def _run_steps(llm: Any, job: dict[str, Any], *, startup_s: float) -> dict[str, Any]:
    from vllm import SamplingParams

    kv_config = job["kv_transfer_config"]
    tables = BlockTables(llm)
    snapshots: dict[str, list[list[bytes]]] = {}
    result: dict[str, Any] = {"startup_s": startup_s, "steps": []}
    filler = SamplingParams(temperature=0.0, max_tokens=1)
    if kv_config is not None:
        spec = _offloading_worker().spec
        result["kv_bytes_per_block"] = spec.config.worker_kv_bytes_per_block
        result["blocks_per_chunk"] = spec.blocks_per_chunk
        result["kvtriton_origin"] = str(Path(sys.modules["kvtriton"].__file__ or "").parent)
    for step in job["steps"]:
        op = step["op"]
        record: dict[str, Any] = {"op": op, "name": step.get("name", op)}
        if op == "generate":
            sampling = SamplingParams(
                temperature=0.0, max_tokens=step["max_tokens"], ignore_eos=True, logprobs=step["logprobs"] or None
            )
            tables.by_request.clear()
            request_started = time.monotonic()
            prompt: dict[str, Any] = {"prompt_token_ids": step["prompt"]}
            if step.get("cache_salt") is not None:
                prompt["cache_salt"] = step["cache_salt"]
            (output,) = llm.generate([prompt], sampling, use_tqdm=False)
            record["seconds"] = time.monotonic() - request_started
            record["token_ids"] = list(output.outputs[0].token_ids)
            record["num_cached_tokens"] = output.num_cached_tokens
            if step["logprobs"]:
                # JSON keys are strings: the pairs travel as lists and become dicts again in StepResult.
                record["logprobs"] = [
                    [[token, entry.logprob] for token, entry in position.items()]
                    for position in output.outputs[0].logprobs
                ]
            # Read the prompt's blocks before anything else runs (the request is finished; its blocks are free).
            (group_block_ids,) = tables.by_request.values()
            if len(group_block_ids) == 1:
                blocks = _prompt_block_bytes(llm, group_block_ids[0], len(step["prompt"]) // job["block_size"])
                snapshots[record["name"]] = blocks
                if step.get("compare_to") is not None:
                    earlier = snapshots[step["compare_to"]]
                    record["blocks_equal"] = [mine == theirs for mine, theirs in zip(blocks, earlier, strict=True)]
                    dtype = _kv_caches(llm)[0].dtype
                    record["blocks_relative_error"] = [
                        _relative_error(mine, theirs, dtype) for mine, theirs in zip(blocks, earlier, strict=True)
                    ]
            elif step.get("compare_to") is not None:
                raise ValueError(
                    f"compare_to needs a model with one KV cache group, this one has {len(group_block_ids)}"
                )
            if step.get("settle", True):
                _settle(llm, filler)
        elif op == "generate_batch":
            # Every prompt in one generate call: vLLM schedules them together, as a server batches requests.
            sampling = SamplingParams(
                temperature=0.0, max_tokens=step["max_tokens"], ignore_eos=True, logprobs=step["logprobs"] or None
            )
            prompts = [{"prompt_token_ids": prompt} for prompt in step["prompts"]]
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            record["completions"] = [
                {
                    "token_ids": list(output.outputs[0].token_ids),
                    "num_cached_tokens": output.num_cached_tokens,
                    "logprobs": _logprob_pairs(output.outputs[0].logprobs),
                }
                for output in outputs
            ]
            _settle(llm, filler)
        elif op == "generate_with_aborts":
            # The prompts submitted together and stepped by hand, as a server's engine loop steps them: after
            # ``abort_after_steps`` steps the ``abort`` ones are aborted mid-flight (with loads and stores of theirs
            # possibly in flight), the others run to their end.
            sampling = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"], ignore_eos=True)
            engine = llm.llm_engine
            ids = [f"{record['name']}-{index}" for index in range(len(step["prompts"]))]
            for request_id, prompt in zip(ids, step["prompts"], strict=True):
                engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
            finished: dict[str, Any] = {}
            deadline = time.monotonic() + SETTLE_TIMEOUT_S * 4
            steps = 0
            while engine.has_unfinished_requests():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{record['name']}: requests still unfinished after {steps} steps")
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                steps += 1
                if steps == step["abort_after_steps"]:
                    engine.abort_request([ids[index] for index in step["abort"]])
            record["completions"] = [
                {
                    "token_ids": list(finished[request_id].outputs[0].token_ids) if request_id in finished else [],
                    "num_cached_tokens": finished[request_id].num_cached_tokens if request_id in finished else 0,
                    "logprobs": [],
                }
                for request_id in ids
            ]
            _settle(llm, filler)
        elif op == "reset_prefix_cache":
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while not llm.reset_prefix_cache():
                if time.monotonic() > deadline:
                    raise TimeoutError("reset_prefix_cache() kept failing: GPU blocks still in use")
                _step_engine(llm, filler)
        elif op == "wait_tiers_up":
            wait_tiers_up(llm)
        elif op == "barrier":
            barrier(step["name"])
        elif op == "check_mooncake_values_sealed":
            record["measured"] = _check_mooncake_values_sealed(_offloading_manager(llm))
        elif op == "damage_mooncake_values":
            _damage_mooncake_values(_offloading_manager(llm))
        elif op == "zero_kv_cache":
            # Nothing left in the KV cache: a block that is right afterwards was written by a load.
            for kv in _kv_caches(llm):
                kv.zero_()
        elif op == "overwrite_host_slab":
            # Replace every byte of kvtriton's host slab: what is loaded afterwards is no longer what was stored.
            generator = torch.Generator().manual_seed(1)
            for engine in _offloading_worker().worker.engines:
                rows = engine.slab.rows
                rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator).view(rows.dtype))
        else:
            raise ValueError(f"unknown step op {op!r} in {step}")
        record["counters"] = vllm_counters(llm)
        record["gauges"] = offloading_gauges(llm)
        result["steps"].append(record)
    return result


def job_main(run_job: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str]) -> int:
    """``JOB_JSON RESULT_JSON``: the job ``e2e.engine.run_process`` wrote, run, and its result written back."""
    job_path, result_path = argv
    result = run_job(json.loads(Path(job_path).read_text()))
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
