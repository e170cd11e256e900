"""A job for :mod:`e2e.sampling_engine`: one engine without a KV connector, requests with their own sampling parameters.

:func:`run_sampling_engine` runs it in a process of its own (the launcher of :mod:`e2e.engine`) and
returns each request's tokens and prompt log-probabilities.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e2e.engine import run_process


@dataclass(frozen=True)
class SampledRequest:
    """One request: its prompt (token ids) and the ``SamplingParams`` arguments it adds to greedy sampling without end-of-sequence (``e2e.sampling_engine.BASE_SAMPLING``)."""

    prompt: list[int]
    sampling: dict[str, Any] = field(default_factory=dict[str, Any])
    """E.g. ``{"logit_bias": {7: 5.0}}``; a ``logit_bias`` travels as ``[[token, bias], ...]`` in the job's JSON."""


@dataclass(frozen=True)
class SamplingJob:
    model: str
    requests: list[SampledRequest]
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 512
    kv_cache_bytes: int = 64 << 20


@dataclass(frozen=True)
class SampledOutput:
    token_ids: list[int]
    prompt_logprobs: list[dict[int, float]]
    """Per prompt position after the first: token id -> log-probability (empty unless ``prompt_logprobs`` was asked)."""


@dataclass(frozen=True)
class SamplingResult:
    outputs: list[SampledOutput]
    startup_s: float
    """How long ``LLM(...)`` took (engine start: model load, KV cache, profiling run)."""
    vllm_version: str


def run_sampling_engine(job: SamplingJob, workdir: Path) -> SamplingResult:
    """Run ``job`` in a new engine process (files under ``workdir``); raises with the process's log on any failure."""
    raw_job = asdict(job)
    for request in raw_job["requests"]:
        if "logit_bias" in request["sampling"]:
            request["sampling"]["logit_bias"] = [list(pair) for pair in request["sampling"]["logit_bias"].items()]
    raw, _ = run_process("e2e.sampling_engine", raw_job, workdir, label="the sampling engine process")
    return SamplingResult(
        outputs=[
            SampledOutput(
                token_ids=output["token_ids"],
                prompt_logprobs=[
                    {int(token): logprob for token, logprob in position} for position in output["prompt_logprobs"]
                ],
            )
            for output in raw["outputs"]
        ],
        startup_s=raw["startup_s"],
        vllm_version=raw["vllm_version"],
    )
