"""Datasets for training: sources -> held-out split -> mixing -> tokenized samples or prompts.

    build_sft_data(cfg, tokenizer, mode)  -> (train, eval: list[TokenizedSample], stats: list[LoadStats])
    build_prompt_data(cfg, tokenizer)      -> (train, eval: list[PromptSample],    stats: list[LoadStats])
    select_rows(cfg)                       -> (train, eval: list[RawRow], stats)   the untokenized stage

Order of operations (all deterministic under `cfg.seed`):
1. read every source in `cfg.datasets` (see loading.py);
2. eval rows: `cfg.eval_dataset` if set, else `cfg.eval_split_ratio` of each source held out (a seeded
   random subset; train and eval never share a row);
3. mixing: the train size is `cfg.max_samples` (0 = all rows); each source contributes
   round(p_i * size) rows (largest remainder), p_i = `cfg.dataset_probs` normalised, or proportional to the
   source sizes when empty. A source asked for fewer rows than it has gives a seeded random subset (in file
   order); asked for more, it is repeated. With one source the file order is kept; several are shuffled
   together;
4. tokenize each selected row once. Rows longer than `cfg.max_len` tokens are dropped and counted; malformed
   rows raise `MalformedRowError` (file, row, key) or, with `cfg.skip_malformed`, are skipped and counted.
   One summary line per source is printed; no training sample left at all is a `DataError`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from relayrl.config.components import DataConfig
from relayrl.data.images import load_vision, prepare_row
from relayrl.data.loading import DataError, MalformedRowError, load_source
from relayrl.data.records import LoadStats, PromptSample, RawRow, TokenizedSample
from relayrl.data.templates import SFTMode, build_prompt, encode, tokenize_sft

S = TypeVar("S")
MAX_LOGGED_SKIPS = 5


def source_name(source: str) -> str:
    """Short name of a source for metrics: a file's stem, a folder's name, or the Hub id."""
    path = Path(source)
    if path.exists():
        return path.stem if path.is_file() else path.name
    return source


def mix_counts(sizes: list[int], probs: list[float] | None, total: int) -> list[int]:
    """Rows to take from each source: round(p_i * total) by largest remainder (so they sum to `total`);
    p = probs normalised, or sizes / sum(sizes) when probs is empty/None."""
    weights = list(probs) if probs else [float(s) for s in sizes]
    norm = sum(weights)
    if norm <= 0:
        return [0] * len(sizes)
    exact = [w / norm * total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _take(rows: list[RawRow], n: int, rng: random.Random) -> list[RawRow]:
    """n rows of `rows`: all of them (n == len), a random subset in file order (n < len), or repeats."""
    if not rows or n <= 0:
        return []
    reps, rest = divmod(n, len(rows))
    picked = sorted(rng.sample(range(len(rows)), rest))
    return rows * reps + [rows[i] for i in picked]


def select_rows(cfg: DataConfig) -> tuple[list[RawRow], list[RawRow], list[LoadStats]]:
    """Steps 1-3 of the module docstring: the train and eval rows (untokenized) and per-source stats."""
    if not cfg.datasets:
        raise ValueError("data.datasets is empty: give at least one source (--data.datasets FILE_OR_ID ...)")
    twice = sorted({s for s in cfg.datasets if cfg.datasets.count(s) > 1})
    if twice:  # per-source counts and mixing are keyed by the source string
        raise ValueError(
            f"data.datasets lists {twice} more than once; list each source once and weight it with "
            "data.dataset_probs instead"
        )
    rng = random.Random(cfg.seed)
    per_source: list[list[RawRow]] = []
    evals: list[RawRow] = []
    stats: list[LoadStats] = []
    for src in cfg.datasets:
        rows, bad = load_source(src, split=cfg.split, skip_malformed=cfg.skip_malformed)
        st = LoadStats(source=src, split="train", rows_read=len(rows) + bad, skipped_malformed=bad)
        if cfg.eval_dataset is None and cfg.eval_split_ratio > 0 and len(rows) > 1:
            n_eval = min(len(rows) - 1, max(1, round(cfg.eval_split_ratio * len(rows))))
            held = set(rng.sample(range(len(rows)), n_eval))
            evals += [r for i, r in enumerate(rows) if i in held]
            rows = [r for i, r in enumerate(rows) if i not in held]
        per_source.append(rows)
        stats.append(st)
    sizes = [len(r) for r in per_source]
    total = cfg.max_samples or sum(sizes)
    counts = mix_counts(sizes, cfg.dataset_probs, total)
    train: list[RawRow] = []
    for rows, n, st in zip(per_source, counts, stats, strict=True):
        chosen = _take(rows, n, rng)
        st.rows_used = len(chosen)
        train += chosen
    if len(per_source) > 1:
        rng.shuffle(train)
    if cfg.eval_dataset is not None:
        rows, bad = load_source(cfg.eval_dataset, split=cfg.eval_split, skip_malformed=cfg.skip_malformed)
        evals = rows
        stats.append(
            LoadStats(source=cfg.eval_dataset, split="eval", rows_read=len(rows) + bad, skipped_malformed=bad)
        )
    elif evals:
        stats += [LoadStats(source=s, split="eval") for s in cfg.datasets]
    eval_stats = {s.source: s for s in stats if s.split == "eval"}
    for r in evals:
        eval_stats[r.source].rows_used += 1
    return train, evals, stats


def convert_rows(
    rows: list[RawRow],
    split: str,
    stats: list[LoadStats],
    cfg: DataConfig,
    fn: Callable[[RawRow, str], tuple[S, int]],
    log: Callable[[str], None],
) -> list[S]:
    """Apply `fn(row, datasource) -> (sample, length)` to rows, dropping too-long and (if allowed) malformed
    rows, counted into the matching LoadStats."""
    by_source = {s.source: s for s in stats if s.split == split}
    out: list[S] = []
    skipped_logged = 0
    for row in rows:
        st = by_source[row.source]
        try:
            sample, length = fn(row, _datasource(row, cfg))
        except MalformedRowError as e:
            if not cfg.skip_malformed:
                raise
            st.skipped_malformed += 1
            if skipped_logged < MAX_LOGGED_SKIPS:
                log(f"data: skipped malformed row: {e}")
                skipped_logged += 1
            continue
        if length > cfg.max_len:
            st.dropped_too_long += 1
            continue
        st.kept += 1
        out.append(sample)
    return out


def _datasource(row: RawRow, cfg: DataConfig) -> str:
    if cfg.datasource_key is not None and row.data.get(cfg.datasource_key) not in (None, ""):
        return str(row.data[cfg.datasource_key])
    return source_name(row.source)


def report_stats(stats: list[LoadStats], log: Callable[[str], None], n_train: int) -> None:
    for st in stats:
        log(st.line())
    if n_train == 0:  # training on nothing would fail later, far from the cause
        lines = "; ".join(st.line() for st in stats if st.split == "train")
        raise DataError(
            f"no training samples left ({lines}). Check data.datasets, data.max_len (rows longer are "
            "dropped) and the key settings (data.input_key, data.output_key, data.messages_key)."
        )


def build_sft_data(
    cfg: DataConfig, tokenizer: Any, mode: SFTMode = "response", *, log: Callable[[str], None] = print
) -> tuple[list[TokenizedSample], list[TokenizedSample], list[LoadStats]]:
    """Tokenized SFT / pretrain samples (train, eval) and per-source stats (printed through `log`)."""
    train_rows, eval_rows, stats = select_rows(cfg)
    vision = load_vision(tokenizer)

    def fn(row: RawRow, ds: str) -> tuple[TokenizedSample, int]:
        row, images = prepare_row(
            row, vision, cfg.image_key, input_key=cfg.input_key, messages_key=cfg.messages_key
        )
        s = tokenize_sft(row, tokenizer, cfg, mode, ds)
        if vision is not None:
            ids, mask = vision.expand(s.input_ids, s.loss_mask, images, row.where)
            s.input_ids, s.loss_mask, s.images = ids, mask or [], images
        return s, len(s.input_ids)

    train = convert_rows(train_rows, "train", stats, cfg, fn, log)
    evals = convert_rows(eval_rows, "eval", stats, cfg, fn, log)
    report_stats(stats, log, len(train))
    return train, evals, stats


def build_prompt_data(
    cfg: DataConfig, tokenizer: Any, *, log: Callable[[str], None] = print
) -> tuple[list[PromptSample], list[PromptSample], list[LoadStats]]:
    """RL prompts (train, eval): templated, tokenized, label and datasource filled, `index` = position in
    its list (stable under the same config). Prompts longer than max_len tokens are dropped and counted."""
    train_rows, eval_rows, stats = select_rows(cfg)
    for st in stats:
        st.no_label = 0
    by_source = {(st.source, st.split): st for st in stats}
    origin: dict[int, tuple[str, str]] = {}
    vision = load_vision(tokenizer)

    def for_split(split: str) -> Callable[[RawRow, str], tuple[PromptSample, int]]:
        def fn(row: RawRow, ds: str) -> tuple[PromptSample, int]:
            row, images = prepare_row(
                row, vision, cfg.image_key, input_key=cfg.input_key, messages_key=cfg.messages_key
            )
            prompt = build_prompt(row, tokenizer, cfg)
            ids = encode(tokenizer, prompt.text)
            if vision is not None:
                ids = vision.expand(ids, None, images, row.where)[0]
            label = row.data.get(cfg.label_key)
            sample = PromptSample(
                index=0,
                prompt=prompt.text,
                prompt_ids=ids,
                label=label,
                datasource=ds,
                messages=prompt.messages,
                images=images,
            )
            origin[id(sample)] = (row.source, split)
            return sample, len(ids)

        return fn

    train = convert_rows(train_rows, "train", stats, cfg, for_split("train"), log)
    evals = convert_rows(eval_rows, "eval", stats, cfg, for_split("eval"), log)
    for samples in (train, evals):
        for i, smp in enumerate(samples):
            smp.index = i
            if smp.label is None:  # kept prompts without a label, per source
                st = by_source[origin[id(smp)]]
                st.no_label = (st.no_label or 0) + 1
    report_stats(stats, log, len(train))
    return train, evals, stats
