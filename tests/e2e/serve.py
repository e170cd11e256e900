"""``vllm serve`` in a process group of its own on the loopback, for tests that talk to it over HTTP.

:func:`vllm_serve` starts the server (API server, engine core and worker
processes), waits for ``/health``, yields a :class:`Server`, and on exit stops
the whole group (SIGTERM, then SIGKILL for anything that outlives the grace
period) and fails if something had to be killed or was left behind.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from e2e.engine import ENGINE_TIMEOUT_S, end_process_group, engine_env
from e2e.vllm_cpu import ENGINE_ENV

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Server:
    url: str
    log_path: Path
    model: str

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as response:  # noqa: S310 -- loopback URL built here
            return response.read().decode()

    def post(self, path: str, body: dict[str, object] | None = None) -> str:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 -- loopback URL built here
            f"{self.url}{path}", data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 -- loopback URL built here
            return response.read().decode()

    def complete(self, prompt: str, max_tokens: int) -> str:
        """Greedy ``/v1/completions`` text for ``prompt``."""
        answer = json.loads(
            self.post(
                "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            )
        )
        return str(answer["choices"][0]["text"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:  # noqa: S310 -- loopback URL built here
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def vllm_serve(
    model: Path, kv_transfer_config: dict[str, object], workdir: Path, *, block_size: int = 32
) -> Generator[Server]:
    """Run ``vllm serve`` for ``model`` with ``kv_transfer_config`` on a free loopback port (dev endpoints on)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = engine_env() | ENGINE_ENV
    # vllm serve runs its engine core in a process of its own, as it does in production.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", LOOPBACK, "--port", str(port), "--dtype", "float32", "--block-size", str(block_size),
        "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager", "--kv-cache-memory-bytes", str(16 << 20),
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]  # fmt: skip
    log_path = workdir / "serve.log"
    server = Server(url=f"http://{LOOPBACK}:{port}", log_path=log_path, model=str(model))
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not _healthy(server.url):
            if process.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {process.returncode}; its log ends:\n{server.log()[-6000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vllm serve not healthy after {ENGINE_TIMEOUT_S}s; its log ends:\n{server.log()[-6000:]}"
                )
            time.sleep(0.5)
        yield server
    finally:
        leftovers = end_process_group(process, grace_s=30.0)
    if leftovers:
        raise AssertionError(
            f"vllm serve did not shut down cleanly: {leftovers}; its log ends:\n{server.log()[-3000:]}"
        )
