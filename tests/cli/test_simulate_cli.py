"""`kvtriton simulate` as an operator uses it: the engine model's flags, the answer it prints, the mistakes it refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvtriton.cli._main import main
from kvtriton.sim._token_trace import TokenWorkloadParams, token_workload, write_trace
from kvtriton.sim._workloads import parse_trace
from tests.cli.conftest import QUICK, SMALL, simulate_json, usage_error

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# The vLLM server model from the command line


def test_gpu_blocks_and_max_num_seqs_select_vllms_order_and_report_its_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(
        tmp_path, capsys, *SMALL, "--gpu-blocks", "120", "--max-num-seqs", "4", "--capacities", "1,4"
    )
    order = record["call_order"]
    assert (order["name"], order["gpu_blocks"], order["max_num_seqs"], order["arrivals"]) == ("vllm", 120, 4, None)
    for point in record["points"]:
        assert point["external_hit_rate"] == point["external_hit_tokens"] / point["external_query_tokens"]
        shares = point["gpu_share"] + point["offload_share"] + point["computed_share"]
        assert shares == pytest.approx(1.0)
        assert point["gpu_share"] > 0  # the GPU cache serves the popular system prompts
        assert point["max_admitted_per_step"] >= 1
    assert record["trace"]["gpu_share"] > 0


def test_the_vllm_table_shows_the_rate_vllm_reports_and_each_levels_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, "--gpu-blocks", "120", "--max-num-seqs", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "vLLM hit" in line)
    assert header.split() == [
        "policy", "GiB", "blocks", "vLLM", "hit", "GPU", "host", "computed", "loaded", "GiB", "stored", "GiB",
        "evictions", "refused", "load", "s", "store", "s",
    ]  # fmt: skip
    assert "admission: up to" in out
    assert "120 GPU blocks, prefix cache on" in out
    # One unit for rates in the printed output: percentages.
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["lru"], ["arc"])]
    assert rows and all(value.endswith("%") for row in rows for value in row[3:7])


def test_sequential_admits_one_request_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = simulate_json(tmp_path, capsys, *SMALL, "--sequential", "--capacities", "1", "--policies", "lru")
    (point,) = record["points"]
    assert record["call_order"]["sequential"] is True
    assert point["max_admitted_per_step"] == 1  # (the previous request's stores may still be in flight)


@pytest.mark.parametrize("name", ["kvtriton", "engine", "KVTRITON"])
def test_kvtriton_order_answers_to_its_earlier_documented_name_engine(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(tmp_path, capsys, *SMALL, "--call-order", name, "--in-flight", "2", "--capacities", "1")
    assert record["call_order"] == {"name": "kvtriton", "in_flight": 2}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--call-order", "vllm", "--in-flight", "3"], "--in-flight applies to --call-order kvtriton"),
        (["--gpu-blocks", "64", "--in-flight", "2"], "--in-flight applies to --call-order kvtriton"),
        (
            ["--call-order", "engine", "--gpu-blocks", "64"],
            "--gpu-blocks models the vLLM server: it applies to --call-order vllm",
        ),
        (["--call-order", "kvtriton", "--max-num-seqs", "4"], "--max-num-seqs models the vLLM server"),
        (
            ["--call-order", "kvtriton", "--arrivals", "4"],
            "--arrivals models the vLLM server: it applies to --call-order",
        ),
        (["--call-order", "kvtriton", "--decode-steps", "2"], "--decode-steps models the vLLM server: it applies to"),
        (["--gpu-blocks", "8"], "needs"),  # a prompt longer than the whole GPU cache
    ],
)
def test_flags_of_the_other_call_order_are_refused(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtriton simulate: error: ") and message in err


# --------------------------------------------------------------------------
# The answer: vLLM's configuration for the smallest size reaching the target


@pytest.mark.parametrize(
    "flags",
    [
        ["--sync-loads"],
        ["--max-num-batched-tokens", "1"],
        ["--decode-steps", "7"],
        ["--load-steps", "3"],
        ["--store-steps", "4"],
        ["--arrivals", "2"],
    ],
)
def test_a_server_model_knob_without_the_vllm_order_is_refused_not_ignored(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --gpu-blocks, --max-num-seqs, --sequential or --call-order vllm the order is kvtriton's: no such knob."""
    assert main(["simulate", *SMALL, *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtriton simulate: error: {flags[0]} models the vLLM server")
    assert "add --call-order vllm" in err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_a_server_model_knob_with_the_vllm_order_changes_the_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [*SMALL, "--call-order", "vllm", "--capacities", "1", "--policies", "lru"]
    default = simulate_json(tmp_path, capsys, *base)
    knob = simulate_json(tmp_path, capsys, *base, "--decode-steps", "7")
    assert (default["call_order"]["decode_steps"], knob["call_order"]["decode_steps"]) == (2, 7)
    assert knob["points"][0]["steps"] > default["points"][0]["steps"]


def test_the_smallest_size_reaching_the_target_is_printed_as_vllm_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [
        *SMALL,
        "--gpu-blocks",
        "120",
        "--max-num-seqs",
        "4",
        "--capacities",
        "0.25,1,4,16",
        "--policies",
        "lru,arc",
    ]
    record = simulate_json(tmp_path, capsys, *flags, "--target-hit-rate", "0.05")
    found = record["recommendation"]
    assert found["reached"] is True
    reaching = [p for p in record["points"] if p["external_hit_rate"] >= 0.05]
    assert found["capacity_bytes"] == min(p["capacity_bytes"] for p in reaching)
    extra = found["kv_connector_extra_config"]
    assert extra == {
        "spec_name": "KVTritonOffloadingSpec",
        "spec_module_path": "kvtriton.integrations.vllm",
        "cpu_bytes_to_use": found["capacity_bytes"],
        "eviction_policy": found["policy"],
    }
    assert found["kv_transfer_config"]["kv_connector_extra_config"] == extra
    assert found["slab_bytes_per_rank"] == found["capacity_bytes"]  # whole blocks, one rank

    assert main(["simulate", *flags, "--target-hit-rate", "5%", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smallest size reaching 5.0% (the hit rate vLLM reports)" in out
    line = next(line for line in out.splitlines() if "--kv-transfer-config" in line)
    assert json.loads(re.search(r"'(.*)'", line).group(1)) == found["kv_transfer_config"]  # pyright: ignore[reportOptionalMemberAccess] -- the line holds a quoted config
    assert (
        "vllm serve <model> --block-size 32 --tensor-parallel-size 1 --max-num-batched-tokens 2048 --max-num-seqs 4"
        in out
    )
    assert f"kvtriton info --slab-size {found['slab_bytes_per_rank']}B" in out
    assert "/dev/shm:  not used by KVTritonOffloadingSpec" in out


def test_the_recommended_config_passes_kvtritons_and_vllms_parsers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")
    from vllm.config import KVTransferConfig

    from kvtriton.integrations.vllm._config import KVTritonOffloadConfig

    record = simulate_json(tmp_path, capsys, *SMALL, "--capacities", "1,4", "--target-hit-rate", "0.01")
    transfer = record["recommendation"]["kv_transfer_config"]
    parsed = KVTransferConfig(**transfer)
    assert parsed.kv_connector == "OffloadingConnector"
    settings = KVTritonOffloadConfig.from_extra_config(parsed.kv_connector_extra_config)
    assert settings.cpu_bytes_to_use == record["recommendation"]["capacity_bytes"]
    assert settings.eviction_policy == record["recommendation"]["policy"]


def test_memlock_is_per_worker_with_tensor_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = simulate_json(
        tmp_path, capsys, *SMALL, "--capacities", "4", "--target-hit-rate", "0.01", "--tensor-parallel-size", "2"
    )
    assert record["recommendation"]["slab_bytes_per_rank"] == 2 * 2**30
    assert main(["simulate", *SMALL, "--capacities", "4", "--target-hit-rate", "0.01", "--tensor-parallel-size", "2",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "each of the 2 worker processes pins its slab, 2.00 GiB" in out
    assert "--tensor-parallel-size 2" in out


def test_no_size_reaching_the_target_is_said_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*SMALL, "--capacities", "0.125,0.25", "--target-hit-rate", "0.99"]
    assert main(["simulate", *flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NO SIZE TRIED REACHES THE TARGET" in out and "below 99.0% at every size tried" in out
    assert "--kv-transfer-config" not in out
    assert "unreachable: the ceiling" in out  # 99% is above what unlimited memory gives: larger sizes do not help
    assert "Try larger --capacities" not in out
    record = simulate_json(tmp_path, capsys, *flags)
    assert record["recommendation"]["reached"] is False
    assert record["recommendation"]["kv_transfer_config"] is None


def test_a_target_above_the_ceiling_is_called_unreachable_and_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    flags = [*SMALL[:-1], "--capacities", "1,64", "--target-hit-rate", "0.95"]
    assert main(["simulate", *flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "simulate-system-prompts.json").read_text())
    ceiling = record["trace"]["unlimited_token_hit_rate"]
    assert ceiling < 0.95
    assert f"unreachable: the ceiling, {100 * ceiling:.1f}%, is below the target" in out
    assert "Try larger --capacities" not in out and "GPU cache" not in out  # the engine order has no GPU cache
    (figure,) = figures
    target = next(line for line in figure.axes[0].get_lines() if line.get_label() == "target 95.0%")
    assert list(target.get_ydata()) == [95.0, 95.0]


def test_a_target_larger_sizes_would_reach_asks_for_larger_capacities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*SMALL, "--capacities", "0.125", "--target-hit-rate", "0.2"]
    record = simulate_json(tmp_path, capsys, *flags)
    assert record["trace"]["unlimited_token_hit_rate"] >= 0.2 > record["points"][0]["token_hit_rate"]
    assert main(["simulate", *flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Try larger --capacities: the largest tried, 128.00 MiB, holds less than the whole trace" in out
    assert "unreachable" not in out


@pytest.mark.parametrize("value", ["0", "1.5", "150%", "-0.2", "half", "nan"])
def test_a_bad_target_hit_rate_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["simulate", "--target-hit-rate", value], capsys)
    assert "argument --target-hit-rate: expected a hit rate as a fraction in (0, 1] or a percentage" in err


# --------------------------------------------------------------------------
# Lists, labels, examples


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--capacities", "-1"], "argument --capacities: sizes must be positive, got '-1'"),
        (["--capacities", "1,-2GiB"], "argument --capacities: sizes must be positive, got '-2GiB'"),
        (["--capacities", "1,,2"], "argument --capacities: item 2 of '1,,2' is empty"),
        (["--capacities", "1,"], "argument --capacities: item 2 of '1,' is empty"),
        (
            ["--capacities", "1,1GiB"],
            "argument --capacities: '1' and '1GiB' are the same size (1.00 GiB): give each size once",
        ),
        (["--policies", "lru,LRU"], "argument --policies: policy 'LRU' is listed twice in 'lru,LRU'"),
        (["--policies", "lru,,arc"], "argument --policies: item 2 of 'lru,,arc' is empty"),
        (["--arrivals", "2", "--sequential"], "argument --sequential: not allowed with argument --arrivals"),
        (
            ["--capacities", "1,1e30"],
            "argument --capacities: '1e30' is 976562500000000019418578944.00 TiB, above the planner's bound of"
            " 128.00 TiB for host memory (a vLLM worker maps its slab into one x86-64 process's 128 TiB of user"
            " address space, and no server holds that much RAM): give a smaller size (a bare number is GiB)",
        ),
        (["--capacities", "129TiB"], "argument --capacities: '129TiB' is 129.00 TiB, above the planner's bound"),
        (
            ["--tier", "mooncake", "--tier-sizes", "1e9"],
            "argument --tier-sizes: '1e9' is 976562.50 TiB, above the planner's bound of 1024.00 TiB for a second"
            " tier (a pool of 128 holders of 8 TiB each): give a smaller size",
        ),
        (["--tier", "mooncake:2000TiB"], "argument --tier: '2000TiB' is 2000.00 TiB, above the planner's bound of"),
    ],
)
def test_bad_lists_are_refused_with_the_reason(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in usage_error(["simulate", *flags], capsys)


@pytest.mark.parametrize(
    ("flags", "label"),
    [
        ([], "llama-3-8b"),
        (["--dtype", "fp8", "--block-size", "32"], "llama-3-8b"),
        (["--layers", "32", "--kv-heads", "8", "--head-dim", "128"], "llama-3-8b"),  # the preset's own values
        (["--layers", "40"], "llama-3-8b (modified)"),
        (["--layers", "40", "--kv-heads", "4", "--head-dim", "64"], "custom"),
    ],
)
def test_the_geometry_is_named_after_the_preset_only_while_it_has_the_presets_shape(
    flags: list[str], label: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = simulate_json(tmp_path, capsys, *SMALL, "--capacities", "4", "--policies", "lru", *flags)
    assert record["geometry"]["model"] == label


def test_the_trace_example_of_the_help_is_a_valid_trace_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    example = re.search(r'\{"id": "r1".*?\}', text)
    assert example is not None
    (request,) = parse_trace([example.group(0)], block_size=16)
    assert len(request.prompt_blocks) * 16 <= request.prompt_tokens < (len(request.prompt_blocks) + 1) * 16


def test_every_trace_example_in_the_docs_is_a_valid_trace_line() -> None:
    text = (REPO / "docs" / "simulate.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if '"blocks"' in line]
    assert lines
    for line in lines:
        assert list(parse_trace([line], block_size=16, source="docs/simulate.md"))


def test_the_plot_keeps_coinciding_policies_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    import kvtriton.cli._simulate as simulate
    from kvtriton.sim._planner import PointReport

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its lines
    reports = [
        PointReport(**{**dict.fromkeys(PointReport.__dataclass_fields__, 0), **fields})  # pyright: ignore[reportArgumentType] -- zeros for the fields the plot does not read
        for fields in (
            {"policy": "lru", "capacity_gib": 1.0, "token_hit_rate": 0.5},
            {"policy": "lru", "capacity_gib": 2.0, "token_hit_rate": 0.6},
            {"policy": "arc", "capacity_gib": 1.0, "token_hit_rate": 0.5},
            {"policy": "arc", "capacity_gib": 2.0, "token_hit_rate": 0.6},
        )
    ]
    plot = simulate._plot  # pyright: ignore[reportPrivateUsage] -- the plot is what is tested
    plot(tmp_path / "plot.png", reports, "t", 0.7, 2.0, "kvtriton", 0.5, stamp="s")
    (figure,) = figures
    lines = [line for line in figure.axes[0].get_lines() if line.get_label() in ("LRU", "ARC")]
    assert len(lines) == 2
    lru, arc = lines
    assert list(lru.get_ydata()) == list(arc.get_ydata())  # they coincide...
    # ...yet differ in marker, line style and size, so the one drawn first shows around the other.
    assert lru.get_marker() != arc.get_marker() and lru.get_linestyle() != arc.get_linestyle()
    assert lru.get_markersize() > arc.get_markersize()


# --------------------------------------------------------------------------
# A producer's trace through the command


def test_a_token_workload_trace_runs_through_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = token_workload(seed=1, params=TokenWorkloadParams(requests=60))
    trace = write_trace(tmp_path / "fidelity.jsonl", requests, block_size=32)
    record = simulate_json(
        tmp_path, capsys, "--trace", str(trace), "--block-size", "32", "--gpu-blocks", "64", "--max-num-seqs", "4",
        "--decode-steps", "1", "--capacities", "64MiB,256MiB", *QUICK,
    )  # fmt: skip
    assert record["trace"]["requests"] == 60
    assert record["trace"]["prompt_tokens"] == sum(len(request.prompt) for request in requests)
    assert all(0 <= point["external_hit_rate"] <= 1 for point in record["points"])


def test_a_trace_read_at_another_block_size_than_its_header_says_is_told_which_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = token_workload(seed=1, params=TokenWorkloadParams(requests=20))
    trace = write_trace(tmp_path / "at16.jsonl", requests, block_size=16)
    header = "# 20 requests, 16 tokens per block, written by kvtriton.sim._token_trace"
    assert main(["simulate", "--trace", str(trace), "--block-size", "32", *QUICK, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvtriton simulate: error: --trace {trace}: this trace was written at 16 tokens per block (its header:"
        f" {header!r}), not at --block-size 32: pass --block-size 16"
    )
    at32 = write_trace(tmp_path / "at32.jsonl", requests, block_size=32)
    assert main(["simulate", "--trace", str(at32), *QUICK, "--out", str(tmp_path)]) == 2
    assert "not at the default --block-size, 16: pass --block-size 32" in capsys.readouterr().err


def test_a_trace_without_a_header_whose_tokens_fit_another_block_size_is_told_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bare.jsonl"
    trace.write_text('{"id": "r1", "blocks": ["h1", "h2", "h3"], "tokens": 56}\n')
    assert main(["simulate", "--trace", str(trace), "--block-size", "32", *QUICK, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvtriton simulate: error: --trace {trace} line 1: tokens = 56 does not fit 3 full blocks of 32 tokens"
        " (expected 96..127) at --block-size 32; it fits 16 tokens per block: if the trace was written at 16 tokens"
        " per block, pass --block-size 16"
    )


def test_the_python_example_in_the_docs_runs_and_prints_what_it_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (REPO / "docs" / "simulate.md").read_text()
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "fidelity.jsonl" in block]
    exec(  # noqa: S102 -- the repository's own docs
        compile(block.replace("/tmp/fidelity.jsonl", str(tmp_path / "fidelity.jsonl")), "docs/simulate.md", "exec"), {}
    )
    printed = capsys.readouterr().out.strip()
    claimed = re.search(r"# ([0-9.]+%)", block)
    assert claimed is not None and printed == claimed.group(1)


# --------------------------------------------------------------------------
# --compression: both curves, the compressed recommendation


def test_compression_sweeps_every_size_with_and_without_compressed_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from kvtriton.kernels._compressed_format import compression_layout

    record = simulate_json(
        tmp_path, capsys, *SMALL, "--capacities", "1,4", "--compression", "fp8-e4m3", "--target-hit-rate", "0.01"
    )
    # llama-3-8b, 32-token blocks: one layer's K and V pages of 32 x 8 x 128 bf16, G = 128.
    pages = [torch.empty((1, 32, 8, 128), dtype=torch.bfloat16, device="meta") for _ in range(2)]
    layer = compression_layout(pages, 128)
    raw = record["geometry"]["bytes_per_block"]
    assert raw == 32 * layer.raw_row_bytes == 4 * 2**20
    compression = record["compression"]
    assert compression["kv_compression"] == "fp8-e4m3" and compression["group_size"] == 128 and compression["lossy"]
    assert compression["stored_bytes_per_block"] == 32 * layer.row_bytes
    assert compression["ratio"] == pytest.approx(layer.ratio) and 0.51 < compression["ratio"] < 0.52
    assert compression["curves"] == ["none", "fp8-e4m3"]
    points = {(point["compression"], point["policy"], point["capacity_bytes"]): point for point in record["points"]}
    assert len(points) == len(record["points"]) == 2 * 2 * 2  # compressions x policies x sizes
    for (kind, policy, size), point in points.items():
        bytes_per_block = raw if kind == "none" else compression["stored_bytes_per_block"]
        assert point["num_blocks"] == size // bytes_per_block
        assert point["bytes_loaded"] == point["hit_blocks"] * bytes_per_block
        assert point["bytes_stored"] == point["blocks_stored"] * bytes_per_block
        if kind == "fp8-e4m3":
            plain = points[("none", policy, size)]
            assert point["num_blocks"] >= int(1.9 * plain["num_blocks"])
            if policy == "lru":  # LRU's stack property: more slots, no fewer hits
                assert point["token_hit_rate"] >= plain["token_hit_rate"]
    found = record["recommendation"]
    assert found["kv_compression"] == "fp8-e4m3"
    assert found["kv_connector_extra_config"]["kvtriton_kv_compression"] == "fp8-e4m3"
    assert found["kv_transfer_config"]["kv_connector_extra_config"]["kvtriton_kv_compression"] == "fp8-e4m3"
    plain_found = record["recommendation_uncompressed"]
    assert plain_found["kv_compression"] == "none"
    assert (
        plain_found["kv_connector_extra_config"] is None
        or "kvtriton_kv_compression" not in plain_found["kv_connector_extra_config"]
    )


def test_compression_prints_both_tables_the_lossy_note_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*SMALL, "--capacities", "1,4", "--target-hit-rate", "0.01", "--compression", "fp8-e4m3"]
    assert main(["simulate", *flags, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stored fp8-e4m3 (G = 128) as 2.06 MiB per block (0.516x)" in out
    assert "none: uncompressed rows, 4.00 MiB per block" in out
    assert "fp8-e4m3: lossy fp8-e4m3 rows, 2.06 MiB per block (0.516x the bytes moved, 1.94x the blocks per GiB)" in out
    assert len([line for line in out.splitlines() if line.startswith("policy ")]) == 2
    assert '"kvtriton_kv_compression": "fp8-e4m3"' in out
    assert "lossy:     kvtriton_kv_compression=fp8-e4m3" in out
    assert re.search(r"^without compression: \d", out, re.MULTILINE)


def test_without_compression_nothing_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = simulate_json(tmp_path, capsys, *SMALL, "--capacities", "1,4", "--target-hit-rate", "0.01")
    assert record["compression"]["curves"] == ["none"] and record["compression"]["ratio"] == 1.0
    assert {point["compression"] for point in record["points"]} == {"none"}
    assert "kvtriton_kv_compression" not in record["recommendation"]["kv_connector_extra_config"]
    assert "recommendation_uncompressed" not in record


def test_group_size_sets_the_scales_per_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = simulate_json(
        tmp_path, capsys, *SMALL, "--capacities", "4", "--compression", "fp8-e4m3", "--group-size", "32"
    )
    # 32 layers x K, V: 32 x 8 x 128 codes, then one fp32 scale per 32 of them.
    assert record["compression"]["stored_bytes_per_block"] == 32 * 2 * (32 * 8 * 128 + 4 * 32 * 8 * 128 // 32)


def test_an_fp8_cache_passes_through_compression_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "simulate",
                *SMALL,
                "--capacities",
                "4",
                "--dtype",
                "fp8",
                "--compression",
                "fp8-e4m3",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(1.000x the bytes moved, 1.00x the blocks per GiB) (an fp8 cache passes through unchanged)" in out


def test_a_group_size_without_compression_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL, "--group-size", "32"]) == 2
    assert "--group-size 32 applies only with --compression fp8-e4m3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compression", "zstd"], "argument --compression: expected one of none, fp8-e4m3, got 'zstd'"),
        (["--compression", "fp8-e4m3", "--group-size", "0"], "argument --group-size"),
    ],
)
def test_bad_compression_flags_are_refused_by_name(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in usage_error(["simulate", *SMALL, *flags], capsys)


def test_the_plot_draws_both_curves_per_policy_with_compression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert (
        main(["simulate", *SMALL[:-1], "--capacities", "1,4", "--compression", "fp8-e4m3", "--out", str(tmp_path)]) == 0
    )
    (figure,) = figures
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    for label in ("LRU", "ARC", "LRU, fp8-e4m3", "ARC, fp8-e4m3", "whole trace fits", "whole trace fits, compressed"):
        assert label in labels
    assert (tmp_path / "simulate-system-prompts.png").is_file()


def test_the_compressed_geometry_is_the_engines_row() -> None:
    """with_compression() sizes a block as PagedKV does for the same cache (flash_attn; MLA's one latent page)."""
    import torch

    from kvtriton.cli._demo import build_cache
    from kvtriton.sim._geometry import PRESETS
    from kvtriton.worker._layout import PagedKV

    for name, layout in (("qwen2.5-7b", "flash_attn"), ("deepseek-v3", "mla")):
        plain = PRESETS[name]
        compressed = plain.with_compression("fp8-e4m3")
        kv = PagedKV.from_tensors(
            build_cache(plain, layout, 1, torch.device("cpu")), layout=layout, kv_compression="fp8-e4m3"
        )
        assert (compressed.bytes_per_block, compressed.stored_bytes_per_block) == (kv.raw_row_bytes, kv.row_bytes)
        assert (
            compressed.blocks_for(2**30) == 2**30 // kv.row_bytes
            and plain.blocks_for(2**30) == 2**30 // kv.raw_row_bytes
        )
        assert compressed.with_compression("none") == plain
    with pytest.raises(ValueError, match="compression must be one of"):
        PRESETS["llama-3-8b"].with_compression("zstd")
    with pytest.raises(ValueError, match="group_size applies only with compression 'fp8-e4m3'"):
        PRESETS["llama-3-8b"].with_compression("none", 64)
