"""Output conventions shared by every benchmark in bench/.

Each benchmark prints a table, and writes JSON (plus a PNG where a curve says
more than a table) under ``bench/results/`` -- or the folder named by
``$KVTRITON_BENCH_OUT`` -- with the machine it ran on recorded beside the
numbers, so figures from different machines are never mixed up.

Units in the JSON: bandwidths are ``bandwidth_GBps``, in GB/s of 10^9 bytes
(never gigabits); times are seconds unless the name says ``_us``. Smoke runs
(``--quick``) write ``<name>-quick.json`` (:func:`quick_name`) and carry no
verdicts, so they never overwrite or pass for a real run's figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtriton.cli._info import collect_machine_info

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

__all__ = [
    "bench_parser",
    "chosen_device",
    "command_line",
    "format_table",
    "machine_record",
    "offloading_config",
    "quick_name",
    "readable_bytes",
    "results_dir",
    "write_json",
]

RESULTS_ENV = "KVTRITON_BENCH_OUT"


def results_dir() -> Path:
    """Where results go: ``$KVTRITON_BENCH_OUT`` if set, else ``bench/results/``."""
    chosen = os.environ.get(RESULTS_ENV)
    folder = Path(chosen) if chosen else Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def machine_record() -> dict[str, object]:
    """Machine info for a result file: GPU name, or ``cpu`` / ``cpu-interpreter``."""
    info = collect_machine_info().as_dict()
    if not info["cuda_available"]:
        info["device_name"] = "cpu-interpreter" if info["triton_interpret"] else "cpu"
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return info


def write_json(name: str, payload: Mapping[str, object]) -> Path:
    """Write ``{"machine": ..., **payload}`` to ``<results>/<name>.json``."""
    path = results_dir() / f"{name}.json"
    record: dict[str, object] = {"machine": machine_record(), **payload}
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def quick_name(name: str) -> str:
    """The file stem of a smoke run (``--quick``): ``kernels`` -> ``kernels-quick``."""
    return name if name.endswith("-quick") else f"{name}-quick"


def bench_parser(
    module: str, doc: str | None, *, quick: str | None = None, device: bool = False
) -> argparse.ArgumentParser:
    """The parser of ``python -m bench.<module>``, described by the first line of its docstring ``doc``.

    ``quick``: what ``--quick``, a smoke run, runs (it writes ``<name>-quick.json``); with it come ``--name``, the result file stem (default
    ``module``), and :func:`result_name`, the stem a run writes. ``device``: ``--device`` (auto, cpu or cuda),
    read with :func:`chosen_device`.
    """
    parser = argparse.ArgumentParser(prog=f"python -m bench.{module}", description=doc.splitlines()[0] if doc else None)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}; writes <name>-quick.json")
        parser.add_argument("--name", default=module, help=f"result file stem (default: {module})")
    if device:
        parser.add_argument(
            "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda when available (default)"
        )
    return parser


def result_name(args: argparse.Namespace) -> str:
    """The stem of the result file a run writes: ``--name``, with ``-quick`` for a smoke run (``--quick``)."""
    name: str = args.name
    return quick_name(name) if args.quick else name


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command a result file records: ``python -m bench.<module>`` and its arguments (``sys.argv``'s by default)."""
    return " ".join([f"python -m bench.{module}", *(sys.argv[1:] if argv is None else argv)])


def chosen_device(choice: str) -> str:
    """``--device``'s choice resolved: ``auto`` is ``cuda`` where torch sees a GPU, else ``cpu``."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def readable_bytes(size: int) -> str:
    """``4096`` -> ``4 KiB``, ``1048576`` -> ``1 MiB``, ``656`` -> ``656 B`` (for axis ticks and tables)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2g} {unit}"
    return f"{size} B"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned plain-text table; floats get 3 significant decimals."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    text_rows = [[cell(value) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in text_rows)]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.rjust(width) for header, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(value.rjust(width) for value, width in zip(row, widths)) for row in text_rows]
    return "\n".join(lines)


def offloading_config(
    extra_config: Mapping[str, object],
    *,
    worker_kv_bytes_per_block: int,
    engine_id: str,
    model_name: str,
    blocks_per_chunk: int = 1,
    world_size: int = 1,
    rank: int = 0,
    enable_events: bool = False,
    canonical_layout: bool = False,
    tokens_per_block: int = 16,
    layer_name: str = "layer0",
    dtype: str = "float16",
    max_model_len: int = 4096,
) -> OffloadingConfig:
    """The ``OffloadingConfig`` vLLM's connector builds for a model of one full-attention group.

    The benchmarks and the tests build their offloading specs from it (the
    tests import it from here: bench never imports tests). The ranks are
    tensor-parallel (``tp_size = world_size``), one data-parallel replica.
    vLLM is imported on call, so this module stays importable without it.
    """
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=(layer_name,), group_id=0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_events,
        extra_config=dict(extra_config),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model_name, dtype=dtype, max_model_len=max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        canonical_layout=canonical_layout,
    )
