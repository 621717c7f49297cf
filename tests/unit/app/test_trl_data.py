"""The TRL trainers' data files are read by the reader every `packing-hf` data goes through: a bad line is
named by file and line (datasets' JSON builder raised a DatasetGenerationError naming neither)."""

from __future__ import annotations

import json

import pytest

from packing_hf.app.trl_data import load_trl_dataset

PAIR = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}


def test_a_preference_file_is_read_with_its_columns_and_limit(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(PAIR | {"prompt": f"{i}+{i}?"}) + "\n" for i in range(5)))
    rows = load_trl_dataset("dpo", str(path), limit=3)
    assert rows.column_names == ["prompt", "chosen", "rejected"] and len(rows) == 3
    assert rows[2]["prompt"] == "2+2?"


@pytest.mark.parametrize(
    "second, match",
    [
        ('{"prompt": "3+3?", "chosen": "6"\n', r"pairs.jsonl:2: malformed JSON"),
        ("[1, 2]\n", r"pairs.jsonl:2: expected a JSON object per line, got a list"),
        (
            json.dumps(PAIR | {"chosen": [{"role": "assistant", "content": "4"}]}) + "\n",
            r"pairs.jsonl: a column holds values of different types in different records",
        ),
    ],
)
def test_a_bad_record_is_named_by_file_and_line(tmp_path, second, match):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PAIR) + "\n" + second)
    with pytest.raises(ValueError, match=match):
        load_trl_dataset("dpo", str(path))
