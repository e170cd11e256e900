"""pytest plugin run inside vLLM's own tests: kvtriton's classes wherever a test constructs vLLM's.

Loaded with ``-p kvtriton_swap`` by tests/vllm_compat/test_vllm_compat.py, in
a pytest process whose root is vLLM's extracted test tree. With
``KVTRITON_SWAP=1`` in the environment it replaces, as it is loaded (before
any conftest or test module is imported), four
names in vLLM's modules (so ``from vllm... import X`` in a test, at the top of
a file or inside a function, gets the replacement; no test body changes):

* ``CPUOffloadingManager(num_chunks, cache_policy, ...)`` builds
  ``KVTritonOffloadingSpec(config).get_manager()`` for a config holding
  ``num_chunks`` slots with those settings;
* ``CPUPrimaryTierOffloadingManager(num_chunks, mmap_region, ...)`` builds
  kvtriton's primary tier as ``KVTritonTieringOffloadingSpec.get_manager()``
  builds it (:func:`kvtriton.integrations.vllm._tiered_spec.build_primary_tier`), over
  the test's region;
* ``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` are kvtriton's two specs
  (also what vLLM's ``OffloadingSpecFactory`` loads for those two names).

A test's own subclass of a replaced manager class stays vLLM's class (it
exists to change vLLM's behaviour). ``isinstance(x, CPUOffloadingManager)``
holds for kvtriton's manager too. vLLM's own modules keep the classes they
imported (kvtriton is imported first, so it builds vLLM's classes where it
means to).

The same names exist, with the same constructors, in vLLM 0.33 and 0.34; the
arguments are bound by name against the signature of the installed vLLM's
class, so a default that changes between releases is the installed one's.

With or without the swap, ``--kvtriton-not-run=ID`` (repeatable) deselects a
test file or a test (a node id without its parameter suffix, covering every
parametrization) that cannot run on this machine, and ``--kvtriton-report=PATH``
writes every test's outcome as JSON: ``outcomes`` maps each node id to
"passed", "failed" or "skipped" (a failed setup or teardown counts as failed),
``messages`` each failure to its one-line cause, ``not_run`` each
``--kvtriton-not-run`` value to the node ids it deselected, ``constructed``
each swapped manager class to how many kvtriton objects it built, and
``specs`` vLLM's two spec names to the class vLLM's factory loads for them.
At the end of the session it stops any child process a failed test left
running (:func:`_stop_orphaned_children`), so that a run always ends.
"""

from __future__ import annotations

import inspect
import json
import os
from abc import ABCMeta
from collections.abc import Callable
from typing import Any, cast

import pytest

SLOT_BYTES = 64
"""Bytes per GPU block in the configs built for a swapped manager (any size works: no slab is allocated)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvtriton")
    group.addoption("--kvtriton-report", default=None, help="write each test's outcome to this JSON file")
    group.addoption(
        "--kvtriton-not-run",
        action="append",
        default=[],
        help="deselect this test file, or this test (node id without parameters); repeatable",
    )


def _offloading_config(extra_config: dict[str, object], *, enable_events: bool) -> Any:
    from bench.common import offloading_config

    return offloading_config(
        extra_config,
        worker_kv_bytes_per_block=SLOT_BYTES,
        engine_id="vllm-compat",
        model_name="test-model",
        enable_events=enable_events,
        layer_name="layer",
    )


def _bound(original: type, args: tuple[object, ...], kwargs: dict[str, object]) -> dict[str, Any]:
    """The arguments of a call to ``original(...)`` by name, defaults filled in (vLLM's defaults, not ours)."""
    signature = inspect.signature(original.__init__)
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))
    return arguments


def _policy_settings(arguments: dict[str, Any]) -> dict[str, object]:
    extra: dict[str, object] = {"eviction_policy": arguments["cache_policy"]}
    if arguments.get("cache_policy_module_path") is not None:
        extra["cache_policy_module_path"] = arguments["cache_policy_module_path"]
    return extra


def _kvtriton_cpu_manager(original: type) -> Callable[..., object]:
    def build(*args: object, **kwargs: object) -> object:
        from kvtriton.integrations.vllm import KVTritonOffloadingSpec

        arguments = _bound(original, args, kwargs)
        extra: dict[str, object] = {
            "spec_name": "KVTritonOffloadingSpec",
            "spec_module_path": "kvtriton.integrations.vllm",
            "cpu_bytes_to_use": arguments["num_chunks"] * SLOT_BYTES,
            "store_threshold": arguments["store_threshold"],
            "max_tracker_size": arguments["max_tracker_size"],
            **_policy_settings(arguments),
        }
        spec = KVTritonOffloadingSpec(_offloading_config(extra, enable_events=bool(arguments["enable_events"])))
        if arguments["info"] is not None:
            spec.cpu_info = arguments["info"]
        return spec.get_manager()

    return build


class _TestRegion:
    """A test's ``mmap_region`` (vLLM's SharedOffloadRegion or a stand-in) as the region kvtriton's primary tier reads."""

    def __init__(self, mmap_region: Any) -> None:
        self._mmap_region = mmap_region

    def chunk_memoryview(self) -> memoryview:
        return cast("memoryview", self._mmap_region.create_kv_memoryview())

    def close(self) -> None:
        self._mmap_region.cleanup()


def _kvtriton_primary_tier(original: type) -> Callable[..., object]:
    def build(*args: object, **kwargs: object) -> object:
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo

        from kvtriton.integrations.vllm._tiered_spec import build_primary_tier

        arguments = _bound(original, args, kwargs)
        info = arguments["info"]
        if info is None:
            config = _offloading_config({}, enable_events=False)
            info = CPUOffloadingInfo.from_config(config, arguments["num_chunks"], SLOT_BYTES)
        return build_primary_tier(
            arguments["num_chunks"],
            _TestRegion(arguments["mmap_region"]),
            eviction_policy=str(arguments["cache_policy"]),
            cache_policy_module_path=arguments["cache_policy_module_path"],
            enable_events=bool(arguments["enable_events"]),
            info=info,
        )

    return build


_constructed: dict[str, int] = {}
"""How many kvtriton objects each swapped vLLM class name built (the report shows the swap took effect)."""


class _SwapMeta(ABCMeta):
    """Constructing the swap class itself builds kvtriton's object; its subclasses are vLLM's classes as usual."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        build = cast("Callable[..., object] | None", cls.__dict__.get("_kvtriton_build"))
        if build is None:
            return super().__call__(*args, **kwargs)
        _constructed[cls.__name__] = _constructed.get(cls.__name__, 0) + 1
        return build(*args, **kwargs)

    def __instancecheck__(cls, instance: object) -> bool:
        extra = cast("tuple[type, ...]", cls.__dict__.get("_kvtriton_types", ()))
        return super().__instancecheck__(instance) or isinstance(instance, extra)


def _swap_class(original: type, build: Callable[..., object], kvtriton_types: tuple[type, ...]) -> type:
    return _SwapMeta(
        original.__name__,
        (original,),
        {
            "_kvtriton_build": staticmethod(build),
            "_kvtriton_types": kvtriton_types,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__doc__": original.__doc__,
        },
    )


def _swap() -> None:
    # kvtriton and every vLLM module it uses first: they keep vLLM's classes.
    import vllm.v1.kv_offload.cpu.manager as cpu_manager
    import vllm.v1.kv_offload.cpu.spec as cpu_spec
    import vllm.v1.kv_offload.factory as spec_factory
    import vllm.v1.kv_offload.tiering.manager as tiering_manager
    import vllm.v1.kv_offload.tiering.spec as tiering_spec

    import kvtriton.integrations.vllm as kvtriton_vllm
    import kvtriton.integrations.vllm._tiered_spec as kvtriton_tiering
    from kvtriton.integrations.vllm._manager import VLLMOffloadingManager

    assert "TieringOffloadingSpec" in spec_factory.OffloadingSpecFactory._registry  # pyright: ignore[reportPrivateUsage] -- the names are registered (lazily loaded) before the swap
    cpu = cpu_manager.CPUOffloadingManager
    setattr(
        cpu_manager,
        "CPUOffloadingManager",
        _swap_class(cpu, _kvtriton_cpu_manager(cpu), (VLLMOffloadingManager,)),
    )
    primary = tiering_manager.CPUPrimaryTierOffloadingManager
    setattr(
        tiering_manager,
        "CPUPrimaryTierOffloadingManager",
        _swap_class(primary, _kvtriton_primary_tier(primary), (kvtriton_tiering.KVTritonPrimaryTier,)),
    )
    setattr(cpu_spec, "CPUOffloadingSpec", kvtriton_vllm.KVTritonOffloadingSpec)
    setattr(tiering_spec, "TieringOffloadingSpec", kvtriton_tiering.KVTritonTieringOffloadingSpec)


_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}
_not_run: dict[str, list[str]] = {}
"""Each ``--kvtriton-not-run`` value and the node ids it deselected."""


def _not_run_entry(nodeid: str, entries: list[str]) -> str | None:
    """The ``--kvtriton-not-run`` entry naming ``nodeid`` (its file, or the test without parameters), if any."""
    test = nodeid.split("[", 1)[0]
    path = nodeid.split("::", 1)[0]
    return next((entry for entry in entries if entry in (test, path)), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = cast("list[str]", config.getoption("--kvtriton-not-run"))
    _not_run.update({entry: [] for entry in entries})
    kept: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        entry = _not_run_entry(item.nodeid, entries)
        if entry is None:
            kept.append(item)
        else:
            _not_run[entry].append(item.nodeid)
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _crash_message(report: pytest.TestReport | pytest.CollectReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None)
    text = message if isinstance(message, str) else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        if _outcomes.get(report.nodeid) != "failed":
            _messages[report.nodeid] = f"{report.when}: {_crash_message(report)}"
        _outcomes[report.nodeid] = "failed"
    elif report.when == "call" and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = report.outcome
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        _messages[report.nodeid] = f"collect: {_crash_message(report)}"


def _spec_classes() -> dict[str, str]:
    """The class vLLM's OffloadingSpecFactory loads for each of vLLM's two spec names."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return {
        name: OffloadingSpecFactory.get_spec_cls({"spec_name": name}).__qualname__
        for name in ("CPUOffloadingSpec", "TieringOffloadingSpec")
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kvtriton-report")
    if path:
        report = {
            "outcomes": _outcomes,
            "messages": _messages,
            "not_run": _not_run,
            "constructed": _constructed,
            "specs": _spec_classes(),
        }
        with open(path, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1, sort_keys=True)
    _stop_orphaned_children()


def _stop_orphaned_children() -> None:
    """Stop the child processes a failed test left running, so the run ends instead of hanging at exit.

    A few of vLLM's tests start worker processes that block until the test
    releases them (``test_multiprocess_race_construct_and_write``: four
    spawned children wait on a queue its last lines fill). When such a test
    fails first (its 30 s wait for children that import torch and vLLM, on a
    loaded machine), the children wait forever, and ``multiprocessing`` joins
    every non-daemon child at exit: the whole run would hang until the
    caller's timeout and report nothing. The failure itself is already
    recorded (and run again on its own by the caller).
    """
    import multiprocessing

    orphans = multiprocessing.active_children()
    for child in orphans:
        child.terminate()
    for child in orphans:
        child.join(timeout=10)
    if orphans:
        print(f"kvtriton_swap: stopped {len(orphans)} child process(es) a test left running", flush=True)


if os.environ.get("KVTRITON_SWAP") == "1":
    _swap()
