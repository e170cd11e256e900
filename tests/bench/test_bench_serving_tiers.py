"""The tiered serving benchmark's own code paths, without a server: its arms, its workload, its goals.

The benchmark (``python -m bench.serving_tiers``) starts real servers, and a
Mooncake cluster for its Mooncake arms, for about 20 minutes; these tests pin
what each arm asks vLLM for, that every round's tiers are fresh and stopped,
and the arithmetic of its goals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import bench.serving_tiers as tiers
from bench.serving import CEILING, MultiTurn, multi_turn_prompts
from bench.serving_tiers import (
    ARMS,
    ENCRYPTED,
    FS,
    KVTRITON,
    LMCACHE_DISK,
    MOONCAKE,
    SYNC_LOAD_BUDGET_BYTES,
    TIER_HOST_BYTES,
    WORKLOAD,
    arm_configuration,
    goals,
    working_set_blocks,
)


def transfer_config(arm: str, folder: Path) -> tuple[dict[str, object], dict[str, str]]:
    """``arm``'s ``--kv-transfer-config`` (parsed; empty without one) and the environment it adds."""
    with arm_configuration(arm, folder) as configuration:
        args = list(configuration.serve_args)
        config: dict[str, object] = json.loads(args[args.index("--kv-transfer-config") + 1]) if args else {}
        return config, dict(configuration.env)


def extra(config: Mapping[str, object]) -> dict[str, object]:
    value = config["kv_connector_extra_config"]
    assert isinstance(value, dict)
    return dict(value)  # pyright: ignore[reportUnknownArgumentType] -- parsed JSON


def test_every_kvtriton_arm_has_the_same_host_bytes_and_loads_within_the_step(tmp_path: Path) -> None:
    host, _ = transfer_config(KVTRITON, tmp_path / "host")
    fs, _ = transfer_config(FS, tmp_path / "fs")
    for config, spec in ((host, "KVTritonOffloadingSpec"), (fs, "KVTritonTieringOffloadingSpec")):
        settings = extra(config)
        assert settings["spec_name"] == spec and settings["cpu_bytes_to_use"] == TIER_HOST_BYTES
        assert settings["sync_load_budget_bytes"] == SYNC_LOAD_BUDGET_BYTES
    assert extra(fs)["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path / "fs" / "fs-root")}]


def test_no_connector_and_the_ceiling_differ_only_in_the_engines_cache(tmp_path: Path) -> None:
    with arm_configuration("none", tmp_path / "none") as none, arm_configuration(CEILING, tmp_path / "c") as ceiling:
        assert none.serve_args == ceiling.serve_args == ()
        assert (
            none.extra_engine_kv_bytes
            == 0
            < 2
            * tiers.working_set_blocks(multi_turn_prompts(tiers.TIERED_MULTI_TURN, seed=1))
            * tiers.KV_BYTES_PER_BLOCK
            <= ceiling.extra_engine_kv_bytes
        )


def test_lmcache_keeps_the_same_host_bytes_with_its_disk_behind_them(tmp_path: Path) -> None:
    config, env = transfer_config(LMCACHE_DISK, tmp_path / "lmcache")
    settings = extra(config)
    assert config["kv_connector_module_path"] == "bench.lmcache_cpu_connector"
    assert settings["lmcache.max_local_cpu_size"] == TIER_HOST_BYTES / (1 << 30)
    assert settings["lmcache.local_disk"] == f"file://{tmp_path / 'lmcache' / 'lmcache-disk'}/"
    assert env["PYTHONHASHSEED"] == "0"


@dataclass
class FakeCluster:
    """A Mooncake cluster that records its start and stop."""

    log_dir: Path
    holder_bytes: int = 0
    events: list[str] = field(default_factory=lambda: [])
    master_address: str = "127.0.0.1:5"

    def start(self) -> FakeCluster:
        CLUSTERS.append(self)
        self.events.append("start")
        return self

    def stop(self) -> None:
        self.events.append("stop")


CLUSTERS: list[FakeCluster] = []


@pytest.mark.parametrize("arm", [MOONCAKE, "kvtriton + encrypted Mooncake"])
def test_a_mooncake_arm_gets_a_cluster_of_its_own_stopped_after_it(
    arm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtriton.integrations

    CLUSTERS.clear()
    monkeypatch.setattr(kvtriton.integrations, "MooncakeCluster", FakeCluster)
    config, env = transfer_config(arm, tmp_path / "arm")
    (cluster,) = CLUSTERS
    assert cluster.events == ["start", "stop"] and cluster.holder_bytes == tiers.MOONCAKE_POOL_BYTES
    assert extra(config)["secondary_tiers"] == [
        {"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake",
         "master_server_address": cluster.master_address, "namespace": "bench"}
    ]  # fmt: skip
    if arm in ENCRYPTED:
        assert extra(config)["kvtriton_encryption"] == {"master_key_env": tiers.MASTER_KEY_ENV}
        assert len(bytes.fromhex(env[tiers.MASTER_KEY_ENV])) == 32
    else:
        assert "kvtriton_encryption" not in extra(config) and not env


def test_an_unknown_arm_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arm 'disk'"), arm_configuration("disk", tmp_path / "x"):
        pass


def test_the_working_set_is_several_times_the_host_memory() -> None:
    blocks = working_set_blocks(multi_turn_prompts(tiers.TIERED_MULTI_TURN, seed=1))
    assert blocks >= 3 * (TIER_HOST_BYTES // tiers.KV_BYTES_PER_BLOCK)
    # Each conversation counted once, by its last (longest) prompt.
    two = MultiTurn(conversations=2, turns=3, opening_words=100, user_words=10, reply_words=5)
    prompts = multi_turn_prompts(two, seed=0)
    assert working_set_blocks(prompts) == working_set_blocks(prompts[-2:])


def figures(ttft: float, tput: float, **sources: float) -> dict[str, dict[str, float]]:
    return {WORKLOAD: {"mean_ttft_ms": ttft, "total_token_throughput": tput, **sources}}


def test_goals_say_which_arm_served_from_its_tier_sooner_and_what_encryption_cost() -> None:
    runs = {
        "none": {r: figures(100.0, 50.0) for r in (1, 2, 3)},
        FS: {1: figures(60.0, 80.0, disk_hit_tokens=64.0), 2: figures(90.0, 70.0, disk_hit_tokens=64.0),
             3: figures(101.0, 49.0, disk_hit_tokens=64.0)},
        MOONCAKE: {r: figures(50.0, 90.0, external_unspecified_hit_tokens=96.0) for r in (1, 2, 3)},
        "kvtriton + encrypted Mooncake": {r: figures(51.0, 88.0, external_unspecified_hit_tokens=96.0) for r in (1, 2, 3)},
        "kvtriton + encrypted fs": {r: figures(120.0, 40.0, disk_hit_tokens=64.0) for r in (1, 2, 3)},
        LMCACHE_DISK: {r: figures(55.0, 85.0, external_unspecified_hit_tokens=96.0) for r in (1, 2, 3)},
    }  # fmt: skip
    verdicts = {str(verdict["goal"]).split(":")[0]: verdict for verdict in goals(runs)}
    assert not verdicts[FS]["met"]  # round 3 was slower than no connector
    assert verdicts[MOONCAKE]["met"] and verdicts["kvtriton + encrypted Mooncake"]["met"]
    assert verdicts[LMCACHE_DISK]["met"] and not verdicts["kvtriton + encrypted fs"]["met"]
    against_lmcache = [v for v in goals(runs) if LMCACHE_DISK in str(v["goal"]) and "at least" in str(v["goal"])]
    assert [v["met"] for v in against_lmcache] == [False, True]  # fs: 70 tok/s < 85; Mooncake ahead on both
    fs, mooncake = [v for v in goals(runs) if str(v["goal"]).startswith("encryption")]
    assert not fs["met"] and fs["measured"] == {"ttft_ratio": 120 / runs[FS][2][WORKLOAD]["mean_ttft_ms"],
                                                "throughput_ratio": 40 / 70}  # fmt: skip
    assert mooncake["met"] and mooncake["measured"] == {"ttft_ratio": 51 / 50, "throughput_ratio": 88 / 90}


def test_a_run_records_every_arm_and_the_skip_of_lmcache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRITON_BENCH_OUT", str(tmp_path / "out"))
    monkeypatch.setattr(tiers, "lmcache_problem", lambda: "LMCache is not installed")
    ran: list[str] = []

    def run_arm(configuration: object, *args: object, **kwargs: object) -> dict[str, object]:
        ran.append(getattr(configuration, "name"))
        return {"figures": figures(10.0, 10.0, computed_tokens=1.0, prompt_tokens=1.0)}

    monkeypatch.setattr(tiers, "run_arm", run_arm)

    def rounds_by_arm(runs: Mapping[str, Mapping[int, object]]) -> dict[str, list[int]]:
        return {arm: sorted(by_round) for arm, by_round in runs.items()}

    monkeypatch.setattr(tiers, "aggregate", rounds_by_arm)
    monkeypatch.setattr(tiers, "table", rounds_by_arm)
    assert tiers.main(["--quick", "--arms", f"{FS},{LMCACHE_DISK}", "--model", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "out" / "serving_tiers-quick.json").read_text())
    assert ran == ["none", FS] and written["skipped"] == {LMCACHE_DISK: "LMCache is not installed"}
    assert written["results"] == {"none": [1], FS: [1]} and written["goals"] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--arms", "kvtriton,disk"], "unknown ['disk']"), (["--rounds", "2"], "--rounds must be >= 3")],
)
def test_bad_arguments_are_refused_before_any_server_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        tiers.parse_args(argv)
    assert message in capsys.readouterr().err


def test_every_arm_is_named_once() -> None:
    assert len(set(ARMS)) == len(ARMS) and ARMS[0] == "none" and CEILING in ARMS
