"""A trace replayed through a model of a vLLM server: its scheduler, its GPU prefix cache, its transfer timing.

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

Arrivals, as ``vllm bench serve`` sends them: all requests at step 1
(``arrivals=None``, a burst: ``--request-rate inf``), ``concurrency`` N: the
client keeps N requests in flight and sends the next the step after one
finished (``--max-concurrency N``; ``sequential`` is N = 1, a client that waits
for each answer, whose previous request's stores may still be in flight),
``request_rate`` R: Poisson arrivals, R requests per scheduler step on average
(``--request-rate``, its default burstiness 1: exponential gaps, seeded by
``arrival_seed``), or the fixed ``arrivals`` new ones per step of the manager
benchmark. A burst's requests all look their prefixes up in step 1, before
anything is stored: with a secondary tier every existence check of that step
answers MISS, and the verdict stays cached while a request that asked for it
is alive (:mod:`kvtriton.sim._secondary_tier`), as in vLLM.

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

import dataclasses
import itertools
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtriton._int_argument import check_int
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
from kvtriton.sim._secondary_tier import SecondaryTier, TierCounts, TieredManager, tiered_calls
from kvtriton.sim._workloads import Request

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's ``SchedulerConfig.max_num_batched_tokens`` default, and ``vllm serve``'s on a GPU under 70 GiB
(an H100 or H200 defaults to 8192: the planner's ``vllm serve`` line sets it, so the server runs what was modelled)."""
DEFAULT_MAX_NUM_SEQS = 256
"""``vllm serve``'s ``--max-num-seqs`` default on a GPU under 70 GiB (an H100 or H200: 1024,
``SchedulerConfig``'s own: 128); the planner models it when none is given and writes it on its ``vllm serve`` line."""
DEFAULT_OUTPUT_TOKENS = 1
"""Tokens each request generates (vLLM's ``max_tokens``)."""
DEFAULT_LOAD_STEPS = 1
"""A load is reported done at the end of the step that submits it."""
DEFAULT_STORE_STEPS = 2
"""A store completes at the end of the second step after the one that prepared it."""

MAX_DEFERRALS = 1000
"""Steps a request may be deferred before the replay calls it stalled (:class:`StalledRequest`)."""

CtxT = TypeVar("CtxT")


class StalledRequest(RuntimeError):
    """A request deferred without end: vLLM's engine would never serve it either."""

    def __init__(self, message: str, *, req_id: str, prompt_blocks: int) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.prompt_blocks = prompt_blocks


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
    """New requests per step (None, and none of the patterns below: every request at step 1, a burst)."""
    sequential: bool = False
    """Each request arrives the step after the previous one finished (its stores may still be in flight)."""
    concurrency: int | None = None
    """The client keeps this many requests in flight (``vllm bench serve --max-concurrency``)."""
    request_rate: float | None = None
    """Poisson arrivals at this many requests per scheduler step on average (``vllm bench serve --request-rate``)."""
    arrival_seed: int = 0
    """Seeds the Poisson arrivals' gaps."""
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    """Tokens each request generates (vLLM's ``max_tokens``)."""
    load_steps: int = DEFAULT_LOAD_STEPS
    store_steps: int = DEFAULT_STORE_STEPS
    sync_loads: bool = False
    """Loads complete within the step that schedules them (vLLM's ``sync_load_budget_bytes``, unbounded)."""
    stores_mark_present: bool = True
    """A tier's finished store turns the lookup verdicts cached for its keys into hits (vLLM's lookup cache's
    ``mark_present``, which the home release has; :class:`~kvtriton.sim._secondary_tier.TieredManager`). False: a
    verdict cached before the store stands until the requests that asked for it end. A caller beside a real engine
    takes it from the installed vLLM (``kvtriton.integrations.vllm``'s ``LOOKUPS_MARK_PRESENT``)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "gpu_blocks", "arrivals"):
            value: object = getattr(self, name)
            if value is not None:
                check_int(name, value, 2 if name == "gpu_blocks" else 1)
        for name in ("output_tokens", "load_steps", "store_steps"):
            check_int(name, getattr(self, name), 1)
        if self.concurrency is not None:
            check_int("concurrency", self.concurrency, 1)
        rate = self.request_rate
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"request_rate must be a finite number > 0 (requests per step), got {rate!r}")
        patterns = [
            name
            for name, given in (
                ("sequential", self.sequential),
                (f"arrivals={self.arrivals}", self.arrivals is not None),
                (f"concurrency={self.concurrency}", self.concurrency is not None),
                (f"request_rate={rate}", rate is not None),
            )
            if given
        ]
        if len(patterns) > 1:
            count = ("two", "three", "four")[len(patterns) - 2]
            raise ValueError(f"{' and '.join(patterns)} are {count} arrival patterns; give one")

    @property
    def in_flight_limit(self) -> int | None:
        """The client's concurrency: 1 when sequential, None when arrivals do not wait for answers."""
        return 1 if self.sequential else self.concurrency

    def arrival_steps(self, count: int) -> list[int] | None:
        """With ``request_rate``: the step each of ``count`` requests arrives at (the first at step 1)."""
        if self.request_rate is None:
            return None
        draw = random.Random(self.arrival_seed)
        steps: list[int] = []
        elapsed = 0.0
        for index in range(count):
            if index:  # vllm bench serve sends the first request at once, then waits an exponential gap per request
                elapsed += draw.expovariate(self.request_rate)
            steps.append(1 + math.floor(elapsed))
        return steps


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
    prompt_tokens: int
    """The outcomes' totals from here to ``external_hit_tokens``."""
    gpu_hit_tokens: int
    external_query_tokens: int
    external_hit_tokens: int
    steps: int
    gpu_evictions: int
    """GPU-cached blocks reused for other tokens."""
    max_admitted_per_step: int
    """The largest number of requests admitted (scheduled for the first time) in one step."""
    admission_steps: int
    """Steps that admitted at least one request."""
    preemptions: int
    """Running requests preempted because a running request found no free GPU block for its next tokens."""
    tiers: TierCounts | None = None
    """With a secondary tier: the host tier's and the tier's counts as vLLM's tiering metrics report them."""

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
        "blocks",
        "cached_blocks",
        "computed",
        "deferrals",
        "external",
        "generated",
        "index",
        "local",
        "next_store",
        "num_prompt",
        "queries",
        "state",
    )

    def __init__(self, index: int, num_prompt: int) -> None:
        self.index = index
        self.num_prompt = num_prompt
        self.state = "waiting"  # waiting -> (loading -> loaded ->) running -> finished; preempted: waiting again
        self.computed = 0
        self.generated = 0
        self.blocks: list[int] = []
        self.cached_blocks = 0
        """How many of ``blocks``, from the first, the GPU prefix cache has been told hold their hash."""
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
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s) through ``calls`` behind the server ``model``.

    ``calls.touch`` is never called. ``contexts`` should hold each prompt key's
    end-token position (:func:`kvtriton.sim._replay.positioned_contexts`).
    Each step is vLLM's: arrivals, ``schedule()`` (running requests, then
    waiting ones), ``build_connector_meta()`` (stores, finished requests),
    then the forward pass and ``update_from_output()`` (see the module docstring).
    """
    (stats,) = replay_vllm_servers([ServerStream(calls, requests, contexts)], block_size=block_size, model=model)
    return stats


@dataclass(frozen=True, slots=True)
class ServerStream(Generic[CtxT]):
    """One server's manager calls and request stream, for :func:`replay_vllm_servers`."""

    calls: ManagerCalls[CtxT]
    requests: Sequence[PreparedRequest]
    contexts: Sequence[CtxT]


def replay_vllm_servers(
    streams: Sequence[ServerStream[CtxT]],
    *,
    block_size: int,
    model: ServerModel | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> list[ServerStats]:
    """Replay several servers in lockstep, one scheduler step each in turn (see :func:`replay_vllm_server`).

    Each stream is one server with its own manager; servers whose managers
    share a secondary tier (one Mooncake pool) see each other's cascades in
    the order their steps interleave. ``on_finished`` is told, after each
    round in which requests finished, how many did (a progress bar's unit:
    a long replay moves it long before it ends).
    """
    check_int("block_size", block_size, 1)
    server_model = model if model is not None else ServerModel()
    servers = [_ServerReplay(stream, block_size, server_model) for stream in streams]
    reported = 0
    while True:
        busy = [server for server in servers if server.has_work()]
        if not busy:
            return [server.stats() for server in servers]
        for server in busy:
            server.step()
        finished = sum(server.finished_requests for server in servers)
        if on_finished is not None and finished > reported:
            on_finished(finished - reported)
            reported = finished


class _ServerReplay(Generic[CtxT]):
    """The state of one replay through the server model, advanced one scheduler step at a time."""

    def __init__(self, stream: ServerStream[CtxT], block_size: int, model: ServerModel) -> None:
        if len(stream.contexts) != len(stream.requests):
            raise ValueError(f"contexts has {len(stream.contexts)} entries for {len(stream.requests)} requests")
        self.calls = stream.calls
        self.requests = stream.requests
        self.contexts = stream.contexts
        self.block_size = block_size
        self.model = model
        self.pool = GpuPrefixCache(model.gpu_blocks) if model.gpu_blocks is not None else None
        # vLLM tracks keys being loaded only with prefix caching on; a hit on one defers the request.
        self.being_loaded: dict[OffloadKey, int] | None = {} if self.pool is not None else None
        self.states = [_Request(index, request.prompt_tokens) for index, request in enumerate(self.requests)]
        self.waiting: deque[_Request] = deque()
        # Loading (or loaded) requests: vLLM's kv_holding_waiting, drained first.
        self.holding: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.jobs: dict[int, _Job] = {}  # by job id: vLLM numbers loads and stores with one counter
        self.job_ids = 0
        self.allocated_this_step: set[int] = set()
        self.loaded: set[int] = set()
        self.finished_last_step: list[_Request] = []
        self.outcomes: dict[int, RequestOutcome] = {}
        self.next_arrival = 0
        self.arrival_steps = model.arrival_steps(len(self.states))
        self.step_number = 0
        self.blocks_stored = self.evictions = self.refused_stores = self.refused_blocks = 0
        self.finished_requests = 0
        self.pending_stops = self.preemptions = self.max_admitted = self.admission_steps = 0
        self._check_requests_fit()

    def _check_requests_fit(self) -> None:
        if self.model.gpu_blocks is None:
            return
        usable = self.model.gpu_blocks - 1
        for request in self.requests:
            needed = _cdiv(request.prompt_tokens + self.model.output_tokens, self.block_size)
            if needed > usable:
                raise ValueError(
                    f"request {request.req_id!r} needs {needed} GPU blocks ({request.prompt_tokens} prompt tokens +"
                    f" {self.model.output_tokens} output) but gpu_blocks={self.model.gpu_blocks} leaves {usable}"
                    " (block 0 is vLLM's null block); vLLM would refuse it too"
                )

    def has_work(self) -> bool:
        return bool(
            self.next_arrival < len(self.states)
            or self.waiting
            or self.holding
            or self.running
            or self.jobs
            or self.finished_last_step
            or self._tier_busy()
        )

    def _tier_busy(self) -> bool:
        """A tiered manager's cascades, promotions or existence checks are still in flight."""
        busy = self.calls.has_pending_work
        return busy is not None and busy()

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> None:
        self.step_number += 1
        arrived_before = self.next_arrival
        self._arrivals()
        budget = self.model.max_num_batched_tokens if self.model.max_num_batched_tokens is not None else sys.maxsize
        scheduled: list[tuple[_Request, int]] = []
        budget, preempted_now = self._schedule_running(scheduled, budget)
        admitted = 0 if preempted_now else self._schedule_waiting(scheduled, budget)
        if admitted:
            self.admission_steps += 1
            self.max_admitted = max(self.max_admitted, admitted)
        self._build_connector_meta(scheduled)
        done = self._update_from_output(scheduled)
        progressed = (
            scheduled
            or admitted
            or done
            or self.jobs
            or self.finished_last_step
            or preempted_now
            or self.next_arrival > arrived_before
            or self._tier_busy()
        )
        if not progressed and (self.waiting or self.holding or self.running):  # a bug guard: every rule makes progress
            left = len(self.waiting) + len(self.holding) + len(self.running)
            raise RuntimeError(f"step {self.step_number}: the server model made no progress with {left} requests left")

    def _arrivals(self) -> None:
        """Arrivals, before this step's schedule()."""
        limit = self.model.in_flight_limit
        if limit is not None:
            in_flight = len(self.waiting) + len(self.holding) + len(self.running)
            if in_flight < limit:
                self._arrive(limit - in_flight)
        elif self.arrival_steps is not None:
            due = self.next_arrival
            while due < len(self.arrival_steps) and self.arrival_steps[due] <= self.step_number:
                due += 1
            self._arrive(due - self.next_arrival)
        elif self.model.arrivals is not None:
            self._arrive(self.model.arrivals)
        elif self.step_number == 1:
            self._arrive(len(self.states))

    def _arrive(self, count: int) -> None:
        on_new = self.calls.on_new_request
        for state in self.states[self.next_arrival : self.next_arrival + count]:
            if on_new is not None:
                on_new(self.contexts[state.index])  # vLLM's add_request
            self.waiting.append(state)
        self.next_arrival = min(self.next_arrival + count, len(self.states))

    def _schedule_running(self, scheduled: list[tuple[_Request, int]], budget: int) -> tuple[int, bool]:
        """schedule(), first part: running requests; one that finds no free block preempts the last one running."""
        preempted_now = False
        index = 0
        while index < len(self.running) and budget > 0:
            state = self.running[index]
            new = min(state.num_tokens - state.computed, budget)
            while not self._grow(state, state.computed + new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is state:
                    break
            if state.state != "running":
                break
            self._cache_up_to(state, state.computed + new)
            scheduled.append((state, new))
            budget -= new
            index += 1
        return budget, preempted_now

    def _schedule_waiting(self, scheduled: list[tuple[_Request, int]], budget: int) -> int:
        """schedule(), second part: waiting requests, those holding KV (loading) first, then new ones, in order."""
        admitted = 0
        skipped_holding: list[_Request] = []
        skipped_waiting: list[_Request] = []
        max_seqs = self.model.max_num_seqs
        while budget > 0 and (self.holding or self.waiting):
            if max_seqs is not None and len(self.running) >= max_seqs:
                break
            queue = self.holding if self.holding else self.waiting
            state = queue[0]
            if state.state == "loading":
                if state.index not in self.loaded:
                    skipped_holding.append(queue.popleft())
                    continue
                # The load is in: its blocks join the prefix cache; a whole-prompt hit recomputes the last token.
                self.loaded.discard(state.index)
                state.state = "loaded"
                self._cache_up_to(state, state.computed)
                if state.computed == state.num_tokens:
                    state.computed -= 1
            if state.state == "loaded":
                new = min(state.num_tokens - state.computed, budget)
                if not self._grow(state, state.computed + new):
                    break
                self._cache_up_to(state, state.computed + new)
                self.allocated_this_step.update(state.blocks)  # its whole block table reaches the connector again
                queue.popleft()
                state.state = "running"
                self.running.append(state)
                scheduled.append((state, new))
                budget -= new
                continue
            outcome = self._admit_new(state, budget, skipped_holding)
            if outcome == "deferred":
                skipped_waiting.append(queue.popleft())
                continue
            if outcome == "no room":
                break
            queue.popleft()
            admitted += 1
            if outcome == "loading":
                skipped_holding.append(state)
                continue
            new = min(state.num_tokens - state.computed, budget)
            state.state = "running"
            self.running.append(state)
            scheduled.append((state, new))
            budget -= new
        self.holding.extendleft(reversed(skipped_holding))
        self.waiting.extendleft(reversed(skipped_waiting))
        return admitted

    def _admit_new(self, state: _Request, budget: int, skipped_holding: Sequence[_Request]) -> str:
        """A request scheduled for the first time: the GPU cache's prefix, then the offload tier's lookups.

        Returns ``deferred`` (skipped this step), ``no room`` (admission stops),
        ``loading`` (its asynchronous load is prepared) or ``running``.
        """
        calls, pool, block_size = self.calls, self.pool, self.block_size
        request = self.requests[state.index]
        context = self.contexts[state.index]
        prompt = request.prompt_keys
        if any(job.state is state for job in self.jobs.values()):
            # A preempted request whose stores are still in flight: the connector answers "not yet".
            state.deferrals += 1
            self.pending_stops += 1
            return "deferred"
        if pool is not None:
            # The last token is always computed: at most the full blocks before it come from the GPU cache.
            most = (state.num_tokens - 1) // block_size
            full_blocks = prompt if most <= len(prompt) else [self._key_of_block(state, index) for index in range(most)]
            local_blocks = pool.cached_prefix(full_blocks, most)
        else:
            local_blocks = []
        local = len(local_blocks)
        hits = 0
        wait = False
        lookup, hit, pending, retry = calls.lookup, calls.hit, calls.pending, calls.retry
        for key in prompt[local:]:
            result = lookup(key, context)
            if result is hit:
                hits += 1
            elif result is pending:
                hits += 1
                wait = True
            elif result is retry and result is not None:
                wait = True  # a tier's existence check is still out: vLLM scans on, so every check starts now
            else:
                break
        if not wait and hits and self.being_loaded:
            wait = any(key in self.being_loaded for key in prompt[local : local + hits])
        if wait:
            state.deferrals += 1
            self.pending_stops += 1
            if state.deferrals > MAX_DEFERRALS:
                raise StalledRequest(
                    f"request {request.req_id!r} was deferred {MAX_DEFERRALS} steps: its lookups never all hit at"
                    " once (with a secondary tier: promoting the chunks it misses into the host tier evicts others"
                    " of its prompt, for want of room or because the host tier's policy ranks them lowest), and"
                    " vLLM would stall on it too",
                    req_id=request.req_id,
                    prompt_blocks=len(prompt),
                )
            return "deferred"
        local_tokens, external_tokens = local * block_size, hits * block_size
        cached_tokens = local_tokens + external_tokens
        asynchronous = hits > 0 and (not self.model.sync_loads or cached_tokens >= state.num_tokens)
        new = 0 if asynchronous else min(state.num_tokens - cached_tokens, budget)
        if pool is not None:
            # The whole prompt must fit in the free blocks (scheduler_reserve_full_isl), a hit on a free
            # block counting as one it takes; what this step allocates must also leave the blocks that
            # loading requests still need, when this request loads asynchronously too.
            evictable = pool.evictable(local_blocks)
            if _cdiv(state.num_tokens, block_size) - local + evictable > pool.num_free:
                return "no room"
            reserved = 0
            if asynchronous:
                # Every loading (or loaded, not yet running) request is in one of these two.
                reserved = sum(
                    max(_cdiv(other.num_tokens, block_size) - len(other.blocks), 0)
                    for other in itertools.chain(self.holding, skipped_holding)
                )
            if _cdiv(cached_tokens + new, block_size) - local + evictable > pool.num_free - reserved:
                return "no room"
            pool.touch(local_blocks)
            state.blocks = list(local_blocks)
            state.cached_blocks = 0
            self._grow(state, cached_tokens + new)
            # The connector sees the new request's whole block table, its prefix hits too.
            self.allocated_this_step.update(local_blocks)
            if not asynchronous:
                self._cache_up_to(state, cached_tokens + new)
        state.local, state.external = local_tokens, external_tokens
        state.queries = state.num_tokens - local_tokens
        if state.index not in self.outcomes:  # vLLM's metrics leave a preempted request's second admission out
            self.outcomes[state.index] = RequestOutcome(
                request.req_id,
                request.prompt_tokens,
                local_tokens,
                state.queries,
                external_tokens,
                self.step_number,
                state.deferrals,
            )
        state.next_store = 0
        state.computed = cached_tokens
        if hits:
            keys = prompt[local : local + hits]
            calls.prepare_load(keys, context)
            # CHUNK_LEVEL offloading: storing resumes after the loaded prefix.
            state.next_store = local + hits
            self._add_job(_Job(state, keys, is_store=False, due=self.step_number + self.model.load_steps - 1))
            if asynchronous:
                if self.being_loaded is not None:
                    for key in keys:
                        self.being_loaded[key] = self.being_loaded.get(key, 0) + 1
                state.state = "loading"
                return "loading"
        return "running"

    def _build_connector_meta(self, scheduled: Sequence[tuple[_Request, int]]) -> None:
        """build_connector_meta(): store what this step computes (prompt only), then end last step's finished requests."""
        block_size = self.block_size
        store_candidates = [(state, state.computed + new) for state, new in scheduled]
        store_candidates += [(state, state.num_prompt) for state in self.finished_last_step]
        for state, end_tokens in store_candidates:
            prompt = self.requests[state.index].prompt_keys
            chunks = min(min(end_tokens, state.num_prompt) // block_size, len(prompt))
            if self.pool is not None:
                chunks = min(chunks, len(state.blocks))
            if chunks <= state.next_store:
                continue
            keys = prompt[state.next_store : chunks]
            output = self.calls.prepare_store(keys, self.contexts[state.index])
            if output is None:
                self.refused_stores += 1
                self.refused_blocks += len(keys)
                continue  # the connector offers the same chunks again next step
            first = state.next_store
            state.next_store = chunks
            stored = output.keys_to_store
            self.evictions += len(output.evicted_keys)
            if stored:
                self.blocks_stored += len(stored)
                chosen = set(stored)
                sources = (
                    tuple(state.blocks[i] for i in range(first, chunks) if prompt[i] in chosen) if self.pool else ()
                )
                due = self.step_number + self.model.store_steps
                self._add_job(_Job(state, stored, is_store=True, due=due, gpu_blocks=sources))
        if self.allocated_this_step:
            # A finished request's blocks given to other tokens while its store is in flight: vLLM
            # flushes the store (the worker waits for it in this step).
            for job in self.jobs.values():
                if (
                    job.is_store
                    and job.state.state == "finished"
                    and not self.allocated_this_step.isdisjoint(job.gpu_blocks)
                ):
                    job.due = self.step_number
            self.allocated_this_step.clear()
        on_finished = self.calls.on_request_finished
        if on_finished is not None:
            for state in self.finished_last_step:
                on_finished(self.contexts[state.index])
        self.finished_last_step = []
        if self.calls.on_schedule_end is not None:
            self.calls.on_schedule_end()

    def _update_from_output(self, scheduled: Sequence[tuple[_Request, int]]) -> list[int]:
        """The forward pass, then update_from_output(): sample, finish, then the workers' completions."""
        for state, new in scheduled:
            state.computed += new
            if state.computed >= state.num_tokens:
                state.generated += 1
                if state.generated >= self.model.output_tokens:
                    state.state = "finished"
                    self.finished_requests += 1
                    self.running.remove(state)
                    if self.pool is not None:
                        self.pool.free(state.blocks)
                    self.finished_last_step.append(state)
        done = [job_id for job_id, job in self.jobs.items() if job.due <= self.step_number]
        for job_id in done:
            job = self.jobs.pop(job_id)
            state = job.state
            if job.is_store:
                self.calls.complete_store(job.keys, self.contexts[state.index])
                continue
            self.calls.complete_load(job.keys, self.contexts[state.index])
            if state.state == "loading":
                self.loaded.add(state.index)
                if self.being_loaded is not None:
                    for key in job.keys:
                        left = self.being_loaded[key] - 1
                        if left:
                            self.being_loaded[key] = left
                        else:
                            del self.being_loaded[key]
        return done

    # -- blocks and jobs -------------------------------------------------------------------------

    def _add_job(self, job: _Job) -> None:
        self.job_ids += 1
        self.jobs[self.job_ids] = job

    def _key_of_block(self, state: _Request, index: int) -> Hashable:
        """The GPU cache's hash of block ``index``: the trace's, else one no other request has.

        vLLM hashes every full block, the ones decoding fills too, and a hashed
        block is freed to the back of the free queue: a block the trace does not
        name still needs a hash for the eviction order to be vLLM's.
        """
        request = self.requests[state.index]
        if index < len(request.prompt_keys):
            return request.prompt_keys[index]
        output = index - len(request.prompt_keys)
        return request.output_keys[output] if output < len(request.output_keys) else (state.index, index)

    def _grow(self, state: _Request, num_tokens: int) -> bool:
        """Give ``state`` the blocks for ``num_tokens`` tokens; False when the pool has too few free."""
        if self.pool is None:
            return True
        need = _cdiv(num_tokens, self.block_size) - len(state.blocks)
        if need > self.pool.num_free:
            return False
        if need > 0:
            taken = self.pool.allocate(need)
            state.blocks += taken
            self.allocated_this_step.update(taken)
        return True

    def _preempt(self, victim: _Request) -> None:
        """vLLM's _preempt_request: free the blocks, start over from the head of the waiting queue."""
        self.preemptions += 1
        assert self.pool is not None  # only a bounded pool runs out of blocks
        self.pool.free(victim.blocks)
        victim.blocks = []
        victim.cached_blocks = 0
        victim.computed = 0
        victim.state = "waiting"
        self.waiting.appendleft(victim)
        for job in self.jobs.values():  # the connector flushes the victim's stores in this step
            if job.state is victim:
                job.due = self.step_number

    def _cache_up_to(self, state: _Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` in the GPU prefix cache (vLLM's cache_blocks).

        Only the blocks past those registered before: a block the request holds keeps its hash until it is
        freed (only a free block is reused), so registering it again would change nothing; the count starts
        over when the request's block table does (admission, preemption).
        """
        pool = self.pool
        if pool is None:
            return
        end = min(num_tokens, state.num_tokens) // self.block_size
        if end <= state.cached_blocks:
            return
        blocks = state.blocks
        prompt = self.requests[state.index].prompt_keys
        for index in range(state.cached_blocks, end):
            pool.cache(blocks[index], prompt[index] if index < len(prompt) else self._key_of_block(state, index))
        state.cached_blocks = end

    def stats(self) -> ServerStats:
        ordered = tuple(self.outcomes[index] for index in range(len(self.states)))
        external_hit_tokens = sum(outcome.external_hit_tokens for outcome in ordered)
        external_blocks = external_hit_tokens // self.block_size
        return ServerStats(
            replay=ReplayStats(
                requests=len(self.requests),
                prompt_blocks=sum(len(request.prompt_keys) for request in self.requests),
                hit_blocks=external_blocks,
                prompt_tokens=sum(request.prompt_tokens for request in self.requests),
                hit_tokens=external_blocks * self.block_size,
                blocks_stored=self.blocks_stored,
                evictions=self.evictions,
                refused_stores=self.refused_stores,
                refused_blocks=self.refused_blocks,
                pending_stops=self.pending_stops,
            ),
            outcomes=ordered,
            prompt_tokens=sum(outcome.prompt_tokens for outcome in ordered),
            gpu_hit_tokens=sum(outcome.gpu_hit_tokens for outcome in ordered),
            external_query_tokens=sum(outcome.external_query_tokens for outcome in ordered),
            external_hit_tokens=external_hit_tokens,
            steps=self.step_number,
            gpu_evictions=self.pool.evictions if self.pool is not None else 0,
            max_admitted_per_step=self.max_admitted,
            admission_steps=self.admission_steps,
            preemptions=self.preemptions,
        )


def predict(
    requests: Sequence[Request],
    *,
    slots: int,
    block_size: int,
    policy: str = "lru",
    model: ServerModel | None = None,
    tier: SecondaryTier | None = None,
) -> ServerStats:
    """What a vLLM server with kvtriton's manager of ``slots`` blocks and ``policy`` counts for ``requests``.

    One point of ``kvtriton simulate --call-order vllm``, for a caller that
    already has the trace (:func:`kvtriton.sim._workloads.read_trace`) and the
    server's settings: compare ``external_hit_rate`` with vLLM's
    ``external_prefix_cache_hits / external_prefix_cache_queries``, and
    ``outcomes`` request by request.

    With ``tier`` the host tier is the primary of vLLM's tiered offloading
    (:class:`~kvtriton.sim._secondary_tier.TieredManager`) in front of it, and
    ``tiers`` holds both tiers' counts. ``tier`` keeps what it holds: predict
    again with the same tier for a restarted engine (empty host tier and GPU
    cache, the tier as it was).
    """
    prepared = prepare(requests)
    manager = CPUOffloadingManager(slots, cache_policy=policy)
    contexts = positioned_contexts(prepared, lambda req_id: ReqContext(req_id=req_id), block_size=block_size)
    if tier is None:
        return replay_vllm_server(vllm_order_calls(manager), prepared, contexts, block_size=block_size, model=model)
    tiered = TieredManager(manager, tier, stores_mark_present=(model or ServerModel()).stores_mark_present)
    stats = replay_vllm_server(tiered_calls(tiered), prepared, contexts, block_size=block_size, model=model)
    return dataclasses.replace(stats, tiers=tiered.counts())
