"""relayrl/workers/engine.py: sampling settings, generate_share, and the EngineWorker used in-process (CPU).

- sampling_params: a training step samples n_samples at the rollout temperature / top-p / top-k; eval samples
  eval.n_samples at the eval temperature, both with max_new_tokens.
- generate_share (one rank: every prompt): one executor call per prompt with the request seed
  (seed * 1_000_003 + index * 7919) mod 2^31, trajectories grouped in prompt order whatever order the calls
  finish in.
- EngineWorker.rollout on the tiny model: n samples per prompt, grouped, each the prompt followed by 1..max_new
  action tokens whose log-probs equal an independent forward's log_softmax(logits / T) of the sampled token;
  the same seed gives the same samples, and the same samples as the colocated policy engine (results do not
  depend on where the engine runs); eval (temperature 0) is the greedy decode of an independent argmax loop.
- weight_layout / weight_checksum describe the actor's weights by hand; receive_weights before join refuses.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.agents.base import AgentExecutorBase, Trajectory
from relayrl.agents.rewards.base import queries_of
from relayrl.config.components import ModelConfig
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import EvalConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.models.loading import load_tokenizer
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.rollout.base import SamplingParams
from relayrl.trainers.rl.roles import decode_queries
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.engine import EngineSpec, EngineWorker, generate_share, sampling_params
from relayrl.workers.policy import PolicySpec, PolicyWorker

T = 0.9
TOK = build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only spin-wait on a busy 2-core machine (restored after each test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _samples() -> list[PromptSample]:
    texts = ["12+34=", "7+8=", "99+1="]
    return [PromptSample(index=10 + i, prompt=t, prompt_ids=TOK.encode(t)) for i, t in enumerate(texts)]


def _rollout() -> RolloutConfig:
    return RolloutConfig(
        prompts_per_step=3, n_samples=2, temperature=T, top_p=0.9, top_k=7, max_new_tokens=6, max_len=64
    )


def test_sampling_params():
    r, e = _rollout(), EvalConfig(n_samples=3, temperature=0.5)
    train = sampling_params(r, e)
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_new_tokens) == (2, T, 0.9, 7, 6)
    ev = sampling_params(r, e, eval=True)
    assert (ev.n, ev.temperature, ev.top_p, ev.top_k, ev.max_new_tokens) == (3, 0.5, 1.0, 0, 6)


class _Recorder(AgentExecutorBase):
    """Records each call's params; answers after a delay that makes the calls finish in reverse order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, SamplingParams]] = []

    async def execute(self, sample: PromptSample, params: SamplingParams) -> list[Trajectory]:
        self.calls.append((sample.index, params))
        await asyncio.sleep(0.01 * (100 - sample.index) / 100)
        return [
            Trajectory(sample=sample, token_ids=[k], action_mask=[False], rollout_logprobs=[0.0])
            for k in range(params.n)
        ]


def test_generate_share_seeds_and_order():
    ex = _Recorder()
    base = SamplingParams(n=2, temperature=0.7, max_new_tokens=4)
    samples = _samples()
    seed = 2_000_000_000
    out = generate_share(ex, base, samples, seed, budget=4)
    assert [(t.sample.index, t.token_ids[0]) for t in out] == [
        (10, 0),
        (10, 1),
        (11, 0),
        (11, 1),
        (12, 0),
        (12, 1),
    ]
    seeds = {index: p.seed for index, p in ex.calls}
    assert seeds == {i: (seed * 1_000_003 + i * 7919) % (2**31) for i in (10, 11, 12)}
    assert all(0 <= s < 2**31 for s in seeds.values())
    assert all(replace(p, seed=None) == base for _, p in ex.calls)  # only the seed differs
    assert base.seed is None  # the caller's params are not changed


def _worker(path, **rollout_over) -> EngineWorker:
    spec = EngineSpec(
        model=ModelConfig(name_or_path=str(path)),
        rollout=replace(_rollout(), **rollout_over),
        eval=EvalConfig(n_samples=2, temperature=0.0),
        device="cpu",
    )
    return EngineWorker(spec)


def test_rollout_samples_match_an_independent_forward(tiny_model_path):
    w = _worker(tiny_model_path, top_p=1.0, top_k=0)
    try:
        samples = _samples()
        trajs = w.rollout(samples, seed=4)
        assert [t.sample.index for t in trajs] == [10, 10, 11, 11, 12, 12]
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        for t in trajs:
            p = len(t.sample.prompt_ids)
            assert t.token_ids[:p] == t.sample.prompt_ids
            assert t.action_mask == [False] * p + [True] * (len(t.token_ids) - p)
            assert 1 <= t.response_len <= 6
            assert all(x == 0.0 for x in t.rollout_logprobs[:p])
            with torch.no_grad():
                logits = fresh(input_ids=torch.tensor([t.token_ids])).logits[0, :-1].float()
            logp = torch.log_softmax(logits / T, -1)
            want = logp.gather(1, torch.tensor(t.token_ids[1:])[:, None]).squeeze(1)[p - 1 :]
            torch.testing.assert_close(torch.tensor(t.rollout_logprobs[p:]), want, rtol=1e-4, atol=1e-4)
        again = w.rollout(samples, seed=4)
        assert [t.token_ids for t in again] == [t.token_ids for t in trajs]
        assert [t.token_ids for t in w.rollout(samples, seed=5)] != [t.token_ids for t in trajs]
    finally:
        w.close()


def test_rollout_equals_the_colocated_policy_engine(tiny_model_path, tmp_path):
    cfg = validate_rl(tiny_cpu_config(str(tiny_model_path), str(tmp_path)))
    policy = PolicyWorker(
        PolicySpec(
            model=cfg.model, optim=cfg.optim, algo=cfg.algo, rollout=_rollout(), eval=cfg.eval, device="cpu"
        )
    )
    w = _worker(tiny_model_path)
    try:
        here, there = w.rollout(_samples(), seed=8), policy.rollout(_samples(), seed=8)
        assert [t.token_ids for t in here] == [t.token_ids for t in there]
        for a, b in zip(here, there, strict=True):
            torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs))
    finally:
        w.close()
        policy.close()


def test_eval_rollout_is_the_greedy_decode(tiny_model_path):
    w = _worker(tiny_model_path)
    try:
        trajs = w.rollout(_samples(), seed=1, eval=True)
        assert [t.sample.index for t in trajs] == [10, 10, 11, 11, 12, 12]  # eval.n_samples = 2
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        for t in trajs:
            ids = list(t.sample.prompt_ids)
            with torch.no_grad():
                for _ in range(6):
                    nxt = int(fresh(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                    ids.append(nxt)
                    if nxt == TOK.eos_token_id:
                        break
            assert t.token_ids == ids
    finally:
        w.close()


def test_weight_layout_and_checksum(tiny_model_path):
    w = _worker(tiny_model_path)
    try:
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        layout = w.weight_layout()
        assert layout == [(n, tuple(p.shape), "torch.float32") for n, p in fresh.named_parameters()]
        want = sum(float(p.detach().double().abs().sum()) for p in fresh.parameters())
        (got,) = w.weight_checksum()
        assert got == pytest.approx(want, rel=1e-12)
        with pytest.raises(RuntimeError, match="before join"):
            w.receive_weights(1)
    finally:
        w.close()


def test_ranks_decode_the_reward_queries_the_driver_would(tiny_model_path, tmp_path):
    """decode_queries (Ray, a reward_func file or remote RM): each trajectory's query_text is the decode of all
    its ids with special tokens kept, made on the rank; every other field is the same as without it, and the
    reward source's queries (agents.rewards.base.queries_of) are the same strings, read instead of decoded."""
    plain, decoding = _worker(tiny_model_path), _worker(tiny_model_path)
    decoding.spec.decode_queries = True
    try:
        old, new = plain.rollout(_samples(), seed=4), decoding.rollout(_samples(), seed=4)
    finally:
        plain.close()
        decoding.close()
    assert all(t.query_text is None for t in old)
    assert [replace(t, query_text=None) for t in new] == old
    tok = load_tokenizer(str(tiny_model_path))  # the reward source's (workers.reward.reward_spec)
    want = [tok.decode(t.token_ids, skip_special_tokens=False) for t in old]
    assert [t.query_text for t in new] == want == queries_of(old, tok)
    assert queries_of([replace(new[0], query_text="read, not decoded"), old[1]], tok) == [
        "read, not decoded",
        want[1],
    ]
    # where it is on: Ray and a source that reads the queries
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path), reward="tests/trainers/data/digit_reward.py")
    ray_cfg = replace(cfg, dist=replace(cfg.dist, mode="ray"))
    assert decode_queries(ray_cfg) and not decode_queries(cfg)
    assert not decode_queries(replace(ray_cfg, reward=replace(cfg.reward, source="task:add2")))
