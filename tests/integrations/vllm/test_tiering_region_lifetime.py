"""The shared region's file: no region outlives its processes, whatever their engine id (docs/operations.md).

Each test works in a directory of its own under /dev/shm (the ``directory``
the region takes), so that the stale files it leaves on purpose are judged
by its own sweeps only, never by a test running beside it. Crashed engines
are real child processes that exit without closing (``os._exit``) or are
SIGKILLed; a live one waits on its stdin.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtriton.worker._shared_region as shared_region
from kvtriton.worker._region_file import REGION_MODE, remove_stale_regions
from kvtriton.worker._shared_region import HEADER_BYTES, RegionLayout, SharedRegion

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = RegionLayout(2, 1, 1, 4096)
CHILD_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    made = Path(tempfile.mkdtemp(prefix="kvtriton-test-", dir="/dev/shm"))
    yield made
    left = sorted(path.name for path in made.iterdir())
    shutil.rmtree(made)
    assert not left, f"left behind in {made}: {left}"


def region_file(directory: Path, name: str) -> Path:
    return directory / f"kvtriton_{name}.region"


def child_code(directory: Path, name: str, expected_mappers: int, *, then: str) -> str:
    """A process that creates region ``name`` (its rank 0 populated: the RAM a crash leaks), then runs ``then``."""
    return (
        "import os, sys\n"
        "from kvtriton.worker._shared_region import RegionLayout, SharedRegion\n"
        f"region = SharedRegion({name!r}, RegionLayout(2, 1, 1, 4096), {expected_mappers}, directory={str(directory)!r})\n"
        "region.rank_slab(0, pin=False)\n"
        f"{then}\n"
    )


def crashed_creator(directory: Path, name: str, expected_mappers: int) -> int:
    """Run a child that creates region ``name`` and dies before the other mappers came; its pid."""
    child = subprocess.run(
        [sys.executable, "-c", child_code(directory, name, expected_mappers, then="print(os.getpid()); os._exit(0)")],
        check=True,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(child.stdout)


def live_creator(directory: Path, name: str, expected_mappers: int) -> subprocess.Popen[str]:
    """A child that creates region ``name`` and runs until its stdin closes (or it is killed)."""
    then = "print('ready', flush=True); sys.stdin.read(); os._exit(0)"
    child = subprocess.Popen(
        [sys.executable, "-c", child_code(directory, name, expected_mappers, then=then)],
        env=CHILD_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def end(child: subprocess.Popen[str], *, kill: bool) -> None:
    if kill:
        child.send_signal(signal.SIGKILL)
    else:
        assert child.stdin is not None
        child.stdin.close()
    child.wait(timeout=60)


def sweep_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage() for record in caplog.records if "stale kvtriton shared host region" in record.getMessage()
    ]


def test_a_region_a_crashed_start_up_left_is_removed_by_the_next_start_whatever_its_engine_id(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid = crashed_creator(shm_dir, "engine-a", 2)  # the scheduler never came: the name stays
    leaked = region_file(shm_dir, "engine-a")
    assert leaked.stat().st_blocks * 512 >= LAYOUT.num_block_rows * LAYOUT.rank_row_bytes  # rank 0 populated: RAM
    caplog.set_level(logging.WARNING, logger="kvtriton.worker._region_file")
    with SharedRegion("engine-b", LAYOUT, 2, directory=str(shm_dir)) as other:  # another engine id
        assert not leaked.exists()
        (line,) = sweep_lines(caplog)  # one line
        assert "kvtriton_engine-a.region" in line and f"creator pid(s) {pid} gone" in line and "freeing" in line
        assert other.mapped_count == 1


def test_a_region_a_live_process_holds_is_kept_until_it_is_gone(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtriton.worker._region_file")
    starting = live_creator(shm_dir, "engine-a", 2)  # another engine, still in its start-up window
    try:
        SharedRegion("engine-b", LAYOUT, 2, directory=str(shm_dir)).close()
        assert region_file(shm_dir, "engine-a").exists() and sweep_lines(caplog) == []
    finally:
        end(starting, kill=True)
    SharedRegion("engine-c", LAYOUT, 2, directory=str(shm_dir)).close()
    assert not region_file(shm_dir, "engine-a").exists()
    assert f"creator pid(s) {starting.pid} gone" in sweep_lines(caplog)[0]


def test_a_region_whose_creator_died_is_kept_while_another_process_maps_it(shm_dir: Path) -> None:
    starting = live_creator(shm_dir, "engine-a", 3)
    survivor = SharedRegion("engine-a", LAYOUT, 3, directory=str(shm_dir))  # a rank that joined before the crash
    end(starting, kill=False)
    try:
        assert remove_stale_regions(str(shm_dir)) == []  # the creator is gone, but a live process holds the file
        assert region_file(shm_dir, "engine-a").exists()
    finally:
        survivor.close()


def test_the_same_engine_id_replaces_a_region_whose_creator_died_and_the_old_one_never_unlinks_it(
    shm_dir: Path,
) -> None:
    starting = live_creator(shm_dir, "engine-a", 3)
    survivor = SharedRegion("engine-a", LAYOUT, 3, directory=str(shm_dir))
    survivor.region_tensor().fill_(7)
    end(starting, kill=True)
    restarted = SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir))  # a restart with a fixed engine_id
    assert restarted.mapped_count == 1 and bool(restarted.region_tensor().eq(0).all())  # afresh, not the dead bytes
    survivor.close()  # the survivor's close leaves the new region's name alone
    assert region_file(shm_dir, "engine-a").exists()
    scheduler = SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir))
    assert scheduler.unlinked and scheduler.mapped_count == 2
    for region in (scheduler, restarted):
        region.close()


def test_an_empty_region_file_is_replaced_at_once_not_waited_on(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the next engine with the same engine_id waited 30 s for a header, then failed with TimeoutError.
    caplog.set_level(logging.WARNING, logger="kvtriton.worker._region_file")
    region_file(shm_dir, "engine-a").write_bytes(b"")
    with SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir)) as region:
        assert region.mapped_count == 1
        assert "1 empty or torn" in sweep_lines(caplog)[0]


def test_a_torn_region_file_is_replaced_even_while_a_process_holds_it(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torn = region_file(shm_dir, "engine-a")
    torn.write_bytes(b"\0" * (HEADER_BYTES // 2))
    torn.chmod(0o600)
    caplog.set_level(logging.WARNING, logger="kvtriton.worker._shared_region")
    with torn.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_SH)  # held (by an older kvtriton, say): the sweep leaves it to the join
        with SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir)) as region:
            assert region.mapped_count == 1 and torn.stat().st_size == HEADER_BYTES + LAYOUT.region_bytes
            assert os.fstat(holder.fileno()).st_nlink == 0  # the torn one is unlinked; its holder keeps its inode
            assert any("empty or torn" in record.getMessage() for record in caplog.records)


def test_staging_files_are_removed_only_when_their_creator_is_gone_and_other_files_never(shm_dir: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dead = shm_dir / f"kvtriton_engine-a.region.creating-{dead_pid}-0a1b2c3d"
    alive = shm_dir / f"kvtriton_engine-b.region.creating-{os.getpid()}-0a1b2c3d"  # a creator between open and lock
    others = [shm_dir / name for name in ("kvtriton_notes.txt", "engine.region", "kvtriton_engine-c.region.bak")]
    for path in (dead, alive, *others):
        path.write_bytes(b"")
    removed = remove_stale_regions(str(shm_dir))
    assert [made.path for made in removed] == [str(dead)] and removed[0].creator == dead_pid
    assert alive.exists() and all(path.exists() for path in others)
    for path in (alive, *others):
        path.unlink()


def test_a_region_file_others_could_read_is_refused_not_joined(shm_dir: Path) -> None:
    shared = region_file(shm_dir, "engine-a")
    shared.write_bytes(b"")
    shared.chmod(0o644)
    with shared.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_SH)  # held, so the sweep leaves it
        with pytest.raises(PermissionError, match=r"kvtriton_engine-a.region has mode 0644: other users could read"):
            SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir))
    shared.unlink()


def test_the_region_is_0600_whatever_the_umask(shm_dir: Path) -> None:
    previous = os.umask(0)
    try:
        with SharedRegion("engine-a", LAYOUT, 2, directory=str(shm_dir)) as region:
            assert Path(region.path).stat().st_mode & 0o777 == REGION_MODE == 0o600
    finally:
        os.umask(previous)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (mounting one needs root: skipped, saying so, without it)."""
    mount = tmp_path / "small-shm"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("populate_advice", ["madvise", "page by page (Linux before 5.14)"])
def test_a_tmpfs_that_filled_after_the_region_was_sized_is_an_error_naming_it_not_a_sigbus(
    small_tmpfs: Path, populate_advice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_region, "shm_free_bytes", lambda directory="": 1 << 40)  # it filled after the check
    if populate_advice != "madvise":
        monkeypatch.setattr(shared_region, "_MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: the fallback runs
    region = SharedRegion("engine-a", RegionLayout(256, 1, 1, 4096), 1, directory=str(small_tmpfs))
    with pytest.raises(OSError, match=r"rank 0 could not allocate its 1048576 bytes of .* filled up after the region"):
        region.rank_slab(0, pin=False)
    region.close()
    assert list(small_tmpfs.iterdir()) == []
