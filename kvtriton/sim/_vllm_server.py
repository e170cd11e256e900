"""A trace replayed through a model of a vLLM 0.33 server: its scheduler, its GPU prefix cache, its transfer timing.

:func:`replay_vllm_server` is the simulator's one loop in vLLM's call order:
``kvtriton simulate --call-order vllm`` sets it from the server's settings,
and :func:`kvtriton.sim._vllm_order.replay_vllm_order` sets it to the
simplest engine (fixed arrivals, no token budget, no GPU cache, stores
reported a step later), the trace the manager benchmark and the parity tests
drive. It models three things, step by step:

**Admission** (``vllm/v1/core/sched/scheduler.py``). Requests wait in arrival
order. Each step first advances the running requests (a prefill chunk, or one
decode token each) within ``max_num_batched_tokens``, then admits waiting ones
while the token budget lasts and fewer than ``max_num_seqs`` requests *run*.
A request waiting for its asynchronous load (``WAITING_FOR_REMOTE_KVS``) does
not run, so it does not count: the engine admits bursts of loading requests.
A request whose lookup meets a block still being stored (``HIT_PENDING``), or
a block another request is still loading, is skipped this step and tried again
the next (the connector answers "not yet"). Admission also stops at the first
request whose whole prompt does not fit in the free GPU blocks (vLLM's
``scheduler_reserve_full_isl``; an asynchronous load must also leave the
blocks that loading requests still need).

**The GPU prefix cache** (:class:`~kvtriton.sim._gpu_prefix_cache.GpuPrefixCache`).
With ``gpu_blocks`` set, a new request first takes the longest prefix the GPU
cache holds (at most ``prompt_tokens - 1`` tokens: the last prompt token is
always computed), and only the blocks after it are looked up in the offload
tier, up to the first miss. vLLM's metrics count exactly those: the request's
*external queries* are its prompt tokens after the GPU hit, its *external hits*
the tokens loaded from the offload tier (``external_prefix_cache_queries`` and
``external_prefix_cache_hits``).

**Transfer timing** (``offloading/scheduler.py`` and ``offloading/worker.py``).
A load prepared at step ``s`` is reported done at the end of step
``s + load_steps - 1`` (1: within its own step), and its request computes the
rest of its prompt the step after. A store is prepared in the step whose
computation fills its blocks; the worker submits it at the start of the next
step and it completes asynchronously, reported at the end of step
``s + store_steps``; until then its blocks look up as ``HIT_PENDING``. The
stored blocks are the prompt's full blocks from the end of the loaded prefix
(from block 0 when nothing was loaded: blocks the GPU cache served are offered
again, and the manager skips those it holds); vLLM offloads prompts only, so
output blocks are never stored. A ``prepare_store`` that returns ``None`` is
tried again the next step, as the connector does. A finished request's store
is done at once (vLLM flushes it) when one of its GPU blocks goes to other
tokens or into a new request's block table.

Arrivals: all requests at step 1 (``arrivals=None``, a burst, what a load
generator sending everything at once produces), ``arrivals`` new ones per step,
or ``sequential``: each request arrives the step after the previous one
finished (a client that waits for each answer); the previous request's stores
may still be in flight, and a lookup that meets one waits for it.

**Preemption.** A running request that finds no free GPU block for its next
tokens preempts the last running request (itself, if it is the last): the
victim frees its blocks, returns to the head of the waiting queue and starts
over from a fresh prefix lookup once its stores are done (they are flushed in
that step); no other request is admitted in a step that preempted. As in
vLLM's metrics, a preempted request's second admission is not counted in its
outcome nor in the totals.

Not modelled: vLLM's asynchronous scheduling (the synchronous scheduler is
modelled: vLLM's on CPU, or with ``--no-async-scheduling``), partial-tail
blocks, sliding windows and hybrid models, several blocks per offloaded chunk
(GPU and offload blocks are the same size here), speculative decoding.
``tests/sim/test_simulate_vllm_scheduler.py`` checks the model against vLLM's own
scheduler request by request.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._gpu_prefix_cache import GpuPrefixCache
from kvtriton.sim._replay import (
    ManagerCalls,
    PreparedRequest,
    ReplayStats,
    positioned_contexts,
    prepare,
    vllm_order_calls,
)
from kvtriton.sim._workloads import Request

__all__ = [
    "DEFAULT_LOAD_STEPS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_OUTPUT_TOKENS",
    "DEFAULT_STORE_STEPS",
    "ServerModel",
    "ServerStats",
    "RequestOutcome",
    "predict",
    "replay_vllm_server",
]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM 0.33's ``SchedulerConfig.max_num_batched_tokens`` default."""
DEFAULT_OUTPUT_TOKENS = 1
"""Tokens each request generates (vLLM's ``max_tokens``)."""
DEFAULT_LOAD_STEPS = 1
"""A load is reported done at the end of the step that submits it."""
DEFAULT_STORE_STEPS = 2
"""A store completes at the end of the second step after the one that prepared it."""

CtxT = TypeVar("CtxT")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True, slots=True)
class ServerModel:
    """The server settings the replay models (see the module docstring)."""

    max_num_seqs: int | None = None
    """vLLM's ``--max-num-seqs``: requests running at once (None: no limit)."""
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """vLLM's ``--max-num-batched-tokens``: tokens computed per step (chunked prefill; None: no limit)."""
    gpu_blocks: int | None = None
    """The server's GPU KV cache size in blocks, its prefix cache on (None: prefix caching off, no block limit)."""
    arrivals: int | None = None
    """New requests per step (None: every request at step 1)."""
    sequential: bool = False
    """Each request arrives the step after the previous one finished (its stores may still be in flight)."""
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    """Tokens each request generates (vLLM's ``max_tokens``)."""
    load_steps: int = DEFAULT_LOAD_STEPS
    store_steps: int = DEFAULT_STORE_STEPS
    sync_loads: bool = False
    """Loads complete within the step that schedules them (vLLM's ``sync_load_budget_bytes``, unbounded)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_blocks", "arrivals"):
            value: object = getattr(self, name)
            if value is not None:
                _check_int(name, value, 2 if name == "gpu_blocks" else 1)
        for name in ("output_tokens", "load_steps", "store_steps"):
            _check_int(name, getattr(self, name), 1)
        if self.sequential and self.arrivals is not None:
            raise ValueError(f"sequential and arrivals={self.arrivals} are two arrival patterns; give one")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """Where one request's prompt tokens came from, counted as vLLM's metrics count them."""

    req_id: str
    prompt_tokens: int
    gpu_hit_tokens: int
    """Served by the engine's GPU prefix cache."""
    external_query_tokens: int
    """Prompt tokens after the GPU hit: what vLLM counts in ``external_prefix_cache_queries``."""
    external_hit_tokens: int
    """Loaded from the offload tier: what vLLM counts in ``external_prefix_cache_hits``."""
    admitted_step: int
    deferrals: int
    """Steps the request was skipped because a block it hit was still being stored or loaded."""


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A replay through the server model: the offload tier's counts, per-request outcomes, admission."""

    replay: ReplayStats
    """The offload tier's counts; its ``hit_blocks`` / ``hit_tokens`` are the external hits."""
    outcomes: tuple[RequestOutcome, ...]
    steps: int
    gpu_evictions: int
    """GPU-cached blocks reused for other tokens."""
    max_admitted_per_step: int
    """The largest number of requests admitted (scheduled for the first time) in one step."""
    admission_steps: int
    """Steps that admitted at least one request."""
    preemptions: int
    """Running requests preempted because a running request found no free GPU block for its next tokens."""

    @property
    def prompt_tokens(self) -> int:
        return sum(outcome.prompt_tokens for outcome in self.outcomes)

    @property
    def gpu_hit_tokens(self) -> int:
        return sum(outcome.gpu_hit_tokens for outcome in self.outcomes)

    @property
    def external_query_tokens(self) -> int:
        return sum(outcome.external_query_tokens for outcome in self.outcomes)

    @property
    def external_hit_tokens(self) -> int:
        return sum(outcome.external_hit_tokens for outcome in self.outcomes)

    @property
    def external_hit_rate(self) -> float:
        """vLLM's offload hit rate: ``external_prefix_cache_hits / external_prefix_cache_queries``."""
        queries = self.external_query_tokens
        return self.external_hit_tokens / queries if queries else 0.0

    @property
    def gpu_share(self) -> float:
        """Share of prompt tokens served by the engine's GPU prefix cache."""
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def offload_share(self) -> float:
        """Share of prompt tokens loaded from the offload tier."""
        return self.external_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_share(self) -> float:
        """Share of prompt tokens the engine computed."""
        return 1.0 - self.gpu_share - self.offload_share if self.prompt_tokens else 0.0

    @property
    def mean_admitted_per_step(self) -> float:
        """Requests admitted per step, over the steps that admitted any."""
        return len(self.outcomes) / self.admission_steps if self.admission_steps else 0.0


class _Request:
    """One request's state in the engine: the scheduler's and the connector's."""

    __slots__ = (
        "blocks", "computed", "deferrals", "external", "generated", "index", "local",
        "next_store", "num_prompt", "queries", "state",
    )  # fmt: skip

    def __init__(self, index: int, num_prompt: int) -> None:
        self.index = index
        self.num_prompt = num_prompt
        self.state = "waiting"  # waiting -> (loading -> loaded ->) running -> finished; preempted: waiting again
        self.computed = 0
        self.generated = 0
        self.blocks: list[int] = []
        self.next_store = 0
        self.local = 0
        self.external = 0
        self.queries = 0
        self.deferrals = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.generated


@dataclass(slots=True)
class _Job:
    """A transfer in flight: a request's load or store, due to be reported done at the end of step ``due``."""

    state: _Request
    keys: Sequence[OffloadKey]
    is_store: bool
    due: int
    gpu_blocks: tuple[int, ...] = ()
    """A store's source blocks: reusing one for other tokens makes vLLM wait for the store (a flush)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay_vllm_server(
    calls: ManagerCalls[CtxT],
    requests: Sequence[PreparedRequest],
    contexts: Sequence[CtxT],
    *,
    block_size: int,
    model: ServerModel | None = None,
) -> ServerStats:
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s) through ``calls`` behind the engine ``model``.

    ``calls.touch`` is never called. ``contexts`` should hold each prompt key's
    end-token position (:func:`kvtriton.sim._vllm_order.positioned_contexts`).
    """
    engine = model if model is not None else ServerModel()
    _check_int("block_size", block_size, 1)
    if len(contexts) != len(requests):
        raise ValueError(f"contexts has {len(contexts)} entries for {len(requests)} requests")
    lookup, prepare_load, prepare_store = calls.lookup, calls.prepare_load, calls.prepare_store
    complete_load, complete_store = calls.complete_load, calls.complete_store
    on_new, on_finished = calls.on_new_request, calls.on_request_finished
    hit, pending = calls.hit, calls.pending
    pool = GpuPrefixCache(engine.gpu_blocks) if engine.gpu_blocks is not None else None
    # vLLM tracks keys being loaded only with prefix caching on; a hit on one defers the request.
    being_loaded: dict[OffloadKey, int] | None = {} if pool is not None else None

    states = [_Request(index, request.prompt_tokens) for index, request in enumerate(requests)]
    waiting: deque[_Request] = deque()
    holding: deque[_Request] = deque()  # loading (or loaded) requests: vLLM's kv_holding_waiting, drained first
    running: list[_Request] = []
    jobs: dict[int, _Job] = {}  # by job id: vLLM numbers loads and stores with one counter
    job_ids = 0
    allocated_this_step: set[int] = set()
    loaded: set[int] = set()
    finished_last_step: list[_Request] = []
    outcomes: dict[int, RequestOutcome] = {}
    next_arrival = 0
    step = 0
    blocks_stored = evictions = refused_stores = refused_blocks = pending_stops = preemptions = 0
    max_admitted = admission_steps = 0
    max_seqs = engine.max_num_seqs

    def arrive(count: int) -> None:
        nonlocal next_arrival
        for state in states[next_arrival : next_arrival + count]:
            if on_new is not None:
                on_new(contexts[state.index])  # vLLM's add_request
            waiting.append(state)
        next_arrival = min(next_arrival + count, len(states))

    def key_of_block(state: _Request, index: int) -> Hashable:
        """The GPU cache's hash of block ``index``: the trace's, else one no other request has.

        vLLM hashes every full block, the ones decoding fills too, and a hashed
        block is freed to the back of the free queue: a block the trace does not
        name still needs a hash for the eviction order to be vLLM's.
        """
        request = requests[state.index]
        if index < len(request.prompt_keys):
            return request.prompt_keys[index]
        output = index - len(request.prompt_keys)
        return request.output_keys[output] if output < len(request.output_keys) else (state.index, index)

    def grow(state: _Request, num_tokens: int) -> bool:
        """Give ``state`` the blocks for ``num_tokens`` tokens; False when the pool has too few free."""
        if pool is None:
            return True
        need = _cdiv(num_tokens, block_size) - len(state.blocks)
        if need > pool.num_free:
            return False
        if need > 0:
            taken = pool.allocate(need)
            state.blocks += taken
            allocated_this_step.update(taken)
        return True

    def preempt(victim: _Request) -> None:
        """vLLM's _preempt_request: free the blocks, start over from the head of the waiting queue."""
        nonlocal preemptions
        preemptions += 1
        assert pool is not None  # only a bounded pool runs out of blocks
        pool.free(victim.blocks)
        victim.blocks = []
        victim.computed = 0
        victim.state = "waiting"
        waiting.appendleft(victim)
        for job in jobs.values():  # the connector flushes the victim's stores in this step
            if job.state is victim:
                job.due = step

    def cache_up_to(state: _Request, num_tokens: int) -> None:
        if pool is None:
            return
        for index in range(min(num_tokens, state.num_tokens) // block_size):
            pool.cache(state.blocks[index], key_of_block(state, index))

    if pool is not None and engine.gpu_blocks is not None:
        usable = engine.gpu_blocks - 1
        for request in requests:
            needed = _cdiv(request.prompt_tokens + engine.output_tokens, block_size)
            if needed > usable:
                raise ValueError(
                    f"request {request.req_id!r} needs {needed} GPU blocks ({request.prompt_tokens} prompt tokens +"
                    f" {engine.output_tokens} output) but gpu_blocks={engine.gpu_blocks} leaves {usable}"
                    " (block 0 is vLLM's null block); vLLM would refuse it too"
                )

    while next_arrival < len(states) or waiting or holding or running or jobs or finished_last_step:
        step += 1
        arrived_before = next_arrival
        # Arrivals, before this step's schedule().
        if engine.sequential:
            if next_arrival < len(states) and not (waiting or holding or running):
                arrive(1)
        elif engine.arrivals is not None:
            arrive(engine.arrivals)
        elif step == 1:
            arrive(len(states))

        # schedule(): running requests first; one that finds no free block preempts the last one running.
        budget = engine.max_num_batched_tokens if engine.max_num_batched_tokens is not None else sys.maxsize
        scheduled: list[tuple[_Request, int]] = []
        preempted_now = False
        index = 0
        while index < len(running) and budget > 0:
            state = running[index]
            new = min(state.num_tokens - state.computed, budget)
            while not grow(state, state.computed + new):
                victim = running.pop()
                preempt(victim)
                preempted_now = True
                if victim is state:
                    break
            if state.state != "running":
                break
            cache_up_to(state, state.computed + new)
            scheduled.append((state, new))
            budget -= new
            index += 1

        # Then waiting requests: those holding KV (loading) first, then new ones, in order.
        admitted = 0
        skipped_holding: list[_Request] = []
        skipped_waiting: list[_Request] = []
        while not preempted_now and budget > 0 and (holding or waiting):
            if max_seqs is not None and len(running) >= max_seqs:
                break
            queue = holding if holding else waiting
            state = queue[0]
            if state.state == "loading":
                if state.index not in loaded:
                    skipped_holding.append(queue.popleft())
                    continue
                # The load is in: its blocks join the prefix cache; a whole-prompt hit recomputes the last token.
                loaded.discard(state.index)
                state.state = "loaded"
                cache_up_to(state, state.computed)
                if state.computed == state.num_tokens:
                    state.computed -= 1
            if state.state == "loaded":
                new = min(state.num_tokens - state.computed, budget)
                if not grow(state, state.computed + new):
                    break
                cache_up_to(state, state.computed + new)
                allocated_this_step.update(state.blocks)  # its whole block table reaches the connector again
                queue.popleft()
                state.state = "running"
                running.append(state)
                scheduled.append((state, new))
                budget -= new
                continue

            request = requests[state.index]
            context = contexts[state.index]
            prompt = request.prompt_keys
            if any(job.state is state for job in jobs.values()):
                # A preempted request whose stores are still in flight: the connector answers "not yet".
                state.deferrals += 1
                pending_stops += 1
                skipped_waiting.append(queue.popleft())
                continue
            if pool is not None:
                full_blocks = [key_of_block(state, index) for index in range(state.num_tokens // block_size)]
                local_blocks = pool.cached_prefix(full_blocks, (state.num_tokens - 1) // block_size)
            else:
                local_blocks = []
            local = len(local_blocks)
            hits = 0
            wait = False
            for key in prompt[local:]:
                result = lookup(key, context)
                if result is hit:
                    hits += 1
                elif result is pending:
                    hits += 1
                    wait = True
                else:
                    break
            if not wait and hits and being_loaded:
                wait = any(key in being_loaded for key in prompt[local : local + hits])
            if wait:
                state.deferrals += 1
                pending_stops += 1
                skipped_waiting.append(queue.popleft())
                continue
            local_tokens, external_tokens = local * block_size, hits * block_size
            cached_tokens = local_tokens + external_tokens
            asynchronous = hits > 0 and (not engine.sync_loads or cached_tokens >= state.num_tokens)
            new = 0 if asynchronous else min(state.num_tokens - cached_tokens, budget)
            if pool is not None:
                # The whole prompt must fit in the free blocks (scheduler_reserve_full_isl), a hit on a free
                # block counting as one it takes; what this step allocates must also leave the blocks that
                # loading requests still need, when this request loads asynchronously too.
                evictable = pool.evictable(local_blocks)
                if _cdiv(state.num_tokens, block_size) - local + evictable > pool.num_free:
                    break
                reserved = 0
                if asynchronous:
                    # Every loading (or loaded, not yet running) request is in one of these two.
                    reserved = sum(
                        max(_cdiv(other.num_tokens, block_size) - len(other.blocks), 0)
                        for other in itertools.chain(holding, skipped_holding)
                    )
                if _cdiv(cached_tokens + new, block_size) - local + evictable > pool.num_free - reserved:
                    break
                pool.touch(local_blocks)
                state.blocks = list(local_blocks)
                grow(state, cached_tokens + new)
                # The connector sees the new request's whole block table, its prefix hits too.
                allocated_this_step.update(local_blocks)
                if not asynchronous:
                    cache_up_to(state, cached_tokens + new)
            queue.popleft()
            admitted += 1
            state.local, state.external = local_tokens, external_tokens
            state.queries = state.num_tokens - local_tokens
            if state.index not in outcomes:  # vLLM's metrics leave a preempted request's second admission out
                outcomes[state.index] = RequestOutcome(
                    request.req_id,
                    request.prompt_tokens,
                    local_tokens,
                    state.queries,
                    external_tokens,
                    step,
                    state.deferrals,
                )
            state.next_store = 0
            if hits:
                keys = prompt[local : local + hits]
                prepare_load(keys, context)
                # CHUNK_LEVEL offloading: storing resumes after the loaded prefix.
                state.next_store = local + hits
                job_ids += 1
                jobs[job_ids] = _Job(state, keys, is_store=False, due=step + engine.load_steps - 1)
                if asynchronous:
                    if being_loaded is not None:
                        for key in keys:
                            being_loaded[key] = being_loaded.get(key, 0) + 1
                    state.state = "loading"
                    state.computed = cached_tokens
                    skipped_holding.append(state)
                    continue
            state.computed = cached_tokens
            state.state = "running"
            running.append(state)
            scheduled.append((state, new))
            budget -= new
        holding.extendleft(reversed(skipped_holding))
        waiting.extendleft(reversed(skipped_waiting))
        if admitted:
            admission_steps += 1
            max_admitted = max(max_admitted, admitted)

        # build_connector_meta(): store what this step computes (prompt only), then end last step's finished requests.
        store_candidates = [(state, state.computed + new) for state, new in scheduled]
        store_candidates += [(state, state.num_prompt) for state in finished_last_step]
        for state, end_tokens in store_candidates:
            prompt = requests[state.index].prompt_keys
            chunks = min(min(end_tokens, state.num_prompt) // block_size, len(prompt))
            if pool is not None:
                chunks = min(chunks, len(state.blocks))
            if chunks <= state.next_store:
                continue
            keys = prompt[state.next_store : chunks]
            output = prepare_store(keys, contexts[state.index])
            if output is None:
                refused_stores += 1
                refused_blocks += len(keys)
                continue  # the connector offers the same chunks again next step
            first = state.next_store
            state.next_store = chunks
            stored = output.keys_to_store
            evictions += len(output.evicted_keys)
            if stored:
                blocks_stored += len(stored)
                job_ids += 1
                chosen = set(stored)
                sources = tuple(state.blocks[i] for i in range(first, chunks) if prompt[i] in chosen) if pool else ()
                jobs[job_ids] = _Job(state, stored, is_store=True, due=step + engine.store_steps, gpu_blocks=sources)
        if allocated_this_step:
            # A finished request's blocks given to other tokens while its store is in flight: vLLM
            # flushes the store (the worker waits for it in this step).
            for job in jobs.values():
                if (
                    job.is_store
                    and job.state.state == "finished"
                    and not allocated_this_step.isdisjoint(job.gpu_blocks)
                ):
                    job.due = step
            allocated_this_step.clear()
        if on_finished is not None:
            for state in finished_last_step:
                on_finished(contexts[state.index])
        finished_last_step = []

        # The forward pass, then update_from_output(): sample, finish, then the workers' completions.
        for state, new in scheduled:
            state.computed += new
            if state.computed >= state.num_tokens:
                state.generated += 1
                if state.generated >= engine.output_tokens:
                    state.state = "finished"
                    running.remove(state)
                    if pool is not None:
                        pool.free(state.blocks)
                    finished_last_step.append(state)
        done = [job_id for job_id, job in jobs.items() if job.due <= step]
        for job_id in done:
            job = jobs.pop(job_id)
            state = job.state
            if job.is_store:
                complete_store(job.keys, contexts[state.index])
                continue
            complete_load(job.keys, contexts[state.index])
            if state.state == "loading":
                loaded.add(state.index)
                if being_loaded is not None:
                    for key in job.keys:
                        left = being_loaded[key] - 1
                        if left:
                            being_loaded[key] = left
                        else:
                            del being_loaded[key]
        progressed = (
            scheduled
            or admitted
            or done
            or jobs
            or finished_last_step
            or preempted_now
            or next_arrival > arrived_before
        )
        if not progressed and (waiting or holding or running):  # a bug guard: every rule above makes progress
            raise RuntimeError(
                f"step {step}: the server model made no progress with {len(waiting) + len(holding) + len(running)} requests left"
            )

    ordered = tuple(outcomes[index] for index in range(len(states)))
    external_blocks = sum(outcome.external_hit_tokens for outcome in ordered) // block_size
    return ServerStats(
        replay=ReplayStats(
            requests=len(requests),
            prompt_blocks=sum(len(request.prompt_keys) for request in requests),
            hit_blocks=external_blocks,
            prompt_tokens=sum(request.prompt_tokens for request in requests),
            hit_tokens=external_blocks * block_size,
            blocks_stored=blocks_stored,
            evictions=evictions,
            refused_stores=refused_stores,
            refused_blocks=refused_blocks,
            pending_stops=pending_stops,
        ),
        outcomes=ordered,
        steps=step,
        gpu_evictions=pool.evictions if pool is not None else 0,
        max_admitted_per_step=max_admitted,
        admission_steps=admission_steps,
        preemptions=preemptions,
    )


def predict(
    requests: Sequence[Request],
    *,
    slots: int,
    block_size: int,
    policy: str = "lru",
    model: ServerModel | None = None,
) -> ServerStats:
    """What a vLLM server with kvtriton's manager of ``slots`` blocks and ``policy`` counts for ``requests``.

    One point of ``kvtriton simulate --call-order vllm``, for a caller that
    already has the trace (:func:`kvtriton.sim._workloads.read_trace`) and the
    server's settings: compare ``external_hit_rate`` with vLLM's
    ``external_prefix_cache_hits / external_prefix_cache_queries``, and
    ``outcomes`` request by request.
    """
    prepared = prepare(requests)
    manager = CPUOffloadingManager(slots, cache_policy=policy)
    contexts = positioned_contexts(prepared, lambda req_id: ReqContext(req_id=req_id), block_size=block_size)
    return replay_vllm_server(vllm_order_calls(manager), prepared, contexts, block_size=block_size, model=model)
