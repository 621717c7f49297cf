"""What ``accelerate launch`` was asked for and did not hand to the processes it started: refused by name.

accelerate 1.15's launcher drops two requests without a word, and the script it starts cannot see them in its
environment; the only trace is the launcher's command line, the parent process's:

- ``--parallelism_config_*`` sizes reach the processes (``ACCELERATE_USE_PARALLELISM_CONFIG`` and the
  ``PARALLELISM_CONFIG_*`` variables) only with ``--use_parallelism_config``, which accelerate allows with
  ``--use_fsdp --fsdp_version 2`` alone. ``accelerate launch --multi_gpu --num_processes 4
  --parallelism_config_sp_size 2 train.py`` runs plain DDP over 4 processes, every packed row whole on each.
- ``--cpu --num_processes N`` (without ``--mpirun_hostfile``) starts one process: the run is one process's,
  not the N asked for.

Both are refused where the run's plan is made (:func:`packing_hf.integrations.parallel.process_world`), with the
launch that does what was asked. The sizes of an accelerate config file's ``parallelism_config`` block do reach
the processes (the launcher sets ``--use_parallelism_config`` from the file itself).

>>> launch_arguments(["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "train.py"])
['--num_processes', '2', 'train.py']
>>> launch_arguments(["/venv/bin/python", "-m", "torch.distributed.run", "train.py"]) is None
True
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

__all__ = ["check_launch", "launch_arguments", "launcher_command"]

# the sizes of accelerate's ParallelismConfig that `accelerate launch --parallelism_config_<name>` takes
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def launch_arguments(command: Sequence[str]) -> list[str] | None:
    """The arguments of ``accelerate launch`` in a process's command line (``accelerate launch ...``,
    ``accelerate-launch ...``, ``python -m accelerate.commands.launch ...``); ``None`` for any other command."""
    for i, word in enumerate(command):
        name = os.path.basename(word)
        if name == "accelerate-launch" or word == "accelerate.commands.launch":
            return list(command[i + 1 :])
        if name in ("accelerate", "accelerate.commands.accelerate_cli") and command[i + 1 : i + 2] == ["launch"]:
            return list(command[i + 2 :])
    return None


def launcher_command() -> list[str] | None:
    """The command line of the process that started this one (``None`` where it cannot be read)."""
    try:
        import psutil  # a dependency of accelerate

        parent = psutil.Process().parent()
        return parent.cmdline() if parent is not None else None
    except Exception:  # noqa: BLE001 - no psutil, the parent gone or not ours to read: nothing to check
        return None


def _check_launched_sizes(world_size: int, environ: Mapping[str, str]) -> None:
    """``dp_replicate_size x sp_size`` set by ``accelerate launch`` in the environment is the run's number of
    processes (accelerate skips that check with ``sp_size > 1``, and packing_hf lays the run out as
    ``world / sp_size`` replicas: a ``dp_replicate_size`` saying otherwise would be ignored)."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    sizes = {name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1") or 1) for name in _SIZES}
    # 1: not given; tp / cp / dp_shard beside sp are refused where the SP size is read (`sequence_parallel_size`)
    given = {name for name, size in sizes.items() if name != "sp_size" and size > 1}
    if sizes["sp_size"] == 1 or given != {"dp_replicate_size"} or math.prod(sizes.values()) == world_size:
        return
    layout = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)
    raise ValueError(
        f"the launcher's parallelism_config ({layout} = {math.prod(sizes.values())} processes) does not match "
        f"the {world_size} processes of the run, which packing_hf lays out as world / sp_size data-parallel "
        "replicas: set parallelism_config_dp_replicate_size to that, or leave it out"
    )


def check_launch(
    world_size: int, command: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse a run started by ``accelerate launch`` that did not get what the launcher was asked for.

    Args:
        world_size: the processes of this run's process group (1 without one).
        command: the launcher's command line (default: the parent process's, :func:`launcher_command`).
        environ: this process's environment (default: ``os.environ``): the sizes ``accelerate launch`` set
            there (``PARALLELISM_CONFIG_*``) must multiply to ``world_size`` with ``sp_size > 1``.

    >>> check_launch(1, ["accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"], {})
    Traceback (most recent call last):
    ...
    ValueError: accelerate launch --num_processes 2 started 1 process: with --cpu its launcher runs one process unless given --mpirun_hostfile (an MPI launch). For N CPU processes launch with `accelerate launch --multi_gpu --num_processes 2` and TrainingArguments(use_cpu=True) (gloo), or torchrun --nproc_per_node 2
    """
    environ = os.environ if environ is None else environ
    _check_launched_sizes(world_size, environ)
    arguments = launch_arguments(launcher_command() if command is None else command)
    if arguments is None:
        return
    from accelerate.commands.launch import launch_command_parser

    try:
        asked, _ = launch_command_parser().parse_known_args(arguments)
    except SystemExit:  # a command line accelerate itself would not have run
        return
    asked_processes = asked.num_processes or 1
    if world_size == 1 and asked_processes > 1:
        raise ValueError(
            f"accelerate launch --num_processes {asked_processes} started 1 process: with --cpu its launcher runs "
            "one process unless given --mpirun_hostfile (an MPI launch). For N CPU processes launch with "
            f"`accelerate launch --multi_gpu --num_processes {asked_processes}` and TrainingArguments(use_cpu=True) "
            f"(gloo), or torchrun --nproc_per_node {asked_processes}"
        )
    dropped = {
        f"--parallelism_config_{name}": size
        for name in _SIZES
        if (size := int(getattr(asked, f"parallelism_config_{name}", 1) or 1)) != 1
        and int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1") or 1) != size
    }
    if dropped:
        flags = " ".join(f"{flag} {size}" for flag, size in dropped.items())
        raise ValueError(
            f"accelerate launch was given {flags}, but the processes did not get it: accelerate passes "
            "--parallelism_config_* on only with --use_parallelism_config, which it allows with --use_fsdp "
            "--fsdp_version 2 alone, so the run would go on without it. Set sp_size in the training arguments "
            "(TrainingArguments(sp_size=N), `sp_size: N` in a packing-hf config), or put the sizes in the "
            "parallelism_config block of an accelerate config file (accelerate launch --config_file; see "
            "docs/distributed.md)"
        )
