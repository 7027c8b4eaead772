"""The tiny model folder: a saved tokenizer encodes and decodes exactly like the in-memory one; the
`python -m relayrl.models.tiny` entry point writes a model and a reward model."""

from __future__ import annotations

import math
import subprocess
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.agents.rewards.local_rm import LocalRewardModel
from relayrl.models.loading import load_tokenizer
from relayrl.models.tiny import main

TEXT = "12 + 34 =\n46\tand  two spaces, ~!@#$%^&*()_{}[]|\\:;\"'<>?/"
MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12 + 34?\nThink first."},
    {"role": "assistant", "content": "12 + 34 = 46\n46"},
]


def test_saved_tokenizer_round_trips_like_the_in_memory_one(tiny_tokenizer, tiny_model_path):
    for loaded in (load_tokenizer(str(tiny_model_path)), AutoTokenizer.from_pretrained(tiny_model_path)):
        ids = tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(TEXT)  # one token per character, spaces and newlines included
        assert loaded(TEXT, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == tiny_tokenizer.decode(ids) == TEXT

        chat = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert loaded.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == chat
        chat_ids = tiny_tokenizer(chat, add_special_tokens=False)["input_ids"]
        assert loaded(chat, add_special_tokens=False)["input_ids"] == chat_ids
        assert chat_ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert loaded.decode(chat_ids) == chat
        assert loaded.decode(chat_ids, skip_special_tokens=True) == tiny_tokenizer.decode(
            chat_ids, skip_special_tokens=True
        )

        assert loaded.get_vocab() == tiny_tokenizer.get_vocab() and len(loaded) == len(tiny_tokenizer)
        assert loaded.all_special_tokens == tiny_tokenizer.all_special_tokens
        assert loaded.all_special_ids == tiny_tokenizer.all_special_ids
        assert (loaded.pad_token_id, loaded.eos_token_id) == (tiny_tokenizer.pad_token_id, 1)
        assert loaded.chat_template == tiny_tokenizer.chat_template
        batch = ["a b", "12 + 34 =\n46"]
        assert loaded(batch, padding=True)["input_ids"] == tiny_tokenizer(batch, padding=True)["input_ids"]
        assert loaded.padding_side == tiny_tokenizer.padding_side == "left"


def test_entry_point_writes_a_model_and_a_reward_model(tmp_path, tiny_tokenizer):
    """`python -m relayrl.models.tiny OUT [--reward-model]` (docs/rl.md "Try it without downloads")."""
    assert main([str(tmp_path / "tiny"), "--hidden", "32", "--layers", "1"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 1)
    assert load_tokenizer(str(tmp_path / "tiny"))(TEXT)["input_ids"] == tiny_tokenizer(TEXT)["input_ids"]

    cmd = [sys.executable, "-m", "relayrl.models.tiny", str(tmp_path / "rm"), "--reward-model"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"tiny reward model written to {tmp_path / 'rm'}" in done.stdout
    rm = LocalRewardModel.from_pretrained(str(tmp_path / "rm"), device="cpu")
    assert rm.model.config.architectures == ["Qwen2ForSequenceClassification"]
    scores = rm.score_texts(["12 + 34 = 46", "12 + 34 = 47"])
    assert all(math.isfinite(s) for s in scores) and scores[0] != scores[1]
