"""What ``accelerate launch`` was asked for and did not hand to the processes (``packing_hf/integrations/launcher.py``):
refused by name where the trainer's plan is made, read from the launcher's command line (the parent process's).

Read from accelerate 1.15's launcher (``accelerate/commands/launch.py``, ``utils/launch.py``) and seen in real
launches: ``--parallelism_config_*`` flags reach the processes only with ``--use_parallelism_config`` (FSDP2 only),
and ``--cpu --num_processes 2`` starts one process. The launch whose sizes do arrive (an accelerate config file's
``parallelism_config`` block) runs for real in ``tests/distributed/test_accelerate_launch.py``.
"""

from __future__ import annotations

import pytest

import packing_hf
from packing_hf.integrations import launcher
from packing_hf.integrations.launcher import check_launch, launch_arguments

ACCELERATE = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
LAUNCHED_SP2 = {
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
    "PARALLELISM_CONFIG_SP_SIZE": "2",
}


@pytest.mark.parametrize(
    "command, arguments",
    [
        ([*ACCELERATE, "--cpu", "train.py", "--lr", "1"], ["--cpu", "train.py", "--lr", "1"]),
        (["python", "-m", "accelerate.commands.launch", "train.py"], ["train.py"]),
        (["python", "/venv/bin/accelerate-launch", "train.py"], ["train.py"]),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"], None),
        (["python", "/venv/bin/accelerate", "env"], None),
    ],
)
def test_the_launchers_arguments_are_found_in_its_command_line(command, arguments):
    assert launch_arguments(command) == arguments


@pytest.mark.parametrize(
    "world, command, environ, refused",
    [
        # the flags without --use_parallelism_config: the processes get nothing, the run would be plain DDP
        (
            2,
            [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--parallelism_config_sp_size", "2", "t.py"],
            {},
            r"was given --parallelism_config_sp_size 2, but the processes did not get it.*sp_size",
        ),
        (
            4,
            [*ACCELERATE, "--multi_gpu", "--num_processes=4", "--parallelism_config_tp_size=2", "t.py"],
            {},
            r"was given --parallelism_config_tp_size 2, but",
        ),
        # --cpu with 2 processes: accelerate starts one
        (1, [*ACCELERATE, "--cpu", "--num_processes", "2", "t.py"], {}, r"--num_processes 2 started 1 process"),
        # sizes that arrived, but say another layout than world / sp_size
        (
            2,
            [*ACCELERATE, "--config_file", "sp.yaml", "t.py"],
            {**LAUNCHED_SP2, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"},
            r"parallelism_config \(dp_replicate_size 2 x sp_size 2 = 4 processes\) does not match the 2 processes",
        ),
    ],
)
def test_what_the_launcher_did_not_pass_on_is_refused(world, command, environ, refused):
    with pytest.raises(ValueError, match=refused):
        check_launch(world, command, environ)


@pytest.mark.parametrize(
    "world, command, environ",
    [
        (2, [*ACCELERATE, "--config_file", "sp.yaml", "t.py"], LAUNCHED_SP2),  # the config file's block arrived
        (4, [*ACCELERATE, "--config_file", "sp.yaml", "t.py"], LAUNCHED_SP2),  # dp 2 x sp 2, dp inferred
        (
            4,
            [*ACCELERATE, "--config_file", "sp.yaml", "t.py"],
            {**LAUNCHED_SP2, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"},
        ),
        (2, [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "t.py"], {}),
        (1, [*ACCELERATE, "--cpu", "t.py"], {}),
        (2, ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], {}),
        # an argument of the script that looks like the launcher's is the script's
        (2, [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "t.py", "--parallelism_config_sp_size", "2"], {}),
    ],
)
def test_a_launch_that_passed_on_what_it_was_asked_is_accepted(world, command, environ):
    check_launch(world, command, environ)


def _trainer(tmp_path, tiny_llama):
    args = packing_hf.TrainingArguments(str(tmp_path), report_to="none", max_tokens_per_batch=64, use_cpu=True)
    data = [{"input_ids": list(range(1, n))} for n in (5, 9, 7)]
    return packing_hf.Trainer(model=tiny_llama(vocab_size=32), args=args, train_dataset=data)


def test_the_trainer_refuses_a_launch_that_dropped_a_size(tmp_path, tiny_llama, monkeypatch):
    """The check runs where the trainer's plan is made, on the parent process's command line."""
    command = [*ACCELERATE, "--num_processes", "1", "--parallelism_config_sp_size", "2", "train.py"]
    monkeypatch.setattr(launcher, "launcher_command", lambda: command)
    with pytest.raises(ValueError, match="was given --parallelism_config_sp_size 2, but the processes did not"):
        _trainer(tmp_path, tiny_llama)
    monkeypatch.setattr(launcher, "launcher_command", lambda: command[:3] + command[-1:])  # without the flag
    assert _trainer(tmp_path, tiny_llama).parallel_plan.world_size == 1


def test_a_size_from_the_launchers_environment_that_sp_cannot_serve_is_refused(tmp_path, tiny_llama, monkeypatch):
    """``tp_size`` next to ``sp_size`` from the launcher's environment (its config file's block): refused by name."""
    for name, value in {**LAUNCHED_SP2, "PARALLELISM_CONFIG_TP_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"sequence parallelism \(sp_size=2\) runs next to .*'tp_size': 2"):
        _trainer(tmp_path, tiny_llama)
