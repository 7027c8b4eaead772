"""relayrl/workers/reward.py: the RewardWorker in-process, over the sources a spec string names.

- reward_spec: the source is reward.source, else task:<task.name> for single-turn, else agent; nothing ->
  an error; the tokenizer from the model (or its tokenizer path), timeout, seed + 2.
- task:add2 scores each response against its label (1 / 0, whitespace stripped), score = reward; a trajectory
  already FAILED is left alone; the same list comes back.
- a reward_func file gets OpenRLHF's arguments (queries = the decode of every token id, special tokens kept;
  prompts; labels; responses) and its rewards / scores / extra_logs land on the right trajectories.
- failures are marked, never a silent zero: a raising function fails every trajectory of its call
  ("exception", counted in the failure log), a NaN fails only its own ("nan"), a wrong-length output all
  ("wrong_length"), a slow one ("timeout" after reward.timeout_s).
- rm:<folder>: the local reward model's head at the last token of each trajectory's own token ids.
- agent: the multi-turn agent's rewards are kept as they are.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import FAILURES
from relayrl.agents.rewards.spec import AGENT
from relayrl.config.components import ModelConfig
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.models.tiny import EOS, build_tiny_tokenizer, save_tiny_reward_model
from relayrl.workers.reward import RewardSpec, RewardWorker, Scored, apply_scores, reward_spec

TOK = build_tiny_tokenizer()


def _traj(index: int, prompt: str, response: str, label: str | None = None) -> Trajectory:
    p = TOK.encode(prompt)
    r = [*TOK.encode(response), TOK.eos_token_id]
    sample = PromptSample(index=index, prompt=prompt, prompt_ids=p, label=label, datasource="ds")
    return Trajectory(
        sample=sample,
        token_ids=p + r,
        action_mask=[False] * len(p) + [True] * len(r),
        rollout_logprobs=[0.0] * len(p) + [-1.0] * len(r),
        response_text=response,
    )


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(body)
    return str(path)


def test_reward_spec_resolves_the_source():
    cfg = tiny_cpu_config("m", "o")  # task add2, single-turn, no reward.source
    assert reward_spec(cfg).source == "task:add2"
    assert reward_spec(replace(cfg, reward=replace(cfg.reward, source="r.py"))).source == "r.py"
    multi = replace(cfg, rollout=replace(cfg.rollout, agent="multi"))
    assert reward_spec(multi).source == AGENT
    nothing = replace(cfg, task=replace(cfg.task, name=""))
    with pytest.raises(ValueError, match=r"reward\.source"):
        reward_spec(nothing)

    spec = reward_spec(replace(cfg, reward=replace(cfg.reward, timeout_s=9.0)))
    assert (spec.source, spec.tokenizer, spec.timeout_s, spec.seed) == ("task:add2", "m", 9.0, 2)
    own_tok = replace(cfg, model=ModelConfig(name_or_path="m", tokenizer_name_or_path="t"))
    assert reward_spec(own_tok).tokenizer == "t"


def test_task_reward_scores_against_labels():
    w = RewardWorker(RewardSpec(source="task:add2"))
    trajs = [
        _traj(0, "12+34=", "46", "46"),
        _traj(0, "12+34=", " 46\n", "46"),
        _traj(0, "12+34=", "47", "46"),
        _traj(1, "7+8=", "15", "15"),
        _traj(1, "7+8=", "15", "15"),
    ]
    trajs[4].status = TrajectoryStatus.FAILED  # e.g. the executor failed it: not scored
    out = w.score(trajs)
    assert out is trajs
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 1.0, None]
    assert [t.score for t in trajs] == [1.0, 1.0, 0.0, 1.0, None]
    assert [t.status for t in trajs[:4]] == [TrajectoryStatus.OK] * 4


def test_reward_func_file_gets_openrlhf_arguments(tmp_path, tiny_model_path):
    path = _write(
        tmp_path,
        "def reward_func(queries, prompts, labels, responses):\n"
        "    return {\n"
        "        'rewards': [float(len(q)) for q in queries],\n"
        "        'scores': [float(r.strip() == l) for r, l in zip(responses, labels)],\n"
        "        'extra_logs': {'prompt_len': [float(len(p)) for p in prompts], 'const': 2.0},\n"
        "    }\n",
    )
    w = RewardWorker(RewardSpec(source=path, tokenizer=str(tiny_model_path)))
    trajs = [_traj(0, "12+34=", "46", "46"), _traj(1, "7+8=", "16", "15")]
    w.score(trajs)
    # queries: prompt + response + the EOS token, decoded with special tokens kept
    assert trajs[0].reward == float(len("12+34=46" + EOS))
    assert trajs[1].reward == float(len("7+8=16" + EOS))
    assert [t.score for t in trajs] == [1.0, 0.0]
    assert trajs[0].extra_logs == {"prompt_len": 6.0, "const": 2.0}
    assert trajs[1].extra_logs == {"prompt_len": 4.0, "const": 2.0}
    assert all(t.status == TrajectoryStatus.OK for t in trajs)


def test_scores_answer_only_the_set_fields_and_apply_gives_the_scored_trajectories(tmp_path, tiny_model_path):
    path = _write(
        tmp_path,
        "import math\n"
        "def reward_func(queries, prompts, labels, responses):\n"
        "    r = [math.nan if x == 'bad' else float(len(x)) for x in responses]\n"
        "    return {'rewards': r, 'scores': [2 * x for x in r], 'extra_logs': {'n': [1.0 for _ in r]}}\n",
    )
    w = RewardWorker(RewardSpec(source=path, tokenizer=str(tiny_model_path)))
    made = [_traj(0, "1+2=", "3", "3"), _traj(0, "1+2=", "bad", "3"), _traj(1, "2+2=", "4" * 40, "4")]
    in_place = w.score(pickle.loads(pickle.dumps(made)))  # what `score` leaves on the trajectories
    sent = pickle.loads(pickle.dumps(made))  # the controller's copies (the Ray actor scores its own)
    answer = w.scores(pickle.loads(pickle.dumps(made)))
    assert all(isinstance(a, Scored) for a in answer)
    assert len(pickle.dumps(answer)) * 2 < len(pickle.dumps(in_place))  # no tokens, no prompt back
    assert pickle.dumps(apply_scores(sent, answer)) == pickle.dumps(in_place)  # field for field
    assert [t.status for t in sent] == [TrajectoryStatus.OK, TrajectoryStatus.FAILED, TrajectoryStatus.OK]
    assert sent[2].reward == 40.0 and sent[2].score == 80.0 and sent[2].extra_logs == {"n": 1.0}
    with pytest.raises(RuntimeError, match="2 scores for 3"):
        apply_scores(sent, answer[:2])


def test_raising_reward_function_fails_and_counts(tmp_path, tiny_model_path):
    path = _write(tmp_path, "def reward_func(queries, prompts, labels):\n    raise RuntimeError('boom')\n")
    w = RewardWorker(RewardSpec(source=path, tokenizer=str(tiny_model_path)))
    trajs = [_traj(0, "1+2=", "3", "3"), _traj(0, "1+2=", "4", "3"), _traj(1, "2+2=", "4", "4")]
    for t in trajs:
        t.reward = 0.5  # whatever was there is not kept as if it were a score
    before = FAILURES.counts["exception"]
    w.score(trajs)
    assert FAILURES.counts["exception"] - before == 3
    for t in trajs:
        assert t.status == TrajectoryStatus.FAILED
        assert t.failure_kind == "exception"
        assert t.reward is None and t.score is None
        assert "boom" in t.error


def test_nan_and_wrong_length_outputs(tmp_path, tiny_model_path):
    nan = _write(
        tmp_path, "def reward_func(queries, prompts, labels):\n    return [1.0, float('nan'), 0.0]\n"
    )
    w = RewardWorker(RewardSpec(source=nan, tokenizer=str(tiny_model_path)))
    trajs = [_traj(i, "1+2=", "3", "3") for i in range(3)]
    w.score(trajs)
    assert [t.status for t in trajs] == [TrajectoryStatus.OK, TrajectoryStatus.FAILED, TrajectoryStatus.OK]
    assert [t.reward for t in trajs] == [1.0, None, 0.0]
    assert trajs[1].failure_kind == "nan"

    short = tmp_path / "short"
    short.mkdir()
    path = _write(short, "def reward_func(queries, prompts, labels):\n    return [1.0]\n")
    w = RewardWorker(RewardSpec(source=path, tokenizer=str(tiny_model_path)))
    trajs = [_traj(i, "1+2=", "3", "3") for i in range(2)]
    w.score(trajs)
    assert [t.failure_kind for t in trajs] == ["wrong_length", "wrong_length"]
    assert all(t.reward is None for t in trajs)


def test_slow_reward_function_times_out(tmp_path, tiny_model_path):
    path = _write(
        tmp_path,
        "import time\n\ndef reward_func(queries, prompts, labels):\n    time.sleep(3)\n    return [1.0]\n",
    )
    w = RewardWorker(RewardSpec(source=path, tokenizer=str(tiny_model_path), timeout_s=0.2))
    trajs = [_traj(0, "1+2=", "3", "3")]
    w.score(trajs)
    assert trajs[0].status == TrajectoryStatus.FAILED and trajs[0].failure_kind == "timeout"


def test_agent_rewards_are_kept():
    w = RewardWorker(RewardSpec(source=AGENT))
    trajs = [_traj(0, "guess 1-3: ", "2", None), _traj(1, "guess 1-3: ", "1", None)]
    trajs[0].reward, trajs[0].score = 0.75, 1.0
    trajs[1].status, trajs[1].failure_kind = TrajectoryStatus.FAILED, "timeout"
    w.score(trajs)
    assert (trajs[0].reward, trajs[0].score, trajs[0].status) == (0.75, 1.0, TrajectoryStatus.OK)
    assert (trajs[1].reward, trajs[1].status) == (None, TrajectoryStatus.FAILED)


def test_local_reward_model_scores_the_token_ids(tmp_path, tiny_model_path):
    rm = save_tiny_reward_model(tmp_path / "rm")
    w = RewardWorker(RewardSpec(source=f"rm:{rm}", tokenizer=str(tiny_model_path)))
    trajs = [_traj(0, "12+34=", "46", "46"), _traj(1, "7+8=", "1599", "15")]
    w.score(trajs)
    independent = AutoModelForSequenceClassification.from_pretrained(rm)
    for t in trajs:  # the head at the last token of the sequence run alone
        with torch.no_grad():
            hidden = independent.model(input_ids=torch.tensor([t.token_ids])).last_hidden_state[0, -1]
            want = float(independent.score(hidden)[0])
        assert t.status == TrajectoryStatus.OK
        assert t.reward == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert t.score == t.reward
    assert trajs[0].reward != trajs[1].reward
