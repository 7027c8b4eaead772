"""relayrl/workers/reward.py: where the reward role runs and what travels to it (runs_in_process, payload,
score_trajectories; relayrl.trainers.rl.roles.spawn_reward / _sizes).

- in process (a worker in this process scoring the trajectories themselves) and through an actor (`payload`
  there, `Scored` back, apply_scores) give exactly what the old path gave (every field pickled to the actor,
  `Scored` back): rewards, scores, statuses, errors, failure kinds, extra_logs, on a batch with normal, NaN,
  already-failed and extra-log trajectories, and on one whose function raises; the failure log counts the
  in-process failures.
- the actor receives no log-prob / version lists, and the controller's trajectories keep theirs.
- only task:, reward_func files and agent run in process; rm:, prm: and http(s) sources keep their actor, and
  with an in-process reward the Ray launcher places no reward actor.
- decode_all: the same strings as one tokenizer.decode per trajectory (relayrl.agents.rewards.base).
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import FAILURES
from relayrl.agents.rewards.base import decode_all, plain_fast_decode
from relayrl.agents.rewards.spec import AGENT
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.distributed.launch.local import LocalLauncher, LocalRole
from relayrl.models.tiny import IM_START, build_tiny_tokenizer
from relayrl.trainers.rl.roles import _sizes, spawn_reward
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.reward import (
    RewardSpec,
    RewardWorker,
    apply_scores,
    runs_in_process,
    score_trajectories,
)

TOK = build_tiny_tokenizer()

MIXED = (
    "import math\n"
    "def reward_func(queries, prompts, labels, responses):\n"
    "    r = [math.nan if x == 'bad' else float(len(q)) for q, x in zip(queries, responses)]\n"
    "    return {'rewards': r, 'scores': [x / 2 for x in r],\n"
    "            'extra_logs': {'n': [float(len(x)) for x in responses], 'const': 3.0,\n"
    "                           'odd': [math.inf if x == '4' else 1.0 for x in responses]}}\n"
)
RAISES = "def reward_func(queries, prompts, labels):\n    raise RuntimeError('boom')\n"


def _traj(index: int, prompt: str, response: str, label: str = "") -> Trajectory:
    p = TOK.encode(prompt)
    r = [*TOK.encode(response), TOK.eos_token_id]
    return Trajectory(
        sample=PromptSample(index=index, prompt=prompt, prompt_ids=p, label=label),
        token_ids=p + r,
        action_mask=[False] * len(p) + [True] * len(r),
        rollout_logprobs=[0.0] * len(p) + [-0.25 * (i + 1) for i in range(len(r))],
        versions=[-1] * len(p) + [2] * len(r),
        response_text=response,
    )


def _batch() -> list[Trajectory]:
    out = [_traj(0, "1+2=", "3"), _traj(0, "1+2=", "bad"), _traj(1, "2+2=", "4"), _traj(1, "2+2=", "44")]
    out[2].extra_logs = {"turns": 1.0}  # the agent's own log, merged with the function's
    out[3].status, out[3].failure_kind, out[3].error = TrajectoryStatus.FAILED, "timeout", "engine timed out"
    return out


class PickledActor:
    """A reward actor stand-in: the arguments and the answer cross a pickle boundary, as through Ray."""

    name, world = "reward", 1

    def __init__(self, worker: RewardWorker) -> None:
        self.worker = worker
        self.received: list[Trajectory] = []

    def call(self, method: Any, *args: Any) -> Any:
        (trajs,) = pickle.loads(pickle.dumps(args))
        self.received = trajs
        return pickle.loads(pickle.dumps(getattr(self.worker, method.__name__)(trajs)))


def _fields(trajs: list[Trajectory]) -> list[tuple]:
    return [
        (t.reward, t.score, t.status, t.error, t.failure_kind, t.extra_logs, t.dense_rewards) for t in trajs
    ]


@pytest.mark.parametrize("body", [MIXED, RAISES], ids=["mixed", "raises"])
def test_in_process_and_actor_paths_score_exactly_as_the_old_path(tmp_path, tiny_model_path, body):
    path = tmp_path / "reward.py"
    path.write_text(body)
    worker = RewardWorker(RewardSpec(source=str(path), tokenizer=str(tiny_model_path)))
    old = _batch()  # the old path: every field to the actor, Scored back
    apply_scores(old, PickledActor(worker).call(RewardWorker.scores, old))
    before = dict(FAILURES.counts)
    local = score_trajectories(LocalRole("reward", worker), _batch())  # type: ignore[arg-type]
    counted = {k: v - before.get(k, 0) for k, v in FAILURES.counts.items() if v != before.get(k, 0)}
    actor = PickledActor(worker)
    remote = score_trajectories(actor, _batch())  # type: ignore[arg-type]

    assert _fields(local) == _fields(old) and _fields(remote) == _fields(old)
    if body == MIXED:  # the values themselves, so that the three paths cannot agree on nothing
        assert [t.reward for t in old] == [
            float(len("1+2=3<|im_end|>")),
            None,
            float(len("2+2=4<|im_end|>")),
            None,
        ]
        assert [t.failure_kind for t in old] == [None, "nan", None, "timeout"]
        assert old[0].extra_logs == {"n": 1.0, "const": 3.0, "odd": 1.0}
        assert old[2].extra_logs == {"turns": 1.0, "n": 1.0, "const": 3.0}  # inf left out
        assert counted == {"nan": 1}
    else:
        assert [t.failure_kind for t in old] == ["exception"] * 3 + ["timeout"]
        assert "boom" in (old[0].error or "") and counted == {"exception": 3}


def test_the_actor_gets_no_logprobs_and_the_controller_keeps_them(tmp_path, tiny_model_path):
    path = tmp_path / "reward.py"
    path.write_text(MIXED)
    actor = PickledActor(RewardWorker(RewardSpec(source=str(path), tokenizer=str(tiny_model_path))))
    trajs = _batch()
    kept = [(list(t.token_ids), list(t.rollout_logprobs), list(t.versions)) for t in trajs]
    score_trajectories(actor, trajs)  # type: ignore[arg-type]
    assert [(t.rollout_logprobs, t.versions, t.routes) for t in actor.received] == [([], [], None)] * 4
    sent = [(t.token_ids, t.action_mask, t.response_text, t.sample.prompt) for t in actor.received]
    assert sent == [(t.token_ids, t.action_mask, t.response_text, t.sample.prompt) for t in trajs]
    assert [(t.token_ids, t.rollout_logprobs, t.versions) for t in trajs] == kept


@pytest.mark.parametrize(
    "source, inside",
    [
        ("task:add2", True),
        ("examples/reward_func.py", True),
        (AGENT, True),
        ("rm:/models/rm", False),
        ("prm:/models/prm", False),
        ("http://127.0.0.1:5000/get_reward", False),
        ("http://a:1/r,https://b:2/r", False),
    ],
)
def test_only_in_process_sources_skip_the_actor(source, inside):
    assert runs_in_process(RewardSpec(source=source)) is inside


class FakeRayLauncher:
    """Records what it was asked to spawn (no Ray)."""

    mode = "ray"

    def __init__(self) -> None:
        self.spawned: list[str] = []

    def spawn(self, name: str, cls: Any, *args: Any) -> str:
        self.spawned.append(name)
        return "actor"


def test_spawn_reward_places_an_actor_only_for_model_and_remote_sources(tiny_model_path, tmp_path):
    ray = FakeRayLauncher()
    role = spawn_reward(ray, RewardSpec(source="task:add2"))  # type: ignore[arg-type]
    assert isinstance(role, LocalRole) and isinstance(role.instance, RewardWorker) and ray.spawned == []
    assert spawn_reward(ray, RewardSpec(source="rm:/models/rm")) == "actor"  # type: ignore[arg-type]
    assert ray.spawned == ["reward"]
    local = spawn_reward(LocalLauncher(), RewardSpec(source="task:add2"))  # local mode: the launcher's role
    assert isinstance(local, LocalRole)
    cfg = validate_rl(tiny_cpu_config(str(tiny_model_path), str(tmp_path)))
    assert "reward" not in _sizes(cfg, cfg.algo, 0, reward_actor=False)
    assert _sizes(cfg, cfg.algo, 0, reward_actor=True)["reward"] == 1


def test_decode_all_is_one_decode_per_trajectory():
    ids = [_traj(i, "7+8=", r).token_ids for i, r in enumerate(["15", " a b\n", "", "x y"])]
    ids += [[*TOK.encode(IM_START), *TOK.encode("user\nhi"), TOK.eos_token_id, TOK.pad_token_id]]
    want = [str(TOK.decode(x, skip_special_tokens=False)) for x in ids]
    assert plain_fast_decode(TOK) and decode_all(TOK, ids) == want
    assert IM_START in want[-1] and "<|im_end|>" in want[0]  # special tokens kept

    class Wrapped:  # not a fast tokenizer: one decode each, through its own `decode`
        def decode(self, x: list[int], skip_special_tokens: bool = False) -> str:
            return "|" + str(TOK.decode(x, skip_special_tokens=skip_special_tokens))

    assert not plain_fast_decode(Wrapped()) and decode_all(Wrapped(), ids) == ["|" + w for w in want]
    TOK.clean_up_tokenization_spaces = True  # a tokenizer that cleans up spaces: its own decode
    try:
        assert not plain_fast_decode(TOK) and decode_all(TOK, ids) == want
    finally:
        TOK.clean_up_tokenization_spaces = False
