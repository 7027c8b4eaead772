"""The fp8 engine's host work outside the model's forward equals the bf16 engine's, op for op.

On a GPU the forward (prefill eager, each decode step a CUDA graph) is the only place the fp8 path differs
from bf16 (rollout/fp8.py: FP8Runner overrides only the runner's projections and decode kernels), so the
engine's per-round host loop (admission bookkeeping, the sampler's inputs, stop checks, retire's syncs and
copies: everything a graph replay leaves to the host) must dispatch the same tensor ops for both engines. This
pins it: a change that adds per-step or per-round work to the fp8 engine outside its forward (a scale check, a
re-quantisation, a sync) fails here. bench/decode_phases.py measures the same split on a GPU.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all
from relayrl.rollout.fp8 import FP8Runner
from relayrl.rollout.native import NativeEngine


class _OpCounter(TorchDispatchMode):
    """Counts aten ops by name, apart for those dispatched inside the runner's forward (`depth` > 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.inside if self.depth else self.outside)[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _count_round(model, tokenizer, quantization: str) -> tuple[int, Counter[str], Counter[str]]:
    engine = build_engine(
        "native", model, tokenizer, max_slots=8, max_seq_len=48, eos_token_id=[], driver="loop",
        prefix_cache=False, quantization=quantization, sync_every=4,
    )  # fmt: skip
    assert isinstance(engine, NativeEngine)
    assert isinstance(engine.runner, FP8Runner) == (quantization == "fp8")

    def reqs(r: int) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                prompt_ids=[2 + i, 4, 6, 8, 10],
                params=SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=r + i),
            )
            for i in range(4)
        ]

    try:
        generate_all(engine, reqs(0))  # warm-up round
        counter = _OpCounter()
        for name in ("prefill", "decode"):  # every forward the engine calls in this workload
            forward = getattr(engine.runner, name)

            def wrapped(*args, forward=forward, **kwargs):
                counter.depth += 1
                try:
                    return forward(*args, **kwargs)
                finally:
                    counter.depth -= 1

            setattr(engine.runner, name, wrapped)
        steps = engine.decode_steps
        with counter, torch.no_grad():
            generate_all(engine, reqs(100))
        return engine.decode_steps - steps, counter.outside, counter.inside
    finally:
        engine.close()


def test_fp8_engine_dispatches_the_same_ops_as_bf16_outside_the_forward(tiny_model, tiny_tokenizer):
    model = tiny_model.eval()
    steps_bf16, outside_bf16, inside_bf16 = _count_round(model, tiny_tokenizer, "none")
    steps_fp8, outside_fp8, inside_fp8 = _count_round(model, tiny_tokenizer, "fp8")
    assert steps_bf16 == steps_fp8 == 13  # 14 tokens: one from the prefill, 13 decode steps
    assert outside_fp8 == outside_bf16 and sum(outside_bf16.values()) > 0  # the same multiset of ops
    # the counter sees the forward: fp8's quantisers run there (emulated on a CPU), not outside it
    assert inside_fp8["aten.amax"] > 0 and inside_bf16["aten.amax"] == 0 and outside_fp8["aten.amax"] == 0
