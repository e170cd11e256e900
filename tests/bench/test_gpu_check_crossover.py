"""bench/crossover.py's verdict after every case: a sweep cut off part-way keeps the verdict of what it measured."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pytest

from bench.crossover import Timing, crossover, main, verdict

KiB = 1024


def _timings(sizes: list[int], dma_wins_from: int, patterns: tuple[str, ...] = ("random", "runs")) -> list[Timing]:
    """Both backends and directions at ``sizes``: dma twice as fast from ``dma_wins_from`` on, twice as slow below."""
    timings: list[Timing] = []
    for size in sizes:
        for pattern in patterns:
            for direction in ("store", "load"):
                dma = 1.0 if size >= dma_wins_from else 4.0
                timings.append(Timing("triton", direction, pattern, size, 2.0, 1.0))
                timings.append(Timing("dma", direction, pattern, size, dma, 1.0))
    return timings


def test_the_crossover_is_where_dma_wins_at_every_larger_size() -> None:
    timings = _timings([8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB], dma_wins_from=32 * KiB)
    assert crossover(timings, "triton", "store", "random") == 32 * KiB
    # dma winning at 8 KiB but not at 16 KiB does not make 8 KiB the crossover.
    flipped = [
        Timing("dma", t.direction, t.pattern, t.page_bytes, 1.0, 1.0)
        if (t.page_bytes, t.backend) == (8 * KiB, "dma")
        else t
        for t in timings
    ]
    assert crossover(flipped, "triton", "load", "runs") == 32 * KiB


def test_a_cut_off_sweep_gives_the_verdict_of_the_sizes_it_measured() -> None:
    measured = _timings([8 * KiB, 16 * KiB], dma_wins_from=16 * KiB)
    # The 32 KiB case was cut off after its random pattern: the runs pattern has no 32 KiB row.
    measured += _timings([32 * KiB], dma_wins_from=0, patterns=("random",))
    result = verdict(measured, "triton", ["random", "runs"])
    assert result.crossings == {key: 16 * KiB for key in ("store/random", "store/runs", "load/random", "load/runs")}
    assert result.rules == {"store": 16 * KiB, "load": 16 * KiB}
    assert result.rows["store"] == 'AutoRule("cuda", True, TransferDirection.STORE, 16384, TransferBackend.DMA),'
    assert result.page_sizes == [8 * KiB, 16 * KiB, 32 * KiB]


def test_a_pattern_not_measured_yet_leaves_its_direction_without_a_rule() -> None:
    result = verdict(_timings([8 * KiB], dma_wins_from=0, patterns=("random",)), "triton", ["random", "runs"])
    assert result.crossings == {"store/random": 8 * KiB, "load/random": 8 * KiB}
    assert result.rules == {} and result.rows == {}
    triton_wins = verdict(_timings([8 * KiB], dma_wins_from=64 * KiB), "triton", ["random", "runs"])
    assert triton_wins.rules == {"store": None, "load": None}
    assert triton_wins.rows["load"] == "no dma row for load (triton wins at some size with some pattern)"


@pytest.mark.requires_interpreter
def test_the_json_holds_the_verdict_after_the_first_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.crossover as module

    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path))
    written: list[dict[str, object]] = []
    original = module.write_json

    def keep(name: str, payload: Mapping[str, object]) -> Path:
        written.append(json.loads(json.dumps(payload)))
        return original(name, payload)

    monkeypatch.setattr(module, "write_json", keep)
    args = ["--device", "cpu", "--page-kib", "0.25", "1", "--layers", "1", "--blocks", "16", "--jobs", "1"]
    args += ["--name", "x"]
    assert main(args) == 0
    first = written[0]
    assert first["complete"] is False and first["verdict_page_bytes"] == [256]
    assert set(cast(dict[str, object], first["crossover_page_bytes"])) == {"store/random", "load/random"}
    final = json.loads((tmp_path / "x.json").read_text())
    assert final["complete"] is True and set(final["auto_table_rows"]) == {"store", "load"}
