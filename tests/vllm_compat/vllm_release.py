"""vLLM's own offloading tests, from the source release of the installed vLLM series, cached outside the repository.

The files are vLLM's code, not kvtriton's: for the series of the installed
vLLM (:func:`installed_release`: 0.33.x or 0.34.x, :data:`RELEASES`) the
``.0`` source release is downloaded once (checked against its
:attr:`Release.sdist_sha256`), the test folders that release's suite needs
are extracted into :meth:`Release.cache_dir`, and nothing is ever written
into the repository. The index is the one pip is configured with (``pip
config`` / ``PIP_INDEX_URL``, else pip's own default), asked through its JSON
simple API (PEP 691); no host name is written here.

vLLM runs these tests from its repository root with a CPU build and a Hugging
Face cache. Here (a python-only vLLM install, no network) :func:`run_env`
names the CPU platform (``VLLM_TARGET_DEVICE=cpu``) and points the Hugging Face
hub, offline, at a cache holding only the ``config.json`` of the model vLLM's
connector tests name (``facebook/opt-125m``: its public architecture, no
weights, no tokenizer); vLLM's top-level ``tests/conftest.py`` (model-runner
fixtures needing tblib, transformers, PIL, ...) is not extracted: the tests
that use its fixtures are in their release's :attr:`Release.not_run`.
"""

from __future__ import annotations

import hashlib
import html
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from packaging.version import InvalidVersion, Version

from bench.real_model import cache_root

_OFFLOAD = "tests/v1/kv_offload"
_CONNECTOR = "tests/v1/kv_connector/unit/offloading_connector"


@dataclass(frozen=True)
class Release:
    """One vLLM release whose own offloading tests run against kvtriton: where they come from and which run."""

    version: str
    """The release the tests come from (``X.Y.0``); it serves every installed ``X.Y.z``."""
    sdist_sha256: str
    """The sha256 of the release's source distribution, as the index lists it."""
    selected: tuple[str, ...]
    """vLLM's test files or folders run in both passes (paths inside vLLM's repository)."""
    not_run: dict[str, str]
    """Tests of :attr:`selected` deselected in both passes, each with why it cannot run on this CPU-only machine.

    Keys are a test file, or a node id without its parameter suffix (covering every parametrization); no
    test here touches a class kvtriton replaces, or the baseline could not prove it.
    """
    extracted_folders: tuple[str, ...]
    """The parts of vLLM's tests/ the selected files import (plus the package ``__init__.py`` files above them)."""
    extracted_files: tuple[str, ...]

    @property
    def series(self) -> str:
        """``X.Y``: the installed versions this release's tests serve."""
        return _series(self.version)

    @property
    def sdist_name(self) -> str:
        return f"vllm-{self.version}.tar.gz"

    def cache_dir(self) -> Path:
        """Where the extracted tests live: ``<cache root>/vllm-X.Y.0-tests`` (its ``tests/`` is vLLM's)."""
        return cache_root() / f"vllm-{self.version}-tests"


_PACKAGE_INITS = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_connector/__init__.py")

_TOP_LEVEL_FIXTURE = (
    "takes {fixture} from vLLM's top-level tests/conftest.py, which imports packages this environment does "
    "not install (tblib, ...) and is not extracted"
)
_NEEDS_DEVICE_EVENTS = (
    "runs vLLM's own CPUOffloadingWorker on a real KV cache: its transfers record device events, which the CPU "
    "backend lacks ('cpu backend doesn't support events'), so it needs an accelerator; it also takes "
    "default_vllm_config from vLLM's top-level tests/conftest.py (not extracted)"
)

RELEASES: tuple[Release, ...] = (
    Release(
        version="0.33.0",
        sdist_sha256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        selected=(
            f"{_OFFLOAD}/cpu/test_manager.py",
            f"{_OFFLOAD}/cpu/policies/test_factory.py",
            f"{_OFFLOAD}/tiering/test_tiering_offloading.py",
            f"{_OFFLOAD}/tiering/test_backpressure.py",
            f"{_OFFLOAD}/tiering/test_tier_poll_thread.py",
            f"{_OFFLOAD}/tiering/test_fs_tier.py",
            f"{_OFFLOAD}/tiering/test_obj_tier.py",
            f"{_CONNECTOR}/test_events.py",
            f"{_CONNECTOR}/test_scheduler.py",
        ),
        not_run={},
        extracted_folders=(f"{_OFFLOAD}/", "tests/v1/kv_connector/unit/"),
        extracted_files=_PACKAGE_INITS,
    ),
    Release(
        version="0.34.0",
        sdist_sha256="fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
        selected=(f"{_OFFLOAD}/", f"{_CONNECTOR}/"),
        not_run={
            **{
                f"{_OFFLOAD}/cpu/test_gpu_worker.py::{name}": _NEEDS_DEVICE_EVENTS
                for name in ("test_transfer", "test_transfer_multi_group")
            },
            **{
                f"{_OFFLOAD}/cpu/test_gpu_worker.py::{name}": _TOP_LEVEL_FIXTURE.format(fixture="caplog_vllm")
                for name in (
                    "test_worker_logs_handler_error_and_cleans_region",
                    "test_worker_syncs_before_cleanup_after_handler_failure",
                )
            },
            f"{_OFFLOAD}/tiering/test_p2p_lifecycle_e2e.py": (
                "runs real vLLM engines with model weights through the vllm_runner fixture of vLLM's top-level "
                "tests/conftest.py (not extracted; kvtriton's own e2e suite runs real engines)"
            ),
            **{
                f"{_CONNECTOR}/test_scheduler.py::{name}": (
                    "configures speculative decoding (EAGLE lookahead), which VllmConfig refuses on the standalone "
                    "CPU model runner that vLLM 0.34's CPU platform takes here ('The CPU model runner without Triton "
                    "does not yet support: speculative decoding')"
                )
                for name in (
                    "test_lookahead_partial_lookup_uses_available_hashes",
                    "test_lookahead_partial_store_uses_checkpoint_hash",
                )
            },
        },
        extracted_folders=(f"{_OFFLOAD}/", "tests/v1/kv_connector/unit/"),
        # test_scheduler.py imports the speculative-decoding config helpers of tests/v1/spec_decode.
        extracted_files=(*_PACKAGE_INITS, "tests/v1/spec_decode/__init__.py", "tests/v1/spec_decode/utils.py"),
    ),
)
"""The releases whose tests this suite runs, one per supported vLLM series."""


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM belongs to no series in :data:`RELEASES`."""


def _series(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def release_for(version: str) -> Release:
    """The release whose tests serve vLLM ``version`` (same ``X.Y``); UnsupportedVLLMError naming the choices else."""
    try:
        series = _series(version)
    except InvalidVersion:
        series = None
    for release in RELEASES:
        if release.series == series:
            return release
    supported = ", ".join(f"{release.series}.x" for release in RELEASES)
    raise UnsupportedVLLMError(
        f"vLLM {version} is installed; tests/vllm_compat runs vLLM's own tests for {supported} only: install one "
        f"of those, or add the new release's sdist, selection and allow-list to tests/vllm_compat "
        f"(vllm_release.RELEASES, allow_list.py)"
    )


def installed_release() -> Release:
    """The release for the vLLM installed in this interpreter (see :func:`release_for`)."""
    return release_for(importlib.metadata.version("vllm"))


OPT_125M_CONFIG: dict[str, object] = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}
"""The architecture of ``facebook/opt-125m``, the model vLLM's connector tests build a ModelConfig for."""


def index_url() -> str:
    """The simple index pip uses: its configured ``index-url``, else pip's default."""
    try:
        configured = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True, text=True, timeout=60, check=False,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        configured = ""
    url = os.environ.get("PIP_INDEX_URL") or configured
    if not url:
        from pip._internal.models.index import PyPI  # pip's own default index; pip ships no public constant for it

        url = PyPI.simple_url
    return url.rstrip("/")


def sdist_url(index: str, sdist_name: str) -> str:
    """The download URL of vLLM's sdist ``sdist_name``, from the index's project page (PEP 691 JSON, or HTML)."""
    page_url = f"{index}/vllm/"
    request = urllib.request.Request(  # noqa: S310 -- the https index pip is configured with
        page_url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 -- the https index pip is configured with
        body = cast("bytes", response.read())
    try:
        page = cast("dict[str, object]", json.loads(body))
        urls = [
            str(entry["url"])
            for entry in cast("list[dict[str, object]]", page.get("files", []))
            if entry.get("filename") == sdist_name
        ]
    except ValueError:  # an HTML simple page (PEP 503)
        urls = [html.unescape(href) for href in re.findall(r'href="([^"]+)"', body.decode("utf-8", "replace"))
                if urllib.parse.urlsplit(html.unescape(href)).path.endswith("/" + sdist_name)]  # fmt: skip
    if not urls:
        raise RuntimeError(f"the package index {index} lists no {sdist_name}")
    return urllib.parse.urljoin(page_url, urls[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(release: Release, destination: Path) -> None:
    url = sdist_url(index_url(), release.sdist_name)
    print(f"downloading {release.sdist_name} (about 50 MB, once) into {destination.parent}", file=sys.stderr)
    partial = destination.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as file:  # noqa: S310 -- a URL from that index's project page
        shutil.copyfileobj(response, file)
    actual = _sha256(partial)
    if actual != release.sdist_sha256:
        partial.unlink()
        raise RuntimeError(
            f"{release.sdist_name} from {url} has sha256 {actual}, expected {release.sdist_sha256}: refusing it"
        )
    partial.replace(destination)


def _wanted(release: Release, name: str) -> bool:
    inner = name.partition("/")[2]
    return inner in release.extracted_files or any(inner.startswith(folder) for folder in release.extracted_folders)


def _write_model_cache(root: Path) -> None:
    snapshot = root / "hf" / "hub" / "models--facebook--opt-125m" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=1))
    (root / "hf" / "hub" / "models--facebook--opt-125m" / "refs").mkdir(exist_ok=True)
    (root / "hf" / "hub" / "models--facebook--opt-125m" / "refs" / "main").write_text("local")


def _extraction_marker(release: Release) -> str:
    """What ``.complete`` holds once ``release``'s tests are extracted: a changed selection extracts again."""
    return json.dumps([release.sdist_sha256, release.extracted_folders, release.extracted_files])


def ensure_tests(release: Release) -> Path:
    """``release``'s extracted tests (``<dir>/tests/...``), downloading and extracting them the first time."""
    target = release.cache_dir()
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == _extraction_marker(release):
        return target
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / release.sdist_name
    if not sdist.exists() or _sha256(sdist) != release.sdist_sha256:
        _download(release, sdist)
    staging = Path(tempfile.mkdtemp(prefix="vllm-tests-", dir=root))
    try:
        with tarfile.open(sdist) as archive:
            members = [member for member in archive.getmembers() if member.isfile() and _wanted(release, member.name)]
            for member in members:
                member.name = member.name.partition("/")[2]
            archive.extractall(staging, members=members, filter="data")
        _write_model_cache(staging)
        (staging / ".complete").write_text(_extraction_marker(release))
        if target.exists():
            shutil.rmtree(target)
        staging.replace(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def run_env(root: Path) -> dict[str, str]:
    """The environment vLLM's tests run in here: CPU platform, an offline hub holding the one model config."""
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(root / "hf"),
        TRANSFORMERS_OFFLINE="1",
    )
    return env
