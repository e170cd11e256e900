from __future__ import annotations

import json
import re

import pytest

from kvtriton.cli._main import main
from tests.cli.conftest import usage_error


@pytest.mark.requires_interpreter
def test_info_reports_versions_and_machine_facts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "kvtriton",
        "python",
        "torch",
        "triton",
        "vllm",
        "mooncake",
        "cuda_available",
        "device_name",
        "pinned_memory",
        "memlock_limit",
        "triton_interpret",
        "memlock_verdict",
        "memory_verdict",
        "shm_verdict",
        "engine_warmup",
    }
    assert report["torch"].startswith("2.")
    assert report["triton_interpret"] is True  # conftest sets it for the kernel tests


def test_info_prints_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "memlock limit" in out and "pinned memory" in out


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'no-such-command'" in usage_error(["no-such-command"], capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "kvtriton: error: a command is required, one of info, demo, simulate, bench"),
        (["--bogus"], "kvtriton: error: unknown option --bogus: give a command first, one of info, demo, simulate"),
        (["simulate", "--capacity", "4"], "error: unrecognized arguments: --capacity 4 (did you mean --capacities?)"),
        (["demo", "--polcy=arc"], "kvtriton demo: error: unrecognized arguments: --polcy=arc (did you mean --policy?)"),
        (["simulate", "--zzzzzz"], "kvtriton simulate: error: unrecognized arguments: --zzzzzz\n"),
    ],
)
def test_an_unknown_option_or_a_missing_command_is_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in usage_error(argv, capsys)


def test_a_choice_argument_takes_any_case_and_names_the_valid_values() -> None:
    import argparse

    from kvtriton.cli._main import choice_argument

    convert = choice_argument(["lru", "arc"])
    assert (convert("ARC"), convert(" Lru ")) == ("arc", "lru")
    with pytest.raises(argparse.ArgumentTypeError, match="^expected one of lru, arc, got 'FIFO'$"):
        convert("FIFO")


def test_warnings_print_as_one_line_naming_kvtriton() -> None:
    import warnings

    from kvtriton.cli._main import _format_warning  # pyright: ignore[reportPrivateUsage] -- the formatter is the unit under test

    line = _format_warning(UserWarning("slab stays pageable"), UserWarning, "demo.py", 12, "source line")
    assert line == "kvtriton: UserWarning: slab stays pageable\n"
    before = warnings.formatwarning
    assert main(["info", "--json"]) == 0
    assert warnings.formatwarning is before  # restored after the command


def test_output_piped_into_head_ends_quietly_with_the_sigpipe_status() -> None:
    import subprocess
    import sys

    script = "import sys\nfrom kvtriton.cli._main import main\nsys.exit(main(['info']))\n"
    # Close the read end at once: every write to stdout fails with EPIPE.
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait() == 141
    assert "Traceback" not in stderr


def test_version_prints_the_release_the_package_and_its_metadata_carry(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    import kvtriton

    # kvtriton/_version.py is the one place the release is written; pyproject.toml reads it for the wheel
    # (tests/project/test_packaging.py checks the built wheel's metadata).
    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out == f"kvtriton {kvtriton.__version__}\n"
    assert importlib.metadata.version("kvtriton") == kvtriton.__version__


def test_top_level_help_states_the_unit_rule_for_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "a bare number is GiB" in out and "--version" in out


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--help"])
    assert raised.value.code == 0
    return capsys.readouterr().out


def _option_helps(help_text: str) -> dict[str, str]:
    """Each option's ``--flag METAVAR`` line and help, joined into one line, by flag."""
    options: dict[str, str] = {}
    flag = ""
    for line in help_text.splitlines():
        started = re.match(r"^  (?:-\w, )?(--[\w-]+)", line)
        if started:
            flag = started.group(1)
            options[flag] = line.strip()
        elif flag and line.startswith("   "):
            options[flag] += " " + line.strip()
        else:
            flag = ""
    return options


def test_every_size_flag_of_every_command_says_a_bare_number_is_gib(capsys: pytest.CaptureFixture[str]) -> None:
    """A size flag is one named after a capacity or shown with a SIZE metavar; each states the unit rule."""
    commands = re.findall(r"^    (\w+) ", _help([], capsys), re.MULTILINE)
    assert {"info", "demo", "simulate", "bench"} <= set(commands)
    size_flags: dict[str, str] = {}
    for command in commands:
        for flag, text in _option_helps(_help([command], capsys)).items():
            if "capacit" in flag or re.match(rf"{flag} SIZES?\b", text):
                size_flags[f"{command} {flag}"] = text
    assert {"demo --capacity", "simulate --capacities"} <= set(size_flags)
    for where, text in size_flags.items():
        assert re.search(r"bare numbers? (is|are) GiB", text), f"kvtriton {where}: {text}"


def test_top_level_help_names_every_benchmark_that_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtriton.cli._bench import BENCHMARKS

    text = " ".join(_help([], capsys).split())
    for name in BENCHMARKS:
        assert name in text
    assert "the manager and kernel benchmarks" not in text
