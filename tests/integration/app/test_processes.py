"""``packing-hf train`` on a process other than the main one of a launch (``RANK`` > 0), and the whole run's
stream counters (the launches themselves: ``tests/distributed/test_cli_launch.py``)."""

from __future__ import annotations

import pytest

from packing_hf.app.cli import main
from packing_hf.app.processes import combine_stream_stats


@pytest.fixture
def progress_bars_restored(monkeypatch):
    """The process-wide settings a non-main process's command line changes, as they were after the test."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")
    disabled = datasets.utils.are_progress_bars_disabled()
    yield
    (datasets.disable_progress_bars if disabled else datasets.enable_progress_bars)()


def test_a_process_other_than_the_main_one_prints_no_lines_but_its_errors(
    tmp_path, monkeypatch, capsys, progress_bars_restored
):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_type: llama\nmax_tokns_per_batch: 512\n")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "[packing-hf]" not in captured.out  # the main process says what the run does
    assert (
        "packing-hf train: error (process 1 of a launch): unknown config key 'max_tokns_per_batch'"
        in captured.err
    )

    monkeypatch.setenv("RANK", "0")
    assert main(["train", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "[packing-hf] reading the config" in captured.out
    assert "packing-hf train: error: unknown config key 'max_tokns_per_batch'" in captured.err


RANK_STATS = [
    {"samples_in": 6, "batches": 3, "samples": 5, "tokens": 90, "fill": 0.75, "epoch": 1, "records_read": 6,
     "peak_buffered_samples": 4, "truncated_samples": 1},
    {"samples_in": 5, "batches": 3, "samples": 5, "tokens": 60, "fill": 0.5, "epoch": 1, "records_read": 5,
     "peak_buffered_samples": 2, "truncated_samples": 0},
]  # fmt: skip


def test_stream_counters_of_the_whole_run():
    # two replicas: each packed its own shard, the run's counters are their sums (the fill of the sums)
    run = combine_stream_stats(RANK_STATS, sp_size=1, max_tokens_per_batch=40)
    assert run["samples"] == 10 and run["tokens"] == 150 and run["records_read"] == 11 and run["batches"] == 6
    assert run["truncated_samples"] == 1 and run["epoch"] == 1 and run["peak_buffered_samples"] == 4
    assert run["fill"] == pytest.approx(150 / (6 * 40))
    # one sequence-parallel group of 2: both processes read and count the same shard, counted once
    group = combine_stream_stats([RANK_STATS[0], RANK_STATS[0]], sp_size=2, max_tokens_per_batch=40)
    assert group == {**RANK_STATS[0], "fill": pytest.approx(0.75)}


def test_ctrl_c_under_a_launcher_says_to_resume_under_it(tmp_path, monkeypatch):
    from packing_hf.app.cli import _interrupted

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    alone = _interrupted(KeyboardInterrupt(), "run.yaml", ["max_steps=9"], tmp_path)
    assert alone.endswith("packing-hf train run.yaml max_steps=9 resume=true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    launched = _interrupted(KeyboardInterrupt(), "run.yaml", ["max_steps=9"], tmp_path)
    assert launched.endswith(
        "packing-hf train run.yaml max_steps=9 resume=true   (under the same launcher, as this run was)"
    )


def test_train_closes_the_process_group_of_its_run(tmp_path):
    """``packing-hf train`` destroys the process group its run started, however the run ends (here a config
    error): left to the interpreter's exit, gloo's threads can abort a process whose run succeeded (SIGABRT,
    "terminate called without an active exception", seen under ``accelerate launch``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        bad = tmp_path / "bad.yaml"
        bad.write_text("model_type: llama\nmax_tokns_per_batch: 512\n")
        assert main(["train", str(bad)]) == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
