"""A process reward model as a reward source (relayrl.agents.rewards.prm): where steps end, which tokens the PRM
reads, the token-level rewards it gives (positions and values), the min / last outcomes, dense rewards in the
advantage estimators, and `relayrl rl --reward.source prm:PATH` on a PRM that `relayrl prm` trained.

The PRM is the tiny model trained by `relayrl prm` for 2 steps on two-step sums ("a+b=s;s+c=t;", placeholder
";", reward tokens + / -). Expected step scores are computed here independently: the text with the
placeholders written into it, tokenized, one forward, softmax over (+, -) at each ";" (rtol 1e-6: the same
model on the same ids)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch
from preference_fixtures import cli_args, small_data

from relayrl.agents.base import PromptSample, Trajectory
from relayrl.agents.rewards import PRMSource, ProcessRewardModel, build_reward_source, parse_reward_spec
from relayrl.algorithms.advantages import ADVANTAGES, AdvantageInputs
from relayrl.cli import main as cli_main
from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import run_rl


@pytest.fixture(scope="module")
def prm_path(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prm")
    data = small_data(tmp)["steps"]
    argv = cli_args(tiny_model_path, data, tmp / "run", "--prm.placeholder", ";", "--train.max_steps", "2")
    assert cli_main(["prm", *argv]) == 0
    final = tmp / "run" / "final"
    assert json.loads((final / "prm.json").read_text()) == {"placeholder": ";", "reward_tokens": ["+", "-"]}
    return final


def _traj(tok, prompt: str, response: str) -> Trajectory:
    p, r = tok.encode(prompt), tok.encode(response)
    return Trajectory(
        sample=PromptSample(index=0, prompt=prompt, prompt_ids=p),
        token_ids=p + r,
        action_mask=[False] * len(p) + [True] * len(r),
        rollout_logprobs=[0.0] * (len(p) + len(r)),
        response_text=response,
    )


def _expected(prm: ProcessRewardModel, text: str) -> list[float]:
    """p(+) at every ';' of `text`, by a plain forward of its tokens."""
    ids = prm.tokenizer.encode(text)
    with torch.no_grad():
        logits = prm.model(input_ids=torch.tensor([ids])).logits[0]
    at = [i for i, t in enumerate(ids) if t == prm.placeholder]
    return torch.softmax(logits[at][:, [prm.good, prm.bad]], dim=-1)[:, 0].tolist()


def test_the_spec_names_a_process_reward_model(prm_path):
    parsed = parse_reward_spec(f"prm:{prm_path}")
    assert (parsed.kind, parsed.target) == ("prm", str(prm_path))
    source = build_reward_source(parsed, outcome="last", step_separator=";", device="cpu")
    assert isinstance(source, PRMSource) and source.outcome == "last" and source.prm.separator == ";"


def test_dense_rewards_sit_at_each_steps_last_token_with_its_score(prm_path):
    """Steps ending in the placeholder are read in place; the unfinished last step gets one appended."""
    prm = ProcessRewardModel.from_pretrained(str(prm_path), step_separator=";")
    tok = prm.tokenizer
    t = _traj(tok, "12+5=", "17;17+3=2")
    n_prompt = len(t.sample.prompt_ids)
    ends = prm.step_ends(t.token_ids, t.action_mask)
    assert ends == [n_prompt + 2, n_prompt + 8]  # the ';' and the final '2'
    ids, positions = prm.prm_input(t.token_ids, ends)
    assert tok.decode(ids) == "12+5=17;17+3=2;" and positions == [n_prompt + 2, n_prompt + 9]
    asyncio.run(PRMSource(prm).score([t]))
    want = _expected(prm, "12+5=17;17+3=2;")
    assert len(t.dense_rewards) == len(t.token_ids)
    assert [i for i, r in enumerate(t.dense_rewards) if r != 0.0] == ends
    assert [t.dense_rewards[e] for e in ends] == pytest.approx(want, rel=1e-6)
    assert t.reward == 0.0 and t.score == pytest.approx(min(want), rel=1e-6)
    assert t.extra_logs["prm_steps"] == 2.0 and t.extra_logs["prm_last"] == pytest.approx(want[1], rel=1e-6)


def test_a_separator_other_than_the_placeholder_gets_a_placeholder_inserted(prm_path):
    prm = ProcessRewardModel.from_pretrained(str(prm_path), step_separator="\n")
    t = _traj(prm.tokenizer, "1+1=", "2\n2+2=4\n")
    ends = prm.step_ends(t.token_ids, t.action_mask)
    ids, _ = prm.prm_input(t.token_ids, ends)
    assert prm.tokenizer.decode(ids) == "1+1=2\n;2+2=4\n;" and len(ends) == 2
    got = prm.step_scores(t.token_ids, ends)
    assert got == pytest.approx(_expected(prm, "1+1=2\n;2+2=4\n;"), rel=1e-6)


@pytest.mark.parametrize("outcome", ["min", "last"])
def test_the_outcome_options_give_one_sequence_reward(prm_path, outcome):
    prm = ProcessRewardModel.from_pretrained(str(prm_path), step_separator=";")
    t = _traj(prm.tokenizer, "3+4=", "7;7+8=15;15+1=16;")
    asyncio.run(PRMSource(prm, outcome=outcome).score([t]))
    want = _expected(prm, "3+4=7;7+8=15;15+1=16;")
    assert len(want) == 3 and t.dense_rewards == []
    assert t.reward == pytest.approx(min(want) if outcome == "min" else want[-1], rel=1e-6)


def test_dense_rewards_enter_the_returns_at_their_tokens():
    """REINFORCE (gamma 1, no whitening): G_t = sum over action tokens k >= t of d_k + [last] r, by hand."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    dense = torch.tensor([[9.0, 0.25, 0.0, 0.5, 0.0, 7.0]], dtype=torch.float64)  # off-mask values unread
    inputs = AdvantageInputs(rewards=torch.tensor([1.0], dtype=torch.float64), action_mask=mask,
                             dense_rewards=dense)  # fmt: skip
    _, ret, _ = ADVANTAGES["reinforce"](inputs, whiten=False)
    assert ret.tolist() == [[0.0, 1.75, 1.5, 1.5, 1.0, 0.0]]
    bad = AdvantageInputs(rewards=torch.tensor([1.0]), action_mask=mask, dense_rewards=torch.zeros(1, 5))
    with pytest.raises(ValueError, match="dense_rewards must match action_mask"):
        ADVANTAGES["reinforce"](bad, whiten=False)


@pytest.mark.slow  # a whole (2-step) RL run
@pytest.mark.timeout(300)
def test_rl_runs_with_a_process_reward_model_source(prm_path, tiny_model_path, tmp_path):
    """Two GRPO steps with `--reward.source prm:PATH` (dense step rewards, ';' ends a step)."""
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "rl"), steps=2, reward=f"prm:{prm_path}")
    cfg = replace(cfg, reward=replace(cfg.reward, prm_step_separator=";"),
                  algo=replace(cfg.algo, advantage="reinforce"))  # fmt: skip
    result = run_rl(cfg)
    assert result.exit_code == 0, result.message
    assert len(result.history) == 2
    for row in result.history:
        assert row["rollout/prm_steps"] >= 1.0 and 0.0 < row["rollout/prm_mean"] < 1.0
        assert row["rollout/reward_mean"] == 0.0  # dense: the whole signal sits at the step ends
        assert row["adv/return_mean"] != 0.0
