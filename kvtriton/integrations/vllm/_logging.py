"""Show kvtriton's log lines in vLLM's log, formatted like vLLM's own.

vLLM configures Python logging for the ``vllm`` logger only (its handler
writes to stderr, its level is ``VLLM_LOGGING_LEVEL``); every other logger
falls through to the root logger, which nobody configured in a plain
``vllm serve``, so kvtriton's start-up lines (slab size, slots, backend) and
its warnings were dropped. :func:`attach_to_vllm_logging` runs when vLLM
loads kvtriton's spec (``kvtriton.integrations.vllm`` calls it on import,
in every vLLM process that loads it) and makes the ``kvtriton`` logger hand
its records to whatever handlers the ``vllm`` logger has at the time of each
record, so a later re-configuration by vLLM (its engine processes re-apply
their logging config) is followed.

It stands back wherever someone else decided: when vLLM is told not to
configure logging (``VLLM_CONFIGURE_LOGGING=0``), when the ``kvtriton``
logger already has a handler, or when the root logger has one (an
application that configured logging already sees kvtriton's lines). It never
stops propagation, so handlers added later (pytest's ``caplog``) still get
the records.
"""

from __future__ import annotations

import logging

from typing_extensions import override

KVTRITON_LOGGER = "kvtriton"
VLLM_LOGGER = "vllm"


class VLLMForwardingHandler(logging.Handler):
    """Hands each record to the handlers the ``vllm`` logger has now (each applying its own level)."""

    @override
    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(VLLM_LOGGER).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def attach_to_vllm_logging() -> bool:
    """Route the ``kvtriton`` logger's records to vLLM's handlers, at vLLM's level; whether it did (see the module doc)."""
    from kvtriton.integrations.vllm._surface import vllm_configures_logging

    kvtriton_logger = logging.getLogger(KVTRITON_LOGGER)
    if any(isinstance(handler, VLLMForwardingHandler) for handler in kvtriton_logger.handlers):
        return True
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    if (
        not vllm_configures_logging()
        or not vllm_logger.handlers
        or kvtriton_logger.handlers
        or logging.getLogger().handlers
    ):
        return False
    if kvtriton_logger.level == logging.NOTSET:
        kvtriton_logger.setLevel(vllm_logger.getEffectiveLevel())
    kvtriton_logger.addHandler(VLLMForwardingHandler())
    return True
