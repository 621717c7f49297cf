"""Ctrl-C during `packing-hf train` and `resume=true`: the first Ctrl-C lets the step finish, saves a whole
checkpoint and the summary so far and says how to resume; the resumed run trains the remaining steps to the
weights of the run that was never interrupted (fp32, SGD: exactly), and its summary counts both runs' steps.

The Ctrl-C is a real SIGINT to this process, sent while step 1 runs (from a callback ahead of the job's own).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_callback import DefaultFlowCallback

from packing_hf.app.cli import main
from packing_hf.app.train import SUMMARY_NAME

ROOT = Path(__file__).resolve().parents[3]
SMALL = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}'
STEPS = 3


def _args(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "gguf_file=null",
        "gguf_package=null",
        f"model_config={SMALL}",
        "num_samples=24",
        "max_length=512",
        "max_tokens_per_batch=512",
        f"max_steps={STEPS}",
        "optim=sgd",
        "learning_rate=0.5",  # large enough that a replayed or skipped batch moves the weights visibly
        "eval_dataset=null",
        "baseline_batches=0",
        "packing_preflight=off",  # the pre-flight check is tested elsewhere; here it would run 4 times
        "save_strategy=no",  # the checkpoint comes from Ctrl-C alone
        f"output_dir={out}",
        "disable_tqdm=true",
        *extra,
    ]


@pytest.fixture
def ctrl_c_during_step(monkeypatch, request):
    """SIGINT delivered to this process during step ``n``, right after its optimizer update (before the step
    ends), as a terminal's Ctrl-C is. The process starts with Python's own SIGINT handler, as a command run from
    a terminal does (an earlier test of this worker may have left another one: the CLI only takes Ctrl-C over
    where it can hand it back), restored afterwards."""
    import torch.distributed as dist

    left = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: left is not None and signal.signal(signal.SIGINT, left))
    assert not dist.is_initialized(), "an earlier test left a process group: the CLI would see a launcher"

    def arm(n: int) -> None:
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == n - 1:  # the step in flight is n
                os.kill(os.getpid(), signal.SIGINT)
            return control

        monkeypatch.setattr(DefaultFlowCallback, "on_optimizer_step", on_optimizer_step, raising=False)

    return arm


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.usefixtures("one_torch_thread")
def test_ctrl_c_saves_a_checkpoint_and_resume_true_ends_where_the_uninterrupted_run_does(
    data_dir, tmp_path, capsys, ctrl_c_during_step, monkeypatch
):
    whole = tmp_path / "whole"
    assert main(_args(data_dir, whole)) == 0
    capsys.readouterr()

    out = tmp_path / "run"
    ctrl_c_during_step(1)
    assert main(_args(data_dir, out)) == 130
    printed = capsys.readouterr()
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1
    assert "Ctrl-C: finishing step 1, then saving a checkpoint" in printed.out
    assert f"stopped by Ctrl-C after step 1 of {STEPS}: checkpoint saved to {checkpoint}" in printed.err
    resume_line = printed.err.strip().splitlines()[-1].strip()
    assert resume_line.startswith("packing-hf train ") and resume_line.endswith(" resume=true")
    so_far = json.loads((out / SUMMARY_NAME).read_text())
    assert so_far["interrupted"] == {"global_step": 1, "checkpoint": str(checkpoint)}
    assert so_far["global_step"] == so_far["steps_this_run"] == 1 and len(so_far["losses"]) == 1
    assert not (out / "model.safetensors").exists()  # the checkpoint holds the model; no final save
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C handling given back

    monkeypatch.undo()  # no more Ctrl-C
    assert main(_args(data_dir, out, "resume=true")) == 0
    printed = capsys.readouterr().out
    assert f"resuming from {checkpoint}" in printed and f"(resuming after step 1 of {checkpoint})" in printed
    assert "2 steps in" in printed and f"resumed from {checkpoint} (1 step before): 3 steps in all" in printed
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert (summary["global_step"], summary["steps_this_run"]) == (STEPS, STEPS - 1)
    assert summary["resumed_from"] == {"checkpoint": str(checkpoint), "global_step": 1}
    assert len(summary["losses"]) == STEPS - 1 and "interrupted" not in summary
    resumed, expected = _weights(out), _weights(whole)
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), f"{name} differs after the resume"

    # negative control: the same checkpoint resumed with the data order restarted (a batch trained twice,
    # one never) ends elsewhere, so the equality above can see a wrong resume
    replay = tmp_path / "replay"
    replay.mkdir()
    os.symlink(checkpoint, replay / "checkpoint-1")
    assert main(_args(data_dir, replay, "resume=true", "ignore_data_skip=true")) == 0
    replayed = _weights(replay)
    assert any(not torch.equal(replayed[name], expected[name]) for name in expected)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_trl_trainer_run_stopped_by_ctrl_c_resumes_and_counts_both_runs(
    data_dir, tmp_path, capsys, ctrl_c_during_step, monkeypatch
):
    """The TRL trainers' job (here ORPO) stops, saves and resumes the same way."""
    out = tmp_path / "orpo"
    args = [
        "train",
        str(ROOT / "configs" / "tiny_orpo.yaml"),
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "gguf_file=null",
        "gguf_package=null",
        f"model_config={SMALL}",
        "num_samples=4",
        "max_length=384",
        "max_steps=2",
        "per_device_train_batch_size=1",
        "packing_preflight=off",
        f"output_dir={out}",
        "disable_tqdm=true",
    ]
    ctrl_c_during_step(1)
    assert main(args) == 130
    err = capsys.readouterr().err
    assert f"stopped by Ctrl-C after step 1 of 2: checkpoint saved to {out / 'checkpoint-1'}" in err
    assert json.loads((out / SUMMARY_NAME).read_text())["interrupted"]["global_step"] == 1
    monkeypatch.undo()
    assert main([*args, "resume=true"]) == 0
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert (summary["global_step"], summary["steps_this_run"], summary["resumed_from"]["global_step"]) == (
        2,
        1,
        1,
    )
    assert len(summary["losses"]) == 1 and (out / "model.safetensors").is_file()


def test_resume_without_a_checkpoint_is_refused_before_anything_loads(data_dir, tmp_path, capsys):
    assert main(_args(data_dir, tmp_path / "empty", "resume=true")) == 1
    err = capsys.readouterr().err
    assert "no checkpoint-* folder with a trainer_state.json in output_dir" in err and "resume=true" in err
    both = _args(data_dir, tmp_path / "empty", "resume=true", f"resume_from_checkpoint={tmp_path}")
    assert main(both) == 1
    assert "keep one of the two" in capsys.readouterr().err
