"""vLLM's connector call order over the host tier alone: the server model with fixed arrivals and no GPU cache.

:mod:`kvtriton.sim._replay` calls a manager request by request, the way
kvtriton's own API is meant to be driven (with ``touch``). vLLM's connector
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``)
calls it step by step instead, and never calls ``touch``. :func:`replay_vllm_order`
is the model of a vLLM server (:func:`kvtriton.sim._vllm_server.replay_vllm_server`,
one loop for both) set to the simplest engine that makes those calls in that order:

* ``arrivals`` new requests per step, no token budget, no ``max_num_seqs``;
* no GPU prefix cache: every prompt block is looked up in host memory;
* a load is reported at the end of its step and its request computes the
  rest of its prompt the step after (``sync_loads``: in the same step);
* a store is reported at the end of the step after the one that prepared it
  (until then its blocks look up as ``HIT_PENDING`` and a request meeting one
  waits a step);
* ``on_request_finished`` ``decode_steps`` steps after the prompt (the
  server model's ``output_tokens``).

It is the trace that tests drive vLLM's own manager and kvtriton's adapter
with (``tests/sim/test_vllm_order_parity.py``) and that ``bench/manager.py``
times; ``kvtriton simulate --call-order vllm`` sets the server model from the
server's own settings instead (admission by ``max_num_seqs``, the engine's
prefix cache, stores reported two steps later, flushes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvtriton._int_argument import check_int
from kvtriton._offload_types import ReqContext
from kvtriton.manager import OffloadingManager
from kvtriton.sim._replay import ManagerCalls, PreparedRequest, ReplayStats, positioned_contexts, vllm_order_calls
from kvtriton.sim._vllm_server import ServerModel, replay_vllm_server

DEFAULT_ARRIVALS = 4
"""New requests the scheduler admits per step."""
DEFAULT_DECODE_STEPS = 2
"""Steps between a request's prompt computation and its end (``on_request_finished``)."""

CtxT = TypeVar("CtxT")


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
    check_int("decode_steps", decode_steps, 1)  # by its own name: the server model calls it output_tokens
    model = ServerModel(
        max_num_batched_tokens=None,
        arrivals=arrivals,
        output_tokens=decode_steps,
        store_steps=1,
        sync_loads=sync_loads,
    )
    return replay_vllm_server(calls, requests, contexts, block_size=block_size, model=model).replay


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
