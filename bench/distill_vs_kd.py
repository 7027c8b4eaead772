"""On-policy distillation (`relayrl rl --distill.teacher`) vs off-policy `relayrl kd` at equal teacher calls.

    python bench/distill_vs_kd.py            # CPU, tiny models, ~2 minutes on 2 cores

Teacher: the tiny student's own model with its final norm scaled by 3 (logits x 3, a sharper copy). Both
methods see 6 steps x 32 sequences scored by the teacher (192 teacher calls): on-policy, 8 add2 prompts x 4
student samples per step (REINFORCE, gamma 0, pure reverse-KL reward); kd, 192 teacher samples on random
add2 prompts (empty answers skipped), coef 1 (divergence only), forward or reverse KL over the vocabulary.
lr 5e-3 constant for all. Measure: the exact KL(student || teacher) of the next-token distributions after 63
fixed add2 prompts. Writes JSON to $OUT/distill_vs_kd.json when $OUT is set, else bench/results/.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from relayrl.cli import main as cli_main
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import DistillConfig
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer, save_tiny
from relayrl.trainers.rl.loop import run_rl

STEPS, BATCH, LR = 6, 32, 5e-3
PROMPTS = [f"{a}+{b}=" for a in range(10, 90, 9) for b in range(11, 90, 13)]


def exact_kl(student: str, teacher: str, tok) -> float:
    s, t = (AutoModelForCausalLM.from_pretrained(p) for p in (student, teacher))
    total = 0.0
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            ls = torch.log_softmax(s(input_ids=ids).logits[0, -1], -1)
            lt = torch.log_softmax(t(input_ids=ids).logits[0, -1], -1)
            total += float((ls.exp() * (ls - lt)).sum())
    return total / len(PROMPTS)


def teacher_rows(model, tok, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            a, b = (int(x) for x in torch.randint(10, 100, (2,), generator=g))
            ids = torch.tensor([tok.encode(f"{a}+{b}=")])
            out = model.generate(ids, do_sample=True, max_new_tokens=6, top_k=0, top_p=1.0,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
            rows.append(
                {"input": f"{a}+{b}=", "output": tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)}
            )
    return rows


def main() -> None:
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root, tok = Path(tmp), build_tiny_tokenizer()
        student = str(save_tiny(root / "student"))
        tm = build_tiny_model(tok, TinyModelSpec(seed=0))
        with torch.no_grad():
            tm.model.norm.weight.mul_(3.0)
        teacher = str(root / "teacher")
        tm.save_pretrained(teacher)
        tok.save_pretrained(teacher)
        result["before"] = exact_kl(student, teacher, tok)
        data = root / "kd.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in teacher_rows(tm, tok, STEPS * BATCH)))
        for div in ("forward_kl", "reverse_kl"):
            t0, out = time.time(), root / f"kd_{div}"
            argv = [
                "kd", *("--model.name_or_path", student, "--data.datasets", str(data), "--kd.teacher", teacher),
                *("--kd.coef", "1.0", "--kd.divergence", div, "--data.skip_malformed", "true"),
                *("--train.batch_size", str(BATCH), "--train.micro_batch_size", str(BATCH), "--optim.lr", str(LR)),
                *("--optim.scheduler", "constant", "--optim.warmup_steps", "0", "--train.device", "cpu"),
                *("--train.max_steps", str(STEPS), "--logger.progress_bar", "false", "--ckpt.save_every", "0"),
                *("--train.output_dir", str(out)),
            ]  # fmt: skip
            assert cli_main(argv) == 0
            result[f"kd_{div}"] = {
                "kl": exact_kl(str(out / "final"), teacher, tok),
                "seconds": time.time() - t0,
            }
        t0 = time.time()
        cfg = tiny_cpu_config(student, str(root / "rl"), steps=STEPS)
        cfg = replace(
            cfg,
            distill=DistillConfig(teacher=teacher, outcome=False),
            algo=replace(cfg.algo, advantage="reinforce", gamma=0.0),
            optim=replace(cfg.optim, lr=LR),
        )
        assert run_rl(cfg).exit_code == 0
        result["on_policy"] = {
            "kl": exact_kl(str(root / "rl" / "final"), teacher, tok),
            "seconds": time.time() - t0,
        }
    print(json.dumps(result, indent=1))
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "distill_vs_kd.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
