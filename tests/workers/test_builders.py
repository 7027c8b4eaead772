"""relayrl/workers/builders.py: the construction contracts of what the role workers own.

- setup_process seeds python / numpy / torch (the same seed gives the same draws).
- inference_dtype: fp32 on a CPU whatever model.dtype says; on a GPU fp32 / fp16 when asked, else bf16.
- build_trainable: fp32 master weights whatever model.dtype says, equal to the folder's; LoRA adapters when
  lora.rank > 0 (only they train); the tokenizer of the folder.
- build_frozen: eval mode, no gradients, the inference dtype of `like`, the folder's weights, never adapters.
- build_policy_objective maps the resolved algo (clip bounds, dual clip 0 -> None, KL estimator only when
  kl_mode is loss, the generation budget as Dr. GRPO's constant); exact_on_policy's truth table.
- engine_slots: rollout.engine_slots, else the samples of one engine's share of a step's prompts (+1/8 slack,
  at most the whole step); an engine with fewer slots than a share's samples queues the rest and returns
  every sample.
- engine_copy: rollout.engine_copy yes / no as set; auto only for a native engine on a GPU without exact mode,
  fp8 or LoRA, not with dist.engine_sleep yes or offload_optimizer_in_rollout, and only while the copy takes
  <= 5% of the card's memory (the boundary byte exact).
- build_engine_for: native engine slots (engine_slots, at least the eval samples), max_len, prefix cache off for single-turn; an own-weights engine (vllm) without a source or on
  another device is refused before anything loads.
- build_executor: single -> SingleTurnExecutor bound to the engine with max_len; multi -> the multi-turn task's
  executor or a user file's AgentInstance; a task without one is refused.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from relayrl.agents.base import AgentExecutorBase
from relayrl.agents.executors import MultiTurnExecutor, SingleTurnExecutor
from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.config.dist import DistConfig
from relayrl.config.rl import AlgoConfig, EvalConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.models.loading import checkpointing_enabled
from relayrl.models.tiny import build_tiny_model, build_tiny_tokenizer
from relayrl.rollout.native import NativeEngine
from relayrl.tasks.guess import GuessAgent
from relayrl.trainers.rl.validate import resolve_algo
from relayrl.workers.builders import (
    build_engine_for,
    build_executor,
    build_frozen,
    build_policy_objective,
    build_trainable,
    engine_copy,
    engine_slots,
    exact_on_policy,
    inference_dtype,
    setup_process,
)
from relayrl.workers.engine import generate_share, sampling_params

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only its type is read: no GPU is needed


def _reference_weights() -> dict[str, torch.Tensor]:
    """The weights save_tiny writes (the conftest folder): the tiny model of the default spec."""
    return build_tiny_model(build_tiny_tokenizer()).state_dict()


def test_setup_process_seeds_every_generator():
    setup_process(123)
    a = (random.random(), float(np.random.rand()), torch.rand(3))
    setup_process(123)
    b = (random.random(), float(np.random.rand()), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    setup_process(124)
    assert not torch.equal(torch.rand(3), b[2])


@pytest.mark.parametrize(
    ("dtype", "cpu", "cuda"),
    [
        ("auto", torch.float32, torch.bfloat16),
        ("bf16", torch.float32, torch.bfloat16),
        ("fp16", torch.float32, torch.float16),
        ("fp32", torch.float32, torch.float32),
    ],
)
def test_inference_dtype(dtype, cpu, cuda):
    m = ModelConfig(name_or_path="x", dtype=dtype)
    assert inference_dtype(m, CPU) == cpu
    assert inference_dtype(m, CUDA) == cuda


def test_build_trainable_is_fp32_and_equals_the_folder(tiny_model_path):
    model, tok = build_trainable(ModelConfig(name_or_path=str(tiny_model_path), dtype="bf16"), CPU)
    assert tok.pad_token_id == build_tiny_tokenizer().pad_token_id
    assert tok.encode("12+34=") == build_tiny_tokenizer().encode("12+34=")
    want = _reference_weights()
    got = model.state_dict()
    assert set(got) == set(want)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.requires_grad, name
    for k, v in want.items():
        assert torch.equal(got[k].float(), v), k


def test_build_trainable_with_lora_trains_only_adapters(tiny_model_path):
    cfg = ModelConfig(name_or_path=str(tiny_model_path), lora=LoraConfig(rank=4, alpha=8))
    model, _ = build_trainable(cfg, CPU)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert frozen and not any("lora_" in n for n in frozen)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("like", "dtype"), [(None, torch.float32), (CUDA, torch.bfloat16)])
def test_build_frozen(tiny_model_path, like, dtype):
    # LoRA in the config is ignored: the reference is the base weights
    cfg = ModelConfig(name_or_path=str(tiny_model_path), lora=LoraConfig(rank=4), gradient_checkpointing=True)
    model = build_frozen(cfg, CPU, like=like)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.dtype == dtype for p in model.parameters())
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert not checkpointing_enabled(model)
    want = _reference_weights()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v.float(), want[k].to(dtype).float(), rtol=0, atol=0)


def test_build_policy_objective_maps_the_resolved_algo():
    algo = resolve_algo(
        AlgoConfig(
            policy_loss="ppo",
            clip_eps_low=0.1,
            clip_eps_high=0.3,
            dual_clip_c=0.0,
            aggregation="seq_mean_token_sum_norm",
            kl_mode="loss",
            kl_estimator="k2",
            entropy_coef=0.01,
            off_policy="tis",
            off_policy_high=2.0,
        )
    )
    o = build_policy_objective(algo, max_new_tokens=48)
    assert (o.policy_loss, o.eps_low, o.eps_high, o.dual_clip) == ("ppo", 0.1, 0.3, None)
    assert (o.aggregation, o.norm_const) == ("seq_mean_token_sum_norm", 48.0)
    assert (o.kl_loss_estimator, o.entropy_coef) == ("k2", 0.01)
    assert (o.off_policy, o.off_policy_low, o.off_policy_high) == ("tis", None, 2.0)

    o2 = build_policy_objective(replace(algo, kl_mode="reward", dual_clip_c=3.0), max_new_tokens=8)
    assert o2.kl_loss_estimator is None  # a KL in the reward is no loss term
    assert o2.dual_clip == 3.0


@pytest.mark.parametrize(
    ("epochs", "mini_batches", "kl_mode", "want"),
    [
        (1, 1, "none", True),
        (1, 1, "loss", True),
        (1, 1, "reward", False),  # the KL penalty needs the log-probs before the update
        (2, 1, "none", False),
        (1, 2, "none", False),
    ],
)
def test_exact_on_policy(epochs, mini_batches, kl_mode, want):
    algo = replace(resolve_algo(AlgoConfig()), epochs=epochs, mini_batches=mini_batches, kl_mode=kl_mode)
    assert exact_on_policy(algo) is want


@pytest.mark.parametrize(
    ("slots", "prompts", "n", "eval_n", "want"),
    [(0, 3, 2, 1, 6), (5, 3, 2, 1, 5), (2, 3, 2, 4, 4)],
)
def test_build_engine_for_native_settings(tiny_model, tiny_tokenizer, slots, prompts, n, eval_n, want):
    rollout = RolloutConfig(engine_slots=slots, prompts_per_step=prompts, n_samples=n, max_len=40)
    engine = build_engine_for(rollout, EvalConfig(n_samples=eval_n), tiny_model, tiny_tokenizer)
    try:
        assert isinstance(engine, NativeEngine)
        assert engine.model is tiny_model  # generates from the module it was given
        assert engine.max_slots == want
        assert engine.max_seq_len == 40
        assert engine.pool.enabled is False  # single-turn: fresh prompts never hit the prefix cache
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("slots", "prompts", "n", "engines", "want"),
    [(0, 64, 8, 1, 512), (0, 128, 8, 2, 576), (0, 256, 8, 4, 576), (0, 3, 2, 2, 6), (0, 5, 1, 8, 2),
     (7, 64, 8, 4, 7)],
)  # fmt: skip
def test_engine_slots_cover_one_engine_s_share(slots, prompts, n, engines, want):
    rollout = RolloutConfig(engine_slots=slots, prompts_per_step=prompts, n_samples=n)
    assert engine_slots(rollout, engines) == want  # 128 over 2: a share of 64 prompts + 8 slack, x 8 samples


def test_an_engine_with_fewer_slots_queues_the_rest(tiny_model, tiny_tokenizer):
    rollout = RolloutConfig(engine_slots=3, prompts_per_step=4, n_samples=2, max_new_tokens=5, max_len=40)
    engine = build_engine_for(rollout, EvalConfig(n_samples=1), tiny_model, tiny_tokenizer)
    try:
        assert isinstance(engine, NativeEngine) and engine.max_slots == 3  # 8 samples, 3 slots
        executor = build_executor(rollout, engine, tiny_tokenizer)
        samples = [PromptSample(index=i, prompt=t, prompt_ids=tiny_tokenizer.encode(t)) for i, t in
                   enumerate(["1+2=", "3+4=", "5+6=", "7+8="])]  # fmt: skip
        trajs = generate_share(executor, sampling_params(rollout, EvalConfig()), samples, 0, 5)
        assert [t.sample.index for t in trajs] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(1 <= sum(t.action_mask) <= 5 for t in trajs)
    finally:
        engine.close()


def test_build_engine_for_multi_turn_keeps_the_prefix_cache(tiny_model, tiny_tokenizer):
    rollout = RolloutConfig(agent="multi", agent_file="guess", prompts_per_step=1, n_samples=1, max_len=40)
    engine = build_engine_for(rollout, EvalConfig(), tiny_model, tiny_tokenizer)
    try:
        assert engine.pool.enabled is True  # None -> the engine's default for a CPU model: on
    finally:
        engine.close()


def test_build_engine_for_own_weights_engine_refusals(tiny_tokenizer, tiny_model_path):
    rollout = RolloutConfig(engine="vllm")
    with pytest.raises(ValueError, match="source="):
        build_engine_for(rollout, EvalConfig(), None, tiny_tokenizer)
    with pytest.raises(ValueError, match="source="):
        build_engine_for(rollout, EvalConfig(), None, tiny_tokenizer, source=ModelConfig())
    elsewhere = replace(rollout, engine_device="cuda:1")
    with pytest.raises(ValueError, match="engine_device"):
        build_engine_for(
            elsewhere,
            EvalConfig(),
            None,
            tiny_tokenizer,
            source=ModelConfig(name_or_path=str(tiny_model_path)),
        )


class _Engine:
    """Stands for an engine: the executors only hold it until they run."""


def test_build_executor_single(tiny_tokenizer):
    engine = _Engine()
    ex = build_executor(RolloutConfig(max_len=77), engine, tiny_tokenizer)
    assert type(ex) is SingleTurnExecutor
    assert ex.engine is engine and ex.tokenizer is tiny_tokenizer and ex.max_total_len == 77


def test_build_executor_multi_turn_task(tiny_tokenizer):
    engine = _Engine()
    rollout = RolloutConfig(agent="multi", max_len=90)
    ex = build_executor(rollout, engine, tiny_tokenizer, task_name="guess", step_timeout=5.0)
    assert isinstance(ex, MultiTurnExecutor)
    assert ex.agent_cls is GuessAgent
    assert ex.engine is engine and ex.max_total_len == 90 and ex.step_timeout == 5.0
    # agent_file naming a task wins over the run's task
    ex2 = build_executor(replace(rollout, agent_file="guess"), engine, tiny_tokenizer, task_name="add2")
    assert isinstance(ex2, MultiTurnExecutor) and ex2.agent_cls is GuessAgent


def test_build_executor_user_file(tiny_tokenizer, tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(
        "from relayrl.agents.base import AgentInstanceBase\n\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def step(self, states, **kwargs):\n"
        "        return {'rewards': 1.0, 'environment_feedback': '', 'done': True}\n"
    )
    engine = _Engine()
    rollout = RolloutConfig(agent="multi", agent_file=str(path), max_len=50, max_turns=3)
    ex = build_executor(rollout, engine, tiny_tokenizer, step_timeout=7.0)
    assert isinstance(ex, MultiTurnExecutor) and isinstance(ex, AgentExecutorBase)
    assert ex.agent_cls.__name__ == "AgentInstance"
    assert ex.engine is engine and ex.max_total_len == 50 and ex.max_turns == 3 and ex.step_timeout == 7.0


def test_build_executor_refuses_a_task_without_an_agent(tiny_tokenizer):
    with pytest.raises(ValueError, match="multi-turn"):
        build_executor(RolloutConfig(agent="multi"), _Engine(), tiny_tokenizer, task_name="add2")


def test_engine_copy_auto_only_for_a_plain_native_engine_whose_copy_is_small(monkeypatch):
    class Props:
        total_memory = 100 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    limit = 5 * 2**30 // 2  # bf16 parameters whose copy is exactly 5% of 100 GiB
    auto, model = RolloutConfig(), ModelConfig(name_or_path="m")
    assert engine_copy(auto, model, limit, torch.bfloat16, CUDA)
    assert not engine_copy(auto, model, limit + 1, torch.bfloat16, CUDA)
    assert not engine_copy(auto, model, limit, torch.float32, CUDA)  # 4 bytes a parameter: 10%
    assert not engine_copy(auto, model, 10, torch.bfloat16, CPU)
    for rollout in (RolloutConfig(exact=True), RolloutConfig(quantization="fp8"), RolloutConfig(engine="hf")):
        assert not engine_copy(rollout, model, 10, torch.bfloat16, CUDA)
    lora = ModelConfig(name_or_path="m", lora=LoraConfig(rank=8))
    assert not engine_copy(auto, lora, 10, torch.bfloat16, CUDA)
    # settings that save memory around the update: a copy would stay on the card through it
    for dist in (DistConfig(engine_sleep="yes"), DistConfig(mode="ray", offload_optimizer_in_rollout=True)):
        assert not engine_copy(auto, model, 10, torch.bfloat16, CUDA, dist)
    assert engine_copy(auto, model, 10, torch.bfloat16, CUDA, DistConfig())
    # set explicitly, the setting wins over every rule
    assert engine_copy(RolloutConfig(engine_copy="yes"), lora, 10**12, torch.float32, CPU)
    assert not engine_copy(RolloutConfig(engine_copy="no"), model, 10, torch.bfloat16, CUDA)
