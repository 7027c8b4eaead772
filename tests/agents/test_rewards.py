"""Reward sources: reward_func files (timeout, bad outputs), a task, a local reward model."""

from __future__ import annotations

import asyncio
import math
import textwrap
import threading
import time

import pytest
import torch

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import FailureLog
from relayrl.agents.rewards import (
    LocalRewardModel,
    LocalRMSource,
    RewardFuncSource,
    TaskRewardSource,
    build_reward_source,
)
from relayrl.data.records import PromptSample
from relayrl.tasks import get_task


def make_trajs(tok, responses: list[str], label: str = "46") -> list[Trajectory]:
    out = []
    for i, text in enumerate(responses):
        prompt = "12+34="
        p_ids, r_ids = tok(prompt)["input_ids"], tok(text)["input_ids"] + [tok.eos_token_id]
        sample = PromptSample(index=i // 2, prompt=prompt, prompt_ids=p_ids, label=label)
        out.append(
            Trajectory(
                sample=sample,
                token_ids=p_ids + r_ids,
                action_mask=[False] * len(p_ids) + [True] * len(r_ids),
                rollout_logprobs=[0.0] * len(p_ids) + [-0.5] * len(r_ids),
                response_text=text,
            )
        )
    return out


REWARD_FILE = textwrap.dedent(
    """
    import time
    import torch

    def reward_func(queries, prompts, labels, responses):
        if responses[0] == "slow":
            time.sleep(3)
        if responses[0] == "boom":
            raise ZeroDivisionError("boom")
        if responses[0] == "short":
            return [1.0]
        r = torch.tensor([1.0 if q.endswith(l + "<|im_end|>") else 0.0 for q, l in zip(queries, labels)])
        r[[i for i, x in enumerate(responses) if x == "nan"]] = float("nan")
        return {"rewards": r, "scores": r * 0.5, "extra_logs": {"len": torch.tensor([float(len(x)) for x in responses]),
                "batch_mean": r.nanmean()}}
    """
)


def test_reward_func_file_openrlhf_contract(tiny_tokenizer, tmp_path):
    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FILE)
    trajs = make_trajs(tiny_tokenizer, ["46", "47", "nan", "46"])
    log = FailureLog()
    source = build_reward_source(str(path), tokenizer=tiny_tokenizer, batch_size=2, log=log)
    assert isinstance(source, RewardFuncSource)
    asyncio.run(source.score(trajs))
    # queries = decode(prompt + response + eos) = "12+34=46<|im_end|>" -> reward 1 for "46"
    assert [t.reward for t in trajs] == [1.0, 0.0, None, 1.0]
    assert [t.score for t in trajs] == [0.5, 0.0, None, 0.5]
    assert trajs[2].status == TrajectoryStatus.FAILED and trajs[2].failure_kind == "nan"
    assert trajs[0].extra_logs == {"len": 2.0, "batch_mean": 0.5}  # batch 1 = ("46", "47"): mean 0.5
    assert trajs[3].extra_logs == {"len": 2.0, "batch_mean": 1.0}  # batch 2 = ("nan", "46"): nanmean 1.0
    assert log.counts == {"nan": 1}


@pytest.mark.parametrize(
    ("response", "kind"), [("slow", "timeout"), ("boom", "exception"), ("short", "wrong_length")]
)
def test_reward_func_failures(tiny_tokenizer, tmp_path, response, kind):
    path = tmp_path / "reward_func.py"
    path.write_text(REWARD_FILE)
    trajs = make_trajs(tiny_tokenizer, [response, "46"])
    log = FailureLog()
    source = RewardFuncSource(path, timeout=0.3, log=log)
    start = time.perf_counter()
    asyncio.run(source.score(trajs))
    assert time.perf_counter() - start < 2.5  # the 3 s sleep is not waited for (0.3 s timeout)
    assert [t.failure_kind for t in trajs] == [kind, kind]  # one call per batch: the whole batch fails
    assert all(t.reward is None and kind in t.error for t in trajs)
    assert log.counts == {kind: 2}


def test_reward_func_plain_function_and_event_loop_free(tiny_tokenizer):
    loop_ran = threading.Event()

    def reward_func(queries, prompts, labels):
        # blocks until a coroutine on the event loop has run: only possible if we are off the loop
        if not loop_ran.wait(10):
            raise RuntimeError("the event loop was blocked while the reward function ran")
        return [float(len(q)) for q in queries]

    async def run() -> None:
        async def other_work() -> None:
            await asyncio.sleep(0)
            loop_ran.set()

        await asyncio.gather(RewardFuncSource(reward_func).score(trajs), other_work())

    trajs = make_trajs(tiny_tokenizer, ["4", "46"])
    asyncio.run(run())
    assert [t.status for t in trajs] == [TrajectoryStatus.OK] * 2, trajs[0].error
    assert [t.reward for t in trajs] == [7.0, 8.0]  # "12+34=" + response, no tokenizer: text concat


def test_async_reward_func_awaited_with_timeout(tiny_tokenizer):
    async def reward_func(queries, prompts, labels, responses):
        if responses[0] == "slow":
            await asyncio.sleep(30)
        return {"rewards": [float(r == lab) for r, lab in zip(responses, labels, strict=True)]}

    trajs = make_trajs(tiny_tokenizer, ["46", "47"])
    asyncio.run(RewardFuncSource(reward_func).score(trajs))
    assert [t.reward for t in trajs] == [1.0, 0.0] and [t.score for t in trajs] == [1.0, 0.0]
    slow = make_trajs(tiny_tokenizer, ["slow"])
    log = FailureLog()
    asyncio.run(RewardFuncSource(reward_func, timeout=0.2, log=log).score(slow))
    assert slow[0].failure_kind == "timeout" and log.counts == {"timeout": 1}


def test_reward_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        build_reward_source(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("def reward_func(queries, prompts, labels)\n    return queries\n")
    with pytest.raises(ImportError, match=r"cannot load reward file .*broken\.py' \(line 1\): SyntaxError"):
        build_reward_source(str(broken))
    other = tmp_path / "other.py"
    other.write_text("def score(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    with pytest.raises(AttributeError, match=r"other\.py has no function `reward_func"):
        build_reward_source(str(other))
    failing = tmp_path / "failing.py"
    failing.write_text("import math\n\nimport not_a_module_anywhere\n")
    with pytest.raises(ImportError, match=r"failing\.py' \(line 3\): ModuleNotFoundError: No module named"):
        build_reward_source(str(failing))


def test_task_reward_source(tiny_tokenizer):
    trajs = make_trajs(tiny_tokenizer, ["46", " 46 ", "47"])
    source = build_reward_source("task:add2", get_task=get_task)
    assert isinstance(source, TaskRewardSource)
    asyncio.run(source.score(trajs))
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0] and [t.score for t in trajs] == [1.0, 1.0, 0.0]
    assert get_task("add2").reward("46", "46") == 1.0


def test_local_rm_batch_invariant_and_matches_hf_pooling(tiny_tokenizer, tiny_rm_path):
    rm = LocalRewardModel.from_pretrained(str(tiny_rm_path), device="cpu", batch_size=3)
    seqs = [tiny_tokenizer(t)["input_ids"] for t in ["12+34=46", "1", "hello world!", "abc", "9+9=18"]]
    batched = rm.score_ids(seqs)
    alone = [rm.score_ids([s])[0] for s in seqs]
    assert batched == pytest.approx(alone, abs=1e-5)
    with torch.no_grad():  # HF's own pooling on an unpadded sequence: the last token's score
        hf = [rm.model(torch.tensor([s])).logits[0, 0].item() for s in seqs]
    assert alone == pytest.approx(hf, abs=1e-5)
    assert len(set(round(x, 4) for x in alone)) == 5  # distinct inputs, distinct scores

    trajs = make_trajs(tiny_tokenizer, ["46", "47"])
    source = build_reward_source(f"rm:{tiny_rm_path}", device="cpu")
    assert isinstance(source, LocalRMSource)
    asyncio.run(source.score(trajs))
    expected = rm.score_ids([t.token_ids for t in trajs])
    assert [t.reward for t in trajs] == pytest.approx(expected, abs=1e-6)
    assert all(math.isfinite(t.reward) for t in trajs)


def test_build_reward_source_errors():
    with pytest.raises(ValueError, match="not understood"):
        build_reward_source("something")
    with pytest.raises(ValueError, match="http"):
        build_reward_source(["ftp://x"])
    with pytest.raises(ValueError, match="get_task"):  # the reward layer does not import relayrl.tasks
        build_reward_source("task:add2")
