"""Config components: one dataclass per component; a command's config is a tree of them.

    ModelConfig(lora: LoraConfig)  DataConfig  OptimConfig  TrainConfig  CkptConfig  LoggerConfig
    OneModelConfig(model, data, optim, train, ckpt, logger, dist: DistConfig)
        the sections every one-model training command shares (sft, rm, prm, dpo, kto, kd: relayrl.config.recipes
        adds each command's own section); the shared recipe runner (relayrl.trainers.recipe) reads only these

Every field carries a docstring (the string under it): that text is the `--help`. Values are checked in
`__post_init__` with `invalid(field, value, valid)`, so a bad value fails before any work starts with a
message naming the field, the value and the valid range. Literal fields list their choices in errors.

Extending (other engineers add fields here): add `name: type = default` plus a one-line docstring under it,
and a check in `__post_init__` if the value has a range. Keep defaults sensible so few flags are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from relayrl.config.base import check_choices, invalid
from relayrl.config.dist import DistConfig


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters through peft (rank 0 = off: full fine-tuning)."""

    rank: int = 0
    """LoRA rank r; 0 disables LoRA and trains all weights."""
    alpha: int = 16
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt (e.g. q_proj v_proj), or all-linear for every linear layer but the LM head."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise invalid("rank", self.rank, "an int >= 0 (0 = LoRA off)")
        if self.alpha <= 0:
            raise invalid("alpha", self.alpha, "an int > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise invalid("dropout", self.dropout, "a float in [0, 1)")
        if self.rank > 0 and not self.target_modules:
            raise invalid("target_modules", self.target_modules, "at least one module name, or all-linear")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model: a local folder or Hub id, its dtype, attention kernel and adapters."""

    name_or_path: str = ""
    """Hugging Face Hub id or local folder of an AutoModelForCausalLM (required by commands that load one)."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer folder or Hub id; None uses name_or_path."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute dtype. Trained weights and optimizer states are always fp32 (master weights); on a GPU, auto /
    bf16 / fp16 train under bf16 autocast and hold frozen copies (the rollout engine's weights, the reference
    model, served models) in bf16 (fp16 for fp16); fp32 computes in fp32. auto = bf16 on a GPU, fp32 on a CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel; flash_attention_2 needs the flash-attn package and a GPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% slower."""
    trust_remote_code: bool = False
    """Allow model code from the Hub repository (only for repositories you trust)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    load_in_4bit: bool = False
    """QLoRA: load the base weights in 4-bit (needs bitsandbytes, a GPU and lora.rank > 0)."""
    freeze_vision_tower: bool = True
    """Vision-language models (docs/vlm.md): keep the vision tower's weights fixed (not trained, never synced to
    the engine); false trains it with the rest. Ignored for text models."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.load_in_4bit and self.lora.rank == 0:
            raise invalid(
                "load_in_4bit", True, "false unless LoRA is on (set --model.lora.rank > 0 for QLoRA)"
            )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Datasets, their keys and templates (see docs/data.md)."""

    datasets: list[str] = field(default_factory=list)
    """Training sources: .json/.jsonl/.parquet/.csv files, folders of them, or Hub dataset ids."""
    dataset_probs: list[float] = field(default_factory=list)
    """Mixing probabilities, one per source (normalised); empty = proportional to each source's size."""
    split: str = "train"
    """Split to read from Hub datasets (local files have no splits)."""
    eval_dataset: str | None = None
    """Evaluation source (file, folder or Hub id); None = use eval_split_ratio."""
    eval_split: str = "test"
    """Split to read when eval_dataset is a Hub dataset."""
    eval_split_ratio: float = 0.0
    """Fraction of each training source held out for evaluation (seeded) when no eval_dataset; 0 = none."""
    max_samples: int = 0
    """Training rows to use after mixing; 0 = all."""
    input_key: str = "input"
    """Key of the prompt text (or of a chat list of messages)."""
    output_key: str = "output"
    """Key of the response text (SFT)."""
    label_key: str = "label"
    """Key of the ground truth for verifiable rewards (RL); rows without it get label None."""
    messages_key: str = "messages"
    """Key of a chat list [{role, content}, ...]; rows that have it are rendered with the chat template."""
    image_key: str = "images"
    """Key of a row's images (vision-language models, docs/vlm.md): a file path, data URI or URL, or a list;
    text marks each with `<image>`. Used only when the model folder has an image processor."""
    chosen_key: str = "chosen"
    """Key of the preferred response (reward model / DPO)."""
    rejected_key: str = "rejected"
    """Key of the rejected response (reward model / DPO)."""
    datasource_key: str | None = None
    """Key naming each row's data source (metrics are split by it); None = the source's file or Hub name."""
    apply_chat_template: bool = False
    """Wrap the input as a user message and render it with the tokenizer's chat template."""
    input_template: str | None = None
    """Prompt template with one {} for the input, e.g. 'Q: {}\\nA: ' (when not using the chat template)."""
    max_len: int = 2048
    """Longest sample in tokens (prompt + response; prompt only for RL); longer ones are dropped and counted."""
    skip_malformed: bool = False
    """Skip (and count) rows with a missing key, wrong type or empty text instead of stopping with an error."""
    seed: int = 42
    """Seed for mixing, held-out split and subsampling."""

    def __post_init__(self) -> None:
        if self.dataset_probs:
            if len(self.dataset_probs) != len(self.datasets):
                raise invalid(
                    "dataset_probs",
                    self.dataset_probs,
                    f"one probability per source ({len(self.datasets)} sources in datasets)",
                )
            if any(p < 0 for p in self.dataset_probs) or sum(self.dataset_probs) <= 0:
                raise invalid("dataset_probs", self.dataset_probs, "non-negative numbers with a positive sum")
        if not 0.0 <= self.eval_split_ratio < 1.0:
            raise invalid("eval_split_ratio", self.eval_split_ratio, "a float in [0, 1)")
        if self.max_samples < 0:
            raise invalid("max_samples", self.max_samples, "an int >= 0 (0 = all)")
        if self.max_len <= 0:
            raise invalid("max_len", self.max_len, "an int > 0")
        if self.input_template is not None and self.input_template.count("{}") != 1:
            raise invalid("input_template", self.input_template, "a string with exactly one {} for the input")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The optimizer (AdamW or Muon), gradient clipping and the learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup: cosine or linear down to min_lr_ratio * lr, or constant."""
    warmup_steps: int = 0
    """Linear warmup steps; when > 0 it overrides warmup_ratio."""
    warmup_ratio: float = 0.03
    """Warmup as a fraction of the total optimizer steps (used when warmup_steps is 0)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr, in [0, 1]."""
    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Newton-Schulz-orthogonalised momentum on 2-D hidden weights (update RMS matched to AdamW,
    so the same lr), AdamW on embeddings, heads and 1-D params; clipping acts on the raw gradient before it."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum, in [0, 1); used when name is muon."""

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.lr > 0:
            raise invalid("lr", self.lr, "a float > 0")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise invalid("muon_momentum", self.muon_momentum, "a float in [0, 1)")
        if self.weight_decay < 0:
            raise invalid("weight_decay", self.weight_decay, "a float >= 0")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise invalid("adam_betas", list(self.adam_betas), "two floats in [0, 1), e.g. 0.9 0.95")
        if not self.eps > 0:
            raise invalid("eps", self.eps, "a float > 0")
        if self.max_grad_norm < 0:
            raise invalid("max_grad_norm", self.max_grad_norm, "a float >= 0 (0 = no clipping)")
        if self.warmup_steps < 0:
            raise invalid("warmup_steps", self.warmup_steps, "an int >= 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise invalid("warmup_ratio", self.warmup_ratio, "a float in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise invalid("min_lr_ratio", self.min_lr_ratio, "a float in [0, 1]")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The training loop: batch sizes, length, evaluation and logging cadence, device, run folder."""

    seed: int = 42
    """Seed for weights init, data order and dropout."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass (gradients accumulate up to batch_size)."""
    batch_size: int = 64
    """Sequences per optimizer step (a multiple of micro_batch_size)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per micro-batch (replaces micro_batch_size when > 0); 0 = off."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 = run all epochs."""
    eval_every: int = 0
    """Evaluate every N optimizer steps; 0 = only at the end."""
    log_every: int = 1
    """Log metrics every N optimizer steps."""
    packing: bool = False
    """Pack several samples into one row (no cross-sample attention, positions restart per sample)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto = cuda when available, else cpu."""
    output_dir: str = ""
    """Run folder (config, metrics, checkpoints); empty = runs/<command>."""

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("micro_batch_size", "batch_size", "epochs", "log_every"):
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "an int >= 1")
        for name in ("max_tokens_per_micro_batch", "max_steps", "eval_every"):
            if getattr(self, name) < 0:
                raise invalid(name, getattr(self, name), "an int >= 0 (0 = off)")
        if self.max_tokens_per_micro_batch == 0 and self.batch_size % self.micro_batch_size:
            raise invalid(
                "batch_size", self.batch_size, f"a multiple of micro_batch_size ({self.micro_batch_size})"
            )


@dataclass(kw_only=True, slots=True)
class CkptConfig:
    """Checkpoints: cadence, rotation, best-model tracking and resume."""

    save_every: int = 0
    """Save a checkpoint every N optimizer steps; 0 = only at the end."""
    keep_last: int = 2
    """Keep the newest N checkpoints (older ones are deleted); 0 = keep all."""
    keep_best: bool = False
    """Also keep the checkpoint with the best best_metric."""
    best_metric: str = "eval/loss"
    """Metric that picks the best checkpoint."""
    best_mode: Literal["min", "max"] = "min"
    """Whether a lower (min) or higher (max) best_metric is better."""
    resume: str = "auto"
    """auto = continue from the run folder's latest checkpoint if any; none = start fresh (refused when the
    run folder already holds a run, unless overwrite); or a checkpoint path."""
    overwrite: bool = False
    """With resume none (or a checkpoint path) in a run folder that already holds a run: move that run aside
    to <folder>.old-<time> and start in an empty folder (never mix two runs' files)."""
    save_hf_model: bool = True
    """Write an HF-format model folder (from_pretrained loads it) in every checkpoint."""
    save_final: bool = True
    """Write the last checkpoint and the final/ HF model when the run ends; false: neither (benchmarks and
    throwaway runs end right after their last step; checkpoints every save_every steps are still written)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.save_every < 0:
            raise invalid("save_every", self.save_every, "an int >= 0 (0 = only at the end)")
        if self.keep_last < 0:
            raise invalid("keep_last", self.keep_last, "an int >= 0 (0 = keep all)")
        if not self.resume:
            raise invalid("resume", self.resume, "auto, none or a checkpoint path")


@dataclass(kw_only=True, slots=True)
class LoggerConfig:
    """Metrics: JSONL always (<run>/metrics.jsonl), plus TensorBoard, W&B and a console progress bar."""

    tensorboard: bool = False
    """Also write TensorBoard event files to <run>/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb extra and a login)."""
    wandb_project: str = "relayrl"
    """W&B project name."""
    wandb_run_name: str | None = None
    """W&B run name; None = the run folder's name."""
    progress_bar: bool = True
    """Show a console progress bar (step, loss, lr, tokens/s, ETA)."""


@dataclass(kw_only=True, slots=True)
class OneModelConfig:
    """What every one-model training command (sft, rm, prm, dpo, kto, kd) shares; each adds its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train (and its tokenizer)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training / eval data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints and resume."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics sinks."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Data parallelism: one process, or Ray ranks with FSDP2 shards (dist.num_nodes x dist.num_gpus_per_node)."""

    def __post_init__(self) -> None:
        check_choices(self)
        self.dist.check_command("model")
