"""The ``secondary_tiers`` entries of the tiered spec, checked at start-up before vLLM builds a tier.

Each entry names a tier type vLLM's ``SecondaryTierFactory`` resolves (a
built-in such as ``fs``, or a ``module_path`` such as Mooncake's); this module
resolves it the same way, says which package a built-in tier needs when it is
missing, and checks every key the entry gives against the tier class's
constructor (unknown keys with the closest known one, JSON types, thread
counts within 1..:data:`MAX_TIER_THREADS`, ``locality``'s choices, the
backpressure settings), so a typo stops the server naming the entry and the
key instead of failing later inside the tier. A tier that fails while it is
built has the threads it started stopped (:func:`release_half_built`) and its
error restated naming the tier (:func:`tier_failure`).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import threading
from collections.abc import Collection, Mapping
from typing import Any, cast

from kvtriton._int_argument import check_int
from kvtriton._private_files import tier_root_problem
from kvtriton.integrations.vllm._surface import (
    FACTORY_ARGUMENTS,
    FACTORY_KEYS,
    TIER_CLASS_REFUSED,
    BackpressureDetector,
    BackpressurePolicy,
    Locality,
    SecondaryTierFactory,
    SecondaryTierManager,
    backpressure_class_problem,
)

logger = logging.getLogger(__name__)


_TIER_PACKAGES: dict[str, tuple[str, str]] = {
    "obj": ("nixl", "pip install nixl (NIXL with its OBJ plugin)"),
    "p2p": ("nixl", "pip install nixl"),
    "kvcr": ("kvcr", "pip install kvcr"),
}
"""Built-in tier types whose manager needs a package vLLM does not install, with how to get it."""


def tier_label(index: int, tier_config: object) -> str:
    kind = cast("dict[str, object]", tier_config).get("type") if isinstance(tier_config, dict) else None
    return f"secondary_tiers[{index}] (type {kind!r})"


_SIMPLE_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "None": ((type(None),), "null"),
}
"""The JSON value types a tier parameter annotated with these names takes (``int`` excludes ``bool``), and in words."""


def _json_types(annotation: object) -> tuple[tuple[type, ...], str] | None:
    """The value types a tier parameter's annotation allows, and their description, for ``int``, ``float``,
    ``bool``, ``str`` and their ``X | None``; None for any other annotation (not checked: the constructor judges it).

    Annotations are often strings (``from __future__ import annotations``), so their text is read rather than
    evaluated: evaluating would import the names a tier module keeps under ``TYPE_CHECKING``.
    """
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    accepted: tuple[type, ...] = ()
    words: list[str] = []
    for part in text.split("|"):
        simple = _SIMPLE_TYPES.get(part.strip())
        if simple is None:
            return None
        accepted += simple[0]
        words.append(simple[1])
    return accepted, " or ".join(words)


MAX_TIER_THREADS = 256
"""The most I/O threads one thread-count key of a tier may ask for (:data:`THREAD_COUNT_KEYS`).

vLLM's fs tier defaults to 16 readers and 16 writers; past a few hundred,
threads only queue on the same disk. Each is a thread of the engine core, and
a count in the tens of thousands exhausts the process's threads: vLLM's fs
tier then fails with a bare ``RuntimeError: can't start new thread``.
"""

THREAD_COUNT_KEYS = frozenset({"n_read_threads", "n_write_threads", "io_threads", "num_threads"})
"""The keys by which a tier's constructor takes a number of threads: vLLM's fs tier (``n_read_threads``,
``n_write_threads``), its obj tier and kvtriton's remote tiers (``io_threads``), its p2p tier (``num_threads``).
Each must be 1 to :data:`MAX_TIER_THREADS` (0 would leave the tier's jobs to nobody)."""

LOCALITY_KEY = "locality"
"""The tier key vLLM's fs and obj tiers (and kvtriton's remote tiers) read with ``Locality(value)``: case matters."""


def _check_tier_values(label: str, config: dict[str, Any], parameters: Mapping[str, inspect.Parameter]) -> None:
    """One line naming a tier key whose JSON value has the wrong type (``"n_read_threads": "4"``) or is out of range
    (a thread count, a ``locality``), before the tier is built: the constructor would fail later, in the scheduler,
    with a bare error naming neither."""
    for name, parameter in parameters.items():
        if name not in config:
            continue
        expected = _json_types(parameter.annotation)
        value: object = config[name]
        if expected is not None and type(value) not in expected[0]:
            raise TypeError(f"{label} key {name!r} must be {expected[1]}, got {type(value).__name__} {value!r}")
        if name in THREAD_COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool):
            _check_thread_count(f"{label} key {name!r}", value)
        if name == LOCALITY_KEY and value is not None:
            _check_locality(f"{label} key {name!r}", value)


def _check_thread_count(where: str, value: int) -> None:
    try:
        check_int(where, value, 1, MAX_TIER_THREADS)
    except ValueError as error:
        raise ValueError(
            f"{error}: each is an I/O thread of the engine core (vLLM's fs tier starts 16 of each kind by default)"
        ) from None


def _check_locality(where: str, value: object) -> None:
    valid = [member.value for member in Locality]
    if value not in valid:
        raise ValueError(f"{where} must be one of {valid} (upper case) or null, got {value!r}")


def check_backpressure(where: str, value: object) -> None:
    """vLLM merges ``backpressure`` into a dict field by field: anything but a mapping fails with a bare error, and a
    ``backpressure_cls`` or ``policy_cls`` vLLM cannot import fails in the scheduler with a raw AttributeError."""
    if value is not None and not isinstance(value, dict):
        raise ValueError(
            f"{where} must be a mapping of back-pressure settings (with 'backpressure_cls', see vLLM's "
            f"tiering/backpressure.py), got {type(value).__name__} {value!r}"
        )
    settings = cast("dict[str, object]", value or {})
    for key, base in (("backpressure_cls", BackpressureDetector), ("policy_cls", BackpressurePolicy)):
        problem = backpressure_class_problem(settings[key], base) if key in settings else None
        if problem is not None:
            raise ValueError(f"{where} key {key!r}={settings[key]!r} {problem}")


def check_poll_interval(extra_config: Mapping[str, object]) -> None:
    """``tier_poll_interval_s``: seconds >= 0 (0 turns vLLM's tier-poll thread off); vLLM itself takes any float."""
    if "tier_poll_interval_s" not in extra_config:
        return
    raw = extra_config["tier_poll_interval_s"]
    value = float("nan")
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            pass
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            "kv_connector_extra_config['tier_poll_interval_s'] must be a number of seconds >= 0 (0 turns vLLM's "
            f"tier-poll thread off), got {type(raw).__name__} {raw!r}"
        )


def _is_thread_start_failure(error: BaseException) -> bool:
    """Whether ``error`` is Python's refusal to start one more thread (the process or its cgroup is at its limit)."""
    return isinstance(error, RuntimeError) and "start new thread" in str(error)


def release_half_built(error: BaseException, threads_before: Collection[threading.Thread]) -> list[threading.Thread]:
    """Stop the threads a failed tier constructor started and left running; returns any still running after.

    A constructor that starts threads one by one (vLLM's fs tier, in its
    thread pool's ``__init__``) leaves the ones it started running when a
    later one fails, each waiting for jobs that never come, and nobody holds
    the pool to stop them: in a process short of threads every later spec
    then fails too. The objects it was building are still reachable from the
    error's traceback (each ``__init__`` frame below the caller's holds its
    ``self``), so each one's ``shutdown()`` is called, innermost first, until
    no thread started since ``threads_before`` is left; when a half-built
    object's own ``shutdown()`` fails (it reads an attribute never set), the
    ``shutdown()`` of each object it already holds is called instead. Nothing
    is called when the build left no thread running.
    """
    before = set(threads_before)

    def left_running() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread not in before]

    if not left_running():
        return []
    for half_built in reversed(_objects_under_construction(error)):
        if not _shut_down(half_built):
            for part in list(vars(half_built).values()) if hasattr(half_built, "__dict__") else []:
                _shut_down(part)
        if not left_running():
            return []
    return left_running()


def _objects_under_construction(error: BaseException) -> list[object]:
    """The ``self`` of every ``__init__`` that ``error`` ran through below the frame that caught it, outermost first."""
    found: list[object] = []
    frames = error.__traceback__.tb_next if error.__traceback__ is not None else None
    while frames is not None:
        frame = frames.tb_frame
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            found.append(frame.f_locals["self"])
        frames = frames.tb_next
    return found


def _shut_down(part: object) -> bool:
    """Call ``part.shutdown()`` if it has one; whether it ran without an error (a thread is no part to shut down)."""
    shutdown = getattr(part, "shutdown", None)
    if isinstance(part, threading.Thread) or not callable(shutdown):
        return False
    try:
        shutdown()
    except Exception:
        logger.debug("shutting down the half-built %s failed", type(part).__name__, exc_info=True)
        return False
    return True


def tier_failure(
    label: str, config: Mapping[str, Any], error: Exception, *, threads_left: Collection[threading.Thread] = ()
) -> Exception:
    """``error``, raised while vLLM built a tier, restated with the tier and (for a path) the key it came from.

    ``threads_left``: what :func:`release_half_built` could not stop, named so the operator knows the process is
    short of them.
    """
    if _is_thread_start_failure(error):
        counts = ", ".join(f"{key}={config[key]!r}" for key in sorted(THREAD_COUNT_KEYS) if key in config)
        left = f"; {len(threads_left)} thread(s) it started are still running" if threads_left else ""
        return RuntimeError(
            f"{label}: the engine core cannot start the tier's I/O threads ({error}{'; ' + counts if counts else ''})"
            f"{left}; lower the tier's thread counts, or raise the process's thread limit (ulimit -u, or the "
            f"container's pids limit)"
        )
    if isinstance(error, OSError):
        failed = os.fsdecode(error.filename) if isinstance(error.filename, (str, bytes)) else None
        keys = [
            key
            for key, value in config.items()
            if isinstance(value, str)
            and value
            and failed is not None
            and (failed == value or failed.startswith(value.rstrip("/") + "/"))
        ]
        where = f"{label} key {keys[0]!r}={config[keys[0]]!r}" if keys else label
        return ValueError(f"{where}: the tier cannot use it ({error.strerror or error}: {failed or '?'})")
    if isinstance(error, ImportError):
        return ImportError(f"{label}: {error}")
    if isinstance(error, TypeError):
        return TypeError(f"{label}: {error}")
    if isinstance(error, RuntimeError):
        return RuntimeError(f"{label}: {error}")
    return ValueError(f"{label}: {error}")


def _check_tier_keys(label: str, config: dict[str, Any], tier_cls: type[SecondaryTierManager]) -> None:
    """One line naming a missing or unknown key of a tier's config, instead of the constructor's raw TypeError."""
    try:
        parameters = inspect.signature(tier_cls.__init__).parameters
    except (TypeError, ValueError):
        return
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    missing = [
        name
        for name, parameter in parameters.items()
        if name not in FACTORY_ARGUMENTS
        and parameter.default is inspect.Parameter.empty
        and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name not in config
    ]
    if missing:
        raise ValueError(f"{label} is missing the required key {missing[0]!r} ({tier_cls.__name__} needs it)")
    check_backpressure(f"{label} key 'backpressure'", config.get("backpressure"))
    _check_tier_values(label, config, {name: p for name, p in parameters.items() if name not in FACTORY_ARGUMENTS})
    if takes_any:
        return
    accepted = set(parameters) - FACTORY_ARGUMENTS
    unknown = sorted(key for key in config if key not in accepted and key not in FACTORY_KEYS)
    if unknown:
        raise ValueError(f"{label} has unknown key {unknown[0]!r}; {tier_cls.__name__} takes {sorted(accepted)}")


def resolve_tier(index: int, tier_config: object) -> type[SecondaryTierManager]:
    """The manager class of one secondary tier, or an error saying what to fix."""
    label = tier_label(index, tier_config)
    if not isinstance(tier_config, dict):
        raise ValueError(f"secondary_tiers[{index}] must be a mapping with a 'type', got {tier_config!r}")
    config = cast("dict[str, Any]", tier_config)
    kind = config.get("type")
    module_path = config.get("module_path")
    try:
        tier_cls = SecondaryTierFactory.get_tier_class(config)  # pyright: ignore[reportUnknownMemberType] -- vLLM annotates tier configs as a bare dict
    except ModuleNotFoundError as error:
        missing = error.name or str(error)
        if module_path is not None and (missing == module_path or str(module_path).startswith(missing + ".")):
            raise ImportError(
                f"{label}: module_path {module_path!r} cannot be imported ({error}); install the package that "
                f"provides it or fix the path"
            ) from error
        hint = _TIER_PACKAGES.get(str(kind), (missing, f"pip install {missing}"))[1]
        raise ImportError(f"{label} needs the Python package {missing!r}, which is not installed: {hint}") from error
    except AttributeError as error:
        raise ImportError(f"{label}: module {module_path!r} has no class {kind!r} ({error})") from error
    except TIER_CLASS_REFUSED as error:
        raise TypeError(f"{label}: {module_path}.{kind} is not a vLLM SecondaryTierManager subclass") from error
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from error
    package = _TIER_PACKAGES.get(str(kind))
    if package is not None and module_path is None and importlib.util.find_spec(package[0]) is None:
        raise ImportError(
            f"{label} needs the Python package {package[0]!r}, which is not installed: {package[1]}; "
            "or remove this tier from secondary_tiers"
        )
    _check_tier_keys(label, config, tier_cls)
    unusable_root = tier_root_problem(config)
    if unusable_root is not None:
        raise ValueError(f"{label} {unusable_root}")
    return tier_cls
