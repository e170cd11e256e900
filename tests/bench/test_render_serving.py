"""docs/benchmarks.md's serving section and README.md's serving line render from what bench/serving.py writes.

The record here is built by the benchmark's own :func:`bench.serving.report`
from made-up rounds (no server), so the writer and the renderers cannot
drift apart; the committed result file is checked against the docs by
tests/project/test_docs_figures.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.render_docs import RENDERERS, RenderError, Results, render_text
from bench.render_serving import SERVING_RENDERERS, serving_goal_row
from bench.serving import CEILING, FULL_SIZES, LMCACHE, recompute, report, workloads

ROUND_FIGURES = {
    # arm -> round -> workload -> (mean TTFT ms, total tok/s); round 2 is a slow spell for every arm.
    "none": {1: {"prefix-heavy": (1000, 100), "multi-turn": (2000, 80), "no-reuse": (900, 100)},
             2: {"prefix-heavy": (2000, 50), "multi-turn": (3000, 40), "no-reuse": (1800, 50)},
             3: {"prefix-heavy": (1100, 90), "multi-turn": (2100, 75), "no-reuse": (950, 95)}},
    "kvtriton": {1: {"prefix-heavy": (600, 150), "multi-turn": (1500, 100), "no-reuse": (920, 98)},
                 2: {"prefix-heavy": (1200, 75), "multi-turn": (2500, 50), "no-reuse": (1900, 48)},
                 3: {"prefix-heavy": (640, 140), "multi-turn": (1600, 95), "no-reuse": (960, 94)}},
    CEILING: {1: {"prefix-heavy": (500, 160), "multi-turn": (1000, 120), "no-reuse": (900, 100)},
              2: {"prefix-heavy": (1000, 80), "multi-turn": (2000, 60), "no-reuse": (1800, 50)},
              3: {"prefix-heavy": (600, 150), "multi-turn": (1100, 110), "no-reuse": (950, 95)}},
}  # fmt: skip


LMCACHE_FIGURES = {
    # LMCache: slower than kvtriton on prefix-heavy, as fast on multi-turn, as no connector on no-reuse.
    1: {"prefix-heavy": (800, 120), "multi-turn": (1500, 100), "no-reuse": (900, 100)},
    2: {"prefix-heavy": (1600, 60), "multi-turn": (2500, 50), "no-reuse": (1800, 50)},
    3: {"prefix-heavy": (800, 112), "multi-turn": (1600, 95), "no-reuse": (950, 95)},
}
LMCACHE_NOTE = "LMCache 0.5.6 ...; the copy path is the benchmark's, not LMCache's own"

HITS = {"none": (480.0, 0.0), "kvtriton": (480.0, 640.0), CEILING: (1120.0, 0.0), LMCACHE: (480.0, 640.0)}
"""The prompt tokens from the engine's cache and from the connector, by arm (the same every round)."""


def _figures(arm: str, ttft: float, throughput: float) -> dict[str, float]:
    engine, connector = HITS[arm]
    return {"completed": 18.0, "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "mean_tpot_ms": 50.0, "output_throughput": throughput / 40, "total_token_throughput": throughput,
            "request_throughput": 1.0, "duration": 20.0, "prompt_tokens": 2880.0, "engine_cache_hit_tokens": engine,
            "connector_hit_tokens": connector, "computed_tokens": 2880.0 - engine - connector}  # fmt: skip


def _record(tmp_path: Path, *, quick: bool = False, lmcache: bool = False) -> Path:
    figures = {**ROUND_FIGURES, LMCACHE: LMCACHE_FIGURES} if lmcache else ROUND_FIGURES
    runs = {arm: {r: {w: _figures(arm, *pair) for w, pair in by_w.items()} for r, by_w in by_round.items()}
            for arm, by_round in figures.items()}  # fmt: skip
    records = [{"round": r, "arm": arm, "figures": runs[arm][r], "wall_s": 100.0, "load_average_before": [3.5, 3.0, 2.0], "load_average_after": [5.25, 4.0, 3.0]}
               for r in (1, 2, 3) for arm in runs]  # fmt: skip
    args = argparse.Namespace(
        quick=quick, model=None, device="cpu", engine_kv_bytes=24 * 1_474_560, host_bytes=512 << 20
    )
    unavailable = {"vLLM CPU offload": "not available on this platform (CpuPlatform)"}
    if not lmcache:
        unavailable[LMCACHE] = "skipped: LMCache is not installed in this Python"
    payload = report(runs, unavailable, records, sizes=FULL_SIZES, chosen=workloads(FULL_SIZES, tmp_path / "mt.json"),
                     model=tmp_path, args=args, rounds=3, notes={LMCACHE: LMCACHE_NOTE} if lmcache else {})  # fmt: skip
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"machine": {"date": "2026-12-06T16:00:00+00:00", "device_name": "cpu"}, **payload}))
    return tmp_path


def test_every_serving_region_is_a_known_region() -> None:
    assert set(SERVING_RENDERERS) <= set(RENDERERS)
    assert {"serving-table", "serving-ceiling-table", "serving-goals", "serving-summary"} <= set(SERVING_RENDERERS)


def test_the_table_shows_each_median_with_the_range_of_the_rounds(tmp_path: Path) -> None:
    table = SERVING_RENDERERS["serving-table"](Results(_record(tmp_path)))
    assert "| `none` | prefix-heavy | 1,100 (1,000-2,000) | 2,200 (2,000-4,000) | 90 (50-100) |" in table
    assert "| `vLLM CPU offload` | all | not available on this platform (CpuPlatform) |" in table
    # A figure every round agrees on is shown once.
    assert (
        "| `kvtriton` | prefix-heavy | 640 (600-1,200) | 1,280 (1,200-2,400) | 140 (75-150) | 1,760 | 480 | 640 |"
        in table
    )


def test_the_ceiling_table_gives_the_share_of_the_medians_and_each_rounds(tmp_path: Path) -> None:
    table = SERVING_RENDERERS["serving-ceiling-table"](Results(_record(tmp_path)))
    # prefix-heavy medians: none 1100, kvtriton 640, ceiling 600 -> 92% of a 500 ms gain; rounds 80%, 80%, 92%.
    # kvtriton's connector served every token the ceiling's larger cache did not compute.
    assert ("| `kvtriton` | prefix-heavy | 500 (rounds 500 to 1,000) | 92% (rounds 80% to 92%) | 100% | "
            "1.56x (rounds 1.50x to 1.56x) |") in table  # fmt: skip
    # no-reuse: nothing to share.
    assert (
        "| `kvtriton` | no-reuse | - (no reuse) | - (no reuse) | - (no reuse) | 0.99x (rounds 0.96x to 0.99x) |"
        in table
    )
    assert (
        "| `ceiling` | multi-turn | 1,000 (rounds 1,000 to 1,000) | (it is the ceiling) | (it is the ceiling) |"
        in table
    )


def test_goals_and_the_readme_line_say_what_was_met(tmp_path: Path) -> None:
    results = Results(_record(tmp_path))
    goals = SERVING_RENDERERS["serving-goals"](results)
    assert "| prefix-heavy: kvtriton's share of the ceiling's TTFT gain >= 90% | 92% | met |" in goals
    # multi-turn medians: none 2100, kvtriton 1600, ceiling 1100 -> 50%.
    assert "| multi-turn: kvtriton's share of the ceiling's TTFT gain >= 90% | 50% | not met |" in goals
    assert "| no-reuse: kvtriton's throughput >= 0.97x no connector's | 0.99x | met |" in goals
    summary = SERVING_RENDERERS["serving-summary"](results)
    assert summary.startswith(
        "on prefix-heavy load kvtriton served 100% of the prompt tokens the ceiling did not compute and reached "
        "92% (rounds 80% to 92%) of the ceiling's TTFT gain"
    )
    assert summary.endswith("(medians of 3 alternating rounds)")
    goal, measured = serving_goal_row(results)
    assert "90%" in goal and "0.97x" in goal and measured.endswith("(2 of 3 met)")
    setup = SERVING_RENDERERS["serving-setup"](results)
    assert "3 rounds" in setup and "load average 3.5 to 5.2" in setup and "15 minutes in all" in setup


def test_a_region_renders_inside_a_document(tmp_path: Path) -> None:
    text = "Serving: <!-- generated:serving-summary -->old<!-- /generated:serving-summary -->.\n"
    rendered = render_text(text, Results(_record(tmp_path)), "README.md")
    assert "old" not in rendered and "of the ceiling's TTFT gain" in rendered


def test_a_smoke_run_is_never_rendered_as_a_figure(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match="smoke run"):
        SERVING_RENDERERS["serving-summary"](Results(_record(tmp_path, quick=True)))


def test_a_ceiling_gain_some_round_reverses_is_reported_as_noise_not_as_a_share(tmp_path: Path) -> None:
    folder = _record(tmp_path)
    record = json.loads((folder / "serving.json").read_text())
    slow = {**record["runs"][-1]["figures"]["multi-turn"], "mean_ttft_ms": 2500.0}  # round 3's ceiling, now slower
    record["runs"][-1]["figures"]["multi-turn"] = slow
    (folder / "serving.json").write_text(json.dumps(record))
    recompute(folder / "serving.json")
    results = Results(folder)
    assert (
        "| multi-turn: kvtriton's share of the ceiling's TTFT gain >= 90% | the ceiling was not faster than no "
        "connector in every round: its gain is within the noise | not measurable |"
        in SERVING_RENDERERS["serving-goals"](results)
    )
    assert "| `kvtriton` | multi-turn | 100 (rounds -400 to 1,000) | within the noise (" in SERVING_RENDERERS[
        "serving-ceiling-table"](results)  # fmt: skip
    assert (
        "is not measurable (the ceiling's own gain over no connector, 100 (rounds -400 to 1,000) ms, is within"
        in SERVING_RENDERERS["serving-summary"](results)
    )


def test_lmcache_stands_beside_kvtriton_with_its_caveat_and_the_ratios_of_the_paired_rounds(tmp_path: Path) -> None:
    results = Results(_record(tmp_path, lmcache=True))
    table = SERVING_RENDERERS["serving-table"](results)
    assert "| `LMCache` | prefix-heavy | 800 (800-1,600) |" in table
    # The arm's caveat, from the result, under the table: its copy path is not LMCache's own.
    assert table.endswith(f"\n\n* `LMCache`: {LMCACHE_NOTE}")
    versus = SERVING_RENDERERS["serving-versus-lmcache"](results)
    # prefix-heavy medians: kvtriton 640 ms and 140 tok/s, LMCache 800 ms and 112 tok/s; rounds 0.75, 0.75, 0.80.
    assert "| prefix-heavy | 0.80x (rounds 0.75x to 0.80x) | 1.25x (rounds 1.25x to 1.25x) |" in versus
    assert "| no-reuse | 1.01x (rounds 1.01x to 1.06x) | 0.99x (rounds 0.96x to 0.99x) |" in versus
    # A ratio some paired round reverses says nothing of which is faster.
    record = json.loads((tmp_path / "serving.json").read_text())
    record["kvtriton_vs_lmcache"]["multi-turn"]["mean_ttft_ms"] |= {"ratio": 0.9, "min": 0.5, "max": 1.5}
    (tmp_path / "serving.json").write_text(json.dumps(record))
    noisy = Results(tmp_path)
    assert "| multi-turn | within the noise (0.90x of the medians, rounds 0.50x to 1.50x) |" in SERVING_RENDERERS[
        "serving-versus-lmcache"](noisy)  # fmt: skip
    assert "multi-turn 0.90x the TTFT and 1.00x the throughput (within the noise: some round reverses it)" in \
        SERVING_RENDERERS["serving-summary"](noisy)  # fmt: skip
    summary = SERVING_RENDERERS["serving-summary"](results)
    assert "against LMCache in the same server (its CPU copy path the benchmark's): kvtriton had prefix-heavy " \
        "0.80x the TTFT and 1.25x the throughput" in summary  # fmt: skip
    # kvtriton's shares are unchanged by another arm beside it; LMCache gets its own.
    assert "| `LMCache` | prefix-heavy | 500 (rounds 500 to 1,000) | 60% (rounds 40% to 60%) |" in SERVING_RENDERERS[
        "serving-ceiling-table"](results)  # fmt: skip


def test_without_lmcache_the_comparison_says_why_it_is_missing(tmp_path: Path) -> None:
    results = Results(_record(tmp_path))
    assert SERVING_RENDERERS["serving-versus-lmcache"](results) == (
        "LMCache was not measured in this run: skipped: LMCache is not installed in this Python"
    )
    assert "| `LMCache` | all | skipped: LMCache is not installed in this Python |" in SERVING_RENDERERS[
        "serving-table"](results)  # fmt: skip
    assert "LMCache" not in SERVING_RENDERERS["serving-summary"](results)
