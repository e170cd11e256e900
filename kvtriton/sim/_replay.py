"""The order in which a serving engine calls an offloading manager, replayed from a trace.

One loop, :func:`replay_calls`, drives any manager through the calls a
serving engine makes per request -- lookup until the first miss,
prepare_load the hits, touch every key, prepare_store the rest, then
complete_load and complete_store once the request leaves the in-flight
window -- and counts what happened. ``kvtriton simulate`` sweeps it over
capacities; ``bench/manager.py`` times it for kvtriton's manager and vLLM's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvtriton._int_argument import check_int
from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import LookupResult, ReqContext
from kvtriton.manager import OffloadingManager
from kvtriton.sim._workloads import Request, check_block_size


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request with its block hashes turned into offload keys (group 0) once, before any replay."""

    req_id: str
    prompt_keys: tuple[OffloadKey, ...]
    output_keys: tuple[OffloadKey, ...]
    prompt_tokens: int


def prepare(requests: Sequence[Request]) -> list[PreparedRequest]:
    """Turn block hashes into offload keys, sharing one key object per distinct hash."""
    keys: dict[bytes, OffloadKey] = {}

    def key(block_hash: bytes) -> OffloadKey:
        found = keys.get(block_hash)
        if found is None:
            found = keys[block_hash] = make_offload_key(block_hash)
        return found

    return [
        PreparedRequest(
            request.req_id,
            tuple(key(h) for h in request.prompt_blocks),
            tuple(key(h) for h in request.output_blocks),
            request.prompt_tokens,
        )
        for request in requests
    ]


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """What one replay of a trace through one manager observed, in blocks and tokens."""

    requests: int
    prompt_blocks: int
    hit_blocks: int
    prompt_tokens: int
    hit_tokens: int
    blocks_stored: int
    evictions: int
    refused_stores: int
    """``prepare_store`` calls that returned ``None`` (no room: everything evictable was in use)."""
    refused_blocks: int
    """Blocks named in those refused calls."""
    pending_stops: int
    """Lookups that stopped at a block still being stored by an in-flight request."""

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class StoreOutput(Protocol):
    """What the replay reads from a ``prepare_store`` answer (kvtriton's ``PrepareStoreOutput`` or vLLM's)."""

    @property
    def keys_to_store(self) -> list[OffloadKey]: ...
    @property
    def evicted_keys(self) -> list[OffloadKey]: ...


CtxT = TypeVar("CtxT")
KeysCall = Callable[[Sequence[OffloadKey], CtxT], object]


@dataclass(frozen=True, slots=True)
class ManagerCalls(Generic[CtxT]):
    """A manager's bound methods and lookup answers, so that one replay loop drives any manager.

    :func:`manager_calls` builds them for a kvtriton manager; ``bench/manager.py``
    builds them for vLLM's, with its per-request hooks and without ``touch``
    (its connector never calls it).
    """

    lookup: Callable[[OffloadKey, CtxT], object]
    prepare_load: KeysCall[CtxT]
    touch: KeysCall[CtxT] | None
    prepare_store: Callable[[Sequence[OffloadKey], CtxT], StoreOutput | None]
    complete_load: KeysCall[CtxT]
    complete_store: KeysCall[CtxT]
    hit: object
    """The manager's ``LookupResult.HIT``."""
    pending: object
    """The manager's ``LookupResult.HIT_PENDING``."""
    on_new_request: Callable[[CtxT], object] | None = None
    on_request_finished: Callable[[CtxT], object] | None = None
    retry: object = None
    """A tiered manager's RETRY (a secondary tier's existence check has not run yet); None: it never answers one."""
    on_schedule_end: Callable[[], object] | None = None
    """vLLM's per-step hook, the last manager call of a step (a tiered manager submits its tier work there)."""
    has_pending_work: Callable[[], bool] | None = None
    """Whether tier work is still in flight (the server replay steps on until it is done)."""


def manager_calls(manager: OffloadingManager) -> ManagerCalls[ReqContext]:
    """The replay calls of a kvtriton manager."""
    return ManagerCalls(
        lookup=manager.lookup,
        prepare_load=manager.prepare_load,
        touch=manager.touch,
        prepare_store=manager.prepare_store,
        complete_load=manager.complete_load,
        complete_store=manager.complete_store,
        hit=LookupResult.HIT,
        pending=LookupResult.HIT_PENDING,
    )


class PositionedContext(Protocol):
    """A request context that records each key's end-token position (kvtriton's and vLLM's ``ReqContext``)."""

    def set_offload_key_position(
        self, key: Any, end_token: int, /
    ) -> None: ...  # vLLM types its key with its own NewType


PCtxT = TypeVar("PCtxT", bound=PositionedContext)


def positioned_contexts(
    requests: Sequence[PreparedRequest], make_context: Callable[[str], PCtxT], *, block_size: int
) -> list[PCtxT]:
    """One context per request, holding each prompt key's end-token position, as vLLM's scheduler records it."""
    check_block_size(block_size)
    contexts: list[PCtxT] = []
    for request in requests:
        context = make_context(request.req_id)
        for index, key in enumerate(request.prompt_keys):
            context.set_offload_key_position(key, (index + 1) * block_size)
        contexts.append(context)
    return contexts


class HookedManager(Protocol):
    """A manager with vLLM's request hooks, seen the way the replay calls it.

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


def vllm_order_calls(manager: OffloadingManager) -> ManagerCalls[ReqContext]:
    """A kvtriton manager's calls as vLLM's connector makes them: request hooks, no ``touch``."""
    return hooked_calls(manager, hit=LookupResult.HIT, pending=LookupResult.HIT_PENDING)


@dataclass(frozen=True, slots=True)
class _InFlight(Generic[CtxT]):
    context: CtxT
    loaded: tuple[OffloadKey, ...]
    stored: Sequence[OffloadKey]


def replay_calls(
    calls: ManagerCalls[CtxT],
    requests: Sequence[PreparedRequest],
    contexts: Sequence[CtxT],
    *,
    block_size: int,
    in_flight: int = 1,
) -> ReplayStats:
    """Replay ``requests`` (``contexts[i]`` is request ``i``'s) through ``calls``, the way a serving engine calls a manager.

    Per request, on arrival: ``on_new_request``; ``lookup`` the prompt blocks
    in order until the first one that is not a ``HIT``, ``prepare_load`` the
    hits, ``touch`` every prompt block, ``prepare_store`` the missed prompt
    blocks and the output blocks. When the request retires: ``complete_load``
    the hits, ``complete_store`` what was stored, ``on_request_finished``.
    ``in_flight`` requests are admitted before the oldest retires (1: each
    request retires before the next one arrives), so loads in progress pin
    their blocks and stores in progress look up as ``HIT_PENDING``, which
    counts as a miss here (an engine would wait).
    """
    check_int("in_flight", in_flight, minimum=1)
    check_block_size(block_size)
    if len(contexts) != len(requests):
        raise ValueError(f"contexts has {len(contexts)} entries for {len(requests)} requests")
    # Bound once: this loop is what bench/manager.py times.
    lookup, prepare_load, touch, prepare_store = calls.lookup, calls.prepare_load, calls.touch, calls.prepare_store
    complete_load, complete_store = calls.complete_load, calls.complete_store
    on_new, on_finished = calls.on_new_request, calls.on_request_finished
    hit, pending = calls.hit, calls.pending
    window: deque[_InFlight[CtxT]] = deque()
    prompt_blocks = hit_blocks = prompt_tokens = blocks_stored = evictions = 0
    refused_stores = refused_blocks = pending_stops = 0

    def retire(job: _InFlight[CtxT]) -> None:
        if job.loaded:
            complete_load(job.loaded, job.context)
        if job.stored:
            complete_store(job.stored, job.context)
        if on_finished is not None:
            on_finished(job.context)

    for request, context in zip(requests, contexts):
        if len(window) == in_flight:
            retire(window.popleft())
        if on_new is not None:
            on_new(context)
        prompt = request.prompt_keys
        hits = 0
        for key in prompt:
            result = lookup(key, context)
            if result is not hit:
                if result is pending:
                    pending_stops += 1
                break
            hits += 1
        loaded = prompt[:hits]
        if loaded:
            prepare_load(loaded, context)
        if prompt and touch is not None:
            touch(prompt, context)
        to_store = prompt[hits:] + request.output_keys
        stored: Sequence[OffloadKey] = ()
        if to_store:
            output = prepare_store(to_store, context)
            if output is None:
                refused_stores += 1
                refused_blocks += len(to_store)
            else:
                stored = output.keys_to_store
                evictions += len(output.evicted_keys)
                blocks_stored += len(stored)
        prompt_blocks += len(prompt)
        hit_blocks += hits
        prompt_tokens += request.prompt_tokens
        window.append(_InFlight(context, loaded, stored))
    while window:
        retire(window.popleft())
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


def replay(
    requests: Sequence[PreparedRequest],
    manager: OffloadingManager,
    *,
    block_size: int,
    in_flight: int = 1,
) -> ReplayStats:
    """Replay ``requests`` through a kvtriton ``manager`` (see :func:`replay_calls`), one context per request."""
    contexts = [ReqContext(req_id=request.req_id) for request in requests]
    return replay_calls(manager_calls(manager), requests, contexts, block_size=block_size, in_flight=in_flight)
