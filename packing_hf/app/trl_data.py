"""Datasets for the TRL trainers of ``packing-hf train`` (``trainer: dpo | kto | reward | orpo | cpo | grpo | rloo``).

Each trainer reads one of TRL's formats, conversational (lists of ``{"role", "content"}`` messages) or standard
(plain text), which TRL itself renders with the chat template:

- preference (``dpo``, ``reward``, ``orpo``, ``cpo``): ``chosen`` and ``rejected``, with ``prompt`` (explicit) or
  without (implicit: the shared start of the two);
- unpaired preference (``kto``): ``prompt``, ``completion`` and a boolean ``label``;
- prompt-only (``grpo``, ``rloo``): ``prompt``, plus any column the reward functions read (``answer``).

``column_mapping`` renames other column names first (``{your name: trl name}``). ``embedded`` (the 1,000 GSM8K
rows shipped with packing_hf) is turned into each format honestly, without inventing text: the chosen answer
of a question is its reference answer, the rejected one the reference answer of *another* question (the next
row); KTO gets each question once with its own answer (label true) and once with the next row's (label false);
GRPO/RLOO get the questions as prompts and the reference answers as the ``answer`` column for
:func:`packing_hf.app.rewards.gsm8k_answer_match`.

>>> rows = [{"question": "1+1?", "answer": "2\\n#### 2"}, {"question": "2+2?", "answer": "4\\n#### 4"}]
>>> pairs = gsm8k_as("dpo", rows)
>>> pairs[0]["chosen"][0]["content"], pairs[0]["rejected"][0]["content"]
('2\\n#### 2', '4\\n#### 4')
>>> [row["label"] for row in gsm8k_as("kto", rows)]
[True, False, True, False]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .catalogue import PREFERENCE, PROMPT_ONLY, UNPAIRED_PREFERENCE, DataFormat, trainer_entry, trainers_where

__all__ = ["gsm8k_as", "load_trl_dataset", "trl_format"]


def trl_format(trainer: str) -> DataFormat:
    """The TRL format ``trainer`` reads (its catalogue entry's); refused for a trainer reading packing_hf's
    records.

    >>> trl_format("kto").columns
    ('prompt', 'completion', 'label')
    """
    entry = trainer_entry(trainer)
    if not entry.reads_trl_format:
        raise ValueError(
            f"no TRL data format for trainer {trainer!r}; one of {', '.join(trainers_where('reads_trl_format'))}"
        )
    return entry.data


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def gsm8k_as(trainer: str, rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GSM8K ``question``/``answer`` rows in the conversational format of ``trainer`` (see the module doc)."""
    n = len(rows)
    data = trl_format(trainer)
    if n < 2 and data is not PROMPT_ONLY:
        raise ValueError(
            f"trainer: {trainer} builds its rejected answers from other questions' answers: it needs at least 2 "
            f"rows, got {n}; raise num_samples"
        )
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        prompt, answer = _user(row["question"]), row["answer"]
        other = rows[(i + 1) % n]["answer"] if n > 1 else None
        if data is PREFERENCE:
            out.append({"prompt": prompt, "chosen": _assistant(answer), "rejected": _assistant(other)})
        elif data is UNPAIRED_PREFERENCE:
            out.append({"prompt": prompt, "completion": _assistant(answer), "label": True})
            out.append({"prompt": prompt, "completion": _assistant(other), "label": False})
        else:
            out.append({"prompt": prompt, "answer": answer})
    return out


def _read_embedded(name: str, limit: int | None) -> list[dict[str, Any]]:
    from .records import _EMBEDDED_DIR, _EMBEDDED_FILES

    rows = []
    with (_EMBEDDED_DIR / _EMBEDDED_FILES[name]).open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _load(source: str, *, split: str, config_name: str | None, limit: int | None = None):
    import datasets

    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl", ".parquet"):
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        if suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
        return _json_rows(path, limit)
    if path.exists():
        raise ValueError(f"{path}: expected a .json/.jsonl/.parquet file or a Hub dataset name")
    return datasets.load_dataset(source, config_name, split=split)


def _json_rows(path: Path, limit: int | None):
    """A JSON / JSON Lines file read by the reader every ``packing-hf`` data goes through, so a malformed line
    or a record that is not an object is refused with its file and line (``datasets``' JSON builder would raise
    a ``DatasetGenerationError`` without either)."""
    import datasets

    from ..streaming.files import read_record_file

    rows = []
    for _, record in read_record_file(path):
        rows.append(record)
        if limit is not None and len(rows) >= limit:
            break
    try:
        return datasets.Dataset.from_list(rows)
    except (ValueError, TypeError) as error:  # pyarrow's ArrowInvalid / ArrowTypeError
        raise ValueError(
            f"{path}: a column holds values of different types in different records ({error}); give each "
            "column one type (text, or a list of {role, content} messages) in every record"
        ) from None


def load_trl_dataset(
    trainer: str,
    source: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    column_mapping: Mapping[str, str] | None = None,
):
    """The training data of ``trainer`` as a ``datasets.Dataset`` in TRL's format, checked.

    Args:
        trainer: ``dpo``, ``kto``, ``reward``, ``orpo``, ``cpo``, ``grpo`` or ``rloo``.
        source: ``embedded`` (GSM8K, turned into the format: see the module doc), ``embedded:eval``, a
            ``.json`` / ``.jsonl`` / ``.parquet`` file or a Hub dataset name.
        split, config_name: the Hub split and configuration.
        limit: only the first ``limit`` records (``num_samples``).
        column_mapping: ``{column in the data: column TRL reads}``, applied before the check.

    Raises:
        ValueError: a column the format needs is missing (named, with the columns found and the
            ``column_mapping`` that would fix it), or a mapped column is not in the data.

    >>> ds = load_trl_dataset("grpo", "embedded", limit=3)
    >>> ds.column_names, len(ds)
    (['prompt', 'answer'], 3)
    """
    import datasets

    data = trl_format(trainer)
    kind, needed, optional = data.name, data.columns, data.optional
    if source in ("embedded", "embedded:eval"):
        dataset = datasets.Dataset.from_list(gsm8k_as(trainer, _read_embedded(source, limit)))
    else:
        dataset = _load(source, split=split, config_name=config_name, limit=limit)
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
    if column_mapping:
        absent = sorted(set(column_mapping) - set(dataset.column_names))
        if absent:
            raise ValueError(
                f"column_mapping names {absent}, which {source} does not have; its columns: {dataset.column_names}"
            )
        dataset = dataset.rename_columns(dict(column_mapping))
    missing = [name for name in needed if name not in dataset.column_names]
    if missing:
        hint = ", ".join(f"<your column>: {name}" for name in missing)
        raise ValueError(
            f"trainer: {trainer} reads TRL's {kind} format: columns {list(needed)}"
            + (f" (optional: {list(optional)})" if optional else "")
            + f"; {source} lacks {missing} (its columns: {dataset.column_names}). Rename them with "
            f"column_mapping: {{{hint}}}"
        )
    if len(dataset) == 0:
        raise ValueError(f"{source} holds no records")
    return dataset
