"""The secondary tiers the simulator models, by name: the one place a tier model is registered.

``kvtriton simulate --tier NAME[:SIZE]`` takes its choices, its help and its
errors from :data:`TIER_MODELS`; a :class:`TierSpec` (one ``--tier`` value)
builds its store, sizes its objects and writes its ``secondary_tiers`` entry
from its :class:`TierModel`, and the command words its table heading and its
answer from the same entry. A new backend is a store model (a
:class:`~kvtriton.sim._secondary_tier.SecondaryTier`, beside
:class:`~kvtriton.sim._secondary_tier.FsTier` and
:class:`~kvtriton.sim._secondary_tier.MooncakePool`) and one entry here;
docs/simulate.md ("Adding a tier model") walks through it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtriton._integrity import SEAL_BYTES
from kvtriton.sim._geometry import ModelGeometry, check_tier_bytes, format_bytes, parse_capacity
from kvtriton.sim._secondary_tier import (
    MOONCAKE_EVICTION_RATIO,
    MOONCAKE_HIGH_WATERMARK,
    FsTier,
    MooncakePool,
    SecondaryTier,
)


@dataclass(frozen=True, slots=True)
class TierModel:
    """One kind of secondary tier: how the simulator builds it, sizes it, configures it in vLLM and words it."""

    name: str
    """The ``--tier`` name (lower case), :attr:`TierSpec.kind` and the store's ``kind``."""
    help: str
    """What ``--tier NAME`` models, in its help: how the tier stores and whether it evicts."""
    heading: str
    """The tier as the tiered table's heading names it."""
    store: Callable[[int | None], SecondaryTier]
    """An empty store holding at most the given number of objects (None: the tier has no capacity)."""
    vllm_config: Mapping[str, object]
    """The tier's ``secondary_tiers`` entry for vLLM; values in angle brackets are the deployment's to fill in."""
    bought_as: str
    """The tier of ``{size}`` as the answer names it: what is bought (a pool's capacity, or the disk filled)."""
    deployment: str
    """The answer's line on what to provision for ``{size}`` of this tier."""
    sized: bool = False
    """True: the tier has a capacity (``--tier NAME:SIZE``, or ``NAME`` with ``--tier-sizes`` to sweep it) and the
    planner prices that; False: it never evicts and is priced by what it fills over the trace."""
    object_overhead_bytes: int = 0
    """Bytes each stored chunk carries beyond the tiered region's chunk (Mooncake's value: its own seal)."""


def _fs_store(objects: int | None) -> SecondaryTier:
    del objects  # a file per chunk: no capacity to size
    return FsTier()


def _mooncake_store(objects: int | None) -> SecondaryTier:
    if objects is None:
        raise ValueError("a Mooncake pool needs a size: give --tier mooncake:SIZE or sweep it with --tier-sizes")
    return MooncakePool(objects)


TIER_MODELS: dict[str, TierModel] = {
    model.name: model
    for model in (
        TierModel(
            name="fs",
            help="vLLM's, a file per chunk, never evicts: the planner reports the disk it fills",
            heading="vLLM's fs tier (no capacity, never evicts: its column is the disk it filled)",
            store=_fs_store,
            vllm_config={"type": "fs", "root_dir": "<a directory on local NVMe>"},
            bought_as="an fs tier that fills {size} over the trace",
            deployment=(
                "disk:      {size} under root_dir after this trace; fs never evicts,"
                " so it keeps growing with every new prefix (clear it yourself)"
            ),
        ),
        TierModel(
            name="mooncake",
            help="a Mooncake Store pool of SIZE, evicting as its master does",
            heading=(
                f"a Mooncake Store pool (its master evicts {MOONCAKE_EVICTION_RATIO:.0%} of the objects, least"
                f" recently used first, past {MOONCAKE_HIGH_WATERMARK:.0%} full)"
            ),
            store=_mooncake_store,
            vllm_config={
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": "<mooncake_master host:port>",
            },
            bought_as="a Mooncake pool of {size}",
            deployment=(
                "pool:      the holders' --global_segment_size adding up to {size}"
                ' (docs/tiers.md, "Deploying Mooncake Store")'
            ),
            sized=True,
            object_overhead_bytes=SEAL_BYTES,
        ),
    )
}
"""Every tier ``--tier`` takes, in the order the command lists them. Add an entry to model a new backend."""


def tier_names() -> list[str]:
    """The ``--tier`` names, in the registry's order."""
    return list(TIER_MODELS)


def _spoken(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``: a choice as an error message says it."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def tier_choices() -> str:
    """The ``--tier`` names as an error message says them: ``fs or mooncake``."""
    return _spoken(tier_names())


def tier_metavar() -> str:
    """``--tier``'s metavar: every name, ``[:SIZE]`` after those with a capacity (``fs|mooncake[:SIZE]``)."""
    return "|".join(f"{model.name}[:SIZE]" if model.sized else model.name for model in TIER_MODELS.values())


def tier_help() -> str:
    """``--tier``'s help: what each registered tier models."""
    each = [
        f"'{model.name}:SIZE' ({model.help}), or '{model.name}' to sweep its size (--tier-sizes)"
        if model.sized
        else f"'{model.name}' ({model.help})"
        for model in TIER_MODELS.values()
    ]
    return f"the second tier: {', '.join(each)}"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A ``--tier`` value: a registered tier's name, and the size of one that has a capacity (None: unsized)."""

    kind: str
    capacity_bytes: int | None = None
    """The tier's size (None for a tier without capacity, or one whose size is still to be swept)."""

    def __post_init__(self) -> None:
        if self.kind not in TIER_MODELS:
            raise ValueError(f"kind must be one of {tier_names()}, got {self.kind!r}")

    @property
    def model(self) -> TierModel:
        return TIER_MODELS[self.kind]

    def object_bytes(self, geometry: ModelGeometry) -> int:
        """What one chunk takes in the tier: the region's sealed chunk, plus what the tier's value adds."""
        return geometry.tiered_chunk_bytes + self.model.object_overhead_bytes

    def build(self, geometry: ModelGeometry) -> SecondaryTier:
        """An empty tier of this kind for ``geometry``'s chunks; ValueError when its size holds none."""
        if self.capacity_bytes is None:
            return self.model.store(None)
        objects = self.capacity_bytes // self.object_bytes(geometry)
        if objects < 1:
            raise ValueError(
                f"{self.model.bought_as.format(size=format_bytes(self.capacity_bytes))} holds no chunk of"
                f" {format_bytes(self.object_bytes(geometry))}"
            )
        return self.model.store(objects)

    def describe(self) -> str:
        return self.kind if self.capacity_bytes is None else f"{self.kind} {format_bytes(self.capacity_bytes)}"


_TIER = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?::\s*(.+?))?\s*$")


def parse_tier(text: str) -> TierSpec:
    """A registered name, any case (``fs``), or with a size where the tier has one (``mooncake:64GiB``)."""
    match = _TIER.match(text)
    model = TIER_MODELS.get(match.group(1).lower()) if match is not None else None
    if match is None or model is None:
        choices: list[str] = []
        for each in TIER_MODELS.values():
            choices += [each.name, f"{each.name}:SIZE"] if each.sized else [each.name]
        sized = [each.name for each in TIER_MODELS.values() if each.sized]
        example = f" (e.g. {sized[0]}:64GiB)" if sized else ""
        raise ValueError(f"tier must be {_spoken(choices)}{example}, got {text!r}")
    size = match.group(2)
    if size is None:
        return TierSpec(model.name)
    if not model.sized:
        raise ValueError(
            f"the {model.name} tier has no capacity (it never evicts): give --tier {model.name}, got {text!r}"
        )
    capacity = parse_capacity(size)
    check_tier_bytes(capacity, size)
    return TierSpec(model.name, capacity)


def tier_extra_config(tier: TierSpec) -> dict[str, object]:
    """The ``secondary_tiers`` entry of ``tier``; the placeholders in angle brackets are the deployment's."""
    return dict(tier.model.vllm_config)
