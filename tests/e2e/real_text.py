"""Real text through a real model: the engines the real-model end-to-end tests and ``bench/compression.py`` share.

The model is SmolLM2-135M-Instruct (:mod:`bench.real_model`), run in fp32
(its bf16 weights widen exactly) at block size 32; the prompts are its chat
prompts over one shared system prompt. Each engine runs :func:`offload_steps`:
the prompts once (``cold``: computed, stored), again with vLLM's own prefix
cache holding them (``local``), and, after a prefix-cache reset and the KV
cache zeroed, once more (``warm``): the prefix can only come from the
connector. ``local`` and ``warm`` see the same cached prefix and the same
batch, so whatever differs between them comes from what the connector loaded.
:func:`run_engines` starts several engines at once (each in a process of its
own, as :func:`e2e.engine.run_engine` does), so that their start-ups overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.real_model import PreparedModel
from e2e.engine import (
    RESET_PREFIX_CACHE,
    ZERO_KV_CACHE,
    EngineJob,
    EngineResult,
    generate_batch,
    run_engine,
    spec_config,
)
from e2e.vllm_cpu import fp8_kv_cache_problem

BLOCK_SIZE = 32
DTYPE = "float32"
"""The engines' dtype: exact for the bf16 checkpoint, and the dtype in which ``local`` and ``warm`` agree bit for bit."""
KV_CACHE_BYTES = 128 << 20
"""The engine's own KV cache: about 87 blocks of 32 tokens of this model in fp32: it keeps every prompt's blocks."""
HOST_BYTES = 64 << 20
"""kvtriton's host slab for the single-tier engines: room for every prompt's blocks."""


def offload_steps(prompts: Sequence[Sequence[int]], max_tokens: int, *, logprobs: int = 0) -> list[dict[str, object]]:
    """``cold``, ``local`` (vLLM's own prefix cache), reset, KV cache zeroed, ``warm`` (the connector's prefix)."""
    return [
        generate_batch(prompts, max_tokens, "cold", logprobs=logprobs),
        generate_batch(prompts, max_tokens, "local", logprobs=logprobs),
        RESET_PREFIX_CACHE,
        ZERO_KV_CACHE,
        generate_batch(prompts, max_tokens, "warm", logprobs=logprobs),
    ]


def real_text_job(
    model: Path,
    steps: list[dict[str, object]],
    kv_transfer_config: dict[str, object] | None,
    *,
    kv_cache_dtype: str = "auto",
) -> EngineJob:
    """One engine of the real model (fp32, block size 32) with ``kv_transfer_config`` (None: no connector)."""
    return EngineJob(
        model=str(model), steps=steps, kv_transfer_config=kv_transfer_config, block_size=BLOCK_SIZE, max_model_len=512,
        kv_cache_bytes=KV_CACHE_BYTES, dtype=DTYPE, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def single_tier_config(*, kv_compression: str = "none") -> dict[str, object]:
    """kvtriton's single-tier spec with a host slab of :data:`HOST_BYTES` (compressed with ``kv_compression``)."""
    return spec_config("KVTritonOffloadingSpec", cpu_bytes_to_use=HOST_BYTES, kvtriton_kv_compression=kv_compression)


def tiered_config(fs_root: Path, host_bytes: int = HOST_BYTES) -> dict[str, object]:
    """kvtriton's host slab of ``host_bytes`` in front of vLLM's ``fs`` tier rooted at ``fs_root``."""
    return spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=host_bytes,
        secondary_tiers=[{"type": "fs", "root_dir": str(fs_root)}],
    )


def run_engines(jobs: Mapping[str, tuple[EngineJob, Path]]) -> dict[str, EngineResult]:
    """Run every ``name: (job, workdir)`` at once, each engine in a process of its own; their results by name."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(run_engine, job, workdir) for name, (job, workdir) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def distinct_full_blocks(prompts: Sequence[Sequence[int]]) -> int:
    """How many different full blocks the prompts hold (a block is its whole prefix: shared prefixes count once)."""
    return len(
        {tuple(prompt[: BLOCK_SIZE * (index + 1)]) for prompt in prompts for index in range(len(prompt) // BLOCK_SIZE)}
    )


REAL_TEXT_PROMPTS = 6
"""Chat prompts in every engine: the shared system prompt's 3 blocks and 2 of each prompt's own, 15 blocks in all."""
REAL_TEXT_TOKENS = 10
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class RealTextRuns:
    """The real-model engines of the end-to-end tests, on the same prompts (:func:`run_real_text_engines`).

    ``tiered`` runs :func:`offload_steps`; ``disk`` one ``disk`` step, in a
    fresh engine on ``tiered``'s fs root; ``fp8`` :func:`offload_steps`
    without ``local`` (``tiered``'s ``local`` is its reference: the same
    schedule, the exact prefix); ``vllm_fp8`` only ``cold`` (``fp8``'s
    ``cold`` is its reference), and only where vLLM's CPU attention has an fp8 KV cache.
    """

    tiered: EngineResult
    """kvtriton's host slab in front of vLLM's fs tier: every block goes to both."""
    disk: EngineResult
    """A fresh engine (empty slab) on ``tiered``'s fs root: the whole prefix comes from disk."""
    fp8: EngineResult
    """kvtriton's single tier with ``kvtriton_kv_compression="fp8-e4m3"``."""
    vllm_fp8: EngineResult | None
    """No connector, vLLM's own ``kv_cache_dtype="fp8"``; None where this CPU has none (:func:`fp8_kv_cache_problem`)."""
    fs_root: Path


def run_real_text_engines(model: PreparedModel, workdir: Path) -> RealTextRuns:
    """The engines of :class:`RealTextRuns`, their files under ``workdir``: all at once but ``disk``, which starts
    when ``tiered`` has finished (it reads what ``tiered`` wrote)."""
    fs_root = workdir / "real-text-fs"
    prompts = model.chat_prompts[:REAL_TEXT_PROMPTS]
    steps = offload_steps(prompts, REAL_TEXT_TOKENS, logprobs=TOP_LOGPROBS)
    without_local = [step for step in steps if step.get("name") != "local"]
    tiered = real_text_job(model.path, steps, tiered_config(fs_root))
    disk = real_text_job(model.path, [generate_batch(prompts, REAL_TEXT_TOKENS, "disk")], tiered_config(fs_root))
    fp8 = real_text_job(model.path, without_local, single_tier_config(kv_compression="fp8-e4m3"))
    jobs = {"tiered": tiered, "fp8": fp8}
    if fp8_kv_cache_problem() is None:
        jobs["vllm_fp8"] = real_text_job(model.path, steps[:1], None, kv_cache_dtype="fp8")
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        running = {name: pool.submit(run_engine, job, workdir / f"real-text-{name}") for name, job in jobs.items()}
        tiered_result = running["tiered"].result()
        disk_result = run_engine(disk, workdir / "real-text-disk")
        vllm_fp8 = running["vllm_fp8"].result() if "vllm_fp8" in running else None
        return RealTextRuns(
            tiered=tiered_result, disk=disk_result, fp8=running["fp8"].result(), vllm_fp8=vllm_fp8, fs_root=fs_root
        )
