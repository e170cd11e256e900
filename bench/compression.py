"""What fp8-e4m3 compression of offloaded KV costs in accuracy, and what it saves in bytes.

Run ``python -m bench.compression`` (``--quick`` for a smoke run). On
synthetic KV shaped like one Llama-3-8B layer (8 KV heads x 128 dims, 16-token
blocks, bf16) with realistic outliers -- K has a few channels 10-30x larger
than the rest, the same channels in every token (what rotary K caches show),
and a per-token magnitude spread; V is closer to normal with rarer outlier
channels -- it reports, side by side for

* ``group fp8``: kvtriton's format (one fp32 scale per group of G contiguous
  elements, G = the head dimension = 128 by default, and G = 32),
* ``per-tensor fp8``: one scale for the whole tensor (what an fp8 KV cache in
  vLLM does: ``kv_cache_dtype="fp8_e4m3"`` with a per-tensor scale),

the per-element error of K and V (relative RMS error, largest error relative
to the tensor's RMS, and the share of elements whose error exceeds the
issue's bound ``2^-4 |x| + scale 2^-9``) and the relative error of attention
outputs (``softmax(q K^T / sqrt(d)) V`` for random queries over every cached
token, each head; the queries scaled so that the logits have a standard
deviation of 2) against the uncompressed cache. It also reports the bytes
one block moves and holds, from the format (bf16, fp16, fp32 pages) and from
a real store job of the CPU transfer engine (its ``transfer_size``).

Writes ``bench/results/compression.json`` (``compression-quick.json`` for
``--quick``). The real-model figures (the end-to-end tests' tiny model
through vLLM) are not measured here.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

import torch

from bench.common import format_table, machine_record, quick_name, write_json
from kvtriton.kernels.compression import E4M3_MAX, compression_layout, dequantize_groups, quantize_groups
from kvtriton.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.tools.progress import progress
from kvtriton.worker.engine import TransferEngine
from kvtriton.worker.layout import PagedKV
from kvtriton.worker.slab import HostSlab

HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
K_OUTLIER_CHANNELS = 6
"""Channels per K head that are 10-30x larger than the rest (fixed across tokens)."""
V_OUTLIER_CHANNELS = 2
LOGIT_STD = 2.0
"""Standard deviation of the attention logits of the random queries."""


def synthetic_kv(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``(tokens, heads, head_dim)`` bf16, with outlier channels and token spread."""
    token_scale = torch.exp(torch.randn(tokens, 1, 1, generator=generator) * 0.5)
    k = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator) * token_scale
    v = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator) * token_scale.sqrt()
    for head in range(HEADS):
        k_channels = torch.randperm(HEAD_DIM, generator=generator)[:K_OUTLIER_CHANNELS]
        k[:, head, k_channels] *= 10 + 20 * torch.rand(K_OUTLIER_CHANNELS, generator=generator)
        k[:, head, k_channels] += 5 * torch.sign(torch.randn(K_OUTLIER_CHANNELS, generator=generator))
        v_channels = torch.randperm(HEAD_DIM, generator=generator)[:V_OUTLIER_CHANNELS]
        v[:, head, v_channels] *= 8
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def group_fp8(group_size: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """kvtriton's format on ``(tokens, heads, dim)``: groups of ``group_size`` contiguous elements of one block's page."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = x.reshape(-1, BLOCK_SIZE * HEADS * HEAD_DIM)
        codes, scales, bad = quantize_groups(pages, group_size)
        assert not bool(bad.any())
        decoded = dequantize_groups(codes, scales, group_size, x.dtype).reshape(x.shape)
        per_element = scales.repeat_interleave(group_size, dim=1)[:, : pages.shape[1]].reshape(x.shape)
        return decoded, per_element

    return run


def per_tensor_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (absmax / 448), torch's fp8 cast (round to nearest even)."""
    scale = x.float().abs().max() / E4M3_MAX
    codes = (x.float() / scale).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype), torch.full(x.shape, float(scale))


def element_errors(x: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor) -> dict[str, float]:
    exact, approx = x.double(), decoded.double()
    error = (exact - approx).abs()
    rms = exact.pow(2).mean().sqrt()
    bound = 2.0**-4 * exact.abs() + scale.double() * 2.0**-9
    return {
        "relative_rms_error": float(error.pow(2).mean().sqrt() / rms),
        "max_error_over_rms": float(error.max() / rms),
        "share_over_bound": float((error > bound).double().mean()),
    }


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q K^T / sqrt(d)) V`` per head: q ``(queries, heads, d)``, k / v ``(tokens, heads, d)``."""
    scores = torch.einsum("qhd,thd->hqt", q.double(), k.double()) / math.sqrt(HEAD_DIM)
    return torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v.double())


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((exact - approx).pow(2).sum().sqrt() / exact.pow(2).sum().sqrt())


def bytes_per_block() -> list[dict[str, object]]:
    """Compressed over uncompressed bytes per block, from the format and from a real CPU engine store job."""
    rows: list[dict[str, object]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layers = [torch.zeros(2, 4, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
        plain = PagedKV.from_tensors(layers)
        compressed = plain.with_compression("fp8-e4m3")
        moved = {}
        for kv in (plain, compressed):
            with HostSlab(4, 1, kv.row_bytes, pin=False) as slab, TransferEngine(kv, slab, "torch") as engine:
                engine.submit_store(1, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0, 1, 2]))
                (result,) = engine.get_finished()
                moved[kv.compression.value] = result.transfer_size
        layout = compression_layout(plain.pages, HEAD_DIM)
        rows.append({
            "dtype": str(dtype).removeprefix("torch."), "group_size": HEAD_DIM, "raw_row_bytes": plain.row_bytes,
            "compressed_row_bytes": compressed.row_bytes, "format_ratio": layout.ratio,
            "engine_bytes_moved_ratio": moved["fp8-e4m3"] / moved["none"], "blocks_per_gib_gain": plain.row_bytes / compressed.row_bytes,
        })  # fmt: skip
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compression", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=4096, help="cached tokens of the synthetic layer (default: 4096)")
    parser.add_argument("--queries", type=int, default=32, help="random queries per head for the attention error (default: 32)")
    parser.add_argument("--seeds", type=int, default=3, help="independent synthetic layers, figures averaged (default: 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, 1 seed; writes compression-quick.json")
    parser.add_argument("--name", default="compression", help="result file stem (default: compression)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tokens, seeds = (512, 1) if args.quick else (args.tokens, args.seeds)
    if args.quick:
        print("SMOKE RUN (--quick): 512 tokens, one seed; the figures are no verdict.")
    tokens = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE
    schemes: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
        f"group fp8 (G={HEAD_DIM})": group_fp8(HEAD_DIM),
        "group fp8 (G=32)": group_fp8(32),
        "per-tensor fp8": per_tensor_fp8,
    }
    sums: dict[str, dict[str, float]] = {name: {} for name in schemes}
    for seed in progress(range(seeds), seeds, "compression bench", stream=sys.stderr):
        generator = torch.Generator().manual_seed(seed)
        k, v = synthetic_kv(tokens, generator)
        q = torch.randn(args.queries, HEADS, HEAD_DIM, generator=generator)
        # Queries scaled so that the logits q.k / sqrt(d) have a standard deviation of LOGIT_STD (a softmax
        # over thousands of tokens that neither ignores the keys nor attends to one token only).
        logits = torch.einsum("qhd,thd->hqt", q.double(), k.double()) / math.sqrt(HEAD_DIM)
        q = (q * (LOGIT_STD / float(logits.std()))).to(torch.bfloat16)
        reference = attention(q, k, v)
        for name, scheme in schemes.items():
            k2, k_scale = scheme(k)
            v2, v_scale = scheme(v)
            figures = {f"k_{key}": value for key, value in element_errors(k, k2, k_scale).items()}
            figures |= {f"v_{key}": value for key, value in element_errors(v, v2, v_scale).items()}
            figures["attention_relative_error"] = relative_error(reference, attention(q, k2, v2))
            figures["attention_relative_error_k_only"] = relative_error(reference, attention(q, k2, v))
            for key, value in figures.items():
                sums[name][key] = sums[name].get(key, 0.0) + value / seeds
    headers = ["scheme", "K rel. RMS err", "K max err / RMS", "K over bound", "V rel. RMS err", "V over bound", "attention rel. err"]
    table = [
        [name, f"{f['k_relative_rms_error']:.4f}", f"{f['k_max_error_over_rms']:.3f}", f"{f['k_share_over_bound']:.4f}",
         f"{f['v_relative_rms_error']:.4f}", f"{f['v_share_over_bound']:.4f}", f"{f['attention_relative_error']:.4f}"]
        for name, f in sums.items()
    ]  # fmt: skip
    print(f"synthetic Llama-3-8B-shaped layer: {tokens} tokens, {HEADS} KV heads x {HEAD_DIM}, bf16, {seeds} seed(s)")
    print(format_table(headers, table))
    sizes = bytes_per_block()
    print("\nbytes per block (2 layers x K,V pages of 16 tokens x 8 heads x 128; G = 128):")
    print(format_table(
        ["dtype", "raw B", "compressed B", "format ratio", "engine bytes moved ratio", "blocks per GiB gain"],
        [[row["dtype"], row["raw_row_bytes"], row["compressed_row_bytes"], f"{row['format_ratio']:.4f}",
          f"{row['engine_bytes_moved_ratio']:.4f}", f"{row['blocks_per_gib_gain']:.3f}x"] for row in sizes],
    ))  # fmt: skip
    payload: dict[str, object] = {
        "machine": machine_record(), "smoke_run": args.quick, "tokens": tokens, "heads": HEADS, "head_dim": HEAD_DIM,
        "queries": args.queries, "seeds": seeds, "k_outlier_channels_per_head": K_OUTLIER_CHANNELS,
        "v_outlier_channels_per_head": V_OUTLIER_CHANNELS, "accuracy": sums, "bytes": sizes,
        "note": "errors are averaged over seeds; attention error is ||o' - o|| / ||o|| over every query and head, in float64",
    }  # fmt: skip
    print(f"wrote {write_json(quick_name(args.name) if args.quick else args.name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
