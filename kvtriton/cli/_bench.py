"""`kvtriton bench`: the front door to the benchmarks in bench/ (source checkouts only).

Runs ``python -m bench.<name>`` for each chosen benchmark in the checkout,
streaming its output. Each benchmark prints a table and writes JSON (with the
machine it ran on) and PNG plots under ``bench/results/``, or under ``--out``.
By default each benchmark runs as a smoke run (its ``--quick`` mode): small
sizes, one repeat, no goal verdicts, results written as ``<name>-quick.*`` so
that they never overwrite the full-size results; it shows that every benchmark
runs here (``all`` takes about three minutes on a 2-core CPU machine), not how
fast anything is. ``--full`` runs them at their full size under their own
names: the figures and verdicts in docs/benchmarks.md come from such runs.
``all`` skips a benchmark that needs a package this environment lacks (vLLM,
Mooncake: ``make demo`` installs neither), with one line saying which and how
to install it; a benchmark named alone that cannot run is an error.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtriton.cli._main import command_error

RESULTS_ENV = "KVTRITON_BENCH_OUT"  # read by bench/common.py's results_dir()

SMOKE_RUN_NOTE = (
    "smoke runs (--quick): small sizes and one repeat show that each benchmark runs here; their figures are"
    " not measurements and carry no goal verdicts (--full runs produce those; see docs/benchmarks.md)"
)
"""Printed before quick runs, so that no figure of a smoke run is read as a result."""

ALL_QUICK_DURATION = "about 5 minutes on a 2-core CPU machine"
"""What ``kvtriton bench all`` takes in smoke runs (measured: 160-200 s on the 2-core development box, plus about
2.5 minutes for ``serving``'s quick round of servers)."""


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One benchmark module in bench/."""

    name: str
    summary: str
    needs_vllm: bool = False
    """It imports vLLM (which ``make demo``'s environment lacks): skipped, with one line saying so, where it is absent."""
    needs_mooncake: bool = False
    """It imports the mooncake package too."""

    def missing(self) -> str | None:
        """Why this benchmark cannot run with this interpreter (a package it needs is not installed), or None."""
        from kvtriton.integrations import mooncake_missing, vllm_missing

        problems = [
            problem
            for needed, problem_of in ((self.needs_vllm, vllm_missing), (self.needs_mooncake, mooncake_missing))
            if needed and (problem := problem_of()) is not None
        ]
        return "; ".join(problems) or None

    @property
    def module(self) -> str:
        return f"bench.{self.name}"

    @property
    def quick_flags(self) -> tuple[str, ...]:
        """The flags of a smoke run: every benchmark's ``--quick``, writing ``<name>-quick.*``."""
        return ("--quick", "--name", f"{self.name}-quick")


BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark(
            "manager",
            "kvtriton's manager through its vLLM adapter against vLLM's own, in vLLM's call order on four workloads"
            " (blocks/s, hit rates), then kvtriton's direct calls",
        ),
        Benchmark("kernels", "gather/scatter GB/s against the torch, copy-loop and contiguous-copy baselines"),
        Benchmark(
            "host_cost",
            "the transfer engine's host microseconds per submit_store + submit_load, copies stubbed out, against the"
            " pre-redesign engine",
        ),
        Benchmark(
            "tiers",
            "cascade/promotion GB/s through kvtriton's primary tier vs vLLM's CPU primary behind one fs root",
            needs_vllm=True,
        ),
        Benchmark(
            "tiers_mooncake",
            "Mooncake Store tier cascade/promotion GB/s next to the raw batch calls and the fs tier",
            needs_vllm=True,
            needs_mooncake=True,
        ),
        Benchmark(
            "compression",
            "fp8-e4m3 compression's accuracy (K/V element and attention error, group against per-tensor scales)"
            " and the bytes a block moves and holds",
        ),
        Benchmark(
            "fleet_scale",
            "`kvtriton simulate`'s fleet model: seconds and requests/s to replay 100 engines sharing one Mooncake"
            " pool at 10k, 100k and 1M requests, and how the time per request grows",
        ),
        Benchmark(
            "serving",
            "`vllm serve` on SmolLM2-135M driven by `vllm bench serve` (prefix-heavy, multi-turn and no-reuse), arms in"
            " alternating rounds: TTFT, throughput and hit tokens by source without a connector, with kvtriton, with"
            " kvtriton fp8, at the ceiling (kvtriton's host bytes given to the engine's own cache) and with vLLM's CPU"
            " offload where the platform runs it",
            needs_vllm=True,
        ),
    )
}
"""The benchmarks ``all`` runs, in order. Quick runs write ``<name>-quick.*`` so that they never
overwrite the full-size results committed under bench/results/."""


def find_checkout(explicit: Path | None = None) -> Path | None:
    """The source checkout whose bench/ to run, or ``None`` when there is none.

    ``explicit`` wins; otherwise the checkout this kvtriton is imported from
    (an editable install), then the current directory.
    """
    candidates = [explicit] if explicit is not None else [Path(__file__).resolve().parents[2], Path.cwd()]
    for candidate in candidates:
        if (candidate / "bench" / "__init__.py").is_file() and (candidate / "bench" / "common.py").is_file():
            return candidate.resolve()
    return None


def benchmark_command(benchmark: Benchmark, *, full: bool, extra: Sequence[str]) -> list[str]:
    """The command line that runs ``benchmark`` with this interpreter."""
    flags = () if full else benchmark.quick_flags
    return [sys.executable, "-m", benchmark.module, *flags, *extra]


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--full",
        action="store_true",
        help="run at full size, without the quick flags, writing <name>.* (minutes on a GPU, much longer on"
        " CPU); the default is a smoke run writing <name>-quick.*",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"write results here instead of bench/results/ (sets ${RESULTS_ENV}; default: bench/results/)",
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        metavar="DIR",
        help="source checkout holding bench/ (default: the checkout kvtriton is installed from, else the"
        " current directory)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (__doc__ or "").split("\n\n")[0].removeprefix("`kvtriton bench`: ")
    parser.epilog = (
        textwrap.fill(f"{SMOKE_RUN_NOTE}; `all` takes {ALL_QUICK_DURATION}.", 79)
        + ("\n\nbenchmarks (all runs them in this order):\n")
        + "\n".join(
            f"  {benchmark.name}: {benchmark.summary} (quick flags: {' '.join(benchmark.quick_flags)}"
            f"{'; needs vLLM' if benchmark.needs_vllm else ''}{' and Mooncake' if benchmark.needs_mooncake else ''})"
            for benchmark in BENCHMARKS.values()
        )
        + (
            "\n\nexamples:\n  kvtriton bench all\n  kvtriton bench kernels --out /tmp/results"
            "\n  kvtriton bench manager -- --help      # the benchmark's own options"
        )
    )
    _add_options(parser)
    # One REMAINDER positional rather than a name plus nargs="*": argparse
    # drops a nargs="*" positional's `-- ARGS` when options sit between the
    # name and `--`, and a REMAINDER after the name loses a leading `--`. The
    # name, any options after it, and the `--` split are parsed in run().
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="{" + ",".join([*BENCHMARKS, "all"]) + "} [-- ARGS]",
        help="which benchmark to run (required); ARGS after `--` go unchanged to every chosen benchmark module",
    )


@dataclass(frozen=True, slots=True)
class _Invocation:
    benchmarks: list[Benchmark]
    extra: list[str]
    full: bool
    out: Path | None
    checkout: Path | None


def _invocation(args: argparse.Namespace) -> _Invocation:
    """Split ``NAME [OPTIONS] [-- ARGS]`` and parse the options given after the name."""
    command: list[str] = list(args.command)
    choices = [*BENCHMARKS, "all"]
    if not command:
        raise ValueError(f"which benchmark? name one of {', '.join(choices)}")
    name, rest = command[0], command[1:]
    if name not in choices:
        raise ValueError(f"invalid benchmark {name!r} (choose from {', '.join(choices)})")
    cut = rest.index("--") if "--" in rest else len(rest)
    options = argparse.ArgumentParser(prog="kvtriton bench", add_help=False)
    _add_options(options)
    # Parsing into ``args`` keeps what was given before the name: defaults
    # never overwrite attributes the namespace already has.
    parsed, unknown = options.parse_known_args(rest[:cut], namespace=args)
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (arguments for the benchmark go after `--`)")
    chosen = list(BENCHMARKS.values()) if name == "all" else [BENCHMARKS[name]]
    return _Invocation(chosen, rest[cut + 1 :], bool(parsed.full), parsed.out, parsed.checkout)


def _results_dir(checkout: Path, out: Path | None) -> Path:
    if out is not None:
        return out.resolve()
    chosen = os.environ.get(RESULTS_ENV)
    return Path(chosen).resolve() if chosen else checkout / "bench" / "results"


def _out_problem(out: Path) -> str | None:
    """Why ``--out`` cannot be the results folder (creating it when missing), or None."""
    if out.exists() and not out.is_dir():
        return "is a file, not a folder (name a folder, created when missing)"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create the folder: {error.strerror or error}"
    if not os.access(out, os.W_OK):
        return "the folder is not writable"
    return None


_SIGNAL_ADVICE: dict[signal.Signals, str] = {
    signal.SIGILL: "illegal instruction: a compiled library (torch, vLLM, triton) uses an instruction this CPU lacks,"
    " e.g. an AVX-512 build on an AVX2 machine; install builds made for this CPU (lscpu lists its flags), and run"
    " the benchmark alone to see which import dies",
    signal.SIGKILL: "killed from outside, most often by the kernel's out-of-memory killer (dmesg says); free memory"
    " or run the benchmark alone",
    signal.SIGSEGV: "a crash in native code; run the benchmark alone with PYTHONFAULTHANDLER=1 to see where",
    signal.SIGBUS: "a bus error, often a full /dev/shm or a file shrunk under a mapping (df -h /dev/shm)",
    signal.SIGABRT: "aborted by native code; its own message is printed above",
}
"""What a benchmark killed by each signal most likely met, and what to do."""


def exit_description(returncode: int) -> str:
    """A child's return code in words: ``exit N``, or the signal that killed it (a negative code) and what to do."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        killer = signal.Signals(-returncode)
    except ValueError:
        return f"killed by signal {-returncode}"
    advice = _SIGNAL_ADVICE.get(killer)
    return f"killed by {killer.name}" + (f" ({advice})" if advice else "")


def exit_status(returncode: int) -> int:
    """The command's own exit status for a child's return code: a signal N as a shell reports it, 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _written_since(folder: Path, started: float) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(
        path for path in folder.iterdir() if path.suffix in (".json", ".png") and path.stat().st_mtime >= started
    )


def run(args: argparse.Namespace) -> int:
    try:
        invocation = _invocation(args)
    except ValueError as error:
        return command_error("bench", error)
    checkout = find_checkout(invocation.checkout)
    if checkout is None:
        looked = (
            str(invocation.checkout)
            if invocation.checkout is not None
            else f"{Path(__file__).resolve().parent.parent} and {Path.cwd()}"
        )
        return command_error(
            "bench",
            "bench/ is not importable: the benchmarks ship only in a source checkout, not in the installed package"
            f" (looked in {looked}). Run `kvtriton bench` inside a clone of the repository, or pass --checkout DIR.",
        )
    missing = [b for b in invocation.benchmarks if not (checkout / "bench" / f"{b.name}.py").is_file()]
    if missing:
        names = ", ".join(f"bench/{b.name}.py" for b in missing)
        return command_error("bench", f"{names} not found in the checkout {checkout}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [env.get("PYTHONPATH")])])
    if invocation.out is not None:
        problem = _out_problem(invocation.out)
        if problem is not None:
            return command_error("bench", f"--out {invocation.out}: {problem}")
        env[RESULTS_ENV] = str(invocation.out.resolve())
    results = _results_dir(checkout, invocation.out)
    failures: list[tuple[str, int]] = []
    started = time.time() - 1  # file times may be rounded down to the second
    began_all = time.perf_counter()
    kind = "full run" if invocation.full else "smoke run"
    if not invocation.full:
        duration = (
            f"; all {len(invocation.benchmarks)} take {ALL_QUICK_DURATION}" if len(invocation.benchmarks) > 1 else ""
        )
        print(f"kvtriton bench: {SMOKE_RUN_NOTE}{duration}", flush=True)
    skipped: list[str] = []
    for benchmark in invocation.benchmarks:
        missing = benchmark.missing()
        if missing is not None:
            # `all` runs what this environment can (`make demo` installs no vLLM); a benchmark named alone fails.
            if len(invocation.benchmarks) == 1:
                return command_error("bench", f"{benchmark.name} cannot run here: {missing}")
            print(f"== {benchmark.name}: skipped: {missing}", flush=True)
            skipped.append(benchmark.name)
            continue
        command = benchmark_command(benchmark, full=invocation.full, extra=invocation.extra)
        shown = " ".join(["python", *command[1:]])
        print(f"== kvtriton bench {benchmark.name} ({kind}): {shown}  (in {checkout})", flush=True)
        began = time.perf_counter()
        returncode = subprocess.run(command, cwd=checkout, env=env, check=False).returncode
        took = time.perf_counter() - began
        print(f"== {benchmark.name}: {exit_description(returncode)} after {took:.1f} s", flush=True)
        if returncode != 0:
            failures.append((benchmark.name, returncode))
    if len(invocation.benchmarks) > 1:
        ran = len(invocation.benchmarks) - len(skipped)
        skipped_note = f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""
        print(f"== {ran} benchmarks in {time.perf_counter() - began_all:.0f} s{skipped_note}", flush=True)
    written = _written_since(results, started)
    if written:
        print("results:")
        for path in written:
            print(f"  {path}")
    if failures:
        listed = ", ".join(f"{name} ({exit_description(code)})" for name, code in failures)
        print(f"kvtriton bench: error: failed: {listed}", file=sys.stderr)
        return exit_status(failures[0][1])
    return 0
