"""Per-turn loss weights in the app: OpenAI's per-message ``weight`` on assistant turns becomes a per-token
``loss_weights`` column; bad weights are named with the record's file and line; preview shows them."""

from __future__ import annotations

import json

import pytest

from packing_hf.app.data import prepare_dataset, tokenize_records
from packing_hf.app.records import read_records
from packing_hf.app.render import preview_samples, trl_records


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat(answer: str, weight=None, question: str = "What is two plus two?"):
    assistant = {"role": "assistant", "content": answer}
    if weight is not None:
        assistant["weight"] = weight
    return {"messages": [{"role": "user", "content": question}, assistant]}


def test_turn_weights_become_per_token_weights(tmp_path, tokenizer):
    records = read_records(
        _write(tmp_path / "w.jsonl", [_chat("Four, as two and two make four.", 0.5), _chat("Four.")])
    )
    dataset = tokenize_records(records, tokenizer, desc=None)
    assert "loss_weights" in dataset.column_names
    for row, weight in zip(dataset, (0.5, 1.0), strict=True):
        assert len(row["loss_weights"]) == len(row["input_ids"])
        trained = [w for w, label in zip(row["loss_weights"], row["labels"], strict=True) if label != -100]
        assert trained and set(trained) == {weight}
    text = preview_samples(dataset, tokenizer, 2, tokens=True)
    assert "»[weight 0.5]" in text and "[weight 1]" not in text and "label  weight  token" in text
    # no weight anywhere: no column, the stock loss path
    plain = tokenize_records(
        read_records(_write(tmp_path / "p.jsonl", [_chat("Four.")])), tokenizer, desc=None
    )
    assert "loss_weights" not in plain.column_names


def test_truncation_keeps_the_weights_aligned(tmp_path, tokenizer):
    path = _write(tmp_path / "w.jsonl", [_chat("Four. " * 40, 2.0), _chat("Four.", 0.0)])
    prepared = prepare_dataset(path, tokenizer, max_length=48, overflow="truncate", desc=None)
    for row in prepared.dataset:
        assert len(row["loss_weights"]) == len(row["input_ids"]) <= 48


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (-1, r"messages\[1\]\.weight = -1"),
        (float("nan"), r"messages\[1\]\.weight = nan"),
        ("high", r"messages\[1\]\.weight = 'high'"),
    ],
)
def test_bad_weights_name_the_record(weight, message, tmp_path):
    path = _write(tmp_path / "bad.jsonl", [_chat("Four."), _chat("Four.", weight)])
    with pytest.raises(
        ValueError, match=rf"bad\.jsonl:2: {message}; a loss weight must be a finite number >= 0"
    ):
        read_records(path)


def test_weight_on_a_user_turn_is_refused(tmp_path):
    row = {
        "messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "yo"}]
    }
    with pytest.raises(ValueError, match=r"u\.jsonl:1: messages\[0\]\.weight is set on a user turn"):
        read_records(_write(tmp_path / "u.jsonl", [row]))


def test_paths_that_cannot_carry_weights_refuse_them(tmp_path, tokenizer):
    records = read_records(_write(tmp_path / "w.jsonl", [_chat("Four.", 0.5)]))
    with pytest.raises(ValueError, match="w.jsonl:1: an assistant turn has a loss weight.*trainer: trainer"):
        trl_records(records, tokenizer)
