"""Reading rows from every local format, folders, and the offline Hub error."""

from __future__ import annotations

import csv
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data.loading import DataError, MalformedRowError, load_source

ROWS = [{"input": "1+1=", "output": "2"}, {"input": "2+2=", "output": "4"}, {"input": "3+3=", "output": "6"}]


def write_all_formats(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # blank line skipped
    (folder / "b.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), folder / "c.parquet")
    with (folder / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["input", "output"])
        w.writeheader()
        w.writerows(ROWS)
    (folder / "notes.txt").write_text("ignored")
    return folder


@pytest.mark.parametrize("name", ["a.jsonl", "b.json", "c.parquet", "d.csv"])
def test_each_file_format(tmp_path, name):
    folder = write_all_formats(tmp_path / "data")
    rows, bad = load_source(str(folder / name))
    assert [r.data for r in rows] == ROWS and bad == 0
    assert [r.row for r in rows] == [1, 2, 3] and rows[0].file == str(folder / name)
    assert rows[0].source == str(folder / name)


def test_folder_reads_every_supported_file_in_name_order(tmp_path):
    folder = write_all_formats(tmp_path / "data")
    rows, _ = load_source(str(folder))
    assert [r.data for r in rows] == ROWS * 4
    assert [r.file.rsplit("/", 1)[1] for r in rows[::3]] == ["a.jsonl", "b.json", "c.parquet", "d.csv"]
    assert {r.source for r in rows} == {str(folder)}


def test_json_lines_in_a_json_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert [r.data for r in load_source(str(p))[0]] == ROWS


@pytest.mark.parametrize("name", ["a.jsonl", "b.json", "d.csv"])
def test_utf8_byte_order_mark_is_ignored(tmp_path, name):
    folder = write_all_formats(tmp_path / "src")
    path = folder / name
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # Excel / Notepad save with a BOM
    rows, bad = load_source(str(path))
    assert [r.data for r in rows] == ROWS and bad == 0  # the csv header is 'input', not '\ufeffinput'


def test_bad_json_line_names_file_and_line_unless_skipped(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + '{"input": "oops"\n' + "[1, 2]\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(MalformedRowError, match=rf"^{p}, line 2: invalid JSON"):
        load_source(str(p))
    rows, bad = load_source(str(p), skip_malformed=True)
    assert [r.row for r in rows] == [1, 4] and bad == 2


def test_invalid_utf8_names_file_and_line_and_jsonl_rows_can_be_skipped(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(
        (json.dumps(ROWS[0]) + "\n").encode()
        + b'{"input": "\xff\xfe"}\n'
        + (json.dumps(ROWS[1]) + "\n").encode()
    )
    with pytest.raises(MalformedRowError, match=rf"^{p}, line 2: not valid UTF-8 \(byte 0xff at column 12\)"):
        load_source(str(p))
    rows, bad = load_source(str(p), skip_malformed=True)
    assert [r.row for r in rows] == [1, 3] and bad == 1
    for name, body in (("y.json", b'[{"input": "a"},\n {"input": "\xe9"}]'), ("z.csv", b"input\na\n\xe9\n")):
        q = tmp_path / name
        q.write_bytes(body)
        with pytest.raises(
            DataError, match=rf"^{q}, line \d: not valid UTF-8 \(byte 0xe9\); re-save the file as UTF-8"
        ):
            load_source(str(q))


def test_missing_sources_fail_fast(tmp_path):
    with pytest.raises(DataError, match=r"'nope/x.jsonl' not found"):
        load_source("nope/x.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"folder without .jsonl/.json/.parquet/.csv files"):
        load_source(str(tmp_path / "empty"))


def test_hub_id_offline_is_a_clear_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"Hugging Face Hub cannot be used \(HF_HUB_OFFLINE is set\)"):
        load_source("someorg/somedataset")
    # no offline flag, but the endpoint does not answer (a closed local port): still a quick, clear error
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(
        DataError, match=r"'someorg/somedataset' is not a local file or folder.*127.0.0.1:9 is"
    ):
        load_source("someorg/somedataset")
    assert time.monotonic() - start < 5.0


def test_save_to_disk_folder(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert [r.data for r in load_source(str(tmp_path / "ds"))[0]] == ROWS


def test_csv_quoted_commas_and_rows_with_extra_fields(tmp_path):
    # a quoted field keeps its comma; an unquoted one made an extra field and the row silently trained on
    # "Hello": now that row is malformed, named by file and row (and line), skippable and counted
    p = tmp_path / "greet.csv"
    p.write_text(
        'input,output\n"Greet me:","Hello, dear friend"\nSay hi:,"two\nlines"\nGreet me:,Hello, dear friend\n'
    )
    with pytest.raises(MalformedRowError, match=rf"^{p}, row 3 \(line 5\): 3 fields where the header"):
        load_source(str(p))
    rows, bad = load_source(str(p), skip_malformed=True)
    assert bad == 1
    assert [r.data for r in rows] == [
        {"input": "Greet me:", "output": "Hello, dear friend"},
        {"input": "Say hi:", "output": "two\nlines"},
    ]
    assert [r.row for r in rows] == [1, 2]
    # a short row is malformed too (a missing field is not an empty one)
    p.write_text("input,output\nonly one field\n")
    with pytest.raises(MalformedRowError, match=r"row 1 \(line 2\): 1 fields"):
        load_source(str(p))
