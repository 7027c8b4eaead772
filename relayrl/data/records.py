"""Typed records of the data stage.

    RawRow            one row as read from a file / Hub dataset, with where it came from (for error messages)
    TokenizedSample   one SFT / pretrain sample: token ids + which tokens are targets (trainers consume it)
    LoadStats         per-source counts: rows read, kept, dropped as too long, skipped as malformed

RL prompts are `relayrl.agents.base.PromptSample` (built by `relayrl.data.build.build_prompt_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.rollout.media import ImageInputs


@dataclass(kw_only=True, slots=True)
class RawRow:
    """One untokenized row and its origin."""

    data: dict[str, Any]
    """The row's columns, as read (JSON types; CSV cells are strings)."""
    source: str
    """The configured source it came from (file, folder or Hub id), as written in DataConfig."""
    file: str
    """The file it was read from (the Hub id for Hub datasets)."""
    row: int
    """1-based row number in `file` (the line number for .jsonl; the data row, header excluded, for .csv)."""

    @property
    def where(self) -> str:
        """'file, row N' (or 'line N' for jsonl) for error messages."""
        unit = "line" if self.file.endswith(".jsonl") else "row"
        return f"{self.file}, {unit} {self.row}"


@dataclass(kw_only=True, slots=True)
class TokenizedSample:
    """One SFT / pretrain sample, tokenized once at the edge.

    `loss_mask[i]` True means token i is a target: the loss includes -log p(input_ids[i] | input_ids[:i]).
    `loss_mask[0]` is always False (nothing predicts the first token), so packed samples never train one
    sample's first token from the previous sample's tail."""

    input_ids: list[int]
    """[T] token ids: prompt / context followed by the response(s)."""
    loss_mask: list[bool]
    """[T] True where the token is a training target (response tokens incl. their end token)."""
    source: str = "default"
    """Data source name (the configured source, or the row's datasource_key value)."""
    images: ImageInputs | None = None
    """The sample's images (vision-language models; relayrl.data.images), None for text."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        """Number of tokens (len)."""
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Number of target tokens (True in loss_mask)."""
        return sum(self.loss_mask)


@dataclass(kw_only=True, slots=True)
class LoadStats:
    """What happened to one source's rows (one line of the printed data summary)."""

    source: str
    """The source as configured (file, folder or Hub id)."""
    split: str = "train"
    """"train" or "eval"."""
    rows_read: int = 0
    """Rows read from the source (before held-out split and mixing)."""
    rows_used: int = 0
    """Rows selected for this split after the held-out split, mixing and max_samples (before dropping)."""
    kept: int = 0
    """Samples produced."""
    dropped_too_long: int = 0
    """Selected rows dropped because they exceed data.max_len tokens."""
    skipped_malformed: int = 0
    """Selected rows skipped as malformed (only with data.skip_malformed)."""
    no_label: int | None = None
    """RL prompts: kept rows without a label (data.label_key missing or null); None for data without labels."""

    def line(self) -> str:
        """One summary line, e.g. 'data[train] a.jsonl: read 100, used 100, kept 97, dropped_too_long 2, ...'."""
        tail = f", no_label {self.no_label}" if self.no_label is not None else ""
        return (
            f"data[{self.split}] {self.source}: read {self.rows_read}, used {self.rows_used}, kept {self.kept}, "
            f"dropped_too_long {self.dropped_too_long}, skipped_malformed {self.skipped_malformed}{tail}"
        )


@dataclass(kw_only=True, slots=True)
class PromptSample:
    """One prompt from the dataset, tokenized once at the edge."""

    index: int
    """Position of the prompt in its dataset (stable across resume); groups are keyed by it."""
    prompt: str
    """Prompt text after templating (for reward functions and logs)."""
    prompt_ids: list[int]
    """Prompt token ids, [P] ints."""
    label: Any = None
    """Ground truth for verifiable rewards (task-defined), or None."""
    datasource: str = "default"
    """Name of the dataset it came from (metrics are split by it)."""
    messages: list[dict[str, str]] | None = None
    """The chat messages the prompt was built from, when it was a chat."""
    images: ImageInputs | None = None
    """The prompt's images (vision-language models), their pad tokens already in `prompt_ids`; None for text."""
