"""A trace replayed in the order vLLM 0.33's OffloadingConnector calls its manager.

:mod:`kvtriton.sim._replay` calls a manager request by request, the way
kvtriton's own API is meant to be driven (with ``touch``). vLLM's connector
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``)
calls it step by step instead, and never calls ``touch``. Per engine step,
:func:`replay_vllm_order` makes the calls the connector makes, in its order:

1. completions reported by the workers since the last step:
   ``complete_load`` of the loads prepared one step earlier,
   ``complete_store`` of the stores prepared two steps earlier;
2. for each request scheduled for the first time (``arrivals`` new ones per
   step, after the ones deferred last step): ``on_new_request`` (once per
   request; its context already holds every prompt key's token position, as
   the scheduler records them), then ``lookup`` from the first chunk until
   the first miss. A ``HIT_PENDING`` among the hits defers the request to the
   next step (the connector answers "not yet"); otherwise the hits are
   ``prepare_load``-ed and the request computes the rest of its prompt in
   the next step, once its asynchronous load is in (``sync_loads=True``: in
   this step, as with vLLM's ``sync_load_budget_bytes``); a request without
   hits computes at once;
3. the connector's meta-building phase: ``prepare_store`` of the chunks
   computed in this step (the prompt after the loaded prefix: vLLM offloads
   the prompt only by default), then ``on_request_finished`` for the requests
   that finish in this step, ``decode_steps`` steps after their prompt.

The trace models the host tier alone: every prompt block is looked up in host
memory, as if the GPU prefix cache held nothing, and a fixed number of
requests is admitted per step. Tests drive vLLM's own manager and kvtriton's
adapter with it (``tests/sim/test_vllm_order_parity.py``) and ``bench/manager.py``
times it. ``kvtriton simulate --call-order vllm`` uses the fuller model of
:mod:`kvtriton.sim._vllm_server` instead (admission by ``max_num_seqs``, the
engine's own prefix cache, stores completing a step later, flushes), checked
request by request against vLLM's scheduler; this module's positioned
contexts and hooked calls serve both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvtriton._keys import OffloadKey
from kvtriton._offload_types import LookupResult, ReqContext
from kvtriton.manager import OffloadingManager
from kvtriton.sim._replay import ManagerCalls, PreparedRequest, ReplayStats, StoreOutput

__all__ = [
    "DEFAULT_ARRIVALS",
    "DEFAULT_DECODE_STEPS",
    "HookedManager",
    "PositionedContext",
    "hooked_calls",
    "positioned_contexts",
    "replay_vllm_order",
    "vllm_order",
    "vllm_order_calls",
]

DEFAULT_ARRIVALS = 4
"""New requests the scheduler admits per step."""
DEFAULT_DECODE_STEPS = 2
"""Steps between a request's prompt computation and its end (``on_request_finished``)."""


class PositionedContext(Protocol):
    """A request context that records each key's end-token position (kvtriton's and vLLM's ``ReqContext``)."""

    def set_offload_key_position(
        self, key: Any, end_token: int, /
    ) -> None: ...  # vLLM types its key with its own NewType


CtxT = TypeVar("CtxT")
PCtxT = TypeVar("PCtxT", bound=PositionedContext)


def positioned_contexts(
    requests: Sequence[PreparedRequest], make_context: Callable[[str], PCtxT], *, block_size: int
) -> list[PCtxT]:
    """One context per request, holding each prompt key's end-token position, as vLLM's scheduler records it."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    contexts: list[PCtxT] = []
    for request in requests:
        context = make_context(request.req_id)
        for index, key in enumerate(request.prompt_keys):
            context.set_offload_key_position(key, (index + 1) * block_size)
        contexts.append(context)
    return contexts


def vllm_order_calls(manager: OffloadingManager) -> ManagerCalls[ReqContext]:
    """A kvtriton manager's calls as vLLM's connector makes them: request hooks, no ``touch``."""
    return ManagerCalls(
        lookup=manager.lookup,
        prepare_load=manager.prepare_load,
        touch=None,
        prepare_store=manager.prepare_store,
        complete_load=manager.complete_load,
        complete_store=manager.complete_store,
        hit=LookupResult.HIT,
        pending=LookupResult.HIT_PENDING,
        on_new_request=manager.on_new_request,
        on_request_finished=manager.on_request_finished,
    )


class HookedManager(Protocol):
    """A manager with vLLM 0.33's request hooks, seen the way the replay calls it.

    vLLM's ``CPUOffloadingManager`` and kvtriton's ``VLLMOffloadingManager``
    fit once cast (their keys are vLLM's ``OffloadKey``, the same bytes under
    another ``NewType``; their contexts are vLLM's ``ReqContext``).
    """

    def lookup(self, key: OffloadKey, req_context: Any, /) -> object: ...
    def prepare_load(self, keys: Sequence[OffloadKey], req_context: Any, /) -> object: ...
    def prepare_store(self, keys: Sequence[OffloadKey], req_context: Any, /) -> StoreOutput | None: ...
    def complete_load(self, keys: Sequence[OffloadKey], req_context: Any, /) -> object: ...
    def complete_store(self, keys: Sequence[OffloadKey], req_context: Any, /) -> object: ...
    def on_new_request(self, req_context: Any, /) -> object: ...
    def on_request_finished(self, req_context: Any, /) -> object: ...


def hooked_calls(manager: HookedManager, *, hit: object, pending: object) -> ManagerCalls[Any]:
    """The replay calls of a manager with request hooks (``hit`` / ``pending``: its ``LookupResult`` members)."""
    return ManagerCalls(
        lookup=manager.lookup,
        prepare_load=manager.prepare_load,
        touch=None,
        prepare_store=manager.prepare_store,
        complete_load=manager.complete_load,
        complete_store=manager.complete_store,
        hit=hit,
        pending=pending,
        on_new_request=manager.on_new_request,
        on_request_finished=manager.on_request_finished,
    )


def _check(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- CLI and callers outside the typed world
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def replay_vllm_order(
    calls: ManagerCalls[CtxT],
    requests: Sequence[PreparedRequest],
    contexts: Sequence[CtxT],
    *,
    block_size: int,
    arrivals: int = DEFAULT_ARRIVALS,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    sync_loads: bool = False,
) -> ReplayStats:
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s) through ``calls`` in vLLM's call order (module docstring).

    ``calls.touch`` is never called. ``pending_stops`` counts deferrals (a
    lookup that met a block still being stored); a deferred request is looked
    up again next step and counted once, when it is admitted. By
    default a request that loads computes (and stores) its prompt one
    step later, once its load is in (vLLM's asynchronous loads, its default);
    with ``sync_loads`` it computes in the step of its load (vLLM with a
    ``sync_load_budget_bytes``).
    """
    _check("block_size", block_size, 1)
    _check("arrivals", arrivals, 1)
    _check("decode_steps", decode_steps, 1)
    if len(contexts) != len(requests):
        raise ValueError(f"contexts has {len(contexts)} entries for {len(requests)} requests")
    # Bound once: this loop is what bench/manager.py times.
    lookup, prepare_load, prepare_store = calls.lookup, calls.prepare_load, calls.prepare_store
    complete_load, complete_store = calls.complete_load, calls.complete_store
    on_new, on_finished = calls.on_new_request, calls.on_request_finished
    hit, pending = calls.hit, calls.pending

    # Work due at a later step, by step number.
    loads_due: dict[int, list[tuple[CtxT, Sequence[OffloadKey]]]] = {}
    stores_due: dict[int, list[tuple[CtxT, Sequence[OffloadKey]]]] = {}
    compute_due: dict[int, list[tuple[int, int]]] = {}
    finish_due: dict[int, list[CtxT]] = {}
    started = [False] * len(requests)
    deferred: list[int] = []
    next_arrival = 0
    step = 0
    prompt_blocks = hit_blocks = prompt_tokens = blocks_stored = evictions = 0
    refused_stores = refused_blocks = pending_stops = 0

    while next_arrival < len(requests) or deferred or loads_due or stores_due or compute_due or finish_due:
        step += 1
        # 1. Completions the workers reported since the last step.
        for context, keys in loads_due.pop(step, ()):
            complete_load(keys, context)
        for context, keys in stores_due.pop(step, ()):
            complete_store(keys, context)

        # 2. Requests scheduled for the first time: the ones deferred last step first.
        admitted = deferred
        deferred = []
        end = min(next_arrival + arrivals, len(requests))
        admitted.extend(range(next_arrival, end))
        next_arrival = end
        computing = compute_due.pop(step, [])
        for index in admitted:
            context = contexts[index]
            if not started[index]:
                started[index] = True
                if on_new is not None:
                    on_new(context)
            prompt = requests[index].prompt_keys
            hits = 0
            waiting = False
            for key in prompt:
                result = lookup(key, context)
                if result is hit:
                    hits += 1
                elif result is pending:
                    hits += 1
                    waiting = True
                else:
                    break
            if waiting:
                deferred.append(index)
                pending_stops += 1
                continue
            prompt_blocks += len(prompt)
            prompt_tokens += requests[index].prompt_tokens
            if hits:
                hit_blocks += hits
                loaded = prompt[:hits]
                prepare_load(loaded, context)
                loads_due.setdefault(step + 1, []).append((context, loaded))
                if not sync_loads:
                    # An asynchronous load (vLLM's default): the prompt is computed once it is in, next step.
                    compute_due.setdefault(step + 1, []).append((index, hits))
                    continue
            computing.append((index, hits))

        # 3. Meta-building phase: store what this step computed, then end finished requests.
        for index, hits in computing:
            context = contexts[index]
            to_store = requests[index].prompt_keys[hits:]
            if to_store:
                output = prepare_store(to_store, context)
                if output is None:
                    refused_stores += 1
                    refused_blocks += len(to_store)
                else:
                    stored = output.keys_to_store
                    evictions += len(output.evicted_keys)
                    if stored:
                        blocks_stored += len(stored)
                        stores_due.setdefault(step + 2, []).append((context, stored))
            finish_due.setdefault(step + decode_steps, []).append(context)
        finishing = finish_due.pop(step, ())
        if on_finished is not None:
            for context in finishing:
                on_finished(context)

    return ReplayStats(
        requests=len(requests),
        prompt_blocks=prompt_blocks,
        hit_blocks=hit_blocks,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_blocks * block_size,
        blocks_stored=blocks_stored,
        evictions=evictions,
        refused_stores=refused_stores,
        refused_blocks=refused_blocks,
        pending_stops=pending_stops,
    )


def vllm_order(
    requests: Sequence[PreparedRequest],
    manager: OffloadingManager,
    *,
    block_size: int,
    arrivals: int = DEFAULT_ARRIVALS,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    sync_loads: bool = False,
) -> ReplayStats:
    """Replay ``requests`` through a kvtriton ``manager`` in vLLM's call order, with positioned contexts."""
    contexts = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=block_size)
    return replay_vllm_order(
        vllm_order_calls(manager),
        requests,
        contexts,
        block_size=block_size,
        arrivals=arrivals,
        decode_steps=decode_steps,
        sync_loads=sync_loads,
    )
