"""The identity fingerprint: what changes it (everything that changes a block's KV bytes) and what must not."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.config.model import ModelDType
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm_fixtures.builders import SPEC_EXTRA_CONFIG, TINY_MODEL_DIR, offloading_config
from vllm_fixtures.in_process import cpu_vllm_config

from kvtriton._integrity import FINGERPRINT_BYTES, ROW_FORMAT_VERSION
from kvtriton.integrations.vllm._identity import (
    IDENTITY_KEY,
    IdentityParts,
    KVIdentity,
    compute_identity,
    identity_parts,
    parse_identity_key,
    resolve_model_dir,
    vllm_identity,
    weights_fingerprint,
)

LAYERS = ("layer0", "layer1")


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A real safetensors file (header JSON, then the raw bytes), written without the safetensors package."""
    header: dict[str, object] = {}
    offset = 0
    payload = b""
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "F16", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        payload += data
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + payload)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The tiny Llama's config with 64 KiB of weights, a tokenizer and a README."""
    folder = tmp_path / "tiny_llama"
    shutil.copytree(TINY_MODEL_DIR, folder)
    generator = torch.Generator().manual_seed(0)
    _write_safetensors(
        folder / "model.safetensors",
        {f"layer{i}.weight": torch.randn(64, 128, generator=generator).half() for i in range(4)},
    )
    (folder / "tokenizer.json").write_text('{"vocab": {}}')
    (folder / "README.md").write_text("a tiny model\n")
    return folder


def _parts(model_dir: Path, **changes: object) -> IdentityParts:
    base = IdentityParts(
        model=str(model_dir),
        revision=None,
        weights=weights_fingerprint(model_dir),
        model_dtype="float16",
        kv_cache_dtype="float16",
        tokens_per_block=(16,),
        layout="kvtriton-block-rows-v1;kv_cache_layout=NHD;canonical=False",
        bytes_per_block=8192,
        blocks_per_chunk=1,
        tokens_per_hash=16,
        kv_groups=(LAYERS,),
        rank=0,
        world_size=2,
        tp_size=2,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        compression="none",
    )
    return dataclasses.replace(base, **changes)


def _fingerprint(parts: IdentityParts, namespace: str = "") -> bytes:
    return compute_identity(parts, namespace=namespace).fingerprint


def test_the_fingerprint_is_fixed_length_and_deterministic(model_dir: Path) -> None:
    first = compute_identity(_parts(model_dir))
    assert len(first.fingerprint) == FINGERPRINT_BYTES
    assert first == compute_identity(_parts(model_dir))
    assert first.parts.row_format_version == ROW_FORMAT_VERSION
    assert first.source == "computed"
    assert first.hex in first.describe()


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "/models/other"},
        {"revision": "refs/pr/1"},
        {"model_dtype": "bfloat16"},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"tokens_per_block": (32,)},
        {"layout": "kvtriton-block-rows-v1;kv_cache_layout=HND;canonical=False"},
        {"layout": "vllm-cpu;kv_cache_layout=NHD;canonical=False"},
        {"bytes_per_block": 4096},
        {"blocks_per_chunk": 4},
        {"tokens_per_hash": 8},
        {"kv_groups": (("layer0",),)},
        {"rank": 1},
        {"rank": None},
        {"world_size": 4, "tp_size": 4},
        {"world_size": 2, "tp_size": 1, "pp_size": 2},
        {"pcp_size": 2},
        {"dcp_size": 2},
        {"compression": "fp8-e4m3-g128"},
        {"row_format_version": ROW_FORMAT_VERSION + 1},
    ],
    ids=lambda changes: ",".join(f"{name}={value}" for name, value in changes.items()),
)
def test_everything_that_changes_the_kv_bytes_changes_the_fingerprint(
    model_dir: Path, changes: dict[str, object]
) -> None:
    assert _fingerprint(_parts(model_dir, **changes)) != _fingerprint(_parts(model_dir))


def test_the_namespace_salts_the_fingerprint(model_dir: Path) -> None:
    assert _fingerprint(_parts(model_dir), "prod") != _fingerprint(_parts(model_dir), "")
    assert _fingerprint(_parts(model_dir), "prod") != _fingerprint(_parts(model_dir), "staging")


def test_other_weights_of_the_same_shape_change_the_weights_fingerprint(model_dir: Path) -> None:
    before = weights_fingerprint(model_dir)
    generator = torch.Generator().manual_seed(1)  # a fine-tune copied over: same names, shapes and sizes
    _write_safetensors(
        model_dir / "model.safetensors",
        {f"layer{i}.weight": torch.randn(64, 128, generator=generator).half() for i in range(4)},
    )
    assert weights_fingerprint(model_dir) != before


def test_config_and_weight_files_count_but_unrelated_files_do_not(model_dir: Path) -> None:
    before = weights_fingerprint(model_dir)
    (model_dir / "README.md").write_text("edited\n")
    (model_dir / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    (model_dir / "notes.txt").write_text("unrelated")
    assert weights_fingerprint(model_dir) == before
    (model_dir / "extra.bin").write_bytes(b"\x00" * 100)
    with_bin = weights_fingerprint(model_dir)
    assert with_bin != before
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    assert weights_fingerprint(model_dir) != with_bin


def test_a_grown_weight_file_changes_the_fingerprint(model_dir: Path) -> None:
    before = weights_fingerprint(model_dir)
    with (model_dir / "model.safetensors").open("ab") as weights:
        weights.write(b"\x00" * 2)
    assert weights_fingerprint(model_dir) != before


def test_a_model_without_a_local_folder_has_no_weights_part() -> None:
    assert resolve_model_dir("no-such-org/no-such-model-kvtriton", None) is None
    parts = identity_parts(
        offloading_config({}), layout="vllm-cpu", compression=None, rank=0, model_dir=None, model_dtype="float16"
    )
    assert parts.weights == ""
    assert parts.model == "tiny"


def test_the_identity_key_replaces_the_model_part_but_not_the_layout(model_dir: Path) -> None:
    here = compute_identity(_parts(model_dir), namespace="prod", identity_key="llama-3-8b-2026-11")
    elsewhere = compute_identity(
        _parts(model_dir, model="/mnt/other/copy", weights="0" * 32),
        namespace="prod",
        identity_key="llama-3-8b-2026-11",
    )
    assert here.fingerprint == elsewhere.fingerprint
    assert here.source == "identity_key"
    assert "identity_key='llama-3-8b-2026-11'" in here.describe()
    assert here.fingerprint != compute_identity(_parts(model_dir), namespace="prod").fingerprint
    other_layout = compute_identity(
        _parts(model_dir, tokens_per_block=(32,)), namespace="prod", identity_key="llama-3-8b-2026-11"
    )
    assert other_layout.fingerprint != here.fingerprint
    other_namespace = compute_identity(_parts(model_dir), namespace="staging", identity_key="llama-3-8b-2026-11")
    assert other_namespace.fingerprint != here.fingerprint


@pytest.mark.parametrize("raw", ["", "  ", 7, None])
def test_a_bad_identity_key_is_refused_naming_the_key(raw: object) -> None:
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{IDENTITY_KEY}'\] must be a non-empty string"):
        parse_identity_key({IDENTITY_KEY: raw})
    assert parse_identity_key({}) is None
    assert parse_identity_key({IDENTITY_KEY: " shared "}) == "shared"


def test_bad_parts_are_refused_naming_the_field(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"rank must be None or in 0\.\.1 \(world_size\), got 2"):
        _parts(model_dir, rank=2)
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1, got 0"):
        _parts(model_dir, bytes_per_block=0)


# --- from vLLM's own configuration objects ---------------------------------------------------------------------


def _vllm_config(
    model_dir: Path,
    *,
    dtype: ModelDType = "float16",
    cache_dtype: CacheDType = "auto",
    block_size: int = 16,
    max_num_seqs: int = 4,
) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=1024)
    return cpu_vllm_config(
        model, SPEC_EXTRA_CONFIG, block_size=block_size, cache_dtype=cache_dtype, max_num_seqs=max_num_seqs
    )


def _kv_cache_config(vllm_config: VllmConfig) -> KVCacheConfig:
    cache = vllm_config.cache_config
    dtype = vllm_config.model_config.dtype if cache.cache_dtype == "auto" else torch.uint8
    spec = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=2, head_size=16, dtype=dtype)
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def _identity_of(vllm_config: VllmConfig, *, compression: str | None = None, namespace: str = "") -> KVIdentity:
    offloading = build_offloading_config(vllm_config, _kv_cache_config(vllm_config))
    return vllm_identity(
        offloading,
        layout="kvtriton-block-rows-v1",
        compression=compression,
        rank=0,
        namespace=namespace,
        vllm_config=vllm_config,
    )


@pytest.fixture
def reference(model_dir: Path) -> KVIdentity:
    return _identity_of(_vllm_config(model_dir))


def test_vllm_config_gives_the_model_dtype_kv_dtype_and_block_size(reference: KVIdentity, model_dir: Path) -> None:
    parts = reference.parts
    assert parts.model == str(model_dir)
    assert parts.model_dtype == "float16"
    assert parts.kv_cache_dtype == "float16"
    assert parts.tokens_per_block == (16,)
    assert parts.kv_groups == (LAYERS,)
    assert parts.weights == weights_fingerprint(model_dir)


def test_a_different_max_num_seqs_keeps_the_fingerprint(reference: KVIdentity, model_dir: Path) -> None:
    assert _identity_of(_vllm_config(model_dir, max_num_seqs=64)).fingerprint == reference.fingerprint


def test_an_unrelated_file_in_the_model_folder_keeps_the_fingerprint(reference: KVIdentity, model_dir: Path) -> None:
    (model_dir / "eval_results.txt").write_text("mmlu 0.1\n")
    (model_dir / "README.md").write_text("rewritten\n")
    assert _identity_of(_vllm_config(model_dir)).fingerprint == reference.fingerprint


def test_changed_weights_at_the_same_path_change_the_fingerprint(reference: KVIdentity, model_dir: Path) -> None:
    generator = torch.Generator().manual_seed(7)
    _write_safetensors(
        model_dir / "model.safetensors",
        {f"layer{i}.weight": torch.randn(64, 128, generator=generator).half() for i in range(4)},
    )
    assert _identity_of(_vllm_config(model_dir)).fingerprint != reference.fingerprint


@pytest.mark.parametrize(
    "changes",
    [{"dtype": "bfloat16"}, {"cache_dtype": "fp8_e4m3"}, {"block_size": 32}],
    ids=["model-dtype", "kv-dtype", "block-size"],
)
def test_vllm_settings_that_change_the_bytes_change_the_fingerprint(
    reference: KVIdentity, model_dir: Path, changes: dict[str, object]
) -> None:
    changed = _identity_of(_vllm_config(model_dir, **changes))  # pyright: ignore[reportArgumentType] -- each case is one valid keyword
    assert changed.fingerprint != reference.fingerprint


def test_compression_and_namespace_change_the_fingerprint(reference: KVIdentity, model_dir: Path) -> None:
    config = _vllm_config(model_dir)
    assert _identity_of(config, compression="fp8-e4m3-g128").fingerprint != reference.fingerprint
    assert _identity_of(config, namespace="tenant-a").fingerprint != reference.fingerprint


def test_the_identity_key_in_the_extra_config_is_read(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    keyed: list[bytes] = []
    for folder in (model_dir, copy):
        config = _vllm_config(folder)
        assert config.kv_transfer_config is not None
        config.kv_transfer_config.kv_connector_extra_config[IDENTITY_KEY] = "shared-llama"
        keyed.append(_identity_of(config).fingerprint)
    assert keyed[0] == keyed[1]
    assert _identity_of(_vllm_config(model_dir)).fingerprint != _identity_of(_vllm_config(copy)).fingerprint


def test_outside_a_connector_the_model_part_comes_from_the_current_vllm_config(model_dir: Path) -> None:
    config = _vllm_config(model_dir, dtype="bfloat16")
    offloading = build_offloading_config(config, _kv_cache_config(config))
    outside = vllm_identity(offloading, layout="kvtriton-block-rows-v1", compression=None, rank=None)
    assert outside.parts.model_dtype == ""  # no config to read: the rest still counts
    with set_current_vllm_config(config):
        current = vllm_identity(offloading, layout="kvtriton-block-rows-v1", compression=None, rank=None)
    assert current.parts.model_dtype == "bfloat16"
    assert current == vllm_identity(
        offloading, layout="kvtriton-block-rows-v1", compression=None, rank=None, vllm_config=config
    )
