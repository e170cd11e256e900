"""The serving benchmark's own code paths, without a server: its commands, its workloads, its statistics.

The benchmark itself (``python -m bench.serving``, ``kvtriton bench serving``)
starts real servers and takes about 20 minutes; its smoke run (``--quick``) is
not part of ``make test``. These tests pin what it asks vLLM for, the order
the arms run in, and the arithmetic of its medians, spreads, ceiling shares
and goals.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import re
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path

import pytest

from bench import serving
from bench.serving import (
    ARMS,
    BLOCK_SIZE,
    CEILING,
    CEILING_SHARE_GOAL,
    FULL_SIZES,
    LMCACHE,
    LMCACHE_CHUNK_SIZE,
    LMCACHE_VERSION,
    MAX_CONCURRENCY,
    THROUGHPUT_GOAL,
    MultiTurn,
    aggregate,
    alternating_schedule,
    bench_serve_args,
    ceiling_share,
    chosen_arms,
    configurations,
    goals,
    lmcache_problem,
    lmcache_settings,
    main,
    multi_turn_prompts,
    prometheus_totals,
    prompt_token_sources,
    recompute,
    report,
    run_arm,
    serve_command,
    server_env,
    shares,
    spread,
    summarize,
    throughput_ratios,
    versus,
    vllm_offload_problem,
    workloads,
    write_sharegpt,
)

METRICS_BEFORE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""
METRICS_AFTER = """vllm:prompt_tokens_total{engine="0",model_name="m"} 1100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 232.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 512.0
vllm:kv_offload_load_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 7.0
vllm:kv_offload_load_bytes_total{engine="0",model_name="m",transfer_type="disk_to_GPU"} 3.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 200.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 384.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 128.0
"""


def test_prometheus_totals_sum_every_label_set_and_skip_comments() -> None:
    totals = prometheus_totals(METRICS_AFTER + "# a comment 1.0\n")
    assert totals["vllm:kv_offload_load_bytes_total"] == 10.0
    assert totals["vllm:prompt_tokens_total"] == 1100.0
    assert totals["vllm:prompt_tokens_cached_by_source_total"] == 712.0  # every source's, and each one's own:
    assert totals["vllm:prompt_tokens_cached_by_source_total/host"] == 384.0
    assert "#" not in "".join(totals)


def test_prompt_tokens_are_split_into_computed_engine_cache_and_connector_hits() -> None:
    sources = prompt_token_sources(prometheus_totals(METRICS_BEFORE), prometheus_totals(METRICS_AFTER))
    assert sources == {"prompt_tokens": 1000.0, "engine_cache_hit_tokens": 200.0, "connector_hit_tokens": 512.0,
                       "computed_tokens": 288.0, "host_hit_tokens": 384.0, "disk_hit_tokens": 128.0,
                       "p2p_hit_tokens": 0.0, "external_unspecified_hit_tokens": 0.0}  # fmt: skip


def test_summary_keeps_the_reported_figures_and_names_a_missing_one() -> None:
    result: dict[str, object] = {
        "completed": 8, "mean_ttft_ms": 400.0, "p99_ttft_ms": 900.5, "median_ttft_ms": 350.0, "mean_tpot_ms": 50.0,
        "output_throughput": 12.5, "total_token_throughput": 300.0, "request_throughput": 0.5, "duration": 16.0,
        "ttfts": [0.4] * 8,
    }  # fmt: skip
    figures = summarize(result, {"connector_hit_tokens": 64.0})
    assert figures["p99_ttft_ms"] == 900.5 and figures["connector_hit_tokens"] == 64.0 and "ttfts" not in figures
    with pytest.raises(ValueError, match="p99_ttft_ms"):
        summarize({**result, "p99_ttft_ms": None}, {})


# -- the servers ---------------------------------------------------------------------------------------------


def test_servers_differ_only_in_their_offloading_arguments_and_the_ceiling_in_its_cache_size(tmp_path: Path) -> None:
    arms = configurations(host_bytes=256 << 20)
    commands = {name: serve_command(tmp_path, 8000, c, engine_kv_bytes=64 << 20) for name, c in arms.items()}
    base = commands["none"]
    assert base[base.index("--max-num-seqs") + 1] == str(MAX_CONCURRENCY)
    assert base[base.index("--host") + 1] == "127.0.0.1"
    kv_at = base.index("--kv-cache-memory-bytes") + 1
    assert base[kv_at] == str(64 << 20)
    for name, command in commands.items():
        if name == CEILING:
            # The ceiling: no connector, kvtriton's host bytes given to the engine's own cache instead.
            assert command[:kv_at] + command[kv_at + 1 :] == base[:kv_at] + base[kv_at + 1 :]
            assert command[kv_at] == str((64 << 20) + (256 << 20))
        else:
            assert command[: len(base)] == base, name
    kvtriton = json.loads(commands["kvtriton"][-1])["kv_connector_extra_config"]
    fp8 = json.loads(commands["kvtriton fp8-e4m3"][-1])["kv_connector_extra_config"]
    assert kvtriton["spec_name"] == "KVTritonOffloadingSpec" and kvtriton["cpu_bytes_to_use"] == 256 << 20
    assert fp8 == {**kvtriton, "kvtriton_kv_compression": "fp8-e4m3"}
    assert "--kv-offloading-size" in commands["vLLM CPU offload"]


def test_the_lmcache_arm_runs_lmcaches_connector_over_the_benchmarks_cpu_copy_path_with_kvtritons_host_bytes(
    tmp_path: Path,
) -> None:
    lmcache_connector = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector")
    lmcache = configurations(host_bytes=256 << 20)[LMCACHE]
    transfer = json.loads(serve_command(tmp_path, 8000, lmcache, engine_kv_bytes=64 << 20)[-1])
    # vLLM loads the class named kv_connector from the module: it must be there, and be vLLM's LMCache connector.
    module = importlib.import_module(transfer["kv_connector_module_path"])
    assert issubclass(getattr(module, transfer["kv_connector"]), lmcache_connector.LMCacheConnectorV1)
    settings = transfer["kv_connector_extra_config"]
    assert settings == lmcache_settings(256 << 20)
    # The same host memory as kvtriton, in LMCache's GB (2**30 bytes).
    assert settings["lmcache.local_cpu"] is True and settings["lmcache.max_local_cpu_size"] * (1 << 30) == 256 << 20
    # vLLM loads whole blocks: a chunk that is not a multiple of the block size could never be loaded whole.
    assert settings["lmcache.chunk_size"] == LMCACHE_CHUNK_SIZE and LMCACHE_CHUNK_SIZE % BLOCK_SIZE == 0
    assert settings["lmcache.save_unfull_chunk"] is True
    # LMCache keys chunks by Python's hash() in two processes: the seed is pinned, for this arm's server only.
    assert dict(lmcache.env)["PYTHONHASHSEED"] == "0"
    assert all(not c.env for name, c in configurations().items() if name != LMCACHE)
    assert LMCACHE_VERSION in lmcache.note and "not LMCache's own" in lmcache.note


def test_the_lmcache_arm_is_skipped_with_one_line_saying_how_to_install_it_where_lmcache_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    problem = lmcache_problem()
    assert problem is not None and problem.startswith("skipped: LMCache is not installed") and "\n" not in problem
    assert ".bench-lmcache/bin/python -m bench.serving" in problem
    monkeypatch.setattr(importlib.metadata, "version", {"lmcache": LMCACHE_VERSION}.__getitem__)
    assert lmcache_problem() is None
    monkeypatch.setattr(importlib.metadata, "version", {"lmcache": "0.9.0"}.__getitem__)
    assert lmcache_problem() is None  # another release runs, and the run says so
    assert f"0.9.0 installed, the arm was written against {LMCACHE_VERSION}" in capsys.readouterr().err


def _no_warm_up(url: str, model: Path) -> None:
    """The servers here are stand-ins: nothing to warm up."""


def _no_metrics(url: str) -> str:
    return ""


def test_a_run_without_lmcache_records_the_skip_and_runs_every_other_arm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path / "out"))
    monkeypatch.setattr(serving, "lmcache_problem", lambda: "skipped: not here")
    started: list[tuple[str, dict[str, str]]] = []

    @contextlib.contextmanager
    def served(command: list[str], env: Mapping[str, str], log_path: Path) -> Generator[str]:
        started.append((command[command.index("--kv-cache-memory-bytes") + 1], dict(env)))
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(serving, "served", served)
    monkeypatch.setattr(serving, "_warm_up", _no_warm_up)
    monkeypatch.setattr(serving, "_get", _no_metrics)
    result: dict[str, object] = {"completed": 4, **dict.fromkeys(("mean_ttft_ms", "p99_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
              "output_throughput", "total_token_throughput", "request_throughput", "duration"), 1.0)}  # fmt: skip

    def run_client(args: Sequence[str], log_path: Path) -> dict[str, object]:
        return result

    monkeypatch.setattr(serving, "run_client", run_client)
    assert main(["--quick", "--configurations", f"kvtriton,{LMCACHE}", "--model", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "out" / "serving-quick.json").read_text())
    assert written["results"][LMCACHE] == "skipped: not here"
    assert [arm for _, arm in written["schedule"]] == ["none", "kvtriton"] and len(started) == 2
    assert "lmcache" not in written and "PYTHONHASHSEED" not in started[1][1]


def test_the_lmcache_arms_server_gets_its_pinned_hash_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, str]] = []

    @contextlib.contextmanager
    def served(command: list[str], env: Mapping[str, str], log_path: Path) -> Generator[str]:
        seen.append(dict(env))
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(serving, "served", served)
    monkeypatch.setattr(serving, "_warm_up", _no_warm_up)
    run_arm(configurations()[LMCACHE], tmp_path, [], engine_kv_bytes=1, env={"A": "1", "PYTHONHASHSEED": "random"},
            folder=tmp_path / "arm", progress="")  # fmt: skip
    assert seen == [{"A": "1", "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}]


def test_the_server_environment_drops_the_variable_that_would_override_every_arms_cache_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = server_env("cpu")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_TARGET_DEVICE"] == "cpu"


def test_vllms_cpu_offload_is_reported_unavailable_on_the_cpu_platform() -> None:
    pytest.importorskip("vllm")
    problem = vllm_offload_problem(server_env("cpu"))
    assert problem is not None and problem.startswith("not available on this platform")


# -- the workloads -------------------------------------------------------------------------------------------


def test_the_client_runs_vllms_bench_serve_over_the_three_workloads(tmp_path: Path) -> None:
    prefix_heavy, multi_turn, no_reuse = workloads(FULL_SIZES, tmp_path / "mt.json")
    args = bench_serve_args(tmp_path, "http://127.0.0.1:1", prefix_heavy)
    assert args[args.index("--dataset-name") + 1] == "prefix_repetition"
    assert args[args.index("--max-concurrency") + 1] == str(MAX_CONCURRENCY)
    assert args[args.index("--num-prompts") + 1] == str(prefix_heavy.num_prompts)
    # The conversations are read in the order written: a turn comes after the conversation's earlier turns.
    assert multi_turn.args[multi_turn.args.index("--dataset-name") + 1] == "sharegpt"
    assert "--disable-shuffle" in multi_turn.args and str(tmp_path / "mt.json") in multi_turn.args
    assert multi_turn.num_prompts == FULL_SIZES.multi_turn.conversations * FULL_SIZES.multi_turn.turns
    # The no-reuse prompts are as long as the prefix-heavy ones: only the reuse differs.
    heavy = dict(zip(prefix_heavy.args[::2], prefix_heavy.args[1::2]))
    fresh = dict(zip(no_reuse.args[::2], no_reuse.args[1::2]))
    length = int(heavy["--prefix-repetition-prefix-len"]) + int(heavy["--prefix-repetition-suffix-len"])
    assert fresh["--dataset-name"] == "random" and int(fresh["--random-input-len"]) == length


def test_multi_turn_prompts_go_turn_by_turn_and_each_turn_extends_its_conversations_last(tmp_path: Path) -> None:
    spec = MultiTurn(conversations=3, turns=4, opening_words=20, user_words=5, reply_words=4)
    prompts = multi_turn_prompts(spec, seed=7)
    assert len(prompts) == 12 and prompts == multi_turn_prompts(spec, seed=7)
    for index in range(spec.conversations, len(prompts)):
        earlier, later = prompts[index - spec.conversations], prompts[index]
        # A whole earlier prompt, cut where a line ends, so the tokenizer splits the shared part alike.
        assert later.startswith(earlier) and earlier.endswith("Assistant:") and len(later) > len(earlier)
    openings = {prompt.split("\n", 1)[0] for prompt in prompts[: spec.conversations]}
    assert len(openings) == spec.conversations  # each conversation is about a document of its own
    entries = json.loads(write_sharegpt(prompts, tmp_path / "mt.json").read_text())
    assert [entry["conversations"][0]["value"] for entry in entries] == prompts
    with pytest.raises(ValueError, match="conversation and a turn"):
        multi_turn_prompts(MultiTurn(0, 2, 1, 1, 1), seed=0)


# -- the order and the statistics ----------------------------------------------------------------------------


def test_arms_alternate_round_by_round() -> None:
    assert alternating_schedule(["a", "b", "c"], 3) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c"), (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        alternating_schedule(["a"], 0)
    with pytest.raises(ValueError, match="distinct"):
        alternating_schedule(["a", "a"], 1)


def test_no_connector_and_the_ceiling_always_run_and_a_smoke_run_keeps_none_and_the_named_arms() -> None:
    assert chosen_arms("kvtriton", quick=False) == ["none", "kvtriton", CEILING]
    assert chosen_arms(",".join(ARMS), quick=False) == list(ARMS) == chosen_arms(None, quick=False)
    assert chosen_arms(None, quick=True) == ["none", "kvtriton"]
    assert chosen_arms(f"{LMCACHE},kvtriton", quick=True) == ["none", "kvtriton", LMCACHE]


def test_spread_is_the_median_and_range_of_the_rounds_in_their_order() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": [3.0, 1.0, 2.0]}
    assert spread([4.0, 1.0, 2.0, 3.0])["median"] == 2.5
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_ceiling_share_is_kvtritons_part_of_the_ceilings_ttft_gain() -> None:
    assert ceiling_share(none=1000.0, kvtriton=550.0, ceiling=500.0) == 0.9
    assert ceiling_share(none=1000.0, kvtriton=1100.0, ceiling=500.0) == -0.2  # slower than no connector
    assert ceiling_share(none=1000.0, kvtriton=400.0, ceiling=500.0) == 1.2  # faster than the ceiling (noise)
    assert ceiling_share(none=1000.0, kvtriton=900.0, ceiling=1000.0) is None  # the ceiling gained nothing
    # Hit tokens: more is better; kvtriton recovered 600 of the ceiling's 800 extra.
    assert ceiling_share(none=200.0, kvtriton=800.0, ceiling=1000.0, higher_is_better=True) == 0.75
    assert ceiling_share(none=200.0, kvtriton=800.0, ceiling=200.0, higher_is_better=True) is None


def _figures(ttft: float, throughput: float) -> dict[str, float]:
    keys = ("median_ttft_ms", "p99_ttft_ms", "output_throughput", "duration", "prompt_tokens",
            "engine_cache_hit_tokens", "connector_hit_tokens", "computed_tokens")  # fmt: skip
    return {"mean_ttft_ms": ttft, "total_token_throughput": throughput, **dict.fromkeys(keys, 1.0)}


RUNS = {
    # arm -> round -> workload -> figures; round 2 is a slow spell for every arm alike.
    "none": {1: {"prefix-heavy": _figures(1000, 100), "no-reuse": _figures(900, 100)},
             2: {"prefix-heavy": _figures(2000, 50), "no-reuse": _figures(1800, 50)},
             3: {"prefix-heavy": _figures(1100, 90), "no-reuse": _figures(950, 95)}},
    "kvtriton": {1: {"prefix-heavy": _figures(600, 150), "no-reuse": _figures(920, 98)},
                 2: {"prefix-heavy": _figures(1200, 75), "no-reuse": _figures(1900, 48)},
                 3: {"prefix-heavy": _figures(640, 140), "no-reuse": _figures(960, 94)}},
    CEILING: {1: {"prefix-heavy": _figures(500, 160), "no-reuse": _figures(900, 100)},
              2: {"prefix-heavy": _figures(1000, 80), "no-reuse": _figures(1800, 50)},
              3: {"prefix-heavy": _figures(600, 150), "no-reuse": _figures(950, 95)}},
}  # fmt: skip


def test_aggregate_takes_every_figure_over_the_rounds() -> None:
    summary = aggregate(RUNS)
    assert summary["none"]["prefix-heavy"]["mean_ttft_ms"] == {
        "median": 1100, "min": 1000, "max": 2000, "rounds": [1000, 2000, 1100]
    }  # fmt: skip
    assert set(summary["kvtriton"]["no-reuse"]) >= {"total_token_throughput", "connector_hit_tokens", "p99_ttft_ms"}


def test_shares_of_the_medians_and_of_each_paired_round() -> None:
    share = shares(RUNS, "kvtriton")["prefix-heavy"]
    # Medians: none 1100, kvtriton 640, ceiling 600: (1100 - 640) / (1100 - 600).
    assert share["share"] == pytest.approx(0.92)
    assert share["rounds"] == pytest.approx([0.8, 0.8, 0.92]) and share["min"] == pytest.approx(0.8)
    assert share["hit_tokens_share"] is None  # every arm here hit the same tokens
    assert share["gain_ms"] == {"of_medians": 500, "rounds": [500, 1000, 500], "min": 500, "max": 1000}
    # No reuse: nothing to share.
    assert "no-reuse" not in shares(RUNS, "kvtriton")


def test_throughput_ratios_of_the_medians_and_of_each_round() -> None:
    ratio = throughput_ratios(RUNS, "kvtriton")["no-reuse"]
    assert ratio["ratio"] == pytest.approx(94 / 95)
    assert ratio["rounds"] == pytest.approx([0.98, 0.96, 94 / 95]) and ratio["min"] == pytest.approx(0.96)


def test_kvtriton_against_lmcache_is_the_ratio_of_the_medians_with_each_paired_rounds() -> None:
    runs = {**RUNS, LMCACHE: {r: {w: _figures(f["mean_ttft_ms"] * 2, f["total_token_throughput"] / 2)
                                  for w, f in RUNS["none"][r].items()} for r in (1, 2)}}  # fmt: skip
    against = versus(runs, "kvtriton", LMCACHE)["prefix-heavy"]
    # Medians over its own rounds: kvtriton 640 ms and 140 tok/s; LMCache (rounds 1 and 2) 3,000 ms and 37.5 tok/s.
    assert against["mean_ttft_ms"]["ratio"] == pytest.approx(640 / 3000)
    assert against["mean_ttft_ms"]["rounds"] == pytest.approx([0.3, 0.3])  # round 3 has no LMCache to pair with
    assert against["total_token_throughput"]["ratio"] == pytest.approx(140 / 37.5)
    assert against["total_token_throughput"]["min"] == pytest.approx(3.0)


def test_goals_are_reported_met_not_met_or_not_measurable() -> None:
    share: dict[str, dict[str, object]] = {
        "prefix-heavy": {"share": 0.92, "gain_ms": {"min": 500.0}},
        # The ceiling was slower than no connector in one round: its gain, and any share of it, is noise.
        "multi-turn": {"share": 0.95, "gain_ms": {"min": -20.0}},
    }
    verdicts = goals(share, {"no-reuse": {"ratio": 0.96}})
    assert [(v["workload"], v["measured"], v["met"]) for v in verdicts] == [
        ("prefix-heavy", 0.92, True), ("multi-turn", None, None), ("no-reuse", 0.96, False),
    ]  # fmt: skip
    assert "within the noise" in str(verdicts[1]["reason"]) and verdicts[0]["reason"] is None
    assert f"{CEILING_SHARE_GOAL:.0%}" in str(verdicts[0]["goal"]) and f"{THROUGHPUT_GOAL:g}x" in str(
        verdicts[2]["goal"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "2"], "--rounds must be >= 3 (a median and a spread), got 2"),
        (["--configurations", "none,fast"], "unknown ['fast']"),
        (["--engine-kv-bytes", "0"], "--engine-kv-bytes must be > 0, got 0"),
        (["--host-bytes", "-1"], "--host-bytes must be > 0, got -1"),
    ],
)
def test_bad_arguments_are_refused_before_any_server_starts(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(argv)


def test_the_hit_token_share_counts_the_prompt_tokens_the_ceiling_did_not_compute() -> None:
    def hits(engine: float, connector: float) -> dict[str, dict[str, float]]:
        figures = {**_figures(1000, 100), "engine_cache_hit_tokens": engine, "connector_hit_tokens": connector}
        return {"prefix-heavy": figures}

    runs = {
        "none": {1: hits(480, 0), 2: hits(480, 0), 3: hits(512, 0)},
        "kvtriton": {1: hits(448, 672), 2: hits(448, 600), 3: hits(448, 672)},
        CEILING: {1: hits(1120, 0), 2: hits(1120, 0), 3: hits(1120, 0)},
    }
    # Medians: none 480, kvtriton 1120, ceiling 1120: every token the ceiling did not compute, kvtriton did not either.
    assert shares(runs, "kvtriton")["prefix-heavy"]["hit_tokens_share"] == 1.0


def test_recompute_rewrites_what_the_rounds_say_and_keeps_the_measurements(tmp_path: Path) -> None:
    records = [{"round": r, "arm": arm, "figures": RUNS[arm][r], "load_average_before": [2.0, 0.0, 0.0],
                "load_average_after": [3.0, 0.0, 0.0]} for r in (1, 2, 3) for arm in RUNS]  # fmt: skip
    args = argparse.Namespace(quick=False, model=None, device="cpu", engine_kv_bytes=1 << 20, host_bytes=1 << 20)
    payload = report(RUNS, {"vLLM CPU offload": "not here"}, records, sizes=FULL_SIZES,
                     chosen=workloads(FULL_SIZES, tmp_path / "mt.json"), model=tmp_path, args=args, rounds=3)  # fmt: skip
    stale = {**payload, "machine": {"date": "then"}, "ceiling_share": {}, "goals": {}}
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(stale))
    fresh = json.loads(recompute(path).read_text())
    assert fresh["machine"] == {"date": "then"} and fresh["runs"] == json.loads(json.dumps(records))
    assert fresh["ceiling_share"] == json.loads(json.dumps(payload["ceiling_share"]))
    assert fresh["goals"] == json.loads(json.dumps(payload["goals"]))
    assert fresh["results"]["vLLM CPU offload"] == "not here"
    # The recorded client command names the conversations' file, not the scratch folder it was in.
    assert "mt.json" in fresh["workloads"]["multi-turn"]["vllm_bench_serve"]
    assert str(tmp_path) not in fresh["workloads"]["multi-turn"]["vllm_bench_serve"]
