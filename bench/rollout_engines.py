"""bench/rollout.py's pieces: model shapes, the workloads, the engines under test and the timed rounds.

Engines (`settings` records what was set; vLLM is built once per shape for every workload):

    native         relayrl's engine: build_engine("native", model, max_slots = the workload's samples,
                   max_seq_len = prompt + its longest completion, prefix_cache=False (the prompts are fresh
                   random tokens every round, so there is nothing to reuse), CUDA graphs); built per workload
    vllm-default   vLLM as its users run it offline: `LLM(model=folder)` with nothing set but the dtype,
                   token ids in (skip_tokenizer_init), seed 0 and, with --tp, tensor_parallel_size
    vllm-tuned     the same with the settings vLLM's "Optimization and Tuning" guide names for throughput
                   (VLLM_TUNED below, each with its reason)

vLLM loads `load_format="dummy"` weights (random, drawn by vLLM) from a folder holding only the shape's
config.json, so a 7B or 32B shape needs no multi-GB save; every workload ignores EOS or fixes each request's
length, so the work done does not depend on the weights' values. `--vllm-real-weights` saves the bench's own
model instead (needed to compare log-probs).
"""

from __future__ import annotations

import inspect
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all
from relayrl.rollout.native import NativeEngine

QWEN05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
QWEN7B = dict(
    QWEN05,
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN32B = dict(
    QWEN7B, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
    intermediate_size=27648,
)  # fmt: skip
TINY = dict(
    QWEN05, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=4096,
)  # fmt: skip
SHAPES = {"tiny": TINY, "0.5b": QWEN05, "7b": QWEN7B, "32b": QWEN32B}
"""Qwen2.5 shapes by name (random weights); "tiny" is for CPU smoke runs."""
ALIASES = {"qwen2.5-0.5b": "0.5b", "qwen2.5-7b": "7b", "qwen2.5-32b": "32b"}

VLLM_TUNED: dict[str, tuple[Any, str]] = {
    "gpu_memory_utilization": (0.92, "more KV cache blocks, so no request is preempted (guide: Preemption)"),
    "max_num_batched_tokens": (32768, "guide: '> 8192 for throughput, especially smaller models on large GPUs'; "
                               "w1's whole prefill (256 x 128) fits one step"),
    "enable_prefix_caching": (True, "vLLM's default, kept: the n samples of a w2 prompt share its blocks"),
    "async_scheduling": (True, "the host schedules step t+1 while the GPU runs step t"),
}  # fmt: skip
"""vllm-tuned's fixed settings; per shape it also sets max_num_seqs = the largest workload batch (>= the batch,
so the whole batch decodes in one step), max_model_len = prompt + the longest completion (smaller block tables)
and compilation_config.cudagraph_capture_sizes up to that batch (the decode batch runs as a full CUDA graph)."""


def shape_config(shape: str, layers: int = 0):
    from transformers import Qwen2Config

    spec = {**SHAPES[ALIASES.get(shape, shape)], **({"num_hidden_layers": layers} if layers else {})}
    config = Qwen2Config(**spec, pad_token_id=0)
    config.eos_token_id = config.bos_token_id = None
    return config


def build_model(shape: str, device: str, dtype: torch.dtype, layers: int = 0) -> torch.nn.Module:
    """A random-weight Qwen2 of `shape` built directly on `device` in `dtype` (seed 0)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: a 32B shape in fp32 would not fit a card
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(shape_config(shape, layers))
    finally:
        torch.set_default_dtype(default)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: lengths are set by each workload
    model.generation_config.pad_token_id = 0
    return model


def param_counts(config) -> dict[str, int]:
    """Parameters a decode step multiplies by (every projection and the LM head) and all parameters."""
    h, layers, heads, kv = (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    d = h // heads
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * config.intermediate_size
    matmul = layers * per_layer + h * config.vocab_size
    embed = 0 if config.tie_word_embeddings else h * config.vocab_size
    return dict(matmul=matmul, total=matmul + embed + layers * 2 * h + h)


# ---------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """`prompts` random prompts of `prompt_len` tokens, n samples each, `new_tokens` new tokens (or, when
    `lengths` is set, lengths[i] for request i: w3); fresh prompts every round (seed, round), the same for
    every engine; temperature 1, top_p 1, top_k 0."""

    name: str
    prompts: int
    prompt_len: int
    n: int
    new_tokens: int
    logprobs: bool
    seed: int
    lengths: list[int] | None = None

    def requests(self, vocab: int, round_idx: int, max_new: int | None = None) -> list[GenerationRequest]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + round_idx)
        ids = torch.randint(2, vocab, (self.prompts, self.prompt_len), generator=gen)
        out = []
        for i, row in enumerate(ids.tolist()):
            new = max_new or (self.lengths[i] if self.lengths else self.new_tokens)
            params = SamplingParams(n=self.n, temperature=1.0, max_new_tokens=new, logprobs=self.logprobs)
            out.append(
                GenerationRequest(prompt_ids=row, params=params, request_id=f"{self.name}-{round_idx}-{i}")
            )
        return out

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def tokens(self) -> int:
        return self.n * (sum(self.lengths) if self.lengths else self.prompts * self.new_tokens)

    @property
    def longest(self) -> int:
        return max(self.lengths) if self.lengths else self.new_tokens


def w3_lengths(prompts: int, cap: int, seed: int = 3) -> list[int]:
    """Per-request max_tokens of w3: 16 + an exponential draw of mean cap / 3, truncated at `cap` (an RL
    response-length shape: most short, a long tail, some truncated), from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.empty(prompts).exponential_(3.0 / cap, generator=gen)
    return [min(cap, 16 + int(x)) for x in draws.tolist()]


def workloads(args) -> dict[str, Workload]:
    return {
        "w1": Workload("w1", args.prompts, args.prompt_len, 1, args.new_tokens, False, 1),
        "w2": Workload("w2", args.n_prompts, args.prompt_len, args.n, args.n_new_tokens, True, 2),
        "w3": Workload(
            "w3", args.w3_prompts, args.prompt_len, 1, args.w3_max_new, True, 3,
            lengths=w3_lengths(args.w3_prompts, args.w3_max_new),
        ),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- engines
Samples = list[tuple[list[int], list[list[int]], list[list[float]]]]
"""Per request: (prompt ids, each sample's token ids, each sample's log-probs)."""


@dataclass
class Runner:
    """An engine under test: `generate(requests)` runs them all and returns Samples."""

    name: str
    startup_s: float
    settings: dict[str, Any]
    impl: Any
    counters: dict[str, int] = field(default_factory=dict)

    def generate(self, reqs: list[GenerationRequest]) -> Samples:
        if self.name in ("native", "hf"):
            before = [getattr(self.impl, c, 0) for c in ("decode_steps", "prefill_batches")]
            res = generate_all(self.impl, reqs)
            if self.name == "native":
                self.counters = dict(
                    decode_steps=self.impl.decode_steps - before[0],
                    prefill_batches=self.impl.prefill_batches - before[1],
                )
            return [
                (r.prompt_ids, [c.token_ids for c in r.completions], [c.logprobs for c in r.completions])
                for r in res
            ]
        return _vllm_generate(self.impl, reqs)

    def close(self) -> None:
        if self.name in ("native", "hf"):
            self.impl.close()
        self.impl = None


def native_runner(model, wls: list[Workload], *, tp: int, opts: dict[str, Any]) -> Runner:
    """The native engine sized for every workload in `wls`; tp > 1 passes tp_size through (an engine without
    that option raises NotImplementedError: the row is skipped)."""
    opts = dict(opts)
    if tp > 1:
        if "tp_size" not in inspect.signature(NativeEngine.__init__).parameters:
            raise NotImplementedError(
                "the native engine's tensor parallelism is a group of ranks (TPNativeEngine under torchrun): "
                "run `torchrun --nproc_per_node=N bench/tp_decode.py --tp N` for its TP rows"
            )
        opts["tp_size"] = tp
    settings = dict(
        max_slots=max(w.samples for w in wls),
        max_seq_len=max(w.prompt_len + w.longest for w in wls),
        prefix_cache=False,
        **opts,
    )
    t0 = time.perf_counter()
    engine = build_engine("native", model, None, eos_token_id=[], **settings)
    _sync()
    return Runner("native", time.perf_counter() - t0, settings, engine)


def vllm_folder(shape: str, layers: int, model=None) -> str:
    """A folder vLLM can load: the shape's config (dummy weights), or `model` saved whole."""
    folder = tempfile.mkdtemp(prefix=f"relayrl-bench-{shape}-")
    if model is not None:
        model.save_pretrained(folder)
    else:
        config = shape_config(shape, layers)
        config.architectures = ["Qwen2ForCausalLM"]  # vLLM picks its model class from this
        config.save_pretrained(folder)
    return folder


def vllm_runner(
    name: str, folder: str, dtype: torch.dtype, wls: list[Workload], *, tp: int, dummy: bool, extra: dict
) -> Runner:
    from vllm import LLM

    args: dict[str, Any] = dict(dtype=str(dtype).removeprefix("torch."), skip_tokenizer_init=True, seed=0)
    if dummy:
        args["load_format"] = "dummy"
    if tp > 1:
        args["tensor_parallel_size"] = tp
    if name == "vllm-tuned":
        batch = max(w.samples for w in wls)
        args.update({k: v for k, (v, _) in VLLM_TUNED.items()})
        args.update(
            max_num_seqs=batch,
            max_model_len=max(w.prompt_len + w.longest for w in wls),
            compilation_config={"cudagraph_capture_sizes": capture_sizes(batch)},
        )
    args.update(extra)
    t0 = time.perf_counter()
    llm = LLM(model=folder, **args)
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    settings = dict(
        asked=args,
        max_num_seqs=cfg.scheduler_config.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
        async_scheduling=getattr(cfg.scheduler_config, "async_scheduling", None),
        prefix_caching=cfg.cache_config.enable_prefix_caching,
        gpu_memory_utilization=cfg.cache_config.gpu_memory_utilization,
        max_model_len=cfg.model_config.max_model_len,
        enforce_eager=cfg.model_config.enforce_eager,
        cudagraph_mode=str(getattr(cfg.compilation_config, "cudagraph_mode", None)),
    )
    return Runner(name, startup, settings, llm)


def capture_sizes(batch: int) -> list[int]:
    """CUDA-graph batch sizes up to `batch`: 1, 2, 4, 8, 16, 32, then every 32 (vLLM pads a batch up to the
    next size, so a decode batch of `batch` or fewer always replays a graph)."""
    sizes = {s for s in (1, 2, 4, 8, 16) if s < batch} | set(range(32, batch, 32)) | {batch}
    return sorted(sizes)


def _vllm_generate(llm, reqs: list[GenerationRequest]) -> Samples:
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    params = [
        VSP(
            n=r.params.n,
            temperature=r.params.temperature,
            max_tokens=r.params.max_new_tokens,
            ignore_eos=True,
            logprobs=0 if r.params.logprobs else None,
            detokenize=False,
        )
        for r in reqs
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs], params, use_tqdm=False)
    return [
        (
            r.prompt_ids,
            [list(o.token_ids) for o in out.outputs],
            [
                [float(step[t].logprob) for step, t in zip(o.logprobs or [], o.token_ids, strict=False)]
                for o in out.outputs
            ],
        )
        for r, out in zip(reqs, outs, strict=True)
    ]


# ---------------------------------------------------------------------------------------------- timed rounds
def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _check(name: str, wl: Workload, reqs: list[GenerationRequest], out: Samples) -> int:
    """Every sample has exactly its request's length (and log-probs when asked); returns the token count."""
    for r, (_, toks, lps) in zip(reqs, out, strict=True):
        want = r.params.max_new_tokens
        lens = {len(t) for t in toks}
        assert lens == {want} and len(toks) == wl.n, (
            f"{name} {wl.name}: want {wl.n} x {want} tokens, got {lens}"
        )
        if wl.logprobs:
            assert all(len(lp) == want for lp in lps), f"{name} {wl.name}: missing log-probs"
    return sum(len(t) for _, toks, _ in out for t in toks)


def time_rounds(runner: Runner, wl: Workload, vocab: int, rounds: int) -> tuple[dict, Samples]:
    """One full-size warm-up round, then `rounds` timed rounds (fresh prompts each), then one prefill-only
    round (the same shapes, max_new_tokens=1) so decode time = round - prefill."""
    warm = wl.requests(vocab, 0)
    _sync()
    t0 = time.perf_counter()
    _check(runner.name, wl, warm, runner.generate(warm))
    _sync()
    warm_s = time.perf_counter() - t0
    seconds, counters, out = [], [], []
    for r in range(1, rounds + 1):
        reqs = wl.requests(vocab, r)
        _sync()
        t0 = time.perf_counter()
        out = runner.generate(reqs)
        _sync()
        seconds.append(time.perf_counter() - t0)
        assert _check(runner.name, wl, reqs, out) == wl.tokens
        counters.append(runner.counters)
    reqs = wl.requests(vocab, rounds + 1, max_new=1)
    _sync()
    t0 = time.perf_counter()
    runner.generate(reqs)
    _sync()
    prefill_s = time.perf_counter() - t0
    med = statistics.median(seconds)
    row = dict(
        tokens=wl.tokens,
        seconds=[round(s, 4) for s in seconds],
        tok_s_median=wl.tokens / med,
        tok_s_min=wl.tokens / max(seconds),
        tok_s_max=wl.tokens / min(seconds),
        warmup_s=round(warm_s, 4),
        prefill_s=round(prefill_s, 4),
        decode_ms_per_step=max(0.0, med - prefill_s) / max(1, wl.longest - 1) * 1e3,
    )
    if counters and counters[0]:
        row["engine_counters"] = counters[len(counters) // 2]
    return row, out


def mismatch(model, samples: Samples, temperature: float, limit: int) -> dict:
    """The engine's log-probs against relayrl's trainer forward (relayrl.models.forward.token_logprobs, the
    layout the trainer uses on this device, the same weights) over the first `limit` samples:
    relayrl.algorithms.off_policy.logprob_mismatch."""
    from relayrl.algorithms.off_policy import logprob_mismatch
    from relayrl.models import forward

    device = next(model.parameters()).device
    layout = forward.choose_layout(model, device)
    forward.prepare_model(model, layout)
    flat = [(p, t, lp) for p, toks, lps in samples for t, lp in zip(toks, lps, strict=True)][:limit]
    seqs = [torch.tensor(p + t, device=device) for p, t, _ in flat]
    width = max(len(s) for s in seqs)
    parts = []
    with torch.no_grad():  # 16 sequences per forward: bounded memory beside an engine that holds most of it
        for i in range(0, len(seqs), 16):
            chunk = seqs[i : i + 16]
            lp, _ = forward.token_logprobs(model, chunk, layout, temperature=temperature)
            parts.append(forward.to_padded(lp, [len(s) for s in chunk], width).float().cpu())
    trainer = torch.cat(parts)
    rollout = torch.zeros_like(trainer)
    mask = torch.zeros_like(trainer, dtype=torch.bool)
    for i, (p, t, lps) in enumerate(flat):
        rollout[i, len(p) : len(p) + len(t)] = torch.tensor(lps)
        mask[i, len(p) : len(p) + len(t)] = True
    out = logprob_mismatch(trainer, rollout, mask)
    out["samples"] = len(flat)
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in out.items()}
