"""The RL console's sample table: shown every train.log_every steps, without template tokens, with a
multi-turn response marked [assistant] / [env]; samples.jsonl keeps the raw text of every step."""

from __future__ import annotations

from dataclasses import replace

from relayrl.agents.base import Trajectory
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.trainers.rl.report import prompt_view, response_view, special_token_texts
from relayrl.training.logging import read_jsonl


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_views_drop_special_tokens_and_mark_turns(tiny_tokenizer):
    specials = special_token_texts(tiny_tokenizer)
    assert set(specials) == {"<|pad|>", "<|im_end|>", "<|im_start|>", "<|unk|>"}
    text = "<|im_start|>user\nguess 2-7: <|im_end|>\n<|im_start|>assistant\n"
    sample = PromptSample(index=0, prompt=text, prompt_ids=_ids(tiny_tokenizer, text))
    assert prompt_view(sample, specials) == "user\nguess 2-7: \nassistant"
    chat = replace(
        sample, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert prompt_view(chat, specials) == "[system] Be brief.\n[user] hi"

    turns = [("4<|im_end|>", True), (" higher\n", False), ("6<|im_end|>", True), (" correct\n", False)]
    ids, mask = list(sample.prompt_ids), [False] * len(sample.prompt_ids)
    for part, is_action in turns:
        ids += _ids(tiny_tokenizer, part)
        mask += [is_action] * len(_ids(tiny_tokenizer, part))
    multi = Trajectory(
        sample=sample, token_ids=ids, action_mask=mask, rollout_logprobs=[0.0] * len(ids), num_turns=2
    )
    assert response_view(multi, tiny_tokenizer, specials) == (
        "[assistant] 4\n[env] higher\n[assistant] 6\n[env] correct"
    )
    answer = _ids(tiny_tokenizer, "46<|im_end|>")
    single = Trajectory(
        sample=sample,
        token_ids=sample.prompt_ids + answer,
        action_mask=[False] * len(sample.prompt_ids) + [True] * len(answer),
        rollout_logprobs=[0.0] * (len(sample.prompt_ids) + len(answer)),
        response_text="46<|im_end|>",  # even when a decoder kept it
    )
    assert response_view(single, tiny_tokenizer, specials) == "46"


def _rl(cfg, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's table width when stdout is not a terminal
    capsys.readouterr()
    RLTrainer(cfg).fit()
    return capsys.readouterr().out


def test_single_turn_table_every_n_steps_without_template_tokens(
    tiny_model_path, tmp_path, capsys, monkeypatch
):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=4)
    cfg = replace(
        cfg,
        train=replace(cfg.train, log_every=2),
        logger=replace(cfg.logger, progress_bar=True),
        data=replace(cfg.data, apply_chat_template=True),  # prompts carry <|im_start|> ... <|im_end|>
        rollout=replace(cfg.rollout, prompts_per_step=4, n_samples=2, max_new_tokens=4),
    )
    out = _rl(cfg, capsys, monkeypatch)
    assert [n for n in range(1, 5) if f"samples, step {n}" in out] == [2, 4]
    assert "[user] " in out and "<|" not in out
    rows = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4]  # the file gets every step, raw
    assert all(r["prompt"].startswith("<|im_start|>user\n") for r in rows)


def test_multi_turn_table_marks_assistant_and_env_turns(tiny_model_path, tmp_path, capsys, monkeypatch):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=1)
    cfg = replace(
        cfg,
        logger=replace(cfg.logger, progress_bar=True),
        task=replace(cfg.task, name="guess"),
        rollout=replace(
            cfg.rollout, agent="multi", max_turns=3, prompts_per_step=2, n_samples=2, max_new_tokens=3
        ),
    )
    out = _rl(cfg, capsys, monkeypatch)
    assert "samples, step 1" in out and "<|" not in out
    assert "[assistant] " in out and "[env] " in out
    assert any(hint in out for hint in ("[env] higher", "[env] lower", "[env] correct", "[env] invalid"))
    rows = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert rows and not any("[assistant]" in r["response"] or "[env]" in r["response"] for r in rows)
