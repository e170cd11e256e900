"""The router in front of a fleet: which engine serves each request of one trace.

``kvtriton simulate --engines N --router NAME`` splits the trace into one
request stream per engine, in arrival order, before any engine runs (a router
that sees no engine's state, as a load balancer in front of ``vllm serve``
replicas does). Two rules, each a pure function of the request and its place
in the trace:

* ``round-robin``: request ``i`` of the trace goes to engine ``i mod N``.
* ``prefix-affinity``: the request goes to the engine a hash of its first
  ``affinity_blocks`` prompt blocks picks (the hash modulo N). Block hashes
  are chained, so two requests go to the same engine exactly when they share
  their first K blocks; a prompt shorter than K full blocks hashes the blocks
  it has, and one with no full block its request id. The hash is BLAKE2b, the
  same in every process (Python's own ``hash`` of bytes changes with
  ``PYTHONHASHSEED``).

K is the knob that matters: below the length of a prefix every request
shares (one system prompt in front of every conversation), every request
lands on one engine; above the prefixes requests share, affinity is random
placement. docs/simulate.md ("Fleet") says how to pick it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal, get_args

from kvtriton._int_argument import check_int
from kvtriton.sim._replay import PreparedRequest

RouterName = Literal["round-robin", "prefix-affinity"]
ROUTERS: tuple[RouterName, ...] = get_args(RouterName)
"""The routers ``--router`` takes, in the order its help lists them."""
DEFAULT_ROUTER: RouterName = "round-robin"
DEFAULT_AFFINITY_BLOCKS = 4
"""``--affinity-blocks``: 4 blocks, 64 tokens at vLLM's default 16 tokens per block."""


def _affinity_engine(request: PreparedRequest, engines: int, affinity_blocks: int) -> int:
    head = request.prompt_keys[:affinity_blocks]
    # Chained hashes: the last of the first K blocks names the whole K-block prefix.
    material = head[-1] if head else request.req_id.encode()
    digest = hashlib.blake2b(material, digest_size=8).digest()
    return int.from_bytes(digest, "big") % engines


def route(
    requests: Sequence[PreparedRequest],
    engines: int,
    router: RouterName,
    *,
    affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS,
) -> list[int]:
    """The engine (0..``engines``-1) each request goes to, in trace order (see the module docstring)."""
    check_int("engines", engines, 1)
    check_int("affinity_blocks", affinity_blocks, 1)
    if router == "round-robin":
        return [index % engines for index in range(len(requests))]
    if router == "prefix-affinity":
        return [_affinity_engine(request, engines, affinity_blocks) for request in requests]
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")


def split_streams(
    requests: Sequence[PreparedRequest], engines: int, assignment: Sequence[int]
) -> list[list[PreparedRequest]]:
    """Each engine's requests, in trace order: ``assignment[i]`` is request ``i``'s engine (from :func:`route`)."""
    if len(assignment) != len(requests):
        raise ValueError(f"assignment has {len(assignment)} entries for {len(requests)} requests")
    streams: list[list[PreparedRequest]] = [[] for _ in range(engines)]
    for request, engine in zip(requests, assignment):
        streams[engine].append(request)
    return streams
