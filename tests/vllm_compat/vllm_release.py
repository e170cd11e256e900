"""vLLM 0.33.0's own offloading tests, from its source release on the package index, cached outside the repository.

The files are vLLM's code, not kvtriton's: they are downloaded once (the
sdist, checked against :data:`SDIST_SHA256`), the test folders the suite needs
are extracted into :func:`cache_dir`, and nothing is ever written into the
repository. The index is the one pip is configured with (``pip config`` /
``PIP_INDEX_URL``, else pip's own default), asked through its JSON simple API
(PEP 691); no host name is written here.

vLLM runs these tests from its repository root with a CPU build and a Hugging
Face cache. Here (a python-only vLLM install, no network) :func:`test_env`
names the CPU platform (``VLLM_TARGET_DEVICE=cpu``) and points the Hugging Face
hub, offline, at a cache holding only the ``config.json`` of the model vLLM's
connector tests name (``facebook/opt-125m``: its public architecture, no
weights, no tokenizer); vLLM's top-level ``tests/conftest.py`` (model-runner
fixtures needing transformers, PIL, ...) is not extracted: none of the selected
files uses it.
"""

from __future__ import annotations

import hashlib
import html
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
from pathlib import Path
from typing import cast

from bench.real_model import cache_root

VLLM_VERSION = "0.33.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
"""The sha256 of vLLM 0.33.0's source release, as the index lists it."""

EXTRACTED_FOLDERS = ("tests/v1/kv_offload/", "tests/v1/kv_connector/unit/")
"""The parts of vLLM's tests/ the selected files import (plus the package ``__init__.py`` files above them)."""

EXTRACTED_FILES = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_connector/__init__.py")

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


def cache_dir() -> Path:
    """Where the extracted tests live: ``<cache root>/vllm-0.33.0-tests`` (its ``tests/`` is vLLM's)."""
    return cache_root() / f"vllm-{VLLM_VERSION}-tests"


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


def sdist_url(index: str) -> str:
    """The download URL of vLLM 0.33.0's sdist, from the index's project page (PEP 691 JSON, or the HTML page)."""
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
            if entry.get("filename") == SDIST_NAME
        ]
    except ValueError:  # an HTML simple page (PEP 503)
        urls = [html.unescape(href) for href in re.findall(r'href="([^"]+)"', body.decode("utf-8", "replace"))
                if urllib.parse.urlsplit(html.unescape(href)).path.endswith("/" + SDIST_NAME)]  # fmt: skip
    if not urls:
        raise RuntimeError(f"the package index {index} lists no {SDIST_NAME}")
    return urllib.parse.urljoin(page_url, urls[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(destination: Path) -> None:
    url = sdist_url(index_url())
    print(f"downloading {SDIST_NAME} (47 MB, once) into {destination.parent}", file=sys.stderr)
    partial = destination.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as file:  # noqa: S310 -- a URL from that index's project page
        shutil.copyfileobj(response, file)
    actual = _sha256(partial)
    if actual != SDIST_SHA256:
        partial.unlink()
        raise RuntimeError(f"{SDIST_NAME} from {url} has sha256 {actual}, expected {SDIST_SHA256}: refusing it")
    partial.replace(destination)


def _wanted(name: str) -> bool:
    inner = name.partition("/")[2]
    return inner in EXTRACTED_FILES or any(inner.startswith(folder) for folder in EXTRACTED_FOLDERS)


def _write_model_cache(root: Path) -> None:
    snapshot = root / "hf" / "hub" / "models--facebook--opt-125m" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=1))
    (root / "hf" / "hub" / "models--facebook--opt-125m" / "refs").mkdir(exist_ok=True)
    (root / "hf" / "hub" / "models--facebook--opt-125m" / "refs" / "main").write_text("local")


def ensure_tests() -> Path:
    """The extracted release (``<dir>/tests/...``), downloading and extracting it the first time."""
    target = cache_dir()
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == SDIST_SHA256:
        return target
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / SDIST_NAME
    if not sdist.exists() or _sha256(sdist) != SDIST_SHA256:
        _download(sdist)
    staging = Path(tempfile.mkdtemp(prefix="vllm-tests-", dir=root))
    try:
        with tarfile.open(sdist) as archive:
            members = [member for member in archive.getmembers() if member.isfile() and _wanted(member.name)]
            for member in members:
                member.name = member.name.partition("/")[2]
            archive.extractall(staging, members=members, filter="data")
        _write_model_cache(staging)
        (staging / ".complete").write_text(SDIST_SHA256)
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
