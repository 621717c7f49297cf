"""packing_hf.app.data: the embedded dataset, record formats, loss masks and the over-long sample policy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from packing_hf.app.data import detect_format, load_records, prepare_dataset, tokenize_records
from packing_hf.app.demo import make_embedded_dataset


def test_embedded_dataset_is_deterministic_varied_and_correct():
    first, again, other = (
        make_embedded_dataset(300, seed=0),
        make_embedded_dataset(300, seed=0),
        make_embedded_dataset(300, seed=1),
    )
    assert first == again and first != other
    assert len({r["instruction"].split()[0] for r in first}) >= 6  # several task families
    sums = [r for r in first if r["instruction"] == "Add these numbers."]
    assert sums
    for record in sums:  # the answers are computed, so they are right
        assert record["output"].endswith(f"The sum is {sum(int(x) for x in record['input'].split(', '))}.")
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        make_embedded_dataset(0)


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        (["messages", "text"], "messages"),
        (["instruction", "input", "output"], "instruction"),
        (["question", "answer"], "question"),
        (["prompt", "completion"], "prompt"),
        (["text", "id"], "text"),
    ],
)
def test_detect_format(columns, expected):
    assert detect_format(columns) == expected


def test_detect_format_names_the_columns_and_the_fix():
    with pytest.raises(ValueError, match=r"columns \['body', 'title'\].*rename"):
        detect_format(["title", "body"])


def test_chat_labels_cover_exactly_the_assistant_answer(tokenizer):
    records = load_records("embedded", limit=8)
    dataset = tokenize_records(records, tokenizer, desc=None)
    for record, row in zip(records, dataset, strict=True):
        trained = [t for t in row["labels"] if t != -100]
        assert tokenizer.decode(trained) == record["output"] + "<|im_end|>\n"
        assert len(row["labels"]) == len(row["input_ids"])
        kept = np.asarray(row["labels"]) != -100
        assert np.array_equal(np.asarray(row["labels"])[kept], np.asarray(row["input_ids"])[kept])


def test_multi_turn_messages_train_every_assistant_turn(tokenizer):
    import datasets

    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    row = tokenize_records(datasets.Dataset.from_list([{"messages": chat}]), tokenizer, desc=None)[0]
    assert tokenizer.decode([t for t in row["labels"] if t != -100]) == "Hello!<|im_end|>\n4<|im_end|>\n"


def test_alpaca_and_text_formats(tokenizer):
    import datasets

    qa = datasets.Dataset.from_list([{"question": "What is 3+4?", "answer": "7"}])
    row = tokenize_records(qa, tokenizer, prompt_format="alpaca", desc=None)[0]
    assert "### Instruction:\nWhat is 3+4?" in tokenizer.decode(row["input_ids"])
    assert tokenizer.decode([t for t in row["labels"] if t != -100]) == "7" + tokenizer.eos_token
    text = datasets.Dataset.from_list([{"text": "plain words"}])
    row = tokenize_records(text, tokenizer, desc=None)[0]
    assert row["labels"] == row["input_ids"] and tokenizer.decode(row["input_ids"]).endswith(
        tokenizer.eos_token
    )
    with pytest.raises(ValueError, match="needs a 'text' column"):
        tokenize_records(qa, tokenizer, prompt_format="text", desc=None)


def test_completion_only_loss_off_trains_every_token(tokenizer):
    row = tokenize_records(
        load_records("embedded", limit=1), tokenizer, completion_only_loss=False, desc=None
    )[0]
    assert row["labels"] == row["input_ids"]


def test_overflow_policies_count_what_they_do(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": "q" * 5, "answer": "short"},
        {"question": "long " * 200, "answer": "a"},
        {"question": "x", "answer": "y"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError,
        match=r"1 of 3 samples .* longer than max_length=64 .*sample 1 has \d+.*overflow: truncate",
    ):
        prepare_dataset(path, tokenizer, max_length=64)
    truncated = prepare_dataset(path, tokenizer, max_length=64, overflow="truncate")
    assert truncated.num_truncated == 1 and truncated.lengths.max() == 64 and len(truncated.dataset) == 3
    dropped = prepare_dataset(path, tokenizer, max_length=64, overflow="drop")
    assert dropped.num_dropped == 1 and len(dropped.dataset) == 2 and dropped.lengths.max() <= 64
    # the truncated long sample kept only prompt tokens: it has nothing to train on, and that is counted
    assert truncated.num_untrained == 1 and dropped.num_untrained == 0


def test_load_records_local_files_and_errors(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert load_records(array).num_rows == 2
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"train": [{"text": "a"}]}))
    assert load_records(wrapped).num_rows == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_records(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "missing.jsonl")
    assert load_records("embedded", limit=5).num_rows == 5


def test_real_gsm8k_file(data_dir, tokenizer):
    prepared = prepare_dataset(data_dir / "gsm8k_test.jsonl", tokenizer, limit=64, max_length=1024)
    assert prepared.record_format == "question" and prepared.prompt_format == "chat"
    assert len(prepared.dataset) == 64 and prepared.num_untrained == 0
    assert 50 < prepared.lengths.mean() < 600
