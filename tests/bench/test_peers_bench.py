"""bench/peers' verl and OpenRLHF harness on the CPU: log parsing, data files, the process runner (timeout,
step counting, partial results) and the summary. The peers themselves run only on the GPU machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(PEERS))

import openrlhf_grpo  # noqa: E402  # pyright: ignore[reportMissingImports]
import peer_common as pc  # noqa: E402  # pyright: ignore[reportMissingImports]
import run_cells  # noqa: E402  # pyright: ignore[reportMissingImports]
import verl_grpo  # noqa: E402  # pyright: ignore[reportMissingImports]
import verl_reward  # noqa: E402  # pyright: ignore[reportMissingImports]

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


H100, H200 = 79.2, 139.8  # GiB nvidia-smi reports


def test_offload_mode_per_cell_and_card():
    """16 bytes a parameter of states: 7B is 6.53B parameters (97 GiB), 0.5B 0.36B."""
    assert 6.5e9 < pc.param_count("7b") < 6.6e9 and 3.5e8 < pc.param_count("0.5b") < 3.7e8
    assert [pc.offload_mode("7b", 1, m) for m in (H100, H200)] == ["full", "states"]
    for shape, gpus in (("0.5b", 1), ("0.5b", 4), ("7b", 4)):
        assert [pc.offload_mode(shape, gpus, m) for m in (H100, H200)] == ["none", "none"], (shape, gpus)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("card", [H100, H200])
@pytest.mark.parametrize("shape,gpus", [("7b", 1), ("0.5b", 4), ("7b", 4)])
def test_the_six_missing_cells_command_lines(tmp_path, shape, gpus, card):
    """verl and OpenRLHF x {7B 1 GPU, 0.5B 4 GPUs, 7B 4 GPUs} on either card, with relayrl's side."""
    mode = pc.offload_mode(shape, gpus, card)
    ov = verl_grpo.overrides(Path("/m"), Path("/d"), gpus, shape, 4, tmp_path, False, mode)
    assert f"trainer.n_gpus_per_node={gpus}" in ov and "data.train_batch_size=64" in ov
    assert (
        "actor_rollout_ref.rollout.n=8" in ov
        and "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in ov
    )
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=64" in ov and "trainer.total_training_steps=4" in ov
    assert (
        "actor_rollout_ref.actor.optim.override_optimizer_config={fused:True}" in ov
    )  # relayrl's AdamW kernel
    offl = {
        k.rsplit(".", 1)[1]: v
        for k, v in (o.split("=") for o in ov if ".fsdp_config." in o and "offload" in o)
    }
    expect = {  # verl: legacy offload keeps the update on the GPU (~104 GB there at 7B): H200 only
        "none": {"param_offload": "False", "optimizer_offload": "False", "offload_policy": "False"},
        "states": {"param_offload": "True", "optimizer_offload": "True", "offload_policy": "False"},
        "full": {"param_offload": "False", "optimizer_offload": "False", "offload_policy": "True"},
    }[mode]
    assert offl == expect
    for torch_adam in (False, True):
        args = openrlhf_grpo.arguments(Path("/m"), Path("/d"), gpus, shape, 4, tmp_path, mode, torch_adam)
        assert _flag(args, "--vllm.num_engines") == str(gpus) and _flag(
            args, "--actor.num_gpus_per_node"
        ) == str(gpus)
        assert (
            _flag(args, "--vllm.tensor_parallel_size") == "1" and _flag(args, "--train.batch_size") == "512"
        )
        assert _flag(args, "--train.micro_batch_size") == ("64" if shape == "0.5b" else "16")
        assert "--train.colocate_all" in args and "--vllm.enable_sleep" in args
        assert ("--ds.enable_sleep" in args) is not torch_adam  # DeepSpeed offloads FusedAdam's states only
        adam_offload = mode == "full" or (mode == "states" and torch_adam)
        assert ("--ds.adam_offload" in args) is adam_offload, (mode, torch_adam)
    cmd = pc.relayrl_command(shape, gpus, 4, Path("/m"), tmp_path / "o.json", mode)
    kw = json.loads(cmd[-2])
    assert kw["policy_gpus"] == gpus and kw["steps"] == 4 and kw["shape"] == pc.RL_SHAPES[shape]
    assert kw["dist_mode"] == ("ray" if gpus > 1 or mode == "full" else "local")
    assert kw["offload"] is (mode == "full")
    assert kw.get("offload_optimizer_in_rollout", False) is (mode == "states")
    # both peers' engines sleep
    assert kw.get("engine_sleep", "auto") == ("auto" if mode == "none" else "yes")
    assert kw.get("gradient_checkpointing", False) is (shape == "7b")  # as both peers run 7B


def test_deepspeed_gets_an_arch_list_it_can_parse(monkeypatch):
    """The GPU image sets TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed 0.19.5's JIT builder cannot sort: the card's
    capability replaces any list with such an entry; a list DeepSpeed parses is kept."""
    monkeypatch.setattr(openrlhf_grpo, "cuda_arch", lambda: "9.0")
    for env, want in (("9.0a", "9.0"), ("8.0 9.0a", "9.0"), ("", "9.0"), ("8.0;9.0+PTX", "8.0;9.0+PTX"),
                      ("9.0", "9.0")):  # fmt: skip
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
        assert openrlhf_grpo.ds_arch_list() == want, env
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(openrlhf_grpo, "cuda_arch", lambda: "")
    assert openrlhf_grpo.ds_arch_list() == "9.0"  # no nvidia-smi: Hopper, the cards these runs use


def test_relayrl_side_kwargs_are_rl_step_run_parameters(tmp_path):
    """Every keyword relayrl_command passes exists in bench/rl_step.run (a typo would fail on the GPU)."""
    import inspect

    sys.path.insert(0, str(PEERS.parents[1]))
    from bench.rl_step import run

    params = set(inspect.signature(run).parameters)
    for mode in pc.OFFLOAD_MODES:
        kw = json.loads(pc.relayrl_command("7b", 1, 4, Path("/m"), tmp_path / "o.json", mode)[-2])
        assert set(kw) <= params, set(kw) - params
    kw = json.loads(pc.relayrl_command("0.5b", 4, 4, Path("/m"), tmp_path / "o.json", "none", True)[-2])
    assert kw["replicate"] is True and kw["dist_mode"] == "ray" and set(kw) <= params
    assert "replicate" not in json.loads(
        pc.relayrl_command("0.5b", 4, 4, Path("/m"), tmp_path / "o.json")[-2]
    )
    with pytest.raises(ValueError, match="offload"):
        pc.relayrl_command("7b", 1, 4, Path("/m"), tmp_path / "o.json", "some")
    for gpus, mode in ((1, "none"), (4, "full")):
        with pytest.raises(ValueError, match="replicate needs"):
            pc.relayrl_command("0.5b", gpus, 4, Path("/m"), tmp_path / "o.json", mode, True)


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


# ============================================================================================== the cell driver
def _cells(text: str, gpus: int = 4):
    return run_cells.parse_cells(text, gpus)


def test_plan_runs_one_gpu_cells_side_by_side_and_multi_gpu_cells_alone():
    units = run_cells.plan(_cells("verl:7b:1,openrlhf:7b:1"), 4, lambda s, g: "states")
    assert [[j.name for j in u] for u in units] == [
        ["verl-7b-1gpu", "openrlhf-7b-1gpu", "relayrl-7b-1gpu", "relayrl-7b-1gpu-alt"]
    ]
    assert units[0][3].offload == "full"  # the spare GPU runs relayrl's other way to fit
    units = run_cells.plan(_cells("verl:7b:1,openrlhf:7b:1"), 4, lambda s, g: "full")
    assert [j.name for j in units[0]] == ["verl-7b-1gpu", "openrlhf-7b-1gpu", "relayrl-7b-1gpu"]
    units = run_cells.plan(_cells("verl:0.5b:4,openrlhf:0.5b:4,verl:7b:4"), 4, lambda s, g: "none")
    assert [[j.name for j in u] for u in units] == [
        ["relayrl-0.5b-4gpu"],
        ["verl-0.5b-4gpu"],
        ["openrlhf-0.5b-4gpu"],
        ["relayrl-7b-4gpu"],
        ["verl-7b-4gpu"],
    ]

    def fits(shape: str, gpus: int) -> str:  # 7B needs 4 GPUs' memory without offload, as on the real cards
        return "none" if shape == "0.5b" or gpus > 1 else "states"

    units = run_cells.plan(_cells("verl:0.5b:4,openrlhf:0.5b:4,verl:7b:4"), 4, fits, True)
    assert [[j.name for j in u] for u in units] == [
        ["relayrl-0.5b-4gpu"],
        ["relayrl-0.5b-4gpu-replicate"],  # once per shape
        ["verl-0.5b-4gpu"],
        ["openrlhf-0.5b-4gpu"],
        ["relayrl-7b-4gpu"],  # no replicate: the whole 7B training state does not fit one card
        ["verl-7b-4gpu"],
    ]
    units = run_cells.plan(_cells("verl:7b:4"), 4, lambda s, g: "states", True)
    assert [[j.name for j in u] for u in units] == [["relayrl-7b-4gpu"], ["verl-7b-4gpu"]]
    for bad in ("verl:7b", "trl:7b:1", "verl:3b:1", "verl:7b:8", "verl:7b:1,verl:7b:1"):
        with pytest.raises(SystemExit):
            _cells(bad)
    # four 1-GPU jobs on 2 GPUs: two waves, longest first
    jobs = [run_cells.Job("verl", "7b", 1, "full"), run_cells.Job("openrlhf", "7b", 1, "full")]
    jobs += [run_cells.Job("relayrl", "7b", 1, "full"), run_cells.Job("relayrl", "0.5b", 1, "none")]
    assert run_cells.unit_est(jobs, 2) == 480 + 300 and run_cells.unit_est(jobs, 4) == 560


STUB = r"""
import json, os, sys, time
name, out = sys.argv[1], os.environ["OUT"]
with open(os.path.join(out, name + ".env"), "w") as fh:
    json.dump({k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "RAY_ADDRESS", "OMP_NUM_THREADS")}, fh)
if name.startswith("relayrl"):
    json.dump({"per_step": [{"step": 9.0}] + [{"step": s} for s in (1.0, 2.0, 1.5)]},
              open(os.path.join(out, name + ".json"), "w"))
elif name.startswith("verl"):
    json.dump({"verl": {"step_median_s": 6.0, "steps_timed": 3, "status": "ok"}, "versions": {"verl": "0.9.1"},
               "device": "stub card"}, open(os.path.join(out, name + ".json"), "w"))
else:
    print("starting", flush=True)
    time.sleep(600)
"""


def test_driver_runs_cells_in_parallel_kills_at_the_budget_and_writes_the_table(tmp_path, monkeypatch):
    """Stub jobs: relayrl and verl finish, OpenRLHF never does and is killed at the command's budget; the
    table holds the ratio and the statuses; the 1-GPU jobs ran at once on separate GPUs with their own Ray."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(run_cells, "RESERVE_S", 1.0)
    monkeypatch.setattr(run_cells, "MIN_UNIT_S", 3.0)
    monkeypatch.setattr(run_cells, "kill_gpu_leftovers", lambda: None)
    (tmp_path / "models" / "7b").mkdir(parents=True)
    (tmp_path / "models" / "7b" / ".complete").write_text("7b\n")  # built by an earlier command: reused
    monkeypatch.setattr(
        run_cells.Driver, "command", lambda self, job, model_dir, t: [sys.executable, "-c", STUB, job.name]
    )
    t0 = time.perf_counter()
    rows = run_cells.main(
        [
            "--cells",
            "verl:7b:1,openrlhf:7b:1",
            "--budget",
            "8",
            "--gpus-available",
            "4",
            "--gpu-gib",
            "80",
            "--torch-adam",
            "yes",
            "--models",
            str(tmp_path / "models"),
        ]
    )
    wall = time.perf_counter() - t0
    assert wall < 20, wall  # 8 s budget; the stuck job is killed at its timeout (SIGTERM ends it at once)
    out = tmp_path / "out"
    envs = {
        n: json.loads((out / f"{n}.env").read_text())
        for n in ("verl-7b-1gpu", "openrlhf-7b-1gpu", "relayrl-7b-1gpu")
    }
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs.values()) == ["0", "1", "2"]
    assert all(e["RAY_ADDRESS"] == "local" for e in envs.values())
    assert all(e["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 2) // 3)) for e in envs.values())
    # a job alone (a multi-GPU cell's side) gets no OMP_NUM_THREADS, even when the driver's environment has one:
    # Ray then sizes each actor's threads from its CPUs, as the frameworks' users run them
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    alone = run_cells.job_env(run_cells.Job("verl", "7b", 4, "none", devices="0,1,2,3"), 1)
    assert "OMP_NUM_THREADS" not in alone and alone["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    verl, orl = rows
    assert verl["cell"] == "verl-7b-1gpu" and verl["peer_step_s"] == 6.0 and verl["relayrl_step_s"] == 1.5
    assert verl["ratio"] == 4.0 and verl["offload"] == "full" and verl["versions"] == {"verl": "0.9.1"}
    assert orl["ratio"] is None and orl["peer_status"].startswith("no result (timeout")
    saved = json.loads((out / "cells.json").read_text())
    assert saved["cells"] == rows and saved["openrlhf_optimizer"] == "torch AdamW"
    assert "| verl-7b-1gpu | 6.000 | 1.500 | 4.0x |" in (out / "cells.md").read_text()
    assert not (out / "relayrl-7b-1gpu-alt.env").exists()  # "full" already: no second relayrl run


def test_a_peer_script_killed_by_sigterm_keeps_the_steps_it_logged(tmp_path):
    """The driver's SIGTERM: the script kills its running child at once and returns its partial steps."""
    child = "import time\nfor i in range(2):\n    print(f'step:{i} - timing_s/step:{i + 0.5}', flush=True)\ntime.sleep(600)\n"
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import peer_common as pc, verl_grpo\n"
        "pc.stop_on_sigterm()\n"
        f"res = pc.run_logged([sys.executable, '-c', {child!r}], {{}}, __import__('pathlib').Path(sys.argv[2]) / 'c.log', 60, verl_grpo.step_line)\n"
        "json.dump({'res': res, 'stopped': pc.stopped()}, open(sys.argv[2] + '/r.json', 'w'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(PEERS), str(tmp_path)])
    deadline = time.time() + 30
    while time.time() < deadline and "step:1" not in (
        (tmp_path / "c.log").read_text() if (tmp_path / "c.log").exists() else ""
    ):
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["stopped"] and r["res"]["status"] == "stopped (SIGTERM)"
    assert [s["step"] for s in r["res"]["steps"]] == [0.5, 1.5]


@pytest.mark.parametrize("fused", ["ok", "ValueError: invalid literal for int() with base 10: '0a'"])
def test_openrlhf_jobs_wait_for_the_deepspeed_ops_and_pick_the_optimizer(tmp_path, monkeypatch, fused):
    """--torch-adam auto: FusedAdam (and --ds.enable_sleep) when it built, DeepSpeed's torch AdamW when not;
    the model folder is built meanwhile and reused from --models."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(run_cells, "RESERVE_S", 1.0)
    monkeypatch.setattr(run_cells, "MIN_UNIT_S", 3.0)
    monkeypatch.setattr(run_cells, "kill_gpu_leftovers", lambda: None)
    monkeypatch.setattr(
        openrlhf_grpo, "prebuild_ops", lambda t: time.sleep(0.5) or {"fused_adam": fused, "cpu_adam": "ok"}
    )
    (tmp_path / "models" / "0.5b").mkdir(parents=True)
    (tmp_path / "models" / "0.5b" / ".complete").write_text("0.5b\n")
    seen: list[list[str]] = []
    real = run_cells.Driver.command

    def command(self, job, model_dir, t):
        seen.append(real(self, job, model_dir, t))
        return [sys.executable, "-c", STUB.replace("time.sleep(600)", "pass"), job.name]

    monkeypatch.setattr(run_cells.Driver, "command", command)
    run_cells.main(
        [
            "--cells",
            "openrlhf:0.5b:1",
            "--budget",
            "6",
            "--gpus-available",
            "2",
            "--gpu-gib",
            "80",
            "--models",
            str(tmp_path / "models"),
        ]
    )
    orl = next(c for c in seen if "openrlhf_grpo.py" in c[1])
    assert orl[orl.index("--torch-adam") + 1] == ("no" if fused == "ok" else "yes")
    assert orl[orl.index("--model-dir") + 1] == str(tmp_path / "models" / "0.5b")
    saved = json.loads((tmp_path / "out" / "cells.json").read_text())
    assert saved["openrlhf_optimizer"] == ("FusedAdam" if fused == "ok" else "torch AdamW")
    assert saved["deepspeed_ops"]["fused_adam"] == fused


def test_gpu_leftovers_killed_only_when_a_job_started_them(monkeypatch):
    """Of two processes nvidia-smi lists, only the one carrying the driver's marker (set in every job's
    environment, so inherited by engines a job leaves behind) is killed."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep, env={**os.environ, run_cells.MARKER: "123"})
    other = subprocess.Popen(sleep)
    try:
        listing = f"{ours.pid}\n{other.pid}\n"
        monkeypatch.setattr(run_cells.pc, "nvidia_smi", lambda *a: listing)
        monkeypatch.setattr(run_cells.time, "sleep", lambda s: None)
        run_cells.kill_gpu_leftovers()
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_unit_span_shares_the_budget_by_estimate_with_room_for_the_first():
    assert run_cells.unit_span(575, 360, 0) == 575  # the last unit: all that is left
    assert run_cells.unit_span(575, 100, 360) == 150  # share 125 < 1.5 x 100, later units keep >= 180
    assert run_cells.unit_span(575, 300, 300) == 425  # 1.5 x 300 capped: the later unit keeps 150
    assert run_cells.unit_span(200, 100, 360) == run_cells.MIN_UNIT_S  # 20 s would be left: the floor


def test_relayrl_falls_back_to_its_full_offload_run_when_the_states_run_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = run_cells.argparse.Namespace(
        budget=60, steps=4, warmup=1, offload="states", torch_adam="yes", gpu_gib=0, replicate=False
    )
    d = run_cells.Driver(args, _cells("verl:7b:1"), 4)
    verl, rl, alt = d.units[0]
    verl.result = {"step_median_s": 50.0, "status": "ok"}
    rl.result = {"status": "exit code 1"}  # e.g. out of memory in the update
    alt.result = {"step_median_s": 10.0, "status": "ok"}
    d.write_table()
    row = d.table[0]
    assert row["ratio"] == 5.0 and row["relayrl_offload"] == "full (its states run failed)"
    assert row["relayrl_alt"]["step_median_s"] == 10.0


def test_the_replicate_run_is_recorded_beside_the_cell_not_as_its_number(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = run_cells.argparse.Namespace(
        budget=60, steps=4, warmup=1, offload="none", torch_adam="yes", gpu_gib=0, replicate=True
    )
    d = run_cells.Driver(args, _cells("openrlhf:0.5b:4"), 4)
    (rl,), (rep,), (orl,) = d.units
    assert d.command(rep, tmp_path, 60)[-1] == str(tmp_path / "relayrl-0.5b-4gpu-replicate.json")
    orl.result = {"step_median_s": 9.0, "status": "ok"}
    rl.result = {"step_median_s": 3.0, "status": "ok"}
    rep.result = {"step_median_s": 1.5, "status": "ok"}
    d.write_table()
    row = d.table[0]
    assert row["relayrl_step_s"] == 3.0 and row["ratio"] == 3.0
    assert row["relayrl_replicate"] == {"step_median_s": 1.5, "status": "ok"}
    assert (
        "openrlhf-0.5b-4gpu: relayrl with dist.replicate (every rank the whole model) 1.500 s (ok)"
        in (tmp_path / "cells.md").read_text()
    )


def test_a_plan_longer_than_its_budget_is_named_with_the_fix(tmp_path, monkeypatch):
    """Two 4-GPU peers and relayrl's two runs under 680 s left OpenRLHF 154 s on 4 x H200 (2026-11-28): the
    driver now says so before it starts, naming the last job and the budget that would fit."""
    monkeypatch.setenv("OUT", str(tmp_path))

    def args(budget: float) -> run_cells.argparse.Namespace:
        return run_cells.argparse.Namespace(
            budget=budget, steps=4, warmup=1, offload="none", torch_adam="yes", gpu_gib=0, replicate=True
        )

    cells = _cells("verl:0.5b:4,openrlhf:0.5b:4")
    d = run_cells.Driver(args(680), cells, 4)
    est = d.estimate()
    want = run_cells.BUILD_S["0.5b"] + sum(
        run_cells.EST_S[k]
        for k in [("relayrl", "0.5b", 4)] * 2 + [("verl", "0.5b", 4), ("openrlhf", "0.5b", 4)]
    )
    assert est == want
    warning = d.over_budget()
    assert f"estimate {est:.0f} s exceeds --budget 680 s" in warning
    assert "last: openrlhf-0.5b-4gpu" in warning and f"raise --budget to >= {est:.0f}" in warning
    assert run_cells.Driver(args(est), cells, 4).over_budget() == ""


def test_versions_name_the_commit_from_git_or_from_the_carried_copy(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAYRL_COMMIT", raising=False)
    v = pc.versions(("pytest", "no-such-package-xyz"))
    head = subprocess.run(
        ["git", "-C", str(pc.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # a clone: the commit, marked when relayrl/ has local changes
        dirty = subprocess.run(
            ["git", "-C", str(pc.ROOT), "status", "--porcelain", "relayrl"], capture_output=True, text=True
        ).stdout.strip()
        assert v["relayrl"] == head.stdout.strip() + ("-dirty" if dirty else "")
    assert v["pytest"] == pytest.__version__
    assert v["no-such-package-xyz"] == "not installed"
    # the commit the runner names wins over git's (a GPU machine's copy can hold an older .git)
    monkeypatch.setenv("RELAYRL_COMMIT", "abc1234")
    assert pc.versions(())["relayrl"] == "abc1234"
    # a copy of the tree without .git and without the variable: unknown
    monkeypatch.setattr(pc, "ROOT", tmp_path)
    monkeypatch.delenv("RELAYRL_COMMIT")
    assert pc.versions(())["relayrl"] == "unknown"
