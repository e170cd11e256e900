"""The figures of docs/simulate.md, from the simulator's own runs: one source for each number there.

``python -m bench.render_simulate`` reruns the documented ``kvtriton
simulate`` commands (:data:`RUNS`, about 30 s on two CPU cores) and writes
each record to ``bench/results/<run>.json`` and each plot to
``docs/img/<run>.png``; ``python -m bench.render_docs`` then rewrites the
generated regions of docs/simulate.md from those records with
:data:`SIMULATE_RENDERERS` (merged into its ``RENDERERS``). Each plot carries
the stamp of the record it was drawn from (``kvtriton.cli._simulate.plot_stamp``),
so a test can tell a stale picture from a fresh one without comparing pixels.

A renderer whose figure backs a claim of the prose around it (ARC ahead of
LRU here, LRU ahead there) raises :class:`RenderError` when a rerun turns the
claim around, so the prose gets rewritten rather than contradicted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, cast

from bench.common import bench_parser
from bench.render_results import REPO, RESULTS, JSONObject, RenderError, Results

__all__ = ["IMAGES", "RUNS", "SIMULATE_RENDERERS", "SimulateRun", "build_parser", "main", "run_flags"]

IMAGES = REPO / "docs" / "img"


def _fail(message: str) -> NoReturn:
    """Raise RenderError, which render_docs reports naming the region that failed."""
    raise RenderError(message)


PREFIX_SHARING_FROM = "manager"
"""The result file whose ``simulate`` field is the prefix-sharing run's command (bench/manager.py writes it)."""


@dataclass(frozen=True, slots=True)
class SimulateRun:
    """One documented ``kvtriton simulate`` run: ``bench/results/<name>.json`` (and ``docs/img/<name>.png``)."""

    name: str
    flags: tuple[str, ...]
    """The command's flags, without ``--no-progress`` (added) and ``--out`` (a scratch folder)."""
    plot: bool


RUNS: tuple[SimulateRun, ...] = (
    SimulateRun("simulate-chat", (), plot=False),
    SimulateRun("simulate-chat-fp8", ("--compression", "fp8-e4m3"), plot=True),
    SimulateRun("simulate-few-shot", ("--workload", "few-shot"), plot=True),
    SimulateRun(
        "simulate-system-prompts-vllm",
        ("--workload", "system-prompts", "--gpu-blocks", "4096", "--max-num-seqs", "64"),
        plot=True,
    ),
    SimulateRun("simulate-prefix-sharing", (), plot=False),  # flags: the manager benchmark's command (run_flags)
)


def run_flags(run: SimulateRun, results: Results) -> list[str]:
    """The flags ``run`` is made with: its own, or for the prefix-sharing run the command bench/manager.py records."""
    if run.name != "simulate-prefix-sharing":
        return list(run.flags)
    command = shlex.split(str(results(PREFIX_SHARING_FROM).get("simulate")))
    if command[:2] != ["kvtriton", "simulate"]:
        _fail(f"bench/results/{PREFIX_SHARING_FROM}.json: 'simulate' is no kvtriton simulate command: {command!r:.80}")
    return command[2:]


def _argv(run: SimulateRun, results: Results) -> list[str]:
    return ["simulate", *run_flags(run, results), "--no-progress", *([] if run.plot else ["--no-plot"])]


# -- reading a record ------------------------------------------------------------------------------------


def _points(record: JSONObject, compression: str = "none") -> list[JSONObject]:
    points = cast(list[JSONObject], record.get("points"))
    return [point for point in points if point.get("compression", "none") == compression]


def _rate(record: JSONObject, point: JSONObject) -> float:
    """The rate the command checks the target against: vLLM's reported one in its order, the token hit rate else."""
    order = str(cast(JSONObject, record["call_order"])["name"])
    return float(cast(float, point["external_hit_rate" if order == "vllm" else "token_hit_rate"]))


def _at(record: JSONObject, policy: str, gib: float, compression: str = "none") -> JSONObject:
    for point in _points(record, compression):
        if point.get("policy") == policy and point.get("capacity_gib") == gib:
            return point
    _fail(f"no {policy} point at {gib:g} GiB ({compression}) in the record of `{_command(record)}`")


def _ceiling(record: JSONObject) -> float:
    return float(cast(float, cast(JSONObject, record["trace"])["unlimited_external_hit_rate"]))


def _command(record: JSONObject) -> str:
    return "kvtriton " + " ".join(cast(list[str], record.get("argv")))


def _pct(rate: float) -> str:
    """As the command prints a rate: one decimal, in percent."""
    return f"{100 * rate:.1f}%"


def _gib(gib: float) -> str:
    return f"{gib:g} GiB"


# -- the command's output, trimmed ----------------------------------------------------------------------


def _table_key(line: str) -> tuple[str, str] | None:
    """``(policy, GiB)`` of a table row of the printed output, None for any other line."""
    cells = line.split()
    return (cells[0], cells[1]) if len(cells) > 2 and cells[0] in ("lru", "arc") else None


def _trimmed_output(record: JSONObject, rows: Sequence[tuple[str, str]], tail: Sequence[str]) -> str:
    """The printed output as a fenced block: the lines above the table, its header and ``rows``, and ``tail``.

    A run of rows left out is one ``…`` line; each of ``tail`` is the first
    line starting with it, cut after its first clause when longer than that.
    """
    printed = cast(list[str], record.get("printed"))
    if not printed:
        _fail(f"the record of `{_command(record)}` has no printed output (rerun python -m bench.render_simulate)")
    top = printed[: printed.index("")]
    header = next(index for index, line in enumerate(printed) if line.lstrip().startswith("policy"))
    lines = [*top, "", printed[header], printed[header + 1]]
    skipped = False
    for line in printed[header + 2 :]:
        key = _table_key(line)
        if key is None:
            break
        if key in rows:
            if skipped:
                lines.append("   …")
            lines.append(line)
            skipped = False
        else:
            skipped = True
    if skipped:
        lines.append("   …")
    lines.append("")
    for start in tail:
        line = next((line for line in printed if line.startswith(start)), None)
        if line is None:
            _fail(f"the output of `{_command(record)}` has no line starting {start!r}")
        first, sep, _ = line.partition("; ")
        lines.append(f"{first}; …" if sep else line)
    lines.append("…")
    return "```\n" + "\n".join(lines) + "\n```"


def few_shot_output(results: Results) -> str:
    rows = [(policy, gib) for policy in ("lru", "arc") for gib in ("4", "8", "16")]
    return _trimmed_output(results("simulate-few-shot"), rows, ["smallest size reaching"])


def vllm_output(results: Results) -> str:
    rows = [*(("lru", gib) for gib in ("1", "2", "4", "8")), ("arc", "16")]
    return _trimmed_output(results("simulate-system-prompts-vllm"), rows, ["admission:"])


# -- figures in the prose ---------------------------------------------------------------------------------


def chat_seconds(results: Results) -> str:
    return f"{float(cast(float, results('simulate-chat')['elapsed_seconds'])):.1f} s"


def _ahead(record: JSONObject, leader: str, other: str, gib: float) -> str:
    """``LEADER x% against OTHER y% at N GiB``; RenderError when ``leader`` is not ahead (the prose says it is)."""
    lead, behind = _rate(record, _at(record, leader, gib)), _rate(record, _at(record, other, gib))
    if lead <= behind:
        _fail(
            f"the prose says {leader.upper()} is ahead of {other.upper()} at {_gib(gib)} in `{_command(record)}`,"
            f" but it reads {_pct(lead)} against {_pct(behind)}: rewrite the sentence"
        )
    return f"{leader.upper()} {_pct(lead)} against {other.upper()} {_pct(behind)} at {_gib(gib)}"


def few_shot_arc_ahead(results: Results) -> str:
    return _ahead(results("simulate-few-shot"), "arc", "lru", 4)


def chat_lru_ahead(results: Results) -> str:
    return _ahead(results("simulate-chat"), "lru", "arc", 8)


def few_shot_knee(results: Results) -> str:
    """What 16 GiB serves against the ceiling, and what doubling to 32 GiB adds."""
    record = results("simulate-few-shot")
    at16 = sorted(_rate(record, _at(record, policy, 16)) for policy in ("lru", "arc"))
    at32 = min(_rate(record, _at(record, policy, 32)) for policy in ("lru", "arc"))
    return (
        f"16 GiB serves {100 * at16[0]:.1f}-{_pct(at16[1])} of prompt tokens against a {_pct(_ceiling(record))}"
        f" ceiling, and doubling to 32 GiB adds {100 * (at32 - at16[0]):.1f} points more"
    )


def fp8_shift(results: Results) -> str:
    """LRU's compressed curve at 4 GiB against its uncompressed one at 8 GiB: one doubling apart."""
    record = results("simulate-chat-fp8")
    compressed = _rate(record, _at(record, "lru", 4, "fp8-e4m3"))
    uncompressed = _rate(record, _at(record, "lru", 8))
    return f"LRU {_pct(compressed)} at 4 GiB compressed against {_pct(uncompressed)} at 8 GiB uncompressed"


def _first_at_ceiling(record: JSONObject, policy: str, within: float) -> float:
    """The smallest size at which ``policy`` comes within ``within`` (a fraction) of the ceiling."""
    ceiling = _ceiling(record)
    sizes = [
        float(cast(float, p["capacity_gib"]))
        for p in _points(record)
        if p["policy"] == policy and _rate(record, p) >= ceiling - within
    ]
    if not sizes:
        _fail(f"{policy} never comes within {100 * within:.1f} points of the ceiling in `{_command(record)}`")
    return min(sizes)


def vllm_gpu_share(results: Results) -> str:
    """What the GPU cache serves, what host memory adds at most, where vLLM's rate stops rising, and the answer."""
    record = results("simulate-system-prompts-vllm")
    trace = cast(JSONObject, record["trace"])
    host = max(float(cast(float, p["offload_share"])) for p in _points(record))
    flat = max(_first_at_ceiling(record, policy, 0.0005) for policy in ("lru", "arc"))
    found = cast(JSONObject, record["recommendation"])
    target = _pct(float(cast(float, found["target_hit_rate"])))
    if found["reached"]:
        answer = f"{target} is reached at {_gib(float(cast(int, found['capacity_bytes'])) / 2**30)}"
    else:
        answer = f"no size reaches {target}"
    return (
        f"a {cast(JSONObject, record['call_order'])['gpu_blocks']}-block GPU cache already serves"
        f" {_pct(float(cast(float, trace['gpu_share'])))} of prompt tokens, so host memory adds at most"
        f" {100 * host:.1f} points: vLLM would report {_pct(_ceiling(record))} at any size from {_gib(flat)},"
        f" and {answer}"
    )


def vllm_ceiling(results: Results) -> str:
    """ARC against LRU at 16 GiB behind the GPU cache, and the size from which both give the ceiling."""
    record = results("simulate-system-prompts-vllm")
    flat = max(_first_at_ceiling(record, policy, 0.0005) for policy in ("lru", "arc"))
    return f"{_ahead(record, 'arc', 'lru', 16)}; both give the {_pct(_ceiling(record))} ceiling from {_gib(flat)}"


def prefix_sharing_command(results: Results) -> str:
    """The manager benchmark's equivalent command as a bash block, with the hit rates it gives."""
    record = results("simulate-prefix-sharing")
    words = [word for word in cast(list[str], record["argv"])[1:] if word not in ("--no-progress", "--no-plot")]
    options: list[str] = []  # each flag with its value, kept on one line
    for word in words:
        if word.startswith("--") or not options:
            options.append(word)
        else:
            options[-1] += f" {word}"
    lines: list[str] = []
    line = "kvtriton simulate"
    for option in options:
        if len(line) + len(option) + 1 > 100:
            lines.append(line + " \\")
            line = " "
        line += f" {option}"
    points = _points(record)
    blocks = {int(cast(int, point["num_blocks"])) for point in points}
    rates = ", ".join(f"{_pct(_rate(record, point))} ({str(point['policy']).upper()})" for point in points)
    lines.append(f"{line}      # {', '.join(map(str, sorted(blocks)))} blocks: {rates}")
    return "```bash\n" + "\n".join(lines) + "\n```"


def run_date(results: Results) -> str:
    """When and where the simulate runs were made (the oldest of their records)."""
    records = [results(run.name) for run in RUNS]
    date = min(str(record["date"]) for record in records)
    return f"{date[:10]} {date[11:16]} UTC, {records[0]['platform']}"


SIMULATE_RENDERERS: dict[str, Callable[[Results], str]] = {
    **{
        "simulate-" + renderer.__name__.replace("_", "-"): renderer
        for renderer in (
            chat_seconds,
            fp8_shift,
            prefix_sharing_command,
            few_shot_output,
            vllm_output,
            vllm_gpu_share,
            few_shot_knee,
            few_shot_arc_ahead,
            chat_lru_ahead,
            vllm_ceiling,
        )
    },
    "run-simulate": run_date,
}
"""The generated regions of docs/simulate.md, by name, and what renders each (render_docs' signature): ``simulate-``
and the renderer's name with dashes, so the two cannot drift apart."""


# -- the runs ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("render_simulate", __doc__)
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="folder for the JSON records (default: bench/results)"
    )
    parser.add_argument("--images", type=Path, default=IMAGES, help="folder for the plots (default: docs/img)")
    parser.add_argument(
        "--only",
        choices=[run.name for run in RUNS],
        action="append",
        help="make only this run (repeatable; default: every run)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvtriton.cli import main as kvtriton

    args = build_parser().parse_args(argv)
    results_dir, images_dir = cast(Path, args.results).resolve(), cast(Path, args.images).resolve()
    chosen = [run for run in RUNS if not args.only or run.name in args.only]
    here = Path.cwd()
    for run in chosen:
        argv_run = _argv(run, Results(RESULTS))
        # In a scratch folder, with the default --out, so the record's command line names no scratch path.
        with tempfile.TemporaryDirectory() as scratch:
            os.chdir(scratch)
            try:
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    status = kvtriton(argv_run)
            finally:
                os.chdir(here)
            if status != 0:
                print(f"render_simulate: error: `kvtriton {' '.join(argv_run)}` exited {status}", file=sys.stderr)
                return status
            out = Path(scratch) / "simulate-results"
            (record,) = out.glob("simulate-*.json")
            results_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(record, results_dir / f"{run.name}.json")
            written = [results_dir / f"{run.name}.json"]
            if run.plot:
                images_dir.mkdir(parents=True, exist_ok=True)
                shutil.move(record.with_suffix(".png"), images_dir / f"{run.name}.png")
                written.append(images_dir / f"{run.name}.png")
        print(f"kvtriton {' '.join(argv_run)}: wrote {' and '.join(map(str, written))}")
    print("now run `python -m bench.render_docs` and commit the results, the plots and the docs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
