"""The ``secondary_tiers`` entries of the tiered spec, checked at start-up before vLLM builds a tier.

Each entry names a tier type vLLM's ``SecondaryTierFactory`` resolves (a
built-in such as ``fs``, or a ``module_path`` such as Mooncake's); this module
resolves it the same way, says which package a built-in tier needs when it is
missing, and checks every key the entry gives against the tier class's
constructor (unknown keys with the closest known one, JSON types, the
backpressure settings), so a typo stops the server naming the entry and the
key instead of failing later inside the tier.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
from collections.abc import Mapping
from typing import Any, cast

from kvtriton._private_files import tier_root_problem
from kvtriton.integrations.vllm._surface import (
    FACTORY_ARGUMENTS,
    FACTORY_KEYS,
    TIER_CLASS_REFUSED,
    BackpressureDetector,
    BackpressurePolicy,
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


def _check_tier_values(label: str, config: dict[str, Any], parameters: Mapping[str, inspect.Parameter]) -> None:
    """One line naming a tier key whose JSON value has the wrong type (``"n_read_threads": "4"``), before the tier
    is built: the constructor would fail later, in the scheduler, with a bare TypeError naming neither."""
    for name, parameter in parameters.items():
        if name not in config:
            continue
        expected = _json_types(parameter.annotation)
        value: object = config[name]
        if expected is not None and type(value) not in expected[0]:
            raise TypeError(f"{label} key {name!r} must be {expected[1]}, got {type(value).__name__} {value!r}")


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


def tier_failure(label: str, config: Mapping[str, Any], error: Exception) -> Exception:
    """``error``, raised while vLLM built a tier, restated with the tier and (for a path) the key it came from."""
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
