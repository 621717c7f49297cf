"""Records for the ``packing-hf`` command line: read a source, tell every record's format, check it and
normalise it into a :class:`Record` (no tokenizer, no model: errors come first and cheap).

Sources:

- ``"embedded"``: a slice of GSM8K (MIT, shipped in ``packing_hf/app/embedded/`` with its license):
  1,000 training rows; ``"embedded:eval"`` is 200 held-out rows of GSM8K's test split;
- a local ``.jsonl``, ``.json`` (JSON Lines or a list of objects, told by content) or ``.parquet`` file,
  read by :func:`packing_hf.streaming.files.read_record_file`, the reader streaming uses too;
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

Rendering and loss masks: :mod:`packing_hf.app.render`; tokenization and the over-long sample policy:
:mod:`packing_hf.app.data`; ``streaming: true``: :mod:`packing_hf.app.record_stream`.

>>> detect_format({"instruction": "Add", "input": "2, 3", "output": "5"})
'instruction'
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..streaming.files import RECORD_FILE_SUFFIXES, read_record_file

__all__ = [
    "EMBEDDED_DATASET",
    "EMBEDDED_EVAL",
    "Record",
    "RecordSet",
    "detect_format",
    "normalise_record",
    "read_records",
]

logger = logging.getLogger(__name__)

EMBEDDED_DATASET = "embedded"
EMBEDDED_EVAL = "embedded:eval"
_EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
_EMBEDDED_FILES = {EMBEDDED_DATASET: "gsm8k_train.jsonl", EMBEDDED_EVAL: "gsm8k_eval.jsonl"}
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


def _turns(
    raw: Any, where: str, column: str, keys: tuple[str, str]
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(name, turn)`` for every turn of a conversation column, refusing what is not a list of objects."""
    if not isinstance(raw, list):
        raise TypeError(f"{where}: {column} must be a list of {{{', '.join(map(repr, keys))}}} objects")
    for i, turn in enumerate(raw):
        name = f"{column}[{i}]"
        if not isinstance(turn, Mapping):
            raise TypeError(f"{where}: {name} must be an object with {' and '.join(keys)}")
        yield name, turn


def _openai_messages(raw: Any, where: str) -> list[dict[str, Any]]:
    messages = []
    for name, turn in _turns(raw, where, "messages", ("role", "content")):
        role = turn.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}: {name}.role is {role!r}; expected one of {', '.join(_ROLES)}")
        calls = turn.get("tool_calls")
        if turn.get("content") is None and not (role == "assistant" and calls):
            # OpenAI leaves out content only on an assistant turn that calls tools; anywhere else a turn with no
            # content is a broken record (a renamed key, a lost field), not an empty answer to skip
            missing = "has no content" if "content" not in turn else "has content null"
            raise ValueError(
                f"{where}: {name} ({role}) {missing}; every message needs its text in `content` (only an "
                "assistant turn with tool_calls may leave it out); fix or remove the record"
            )
        message: dict[str, Any] = {
            "role": role,
            "content": _content(turn.get("content"), where, f"{name}.content"),
        }
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
        if turn.get("weight") is not None:
            message["weight"] = _turn_weight(turn["weight"], role, where, f"{name}.weight")
        messages.append(message)
    return messages


def _turn_weight(value: Any, role: str, where: str, name: str) -> float:
    """An assistant turn's loss weight (OpenAI's per-message ``weight``): a finite number >= 0."""
    if role != "assistant":
        raise ValueError(
            f"{where}: {name} is set on a {role} turn; only assistant turns are trained and weighted"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: {name} = {value!r}; a loss weight must be a finite number >= 0 (0 = not trained)"
        )
    return float(value)


def _sharegpt_messages(raw: Any, where: str) -> list[dict[str, Any]]:
    messages = []
    for name, turn in _turns(raw, where, "conversations", ("from", "value")):
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


# fields of TRL's vision-language format (and common variants): refused by name, never silently dropped
_MEDIA_FIELDS = ("images", "image", "videos", "video", "pixel_values")


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
    media = sorted(key for key in _MEDIA_FIELDS if record.get(key) not in (None, [], ""))
    if media:
        raise ValueError(
            f"{where}: an image+text record (field {', '.join(media)}); packing-hf train reads text records "
            "only and would drop the media. Train image+text data in Python: packing_hf.SFTTrainer with the "
            "model's processor (README, 'Vision-language models'); or remove the field to train on the text"
        )
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


def _iter_source(source: str, split: str, config_name: str | None) -> Iterable[tuple[str, Any]]:
    if source in _EMBEDDED_FILES:
        yield from read_record_file(_EMBEDDED_DIR / _EMBEDDED_FILES[source])
        return
    path = Path(source).expanduser()
    if path.suffix.lower() in RECORD_FILE_SUFFIXES:
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist; check the `dataset` path")
        yield from read_record_file(path)
        return
    if path.exists():
        raise ValueError(f"{path} exists but is not a .jsonl/.json/.parquet file; convert it to JSON Lines")
    for i, row in enumerate(_hub_dataset(source, config_name, split)):
        yield f"{source} record {i + 1}", row


def unread_fields(raw: Mapping[str, Any], record_format: str) -> list[str]:
    """The keys of a raw record that its format does not read (counted and reported, never silently dropped).

    >>> unread_fields({"question": "1+1?", "answer": "2", "source": "web"}, "question")
    ['source']
    """
    required, optional = _FORMATS[record_format]
    return [k for k, v in raw.items() if k not in required and k not in optional and v is not None]


def _hub_dataset(source: str, config_name: str | None, split: str, streaming: bool = False) -> Any:
    """``datasets.load_dataset`` of a Hub name; any failure (offline, missing split, gated, ...) becomes one
    message with the fixes."""
    import datasets

    try:
        return datasets.load_dataset(source, config_name, split=split, streaming=streaming)
    except Exception as error:
        raise ValueError(
            f"could not {'stream' if streaming else 'load'} the Hub dataset {source!r} (config {config_name!r}, "
            f"split {split!r}): {type(error).__name__}: {error}. Use a local .jsonl/.json/.parquet path, "
            "'embedded', or check the name, `dataset_config`, `dataset_split` and your network "
            "(HF_HUB_OFFLINE must be unset)"
        ) from error


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
        result.ignored_fields.update(unread_fields(raw, record.format))
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


def _records_dataset(records: RecordSet | Sequence[Record]):
    import datasets

    items = records.records if isinstance(records, RecordSet) else records
    return datasets.Dataset.from_dict({"record": [r.to_json() for r in items]})
