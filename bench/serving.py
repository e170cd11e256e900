"""What kvtriton does to a server's TTFT and throughput, against no connector and against the ceiling.

Run ``python -m bench.serving`` (``--quick`` for a smoke run). Each arm is a
``vllm serve`` of SmolLM2-135M-Instruct (:mod:`bench.real_model`, fp32) with
a small engine KV cache (:data:`ENGINE_KV_BYTES`, 24 blocks of 32 tokens: the
requests in flight take half of it, so a prefix seen a few requests earlier is
gone from it when it comes back):

* ``none``: no connector;
* ``kvtriton``: kvtriton's OffloadingConnector spec with a host slab of
  :data:`HOST_BYTES`;
* ``kvtriton fp8-e4m3``: the same, stored compressed
  (``kvtriton_kv_compression``; kvtriton's own fp8, in its kernels, not
  vLLM's fp8 KV cache);
* ``LMCache``: LMCache 0.5.6 (:data:`LMCACHE_VERSION`) behind vLLM's
  ``LMCacheConnectorV1``: its cache engine and local CPU backend, with
  kvtriton's host bytes (``max_local_cpu_size``), chunks of one engine block
  (:data:`LMCACHE_CHUNK_SIZE`) and partial chunks saved (LMCache's documented
  default; its 0.5.6 code defaults to dropping them). LMCache has no copy path
  between vLLM's paged CPU cache and its buffers, so the benchmark supplies
  one (:mod:`bench.lmcache_cpu_connector`, loaded through vLLM's
  ``kv_connector_module_path``): that copy is the benchmark's, not LMCache's
  own; everything else is LMCache's. LMCache hashes with Python's ``hash()``
  across vLLM's processes, so the arm's servers run with ``PYTHONHASHSEED``
  pinned. The arm is optional: LMCache is not a kvtriton dependency and its
  declared requirements pull CUDA packages, so it lives in an environment of
  the benchmark's own, layered over the project's ``.venv``::

      purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
      .venv/bin/python -m venv --without-pip .bench-lmcache && echo "import site; site.addsitedir('$(.venv/bin/python -c "$purelib")')" > "$(.bench-lmcache/bin/python -c "$purelib")/project_venv.pth"
      .bench-lmcache/bin/python -m pip install --no-deps lmcache==0.5.6 numba llvmlite sortedcontainers aiofile caio aiofiles

  and the benchmark run with ``.bench-lmcache/bin/python -m bench.serving``
  (the servers run on the benchmark's own interpreter). Without LMCache the
  arm is skipped with one line saying how to install it;
* ``ceiling``: no connector, kvtriton's host bytes given to the engine's own
  KV cache instead (``--kv-cache-memory-bytes`` of both together): what an
  offload that cost nothing would reach;
* ``vLLM CPU offload`` (``--kv-offloading-size``), where vLLM's platform runs
  it: its worker needs a CUDA-alike or XPU platform, so on vLLM's CPU
  platform the arm says so and carries no figures.

Every arm is driven by vLLM's own client (``vllm bench serve``'s code,
called in this process so that vLLM is imported once), 2 requests at a
time, over three workloads, one after the other on the same server:

* ``prefix-heavy``: ``prefix_repetition``, a few prefixes each followed by a
  short random suffix, shuffled (a shared system prompt or document);
* ``multi-turn``: conversations (:class:`MultiTurn`), each turn's prompt the
  whole conversation so far, sent turn by turn across all conversations so
  that the other conversations' turns evict a conversation's blocks from
  the engine's cache before its next turn comes (vLLM's own multi-turn
  benchmark, ``benchmarks/multi_turn`` of its source release, is not in the
  installed package and needs pandas; this is the same traffic through
  ``vllm bench serve``'s ``sharegpt`` reader, in order);
* ``no-reuse``: ``random``, every prompt new (what offloading cannot help
  and must not slow down).

The arms alternate (none, kvtriton, ..., none, kvtriton, ...) for
``--rounds`` rounds (default 3), each round a fresh server, so that a slow
spell of a shared machine lands on every arm alike. Per arm, workload and
figure the result holds every round and their median and range. It adds
kvtriton's share of the ceiling's TTFT gain over no connector,
``(TTFT_none - TTFT_kvtriton) / (TTFT_none - TTFT_ceiling)`` of the median
mean TTFTs (claimed only where the ceiling beat no connector in every round:
a gain that a round reverses is noise), its share of the prompt tokens the
ceiling did not compute (which timing does not move), and the throughput of
each arm against no connector, and says whether the goals are met
(reported, not asserted): on prefix-heavy and
multi-turn load kvtriton reaches :data:`CEILING_SHARE_GOAL` of the ceiling's
gain, on no-reuse load its throughput is at least :data:`THROUGHPUT_GOAL`
of no connector's. Where the prompt tokens came from (computed, the engine's
own prefix cache, the connector) comes from vLLM's ``/metrics`` before and
after each workload; the load average before and after each server is
recorded, so that a reader can judge the noise.

Every server listens on 127.0.0.1 only, in a process group of its own that
is stopped when its round ends, fails, or is interrupted (Ctrl-C, SIGTERM);
its start (:data:`START_TIMEOUT_S`), its warm-up request and every workload
(:data:`CLIENT_TIMEOUT_S`) are bounded.

On a GPU server, run it with ``--device cuda`` (the CPU environment is then
not forced), a larger ``--host-bytes`` and, for another model, ``--model
DIR``; the engine KV cache stays small on purpose (``--engine-kv-bytes``).

Writes ``bench/results/serving.json`` (``serving-quick.json`` for ``--quick``);
``--recompute`` runs nothing and derives the shares, ratios and goals again
from the rounds a result file holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import cast

from bench.common import bench_parser, command_line, format_table, result_name, results_dir, write_json

__all__ = [
    "ARMS",
    "CEILING",
    "CEILING_SHARE_GOAL",
    "FULL_SIZES",
    "QUICK_SIZES",
    "THROUGHPUT_GOAL",
    "Configuration",
    "MultiTurn",
    "Workload",
    "Sizes",
    "aggregate",
    "alternating_schedule",
    "bench_serve_args",
    "ceiling_share",
    "chosen_arms",
    "configurations",
    "derived",
    "goals",
    "kvtriton_arguments",
    "lmcache_configuration",
    "main",
    "multi_turn_prompts",
    "prometheus_totals",
    "prompt_token_sources",
    "recompute",
    "report",
    "serve_command",
    "server_env",
    "shares",
    "spread",
    "summarize",
    "throughput_ratios",
    "vllm_offload_problem",
    "workloads",
    "write_sharegpt",
]

LOOPBACK = "127.0.0.1"
BLOCK_SIZE = 32
MAX_CONCURRENCY = 2
"""Requests at a time (the client) and sequences at a time (the server): two cores compute no faster with more, and
two in flight leave most of a small engine cache to what it has cached."""
MAX_MODEL_LEN = 512
"""Long enough for every prompt here; short enough that vLLM accepts an engine cache of 16 blocks or more."""
ENGINE_KV_BYTES = 24 * 1_474_560
"""The engine's own KV cache: 24 blocks of 32 tokens of SmolLM2-135M in fp32 (1,474,560 bytes a block: 30 layers,
K and V, 3 KV heads of 64); the 2 requests in flight hold up to 14 of them."""
HOST_BYTES = 512 << 20
"""kvtriton's host slab (and vLLM's CPU offloading size; the ceiling adds it to the engine's cache): 364 blocks,
room for every block of a round's three workloads."""
ROUNDS = 3
START_TIMEOUT_S = 300.0
"""How long a server may take to answer ``/health`` (a loaded 2-core machine needs about a minute)."""
WARM_UP_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 600.0
"""How long one workload may take on one server, every request included."""
CEILING_SHARE_GOAL = 0.9
"""kvtriton's share of the ceiling's mean-TTFT gain over no connector, on the workloads with reuse."""
THROUGHPUT_GOAL = 0.97
"""kvtriton's total token throughput against no connector's, on the no-reuse workload."""
REUSE_WORKLOADS = ("prefix-heavy", "multi-turn")
NO_REUSE_WORKLOAD = "no-reuse"
VLLM_OFFLOAD = "vLLM CPU offload"
LMCACHE = "LMCache"
LMCACHE_VERSION = "0.5.6"
"""The LMCache release the arm and its CPU copy path (:mod:`bench.lmcache_cpu_connector`) were written against."""
LMCACHE_CHUNK_SIZE = BLOCK_SIZE
"""LMCache's chunk (``chunk_size`` in its configuration reference, default 256): one engine block. LMCache reuses
whole chunks of a prefix only, so its default would reuse nothing of these workloads' prompts (160 to 300 tokens) but
a whole identical prompt. One block is the finest chunk vLLM can load (a chunk must be a multiple of the block size)
and the granularity kvtriton reuses at: the comparison is of the two copy and lookup paths, not of their chunking."""
LMCACHE_SAVE_UNFULL_CHUNK = True
"""Save a request's last, partial chunk (LMCache's documented default; its 0.5.6 code drops it unless told)."""
LMCACHE_ENV_DIR = ".bench-lmcache"
"""The benchmark's own environment that holds LMCache (the module docstring says how to make it)."""
CEILING = "ceiling"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TIER_SOURCES = ("host", "disk", "p2p", "external_unspecified")
"""The sources of prompt tokens an offload serves (vLLM's ``CacheHitSource`` but ``device``, the engine's own cache):
kvtriton's host memory, vLLM's fs tier (``disk``), a peer, and a tier vLLM cannot name (Mooncake, LMCache)."""
SPREAD_METRICS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "output_throughput",
    "total_token_throughput",
    "duration",
    "prompt_tokens",
    "engine_cache_hit_tokens",
    "connector_hit_tokens",
    "computed_tokens",
)
"""The figures whose median and range over the rounds the result keeps."""
SOURCE_METRICS = tuple(f"{source}_hit_tokens" for source in TIER_SOURCES)
"""The prompt tokens each source served, kept beside :data:`SPREAD_METRICS` where the rounds have them (results
written before 2026-12-08 do not)."""
PROMETHEUS_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.MULTILINE)
SOURCE_LABEL = re.compile(r'(?:^|,)source="(?P<source>[^"]*)"')


@dataclass(frozen=True, slots=True)
class Configuration:
    """One server: its name, the ``vllm serve`` arguments that make it, and the engine KV bytes it adds."""

    name: str
    serve_args: tuple[str, ...]
    extra_engine_kv_bytes: int = 0
    """Bytes added to the engine's own KV cache (the ceiling: kvtriton's host bytes)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables this arm's server needs on top of :func:`server_env`'s."""
    note: str = ""
    """What a reader must know about this arm (the result file and the docs carry it)."""


def kvtriton_arguments(host_bytes: int, spec_name: str = "KVTritonOffloadingSpec", **extra: object) -> tuple[str, ...]:
    """``vllm serve``'s ``--kv-transfer-config`` for kvtriton's spec ``spec_name`` with ``host_bytes``, plus ``extra``."""
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": spec_name,
            "spec_module_path": "kvtriton.integrations.vllm",
            "cpu_bytes_to_use": host_bytes,
            **extra,
        },
    }
    return ("--kv-transfer-config", json.dumps(config))


def lmcache_settings(host_bytes: int) -> dict[str, object]:
    """LMCache's settings for the arm (``lmcache.``-prefixed keys of vLLM's ``kv_connector_extra_config``, which
    LMCache's vLLM adapter applies over its defaults): its local CPU backend with ``host_bytes``."""
    return {
        "lmcache.chunk_size": LMCACHE_CHUNK_SIZE,
        "lmcache.local_cpu": True,
        "lmcache.max_local_cpu_size": host_bytes / (1 << 30),  # LMCache's GB are 2**30 bytes
        "lmcache.save_unfull_chunk": LMCACHE_SAVE_UNFULL_CHUNK,
    }


def lmcache_configuration(
    host_bytes: int, name: str = LMCACHE, *, disk: Path | None = None, disk_gb: float = 0.0
) -> Configuration:
    """The LMCache arm ``name``: its local CPU backend with ``host_bytes``, and its local disk backend of
    ``disk_gb`` in folder ``disk`` behind it when given."""
    settings = lmcache_settings(host_bytes)
    backends = f"local CPU backend, {host_bytes >> 20} MiB"
    if disk is not None:
        settings |= {"lmcache.local_disk": f"file://{disk}/", "lmcache.max_local_disk_size": disk_gb}
        backends += f", and its local disk backend, {disk_gb:g} GB"
    config = {
        "kv_connector": "LMCacheCPUConnectorV1",
        "kv_connector_module_path": "bench.lmcache_cpu_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": settings,
    }
    note = (
        f"LMCache {LMCACHE_VERSION} (its cache engine and {backends}) behind vLLM's "
        f"LMCacheConnectorV1; chunks of {LMCACHE_CHUNK_SIZE} tokens (one engine block), partial chunks "
        f"{'saved' if LMCACHE_SAVE_UNFULL_CHUNK else 'dropped'}; the copy between vLLM's paged CPU cache and "
        "LMCache's buffers is the benchmark's (bench/lmcache_cpu_connector.py), not LMCache's own, which has none "
        "for vLLM's CPU platform"
    )
    # LMCache keys chunks by Python's hash() of their tokens in vLLM's scheduler and its worker: one seed for both.
    env = (("PYTHONHASHSEED", "0"), ("LMCACHE_TRACK_USAGE", "false"), ("DO_NOT_TRACK", "1"))
    return Configuration(name, ("--kv-transfer-config", json.dumps(config)), env=env, note=note)


def configurations(host_bytes: int = HOST_BYTES) -> dict[str, Configuration]:
    """The servers compared, in the order each round runs them, for a host memory of ``host_bytes``."""
    return {
        c.name: c
        for c in (
            Configuration("none", ()),
            Configuration("kvtriton", kvtriton_arguments(host_bytes)),
            Configuration("kvtriton fp8-e4m3", kvtriton_arguments(host_bytes, kvtriton_kv_compression="fp8-e4m3")),
            lmcache_configuration(host_bytes),
            Configuration(CEILING, (), extra_engine_kv_bytes=host_bytes),
            Configuration(
                VLLM_OFFLOAD,
                ("--kv-offloading-size", f"{host_bytes / (1 << 30):g}", "--kv-offloading-backend", "native"),
            ),
        )
    }


ARMS = tuple(configurations())


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Conversations of ``turns`` user turns; sizes in words (SmolLM2's tokenizer makes about 1.3 tokens a word)."""

    conversations: int
    turns: int
    opening_words: int
    """The conversation's own opening (a document it is about), before its first user turn."""
    user_words: int
    reply_words: int
    """The assistant's reply each later turn's history holds (written here: the server's own reply is not used)."""


def _vocabulary() -> list[str]:
    from bench.real_model import CHAT_PROMPTS, REFERENCE_TEXT, SYSTEM_PROMPT

    text = " ".join([SYSTEM_PROMPT, *CHAT_PROMPTS, REFERENCE_TEXT])
    return sorted({word.strip(".,:;?!'\"()").lower() for word in text.split()} - {""})


def multi_turn_prompts(spec: MultiTurn, *, seed: int) -> list[str]:
    """The conversations' prompts in the order they are sent: every conversation's turn 1, then every turn 2, ...

    Turn ``t`` of a conversation is its turn ``t - 1`` prompt, the reply to it
    and the next user message: the earlier prompt is a prefix of the later
    one, cut where a line ends, so that the tokenizer splits it the same way.
    Between two turns of one conversation come ``conversations - 1`` turns of
    the others, whose blocks push its blocks out of a small engine cache.
    """
    if spec.conversations < 1 or spec.turns < 1:
        raise ValueError(f"a multi-turn workload needs a conversation and a turn, got {spec}")
    words = _vocabulary()
    draw = random.Random(seed)

    def text(count: int) -> str:
        return " ".join(draw.choice(words) for _ in range(count))

    histories = [f"Document {c + 1}: {text(spec.opening_words)}.\n" for c in range(spec.conversations)]
    prompts: list[str] = []
    for turn in range(spec.turns):
        for c in range(spec.conversations):
            if turn > 0:
                histories[c] += f" {text(spec.reply_words)}.\n"
            histories[c] += f"User: {text(spec.user_words)}?\nAssistant:"
            prompts.append(histories[c])
    return prompts


def write_sharegpt(prompts: Sequence[str], path: Path) -> Path:
    """``prompts`` as a ShareGPT-format file, ``vllm bench serve --dataset-name sharegpt`` reads (in order with
    ``--disable-shuffle``; the reply is not used when ``--sharegpt-output-len`` is given)."""
    entries = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]} for p in prompts]
    path.write_text(json.dumps(entries))
    return path


@dataclass(frozen=True, slots=True)
class Workload:
    """One ``vllm bench serve`` workload: its name, its dataset arguments and its number of requests."""

    name: str
    args: tuple[str, ...]
    num_prompts: int
    description: str


@dataclass(frozen=True, slots=True)
class Sizes:
    """The sizes of the three workloads (a full run's, or a smoke run's)."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    prefix_prompts: int
    random_prompts: int
    output_len: int
    multi_turn: MultiTurn


FULL_SIZES = Sizes(
    prefix_len=128,
    suffix_len=32,
    num_prefixes=9,
    prefix_prompts=18,
    random_prompts=12,
    output_len=4,
    multi_turn=MultiTurn(conversations=6, turns=3, opening_words=70, user_words=20, reply_words=10),
)
"""About 20-25 minutes for 3 rounds of the four arms on a 2-core machine: every workload here computes 2,000 to
3,000 prompt tokens without reuse, and 4 output tokens a request (the TTFT is the figure; decoding is not)."""
QUICK_SIZES = Sizes(
    prefix_len=64,
    suffix_len=32,
    num_prefixes=2,
    prefix_prompts=4,
    random_prompts=4,
    output_len=2,
    multi_turn=MultiTurn(conversations=2, turns=2, opening_words=40, user_words=10, reply_words=5),
)


def workloads(sizes: Sizes, multi_turn_path: Path) -> list[Workload]:
    """The prefix-heavy, multi-turn and no-reuse workloads (the multi-turn prompts are read from
    ``multi_turn_path``, which :func:`write_sharegpt` writes)."""
    mt = sizes.multi_turn
    return [
        Workload(
            "prefix-heavy",
            (
                "--dataset-name",
                "prefix_repetition",
                "--prefix-repetition-prefix-len",
                str(sizes.prefix_len),
                "--prefix-repetition-suffix-len",
                str(sizes.suffix_len),
                "--prefix-repetition-num-prefixes",
                str(sizes.num_prefixes),
                "--prefix-repetition-output-len",
                str(sizes.output_len),
            ),
            sizes.prefix_prompts,
            f"`prefix_repetition`: {sizes.num_prefixes} prefixes of {sizes.prefix_len} tokens, each followed by "
            f"{sizes.suffix_len} random tokens, {sizes.prefix_prompts} requests shuffled",
        ),
        Workload(
            "multi-turn",
            (
                "--dataset-name",
                "sharegpt",
                "--dataset-path",
                str(multi_turn_path),
                "--disable-shuffle",
                "--sharegpt-output-len",
                str(sizes.output_len),
            ),
            mt.conversations * mt.turns,
            f"{mt.conversations} conversations of {mt.turns} turns (an opening of {mt.opening_words} words, "
            f"{mt.user_words}-word user turns, {mt.reply_words}-word replies), sent turn by turn across the "
            "conversations (`sharegpt` reader, in order)",
        ),
        Workload(
            NO_REUSE_WORKLOAD,
            (
                "--dataset-name",
                "random",
                "--random-input-len",
                str(sizes.prefix_len + sizes.suffix_len),
                "--random-output-len",
                str(sizes.output_len),
                "--random-range-ratio",
                "0",
            ),
            sizes.random_prompts,
            f"`random`: {sizes.random_prompts} prompts of {sizes.prefix_len + sizes.suffix_len} random tokens",
        ),
    ]


def serve_command(
    model: Path, port: int, configuration: Configuration, *, engine_kv_bytes: int, python: str = sys.executable
) -> list[str]:
    """``vllm serve`` for ``configuration`` on the loopback (fp32, block size 32, 2 sequences at a time)."""
    kv_bytes = engine_kv_bytes + configuration.extra_engine_kv_bytes
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_CONCURRENCY),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        *configuration.serve_args,
    ]


def bench_serve_args(model: Path, url: str, workload: Workload) -> list[str]:
    """The arguments of ``vllm bench serve`` for ``workload``, :data:`MAX_CONCURRENCY` requests at a time."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        *workload.args,
        "--num-prompts",
        str(workload.num_prompts),
        "--max-concurrency",
        str(MAX_CONCURRENCY),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]


# -- statistics ---------------------------------------------------------------------------------------------


def alternating_schedule(arms: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, arm)`` in the order they run: every arm once per round (ABCABC...), rounds counted from 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct and not empty, got {list(arms)}")
    return [(r, arm) for r in range(1, rounds + 1) for arm in arms]


def with_progress(schedule: Sequence[tuple[int, str]]) -> Iterator[tuple[int, str, str]]:
    """Each ``(round, arm)`` of ``schedule`` as it runs, with its label ``[round R/ROUNDS, I/N, about M min left]``
    (the minutes left estimated from the time the runs before it took)."""
    rounds = schedule[-1][0] if schedule else 0
    began = time.monotonic()
    for index, (r, arm) in enumerate(schedule, start=1):
        elapsed = time.monotonic() - began
        eta = "" if index == 1 else f", about {elapsed / (index - 1) * (len(schedule) - index + 1) / 60:.0f} min left"
        yield r, arm, f"[round {r}/{rounds}, {index}/{len(schedule)}{eta}]"


def spread(values: Sequence[float]) -> dict[str, object]:
    """The rounds' values, their median and their range."""
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": list(values)}


def ceiling_share(none: float, kvtriton: float, ceiling: float, *, higher_is_better: bool = False) -> float | None:
    """``(none - kvtriton) / (none - ceiling)``: the part of the ceiling's gain kvtriton reaches (a TTFT, lower is
    better; with ``higher_is_better``, hit tokens: ``(kvtriton - none) / (ceiling - none)``).

    None where the ceiling gained nothing over no connector (no gain to share:
    the engine's own cache already held what came back).
    """
    sign = -1.0 if higher_is_better else 1.0
    gain = sign * (none - ceiling)
    if gain <= 0:
        return None
    return sign * (none - kvtriton) / gain


def prometheus_totals(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, summed over its label sets, by name; a sample with a
    ``source`` label also under ``name/source``."""
    totals: dict[str, float] = {}
    for match in PROMETHEUS_LINE.finditer(text):
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        names = [match.group("name")]
        if (source := SOURCE_LABEL.search(match.group("labels") or "")) is not None:
            names.append(f"{names[0]}/{source.group('source')}")
        for name in names:
            totals[name] = totals.get(name, 0.0) + value
    return totals


def prompt_token_sources(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Where a run's prompt tokens came from: vLLM's counters' growth between two ``/metrics`` scrapes."""

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = grew("vllm:prompt_tokens_total")
    local, external = grew("vllm:prefix_cache_hits_total"), grew("vllm:external_prefix_cache_hits_total")
    return {
        "prompt_tokens": prompt,
        "engine_cache_hit_tokens": local,
        "connector_hit_tokens": external,
        "computed_tokens": prompt - local - external,
        **{f"{source}_hit_tokens": grew(f"{CACHED_BY_SOURCE}/{source}") for source in TIER_SOURCES},
    }


def summarize(result: Mapping[str, object], sources: Mapping[str, float]) -> dict[str, float]:
    """The figures of one ``vllm bench serve`` result (and the prompt tokens' sources) this benchmark reports."""
    keys = (
        "completed",
        "mean_ttft_ms",
        "p99_ttft_ms",
        "median_ttft_ms",
        "mean_tpot_ms",
        "output_throughput",
        "total_token_throughput",
        "request_throughput",
        "duration",
    )
    figures: dict[str, float] = {}
    for key in keys:
        value = result.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"the vllm bench serve result has no number at {key!r}, got {value!r:.60}")
        figures[key] = float(value)
    return figures | dict(sources)


Runs = Mapping[str, Mapping[int, Mapping[str, Mapping[str, float]]]]
"""Figures by arm, round and workload."""


def aggregate(runs: Runs) -> dict[str, dict[str, dict[str, dict[str, object]]]]:
    """Per arm, workload and figure of :data:`SPREAD_METRICS` (and :data:`SOURCE_METRICS` where every round has
    them): :func:`spread` over the rounds (in round order)."""
    out: dict[str, dict[str, dict[str, dict[str, object]]]] = {}
    for arm, by_round in runs.items():
        rounds = [by_round[r] for r in sorted(by_round)]
        out[arm] = {
            workload: {
                metric: spread([r[workload][metric] for r in rounds])
                for metric in (*SPREAD_METRICS, *SOURCE_METRICS)
                if metric in SPREAD_METRICS or all(metric in r[workload] for r in rounds)
            }
            for workload in rounds[0]
        }
    return out


def _median(runs: Runs, arm: str, workload: str, metric: str) -> float:
    return statistics.median(by_workload[workload][metric] for by_workload in runs[arm].values())


def _hit_tokens(figures: Mapping[str, float]) -> float:
    return figures["engine_cache_hit_tokens"] + figures["connector_hit_tokens"]


def shares(runs: Runs, arm: str) -> dict[str, dict[str, object]]:
    """``arm``'s share of the ceiling's mean-TTFT gain on each workload with reuse (not the no-reuse one, where
    there is nothing to share): of the medians, and each round's (paired); the ceiling's gain itself (``gain_ms``,
    of the medians, and each round's), which says whether the share stands above the noise; and ``arm``'s share of
    the ceiling's extra prompt tokens not computed (``hit_tokens_share``, of the medians), which timing does not
    move."""
    out: dict[str, dict[str, object]] = {}
    rounds = [r for r in sorted(runs[arm]) if all(r in runs[a] for a in ("none", CEILING))]
    for workload in runs[arm][min(runs[arm])]:
        if workload == NO_REUSE_WORKLOAD:
            continue
        medians = [_median(runs, a, workload, "mean_ttft_ms") for a in ("none", arm, CEILING)]
        hits = [
            statistics.median(_hit_tokens(by_w[workload]) for by_w in runs[a].values()) for a in ("none", arm, CEILING)
        ]
        per_round = [
            ceiling_share(*(runs[a][r][workload]["mean_ttft_ms"] for a in ("none", arm, CEILING))) for r in rounds
        ]
        gains = [runs["none"][r][workload]["mean_ttft_ms"] - runs[CEILING][r][workload]["mean_ttft_ms"] for r in rounds]
        known = [share for share in per_round if share is not None]
        out[workload] = {
            "share": ceiling_share(*medians),
            "rounds": per_round,
            "min": min(known) if known else None,
            "max": max(known) if known else None,
            "gain_ms": {
                "of_medians": medians[0] - medians[2],
                "rounds": gains,
                "min": min(gains, default=None),
                "max": max(gains, default=None),
            },
            "hit_tokens_share": ceiling_share(*hits, higher_is_better=True),
        }
    return out


def throughput_ratios(runs: Runs, arm: str) -> dict[str, dict[str, object]]:
    """``arm``'s total token throughput over no connector's, per workload: of the medians, and each round's."""
    out: dict[str, dict[str, object]] = {}
    for workload in runs[arm][min(runs[arm])]:
        metric = "total_token_throughput"
        per_round = [
            runs[arm][r][workload][metric] / runs["none"][r][workload][metric]
            for r in sorted(runs[arm])
            if r in runs["none"]
        ]
        out[workload] = {
            "ratio": _median(runs, arm, workload, metric) / _median(runs, "none", workload, metric),
            "rounds": per_round,
            "min": min(per_round),
            "max": max(per_round),
        }
    return out


def versus(runs: Runs, arm: str, other: str) -> dict[str, dict[str, dict[str, object]]]:
    """``arm`` against ``other`` per workload: mean TTFT (below 1: ``arm`` answers sooner) and total throughput
    (above 1: ``arm`` serves more) as ratios of the medians, with each paired round's ratio and their range."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    paired = [r for r in sorted(runs[arm]) if r in runs[other]]
    for workload in runs[arm][min(runs[arm])]:
        out[workload] = {}
        for metric in ("mean_ttft_ms", "total_token_throughput"):
            per_round = [runs[arm][r][workload][metric] / runs[other][r][workload][metric] for r in paired]
            out[workload][metric] = {
                "ratio": _median(runs, arm, workload, metric) / _median(runs, other, workload, metric),
                "rounds": per_round,
                "min": min(per_round, default=None),
                "max": max(per_round, default=None),
            }
    return out


def goals(
    share_by_workload: Mapping[str, Mapping[str, object]], ratio_by_workload: Mapping[str, Mapping[str, object]]
) -> list[dict[str, object]]:
    """The goals for kvtriton, each with its measured figure and whether it is met.

    A share is measurable only where the ceiling was faster than no connector
    in every round: a gain that some round reverses is the machine's noise,
    and a share of it says nothing (``measured`` and ``met`` are then None,
    ``reason`` says why).
    """
    verdicts: list[dict[str, object]] = []
    for workload in REUSE_WORKLOADS:
        entry = share_by_workload.get(workload, {})
        share, gain = entry.get("share"), entry.get("gain_ms")
        slowest_gain = cast(Mapping[str, object], gain).get("min") if isinstance(gain, Mapping) else None
        reason = None
        if not isinstance(slowest_gain, float | int) or slowest_gain <= 0:
            reason = "the ceiling was not faster than no connector in every round: its gain is within the noise"
        measured = share if isinstance(share, float) and reason is None else None
        verdicts.append(
            {
                "goal": f"{workload}: kvtriton's share of the ceiling's TTFT gain >= {CEILING_SHARE_GOAL:.0%}",
                "workload": workload,
                "measured": measured,
                "reason": reason,
                "met": None if measured is None else measured >= CEILING_SHARE_GOAL,
            }
        )
    ratio = ratio_by_workload.get(NO_REUSE_WORKLOAD, {}).get("ratio")
    measured = ratio if isinstance(ratio, float) else None
    verdicts.append(
        {
            "goal": f"{NO_REUSE_WORKLOAD}: kvtriton's throughput >= {THROUGHPUT_GOAL:g}x no connector's",
            "workload": NO_REUSE_WORKLOAD,
            "measured": measured,
            "reason": None,
            "met": None if measured is None else measured >= THROUGHPUT_GOAL,
        }
    )
    return verdicts


# -- servers and client -------------------------------------------------------------------------------------


def vllm_offload_problem(env: Mapping[str, str]) -> str | None:
    """None when vLLM's own CPU offloading runs on this platform, else why not (its worker's own condition)."""
    probe = (
        "from vllm.platforms import current_platform as p\n"
        "print('yes' if p.is_cuda_alike() or p.is_xpu() else type(p).__name__)"
    )
    answer = subprocess.run([sys.executable, "-c", probe], env=dict(env), capture_output=True, text=True, timeout=300)
    platform = answer.stdout.strip().splitlines()[-1] if answer.stdout.strip() else f"unknown ({answer.stderr[-200:]})"
    if platform == "yes":
        return None
    return (
        f"not available on this platform ({platform}): vLLM's CPU offloading runs on CUDA-alike and XPU platforms only"
    )


def lmcache_problem() -> str | None:
    """None when LMCache imports in this interpreter (the servers run on it too), else the one line that says why
    the arm is skipped and how to install it."""
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return (
            f"skipped: LMCache is not installed in this Python ({sys.executable}); make the benchmark's own "
            f"environment {LMCACHE_ENV_DIR}/ (bench/serving.py's docstring, docs/benchmarks.md) and run "
            f"{LMCACHE_ENV_DIR}/bin/python -m bench.serving"
        )
    if version != LMCACHE_VERSION:
        _say(f"== {LMCACHE}: {version} installed, the arm was written against {LMCACHE_VERSION}")
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 -- loopback URL built here
            return response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _warm_up(url: str, model: Path) -> None:
    """One short request of unrelated text: the first forward pass's one-off costs stay out of every workload."""
    body = json.dumps({"model": str(model), "prompt": "Warm up the server, please.", "max_tokens": 2}).encode()
    request = urllib.request.Request(  # noqa: S310 -- loopback URL built here
        f"{url}/v1/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=WARM_UP_TIMEOUT_S) as response:  # noqa: S310 -- same
        response.read()


@contextmanager
def served(command: list[str], env: Mapping[str, str], log_path: Path) -> Generator[str]:
    """Run ``command`` (a ``vllm serve``) in a process group of its own until ``/health`` answers; yield its URL."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tests.e2e.engine import end_process_group  # the end-to-end tests' group shutdown: nothing left behind

    port = command[command.index("--port") + 1]
    url = f"http://{LOOPBACK}:{port}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _get(f"{url}/health") is None:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve did not come up (exit {process.poll()}); its log ends:\n{tail}")
            time.sleep(1.0)
        yield url
    finally:
        end_process_group(process, grace_s=30.0)


def server_env(device: str) -> dict[str, str]:
    """The servers' environment: this one's, the repository importable, vLLM's CPU platform unless ``device`` is cuda."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    env |= {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # vLLM's CPU platform lets this variable override --kv-cache-memory-bytes: the arms' cache sizes would be equal.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if device == "cpu":
        # A shared machine: no OpenMP pinning to cores other processes use.
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": LOOPBACK}
    return env


def run_client(args: Sequence[str], log_path: Path) -> dict[str, object]:
    """vLLM's own client, ``vllm bench serve``'s code called in this process (bounded by :data:`CLIENT_TIMEOUT_S`);
    what it prints goes to ``log_path``."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    namespace = parser.parse_args(list(args))
    if namespace is None:  # vLLM's parser is typed to return None where it printed help instead
        raise RuntimeError(f"vllm bench serve refused its arguments: {list(args)}")
    with log_path.open("a") as log, contextlib.redirect_stdout(log):
        result = asyncio.run(asyncio.wait_for(main_async(namespace), CLIENT_TIMEOUT_S))
    return cast(dict[str, object], result)


def run_arm(
    configuration: Configuration,
    model: Path,
    chosen: Sequence[Workload],
    *,
    engine_kv_bytes: int,
    env: Mapping[str, str],
    folder: Path,
    progress: str,
) -> dict[str, object]:
    """One fresh server for ``configuration``, every workload through it in turn: figures by workload, the start
    time and the load averages before and after."""
    folder.mkdir(parents=True)
    command = serve_command(model, _free_port(), configuration, engine_kv_bytes=engine_kv_bytes)
    load_before = os.getloadavg()
    started = time.monotonic()
    _say(f"{progress} {configuration.name}: starting vllm serve (load average {load_before[0]:.1f})")
    figures: dict[str, dict[str, float]] = {}
    with served(command, {**env, **dict(configuration.env)}, folder / "serve.log") as url:
        start_s = time.monotonic() - started
        _warm_up(url, model)
        _say(f"{progress} {configuration.name}: up in {start_s:.0f} s")
        for workload in chosen:
            before = prometheus_totals(_get(f"{url}/metrics") or "")
            result = run_client(bench_serve_args(model, url, workload), folder / "client.log")
            completed = result.get("completed")
            if completed != workload.num_prompts:
                raise RuntimeError(
                    f"{configuration.name}, {workload.name}: {completed} of {workload.num_prompts} "
                    f"requests completed; the client's log: {folder / 'client.log'}"
                )
            after = prometheus_totals(_get(f"{url}/metrics") or "")
            figures[workload.name] = f = summarize(result, prompt_token_sources(before, after))
            _say(
                f"{progress} {configuration.name}, {workload.name}: mean TTFT {f['mean_ttft_ms']:.0f} ms, "
                f"{f['total_token_throughput']:.0f} tok/s, {f['duration']:.0f} s; prompt tokens from the connector "
                f"{f['connector_hit_tokens']:.0f}, the engine's cache {f['engine_cache_hit_tokens']:.0f}"
            )
    return {
        "figures": figures,
        "start_s": start_s,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "wall_s": time.monotonic() - started,
    }


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _stopped_by_sigterm() -> Generator[None]:
    """SIGTERM raises like Ctrl-C inside the block, so that every server's shutdown (a ``finally``) runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the run ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("serving", __doc__, quick="one round of none and kvtriton, a few short requests")
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help=f"rounds; each runs every arm once, on a fresh server (default: {ROUNDS}; >= 3 but in a smoke run)",
    )
    parser.add_argument(
        "--configurations",
        help=f"comma-separated, from: {', '.join(ARMS)} (default: all; none and ceiling are always run; with --quick, "
        "none and the named ones, default kvtriton)",
    )
    parser.add_argument(
        "--model", type=Path, help="a model folder (default: SmolLM2-135M-Instruct, prepared and cached)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM's platform (default: cpu)")
    parser.add_argument(
        "--engine-kv-bytes",
        type=int,
        default=ENGINE_KV_BYTES,
        help=f"the engine's own KV cache (default: {ENGINE_KV_BYTES:,} bytes, 24 blocks of SmolLM2-135M)",
    )
    parser.add_argument(
        "--host-bytes",
        type=int,
        default=HOST_BYTES,
        help=f"kvtriton's host slab, and what the ceiling adds to the engine's cache (default: {HOST_BYTES >> 20} MiB)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="run nothing: rewrite the shares, ratios, spreads and goals of bench/results/<name>.json from its rounds",
    )
    return parser.parse_args(argv)


def chosen_arms(text: str | None, *, quick: bool) -> list[str]:
    """The arms to run, in :data:`ARMS` order: the named ones (all when ``text`` is None) plus ``none`` and the
    ceiling, which every figure is measured against; a smoke run: ``none`` and the named ones (kvtriton when none
    is named), no ceiling."""
    named = list(ARMS) if text is None else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in named if name not in ARMS]
    if unknown or not named:
        raise SystemExit(f"--configurations: unknown {unknown or named!r} (choose from {', '.join(ARMS)})")
    if quick:
        return ["none", *(arm for arm in ARMS if arm in named and arm != "none")] if text else ["none", "kvtriton"]
    return [arm for arm in ARMS if arm in named or arm in ("none", CEILING)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recompute:
        print(f"rewrote {recompute(results_dir() / f'{args.name}.json')}")
        return 0
    arms = chosen_arms(args.configurations, quick=args.quick)
    rounds = 1 if args.quick else args.rounds
    if not args.quick and rounds < 3:
        raise SystemExit(f"--rounds must be >= 3 (a median and a spread), got {rounds}")
    if args.engine_kv_bytes <= 0:
        raise SystemExit(f"--engine-kv-bytes must be > 0, got {args.engine_kv_bytes}")
    if args.host_bytes <= 0:
        raise SystemExit(f"--host-bytes must be > 0, got {args.host_bytes}")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.quick:
        print(f"SMOKE RUN (--quick): one round of {', '.join(arms)}, a few short requests; the figures are no verdict.")
    if args.model is None:
        from bench.real_model import prepared_model

        model = prepared_model().path
    else:
        model = args.model
    env = server_env(args.device)
    all_configurations = configurations(args.host_bytes)
    unavailable: dict[str, str] = {}
    if VLLM_OFFLOAD in arms and (problem := vllm_offload_problem(env)) is not None:
        unavailable[VLLM_OFFLOAD] = problem
        _say(f"== {VLLM_OFFLOAD}: {problem}")
    if LMCACHE in arms and (problem := lmcache_problem()) is not None:
        unavailable[LMCACHE] = problem
        _say(f"== {LMCACHE}: {problem}")
    running = [arm for arm in arms if arm not in unavailable]
    schedule = alternating_schedule(running, rounds)
    scratch = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    mt_path = write_sharegpt(multi_turn_prompts(sizes.multi_turn, seed=0), scratch / "multi-turn.json")
    chosen = workloads(sizes, mt_path)
    runs: dict[str, dict[int, dict[str, dict[str, float]]]] = {arm: {} for arm in running}
    records: list[dict[str, object]] = []
    try:
        with _stopped_by_sigterm():
            for r, arm, progress in with_progress(schedule):
                record = run_arm(
                    all_configurations[arm],
                    model,
                    chosen,
                    engine_kv_bytes=args.engine_kv_bytes,
                    env=env,
                    folder=scratch / f"{r}-{arm.replace(' ', '-')}",
                    progress=progress,
                )
                runs[arm][r] = cast(dict[str, dict[str, float]], record["figures"])
                records.append({"round": r, "arm": arm, **record})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    notes = {arm: note for arm in arms if (note := all_configurations[arm].note)}
    payload = report(
        runs, unavailable, records, sizes=sizes, chosen=chosen, model=model, args=args, rounds=rounds, notes=notes
    )
    if LMCACHE in runs:
        payload["lmcache"] = _lmcache_record(args.host_bytes)
    print(f"wrote {write_json(result_name(args), payload)}")
    return 0


def derived(runs: Runs, unavailable: Mapping[str, str]) -> dict[str, object]:
    """What the rounds say, as the result file holds it (and printed): the spreads, the shares, the ratios, the goals."""
    summary = aggregate(runs)
    with_ceiling = CEILING in runs
    offload_arms = [arm for arm in runs if arm not in ("none", CEILING)]
    share = {arm: shares(runs, arm) for arm in offload_arms} if with_ceiling else {}
    ratio = {arm: throughput_ratios(runs, arm) for arm in runs if arm != "none"}
    verdicts = (
        goals(share.get("kvtriton", {}), ratio.get("kvtriton", {})) if with_ceiling and "kvtriton" in runs else []
    )
    rows: list[list[object]] = []
    for arm, by_workload in summary.items():
        for workload, figures in by_workload.items():
            ttft, tput = figures["mean_ttft_ms"], figures["total_token_throughput"]
            rows.append(
                [
                    arm,
                    workload,
                    _triple(ttft, "{:.0f}"),
                    _triple(tput, "{:.0f}"),
                    _triple(figures["connector_hit_tokens"], "{:.0f}"),
                ]
            )
    for arm, problem in unavailable.items():
        rows.append([arm, "-", problem, "", ""])
    print(
        format_table(["arm", "workload", "mean TTFT ms median (min-max)", "total tok/s", "connector hit tokens"], rows)
    )
    for verdict in verdicts:
        measured = verdict["measured"]
        print(
            f"goal {verdict['goal']}: measured {measured if measured is None else f'{measured:.3f}'}, "
            f"{'met' if verdict['met'] else 'not met' if verdict['met'] is False else 'not measurable'}"
        )
    against_lmcache = versus(runs, "kvtriton", LMCACHE) if "kvtriton" in runs and LMCACHE in runs else {}
    for workload, by_metric in against_lmcache.items():
        ttft, tput = by_metric["mean_ttft_ms"], by_metric["total_token_throughput"]
        print(
            f"kvtriton against LMCache, {workload}: mean TTFT {ttft['ratio']:.2f}x, "
            f"throughput {tput['ratio']:.2f}x (medians)"
        )
    return {
        "results": {**summary, **unavailable},
        "ceiling_share": share,
        "throughput_vs_none": ratio,
        "kvtriton_vs_lmcache": against_lmcache,
        "goals": {"ceiling_share": CEILING_SHARE_GOAL, "throughput": THROUGHPUT_GOAL, "verdicts": verdicts},
    }


def recompute(path: Path) -> Path:
    """Rewrite the figures a result file derives from its rounds (``runs``) with this module's statistics, keeping
    every measured figure, its date and its machine: a change to the statistics needs no new run."""
    record = cast(dict[str, object], json.loads(path.read_text()))
    runs: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for run in cast(list[dict[str, object]], record.get("runs") or []):
        figures = cast(dict[str, dict[str, float]], run["figures"])
        runs.setdefault(str(run["arm"]), {})[cast(int, run["round"])] = figures
    if not runs:
        raise SystemExit(f"--recompute: {path} holds no rounds (`runs`)")
    results = cast(dict[str, object], record.get("results") or {})
    unavailable = {arm: value for arm, value in results.items() if isinstance(value, str)}
    record |= derived(runs, unavailable)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def report(
    runs: Runs,
    unavailable: Mapping[str, str],
    records: Sequence[Mapping[str, object]],
    *,
    sizes: Sizes,
    chosen: Sequence[Workload],
    model: Path,
    args: argparse.Namespace,
    rounds: int,
    notes: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The result file's payload (and the table printed): every round, the spreads, the shares, the goals, and what a
    reader must know about an arm (``notes``, by arm)."""
    loads = [
        value
        for record in records
        for key in ("load_average_before", "load_average_after")
        for value in cast(list[float], record[key])[:1]
    ]
    return {
        "smoke_run": args.quick,
        "command": command_line("serving", None),
        "model": str(model) if args.model is not None else "SmolLM2-135M-Instruct",
        "device": args.device,
        "rounds": rounds,
        "max_concurrency": MAX_CONCURRENCY,
        "max_model_len": MAX_MODEL_LEN,
        "engine_kv_bytes": args.engine_kv_bytes,
        "host_bytes": args.host_bytes,
        "block_size": BLOCK_SIZE,
        "ceiling_engine_kv_bytes": args.engine_kv_bytes + args.host_bytes,
        "workloads": {
            w.name: {"description": w.description, "num_prompts": w.num_prompts, "vllm_bench_serve": _shown_command(w)}
            for w in chosen
        },
        "multi_turn": {"conversations": sizes.multi_turn.conversations, "turns": sizes.multi_turn.turns},
        "schedule": [[record["round"], record["arm"]] for record in records],
        "load_average_1min": {"min": min(loads), "max": max(loads)} if loads else None,
        "arm_notes": dict(notes or {}),
        **derived(runs, unavailable),
        "runs": list(records),
    }


def _lmcache_record(host_bytes: int) -> dict[str, object]:
    """What the LMCache arm ran: the installed release and the settings it was given."""
    return {
        "version": importlib.metadata.version("lmcache"),
        "settings": lmcache_settings(host_bytes),
        "copy_path": "bench/lmcache_cpu_connector.py (the benchmark's, not LMCache's own)",
        "server_env": dict(configurations(host_bytes)[LMCACHE].env),
    }


def _shown_command(workload: Workload) -> str:
    """``vllm bench serve`` with the workload's arguments, a scratch file named by its name alone."""
    shown = [Path(arg).name if arg.endswith(".json") else arg for arg in workload.args]
    return shlex.join(["vllm", "bench", "serve", *shown])


def _triple(figure: Mapping[str, object], form: str) -> str:
    values = [cast(float, figure[key]) for key in ("median", "min", "max")]
    return f"{form.format(values[0])} ({form.format(values[1])}-{form.format(values[2])})"


if __name__ == "__main__":
    raise SystemExit(main())
