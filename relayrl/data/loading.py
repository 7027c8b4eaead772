"""Read rows from a data source: a local file, a folder of files, or a Hugging Face Hub dataset.

    load_source(source, split=, skip_malformed=) -> (list[RawRow], n_unreadable)

Sources, tried in this order:
- a file: .jsonl (one JSON object a line; blank lines skipped), .json (a list of objects, or JSON Lines
  in a .json file), .parquet, .csv (header row; every cell a string; a field holding a comma is quoted, and a
  row with more or fewer fields than the header is malformed); UTF-8, a leading byte-order mark
  (as Excel writes) ignored;
- a folder: every such file directly in it (sorted by name), or a `datasets.save_to_disk` folder;
- anything else that looks like a Hub id (`org/name`, optionally `org/name@config`): `datasets.load_dataset`
  with `split`. Only where online: with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or when the Hub does not
  answer within a few seconds, it fails at once with a clear error (never hangs).

Each row remembers its file and 1-based row number (the line number for .jsonl) so later errors can name
them. A line that is not a JSON object is an error naming file and line, unless `skip_malformed`, in which
case it is counted (`n_unreadable`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from relayrl.data.records import RawRow

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
HUB_TIMEOUT_S = 3.0


class DataError(ValueError):
    """Bad data or a data source that cannot be read; the message names the source/file and how to fix it."""


class MalformedRowError(DataError):
    """One row is unusable (missing key, wrong type, empty text); names file, row and key.

    Skippable with data.skip_malformed."""

    def __init__(self, row: RawRow | None, key: str | None, problem: str, *, where: str | None = None):
        self.where = where or (row.where if row is not None else "?")
        self.key = key
        self.problem = problem
        key_txt = f" key {key!r}:" if key else ""
        super().__init__(
            f"{self.where}:{key_txt} {problem}. Fix the row, or set --data.skip_malformed true to skip "
            "(and count) malformed rows."
        )


def load_source(
    source: str, *, split: str = "train", skip_malformed: bool = False
) -> tuple[list[RawRow], int]:
    """All rows of `source` and the number of unreadable rows skipped (only with `skip_malformed`)."""
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path, source, skip_malformed)
    if path.is_dir():
        if (path / "state.json").exists() and (path / "dataset_info.json").exists():
            return _from_hf_dataset(_load_from_disk(path), source, str(path)), 0  # datasets.save_to_disk
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(FILE_SUFFIXES))
        if not files:
            raise DataError(f"data source {source!r} is a folder without {'/'.join(FILE_SUFFIXES)} files")
        rows: list[RawRow] = []
        bad = 0
        for f in files:
            r, b = _read_file(f, source, skip_malformed)
            rows += r
            bad += b
        return rows, bad
    if source.endswith(FILE_SUFFIXES) or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise DataError(f"data source {source!r} not found (no such file or folder)")
    return _from_hf_dataset(_load_hub(source, split), source, source), 0


def _read_file(path: Path, source: str, skip_malformed: bool) -> tuple[list[RawRow], int]:
    name = path.name
    if name.endswith(".jsonl"):
        return _read_jsonl(path, source, skip_malformed)
    if name.endswith(".json"):
        return _read_json(path, source, skip_malformed)
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return [
            RawRow(data=d, source=source, file=str(path), row=i) for i, d in enumerate(table.to_pylist(), 1)
        ], 0
    if name.endswith(".csv"):
        return _read_csv(path, source, skip_malformed)
    raise DataError(f"{path}: unsupported file type; use one of {', '.join(FILE_SUFFIXES)}")


def _read_csv(path: Path, source: str, skip_malformed: bool) -> tuple[list[RawRow], int]:
    """Rows of a CSV file with a header (Python's csv module: a field holding a comma, quote or line break is
    quoted, `"Hello, dear friend"`). A row with more or fewer fields than the header is malformed (an unquoted
    comma would otherwise shift the text into a field nobody reads), named by file and line."""
    reader = csv.reader(io.StringIO(_utf8(path), newline=""))
    header = next(reader, None)
    if header is None:
        return [], 0
    rows: list[RawRow] = []
    bad = 0
    for i, fields in enumerate(reader, 1):
        if not fields:  # a blank line
            continue
        if len(fields) != len(header):
            problem = (
                f"{len(fields)} fields where the header {header} has {len(header)}; a field holding a comma "
                'must be quoted ("Hello, dear friend")'
            )
            if not skip_malformed:
                raise MalformedRowError(
                    None, None, problem, where=f"{path}, row {i} (line {reader.line_num})"
                )
            bad += 1
            continue
        rows.append(RawRow(data=dict(zip(header, fields, strict=True)), source=source, file=str(path), row=i))
    return rows, bad


def _read_jsonl(path: Path, source: str, skip_malformed: bool) -> tuple[list[RawRow], int]:
    rows: list[RawRow] = []
    bad = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            data: Any = None
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                line, problem = "", f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
            else:
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    problem = (
                        None
                        if isinstance(data, dict)
                        else f"expected a JSON object, got {type(data).__name__}"
                    )
                except json.JSONDecodeError as e:
                    problem = f"invalid JSON ({e.msg} at column {e.colno})"
            if problem is not None:
                if not skip_malformed:
                    raise MalformedRowError(None, None, problem, where=f"{path}, line {lineno}")
                bad += 1
                continue
            rows.append(RawRow(data=data, source=source, file=str(path), row=lineno))
    return rows, bad


def _utf8(path: Path) -> str:
    """The file's text; a file that is not UTF-8 is a DataError naming the file, line and byte."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}, line {line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); re-save the file as UTF-8"
        ) from None


def _read_json(path: Path, source: str, skip_malformed: bool) -> tuple[list[RawRow], int]:
    text = _utf8(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines saved as .json (the Hub does this)
            return _read_jsonl(path, source, skip_malformed)
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of row objects, got a {type(data).__name__}")
    rows: list[RawRow] = []
    bad = 0
    for i, d in enumerate(data, 1):
        if not isinstance(d, dict):
            if not skip_malformed:
                problem = f"expected a JSON object, got {type(d).__name__}"
                raise MalformedRowError(None, None, problem, where=f"{path}, row {i}")
            bad += 1
            continue
        rows.append(RawRow(data=d, source=source, file=str(path), row=i))
    return rows, bad


def _from_hf_dataset(ds: Any, source: str, file: str) -> list[RawRow]:
    return [RawRow(data=dict(d), source=source, file=file, row=i) for i, d in enumerate(ds, 1)]


def _load_from_disk(path: Path) -> Any:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict folder; point at one split's folder, e.g. {path}/train")
    return ds


def hub_offline_reason() -> str | None:
    """Why the Hub cannot be used right now (offline env var or no answer), or None when it answers."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    # DNS lookups ignore socket timeouts, so the probe runs in a daemon thread bounded by HUB_TIMEOUT_S.
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_TIMEOUT_S).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port} is unreachable ({e.__class__.__name__})")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S + 0.5)
    return result[0] if result else f"{host}:{port} did not answer within {HUB_TIMEOUT_S:.0f} s"


def _load_hub(source: str, split: str) -> Any:
    """`datasets.load_dataset` for a Hub id `org/name` or `org/name@config`, only when online."""
    reason = hub_offline_reason()
    if reason is not None:
        raise DataError(
            f"data source {source!r} is not a local file or folder, and the Hugging Face Hub cannot be used "
            f"({reason}). Use a local .jsonl/.json/.parquet/.csv file or folder, or go online."
        )
    import datasets

    repo, _, config = source.partition("@")
    try:
        return datasets.load_dataset(repo, name=config or None, split=split)
    except Exception as e:  # the Hub's many error types -> one clear message naming the source
        raise DataError(f"cannot load Hub dataset {source!r} split {split!r}: {e}") from e
