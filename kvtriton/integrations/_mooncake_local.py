"""A Mooncake Store on the loopback for tests, benchmarks and trying the tier out: a master and one storage holder.

:class:`MooncakeCluster` starts ``mooncake_master`` and a ``mooncake_client``
storage holder the way a user does (the binaries shipped in the mooncake
package), on 127.0.0.1 with free ports and MC_TCP_BIND_ADDRESS=127.0.0.1, logs
each to a file, and stops exactly the processes it started. It is no
deployment: docs/mooncake.md describes one.

It also holds what kvtriton knows of the Mooncake install: the packages
(:data:`MOONCAKE_PACKAGES`), whether one is there (:func:`mooncake_missing`),
its version, and the oldest version the tier accepts
(:data:`MINIMUM_MOONCAKE_VERSION`, :func:`mooncake_version_problem`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"

MOONCAKE_PACKAGES = "mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4"
"""The Mooncake tier's packages, as the Makefile's ``MOONCAKE_PACKAGES`` and docs/mooncake.md give them."""


MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
"""The names the mooncake package is published under (the CPU build and the CUDA one)."""

MINIMUM_MOONCAKE_VERSION = (0, 3, 13)
"""The oldest Mooncake the tier accepts. Before 0.3.13 the transfer engine's TCP data port, which every process
using the tier opens on all interfaces, let anyone who reached it read and write that process's memory
(CVE-2026-103764; docs/security.md lists the advisories)."""


def installed_mooncake_version() -> tuple[str, str] | None:
    """The installed Mooncake's ``(version, distribution name)``, or None when neither distribution is installed."""
    for name in MOONCAKE_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name), name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def mooncake_version_problem(installed: tuple[str, str] | None = None) -> str | None:
    """Why the installed Mooncake (default: :func:`installed_mooncake_version`) is refused, or None.

    Refused: a release older than :data:`MINIMUM_MOONCAKE_VERSION`, or a
    version string that names no release. An absent package is no problem
    here (:func:`mooncake_missing` says that).
    """
    found = installed if installed is not None else installed_mooncake_version()
    if found is None:
        return None
    version, name = found
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    release = tuple(int(part) for part in match.groups()) if match else None
    minimum = ".".join(map(str, MINIMUM_MOONCAKE_VERSION))
    if release is not None and release >= MINIMUM_MOONCAKE_VERSION:
        return None
    return (
        f"{name} {version} is installed, but the Mooncake tier needs {minimum} or newer: older transfer engines let "
        f"anyone who reaches their data port read and write this process's memory (CVE-2026-103764); install the "
        f"tested release: pip install --no-deps {MOONCAKE_PACKAGES}"
    )


def mooncake_missing() -> str | None:
    """Why the Mooncake tier cannot be tried here (the package is absent), or None."""
    if importlib.util.find_spec("mooncake") is not None:
        return None
    return (
        f"the mooncake package is not installed: pip install --no-deps {MOONCAKE_PACKAGES} (its libraries need the "
        "OS packages libibverbs1, libnuma1 and libcurl4; make test installs all of them)"
    )


START_TIMEOUT_S = 20.0


def mooncake_binary(name: str) -> Path:
    """``mooncake_master`` / ``mooncake_client`` as shipped inside the mooncake package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(mooncake_missing() or "the mooncake package has no files")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the mooncake package")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class MooncakeCluster:
    """One master and one storage holder of ``holder_bytes`` on the loopback, logs under ``log_dir``."""

    log_dir: Path
    holder_bytes: int = 256 * 1024 * 1024
    master_port: int = field(default_factory=free_port)
    master_extra_args: tuple[str, ...] = ()
    master: subprocess.Popen[bytes] | None = None
    holder: subprocess.Popen[bytes] | None = None
    _started: list[subprocess.Popen[bytes]] = field(default_factory=lambda: [])
    _restarts: int = 0

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.master_port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 -- the child keeps it; closed with the file object below
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": LOOPBACK}
        try:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()
        self._started.append(process)
        return process

    def start_master(self) -> None:
        """(Re)start the master on the same port, so clients find it again at the same address."""
        self._restarts += 1
        self.master = self._spawn(
            f"master-{self._restarts}",
            [
                str(mooncake_binary("mooncake_master")),
                f"--rpc_port={self.master_port}",
                f"--rpc_address={LOOPBACK}",
                f"--metrics_port={free_port()}",
                f"--metrics_host={LOOPBACK}",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={free_port()}",
                "--client_ttl=2",  # a vanished holder's segment is dropped after 2 s, not 10
                *self.master_extra_args,
            ],
        )
        self._wait(self.master, self.master_port, "master")

    def start_holder(self) -> None:
        port = free_port()
        self.holder = self._spawn(
            "holder",
            [
                str(mooncake_binary("mooncake_client")),
                f"--host={LOOPBACK}",
                f"--port={port}",
                f"--master_server_address={self.master_address}",
                "--metadata_server=P2PHANDSHAKE",
                f"--global_segment_size={self.holder_bytes}",
                "--protocol=tcp",
            ],
        )
        self._wait(self.holder, port, "holder")
        # The holder listens before its segment is mounted; the master logs the mount.
        log = self.log_dir / f"master-{self._restarts}.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        while "mount_segment" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the holder's segment never reached the master; see {log}")
            time.sleep(0.05)

    def _wait(self, process: subprocess.Popen[bytes], port: int, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts(port):
            if process.poll() is not None:
                raise RuntimeError(f"mooncake {what} exited with {process.returncode}; see its log in {self.log_dir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake {what} did not listen on {LOOPBACK}:{port} in {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def start(self) -> MooncakeCluster:
        """Start the master, then the holder; if either fails to start, stop what did (nothing is left running)."""
        try:
            self.start_master()
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def kill_master(self) -> None:
        master = self._running(self.master)
        master.kill()
        master.wait(5)

    def hang_master(self) -> None:
        """SIGSTOP: the master keeps its sockets open and answers nothing.

        Returns once every thread of the master is stopped: ``kill`` only queues
        the signal, and a thread running on another core can still answer a
        request that arrives in between (seen on a loaded 2-core machine).
        """
        _stop(self._running(self.master), "mooncake_master")

    def resume_master(self) -> None:
        self._running(self.master).send_signal(signal.SIGCONT)

    def hang_holder(self) -> None:
        """SIGSTOP the storage holder (as :meth:`hang_master`): transfers to and from its segment stall."""
        _stop(self._running(self.holder), "mooncake_client")

    def resume_holder(self) -> None:
        self._running(self.holder).send_signal(signal.SIGCONT)

    def kill_holder(self) -> None:
        holder = self._running(self.holder)
        holder.kill()
        holder.wait(5)

    @staticmethod
    def _running(process: subprocess.Popen[bytes] | None) -> subprocess.Popen[bytes]:
        if process is None:
            raise RuntimeError("that process was never started")
        return process

    def stop(self) -> None:
        """Kill every process this cluster started (and only those), waiting for each."""
        for process in reversed(self._started):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped master must run to die promptly
                process.kill()
            process.wait(5)
        self._started.clear()


def _stop(process: subprocess.Popen[bytes], what: str) -> None:
    """SIGSTOP ``process`` and return once every thread of it is stopped (a queued signal is not yet a stop)."""
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5.0
    while not _all_threads_stopped(process.pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} (pid {process.pid}) did not stop within 5 s of SIGSTOP")
        time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state ('T' in /proc/PID/task/TID/stat)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        # The state follows the parenthesised command name, which may itself hold spaces.
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return bool(states) and all(state in ("T", "t") for state in states)
