"""Mixing, held-out split, max_samples, length drops, malformed rows and RL prompts, end to end from files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from relayrl.config import DataConfig
from relayrl.data.build import build_prompt_data, build_sft_data, mix_counts, select_rows
from relayrl.data.loading import DataError, MalformedRowError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(tag, n):
    return [{"input": f"{tag}{i}=", "output": str(i), "label": str(i)} for i in range(n)]


def test_mix_counts_largest_remainder():
    assert mix_counts([100, 100], [0.25, 0.75], 40) == [10, 30]
    assert mix_counts([30, 10], None, 20) == [15, 5]  # proportional to size
    assert mix_counts([5, 5, 5], [1, 1, 1], 10) == [4, 3, 3]  # 3.33 each; the first remainder wins the tie


def test_mixing_proportions_and_determinism(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 100))
    b = write_jsonl(tmp_path / "b.jsonl", rows_of("b", 100))
    cfg = DataConfig(datasets=[a, b], dataset_probs=[0.25, 0.75], max_samples=40, seed=1)
    train, evals, stats = select_rows(cfg)
    assert Counter(r.data["input"][0] for r in train) == {"a": 10, "b": 30} and evals == []
    assert [s.rows_used for s in stats] == [10, 30] and [s.rows_read for s in stats] == [100, 100]
    assert len({id(r) for r in train}) == 40  # subsets without repeats
    again, _, _ = select_rows(cfg)
    assert [r.data for r in again] == [r.data for r in train]
    other, _, _ = select_rows(DataConfig(datasets=[a, b], dataset_probs=[0.25, 0.75], max_samples=40, seed=2))
    assert [r.data for r in other] != [r.data for r in train]


def test_oversampling_a_small_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 100))
    b = write_jsonl(tmp_path / "b.jsonl", rows_of("b", 10))
    train, _, _ = select_rows(DataConfig(datasets=[a, b], dataset_probs=[0.5, 0.5], max_samples=40))
    per_b = Counter(r.data["input"] for r in train if r.data["input"].startswith("b"))
    assert sum(per_b.values()) == 20 and set(per_b.values()) == {2}  # every b row exactly twice


def test_max_samples_single_source_keeps_file_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 50))
    train, _, _ = select_rows(DataConfig(datasets=[a], max_samples=7))
    lines = [r.row for r in train]
    assert len(lines) == 7 and lines == sorted(lines) and len(set(lines)) == 7
    full, _, _ = select_rows(DataConfig(datasets=[a]))
    assert [r.row for r in full] == list(range(1, 51))


def test_eval_split_is_disjoint_and_seeded(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 50))
    cfg = DataConfig(datasets=[a], eval_split_ratio=0.2, seed=3)
    train, evals, stats = select_rows(cfg)
    t, e = {r.row for r in train}, {r.row for r in evals}
    assert len(e) == 10 and len(t) == 40 and not (t & e) and t | e == set(range(1, 51))
    assert {r.row for r in select_rows(cfg)[1]} == e
    assert [(s.split, s.rows_used) for s in stats] == [("train", 40), ("eval", 10)]


def test_eval_dataset_file(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 8))
    ev = write_jsonl(tmp_path / "ev.jsonl", rows_of("e", 3))
    train, evals, stats = build_sft_data(
        DataConfig(datasets=[a], eval_dataset=ev), _tok(), log=lambda s: None
    )
    assert len(train) == 8 and len(evals) == 3
    assert [(s.source, s.split, s.kept) for s in stats] == [(a, "train", 8), (ev, "eval", 3)]


def _tok():
    from relayrl.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_too_long_rows_are_dropped_counted_and_printed(tmp_path, tiny_tokenizer):
    rows = [
        {"input": "1+1=", "output": "2"},
        {"input": "12345+1=", "output": "12346"},
        {"input": "9=", "output": "9"},
    ]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    logged = []
    # lengths with EOS: "1+1=2" + EOS = 6 tokens; "12345+1=12346" + EOS = 14; "9=9" + EOS = 4
    train, _, stats = build_sft_data(DataConfig(datasets=[a], max_len=6), tiny_tokenizer, log=logged.append)
    assert [len(s) for s in train] == [6, 4]
    assert (stats[0].kept, stats[0].dropped_too_long) == (2, 1)
    assert logged == [f"data[train] {a}: read 3, used 3, kept 2, dropped_too_long 1, skipped_malformed 0"]


def test_nothing_left_to_train_on_is_a_clear_error(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": "12345+1=", "output": "12346"}])
    with pytest.raises(
        DataError, match=r"no training samples left \(data\[train\] .*kept 0, dropped_too_long 1"
    ):
        build_sft_data(DataConfig(datasets=[a], max_len=6), tiny_tokenizer, log=lambda s: None)
    with pytest.raises(DataError, match=r"no training samples left .*data.max_len"):
        build_prompt_data(DataConfig(datasets=[a], max_len=3), tiny_tokenizer, log=lambda s: None)


def test_same_source_twice_is_rejected(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of("a", 3))
    with pytest.raises(ValueError, match=r"lists \[.*a\.jsonl'\] more than once; .*data.dataset_probs"):
        select_rows(DataConfig(datasets=[a, a]))


def test_malformed_row_error_names_file_row_and_key(tmp_path, tiny_tokenizer):
    a = write_jsonl(
        tmp_path / "a.jsonl", [{"input": "1=", "output": "1"}, {"input": "2="}, {"input": "3=", "output": ""}]
    )
    with pytest.raises(MalformedRowError) as e:
        build_sft_data(DataConfig(datasets=[a]), tiny_tokenizer, log=lambda s: None)
    assert str(e.value).startswith(f"{a}, line 2: key 'output': missing (the row has keys ['input'])")
    csv_path = tmp_path / "c.csv"
    csv_path.write_text("input,output\n1=,1\n2=,\n")
    with pytest.raises(MalformedRowError, match=rf"^{csv_path}, row 2: key 'output': empty text"):
        build_sft_data(DataConfig(datasets=[str(csv_path)]), tiny_tokenizer, log=lambda s: None)


def test_skip_malformed_counts_and_logs(tmp_path, tiny_tokenizer):
    a = tmp_path / "a.jsonl"
    a.write_text(
        '{"input": "1=", "output": "1"}\nnot json\n{"input": "2="}\n{"input": 5, "output": "5"}\n'
        '{"input": "3=", "output": "3"}\n'
    )
    logged = []
    cfg = DataConfig(datasets=[str(a)], skip_malformed=True)
    train, _, stats = build_sft_data(cfg, tiny_tokenizer, log=logged.append)
    assert len(train) == 2
    assert (stats[0].rows_read, stats[0].kept, stats[0].skipped_malformed) == (5, 2, 3)
    assert logged[0].startswith(f"data: skipped malformed row: {a}, line 3: key 'output': missing")
    assert logged[1].startswith(
        f"data: skipped malformed row: {a}, line 4: key 'input': expected a string, got int"
    )
    assert logged[-1].endswith("kept 2, dropped_too_long 0, skipped_malformed 3")


def test_prompt_data_for_rl(tmp_path, tiny_tokenizer):
    rows = [{"q": "1+1=", "answer": "2", "src": "math"}, {"q": "hi", "src": ""}, {"q": "2+2=", "answer": "4"}]
    a = write_jsonl(tmp_path / "pr.jsonl", rows)
    cfg = DataConfig(
        datasets=[a], input_key="q", label_key="answer", datasource_key="src", input_template="Q:{}"
    )
    train, evals, _ = build_prompt_data(cfg, tiny_tokenizer, log=lambda s: None)
    assert [s.index for s in train] == [0, 1, 2] and evals == []
    assert [s.prompt for s in train] == ["Q:1+1=", "Q:hi", "Q:2+2="]
    assert train[0].prompt_ids == tiny_tokenizer.convert_tokens_to_ids(list("Q:1+1="))
    assert [s.label for s in train] == ["2", None, "4"]
    assert [s.datasource for s in train] == ["math", "pr", "pr"]  # empty / missing -> the file's stem
    assert train[0].messages is None
