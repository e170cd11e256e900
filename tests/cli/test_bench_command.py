from __future__ import annotations

import importlib.util
import json
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from kvtriton.cli._bench import ALL_QUICK_DURATION, BENCHMARKS, SMOKE_RUN_NOTE, exit_description, find_checkout
from kvtriton.cli._main import main
from kvtriton.integrations._vllm_release import VLLM_INSTALL

# A stand-in benchmark: records its argv and where it was told to write, like bench/common.py does.
FAKE_BENCHMARK = """
import json, os, sys
from pathlib import Path
out = Path(os.environ.get("KVTRITON_BENCH_OUT") or Path(__file__).resolve().parent / "results")
out.mkdir(parents=True, exist_ok=True)
(out / "{name}.json").write_text(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}))
print("{name} table row")
sys.exit({code})
"""


def fake_checkout(root: Path, codes: dict[str, int] | None = None) -> Path:
    """A source checkout holding a bench/ package with the given benchmarks and their exit codes."""
    bench = root / "bench"
    bench.mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "common.py").write_text("")
    for name, code in (codes if codes is not None else dict.fromkeys(BENCHMARKS, 0)).items():
        (bench / f"{name}.py").write_text(FAKE_BENCHMARK.format(name=name, code=code))
    return root


def recorded(folder: Path, name: str) -> dict[str, object]:
    return json.loads((folder / f"{name}.json").read_text())


def test_bench_runs_one_benchmark_quick_with_extra_args_and_lists_its_results(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    out = tmp_path / "out"
    argv = ["bench", "manager", "--checkout", str(checkout), "--out", str(out), "--", "--requests", "10"]
    assert main(argv) == 0
    assert recorded(out, "manager")["argv"] == [*BENCHMARKS["manager"].quick_flags, "--requests", "10"]
    assert recorded(out, "manager")["cwd"] == str(checkout.resolve())
    assert not (out / "kernels.json").exists()
    stdout = capfd.readouterr().out
    assert "manager table row" in stdout  # the benchmark's own output is streamed through
    assert f"results:\n  {out / 'manager.json'}" in stdout


def test_bench_all_runs_every_benchmark_in_order_into_bench_results(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTRITON_BENCH_OUT", raising=False)
    checkout = fake_checkout(tmp_path)
    assert main(["bench", "all", "--checkout", str(checkout)]) == 0
    stdout = capfd.readouterr().out
    assert stdout.index("manager table row") < stdout.index("kernels table row")
    for name in BENCHMARKS:
        assert (checkout / "bench" / "results" / f"{name}.json").is_file()


def test_bench_full_drops_the_quick_flags(tmp_path: Path) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    out = tmp_path / "out"
    assert main(["bench", "kernels", "--full", "--checkout", str(checkout), "--out", str(out)]) == 0
    assert recorded(out, "kernels")["argv"] == []


def test_failing_benchmark_is_named_and_its_exit_code_returned(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    checkout = fake_checkout(tmp_path / "repo", {**dict.fromkeys(BENCHMARKS, 0), "manager": 3})
    assert main(["bench", "all", "--checkout", str(checkout), "--out", str(tmp_path / "out")]) == 3
    captured = capfd.readouterr()
    assert "kernels table row" in captured.out  # later benchmarks still run
    assert "failed: manager (exit 3)" in captured.err


def test_a_benchmark_killed_by_a_signal_is_said_in_words_with_what_to_do(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # An AVX-512 build of torch on an AVX2 machine dies of SIGILL: Python reported it as exit -4.
    checkout = fake_checkout(tmp_path / "repo", {"kernels": 0})
    (checkout / "bench" / "kernels.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    assert main(["bench", "kernels", "--checkout", str(checkout), "--out", str(tmp_path / "out")]) == 128 + 4
    captured = capfd.readouterr()
    assert "exit -4" not in captured.out + captured.err
    assert "== kernels: killed by SIGILL (illegal instruction: a compiled library" in captured.out
    assert "e.g. an AVX-512 build on an AVX2 machine; install builds made for this CPU" in captured.out
    assert "failed: kernels (killed by SIGILL (illegal instruction:" in captured.err


@pytest.mark.parametrize(
    ("returncode", "said"),
    [
        (0, "exit 0"),
        (3, "exit 3"),
        (-9, "killed by SIGKILL (killed from outside, most often by the kernel's out-of-memory killer"),
        (-11, "killed by SIGSEGV (a crash in native code"),
        (-15, "killed by SIGTERM"),
        (-200, "killed by signal 200"),
    ],
)
def test_every_return_code_is_said_in_words(returncode: int, said: str) -> None:
    assert exit_description(returncode).startswith(said)


def test_bench_without_a_source_checkout_says_so_and_exits_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all", "--checkout", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert "bench/ is not importable" in err and "source checkout" in err and str(tmp_path) in err


def test_bench_names_a_missing_benchmark_module(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    checkout = fake_checkout(tmp_path, {"manager": 0})
    assert main(["bench", "kernels", "--checkout", str(checkout)]) == 2
    assert "bench/kernels.py not found" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [],
            "which benchmark? name one of manager, kernels, host_cost, tiers, tiers_mooncake, compression, fleet_scale, serving, all",
        ),
        (
            ["disk"],
            "invalid benchmark 'disk' (choose from manager, kernels, host_cost, tiers, tiers_mooncake, compression, fleet_scale, serving, all)",
        ),
        (
            ["manager", "--requests", "5"],
            "unrecognized arguments: --requests 5 (arguments for the benchmark go after `--`)",
        ),
        (["manager", "kernels"], "unrecognized arguments: kernels"),
    ],
)
def test_bad_invocation_exits_2_naming_the_problem(
    argv: list[str], message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capfd.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--full", "--out", "{out}", "manager", "--", "--full"],
        ["manager", "--full", "--out", "{out}", "--", "--full"],
        ["manager", "--out", "{out}", "--full", "--", "--full"],
    ],
)
def test_options_may_come_before_or_after_the_name_and_args_after_double_dash_pass_through(
    argv: list[str], tmp_path: Path
) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    out = tmp_path / "out"
    filled = [str(out) if arg == "{out}" else arg for arg in argv]
    assert main(["bench", "--checkout", str(checkout), *filled]) == 0
    assert recorded(out, "manager")["argv"] == ["--full"]  # --full of ours dropped the quick flags; theirs passed


def test_this_checkout_is_found_from_the_installed_package() -> None:
    checkout = find_checkout()
    assert checkout is not None
    assert (checkout / "bench" / "common.py").is_file()


def test_help_lists_the_benchmarks_and_their_quick_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for name, benchmark in BENCHMARKS.items():
        assert f"{name}: " in text and " ".join(benchmark.quick_flags) in text
    assert (
        "--full" in text
        and "--out" in text
        and "{manager,kernels,host_cost,tiers,tiers_mooncake,compression,fleet_scale,serving,all} [-- ARGS]" in text
    )


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("manager", ["--requests", "100", "--no-vllm"]),
        ("kernels", []),
        ("host_cost", ["--no-baseline"]),
        ("compression", []),
        ("fleet_scale", ["--requests", "60,30", "--engines", "3"]),
    ],
)
def test_real_benchmark_accepts_its_quick_flags_and_records_the_machine(
    name: str, extra: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    checkout = find_checkout()
    if checkout is None or not (checkout / "bench" / f"{name}.py").is_file():
        pytest.skip(f"bench/{name}.py is not in this checkout")
    assert main(["bench", name, "--out", str(tmp_path), "--", *extra]) == 0
    record = json.loads((tmp_path / f"{name}-quick.json").read_text())
    assert record["machine"]["device_name"] in ("cpu", "cpu-interpreter") or record["machine"]["cuda_available"]
    assert f"{tmp_path / name}-quick.json" in capfd.readouterr().out


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_prints_its_help(name: str) -> None:
    """`python -m bench.NAME --help` renders (argparse reads '%' in help text as a format character)."""
    import subprocess
    import sys

    checkout = find_checkout()
    if checkout is None or not (checkout / "bench" / f"{name}.py").is_file():
        pytest.skip(f"bench/{name}.py is not in this checkout")
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"], cwd=checkout, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_quick_runs_are_announced_as_smoke_runs_with_how_long_all_takes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    assert main(["bench", "all", "--checkout", str(checkout), "--out", str(tmp_path / "out")]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"kvtriton bench: {SMOKE_RUN_NOTE}; all {len(BENCHMARKS)} take {ALL_QUICK_DURATION}")
    assert "no goal verdicts" in SMOKE_RUN_NOTE
    assert "== kvtriton bench manager (smoke run): python -m bench.manager --quick" in out
    assert f"== {len(BENCHMARKS)} benchmarks in " in out
    assert main(["bench", "kernels", "--full", "--checkout", str(checkout), "--out", str(tmp_path / "out")]) == 0
    full = capfd.readouterr().out
    assert "smoke" not in full and "== kvtriton bench kernels (full run): python -m bench.kernels  (in" in full


def test_every_quick_run_writes_a_quick_named_file(tmp_path: Path) -> None:
    for benchmark in BENCHMARKS.values():
        flags = list(benchmark.quick_flags)
        assert "--quick" in flags and flags[flags.index("--name") + 1] == f"{benchmark.name}-quick"


def test_an_out_that_is_a_file_is_refused_in_words(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    taken = tmp_path / "results.txt"
    taken.write_text("not a folder")
    assert main(["bench", "manager", "--checkout", str(checkout), "--out", str(taken)]) == 2
    err = capfd.readouterr().err
    assert f"kvtriton bench: error: --out {taken}: is a file, not a folder" in err
    assert "File exists" not in err and taken.read_text() == "not a folder"


@pytest.fixture
def without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """This interpreter as `make demo` builds it: no vLLM (and so no benchmark that imports it can run)."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "vllm" or name.startswith("vllm.") else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


NEEDS_VLLM = [name for name, benchmark in BENCHMARKS.items() if benchmark.needs_vllm]


def test_bench_all_without_vllm_skips_the_benchmarks_that_need_it_with_one_line_each_and_exits_0(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], without_vllm: None
) -> None:
    assert NEEDS_VLLM == ["tiers", "tiers_mooncake", "serving"]
    checkout = fake_checkout(tmp_path / "repo")
    out = tmp_path / "out"
    assert main(["bench", "all", "--checkout", str(checkout), "--out", str(out)]) == 0
    captured = capfd.readouterr()
    for name in BENCHMARKS:
        skipped = [line for line in captured.out.splitlines() if line.startswith(f"== {name}: skipped: ")]
        if name in NEEDS_VLLM:
            assert skipped == [f"== {name}: skipped: vLLM is not installed: {VLLM_INSTALL}; make test installs it"]
            assert not (out / f"{name}.json").exists()
        else:
            assert skipped == [] and (out / f"{name}.json").is_file()
    assert f"== {len(BENCHMARKS) - 3} benchmarks in " in captured.out
    assert "(3 skipped: tiers, tiers_mooncake, serving)" in captured.out
    assert captured.err == ""


def test_a_benchmark_named_alone_that_needs_a_missing_vllm_is_an_error_saying_how_to_install_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], without_vllm: None
) -> None:
    checkout = fake_checkout(tmp_path / "repo")
    assert main(["bench", "tiers", "--checkout", str(checkout), "--out", str(tmp_path / "out")]) == 2
    assert f"tiers cannot run here: vLLM is not installed: {VLLM_INSTALL}" in capfd.readouterr().err
