"""The body of one engine process without a KV connector: requests with their own sampling parameters, in one batch.

Run by :func:`e2e.sampling_job.run_sampling_engine` as ``python -m e2e.sampling_engine JOB_JSON RESULT_JSON`` (tests/ on
``PYTHONPATH``). Every request goes into one ``LLM.generate`` call, so vLLM schedules them together;
each comes back with its tokens and, when it asked for them, its prompt log-probabilities. What the
test compares them with (``transformers`` on the same weights) is computed in the test process.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from e2e.engine_process import job_main  # sets vLLM's CPU environment on import, as this process needs
from e2e.vllm_cpu import ENGINE_ENV, cpu_kernels_problem

os.environ.update(ENGINE_ENV)


BASE_SAMPLING: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
"""Greedy, and never cut short by the model's end-of-sequence token (a random model emits it any time)."""


def _prompt_logprob_pairs(positions: list[dict[int, Any] | None] | None) -> list[list[list[float]]]:
    """Each prompt position after the first (vLLM gives the first none) as [token, logprob] pairs: JSON keys are strings."""
    return [
        [[token, entry.logprob] for token, entry in position.items()]
        for position in (positions or [])[1:]
        if position is not None
    ]


def run(job: dict[str, Any]) -> dict[str, Any]:
    problem = cpu_kernels_problem()
    if problem is not None:
        raise RuntimeError(f"vLLM CPU kernels: {problem}")
    import vllm
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm: Any = LLM(  # Any: vLLM's LLM leaves much of what is used here untyped
        model=job["model"],
        dtype=job["dtype"],
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=len(job["requests"]),
        max_num_batched_tokens=job["max_model_len"] * len(job["requests"]),
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        enforce_eager=True,
        seed=0,
    )
    startup_s = time.monotonic() - started
    try:
        params: list[Any] = []
        for request in job["requests"]:
            sampling = {**BASE_SAMPLING, **request["sampling"]}
            if "logit_bias" in sampling:
                sampling["logit_bias"] = {int(token): float(bias) for token, bias in sampling["logit_bias"]}
            params.append(SamplingParams(**sampling))
        prompts = [{"prompt_token_ids": request["prompt"]} for request in job["requests"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return {
            "outputs": [
                {
                    "token_ids": list(output.outputs[0].token_ids),
                    "prompt_logprobs": _prompt_logprob_pairs(output.prompt_logprobs),
                }
                for output in outputs
            ],
            "startup_s": startup_s,
            "vllm_version": vllm.__version__,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    sys.exit(job_main(run, sys.argv[1:]))
