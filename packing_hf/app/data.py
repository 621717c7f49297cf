"""Datasets for the ``packing-hf`` command line: read records, check them one by one, render prompts,
tokenize with loss masks.

Sources, one result (a ``datasets.Dataset`` with ``input_ids`` and ``labels``, ready for
:class:`~packing_hf.PaddingFreeCollator`):

- ``"embedded"``: a slice of GSM8K (MIT, shipped in ``packing_hf/app/embedded/`` with its license):
  1,000 training rows; ``"embedded:eval"`` is 200 held-out rows of GSM8K's test split;
- a local ``.json`` (a list of objects), ``.jsonl`` or ``.parquet`` file;
- any other string is a Hugging Face Hub dataset name (needs network, loaded with ``datasets``).

Every record is read as it is, never through a schema inferred from other records, and its format is
told from its own fields (:func:`detect_format`):

=================  ================================================================================
``messages``       OpenAI chat: ``role`` (system/user/assistant/tool), ``content``, ``tool_calls``,
                   ``tool_call_id``/``name`` on tool results; optional record-level ``tools``
``conversations``  ShareGPT / LLaMA-Factory: ``from`` (human/gpt/system/function_call/observation)
                   and ``value``; optional record-level ``system`` and ``tools``
``instruction``    Alpaca: ``instruction``, ``output``, optional ``input``, ``system``, ``history``
``question``       ``question`` / ``answer`` (GSM8K)
``prompt``         ``prompt`` / ``completion``
``text``           plain language modelling, every token trained
=================  ================================================================================

A file holds one format unless ``mixed_formats`` is set; a record that does not fit is an error naming
its file and line, as is a value of the wrong type (a number where text belongs), an empty
instruction or a turn out of order. Records with nothing to learn (an empty answer, or no assistant
turn) are counted, skipped and reported; none left is an error.

Tool calls reach the prompt: a chat template that knows ``tool_calls``/``tools`` renders them itself;
for one that does not (SmolLM2's ChatML), the call is written into the assistant turn as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the Hermes/Qwen convention) and the tool
list into the system turn, so the model is trained to emit the call. With ``completion_only_loss=True``
(the default) only assistant turns (tool calls included) are trained: every other token gets label
``-100``.

With ``streaming: true`` the same records are read, checked, rendered and tokenized as training consumes
them (:class:`RecordStream`, a :class:`~packing_hf.streaming.TokenizedStream` for ``packing_hf.Trainer``).

>>> detect_format({"instruction": "Add", "input": "2, 3", "output": "5"})
'instruction'
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..overflow import check_overflow

__all__ = [
    "EMBEDDED_DATASET",
    "EMBEDDED_EVAL",
    "PreparedDataset",
    "Record",
    "RecordSet",
    "RecordStream",
    "detect_format",
    "format_records",
    "load_records",
    "prepare_dataset",
    "preview_samples",
    "read_records",
    "normalise_record",
    "render_record",
    "tokenize_records",
    "trl_records",
]

logger = logging.getLogger(__name__)

EMBEDDED_DATASET = "embedded"
EMBEDDED_EVAL = "embedded:eval"
_EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
_EMBEDDED_FILES = {EMBEDDED_DATASET: "gsm8k_train.jsonl", EMBEDDED_EVAL: "gsm8k_eval.jsonl"}
PromptFormat = Literal["auto", "chat", "alpaca", "text"]
_PROMPT_FORMATS = ("auto", "chat", "alpaca", "text")
# "split" is the sampler's (pieces are served by its dataset view), not the data preparation's
DATA_OVERFLOWS = ("error", "truncate", "drop")
# a stream tokenizes each batch of records once and hands every record on: it cannot leave one out
STREAM_OVERFLOWS = ("error", "truncate")
_PARQUET_SUFFIXES = (".parquet", ".pq")

# format -> (the field that names it, required fields, optional fields); the first match wins
_FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("tools",)),
    "conversations": (("conversations",), ("system", "tools")),
    "instruction": (("instruction", "output"), ("input", "system", "history")),
    "question": (("question", "answer"), ("system",)),
    "prompt": (("prompt", "completion"), ("system",)),
    "text": (("text",), ()),
}
_ROLES = ("system", "user", "assistant", "tool")
# ShareGPT / LLaMA-Factory speaker names -> chat roles
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",  # its value is the call, as JSON
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}

_ALPACA_HEADER = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
)


# --------------------------------------------------------------------------------------------------
# Records: read, detect, check, normalise
# --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One record after its checks, in a form every renderer takes.

    ``messages`` are ``{"role", "content"}`` dicts (plus ``tool_calls``: ``[{"name", "arguments"}]``
    on assistant turns, ``name``/``tool_call_id`` on tool turns); ``text`` is set instead for plain text.
    ``alpaca`` keeps an Alpaca record's ``(instruction, input)`` apart for the Alpaca prompt.

    >>> Record(where="x.jsonl:1", format="text", text="hi").trainable
    True
    """

    where: str
    format: str
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    text: str | None = None
    alpaca: tuple[str, str] | None = None

    @property
    def skip_reason(self) -> str | None:
        """Why the record has nothing to learn (``"empty answer"``, ``"no assistant turn"``), or None."""
        if self.text is not None:
            return None if self.text.strip() else "empty answer"
        answers = [m for m in self.messages or () if m["role"] == "assistant"]
        if not answers:
            return "no assistant turn"
        if all(not m["content"].strip() and not m.get("tool_calls") for m in answers):
            return "empty answer"
        return None

    @property
    def trainable(self) -> bool:
        return self.skip_reason is None

    def to_json(self) -> str:
        return json.dumps(
            {"where": self.where, "format": self.format, "messages": self.messages, "tools": self.tools,
             "text": self.text, "alpaca": self.alpaca}
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> Record:
        data = json.loads(text)
        alpaca = data.pop("alpaca", None)
        return cls(**data, alpaca=tuple(alpaca) if alpaca is not None else None)


@dataclass
class RecordSet:
    """The checked records of one source, and what was done to them (nothing changes silently).

    >>> RecordSet(source="x", records=[], total=0).skipped
    {}
    """

    source: str
    records: list[Record]
    total: int  # records in the source (before num_samples)
    formats: Counter = field(default_factory=Counter)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> where
    ignored_fields: Counter = field(default_factory=Counter)
    limit: int | None = None
    limit_key: str = "num_samples"

    def describe(self) -> str:
        """One line: how many records, which formats, what was skipped or ignored."""
        used = len(self.records)
        formats = ", ".join(f"{n:,} {name}" for name, n in self.formats.most_common())
        parts = [f"{self.source}: {used:,} records ({formats})"]
        if self.limit is not None and self.limit < self.total:
            parts.append(f"the first {self.limit:,} of {self.total:,} ({self.limit_key})")
        for reason, where in self.skipped.items():
            parts.append(f"{len(where)} skipped ({reason}: {_first(where)})")
        if self.ignored_fields:
            parts.append(
                "fields not used: " + ", ".join(f"{k} ({n})" for k, n in self.ignored_fields.most_common())
            )
        return "; ".join(parts)


def _first(where: Sequence[str], count: int = 3) -> str:
    shown = ", ".join(where[:count])
    return shown + (f" and {len(where) - count} more" if len(where) > count else "")


def detect_format(record: Mapping[str, Any] | Iterable[str]) -> str:
    """Name the format of one record from its own fields (a mapping, or its field names).

    Returns one of ``"messages"``, ``"conversations"``, ``"instruction"``, ``"question"``, ``"prompt"``,
    ``"text"``; fields holding None count as absent.

    >>> detect_format({"question": "2+2?", "answer": "4", "id": 7})
    'question'
    >>> detect_format({"conversations": [{"from": "human", "value": "hi"}]})
    'conversations'
    """
    if isinstance(record, Mapping):
        present = {key for key, value in record.items() if value is not None}
    else:
        present = set(record)
    for name, (required, _) in _FORMATS.items():
        if set(required) <= present:
            return name
    expected = "; ".join("+".join(required) for required, _ in _FORMATS.values())
    raise ValueError(
        f"cannot tell the record format from its fields {sorted(present)}; expected one of: {expected} "
        "(rename the fields to one of these)"
    )


def _string(value: Any, where: str, name: str, *, empty_ok: bool = True) -> str:
    if isinstance(value, bool) or not isinstance(value, str):
        kind = "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
        raise TypeError(
            f'{where}: {name} must be a string, got {kind}; write it as text in the file (e.g. "42")'
        )
    if not empty_ok and not value.strip():
        raise ValueError(f"{where}: {name} is empty; fill it in or remove the record")
    return value


def _content(value: Any, where: str, name: str) -> str:
    """A message's content: a string, None (no text), or OpenAI's list of text parts."""
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError(
                    f"{where}: {name}[{j}] is not a text part ({str(part)[:60]}); only text content can be "
                    "trained here"
                )
            texts.append(_string(part.get("text"), where, f"{name}[{j}].text"))
        return "".join(texts)
    return _string(value, where, name)


def _tool_call(call: Any, where: str, name: str) -> dict[str, Any]:
    """``{"name", "arguments"}`` from OpenAI's ``{"type": "function", "function": {...}}`` or flat form;
    JSON-string arguments are parsed (chat templates expect a mapping)."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: {name} is not valid JSON ({error.msg}): {call[:80]!r}") from None
    if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
        call = call["function"]
    if not isinstance(call, Mapping) or "name" not in call:
        raise ValueError(
            f"{where}: {name} must be a tool call {{'name': ..., 'arguments': {{...}}}}, got {str(call)[:80]}"
        )
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # free-form arguments stay text
    return {"name": _string(call["name"], where, f"{name}.name", empty_ok=False), "arguments": arguments}


def _tools(value: Any, where: str) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: tools is a string but not JSON ({error.msg})") from None
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise TypeError(f"{where}: tools must be a list of tool definitions (JSON objects)")
    return [dict(t) for t in value] or None


def _check_order(messages: list[dict[str, Any]], where: str) -> None:
    """Roles in an order every chat template can render: system first, no two user turns in a row, tool
    results only after an assistant turn that called a tool."""
    if not messages:
        raise ValueError(f"{where}: the conversation has no turns")
    previous = None
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "system" and i != 0:
            raise ValueError(f"{where}: turn {i} is a system turn; only the first turn may be one")
        if role == "user" and previous == "user":
            raise ValueError(
                f"{where}: turns {i - 1} and {i} are both user turns; merge them or add the answer"
            )
        if role == "assistant" and previous == "assistant":
            raise ValueError(f"{where}: turns {i - 1} and {i} are both assistant turns; merge them")
        if role == "tool":
            called = next((m for m in reversed(messages[:i]) if m["role"] != "tool"), None)
            if called is None or called["role"] != "assistant" or not called.get("tool_calls"):
                raise ValueError(
                    f"{where}: turn {i} is a tool result, but no assistant tool call comes before it"
                )
        if role == "assistant" and previous in (None, "system"):
            raise ValueError(f"{where}: turn {i} is an assistant turn before any user turn")
        previous = role


def _openai_messages(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise TypeError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    messages = []
    for i, turn in enumerate(raw):
        name = f"messages[{i}]"
        if not isinstance(turn, Mapping):
            raise TypeError(f"{where}: {name} must be an object with role and content")
        role = turn.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}: {name}.role is {role!r}; expected one of {', '.join(_ROLES)}")
        message: dict[str, Any] = {
            "role": role,
            "content": _content(turn.get("content"), where, f"{name}.content"),
        }
        calls = turn.get("tool_calls")
        if calls:
            if role != "assistant":
                raise ValueError(
                    f"{where}: {name} is a {role} turn with tool_calls; only assistants call tools"
                )
            if not isinstance(calls, list):
                calls = [calls]
            message["tool_calls"] = [
                _tool_call(c, where, f"{name}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if turn.get(key) is not None:
                    message[key] = _string(turn[key], where, f"{name}.{key}")
        messages.append(message)
    return messages


def _sharegpt_messages(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise TypeError(f"{where}: conversations must be a list of {{'from', 'value'}} objects")
    messages = []
    for i, turn in enumerate(raw):
        name = f"conversations[{i}]"
        if not isinstance(turn, Mapping):
            raise TypeError(f"{where}: {name} must be an object with from and value")
        speaker = turn.get("from", turn.get("role"))
        role = _SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise ValueError(
                f"{where}: {name}.from is {speaker!r}; expected one of {', '.join(_SHAREGPT_ROLES)}"
            )
        value = turn.get("value", turn.get("content"))
        if speaker == "function_call":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: {name}.value is not a JSON tool call ({error.msg})") from None
            calls = value if isinstance(value, list) else [value]
            tool_calls = [_tool_call(c, where, f"{name}.value") for c in calls]
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"] = tool_calls  # gpt's words, then its call: one assistant turn
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
            continue
        messages.append({"role": role, "content": _string(value, where, f"{name}.value")})
    return messages


def normalise_record(record: Any, where: str, record_format: str | None = None) -> Record:
    """Check one raw record and turn it into a :class:`Record` (raises with ``where`` in the message).

    Args:
        record: the raw JSON object.
        where: ``"file:line"`` (or ``"source record i"``) for error messages.
        record_format: the expected format (None: detect it from the record).

    >>> normalise_record({"question": "2+2?", "answer": "4"}, "x.jsonl:1").messages[1]
    {'role': 'assistant', 'content': '4'}
    >>> normalise_record({"question": "2+2?", "answer": 4}, "x.jsonl:2")
    Traceback (most recent call last):
    ...
    TypeError: x.jsonl:2: answer must be a string, got int 4; write it as text in the file (e.g. "42")
    """
    if not isinstance(record, Mapping):
        raise TypeError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    try:
        found = detect_format(record)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if record_format is not None and found != record_format:
        raise ValueError(
            f"{where}: a {found!r} record in a file of {record_format!r} records; one format per file "
            "(split the file, or set mixed_formats: true)"
        )
    system = record.get("system")
    system = _string(system, where, "system") if system is not None else ""
    tools = _tools(record.get("tools"), where)
    if found == "text":
        return Record(where, found, text=_string(record["text"], where, "text"))
    alpaca = None
    if found == "messages":
        messages = _openai_messages(record["messages"], where)
    elif found == "conversations":
        messages = _sharegpt_messages(record["conversations"], where)
    else:
        messages = []
        if found == "instruction":
            instruction = _string(record["instruction"], where, "instruction", empty_ok=False)
            extra = record.get("input")
            extra = _string(extra, where, "input") if extra is not None else ""
            for j, pair in enumerate(record.get("history") or ()):
                if not (isinstance(pair, list | tuple) and len(pair) == 2):
                    raise ValueError(f"{where}: history[{j}] must be a [question, answer] pair")
                messages.append({"role": "user", "content": _string(pair[0], where, f"history[{j}][0]")})
                messages.append({"role": "assistant", "content": _string(pair[1], where, f"history[{j}][1]")})
            user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
            answer = _string(record["output"], where, "output")
            alpaca = (instruction, extra) if not messages else None
        else:
            first, second = _FORMATS[found][0]
            user = _string(record[first], where, first, empty_ok=False)
            answer = _string(record[second], where, second)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if system.strip():
        if messages and messages[0]["role"] == "system":
            raise ValueError(f"{where}: both a system field and a system turn; keep one")
        messages.insert(0, {"role": "system", "content": system})
    _check_order(messages, where)
    return Record(where, found, messages=messages, tools=tools, alpaca=alpaca if not system.strip() else None)


def _iter_lines(path: Path) -> Iterable[tuple[str, Any]]:
    """``(where, raw record)`` of a JSON Lines file, one line at a time."""
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{line_number}", json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number} is not valid JSON ({error.msg}); fix that line"
                ) from None


def _iter_parquet(path: Path) -> Iterable[tuple[str, Any]]:
    """``(where, raw record)`` of a Parquet file, read in batches of rows (fields absent from a row are None,
    which :func:`detect_format` treats as absent)."""
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for raw in batch.to_pylist():
            row += 1
            yield f"{path}: row {row}", raw


def _iter_file(path: Path) -> Iterable[tuple[str, Any]]:
    """``(where, raw record)`` of a .json / .jsonl / .parquet file."""
    if path.suffix == ".jsonl":
        yield from _iter_lines(path)
        return
    if path.suffix in _PARQUET_SUFFIXES:
        yield from _iter_parquet(path)
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{error.lineno} is not valid JSON ({error.msg}); for one object per line name the file *.jsonl"
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
    for i, raw in enumerate(data):
        yield f"{path} record {i + 1}", raw


def _iter_source(source: str, split: str, config_name: str | None) -> Iterable[tuple[str, Any]]:
    if source in _EMBEDDED_FILES:
        yield from _iter_file(_EMBEDDED_DIR / _EMBEDDED_FILES[source])
        return
    path = Path(source).expanduser()
    if path.suffix in (".json", ".jsonl", *_PARQUET_SUFFIXES):
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        yield from _iter_file(path)
        return
    if path.exists():
        raise ValueError(f"{path} exists but is not a .json/.jsonl/.parquet file; convert it to JSON Lines")
    import datasets

    try:
        dataset = datasets.load_dataset(source, config_name, split=split)
    except Exception as error:  # offline, missing split, gated, ...: one message with the fixes
        raise ValueError(
            f"could not load the Hub dataset {source!r} (config {config_name!r}, split {split!r}): "
            f"{type(error).__name__}: {error}. Use a local .json/.jsonl path, 'embedded', or check the "
            "name, `dataset_config`, `dataset_split` and your network (HF_HUB_OFFLINE must be unset)"
        ) from error
    for i, row in enumerate(dataset):
        yield f"{source} record {i + 1}", row


def read_records(
    source: str | Path,
    *,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    mixed_formats: bool = False,
    skip_untrainable: bool = True,
) -> RecordSet:
    """Read and check every record of a source (no tokenizer, no model: errors come first and cheap).

    Args:
        source: ``"embedded"`` / ``"embedded:eval"`` (the shipped GSM8K slices), a ``.json``/``.jsonl``
            path, or a Hugging Face Hub dataset name (needs network).
        split, config_name: the split / configuration of a Hub dataset.
        limit: use the first ``limit`` records (reported; None = all).
        mixed_formats: allow records of several formats in one source.
        skip_untrainable: skip (and count) records with nothing to learn: an empty answer, or no
            assistant turn. None left is an error.

    Raises:
        ValueError / TypeError: naming the file and line of the first bad record.

    >>> records = read_records("embedded", limit=4)
    >>> len(records.records), records.total, dict(records.formats)
    (4, 1000, {'question': 4})
    """
    if limit is not None and limit < 1:
        raise ValueError(f"num_samples must be >= 1 or unset, got {limit}")
    source = str(source)
    records: list[Record] = []
    result = RecordSet(source=source, records=records, total=0, limit=limit)
    file_format: tuple[str, str] | None = None
    for where, raw in _iter_source(source, split, config_name):
        result.total += 1
        if limit is not None and result.total > limit:
            continue  # counted, so the report can say "the first N of M"
        record = normalise_record(
            raw, where, None if mixed_formats or file_format is None else file_format[0]
        )
        if file_format is None:
            file_format = (record.format, where)
        result.formats[record.format] += 1
        required, optional = _FORMATS[record.format]
        for key, value in raw.items():
            if key not in required and key not in optional and value is not None:
                result.ignored_fields[key] += 1
        reason = record.skip_reason
        if reason is not None and skip_untrainable:
            result.skipped.setdefault(reason, []).append(where)
            continue
        records.append(record)
    if result.total == 0:
        raise ValueError(f"{source} holds no records")
    if not records:
        reasons = "; ".join(f"{len(w)} with {r} ({_first(w)})" for r, w in result.skipped.items())
        raise ValueError(
            f"nothing to train on in {source}: every record has nothing to learn ({reasons}); every record "
            "needs a non-empty answer / assistant turn"
        )
    for reason, where in result.skipped.items():
        logger.warning(
            "%s: skipped %d of %d records with %s (%s): they would teach nothing%s",
            source,
            len(where),
            len(records) + sum(map(len, result.skipped.values())),
            reason,
            _first(where),
            " but to stop at once" if reason == "empty answer" else "",
        )
    return result


def load_records(
    source: str | Path,
    *,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    mixed_formats: bool = False,
):
    """The checked records of a source as a ``datasets.Dataset`` with one column, ``record`` (each a
    :class:`Record` as JSON: no schema is shared between records, so no field is lost).

    >>> load_records("embedded", limit=3).num_rows
    3
    """
    return _records_dataset(
        read_records(source, split=split, config_name=config_name, limit=limit, mixed_formats=mixed_formats)
    )


def _records_dataset(records: RecordSet | Sequence[Record]):
    import datasets

    items = records.records if isinstance(records, RecordSet) else records
    return datasets.Dataset.from_dict({"record": [r.to_json() for r in items]})


# --------------------------------------------------------------------------------------------------
# Rendering: record -> (text, character spans to train on)
# --------------------------------------------------------------------------------------------------


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", next(iter(template.values()), ""))
    return template or ""


def _call_text(call: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def chat_messages(record: Record, tokenizer) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The record's messages and tools as this tokenizer's chat template will see them.

    A template that renders ``tool_calls`` gets them in OpenAI's form; for one that does not, each call
    is appended to its assistant turn as ``<tool_call>{json}</tool_call>``. Likewise a template that
    ignores ``tools`` finds the tool list, as JSON, in the system turn.

    >>> from types import SimpleNamespace
    >>> r = normalise_record({"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant",
    ...     "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]}]}, "x")
    >>> chat_messages(r, SimpleNamespace(chat_template="{{ message['content'] }}"))[0][1]["content"]
    '<tool_call>\\n{"name": "w", "arguments": {}}\\n</tool_call>'
    """
    template = _template(tokenizer)
    native_calls = "tool_calls" in template
    native_tools = "tools" in template.replace("tool_calls", "")
    messages = []
    for message in record.messages or ():
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            if native_calls:
                message["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            else:
                texts = [message["content"]] if message["content"] else []
                message["content"] = "\n".join(texts + [_call_text(call) for call in calls])
        if not native_calls:
            message.pop("tool_call_id", None)
            message.pop("name", None)
        messages.append(message)
    tools = record.tools
    if tools and not native_tools:
        listing = "You can call these tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        listing += '\nTo call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + listing}
        else:
            messages.insert(0, {"role": "system", "content": listing})
        tools = None
    return messages, tools


def _apply_template(tokenizer, messages, tools, where: str, **kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as error:  # jinja's TemplateError/TypeError: name the record
        raise ValueError(
            f"{where}: the chat template of {getattr(tokenizer, 'name_or_path', 'the tokenizer')!r} cannot "
            f"render this record ({type(error).__name__}: {error})"
        ) from error


def _render_chat(record: Record, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat with the chat template; return the text and the character spans of assistant turns.

    The span of assistant turn ``i`` runs from the end of the prompt rendered up to it (with the
    generation prompt) to the end of the chat rendered through it, so it covers the answer, its tool
    calls and the template's end-of-turn token, which the model must learn to emit.
    """
    messages, tools = chat_messages(record, tokenizer)
    text = _apply_template(tokenizer, messages, tools, record.where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _apply_template(tokenizer, messages[:i], tools, record.where, add_generation_prompt=True)
        through = _apply_template(tokenizer, messages[: i + 1], tools, record.where)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(
                f"{record.where}: the chat template does not render conversations prefix by prefix, so "
                "assistant turns cannot be located; set completion_only_loss: false to train on all tokens"
            )
        spans.append((len(before), len(through)))
    return text, spans


def _render_alpaca(record: Record, eos: str) -> tuple[str, list[tuple[int, int]]]:
    messages = record.messages or []
    if record.alpaca is not None:
        instruction, input_text = record.alpaca
    elif len(messages) == 2 and not messages[1].get("tool_calls"):
        instruction, input_text = messages[0]["content"], ""
    else:
        raise ValueError(
            f"{record.where}: the alpaca prompt format takes one instruction and one answer (no system "
            "turn, history or tool calls); use prompt_format: chat"
        )
    header = _ALPACA_HEADER.format(with_input=", paired with an input" if input_text else "")
    prompt = f"{header}### Instruction:\n{instruction}\n\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n\n"
    prompt += "### Response:\n"
    text = prompt + messages[-1]["content"] + eos
    return text, [(len(prompt), len(text))]


def render_record(record: Record, tokenizer, prompt_format: str) -> tuple[str, list[tuple[int, int]] | None]:
    """``(text, character spans to train on)`` of one record; None spans = train on every token.

    Args:
        record: a checked record (see :func:`read_records`).
        tokenizer: its chat template is used by ``prompt_format="chat"``, its EOS by the others.
        prompt_format: ``"chat"``, ``"alpaca"`` or ``"text"`` (``"auto"`` resolved by the caller).

    >>> from types import SimpleNamespace
    >>> render_record(Record("x", "text", text="hi"), SimpleNamespace(eos_token="</s>"), "text")
    ('hi</s>', None)
    """
    eos = getattr(tokenizer, "eos_token", None) or ""
    if record.text is not None:
        return record.text + eos, None
    if prompt_format == "chat":
        return _render_chat(record, tokenizer)
    if prompt_format == "alpaca":
        return _render_alpaca(record, eos)
    raise ValueError(
        f"{record.where}: prompt_format {prompt_format!r} does not fit {record.format!r} records; use 'chat' "
        "or 'alpaca'"
    )


def format_records(
    records: Sequence[Record], tokenizer, prompt_format: str
) -> tuple[list[str], list[list[tuple[int, int]] | None]]:
    """:func:`render_record` over a batch: the texts and their trained character spans.

    >>> from types import SimpleNamespace
    >>> format_records([Record("x", "text", text="hi")], SimpleNamespace(eos_token="</s>"), "text")
    (['hi</s>'], [None])
    """
    rendered = [render_record(record, tokenizer, prompt_format) for record in records]
    return [text for text, _ in rendered], [spans for _, spans in rendered]


def _resolve_prompt_format(prompt_format: str, formats: Iterable[str], tokenizer) -> str:
    if prompt_format not in _PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {_PROMPT_FORMATS}, got {prompt_format!r}")
    formats = set(formats)
    has_template = bool(_template(tokenizer))
    chats = formats & {"messages", "conversations"}
    if prompt_format == "auto":
        if formats <= {"text"}:
            return "text"
        if has_template:
            return "chat"
        if chats:
            raise ValueError(
                f"{'/'.join(sorted(chats))} records need a chat template, but the tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '')!r} has none; use a chat model's tokenizer"
            )
        return "alpaca"
    if prompt_format == "text" and formats - {"text"}:
        raise ValueError(
            f"prompt_format 'text' needs 'text' records, but the records are {sorted(formats)}; use auto"
        )
    if prompt_format == "chat" and not has_template:
        raise ValueError(
            f"prompt_format: chat, but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
            "template; set prompt_format: alpaca or use a chat model's tokenizer"
        )
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


def _encode_records(
    items: Sequence[Record], tokenizer, prompt_format: str, completion_only_loss: bool
) -> dict[str, list[Any]]:
    """One tokenizer call for a batch of records: ``input_ids``, ``labels`` (-100 outside the trained
    spans when ``completion_only_loss``) and ``where``; ``prompt_format`` is already resolved."""
    texts, spans = format_records(items, tokenizer, prompt_format)
    # Chat templates already spell out their special tokens; adding BOS/EOS again would double them.
    encoded = tokenizer(
        texts, add_special_tokens=prompt_format != "chat", return_offsets_mapping=completion_only_loss
    )
    input_ids = encoded["input_ids"]
    if completion_only_loss:
        labels = [
            _labels_from_spans(ids, offsets, trained)
            for ids, offsets, trained in zip(input_ids, encoded["offset_mapping"], spans, strict=True)
        ]
    else:
        labels = [list(ids) for ids in input_ids]
    return {"input_ids": input_ids, "labels": labels, "where": [r.where for r in items]}


def tokenize_records(
    records,
    tokenizer,
    *,
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    num_proc: int | None = None,
    desc: str | None = "Tokenizing",
):
    """Tokenize checked records into ``input_ids`` / ``labels`` (a batched ``map`` with a progress bar).

    Every record becomes one sample; nothing is truncated here (see :func:`prepare_dataset`).

    Args:
        records: a :class:`RecordSet`, a list of :class:`Record`, or :func:`load_records`' dataset.
        tokenizer: a fast Hugging Face tokenizer (character offsets locate the trained spans).
        prompt_format: ``"auto"`` (chat template when the tokenizer has one, else Alpaca; plain text
            for ``text`` records), ``"chat"``, ``"alpaca"`` or ``"text"``.
        completion_only_loss: train only on answers (assistant turns); prompts get label ``-100``.
        num_proc: worker processes for ``datasets.map`` (None = in process).
        desc: the progress bar's label (None: no bar).

    Returns:
        A ``datasets.Dataset`` with ``input_ids`` (list of int), ``labels`` (list of int, ``-100``
        where not trained) and ``where`` (the record's file and line).

    >>> from transformers import PreTrainedTokenizerFast
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2, "</s>": 3}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Split("</s>", "isolated")
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    >>> ds = tokenize_records([Record("x", "text", text="hi")], tok, desc=None)
    >>> ds[0]["input_ids"], ds[0]["labels"]
    ([1, 3], [1, 3])
    """
    import datasets

    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{type(tokenizer).__name__} is a slow tokenizer; character offsets need a fast one "
            "(AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    if isinstance(records, datasets.Dataset):
        dataset = records
        formats = {Record.from_json(text).format for text in dataset["record"]}
    else:
        dataset = _records_dataset(records)
        items = records.records if isinstance(records, RecordSet) else records
        formats = {record.format for record in items}
    resolved = _resolve_prompt_format(prompt_format, formats, tokenizer)

    def tokenize_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        items = [Record.from_json(text) for text in batch["record"]]
        return _encode_records(items, tokenizer, resolved, completion_only_loss)

    from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    quiet = desc is None and is_progress_bar_enabled()
    if quiet:  # datasets would draw a "Map" bar anyway
        disable_progress_bars()
    try:
        tokenized = dataset.map(
            tokenize_batch, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=desc
        )
    finally:
        if quiet:
            enable_progress_bars()
    tokenized.info.description = resolved  # read back by prepare_dataset
    return tokenized


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
    num_untrained: int = 0  # samples with no trained token left (truncated away): they add no loss
    records: RecordSet | None = None

    @property
    def lengths(self) -> np.ndarray:
        """``(num_samples,)`` int64 token count of every sample."""
        from ..sampler import lengths_from_dataset

        return lengths_from_dataset(self.dataset)


def prepare_dataset(
    source: str | Path | RecordSet,
    tokenizer,
    *,
    max_length: int | None = None,
    overflow: str = "error",
    prompt_format: PromptFormat = "auto",
    completion_only_loss: bool = True,
    split: str = "train",
    config_name: str | None = None,
    limit: int | None = None,
    mixed_formats: bool = False,
    num_proc: int | None = None,
    desc: str | None = "Tokenizing",
) -> PreparedDataset:
    """Read, check, render and tokenize a dataset, then apply the over-long sample policy.

    Args:
        source, split, config_name, limit, mixed_formats: see :func:`read_records`; ``source`` may
            also be a :class:`RecordSet` already read.
        tokenizer, prompt_format, completion_only_loss, num_proc, desc: see :func:`tokenize_records`.
        max_length: the longest sample allowed, in tokens (None = no limit).
        overflow: what to do with longer samples: ``"error"`` (default: raise, naming how many and
            the longest, with its file and line), ``"truncate"`` (keep the first ``max_length``
            tokens) or ``"drop"``; truncations and drops are counted in the result and logged.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> prepared = prepare_dataset("embedded", tok, limit=8, max_length=2048, desc=None)
    >>> prepared.dataset.column_names, prepared.prompt_format, len(prepared.lengths)
    (['input_ids', 'labels', 'where'], 'chat', 8)
    """
    overflow = check_overflow(overflow, "prepare_dataset(overflow=...)", DATA_OVERFLOWS)
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    if isinstance(source, RecordSet):
        records = source
    else:
        records = read_records(
            source, split=split, config_name=config_name, limit=limit, mixed_formats=mixed_formats
        )
    dataset = tokenize_records(
        records,
        tokenizer,
        prompt_format=prompt_format,
        completion_only_loss=completion_only_loss,
        num_proc=num_proc,
        desc=desc,
    )
    formats = records.formats.most_common()
    prepared = PreparedDataset(
        dataset=dataset,
        record_format=formats[0][0] if len(formats) == 1 else "mixed",
        prompt_format=dataset.info.description,
        records=records,
    )
    lengths = prepared.lengths
    if max_length is not None:
        too_long = np.flatnonzero(lengths > max_length)
        if too_long.size:
            longest = int(too_long[np.argmax(lengths[too_long])])
            where = dataset[longest]["where"]
            if overflow == "error":
                raise ValueError(
                    f"{too_long.size} of {len(lengths)} samples of {records.source} are longer than "
                    f"max_length={max_length} tokens (the longest, {where}, has {int(lengths[longest])}); "
                    "raise max_length, or set overflow: truncate or overflow: drop"
                )
            if overflow == "truncate":
                dataset = dataset.map(
                    lambda batch: {
                        key: [ids[:max_length] for ids in batch[key]] for key in ("input_ids", "labels")
                    },
                    batched=True,
                    desc=f"Truncating {too_long.size} samples" if desc else None,
                )
                prepared.num_truncated = int(too_long.size)
            else:
                dataset = dataset.select(np.flatnonzero(lengths <= max_length))
                prepared.num_dropped = int(too_long.size)
            logger.warning(
                "%s %d of %d samples longer than max_length=%d (the longest, %s, had %d tokens)",
                "truncated" if overflow == "truncate" else "dropped",
                too_long.size,
                len(lengths),
                max_length,
                where,
                int(lengths[longest]),
            )
            prepared.dataset = dataset
    if len(prepared.dataset) == 0:
        raise ValueError(
            f"no samples left from {records.source} (all {len(lengths)} were longer than max_length)"
        )
    prepared.num_untrained = _count_untrained(prepared.dataset)
    if prepared.num_untrained == len(prepared.dataset):
        raise ValueError(
            f"nothing to train on in {records.source}: no sample has a trained token left"
            + (" after truncation to max_length; raise max_length" if prepared.num_truncated else "")
        )
    if prepared.num_untrained:
        logger.warning(
            "%d of %d samples have no trained token left (truncated away): they add nothing to the loss",
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


# --------------------------------------------------------------------------------------------------
# Streaming: the same records, checks, prompts and loss masks, read as training consumes them
# --------------------------------------------------------------------------------------------------


def _stream_source(source: str, split: str, config_name: str | None):
    """``(function returning a fresh iterator of (where, raw record), what the data is)`` of a source read
    lazily; files and Hub datasets are opened (and refused) here, before any model loads."""
    path = _EMBEDDED_DIR / _EMBEDDED_FILES[source] if source in _EMBEDDED_FILES else Path(source).expanduser()
    if path.suffix in (".json", ".jsonl", *_PARQUET_SUFFIXES):
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        if path.suffix in _PARQUET_SUFFIXES:
            return (lambda: _iter_parquet(path)), f"{path.name}:{path.stat().st_size}"
        with path.open(encoding="utf-8") as f:
            first = next((line.lstrip()[:1] for line in f if line.strip()), "")
        if first == "[":  # a JSON list is one value: it can only be parsed whole
            raise ValueError(
                f"{path} holds a JSON list, which cannot be streamed (it is parsed whole); write one record per "
                "line (JSON Lines), or set streaming: false"
            )
        return (lambda: _iter_lines(path)), f"{path.name}:{path.stat().st_size}"
    if path.exists():
        raise ValueError(
            f"{path} is not a .json/.jsonl (JSON Lines) or .parquet file, the files streaming: true reads; "
            "convert it to JSON Lines"
        )
    import datasets

    try:
        dataset = datasets.load_dataset(source, config_name, split=split, streaming=True)
    except Exception as error:  # offline, missing split, gated, ...: one message with the fixes
        raise ValueError(
            f"could not stream the Hub dataset {source!r} (config {config_name!r}, split {split!r}): "
            f"{type(error).__name__}: {error}. Use a local .jsonl/.parquet path, 'embedded', or check the "
            "name, `dataset_config`, `dataset_split` and your network (HF_HUB_OFFLINE must be unset)"
        ) from error
    return (lambda: ((f"{source} record {i + 1}", row) for i, row in enumerate(dataset))), (
        f"{source}/{config_name}/{split}"
    )


class RecordStream:
    """The records of a source read, checked, rendered and tokenized as training consumes them
    (``streaming: true``), with the map-style path's per-record checks, prompts and loss masks.

    :attr:`stream` is a :class:`~packing_hf.streaming.TokenizedStream` of ``{"input_ids", "labels"}``
    samples for ``packing_hf.Trainer`` (which packs it online): records are read in order, checked one by
    one (:func:`normalise_record`: errors name the file and line), and ``batch_size`` of them rendered
    (:func:`format_records`) and tokenized in one tokenizer call. Nothing is read up front, hence:

    - a source's format is the format of the first record read; a record of another format stops the
      stream with its file and line, unless ``mixed_formats`` (``prompt_format: auto`` is then resolved
      per batch of records, as :func:`tokenize_records` resolves it for the whole set);
    - records with nothing to learn are skipped and counted as they come (:attr:`skipped`);
    - a sample longer than ``max_length`` stops the stream with its file and line (``overflow="error"``)
      or is truncated and counted (``"truncate"``); ``"drop"`` is not offered: every record read is handed
      on as one sample;
    - ``limit`` takes the first ``limit`` records of the source, in every pass;
    - a pass that reads no record, or none with anything to learn, is an error (training would wait
      forever for a batch).

    Counters (:attr:`records_read`, :attr:`formats`, :attr:`skipped`, :attr:`num_truncated`,
    :attr:`num_untrained`) add up over every pass this process reads.

    Args:
        source: ``"embedded"``, a JSON Lines (``.jsonl``, ``.json`` with one object per line) or Parquet
            path, or a Hub dataset name (``datasets.load_dataset(..., streaming=True)``).
        tokenizer, prompt_format, completion_only_loss: see :func:`tokenize_records`.
        split, config_name, limit, mixed_formats: see :func:`read_records`.
        max_length, overflow: the longest sample and what to do with longer ones (see above).
        batch_size: records rendered and tokenized per tokenizer call.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> records = RecordStream("embedded", tok, limit=3, max_length=2048)
    >>> [len(s["input_ids"]) == len(s["labels"]) for s in records.stream]
    [True, True, True]
    >>> records.describe()
    'embedded (streamed): 3 records read by this process (3 question); the first 3 of the source in every pass (num_samples)'
    """

    def __init__(
        self,
        source: str | Path,
        tokenizer,
        *,
        split: str = "train",
        config_name: str | None = None,
        limit: int | None = None,
        mixed_formats: bool = False,
        max_length: int | None = None,
        overflow: str = "error",
        prompt_format: PromptFormat = "auto",
        completion_only_loss: bool = True,
        batch_size: int = 256,
    ) -> None:
        from ..streaming import TokenizedStream

        self.overflow = check_overflow(overflow, "overflow (with streaming: true)", STREAM_OVERFLOWS)
        if limit is not None and limit < 1:
            raise ValueError(f"num_samples must be >= 1 or unset, got {limit}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"{type(tokenizer).__name__} is a slow tokenizer; character offsets need a fast one "
                "(AutoTokenizer.from_pretrained(..., use_fast=True))"
            )
        if prompt_format not in _PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {_PROMPT_FORMATS}, got {prompt_format!r}")
        self.source = str(source)
        self.tokenizer = tokenizer
        self.limit = limit
        self.mixed_formats = mixed_formats
        self.max_length = max_length
        self.prompt_format = prompt_format
        self.completion_only_loss = completion_only_loss
        self._open, identity = _stream_source(self.source, split, config_name)
        self.records_read = 0
        self.formats: Counter = Counter()
        self.prompt_formats: Counter = Counter()
        self.skipped: dict[str, list[str]] = {}  # reason -> where (every one: the report names the first)
        self.ignored_fields: Counter = Counter()
        self.num_truncated = 0
        self.num_untrained = 0
        self._format: str | None = None
        # the stream's fingerprint (a resumed run must read the same data) names the data, not this object
        self.__qualname__ = f"records({identity}, first {limit})" if limit else f"records({identity})"
        self.stream = TokenizedStream(self, tokenize=self._tokenize, batch_size=batch_size)

    def __call__(self) -> Iterable[dict[str, Record]]:
        """One pass over the source: ``{"record": Record}`` for every checked record with something to learn."""
        read = kept = 0
        skipped_before = {reason: len(where) for reason, where in self.skipped.items()}
        for where, raw in self._open():
            if self.limit is not None and read == self.limit:
                break
            read += 1
            self.records_read += 1
            expected = None if self.mixed_formats else self._format
            record = normalise_record(raw, where, expected)
            self._format = self._format or record.format
            self.formats[record.format] += 1
            required, optional = _FORMATS[record.format]
            for key, value in raw.items():
                if key not in required and key not in optional and value is not None:
                    self.ignored_fields[key] += 1
            reason = record.skip_reason
            if reason is not None:
                if reason not in self.skipped:
                    logger.warning(
                        "%s: skipping %s (%s): it would teach nothing; counted and reported at the end",
                        self.source,
                        where,
                        reason,
                    )
                self.skipped.setdefault(reason, []).append(where)
                continue
            kept += 1
            yield {"record": record}
        if read == 0:
            raise ValueError(f"{self.source} holds no records")
        if kept == 0:
            reasons = "; ".join(
                f"{len(where) - skipped_before.get(reason, 0)} with {reason}"
                for reason, where in self.skipped.items()
            )
            raise ValueError(
                f"nothing to train on in {self.source}: every record has nothing to learn ({reasons}); every "
                "record needs a non-empty answer / assistant turn"
            )

    def _tokenize(self, block: list[dict[str, Record]]) -> dict[str, list[Any]]:
        items = [item["record"] for item in block]
        resolved = _resolve_prompt_format(self.prompt_format, {r.format for r in items}, self.tokenizer)
        self.prompt_formats[resolved] += len(items)
        encoded = _encode_records(items, self.tokenizer, resolved, self.completion_only_loss)
        input_ids, labels = encoded["input_ids"], encoded["labels"]
        limit = self.max_length
        for i, (ids, where) in enumerate(zip(input_ids, encoded["where"], strict=True)):
            if limit is None or len(ids) <= limit:
                continue
            if self.overflow == "error":
                raise ValueError(
                    f"{where}: the sample has {len(ids)} tokens, more than max_length={limit}; raise "
                    "max_length, or set overflow: truncate"
                )
            input_ids[i], labels[i] = ids[:limit], labels[i][:limit]
            self.num_truncated += 1
            if all(label == -100 for label in labels[i]):
                self.num_untrained += 1
        return {"input_ids": input_ids, "labels": labels}

    def trl_dataset(self):
        """The checked records as a ``datasets.IterableDataset`` of TRL rows (see :func:`trl_records`), for
        ``trainer: sft``: TRL renders and tokenizes them as they are read (``prompt_format``,
        ``max_length`` and ``overflow`` of this stream do not apply: TRL's own settings do)."""
        import datasets

        def rows():
            yield from _trl_rows((item["record"] for item in self()), self.tokenizer)

        return datasets.IterableDataset.from_generator(rows)

    def describe(self) -> str:
        """One line: the records read so far, their formats, what was skipped, truncated or ignored."""
        formats = ", ".join(f"{n:,} {name}" for name, n in self.formats.most_common())
        parts = [f"{self.source} (streamed): {self.records_read:,} records read by this process"]
        if formats:
            parts[0] += f" ({formats})"
        if self.limit is not None:
            parts.append(f"the first {self.limit:,} of the source in every pass (num_samples)")
        for reason, where in self.skipped.items():
            parts.append(f"{len(where)} skipped ({reason}: {_first(where)})")
        if self.num_truncated:
            parts.append(f"{self.num_truncated} truncated to max_length={self.max_length}")
        if self.num_untrained:
            parts.append(f"{self.num_untrained} with no trained token left after truncation")
        if self.ignored_fields:
            parts.append(
                "fields not used: " + ", ".join(f"{k} ({n})" for k, n in self.ignored_fields.most_common())
            )
        return "; ".join(parts)


def _trl_rows(items: Iterable[Record], tokenizer) -> Iterable[dict[str, Any]]:
    """Each record as a TRL row (see :func:`trl_records`); one row shape per source."""
    chat = bool(_template(tokenizer))
    plain = type("Plain", (), {"chat_template": ""})()  # renders calls and tools as text
    shape = None
    for record in items:
        if record.text is not None:
            row = {"text": record.text}
        else:
            messages, _ = chat_messages(record, plain)
            single = len(messages) == 2 and messages[0]["role"] == "user"
            if not chat:
                if not single:
                    raise ValueError(
                        f"{record.where}: multi-turn records need a tokenizer with a chat template"
                    )
                row = {"prompt": messages[0]["content"] + "\n", "completion": messages[1]["content"]}
            elif single:
                row = {"prompt": messages[:1], "completion": messages[1:]}
            else:
                row = {"messages": messages}
        if shape is not None and set(row) != shape:
            raise ValueError(
                f"{record.where}: trainer: sft needs one record shape per dataset (single-turn or multi-turn "
                "chats or text, not a mix); use trainer: trainer"
            )
        shape = set(row)
        yield row


def trl_records(records: RecordSet | Sequence[Record], tokenizer):
    """Records in TRL's formats (conversational prompt/completion, messages, or text), for SFTTrainer.

    Tool calls and tool lists are written into the turns' text (as for a template without tool
    support), so every record has the same plain ``{"role", "content"}`` schema.
    """
    import datasets

    items = records.records if isinstance(records, RecordSet) else records
    rows: dict[str, list[Any]] = {}
    for row in _trl_rows(items, tokenizer):
        for key, value in row.items():
            rows.setdefault(key, []).append(value)
    return datasets.Dataset.from_dict(rows)


# --------------------------------------------------------------------------------------------------
# Preview: the samples as the model sees them
# --------------------------------------------------------------------------------------------------

TRAINED_OPEN, TRAINED_CLOSE = "«", "»"


def preview_samples(dataset, tokenizer, count: int, *, tokens: bool = False) -> str:
    """The first ``count`` tokenized samples as the model sees them, trained tokens between « and ».

    Each run of consecutive tokens with the same label mask is decoded on its own (special tokens
    kept), so the text is exactly the token sequence; ``tokens=True`` adds one line per token:
    position, token id, label (``-100`` = not trained) and the token's text.

    Args:
        dataset: :func:`tokenize_records`' output (``input_ids``, ``labels``, ``where``).
        tokenizer: the tokenizer that made it.
        count: how many samples (from the first).
        tokens: add the per-token table.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> ds = tokenize_records([normalise_record({"question": "2+2?", "answer": "4"}, "x:1")], tok, desc=None)
    >>> print(preview_samples(ds, tok, 1).splitlines()[-3:])
    ['<|im_start|>assistant', '«4<|im_end|>', '»']
    """
    blocks = []
    for i, row in enumerate(dataset.select(range(min(count, len(dataset))))):
        ids, labels = row["input_ids"], row["labels"]
        trained = [label != -100 for label in labels]
        parts, start = [], 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or trained[end] != trained[start]:
                text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
                parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained[start] else text)
                start = end
        header = (
            f"--- sample {i + 1} ({row.get('where', '?')}): {len(ids)} tokens, {sum(trained)} trained "
            f"(between {TRAINED_OPEN} and {TRAINED_CLOSE}) ---"
        )
        block = [header, "".join(parts)]
        if tokens:
            block.append(f"{'pos':>5} {'id':>7} {'label':>7}  token")
            for position, (token, label) in enumerate(zip(ids, labels, strict=True)):
                shown = tokenizer.convert_ids_to_tokens(token)
                block.append(f"{position:>5} {token:>7} {label:>7}  {shown!r}")
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)
