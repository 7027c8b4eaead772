"""A tiny model and tokenizer built locally in seconds: used by tests, the demo and CPU benchmarks.

Nothing is ever downloaded. The tokenizer is character-level (a `tokenizers` BPE with no merges, so every
printable ASCII character is one token) wrapped in `PreTrainedTokenizerFast`, with ChatML special tokens and a
chat template, so it behaves like a real Hugging Face tokenizer (`apply_chat_template`, `save_pretrained`,
`AutoTokenizer.from_pretrained`). The model is a few-layer Qwen2 (`Qwen2ForCausalLM`) with random weights.

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec(hidden=64, layers=2))
    path = save_tiny(tmp_path / "tiny")          # a folder that from_pretrained loads
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII plus ChatML special tokens."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.padding_side = "left"
    return tok


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec | None = None
) -> Qwen2ForCausalLM:
    """A randomly initialised few-layer Qwen2 causal LM sized for `tokenizer` (fp32, eval mode off)."""
    spec = spec or TinyModelSpec()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
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
    model = build_tiny_model(tok, spec)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
