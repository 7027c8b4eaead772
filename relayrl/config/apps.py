"""Configs of the interactive and serving apps.

    ChatConfig      relayrl chat       a terminal chat with a model folder             relayrl.apps.chat
    DemoConfig      relayrl demo       tiny model, SFT then RL on a built-in task      relayrl.apps.demo
    ServeConfig     relayrl serve      OpenAI-compatible server over a rollout engine  relayrl.apps.serve
    ServeRMConfig   relayrl serve-rm   a reward model (or reward_func) over HTTP       relayrl.apps.serve_rm

The two servers share their address fields (host, port, device) by name, not by a section, so their flags
stay flat (`--host`, `--port`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from relayrl.config.base import check_choices, invalid
from relayrl.config.components import ModelConfig


@dataclass(kw_only=True, slots=True)
class ChatConfig:
    """`relayrl chat`: an interactive chat with a model folder, streamed token by token."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to talk to (a local folder or Hub id; LoRA settings are not applied)."""
    system: str = ""
    """System prompt at the start of every conversation; empty = none."""
    temperature: float = 0.7
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables it."""
    max_new_tokens: int = 512
    """Most tokens per reply."""
    seed: int | None = None
    """Sampling seed (the same seed and inputs replay the same replies); None = a fresh one per session."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto = cuda when available, else cpu."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.temperature < 0:
            raise invalid("temperature", self.temperature, "a float >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise invalid("top_p", self.top_p, "a float in (0, 1]")
        if self.top_k < 0:
            raise invalid("top_k", self.top_k, "an int >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise invalid("max_new_tokens", self.max_new_tokens, "an int >= 1")


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """`relayrl demo`: tiny model, SFT then RL on a built-in task, on CPU."""

    output_dir: str = "runs/demo"
    """Run folder (summary.json, curves.png, final/, sft/, rl/)."""
    seed: int = 0
    """Seed of the model init, data and training."""
    task: str = "add2"
    """Built-in task (relayrl/tasks)."""
    hidden: int = 64
    """Tiny model hidden size (64 with 2 layers: ~0.13M parameters, an RL step ~4x cheaper than hidden 128 with
    4 layers, ~1M, which needed ~380 s of CPU time for the same gain: docs/rl.md "The demo")."""
    layers: int = 2
    """Tiny model layers."""
    sft_rows: int = 1000
    """SFT training rows (few on purpose: leaves room for RL; 500 left one seed in three unable to generalise)."""
    sft_steps: int = 1200
    """Most SFT optimizer steps (batch 64, constant lr after a 30-step warmup)."""
    sft_chunk: int = 50
    """SFT runs in chunks of this many steps; after each, greedy accuracy on the dev rows is measured."""
    sft_target: float = 0.3
    """SFT stops at the first chunk whose dev accuracy reaches this: RL then starts from a model that is
    right often enough to learn from and wrong often enough to have room (seeds differ a lot at a fixed
    step count: 0.59 vs 0.79 after 600 steps for seeds 0 and 1). 0.3 with rl_lr 2e-4: seeds 0 / 1 / 2 of the
    default model gain +0.400 / +0.392 / +0.404 (0.2 left too few correct samples: docs/rl.md "The demo")."""
    dev_rows: int = 200
    """Rows (disjoint from SFT, RL and eval rows) for the SFT stopping rule."""
    sft_lr: float = 2e-3
    """SFT peak learning rate."""
    rl_steps: int = 600
    """RL steps (rl_prompts prompts x 8 samples each)."""
    rl_prompts: int = 32
    """Prompts per RL step, each sampled 8 times (a group). 16 or 8 cost less per step but gained less per
    second of CPU time on seed 0 (docs/rl.md "The demo")."""
    rl_lr: float = 2e-4
    """RL learning rate (constant)."""
    rl_rows: int = 3000
    """Distinct training prompts available to RL (disjoint from the SFT and eval rows)."""
    rl_filter: bool = True
    """Dynamic filtering of zero-variance groups in RL (a toy-sized demo whose groups are all alike turns it
    off, else every step is filtered and the run reports that it made no update)."""
    rl_kl_monitor: bool = False
    """Measure and plot the KL to the SFT model (kl_mode monitor: a reference model and its forward every
    step, ~18% of a step's CPU time, not used in the loss); false: no reference model, no KL curve, the same
    training."""
    eval_rows: int = 500
    """Held-out prompts for the accuracy measurements."""
    control: bool = False
    """Also run the control: continue SFT for as long as RL took, and measure it the same way."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Device (the demo is sized for 2 CPU cores)."""
    threads: int = 1
    """CPU threads for torch (torch.set_num_threads) during the whole demo. 1: the tiny model's ops are too
    small to split, and with 2 OpenMP threads on 2 cores every op paid a thread hand-off (measured on the
    2-core machine: docs/rl.md "The demo")."""

    def __post_init__(self) -> None:
        check_choices(self)
        ints = (
            "sft_steps",
            "sft_chunk",
            "rl_steps",
            "rl_prompts",
            "sft_rows",
            "dev_rows",
            "eval_rows",
            "threads",
        )
        for name in ints:
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "an int >= 1")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """`relayrl serve` options."""

    model: str = ""
    """Causal LM folder or hub id (loaded with AutoModelForCausalLM / AutoTokenizer)."""
    engine: str = "native"
    """Rollout engine: native (default), hf or vllm."""
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)."""
    port: int = 8000
    """TCP port."""
    model_name: str = ""
    """Name reported by /v1/models and in responses ('' = the model folder's name)."""
    max_total_len: int = 0
    """Prompt + completion length limit (0 = the engine's limit)."""
    device: str = ""
    """Device ('' = cuda when available, else cpu)."""
    vllm_gpu_util: float = 0.0
    """engine vllm: share of the GPU's memory vLLM takes (weights + KV cache; its gpu_memory_utilization), in
    (0, 1); 0: vLLM's own default (0.9)."""
    vllm_any_version: bool = False
    """engine vllm: start with an installed vLLM outside the release line relayrl supports (at your own risk);
    false refuses, naming both versions."""
    tool_parser: str = "auto"
    """How a chat request with `tools` reads tool calls from the output: auto (from the chat template:
    `<tool_call>` -> hermes), hermes (Hermes / Qwen `<tool_call>{json}</tool_call>`), or none (plain text)."""
    max_request_mb: float = 8.0
    """Largest request body in MiB; a larger one is answered 413 before it is read. Parsing, chat-template
    rendering and tokenization run on worker threads, so a large prompt never holds up other requests."""
    allow_client_chat_template: bool = False
    """Render a chat template sent by a client (`chat_template`, also inside `chat_template_kwargs`). A
    template is code the server runs (a looping one holds a worker thread): false answers such requests 400
    and renders only the model's own template."""

    def __post_init__(self) -> None:
        if self.tool_parser not in ("auto", "none", "hermes"):
            raise invalid("tool_parser", self.tool_parser, "auto, none or hermes")
        if not 0.0 <= self.vllm_gpu_util < 1.0:
            raise invalid(
                "vllm_gpu_util", self.vllm_gpu_util, "a fraction of the GPU's memory in (0, 1), or 0"
            )
        if not (math.isfinite(self.max_request_mb) and self.max_request_mb > 0):
            raise invalid("max_request_mb", self.max_request_mb, "a size in MiB > 0 (e.g. 8)")
        if self.max_total_len < 0:
            raise invalid("max_total_len", self.max_total_len, "an int >= 0 (0 = the engine's limit)")
        if not 0 <= self.port <= 65535:
            raise invalid("port", self.port, "a TCP port in [0, 65535]")


@dataclass(kw_only=True, slots=True)
class ServeRMConfig:
    """`relayrl serve-rm` options."""

    model: str = ""
    """Reward model folder (AutoModelForSequenceClassification with num_labels=1); or use --reward-func."""
    reward_func: str = ""
    """A Python file defining reward_func(queries, prompts, labels) to serve instead of a model."""
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)."""
    port: int = 5000
    """TCP port."""
    batch_size: int = 16
    """Sequences per reward-model forward pass."""
    max_len: int = 2048
    """Longest sequence scored (longer ones keep their last max_len tokens)."""
    device: str = ""
    """Device for the model ('' = cuda when available, else cpu)."""
    timeout: float = 120.0
    """Seconds one /get_reward call may score for; a slower one is answered 504 naming this limit (the call's
    thread is left to finish; clients such as RemoteRewardSource retry 5xx answers)."""
    max_concurrency: int = 8
    """Reward-function calls scored at once, each on its own thread, so a slow call does not hold up the
    others; more wait for a free slot (within their timeout). A reward model scores one batch at a time."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise invalid("timeout", self.timeout, "seconds > 0")
        if self.max_concurrency < 1:
            raise invalid("max_concurrency", self.max_concurrency, "an int >= 1")
        if not 0 <= self.port <= 65535:
            raise invalid("port", self.port, "a TCP port in [0, 65535]")
