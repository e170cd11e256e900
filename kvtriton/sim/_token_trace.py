"""A seeded workload of real token prompts, and its trace in ``kvtriton simulate``'s format.

The built-in workloads of :mod:`kvtriton.sim._workloads` produce block hashes
only, which is all the simulator needs. To check a prediction against a real
engine, the engine needs the prompts themselves: :func:`token_workload` makes a
few hundred short requests as token ids (Zipf-popular system prompts, each
followed by a unique user message, mixed with multi-turn conversations that
resend their history and a fixed answer), and :func:`write_trace` writes the
same requests as a JSON-lines trace whose block hashes are chained over the
token ids, so two requests share a block exactly when the engine's prefix
cache would say they do. A producer sends :attr:`TokenRequest.prompt` to the
engine (with ``max_tokens=1``) and runs ``kvtriton simulate --trace`` on the
file.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtriton._int_argument import check_int
from kvtriton.sim._workloads import check_block_size


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One request as an engine receives it: an id and its prompt's token ids."""

    req_id: str
    prompt: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenWorkloadParams:
    """The shape of :func:`token_workload`'s trace (lengths in tokens, ranges inclusive)."""

    requests: int = 300
    system_prompts: int = 12
    """Distinct system prompts, chosen with Zipf popularity."""
    zipf_s: float = 1.0
    system_tokens: tuple[int, int] = (64, 256)
    user_tokens: tuple[int, int] = (8, 64)
    conversation_share: float = 0.4
    """Share of requests that are a turn of a conversation (the rest are one-off questions)."""
    live_conversations: int = 6
    """Conversations open at once; a finished one is replaced by a new one."""
    turns: tuple[int, int] = (2, 5)
    answer_tokens: tuple[int, int] = (16, 48)
    """The fixed answer each turn appends to the history before the next user message."""
    first_token: int = 10
    """Smallest token id used (leaves the model's special tokens alone)."""
    vocab_size: int = 1000
    """Token ids are drawn from ``first_token .. vocab_size - 1``."""

    def __post_init__(self) -> None:
        for name in ("requests", "system_prompts", "live_conversations", "vocab_size"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("system_tokens", "user_tokens", "turns", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(low, high)!r}")
        if not 0.0 <= self.conversation_share <= 1.0:
            raise ValueError(f"conversation_share must be in 0..1, got {self.conversation_share!r}")
        if not self.zipf_s > 0:
            raise ValueError(f"zipf_s must be positive, got {self.zipf_s!r}")
        if not 0 <= self.first_token < self.vocab_size:
            raise ValueError(f"first_token must be in 0..vocab_size-1, got {self.first_token!r}")


def token_workload(seed: int = 0, params: TokenWorkloadParams | None = None) -> list[TokenRequest]:
    """The requests of the workload ``params`` describes; the same seed always gives the same prompts."""
    shape = params if params is not None else TokenWorkloadParams()
    rng = random.Random(seed)

    def tokens(count_range: tuple[int, int]) -> list[int]:
        return [rng.randrange(shape.first_token, shape.vocab_size) for _ in range(rng.randint(*count_range))]

    systems = [tokens(shape.system_tokens) for _ in range(shape.system_prompts)]
    weights = [1.0 / (rank + 1) ** shape.zipf_s for rank in range(shape.system_prompts)]

    def system() -> list[int]:
        return list(rng.choices(systems, weights)[0])

    # Each open conversation: its history so far (the last prompt plus its answer) and the turns left.
    conversations: list[tuple[list[int], int]] = []
    requests: list[TokenRequest] = []
    for index in range(shape.requests):
        if rng.random() < shape.conversation_share:
            while len(conversations) < shape.live_conversations:
                conversations.append((system(), rng.randint(*shape.turns)))
            slot = rng.randrange(len(conversations))
            history, turns_left = conversations[slot]
            prompt = history + tokens(shape.user_tokens)
            if turns_left > 1:
                conversations[slot] = (prompt + tokens(shape.answer_tokens), turns_left - 1)
            else:
                conversations.pop(slot)
        else:
            prompt = system() + tokens(shape.user_tokens)
        requests.append(TokenRequest(f"req-{index:04d}", tuple(prompt)))
    return requests


def block_hashes(prompt: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes of ``prompt``'s full blocks (hex): block ``i``'s covers every token up to its end."""
    check_block_size(block_size)
    hashes: list[str] = []
    previous = b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        block = prompt[start : start + block_size]
        digest = hashlib.blake2b(previous + b"".join(token.to_bytes(4, "big") for token in block), digest_size=16)
        previous = digest.digest()
        hashes.append(digest.hexdigest())
    return hashes


def trace_lines(requests: Sequence[TokenRequest], block_size: int) -> Iterator[str]:
    """``requests`` as ``kvtriton simulate`` trace lines: ``{"id", "blocks", "tokens"}``, one JSON object each."""
    for request in requests:
        record = {
            "id": request.req_id,
            "blocks": block_hashes(request.prompt, block_size),
            "tokens": len(request.prompt),
        }
        yield json.dumps(record, separators=(",", ":"))


def write_trace(path: str | Path, requests: Sequence[TokenRequest], block_size: int) -> Path:
    """Write ``requests`` as a JSON-lines trace file for ``kvtriton simulate --trace`` (see :func:`trace_lines`)."""
    trace_path = Path(path)
    with trace_path.open("w", encoding="utf-8") as handle:
        handle.write(
            f"# {len(requests)} requests, {block_size} tokens per block, written by kvtriton.sim._token_trace\n"
        )
        for line in trace_lines(requests, block_size):
            handle.write(line + "\n")
    return trace_path
