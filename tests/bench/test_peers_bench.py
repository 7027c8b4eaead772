"""bench/peers' verl and OpenRLHF harness on the CPU: log parsing, data files, the process runner (timeout,
step counting, partial results) and the summary. The peers themselves run only on the GPU machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(PEERS))

import openrlhf_grpo  # noqa: E402
import peer_common as pc  # noqa: E402
import verl_grpo  # noqa: E402
import verl_reward  # noqa: E402

VERL_LINE = (
    "(TaskRunner pid=123) step:3 - actor/pg_loss:0.01 - response_length/mean:101.5 - timing_s/gen:2.5 - "
    "timing_s/old_log_prob:0.4 - timing_s/update_actor:1.25 - timing_s/step:4.75 - perf/throughput:99.0"
)
ORL_LINE = (
    "(PPOTrainer pid=9) [INFO] ✨ Global step 2: {'policy_loss': np.float64(0.1), 'rollout/response_length_mean': "
    "90.0, 'rollout/num_samples': 512.0, 'timing/make_experience': 0.5, 'timing/ppo_train': 1.5, "
    "'timing/broadcast': 0.25, 'timing/generation': 2.0, 'timing/step_total': 4.25}"
)


def test_verl_step_line_reads_its_step_timer_parts_and_tokens():
    s = verl_grpo.step_line(VERL_LINE)
    assert s == {"step": 4.75, "gen": 2.5, "update": 1.25, "old_log_prob": 0.4, "gen_tokens": 101.5 * 512}
    assert verl_grpo.step_line("step:3 - actor/pg_loss:0.01") is None  # no step timer: not a step line
    assert verl_grpo.step_line("global_steps: 4 timing") is None


def test_openrlhf_step_line_reads_step_total_parts_and_tokens():
    s = openrlhf_grpo.step_line(ORL_LINE)
    assert s is not None and s["step"] == 4.25 and s["generation"] == 2.0 and s["ppo_train"] == 1.5
    assert s["gen_tokens"] == 90.0 * 512
    # without step_total: the sum of the four parts
    no_total = ORL_LINE.replace(", 'timing/step_total': 4.25", "")
    assert openrlhf_grpo.step_line(no_total)["step"] == pytest.approx(4.25)  # type: ignore[index]
    assert openrlhf_grpo.step_line("Global step 2: {'policy_loss': 0.1}") is None


def test_grab_reads_numbers_in_both_log_forms():
    assert pc.grab("a - timing_s/step:1.5e-1 - b", "timing_s/step") == 0.15
    assert pc.grab("{'timing/x': np.float64(2.5)}", "timing/x") == 2.5
    assert pc.grab("{'timing/x': 3}", "timing/y") is None


def test_verl_reward_is_the_digit_fraction():
    assert verl_reward.compute_score("digits", "12ab", "3") == 0.5
    assert verl_reward.compute_score("digits", "", "3") == 0.0


def test_data_files_hold_the_add2_prompts_as_raw_text(tmp_path):
    pq = verl_grpo.write_data(tmp_path, 5)
    import pandas as pd

    df = pd.read_parquet(pq)
    rows = pc.prompt_rows(5)
    assert [p[0]["content"] for p in df["prompt"]] == [r["input"] for r in rows]
    assert all(p[0]["role"] == "user" for p in df["prompt"])
    js = openrlhf_grpo.write_data(tmp_path, 5).read_text().splitlines()
    assert [json.loads(x)["input"] for x in js] == [r["input"] for r in rows]
    assert rows[0]["input"].endswith("=")


def test_peer_configs_follow_the_batch_and_offload_rules(tmp_path):
    ov = verl_grpo.overrides(Path("/m"), Path("/d"), 4, "7b", 3, tmp_path, False)
    assert "data.train_batch_size=64" in ov and "actor_rollout_ref.rollout.n=8" in ov
    assert (
        "actor_rollout_ref.actor.fsdp_config.param_offload=False" in ov and "trainer.n_gpus_per_node=4" in ov
    )
    one = verl_grpo.overrides(Path("/m"), Path("/d"), 1, "7b", 3, tmp_path, False)
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True" in one
    args = openrlhf_grpo.arguments(Path("/m"), Path("/d"), 1, "0.5b", 3, tmp_path)
    assert "--ds.adam_offload" not in args and args[args.index("--train.batch_size") + 1] == "512"
    assert "--ds.adam_offload" in openrlhf_grpo.arguments(Path("/m"), Path("/d"), 1, "7b", 3, tmp_path)
    assert pc.relayrl_command("7b", 1, 3, Path("/m"), tmp_path / "o.json")[-2].count('"offload": true') == 1


def test_run_logged_counts_steps_stops_early_and_kills_on_timeout(tmp_path):
    code = (
        "import time\n"
        "for i in range(5):\n"
        "    print(f'step:{i} - timing_s/step:{i + 0.5}', flush=True); time.sleep(0.05)\n"
        "time.sleep(60)\n"
    )
    res = pc.run_logged(
        [sys.executable, "-c", code], {}, tmp_path / "a.log", 20, verl_grpo_step, stop_after=3
    )
    assert res["status"].startswith("ok") and [s["step"] for s in res["steps"]] == [0.5, 1.5, 2.5]
    res = pc.run_logged([sys.executable, "-c", code], {}, tmp_path / "b.log", 2, verl_grpo_step)
    assert res["status"].startswith("timeout") and len(res["steps"]) == 5  # partial steps kept
    assert "step:4" in (tmp_path / "b.log").read_text()
    res = pc.run_logged(
        [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "c.log", 20, verl_grpo_step
    )
    assert res["status"] == "exit code 3" and res["steps"] == []


def verl_grpo_step(line: str):
    v = pc.grab(line, "timing_s/step")
    return None if v is None else {"step": v}


def test_summarise_drops_warmup_and_takes_the_median():
    steps = [{"step": 9.0, "gen_tokens": 100.0}] + [{"step": s, "gen_tokens": 100.0} for s in (1.0, 3.0, 2.0)]
    s = pc.summarise(steps, 1)
    assert s["steps_timed"] == 3 and s["step_median_s"] == 2.0 and s["gen_tokens_per_s"] == 50.0
    assert pc.summarise(steps[:1], 1)["steps_timed"] == 1  # fewer steps than the warm-up: all of them
