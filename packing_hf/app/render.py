"""Rendering for the ``packing-hf`` command line: a checked :class:`~packing_hf.app.records.Record` becomes
text plus the character spans to train on, then ``input_ids`` with ``labels`` (-100 outside the spans);
TRL rows for ``trainer: sft``; a preview of samples as the model sees them.

Tool calls reach the prompt: a chat template that knows ``tool_calls``/``tools`` renders them itself;
for one that does not (SmolLM2's ChatML), the call is written into the assistant turn as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the Hermes/Qwen convention) and the tool
list into the system turn, so the model is trained to emit the call. With ``completion_only_loss=True``
(the default) only assistant turns (tool calls included) are trained: every other token gets label
``-100``.

>>> from types import SimpleNamespace
>>> render_record(Record("x", "text", text="hi"), SimpleNamespace(eos_token="</s>"), "text")
('hi</s>', None)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from .records import Record, RecordSet

__all__ = [
    "chat_messages",
    "format_records",
    "preview_samples",
    "render_record",
    "trl_records",
]

PromptFormat = Literal["auto", "chat", "alpaca", "text"]
_PROMPT_FORMATS = ("auto", "chat", "alpaca", "text")
_ALPACA_HEADER = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
)


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
    >>> from packing_hf.app.records import normalise_record
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
        message.pop("weight", None)  # the loss weight is packing_hf's, not the template's
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


def has_turn_weights(records: Iterable[Record]) -> bool:
    """Whether any record gives an assistant turn a loss ``weight`` (then every sample gets ``loss_weights``).

    >>> has_turn_weights([Record("x", "text", text="hi")])
    False
    """
    return any("weight" in m for record in records for m in record.messages or ())


def _weights_from_spans(
    record: Record, offsets: list[tuple[int, int]], spans: list[tuple[int, int]] | None
) -> list[float]:
    """Per-token loss weights: the ``weight`` of the assistant turn whose span holds the token, else 1."""
    weights = np.ones(len(offsets), dtype=np.float64)
    if spans is None:
        return weights.tolist()
    turn_weights = [m.get("weight", 1.0) for m in record.messages or () if m["role"] == "assistant"]
    if record.alpaca is not None or len(turn_weights) != len(spans):  # alpaca: one span, the last turn
        turn_weights = turn_weights[-len(spans) :]
    starts = np.asarray([start for start, _ in offsets], dtype=np.int64).reshape(-1)
    for (begin, end), weight in zip(spans, turn_weights, strict=True):
        weights[(starts >= begin) & (starts < end)] = weight
    return weights.tolist()


def _encode_records(
    items: Sequence[Record], tokenizer, prompt_format: str, completion_only_loss: bool, weighted: bool = False
) -> dict[str, list[Any]]:
    """One tokenizer call for a batch of records: ``input_ids``, ``labels`` (-100 outside the trained
    spans when ``completion_only_loss``), ``where`` and, when ``weighted``, ``loss_weights`` (each assistant
    turn's ``weight``, 1 elsewhere); ``prompt_format`` is already resolved."""
    texts, spans = format_records(items, tokenizer, prompt_format)
    # Chat templates already spell out their special tokens; adding BOS/EOS again would double them.
    encoded = tokenizer(
        texts,
        add_special_tokens=prompt_format != "chat",
        return_offsets_mapping=completion_only_loss or weighted,
    )
    input_ids = encoded["input_ids"]
    if completion_only_loss:
        labels = [
            _labels_from_spans(ids, offsets, trained)
            for ids, offsets, trained in zip(input_ids, encoded["offset_mapping"], spans, strict=True)
        ]
    else:
        labels = [list(ids) for ids in input_ids]
    out = {"input_ids": input_ids, "labels": labels, "where": [r.where for r in items]}
    if weighted:
        out["loss_weights"] = [
            _weights_from_spans(record, offsets, trained)
            for record, offsets, trained in zip(items, encoded["offset_mapping"], spans, strict=True)
        ]
    return out


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
    if has_turn_weights(items):
        where = next(r.where for r in items if has_turn_weights([r]))
        raise ValueError(
            f"{where}: an assistant turn has a loss weight, which TRL's rows cannot carry; use trainer: trainer"
        )
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
        dataset: :func:`~packing_hf.app.data.tokenize_records`' output (``input_ids``, ``labels``, ``where``).
        tokenizer: the tokenizer that made it.
        count: how many samples (from the first).
        tokens: add the per-token table.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> from packing_hf.app.data import tokenize_records
    >>> from packing_hf.app.records import normalise_record
    >>> ds = tokenize_records([normalise_record({"question": "2+2?", "answer": "4"}, "x:1")], tok, desc=None)
    >>> print(preview_samples(ds, tok, 1).splitlines()[-3:])
    ['<|im_start|>assistant', '«4<|im_end|>', '»']
    """
    blocks = []
    for i, row in enumerate(dataset.select(range(min(count, len(dataset))))):
        ids, labels = row["input_ids"], row["labels"]
        weights = row.get("loss_weights") or [1.0] * len(ids)
        trained = [label != -100 for label in labels]
        # a run: consecutive tokens with the same mask and weight
        run_key = [(t, w if t else None) for t, w in zip(trained, weights, strict=True)]
        parts, start = [], 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or run_key[end] != run_key[start]:
                text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
                if trained[start]:
                    weight = f"[weight {weights[start]:g}]" if weights[start] != 1 else ""
                    text = f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}{weight}"
                parts.append(text)
                start = end
        header = (
            f"--- sample {i + 1} ({row.get('where', '?')}): {len(ids)} tokens, {sum(trained)} trained "
            f"(between {TRAINED_OPEN} and {TRAINED_CLOSE}"
            + (", loss weight other than 1 in [weight w]" if "loss_weights" in row else "")
            + ") ---"
        )
        block = [header, "".join(parts)]
        if tokens:
            block.append(f"{'pos':>5} {'id':>7} {'label':>7} {'weight':>7}  token")
            for position, (token, label, weight) in enumerate(zip(ids, labels, weights, strict=True)):
                shown = tokenizer.convert_ids_to_tokens(token)
                block.append(f"{position:>5} {token:>7} {label:>7} {weight:>7g}  {shown!r}")
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)
