from __future__ import annotations

import json

import pytest

from kvtriton.tools.cli import main


@pytest.mark.requires_interpreter
def test_info_reports_versions_and_machine_facts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {
        "python", "torch", "triton", "cuda_available", "device_name",
        "pinned_memory", "memlock_limit", "triton_interpret", "memlock_verdict", "engine_warmup",
    }
    assert report["torch"].startswith("2.")
    assert report["triton_interpret"] is True  # conftest sets it for the kernel tests


def test_info_prints_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "memlock limit" in out and "pinned memory" in out


def test_unknown_command_exits_with_usage() -> None:
    with pytest.raises(SystemExit) as raised:
        main(["no-such-command"])
    assert raised.value.code == 2


def test_warnings_print_as_one_line_naming_kvtriton() -> None:
    import warnings

    from kvtriton.tools.cli import _format_warning  # pyright: ignore[reportPrivateUsage] -- the formatter is the unit under test

    line = _format_warning(UserWarning("slab stays pageable"), UserWarning, "demo.py", 12, "source line")
    assert line == "kvtriton: UserWarning: slab stays pageable\n"
    before = warnings.formatwarning
    assert main(["info", "--json"]) == 0
    assert warnings.formatwarning is before  # restored after the command


def test_output_piped_into_head_ends_quietly_with_the_sigpipe_status() -> None:
    import subprocess
    import sys

    script = "import sys\nfrom kvtriton.tools.cli import main\nsys.exit(main(['info']))\n"
    # Close the read end at once: every write to stdout fails with EPIPE.
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait() == 141
    assert "Traceback" not in stderr
