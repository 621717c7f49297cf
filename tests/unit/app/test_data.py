"""packing_hf.app.{records,render,data}: per-record formats and checks, tool calls, loss masks, the over-long sample policy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packing_hf.app.data import prepare_dataset, tokenize_records
from packing_hf.app.records import detect_format, normalise_record, read_records
from packing_hf.app.render import preview_samples, trl_records


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t in row["labels"] if t != -100])


def test_embedded_dataset_is_the_shipped_gsm8k_slice_with_its_license():
    from packing_hf.app import records as data

    train, held_out = read_records("embedded"), read_records("embedded:eval")
    assert train.total == 1000 and held_out.total == 200 and dict(train.formats) == {"question": 1000}
    assert (data._EMBEDDED_DIR / "LICENSE.gsm8k").read_text().startswith("MIT License")
    questions = {r.messages[0]["content"] for r in train.records}
    assert not questions & {r.messages[0]["content"] for r in held_out.records}  # held out for real
    assert all("####" in r.messages[1]["content"] for r in train.records)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"messages": [], "text": "x"}, "messages"),
        ({"conversations": []}, "conversations"),
        ({"instruction": "a", "output": "b"}, "instruction"),
        ({"question": "a", "answer": "b"}, "question"),
        ({"prompt": "a", "completion": "b"}, "prompt"),
        ({"text": "a", "id": 1}, "text"),
        ({"instruction": None, "text": "a"}, "text"),  # null fields count as absent
    ],
)
def test_detect_format_per_record(record, expected):
    assert detect_format(record) == expected


def test_detect_format_names_the_fields_and_the_fix():
    with pytest.raises(ValueError, match=r"fields \['body', 'title'\].*rename"):
        detect_format({"title": "t", "body": "b"})


def test_every_field_of_every_record_reaches_the_prompt(tokenizer, tmp_path):
    # the first record has no `input`: later records keep theirs (no schema from the first record)
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "Say hi", "output": "hi"},
            {"instruction": "Translate to English", "input": "bonjour le monde", "output": "hello world"},
        ],
    )
    rows = tokenize_records(read_records(path), tokenizer, desc=None)
    prompt = tokenizer.decode(rows[1]["input_ids"])
    assert "Translate to English\n\nbonjour le monde" in prompt
    assert trained_text(tokenizer, rows[1]) == "hello world<|im_end|>\n"
    assert rows[1]["where"].endswith("a.jsonl:2")


def test_mixed_formats_are_an_error_with_the_line_unless_allowed(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [{"text": "plain words"}, {"instruction": "Add 2 and 3", "output": "5"}],
    )
    with pytest.raises(
        ValueError, match=r"m.jsonl:2: a 'instruction' record in a file of 'text' records.*mixed_formats"
    ):
        read_records(path)
    rows = tokenize_records(read_records(path, mixed_formats=True), tokenizer, desc=None)
    assert "None" not in tokenizer.decode(rows[1]["input_ids"])
    assert trained_text(tokenizer, rows[1]) == "5<|im_end|>\n"


@pytest.mark.parametrize(
    ("row", "error", "match"),
    [
        ({"question": "2+2?", "answer": 4}, TypeError, r"x.jsonl:2: answer must be a string, got int 4"),
        ({"question": "", "answer": "4"}, ValueError, r"x.jsonl:2: question is empty"),
        (
            {"messages": [{"role": "bot", "content": "hi"}]},
            ValueError,
            r"x.jsonl:2: messages\[0\].role is 'bot'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            ValueError,
            r"x.jsonl:2: turns 0 and 1 are both user turns",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "42"}]},
            ValueError,
            r"x.jsonl:2: turn 1 is a tool result, but no assistant tool call comes before it",
        ),
        (
            {"messages": [{"role": "user", "content": ["x"]}]},
            ValueError,
            r"x.jsonl:2: messages\[0\].content\[0\]",
        ),
        (  # a message without content is a broken record, not an empty answer to skip
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant"}]},
            ValueError,
            r"x.jsonl:2: messages\[1\] \(assistant\) has no content; every message needs its text",
        ),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "4"}]},
            ValueError,
            r"x.jsonl:2: messages\[0\] \(user\) has no content",
        ),
        (
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "4"}]},
            ValueError,
            r"x.jsonl:2: messages\[0\] \(user\) has content null",
        ),
        (
            {"conversations": [{"from": "robot", "value": "x"}]},
            ValueError,
            r"conversations\[0\].from is 'robot'",
        ),
        ("[1, 2]", ValueError, r"x.jsonl:2: expected a JSON object per line, got a list"),
    ],
)
def test_values_are_checked_per_record_with_file_and_line(tmp_path, row, error, match):
    path = tmp_path / "x.jsonl"
    write_jsonl(path, [{"question": "fine", "answer": "ok"}, row])
    with pytest.raises(error, match=match):
        read_records(path, mixed_formats=True)


def test_openai_tool_calls_are_trained_and_tool_results_are_not(tokenizer):
    record = {
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        ],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        ],
    }
    row = tokenize_records([normalise_record(record, "t.jsonl:1")], tokenizer, desc=None)[0]
    text, trained = tokenizer.decode(row["input_ids"]), trained_text(tokenizer, row)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in trained  # the model learns to emit the call, not an empty turn
    assert "get_weather" in text.split("<|im_start|>user")[0]  # the tool list reached the system turn
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text and "18 C, sunny" not in trained
    assert trained.endswith("It is 18 C and sunny in Paris.<|im_end|>\n")


def test_a_template_with_tool_support_renders_the_calls_itself(tokenizer):
    from packing_hf.app.render import chat_messages

    record = normalise_record(
        {
            "messages": [
                {"role": "user", "content": "w?"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
            ],
            "tools": [{"name": "w"}],
        },
        "x",
    )
    native = type(
        "T", (), {"chat_template": "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"}
    )()
    messages, tools = chat_messages(record, native)
    assert messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "w", "arguments": {}}}]
    assert tools == [{"name": "w"}]


def test_sharegpt_conversations_with_system_tools_and_function_calls(tokenizer):
    record = {
        "system": "You are terse.",
        "tools": json.dumps([{"name": "add", "parameters": {}}]),
        "conversations": [
            {"from": "human", "value": "Add 2 and 3."},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "5."},
        ],
    }
    row = tokenize_records([normalise_record(record, "s.json record 1")], tokenizer, desc=None)[0]
    text, trained = tokenizer.decode(row["input_ids"]), trained_text(tokenizer, row)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\nYou can call these tools:")
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in trained
    assert "<|im_start|>tool\n5<|im_end|>" in text and trained.endswith("5.<|im_end|>\n")


def test_records_with_nothing_to_learn_are_counted_and_none_left_is_an_error(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "e.jsonl",
        [
            {"question": "a?", "answer": ""},
            {"question": "b?", "answer": "b"},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
        ],
    )
    records = read_records(path, mixed_formats=True)
    assert len(records.records) == 1
    assert records.skipped == {"empty answer": [f"{path}:1"], "no assistant turn": [f"{path}:3"]}
    assert "1 skipped (empty answer" in records.describe() and "skipped 1 of 3" in caplog.text
    empty = write_jsonl(tmp_path / "none.jsonl", [{"question": "a?", "answer": " "}] * 2)
    with pytest.raises(ValueError, match=r"nothing to train on in .*none.jsonl.*2 with empty answer"):
        read_records(empty)


def test_num_samples_is_applied_only_when_set_and_reported(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"text": f"t{i}"} for i in range(5)])
    assert len(read_records(path).records) == 5
    limited = read_records(path, limit=2)
    assert len(limited.records) == 2 and "the first 2 of 5 (num_samples)" in limited.describe()


def test_unused_fields_are_reported(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{"question": "a?", "answer": "b", "id": i} for i in range(3)])
    records = read_records(path)
    assert dict(records.ignored_fields) == {"id": 3} and "fields not used: id (3)" in records.describe()


def test_multi_turn_messages_train_every_assistant_turn(tokenizer):
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    row = tokenize_records([normalise_record({"messages": chat}, "x")], tokenizer, desc=None)[0]
    assert trained_text(tokenizer, row) == "Hello!<|im_end|>\n4<|im_end|>\n"


def test_alpaca_and_text_formats(tokenizer):
    qa = [normalise_record({"question": "What is 3+4?", "answer": "7"}, "x")]
    row = tokenize_records(qa, tokenizer, prompt_format="alpaca", desc=None)[0]
    assert "### Instruction:\nWhat is 3+4?" in tokenizer.decode(row["input_ids"])
    assert trained_text(tokenizer, row) == "7" + tokenizer.eos_token
    multi = [normalise_record({"instruction": "Add\n\nthe numbers", "input": "2, 3", "output": "5"}, "x")]
    text = tokenizer.decode(
        tokenize_records(multi, tokenizer, prompt_format="alpaca", desc=None)[0]["input_ids"]
    )
    assert (
        "### Instruction:\nAdd\n\nthe numbers\n\n### Input:\n2, 3" in text
    )  # blank lines stay in the instruction
    row = tokenize_records([normalise_record({"text": "plain words"}, "x")], tokenizer, desc=None)[0]
    assert row["labels"] == row["input_ids"]
    with pytest.raises(ValueError, match="needs 'text' records"):
        tokenize_records(qa, tokenizer, prompt_format="text", desc=None)


def test_completion_only_loss_off_trains_every_token(tokenizer):
    row = tokenize_records(
        read_records("embedded", limit=1), tokenizer, completion_only_loss=False, desc=None
    )[0]
    assert row["labels"] == row["input_ids"]


def test_chat_labels_cover_exactly_the_answer(tokenizer):
    records = read_records("embedded", limit=6)
    for record, row in zip(records.records, tokenize_records(records, tokenizer, desc=None), strict=True):
        assert trained_text(tokenizer, row) == record.messages[1]["content"] + "<|im_end|>\n"
        kept = np.asarray(row["labels"]) != -100
        assert np.array_equal(np.asarray(row["labels"])[kept], np.asarray(row["input_ids"])[kept])


def test_overflow_policies_count_what_they_do(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"question": "q" * 5, "answer": "short"},
            {"question": "long " * 200, "answer": "a"},
            {"question": "x", "answer": "y"},
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"1 of 3 samples .* longer than max_length=64 .*data.jsonl:2, has \d+.*overflow: truncate",
    ):
        prepare_dataset(path, tokenizer, max_length=64, desc=None)
    truncated = prepare_dataset(path, tokenizer, max_length=64, overflow="truncate", desc=None)
    assert truncated.num_truncated == 1 and truncated.lengths.max() == 64 and len(truncated.dataset) == 3
    dropped = prepare_dataset(path, tokenizer, max_length=64, overflow="drop", desc=None)
    assert dropped.num_dropped == 1 and len(dropped.dataset) == 2 and dropped.lengths.max() <= 64
    # the truncated long sample kept only prompt tokens: it has nothing to train on, and that is counted
    assert truncated.num_untrained == 1 and dropped.num_untrained == 0


def test_local_files_and_errors(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert read_records(array).total == 2
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"train": [{"text": "a"}]}))
    assert read_records(wrapped).total == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', "{oops"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSON"):
        read_records(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "name, content, line, byte",
    [
        ("latin1.jsonl", b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', 3, 14),  # the blank line is counted
        ("latin1.json", b'[{"text": "ok"},\n {"text": "caf\xe9"}]\n', 2, 15),
        ("first.json", b'{"text": "\xff"}\n', 1, 11),  # the line that tells JSON Lines from a JSON list
    ],
    ids=["jsonl", "json", "json-first-line"],
)
def test_a_file_that_is_not_utf8_is_refused_naming_its_line_and_the_fix(tmp_path, name, content, line, byte):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        read_records(path)
    message = str(error.value)
    assert message.startswith(f"{path}:{line}: not UTF-8 text") and f"the line's byte {byte})" in message
    assert f"iconv -f <its encoding, e.g. latin1> -t utf-8 {name}" in message
    # the same file in UTF-8 reads
    path.write_bytes(content.decode("latin1").encode("utf-8"))
    assert read_records(path).total == 2 if line > 1 else read_records(path).total == 1


def test_trl_records_keep_tool_calls_as_text(tokenizer):
    record = normalise_record(
        {
            "messages": [
                {"role": "user", "content": "w?"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "content": "sun"},
                {"role": "assistant", "content": "Sunny."},
            ]
        },
        "x",
    )
    rows = trl_records([record], tokenizer)
    assert '"name": "w"' in rows[0]["messages"][1]["content"]


def test_preview_marks_the_trained_tokens(tokenizer):
    records = read_records("embedded", limit=2)
    text = preview_samples(tokenize_records(records, tokenizer, desc=None), tokenizer, 1, tokens=True)
    answer = records.records[0].messages[1]["content"]
    assert f"«{answer}<|im_end|>\n»" in text and "--- sample 1 (" in text and "gsm8k_train.jsonl:1)" in text
    assert "  -100  " in text  # the per-token table shows the masked prompt tokens


def test_real_gsm8k_file(data_dir, tokenizer):
    prepared = prepare_dataset(data_dir / "gsm8k_test.jsonl", tokenizer, limit=64, max_length=1024, desc=None)
    assert prepared.record_format == "question" and prepared.prompt_format == "chat"
    assert len(prepared.dataset) == 64 and prepared.num_untrained == 0
    assert 50 < prepared.lengths.mean() < 600


def test_a_json_file_is_read_by_its_content_as_streaming_reads_it(tmp_path):
    from packing_hf.streaming import read_stream

    rows = [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    lines = tmp_path / "lines.json"  # JSON Lines under a .json name
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(rows, indent=2))
    for path in (lines, listed):
        assert [r.text for r in read_records(path).records] == ["a", "b", "c"]
        assert [r["text"] for r in read_stream(str(path))] == ["a", "b", "c"]
    assert read_records(lines).records[1].where.endswith("lines.json:2")


def test_an_empty_json_file_holds_no_records_and_is_not_told_to_rename(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no records") as caught:
        read_records(empty)
    assert ".jsonl" not in str(caught.value)
