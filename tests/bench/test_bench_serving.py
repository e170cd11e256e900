"""The serving benchmark's own code paths, without a server: its commands, its /metrics arithmetic, its result reading.

The benchmark itself (``python -m bench.serving``, ``kvtriton bench serving``)
starts real servers and takes minutes; its smoke run (``--quick``) is not part
of ``make test``. These tests pin what it asks vLLM for and how it reads the
answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serving import (
    CONFIGURATIONS,
    MAX_CONCURRENCY,
    bench_serve_command,
    datasets,
    main,
    prometheus_totals,
    prompt_token_sources,
    serve_command,
    server_env,
    summarize,
    vllm_offload_problem,
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
"""


def test_prometheus_totals_sum_every_label_set_and_skip_comments() -> None:
    totals = prometheus_totals(METRICS_AFTER + "# a comment 1.0\n")
    assert totals["vllm:kv_offload_load_bytes_total"] == 10.0
    assert totals["vllm:prompt_tokens_total"] == 1100.0
    assert "#" not in "".join(totals)


def test_prompt_tokens_are_split_into_computed_engine_cache_and_connector_hits() -> None:
    sources = prompt_token_sources(prometheus_totals(METRICS_BEFORE), prometheus_totals(METRICS_AFTER))
    assert sources == {"prompt_tokens": 1000.0, "engine_cache_hit_tokens": 200.0, "connector_hit_tokens": 512.0,
                       "computed_tokens": 288.0}  # fmt: skip


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


def test_servers_differ_only_in_their_offloading_arguments(tmp_path: Path) -> None:
    commands = {name: serve_command(tmp_path, 8000, c, engine_kv_bytes=64 << 20) for name, c in CONFIGURATIONS.items()}
    base = commands["none"]
    assert base[base.index("--max-num-seqs") + 1] == str(MAX_CONCURRENCY)
    assert base[base.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    for name, command in commands.items():
        assert command[: len(base)] == base, name
    kvtriton = json.loads(commands["kvtriton fp8-e4m3"][-1])
    assert kvtriton["kv_connector_extra_config"]["spec_name"] == "KVTritonOffloadingSpec"
    assert kvtriton["kv_connector_extra_config"]["kvtriton_kv_compression"] == "fp8-e4m3"
    assert "--kv-offloading-size" in commands["vLLM CPU offload"]


def test_client_runs_vllms_own_bench_serve_over_both_datasets(tmp_path: Path) -> None:
    prefix_heavy, no_reuse = datasets(quick=False)
    command = bench_serve_command(tmp_path, "http://127.0.0.1:1", prefix_heavy, num_prompts=32, result_dir=tmp_path,
                                  result_name="x.json")  # fmt: skip
    assert command[command.index("bench") + 1] == "serve"
    assert command[command.index("--dataset-name") + 1] == "prefix_repetition"
    assert command[command.index("--max-concurrency") + 1] == str(MAX_CONCURRENCY)
    assert no_reuse.args[no_reuse.args.index("--dataset-name") + 1] == "random"
    # The no-reuse prompts are as long as the prefix-heavy ones: only the reuse differs.
    heavy = dict(zip(prefix_heavy.args[::2], prefix_heavy.args[1::2]))
    fresh = dict(zip(no_reuse.args[::2], no_reuse.args[1::2]))
    length = int(heavy["--prefix-repetition-prefix-len"]) + int(heavy["--prefix-repetition-suffix-len"])
    assert int(fresh["--random-input-len"]) == length


def test_vllms_cpu_offload_is_reported_unavailable_on_the_cpu_platform() -> None:
    pytest.importorskip("vllm")
    problem = vllm_offload_problem(server_env("cpu"))
    assert problem is not None and problem.startswith("not available on this platform")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "2"], "--num-prompts must be >= 4, got 2"),
        (["--configurations", "none,fast"], "unknown ['fast']"),
        (["--engine-kv-bytes", "0"], "--engine-kv-bytes must be > 0, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_server_starts(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        main(argv)
