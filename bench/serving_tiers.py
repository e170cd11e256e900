"""Serving beyond host memory: a multi-turn working set several times kvtriton's host memory, from the tiers behind it.

Run ``python -m bench.serving_tiers`` (``--quick`` for a smoke run). The
servers, client and rounds are :mod:`bench.serving`'s (``vllm serve`` of
SmolLM2-135M-Instruct on vLLM's CPU platform, a small engine KV cache, two
requests at a time, arms alternating over ``--rounds`` rounds, each a fresh
server); the workload is one: conversations (:data:`TIERED_MULTI_TURN`), each
turn's prompt the whole conversation so far, sent turn by turn across all
conversations, whose blocks are several times what the host memory of every
arm holds (:data:`TIER_HOST_BYTES`; the JSON records the ratio). So a
conversation's earlier turns have left host memory by the time its next turn
comes, and only a tier behind it can serve them. The arms:

* ``none``: no connector; ``ceiling``: no connector, the engine's own KV
  cache large enough for the whole working set;
* ``kvtriton``: kvtriton's host memory alone (``KVTritonOffloadingSpec``);
* ``kvtriton + fs``: ``KVTritonTieringOffloadingSpec`` with vLLM's ``fs``
  tier behind the host memory, on a fresh directory per server;
* ``kvtriton + Mooncake``: the same with kvtriton's Mooncake Store tier, a
  master and a storage holder started on 127.0.0.1 per server;
* ``kvtriton + encrypted fs`` and ``kvtriton + encrypted Mooncake``: the
  same two with ``kvtriton_encryption`` (a random master key per run, in the
  server's environment): every chunk sealed per tenant before it leaves host
  memory; against the same arm in the clear, the cost of encryption when
  serving (issue 48's goal: within 5 % in TTFT and throughput);
* ``LMCache + disk``: LMCache 0.5.6 (as in :mod:`bench.serving`: its cache
  engine and local CPU backend with the same host bytes, chunks of one
  block, partial chunks saved, the benchmark's CPU copy path) with its local
  disk backend behind it, on a fresh directory per server. Skipped, saying
  why, where LMCache is not installed (:mod:`bench.serving` says how).

Every kvtriton arm loads synchronously within the step that schedules the
load (vLLM's ``sync_load_budget_bytes``), as LMCache's connector does: both
then serve a hit in the step that admits its request.

Per arm it reports the prompt tokens each source served (the engine's own
cache, host memory, vLLM's fs tier as ``disk``, a tier vLLM cannot name, such
as Mooncake or LMCache, as ``external``: vLLM's
``vllm:prompt_tokens_cached_by_source``), the mean TTFT and the throughput,
as medians of the rounds with their range, and the goals (reported, not
asserted): each tiered arm serves from its tier and answers sooner than no
connector in every round; each kvtriton tiered arm's TTFT and throughput are
at least LMCache + disk's; encryption costs at most 5 %.

Writes ``bench/results/serving_tiers.json`` (``serving_tiers-quick.json`` for ``--quick``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import cast

from bench.common import bench_parser, command_line, format_table, result_name, write_json
from bench.serving import (
    BLOCK_SIZE,
    CEILING,
    ENGINE_KV_BYTES,
    LMCACHE_VERSION,
    ROUNDS,
    Configuration,
    MultiTurn,
    Runs,
    Workload,
    _stopped_by_sigterm,  # pyright: ignore[reportPrivateUsage] -- serving's guard, which stops every server on SIGTERM
    aggregate,
    alternating_schedule,
    kvtriton_arguments,
    lmcache_configuration,
    lmcache_problem,
    multi_turn_prompts,
    run_arm,
    server_env,
    with_progress,
    write_sharegpt,
)

TIER_HOST_BYTES = 24 << 20
"""Every offload arm's host memory: 17 blocks of the model's 32 tokens (1,474,560 bytes each, fp32)."""
KV_BYTES_PER_BLOCK = 1_474_560
"""SmolLM2-135M's KV of one 32-token block in fp32 (30 layers, K and V, 3 heads of 64)."""
CEILING_EXTRA_BYTES = 256 << 20
"""What the ceiling adds to the engine's KV cache: more than the whole working set."""
SYNC_LOAD_BUDGET_BYTES = 1 << 30
"""Every kvtriton arm's ``sync_load_budget_bytes``: any hit of a step loads within it."""
MOONCAKE_POOL_BYTES = 512 << 20
LMCACHE_DISK_GB = 1.0
TIERED_MULTI_TURN = MultiTurn(conversations=8, turns=3, opening_words=150, user_words=20, reply_words=10)
QUICK_MULTI_TURN = MultiTurn(conversations=8, turns=2, opening_words=110, user_words=10, reply_words=5)
"""More than the engine's cache and the host memory hold together, so that a smoke run reaches the tiers too."""
ENCRYPTION_GOAL = 0.05
"""Encryption's cost when serving, at most (issue 48): TTFT and throughput of the encrypted arm within 5 %."""
WORKLOAD = "tiered multi-turn"

KVTRITON, FS, MOONCAKE, LMCACHE_DISK = "kvtriton", "kvtriton + fs", "kvtriton + Mooncake", "LMCache + disk"
ENCRYPTED = {"kvtriton + encrypted fs": FS, "kvtriton + encrypted Mooncake": MOONCAKE}
"""Each encrypted arm and the arm it is in the clear."""
ARMS = ("none", KVTRITON, FS, *ENCRYPTED, MOONCAKE, LMCACHE_DISK, CEILING)
TIERED_ARMS = (FS, *ENCRYPTED, MOONCAKE, LMCACHE_DISK)
SOURCES = {"host": "host_hit_tokens", "disk": "disk_hit_tokens", "external": "external_unspecified_hit_tokens"}
"""The sources reported per arm, and the figure each is read from (:data:`bench.serving.SOURCE_METRICS`)."""
MASTER_KEY_ENV = "KVTRITON_BENCH_MASTER_KEY"


def in_the_clear(arm: str) -> str:
    """The arm ``arm`` is, but for encryption (itself where it does not encrypt)."""
    return ENCRYPTED.get(arm, arm)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _offloading(spec_name: str, **extra: object) -> tuple[str, ...]:
    """kvtriton's spec ``spec_name`` with the arms' host bytes, loading within the step."""
    return kvtriton_arguments(TIER_HOST_BYTES, spec_name, sync_load_budget_bytes=SYNC_LOAD_BUDGET_BYTES, **extra)


def _tiered_configuration(arm: str, tier: Mapping[str, object]) -> Configuration:
    """``arm``'s tiered spec with ``tier`` behind the host memory; an encrypted arm's with its key in its server's
    environment."""
    if arm not in ENCRYPTED:
        return Configuration(arm, _offloading("KVTritonTieringOffloadingSpec", secondary_tiers=[tier]))
    encryption = {"master_key_env": MASTER_KEY_ENV}
    args = _offloading("KVTritonTieringOffloadingSpec", secondary_tiers=[tier], kvtriton_encryption=encryption)
    return Configuration(arm, args, env=((MASTER_KEY_ENV, secrets.token_hex(32)),))


def _mooncake_tier(master_address: str) -> dict[str, object]:
    return {
        "type": "MooncakeStoreTier",
        "module_path": "kvtriton.integrations.mooncake",
        "master_server_address": master_address,
        "namespace": "bench",
    }


@contextlib.contextmanager
def arm_configuration(arm: str, folder: Path) -> Generator[Configuration]:
    """``arm``'s server, with what it needs for its round (a fresh fs root or disk folder under ``folder``, a
    Mooncake cluster started for it and stopped after)."""
    folder.mkdir(parents=True)
    if arm == "none":
        yield Configuration(arm, ())
    elif arm == CEILING:
        yield Configuration(arm, (), extra_engine_kv_bytes=CEILING_EXTRA_BYTES)
    elif arm == KVTRITON:
        yield Configuration(arm, _offloading("KVTritonOffloadingSpec"))
    elif in_the_clear(arm) == FS:
        yield _tiered_configuration(arm, {"type": "fs", "root_dir": str(folder / "fs-root")})
    elif in_the_clear(arm) == MOONCAKE:
        from kvtriton.integrations import MooncakeCluster

        cluster = MooncakeCluster(folder / "mooncake", holder_bytes=MOONCAKE_POOL_BYTES).start()
        try:
            yield _tiered_configuration(arm, _mooncake_tier(cluster.master_address))
        finally:
            cluster.stop()
    elif arm == LMCACHE_DISK:
        yield lmcache_configuration(TIER_HOST_BYTES, arm, disk=folder / "lmcache-disk", disk_gb=LMCACHE_DISK_GB)
    else:
        raise ValueError(f"unknown arm {arm!r} (choose from {', '.join(ARMS)})")


def working_set_blocks(prompts: Sequence[str], tokens_per_word: float = 1.3) -> int:
    """About how many engine blocks the conversations' last prompts span (the working set: each holds its
    conversation's earlier ones), from their words (:class:`~bench.serving.MultiTurn`'s tokens per word)."""
    last = {prompt.split(":", 1)[0]: prompt for prompt in prompts}  # by the conversation's "Document N"
    return sum(round(len(prompt.split()) * tokens_per_word) // BLOCK_SIZE for prompt in last.values())


def tiered_workload(spec: MultiTurn, path: Path) -> Workload:
    mt_args = ("--dataset-name", "sharegpt", "--dataset-path", str(path), "--disable-shuffle")
    return Workload(
        WORKLOAD,
        (*mt_args, "--sharegpt-output-len", "4"),
        spec.conversations * spec.turns,
        f"{spec.conversations} conversations of {spec.turns} turns (an opening of {spec.opening_words} words, "
        f"{spec.user_words}-word user turns, {spec.reply_words}-word replies), sent turn by turn across the "
        "conversations (`sharegpt` reader, in order)",
    )


def _lower_every_round(runs: Runs, arm: str, other: str, metric: str) -> bool:
    """Whether ``arm``'s ``metric`` (a TTFT) was below ``other``'s in every round both ran."""
    paired = sorted(set(runs[arm]) & set(runs[other]))
    return bool(paired) and all(runs[arm][r][WORKLOAD][metric] < runs[other][r][WORKLOAD][metric] for r in paired)


def _median(runs: Runs, arm: str, metric: str) -> float:
    return statistics.median(by_workload[WORKLOAD][metric] for by_workload in runs[arm].values())


def goals(runs: Runs) -> list[dict[str, object]]:
    """The verdicts this benchmark reports: each tiered arm serves from its tier and beats no connector's TTFT in
    every round; kvtriton's tiered arms are at least LMCache + disk's; encryption costs at most 5 %."""
    verdicts: list[dict[str, object]] = []
    for arm in (arm for arm in TIERED_ARMS if arm in runs):
        source = "disk" if in_the_clear(arm) == FS else "external"
        served = _median(runs, arm, SOURCES[source])
        sooner = _lower_every_round(runs, arm, "none", "mean_ttft_ms")
        verdicts.append(
            {
                "goal": f"{arm}: serves from its tier and answers sooner than no connector in every round",
                "measured": {"tier_hit_tokens": served, "sooner_every_round": sooner},
                "met": served > 0 and sooner,
            }
        )
    if LMCACHE_DISK in runs:
        for arm in (arm for arm in (FS, MOONCAKE) if arm in runs):
            ttft = _median(runs, arm, "mean_ttft_ms") / _median(runs, LMCACHE_DISK, "mean_ttft_ms")
            tput = _median(runs, arm, "total_token_throughput") / _median(runs, LMCACHE_DISK, "total_token_throughput")
            verdicts.append(
                {
                    "goal": f"{arm}: TTFT and throughput at least {LMCACHE_DISK}'s (medians)",
                    "measured": {"ttft_ratio": ttft, "throughput_ratio": tput},
                    "met": ttft <= 1.0 and tput >= 1.0,
                }
            )
    for encrypted, clear in ((e, c) for e, c in ENCRYPTED.items() if e in runs and c in runs):
        ttft = _median(runs, encrypted, "mean_ttft_ms") / _median(runs, clear, "mean_ttft_ms")
        tput = _median(runs, encrypted, "total_token_throughput") / _median(runs, clear, "total_token_throughput")
        verdicts.append(
            {
                "goal": f"encryption: {encrypted} within {ENCRYPTION_GOAL:.0%} of {clear} (medians)",
                "measured": {"ttft_ratio": ttft, "throughput_ratio": tput},
                "met": ttft <= 1 + ENCRYPTION_GOAL and tput >= 1 - ENCRYPTION_GOAL,
            }
        )
    return verdicts


def _spread_text(figure: Mapping[str, object]) -> str:
    """A figure's median and range over the rounds: ``median (min-max)``."""
    low, median, high = (cast(float, figure[key]) for key in ("min", "median", "max"))
    return f"{median:.0f} ({low:.0f}-{high:.0f})"


def table(runs: Runs) -> str:
    """Per arm: mean TTFT and throughput (median and range), and the median prompt tokens from each source."""
    rows: list[list[object]] = []
    for arm, by_workload in aggregate(runs).items():
        figures = by_workload[WORKLOAD]
        medians = [
            cast(float, figures[metric]["median"]) if metric in figures else 0.0
            for metric in ("computed_tokens", "engine_cache_hit_tokens", *SOURCES.values())
        ]
        rows.append(
            [arm, _spread_text(figures["mean_ttft_ms"]), _spread_text(figures["total_token_throughput"]), *medians]
        )
    headers = ["arm", "mean TTFT ms", "tok/s", "computed", "engine cache", *(f"from {s}" for s in SOURCES)]
    return format_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> tuple[bool, int, list[str], str, Path | None]:
    parser = bench_parser(
        "serving_tiers", __doc__, quick="one round of every arm, eight short conversations of two turns"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"alternating rounds (default: {ROUNDS}, >= 3)")
    parser.add_argument("--arms", help=f"comma-separated, from: {', '.join(ARMS)} (default: all; none is always run)")
    parser.add_argument("--model", type=Path, help="a model folder (default: SmolLM2-135M-Instruct, prepared once)")
    args = parser.parse_args(argv)
    named = list(ARMS) if args.arms is None else [name.strip() for name in args.arms.split(",") if name.strip()]
    if unknown := [name for name in named if name not in ARMS]:
        parser.error(f"--arms: unknown {unknown} (choose from {', '.join(ARMS)})")
    if not args.quick and args.rounds < 3:
        parser.error(f"--rounds must be >= 3 (a median and a spread), got {args.rounds}")
    arms = [arm for arm in ARMS if arm in named or arm == "none"]
    return args.quick, 1 if args.quick else args.rounds, arms, result_name(args), args.model


def main(argv: Sequence[str] | None = None) -> int:
    quick, rounds, arms, name, model = parse_args(argv)
    if LMCACHE_DISK in arms and (problem := lmcache_problem()) is not None:
        _say(f"== {LMCACHE_DISK}: {problem}")
        arms.remove(LMCACHE_DISK)
        skipped = {LMCACHE_DISK: problem}
    else:
        skipped = {}
    if model is None:
        from bench.real_model import prepared_model

        model = prepared_model().path
    spec = QUICK_MULTI_TURN if quick else TIERED_MULTI_TURN
    scratch = Path(tempfile.mkdtemp(prefix="bench-serving-tiers-"))
    prompts = multi_turn_prompts(spec, seed=1)
    workload = tiered_workload(spec, write_sharegpt(prompts, scratch / "multi-turn.json"))
    blocks = working_set_blocks(prompts)
    host_blocks = TIER_HOST_BYTES // KV_BYTES_PER_BLOCK
    _say(f"working set about {blocks} blocks of {BLOCK_SIZE} tokens; host memory {host_blocks} blocks per arm")
    env = server_env("cpu")
    runs: dict[str, dict[int, dict[str, dict[str, float]]]] = {arm: {} for arm in arms}
    records: list[dict[str, object]] = []
    schedule = alternating_schedule(arms, rounds)
    try:
        with _stopped_by_sigterm():
            for r, arm, progress in with_progress(schedule):
                folder = scratch / f"{r}-{ARMS.index(arm)}"
                with arm_configuration(arm, folder) as configuration:
                    record = run_arm(
                        configuration,
                        model,
                        [workload],
                        engine_kv_bytes=ENGINE_KV_BYTES,
                        env=env,
                        folder=folder / "server",
                        progress=progress,
                    )
                runs[arm][r] = cast(dict[str, dict[str, float]], record["figures"])
                records.append({"round": r, "arm": arm, **record})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(runs))
    verdicts = [] if quick else goals(runs)
    for verdict in verdicts:
        print(f"{'met' if verdict['met'] else 'NOT met'}: {verdict['goal']} ({verdict['measured']})")
    payload: dict[str, object] = {
        "smoke_run": quick,
        "command": command_line("serving_tiers", argv),
        "rounds": rounds,
        "workload": {"name": WORKLOAD, "description": workload.description, "num_prompts": workload.num_prompts},
        "host_bytes": TIER_HOST_BYTES,
        "host_blocks": host_blocks,
        "working_set_blocks": blocks,
        "working_set_over_host": blocks / host_blocks,
        "engine_kv_bytes": ENGINE_KV_BYTES,
        "ceiling_extra_bytes": CEILING_EXTRA_BYTES,
        "sync_load_budget_bytes": SYNC_LOAD_BUDGET_BYTES,
        "lmcache_version": LMCACHE_VERSION,
        "skipped": skipped,
        "results": aggregate(runs),
        "goals": verdicts,
        "runs": records,
        "load_average_1min": os.getloadavg()[0],
    }
    print(f"wrote {write_json(name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
