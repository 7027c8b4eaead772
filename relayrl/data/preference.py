"""Preference, unpaired-feedback and process-reward data: rows -> typed samples for `relayrl rm`, `dpo`, `kto`
and `prm`, through the same reading, held-out split, mixing, length rule and skip policy as SFT (build.py).

    build_pair_data(cfg, tokenizer, margin_key=None)      -> (train, eval: list[PairSample], stats)
    build_unpaired_data(cfg, tokenizer)                   -> (train, eval: list[UnpairedSample], stats)
    build_step_data(cfg, tokenizer, placeholder, tokens)  -> (train, eval: list[StepSample], stats)

Pair rows (RM, DPO; KTO reads them too), keys from DataConfig:
    {"input": "2+3=", "chosen": "5", "rejected": "6"}                          prompt + two responses
    {"messages": [...prompt turns...], "chosen": "...", "rejected": "..."}     a chat prompt + two responses
    {"chosen": [...whole chat...], "rejected": [...whole chat...]}            OpenRLHF's form: two chats that
                                                                               end with the assistant's turn
Each side is tokenized exactly like an SFT row in response mode (prompt template, EOS, loss mask on the
response), so the response tokens of a side are its `loss_mask`. A pair is too long when its longer side
exceeds data.max_len (dropped and counted, like SFT). A missing or empty side, a side that is not text or a
chat, and a pair whose two sides tokenize identically are malformed rows (an error naming file, row and key,
or a counted skip with data.skip_malformed). `margin_key` (RM): an optional number per row, 0 when absent.

Unpaired rows (KTO): {"input": ..., "output": ..., "label": true|false} (label_key: desirable or not; also
1 / 0), or pair rows, each giving one desirable and one undesirable sample.

Step rows (PRM): {"input": "step 1 <p> step 2 <p>", "label": ["+", "-"]}: the input holds one placeholder
token after every step, and the label list (label_key) one label per placeholder: hard labels (true / false,
1 / 0, or the reward tokens' text, e.g. "+" / "-") or soft labels (a probability of "good" in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relayrl.config.components import DataConfig
from relayrl.data.build import convert_rows, report_stats, select_rows
from relayrl.data.loading import DataError, MalformedRowError
from relayrl.data.records import LoadStats, RawRow, TokenizedSample
from relayrl.data.templates import build_prompt, encode, row_messages, text_field, tokenize_sft


@dataclass(kw_only=True, slots=True)
class PairSample:
    """A chosen / rejected pair for one prompt."""

    chosen: TokenizedSample
    """Prompt + preferred response; loss_mask marks the response tokens (incl. EOS)."""
    rejected: TokenizedSample
    """Prompt + rejected response."""
    margin: float = 0.0
    """Required reward margin (RM's margin_key), 0 when absent."""
    source: str = "default"
    """Data source name."""
    ref_logps: tuple[float, float] | None = None
    """Reference log-probs of (chosen, rejected) summed over their responses, once precomputed (DPO)."""

    @property
    def num_tokens(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass(kw_only=True, slots=True)
class UnpairedSample:
    """One response with binary feedback (KTO)."""

    sample: TokenizedSample
    """Prompt + response, loss_mask on the response."""
    desirable: bool
    """True: a desirable response; False: an undesirable one."""
    source: str = "default"

    @property
    def num_tokens(self) -> int:
        return len(self.sample)


@dataclass(kw_only=True, slots=True)
class StepSample:
    """A multi-step solution with one label per step (PRM)."""

    input_ids: list[int]
    """[T] token ids; the placeholder token closes every step."""
    positions: list[int]
    """[S] index in input_ids of each step's placeholder."""
    labels: list[float]
    """[S] probability that the step is good: 1.0 / 0.0 for hard labels, in [0, 1] for soft labels."""
    source: str = "default"

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


# ---------------------------------------------------------------------------------------------- pairs
def _side(row: RawRow, cfg: DataConfig, key: str, tokenizer: Any, source: str) -> TokenizedSample:
    """One side of a pair as an SFT response-mode sample (errors name the row's own keys)."""
    value = row.data.get(key)
    if isinstance(value, list):  # a whole chat ending with the assistant's response
        data: dict[str, Any] = {cfg.messages_key: value}
    else:
        text = text_field(row, key)
        msgs = row_messages(row, cfg)
        if msgs is not None:
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            data = {cfg.messages_key: [*msgs, {"role": "assistant", "content": text}]}
        else:
            data = {cfg.input_key: text_field(row, cfg.input_key), cfg.output_key: text}
    sub = RawRow(data=data, source=row.source, file=row.file, row=row.row)
    try:
        return tokenize_sft(sub, tokenizer, cfg, "response", source)
    except MalformedRowError as e:
        named = e.key
        if isinstance(value, list) and e.key and e.key.startswith(cfg.messages_key):
            named = key + e.key[len(cfg.messages_key) :]  # messages[0] -> chosen[0]
        elif e.key == cfg.output_key:
            named = key
        raise MalformedRowError(row, named, e.problem) from None


def _margin(row: RawRow, key: str | None) -> float:
    if key is None or row.data.get(key) is None:
        return 0.0
    value = row.data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedRowError(row, key, f"the margin must be a number, got {value!r:.40}")
    return float(value)


def tokenize_pair(
    row: RawRow, tokenizer: Any, cfg: DataConfig, source: str, margin_key: str | None = None
) -> PairSample:
    """One pair row -> PairSample (see module doc)."""
    chosen = _side(row, cfg, cfg.chosen_key, tokenizer, source)
    rejected = _side(row, cfg, cfg.rejected_key, tokenizer, source)
    if chosen.input_ids == rejected.input_ids:
        raise MalformedRowError(
            row,
            f"{cfg.chosen_key}/{cfg.rejected_key}",
            "chosen and rejected are identical (nothing to prefer)",
        )
    return PairSample(chosen=chosen, rejected=rejected, margin=_margin(row, margin_key), source=source)


def _build(cfg: DataConfig, fn: Callable[[RawRow, str], tuple[Any, int]], log: Callable[[str], None]):
    train_rows, eval_rows, stats = select_rows(cfg)
    train = convert_rows(train_rows, "train", stats, cfg, fn, log)
    evals = convert_rows(eval_rows, "eval", stats, cfg, fn, log)
    report_stats(stats, log, len(train))
    return train, evals, stats


def build_pair_data(
    cfg: DataConfig, tokenizer: Any, *, margin_key: str | None = None, log: Callable[[str], None] = print
) -> tuple[list[PairSample], list[PairSample], list[LoadStats]]:
    """Chosen / rejected pairs (train, eval) and per-source stats (see module doc)."""

    def fn(row: RawRow, ds: str) -> tuple[PairSample, int]:
        p = tokenize_pair(row, tokenizer, cfg, ds, margin_key)
        return p, max(len(p.chosen), len(p.rejected))

    return _build(cfg, fn, log)


# ---------------------------------------------------------------------------------------------- unpaired
def _desirable(row: RawRow, key: str) -> bool:
    value = row.data.get(key)
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise MalformedRowError(
        row,
        key,
        f"expected true / false (or 1 / 0) saying whether the response is desirable, got {value!r:.40}",
    )


def build_unpaired_data(
    cfg: DataConfig, tokenizer: Any, *, log: Callable[[str], None] = print
) -> tuple[list[UnpairedSample], list[UnpairedSample], list[LoadStats]]:
    """Desirable / undesirable samples (train, eval): from rows with a label, or both sides of pair rows."""

    def fn(row: RawRow, ds: str) -> tuple[list[UnpairedSample], int]:
        if cfg.chosen_key in row.data or cfg.rejected_key in row.data:
            p = tokenize_pair(row, tokenizer, cfg, ds)
            out = [
                UnpairedSample(sample=p.chosen, desirable=True, source=ds),
                UnpairedSample(sample=p.rejected, desirable=False, source=ds),
            ]
        else:
            good = _desirable(row, cfg.label_key)
            s = tokenize_sft(row, tokenizer, cfg, "response", ds)
            out = [UnpairedSample(sample=s, desirable=good, source=ds)]
        return out, max(u.num_tokens for u in out)

    train, evals, stats = _build(cfg, fn, log)
    return [u for us in train for u in us], [u for us in evals for u in us], stats


# ---------------------------------------------------------------------------------------------- steps
def single_token(tokenizer: Any, text: str, what: str) -> int:
    """The id of `text`, which must encode to exactly one token (a config error otherwise)."""
    ids = encode(tokenizer, text)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) == 1 and unk is not None and ids[0] == unk and text != getattr(tokenizer, "unk_token", None):
        raise DataError(
            f"{what} {text!r} is not in the tokenizer's vocabulary (it encodes to the unknown token). Pick a "
            "string the tokenizer has as one token (or add it as a special token)."
        )
    if len(ids) != 1:
        raise DataError(
            f"{what} {text!r} must be exactly one token of the tokenizer; it encodes to {len(ids)} tokens "
            f"{ids[:8]}. Pick a string the tokenizer has as one token (or add it as a special token)."
        )
    return ids[0]


def _step_label(row: RawRow, key: str, i: int, value: Any, good: str, bad: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if value == good:
        return 1.0
    if value == bad:
        return 0.0
    if isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise MalformedRowError(
        row,
        f"{key}[{i}]",
        f"expected true / false, {good!r} / {bad!r}, or a probability in [0, 1], got {value!r:.40}",
    )


def build_step_data(
    cfg: DataConfig,
    tokenizer: Any,
    *,
    placeholder: str,
    reward_tokens: tuple[str, str],
    log: Callable[[str], None] = print,
) -> tuple[list[StepSample], list[StepSample], list[LoadStats]]:
    """Step-labelled samples (train, eval) for a process reward model (see module doc)."""
    mark = single_token(tokenizer, placeholder, "prm.placeholder")
    good, bad = reward_tokens

    def fn(row: RawRow, ds: str) -> tuple[StepSample, int]:
        ids = encode(tokenizer, build_prompt(row, tokenizer, cfg).text)
        positions = [i for i, t in enumerate(ids) if t == mark]
        labels = row.data.get(cfg.label_key)
        if not isinstance(labels, list) or not labels:
            raise MalformedRowError(
                row, cfg.label_key, f"expected a non-empty list of step labels, got {labels!r:.40}"
            )
        if len(labels) != len(positions):
            raise MalformedRowError(
                row,
                cfg.label_key,
                f"{len(labels)} labels for {len(positions)} steps (placeholders {placeholder!r} in the input)",
            )
        values = [_step_label(row, cfg.label_key, i, v, good, bad) for i, v in enumerate(labels)]
        return StepSample(input_ids=ids, positions=positions, labels=values, source=ds), len(ids)

    return _build(cfg, fn, log)
