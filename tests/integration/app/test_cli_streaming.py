"""``packing-hf train ... streaming: true``: records read, checked and tokenized as training consumes them.

The command line runs in process with the tiny model of ``configs/tiny_cpu.yaml``; the data is a JSON Lines
file written by each test. What is asserted: the steps run, every batch within the token budget, the
messages the user reads, the refusals (before any model loads), a bad record in the middle of the stream
stopping the run with its file and line, and samples identical to the map-style path's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from packing_hf import PaddingFreeCollator
from packing_hf.app.cli import main
from packing_hf.app.data import prepare_dataset
from packing_hf.app.record_stream import RecordStream

ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
BUDGET = 512

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def tok(data_dir) -> str:
    return str(data_dir / "smollm2_tokenizer")


def train(tok: str, tmp_path: Path, data: str, *overrides: str) -> int:
    return main(
        [
            "train",
            TINY_CONFIG,
            f"tokenizer_name_or_path={tok}",
            f"dataset={data}",
            "streaming=true",
            "max_steps=3",
            f"max_tokens_per_batch={BUDGET}",
            f"max_length={BUDGET}",
            "num_samples=null",
            *([] if "trainer=sft" in overrides else ["baseline_batches=0"]),  # trainer: sft times none
            "save_model=false",
            "save_strategy=no",  # the config's checkpoint only where a test asks for one
            f"output_dir={tmp_path / 'out'}",
            "disable_tqdm=true",
            *overrides,
        ]
    )


@pytest.fixture
def batch_widths(monkeypatch) -> list[int]:
    """The width (tokens) of every packed row the collator builds during the run."""
    widths: list[int] = []
    collate = PaddingFreeCollator.__call__

    def recording(self, features, *args, **kwargs):
        batch = collate(self, features, *args, **kwargs)
        widths.append(int(batch["input_ids"].shape[1]))
        return batch

    monkeypatch.setattr(PaddingFreeCollator, "__call__", recording)
    return widths


def test_streaming_trains_max_steps_in_batches_within_the_budget(
    tmp_path, tok, gsm8k_rows, batch_widths, capsys, monkeypatch
):
    checkpointed = []  # the README's streaming command turns activation checkpointing on
    enable = PreTrainedModel.activation_checkpointing_enable
    monkeypatch.setattr(
        PreTrainedModel,
        "activation_checkpointing_enable",
        lambda self, *args, **kwargs: checkpointed.append(enable(self, *args, **kwargs)),
    )
    data = write_jsonl(tmp_path / "t.jsonl", gsm8k_rows(16))
    assert train(tok, tmp_path, data, "num_samples=6", "activation_checkpointing=true") == 0
    assert len(checkpointed) == 1
    out = capsys.readouterr().out
    assert (
        f"streaming {data}: records are read, checked and tokenized as training consumes them (no total up "
        f"front), packed online into batches of at most {BUDGET} tokens, for 3 steps" in out
    )
    assert "reading and checking the records" not in out  # nothing is read up front
    assert f"max_tokens_per_batch={BUDGET}: 3 steps in" in out
    assert f"{data} (streamed): " in out and "the first 6 of the source in every pass (num_samples)" in out
    # the summary agrees with the step logs: the steps' own batches and fill, then what the loader read ahead
    assert "stream: 3 steps trained on 3 batches, fill " in out and "(mean of the step logs)" in out
    assert "read ahead by the loader: " in out and "overflow of the budget: none" in out
    assert (
        "checking the first 1,000 records of" in out and "6 records read, checked and tokenized: fine" in out
    )
    # 3 steps of 6 short samples: the stream runs through more than one pass, and every row fits the budget
    assert len(batch_widths) >= 3 and max(batch_widths) <= BUDGET


def test_the_stream_renders_and_masks_records_as_the_map_style_path(tmp_path, tokenizer, gsm8k_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gsm8k_rows(7)
    rows.insert(2, {"question": "What is 2 + 2?", "answer": ""})  # nothing to learn: skipped, counted
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    expected = prepare_dataset(data, tokenizer, max_length=1024, desc=None).dataset
    stream = RecordStream(data, tokenizer, max_length=1024, batch_size=3)
    samples = list(stream.stream)
    assert [s["input_ids"] for s in samples] == expected["input_ids"]
    assert [s["labels"] for s in samples] == expected["labels"]
    assert (
        stream.describe()
        == f"{data} (streamed): 8 records read by this process (8 question); 1 skipped (empty answer: {data}:3)"
    )

    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=3)
    from_parquet = list(RecordStream(str(parquet), tokenizer, max_length=1024).stream)
    assert [s["labels"] for s in from_parquet] == expected["labels"]


def test_truncation_is_counted_and_reported(tmp_path, tokenizer):
    long = {"question": "Count: " + "one two three " * 100, "answer": "done"}
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "2+2?", "answer": "4"}, long])
    stream = RecordStream(data, tokenizer, max_length=64, overflow="truncate")
    lengths = [len(s["input_ids"]) for s in stream.stream]
    assert lengths[1] == 64 and lengths[0] < 64
    # the answer came after the truncated prompt: the sample has nothing left to learn, and says so
    assert stream.describe().endswith(
        "1 truncated to max_length=64; 1 with no trained token left after truncation"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_tokens_per_batch=null"], "streaming: true needs max_tokens_per_batch"),
        (["max_steps=-1"], "streaming: true needs max_steps > 0, got -1"),
        (["overflow=drop"], "overflow: drop is not offered with streaming: true"),
        (["dataloader_num_workers=2"], "dataloader_num_workers=2 with streaming: true"),
        (["dataset_num_proc=2"], "dataset_num_proc=2 does not apply with streaming: true"),
    ],
    ids=["no-budget", "no-max-steps", "drop", "workers", "num-proc"],
)
def test_settings_that_need_the_whole_dataset_are_refused_before_the_model(
    tmp_path, tok, gsm8k_rows, capsys, overrides, message
):
    data = write_jsonl(tmp_path / "t.jsonl", gsm8k_rows(2))
    assert train(tok, tmp_path, data, *overrides) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "loading the model" not in captured.out


def test_a_json_list_is_refused_before_the_model(tmp_path, tok, capsys):
    data = tmp_path / "t.json"
    data.write_text(json.dumps([{"question": "2+2?", "answer": "4"}]))
    assert train(tok, tmp_path, str(data)) == 1
    captured = capsys.readouterr()
    assert f"{data} holds a JSON list, which cannot be streamed" in captured.err
    assert "loading the model" not in captured.out


@pytest.mark.parametrize(
    ("bad", "message", "overrides"),
    [
        ({"question": "2+2?", "answer": 4}, ":13: answer must be a string, got int 4", []),
        ({"question": "2+2?", "answer": 4}, ":13: answer must be a string, got int 4", ["trainer=sft"]),
        ({"text": "plain words"}, ":13: a 'text' record in a file of 'question' records", []),
        (
            {"question": "Count: " + "one two three " * 200, "answer": "done"},
            ":13: the sample has 6",  # 600-odd tokens, more than max_length=512
            [],
        ),
    ],
    ids=["wrong-type", "wrong-type-sft", "other-format", "too-long"],
)
def test_a_bad_record_in_the_middle_of_the_stream_stops_with_its_line(
    tmp_path, tok, gsm8k_rows, capsys, bad, message, overrides
):
    rows = gsm8k_rows(20)
    rows.insert(12, bad)
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    assert train(tok, tmp_path, data, *overrides) == 1
    captured = capsys.readouterr()
    assert f"packing-hf train: error: {data}{message}" in captured.err
    assert "loading the model" not in captured.out  # caught by the check of the first records


def test_a_bad_record_past_the_checked_start_stops_training_with_its_line(tmp_path, tok, gsm8k_rows, capsys):
    rows = gsm8k_rows(20)
    rows.insert(12, {"question": "2+2?", "answer": 4})
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    assert train(tok, tmp_path, data, "stream_check_records=5") == 1
    captured = capsys.readouterr()
    assert (
        "5 records read, checked and tokenized: fine" in captured.out and "loading the model" in captured.out
    )
    assert f"packing-hf train: error: {data}:13: answer must be a string, got int 4" in captured.err


def test_trainer_sft_streams_the_records_to_trl(tmp_path, tok, gsm8k_rows, batch_widths, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", gsm8k_rows(12))
    assert train(tok, tmp_path, data, "trainer=sft") == 0
    out = capsys.readouterr().out
    assert f"max_tokens_per_batch={BUDGET}: 3 steps in" in out and f"{data} (streamed): " in out
    assert len(batch_widths) >= 3 and max(batch_widths) <= BUDGET


def test_a_streamed_run_resumes_from_its_checkpoint(tmp_path, tok, gsm8k_rows, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", gsm8k_rows(12))
    assert train(tok, tmp_path, data, "max_steps=2", "save_strategy=steps", "save_steps=2") == 0
    assert (tmp_path / "out" / "checkpoint-2" / "packing_hf_stream_rank0.json").is_file()
    capsys.readouterr()
    assert train(tok, tmp_path, data, "resume_from_checkpoint=true") == 0
    out = capsys.readouterr().out
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert f"resuming from {checkpoint}" in out  # resume_from_checkpoint=true: the latest in output_dir
    # the summary counts this run's step and the resumed ones (it said "3 steps" for the 1 it trained)
    assert f"max_tokens_per_batch={BUDGET}: 1 step in" in out
    assert f"resumed from {checkpoint} (2 steps before): 3 steps in all" in out
    # steps 1 and 2 came from the checkpoint: the resumed run logs the loss of step 3 only
    assert sum(line.startswith("{'loss'") for line in out.splitlines()) == 1
