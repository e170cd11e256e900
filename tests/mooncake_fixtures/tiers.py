"""Build a remote tier (Mooncake, in-memory) over a numpy primary and drive it the way vLLM's tiering manager does."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm_fixtures.builders import offloading_config

from kvtriton.integrations.mooncake import MooncakeStoreTier
from kvtriton.integrations.remote import InMemoryStoreTier, RemoteTier
from kvtriton.integrations.vllm import RequestTenant, TierEncryption

__all__ = ["Primary", "chunk_keys", "make_memory_tier", "make_tier", "poll", "resolve_lookups", "run_job", "submit"]

_T = TypeVar("_T")

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class Primary:
    """A primary tier's host memory: ``num_chunks`` rows of ``chunk_bytes``, as vLLM hands it to secondary tiers."""

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        self.rows = np.zeros((num_chunks, chunk_bytes), dtype=np.uint8)
        self.view: memoryview = self.rows.data

    def fill(self, chunks: Sequence[int], seed: int) -> list[bytes]:
        """Random bytes in ``chunks``; returns each chunk's bytes."""
        generator = np.random.default_rng(seed)
        for chunk in chunks:
            self.rows[chunk] = generator.integers(0, 256, self.rows.shape[1], dtype=np.uint8)
        return [self.rows[chunk].tobytes() for chunk in chunks]

    def chunk(self, index: int) -> bytes:
        return self.rows[index].tobytes()


def chunk_keys(count: int, salt: int = 0, group: int = 0) -> list[OffloadKey]:
    """``count`` distinct 32-byte block hashes (as vLLM's sha256 block hashes are) in KV group ``group``."""
    return [make_offload_key(bytes([salt % 256, index % 256]) * 16, group) for index in range(count)]


def _spec(config_bytes: int, encryption: TierEncryption | None, dtype_override: str | None = None) -> CPUOffloadingSpec:
    """vLLM's CPU spec over ``config_bytes`` of host memory; with ``encryption`` it carries it as kvtriton's encrypting
    tiered spec does (``spec.encryption``), so the tier seals per tenant."""
    config = offloading_config({"cpu_bytes_to_use": config_bytes})
    if dtype_override is not None:
        import dataclasses

        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype_override))
    spec = CPUOffloadingSpec(config)
    if encryption is not None:
        setattr(spec, "encryption", encryption)  # vLLM's spec declares no such attribute
    return spec


def make_tier(
    master_address: str,
    primary: Primary,
    *,
    namespace: str = "test",
    timeout_s: float = 5.0,
    dtype_override: str | None = None,
    wait_up: bool = True,
    encryption: TierEncryption | None = None,
    **tier_config: object,
) -> MooncakeStoreTier:
    spec = _spec(primary.rows.nbytes, encryption, dtype_override)
    tier = MooncakeStoreTier(
        spec,
        primary.view,
        "MooncakeStoreTier",
        master_server_address=master_address,
        namespace=namespace,
        timeout_s=timeout_s,
        **tier_config,  # pyright: ignore[reportArgumentType] -- the tests pass config keys by name, as vLLM's factory does
    )
    if wait_up:
        assert tier.wait_until_up(timeout_s + 5), "the tier never reached the master"
    return tier


def make_memory_tier(
    store: str,
    primary: Primary,
    *,
    timeout_s: float = 5.0,
    encryption: TierEncryption | None = None,
    **tier_config: object,
) -> InMemoryStoreTier:
    """An in-memory tier (no server) over ``primary``, on the process's store called ``store``, once up; with
    ``encryption``, one that seals per tenant."""
    spec = _spec(primary.rows.nbytes, encryption)
    tier = InMemoryStoreTier(
        spec,
        primary.view,
        "InMemoryStoreTier",
        store=store,
        timeout_s=timeout_s,
        **tier_config,  # pyright: ignore[reportArgumentType] -- the tests pass config keys by name, as vLLM's factory does
    )
    assert tier.wait_until_up(timeout_s + 5), "the in-memory tier never came up"
    return tier


def poll(check: Callable[[], _T | None], timeout_s: float, what: str) -> _T:
    """``check()`` every few ms until it returns something; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None:
            return result
        assert time.monotonic() < deadline, f"{what}: nothing after {timeout_s} s"
        time.sleep(0.005)


_job_ids = iter(range(1, 1 << 62))


def submit(
    tier: RemoteTier,
    keys: Sequence[OffloadKey],
    chunks: Sequence[int],
    *,
    load: bool,
    tenant: RequestTenant | None = None,
) -> TransferJob:
    """Submit one store (``load=False``) or load job, as vLLM's tiering manager does; the job. ``tenant``: recorded
    on the job's request context, as kvtriton's hook on vLLM's connector records it."""
    context = ReqContext(req_id="job")
    if tenant is not None:
        context.set_state(tenant)
    job = TransferJob(next(_job_ids), list(keys), np.array(chunks, dtype=np.int64), load, context)
    (tier.submit_load if load else tier.submit_store)(job)
    return job


def run_job(
    tier: RemoteTier,
    keys: Sequence[OffloadKey],
    chunks: Sequence[int],
    *,
    load: bool,
    timeout_s: float = 15.0,
    tenant: RequestTenant | None = None,
) -> JobResult:
    """Submit one store (``load=False``) or load job and wait for its result through ``get_finished_jobs``."""
    job = submit(tier, keys, chunks, load=load, tenant=tenant)

    def finished() -> JobResult | None:
        results = [result for result in tier.get_finished_jobs() if result.job_id == job.job_id]
        return results[0] if results else None

    return poll(finished, timeout_s, f"job {job.job_id}")


def resolve_lookups(
    tier: RemoteTier, keys: Sequence[OffloadKey], request: str = "req", *, finish: bool = True
) -> list[LookupResult]:
    """Look ``keys`` up as the scheduler does, step after step, until no answer is RETRY; then the request
    finishes, unless ``finish=False`` (its verdicts stay cached while it runs)."""
    context = ReqContext(req_id=request)

    def answers() -> list[LookupResult] | None:
        results = [tier.lookup(key, context) for key in keys]
        if LookupResult.RETRY in results:
            tier.on_schedule_end(END_OF_STEP)  # the step ends: the batch goes to the lookup thread
            return None
        return results

    results = poll(answers, 30.0, "lookups")
    if finish:
        tier.on_request_finished(context)
    return results
