"""The serving figures of docs/benchmarks.md and README.md, from ``bench/results/serving.json`` (bench/serving.py).

Every figure is the median of the benchmark's alternating rounds with its
range (``2,694 (2,500-3,100)``); shares of the ceiling's gain and ratios to no
connector are of the medians, their range of the paired rounds (each round
runs every arm once, so a round's arms saw the same machine).
``render_docs`` merges :data:`SERVING_RENDERERS` into its ``RENDERERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

from bench.render_results import JSONObject, RenderError, Results

__all__ = ["SERVING_RENDERERS", "serving_goal_row"]

NAME = "serving"
"""The result file (``bench/results/serving.json``)."""
LMCACHE = "LMCache"
"""The LMCache arm's name (bench/serving.py's ``LMCACHE``; not imported, so that rendering needs no vLLM)."""


def _obj(value: object, where: str) -> JSONObject:
    if not isinstance(value, dict):
        raise RenderError(f"serving.json: expected an object at {where}, got {value!r:.60}")
    return cast(JSONObject, value)


def _num(record: Mapping[str, object], key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RenderError(f"serving.json: expected a number at {where}.{key}, got {value!r:.60}")
    return float(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    rule = ["---:" if letter == "r" else "---" for letter in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _spread(figure: Mapping[str, object], where: str, form: str = "{:,.0f}") -> str:
    """``median (min-max)``; the median alone where every round agrees to the shown digits."""
    median, low, high = (form.format(_num(figure, key, where)) for key in ("median", "min", "max"))
    return median if low == high else f"{median} ({low}-{high})"


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def _share(entry: Mapping[str, object], where: str) -> str:
    """A ceiling share (of the medians) and the paired rounds' range, or why there is none."""
    share = entry.get("share")
    if share is None:
        return "none (the ceiling gained nothing)"
    value = _num(entry, "share", where)
    gain = entry.get("gain_ms")
    if isinstance(gain, dict) and _num(cast(JSONObject, gain), "min", where) <= 0:
        return f"within the noise ({_pct(value)} of the medians)"
    low, high = entry.get("min"), entry.get("max")
    if low is None or high is None:
        return _pct(value)
    return f"{_pct(value)} (rounds {_pct(_num(entry, 'min', where))} to {_pct(_num(entry, 'max', where))})"


def _ratio(entry: Mapping[str, object], where: str) -> str:
    value, low, high = (_num(entry, key, where) for key in ("ratio", "min", "max"))
    return f"{value:.2f}x (rounds {low:.2f}x to {high:.2f}x)"


def _record(results: Results) -> JSONObject:
    record = results(NAME)
    if record.get("smoke_run"):
        raise RenderError("serving.json is a smoke run (--quick): its figures carry no claim; run the full benchmark")
    return record


def _arms(record: JSONObject) -> dict[str, JSONObject | str]:
    """The arms of the result, each its figures by workload or the sentence saying why it did not run."""
    return {
        arm: value if isinstance(value, str) else _obj(value, f"results.{arm}")
        for arm, value in _obj(record.get("results"), "results").items()
    }


def serving_table(results: Results) -> str:
    """Per arm and workload: the mean and p99 TTFT, the total throughput, and the prompt tokens by source."""
    record = _record(results)
    rows: list[list[str]] = []
    for arm, by_workload in _arms(record).items():
        if isinstance(by_workload, str):
            rows.append([f"`{arm}`", "all", by_workload, "", "", "", "", ""])
            continue
        for workload, value in by_workload.items():
            where = f"results.{arm}.{workload}"
            f = _obj(value, where)

            def cell(metric: str, form: str = "{:,.0f}", f: JSONObject = f, where: str = where) -> str:
                return _spread(_obj(f.get(metric), f"{where}.{metric}"), f"{where}.{metric}", form)

            rows.append(
                [
                    f"`{arm}`",
                    workload,
                    cell("mean_ttft_ms"),
                    cell("p99_ttft_ms"),
                    cell("total_token_throughput"),
                    cell("computed_tokens"),
                    cell("engine_cache_hit_tokens"),
                    cell("connector_hit_tokens"),
                ]
            )
    headers = [
        "arm",
        "workload",
        "mean TTFT (ms)",
        "p99 TTFT (ms)",
        "total tok/s",
        "prompt tokens computed",
        "from the engine's cache",
        "from the connector",
    ]
    return _table(headers, rows, "llrrrrrr") + _notes(record)


def _notes(record: JSONObject) -> str:
    """What the result says a reader must know about an arm (its caveat), one line each, under the table."""
    notes = record.get("arm_notes")
    if not isinstance(notes, dict) or not notes:
        return ""
    lines = [f"* `{arm}`: {note}" for arm, note in cast(JSONObject, notes).items()]
    return "\n\n" + "\n".join(lines)


def _versus(record: JSONObject) -> JSONObject:
    return _obj(record.get("kvtriton_vs_lmcache", {}), "kvtriton_vs_lmcache")


def _lmcache_absent(record: JSONObject) -> str:
    """Why the result has no LMCache figures: the arm's own line (skipped), or that it was not asked for."""
    reason = _obj(record.get("results"), "results").get(LMCACHE)
    return (
        f"LMCache was not measured in this run: {reason}"
        if isinstance(reason, str)
        else ("LMCache was not measured in this run (run `bench/serving.py` with its LMCache arm)")
    )


def _reversed(entry: Mapping[str, object], where: str) -> bool:
    """Whether the paired rounds' ratios fall on both sides of 1: one arm ahead in one round, behind in another."""
    if entry.get("min") is None or entry.get("max") is None:
        return False
    return _num(entry, "min", where) < 1 < _num(entry, "max", where)


def _paired(entry: Mapping[str, object], where: str) -> str:
    """A ratio of the medians and the paired rounds' range; "within the noise" where some round reverses it."""
    value = _num(entry, "ratio", where)
    if entry.get("min") is None or entry.get("max") is None:
        return f"{value:.2f}x"
    rounds = f"rounds {_num(entry, 'min', where):.2f}x to {_num(entry, 'max', where):.2f}x"
    if _reversed(entry, where):
        return f"within the noise ({value:.2f}x of the medians, {rounds})"
    return f"{value:.2f}x ({rounds})"


def serving_versus_lmcache(results: Results) -> str:
    """Per workload: kvtriton's mean TTFT and throughput over LMCache's, of the medians and each paired round's."""
    record = _record(results)
    versus = _versus(record)
    if not versus:
        return _lmcache_absent(record)
    rows: list[list[str]] = []
    for workload, value in versus.items():
        by_metric = _obj(value, f"kvtriton_vs_lmcache.{workload}")
        ttft = _obj(by_metric.get("mean_ttft_ms"), f"kvtriton_vs_lmcache.{workload}.mean_ttft_ms")
        tput = _obj(by_metric.get("total_token_throughput"), f"kvtriton_vs_lmcache.{workload}.total_token_throughput")
        rows.append([workload, _paired(ttft, workload), _paired(tput, workload)])
    headers = [
        "workload",
        "kvtriton's mean TTFT / LMCache's (below 1: kvtriton answers sooner)",
        "kvtriton's total throughput / LMCache's (above 1: kvtriton serves more)",
    ]
    return _table(headers, rows, "lrr")


def serving_ceiling_table(results: Results) -> str:
    """Per arm and workload: the ceiling's TTFT gain over no connector, the arm's share of it and of the prompt
    tokens the ceiling did not compute, and the arm's throughput against no connector."""
    record = _record(results)
    shares = _obj(record.get("ceiling_share"), "ceiling_share")
    ratios = _obj(record.get("throughput_vs_none"), "throughput_vs_none")
    rows: list[list[str]] = []
    for arm, by_workload in ratios.items():
        for workload, ratio in _obj(by_workload, f"throughput_vs_none.{arm}").items():
            where = f"{arm}.{workload}"
            entries = [_obj(by_w, "ceiling_share").get(workload) for by_w in shares.values()]
            if not entries or entries[0] is None:
                gain = share = hits = "- (no reuse)"
            else:
                gain = _gain(_obj(_obj(entries[0], where).get("gain_ms"), f"{where}.gain_ms"), where)
                if arm in shares:
                    entry = _obj(_obj(shares[arm], f"ceiling_share.{arm}").get(workload), f"ceiling_share.{where}")
                    share, hits = _share(entry, where), _hit_share(entry, where)
                else:
                    share = hits = "(it is the ceiling)"
            rows.append(
                [f"`{arm}`", workload, gain, share, hits, _ratio(_obj(ratio, f"throughput_vs_none.{where}"), where)]
            )
    headers = [
        "arm",
        "workload",
        "the ceiling's mean-TTFT gain over no connector (ms)",
        "share of the ceiling's TTFT gain",
        "share of the prompt tokens the ceiling did not compute",
        "total throughput vs no connector",
    ]
    return _table(headers, rows, "llrrrr")


def _gain(gain: Mapping[str, object], where: str) -> str:
    of_medians, low, high = (_num(gain, key, where) for key in ("of_medians", "min", "max"))
    return f"{of_medians:,.0f} (rounds {low:,.0f} to {high:,.0f})"


def _hit_share(entry: Mapping[str, object], where: str) -> str:
    if entry.get("hit_tokens_share") is None:
        return "none (the ceiling hit no more)"
    return _pct(_num(entry, "hit_tokens_share", where))


def _verdicts(record: JSONObject) -> list[JSONObject]:
    goals = _obj(record.get("goals"), "goals")
    verdicts = goals.get("verdicts")
    if not isinstance(verdicts, list) or not verdicts:
        raise RenderError("serving.json: no goal verdicts (a run without the ceiling or without kvtriton)")
    return [_obj(v, "goals.verdicts") for v in cast(list[object], verdicts)]


def _verdict_word(verdict: JSONObject) -> str:
    met = verdict.get("met")
    return "met" if met is True else "not met" if met is False else "not measurable"


def serving_goals(results: Results) -> str:
    """The goals, each with the figure measured and met or not (reported, not asserted)."""
    rows: list[list[str]] = []
    for verdict in _verdicts(_record(results)):
        shown = str(verdict.get("reason") or "-") if verdict.get("measured") is None else _measured(verdict)
        rows.append([str(verdict.get("goal")), shown, _verdict_word(verdict)])
    return _table(["goal (kvtriton, medians of the rounds)", "measured", "verdict"], rows, "lrl")


def serving_setup(results: Results) -> str:
    """The run's shape: rounds, requests per workload, cache sizes, and the machine's load while it ran."""
    record = _record(results)
    workloads = _obj(record.get("workloads"), "workloads")
    requests = ", ".join(f"{_num(_obj(w, name), 'num_prompts', name):.0f} {name}" for name, w in workloads.items())
    load = _obj(record.get("load_average_1min"), "load_average_1min")
    runs = record.get("runs")
    minutes = (
        sum(_num(_obj(run, "runs"), "wall_s", "runs") for run in cast(list[object], runs)) / 60
        if isinstance(runs, list)
        else 0.0
    )
    return (
        f"{_num(record, 'rounds', 'rounds'):.0f} rounds, arms alternating, each round a fresh server per arm; "
        f"requests per round: {requests}; {_num(record, 'max_concurrency', 'record'):.0f} at a time; engine KV "
        f"cache {_num(record, 'engine_kv_bytes', 'record') / (1 << 20):.1f} MiB, kvtriton's host slab "
        f"{_num(record, 'host_bytes', 'record') / (1 << 20):.0f} MiB, the ceiling's engine cache "
        f"{_num(record, 'ceiling_engine_kv_bytes', 'record') / (1 << 20):.1f} MiB; the machine's 1-minute load "
        f"average {_num(load, 'min', 'load'):.1f} to {_num(load, 'max', 'load'):.1f} on 2 cores; the servers ran for "
        f"{minutes:.0f} minutes in all"
    )


def serving_summary(results: Results) -> str:
    """One sentence: kvtriton's share of the ceiling's gain on each reuse workload and its no-reuse throughput."""
    record = _record(results)
    parts: list[str] = []
    for verdict in _verdicts(record):
        workload = str(verdict.get("workload"))
        if workload != "no-reuse":
            share = _obj(_obj(_obj(record.get("ceiling_share"), "s").get("kvtriton"), "k").get(workload), workload)
            hits = f"kvtriton served {_hit_share(share, workload)} of the prompt tokens the ceiling did not compute"
            if verdict.get("measured") is None:
                gain = _gain(_obj(share.get("gain_ms"), f"{workload}.gain_ms"), workload)
                parts.append(
                    f"on {workload} load {hits}, and its share of the ceiling's TTFT gain is not measurable "
                    f"(the ceiling's own gain over no connector, {gain} ms, is within the noise)"
                )
            else:
                parts.append(
                    f"on {workload} load {hits} and reached {_share(share, workload)} of the ceiling's TTFT gain"
                )
        elif verdict.get("measured") is None:
            parts.append(f"on {workload} load: not measurable")
        else:
            ratio = _obj(_obj(_obj(record.get("throughput_vs_none"), "t").get("kvtriton"), "k").get(workload), workload)
            parts.append(f"on {workload} load its throughput was {_ratio(ratio, workload)} no connector's")
    versus = _versus(record)
    if versus:
        against = ", ".join(
            f"{workload} {_num(ttft, 'ratio', workload):.2f}x the TTFT and {_num(tput, 'ratio', workload):.2f}x the "
            "throughput"
            + (
                " (within the noise: some round reverses it)"
                if _reversed(ttft, workload) or _reversed(tput, workload)
                else ""
            )
            for workload, value in versus.items()
            for by_metric in [_obj(value, workload)]
            for ttft, tput in [
                (_obj(by_metric.get("mean_ttft_ms"), workload), _obj(by_metric.get("total_token_throughput"), workload))
            ]
        )
        parts.append(f"against LMCache in the same server (its CPU copy path the benchmark's): kvtriton had {against}")
    return f"{'; '.join(parts)} (medians of {_num(record, 'rounds', 'rounds'):.0f} alternating rounds)"


def serving_goal_row(results: Results) -> tuple[str, str]:
    """The goal and the measured verdicts for docs/benchmarks.md's summary table."""
    record = _record(results)
    verdicts = _verdicts(record)
    met = sum(1 for verdict in verdicts if verdict.get("met") is True)
    goals = _obj(record.get("goals"), "goals")
    goal = (
        f"kvtriton >= {_pct(_num(goals, 'ceiling_share', 'goals'))} of the ceiling's TTFT gain (prefix-heavy, "
        f"multi-turn); >= {_num(goals, 'throughput', 'goals'):g}x no connector's throughput (no-reuse)"
    )
    measured = "; ".join(
        f"{verdict.get('workload')}: {_verdict_word(verdict)}"
        + ("" if verdict.get("measured") is None else f" ({_measured(verdict)})")
        for verdict in verdicts
    )
    return goal, f"{measured} ({met} of {len(verdicts)} met)"


def _measured(verdict: JSONObject) -> str:
    value = _num(verdict, "measured", "goals")
    return _pct(value) if verdict.get("workload") != "no-reuse" else f"{value:.2f}x"


SERVING_RENDERERS: dict[str, Callable[[Results], str]] = {
    renderer.__name__.replace("_", "-"): renderer
    for renderer in (
        serving_table,
        serving_ceiling_table,
        serving_versus_lmcache,
        serving_goals,
        serving_setup,
        serving_summary,
    )
}
"""The serving regions, each named after its renderer with dashes."""
