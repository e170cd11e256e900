"""Request traces for capacity planning: built-in synthetic workloads and user traces.

A trace is a list of :class:`Request`: the hashes of each request's full
prompt blocks, in order, plus the blocks its output completes. Hashes are
chained like vLLM's prefix-cache block hashes (a block's hash covers every
token before it), so two requests share a block exactly when they share the
whole prefix up to and including that block.

Built-in workloads are seeded and deterministic: the same name, parameters,
seed and block size always give the same trace.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import itertools
import json
import math
import random
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, cast

from typing_extensions import Self

from kvtriton._int_argument import check_int

_HASH_BYTES = 16


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the offload tier sees it.

    ``prompt_blocks`` are looked up (a prefix of them can hit) and the rest are
    stored; ``output_blocks`` are the full blocks completed while decoding,
    stored after the prompt's. ``prompt_tokens`` counts the partial last
    prompt block too, which is never cached.
    """

    req_id: str
    prompt_blocks: tuple[bytes, ...]
    prompt_tokens: int
    output_blocks: tuple[bytes, ...] = ()


# --------------------------------------------------------------------------
# Chained block hashes


class _Sequence:
    """A token sequence built from content segments, hashed block by block as it grows.

    Tokens are never materialised: a segment is an id (distinct content) and a
    length, and a block's hash covers the previous block's hash plus the
    (segment, offset, length) pieces it holds.
    """

    __slots__ = ("_block_size", "_fill", "_pieces", "hashes", "tokens")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._fill = 0
        self._pieces: list[bytes] = []
        self.hashes: list[bytes] = []
        self.tokens = 0

    def copy(self) -> _Sequence:
        clone = _Sequence(self._block_size)
        clone._fill = self._fill
        clone._pieces = list(self._pieces)
        clone.hashes = list(self.hashes)
        clone.tokens = self.tokens
        return clone

    def append(self, segment_id: int, length: int) -> None:
        offset = 0
        while offset < length:
            take = min(length - offset, self._block_size - self._fill)
            self._pieces.append(struct.pack(">QII", segment_id, offset, take))
            self._fill += take
            offset += take
            if self._fill == self._block_size:
                previous = self.hashes[-1] if self.hashes else b""
                digest = hashlib.blake2b(previous + b"".join(self._pieces), digest_size=_HASH_BYTES).digest()
                self.hashes.append(digest)
                self._pieces.clear()
                self._fill = 0
        self.tokens += length


def check_block_size(block_size: int) -> None:
    """The one rule for a trace's tokens per block, wherever a block size comes in."""
    check_int("block_size", block_size, minimum=1)


def _one_segment(block_size: int, segment_id: int, length: int) -> _Sequence:
    """A new sequence holding ``length`` tokens of one segment (a shared prompt, a document)."""
    sequence = _Sequence(block_size)
    sequence.append(segment_id, length)
    return sequence


def _request(req_id: str, sequence: _Sequence, output_tokens: int, output_segment: int) -> Request:
    """Snapshot ``sequence`` as a prompt, then append ``output_tokens`` of output to it."""
    prompt = tuple(sequence.hashes)
    prompt_tokens = sequence.tokens
    sequence.append(output_segment, output_tokens)
    return Request(req_id, prompt, prompt_tokens, tuple(sequence.hashes[len(prompt) :]))


# --------------------------------------------------------------------------
# Built-in workloads


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class _Range:
    """A parameter drawn anew for each request (or turn, or example) from ``low..high``, both ends included.

    A user sets it as two parameters, ``X_min`` and ``X_max`` (:meth:`_WorkloadParams.by_user_name`).
    """

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def check(self, name: str) -> None:
        _check_positive(f"{name}_min", self.low)
        _check_positive(f"{name}_max", self.high)
        if self.low > self.high:
            raise ValueError(f"{name}_min must be <= {name}_max, got {self.low} > {self.high}")


@dataclass(frozen=True, slots=True)
class _WorkloadParams:
    """What every workload's parameters share: one rule that checks them all.

    Every field must be positive, and every :class:`_Range` field's low end
    <= its high end, except the fields in ``_checked_apart``, which the class
    checks itself after these (in its ``_check_apart``). The single fields are
    checked first, then the ranges, each in declaration order, so the first
    bad value named is always the same one.
    """

    _checked_apart: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        checked = [(name, value) for name, value in self._fields() if name not in self._checked_apart]
        for name, value in sorted(checked, key=lambda field: isinstance(field[1], _Range)):  # stable: singles first
            if isinstance(value, _Range):
                value.check(name)
            else:
                _check_positive(name, value)
        self._check_apart()

    def _fields(self) -> list[tuple[str, object]]:
        return [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]

    def by_user_name(self) -> dict[str, object]:
        """The values by the names a user sets them by, in declaration order: a range as ``X_min`` and ``X_max``."""
        values: dict[str, object] = {}
        for name, value in self._fields():
            if isinstance(value, _Range):
                values[f"{name}_min"], values[f"{name}_max"] = value.low, value.high
            else:
                values[name] = value
        return values

    def with_user_values(self, changes: Mapping[str, int | float]) -> Self:
        """These parameters with ``changes`` (by :meth:`by_user_name`'s names) applied, checked anew."""
        values = {**self.by_user_name(), **changes}
        fields = {
            name: dataclasses.replace(value, low=values[f"{name}_min"], high=values[f"{name}_max"])
            if isinstance(value, _Range)
            else values[name]
            for name, value in self._fields()
        }
        return dataclasses.replace(self, **fields)

    def _check_apart(self) -> None:
        """The checks of the fields in ``_checked_apart`` (none by default)."""


@dataclass(frozen=True, slots=True)
class SharedPromptParams(_WorkloadParams):
    """Many independent requests behind a few long system prompts (one per app or tool set)."""

    requests: int = 1000
    system_prompts: int = 4
    system_tokens: int = 2048
    user_tokens: _Range = _Range(32, 512)
    output_tokens: int = 128


@dataclass(frozen=True, slots=True)
class ChatParams(_WorkloadParams):
    """Multi-turn conversations, interleaved: each turn's prompt is the whole conversation so far."""

    requests: int = 1000
    active_conversations: int = 48
    turns: _Range = _Range(2, 10)
    system_tokens: int = 256
    user_tokens: _Range = _Range(16, 256)
    output_tokens: _Range = _Range(64, 512)


@dataclass(frozen=True, slots=True)
class FewShotParams(_WorkloadParams):
    """Few-shot prompts: one of many long example prefixes, picked with Zipf popularity, plus a question."""

    requests: int = 1000
    prefixes: int = 200
    zipf_s: float = 1.0
    prefix_tokens: _Range = _Range(512, 2048)
    question_tokens: _Range = _Range(16, 128)
    output_tokens: int = 32


@dataclass(frozen=True, slots=True)
class PrefixSharingParams(_WorkloadParams):
    """Fixed-length requests: part of a Zipf-popular shared prefix, then blocks no other request has.

    Sized in blocks, not tokens: the manager benchmark's trace (``bench/manager.py``),
    whose defaults these are. A request shares the first half to all of its prefix.
    """

    requests: int = 4000
    blocks_per_request: int = 64
    prefixes: int = 400
    prefix_blocks: int = 48
    zipf_s: float = 1.1

    _checked_apart: ClassVar[tuple[str, ...]] = ("prefix_blocks", "zipf_s")

    def _check_apart(self) -> None:
        if not 0 <= self.prefix_blocks <= self.blocks_per_request:
            raise ValueError(f"prefix_blocks must be in 0..{self.blocks_per_request}, got {self.prefix_blocks}")
        if not math.isfinite(self.zipf_s):
            raise ValueError(f"zipf_s must be a finite number >= 0, got {self.zipf_s!r}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")


@dataclass(frozen=True, slots=True)
class SystemPromptsParams(_WorkloadParams):
    """Zipf-popular system prompts (apps, agents, tool sets), each request ending in a unique user message."""

    requests: int = 2000
    system_prompts: int = 40
    zipf_s: float = 1.0
    system_tokens: _Range = _Range(256, 1024)
    user_tokens: _Range = _Range(32, 512)
    output_tokens: int = 64


@dataclass(frozen=True, slots=True)
class MultiTurnParams(_WorkloadParams):
    """Interleaved conversations: each turn's prompt is the whole history, the last answer included, plus a new message."""

    requests: int = 1500
    active_conversations: int = 32
    turns: _Range = _Range(2, 8)
    system_tokens: int = 512
    user_tokens: _Range = _Range(16, 256)
    answer_tokens: _Range = _Range(64, 384)


@dataclass(frozen=True, slots=True)
class PrefixTreeParams(_WorkloadParams):
    """Few-shot prompts as a prefix tree: a task header, the first k of the task's fixed examples, a unique question."""

    requests: int = 2000
    tasks: int = 24
    zipf_s: float = 1.0
    header_tokens: int = 256
    examples_per_task: int = 8
    example_tokens: _Range = _Range(64, 256)
    question_tokens: _Range = _Range(32, 256)
    output_tokens: int = 32


@dataclass(frozen=True, slots=True)
class ScanParams(_WorkloadParams):
    """A hot set of Zipf-popular prompts mixed with long one-off documents that sweep through the cache (a scan)."""

    requests: int = 2000
    hot_prompts: int = 60
    zipf_s: float = 0.9
    hot_tokens: _Range = _Range(128, 768)
    scan_fraction: float = 0.15
    document_tokens: _Range = _Range(1024, 4096)
    question_tokens: _Range = _Range(16, 128)
    output_tokens: int = 32

    _checked_apart: ClassVar[tuple[str, ...]] = ("scan_fraction",)

    def _check_apart(self) -> None:
        if not 0.0 <= self.scan_fraction <= 1.0:
            raise ValueError(f"scan_fraction must be in 0..1, got {self.scan_fraction!r}")


class _SegmentIds:
    """Hands out content ids; distinct ids mean distinct token content."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def new(self) -> int:
        return next(self._next)

    def begin_stream(self, rng: random.Random, stream: int) -> None:
        """From here on the content is server ``stream``'s own: what came before (the shared prompts) is common.

        Stream 0 changes nothing (the workload's one-server trace). Any other
        stream draws its requests from a random source of its own and gives
        its content ids no other stream uses, so N servers share the popular
        prefixes and nothing else.
        """
        if stream:
            rng.seed(f"{rng.getrandbits(64)}-stream-{stream}")
            self._next = itertools.count((stream << 40) + 1)


def _shared_prompt(params: SharedPromptParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    ids = _SegmentIds()
    prompts = [_one_segment(block_size, ids.new(), params.system_tokens) for _ in range(params.system_prompts)]
    ids.begin_stream(rng, stream)
    requests: list[Request] = []
    for index in range(params.requests):
        sequence = rng.choice(prompts).copy()
        sequence.append(ids.new(), params.user_tokens.draw(rng))
        requests.append(_request(f"shared-{index}", sequence, params.output_tokens, ids.new()))
    return requests


@dataclass(slots=True)
class _Conversation:
    name: str
    sequence: _Sequence
    turns_left: int
    turn: int = 0


def _interleaved_conversations(
    name: str,
    params: ChatParams | MultiTurnParams,
    rng: random.Random,
    block_size: int,
    stream: int,
    *,
    answer_tokens: _Range,
) -> list[Request]:
    """Conversations behind one system prompt, a random active one taking each turn.

    A turn's prompt is the whole conversation so far plus a new user message;
    ``_request`` appends the answer, so the next turn resends it. A finished
    conversation is replaced by a new one. ``answer_tokens`` is the one range
    the two workloads name differently; the rest is read from ``params``.
    """
    ids = _SegmentIds()
    system = _one_segment(block_size, ids.new(), params.system_tokens)
    ids.begin_stream(rng, stream)
    started = itertools.count()

    def start() -> _Conversation:
        return _Conversation(f"{name}-{next(started)}", system.copy(), params.turns.draw(rng))

    active = [start() for _ in range(params.active_conversations)]
    generated: list[Request] = []
    for _ in range(params.requests):
        slot = rng.randrange(len(active))
        conversation = active[slot]
        conversation.sequence.append(ids.new(), params.user_tokens.draw(rng))
        answer = answer_tokens.draw(rng)
        generated.append(
            _request(f"{conversation.name}-turn-{conversation.turn}", conversation.sequence, answer, ids.new())
        )
        conversation.turn += 1
        conversation.turns_left -= 1
        if conversation.turns_left == 0:
            active[slot] = start()
    return generated


def _chat(params: ChatParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    answer_tokens = params.output_tokens
    return _interleaved_conversations("chat", params, rng, block_size, stream, answer_tokens=answer_tokens)


def _zipf_cumulative(count: int, s: float) -> list[float]:
    """Cumulative Zipf weights for ``random.choices``: item k (0-based) has weight 1 / (k + 1) ** s."""
    return list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(count)))


def _zipf_prefixes_with_unique_tails(
    name: str,
    params: FewShotParams | SystemPromptsParams,
    rng: random.Random,
    block_size: int,
    stream: int,
    *,
    prefixes: int,
    prefix_tokens: _Range,
    tail_tokens: _Range,
) -> list[Request]:
    """Requests that each pick one of ``prefixes`` shared prompts by Zipf popularity, then add a unique tail.

    The keywords are what the two workloads name differently; the rest is read from ``params``.
    """
    ids = _SegmentIds()
    shared = [_one_segment(block_size, ids.new(), prefix_tokens.draw(rng)) for _ in range(prefixes)]
    ids.begin_stream(rng, stream)
    cumulative = _zipf_cumulative(prefixes, params.zipf_s)
    generated: list[Request] = []
    for index in range(params.requests):
        (chosen,) = rng.choices(shared, cum_weights=cumulative)
        sequence = chosen.copy()
        sequence.append(ids.new(), tail_tokens.draw(rng))
        generated.append(_request(f"{name}-{index}", sequence, params.output_tokens, ids.new()))
    return generated


def _few_shot(params: FewShotParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    return _zipf_prefixes_with_unique_tails(
        "few-shot",
        params,
        rng,
        block_size,
        stream,
        prefixes=params.prefixes,
        prefix_tokens=params.prefix_tokens,
        tail_tokens=params.question_tokens,
    )


def _prefix_sharing(params: PrefixSharingParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    ids = _SegmentIds()
    prefix_ids = [ids.new() for _ in range(params.prefixes)]
    ids.begin_stream(rng, stream)
    cumulative = _zipf_cumulative(params.prefixes, params.zipf_s)
    shortest = (params.prefix_blocks + 1) // 2
    requests: list[Request] = []
    for index in range(params.requests):
        (prefix,) = rng.choices(prefix_ids, cum_weights=cumulative)
        shared = rng.randint(shortest, params.prefix_blocks)
        # Block-aligned segments: the first ``shared`` blocks hash the same in every request of this prefix.
        sequence = _one_segment(block_size, prefix, shared * block_size)
        sequence.append(ids.new(), (params.blocks_per_request - shared) * block_size)
        requests.append(Request(f"prefix-sharing-{index}", tuple(sequence.hashes), sequence.tokens))
    return requests


def _system_prompts(params: SystemPromptsParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    return _zipf_prefixes_with_unique_tails(
        "system-prompts",
        params,
        rng,
        block_size,
        stream,
        prefixes=params.system_prompts,
        prefix_tokens=params.system_tokens,
        tail_tokens=params.user_tokens,
    )


def _multi_turn(params: MultiTurnParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    answer_tokens = params.answer_tokens
    return _interleaved_conversations("multi-turn", params, rng, block_size, stream, answer_tokens=answer_tokens)


def _prefix_tree(params: PrefixTreeParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    ids = _SegmentIds()
    # Per task: its header, then its examples as (content id, length), always in the same order.
    tasks: list[tuple[int, list[tuple[int, int]]]] = []
    for _ in range(params.tasks):
        examples = [(ids.new(), params.example_tokens.draw(rng)) for _ in range(params.examples_per_task)]
        tasks.append((ids.new(), examples))
    ids.begin_stream(rng, stream)
    cumulative = _zipf_cumulative(params.tasks, params.zipf_s)
    requests: list[Request] = []
    for index in range(params.requests):
        ((header, examples),) = rng.choices(tasks, cum_weights=cumulative)
        sequence = _one_segment(block_size, header, params.header_tokens)
        for example, length in examples[: rng.randint(0, params.examples_per_task)]:
            sequence.append(example, length)
        sequence.append(ids.new(), params.question_tokens.draw(rng))
        requests.append(_request(f"prefix-tree-{index}", sequence, params.output_tokens, ids.new()))
    return requests


def _scan(params: ScanParams, rng: random.Random, block_size: int, stream: int) -> list[Request]:
    ids = _SegmentIds()
    hot = [_one_segment(block_size, ids.new(), params.hot_tokens.draw(rng)) for _ in range(params.hot_prompts)]
    ids.begin_stream(rng, stream)
    cumulative = _zipf_cumulative(params.hot_prompts, params.zipf_s)
    requests: list[Request] = []
    for index in range(params.requests):
        if rng.random() < params.scan_fraction:
            # A document read once: every block is new and never asked for again.
            sequence = _one_segment(block_size, ids.new(), params.document_tokens.draw(rng))
            name = f"scan-document-{index}"
        else:
            (chosen,) = rng.choices(hot, cum_weights=cumulative)
            sequence = chosen.copy()
            name = f"scan-hot-{index}"
        sequence.append(ids.new(), params.question_tokens.draw(rng))
        requests.append(_request(name, sequence, params.output_tokens, ids.new()))
    return requests


def _convert(raw: str | int | float, default: object, what: str) -> int | float:
    """Parse ``raw`` as the type of ``default`` (int or float), refusing lossy conversions."""
    try:
        if isinstance(default, float):
            return float(raw)
        if isinstance(raw, str):
            return int(raw.strip())
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError(raw)
        return int(raw)
    except ValueError:
        kind = "a number" if isinstance(default, float) else "an integer"
        raise ValueError(f"{what} must be {kind}, got {raw!r}") from None


P = TypeVar("P", bound=_WorkloadParams)


@dataclass(frozen=True, slots=True)
class Workload(Generic[P]):
    """A named synthetic workload: its parameters (with defaults) and its generator."""

    name: str
    summary: str
    defaults: P
    build: Callable[[P, random.Random, int, int], list[Request]]
    """``(params, rng, block_size, stream)``: ``stream`` numbers the server drawing requests (0: the only one)."""

    def parameters(self) -> dict[str, object]:
        """Parameter names and default values, in declaration order (a range as ``X_min`` and ``X_max``)."""
        return self.defaults.by_user_name()

    def params(self, overrides: Mapping[str, str | int | float]) -> P:
        """The default parameters with ``overrides`` applied (strings are parsed as the field's type)."""
        known = self.parameters()
        changes: dict[str, int | float] = {}
        for name, raw in overrides.items():
            if name not in known:
                raise ValueError(
                    f"workload {self.name!r} has no parameter {name!r}; its parameters are {', '.join(known)}"
                )
            changes[name] = _convert(raw, known[name], f"parameter {name} of workload {self.name!r}")
        try:
            return self.defaults.with_user_values(changes)
        except ValueError as error:  # a value out of range, or values that contradict each other
            raise ValueError(f"workload {self.name!r}: {error}") from None

    def generate(
        self,
        *,
        seed: int,
        block_size: int,
        overrides: Mapping[str, str | int | float] | None = None,
        stream: int = 0,
    ) -> list[Request]:
        """The trace for ``seed``; ``stream`` > 0 is another server's: the same shared prompts, its own requests."""
        check_block_size(block_size)
        check_int("stream", stream, minimum=0)
        return self.build(self.params(overrides or {}), random.Random(seed), block_size, stream)


# Each workload has its own parameter type; callers pick a workload by name and hand it strings.
WORKLOADS: dict[str, Workload[Any]] = {
    workload.name: workload
    for workload in (
        Workload(
            "shared-prompt",
            "independent requests behind a few long shared system prompts",
            SharedPromptParams(),
            _shared_prompt,
        ),
        Workload(
            "chat",
            "interleaved multi-turn conversations; each turn resends the whole history",
            ChatParams(),
            _chat,
        ),
        Workload(
            "few-shot",
            "Zipf-popular few-shot example prefixes, each followed by a new question",
            FewShotParams(),
            _few_shot,
        ),
        Workload(
            "prefix-sharing",
            "the manager benchmark's trace: half to all of a Zipf-popular prefix, then unique blocks",
            PrefixSharingParams(),
            _prefix_sharing,
        ),
        Workload(
            "system-prompts",
            "Zipf-popular system prompts of varied length, each request ending in a unique user message",
            SystemPromptsParams(),
            _system_prompts,
        ),
        Workload(
            "multi-turn",
            "interleaved conversations; each turn resends the history and the last answer",
            MultiTurnParams(),
            _multi_turn,
        ),
        Workload(
            "prefix-tree",
            "few-shot prompts as a prefix tree: task header, the first k fixed examples, a unique question",
            PrefixTreeParams(),
            _prefix_tree,
        ),
        Workload(
            "scan",
            "a Zipf-popular hot set of prompts mixed with long one-off documents that sweep the cache",
            ScanParams(),
            _scan,
        ),
    )
}
"""The built-in workloads by name."""

VLLM_ORDER_WORKLOADS = ("system-prompts", "multi-turn", "prefix-tree", "scan")
"""The four workloads the manager is measured on under vLLM's call order (hit-rate parity test, bench/manager.py)."""


def generate(
    name: str,
    *,
    seed: int = 0,
    block_size: int = 16,
    overrides: Mapping[str, str | int | float] | None = None,
    stream: int = 0,
) -> list[Request]:
    """The trace of built-in workload ``name``; deterministic for a given seed.

    ``stream`` numbers servers sharing one tier (``--servers``): every stream
    has the same shared prompts (system prompts, few-shot prefixes) and
    requests of its own, drawn from its own random source.
    """
    workload = WORKLOADS.get(name)
    if workload is None:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return workload.generate(seed=seed, block_size=block_size, overrides=overrides, stream=stream)


# --------------------------------------------------------------------------
# User traces (JSON lines)


TRACE_FIELDS = ("id", "blocks", "tokens", "output_blocks", "timestamp")
"""The fields of a trace line; ``timestamp`` (a number or a string) is accepted and ignored: requests arrive in
line order, as the call order's knobs space them (``--arrivals``, ``--sequential``)."""

_INT_HASH_TAG = b"\xff"
"""Leads every integer hash's bytes: 0xFF never occurs in UTF-8, so no string hash can equal an integer one."""


def _block_hash(value: object, line: str, field: str, index: int) -> bytes:
    """A trace block hash: a string (used as its UTF-8 bytes) or a non-negative integer (tagged big-endian bytes)."""
    if isinstance(value, str) and value:
        return value.encode()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return _INT_HASH_TAG + value.to_bytes(max(8, (value.bit_length() + 7) // 8), "big")
    raise ValueError(f"{line}: {field}[{index}] must be a non-empty string or a non-negative integer, got {value!r}")


class TraceBlockSizeMismatch(ValueError):
    """A trace read at another block size than it was written at: its block hashes cover ``written`` tokens each.

    ``from_header``: the trace's header says so (certain); else a line's tokens fit only that likely block size.
    """

    def __init__(self, written: int, read_at: int, *, from_header: str | None, detail: str) -> None:
        self.written = written
        self.read_at = read_at
        self.from_header = from_header
        """The header line that records the block size (None: inferred from a line's tokens)."""
        self.detail = detail
        """What does not fit: the source and its header line, or the line and its tokens."""
        if from_header is not None:
            super().__init__(f"{detail}: written at {written} tokens per block, not {read_at}; read it at {written}")
        else:
            super().__init__(f"{detail}; it fits {written} tokens per block: read it at {written} if it was written so")


TRACE_HEADER_BLOCK_SIZE = re.compile(r"\b(\d+) tokens per block\b")
"""How a trace's leading ``#`` comment records its block size, as :func:`kvtriton.sim.write_trace` writes it
(``# 300 requests, 16 tokens per block, written by ...``): a trace read at another block size is refused."""

_LIKELY_BLOCK_SIZES = tuple(2**power for power in range(3, 10))
"""Block sizes a trace is plausibly written at (vLLM's are powers of two: 8 to 512), for a line's hint."""


def _fitting_block_size(blocks: int, tokens: int) -> int | None:
    """The one likely block size at which ``blocks`` full blocks hold ``tokens`` tokens, or None (none, or several)."""
    if blocks < 1:
        return None
    fitting = [size for size in _LIKELY_BLOCK_SIZES if blocks * size <= tokens < (blocks + 1) * size]
    return fitting[0] if len(fitting) == 1 else None


def _parse_line(text: str, line: str, block_size: int) -> Request:
    try:
        record: object = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{line}: not valid JSON ({error.msg} at column {error.colno})") from None
    except ValueError as error:  # an integer literal beyond Python's int_max_str_digits
        raise ValueError(f"{line}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{line}: not valid JSON (nested too deeply)") from None
    if not isinstance(record, dict):
        raise ValueError(f"{line}: expected a JSON object, got {type(record).__name__}")
    fields = cast("dict[str, object]", record)  # JSON object keys are always strings
    unknown = set(fields) - set(TRACE_FIELDS)
    if unknown:
        raise ValueError(f"{line}: unknown field(s) {', '.join(sorted(unknown))}; expected {', '.join(TRACE_FIELDS)}")
    lists: dict[str, tuple[bytes, ...]] = {}
    seen: dict[bytes, str] = {}
    for name in ("blocks", "output_blocks"):
        value = fields.get(name, [] if name == "output_blocks" else None)
        if value is None:
            raise ValueError(f"{line}: missing field 'blocks' (the request's prompt block hashes)")
        if not isinstance(value, list):
            raise ValueError(f"{line}: {name} must be a list of block hashes, got {type(value).__name__}")
        items: list[object] = list(value)  # pyright: ignore[reportUnknownArgumentType] -- untyped JSON list
        hashes = tuple(_block_hash(item, line, name, index) for index, item in enumerate(items))
        for index, (item, block_hash) in enumerate(zip(items, hashes)):
            # Chained hashes cover the whole prefix, so one request never holds a block twice: a repeat is a
            # hash of the block's tokens alone, which would make unrelated prompts share blocks.
            if block_hash in seen:
                raise ValueError(
                    f"{line}: {name}[{index}] repeats {seen[block_hash]} ({item!r}): a request's block hashes are"
                    " chained over the prefix, so none repeats (hash each block together with the ones before it)"
                )
            seen[block_hash] = f"{name}[{index}]"
        lists[name] = hashes
    timestamp: object = fields.get("timestamp", 0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float, str)):
        raise ValueError(f"{line}: timestamp must be a number or a string, got {timestamp!r}")
    blocks = lists["blocks"]
    full_tokens = len(blocks) * block_size
    tokens: object = fields.get("tokens", full_tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ValueError(f"{line}: tokens must be an integer, got {tokens!r}")
    if not full_tokens <= tokens < full_tokens + block_size:
        detail = (
            f"{line}: tokens = {tokens} does not fit {len(blocks)} full blocks of {block_size} tokens"
            f" (expected {full_tokens}..{full_tokens + block_size - 1})"
        )
        fitting = _fitting_block_size(len(blocks), tokens)
        if fitting is not None:
            raise TraceBlockSizeMismatch(fitting, block_size, from_header=None, detail=detail)
        raise ValueError(detail)
    if tokens == 0:
        raise ValueError(
            f"{line}: blocks is empty and tokens is 0: a request has at least one prompt token (a prompt shorter"
            f" than one block lists no blocks and gives tokens, 1..{block_size - 1})"
        )
    req_id: object = fields.get("id", line)
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ValueError(f"{line}: id must be a string or an integer, got {req_id!r}")
    return Request(str(req_id), blocks, tokens, lists["output_blocks"])


def parse_trace(lines: Iterable[str], *, block_size: int = 16, source: str = "trace") -> Iterator[Request]:
    """Parse JSON-lines requests; a bad line raises ``ValueError`` naming ``source``, the line and why.

    A ``#`` comment before the first request that says ``N tokens per block``
    (:data:`TRACE_HEADER_BLOCK_SIZE`) records the block size the hashes were
    computed at: another ``block_size`` raises :class:`TraceBlockSizeMismatch`,
    as does a line whose tokens fit only another likely block size.
    Each line that is neither blank nor a ``#`` comment is an object:
    ``blocks`` (list of block hashes, strings or non-negative integers,
    required), ``tokens`` (prompt length, default ``len(blocks) * block_size``),
    ``output_blocks`` (default none) and ``id``.
    """
    check_block_size(block_size)
    requests_seen = False
    for number, text in enumerate(lines, start=1):
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            header = TRACE_HEADER_BLOCK_SIZE.search(stripped)
            if not requests_seen and header is not None and int(header.group(1)) != block_size:
                raise TraceBlockSizeMismatch(
                    int(header.group(1)), block_size, from_header=stripped, detail=f"{source} line {number}"
                )
            continue
        requests_seen = True
        yield _parse_line(text, f"{source} line {number}", block_size)


_GZIP_MAGIC = b"\x1f\x8b"


def read_trace(path: str | Path, *, block_size: int = 16) -> list[Request]:
    """Read a JSON-lines trace file (see :func:`parse_trace`), gzip-compressed or not; an empty trace is an error.

    A gzip file is recognised by its first bytes, not its name, so a pipe of
    one works too.
    """
    trace_path = Path(path)
    compressed = False
    try:
        with trace_path.open("rb") as raw:
            compressed = raw.peek(2)[:2] == _GZIP_MAGIC  # peek, not read: a pipe cannot seek back
            binary: gzip.GzipFile | io.BufferedReader = gzip.GzipFile(fileobj=raw) if compressed else raw
            with io.TextIOWrapper(binary, encoding="utf-8-sig") as handle:  # -sig: drop a byte order mark
                requests = list(parse_trace(handle, block_size=block_size, source=str(trace_path)))
    except UnicodeDecodeError as error:
        what = "its decompressed bytes are" if compressed else "it is"
        raise ValueError(f"{trace_path}: {what} not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise ValueError(f"{trace_path}: gzip-compressed, but it does not decompress: {error}") from None
    if not requests:
        raise ValueError(f"{trace_path}: the trace holds no requests")
    return requests
