"""A tiny model and tokenizer built locally in seconds: used by tests, the demo and CPU benchmarks.

Nothing is ever downloaded. The tokenizer is character-level: a `Qwen2Tokenizer` (byte-level BPE) whose
vocabulary is the printable ASCII characters and which has no merges, so every such character is one token,
with ChatML special tokens and a chat template. It behaves like a real Hugging Face tokenizer
(`apply_chat_template`, `save_pretrained`, `AutoTokenizer.from_pretrained`). Other characters (non-ASCII,
\r, \x0b, \x0c) are not in the vocabulary and are dropped, as Qwen2Tokenizer drops unknown bytes.

Why a Qwen2Tokenizer: for a `qwen2` model folder, AutoTokenizer (transformers 5) always builds
Qwen2Tokenizer, whatever tokenizer_config.json names, and Qwen2Tokenizer keeps only the vocabulary of
tokenizer.json and rebuilds its own normalizer, pre-tokenizer and decoder. A plain character-level tokenizer
saved next to the Qwen2 model therefore lost its spaces and newlines on reload. Building the in-memory
tokenizer as that same class makes a saved folder encode and decode exactly like the in-memory tokenizer.
The model is a few-layer Qwen2 (`Qwen2ForCausalLM`) with random weights.

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec(hidden=64, layers=2))
    path = save_tiny(tmp_path / "tiny")          # a folder that from_pretrained loads
    rm = save_tiny_reward_model(tmp_path / "rm")  # the same, with a value head: a reward model folder

From a shell (to try relayrl's commands without downloading a model; docs/rl.md "Try it without downloads"):

    python -m relayrl.models.tiny runs/tiny                    # causal LM + tokenizer
    python -m relayrl.models.tiny runs/tiny-rm --reward-model  # value-head reward model (rm:runs/tiny-rm)
    python -m relayrl.models.tiny runs/tiny-moe --moe qwen3     # a Qwen3-MoE (or --moe mixtral) causal LM
"""

from __future__ import annotations

import argparse
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import pre_tokenizers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import logging as hf_logging

from relayrl.config.components import ModelConfig
from relayrl.models.value_head import build_value_model, save_value_model

PAD, EOS, IM_START, UNK = "<|pad|>", "<|im_end|>", "<|im_start|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, EOS, IM_START, UNK]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(kw_only=True, slots=True)
class TinyModelSpec:
    """Shape of the tiny Qwen2 model."""

    hidden: int = 64
    """Hidden size."""
    layers: int = 2
    """Number of decoder layers."""
    heads: int = 4
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention when < heads)."""
    intermediate: int = 0
    """MLP width; 0 means 4 x hidden."""
    max_positions: int = 512
    """Maximum sequence length (rotary positions)."""
    seed: int = 0
    """Seed for the random initial weights."""
    moe: str = ""
    """"" a dense Qwen2; "qwen3" a Qwen3-MoE (`Qwen3MoeForCausalLM`); "mixtral" a Mixtral: every layer a sparse
    block of `experts` experts of width `intermediate` (0: 2 x hidden), `top_k` per token."""
    experts: int = 8
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts per token."""


def build_tiny_tokenizer() -> Qwen2Tokenizer:
    """A character-level tokenizer over printable ASCII plus ChatML special tokens (ids: the 4 special tokens,
    then the characters in `string.printable` order). Left padding; saved folders reload identically."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    # byte-level BPE spells a space "Ġ", a newline "Ċ": the vocabulary holds each character's byte-level form
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {
        tok: i for i, tok in enumerate(SPECIAL_TOKENS + [to_bytes.pre_tokenize_str(c)[0][0] for c in chars])
    }
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        bos_token=None,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        padding_side="left",  # an init kwarg, so save_pretrained records it
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _common_config(tokenizer: Qwen2Tokenizer, spec: TinyModelSpec) -> dict[str, Any]:
    """The config fields the dense and the MoE tiny models share (sizes, tied embeddings, special ids)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=cast(int, tokenizer.pad_token_id),
        eos_token_id=cast(int, tokenizer.eos_token_id),
        bos_token_id=None,
        use_cache=True,
    )


def _moe_config(tokenizer: Qwen2Tokenizer, spec: TinyModelSpec) -> Qwen3MoeConfig | MixtralConfig:
    common = {**_common_config(tokenizer, spec), "num_experts_per_tok": spec.top_k}
    width = spec.intermediate or 2 * spec.hidden
    if spec.moe == "qwen3":
        return Qwen3MoeConfig(
            **common, num_experts=spec.experts, moe_intermediate_size=width, norm_topk_prob=True
        )
    if spec.moe == "mixtral":
        return MixtralConfig(**common, num_local_experts=spec.experts, intermediate_size=width)
    raise ValueError(f"TinyModelSpec.moe must be '', 'qwen3' or 'mixtral', got {spec.moe!r}")


def build_tiny_moe_model(tokenizer: Qwen2Tokenizer, spec: TinyModelSpec) -> PreTrainedModel:
    """A randomly initialised few-layer Qwen3-MoE or Mixtral causal LM (`spec.moe`) sized for `tokenizer`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        config = _moe_config(tokenizer, spec)
        model: PreTrainedModel = (
            Qwen3MoeForCausalLM(config) if isinstance(config, Qwen3MoeConfig) else MixtralForCausalLM(config)
        )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_model(tokenizer: Qwen2Tokenizer, spec: TinyModelSpec | None = None) -> Qwen2ForCausalLM:
    """A randomly initialised few-layer Qwen2 causal LM sized for `tokenizer` (fp32, eval mode off); the dense
    model whatever `spec.moe` says (build_tiny_moe_model builds that)."""
    spec = spec or TinyModelSpec()
    config = Qwen2Config(
        **_common_config(tokenizer, spec), intermediate_size=spec.intermediate or 4 * spec.hidden
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the tiny tokenizer and model and save both to `path` (HF format); returns the path."""
    path = Path(path)
    tok = build_tiny_tokenizer()
    model = build_tiny_moe_model(tok, spec) if spec and spec.moe else build_tiny_model(tok, spec)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_tiny_reward_model(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """The tiny model with a new value head (`build_value_model(init="normal")`, as `relayrl rm` starts from)
    saved with its tokenizer to `path`: an `AutoModelForSequenceClassification` folder that `--reward.source
    rm:PATH` (or `relayrl serve-rm`) scores with. Its scores are random until trained (`relayrl rm`)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny(Path(tmp) / "base", spec)
        model = build_value_model(ModelConfig(name_or_path=str(base)), init="normal")
        return save_value_model(model, build_tiny_tokenizer(), path)


def main(argv: list[str] | None = None) -> int:
    """`python -m relayrl.models.tiny OUT [--reward-model] [--hidden H] [--layers L] [--seed S]`."""
    parser = argparse.ArgumentParser(
        prog="python -m relayrl.models.tiny",
        description="Write a tiny random Qwen2 model folder with its character-level tokenizer (no download).",
    )
    parser.add_argument("out", help="folder to write (an HF model folder)")
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="write a value-head reward model (AutoModelForSequenceClassification) instead of a causal LM",
    )
    spec = TinyModelSpec()
    parser.add_argument("--hidden", type=int, default=spec.hidden, help="hidden size")
    parser.add_argument("--layers", type=int, default=spec.layers, help="decoder layers")
    parser.add_argument("--seed", type=int, default=spec.seed, help="seed of the random weights")
    parser.add_argument(
        "--moe", choices=("qwen3", "mixtral"), default="", help="a mixture-of-experts model of this layout"
    )
    parser.add_argument("--experts", type=int, default=spec.experts, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=spec.top_k, help="experts per token")
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        hidden=args.hidden,
        layers=args.layers,
        seed=args.seed,
        moe=args.moe,
        experts=args.experts,
        top_k=args.top_k,
    )
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a one-file model
    hf_logging.set_verbosity_error()  # nor the load report's "score.weight MISSING": the head is new on purpose
    save = save_tiny_reward_model if args.reward_model else save_tiny
    out = save(args.out, spec)
    print(f"tiny {'reward model' if args.reward_model else 'model'} written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
