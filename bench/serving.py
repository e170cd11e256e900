"""What kvtriton does to a server's TTFT and throughput: ``vllm serve`` driven by vLLM's own ``vllm bench serve``.

Run ``python -m bench.serving`` (``--quick`` for a smoke run). For each
configuration -- no connector, kvtriton, kvtriton with
``kvtriton_kv_compression="fp8-e4m3"``, and vLLM's own CPU offloading
(``--kv-offloading-size``) where vLLM's platform runs it -- it starts
``vllm serve`` with SmolLM2-135M-Instruct (:mod:`bench.real_model`) and a
small engine KV cache (:data:`ENGINE_KV_BYTES`, about 43 blocks of 32 tokens:
the prompts in flight fill it, so a prefix seen earlier is gone from it when
it comes back), then drives it with ``vllm bench serve``, 4 requests at a
time, over two of vLLM's synthetic datasets:

* ``prefix-heavy``: ``prefix_repetition``, a few long prefixes each followed
  by a short random suffix (a chat system prompt, a shared document);
* ``no-reuse``: ``random``, every prompt new (what offloading cannot help
  and must not slow down).

Per configuration and dataset it reports the mean and p99 time to first
token, the output and total token throughput, and where the prompt tokens
came from (vLLM's ``/metrics`` before and after: computed, the engine's own
prefix cache, the connector). vLLM's CPU offloading needs a CUDA-alike or
XPU platform (its worker refuses any other); on CPU its row says so and
carries no figures.

On a GPU server, run it the same way with ``--device cuda`` (the CPU
environment is then not forced), a larger ``--host-bytes`` and, for a
different model, ``--model DIR``; the engine KV cache stays small on
purpose (``--engine-kv-bytes``).

Writes ``bench/results/serving.json`` (``serving-quick.json`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import bench_parser, format_table, quick_name, write_json

__all__ = [
    "CONFIGURATIONS",
    "DATASETS",
    "Configuration",
    "Dataset",
    "bench_serve_command",
    "main",
    "prompt_token_sources",
    "serve_command",
    "summarize",
]

LOOPBACK = "127.0.0.1"
BLOCK_SIZE = 32
MAX_CONCURRENCY = 4
ENGINE_KV_BYTES = 64 << 20
"""The engine's own KV cache: about 43 blocks of 32 tokens of SmolLM2-135M in fp32 (1.4 MiB per block)."""
HOST_BYTES = 1 << 30
"""kvtriton's host slab (and vLLM's CPU offloading size): room for every prefix of the runs."""
PREFIXES = 8
"""Distinct prefixes of the prefix-heavy dataset: 8 of 256 tokens are 64 blocks, more than the engine's cache holds."""
START_TIMEOUT_S = 300.0
PROMETHEUS_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (?P<value>\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Configuration:
    """One server: its name and the ``vllm serve`` arguments that make it (none: no connector)."""

    name: str
    serve_args: tuple[str, ...]


def _kvtriton(**extra: object) -> tuple[str, ...]:
    config = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVTritonOffloadingSpec", "spec_module_path": "kvtriton.integrations.vllm",
                                      "cpu_bytes_to_use": HOST_BYTES, **extra},
    }  # fmt: skip
    return ("--kv-transfer-config", json.dumps(config))


CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("none", ()),
        Configuration("kvtriton", _kvtriton()),
        Configuration("kvtriton fp8-e4m3", _kvtriton(kvtriton_kv_compression="fp8-e4m3")),
        Configuration(
            "vLLM CPU offload",
            ("--kv-offloading-size", f"{HOST_BYTES / (1 << 30):g}", "--kv-offloading-backend", "native"),
        ),
    )
}
"""The servers compared, in order."""


@dataclass(frozen=True, slots=True)
class Dataset:
    """One ``vllm bench serve`` workload: its name and its dataset arguments (``num_prompts`` is given separately)."""

    name: str
    args: tuple[str, ...]


def datasets(*, quick: bool) -> list[Dataset]:
    """The prefix-heavy and the no-reuse workload (shorter prompts in a smoke run)."""
    prefix, suffix, output, prefixes = (64, 32, 4, 2) if quick else (256, 32, 16, PREFIXES)
    return [
        Dataset("prefix-heavy", (
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(suffix), "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", str(output),
        )),
        Dataset("no-reuse", (
            "--dataset-name", "random", "--random-input-len", str(prefix + suffix), "--random-output-len", str(output),
            "--random-range-ratio", "0",
        )),
    ]  # fmt: skip


DATASETS = [dataset.name for dataset in datasets(quick=False)]


def serve_command(model: Path, port: int, configuration: Configuration, *, engine_kv_bytes: int) -> list[str]:
    """``vllm serve`` for ``configuration`` on the loopback (fp32, block size 32, 4 sequences at a time)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", LOOPBACK, "--port", str(port),
        "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
        "--max-num-seqs", str(MAX_CONCURRENCY), "--enforce-eager", "--kv-cache-memory-bytes", str(engine_kv_bytes),
        *configuration.serve_args,
    ]  # fmt: skip


def bench_serve_command(
    model: Path, url: str, dataset: Dataset, *, num_prompts: int, result_dir: Path, result_name: str
) -> list[str]:
    """vLLM's own client: ``vllm bench serve`` over ``dataset``, :data:`MAX_CONCURRENCY` requests at a time."""
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", str(model), "--tokenizer", str(model), *dataset.args,
        "--num-prompts", str(num_prompts), "--max-concurrency", str(MAX_CONCURRENCY), "--request-rate", "inf",
        "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
    ]  # fmt: skip


def prometheus_totals(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, summed over its label sets, by name."""
    totals: dict[str, float] = {}
    for match in PROMETHEUS_LINE.finditer(text):
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        totals[match.group("name")] = totals.get(match.group("name"), 0.0) + value
    return totals


def prompt_token_sources(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Where a run's prompt tokens came from: vLLM's counters' growth between two ``/metrics`` scrapes."""

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = grew("vllm:prompt_tokens_total")
    local, external = grew("vllm:prefix_cache_hits_total"), grew("vllm:external_prefix_cache_hits_total")
    return {"prompt_tokens": prompt, "engine_cache_hit_tokens": local, "connector_hit_tokens": external,
            "computed_tokens": prompt - local - external}  # fmt: skip


def summarize(result: Mapping[str, object], sources: Mapping[str, float]) -> dict[str, float]:
    """The figures of one ``vllm bench serve`` result file (and the prompt tokens' sources) this benchmark reports."""
    keys = ("completed", "mean_ttft_ms", "p99_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "output_throughput",
            "total_token_throughput", "request_throughput", "duration")  # fmt: skip
    figures: dict[str, float] = {}
    for key in keys:
        value = result.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"the vllm bench serve result has no number at {key!r}, got {value!r:.60}")
        figures[key] = float(value)
    return figures | dict(sources)


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
    if device == "cpu":
        # A shared machine: no OpenMP pinning to cores other processes use.
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": LOOPBACK}
    return env


def run_configuration(
    configuration: Configuration,
    model: Path,
    workloads: Sequence[Dataset],
    *,
    num_prompts: int,
    engine_kv_bytes: int,
    env: Mapping[str, str],
    scratch: Path,
) -> dict[str, dict[str, float]]:
    """One server for ``configuration``, every workload through it in turn; figures by workload."""
    folder = scratch / configuration.name.replace(" ", "-")
    folder.mkdir(parents=True)
    command = serve_command(model, _free_port(), configuration, engine_kv_bytes=engine_kv_bytes)
    figures: dict[str, dict[str, float]] = {}
    with served(command, env, folder / "serve.log") as url:
        for workload in workloads:
            before = prometheus_totals(_get(f"{url}/metrics") or "")
            client = bench_serve_command(model, url, workload, num_prompts=num_prompts, result_dir=folder,
                                         result_name=f"{workload.name}.json")  # fmt: skip
            print(
                f"== {configuration.name}, {workload.name}: vllm bench serve ({num_prompts} prompts)",
                file=sys.stderr,
                flush=True,
            )
            done = subprocess.run(client, env=dict(env), capture_output=True, text=True, timeout=3600, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"vllm bench serve failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
                )
            after = prometheus_totals(_get(f"{url}/metrics") or "")
            result = json.loads((folder / f"{workload.name}.json").read_text())
            figures[workload.name] = summarize(result, prompt_token_sources(before, after))
    return figures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser("serving", __doc__)
    parser.add_argument(
        "--num-prompts", type=int, default=32, help="requests per dataset and configuration (default: 32)"
    )
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, from: {', '.join(CONFIGURATIONS)} (default: all)")  # fmt: skip
    parser.add_argument(
        "--model", type=Path, help="a model folder (default: SmolLM2-135M-Instruct, prepared and cached)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM's platform (default: cpu)")
    parser.add_argument("--engine-kv-bytes", type=int, default=ENGINE_KV_BYTES,
                        help=f"the engine's own KV cache (default: {ENGINE_KV_BYTES >> 20} MiB)")  # fmt: skip
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8 prompts, shorter prompts, no connector and kvtriton only; writes serving-quick.json",
    )
    parser.add_argument("--name", default="serving", help="result file stem (default: serving)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_prompts < MAX_CONCURRENCY:
        raise SystemExit(f"--num-prompts must be >= {MAX_CONCURRENCY}, got {args.num_prompts}")
    chosen = [name.strip() for name in args.configurations.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in CONFIGURATIONS]
    if unknown or not chosen:
        raise SystemExit(f"--configurations: unknown {unknown or chosen!r} (choose from {', '.join(CONFIGURATIONS)})")
    if args.engine_kv_bytes <= 0:
        raise SystemExit(f"--engine-kv-bytes must be > 0, got {args.engine_kv_bytes}")
    num_prompts = 8 if args.quick else args.num_prompts
    if args.quick:
        chosen = [name for name in chosen if name in ("none", "kvtriton")] or ["none"]
        print("SMOKE RUN (--quick): 8 short prompts per dataset; the figures are no verdict.")
    if args.model is None:
        from bench.real_model import prepared_model

        model = prepared_model().path
    else:
        model = args.model
    env = server_env(args.device)
    workloads = datasets(quick=args.quick)
    results: dict[str, dict[str, dict[str, float]] | str] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    try:
        for name in chosen:
            configuration = CONFIGURATIONS[name]
            problem = vllm_offload_problem(env) if name == "vLLM CPU offload" else None
            if problem is not None:
                results[name] = problem
                print(f"== {name}: {problem}", file=sys.stderr)
                continue
            results[name] = run_configuration(configuration, model, workloads, num_prompts=num_prompts,
                                              engine_kv_bytes=args.engine_kv_bytes, env=env, scratch=scratch)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows: list[list[object]] = []
    for name, figures in results.items():
        if isinstance(figures, str):
            rows.append([name, "-", figures, "", "", "", "", ""])
            continue
        for workload, f in figures.items():
            rows.append([name, workload, f"{f['mean_ttft_ms']:.0f}", f"{f['p99_ttft_ms']:.0f}", f"{f['output_throughput']:.1f}",
                         f"{f['computed_tokens']:.0f}", f"{f['engine_cache_hit_tokens']:.0f}", f"{f['connector_hit_tokens']:.0f}"])  # fmt: skip
    print(format_table(["configuration", "dataset", "mean TTFT ms", "p99 TTFT ms", "output tok/s", "computed",
                        "engine cache hits", "connector hits"], rows))  # fmt: skip
    payload: dict[str, object] = {
        "smoke_run": args.quick, "model": str(model) if args.model is not None else "SmolLM2-135M-Instruct",
        "device": args.device, "num_prompts": num_prompts, "max_concurrency": MAX_CONCURRENCY,
        "engine_kv_bytes": args.engine_kv_bytes, "host_bytes": HOST_BYTES, "block_size": BLOCK_SIZE,
        "datasets": {d.name: list(d.args) for d in workloads}, "results": results,
    }  # fmt: skip
    print(f"wrote {write_json(quick_name(args.name) if args.quick else args.name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
