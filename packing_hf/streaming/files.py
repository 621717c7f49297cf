"""Record files, one reader per format, shared by :class:`~packing_hf.streaming.TokenizedStream` and the
``packing-hf`` app (so a file means the same thing whether it is streamed or loaded whole).

Formats (:func:`file_format`):

- JSON Lines (``.jsonl``, ``.ndjson``): one JSON object per line, blank lines ignored; read a line at a
  time, and lines that are not wanted (another rank's, or before a resume point) are not parsed;
- ``.json``: told by its content, not its name: a file whose first line is a whole JSON object (or that is
  empty) is JSON Lines; otherwise it is one JSON value, parsed whole: a list of records, or an object
  holding exactly one list of records (``{"train": [...]}``, ``{"data": [...]}``; on one line, an object
  whose only field is a list of objects is such a wrapper, unless the field is ``messages`` or
  ``conversations``: that is one chat record);
- Parquet (``.parquet``, ``.pq``): read in batches of rows; row groups before the first wanted row are
  not read.

Every record is a JSON object (a dict); each is named for error messages: ``file.jsonl:12`` (line),
``file.json record 3``, ``file.parquet: row 7`` (all counted from 1).

>>> import json, tempfile, os
>>> folder = tempfile.mkdtemp()
>>> path = os.path.join(folder, "data.json")
>>> with open(path, "w") as f:
...     _ = f.write(json.dumps([{"text": "a"}, {"text": "b"}, {"text": "c"}], indent=1))
>>> file_format(path), [where.split(os.sep)[-1] for where, _ in read_record_file(path, first=1)]
('json', ['data.json record 2', 'data.json record 3'])
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any, Literal

__all__ = ["RECORD_FILE_SUFFIXES", "file_format", "read_record_file"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_JSON_SUFFIXES = (".json",)
_PARQUET_SUFFIXES = (".parquet", ".pq")
RECORD_FILE_SUFFIXES = (*_JSONL_SUFFIXES, *_JSON_SUFFIXES, *_PARQUET_SUFFIXES)

FileFormat = Literal["jsonl", "json", "parquet"]


def file_format(path: str | os.PathLike) -> FileFormat:
    """``"jsonl"``, ``"json"`` (one value, parsed whole) or ``"parquet"``: by suffix, and for ``.json`` by
    content (see the module docstring).

    Raises:
        ValueError: for another suffix, naming the ones read.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix in _PARQUET_SUFFIXES:
        return "parquet"
    if suffix in _JSON_SUFFIXES:
        with path.open("rb") as lines:
            first = next((line for line in lines if line.strip()), b"")
        if not first:
            return "jsonl"  # empty: no records, whatever the name says
        try:
            value = json.loads(first)
        except UnicodeDecodeError:
            return "json"  # its reader names the line that is not UTF-8
        except json.JSONDecodeError:
            return "json"  # a value spread over several lines (a pretty-printed list or object)
        return "jsonl" if isinstance(value, dict) and not _is_wrapper(value) else "json"
    raise ValueError(
        f"cannot read {str(path)!r}: expected JSON Lines ({', '.join(_JSONL_SUFFIXES + _JSON_SUFFIXES)}), a "
        f"JSON list (.json) or Parquet ({', '.join(_PARQUET_SUFFIXES)}); convert it to JSON Lines"
    )


def _is_wrapper(value: dict[str, Any]) -> bool:
    """Whether a one-line object wraps the records (``{"train": [{...}, ...]}``) rather than being one.
    ``messages`` / ``conversations`` hold a list of objects too, but they are one chat record."""
    if len(value) != 1:
        return False
    ((key, items),) = value.items()
    return (
        key not in ("messages", "conversations")
        and isinstance(items, list)
        and all(isinstance(item, dict) for item in items)
    )


def read_record_file(
    path: str | os.PathLike, *, first: int = 0, every: int = 1, phase: int = 0, batch_size: int = 1024
) -> Generator[tuple[str, dict[str, Any]], None, int]:
    """``(where, record)`` for the records ``i`` of a file (counted from 0) with ``i >= first`` and
    ``i % every == phase``; returns (as a generator's return value) the number of records in the file.

    Args:
        path: a JSON Lines, JSON or Parquet file (:func:`file_format`).
        first: the first record wanted; earlier JSON lines are not parsed, earlier Parquet row groups not read.
        every, phase: take every ``every``-th record, those with ``i % every == phase`` (a rank's shard).
        batch_size: Parquet rows read at a time.

    Raises:
        ValueError: naming the line or record: malformed JSON, a record that is not a JSON object, a JSON
            file that is not a list of records.
    """
    path = Path(path)
    kind = file_format(path)
    if kind == "jsonl":
        return (yield from _jsonl(path, first, every, phase))
    if kind == "parquet":
        return (yield from _parquet(path, first, every, phase, batch_size))
    records = _json_list(path)
    for index in range(max(first, 0), len(records)):
        if index % every == phase:
            record = records[index]
            where = f"{path} record {index + 1}"
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object per record, got a {type(record).__name__}")
            yield where, record
    return len(records)


def _jsonl(path: Path, first: int, every: int, phase: int):
    index = 0
    with path.open("rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue  # blank lines hold no record (and are not counted as one)
            wanted = index >= first and index % every == phase
            index += 1
            if not wanted:
                continue  # another rank's line, or one before a resume point: not parsed
            try:
                record = json.loads(line)
            except UnicodeDecodeError as error:
                raise _not_utf8(path, line_number, error.start + 1, line[error.start]) from None
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number}: malformed JSON ({_json_problem(error)}); fix or remove the line"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{line_number}: expected a JSON object per line, got a {type(record).__name__}"
                )
            yield f"{path}:{line_number}", record
    return index


def _json_list(path: Path) -> list[Any]:
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        raise _not_utf8(
            path, raw.count(b"\n", 0, error.start) + 1, error.start - line_start + 1, raw[error.start]
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({_json_problem(error)})") from None
    if isinstance(data, dict):
        # {"train": [...], ...} or {"data": [...]}: the usual wrappers around a list of records
        lists = {key: value for key, value in data.items() if isinstance(value, list)}
        if len(lists) != 1:
            raise ValueError(
                f"{path} holds a JSON object with list fields {sorted(lists)}; expected a list of records "
                "(or an object with exactly one list field), or one record per line (JSON Lines)"
            )
        data = next(iter(lists.values()))
    if not isinstance(data, list):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected a list of records")
    return data


def _parquet(path: Path, first: int, every: int, phase: int, batch_size: int):
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    group_start = 0
    for group in range(file.num_row_groups):
        group_stop = group_start + file.metadata.row_group(group).num_rows
        if group_stop <= first:  # the whole row group is before the first wanted row: not read
            group_start = group_stop
            continue
        row0 = group_start
        for table in file.iter_batches(batch_size=max(batch_size, 1024), row_groups=[group]):
            lo = max(row0, first)
            lo += (phase - lo) % every  # the first wanted row in [row0, row0 + rows)
            picks = range(lo - row0, table.num_rows, every)
            if len(picks):
                records = table.take(list(picks)).to_pylist()
                for local, record in zip(picks, records, strict=True):
                    yield f"{path}: row {row0 + local + 1}", record
            row0 += table.num_rows
        group_start = group_stop
    return group_start


def _not_utf8(path: Path, line: int, column: int, byte: int) -> ValueError:
    """The error for a record file that is not UTF-8 text (JSON is read as UTF-8), naming where it stops being."""
    return ValueError(
        f"{path}:{line}: not UTF-8 text (byte 0x{byte:02x}, the line's byte {column}); record files are read as "
        f"UTF-8: convert the file (iconv -f <its encoding, e.g. latin1> -t utf-8 {path.name} > "
        f"{path.stem}.utf8{path.suffix}) or fix the line"
    )


def _json_problem(error: json.JSONDecodeError) -> str:
    """``json``'s message and column; some messages end in "at" already ("Invalid control character at")."""
    return f"{error.msg.removesuffix(' at')} at column {error.colno}"
