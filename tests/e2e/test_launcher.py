"""The launcher's clean-up: a process group is always ended, and what had to be killed is reported."""

from __future__ import annotations

import subprocess
import time

from e2e.engine import end_process_group, group_members


def spawn(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", script], start_new_session=True)


def test_a_group_that_exits_on_sigterm_ends_quietly() -> None:
    process = spawn("sleep 30 & sleep 30")
    assert end_process_group(process, grace_s=5.0) == []
    assert group_members(process.pid) == []


def test_a_process_ignoring_sigterm_is_killed_and_reported() -> None:
    process = spawn("trap '' TERM; sleep 30 & wait")
    time.sleep(0.2)  # let the shell install its trap
    killed = end_process_group(process, grace_s=0.5)
    assert killed and "ignored SIGTERM" in killed[0]
    assert group_members(process.pid) == []


def test_a_child_outliving_its_parent_is_killed_and_reported() -> None:
    process = spawn("trap '' TERM; sleep 30 & exit 0")
    process.wait()
    killed = end_process_group(process, grace_s=0.5)
    (report,) = killed
    assert report.startswith(f"processes of group {process.pid} outlived the engine: ") and "sleep" in report
    assert group_members(process.pid) == []
