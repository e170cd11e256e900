"""The shared host region's file in /dev/shm: its name, its header, its locks, and when it may be removed.

:class:`~kvtriton.worker._shared_region.SharedRegion` maps the file; this
module says what lies on disk and who may take it away, so that no region
outlives the processes that use it, whatever their engine id:

* **Published whole.** The creator writes the header into a staging file of
  its own (``kvtriton_<name>.region.creating-<pid>-<token>``) and then links
  it under the region's name: a file under that name is either complete or
  left by an older or foreign writer (empty, torn) and replaced, never waited
  on.
* **Held while mapped.** Every process that maps a region holds a shared
  ``flock`` on it from the moment it opens it (the creator from the staging
  file on) until its mapping goes, with the process if it dies. A region
  nobody holds has no user left: :func:`remove_stale_regions`, run by every
  process before it creates or joins a region, removes kvtriton's region and
  staging files whose creator is gone and which no live process holds, any
  engine id, and says so in one log line. The lock, not the creator's pid, is
  what proves a file unused (a pid may be reused, or belong to another pid
  namespace); a live creator only keeps a file a little longer.
* **Counted.** The header counts the processes that mapped the region (the
  one completing the count unlinks the name: from then on the memory lives
  exactly as long as some process maps it), the worker ranks that
  populated their bytes, and the ranks that reported how pinning went (and
  how many CUDA refused), from which every rank takes the same host memory
  path and the scheduler reads it. Both are updated under a record lock on the header
  page (:func:`header_locked`), which the shared ``flock`` every mapper holds
  does not conflict with.

Only files owned by this process's user are judged or joined: a region under
another user's ownership, or one readable by others, is refused (another
account could read or write the KV it holds); /dev/shm's sticky bit keeps
others from removing ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass

from typing_extensions import Buffer

from kvtriton._byte_units import format_bytes
from kvtriton._private_files import PRIVATE_FILE_MODE
from kvtriton._region_rows import ROW_ALIGNMENT

logger = logging.getLogger(__name__)

REGION_DIRECTORY = "/dev/shm"
"""Where regions live: a tmpfs, so the memory is RAM and the file name is only a rendezvous."""

REGION_PREFIX = "kvtriton_"
REGION_SUFFIX = ".region"
CREATING_MARK = ".creating-"
"""A staging file is ``<region path>.creating-<creator pid>-<token>`` until it is linked under the region's name."""

REGION_MODE = PRIVATE_FILE_MODE
"""The region's file mode: the server's user only, whatever its umask and any group configured for the tiers' files
(the region is never shared beyond one engine's processes)."""

HEADER_BYTES = ROW_ALIGNMENT
"""The region starts with one header page (magic, mapper and populated counts, layout); rows follow, still aligned."""

MAGIC = b"KVTRREG5"
"""4: published whole (linked after its header is written) and held under a shared flock while mapped; 5: the
ranks' pinning outcomes and the host memory path they agreed on."""
_MAGIC_FAMILY = b"KVTRREG"  # every kvtriton region's magic starts so; the creator's pid sits at the same offset since 2


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One integer of the header page at a fixed offset."""

    at: int
    format: struct.Struct

    @property
    def end(self) -> int:
        return self.at + self.format.size

    def read(self, buffer: Buffer) -> int:
        (value,) = self.format.unpack_from(buffer, self.at)
        return int(value)

    def write(self, buffer: Buffer, value: int) -> None:
        self.format.pack_into(buffer, self.at, value)


MAPPED = HeaderField(len(MAGIC), struct.Struct("<Q"))
"""Processes that have mapped the region."""
CREATOR = HeaderField(MAPPED.end, struct.Struct("<Q"))
"""The creator's process id (in its pid namespace)."""
POPULATED = HeaderField(CREATOR.end, struct.Struct("<Q"))
"""Worker ranks that have populated their bytes."""
PIN_REPORTED = HeaderField(POPULATED.end, struct.Struct("<Q"))
"""Worker ranks that have said how their pinning went (pinned, refused, or not pinning at all)."""
PIN_REFUSED = HeaderField(PIN_REPORTED.end, struct.Struct("<Q"))
"""Worker ranks whose registration CUDA refused: one is enough for every rank to go pageable."""
FIRST_REFUSAL = HeaderField(PIN_REFUSED.end, struct.Struct("<Q"))
"""The first refused rank plus one (0: none yet) and its CUDA error, ``rank + 1 | code << 32``: that rank logs the
engine's one WARNING."""
MEMORY_PATH = HeaderField(FIRST_REFUSAL.end, struct.Struct("<I"))
"""The slowest host memory path a rank took, plus one (0: no rank decided yet): what the gauge reports."""
LAYOUT_LENGTH = HeaderField(MEMORY_PATH.end, struct.Struct("<I"))
"""Bytes of the layout JSON that follows."""
LAYOUT_AT = LAYOUT_LENGTH.end

_POLL_S = 0.005

_PROCESS_LOCK = threading.Lock()
"""Serialises this process's header updates and its closing of region files.

Record locks (``lockf``) belong to a process, not to a thread or a file
descriptor: they do not keep two threads of one process apart, and closing
any descriptor of the file drops every record lock the process holds on it.
"""


def region_path(directory: str, name: str) -> str:
    """Where the region named ``name`` lives in ``directory``."""
    return os.path.join(directory, f"{REGION_PREFIX}{name}{REGION_SUFFIX}")


def staging_path(path: str) -> str:
    """A staging file for the region at ``path``, named after this process (:data:`CREATING_MARK`)."""
    return f"{path}{CREATING_MARK}{os.getpid()}-{os.urandom(4).hex()}"


def _staging_creator(file_name: str) -> int | None:
    """The creator pid in a staging file's name; None for a region's own name (or a name kvtriton never writes)."""
    _, mark, rest = file_name.partition(CREATING_MARK)
    pid = rest.split("-", 1)[0] if mark else ""
    return int(pid) if pid.isdigit() else None


def is_kvtriton_file(file_name: str) -> bool:
    """Whether ``file_name`` is a region or staging file kvtriton writes (never anything else in the directory)."""
    if not file_name.startswith(REGION_PREFIX):
        return False
    return file_name.endswith(REGION_SUFFIX) or _staging_creator(file_name) is not None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (in this pid namespace; under any user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    return True


def header_creator(fd: int) -> int | None:
    """The creator pid a region file's header names; None when it has no kvtriton header (empty, torn, foreign)."""
    header = os.pread(fd, CREATOR.end, 0)
    if len(header) < CREATOR.end or not header.startswith(_MAGIC_FAMILY):
        return None
    return CREATOR.read(header)


def hold_shared(fd: int, path: str, timeout_s: float) -> None:
    """Take the shared lock every mapper holds; ``TimeoutError`` naming ``path`` after ``timeout_s``.

    Only a process judging whether the file is stale holds it exclusively,
    for as long as a ``stat`` and an ``unlink`` take: the wait is short.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{path} stayed locked exclusively for {timeout_s} s: a process judging whether it is stale "
                    "never let go (is one stopped?)"
                ) from None
            time.sleep(_POLL_S)


def nobody_holds(fd: int) -> bool:
    """Whether no process maps the file: the exclusive lock is free (and is now held by ``fd``, until it closes)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def header_locked(fd: int) -> Generator[None]:
    """Exclusive use of the header page's counters, against every thread and process mapping the region."""
    with _PROCESS_LOCK:
        fcntl.lockf(fd, fcntl.LOCK_EX, HEADER_BYTES, 0)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, HEADER_BYTES, 0)


def close_region_fd(fd: int) -> None:
    """Close a region file's descriptor, never while this process holds the header lock (:data:`_PROCESS_LOCK`)."""
    with _PROCESS_LOCK:
        os.close(fd)


def is_same_file(path: str, opened: os.stat_result) -> bool:
    """Whether ``path`` (not followed if a link) is still the file ``opened`` describes."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def refuse_unless_private(path: str, opened: os.stat_result) -> None:
    """``PermissionError`` naming ``path`` unless it is a regular file of this user that nobody else may open."""
    problem = None
    if not stat.S_ISREG(opened.st_mode):
        problem = "is not a regular file"
    elif opened.st_uid != os.geteuid():
        problem = f"belongs to uid {opened.st_uid}, not to this server's uid {os.geteuid()}"
    elif opened.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(opened.st_mode):04o}: other users could read or write the KV it holds"
    if problem is not None:
        raise PermissionError(
            f"{path} {problem}; kvtriton maps only its own {REGION_MODE:04o} regions: remove the file, or give this "
            "engine another engine_id"
        )


@dataclass(frozen=True, slots=True)
class RemovedRegion:
    """A file :func:`remove_stale_regions` removed."""

    path: str
    allocated_bytes: int
    """The RAM it held (tmpfs pages in use, not its length)."""
    creator: int | None
    """The pid that made it, when its name or header says (None: an empty or torn file)."""


def _remove_if_stale(path: str, named_creator: int | None) -> RemovedRegion | None:
    """Remove ``path`` when it is this user's, its creator is gone (or unknown) and no process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # gone meanwhile, a link, or not ours to read
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or opened.st_uid != os.geteuid():
            return None  # another user's: not this server's to judge
        creator = named_creator if named_creator is not None else header_creator(fd)
        if creator is not None and process_alive(creator):
            return None
        if not nobody_holds(fd) or not is_same_file(path, opened):
            return None
        os.unlink(path)
        return RemovedRegion(path, opened.st_blocks * 512, creator)
    except OSError:
        return None  # removed by another process meanwhile
    finally:
        close_region_fd(fd)


def remove_stale_regions(directory: str = REGION_DIRECTORY) -> list[RemovedRegion]:
    """Remove kvtriton's region and staging files in ``directory`` left by processes that are gone; one log line.

    A file goes when it is this user's, its creator (from its header or its
    staging name) no longer runs or is unknown (an empty or torn file), and
    no live process holds its lock (see the module docstring). Anything else
    in the directory is never touched.
    """
    try:
        names = sorted(entry.name for entry in os.scandir(directory) if is_kvtriton_file(entry.name))
    except OSError:
        return []
    removed = [
        made
        for name in names
        if (made := _remove_if_stale(os.path.join(directory, name), _staging_creator(name))) is not None
    ]
    if removed:
        pids = sorted({made.creator for made in removed if made.creator is not None})
        unknown = sum(made.creator is None for made in removed)
        whose = [f"creator pid(s) {', '.join(map(str, pids))} gone"] if pids else []
        whose += [f"{unknown} empty or torn"] if unknown else []
        logger.warning(
            "removed %d stale kvtriton shared host region file(s) from %s, freeing %s: %s (%s; no process maps them: "
            "left by engines that crashed during start-up)",
            len(removed),
            directory,
            format_bytes(sum(made.allocated_bytes for made in removed)),
            ", ".join(os.path.basename(made.path) for made in removed),
            "; ".join(whose),
        )
    return removed
