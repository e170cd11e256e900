"""Tiny random-weight Llama checkpoints and an offline tokenizer, written to a directory vLLM loads.

The end-to-end tests run them through vLLM; the compression benchmark
(``bench/compression.py``) runs the same weights through transformers. No
model hub: the weights are random (seeded, so every run writes the same
model), float32, a few MB. The weights are drawn wider than transformers'
default (``initializer_range``) so that the greedy tokens depend strongly on
the context: a corrupted KV block changes them, which the negative controls
rely on. The tokenizer is a word-level vocabulary ``w3 .. w1023`` built with
``tokenizers``, so ``vllm serve`` can take text prompts and return text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1024
HEAD_DIM = 32
"""The smallest head size vLLM's CPU attention kernels are built for."""
_SHARED_CONFIG: dict[str, Any] = {
    "max_position_embeddings": 1024,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
    "dtype": "float32",
}
"""What every tiny model's config sets alike: the tokenizer's vocabulary and ids, wide float32 weights."""


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """The shape of one tiny model; ``layer_types`` mixes sliding-window and full attention when given."""

    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def build(self, *, seed: int = 0) -> Any:
        """The model as a transformers ``LlamaForCausalLM`` (the same weights :meth:`write` saves for ``seed``)."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        config = LlamaConfig(
            hidden_size=self.num_heads * HEAD_DIM,
            intermediate_size=2 * self.num_heads * HEAD_DIM,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=HEAD_DIM,
            num_hidden_layers=self.num_layers,
            **_SHARED_CONFIG,
        )
        if self.layer_types is not None:
            # vLLM's Llama reads these per layer (sliding window where "sliding_attention"); saved in config.json.
            setattr(config, "layer_types", list(self.layer_types))  # not a LlamaConfig parameter
            setattr(config, "sliding_window", self.sliding_window)  # same
        torch.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType] -- torch's stub leaves the seed untyped
        return LlamaForCausalLM(config)

    def write(self, directory: Path, *, seed: int = 0) -> Path:
        """Save the checkpoint and tokenizer under ``directory`` (created) and return it."""
        return _save(self.build(seed=seed), directory)


@dataclass(frozen=True, slots=True)
class TinyDeepseekV2:
    """An MLA-shaped model: DeepSeek-V2's latent KV (512 + 64 rope dims, the only size vLLM's CPU MLA kernel takes)."""

    num_layers: int = 2
    num_heads: int = 2

    def write(self, directory: Path, *, seed: int = 0) -> Path:
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            hidden_size=self.num_heads * 64,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=self.num_layers,  # every layer dense: no MoE kernels needed
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            **_SHARED_CONFIG,
        )
        torch.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType] -- torch's stub leaves the seed untyped
        return _save(DeepseekV2ForCausalLM(config), directory)


def _save(model: Any, directory: Path) -> Path:
    """Save ``model``'s checkpoint and the tokenizer under ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over ``w3 .. w{VOCAB_SIZE - 1}`` (ids 0-2 are unk, bos, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{index}": index for index in range(3, VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)  # pyright: ignore[reportUnknownMemberType] -- transformers leaves **kwargs untyped


def prompt_text(token_ids: list[int]) -> str:
    """The text the tokenizer turns into exactly ``token_ids`` (each >= 3), for ``vllm serve``'s text prompts."""
    return " ".join(f"w{token}" for token in token_ids)
