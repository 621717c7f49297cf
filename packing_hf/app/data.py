"""Datasets for the ``packing-hf`` command line: load records, format prompts, tokenize with loss masks.

Three sources, one result (a ``datasets.Dataset`` with ``input_ids`` and ``labels``, ready for
:class:`~packing_hf.PaddingFreeCollator`):

- ``"embedded"``: a small instruction dataset generated deterministically by :mod:`packing_hf.app.demo` (arithmetic,
  sorting, counting, unit conversion, ...), so the demo runs offline with nothing downloaded;
- a local ``.json`` (a list of objects) or ``.jsonl`` file;
- any other string is a Hugging Face Hub dataset name (needs network, loaded with ``datasets``).

Record formats are detected from the columns: ``messages`` (a chat, rendered with the tokenizer's chat
template), ``instruction``/``input``/``output`` (Alpaca), ``question``/``answer`` (GSM8K-style),
``prompt``/``completion``, or ``text`` (plain language modelling). With ``completion_only_loss=True``
(the default) only the answer tokens are trained: prompt tokens get label ``-100``.

>>> detect_format(["instruction", "input", "output"])
'instruction'
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..overflow import check_overflow

__all__ = [
    "EMBEDDED_DATASET",
    "PreparedDataset",
    "detect_format",
    "format_records",
    "load_records",
    "prepare_dataset",
    "tokenize_records",
]

logger = logging.getLogger(__name__)

EMBEDDED_DATASET = "embedded"
PromptFormat = Literal["auto", "chat", "alpaca", "text"]
_PROMPT_FORMATS = ("auto", "chat", "alpaca", "text")
# "split" is the sampler's (pieces are served by its dataset view), not the data preparation's
DATA_OVERFLOWS = ("error", "truncate", "drop")

# column set -> record format; the first match wins, so a chat column beats stray text columns
_FORMATS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("messages", ("messages",)),
    ("instruction", ("instruction", "output")),
    ("question", ("question", "answer")),
    ("prompt", ("prompt", "completion")),
    ("text", ("text",)),
)

_ALPACA_HEADER = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _read_json_records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number} is not valid JSON ({error.msg}); fix that line"
                ) from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}); for one object per line "
            "name the file *.jsonl"
        ) from None
    if isinstance(data, dict):
        # {"train": [...], ...} or {"data": [...]}: the usual wrappers around a list of records
        lists = {key: value for key, value in data.items() if isinstance(value, list)}
        if len(lists) != 1:
            raise ValueError(
                f"{path} holds a JSON object with list fields {sorted(lists)}; expected a list of records "
                "(or an object with exactly one list field)"
            )
        data = next(iter(lists.values()))
    if not isinstance(data, list):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected a list of records")
    return data


def load_records(
    source: str | Path,
    *,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    seed: int = 0,
):
    """Load a dataset as a ``datasets.Dataset`` of raw records (not tokenized yet).

    Args:
        source: ``"embedded"`` (generated offline, see :func:`make_embedded_dataset`), a path to a
            ``.json``/``.jsonl`` file, or a Hugging Face Hub dataset name (needs network).
        split: the split of a Hub dataset (ignored for local files).
        config_name: the configuration of a Hub dataset, e.g. ``"main"`` for ``openai/gsm8k``.
        limit: keep the first ``limit`` records (the embedded dataset generates exactly that many;
            default 1000 there).
        seed: seed of the embedded dataset.

    >>> load_records("embedded", limit=4).num_rows
    4
    """
    import datasets

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    if str(source) == EMBEDDED_DATASET:
        from .demo import make_embedded_dataset

        return datasets.Dataset.from_list(make_embedded_dataset(limit or 1000, seed=seed))
    path = Path(source).expanduser()
    if path.suffix in (".json", ".jsonl"):
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        records = _read_json_records(path)
        if limit is not None:
            records = records[:limit]
        if not records:
            raise ValueError(f"{path} holds no records")
        return datasets.Dataset.from_list(records)
    if path.exists():
        raise ValueError(f"{path} exists but is not a .json/.jsonl file; convert it to JSON Lines")
    try:
        dataset = datasets.load_dataset(str(source), config_name, split=split)
    except Exception as error:  # offline, missing split, gated, ...: one message with the fixes
        raise ValueError(
            f"could not load the Hub dataset {str(source)!r} (config {config_name!r}, split {split!r}): "
            f"{type(error).__name__}: {error}. Use a local .json/.jsonl path, 'embedded', or check the "
            "name, `dataset_config`, `dataset_split` and your network (HF_HUB_OFFLINE must be unset)"
        ) from error
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset


# --------------------------------------------------------------------------------------------------
# Formatting: record -> (text, character spans to train on)
# --------------------------------------------------------------------------------------------------


def detect_format(column_names: Sequence[str]) -> str:
    """Name the record format of a dataset from its columns.

    Returns one of ``"messages"``, ``"instruction"``, ``"question"``, ``"prompt"``, ``"text"``.

    >>> detect_format(["question", "answer"])
    'question'
    """
    columns = set(column_names)
    for name, required in _FORMATS:
        if set(required) <= columns:
            return name
    expected = "; ".join("+".join(required) for _, required in _FORMATS)
    raise ValueError(
        f"cannot tell the record format from the columns {sorted(columns)}; expected one of: {expected} "
        "(rename your columns to one of these)"
    )


def _as_messages(record: dict[str, Any], record_format: str) -> list[dict[str, str]]:
    if record_format == "messages":
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if record_format == "instruction":
        user = record["instruction"]
        if record.get("input"):
            user = f"{user}\n\n{record['input']}"
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    if record_format == "question":
        return [
            {"role": "user", "content": record["question"]},
            {"role": "assistant", "content": record["answer"]},
        ]
    return [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]


def _render_chat(messages: list[dict[str, str]], tokenizer, index: int) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat with the chat template; return the text and the character spans of assistant turns.

    The span of assistant turn ``i`` runs from the end of the prompt rendered up to it (with the
    generation prompt) to the end of the chat rendered through it, so it covers the answer and the
    template's end-of-turn token, which the model must learn to emit.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if i
            else ""
        )
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(
                f"record {index}: the chat template does not render conversations prefix by prefix, so "
                "assistant turns cannot be located; set completion_only_loss: false to train on all tokens"
            )
        spans.append((len(before), len(through)))
    return text, spans


def _render_alpaca(messages: list[dict[str, str]], eos: str) -> tuple[str, list[tuple[int, int]]]:
    if len(messages) != 2 or messages[0]["role"] != "user" or messages[1]["role"] != "assistant":
        raise ValueError(
            "the alpaca prompt format takes one user turn and one answer; use prompt_format: chat"
        )
    user = messages[0]["content"]
    instruction, _, input_text = user.partition("\n\n")
    header = _ALPACA_HEADER.format(with_input=", paired with an input" if input_text else "")
    prompt = f"{header}### Instruction:\n{instruction}\n\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n\n"
    prompt += "### Response:\n"
    text = prompt + messages[1]["content"] + eos
    return text, [(len(prompt), len(text))]


def format_records(
    records: dict[str, list[Any]], tokenizer, record_format: str, prompt_format: str, first_index: int = 0
) -> tuple[list[str], list[list[tuple[int, int]] | None]]:
    """Turn a batch of records (column -> values) into texts and the character spans to train on.

    ``None`` spans mean "train on every token" (plain text).

    Args:
        records: a batch as ``datasets`` passes it to a batched ``map``.
        tokenizer: a Hugging Face tokenizer (its chat template is used by ``prompt_format="chat"``).
        record_format: from :func:`detect_format`.
        prompt_format: ``"chat"``, ``"alpaca"`` or ``"text"`` (``"auto"`` resolved by the caller).
        first_index: index of the batch's first record, for error messages.

    >>> from types import SimpleNamespace
    >>> texts, spans = format_records({"text": ["hi"]}, SimpleNamespace(eos_token="</s>"), "text", "text")
    >>> texts, spans
    (['hi</s>'], [None])
    """
    eos = tokenizer.eos_token or ""
    size = len(next(iter(records.values())))
    texts: list[str] = []
    spans: list[list[tuple[int, int]] | None] = []
    for j in range(size):
        record = {key: values[j] for key, values in records.items()}
        if record_format == "text":
            texts.append(str(record["text"]) + eos)
            spans.append(None)
            continue
        messages = _as_messages(record, record_format)
        if prompt_format == "chat":
            text, trained = _render_chat(messages, tokenizer, first_index + j)
        elif prompt_format == "alpaca":
            text, trained = _render_alpaca(messages, eos)
        else:
            raise ValueError(
                f"prompt_format {prompt_format!r} does not fit {record_format!r} records; use 'chat' or 'alpaca'"
            )
        texts.append(text)
        spans.append(trained)
    return texts, spans


def _resolve_prompt_format(prompt_format: str, record_format: str, tokenizer) -> str:
    if prompt_format not in _PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {_PROMPT_FORMATS}, got {prompt_format!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "auto":
        if record_format == "text":
            return "text"
        if record_format == "messages" or has_template:
            return "chat" if has_template else "missing-template"
        return "alpaca"
    if prompt_format == "text" and record_format != "text":
        raise ValueError(f"prompt_format 'text' needs a 'text' column, but the records are {record_format!r}")
    if prompt_format == "chat" and not has_template:
        return "missing-template"
    return prompt_format


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def _labels_from_spans(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]] | None
) -> list[int]:
    ids = np.asarray(input_ids, dtype=np.int64)
    if spans is None:  # plain text: every token is trained
        return ids.tolist()
    starts = np.asarray([start for start, _ in offsets], dtype=np.int64).reshape(-1)
    trained = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        trained |= (starts >= begin) & (starts < end)
    return np.where(trained, ids, -100).tolist()


def tokenize_records(
    dataset,
    tokenizer,
    *,
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    num_proc: int | None = None,
    desc: str = "Tokenizing",
):
    """Tokenize raw records into ``input_ids`` / ``labels`` columns (a batched ``map`` with a progress bar).

    Every record becomes one sample; nothing is truncated here (see :func:`prepare_dataset`).

    Args:
        dataset: a ``datasets.Dataset`` of records in one of the formats of :func:`detect_format`.
        tokenizer: a fast Hugging Face tokenizer (character offsets locate the trained spans).
        prompt_format: ``"auto"`` (chat template when the tokenizer has one, else Alpaca; plain text
            for ``text`` records), ``"chat"``, ``"alpaca"`` or ``"text"``.
        completion_only_loss: train only on answers (assistant turns); prompts get label ``-100``.
        num_proc: worker processes for ``datasets.map`` (None = in process).
        desc: the progress bar's label.

    Returns:
        The dataset with columns ``input_ids`` (list of int) and ``labels`` (list of int, ``-100`` where
        not trained), the record columns removed.

    >>> import datasets
    >>> from transformers import PreTrainedTokenizerFast
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2, "</s>": 3}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Split("</s>", "isolated")
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    >>> ds = tokenize_records(datasets.Dataset.from_list([{"text": "hi"}]), tok, desc=None)
    >>> ds[0]["input_ids"], ds[0]["labels"]
    ([1, 3], [1, 3])
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{type(tokenizer).__name__} is a slow tokenizer; character offsets need a fast one "
            "(AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    record_format = detect_format(dataset.column_names)
    resolved = _resolve_prompt_format(prompt_format, record_format, tokenizer)
    if resolved == "missing-template":
        raise ValueError(
            f"{record_format!r} records need a chat template, but the tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} has none; set prompt_format: alpaca or use a chat model"
        )
    # Chat templates already spell out their special tokens; adding BOS/EOS again would double them.
    add_special_tokens = resolved != "chat"

    def tokenize_batch(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[list[int]]]:
        texts, spans = format_records(batch, tokenizer, record_format, resolved, indices[0] if indices else 0)
        encoded = tokenizer(
            texts, add_special_tokens=add_special_tokens, return_offsets_mapping=completion_only_loss
        )
        input_ids = encoded["input_ids"]
        if not completion_only_loss:
            return {"input_ids": input_ids, "labels": [list(ids) for ids in input_ids]}
        labels = [
            _labels_from_spans(ids, offsets, trained)
            for ids, offsets, trained in zip(input_ids, encoded["offset_mapping"], spans, strict=True)
        ]
        return {"input_ids": input_ids, "labels": labels}

    return dataset.map(
        tokenize_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=desc,
    )


@dataclass
class PreparedDataset:
    """A tokenized dataset plus what was done to it (so nothing changes silently).

    >>> PreparedDataset(dataset=None, record_format="text", prompt_format="text").num_truncated
    0
    """

    dataset: Any  # datasets.Dataset with input_ids / labels
    record_format: str
    prompt_format: str
    num_truncated: int = 0
    num_dropped: int = 0
    num_untrained: int = 0  # samples with no trained token (e.g. an empty answer): they add no loss

    @property
    def lengths(self) -> np.ndarray:
        """``(num_samples,)`` int64 token count of every sample."""
        from ..sampler import lengths_from_dataset

        return lengths_from_dataset(self.dataset)


def prepare_dataset(
    source: str | Path | Any,
    tokenizer,
    *,
    max_length: int | None = None,
    overflow: str = "error",
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    num_proc: int | None = None,
) -> PreparedDataset:
    """Load, format and tokenize a dataset, then apply the over-long sample policy.

    Args:
        source, split, config_name, limit, seed: see :func:`load_records`; ``source`` may also be
            records already loaded as a ``datasets.Dataset``.
        tokenizer, prompt_format, completion_only_loss, num_proc: see :func:`tokenize_records`.
        max_length: the longest sample allowed, in tokens (None = no limit).
        overflow: what to do with longer samples: ``"error"`` (default: raise, naming how many and
            the longest), ``"truncate"`` (keep the first ``max_length`` tokens) or ``"drop"``;
            truncations and drops are counted in the result and logged.

    >>> from transformers import PreTrainedTokenizerFast
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> backend = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    >>> prepared = prepare_dataset("embedded", tok, limit=8, max_length=2048)
    >>> prepared.dataset.column_names, prepared.prompt_format, len(prepared.lengths)
    (['input_ids', 'labels'], 'alpaca', 8)
    """
    overflow = check_overflow(overflow, "prepare_dataset(overflow=...)", DATA_OVERFLOWS)
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    if isinstance(source, str | Path):
        records = load_records(source, split=split, config_name=config_name, limit=limit, seed=seed)
    else:  # records already loaded (a datasets.Dataset)
        records, source = source, "the dataset"
    record_format = detect_format(records.column_names)
    resolved = _resolve_prompt_format(prompt_format, record_format, tokenizer)
    dataset = tokenize_records(
        records,
        tokenizer,
        prompt_format=prompt_format,
        completion_only_loss=completion_only_loss,
        num_proc=num_proc,
    )
    prepared = PreparedDataset(dataset=dataset, record_format=record_format, prompt_format=resolved)
    lengths = prepared.lengths
    if max_length is not None:
        too_long = np.flatnonzero(lengths > max_length)
        if too_long.size:
            longest = int(too_long[np.argmax(lengths[too_long])])
            if overflow == "error":
                raise ValueError(
                    f"{too_long.size} of {len(lengths)} samples of {source} are longer than max_length="
                    f"{max_length} tokens (sample {longest} has {int(lengths[longest])}); raise max_length, "
                    "or set overflow: truncate or overflow: drop"
                )
            if overflow == "truncate":
                dataset = dataset.map(
                    lambda batch: {
                        key: [ids[:max_length] for ids in batch[key]] for key in ("input_ids", "labels")
                    },
                    batched=True,
                    desc=f"Truncating {too_long.size} samples",
                )
                prepared.num_truncated = int(too_long.size)
            else:
                dataset = dataset.select(np.flatnonzero(lengths <= max_length))
                prepared.num_dropped = int(too_long.size)
            logger.warning(
                "%s %d of %d samples longer than max_length=%d (the longest had %d tokens)",
                "truncated" if overflow == "truncate" else "dropped",
                too_long.size,
                len(lengths),
                max_length,
                int(lengths[longest]),
            )
            prepared.dataset = dataset
    if len(prepared.dataset) == 0:
        raise ValueError(f"no samples left from {source} (all {len(lengths)} were longer than max_length)")
    prepared.num_untrained = _count_untrained(prepared.dataset)
    if prepared.num_untrained:
        logger.warning(
            "%d of %d samples have no trained token (an empty answer, or one truncated away): they add "
            "nothing to the loss",
            prepared.num_untrained,
            len(prepared.dataset),
        )
    return prepared


def _count_untrained(dataset) -> int:
    """How many samples have no label other than -100 (they contribute nothing to the loss)."""
    import pyarrow.compute as pc

    labels = dataset.with_format("arrow")[:].column("labels").combine_chunks()
    per_sample_tokens = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    trained = (labels.flatten().to_numpy(zero_copy_only=False) != -100).astype(np.int64)
    cumulative = np.concatenate([[0], np.cumsum(trained)])
    ends = np.cumsum(per_sample_tokens)
    per_sample_trained = cumulative[ends] - cumulative[ends - per_sample_tokens]
    return int(np.count_nonzero(per_sample_trained == 0))


def trl_records(dataset, tokenizer):
    """Records in TRL's formats (conversational prompt/completion, messages, or text), for SFTTrainer."""
    record_format = detect_format(dataset.column_names)
    chat = bool(getattr(tokenizer, "chat_template", None))

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        if record_format == "messages":
            return {"messages": row["messages"]}
        if record_format == "text":
            return {"text": row["text"]}
        if record_format == "instruction":
            prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
            completion = row["output"]
        elif record_format == "question":
            prompt, completion = row["question"], row["answer"]
        else:
            prompt, completion = row["prompt"], row["completion"]
        if chat:
            return {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": completion}],
            }
        return {"prompt": prompt + "\n", "completion": completion}

    return dataset.map(convert, remove_columns=dataset.column_names, desc="Formatting for TRL")
