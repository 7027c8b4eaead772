"""Long context with sequence parallelism (dist.sp_size; relayrl.models.sequence_parallel): SFT steps on ONE
long sample of a Qwen2.5-1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab 151936;
random weights, bf16 compute over fp32 masters, gradient checkpointing), tokens/s and peak memory per GPU.

    torchrun --standalone --nproc_per_node 4 bench/long_context.py                 # the 4-GPU table
    torchrun --standalone --nproc_per_node 1 bench/long_context.py --cases 1:8192,1:32768,1:131072  # one GPU

No Ray: torchrun starts the ranks; the model goes through the product's own construction (build_trained:
FSDP2 over every rank, the SP groups, the varlen layout, AdamW) and step (TrainStep + the SFT loss). A case
"W:L" trains samples of L tokens with SP size W: the W ranks of a group share one sample (L / W tokens each),
the ranks / W groups each train their own (data parallel), so a step covers ranks / W samples. SP size 1 on
4 GPUs is plain FSDP2 data parallelism (each GPU a whole L-token sample). The SP groups are switched on and
off between cases over the same sharded model (relayrl.models.sequence_parallel.set_group).

First, a numerics check: one sample's token log-probs with SP on vs off (same weights; max / mean absolute
difference, bf16). Per case: one warm-up step, then timed steps (1 for samples over 32k tokens, else 2): seconds per step,
tokens/s of the whole step (every group's sample), the peak allocated CUDA memory (max over ranks) over the
case and the memory held before it (sharded weights + optimizer states): peak - held = activations. A case
that runs out of memory is caught and recorded ("oom"); such cases come last in the default list, because a
rank that fails inside a collective can leave its peers waiting (bounded by a 120 s collective timeout).

On one GPU (the second command) nothing is sharded: the whole fp32 masters and AdamW states sit on it, as in
a one-GPU `relayrl sft` run: the baseline of "memory per GPU at SP=4 vs SP=1". Writes $OUT/long_context.json
(or ./long_context.json) from rank 0 after every case. Expect ~2-3 minutes per command on H100s (most of it
the 128k cases and the model's construction).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.config.components import OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.data.batches import SFTBatch
from relayrl.models import sequence_parallel
from relayrl.models.forward import hf_model, token_logprobs
from relayrl.trainers.sft import next_token_loss
from relayrl.workers.trained import build_trained

SHAPE = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072, rope_theta=1e6,
    tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000)  # fmt: skip
"""--tiny: a smoke test of the script itself (runs on CPU ranks too: torchrun ... --tiny --cases 2:64,1:64)."""
DEFAULT_CASES = "4:8192,1:8192,4:32768,4:131072,1:32768,1:131072"


def _model(device: torch.device, shape: dict) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))  # pyright: ignore[reportArgumentType]
    enable = getattr(model, "activation_checkpointing_enable", None)  # newer transformers 5; 5.17 has only
    if enable is not None:  # gradient_checkpointing_enable (as relayrl.models.loading.finish_model)
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def _sample(length: int, seed: int, vocab: int) -> SFTBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=g)
    return SFTBatch(input_ids=[ids], targets=[torch.ones(length, dtype=torch.bool)], layout="varlen",
                    num_tokens=length)  # fmt: skip


def _max(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x])  # a CPU tensor: the gloo half of the group
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_case(train, group, sp: int, length: int, world: int, vocab: int) -> dict:
    """One case (see module doc)."""
    sequence_parallel.set_group(group if sp > 1 else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    batch = _sample(length, seed=rank // sp, vocab=vocab)  # one sample per SP group
    timed = 1 if length > 32768 else 2
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    out: dict[str, Any] = {
        "sp": sp,
        "dp": world // sp,
        "tokens_per_sample": length,
        "tokens_per_step": length * world // sp,
    }
    try:
        train.step([batch], next_token_loss)  # warm-up (and the optimizer states' first allocation)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = None
        for _ in range(timed):
            res = train.step([batch], next_token_loss)
        assert res is not None
        if cuda:
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / timed
        out.update(status="ok", loss=res.loss, step_s=_max(step_s))
        out["tokens_per_s"] = out["tokens_per_step"] / out["step_s"]
    except torch.OutOfMemoryError as e:
        train.optimizer.zero_grad(set_to_none=True)
        out.update(status="oom", error=str(e).split("\n")[0][:300])
    out["peak_mem_gib"] = _max(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    out["held_before_gib"] = _max(held)
    return out


def logprob_check(train, group, layout: str, vocab: int, length: int = 4096) -> dict[str, float]:
    """Token log-probs of one sample with the SP groups on and off (same weights, no gradients, bf16): the
    all-to-all attention path against the plain one on the GPU kernels."""
    seq = _sample(length, seed=123, vocab=vocab).input_ids
    out = []
    for g in (group, None):
        sequence_parallel.set_group(g)
        with torch.no_grad(), train.autocast():
            out.append(token_logprobs(train.model, seq, layout)[0].float())
    hf_model(train.model).reshard()  # the root stays gathered after a forward without backward
    diff = (out[0] - out[1]).abs()
    return {"tokens": length, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated SP:TOKENS cases, run in order")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test of the script)")
    args = ap.parse_args()
    shape = TINY if args.tiny else SHAPE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    sp_max = max(sp for sp, _ in cases)
    if world > 1:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    model = _model(device, shape)
    built = build_trained(
        model,
        device=device,
        dtype="auto",
        optim=OptimConfig(lr=1e-5, scheduler="constant", warmup_steps=0, warmup_ratio=0.0),
        opt_steps=100,
        dist=DistConfig(mode="ray", num_gpus_per_node=world, sp_size=sp_max),
        loss_fn=next_token_loss,
    )
    group = sequence_parallel.active()
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": world,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "shape": shape,
        "layout": built.layout,
        "precision": built.train.precision,
        "gradient_checkpointing": True,
        "cases": [],
    }
    if group is not None:
        report["logprob_check"] = logprob_check(built.train, group, built.layout, int(shape["vocab_size"]))
    out = Path(os.environ.get("OUT", ".")) / "long_context.json"
    for sp, length in cases:
        r = run_case(built.train, group, sp, length, world, int(shape["vocab_size"]))
        report["cases"].append(r)
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            print(json.dumps(r), flush=True)
            out.write_text(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
