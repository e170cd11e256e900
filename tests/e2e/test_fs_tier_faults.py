"""vLLM's fs tier behind kvtriton's primary when its root fills up (ENOSPC) or turns read-only mid-serve (issue 41).

Each engine serves a first request while the root is healthy (its chunks reach
the disk), then the test breaks the root between two requests
(:func:`e2e.engine.barrier`): fills it to the last byte, or remounts it
read-only, as a file system does after errors. The root is a small tmpfs of the
test's own, so filling it touches nothing else; mounting needs root (or
CAP_SYS_ADMIN), and the tests skip, saying so, without it. Serving goes on:
the next request has the reference tokens, its cascade to the disk fails and is
counted and logged, a repeat of it hits kvtriton's host memory, and the root
holds no half-written file afterwards.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e.engine import (
    HITS,
    RESET_PREFIX_CACHE,
    EngineJob,
    EngineResult,
    barrier,
    faults_at,
    generate,
    run_engine,
    spec_config,
)
from e2e.prompts import BLOCK_SIZE, MAX_TOKENS, PROMPT_A

FULL_TOKENS = len(PROMPT_A) // BLOCK_SIZE * BLOCK_SIZE
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
CASCADE_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
ROOT_BYTES = 4 << 20
"""The tmpfs root's size: a few dozen of the tiny model's chunks."""
MOUNT_TIMEOUT_S = 30.0


def _mount(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *arguments], capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)


@pytest.fixture
def small_root(tmp_path: Path) -> Iterator[Path]:
    """A private 4 MiB tmpfs (mode 0700, as kvtriton wants an fs root), unmounted afterwards whatever happened."""
    root = tmp_path / "fs-root"
    root.mkdir(mode=0o700)
    try:
        mounted = _mount("-t", "tmpfs", "-o", f"size={ROOT_BYTES},mode=0700", "tmpfs", str(root))
    except (FileNotFoundError, PermissionError) as error:
        pytest.skip(f"cannot mount a tmpfs as the fs tier's root: {error}")
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs as the fs tier's root (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}"
        )
    try:
        yield root
    finally:
        unmounted = subprocess.run(["umount", str(root)], capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)
        if unmounted.returncode != 0:  # something still holds it open: detach it so nothing is left mounted
            subprocess.run(["umount", "-l", str(root)], check=True, timeout=MOUNT_TIMEOUT_S)


def fill(root: Path) -> None:
    """Write a filler file into ``root`` until the file system says it is full."""
    piece = bytes(64 << 10)
    with (root / "filler").open("wb", buffering=0) as filler:
        while True:
            try:
                filler.write(piece)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
    # The last bytes too: a write smaller than a page can still find room after a 64 KiB one did not.
    with (root / "filler").open("ab", buffering=0) as filler:
        try:
            while filler.write(bytes(512)):
                pass
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise


def make_read_only(root: Path) -> None:
    remounted = _mount("-o", "remount,ro", str(root))
    assert remounted.returncode == 0, remounted.stderr


def engine_with_fault(model: Path, root: Path, workdir: Path, fault: Callable[[Path], None]) -> EngineResult:
    """A healthy request, ``fault(root)`` at the barrier, then a new prefix (A under another salt) twice."""
    config = spec_config(
        "KVTritonTieringOffloadingSpec",
        cpu_bytes_to_use=8 << 20,
        secondary_tiers=[{"type": "fs", "root_dir": str(root)}],
    )
    steps = [
        generate(PROMPT_A, MAX_TOKENS, "healthy", cache_salt="before"),
        barrier("fault"),
        generate(PROMPT_A, MAX_TOKENS, "after-fault", cache_salt="after"),
        RESET_PREFIX_CACHE,
        generate(PROMPT_A, MAX_TOKENS, "repeated", cache_salt="after"),
    ]
    with faults_at(workdir, [("fault", lambda: fault(root))]):
        return run_engine(EngineJob(model=str(model), steps=steps, kv_transfer_config=config), workdir)


def chunk_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() and path.name != "filler")


def assert_serving_went_on(result: EngineResult, reference: EngineResult) -> None:
    for name in ("healthy", "after-fault", "repeated"):
        assert result.step(name).token_ids == reference.step("A").token_ids, name
    assert result.delta("healthy", WRITE_BYTES) > 0  # the root took the first prefix
    assert result.delta("after-fault", HITS) == 0
    assert result.delta("after-fault", CASCADE_FAILURES) >= 1
    assert result.delta("after-fault", WRITE_BYTES) == 0
    assert result.delta("repeated", HITS) == FULL_TOKENS  # from kvtriton's host memory
    assert "block I/O failed" in result.log


@pytest.mark.parametrize(
    ("break_root", "logged"),
    [(fill, "No space left on device"), (make_read_only, "Read-only file system")],
    ids=["full", "read-only"],
)
def test_a_broken_root_fails_the_cascades_and_serving_goes_on(
    break_root: Callable[[Path], None],
    logged: str,
    small_root: Path,
    llama: Path,
    tmp_path: Path,
    reference: EngineResult,
) -> None:
    before: list[Path] = []

    def break_after_the_first_prefix(root: Path) -> None:
        before.extend(chunk_files(root))
        break_root(root)

    result = engine_with_fault(llama, small_root, tmp_path / "engine", break_after_the_first_prefix)
    assert_serving_went_on(result, reference)
    assert logged in result.log
    assert before and chunk_files(small_root) == before  # nothing half-written left behind
