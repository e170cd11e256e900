from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from kvtriton._keys import OffloadKey, make_offload_key
from kvtriton._offload_types import LookupResult, ReqContext
from kvtriton.cli._main import main
from kvtriton.manager import CPUOffloadingManager, policy_names
from kvtriton.sim._geometry import PRESETS, KVDtype, ModelGeometry
from kvtriton.sim._planner import default_capacities, summarize, sweep
from kvtriton.sim._replay import ManagerCalls, PreparedRequest, manager_calls, prepare, replay, replay_calls
from kvtriton.sim._workloads import Request, generate

# One byte per block: capacities in bytes are capacities in blocks.
ONE_BYTE_BLOCKS = ModelGeometry(
    "unit", num_layers=1, num_kv_heads=1, head_dim=1, dtype=KVDtype.FP8, block_size=1, kv_factor=1
)


def request(req_id: str, prompt: str, output: str = "", *, block_size: int = 1) -> Request:
    """A request whose blocks are named by letters: ``request("r", "abc", "d")``."""
    return Request(
        req_id, tuple(c.encode() for c in prompt), len(prompt) * block_size, tuple(c.encode() for c in output)
    )


def key(name: str) -> OffloadKey:
    return make_offload_key(name.encode())


# --------------------------------------------------------------------------
# replay against the manager


def test_replay_counts_hits_stores_and_evictions_of_a_small_lru_trace() -> None:
    # LRU order, least recent first, after each request (docs/manager.md, LRU: touch ranks
    # the first key most recent; a store without positions ranks its keys in offer order).
    trace = prepare([
        request("r0", "ab", "c"),  # miss a; store a b c                     -> a b c
        request("r1", "abx"),      # hit a b; store x, evicting c            -> b a x
        request("r2", "ac"),       # hit a; c is gone; store c, evicting b   -> x a c
        request("r3", "ab"),       # hit a; b is gone; store b, evicting x   -> c a b
    ])  # fmt: skip
    manager = CPUOffloadingManager(3, cache_policy="lru")
    stats = replay(trace, manager, block_size=1)
    assert (stats.prompt_blocks, stats.hit_blocks, stats.blocks_stored, stats.evictions) == (9, 4, 6, 3)
    assert (stats.refused_stores, stats.pending_stops) == (0, 0)
    assert [manager.lookup(key(c), ReqContext()) for c in "abcx"] == [
        LookupResult.HIT, LookupResult.HIT, LookupResult.HIT, LookupResult.MISS,
    ]  # fmt: skip


def _drive_by_hand(
    trace: list[PreparedRequest], manager: CPUOffloadingManager
) -> tuple[list[int], list[list[OffloadKey]]]:
    """The engine's calls written out, request by request, recording hits and evictions."""
    hits: list[int] = []
    evictions: list[list[OffloadKey]] = []
    for item in trace:
        context = ReqContext(req_id=item.req_id)
        hit = 0
        while hit < len(item.prompt_keys) and manager.lookup(item.prompt_keys[hit], context) is LookupResult.HIT:
            hit += 1
        loaded = list(item.prompt_keys[:hit])
        if loaded:
            manager.prepare_load(loaded, context)
        manager.touch(list(item.prompt_keys), context)
        output = manager.prepare_store(list(item.prompt_keys[hit:] + item.output_keys), context)
        if loaded:
            manager.complete_load(loaded, context)
        if output is not None:
            manager.complete_store(output.keys_to_store, context)
            evictions.append(list(output.evicted_keys))
        hits.append(hit)
    return hits, evictions


@pytest.mark.parametrize("policy", policy_names())
def test_replay_agrees_with_direct_manager_calls(policy: str) -> None:
    trace = prepare(generate("few-shot", seed=3, block_size=16, overrides={
        "requests": "80", "prefixes": "12", "prefix_tokens_min": "32", "prefix_tokens_max": "160",
    }))  # fmt: skip
    by_hand = CPUOffloadingManager(40, cache_policy=policy, enable_events=True)
    hits, evictions = _drive_by_hand(trace, by_hand)
    simulated = CPUOffloadingManager(40, cache_policy=policy, enable_events=True)
    stats = replay(trace, simulated, block_size=16)
    assert stats.hit_blocks == sum(hits) > 0
    assert stats.evictions == sum(len(evicted) for evicted in evictions) > 0
    assert list(simulated.take_events()) == list(by_hand.take_events())  # same stores and evictions, same order
    every_key = {k for item in trace for k in item.prompt_keys + item.output_keys}
    context = ReqContext()
    assert {k: simulated.lookup(k, context) for k in every_key} == {k: by_hand.lookup(k, context) for k in every_key}


def _stack_distance_trace(length: int, seed: int) -> list[Request]:
    """Single-block requests whose reuse distances are drawn from a skewed distribution."""
    rng = random.Random(seed)
    stack: list[bytes] = []
    fresh = 0
    requests: list[Request] = []
    for index in range(length):
        depth = int(rng.expovariate(1 / 12))
        if depth < len(stack):
            block = stack.pop(len(stack) - 1 - depth)
        else:
            block = f"block-{fresh}".encode()
            fresh += 1
        stack.append(block)
        requests.append(Request(f"r{index}", (block,), 1))
    return requests


def _lru_hits_from_stack_distances(trace: list[Request], capacity: int) -> int:
    """Textbook LRU: a reference hits iff fewer than ``capacity`` distinct blocks were used since its last use."""
    stack: list[bytes] = []
    hits = 0
    for item in trace:
        (block,) = item.prompt_blocks
        if block in stack:
            depth = len(stack) - 1 - stack.index(block)
            hits += depth < capacity
            stack.remove(block)
        stack.append(block)
    return hits


def test_lru_hit_rate_never_drops_as_capacity_grows_on_a_stack_distance_trace() -> None:
    trace = _stack_distance_trace(1500, seed=5)
    prepared = prepare(trace)
    distinct = summarize(prepared).distinct_blocks
    capacities = list(range(1, distinct + 2, 3))
    points = sweep(prepared, ONE_BYTE_BLOCKS, capacities, ["lru"])
    hits = [point.stats.hit_blocks for point in points]
    assert hits == sorted(hits)
    assert hits[0] < hits[-1] == len(trace) - distinct  # only compulsory misses once everything fits
    # LRU is a stack algorithm: the simulator matches the stack-distance count at every capacity.
    assert hits == [_lru_hits_from_stack_distances(trace, capacity) for capacity in capacities]


def test_store_larger_than_the_cache_is_refused_and_changes_nothing() -> None:
    trace = prepare([request("small", "ab"), request("huge", "cdefg")])
    manager = CPUOffloadingManager(4)
    stats = replay(trace, manager, block_size=1)
    assert (stats.refused_stores, stats.refused_blocks, stats.blocks_stored, stats.evictions) == (1, 5, 2, 0)
    assert manager.lookup(key("a"), ReqContext()) is LookupResult.HIT


def test_in_flight_store_looks_pending_and_is_not_stored_twice() -> None:
    trace = prepare([request("first", "abc"), request("twin", "abc")])
    stats = replay(trace, CPUOffloadingManager(8), block_size=1, in_flight=2)
    assert (stats.hit_blocks, stats.pending_stops, stats.blocks_stored) == (0, 1, 3)
    sequential = replay(trace, CPUOffloadingManager(8), block_size=1, in_flight=1)
    assert (sequential.hit_blocks, sequential.pending_stops) == (3, 0)


def test_blocks_loading_for_an_in_flight_request_are_never_evicted() -> None:
    # "reader" loads all four cached blocks and is still in flight when "writer" needs two slots.
    trace = prepare([request("seed", "abcd"), request("pad", ""), request("reader", "abcd"), request("writer", "ef")])
    overlapped = replay(trace, CPUOffloadingManager(4), block_size=1, in_flight=2)
    assert (overlapped.hit_blocks, overlapped.evictions, overlapped.refused_stores, overlapped.refused_blocks) == (
        4,
        0,
        1,
        2,
    )
    sequential = replay(trace, CPUOffloadingManager(4), block_size=1, in_flight=1)
    assert (sequential.hit_blocks, sequential.evictions, sequential.refused_stores) == (4, 2, 0)


def test_token_hit_rate_counts_the_uncacheable_prompt_tail() -> None:
    trace = prepare([Request("a", (b"x",), 24), Request("b", (b"x",), 24)])
    stats = replay(trace, CPUOffloadingManager(4), block_size=16)
    assert stats.block_hit_rate == 0.5
    assert stats.hit_tokens == 16
    assert stats.token_hit_rate == 16 / 48


def _logged(calls: ManagerCalls[ReqContext], log: list[str]) -> ManagerCalls[ReqContext]:
    """``calls`` with every call, the per-request hooks included, appended to ``log`` as "name req keys"."""

    def keyed(name: str, call: Callable[[Sequence[OffloadKey], ReqContext], object]) -> Callable[..., object]:
        def logged(keys: Sequence[OffloadKey], context: ReqContext) -> object:
            log.append(f"{name} {context.req_id} {''.join(k[:1].decode() for k in keys)}")
            return call(keys, context)

        return logged

    def lookup(key: OffloadKey, context: ReqContext) -> object:
        result = calls.lookup(key, context)
        log.append(f"lookup {context.req_id} {key[:1].decode()} {getattr(result, 'name')}")
        return result

    def hook(name: str) -> Callable[[ReqContext], None]:
        return lambda context: log.append(f"{name} {context.req_id}")

    assert calls.touch is not None
    return replace(
        calls,
        lookup=lookup,
        prepare_load=keyed("prepare_load", calls.prepare_load),
        touch=keyed("touch", calls.touch),
        prepare_store=keyed("prepare_store", calls.prepare_store),
        complete_load=keyed("complete_load", calls.complete_load),
        complete_store=keyed("complete_store", calls.complete_store),
        on_new_request=hook("new"),
        on_request_finished=hook("finished"),
    )


def test_replay_calls_follow_the_engine_order_and_retire_after_the_window() -> None:
    trace = prepare([request("r0", "ab"), request("r1", "ab"), request("r2", "ac")])
    log: list[str] = []
    calls = _logged(manager_calls(CPUOffloadingManager(8)), log)
    stats = replay_calls(calls, trace, [ReqContext(req_id=r.req_id) for r in trace], block_size=1, in_flight=2)
    assert log == [
        "new r0", "lookup r0 a MISS", "touch r0 ab", "prepare_store r0 ab",
        "new r1", "lookup r1 a HIT_PENDING", "touch r1 ab", "prepare_store r1 ab",  # r0's store is in flight
        "complete_store r0 ab", "finished r0",  # the window is full: r0 retires before r2 arrives
        "new r2", "lookup r2 a HIT", "lookup r2 c MISS", "prepare_load r2 a", "touch r2 ac", "prepare_store r2 c",
        "finished r1",  # r1 stored nothing: no completions
        "complete_load r2 a", "complete_store r2 c", "finished r2",
    ]  # fmt: skip
    assert (stats.hit_blocks, stats.pending_stops, stats.blocks_stored) == (1, 1, 3)


def test_replay_calls_need_one_context_per_request() -> None:
    trace = prepare([request("r0", "a")])
    with pytest.raises(ValueError, match="contexts has 0 entries for 1 requests"):
        replay_calls(manager_calls(CPUOffloadingManager(1)), trace, [], block_size=1)


def test_replay_rejects_bad_window_and_block_size() -> None:
    with pytest.raises(ValueError, match="in_flight must be >= 1, got 0"):
        replay([], CPUOffloadingManager(1), block_size=1, in_flight=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        replay([], CPUOffloadingManager(1), block_size=0)


def test_default_sweep_doubles_up_to_the_power_of_two_holding_the_trace() -> None:
    geometry = PRESETS["llama-3-8b"]  # 2 MiB blocks
    capacities = default_capacities(geometry, distinct_blocks=3000)  # 5.9 GiB
    assert [c / 2**30 for c in capacities] == [0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8]
    assert default_capacities(geometry, distinct_blocks=1) == [2**21]  # smaller sizes hold no block


def test_sweep_rejects_a_capacity_below_one_block() -> None:
    with pytest.raises(ValueError, match="capacity 1.00 MiB holds no block of 2.00 MiB"):
        sweep([], PRESETS["llama-3-8b"], [2**20], ["lru"])


# --------------------------------------------------------------------------
# command line

TINY = ["--requests", "30", "--capacities", "0.25,1", "--no-progress"]


def test_simulate_command_prints_a_table_and_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--workload", "few-shot", *TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hit tok" in out and "llama-3-8b" in out
    assert out.count(" lru ") == 2 and out.count(" arc ") == 2
    record = json.loads((tmp_path / "simulate-few-shot.json").read_text())
    assert [(p["policy"], p["capacity_gib"]) for p in record["points"]] == [
        ("lru", 0.25), ("lru", 1.0), ("arc", 0.25), ("arc", 1.0),
    ]  # fmt: skip
    assert record["points"][0]["num_blocks"] == 128
    assert record["source"]["params"]["requests"] == 30
    assert record["geometry"]["bytes_per_block"] == 2 * 2**20
    for point in record["points"]:
        assert point["bytes_loaded"] == point["hit_blocks"] * 2 * 2**20
        assert 0 <= point["token_hit_rate"] <= record["trace"]["unlimited_token_hit_rate"] + 1e-12
    assert (tmp_path / "simulate-few-shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_answer_is_printed_and_the_plot_is_a_one_line_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install --no-deps` into vLLM's environment leaves matplotlib out: the table and the answer still come."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert main(["simulate", *TINY, "--target-hit-rate", "0.01", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "hit tok" in captured.out and "smallest size reaching 1.0%" in captured.out and "vllm serve" in captured.out
    assert captured.err.splitlines() == [
        "kvtriton simulate: no plot: matplotlib is not installed"
        " (pip install matplotlib to draw it, --no-plot to skip it)"
    ]
    assert captured.out.rstrip().endswith(f"wrote {tmp_path / 'simulate-chat.json'}")  # and no PNG named
    assert json.loads((tmp_path / "simulate-chat.json").read_text())["recommendation"]["reached"] is True
    assert not (tmp_path / "simulate-chat.png").exists()


def test_the_record_keeps_the_command_line_and_the_printed_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", *TINY, "--policies", "lru", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "simulate-chat.json").read_text())
    assert record["argv"] == argv  # what main() was given, not the test runner's sys.argv
    assert printed == "\n".join(record["printed"]) + f"\n\nwrote {tmp_path / 'simulate-chat.json'}\n"


def test_simulate_json_flag_prints_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TINY, "--policies", "lru", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["source"]["workload"] == "chat"
    assert len(record["points"]) == 2
    assert not (tmp_path / "simulate-chat.png").exists()


def test_simulate_replays_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mine.jsonl"
    trace.write_text("".join(json.dumps({"blocks": ["p", f"u{i}"]}) + "\n" for i in range(5)))
    args = [
        "simulate",
        "--trace",
        str(trace),
        "--model",
        "qwen2.5-7b",
        "--block-size",
        "32",
        "--capacities",
        "64MiB",
        "--policies",
        "lru",
    ]
    assert main([*args, "--no-progress", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    (point,) = record["points"]
    assert point["hit_blocks"] == 4  # "p" hits for the last four requests
    assert point["num_blocks"] == 64 * 2**20 // (28 * 2 * 4 * 128 * 2 * 32)


def test_malformed_trace_file_fails_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"blocks": ["a"]}\n{"blocks": ["a", 1.5]}\n')
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path)]) == 2
    assert f"{trace} line 2: blocks[1] must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--capacities", "4x"], "argument --capacities: capacity unit must be one of .* got '4x'"),
        (
            ["--policies", "lru,nosuch"],
            f"argument --policies: unknown policy 'nosuch' in 'lru,nosuch': expected {', '.join(policy_names())}",
        ),
        (["--requests", "0"], "argument --requests: expected a positive integer, got '0'"),
        (["--dtype", "int3"], "argument --dtype: dtype must be one of .*got 'int3'"),
        (["--workload", "web"], "argument --workload: expected one of shared-prompt, chat, .*, got 'web'"),
        (["--model", "Llama-4"], "argument --model: expected one of llama-3-8b, .*, got 'Llama-4'"),
        (["--call-order", "server"], "argument --call-order: expected one of kvtriton, vllm, got 'server'"),
        (["--param", "requests"], "argument --param: expected NAME=VALUE, got 'requests'"),
        (["--bandwidth", "-3"], "argument --bandwidth: expected a positive number, got '-3'"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_value(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["simulate", *flags])
    assert raised.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--capacities", "1MiB"], "--capacities: 1.00 MiB holds no block of 2.00 MiB"),
        (["--trace", "/no/such/trace.jsonl"], "--trace: no such file: /no/such/trace.jsonl"),
        (["--param", "requests=0"], "--param: workload 'chat': requests must be positive, got 0"),
        (["--workload", "few-shot", "--param", "zipf_s=nan"], "--param: workload 'few-shot': zipf_s must be a finite"),
        (["--param", "turns=3"], "--param: workload 'chat' has no parameter 'turns'"),
        (
            ["--requests", "7", "--param", "requests=5"],
            "--requests 7 and --param requests=5 both set the request count",
        ),
    ],
)
def test_bad_settings_exit_2_with_a_message(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *flags, "--no-progress", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_trace_that_is_a_directory_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(tmp_path), "--no-progress", "--out", str(tmp_path / "out")]) == 2
    assert f"--trace: {tmp_path} is a directory" in capsys.readouterr().err


def test_trace_unreadable_file_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"blocks": ["a"]}\n')

    def refuse(*args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(trace))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "open", refuse)
        assert main(["simulate", "--trace", str(trace), "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 2
    assert f"--trace: cannot read {trace}: Permission denied" in capsys.readouterr().err


def test_trace_can_be_read_from_a_pipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What `--trace <(zcat trace.jsonl.gz)` passes: a /dev/fd path to a pipe, not a regular file.
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"blocks": ["a"]}\n{"blocks": ["a", "b"]}\n')
    os.close(write_end)
    try:
        argv = ["simulate", "--trace", f"/dev/fd/{read_end}", "--capacities", "64MiB", "--policies", "lru"]
        assert main([*argv, "--no-progress", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    finally:
        os.close(read_end)
    (point,) = json.loads(capsys.readouterr().out)["points"]
    assert point["hit_blocks"] == 1


def test_out_that_is_a_file_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "results"
    taken.write_text("")
    assert main(["simulate", *TINY, "--no-plot", "--out", str(taken)]) == 2
    assert f"kvtriton simulate: error: --out {taken}: is a file, not a folder" in capsys.readouterr().err


def test_policy_names_are_case_insensitive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TINY, "--policies", "LRU,Arc", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    assert [p["policy"] for p in json.loads(capsys.readouterr().out)["points"]] == ["lru", "lru", "arc", "arc"]


def test_every_choice_flag_takes_its_names_in_any_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--workload", "Few-Shot", "--model", "QWEN3-8B", "--call-order", "VLLM", "--compression", "NONE"]
    assert main(["simulate", *TINY, *flags, "--policies", "LRU", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["source"]["workload"], record["geometry"]["model"]) == ("few-shot", "qwen3-8b")
    assert (record["call_order"]["name"], record["compression"]["kv_compression"]) == ("vllm", "none")


def test_help_documents_every_knob_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in [
        "--workload", "(default: chat)", "--seed", "(default: 0)", "--model", "(default: llama-3-8b)",
        "--capacities", "--policies", "(default: lru,arc)", "--in-flight", "(default: 1)", "--bandwidth",
        "(default: 25", "--out", "(default: ./simulate-results)", "few-shot:", "zipf_s=1.0", "deepseek-v3",
    ]:  # fmt: skip
        assert expected in text, expected


def test_simulate_imports_neither_torch_nor_triton_nor_matplotlib() -> None:
    code = (
        "import argparse, sys; import kvtriton.cli._simulate as simulate; parser = argparse.ArgumentParser();"
        " simulate.add_arguments(parser); parser.parse_args([]);"
        " print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_vllm_call_order_is_recorded_and_matches_the_server_model_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtriton.sim._replay import positioned_contexts, vllm_order_calls
    from kvtriton.sim._vllm_server import ServerModel, replay_vllm_server

    args = ["simulate", "--workload", "scan", "--requests", "60", "--capacities", "0.25", "--policies", "lru"]
    knobs = ["--call-order", "vllm", "--arrivals", "3", "--decode-steps", "2", "--sync-loads", "--store-steps", "3"]
    assert main([*args, *knobs, "--no-progress", "--no-plot", "--json", "--out", str(tmp_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["call_order"] == {
        "name": "vllm", "arrivals": 3, "sequential": False, "concurrency": None, "request_rate": None,
        "arrival_seed": 0, "max_num_seqs": 256,
        "max_num_batched_tokens": 2048, "gpu_blocks": None, "decode_steps": 2, "load_steps": 1, "store_steps": 3,
        "sync_loads": True,
    }  # fmt: skip
    (point,) = record["points"]
    requests = prepare(generate("scan", seed=0, block_size=16, overrides={"requests": 60}))
    contexts = positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=16)
    model = ServerModel(arrivals=3, output_tokens=2, sync_loads=True, store_steps=3, max_num_seqs=256)
    expected = replay_vllm_server(
        vllm_order_calls(CPUOffloadingManager(point["num_blocks"])), requests, contexts, block_size=16, model=model
    )
    assert point["hit_blocks"] == expected.replay.hit_blocks
    assert point["evictions"] == expected.replay.evictions
    assert point["external_hit_rate"] == expected.external_hit_rate


def test_help_documents_the_vllm_order_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in [
        "--call-order", "(default: vllm when --gpu-blocks", "--arrivals", "(default: 4 per step when", "burst", "concurrency:N", "rate:R", "--decode-steps",
        "(default: 2)", "--sync-loads", "--gpu-blocks", "--max-num-seqs", "--sequential", "--load-steps",
        "--store-steps", "--max-num-batched-tokens", "(default: 2048,", "(default: 256,", "--target-hit-rate", "default: 0.5)",
        "--tensor-parallel-size", "prefix-tree:", "scan_fraction=0.15",
    ]:  # fmt: skip
        assert expected in text, expected
