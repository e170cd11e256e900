"""The body of one fidelity engine process: a vLLM engine on CPU with kvtriton, a workload sent one request at a time.

Run by :func:`e2e.fidelity_table.measure` as ``python -m e2e.fidelity_engine JOB_JSON RESULT_JSON``
(tests/ on ``PYTHONPATH``). Unlike :mod:`e2e.engine_process`, this engine has
a small GPU KV cache (``num_gpu_blocks_override``) with its prefix cache on,
and nothing runs between two requests: no filler prompt steps the engine
(a filler would take a free GPU block and evict a cached one, an eviction
the simulator does not know of). Each request is sent once the previous one
has finished; a store still in flight when the next request looks its blocks
up answers "not yet" and the engine steps until it is done, which is what
the simulator's ``--sequential`` mode counts. With ``all_at_once`` every
request is added before the first step instead (what ``--max-num-seqs``
without ``--arrivals`` models). With ``concurrency`` N the job is a client
that keeps N requests in flight: it adds requests until N are unfinished,
steps the engine, and adds the next ones once some finished (``--arrivals
concurrency:N``; N = 1 is one at a time, N >= the request count a burst).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from e2e.engine_process import job_main, vllm_counters  # sets vLLM's CPU environment on import, as this process needs
from e2e.vllm_cpu import ENGINE_ENV, cpu_kernels_problem

os.environ.update(ENGINE_ENV)


def run(
    job: dict[str, Any],
    *,
    before_requests: Callable[[Any], None] | None = None,
    after_requests: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One engine over the job's prompts; ``before_requests(llm)`` runs once it is up, ``after_requests(llm)`` adds
    to the result before the engine shuts down."""
    problem = cpu_kernels_problem()
    if problem is not None:
        raise RuntimeError(f"vLLM CPU kernels: {problem}")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    started = time.monotonic()
    llm: Any = LLM(  # Any: the job reaches into engine internals vLLM does not type
        model=job["model"],
        dtype="float32",
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        num_gpu_blocks_override=job["gpu_blocks"],
        enable_prefix_caching=True,
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        kv_transfer_config=KVTransferConfig(**job["kv_transfer_config"]),
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    startup_s = time.monotonic() - started
    try:
        connector: Any = get_kv_transfer_group()  # vLLM types it as the connector base
        spec = connector.connector_worker.spec
        sampling = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        prompts: list[dict[str, list[int]]] = [{"prompt_token_ids": prompt} for prompt in job["prompts"]]
        if before_requests is not None:
            before_requests(llm)
        started = time.monotonic()
        if job.get("concurrency") is not None:
            outputs = _with_concurrency(llm, prompts, sampling, job["concurrency"])
        elif job["all_at_once"]:  # every request added before the first step, in the workload's order
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
        else:
            outputs = [llm.generate([prompt], sampling, use_tqdm=False)[0] for prompt in prompts]
        cached = [int(output.num_cached_tokens) for output in outputs]
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        run_s, counters = time.monotonic() - started, vllm_counters(llm)  # before anything else steps the engine
        extra = {} if after_requests is None else after_requests(llm)
        return {
            **extra,
            "startup_s": startup_s,
            "run_s": run_s,
            # The single-tier spec counts slots, the tiered one chunks (one block each here).
            "num_slots": int(spec.num_slots if hasattr(spec, "num_slots") else spec.num_chunks),
            "kv_bytes_per_block": int(spec.config.worker_kv_bytes_per_block),
            "gpu_blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
            "cached_tokens": cached,
            "counters": counters,
        }
    finally:
        # The engine core's shutdown runs the connector's: kvtriton's spec closes its slab.
        llm.llm_engine.engine_core.shutdown()


def _with_concurrency(llm: Any, prompts: list[dict[str, list[int]]], sampling: Any, concurrency: int) -> list[Any]:
    """Each prompt's output, sent by a client that keeps ``concurrency`` requests unfinished: before each engine
    step it adds requests, in order, until that many are in flight."""
    engine = llm.llm_engine
    finished: dict[int, Any] = {}
    sent = 0
    while len(finished) < len(prompts):
        while sent < len(prompts) and sent - len(finished) < concurrency:
            engine.add_request(str(sent), prompts[sent], sampling)
            sent += 1
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output
    return [finished[index] for index in range(len(prompts))]


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
